"""casstore vs orbax-checkpoint: blocking time of an asynchronous save; casstore GC of 50 steps.

README.md's ``async_gc.py`` section says what each part saves, checks and times."""

import inspect
import math
import os
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

import casstore

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h

SYSTEMS = ("casstore", "orbax")
PEERS = {"casstore": h.peers.CasstoreManager, "orbax": h.peers.Orbax}
ASYNC_SAVES = 3  # steps 1..3; the proof step is ASYNC_SAVES + 1
ASYNC_FIGURES = [
    ("blocking_s", "`save()` blocking, median", "s"),
    ("first_blocking_s", "`save()` blocking, step 1 (everything new)", "s"),
    ("later_blocking_s", "`save()` blocking, steps 2.., median", "s"),
    ("reported_blocking_s", "`mngr.last_save_blocking_s`, median", "s"),
    ("wait_s", "`wait_until_finished()`, median", "s"),
    ("total_s", "total, `save()` call to finished, median", "s"),
    ("first_total_s", "total of step 1 (everything new)", "s"),
    ("written_bytes", "written per save, median", "MB"),
    ("rss_extra_bytes", "peak extra RSS, `save()` call to finished, median", "MB"),
]
GC_STEPS, GC_KEEP = 50, 10
GC_SIZES = {"gpt2": (64, 128 * 1024, 256, 16), "tiny": (8, 32 * 1024, 16, 2)}  # matrices,
# float32 elements per matrix, bias elements, matrices changed per step
GC_FIGURES = [("seconds", "seconds", "s"), ("manifests", "manifests read", "n"),
              ("chunks", "chunks listed", "n"), ("referenced_chunks", "chunks referenced", "n"),
              ("deleted_chunks", "chunks deleted (dry run: would be)", "n"),
              ("deleted_bytes", "MB freed (dry run: would be)", "MB")]
_plus_one_donated = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)


def delete_arrays(state: object) -> None:
    """Frees every jax buffer of ``state``, as a training loop moving on would."""
    for leaf in jax.tree.leaves(state):
        leaf.delete()


def bench_async(system: str, root: pathlib.Path, np_states: list, proof_state: object,
                dev: jax.Device, drop: bool) -> dict:
    """``system``'s asynchronous saves of ``np_states`` and the proof step, checked."""
    saves, abstract, proof_step = [], h.abstract_of(proof_state, dev), len(np_states) + 1
    with PEERS[system](root) as ckpt:
        for step, np_state in enumerate(np_states, start=1):
            state = h.to_jax([np_state], dev, copy=True)[0]
            h.settle(drop=drop)
            with h.PeakRss() as rss:
                t0 = time.perf_counter()
                blocking_s = h.seconds(lambda n=step, s=state: ckpt.save_async(n, s))[0]
                delete_arrays(state)  # the caller moves on: its buffers are gone
                del state
                wait_s = h.seconds(ckpt.wait)[0]
                total_s = time.perf_counter() - t0
            reported = ckpt.mngr.last_save_blocking_s if system == "casstore" else math.nan
            saves.append({"step": step, "blocking_s": blocking_s, "wait_s": wait_s,
                          "reported_blocking_s": reported, "total_s": total_s,
                          "written_bytes": ckpt.saved(step)["written_bytes"],
                          "rss_extra_bytes": rss.extra})
        for step, np_state in enumerate(np_states, start=1):
            h.verify_equal(np_state, ckpt.restore(step, abstract), system, True)
        # The proof step: the update donates the saved arrays, so XLA writes into their
        # buffers whenever nothing else holds them; then garbage reuses any freed memory.
        delete_arrays(_plus_one_donated(h.to_jax([proof_state], dev, copy=True)[0]))
        state = h.to_jax([proof_state], dev, copy=True)[0]
        ckpt.save_async(proof_step, state)
        updated = jax.block_until_ready(_plus_one_donated(state))
        donated = all(x.is_deleted() for x in jax.tree.leaves(state))
        if not donated:  # jax copied instead (the buffers were still referenced)
            delete_arrays(state)
        garbage = h.to_jax([jax.tree.map(np.zeros_like, proof_state)], dev, copy=True)[0]
        delete_arrays(updated)
        ckpt.wait()
        h.verify_equal(proof_state, ckpt.restore(proof_step, abstract), f"{system} proof", True)
        delete_arrays(garbage)
    return {"saves": saves, "verified_steps": len(np_states), "proof_verified": True,
            "buffers_donated_in_place": donated}


