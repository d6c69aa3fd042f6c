"""casstore with deltas vs without vs orbax: bytes per step when every tensor changes (issue 15).

Scenarios: finetune (all of MiniLM under adam at each of ``--lrs``), restore (its step at the end
of the longest delta chain, cold and warm) and pretrain (a GPT-2 state under adam, real
gradients), harness/training.py's models. README.md's ``storage_cost.py`` section."""

import math
import pathlib
import sys

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h
from harness import training

SYSTEMS, SCENARIOS = ("delta", "whole", "orbax"), ("finetune", "restore", "pretrain")
CODECS = {"default": None, "no-shuffle": False}  # --codecs -> save(..., shuffle=)
DEFAULTS = {"steps": (8, 3), "lrs": ("1e-4,1e-5", "1e-4"), "pretrain_steps": (4, 3)}  # , --tiny
TARGETS = {"all": 0.40, "params": 0.35, "restore_vs_whole": 1.25, "restore_vs_orbax": 0.8}
VS = {"whole": TARGETS["restore_vs_whole"], "orbax": TARGETS["restore_vs_orbax"]}  # restores


def run_steps(args, root: pathlib.Path, steps: int, state: object, step_fn, limit: dict,
              restore: str | None) -> dict:
    """Saves ``steps`` states of ``state, loss, changed = step_fn(state, i)`` into the three
    systems; with ``restore``, then restores step ``"last"`` or the end of the longest delta
    chain (``"chain"``: most levels, oldest base, latest)."""
    shuffle, kept, losses, changed = CODECS[args.codecs], [], [], []
    (root / "orbax").mkdir(parents=True)
    peers = {"delta": h.peers.Casstore(root / "delta", shuffle=shuffle),
             "whole": h.peers.Casstore(root / "whole", delta=False, shuffle=shuffle),
             "orbax": h.peers.Orbax(root / "orbax")}
    per_step = {s: [] for s in SYSTEMS}
    for i in range(steps):
        state, loss, n_changed = jax.block_until_ready(step_fn(state, i))
        losses.append(float(loss))
        changed.append(int(n_changed))
        for system, peer in peers.items():
            fig = {"step": i}
            h.phase(fig, "save_s", lambda p=peer, i=i, s=state: p.save(i, s))
            per_step[system].append({**fig, **peer.saved(i)})
        kept.append(state if restore == "chain" else None)
    raw = training.raw_bytes(peers["delta"].url, steps - 1)
    out = {"steps": steps, "losses": losses, "changed_leaves_per_step": changed,
           "leaves": len(jax.tree.leaves(state)), "raw_bytes": raw,
           "systems": {s: training.summary(figs, peers[s].url if peers[s].dedups else None, raw)
                       for s, figs in per_step.items()},
           "save_limit_s": h.limit.save_s(limit, raw["all"], np.mean(
               [f["written_bytes"] for f in per_step["delta"][1:]]))}
    if restore:
        per = per_step["delta"]
        i = steps - 1 if restore == "last" else max(
            range(steps), key=lambda i: (per[i]["chain_depth"], per[i]["base_age"], i))
        out["restore"] = h.peers.cold_and_warm(peers, "delta", i, kept[i] or state, args, limit,
                                               per_step["whole"][i]["written_bytes"])
        out["restore"].update({k: per[i][k] for k in ("chain_depth", "base_age",
                                                       "delta_objects", "new_chunk_objects")})
    peers["orbax"].close()
    return out


