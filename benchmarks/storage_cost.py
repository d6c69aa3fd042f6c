"""casstore with deltas vs casstore without vs orbax: bytes per step when every tensor changes.

Issue 15. Three systems get the same states, step after step, each into its own repository on
local disk: ``delta`` (``casstore.save``, deltas on, the default), ``whole``
(``casstore.save(..., delta=False)``: every changed chunk stored whole) and ``orbax``
(``ocp.StandardCheckpointer``, timed through ``wait_until_finished``). casstore saves with its
default codecs (``--codecs default``: byte planes wherever they save 1/8) or with
``shuffle=False`` (``--codecs no-shuffle``: barely compressible floats stored raw, local disk's
default before 2026-11-23). Scenarios, in one run:

1. finetune: a full fine-tune of all-MiniLM-L6-v2 (the model, data and train step of
   ``examples/finetune_minilm.py --full``, imported from it): every layer and the head trained
   with adam at each ``--lrs`` (1e-4 and 1e-5), real gradients on the example's data, a
   checkpoint every step for ``--steps`` (8) steps. Per system, the bytes written per step after
   the first as a fraction of the raw state, split into params / adam mu / adam nu / all. The
   split reads each step's manifest: a chunk no earlier step of the repository references is new,
   and its stored bytes are attributed to the leaves whose blocks it holds, in proportion to
   their raw bytes. "all" is ``SaveInfo.written_bytes`` (new chunks plus the manifest); for
   orbax, the growth of its directory. Targets: all <= 0.40 of raw, params <= 0.35.
2. restore: the first learning rate's repositories; the step at the end of the longest delta
   chain (chunk refs' ``base`` followed through the manifests; as a delta is taken against its
   base's whole chunk, the step whose oldest base lies furthest back; the latest on a tie),
   restored into an abstract target
   from each system, cold (page cache dropped, ``--drop-caches``) and warm, median of
   ``--repeat``; every restore is checked bit-exact against the live state (AssertionError
   otherwise). Targets: delta restore <= 1.25x whole restore and <= 0.8x orbax's.
3. pretrain: a GPT-2-small-shaped train state (``harness.train_state``: params, adam mu, nu,
   count; ``--pretrain-size``) updated by ``--pretrain-steps`` (4) real adam steps (lr 6e-4) with
   real gradients of GPT-2's next-token loss on the bytes of the example's data file (a
   batch of 2 x 64 tokens; every tensor changes every step). Bytes written per step and the
   restore of the last step, as in 1 and 2.

Usage::

    python benchmarks/storage_cost.py [--scenarios finetune,restore,pretrain] [--steps N]
                                      [--lrs 1e-4,1e-5] [--pretrain-steps K]
                                      [--pretrain-size gpt2|small|tiny] [--repeat N]
                                      [--codecs default|no-shuffle] [--drop-caches]
                                      [--no-warm] [--dir DIR] [--tiny] [--json PATH]
"""

from __future__ import annotations

import collections
import math
import os
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import casstore
from casstore._layout import chunk_key

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h  # noqa: E402

SYSTEMS = ("delta", "whole", "orbax")  # casstore deltas, casstore delta=False, orbax
CODECS = {"default": None, "no-shuffle": False}  # --codecs -> save(..., shuffle=)
SCENARIOS = ("finetune", "restore", "pretrain")
KINDS = ("params", "mu", "nu")
EXAMPLE = h.HERE.parent / "examples" / "finetune_minilm.py"
MAX_WARM_BYTES = 8 << 30
TINY = {"steps": 3, "lrs": "1e-4", "batch_size": 8, "pretrain_steps": 3, "pretrain_size": "tiny"}
TARGETS = {"all": 0.40, "params": 0.35, "restore_vs_whole": 1.25, "restore_vs_orbax": 0.8}
GRADIENTS = "real: GPT-2 next-token cross-entropy on the bytes of examples/data/sentiment.tsv"


def example():
    """``examples/finetune_minilm.py`` as a module (model, data, optimizer and train step)."""
    return h.load_module("finetune_minilm", EXAMPLE)


