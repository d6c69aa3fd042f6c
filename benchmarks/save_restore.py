"""casstore vs orbax-checkpoint vs safetensors: save and restore a GPT-2-small train state.

The state is GPT-2-small-shaped: 124M float32 parameters (``wte``, ``wpe``, 12 blocks, ``ln_f``)
plus adam ``mu`` and ``nu`` of the same shapes and an int32 ``count``, about 1.49 GB of random
values made with numpy (no download); ``--size gpt2-xl`` is GPT-2-XL-shaped (1.56B params,
18.7 GB in 1741 leaves), made with ``jax.random`` on the device (``harness.train_state``).
Every system saves it to local disk, durably, in the same run:

- casstore: ``casstore.save`` with its default codecs, byte planes (codec 4, format.md §3.2)
  wherever they save 1/8 (its LocalStore fsyncs every object and directory), then
  ``casstore.restore(target=...)`` with an abstract target of ``jax.ShapeDtypeStruct``;
- casstore-raw: the same with ``save(..., shuffle=False)``: barely compressible floats stored
  raw, local disk's default before 2026-11-23 (issue 15's item 2 asked whether codec 4 is
  cheap enough for local disk: compare the two);
- orbax: ``ocp.StandardCheckpointer().save`` timed through ``wait_until_finished`` (it fsyncs
  its files), then ``restore`` with the same abstract target;
- safetensors: ``safetensors.numpy.save_file`` of the flattened state plus ``os.fsync`` of the
  file and its directory, then ``load_file``.

casstore and orbax get jax arrays on ``--device`` (default: jax's default device, a GPU when
there is one; ``cpu``: the CPU device) and restore onto it; safetensors gets numpy arrays.

Figures, each as seconds or bytes and as a ratio to orbax's figure in the same run:

1. first save: time, bytes on disk after it;
2. a second save in which the embeddings and all blocks but the last 2 (params and their adam
   moments) are unchanged and the last 2 blocks, ``ln_f`` and ``count`` have new random values:
   time and bytes written (casstore: ``SaveInfo.written_bytes``; orbax and safetensors rewrite
   everything, so the size of the new checkpoint), also against the zstd (level 1) size of the
   changed leaves;
3. a save of the unchanged state (step 3 = step 2's tree): time and bytes written;
4. restore of step 3: time, then checked bit-exact against the saved state outside the timed
   region (this raises if it fails);
5. peak extra host RSS (peak minus the phase's starting RSS, sampled every 2 ms and
   cross-checked with the kernel's VmHWM) of the first save and of the restore.

With ``--drop-caches`` the page cache is dropped before each timed phase (needs root; without
it a note says so and the table records it).

Usage::

    python benchmarks/save_restore.py [--dir DIR] [--repeat N] [--drop-caches] [--tiny]
                                      [--size gpt2|gpt2-xl|small|tiny] [--device default|cpu]
                                      [--systems casstore,orbax,safetensors] [--no-warm]
                                      [--json PATH]

Systems run one after another in one process, in a rotating order across repeats; before each
timed phase garbage is collected, dirty pages are written back and memory is warmed
(``harness.settle``); each system writes into its own fresh directory, deleted after it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

import casstore

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h  # noqa: E402

SYSTEMS = ("casstore", "casstore-raw", "orbax", "safetensors")
MAX_WARM_BYTES = 8 << 30  # warm at most this much memory before a phase (gpt2-xl: 3x = 56 GB)

# Figures every system reports: (key, label, unit). Seconds are "s", sizes "B", multiples "x".
FIGURES = [
    ("first_save_s", "1. first save", "s"),
    ("first_save_cpu_s", "1. ... CPU time, user + system", "s"),
    ("first_save_disk_bytes", "1. first save: bytes on disk", "B"),
    ("changed_save_s", "2. save, last 2 blocks + ln_f + count changed", "s"),
    ("changed_save_written_bytes", "2. ... bytes written", "B"),
    ("changed_save_vs_changed_zstd", "2. ... written / changed leaves' zstd-1 bytes", "x"),
    ("unchanged_save_s", "3. save of the unchanged state", "s"),
    ("unchanged_save_written_bytes", "3. ... bytes written", "B"),
    ("restore_s", "4. restore", "s"),
    ("restore_cpu_s", "4. ... CPU time, user + system", "s"),
    ("repo_bytes", "bytes on disk after the 3 saves", "B"),
    ("save_rss_extra_bytes", "5. peak extra RSS, first save", "B"),
    ("restore_rss_extra_bytes", "5. peak extra RSS, restore", "B"),
]
FIGURE_KEYS = [key for key, _, _ in FIGURES]


# -- the three systems -------------------------------------------------------------------------
# Each takes a fresh directory, the two states (jax for casstore and orbax, numpy or jax for
# safetensors) and the abstract target, runs the phases in order and returns {figure: value}
# plus "verified_leaves" and "dropped_caches".

def _phase(out: dict, key: str, fn: Callable[[], Any], *, warm: int, drop: bool,
           rss: str | None = None) -> Any:
    """Times ``fn`` as figure ``key`` after ``harness.settle`` (dropping the page cache with
    ``drop``); with ``rss``, its peak extra RSS is figure ``rss``. Returns ``fn``'s result."""
    dropped = h.settle(warm, drop)
    out["dropped_caches"] = out.get("dropped_caches", True) and dropped
    meter = h.PeakRss() if rss else contextlib.nullcontext()
    with meter:
        result = h.timed(out, key, fn)
    if rss:
        out[rss] = meter.extra
    return result


