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
import os
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from ._codec import decode_chunk, max_object_bytes
from ._delta import decode_delta, read_again
from ._errors import (
    CorruptChunkError,
    ManifestError,
    ObjectNotFoundError,
    UnsupportedFormatError,
    not_here,
    unreadable,
    warn_read_again,
)
from ._layout import CONFIG_KEY, chunk_key, parse_manifest_key
from ._locks import save_lock_unless_gc
from ._manifest import ChunkRef, decode_manifest, needed_objects
from ._repository import Url, list_chunk_objects, parse_config
from .store import ObjectInfo, Store, open_store

log = logging.getLogger("casstore")
# The most bytes a FallbackStore with write_back holds, read from fallbacks and not yet checked:
# a restore's reads in flight (at most 16 chunk objects of up to 16 MiB on local disk) fit.
HELD_BYTES = 512 << 20


def _check(key: str, data: bytes, url: str) -> None:
    """Raises as a reader of ``url`` would if ``data`` is the config object or a manifest and
    not a valid one (ManifestError, naming ``url``; UnsupportedFormatError for a newer
    format); nothing for any other object (a chunk is checked by its reader)."""
    step = parse_manifest_key(key)
    if key == CONFIG_KEY:
        parse_config(data, url)
    elif step is not None:
        decode_manifest(data, run=step[0], step=step[1], url=url)


def _damaged(key: str, data: bytes, url: str) -> bool:
    """True if ``data`` is the config object or a manifest and not a valid one (one of a newer
    format is not damaged); False for any other object (a chunk is checked by its reader)."""
    try:
        _check(key, data, url)
    except UnsupportedFormatError:
        return False
    except ManifestError:
        return True
    return False


def _read(store: Store, key: str, nbytes: int | None) -> bytes:
    """``key``'s bytes in ``store``: the first ``nbytes`` (None: all of them)."""
    return store.get(key) if nbytes is None else store.head(key, nbytes)


