"""Bounded concurrency for the chunk pipelines of save and restore."""

from __future__ import annotations

import collections
import concurrent.futures as cf
from collections.abc import Callable, Iterable
from typing import Any


def bounded_map(fn: Callable[[Any], Any], items: Iterable, max_workers: int) -> list:
    """``[fn(x) for x in items]`` in a thread pool, with at most ``2 * max_workers`` in flight.

    Items are submitted lazily, so the memory a task holds (a chunk or two) stays bounded by the
    window, not by the number of items. The first exception cancels what is still pending and is
    re-raised once the running tasks have finished.
    """
    out: list = []
    pending: collections.deque[cf.Future] = collections.deque()
    with cf.ThreadPoolExecutor(max_workers) as pool:
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 2 * max_workers:
                    out.append(pending.popleft().result())
            while pending:
                out.append(pending.popleft().result())
        except BaseException:
            for f in pending:
                f.cancel()
            raise
    return out