def kind_of(path: str) -> str:
    """``params``, ``mu`` or ``nu`` for a manifest key path (format.md §5), else ``other``."""
    parts = path.split("/")
    if parts[0] == "params":
        return "params"
    return next((k for k in ("mu", "nu") if k in parts), "other")


def raw_bytes(url: str, step: int) -> dict[str, int]:
    """Raw bytes per kind and ``all`` of a step's leaves, from its manifest."""
    out = dict.fromkeys((*KINDS, "other", "all"), 0)
    for leaf in casstore.read_manifest(url, step).leaves:
        out[kind_of(leaf.path)] += leaf.nbytes
        out["all"] += leaf.nbytes
    return out


# -- the three systems -------------------------------------------------------------------------

class Systems:
    """One training run's three repositories under ``root``: :meth:`save` stores a state in
    each (measuring what it wrote), :meth:`restore` reads a step back from one."""

    def __init__(self, root: pathlib.Path, shuffle: bool | None):
        import orbax.checkpoint as ocp

        self.shuffle = shuffle

        self.urls = {"delta": str(root / "delta"), "whole": str(root / "whole")}
        self.orbax_dir = root / "orbax"
        self.orbax_dir.mkdir(parents=True)
        self.ckptr = ocp.StandardCheckpointer()
        self.per_step: dict[str, list[dict]] = {s: [] for s in SYSTEMS}

    def save(self, step: int, state: Any) -> None:
        """Saves ``state`` as ``step`` in every repository, one after another."""
        for system in SYSTEMS:
            h.settle()
            fig: dict[str, Any] = {"step": step}
            if system == "orbax":
                before = h.du(self.orbax_dir)[1]

                def save_orbax() -> None:
                    self.ckptr.save(self.orbax_dir / str(step), state)
                    self.ckptr.wait_until_finished()

                h.timed(fig, "save_s", save_orbax)
                fig["written_bytes"] = h.du(self.orbax_dir)[1] - before
            else:
                info = h.timed(fig, "save_s", lambda s=system: casstore.save(
                    self.urls[s], step, state, delta=s == "delta", shuffle=self.shuffle))
                fig.update(written_bytes=info.written_bytes, manifest_bytes=info.manifest_bytes,
                           new_chunks=info.new_chunks, delta_chunks=info.delta_chunks,
                           delta_saved_bytes=info.delta_saved_bytes)
            self.per_step[system].append(fig)

    def restore(self, system: str, step: int, abstract: Any) -> Any:
        """``step`` read back from ``system`` into ``abstract``, ready."""
        if system == "orbax":
            return jax.block_until_ready(self.ckptr.restore(self.orbax_dir / str(step), abstract))
        return jax.block_until_ready(casstore.restore(self.urls[system], step, target=abstract))

    def close(self) -> None:
        self.ckptr.close()


def attribute(url: str, steps: list[int]) -> list[dict]:
    """Per step of ``url``'s default run: the stored bytes of the chunk objects it added, by
    kind, with their count, how many are deltas, the longest delta chain it references and
    the age in steps of its oldest delta base.

    An object (a whole chunk or a delta, ``ChunkRef.key``; format.md §2, §3.5) is added by the
    first step whose manifest references it; its stored bytes are shared among the blocks
    referencing it in that step in proportion to their raw bytes (a pack holds many leaves'
    blocks, format.md §3.4).
    """
    first_step: dict[str, int] = {}  # object key -> the step that added it
    base_of: dict[str, str | None] = {}  # chunk id -> its delta base
    out = []
    for step in steps:
        manifest = casstore.read_manifest(url, step)
        refs = [(kind_of(leaf.path), ref, math.prod(ref.shape) * jnp.dtype(leaf.dtype).itemsize)
                for leaf in manifest.leaves for ref in leaf.chunks]
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

        fig["chunk_bytes"] = sum(fig[k] for k in (*KINDS, "other"))
        fig["new_chunk_objects"] = len(covered)
        fig["delta_objects"] = len({ref.key for _, ref, _ in new if ref.base is not None})
        fig["chain_depth"] = max((depth(ref.id) for _, ref, _ in refs), default=0)
        fig["base_age"] = max((step - first_step[chunk_key(ref.base)]
                               for _, ref, _ in refs if ref.base is not None), default=0)
        out.append(fig)
    return out


