"""casstore vs orbax-checkpoint: blocking time of an asynchronous save; casstore GC of 50 steps.

Part 1, asynchronous save. The GPT-2-small train state of ``harness.train_state`` (124M float32
parameters plus adam ``mu`` and ``nu`` and an int32 ``count``, about 1.49 GB of random values;
``--size gpt2-xl``: 18.7 GB made with ``jax.random`` on the device), as jax arrays on
``--device`` (default: jax's default device, a GPU when there is one; ``cpu``: the CPU device),
is saved to local disk several times (steps 1..3; from step 2 on the last 2 blocks, ``ln_f``
and ``count`` have new values) by

- casstore: ``CheckpointManager(dir, enable_async_checkpointing=True)``: ``mngr.save(step,
  state)`` is the blocking part (``mngr.last_save_blocking_s`` is recorded too), then
  ``mngr.wait_until_finished()``;
- orbax: ``ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())`` (``ocp.StandardCheckpointer``
  is a subclass of it in orbax 0.12): ``ckptr.save(path, args=ocp.args.StandardSave(state))``
  is the blocking part, then ``ckptr.wait_until_finished()``.

As soon as ``save`` returns, the caller's arrays are deleted (``jax.Array.delete``); the total is
the wall time from the ``save`` call until ``wait_until_finished`` returns. Medians over all saves
are reported, and the blocking time of step 1 (everything new) apart from the later steps'; the
peak extra host RSS from the ``save`` call until the save finished is sampled too. With
``--drop-caches`` the page cache is dropped before each save (needs root). Outside the timed
region every step is restored and compared bit for bit with the state it was made from; then one
more save (the proof step) is followed, while the save runs in the background, by a jitted update
that donates the caller's buffers and overwrites them (``x + 1``), and is then restored and
compared bit for bit too. These checks raise ``AssertionError`` on any difference.

Part 2, garbage collection (casstore only). A repository gets 50 steps of a state of 64 float32
matrices of 512 KiB plus 64 small biases (32 MiB); each step gives 16 matrices and their biases
new values (rotating, so every matrix changes every 4 steps). Steps 0..39 are deleted
(``casstore.delete``, manifests only), leaving the latest 10. A dry run with the default grace
period must spare every unreferenced chunk; then the chunk files' mtime is set 2 hours back
(``os.utime``) and ``casstore.gc(repo, grace_period_s=0, dry_run=True)`` and ``casstore.gc(repo,
grace_period_s=0)`` are timed. The chunks deleted must be exactly those referenced only by the
deleted steps (computed from the manifests beforehand), the bytes freed must match the files'
sizes, a second GC must find nothing, ``casstore.verify(repo)`` must be ok and all 10 remaining
steps must restore bit-exact.

Usage::

    python benchmarks/async_gc.py [--dir DIR] [--repeat N] [--tiny] [--size gpt2|gpt2-xl|tiny]
                                  [--device default|cpu] [--drop-caches] [--json PATH]
"""

from __future__ import annotations

import inspect
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np

import casstore

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h  # noqa: E402

SYSTEMS = ("casstore", "orbax")
ASYNC_SAVES = 3  # steps 1..3; the proof step is ASYNC_SAVES + 1
GC_STEPS, GC_KEEP = 50, 10
GC_SIZES = {  # matrices per step, float32 elements per matrix, bias elements, changed per step
    "gpt2": dict(matrices=64, elements=128 * 1024, bias=256, changed=16),
    "tiny": dict(matrices=8, elements=32 * 1024, bias=16, changed=2),
}
# How far back chunk mtimes are set: twice casstore.gc's default grace period.
AGE_S = 2 * inspect.signature(casstore.gc).parameters["grace_period_s"].default

