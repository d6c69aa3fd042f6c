"""storage_cost.py's models, each a train state and ``step(state, i) -> (state, loss, leaves
changed)``, and what a repository's steps store by kind of leaf (params, adam ``mu``, ``nu``)."""

import collections
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import casstore
from casstore._layout import chunk_key

from .states import KINDS, SIZES, check, train_state
from .storage import HERE, load_module

EXAMPLE = HERE.parent / "examples" / "finetune_minilm.py"
TEXT = EXAMPLE.parent / "data" / "sentiment.tsv"  # pretraining's tokens: its bytes
GRADIENTS = "real: GPT-2 next-token cross-entropy on the bytes of examples/data/sentiment.tsv"


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


def pretraining(size: str, lr: float) -> tuple[dict, Callable]:
    """A ``train_state(size)`` as jax arrays in ``optax.adam(lr)``'s form (AssertionError if it
    does not fit), and its step: adam on two random windows of up to 64 tokens of TEXT's bytes."""
    optimizer, state = optax.adam(lr), jax.tree.map(jnp.asarray, train_state(size))
    params, opt = state["params"], state["opt_state"]
    opt_state = (optax.ScaleByAdamState(opt["count"], opt["mu"], opt["nu"]), optax.EmptyState())
    check(jax.tree.structure(opt_state)
          == jax.tree.structure(jax.eval_shape(optimizer.init, params)),
          "the harness's adam state does not fit optax.adam's")
    data = np.frombuffer(TEXT.read_bytes(), np.uint8)
    n, rng = min(65, SIZES[size]["ctx"] + 1), np.random.default_rng(0)

    @jax.jit
    def train_step(state: dict, tokens: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(gpt2_loss)(state["params"], tokens)
        updates, opt = optimizer.update(grads, state["opt_state"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt}
        return new, loss, sum(jnp.any(a != b) for a, b in zip(jax.tree.leaves(state),
                                                              jax.tree.leaves(new)))

    def step(state: dict, i: int) -> tuple:
        tokens = np.stack([data[s:s + n] for s in rng.integers(0, len(data) - n, 2)])
        return train_step(state, jnp.asarray(tokens.astype(np.int32)))

    return {"params": params, "opt_state": opt_state}, step


def finetuning(lr: float, batch_size: int, tiny: bool = False) -> tuple[dict, Callable, int]:
    """All of MiniLM (``tiny``: its first encoder layer only) under adam at ``lr`` (the example's
    ``--full``), its step on a random batch of the training data (leaves changed: -1, not
    counted) and the batch size."""
    ex = load_module("finetune_minilm", EXAMPLE)
    train, _ = ex.load_data(ex.Tokenizer.from_file(str(ex.model_dir() / "tokenizer.json")))
    params = ex.load_params(ex.model_dir(), num_labels=2, seed=0)
    params["layers"] = params["layers"][:1 if tiny else None]
    labels = ex.trainable_labels(params, full=True)
    optimizer = ex.make_optimizer(labels, lr, full=True)
    train_step, rng = ex.make_train_step(labels, optimizer), np.random.default_rng(0)
    batch_size = min(batch_size, len(train[2]))

    def step(state: dict, i: int) -> tuple:
        batch = rng.choice(len(train[2]), batch_size, replace=False)
        return (*train_step(state, *(a[batch] for a in train)), -1)

    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0)}
    return state, step, batch_size


def kind_of(path: str) -> str:
    """``params``, ``mu`` or ``nu`` for a manifest key path (format.md §5), else ``other``."""
    parts = path.split("/")
    return "params" if parts[0] == "params" else next((k for k in ("mu", "nu") if k in parts),
                                                       "other")


def raw_bytes(url: str, step: int) -> dict[str, int]:
    """Raw bytes per kind and ``all`` of a step's leaves, from its manifest."""
    out = dict.fromkeys((*KINDS, "other", "all"), 0)
    for leaf in casstore.read_manifest(url, step).leaves:
        out[kind_of(leaf.path)] += leaf.nbytes
        out["all"] += leaf.nbytes
    return out


def attribute(url: str, steps: list[int]) -> list[dict]:
    """Per step: the stored bytes of the chunk objects it added by kind (shared among the blocks
    in an object by raw bytes), their count, deltas, longest delta chain and oldest base age."""
    first_step, base_of, out = {}, {}, []
    for step in steps:
        refs = [(kind_of(leaf.path), ref, math.prod(ref.shape) * jnp.dtype(leaf.dtype).itemsize)
                for leaf in casstore.read_manifest(url, step).leaves for ref in leaf.chunks]
        new = [(kind, ref, size) for kind, ref, size in refs if ref.key not in first_step]
        covered: collections.Counter = collections.Counter()
        for _, ref, size in new:
            covered[ref.key] += size
        fig = dict.fromkeys((*KINDS, "other"), 0.0)
        for kind, ref, size in new:
            fig[kind] += ref.stored_bytes * size / covered[ref.key]
        first_step.update(dict.fromkeys(covered, step))
        base_of.update({ref.id: ref.base for _, ref, _ in refs})

        def depth(cid: str) -> int:
            n = 0
            while base_of.get(cid) is not None:
                cid, n = base_of[cid], n + 1
            return n

        fig.update(chunk_bytes=sum(fig[k] for k in (*KINDS, "other")),
                   new_chunk_objects=len(covered),
                   delta_objects=len({ref.key for _, ref, _ in new if ref.base is not None}),
                   chain_depth=max((depth(ref.id) for _, ref, _ in refs), default=0),
                   base_age=max((step - first_step[chunk_key(ref.base)] for _, ref, _ in refs
                                 if ref.base is not None), default=0))
        out.append(fig)
    return out


def summary(per_step: list[dict], url: str | None, raw: dict[str, int]) -> dict:
    """A system's figures of its steps ``per_step`` (``save_s``, ``written_bytes``; with the
    repository ``url``, :func:`attribute`'s added to them): the mean save time and the written
    / raw bytes after the first step, in all and (with ``url``) per kind."""
    for fig, split in zip(per_step, attribute(url, range(len(per_step))) if url else ()):
        fig.update(split)
    later = per_step[1:]
    return {"per_step": per_step, "mean_save_s": np.mean([f["save_s"] for f in later]),
            "fraction": {k: sum(f[k if k != "all" else "written_bytes"] for f in later)
                         / (raw[k] * len(later)) for k in ("all", *(KINDS if url else ()))}}
