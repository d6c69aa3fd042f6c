"""Reading a repository from the nearest copy of each object: a primary store and fallbacks.

A tiered restore (``docs/tiers.md``) reads every object from the primary store (the fast local
tier) and takes an object that is missing there, or whose chunk fails its checks there, from
the first fallback (the persistent tier) that has it intact; so too the repository's config
object (format.md §2.1) where the primary's is damaged. Chunk ids name raw bytes, so any
tier's copy of a chunk is as good as another's: the id check decides, not the tier.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from ._codec import decode_chunk
from ._delta import decode_delta
from ._errors import CorruptChunkError, ManifestError, ObjectNotFoundError, UnsupportedFormatError
from ._layout import CONFIG_KEY, chunk_key
from ._manifest import ChunkRef
from ._repository import parse_config
from .store import ObjectInfo, Store, open_store

log = logging.getLogger("casstore")


def _damaged_config(data: bytes, url: str) -> bool:
    """True if ``data`` is no valid config object (one of a newer format is not damaged)."""
    try:
        parse_config(data, url)
    except UnsupportedFormatError:
        return False
    except ManifestError:
        return True
    return False


class FallbackStore(Store):
    """A read view of ``primary`` that reads what ``primary`` lacks from ``fallbacks``.

    ``get`` and ``get_into`` try the primary, then each fallback in order, for a missing
    object, and ``get`` for a config object that is damaged in the primary (one that fails
    validation: not one of a newer format); :func:`reread_chunk` (which a restore calls for a
    chunk that fails its checks) reads the chunk from the fallbacks only. ``list`` yields the
    union of every tier's keys (the primary's entry where several have one), so the latest
    step is the latest of all tiers. Writes and deletes go to the primary.

    Args:
      primary: a path, URL or Store: read first, and written to.
      fallbacks: URLs or Stores, tried in order.
      write_back: put each object read from a fallback into the primary too (best effort: a
        failed write is logged and the read still succeeds), so the next restore finds it.

    Attributes:
      bytes_read: ``{url: bytes}``: stored bytes read from each tier (primary first), as
        objects were read through this view.
      objects_recovered: objects read from a fallback (missing or damaged in the primary).
    """

    def __init__(self, primary, fallbacks: Sequence, *, write_back: bool = False):
        self.primary = open_store(primary)
        self.fallbacks = [open_store(f) for f in fallbacks]
        self.write_back = write_back
        self.url = self.primary.url
        self.read_only = self.primary.read_only
        self.max_workers = self.primary.max_workers
        self.shuffle = self.primary.shuffle
        self.bytes_read = {t.url: 0 for t in [self.primary, *self.fallbacks]}
        self.objects_recovered = 0
        self._lock = threading.Lock()

    @property
    def read_workers(self) -> int:
        """The primary's: a restore through the tiers reads mostly from it."""
        return self.primary.read_workers

    def _count(self, tier: Store, nbytes: int, recovered: bool = False) -> None:
        with self._lock:
            self.bytes_read[tier.url] += nbytes
            self.objects_recovered += recovered

    def get(self, key: str) -> bytes:
        try:
            data = self.primary.get(key)
        except FileNotFoundError:
            return self.from_fallbacks(key)
        self._count(self.primary, len(data))
        if key == CONFIG_KEY and _damaged_config(data, self.primary.url):
            with contextlib.suppress(FileNotFoundError):
                good = self.from_fallbacks(key)
                log.warning("casstore: the config object of %s is damaged; read another tier's",
                            self.primary.url)
                return good
        return data

    def get_into(self, key: str, buffer: np.ndarray | None) -> tuple[memoryview, np.ndarray]:
        try:
            data, buffer = self.primary.get_into(key, buffer)
        except FileNotFoundError:
            return memoryview(self.from_fallbacks(key)), buffer
        self._count(self.primary, len(data))
        return data, buffer

    def get_split(self, key: str, head: bytearray, body: memoryview | np.ndarray) -> bool:
        try:  # the primary's copy only: a missing one is read from a fallback by get_into
            if not self.primary.get_split(key, head, body):
                return False
        except FileNotFoundError:
            return False
        self._count(self.primary, len(head) + memoryview(body).nbytes)
        return True

    def from_fallbacks(self, key: str, skip: int = 0) -> bytes:
        """``key``'s bytes from the first fallback (after the first ``skip``) that has it.

        Raises:
          ObjectNotFoundError: no fallback has it (the primary's error, naming its URL).
        """
        return self._from_fallback(key, skip)[0]

    def _from_fallback(self, key: str, skip: int = 0) -> tuple[bytes, int]:
        """``(bytes, index of the fallback they came from)``; see :meth:`from_fallbacks`."""
        for i, tier in enumerate(self.fallbacks[skip:], skip):
            try:
                data = tier.get(key)
            except FileNotFoundError:
                continue
            self._count(tier, len(data), recovered=True)
            self._write_back(key, data)
            return data, i
        urls = ", ".join(t.url for t in [self.primary, *self.fallbacks[skip:]])
        raise ObjectNotFoundError(f"no such object in any tier ({urls})",
                                  url=f"{self.primary.url}/{key}")

    def _write_back(self, key: str, data: bytes) -> None:
        if self.write_back and not self.primary.read_only:
            try:
                self.primary.put(key, data)
            except Exception as e:  # best effort: the read itself succeeded
                log.warning("casstore: could not write %s back to %s: %s", key, self.primary.url,
                            e)

    def exists(self, key: str) -> bool:
        return any(t.exists(key) for t in [self.primary, *self.fallbacks])

    def stat(self, key: str) -> ObjectInfo:
        try:
            return self.primary.stat(key)
        except FileNotFoundError:
            for tier in self.fallbacks:
                with contextlib.suppress(FileNotFoundError):
                    return tier.stat(key)
            raise

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        seen: set[str] = set()
        for tier in [self.primary, *self.fallbacks]:
            for info in tier.list(prefix):
                if info.key not in seen:
                    seen.add(info.key)
                    yield info

    def _put(self, key: str, data: bytes | memoryview, *, exclusive: bool) -> None:
        (self.primary.put_if_absent if exclusive else self.primary.put)(key, data)

    def _delete(self, key: str) -> None:
        self.primary.delete(key)

    def summary(self) -> str:
        """One line: the bytes read from each tier, e.g. for a log."""
        return ", ".join(f"{n} bytes from {url}" for url, n in self.bytes_read.items())