def summarize(systems: Systems, raw: dict[str, int]) -> dict:
    """Per system: the per-step figures (with the manifest-attributed split for casstore) and
    the mean bytes per step after the first as fractions of the raw bytes."""
    out = {}
    for system, per_step in systems.per_step.items():
        steps = [f["step"] for f in per_step]
        if system != "orbax":
            for fig, split in zip(per_step, attribute(systems.urls[system], steps)):
                fig.update(split)
        later = per_step[1:]
        fraction = {"all": sum(f["written_bytes"] for f in later) / (raw["all"] * len(later))}
        if system != "orbax":
            fraction.update({k: sum(f[k] for f in later) / (raw[k] * len(later)) for k in KINDS})
        out[system] = {"per_step": per_step, "fraction": fraction,
                       "mean_save_s": sum(f["save_s"] for f in later) / len(later)}
    return out


def time_restores(systems: Systems, step: int, expected: Any, args: Any,
                  warm_bytes: int) -> dict:
    """Restores ``step`` from every system ``args.repeat`` times (rotating), cold (after
    dropping the page cache, with ``--drop-caches``; else not reported) then warm; checks each
    bit-exact against ``expected``. Returns medians per system and their ratios.

    Raises:
      AssertionError: a restore was not bit-exact.
    """
    abstract = h.abstract_of(expected, h.device("cpu"))
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    dropped = True
    for r in range(args.repeat):
        for system in h.rotated(SYSTEMS, r):
            fig: dict[str, Any] = {}
            for phase in ("cold", "warm"):
                was_dropped = h.settle(warm_bytes, drop=phase == "cold" and args.drop_caches)
                restored = h.timed(fig, f"{phase}_s",
                                   lambda s=system: systems.restore(s, step, abstract))
                fig["verified_leaves"] = h.verify_equal(expected, h.flatten(restored),
                                                        f"{system} step {step}", True)
                del restored
                if phase == "cold":
                    dropped = dropped and was_dropped
                    if not was_dropped:
                        fig["cold_s"] = fig["cold_cpu_s"] = float("nan")
            runs[system].append(fig)
    med = {s: h.medians(rs) for s, rs in runs.items()}
    ratios = {f"{phase}_{vs}": h.ratio(med["delta"][f"{phase}_s"], med[peer][f"{phase}_s"])
              for phase in ("cold", "warm") for vs, peer in (("vs_whole", "whole"),
                                                               ("vs_orbax", "orbax"))}
    return {"step": step, "dropped_caches": dropped, "systems": med, "ratios": ratios,
            "runs": runs}


# -- scenarios ---------------------------------------------------------------------------------

def finetune(args: Any, lr: float, root: pathlib.Path, keep: bool) -> tuple[dict, Any]:
    """Trains all of MiniLM at ``lr`` for ``args.steps`` steps, saving every step into the
    three systems. Returns the figures and, with ``keep``, ``(systems, states)`` for restores
    (the caller closes them), else None."""
    ex = example()
    path = ex.model_dir()
    train, _ = ex.load_data(ex.Tokenizer.from_file(str(path / "tokenizer.json")))
    params = ex.load_params(path, num_labels=2, seed=0)
    labels = ex.trainable_labels(params, full=True)
    optimizer = ex.make_optimizer(labels, lr, full=True)
    train_step = ex.make_train_step(labels, optimizer)
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0)}
    rng = np.random.default_rng(0)
    batch_size = min(args.batch_size, len(train[2]))
    systems, states, losses = Systems(root, CODECS[args.codecs]), [], []
    for step in range(args.steps):
        batch = rng.choice(len(train[2]), batch_size, replace=False)
        state, loss = jax.block_until_ready(train_step(state, *(a[batch] for a in train)))
        losses.append(float(loss))
        systems.save(step, state)
        if keep:
            states.append(state)
    raw = raw_bytes(systems.urls["delta"], args.steps - 1)
    out = {"lr": lr, "steps": args.steps, "batch_size": batch_size, "losses": losses,
           "raw_bytes": raw, "systems": summarize(systems, raw)}
    if keep:
        return out, (systems, states)
    systems.close()
    return out, None


