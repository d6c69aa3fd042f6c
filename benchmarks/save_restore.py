"""casstore vs orbax-checkpoint vs safetensors: save and restore a GPT-2-small train state.

The state is GPT-2-small-shaped: 124M float32 parameters (``wte``, ``wpe``, 12 blocks, ``ln_f``)
plus adam ``mu`` and ``nu`` of the same shapes and an int32 ``count``, about 1.49 GB of random
values made with numpy (no download). Every system saves it to local disk, durably, in the same
run:

- casstore: ``casstore.save`` (its LocalStore fsyncs every object and directory), then
  ``casstore.restore(target=...)`` with an abstract target of ``jax.ShapeDtypeStruct``;
- orbax: ``ocp.StandardCheckpointer().save`` timed through ``wait_until_finished`` (it fsyncs
  its files), then ``restore`` with the same abstract target;
- safetensors: ``safetensors.numpy.save_file`` of the flattened state plus ``os.fsync`` of the
  file and its directory, then ``load_file``.

casstore and orbax get jax arrays on the CPU device; safetensors gets the numpy arrays.

Figures, each as seconds or bytes and as a ratio to orbax's figure in the same run:

1. first save: time, bytes on disk after it;
2. a second save in which the embeddings and all blocks but the last 2 (params and their adam
   moments) are unchanged and the last 2 blocks, ``ln_f`` and ``count`` have new random values:
   time and bytes written (casstore: ``SaveInfo.written_bytes``; orbax and safetensors rewrite
   everything, so the size of the new checkpoint), also against the zstd (level 1) size of the
   changed leaves;
3. a save of the unchanged state (step 3 = step 2's tree): time and bytes written;
4. restore of step 3: time (after dropping the page cache with ``--drop-caches``), then checked
   bit-exact against the saved state outside the timed region (this raises if it fails);
5. peak extra RSS (peak minus the phase's starting RSS, sampled every 2 ms and cross-checked
   with the kernel's VmHWM) of the first save and of the restore.

Usage::

    python benchmarks/save_restore.py [--dir DIR] [--repeat N] [--drop-caches] [--tiny]
                                      [--systems casstore,orbax,safetensors] [--no-warm]
                                      [--json PATH]

Systems run one after another in one process, in a rotating order across repeats; before each
timed phase garbage is collected, dirty pages are written back and memory is warmed
(:func:`settle`); each system writes into its own fresh directory, deleted after it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import psutil
import zstandard

import casstore

SIZES = {
    "gpt2": dict(vocab=50257, ctx=1024, width=768, blocks=12),
    "tiny": dict(vocab=1000, ctx=64, width=64, blocks=3),
}
CHANGED_BLOCKS = 2  # the last blocks get new values in the second save
SYSTEMS = ("casstore", "orbax", "safetensors")

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


# -- the state ---------------------------------------------------------------------------------

def _gpt2_tree(make: Callable[[tuple[int, ...]], np.ndarray], vocab: int, ctx: int, width: int,
               blocks: int) -> dict:
    """GPT-2 parameter shapes (HF ``GPT2LMHeadModel`` naming); ``make(shape)`` fills leaves."""

    def ln() -> dict:
        return {"g": make((width,)), "b": make((width,))}

    def block() -> dict:
        return {"ln_1": ln(),
                "attn": {"c_attn": {"w": make((width, 3 * width)), "b": make((3 * width,))},
                         "c_proj": {"w": make((width, width)), "b": make((width,))}},
                "ln_2": ln(),
                "mlp": {"c_fc": {"w": make((width, 4 * width)), "b": make((4 * width,))},
                        "c_proj": {"w": make((4 * width, width)), "b": make((width,))}}}

    return {"wte": make((vocab, width)), "wpe": make((ctx, width)),
            "h": [block() for _ in range(blocks)], "ln_f": ln()}


def _filler(rng: np.random.Generator, kind: str) -> Callable[[tuple[int, ...]], np.ndarray]:
    """Random float32 leaves, generated in place: params and mu N(0, 0.02), nu |N(0, 1e-3)|."""

    def make(shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, np.float32)
        rng.standard_normal(dtype=np.float32, out=out)
        if kind == "nu":
            np.abs(out, out=out)
            out *= np.float32(1e-3)
        else:
            out *= np.float32(0.02)
        return out

    return make


def train_state(size: str, seed: int = 0) -> dict:
    """Params, adam mu and nu (random, like a state mid-training) and the step count."""
    rng = np.random.default_rng(seed)
    shape = SIZES[size]
    return {"params": _gpt2_tree(_filler(rng, "params"), **shape),
            "opt_state": {"count": np.int32(1000),
                          "mu": _gpt2_tree(_filler(rng, "mu"), **shape),
                          "nu": _gpt2_tree(_filler(rng, "nu"), **shape)}}


def changed_state(state: dict, seed: int = 1) -> dict:
    """``state`` with new random values in the last blocks and ln_f (params, mu, nu) and count + 1.

    Unchanged leaves are the same numpy objects as in ``state``; ``state`` is not modified.
    """
    rng = np.random.default_rng(seed)
    blocks = len(state["params"]["h"])
    changed = range(max(0, blocks - CHANGED_BLOCKS), blocks)

    def renew(tree: dict, kind: str) -> dict:
        make = _filler(rng, kind)
        fresh = lambda x: make(x.shape)  # noqa: E731
        out = dict(tree, h=list(tree["h"]), ln_f=jax.tree.map(fresh, tree["ln_f"]))
        for i in changed:
            out["h"][i] = jax.tree.map(fresh, tree["h"][i])
        return out

    opt = state["opt_state"]
    return {"params": renew(state["params"], "params"),
            "opt_state": {"count": np.int32(opt["count"] + 1), "mu": renew(opt["mu"], "mu"),
                          "nu": renew(opt["nu"], "nu")}}


def flat_name(path: tuple) -> str:
    """A key path as ``params/h/0/attn/c_attn/w`` (the safetensors tensor name)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def flatten(tree: Any) -> dict[str, Any]:
    return {flat_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def _same_bytes(a: Any, b: Any) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)))


