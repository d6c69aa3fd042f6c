"""How a benchmark times a phase, settles before it, interleaves systems and takes medians."""

import collections
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

SMOKE = False  # --tiny: a smoke run, whose figures are not read (report.command sets it)


def _write(path: str, text: str) -> bool:
    """Writes ``text`` into a /proc file; False where that is not permitted."""
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


class PeakRss:
    """``extra``: peak RSS minus the RSS on entry (bytes), sampled every 2 ms by a thread, with
    the kernel's VmHWM (reset on entry where permitted) for the peaks between samples."""

    def __enter__(self) -> "PeakRss":
        self.proc, self.hwm = psutil.Process(), _write("/proc/self/clear_refs", "5")
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        if self.hwm:
            with open("/proc/self/status") as f:
                hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
            self.peak = max(self.peak, hwm)
        self.extra = max(self.peak, self.proc.memory_info().rss) - self.base


def seconds(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(wall seconds, result) of ``fn()``."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def medians(runs: list[dict]) -> dict:
    """Per key of ``runs[0]``: the median over ``runs`` of a number, the medians of dicts of
    the same keys, else the last run's value."""
    def median(values: list) -> Any:
        if all(isinstance(v, dict) and v.keys() == values[0].keys() for v in values):
            return medians(values)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return statistics.median(values)
        return values[-1]

    return {key: median([r[key] for r in runs]) for key in runs[0]}


def rotated(items: tuple, r: int) -> tuple:
    """``items`` rotated by ``r``: the order of systems in repeat ``r``."""
    return items[r % len(items):] + items[:r % len(items)]


_drop_refused = False


def drop_caches() -> bool:
    """Drops the OS page cache; True if it did. It needs root: where refused, a note says so
    once on stderr, and the phases read with a warm cache."""
    global _drop_refused
    os.sync()
    if _write("/proc/sys/vm/drop_caches", "3\n"):
        return True
    if not _drop_refused:
        print("note: the page cache was not dropped (writing /proc/sys/vm/drop_caches needs "
              "root); phases read with a warm cache", file=sys.stderr)
    _drop_refused = True
    return False


def settle(warm_bytes: int = 0, drop: bool = False) -> bool:
    """Before a phase: collect garbage, give freed heap back, write back dirty pages, drop the
    page cache with ``drop``, touch and free ``warm_bytes`` of memory (README.md: why); returns
    whether the cache was dropped. A smoke run (``--tiny``) only drops the cache."""
    if SMOKE:
        return drop_caches() if drop else False
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    os.sync()
    dropped = drop_caches() if drop else False
    if warm_bytes:
        np.ones(warm_bytes, np.uint8)  # touched, then freed
    return dropped


def phase(out: dict, key: str, fn: Callable[[], Any], *, warm: int = 0, drop: bool = False,
          rss: str | None = None, probes: Iterable[Callable[[], dict]] = ()) -> Any:
    """``fn()`` after :func:`settle`; into ``out`` (``name`` = ``key`` less ``_s``): ``key`` wall
    and ``name_cpu_s`` CPU seconds, ``name_disk_read_bytes``, the peak extra RSS as ``rss``, the
    change ``name_K`` of each reading K of ``probes``; ``dropped_caches``: every drop done."""
    out["dropped_caches"] = settle(warm, drop) and out.get("dropped_caches", True)
    name, proc, probes = key.removesuffix("_s"), psutil.Process(), list(probes)
    before = [probe() for probe in probes]
    with PeakRss() if rss else contextlib.nullcontext() as meter:
        c0, io0 = proc.cpu_times(), proc.io_counters()
        out[key], result = seconds(fn)
        c1, io1 = proc.cpu_times(), proc.io_counters()
    out[f"{name}_cpu_s"] = (c1.user + c1.system) - (c0.user + c0.system)
    out[f"{name}_disk_read_bytes"] = io1.read_bytes - io0.read_bytes
    for probe, old in zip(probes, before):
        for k, v in probe().items():
            diff = v - old[k]
            out[f"{name}_{k}"] = dict(diff) if isinstance(v, collections.Counter) else diff
    if rss:
        out[rss] = meter.extra
    return result


def interleave(systems: tuple[str, ...], repeat: int, run_one: Callable[[str], dict],
               before: Callable[[], Any] | None = None) -> tuple[dict, dict, list]:
    """``run_one(system)`` for every system, ``repeat`` times in rotating order, ``before()``
    once per repeat; returns (runs per system, their :func:`medians`, ``before()``'s)."""
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    extra = []
    for r in range(repeat):
        for system in rotated(systems, r):
            load = os.getloadavg()[0]
            if before is not None and system == systems[0]:
                extra.append(before())
            runs[system].append({**run_one(system), "load_1m_at_start": load})
            settle()
    return runs, {s: medians(rs) for s, rs in runs.items()}, extra