def restore_scenario(args: Any, systems: Systems, states: list) -> dict:
    """Restore cost of the step at the end of the longest delta chain: the most levels of
    bases, then the oldest base (a delta is taken against its base's whole chunk, format.md
    §3.5), then the latest step."""
    per_step = systems.per_step["delta"]
    step = max(range(len(per_step)), key=lambda i: (per_step[i]["chain_depth"],
                                                    per_step[i]["base_age"], i))
    warm = min(3 * h.state_bytes(states[step]), MAX_WARM_BYTES) if not args.no_warm else 0
    out = time_restores(systems, step, states[step], args, warm)
    out.update(chain_depth=per_step[step]["chain_depth"], base_age=per_step[step]["base_age"],
               delta_objects=per_step[step]["delta_objects"],
               new_chunk_objects=per_step[step]["new_chunk_objects"])
    return out


def gpt2_loss(params: dict, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of GPT-2 (pre-LayerNorm blocks, tanh GELU, tied output
    embedding) with ``params`` in the harness's HF names, on ``tokens`` ``(batch, n)``."""
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


def pretrain(args: Any, root: pathlib.Path) -> dict:
    """``args.pretrain_steps`` adam steps on a GPT-2-shaped state mid-training, saving every
    step into the three systems, then the restore cost of the last step."""
    source = h.train_state(args.pretrain_size)
    optimizer = optax.adam(args.pretrain_lr)
    params = jax.tree.map(jnp.asarray, source["params"])
    opt = source["opt_state"]
    opt_state = (optax.ScaleByAdamState(count=jnp.asarray(opt["count"]),
                                        mu=jax.tree.map(jnp.asarray, opt["mu"]),
                                        nu=jax.tree.map(jnp.asarray, opt["nu"])),
                 optax.EmptyState())  # optax.adam's state: scale_by_adam, then the learning rate
    h.check(jax.tree.structure(opt_state)
            == jax.tree.structure(jax.eval_shape(optimizer.init, params)),
            "the harness's adam state does not fit optax.adam's")
    state = {"params": params, "opt_state": opt_state}
    del source, opt

    @jax.jit
    def train_step(state: dict, tokens: jax.Array) -> tuple[dict, jax.Array, jax.Array]:
        loss, grads = jax.value_and_grad(gpt2_loss)(state["params"], tokens)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
        changed = sum(jnp.any(a != b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new)))
        return new, loss, changed

    text = np.frombuffer((EXAMPLE.parent / "data" / "sentiment.tsv").read_bytes(), np.uint8)
    n = min(65, h.SIZES[args.pretrain_size]["ctx"] + 1)
    rng = np.random.default_rng(0)
    systems, losses, changed = Systems(root, CODECS[args.codecs]), [], []
    leaves = len(jax.tree.leaves(state))
    try:
        for step in range(args.pretrain_steps):
            starts = rng.integers(0, len(text) - n, 2)
            tokens = jnp.asarray(np.stack([text[s:s + n] for s in starts]).astype(np.int32))
            state, loss, n_changed = jax.block_until_ready(train_step(state, tokens))
            losses.append(float(loss))
            changed.append(int(n_changed))
            systems.save(step, state)
        raw = raw_bytes(systems.urls["delta"], args.pretrain_steps - 1)
        out = {"size": args.pretrain_size, "shape": h.SIZES[args.pretrain_size],
               "steps": args.pretrain_steps, "lr": args.pretrain_lr, "gradients": GRADIENTS,
               "losses": losses, "leaves": leaves, "changed_leaves_per_step": changed,
               "raw_bytes": raw, "systems": summarize(systems, raw)}
        warm = min(3 * raw["all"], MAX_WARM_BYTES) if not args.no_warm else 0
        out["restore"] = time_restores(systems, args.pretrain_steps - 1, state, args, warm)
        return out
    finally:
        systems.close()


