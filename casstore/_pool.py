"""Bounded concurrency for the chunk pipelines of save and restore, sized by the machine."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
from collections.abc import Callable, Iterable
from typing import Any


def default_workers(io_per_core: int, cap: int) -> int:
    """Worker threads for a pipeline: ``io_per_core`` per usable core, at most ``cap``.

    Hashing, compression and numpy copies release the GIL, so CPU-bound stages scale with the
    cores; requests to an object store wait on latency, so they take several threads per core.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(cap, io_per_core * (cores or 1)))


def bounded_map(fn: Callable[[Any], Any], items: Iterable, max_workers: int,
                window: int | None = None) -> list:
    """``[fn(x) for x in items]`` in a thread pool, with at most ``window`` items in flight.

    Items are pulled from ``items`` lazily, only when the window has room, so the memory they
    hold (a chunk or two each) stays bounded by the window, not by the number of items, and a
    generator's side effects (starting a device-to-host copy) run just ahead of the workers.
    The first exception cancels what is still pending and is re-raised once the running tasks
    have finished. ``fn`` may return a :class:`concurrent.futures.Future` (a second stage it
    started on another pool, such as an upload): the item then keeps its place in the window
    until that future is done, and its result is what is collected.

    Args:
      max_workers: threads.
      window: items submitted and not yet collected (default ``2 * max_workers``; at least 1).
    """
    window = max(1, window or 2 * max_workers)
    out: list = []
    pending: collections.deque[cf.Future] = collections.deque()
    with cf.ThreadPoolExecutor(max(1, min(max_workers, window))) as pool:
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= window:
                    out.append(_result(pending.popleft()))
            while pending:
                out.append(_result(pending.popleft()))
        except BaseException:
            for f in pending:
                f.cancel()
            raise
    return out


def _result(future: cf.Future) -> Any:
    """The future's result, or the result of the future it returned."""
    out = future.result()
    return out.result() if isinstance(out, cf.Future) else out