def changed_zstd_bytes(old: dict, new: dict) -> tuple[int, int, int]:
    """(leaves that differ, their raw bytes, their zstd level-1 size) between two states."""
    level1 = zstandard.ZstdCompressor(level=1)
    old_flat, count, raw, packed = flatten(old), 0, 0, 0
    for name, b in flatten(new).items():
        if not _same_bytes(old_flat[name], b):
            data = np.ascontiguousarray(b).tobytes()
            count, raw, packed = count + 1, raw + len(data), packed + len(level1.compress(data))
    return count, raw, packed


def verify_equal(expected: dict, restored: dict[str, Any], system: str, want_jax: bool) -> int:
    """Raises AssertionError unless every leaf of ``restored`` (flat) matches bit for bit."""
    want = flatten(expected)
    if set(want) != set(restored):
        raise AssertionError(f"{system}: restored keys differ: "
                             f"{sorted(set(want) ^ set(restored))[:5]}")
    for name, e in want.items():
        got = restored[name]
        if want_jax and not isinstance(got, jax.Array):
            raise AssertionError(f"{system}: {name} restored as {type(got).__name__}")
        if not _same_bytes(e, got):
            raise AssertionError(f"{system}: {name} differs from the saved state")
    return len(want)


# -- measuring ---------------------------------------------------------------------------------

def _clear_hwm() -> bool:
    """Resets the kernel's peak-RSS counter (VmHWM) of this process; False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakRss:
    """Peak RSS of this process minus its RSS on entry, as ``extra`` (bytes).

    A thread samples RSS every ``interval_s``; where the kernel allows it, its VmHWM (reset on
    entry) catches peaks between samples.
    """

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s

    def __enter__(self) -> PeakRss:
        self.proc = psutil.Process()
        self.hwm_reset = _clear_hwm()
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        hwm = _hwm() if self.hwm_reset else None
        self.peak = max(self.peak, hwm or 0, self.proc.memory_info().rss)
        self.extra = self.peak - self.base


def timed(out: dict, key: str, fn: Callable[[], Any]) -> Any:
    """Runs ``fn``; sets ``out[key]`` to its wall time and ``out[key_cpu_s]`` to the CPU time
    (user + system, all threads) the process spent meanwhile. Returns ``fn``'s result."""
    proc = psutil.Process()
    c0, t0 = proc.cpu_times(), time.perf_counter()
    result = fn()
    t1, c1 = time.perf_counter(), proc.cpu_times()
    out[key] = t1 - t0
    out[key.removesuffix("_s") + "_cpu_s"] = (c1.user + c1.system) - (c0.user + c0.system)
    return result