class FallbackStore(Store):
    """A read view of ``primary`` that reads what ``primary`` lacks from ``fallbacks``.

    ``get`` and ``get_into`` try the primary, then each fallback in order, for a missing object,
    and ``get`` for a config object or a manifest that is damaged in the primary (one that fails
    validation: not one of a newer format) where a fallback's is not; :func:`reread_chunk` (which a
    restore calls for a chunk that fails its checks) reads the chunk from the other copies.
    ``list`` yields the union of every tier's keys (the primary's entry where several have one), so
    the latest step is the latest of all tiers. It is read-only
    (:class:`~casstore.ReadOnlyStoreError`): ``exists`` answers for every tier, so a save through
    it would skip the chunks only a fallback holds; save to the primary itself.

    Args:
      primary: a path, URL or Store: read first (and written to by ``write_back``).
      fallbacks: a URL or Store, or a list of them, tried in order.
      write_back: put what a restore read from a fallback into the primary too, once it is
        checked (best effort: a failed write is logged and the read still succeeds), so the
        next restore finds it there: a chunk or delta object after the restore decoded it and
        checked it against its chunk id (:func:`confirm_chunk`), a config object once it
        parses, and a manifest the primary lacks at the end of the restore, create-only and
        only if the primary then holds every object it needs (format.md §7's commit rule),
        under a save lock and not while a GC holds its lock there (format.md §8).
        Nothing a fallback holds damaged is written to the primary.

    Attributes:
      bytes_read: ``{url: bytes}``: stored bytes read from each tier (primary first), as
        objects were read through this view.
      objects_recovered: objects read from a fallback (missing or damaged in the primary).
    """

    def __init__(self, primary, fallbacks: Sequence | Url, *, write_back: bool = False):
        self.primary = open_store(primary)
        self.fallbacks = [open_store(f) for f in (  # one URL, or any iterable of them
            [fallbacks] if isinstance(fallbacks, str | os.PathLike | Store | bytes)
            or not hasattr(fallbacks, "__iter__") else fallbacks)]
        self.write_back = write_back
        self.url = self.primary.url
        self.read_only = True  # a view: see the class docstring
        self.read_only_reason = ("store is read-only: a FallbackStore is a read view of its "
                                 "tiers; save to its primary")
        self.max_workers = self.primary.max_workers
        self.shuffle = self.primary.shuffle
        self.bytes_read = {t.url: 0 for t in [self.primary, *self.fallbacks]}
        self.objects_recovered = 0
        self._lock = threading.Lock()
        self._held: dict[str, bytes] = {}  # read from a fallback, written back once checked

    @property
    def read_workers(self) -> int:
        """The primary's: a restore through the tiers reads mostly from it."""
        return self.primary.read_workers

    def read_threads(self, encoded: bool = False) -> int:
        """:attr:`read_workers`, encoded chunks or not: those a restore takes from another
        tier come over the network, where its readers wait."""
        return self.read_workers

    def _count(self, tier: Store, nbytes: int, recovered: bool = False) -> None:
        with self._lock:
            self.bytes_read[tier.url] += nbytes
            self.objects_recovered += recovered

    def get(self, key: str) -> bytes:
        return self.head(key, None)

    def head(self, key: str, nbytes: int | None) -> bytes:
        """As :meth:`get`, of each tier's first ``nbytes`` bytes (None: all of them).

        Raises:
          ManifestError: the config object or manifest ``key`` is damaged in the tier it
            was read from, a fallback (named), or in every tier that has it (all named);
            UnsupportedFormatError: of a newer format in the fallback it was read from.
        """
        try:
            data, failed = _read(self.primary, key, nbytes), None
        except OSError as e:  # fallbacks are read outside this handler: their errors keep theirs
            failed = e
        if failed is not None:
            data, i = self._from_fallback(key, nbytes=nbytes, failed=failed)
            self._checked(key, data, self.fallbacks[i].url)
            return data
        self._count(self.primary, len(data))
        if _damaged(key, data, self.primary.url):
            try:
                good, i = self._from_fallback(key, nbytes=nbytes)
            except FileNotFoundError:
                return data  # its reader's error names the primary, the one tier with it
            try:
                self._checked(key, good, self.fallbacks[i].url)
            except UnsupportedFormatError:
                raise  # a newer format there: not damage, named there
            except ManifestError as e:
                urls = ", ".join(t.url for t in [self.primary, self.fallbacks[i]])
                raise ManifestError(f"{e.message}; damaged in every tier that has it "
                                    f"({urls})", url=self.primary.url, run=e.run,
                                    step=e.step) from e
            log.warning("casstore: %s of %s is damaged; read another tier's",
                        "the config object" if key == CONFIG_KEY else f"manifest {key}",
                        self.primary.url)
            return good
        return data

    def _checked(self, key: str, data: bytes, url: str) -> None:
        """Checks the config object or a manifest read from the fallback at ``url`` as its
        reader would, naming ``url`` (:func:`_check`); a config object that parses is
        written back (``write_back``)."""
        try:
            _check(key, data, url)
        except BaseException:
            self.confirm(key, keep=False)
            raise
        if key == CONFIG_KEY:
            self.confirm(key)

    def from_fallbacks(self, key: str, skip: int = 0, nbytes: int | None = None,
                       failed: OSError | None = None) -> bytes:
        """``key``'s bytes (its first ``nbytes`` if given) from the first fallback (after the
        first ``skip``) that has it, the primary's read having ``failed``; a config object is
        written back at once if it parses (``write_back``).

        Raises:
          ObjectNotFoundError: no fallback has it (the primary's error, naming its URL).
          OSError: ``failed``, unless missing, where no fallback has it, or at once where it
            is no failure of the one object (a timeout: :func:`~casstore._errors.unreadable`).
        """
        data = self._from_fallback(key, skip, nbytes, failed)[0]
        if key == CONFIG_KEY and not _damaged(key, data, self.primary.url):
            self.confirm(key)
        return data

    def get_into(self, key: str, buffer: np.ndarray | None, max_bytes: int | None = None
                 ) -> tuple[memoryview, np.ndarray]:
        try:
            data, buffer = self.primary.get_into(key, buffer, max_bytes)
        except OSError as e:
            failed = e  # the fallbacks are read outside this handler (see head)
        else:
            self._count(self.primary, len(data))
            return data, buffer
        more = None if max_bytes is None else max_bytes + 1
        return memoryview(self.from_fallbacks(key, nbytes=more, failed=failed)), buffer

    def get_split(self, key: str, head: bytearray, body: memoryview | np.ndarray) -> bool:
        try:  # the primary's copy only: a missing or unreadable one is read from a
            if not self.primary.get_split(key, head, body):  # fallback by get_into
                return False
        except OSError as e:
            if not_here(e):
                return False
            raise
        self._count(self.primary, len(head) + memoryview(body).nbytes)
        return True

    def _from_fallback(self, key: str, skip: int = 0, nbytes: int | None = None,
                       failed: OSError | None = None) -> tuple[bytes, int]:
        """``(bytes, index of the fallback they came from)``; see :meth:`from_fallbacks`."""
        if failed is not None and not not_here(failed):
            raise failed
        if unreadable(failed):
            log.warning("casstore: %s in %s unreadable (%s: %s); reading another tier's copy",
                        key, self.primary.url, type(failed).__name__, failed)
        for i, tier in enumerate(self.fallbacks[skip:], skip):
            try:
                data = _read(tier, key, nbytes)
            except FileNotFoundError:
                continue
            self._count(tier, len(data), recovered=True)
            if self.write_back and not self.primary.read_only:
                self._hold(key, data)
            return data, i
        if unreadable(failed):
            raise failed
        urls = ", ".join(t.url for t in [self.primary, *self.fallbacks[skip:]])
        raise ObjectNotFoundError(f"no such object in any tier ({urls})",
                                  url=f"{self.primary.url}/{key}")

    def _hold(self, key: str, data: bytes) -> None:
        """Keeps ``data`` until it is confirmed; the oldest held objects beyond
        ``HELD_BYTES`` are forgotten (not written back: reads that no restore checks, such
        as a copy's, would otherwise pile up)."""
        with self._lock:
            self._held[key] = data
            total = sum(len(v) for v in self._held.values())
            while total > HELD_BYTES and len(self._held) > 1:
                total -= len(self._held.pop(next(iter(self._held))))

    def copies(self, key: str, nbytes: int | None = None) -> list[tuple[Store, bytes]]:
        """``(tier, bytes)`` of every tier's copy of ``key`` (its first ``nbytes`` if given),
        the primary's first; tiers without one, whose copy is unreadable (logged), or whose
        read failed its transfer checksum, are left out."""
        found = []
        for tier in [self.primary, *self.fallbacks]:
            try:
                data = _read(tier, key, nbytes)
            except (OSError, CorruptChunkError) as e:  # (a transfer checksum's: a ValueError)
                if not (isinstance(e, CorruptChunkError) or not_here(e)):
                    raise
                if unreadable(e):
                    log.warning("casstore: %s in %s unreadable: %s: %s", key, tier.url,
                                type(e).__name__, e)
                continue
            self._count(tier, len(data), recovered=tier is not self.primary)
            found.append((tier, data))
        return found

    def write_back_copy(self, key: str, tier: Store, data: bytes) -> None:
        """Writes ``data``, ``tier``'s copy of ``key`` that a restore checked, to the primary
        (``write_back``) unless it came from there."""
        if self.write_back and not self.primary.read_only and tier is not self.primary:
            self._write_back(key, data, exclusive=False)

    def confirm(self, key: str, *, keep: bool = True) -> None:
        """Writes ``key``'s bytes, read from a fallback and since checked, to the primary
        (``write_back``); with ``keep=False`` forgets them instead (they failed the check)."""
        with self._lock:
            data = self._held.pop(key, None)
        if data is not None and keep:
            self._write_back(key, data, exclusive=False)

    def finish(self) -> None:
        """The end of a restore: writes back each manifest the primary lacked (create-only)
        whose objects the primary now all holds, and forgets every other object held."""
        with self._lock:
            held, self._held = self._held, {}
        manifests = {k: (v, parse_manifest_key(k)) for k, v in held.items()
                     if parse_manifest_key(k)}
        if not manifests:
            return
        try:
            # Under a save lock, as a save commits (format.md §8): a GC that listed the
            # manifests before this one is written could delete the chunks it needs.
            with save_lock_unless_gc(self.primary) as locked:
                if not locked:
                    log.info("casstore: no step written back to %s: garbage collection runs "
                             "there", self.primary.url)
                    return
                present = {info.key for info in list_chunk_objects(self.primary)}
                for key, (data, (run, step)) in manifests.items():
                    with contextlib.suppress(ManifestError, UnsupportedFormatError):
                        manifest = decode_manifest(data, run=run, step=step, url=self.url)
                        if needed_objects(manifest).keys() <= present:
                            self._write_back(key, data, exclusive=True)
        except Exception as e:  # best effort: the restore itself succeeded
            log.warning("casstore: could not write steps back to %s: %s", self.primary.url, e)

    def _write_back(self, key: str, data: bytes, *, exclusive: bool) -> None:
        try:
            (self.primary.put_if_absent if exclusive else self.primary.put)(key, data)
        except FileExistsError:
            pass
        except Exception as e:  # best effort: the read itself succeeded
            log.warning("casstore: could not write %s back to %s: %s", key, self.primary.url, e)

    def exists(self, key: str) -> bool:
        return any(t.exists(key) for t in [self.primary, *self.fallbacks])

    def stat(self, key: str) -> ObjectInfo:
        try:
            return self.primary.stat(key)
        except OSError as e:
            if not not_here(e):
                raise
            failed = e  # the fallbacks are read outside this handler (see head)
        for tier in self.fallbacks:
            with contextlib.suppress(FileNotFoundError):
                return tier.stat(key)
        raise failed

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        seen: set[str] = set()
        for tier in [self.primary, *self.fallbacks]:
            for info in tier.list(prefix):
                if info.key not in seen:
                    seen.add(info.key)
                    yield info

    def _put(self, key: str, data: bytes | memoryview, *, exclusive: bool) -> None:
        raise NotImplementedError  # read-only: Store.put refuses first

    def _delete(self, key: str) -> None:
        raise NotImplementedError

    def summary(self) -> str:
        """One line: the bytes read from each tier, e.g. for a log."""
        return ", ".join(f"{n} bytes from {url}" for url, n in self.bytes_read.items())