def run(args: Any) -> dict:
    """Runs the scenarios of ``args.scenarios``; returns all figures."""
    env = h.environment("orbax-checkpoint", "optax", "zstandard")
    result: dict[str, Any] = {"scenarios": list(args.scenarios), "repeat": args.repeat,
                              "drop_caches_requested": args.drop_caches,
                              "codecs": args.codecs, "load_before": os.getloadavg(),
                              "environment": env,
                              "targets": TARGETS}
    lrs = [float(x) for x in args.lrs.split(",")]
    if {"finetune", "restore"} & set(args.scenarios):
        result["finetune"] = []
        for i, lr in enumerate(lrs if "finetune" in args.scenarios else lrs[:1]):
            keep = i == 0 and "restore" in args.scenarios
            with h.scratch(args.dir, f"storage-cost-finetune-{i}") as root:
                figures, kept = finetune(args, lr, root, keep)
                result["finetune"].append(figures)
                if kept:
                    try:
                        result["restore"] = restore_scenario(args, *kept)
                    finally:
                        kept[0].close()
                    del kept
            h.settle()
    if "pretrain" in args.scenarios:
        with h.scratch(args.dir, "storage-cost-pretrain") as root:
            result["pretrain"] = pretrain(args, root)
    result["load_after"] = os.getloadavg()
    return result


# -- reporting ---------------------------------------------------------------------------------

def _met(value: float, limit: float) -> str:
    return f"{value:.3f} ({'met' if value <= limit else 'NOT met'}, target <= {limit})"


def bytes_table(figures: dict, label: str, targets: bool) -> list[str]:
    """Per system: written / raw per step after the first, by kind, and MB and seconds; with
    ``targets``, issue 15's targets for the fine-tune."""
    res, raw = figures["systems"], figures["raw_bytes"]
    rows = [[f"{'adam ' if k != 'params' else ''}{k} ({h.fmt(raw[k], 'B')} raw)",
             *(h.fmt(res[s]["fraction"].get(k, float("nan")), "x") for s in SYSTEMS),
             f"<= {TARGETS[k]}" if targets and k in TARGETS else ""] for k in KINDS]
    rows.append([f"all, incl. manifest ({h.fmt(raw['all'], 'B')} raw)",
                 *(h.fmt(res[s]["fraction"]["all"], "x") for s in SYSTEMS),
                 f"<= {TARGETS['all']}" if targets else ""])
    mb = [sum(f["written_bytes"] for f in res[s]["per_step"][1:]) / (figures["steps"] - 1)
          for s in SYSTEMS]
    rows.append(["MB written per step", *(h.fmt(v, "MB") for v in mb), ""])
    rows.append(["delta chunks per step", *(h.fmt(sum(f.get("delta_chunks", 0) for f in
                                                      res[s]["per_step"][1:])
                                                  / (figures["steps"] - 1), "n")
                                            if s != "orbax" else "" for s in SYSTEMS), ""])
    rows.append(["save s per step (mean)", *(h.fmt(res[s]["mean_save_s"], "s") for s in SYSTEMS),
                 ""])
    header = [f"{label}: written / raw, per step after the first", *SYSTEMS, "target"]
    lines = h.md_table(header, rows)
    delta = res["delta"]["fraction"]
    if targets:
        lines += ["", f"- target, casstore with deltas: all {_met(delta['all'], TARGETS['all'])}"
                      f"; params {_met(delta['params'], TARGETS['params'])}"]
    return lines


def restore_table(restore: dict, label: str) -> list[str]:
    """Cold and warm restore seconds per system and delta's ratios to the others."""
    res = restore["systems"]
    rows = [[f"{phase} restore (s)", *(h.fmt(res[s][f"{phase}_s"], "s") for s in SYSTEMS),
             h.fmt(restore["ratios"][f"{phase}_vs_whole"], "x"),
             h.fmt(restore["ratios"][f"{phase}_vs_orbax"], "x")] for phase in ("cold", "warm")]
    rows += [[f"{phase} restore CPU (s)", *(h.fmt(res[s][f"{phase}_cpu_s"], "s") for s in SYSTEMS),
              h.fmt(h.ratio(res["delta"][f"{phase}_cpu_s"], res["whole"][f"{phase}_cpu_s"]), "x"),
              h.fmt(h.ratio(res["delta"][f"{phase}_cpu_s"], res["orbax"][f"{phase}_cpu_s"]), "x")]
             for phase in ("cold", "warm")]
    rows.append(["warm restore, read from disk",
                 *(h.fmt(res[s]["warm_disk_read_bytes"], "B") for s in SYSTEMS), "", ""])
    lines = h.md_table([f"{label}: restore of step {restore['step']}", *SYSTEMS,
                        "delta / whole", "delta / orbax"], rows) + [""]
    for phase in ("cold", "warm"):
        r = restore["ratios"]
        if not math.isnan(r[f"{phase}_vs_whole"]):
            lines.append(f"- target, {phase}: delta / whole "
                         f"{_met(r[f'{phase}_vs_whole'], TARGETS['restore_vs_whole'])}; delta / "
                         f"orbax {_met(r[f'{phase}_vs_orbax'], TARGETS['restore_vs_orbax'])}")
    if not restore["dropped_caches"]:
        lines.append("- cold: n/a (the page cache was not dropped; pass --drop-caches as root)")
    return lines


