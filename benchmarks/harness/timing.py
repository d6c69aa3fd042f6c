"""How a benchmark times a phase: wall and CPU time, peak extra RSS, bytes read from disk,
page-cache dropping and memory warming before it, and systems interleaved across repeats with
medians of their figures."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import psutil


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


def seconds(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Runs ``fn`` and returns (wall seconds, its result)."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def timed(out: dict, key: str, fn: Callable[[], Any]) -> Any:
    """Runs ``fn``; sets ``out[key]`` to its wall time, ``out[key_cpu_s]`` to the CPU time
    (user + system, all threads) the process spent meanwhile and ``out[key_disk_read_bytes]``
    to the bytes it read from storage devices meanwhile (``/proc/self/io``'s ``read_bytes``:
    page-cache hits are not counted, so a warm phase that reads 0 was warm). Returns ``fn``'s
    result."""
    proc = psutil.Process()
    c0, io0 = proc.cpu_times(), proc.io_counters()
    out[key], result = seconds(fn)
    c1, io1 = proc.cpu_times(), proc.io_counters()
    name = key.removesuffix("_s")
    out[name + "_cpu_s"] = (c1.user + c1.system) - (c0.user + c0.system)
    out[name + "_disk_read_bytes"] = io1.read_bytes - io0.read_bytes
    return result


def medians(runs: list[dict]) -> dict:
    """Per key of ``runs[0]``: the median over ``runs`` of a number, else the last run's value."""
    def median(values: list) -> Any:
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return statistics.median(values)
        return values[-1]

    return {key: median([r[key] for r in runs]) for key in runs[0]}


def rotated(items: tuple, r: int) -> tuple:
    """``items`` rotated by ``r``: the order of systems in repeat ``r``."""
    return items[r % len(items):] + items[:r % len(items)]


_drop_refused = False


def drop_caches() -> bool:
    """Drops the OS page cache so the next phase reads from disk; True if it did.

    Needs root (writing ``/proc/sys/vm/drop_caches``). Where that is not permitted, says so
    once on stderr and returns False: the phases then run with a warm page cache.
    """
    global _drop_refused
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        if not _drop_refused:
            print(f"note: the page cache was not dropped ({e.strerror}: writing "
                  "/proc/sys/vm/drop_caches needs root); phases read with a warm cache",
                  file=sys.stderr)
        _drop_refused = True
        return False


def settle(warm_bytes: int = 0, drop: bool = False) -> bool:
    """Before a phase: free garbage, give freed heap back, write back dirty pages, optionally
    drop the page cache (:func:`drop_caches`), warm memory. Returns whether the cache was
    dropped.

    ``warm_bytes`` of memory are touched and freed again (untimed), so the phase finds warm free
    pages for its buffers and the page cache. On this project's VMs memory left free for a
    few seconds is handed back to the host, and touching it again runs at ~0.5 GB/s: without
    warming, a 1.5 GB write took 4.2 s instead of 1.1 s, charged to whichever phase came first.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    os.sync()
    dropped = drop_caches() if drop else False
    if warm_bytes:
        touched = np.ones(warm_bytes, np.uint8)
        del touched
    return dropped


def phase(out: dict, key: str, fn: Callable[[], Any], *, warm: int = 0, drop: bool = False,
          rss: str | None = None, probes: Iterable[Any] = ()) -> Any:
    """Times ``fn`` as figure ``key`` (see :func:`timed`) after :func:`settle` (warming
    ``warm`` bytes, dropping the page cache with ``drop``: ``out["dropped_caches"]`` stays True
    only while every drop was asked for and succeeded). With ``rss``, ``fn``'s peak extra RSS
    is figure ``rss``. Each probe's ``start()`` runs just before ``fn`` and ``stop(out,
    name)`` just after, ``name`` being ``key`` without ``_s`` (request counters, a server's CPU
    time). Returns ``fn``'s result."""
    dropped = settle(warm, drop)
    out["dropped_caches"] = out.get("dropped_caches", True) and dropped
    meter = PeakRss() if rss else contextlib.nullcontext()
    probes = list(probes)
    for probe in probes:
        probe.start()
    with meter:
        result = timed(out, key, fn)
    for probe in probes:
        probe.stop(out, key.removesuffix("_s"))
    if rss:
        out[rss] = meter.extra
    return result


def interleave(systems: tuple[str, ...], repeat: int,
               run_one: Callable[[str], dict]) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Runs ``run_one(system)`` for every system, ``repeat`` times in an order rotating across
    repeats (:func:`rotated`), settling after each; every run's figures get
    ``load_1m_at_start``. Returns (runs per system, their :func:`medians`)."""
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(repeat):
        for system in rotated(systems, r):
            load = os.getloadavg()[0]
            figures = run_one(system)
            figures["load_1m_at_start"] = load
            runs[system].append(figures)
            del figures
            settle()
    return runs, {s: medians(rs) for s, rs in runs.items()}