def with_fallback(store: Store, fallback) -> Store:
    """``store`` itself for ``fallback=None``, else a :class:`FallbackStore` reading what
    ``store`` lacks from ``fallback`` (a URL, a Store, or a list of them, tried in order)."""
    return store if fallback is None else FallbackStore(store, fallback)


def reread_chunk(store: Store, key: str, ref: ChunkRef, out: np.ndarray | None,
                 missing: bool = False) -> memoryview | None:
    """A chunk that failed its checks (or was missing) as first read, read again and decoded:
    from ``store`` itself (:func:`~casstore._delta.read_again`: bytes damaged on their way);
    for tiers, from each tier's copy, the primary's first: a whole chunk from the first copy
    that passes them; a delta chunk from the first pair of copies of the delta object and of
    its base (from any tier: either of the two may be the damaged one) that passes them.
    None if nothing passes (at once for a ``missing`` object of a plain store). ``out`` as
    for :func:`decode_chunk`. The copies used are written back to the primary when the store
    says so (replacing the damaged ones)."""
    if not isinstance(store, FallbackStore):
        if missing:
            return None
        try:
            return read_again(store, key, ref.id, ref.base, ref.raw_bytes, out)
        except (CorruptChunkError, FileNotFoundError, UnsupportedFormatError):
            return None
    confirm_chunk(store, key, ref.base, ok=False)  # what the first read held failed its checks
    most = max_object_bytes(ref.raw_bytes) + 1  # a larger object is corrupt: not read whole
    if ref.base is None:
        pairs = [(c, None) for c in store.copies(key, most)]
    else:
        bases = store.copies(chunk_key(ref.base), most)
        pairs = [(c, b) for c in store.copies(key, most) for b in bases]
    failed: list[tuple[tuple, tuple | None, Exception]] = []
    for copy, base in pairs:
        try:
            if base is None:
                raw = decode_chunk(copy[1], ref.id, ref.raw_bytes, out)
            else:
                raw = decode_delta(copy[1], base[1], ref.id, ref.base, ref.raw_bytes, out)
        except (CorruptChunkError, UnsupportedFormatError) as e:
            failed.append((copy, base, e))
            continue
        _warn_unusable(key, ref, failed, good=(copy, base))
        if all(c is None or c[0] is store.primary for c in (copy, base)):
            warn_read_again(f"chunk object {key}", store.primary.url)  # the primary's, again
        store.write_back_copy(key, *copy)
        if base is not None:
            store.write_back_copy(chunk_key(ref.base), *base)
        return raw
    _warn_unusable(key, ref, failed, good=())
    return None