def settle(warm_bytes: int = 0) -> None:
    """Before a phase: free garbage, give freed heap back, write back dirty pages, warm memory.

    ``warm_bytes`` of memory are touched and freed again (untimed), so the phase finds warm free
    pages for its buffers and the page cache. On this project's VMs memory left free for a
    few seconds is handed back to the host, and touching it again runs at ~0.5 GB/s: without
    warming, a 1.5 GB write took 4.2 s instead of 1.1 s, charged to whichever phase came first.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    os.sync()
    if warm_bytes:
        touched = np.ones(warm_bytes, np.uint8)
        del touched


def drop_caches() -> bool:
    """Drops the OS page cache so a restore reads from disk (needs root); True if it did."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def du(path: pathlib.Path) -> int:
    """Bytes of all files under ``path`` (or of the file)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fsync_path(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the three systems -------------------------------------------------------------------------
# Each takes a fresh directory, the two states (jax for casstore and orbax, numpy for
# safetensors) and the abstract target, runs the phases in order and returns {figure: value}
# plus "verified_leaves" and "dropped_caches".

def _restore_phase(out: dict, drop: bool, warm: int, restore: Callable[[], Any]) -> Any:
    settle()
    out["dropped_caches"] = drop_caches() if drop else False
    settle(warm)
    with PeakRss() as rss:
        restored = timed(out, "restore_s", restore)
    out["restore_rss_extra_bytes"] = rss.extra
    return restored


def bench_casstore(root: pathlib.Path, states: list[dict], abstract: Any, drop: bool,
                   warm: int) -> dict:
    repo, out = root / "repo", {}
    settle(warm)
    with PeakRss() as rss:
        info = timed(out, "first_save_s", lambda: casstore.save(str(repo), 1, states[0]))
    out["save_rss_extra_bytes"] = rss.extra
    out["first_save_disk_bytes"], out["first_save_written_bytes"] = du(repo), info.written_bytes
    settle(warm)
    info = timed(out, "changed_save_s", lambda: casstore.save(str(repo), 2, states[1]))
    out["changed_save_written_bytes"] = info.written_bytes
    out["changed_save_new_chunks"], out["changed_save_reused_chunks"] = (info.new_chunks,
                                                                         info.reused_chunks)
    settle(warm)
    info = timed(out, "unchanged_save_s", lambda: casstore.save(str(repo), 3, states[1]))
    out["unchanged_save_written_bytes"] = info.written_bytes
    out["unchanged_save_new_chunks"] = info.new_chunks
    out["repo_bytes"] = du(repo)
    restored = _restore_phase(out, drop, warm, lambda: jax.block_until_ready(
        casstore.restore(str(repo), 3, target=abstract)))
    out["verified_leaves"] = verify_equal(states[1], flatten(restored), "casstore", True)
    return out


def bench_orbax(root: pathlib.Path, states: list[dict], abstract: Any, drop: bool,
                warm: int) -> dict:
    import orbax.checkpoint as ocp

    out: dict[str, Any] = {}
    with ocp.StandardCheckpointer() as ckptr:
        def save(step: int, state: dict) -> None:
            ckptr.save(root / str(step), state)
            ckptr.wait_until_finished()

        settle(warm)
        with PeakRss() as rss:
            timed(out, "first_save_s", lambda: save(1, states[0]))
        out["save_rss_extra_bytes"] = rss.extra
        out["first_save_disk_bytes"] = du(root)
        settle(warm)
        timed(out, "changed_save_s", lambda: save(2, states[1]))
        out["changed_save_written_bytes"] = du(root / "2")
        settle(warm)
        timed(out, "unchanged_save_s", lambda: save(3, states[1]))
        out["unchanged_save_written_bytes"] = du(root / "3")
        out["repo_bytes"] = du(root)
        restored = _restore_phase(out, drop, warm, lambda: jax.block_until_ready(
            ckptr.restore(root / "3", abstract)))
    out["verified_leaves"] = verify_equal(states[1], flatten(restored), "orbax", True)
    return out


def bench_safetensors(root: pathlib.Path, states: list[dict], abstract: Any, drop: bool,
                      warm: int) -> dict:
    from safetensors.numpy import load_file, save_file

    out: dict[str, Any] = {}
    flat = [{k: np.asarray(v) for k, v in flatten(s).items()} for s in states]

    def save(step: int, tensors: dict) -> None:
        path = root / f"{step}.safetensors"
        save_file(tensors, str(path))
        fsync_path(path)
        fsync_path(root)

    settle(warm)
    with PeakRss() as rss:
        timed(out, "first_save_s", lambda: save(1, flat[0]))
    out["save_rss_extra_bytes"] = rss.extra
    out["first_save_disk_bytes"] = du(root)
    settle(warm)
    timed(out, "changed_save_s", lambda: save(2, flat[1]))
    out["changed_save_written_bytes"] = du(root / "2.safetensors")
    settle(warm)
    timed(out, "unchanged_save_s", lambda: save(3, flat[1]))
    out["unchanged_save_written_bytes"] = du(root / "3.safetensors")
    out["repo_bytes"] = du(root)
    restored = _restore_phase(out, drop, warm, lambda: load_file(str(root / "3.safetensors")))
    out["verified_leaves"] = verify_equal(states[1], restored, "safetensors", False)
    return out


BENCHES = {"casstore": bench_casstore, "orbax": bench_orbax, "safetensors": bench_safetensors}


def _to_jax(states: list[dict]) -> list[dict]:
    """The states as jax arrays on the CPU device; a leaf shared by both states is put once."""
    cache: dict[int, jax.Array] = {}
    device = jax.devices("cpu")[0]

    def put(x: np.ndarray) -> jax.Array:
        if id(x) not in cache:
            cache[id(x)] = jax.device_put(x, device)
        return cache[id(x)]

    return jax.block_until_ready([jax.tree.map(put, s) for s in states])


@contextlib.contextmanager
def _scratch(base_dir: str | None, system: str) -> Iterator[pathlib.Path]:
    if base_dir is not None:
        os.makedirs(base_dir, exist_ok=True)
    root = pathlib.Path(tempfile.mkdtemp(prefix=f"casstore-bench-{system}-", dir=base_dir))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _environment() -> dict:
    versions = {}
    for dist in ("casstore", "jax", "jaxlib", "numpy", "orbax-checkpoint", "safetensors",
                 "zstandard", "xxhash", "tensorstore"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    sha = None
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        src = pathlib.Path(casstore.__file__).parent
        sha = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=src, check=True,
                             capture_output=True, text=True).stdout.strip() or None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "memory_bytes": psutil.virtual_memory().total,
            "platform": platform.platform(), "python": platform.python_version(),
            "casstore_path": os.path.dirname(casstore.__file__), "casstore_git": sha,
            "versions": versions}


def run(size: str = "gpt2", base_dir: str | None = None, repeat: int = 1, drop: bool = False,
        systems: tuple[str, ...] = SYSTEMS, warm: bool = True) -> dict:
    """Runs every system ``repeat`` times (rotating their order); returns medians and all runs.

    Before each timed phase, 3x the state's size of memory is warmed (see :func:`settle`)
    unless ``warm`` is False.

    Raises:
      AssertionError: a restore was not bit-exact.
    """
    env = _environment()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    np_states = [train_state(size)]
    np_states.append(changed_state(np_states[0]))
    generate_s = time.perf_counter() - t0
    logical = sum(np.asarray(x).nbytes for x in jax.tree.leaves(np_states[0]))
    n_changed, changed_raw, changed_zstd = changed_zstd_bytes(*np_states)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        np.shape(x), np.asarray(x).dtype,
        sharding=jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])), np_states[1])
    warm_bytes = 3 * logical if warm else 0
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(repeat):
        for system in systems[r % len(systems):] + systems[:r % len(systems)]:
            states = np_states if system == "safetensors" else _to_jax(np_states)
            load_1m = os.getloadavg()[0]
            with _scratch(base_dir, system) as root:
                figures = BENCHES[system](root, states, abstract, drop, warm_bytes)
            figures["load_1m_at_start"] = load_1m
            figures["changed_save_vs_changed_zstd"] = (figures["changed_save_written_bytes"]
                                                       / changed_zstd)
            runs[system].append(figures)
            del states, figures
            settle()
    medians = {s: {k: statistics.median(run[k] for run in rs) for k in rs[0]}
               for s, rs in runs.items()}
    return {"size": size, "shape": SIZES[size], "changed_blocks": CHANGED_BLOCKS,
            "logical_bytes": logical, "leaves": len(jax.tree.leaves(np_states[0])),
            "changed_leaves": n_changed, "changed_raw_bytes": changed_raw,
            "changed_zstd_bytes": changed_zstd, "generate_s": generate_s, "repeat": repeat,
            "drop_caches_requested": drop, "warmed_bytes": warm_bytes,
            "dropped_caches": all(run["dropped_caches"] for rs in runs.values() for run in rs),
            "load_before": load_before, "load_after": os.getloadavg(), "environment": env,
            "results": medians, "runs": runs}


# -- reporting ---------------------------------------------------------------------------------

def _fmt(value: float, unit: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if unit == "s":
        return f"{value:.3f}"
    if unit == "x":
        return f"{value:.3f}" if value >= 0.01 else f"{value:.2e}"
    if value >= 1e6:
        return f"{value / 1e6:.1f} MB"
    return f"{value / 1e3:.1f} kB" if value >= 1e3 else f"{value:.0f} B"


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


TARGETS = [  # (description, casstore's figure from the medians, limit)
    ("changed save writes <= 1.1x the changed leaves' zstd-1 bytes",
     lambda res: res["casstore"]["changed_save_vs_changed_zstd"], 1.1),
    ("unchanged save takes <= 0.05x orbax's time",
     lambda res: _ratio(res["casstore"]["unchanged_save_s"], res["orbax"]["unchanged_save_s"]),
     0.05),
    ("unchanged save writes < 1 MB",
     lambda res: res["casstore"]["unchanged_save_written_bytes"] / 1e6, 1.0),
    ("first save takes <= 0.8x orbax's time",
     lambda res: _ratio(res["casstore"]["first_save_s"], res["orbax"]["first_save_s"]), 0.8),
    ("restore takes <= 0.8x orbax's time",
     lambda res: _ratio(res["casstore"]["restore_s"], res["orbax"]["restore_s"]), 0.8),
]


def table(result: dict) -> str:
    """The median figures as a markdown table with casstore / orbax ratios, then notes."""
    res = result["results"]
    cols = [s for s in SYSTEMS if s in res]
    lines = ["| figure | " + " | ".join(cols) + " | casstore / orbax |",
             "|---|" + "---:|" * (len(cols) + 1)]
    for key, label, unit in FIGURES:
        vals = [res[s].get(key, float("nan")) for s in cols]
        ratio = (_ratio(res["casstore"][key], res["orbax"][key])
                 if {"casstore", "orbax"} <= set(res) else float("nan"))
        lines.append(f"| {label}{f' ({unit})' if unit != 'B' else ''} | "
                     + " | ".join(_fmt(v, unit) for v in vals) + f" | {_fmt(ratio, 'x')} |")
    notes = [
        "",
        f"- state: {result['logical_bytes'] / 1e6:.1f} MB in {result['leaves']} leaves "
        f"({result['size']}); the second save changes {result['changed_leaves']} leaves, "
        f"{result['changed_raw_bytes'] / 1e6:.1f} MB raw, "
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
    if {"casstore", "orbax"} <= set(res):
        for text, figure, limit in TARGETS:
            value = figure(res)
            notes.append(f"- target: {text}: {value:.3g} "
                         f"({'met' if value <= limit else 'NOT met'})")
    env = result["environment"]
    notes.append(
        f"- median of {result['repeat']} run(s); restores verified bit-exact; page cache "
        f"dropped before each restore: {'yes' if result['dropped_caches'] else 'no'}; memory "
        f"warmed before each phase: {'yes' if result['warmed_bytes'] else 'no'}; "
        f"{env['cpus']} cores, {env['memory_bytes'] / 2**30:.0f} GiB; load average "
        f"{result['load_before'][0]:.2f} before, {result['load_after'][0]:.2f} after; "
        f"{env['date']}; casstore {env['casstore_git'] or env['versions'].get('casstore')}")
    return "\n".join(lines + notes)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None,
                    help="where to write (a fresh temp dir inside it; default: under /tmp)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per system; medians are shown")
    ap.add_argument("--tiny", action="store_true", help="a tiny state (3 blocks of width 64)")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the OS page cache before each restore (needs root)")
    ap.add_argument("--no-warm", action="store_true",
                    help="do not warm memory before each timed phase (see settle())")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated subset of " + ",".join(SYSTEMS))
    ap.add_argument("--json", default=None, help="also write all figures as JSON here")
    args = ap.parse_args(argv)
    systems = tuple(s for s in SYSTEMS if s in args.systems.split(","))
    if not systems or args.repeat < 1:
        ap.error("need at least one known system and --repeat >= 1")
    result = run("tiny" if args.tiny else "gpt2", args.dir, args.repeat, args.drop_caches,
                 systems, not args.no_warm)
    if args.drop_caches and not result["dropped_caches"]:
        print("warning: could not drop the page cache (not root?)", file=sys.stderr)
    print(table(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