def _rewriting_saves(out: dict, phase: Callable, save: Callable[[int, Any], None],
                     states: list, root: pathlib.Path,
                     step_path: Callable[[int], pathlib.Path]) -> None:
    """The three saves of a system that writes a whole new checkpoint (``step_path(step)``)
    per step: its size is the bytes written."""
    phase("first_save_s", lambda: save(1, states[0]), rss="save_rss_extra_bytes")
    out["first_save_disk_bytes"] = h.du(root)[1]
    for name, step in (("changed_save", 2), ("unchanged_save", 3)):
        phase(f"{name}_s", lambda s=step: save(s, states[1]))
        out[f"{name}_written_bytes"] = h.du(step_path(step))[1]
    out["repo_bytes"] = h.du(root)[1]


def bench_casstore(root: pathlib.Path, states: list[dict], abstract: Any, drop: bool,
                   warm: int, shuffle: bool | None = None) -> dict:
    repo, out = root / "repo", {}
    phase = functools.partial(_phase, out, warm=warm, drop=drop)
    save = functools.partial(casstore.save, shuffle=shuffle)
    info = phase("first_save_s", lambda: save(str(repo), 1, states[0]),
                 rss="save_rss_extra_bytes")
    out["first_save_disk_bytes"], out["first_save_written_bytes"] = (h.du(repo)[1],
                                                                     info.written_bytes)
    info = phase("changed_save_s", lambda: save(str(repo), 2, states[1]))
    out["changed_save_written_bytes"] = info.written_bytes
    out["changed_save_new_chunks"], out["changed_save_reused_chunks"] = (info.new_chunks,
                                                                         info.reused_chunks)
    info = phase("unchanged_save_s", lambda: save(str(repo), 3, states[1]))
    out["unchanged_save_written_bytes"] = info.written_bytes
    out["unchanged_save_new_chunks"] = info.new_chunks
    out["repo_bytes"] = h.du(repo)[1]
    restored = phase("restore_s", lambda: jax.block_until_ready(
        casstore.restore(str(repo), 3, target=abstract)), rss="restore_rss_extra_bytes")
    out["verified_leaves"] = h.verify_equal(states[1], h.flatten(restored),
                                            f"casstore shuffle={shuffle}", True)
    return out


def bench_orbax(root: pathlib.Path, states: list[dict], abstract: Any, drop: bool,
                warm: int) -> dict:
    import orbax.checkpoint as ocp

    out: dict[str, Any] = {}
    phase = functools.partial(_phase, out, warm=warm, drop=drop)
    with ocp.StandardCheckpointer() as ckptr:
        def save(step: int, state: dict) -> None:
            ckptr.save(root / str(step), state)
            ckptr.wait_until_finished()

        _rewriting_saves(out, phase, save, states, root, lambda step: root / str(step))
        restored = phase("restore_s", lambda: jax.block_until_ready(
            ckptr.restore(root / "3", abstract)), rss="restore_rss_extra_bytes")
    out["verified_leaves"] = h.verify_equal(states[1], h.flatten(restored), "orbax", True)
    return out


