"""An in-memory store: the reference implementation for tests (STYLE.md §3)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from .._errors import ObjectNotFoundError
from ._base import ObjectInfo, Store, check_key


class MemoryStore(Store):
    """A dict-backed store. It copies bytes on write, so it never aliases caller memory.

    Args:
      read_only: refuse writes.
    """

    def __init__(self, *, read_only: bool = False):
        self.url = f"memory:{id(self):x}"
        self.read_only = read_only
        self._objects: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        try:
            return self._objects[check_key(key)][0]
        except KeyError:
            raise ObjectNotFoundError("no such object", url=f"{self.url}/{key}") from None

    def exists(self, key: str) -> bool:
        return check_key(key) in self._objects

    def stat(self, key: str) -> ObjectInfo:
        try:
            data, mtime = self._objects[check_key(key)]
        except KeyError:
            raise ObjectNotFoundError("no such object", url=f"{self.url}/{key}") from None
        return ObjectInfo(key, len(data), mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._lock:
            items = sorted(self._objects.items())
        for key, (data, mtime) in items:
            if key.startswith(prefix):
                yield ObjectInfo(key, len(data), mtime)

    def _put(self, key: str, data: bytes | memoryview, *, exclusive: bool) -> None:
        copy = bytes(data)
        with self._lock:
            if exclusive and key in self._objects:
                raise FileExistsError(f"{self.url}/{key} exists")
            self._objects[key] = (copy, time.time())

    def _delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)