def _warn_unusable(key: str, ref: ChunkRef, failed: list, good: tuple) -> None:
    """Warns of the damaged copies among the ``failed`` pairs (copy, base copy or None,
    error): a copy that failed alone or beside one of the ``good`` pair's copies is damaged.
    A pair of two copies neither good nor known damaged (nothing else checked) is named
    whole, both tiers; a pair with a copy known damaged says nothing of the other."""
    good_ids = {id(c) for c in good if c is not None}
    bad: dict[int, str] = {}
    unclear = []
    for copy, base, e in failed:
        rest = [(k, c) for k, c in ((key, copy), (ref.base and chunk_key(ref.base), base))
                if c is not None and id(c) not in good_ids]
        if len(rest) == 1:
            bad.setdefault(id(rest[0][1]), f"the copy of {rest[0][0]} in {rest[0][1][0].url} "
                                           f"unusable: {e}")
        else:
            unclear.append((rest, e))
    for message in bad.values():
        log.warning("casstore: %s", message)
    for rest, e in unclear:
        if not any(id(c) in bad for _, c in rest):
            log.warning("casstore: the copies of %s unusable together: %s", " and ".join(
                f"{k} in {c[0].url}" for k, c in rest), e)


def confirm_chunk(store: Store, key: str, base: str | None, ok: bool = True) -> None:
    """A restore decoded chunk object ``key`` (a delta on ``base`` if given) and it matched its
    chunk id (``ok``), or it did not: a :class:`FallbackStore` with ``write_back`` writes the
    object (and the base) back to its primary if it read them from a fallback, or forgets
    them."""
    if isinstance(store, FallbackStore):
        store.confirm(key, keep=ok)
        if base is not None:
            store.confirm(chunk_key(base), keep=ok)


def log_tiers(store: Store, what: str) -> None:
    """The end of a restore through a tiered store: :meth:`FallbackStore.finish`, and a log
    line (INFO, logger ``casstore``) saying where its bytes came from."""
    if isinstance(store, FallbackStore):
        store.finish()
        log.info("casstore: %s: %s (%d objects from fallbacks)", what, store.summary(),
                 store.objects_recovered)