def bench_safetensors(root: pathlib.Path, states: list[dict], abstract: Any, drop: bool,
                      warm: int) -> dict:
    from safetensors.numpy import load_file, save_file

    out: dict[str, Any] = {}
    phase = functools.partial(_phase, out, warm=warm, drop=drop)
    flat = [{k: h.host_array(v) for k, v in h.flatten(s).items()} for s in states]

    def save(step: int, tensors: dict) -> None:
        path = root / f"{step}.safetensors"
        save_file(tensors, str(path))
        h.fsync_path(path)
        h.fsync_path(root)

    _rewriting_saves(out, phase, save, flat, root, lambda step: root / f"{step}.safetensors")
    restored = phase("restore_s", lambda: load_file(str(root / "3.safetensors")),
                     rss="restore_rss_extra_bytes")
    out["verified_leaves"] = h.verify_equal(states[1], restored, "safetensors", False)
    return out


BENCHES = {"casstore": bench_casstore,
           "casstore-raw": functools.partial(bench_casstore, shuffle=False),
           "orbax": bench_orbax, "safetensors": bench_safetensors}


def run(size: str = "gpt2", base_dir: str | None = None, repeat: int = 1, drop: bool = False,
        systems: tuple[str, ...] = SYSTEMS, warm: bool = True, device: str = "default") -> dict:
    """Runs every system ``repeat`` times (rotating their order); returns medians and all runs.

    The state lives on ``device`` (``"default"`` or ``"cpu"``, see ``harness.device``). Before
    each timed phase, 3x the state's size of memory (at most MAX_WARM_BYTES) is warmed (see
    ``harness.settle``) unless ``warm`` is False.

    Raises:
      AssertionError: a restore was not bit-exact.
    """
    env = h.environment("orbax-checkpoint", "safetensors", "zstandard", "xxhash", "tensorstore")
    dev = h.device(device)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    source = [h.train_state(size, device=dev)]
    source.append(h.changed_state(source[0]))
    jax.block_until_ready(source)
    generate_s = time.perf_counter() - t0
    logical = h.state_bytes(source[0])
    n_changed, changed_raw, changed_zstd = h.changed_zstd_bytes(*source)
    abstract = h.abstract_of(source[1], dev)
    warm_bytes = min(3 * logical, MAX_WARM_BYTES) if warm else 0
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(repeat):
        for system in h.rotated(systems, r):
            states = source if system == "safetensors" else h.to_jax(source, dev)
            load_1m = os.getloadavg()[0]
            with h.scratch(base_dir, system) as root:
                figures = BENCHES[system](root, states, abstract, drop, warm_bytes)
            figures["load_1m_at_start"] = load_1m
            figures["changed_save_vs_changed_zstd"] = (figures["changed_save_written_bytes"]
                                                       / changed_zstd)
            runs[system].append(figures)
            del states, figures
            h.settle()
    return {"size": size, "shape": h.SIZES[size], "changed_blocks": h.CHANGED_BLOCKS,
            "device": str(dev), "logical_bytes": logical,
            "leaves": len(jax.tree.leaves(source[0])), "changed_leaves": n_changed,
            "changed_raw_bytes": changed_raw, "changed_zstd_bytes": changed_zstd,
            "generate_s": generate_s, "repeat": repeat, "drop_caches_requested": drop,
            "warmed_bytes": warm_bytes,
            "dropped_caches": all(run["dropped_caches"] for rs in runs.values() for run in rs),
            "load_before": load_before, "load_after": os.getloadavg(), "environment": env,
            "results": {s: h.medians(rs) for s, rs in runs.items()}, "runs": runs}


# -- reporting ---------------------------------------------------------------------------------