def table(result: dict) -> str:
    """Every scenario's tables and targets, then the run's conditions."""
    lines: list[str] = []
    for ft in result.get("finetune", []):
        lines += bytes_table(ft, f"MiniLM full fine-tune, adam lr {ft['lr']:g}, {ft['steps']} "
                                 f"steps", targets=True) + [""]
    if "restore" in result:
        r = result["restore"]
        lines += restore_table(r, f"MiniLM lr {result['finetune'][0]['lr']:g}")
        lines += [f"- step {r['step']}: longest delta chain {r['chain_depth']}, oldest base "
                  f"{r['base_age']} steps back; {r['delta_objects']} of its "
                  f"{r['new_chunk_objects']} new chunk objects are deltas", ""]
    if "pretrain" in result:
        p = result["pretrain"]
        lines += bytes_table(p, f"{p['size']} pretraining, adam lr {p['lr']:g}, {p['steps']} "
                                f"steps", targets=False)
        lines += ["", f"- gradients: {p['gradients']}; leaves changed per step: "
                  f"{p['changed_leaves_per_step']} of {p['leaves']}", ""]
        lines += restore_table(p["restore"], f"{p['size']} pretraining") + [""]
    lines.append(f"- casstore codecs: {result['codecs']} (shuffle="
                 f"{CODECS[result['codecs']]}); restores verified bit-exact; median of "
                 f"{result['repeat']} restore(s); {h.machine_note(result)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = h.parser(__doc__, "dir", "repeat", "tiny", "drop-caches", "no-warm", "json",
                  repeat="restores of each system; medians are shown",
                  tiny=f"{TINY['steps']} fine-tune steps at lr 1e-4 (batch 8), "
                       f"{TINY['pretrain_steps']} steps of a tiny GPT-2 (smoke test)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help="comma-separated subset of " + ",".join(SCENARIOS))
    ap.add_argument("--steps", type=int, default=8, help="fine-tune steps (checkpoints)")
    ap.add_argument("--lrs", default="1e-4,1e-5",
                    help="fine-tune learning rates; the first one's repositories are restored")
    ap.add_argument("--batch-size", type=int, default=32, help="fine-tune batch size")
    ap.add_argument("--pretrain-steps", type=int, default=4, help="pretraining steps")
    ap.add_argument("--pretrain-size", choices=tuple(s for s in h.SIZES if s not in h.JAX_SIZES),
                    default="gpt2", help="GPT-2 shape of the pretraining state (harness.SIZES)")
    ap.add_argument("--pretrain-lr", type=float, default=6e-4)
    ap.add_argument("--codecs", choices=tuple(CODECS), default="default",
                    help="casstore's codecs: its default (byte planes wherever they save 1/8) "
                         "or shuffle=False (barely compressible floats stored raw)")
    args = h.parse(ap, argv)
    if args.tiny:
        for key, value in TINY.items():
            if ap.get_default(key) == getattr(args, key):
                setattr(args, key, value)
    args.scenarios = tuple(s for s in SCENARIOS if s in args.scenarios.split(","))
    if not args.scenarios:
        ap.error("need at least one of " + ",".join(SCENARIOS))
    if args.steps < 2 or args.pretrain_steps < 2:
        ap.error("--steps and --pretrain-steps must be >= 2 (figures are per step after the "
                 "first)")
    result = run(args)
    return h.report(result, table(result), args.json)


if __name__ == "__main__":
    main()