def save_medians(runs: list[dict]) -> dict:
    """Medians of the runs' per-save figures; step 1's total and blocking time apart."""
    saves = [s for r in runs for s in r["saves"]]
    med = lambda key, steps: statistics.median(s[key] for s in steps)  # noqa: E731
    first, later = [s for s in saves if s["step"] == 1], [s for s in saves if s["step"] > 1]
    return {**{key: med(key, saves) for key in saves[0] if key != "step"},
            "first_total_s": med("total_s", first), "first_blocking_s": med("blocking_s", first),
            "later_blocking_s": med("blocking_s", later or first), "saves_measured": len(saves),
            "verified_steps": sum(r["verified_steps"] for r in runs),
            **{k: all(r[k] for r in runs) for k in ("proof_verified", "buffers_donated_in_place")}}


def bench_gc(root: pathlib.Path, size: str, drop: bool) -> dict:
    """50 steps, some matrices and biases new in each; deletes 40, times GC and checks it."""
    matrices, elements, bias, changed = GC_SIZES[size]
    rng, layers, states = np.random.default_rng(0), [None] * matrices, []
    repo, chunk_dir = str(root / "gc-repo"), root / "gc-repo" / "chunks"
    for step in range(GC_STEPS):
        for i in range((step - 1) * changed, step * changed) if step else range(matrices):
            layers[i % matrices] = {"w": rng.standard_normal(elements, dtype=np.float32),
                                    "b": rng.standard_normal(bias, dtype=np.float32)}
        states.append({"layers": list(layers), "step": np.int64(step)})
    build_s = sum(h.seconds(lambda s=s, t=t: casstore.save(repo, s, t))[0]
                  for s, t in enumerate(states))
    refs = [casstore.read_manifest(repo, s).chunk_ids() for s in range(len(states))]
    keep, doomed = list(range(GC_STEPS - GC_KEEP, GC_STEPS)), range(GC_STEPS - GC_KEEP)
    live = set().union(*(refs[s] for s in keep))
    garbage = set().union(*(refs[s] for s in doomed)) - live
    garbage_bytes = sum((chunk_dir / c[:2] / c[2:]).stat().st_size for c in garbage)
    chunks_before, bytes_before = h.du(chunk_dir)
    for step in doomed:
        casstore.delete(repo, step)
    young = casstore.gc(repo, dry_run=True)  # default grace period: nothing is old enough
    h.check(young.deleted_chunks == 0 and young.young_unreferenced_chunks == len(garbage), young)
    age_s = 2 * inspect.signature(casstore.gc).parameters["grace_period_s"].default
    for path in chunk_dir.rglob("*"):
        os.utime(path, (time.time() - age_s,) * 2)
    h.settle(drop=drop)
    dry, real = (casstore.gc(repo, grace_period_s=0, dry_run=d) for d in (True, False))
    for info in (dry, real):
        h.check((info.deleted_chunks, info.deleted_bytes, info.manifests, info.chunks,
                 info.referenced_chunks, info.missing_chunks) == (
            len(garbage), garbage_bytes, GC_KEEP, chunks_before, len(live), 0), info)
    chunks_after, bytes_after = h.du(chunk_dir)
    h.check((chunks_after, bytes_after) == (chunks_before - len(garbage),
                                            bytes_before - garbage_bytes), "GC left too much")
    again, report = casstore.gc(repo, grace_period_s=0), casstore.verify(repo)
    h.check(again.deleted_chunks == 0 and report.ok, (again, report.problems))
    h.check(sorted(s for _, s in report.steps_checked) == keep, report.steps_checked)
    for step in keep:
        h.verify_equal(states[step], casstore.restore(repo, step), "gc")
    return {"steps": len(states), "kept_steps": keep, "deleted_steps": len(doomed),
            "state_bytes": h.state_bytes(states[0]), "build_s": build_s,
            "chunks_before": chunks_before, "bytes_before": bytes_before,
            "chunks_after": chunks_after, "bytes_after": bytes_after,
            "young_dry_run_spared": young.young_unreferenced_chunks,
            **{p: {k: getattr(info, k) for k, _, _ in GC_FIGURES}
               for p, info in (("dry_run", dry), ("gc", real))},
            "second_gc_deleted": again.deleted_chunks, "verify_ok": report.ok,
            "verify_chunks": report.chunks_checked, "verify_s": report.seconds,
            "verify_bytes_read": report.bytes_read, "restored_steps": len(keep)}


