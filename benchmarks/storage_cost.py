"""casstore with deltas vs without vs orbax: bytes per step when every tensor changes (issue 15).

Scenarios: finetune (all of MiniLM under adam at each of ``--lrs``), restore (its step at the end
of the longest delta chain, cold and warm) and pretrain (a GPT-2 state under adam, real
gradients). README.md's ``storage_cost.py`` section says what each measures and its targets.

Usage::

    python benchmarks/storage_cost.py [--scenarios finetune,restore,pretrain] [--steps N]
                                      [--lrs 1e-4,1e-5] [--pretrain-steps K] [--repeat N]
                                      [--codecs default|no-shuffle] [--drop-caches]
                                      [--no-warm] [--dir DIR] [--tiny] [--json PATH]
"""

from __future__ import annotations

import collections
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import casstore
from casstore._layout import chunk_key

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h
from harness.gpt2 import adam_state, gpt2_loss

SYSTEMS, SCENARIOS = ("delta", "whole", "orbax"), ("finetune", "restore", "pretrain")
KINDS = ("params", "mu", "nu")
CODECS = {"default": None, "no-shuffle": False}  # --codecs -> save(..., shuffle=)
EXAMPLE = h.HERE.parent / "examples" / "finetune_minilm.py"
DEFAULTS = {"steps": 8, "lrs": "1e-4,1e-5", "pretrain_steps": 4}
TINY = {"steps": 3, "lrs": "1e-4", "pretrain_steps": 3}
TARGETS = {"all": 0.40, "params": 0.35, "restore_vs_whole": 1.25, "restore_vs_orbax": 0.8}
GRADIENTS = "real: GPT-2 next-token cross-entropy on the bytes of examples/data/sentiment.tsv"


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

        fig.update(chunk_bytes=sum(fig[k] for k in (*KINDS, "other")),
                   new_chunk_objects=len(covered),
                   delta_objects=len({ref.key for _, ref, _ in new if ref.base is not None}),
                   chain_depth=max((depth(ref.id) for _, ref, _ in refs), default=0),
                   base_age=max((step - first_step[chunk_key(ref.base)] for _, ref, _ in refs
                                 if ref.base is not None), default=0))
        out.append(fig)
    return out


def training(args, root: pathlib.Path, steps: int, state: object, step_fn, limit: dict,
             restore: str | None = None) -> dict:
    """Saves ``steps`` states of ``state, loss, changed = step_fn(state, i)`` into the three
    systems; then, with ``restore``, the restore of step ``"last"`` or of the end of the
    longest delta chain (``"chain"``: most levels, oldest base, latest)."""
    shuffle, keep = CODECS[args.codecs], []
    (root / "orbax").mkdir(parents=True)
    peers = {"delta": h.peers.Casstore(root / "delta", shuffle=shuffle),
             "whole": h.peers.Casstore(root / "whole", delta=False, shuffle=shuffle),
             "orbax": h.peers.Orbax(root / "orbax")}
    per_step, losses, changed = {s: [] for s in SYSTEMS}, [], []
    for i in range(steps):
        state, loss, n_changed = jax.block_until_ready(step_fn(state, i))
        losses.append(float(loss))
        changed.append(int(n_changed))
        for system, peer in peers.items():
            fig = {"step": i}
            h.phase(fig, "save_s", lambda p=peer, i=i, s=state: p.save(i, s))
            per_step[system].append({**fig, **peer.saved(i)})
        if restore == "chain":
            keep.append(state)
    raw = raw_bytes(peers["delta"].url, steps - 1)
    out = {"steps": steps, "losses": losses, "changed_leaves_per_step": changed,
           "leaves": len(jax.tree.leaves(state)), "raw_bytes": raw, "systems": {}}
    for system, figs in per_step.items():
        if system != "orbax":
            for fig, split in zip(figs, attribute(peers[system].url, range(steps))):
                fig.update(split)
        out["systems"][system] = {"per_step": figs, "mean_save_s": np.mean(
            [f["save_s"] for f in figs[1:]]), "fraction": {
                k: sum(f[k if k != "all" else "written_bytes"] for f in figs[1:])
                / (raw[k] * (steps - 1)) for k in ("all", *(KINDS * (system != "orbax")))}}
    out["save_limit_s"] = h.limit.save_s(limit, raw["all"], np.mean(
        [f["written_bytes"] for f in per_step["delta"][1:]]))
    if restore:
        per = per_step["delta"]
        i = steps - 1 if restore == "last" else max(
            range(steps), key=lambda i: (per[i]["chain_depth"], per[i]["base_age"], i))
        out["restore"] = restores(peers, i, keep[i] if keep else state, args, limit,
                                  per_step["whole"][i]["written_bytes"])
        out["restore"].update({k: per[i][k] for k in ("chain_depth", "base_age",
                                                       "delta_objects", "new_chunk_objects")})
    peers["orbax"].close()
    return out


