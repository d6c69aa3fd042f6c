"""casstore vs orbax-checkpoint: blocking time of an asynchronous save; casstore GC of 50 steps.

Part 1: steps 1..3 of ``harness.train_state`` saved asynchronously by both, then a proof step
whose buffers are donated while it saves, all restored bit-exact; part 2: gc_steps.py.
"""

import math
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gc_steps
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

    def one(system: str) -> dict:
        with h.scratch(args.dir, system) as root:
            return bench_async(system, root, np_states, proof_state, dev, args.drop_caches)

    runs, _, lim = h.limit.interleaved(args, logical, SYSTEMS, one, limit)
    gc_runs, gc = gc_steps.run_gc(args, "tiny" if size == "tiny" else "gpt2")
    return {"size": size, "device": str(dev), "logical_bytes": logical, "repeat": args.repeat,
            "async_saves_per_run": ASYNC_SAVES, "host_copy_s": statistics.median(copy_s),
            "host_copy_runs_s": copy_s, "async_runs": runs, "limit": lim, "gc_runs": gc_runs,
            "async": {s: save_medians(rs) for s, rs in runs.items()}, "gc": gc,
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
            *gc_steps.gc_table(result["gc"])]


main = h.command(__doc__, run, table, "dir", "repeat", "tiny", "drop-caches", "device", "plot",
                 plot_of=("casstore", "orbax", "async"),
                 extra=(("--size", {"choices": ("gpt2", "gpt2-xl", "tiny"), "default": "gpt2"}),))

if __name__ == "__main__":
    main()
