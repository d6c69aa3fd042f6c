"""Buffers of chunks: reusing a save's encode buffers once their objects are stored
(docs/design-notes.md), and buffers mapped on their own, outside malloc's heap.

A fresh 16 MiB numpy buffer per chunk costs the kernel one page fault (and the zeroing of a
page) per 4 KiB the first time it is written: on the 2-core machine about as much CPU time as
the byte shuffle that fills it. A :class:`BufferPool` hands a save's stored buffers to its
later chunks instead. It lives as long as one save, so nothing is held after it.
"""

from __future__ import annotations

import collections
import math
import mmap
import threading

import numpy as np

MIN_POOLED_BYTES = 2**20  # smaller buffers come from malloc's heap, already mapped
ALIGN = 64  # bytes: jax's CPU client adopts buffers aligned so (jax.device_put with may_alias)
MMAP_BYTES = 1 << 20  # buffers of restored leaves from this size on may be mapped on their own
_local = threading.local()


class BufferPool:
    """Thread-safe free lists of uint8 buffers, by size.

    :meth:`take` gives a buffer of exactly ``nbytes`` (a freed one if there is one, else a new
    ``np.empty``); :meth:`give` takes back a buffer (or a memoryview of one) whose bytes
    nobody reads any more. Buffers under ``MIN_POOLED_BYTES`` are neither kept nor reused, and
    at most ``max_free`` are kept (the oldest goes first): a size nothing takes again (a
    delta's, where whole chunks are stored raw) cannot pile up.
    """

    def __init__(self, max_free: int = 16) -> None:
        self._free: dict[int, list[np.ndarray]] = collections.defaultdict(list)
        self._order: collections.deque[int] = collections.deque()  # sizes, oldest first
        self._lock = threading.Lock()
        self.max_free = max_free
        self.reused = 0  # buffers handed out again (for tests and profiles)

    def take(self, nbytes: int) -> np.ndarray:
        """A contiguous uint8 array of ``nbytes``, contents undefined."""
        if nbytes >= MIN_POOLED_BYTES:
            with self._lock:
                free = self._free.get(nbytes)
                if free:
                    self.reused += 1
                    self._order.remove(nbytes)
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
                self._order.append(base.nbytes)
                if len(self._order) > self.max_free:  # drop the oldest kept buffer
                    self._free[self._order.popleft()].pop(0)


def mapped(nbytes: int) -> np.ndarray:
    """A uint8 array of ``nbytes`` (zeroed, page-aligned) in an anonymous memory mapping of its
    own, with huge pages advised where Linux offers them; its memory goes back to the OS as
    soon as the array is freed.

    For the large buffers a thread keeps and replaces (a reader's object buffer, its decode
    scratch) and those freed as soon as their leaf is placed. From malloc, a freed buffer of up
    to 32 MiB stays in the arena of the thread that freed it (glibc's dynamic mmap threshold),
    and so does the room that later requests of other sizes cannot use: restoring a 2 GiB
    state of byte planes from 16 reader threads, malloc held 146 MB of freed memory at the
    peak with these buffers from malloc, 61 MB with them mapped (glibc's ``mallinfo2``).
    """
    mapping = mmap.mmap(-1, max(1, nbytes))
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: fewer page faults on first touch
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapping, np.uint8)[:nbytes]


def thread_scratch(nbytes: int) -> np.ndarray:
    """This thread's scratch buffer, ``nbytes`` long (a uint8 array; contents undefined), for
    bytes that live only inside one call of the codec: the zstd planes a chunk decodes into
    before they are interleaved, a frame decoded again to be checked. It is kept and reused
    from chunk to chunk, and :func:`mapped`: new malloc buffers for each chunk left freed
    memory in every thread's arena. The worker threads of a save or restore end with it, and
    their buffers with them."""
    buffer = getattr(_local, "scratch", None)
    if buffer is None or buffer.size < nbytes:
        buffer = _local.scratch = None  # the old one unmapped before the new one is mapped
        buffer = _local.scratch = mapped(nbytes)
    return buffer[:nbytes]


def empty_aligned(shape: list[int] | tuple[int, ...], dtype: np.dtype,
                  own_mapping: bool = False) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary
    (:data:`ALIGN`), so jax's CPU client can adopt it in place.

    With ``own_mapping``, from :data:`MMAP_BYTES` on, the array is :func:`mapped`, so it goes
    back to the OS as soon as it is freed: for buffers dropped once their leaf is on its
    devices. From malloc, a restore placing leaves on a GPU from 33 threads kept up to 32 MiB
    per thread: restoring GPT-2-XL's state onto an H100 took 2.97 GB of extra RSS, 1.85 GB
    with buffers returned at once (and 6% longer: each buffer's pages are faulted in anew).
    """
    n = math.prod(shape) * dtype.itemsize
    if own_mapping and n >= MMAP_BYTES:
        return mapped(n).view(dtype).reshape(shape)
    raw = np.empty(n + ALIGN, np.uint8)
    offset = -raw.ctypes.data % ALIGN
    return raw[offset:offset + n].view(dtype).reshape(shape)
