"""Store wrappers for tests and benchmarks: instrumentation without flags (STYLE.md §3)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator

from ._base import ObjectInfo, Store


class CountingStore(Store):
    """Wraps a store and counts every operation and the bytes moved.

    ``counts[op]`` is the number of calls of ``get``, ``put``, ``put_if_absent``, ``exists``,
    ``stat``, ``delete``, ``list`` and ``server_side_copy`` (bulk calls count once per key; a
    server-side copy the inner store declined is not counted), ``bytes_read`` and
    ``bytes_written`` sum the object sizes (a server-side copy's as written), and
    ``keys_written`` / ``keys_read`` record the keys.

    Args:
      inner: the store to wrap; every call is passed on to it.
    """

    def __init__(self, inner: Store):
        self.inner = inner
        self.url = inner.url
        self.read_only = inner.read_only
        self.max_workers = inner.max_workers
        self.shuffle = inner.shuffle
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Sets every counter back to zero."""
        self.counts: collections.Counter[str] = collections.Counter()
        self.bytes_read = self.bytes_written = 0
        self.keys_read: list[str] = []
        self.keys_written: list[str] = []

    def _count(self, op: str, key: str | None = None, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.counts[op] += 1
            self.bytes_read += read
            self.bytes_written += written
            if key is not None and read:
                self.keys_read.append(key)
            if key is not None and op in ("put", "put_if_absent", "server_side_copy"):
                self.keys_written.append(key)

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        self._count("get", key, read=len(data))
        return data

    def head(self, key: str, nbytes: int) -> bytes:
        """The inner store's (counted as a ``get``)."""
        data = self.inner.head(key, nbytes)
        self._count("get", key, read=len(data))
        return data

    def exists(self, key: str) -> bool:
        self._count("exists")
        return self.inner.exists(key)

    def stat(self, key: str) -> ObjectInfo:
        self._count("stat")
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._count("list")
        return self.inner.list(prefix)

    def _put(self, key: str, data: bytes | memoryview, *, exclusive: bool) -> None:
        if exclusive:
            self.inner.put_if_absent(key, data)
        else:
            self.inner.put(key, data)
        self._count("put_if_absent" if exclusive else "put", key, written=len(data))

    def server_side_copy(self, src: Store, key: str, size: int | None = None) -> int | None:
        """The inner store's, with ``src`` unwrapped if it is a CountingStore too."""
        size = self.inner.server_side_copy(src.inner if isinstance(src, CountingStore) else src,
                                           key, size)
        if size is not None:
            self._count("server_side_copy", key, written=size)
        return size

    def _delete(self, key: str) -> None:
        self._count("delete")
        self.inner.delete(key)