def run(args) -> dict:
    """The limit, then the scenarios of ``args.scenarios``."""
    for key, values in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, values[args.tiny])
    if args.steps < 2 or args.pretrain_steps < 2:
        raise SystemExit("storage_cost.py: --steps and --pretrain-steps must be >= 2")
    result = {"scenarios": list(args.scenarios), "repeat": args.repeat, "codecs": args.codecs,
              "drop_caches_requested": args.drop_caches, "targets": TARGETS,
              "limit": h.limit.measure((8 if args.tiny else 64) << 20, base_dir=args.dir,
                                       drop=args.drop_caches)}
    lrs = [float(x) for x in args.lrs.split(",")]
    if "finetune" not in args.scenarios:  # the restore scenario alone: the first lr's run
        lrs = lrs[:1] if "restore" in args.scenarios else []
    for i, lr in enumerate(lrs):
        state, step, batch_size = training.finetuning(lr, 8 if args.tiny else 32, args.tiny)
        with h.scratch(args.dir, f"storage-cost-finetune-{i}") as root:
            ft = run_steps(args, root, args.steps, state, step, result["limit"],
                           "chain" if i == 0 and "restore" in args.scenarios else None)
        del ft["changed_leaves_per_step"]  # not counted
        ft.update(lr=lr, batch_size=batch_size)
        if "restore" in ft:
            result["restore"] = ft.pop("restore")
        result.setdefault("finetune", []).append(ft)
        h.settle()
    if "pretrain" in args.scenarios:
        size = "tiny" if args.tiny else "gpt2"
        with h.scratch(args.dir, "storage-cost-pretrain") as root:
            out = run_steps(args, root, args.pretrain_steps, *training.pretraining(size, 6e-4),
                            result["limit"], "last")
        result["pretrain"] = {**out, "size": size, "shape": h.SIZES[size], "lr": 6e-4,
                              "gradients": training.GRADIENTS}
    return result


def bytes_table(figures: dict, label: str, targets: bool) -> list[str]:
    """Per system: written / raw per step after the first by kind, MB, deltas, seconds and
    the save's fraction of the machine's limit; with ``targets``, issue 15's."""
    res, raw, n = figures["systems"], figures["raw_bytes"], figures["steps"] - 1
    later = lambda s, k: sum(f.get(k, 0) for f in res[s]["per_step"][1:]) / n  # noqa: E731
    row = lambda label, value: [label, *(value(s) for s in SYSTEMS)]  # noqa: E731
    rows = [row(f"{'adam ' if k != 'params' else ''}{k} ({h.fmt(raw[k], 'B')} raw)",
                lambda s, k=k: h.fmt(res[s]["fraction"].get(k, math.nan), "x")) for k in h.KINDS]
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


def table(result: dict) -> list[str]:
    """Every scenario's tables and targets, the limit, then the run's conditions."""
    lines: list[str] = []
    for ft in result.get("finetune", []):
        title = f"MiniLM full fine-tune, adam lr {ft['lr']:g}, {ft['steps']} steps"
        lines += [*bytes_table(ft, title, targets=True), ""]
    if "restore" in result:
        r = result["restore"]
        lines += h.cold_warm_table(r, f"MiniLM lr {result['finetune'][0]['lr']:g}", "delta", VS)
        lines += [f"- step {r['step']}: longest delta chain {r['chain_depth']}, oldest base "
                  f"{r['base_age']} steps back; {r['delta_objects']} of its "
                  f"{r['new_chunk_objects']} new chunk objects are deltas", ""]
    if "pretrain" in result:
        p = result["pretrain"]
        lines += bytes_table(p, f"{p['size']} pretraining, adam lr {p['lr']:g}, {p['steps']} "
                                f"steps", targets=False)
        lines += ["", f"- gradients: {p['gradients']}; leaves changed per step: "
                  f"{p['changed_leaves_per_step']} of {p['leaves']}", ""]
        lines += h.cold_warm_table(p["restore"], f"{p['size']} pretraining", "delta", VS)
    return [*lines, *h.limit_lines(result["limit"]), f"- casstore codecs: {result['codecs']} "
            f"(shuffle={CODECS[result['codecs']]}); restores verified bit-exact; median of "
            f"{result['repeat']} restore(s)"]


main = h.command(__doc__, run, table, "dir", "repeat", "tiny", "drop-caches", "no-warm", extra=(
    ("--scenarios", {"type": h.subset(SCENARIOS), "default": ",".join(SCENARIOS)}),
    ("--steps", {"type": int}), ("--lrs", {}), ("--pretrain-steps", {"type": int}),
    ("--codecs", {"choices": tuple(CODECS), "default": "default"})))

if __name__ == "__main__":
    main()