# Per-system figures of part 1: (key, label, unit). "s" seconds, "MB" bytes in MB.
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
# Figures of part 2, each for the dry run and the real GC: (GcInfo attribute, label).
GC_FIGURES = [
    ("seconds", "seconds"),
    ("manifests", "manifests read"),
    ("chunks", "chunks listed"),
    ("referenced_chunks", "chunks referenced"),
    ("deleted_chunks", "chunks deleted (dry run: would be)"),
    ("deleted_bytes", "MB freed (dry run: would be)"),
]


# -- helpers -----------------------------------------------------------------------------------

def to_device(state: Any, dev: jax.Device) -> Any:
    """Fresh jax arrays on ``dev`` for every leaf (the caller's buffers, owned by jax)."""
    return h.to_jax([state], dev, copy=True)[0]


def delete_arrays(state: Any) -> None:
    """Frees every jax buffer of ``state``, as a training loop that moves on would."""
    for leaf in jax.tree.leaves(state):
        leaf.delete()


def _plus_one(state: Any) -> Any:
    return jax.tree.map(lambda x: x + 1, state)


# A training step's shape: it consumes the state's buffers and may write the result into them.
_plus_one_donated = jax.jit(_plus_one, donate_argnums=0)


# -- part 1: asynchronous save -----------------------------------------------------------------

class _Casstore:
    """casstore's CheckpointManager behind the interface the async benchmark drives."""

    def __init__(self, root: pathlib.Path):
        self.mngr = casstore.CheckpointManager(str(root / "repo"),
                                               enable_async_checkpointing=True)

    def save(self, step: int, state: Any) -> None:
        h.check(self.mngr.save(step, state), f"casstore did not save step {step}")

    def wait(self) -> None:
        self.mngr.wait_until_finished()

    def reported_blocking_s(self) -> float:
        return self.mngr.last_save_blocking_s

    def written_bytes(self, step: int) -> int:
        return self.mngr.last_save_info.written_bytes

    def restore(self, step: int, abstract: Any) -> Any:
        return self.mngr.restore(step, target=abstract)

    def close(self) -> None:
        self.mngr.close()