TARGETS = [  # (description, casstore's figure from the medians, limit)
    ("changed save writes <= 1.1x the changed leaves' zstd-1 bytes",
     lambda res: res["casstore"]["changed_save_vs_changed_zstd"], 1.1),
    ("unchanged save takes <= 0.05x orbax's time",
     lambda res: h.ratio(res["casstore"]["unchanged_save_s"], res["orbax"]["unchanged_save_s"]),
     0.05),
    ("unchanged save writes < 1 MB",
     lambda res: res["casstore"]["unchanged_save_written_bytes"] / 1e6, 1.0),
    ("first save takes <= 0.8x orbax's time",
     lambda res: h.ratio(res["casstore"]["first_save_s"], res["orbax"]["first_save_s"]), 0.8),
    ("restore takes <= 0.8x orbax's time",
     lambda res: h.ratio(res["casstore"]["restore_s"], res["orbax"]["restore_s"]), 0.8),
]
PLANES_TARGETS = [  # issue 15, item 2: codec 4 cheap enough to be every store's default
    ("first save stores <= 0.9x orbax's bytes",
     lambda res: h.ratio(res["casstore"]["first_save_disk_bytes"],
                         res["orbax"]["first_save_disk_bytes"]), 0.9),
]


def table(result: dict) -> str:
    """The median figures as a markdown table with casstore / orbax ratios, then notes."""
    res = result["results"]
    cols = [s for s in SYSTEMS if s in res]
    ours = [s for s in cols if s.startswith("casstore")] if "orbax" in res else []
    rows = []
    for key, label, unit in FIGURES:
        vals = [res[s].get(key, float("nan")) for s in cols]
        ratios = [h.ratio(res[s][key], res["orbax"][key]) for s in ours]
        rows.append([f"{label}{f' ({unit})' if unit != 'B' else ''}",
                     *(h.fmt(v, unit) for v in vals), *(h.fmt(r, "x") for r in ratios)])
    lines = h.md_table(["figure", *cols, *(f"{s} / orbax" for s in ours)], rows)
    notes = [
        "",
        f"- state: {result['logical_bytes'] / 1e6:.1f} MB in {result['leaves']} leaves "
        f"({result['size']}, on {result['device']}); the second save changes "
        f"{result['changed_leaves']} leaves, {result['changed_raw_bytes'] / 1e6:.1f} MB raw, "
        f"{result['changed_zstd_bytes'] / 1e6:.1f} MB zstd level 1",
    ]
    if "casstore" in res:
        c = res["casstore"]
        notes.append(
            f"- casstore first save wrote {c['first_save_written_bytes'] / 1e6:.1f} MB "
            f"(written_bytes); changed save: {c['changed_save_new_chunks']:.0f} new chunks, "
            f"{c['changed_save_reused_chunks']:.0f} reused; unchanged save: "
            f"{c['unchanged_save_new_chunks']:.0f} new chunks; restore's peak extra RSS "
            f"less the restored state: "
            f"{(c['restore_rss_extra_bytes'] - result['logical_bytes']) / 1e6:.0f} MB")
    targets = TARGETS + PLANES_TARGETS if {"casstore", "orbax"} <= set(res) else []
    for text, figure, limit in targets:
        value = figure(res)
        notes.append(f"- target: {text}: {value:.3g} ({'met' if value <= limit else 'NOT met'})")
    notes.append(
        f"- median of {result['repeat']} run(s); restores verified bit-exact; page cache "
        f"dropped before each phase: {'yes' if result['dropped_caches'] else 'no'}; memory "
        f"warmed before each phase: {'yes' if result['warmed_bytes'] else 'no'}; "
        f"{h.machine_note(result)}")
    return "\n".join(lines + notes)


def main(argv: list[str] | None = None) -> dict:
    ap = h.parser(__doc__, "dir", "repeat", "tiny", "drop-caches", "no-warm", "device", "json",
                  tiny="same as --size tiny (3 blocks of width 64)")
    ap.add_argument("--size", choices=tuple(h.SIZES), default="gpt2",
                    help="gpt2 (1.49 GB), gpt2-xl (18.7 GB, made on the device), small "
                         "(0.27 GB) or tiny (2.6 MB)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated subset of " + ",".join(SYSTEMS))
    args = h.parse(ap, argv)
    systems = tuple(s for s in SYSTEMS if s in args.systems.split(","))
    if not systems:
        ap.error("need at least one known system")
    result = run("tiny" if args.tiny else args.size, args.dir, args.repeat, args.drop_caches,
                 systems, not args.no_warm, args.device)
    return h.report(result, table(result), args.json)


if __name__ == "__main__":
    main()