def restores(peers: dict, step: int, expected: object, args, limit: dict, stored: int) -> dict:
    """Restores ``step`` from every system (rotating), cold (with ``--drop-caches``, else NaN)
    then warm, each checked bit-exact; medians, ratios and the limit (of ``stored`` bytes)."""
    abstract = h.abstract_of(expected, h.device("cpu"))
    raw = h.state_bytes(expected)
    warm = 0 if args.no_warm else min(3 * raw, 8 << 30)

    def one(system: str) -> dict:
        fig: dict = {}
        for p in ("cold", "warm"):
            got = h.phase(fig, f"{p}_s", lambda: peers[system].restore(step, abstract),
                          warm=warm, drop=p == "cold" and args.drop_caches)
            fig["verified_leaves"] = h.verify_equal(expected, got, system, True)
            del got
            if p == "cold" and not fig.pop("dropped_caches"):
                fig["cold_s"] = fig["cold_cpu_s"] = float("nan")
        return fig

    runs, med, _ = h.interleave(SYSTEMS, args.repeat, one)
    return {"step": step, "systems": med, "runs": runs,
            "dropped_caches": not math.isnan(med["delta"]["cold_s"]),
            "ratios": {f"{p}_vs_{o}": h.ratio(med["delta"][f"{p}_s"], med[o][f"{p}_s"])
                       for p in ("cold", "warm") for o in ("whole", "orbax")},
            "limits": {f"{p}_s": h.limit.restore_s(limit, raw, stored, cold=p == "cold")
                       for p in ("cold", "warm")}}


def finetune(args, lr: float, root: pathlib.Path, limit: dict, restore: bool) -> dict:
    """All of MiniLM trained at ``lr``; with ``restore``, then the restore scenario."""
    ex = h.load_module("finetune_minilm", EXAMPLE)
    train, _ = ex.load_data(ex.Tokenizer.from_file(str(ex.model_dir() / "tokenizer.json")))
    params = ex.load_params(ex.model_dir(), num_labels=2, seed=0)
    labels = ex.trainable_labels(params, full=True)
    optimizer = ex.make_optimizer(labels, lr, full=True)
    train_step, rng = ex.make_train_step(labels, optimizer), np.random.default_rng(0)
    batch_size = min(8 if args.tiny else 32, len(train[2]))

    def step_fn(state: dict, i: int) -> tuple:
        batch = rng.choice(len(train[2]), batch_size, replace=False)
        return (*train_step(state, *(a[batch] for a in train)), -1)  # changes not counted

    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0)}
    out = training(args, root, args.steps, state, step_fn, limit, "chain" if restore else None)
    del out["changed_leaves_per_step"]
    return {**out, "lr": lr, "batch_size": batch_size}