class _Orbax:
    """orbax's AsyncCheckpointer(StandardCheckpointHandler()), one directory per step."""

    def __init__(self, root: pathlib.Path):
        import orbax.checkpoint as ocp

        self.ocp, self.root = ocp, root
        self.ckptr = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())

    def save(self, step: int, state: Any) -> None:
        self.ckptr.save(self.root / str(step), args=self.ocp.args.StandardSave(state))

    def wait(self) -> None:
        self.ckptr.wait_until_finished()

    def reported_blocking_s(self) -> float:
        return float("nan")

    def written_bytes(self, step: int) -> int:
        return h.du(self.root / str(step))[1]  # orbax rewrites the whole state every step

    def restore(self, step: int, abstract: Any) -> Any:
        return self.ckptr.restore(self.root / str(step),
                                  args=self.ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        self.ckptr.close()


CHECKPOINTERS = {"casstore": _Casstore, "orbax": _Orbax}


def bench_async(system: str, root: pathlib.Path, np_states: list[Any], proof_state: Any,
                abstract: Any, dev: jax.Device, drop: bool) -> dict:
    """Times ``len(np_states)`` asynchronous saves of ``system`` of states put on ``dev``, then
    checks every step. With ``drop`` the page cache is dropped before each save.

    Returns the per-save figures (``saves``), their medians, the steps verified bit-exact and
    the proof step's outcome.
    """
    ckpt = CHECKPOINTERS[system](root)
    saves = []
    try:
        for step, np_state in enumerate(np_states, start=1):
            state = to_device(np_state, dev)
            h.settle(drop=drop)
            with h.PeakRss() as rss:
                t0 = time.perf_counter()
                ckpt.save(step, state)
                t1 = time.perf_counter()
                delete_arrays(state)  # the caller moves on: its buffers are gone
                del state
                t2 = time.perf_counter()
                ckpt.wait()
                t3 = time.perf_counter()
            saves.append({"step": step, "blocking_s": t1 - t0,
                          "reported_blocking_s": ckpt.reported_blocking_s(),
                          "wait_s": t3 - t2, "total_s": t3 - t0,
                          "written_bytes": ckpt.written_bytes(step),
                          "rss_extra_bytes": rss.extra})
        for step, np_state in enumerate(np_states, start=1):
            restored = jax.block_until_ready(ckpt.restore(step, abstract))
            h.verify_equal(np_state, h.flatten(restored), f"{system} step {step}", True)
            del restored
        proof = _proof_step(ckpt, len(np_states) + 1, proof_state, abstract, system, dev)
    finally:
        ckpt.close()
    out = _save_medians(saves)
    out["verified_steps"] = len(np_states)
    out["saves"], out["proof"] = saves, proof
    return out


def _save_medians(saves: list[dict]) -> dict:
    """Medians of the per-save figures over ``saves`` (in step order, runs concatenated), and
    the first save's total and blocking time apart from the later saves' blocking time."""
    out: dict[str, Any] = {key: statistics.median(s[key] for s in saves)
                           for key in saves[0] if key != "step"}
    first, later = ([s for s in saves if s["step"] == 1], [s for s in saves if s["step"] > 1])
    out["first_total_s"] = statistics.median(s["total_s"] for s in first)
    out["first_blocking_s"] = statistics.median(s["blocking_s"] for s in first)
    out["later_blocking_s"] = statistics.median(s["blocking_s"] for s in later or first)
    return out


def _proof_step(ckpt: Any, step: int, np_state: Any, abstract: Any, system: str,
                dev: jax.Device) -> dict:
    """Saves, overwrites the caller's buffers in place while the save runs, checks the restore.

    The update ``x + 1`` donates the saved arrays, so XLA writes the new values into their
    buffers whenever nothing else holds them. Raises AssertionError if the restored step is not
    bit-exact ``np_state``.
    """
    delete_arrays(_plus_one_donated(to_device(np_state, dev)))  # compile outside the proof
    state = to_device(np_state, dev)
    ckpt.save(step, state)
    updated = jax.block_until_ready(_plus_one_donated(state))
    donated = all(x.is_deleted() for x in jax.tree.leaves(state))
    if not donated:  # jax copied instead (the buffers were still referenced): free them now
        delete_arrays(state)
    del state
    zeros = jax.tree.map(lambda x: np.zeros(np.shape(x), x.dtype), np_state)
    garbage = to_device(zeros, dev)  # reuse any freed memory
    delete_arrays(updated)
    ckpt.wait()
    restored = jax.block_until_ready(ckpt.restore(step, abstract))
    h.verify_equal(np_state, h.flatten(restored), f"{system} proof step {step}", True)
    delete_arrays(garbage)
    return {"step": step, "verified": True, "buffers_donated_in_place": donated}


def host_copy_s(np_state: Any, dev: jax.Device) -> float:
    """Seconds to copy a fresh device state to new host memory (np.array(copy=True) per leaf).

    The floor for any snapshot that copies the caller's arrays, measured for comparison.
    """
    state = to_device(np_state, dev)
    h.settle()
    seconds, copies = h.seconds(lambda: [np.array(x, copy=True) for x in jax.tree.leaves(state)])
    delete_arrays(state)
    del copies
    return seconds


# -- part 2: garbage collection ----------------------------------------------------------------

def gc_states(size: str, steps: int = GC_STEPS, seed: int = 0) -> list[dict]:
    """``steps`` states; each gives ``changed`` matrices and their biases new random values.

    Unchanged leaves are the same numpy objects as in the previous state.
    """
    cfg = GC_SIZES[size]
    rng = np.random.default_rng(seed)

    def layer() -> dict:
        return {"w": rng.standard_normal(cfg["elements"], dtype=np.float32),
                "b": rng.standard_normal(cfg["bias"], dtype=np.float32)}

    layers = [layer() for _ in range(cfg["matrices"])]
    states = [{"layers": list(layers), "step": np.int64(0)}]
    for step in range(1, steps):
        start = (step - 1) * cfg["changed"]
        for i in range(start, start + cfg["changed"]):
            layers[i % cfg["matrices"]] = layer()
        states.append({"layers": list(layers), "step": np.int64(step)})
    return states


def bench_gc(root: pathlib.Path, size: str, drop: bool = False) -> dict:
    """Builds the 50-step repository, deletes 40 steps, times GC, then checks the repository.

    With ``drop`` the page cache is dropped before the timed GCs."""
    repo = root / "gc-repo"
    states = gc_states(size)
    build_s = 0.0
    for step, state in enumerate(states):
        seconds, _ = h.seconds(lambda: casstore.save(str(repo), step, state))  # noqa: B023
        build_s += seconds
    refs = {s: casstore.read_manifest(str(repo), s).chunk_ids() for s in range(len(states))}
    keep, doomed = list(refs)[-GC_KEEP:], list(refs)[:-GC_KEEP]
    live = set().union(*(refs[s] for s in keep))
    garbage = set().union(*(refs[s] for s in doomed)) - live
    chunk_dir = repo / "chunks"
    garbage_bytes = sum((chunk_dir / c[:2] / c[2:]).stat().st_size for c in garbage)
    chunks_before, bytes_before = h.du(chunk_dir)
    for step in doomed:
        casstore.delete(str(repo), step)

    young = casstore.gc(str(repo), dry_run=True)  # default grace period: nothing is old enough
    h.check(young.deleted_chunks == 0 and young.young_unreferenced_chunks == len(garbage), young)
    past = time.time() - AGE_S
    for path in chunk_dir.rglob("*"):
        if path.is_file():
            os.utime(path, (past, past))
    h.settle(drop=drop)
    load = os.getloadavg()
    dry = casstore.gc(str(repo), grace_period_s=0, dry_run=True)
    real = casstore.gc(str(repo), grace_period_s=0)
    for info in (dry, real):
        h.check((info.deleted_chunks, info.deleted_bytes) == (len(garbage), garbage_bytes), info)
        h.check(info.manifests == GC_KEEP and info.chunks == chunks_before, info)
        h.check(info.referenced_chunks == len(live) and info.missing_chunks == 0, info)
    chunks_after, bytes_after = h.du(chunk_dir)
    h.check((chunks_after, bytes_after) == (chunks_before - len(garbage),
                                          bytes_before - garbage_bytes),
          f"chunks/ holds {chunks_after} files, {bytes_after} bytes after GC")
    again = casstore.gc(str(repo), grace_period_s=0)
    h.check(again.deleted_chunks == 0, again)

    report = casstore.verify(str(repo))
    h.check(report.ok, [str(p) for p in report.problems])
    h.check(sorted(s for _, s in report.steps_checked) == keep, report.steps_checked)
    for step in keep:
        restored = casstore.restore(str(repo), step)
        h.verify_equal(states[step], h.flatten(restored), f"gc step {step}", False)
    return {"steps": len(states), "kept_steps": keep, "deleted_steps": len(doomed),
            "state_bytes": sum(np.asarray(x).nbytes for x in jax.tree.leaves(states[0])),
            "build_s": build_s, "chunks_before": chunks_before, "bytes_before": bytes_before,
            "chunks_after": chunks_after, "bytes_after": bytes_after,
            "young_dry_run_spared": young.young_unreferenced_chunks,
            "dry_run": _gc_dict(dry), "gc": _gc_dict(real),
            "second_gc_deleted": again.deleted_chunks,
            "verify_ok": report.ok, "verify_s": report.seconds,
            "verify_chunks": report.chunks_checked, "verify_bytes_read": report.bytes_read,
            "restored_steps": len(keep), "load_during_gc": load}


def _gc_dict(info: casstore.GcInfo) -> dict:
    return {key: getattr(info, key) for key in
            ("seconds", "manifests", "chunks", "referenced_chunks", "deleted_chunks",
             "deleted_bytes", "young_unreferenced_chunks", "missing_chunks")}


# -- running -----------------------------------------------------------------------------------

def run(size: str = "gpt2", base_dir: str | None = None, repeat: int = 1,
        device: str = "default", drop: bool = False) -> dict:
    """Runs part 1 for both systems and part 2, ``repeat`` times each; returns all figures.

    Part 1's states live on ``device`` (``"default"`` or ``"cpu"``, see ``harness.device``);
    part 2 saves numpy states (its ``gpt2`` size for every size but ``tiny``). With ``drop`` the
    page cache is dropped before each save and each GC.

    Raises:
      AssertionError: a restore was not bit-exact or GC did not do exactly what it should.
    """
    env, load_before = h.environment("orbax-checkpoint", "tensorstore"), os.getloadavg()
    dev = h.device(device)
    t0 = time.perf_counter()
    np_states = [h.train_state(size, device=dev)]
    for step in range(2, ASYNC_SAVES + 1):
        np_states.append(h.changed_state(np_states[-1], seed=step))
    proof_state = h.changed_state(np_states[-1], seed=ASYNC_SAVES + 1)
    jax.block_until_ready((np_states, proof_state))
    generate_s = time.perf_counter() - t0
    abstract = h.abstract_of(np_states[0], dev)
    logical_bytes = h.state_bytes(np_states[0])
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    copy_s = []
    for r in range(repeat):
        copy_s.append(host_copy_s(np_states[0], dev))
        for system in h.rotated(SYSTEMS, r):
            with h.scratch(base_dir, system) as root:
                load = os.getloadavg()
                figures = bench_async(system, root, np_states, proof_state, abstract, dev,
                                      drop)
            figures["load_before"] = load
            runs[system].append(figures)
            h.settle()
    async_results = {}
    for system, rs in runs.items():
        med = _save_medians([s for r in rs for s in r["saves"]])
        med["verified_steps"] = sum(r["verified_steps"] for r in rs)
        med["proof_verified"] = all(r["proof"]["verified"] for r in rs)
        med["buffers_donated_in_place"] = all(r["proof"]["buffers_donated_in_place"]
                                              for r in rs)
        med["saves_measured"] = sum(len(r["saves"]) for r in rs)
        async_results[system] = med
    del np_states, proof_state, abstract
    h.settle()
    gc_runs = []
    for _ in range(repeat):
        with h.scratch(base_dir, "gc") as root:
            gc_runs.append(bench_gc(root, "tiny" if size == "tiny" else "gpt2", drop))
        h.settle()
    gc_result = h.medians(gc_runs)
    for part in ("dry_run", "gc"):
        gc_result[part] = h.medians([g[part] for g in gc_runs])
    return {"size": size, "device": str(dev), "logical_bytes": logical_bytes,
            "async_saves_per_run": ASYNC_SAVES, "repeat": repeat, "generate_s": generate_s,
            "drop_caches_requested": drop,
            "load_before": load_before, "load_after": os.getloadavg(), "environment": env,
            "host_copy_s": statistics.median(copy_s), "host_copy_runs_s": copy_s,
            "async": async_results, "async_runs": runs, "gc": gc_result, "gc_runs": gc_runs}


# -- reporting ---------------------------------------------------------------------------------

def table(result: dict) -> str:
    """Part 1 as a markdown table (figure, casstore, orbax, ratio), then part 2, then notes."""
    a, g = result["async"], result["gc"]
    rows = []
    for key, label, unit in ASYNC_FIGURES:
        c, o = a["casstore"][key], a["orbax"][key]
        rows.append([f"{label} ({unit})", h.fmt(c, unit), h.fmt(o, unit),
                     h.fmt(h.ratio(c, o), "x")])
    lines = h.md_table(["figure", "casstore", "orbax", "casstore / orbax"], rows)
    ratio = h.ratio(a["casstore"]["blocking_s"], a["orbax"]["blocking_s"])
    lines += [
        "",
        f"- state: {result['logical_bytes'] / 1e6:.1f} MB ({result['size']}, on "
        f"{result['device']}); "
        f"{a['casstore']['saves_measured']} saves per system ({result['async_saves_per_run']} "
        f"per run x {result['repeat']}); every step and the proof step restored bit-exact "
        f"(casstore: {a['casstore']['verified_steps']} + proof "
        f"{'ok' if a['casstore']['proof_verified'] else 'FAILED'}; orbax: "
        f"{a['orbax']['verified_steps']} + proof "
        f"{'ok' if a['orbax']['proof_verified'] else 'FAILED'})",
        f"- proof step: the caller's buffers were donated and overwritten in place: casstore "
        f"{'yes' if a['casstore']['buffers_donated_in_place'] else 'no (jax copied instead)'}"
        ", orbax "
        f"{'yes' if a['orbax']['buffers_donated_in_place'] else 'no (jax copied instead)'}",
        f"- a plain copy of the state to new host memory (np.array(copy=True) per leaf) took "
        f"{result['host_copy_s']:.3f} s (median)",
        f"- target: casstore's blocking time <= orbax's: {ratio:.3g}x "
        f"({'met' if ratio <= 1 else 'NOT met'})",
        "",
        f"GC of a repository of {g['steps']} steps of {g['state_bytes'] / 1e6:.1f} MB "
        f"({g['deleted_steps']} deleted, {len(g['kept_steps'])} kept; built in "
        f"{g['build_s']:.1f} s):",
        "",
    ]
    units = {"seconds": "s", "deleted_bytes": "MB"}
    lines += h.md_table(["GC figure", "dry run", "gc"],
                        [[label, h.fmt(g["dry_run"][key], units.get(key, "n")),
                          h.fmt(g["gc"][key], units.get(key, "n"))]
                         for key, label in GC_FIGURES])
    env = result["environment"]
    lines += [
        "",
        f"- chunks: {g['chunks_before']:.0f} ({g['bytes_before'] / 1e6:.1f} MB) before GC, "
        f"{g['chunks_after']:.0f} ({g['bytes_after'] / 1e6:.1f} MB) after; a dry run with the "
        f"default grace period spared {g['young_dry_run_spared']:.0f} young unreferenced chunks; "
        f"a second GC deleted {g['second_gc_deleted']:.0f}",
        f"- after GC: verify {'ok' if g['verify_ok'] else 'FAILED'} ({g['verify_chunks']:.0f} "
        f"chunks, {g['verify_bytes_read'] / 1e6:.1f} MB read, {g['verify_s']:.2f} s); "
        f"{g['restored_steps']:.0f} remaining steps restored bit-exact",
        f"- {env['cpus']} cores, {env['memory_bytes'] / 2**30:.0f} GiB; load average "
        f"{'/'.join(f'{x:.2f}' for x in result['load_before'])} before, "
        f"{'/'.join(f'{x:.2f}' for x in result['load_after'])} after; {env['date']}; "
        f"orbax-checkpoint {env['versions'].get('orbax-checkpoint')}, "
        f"jax {env['versions'].get('jax')}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = h.parser(__doc__, "dir", "repeat", "tiny", "drop-caches", "device", "json",
                  repeat="runs of each part; medians over all saves and runs are shown",
                  tiny="tiny states (smoke test): 3 blocks of width 64, 50 GC steps of 1 MiB")
    ap.add_argument("--size", choices=("gpt2", "gpt2-xl", "tiny"), default="gpt2",
                    help="part 1's state: gpt2 (1.49 GB), gpt2-xl (18.7 GB, made on the "
                         "device) or tiny")
    args = h.parse(ap, argv)
    result = run("tiny" if args.tiny else args.size, args.dir, args.repeat, args.device,
                 args.drop_caches)
    return h.report(result, table(result), args.json)


if __name__ == "__main__":
    main()