def gc_table(g: dict) -> list[str]:
    return [f"GC of a repository of {g['steps']} steps of {g['state_bytes'] / 1e6:.1f} MB "
            f"({g['deleted_steps']} deleted, {len(g['kept_steps'])} kept; built in "
            f"{g['build_s']:.1f} s):", "",
            *h.md_table(["GC figure", "dry run", "gc"], [
                [label, *(h.fmt(g[p][key], unit) for p in ("dry_run", "gc"))]
                for key, label, unit in GC_FIGURES]), "",
            f"- chunks: {g['chunks_before']:.0f} ({g['bytes_before'] / 1e6:.1f} MB) before GC, "
            f"{g['chunks_after']:.0f} ({g['bytes_after'] / 1e6:.1f} MB) after; a dry run with "
            f"the default grace period spared {g['young_dry_run_spared']:.0f} young "
            f"unreferenced chunks; a second GC deleted {g['second_gc_deleted']:.0f}; verify "
            f"{'ok' if g['verify_ok'] else 'FAILED'} ({g['verify_chunks']:.0f} chunks, "
            f"{g['verify_bytes_read'] / 1e6:.1f} MB read, {g['verify_s']:.2f} s); "
            f"{g['restored_steps']:.0f} remaining steps restored bit-exact"]


def run(args) -> dict:
    """Part 1 for both systems and part 2, ``args.repeat`` times each."""
    size, dev = "tiny" if args.tiny else args.size, h.device(args.device)
    np_states = [h.train_state(size, device=dev)]
    for step in range(2, ASYNC_SAVES + 2):
        np_states.append(h.changed_state(np_states[-1], seed=step))
    proof_state, logical, copy_s = np_states.pop(), h.state_bytes(np_states[0]), []

    def limit() -> dict:  # and a plain copy of the state to new host memory
        state = h.to_jax([np_states[0]], dev, copy=True)[0]
        leaves = jax.tree.leaves(state)
        copy_s.append(h.seconds(lambda: [np.array(x, copy=True) for x in leaves])[0])
        delete_arrays(state)
        return h.limit.measure(logical, base_dir=args.dir)

    runs, _, lim = h.limit.interleaved(args, logical, SYSTEMS, lambda system, root: bench_async(
        system, root, np_states, proof_state, dev, args.drop_caches), limit)
    gc_runs = []
    for _ in range(args.repeat):
        with h.scratch(args.dir, "gc") as root:
            gc_runs.append(bench_gc(root, "tiny" if size == "tiny" else "gpt2", args.drop_caches))
    return {"size": size, "device": str(dev), "logical_bytes": logical, "repeat": args.repeat,
            "async_saves_per_run": ASYNC_SAVES, "host_copy_s": statistics.median(copy_s),
            "host_copy_runs_s": copy_s, "async_runs": runs, "limit": lim, "gc_runs": gc_runs,
            "async": {s: save_medians(rs) for s, rs in runs.items()}, "gc": h.medians(gc_runs),
            "limits": {"first_total_s": h.limit.save_s(
                lim, logical, runs["casstore"][0]["saves"][0]["written_bytes"])}}


def table(result: dict) -> list[str]:
    """Part 1 with casstore / orbax ratios and the limit, then part 2, then notes."""
    a, c, o = result["async"], result["async"]["casstore"], result["async"]["orbax"]
    donated = lambda r: h.yes(r["buffers_donated_in_place"]) + (  # noqa: E731
        "" if r["buffers_donated_in_place"] else " (jax copied instead)")
    return [*h.figure_table(a, ASYNC_FIGURES, list(SYSTEMS), "orbax", result["limits"]),
            *h.limit_lines(result["limit"]), "",
            f"- state: {result['logical_bytes'] / 1e6:.1f} MB ({result['size']}, on "
            f"{result['device']}); {c['saves_measured']} saves per system; every step and "
            f"the proof step restored bit-exact (casstore {c['verified_steps']}, orbax "
            f"{o['verified_steps']})",
            f"- proof step: the caller's buffers were donated and overwritten in place: "
            f"casstore {donated(c)}, orbax {donated(o)}",
            f"- a plain copy of the state to new host memory (np.array per leaf) took "
            f"{result['host_copy_s']:.3f} s (median)",
            *h.target_lines([("casstore's blocking time <= orbax's",
                              h.ratio(c["blocking_s"], o["blocking_s"]), 1.0)]), "",
            *gc_table(result["gc"])]


main = h.command(__doc__, run, table, "dir", "repeat", "tiny", "drop-caches", "device", "plot",
                 plot_of=("casstore", "orbax", "async"),
                 extra=(("--size", {"choices": ("gpt2", "gpt2-xl", "tiny"), "default": "gpt2"}),))

if __name__ == "__main__":
    main()