def with_fallback(store: Store, fallback) -> Store:
    """``store`` itself for ``fallback=None``, else a :class:`FallbackStore` reading what
    ``store`` lacks from ``fallback`` (a URL, a Store, or a list of them, tried in order)."""
    if fallback is None:
        return store
    fallbacks = list(fallback) if isinstance(fallback, (list, tuple)) else [fallback]
    return FallbackStore(store, fallbacks)


def reread_chunk(store: Store, key: str, ref: ChunkRef, out: np.ndarray | None
                 ) -> memoryview | None:
    """A chunk that failed its checks in the primary, read and decoded from the first fallback
    whose copy (and base, for a delta) passes them; None if ``store`` has no fallbacks or none
    has a good copy. ``out`` as for :func:`decode_chunk`. Written back to the primary when the
    store says so (replacing the damaged copy)."""
    if not isinstance(store, FallbackStore):
        return None
    i = 0
    while i < len(store.fallbacks):
        try:
            data, i = store._from_fallback(key, i)
            if ref.base is None:
                return decode_chunk(data, ref.id, ref.raw_bytes, out)
            base, _ = store._from_fallback(chunk_key(ref.base), i)
            return decode_delta(data, base, ref.id, ref.base, ref.raw_bytes, out)
        except (CorruptChunkError, FileNotFoundError) as e:
            log.warning("casstore: fallback copy of %s unusable: %s", key, e)
            i += 1
    return None


def log_tiers(store: Store, what: str) -> None:
    """Logs (INFO, logger ``casstore``) where a restore's bytes came from, for a tiered store."""
    if isinstance(store, FallbackStore):
        log.info("casstore: %s: %s (%d objects from fallbacks)", what, store.summary(),
                 store.objects_recovered)
