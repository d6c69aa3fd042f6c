"""Reusing a save's encode buffers once their objects are stored (docs/design-notes.md).

A fresh 16 MiB numpy buffer per chunk costs the kernel one page fault (and the zeroing of a
page) per 4 KiB the first time it is written: on the 2-core machine about as much CPU time as
the byte shuffle that fills it. A :class:`BufferPool` hands a save's stored buffers to its
later chunks instead. It lives as long as one save, so nothing is held after it.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

MIN_POOLED_BYTES = 2**20  # smaller buffers come from malloc's heap, already mapped


class BufferPool:
    """Thread-safe free lists of uint8 buffers, by size.

    :meth:`take` gives a buffer of exactly ``nbytes`` (a freed one if there is one, else a new
    ``np.empty``); :meth:`give` takes back a buffer (or a memoryview of one) whose bytes
    nobody reads any more. Buffers under ``MIN_POOLED_BYTES`` are neither kept nor reused.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = collections.defaultdict(list)
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again (for tests and profiles)

    def take(self, nbytes: int) -> np.ndarray:
        """A contiguous uint8 array of ``nbytes``, contents undefined."""
        if nbytes >= MIN_POOLED_BYTES:
            with self._lock:
                free = self._free.get(nbytes)
                if free:
                    self.reused += 1
                    return free.pop()
        return np.empty(nbytes, np.uint8)

    def give(self, data: object) -> None:
        """Takes back the buffer under ``data`` (a uint8 array or a memoryview of one) for
        reuse; anything else (bytes) is ignored. The caller must hold no other view of it."""
        base = data.obj if isinstance(data, memoryview) else data
        if (isinstance(base, np.ndarray) and base.dtype == np.uint8 and base.ndim == 1
                and base.flags.owndata and base.nbytes >= MIN_POOLED_BYTES):
            with self._lock:
                self._free[base.nbytes].append(base)