def pretrain(args, root: pathlib.Path, limit: dict) -> dict:
    """``args.pretrain_steps`` adam steps on a GPT-2 state, then the last step's restore."""
    optimizer, size = optax.adam(6e-4), "tiny" if args.tiny else "gpt2"
    params, opt_state = adam_state(h.train_state(size), optimizer)
    text = np.frombuffer((EXAMPLE.parent / "data" / "sentiment.tsv").read_bytes(), np.uint8)
    n, rng = min(65, h.SIZES[size]["ctx"] + 1), np.random.default_rng(0)

    @jax.jit
    def train_step(state: dict, tokens: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(gpt2_loss)(state["params"], tokens)
        updates, opt = optimizer.update(grads, state["opt_state"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt}
        return new, loss, sum(jnp.any(a != b) for a, b in zip(jax.tree.leaves(state),
                                                              jax.tree.leaves(new)))

    def step_fn(state: dict, i: int) -> tuple:
        starts = rng.integers(0, len(text) - n, 2)
        return train_step(state, jnp.asarray(np.stack([text[s:s + n] for s in starts])
                                             .astype(np.int32)))

    out = training(args, root, args.pretrain_steps, {"params": params, "opt_state": opt_state},
                   step_fn, limit, "last")
    return {**out, "size": size, "shape": h.SIZES[size], "lr": 6e-4, "gradients": GRADIENTS}


def run(args) -> dict:
    """The limit, then the scenarios of ``args.scenarios``."""
    result = {"scenarios": list(args.scenarios), "repeat": args.repeat, "codecs": args.codecs,
              "drop_caches_requested": args.drop_caches, "targets": TARGETS,
              "limit": h.limit.measure(64 << 20, base_dir=args.dir, drop=args.drop_caches)}
    lrs = [float(x) for x in args.lrs.split(",")]
    if {"finetune", "restore"} & set(args.scenarios):
        result["finetune"] = []
        for i, lr in enumerate(lrs if "finetune" in args.scenarios else lrs[:1]):
            with h.scratch(args.dir, f"storage-cost-finetune-{i}") as root:
                ft = finetune(args, lr, root, result["limit"],
                              i == 0 and "restore" in args.scenarios)
            if "restore" in ft:
                result["restore"] = ft.pop("restore")
            result["finetune"].append(ft)
            h.settle()
    if "pretrain" in args.scenarios:
        with h.scratch(args.dir, "storage-cost-pretrain") as root:
            result["pretrain"] = pretrain(args, root, result["limit"])
    return result


def bytes_table(figures: dict, label: str, targets: bool) -> list[str]:
    """Per system: written / raw per step after the first by kind, MB, deltas, seconds and
    the save's fraction of the machine's limit; with ``targets``, issue 15's."""
    res, raw, n = figures["systems"], figures["raw_bytes"], figures["steps"] - 1
    later = lambda s, k: sum(f.get(k, 0) for f in res[s]["per_step"][1:]) / n  # noqa: E731
    row = lambda label, value: [label, *(value(s) for s in SYSTEMS)]  # noqa: E731
    rows = [row(f"{'adam ' if k != 'params' else ''}{k} ({h.fmt(raw[k], 'B')} raw)",
                lambda s, k=k: h.fmt(res[s]["fraction"].get(k, math.nan), "x")) for k in KINDS]
    rows += [row(f"all, incl. manifest ({h.fmt(raw['all'], 'B')} raw)",
                 lambda s: h.fmt(res[s]["fraction"]["all"], "x")),
             row("MB written per step", lambda s: h.fmt(later(s, "written_bytes"), "MB")),
             row("delta chunks per step",
                 lambda s: h.fmt(later(s, "delta_chunks"), "n") if s != "orbax" else ""),
             row("save s per step (mean)", lambda s: h.fmt(res[s]["mean_save_s"], "s")),
             row(f"... limit / figure (limit {figures['save_limit_s']:.3f} s)", lambda s: h.fmt(
                 h.ratio(figures["save_limit_s"], res[s]["mean_save_s"]), "x"))]
    lines = h.md_table([f"{label}: written / raw, per step after the first", *SYSTEMS], rows)
    d = res["delta"]["fraction"]
    return lines + (["", *h.target_lines([(f"casstore with deltas: {k}", d[k], TARGETS[k])
                                          for k in ("all", "params")])] if targets else [])


def restore_table(restore: dict, label: str) -> list[str]:
    """Cold and warm restore seconds and CPU per system, delta's ratios, the limit, targets."""
    figures = [(f"{p}{'_cpu' * cpu}_s", f"{p} restore{' CPU' * cpu}", "s")
               for cpu in (0, 1) for p in ("cold", "warm")]
    r = restore["ratios"]
    return [f"{label}: restore of step {restore['step']}", "", *h.figure_table(
        restore["systems"], [*figures, ("warm_disk_read_bytes", "warm restore, read from disk",
                                        "B")], list(SYSTEMS), limits=restore["limits"],
        ratios=[("delta", "whole"), ("delta", "orbax")]), "", *h.target_lines(
            [(f"{p}: delta / {o}", r[f"{p}_vs_{o}"], TARGETS[f"restore_vs_{o}"])
             for p in ("cold", "warm") for o in ("whole", "orbax")],
            na="n/a (the page cache was not dropped; pass --drop-caches as root)")]


def table(result: dict) -> list[str]:
    """Every scenario's tables and targets, the limit, then the run's conditions."""
    lines: list[str] = []
    for ft in result.get("finetune", []):
        title = f"MiniLM full fine-tune, adam lr {ft['lr']:g}, {ft['steps']} steps"
        lines += [*bytes_table(ft, title, targets=True), ""]
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
        lines += restore_table(p["restore"], f"{p['size']} pretraining")
    return [*lines, *h.limit_lines(result["limit"]), f"- casstore codecs: {result['codecs']} "
            f"(shuffle={CODECS[result['codecs']]}); restores verified bit-exact; median of "
            f"{result['repeat']} restore(s)"]


def main(argv: list[str] | None = None) -> dict:
    args = h.parse(__doc__, argv, "dir", "repeat", "tiny", "drop-caches", "no-warm", extra=(
        ("--scenarios", {"type": h.subset(SCENARIOS), "default": ",".join(SCENARIOS)}),
        ("--steps", {"type": int}), ("--lrs", {}), ("--pretrain-steps", {"type": int}),
        ("--codecs", {"choices": tuple(CODECS), "default": "default"})))
    for key, value in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 2 or args.pretrain_steps < 2:
        raise SystemExit("storage_cost.py: --steps and --pretrain-steps must be >= 2")
    return h.report(run(args), table, args)


if __name__ == "__main__":
    main()
