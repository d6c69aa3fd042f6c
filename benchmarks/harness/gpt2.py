"""GPT-2's loss on the harness's train states, for benchmarks that train them (pretraining)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from .states import check


def adam_state(state: dict, optimizer: optax.GradientTransformation) -> tuple[dict, tuple]:
    """``(params, opt_state)`` of a ``train_state`` as jax arrays, its adam ``mu``, ``nu`` and
    ``count`` in ``optax.adam``'s state; AssertionError if it does not fit ``optimizer``'s."""
    params, opt = jax.tree.map(jnp.asarray, state["params"]), state["opt_state"]
    opt_state = (optax.ScaleByAdamState(count=jnp.asarray(opt["count"]),
                                        mu=jax.tree.map(jnp.asarray, opt["mu"]),
                                        nu=jax.tree.map(jnp.asarray, opt["nu"])),
                 optax.EmptyState())
    check(jax.tree.structure(opt_state)
          == jax.tree.structure(jax.eval_shape(optimizer.init, params)),
          "the harness's adam state does not fit optax.adam's")
    return params, opt_state


def gpt2_loss(params: dict, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of GPT-2 (pre-LayerNorm blocks, tanh GELU, tied output
    embedding) with ``params`` in the harness's HF names, on int32 ``tokens`` ``(batch, n)``."""
    def ln(x: jax.Array, p: dict) -> jax.Array:
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + 1e-5) * p["g"] + p["b"]

    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    (b, n), width = inputs.shape, params["wpe"].shape[1]
    heads = max(1, width // 64)
    x = params["wte"][inputs] + params["wpe"][:n]
    causal = jnp.tril(jnp.ones((n, n), bool))
    for blk in params["h"]:
        attn, mlp = blk["attn"], blk["mlp"]
        qkv = ln(x, blk["ln_1"]) @ attn["c_attn"]["w"] + attn["c_attn"]["b"]
        q, k, v = (t.reshape(b, n, heads, -1).transpose(0, 2, 1, 3)
                   for t in jnp.split(qkv, 3, -1))
        scores = jnp.where(causal, q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(q.shape[-1]), -1e9)
        att = (jax.nn.softmax(scores, -1) @ v).transpose(0, 2, 1, 3).reshape(b, n, width)
        x = x + att @ attn["c_proj"]["w"] + attn["c_proj"]["b"]
        hidden = jax.nn.gelu(ln(x, blk["ln_2"]) @ mlp["c_fc"]["w"] + mlp["c_fc"]["b"])
        x = x + hidden @ mlp["c_proj"]["w"] + mlp["c_proj"]["b"]
    logits = ln(x, params["ln_f"]) @ params["wte"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
