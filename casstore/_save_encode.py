"""Save stage 3, encoding: a planned chunk's bytes -> its id and the object to store, if any.

Takes the raw bytes of each chunk job; gives ``(chunk id, stored bytes, base chunk id,
upload)``, where ``upload`` is the ``(key, encoded object)`` still to put, or None when the
repository has the chunk (format.md §8: known from the run's latest manifest, or one ``stat``)
or another job of the same save puts it. New chunks are encoded whole (format.md §3.1, §3.2)
or as a delta against the previous step's block (§3.5) within the step's
:class:`~casstore._delta.RestoreBudget`. :class:`ChunkWriter` is thread-safe: the upload
stage (:mod:`casstore._save_upload`) calls it from every worker.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

import numpy as np

from ._buffers import BufferPool
from ._codec import chunk_id, decode_chunk, encode_chunk, raw_object
from ._delta import RestoreBudget, encode_delta, read_object
from ._errors import (
    CasstoreError,
    CorruptChunkError,
    ManifestError,
    StepNotFoundError,
    unreadable,
)
from ._layout import chunk_key, delta_key
from ._manifest import Manifest
from ._repository import list_steps, read_manifest
from .store import Store, stored_size

# Of the blocks whose delta did not pay at the previous save (unpaid_blocks), one in this many
# tries again.
DELTA_RETRY = 4


def lost_chunks(store: Store, manifest: Manifest) -> set[str]:
    """Ids of the chunks ``manifest`` references whose object ``store`` no longer has, or has
    in another size than the manifest gives (cut short), or for a delta chunk whose base's
    chunk object (format.md §3.5) it no longer has: one ``stat`` per object. For a store with
    :attr:`~casstore.store.Store.cheap_stat` (local disk), where that costs microseconds: a
    save then writes such a chunk again instead of committing a step that references it
    (format.md §7 lets a writer reuse the latest step's chunks unchecked)."""
    sizes: dict[str, int | None] = {}

    def size(key: str) -> int | None:
        if key not in sizes:
            sizes[key] = stored_size(store, key)
        return sizes[key]

    return {r.id for leaf in manifest.leaves for r in leaf.chunks
            if size(r.key) != r.stored_bytes
            or (r.base is not None and size(chunk_key(r.base)) is None)}


class ChunkWriter:
    """Uploads chunks that the repository does not have yet; thread-safe.

    ``previous`` is the run's latest manifest (or None). Its chunks are stored (format.md §8),
    so they are reused without looking (on a store with cheap stats, local disk, each is
    checked first: :func:`lost_chunks`); with ``lookup``, any other id is looked up with one
    ``stat`` of its key and uploaded only if absent, else uploaded without looking (a
    repository without a committed step: a chunk there is one no manifest references, and
    rewriting it with the same bytes is harmless). A second block with the same id waits for
    the first one's lookup or encoding (its upload is awaited before the commit). With
    ``delta``, a new block whose previous step's block (same key path and bounds) is stored is
    written as a delta against that block's whole chunk if that pays (format.md §3.5),
    reading the base chunk from the store; for a
    block whose delta did not pay at the previous save (:func:`unpaid_blocks`, worked out at
    the first delta a save tries, so a save without changed blocks reads no other manifest)
    only one in ``DELTA_RETRY`` tries, by chunk id. Every chunk the step references is booked
    once in a :class:`RestoreBudget`, which a delta must fit. Without ``compress`` a chunk
    stored whole is stored raw (codec 0; :mod:`casstore._compression` chose it).
    """

    def __init__(self, store: Store, previous: Manifest | None, zstd_level: int, shuffle: bool,
                 delta: bool, lookup: bool = True, compress: bool = True, window: int = 16):
        lost = lost_chunks(store, previous) if previous and store.cheap_stat else set()
        self.lost = {chunk_key(cid) for cid in lost}  # written again, without a lookup
        refs = [(leaf.path, r) for leaf in previous.leaves for r in leaf.chunks
                if r.id not in lost] if previous else []
        self.store, self.zstd_level, self.shuffle, self.lookup = store, zstd_level, shuffle, lookup
        self.previous = previous
        self.compress = compress
        self.unpaid: frozenset | None = None
        self.unpaid_lock = threading.Lock()
        self.known: dict[str, tuple[int, str | None]] = {
            r.id: (r.stored_bytes, r.base) for _, r in refs}
        self.bases = {(path, r.start, r.stop): r for path, r in refs if delta and r.offset == 0}
        self.inflight: dict[str, cf.Future] = {}
        self.lock = threading.Lock()
        self.new = self.reused = self.written = self.deltas = self.delta_saved = 0
        self.budget = RestoreBudget()
        # encode buffers back from stored objects, where the store keeps no view of them; as
        # many free as chunk jobs may be in flight (``window``), so the pool stays within the
        # save's in-flight bytes whatever sizes its objects have
        self.buffers = BufferPool(max_free=window) if store.put_copies else None
        self.booked: set[str] = set()  # chunks of the step the budget has, each once

    def write(self, raw: memoryview | None, element_size: int,
              block: tuple[str, tuple, tuple] | None, cid: str | None = None
              ) -> tuple[str, int, str | None, tuple[str, bytes] | None]:
        """Encodes ``raw`` (elements of ``element_size`` bytes; the whole block ``(key path,
        start, stop)`` of one leaf, or None for a pack) if the repository lacks it; returns
        ``(chunk id, stored bytes, base chunk id or None, upload)``, where ``upload`` is the
        ``(key, object)`` the caller must put, or None if the chunk is stored or put by another
        block with the same id. ``cid``, if given, is ``raw``'s id, hashed already; ``raw``
        may then be None for a chunk of ``previous`` (staging did not copy it).

        Raises:
          CasstoreError: ``raw`` is None and ``previous`` does not reference ``cid`` (another
            process deleted the step the save was staged against).
        """
        cid = cid or chunk_id(raw)
        if raw is None:
            self._still_stored(cid)
        with self.lock:
            stored = self.known.get(cid)
            future = self.inflight.get(cid) if stored is None else None
            owner = stored is None and future is None
            if owner and raw is None:
                raise CasstoreError(
                    f"chunk {cid} was staged as stored by the run's previous step, which another "
                    "process deleted since (and collected the chunk); nothing was committed: "
                    "save again")
            if owner:
                future = self.inflight[cid] = cf.Future()
            else:
                self.reused += 1
            book = stored is not None and cid not in self.booked
            self.booked.add(cid)
        if book:
            (self.budget.add_delta if stored[1] else self.budget.add_whole)(stored[0])
        if stored is not None:
            return cid, *stored, None
        if not owner:
            return cid, *future.result(), None
        try:
            size, base, upload = self._encode_if_absent(cid, raw, element_size, block)
        except BaseException as e:
            future.set_exception(e)
            raise
        with self.lock:
            self.known[cid] = size, base
            self.new += upload is not None
            self.reused += upload is None
            self.written += size if upload is not None else 0
        future.set_result((size, base))
        return cid, size, base, upload

    def is_stored(self, cid: str) -> bool:
        """True if the repository is known to store chunk ``cid`` (``previous`` names it, or
        this save stored or found it)."""
        with self.lock:
            return cid in self.known

    def _encode_if_absent(self, cid: str, raw: memoryview, element_size: int,
                          block: tuple | None) -> tuple[int, str | None, tuple[str, bytes] | None]:
        """``(stored bytes, base, (key, object) to upload or None)``; a stored chunk is not
        re-encoded."""
        key = chunk_key(cid)
        if self.lookup and key not in self.lost and (size := stored_size(self.store, key)
                                                     ) is not None:
            self.budget.add_whole(size)
            return size, None, None
        previous = self.bases.get(block) if block is not None else None
        if (previous is not None and previous.raw_bytes == len(raw) and previous.id != cid
                and (int(cid[:8], 16) % DELTA_RETRY == 0 or block not in self._unpaid())):
            base = previous.base or previous.id
            encoded = self._delta(raw, element_size, base)
            if encoded is not None:
                with self.lock:
                    self.deltas += 1
                    self.delta_saved += encoded[1]
                return len(encoded[0]), base, (delta_key(cid, base), encoded[0])
        data = (encode_chunk(raw, level=self.zstd_level, element_size=element_size,
                             shuffle=self.shuffle, pool=self.buffers) if self.compress
                else raw_object(raw, self.buffers))
        self.budget.add_whole(len(data))
        return len(data), None, (key, data)

    def _still_stored(self, cid: str) -> None:
        """For a block staged as stored (no bytes kept) whose chunk ``previous`` no longer
        names (that step was deleted since it was read): looks the object up, and knows it
        stored if it is there. The caller's save lock keeps GC from deleting it after."""
        with self.lock:
            if cid in self.known or cid in self.inflight:
                return
        if (size := stored_size(self.store, chunk_key(cid))) is not None:
            with self.lock:
                self.known.setdefault(cid, (size, None))

    def stored(self, data: bytes | memoryview) -> None:
        """Called once an object :meth:`write` returned is stored: its buffer serves a later
        chunk (when the store copies on ``put``)."""
        if self.buffers is not None:
            self.buffers.give(data)

    def _unpaid(self) -> frozenset:
        """:func:`unpaid_blocks` of the previous manifest, read once."""
        with self.unpaid_lock:
            if self.unpaid is None:
                self.unpaid = unpaid_blocks(self.store, self.previous)
            return self.unpaid

    def _delta(self, raw: memoryview, element_size: int, base: str) -> tuple[bytes, int] | None:
        """:func:`encode_delta` against chunk ``base``, read from the store and checked against
        its id (a delta on a rotted base would be unreadable, and no copy of the repository
        could repair it); None if it does not pay, or if the base is missing or fails its
        checks (the block is then stored whole: a damaged earlier step must not stop new
        saves; ``verify`` reports it)."""
        k = element_size if len(raw) % element_size == 0 else 1
        try:
            data = read_object(self.store, chunk_key(base), len(raw))
            checked = np.frombuffer(decode_chunk(data, base, len(raw)), np.uint8)
            return encode_delta(raw, checked, k, self.zstd_level,
                                self.shuffle if self.compress else None, self.budget,
                                self.buffers)
        except (CorruptChunkError, FileNotFoundError):
            return None


def unpaid_blocks(store: Store, previous: Manifest) -> frozenset[tuple[str, tuple, tuple]]:
    """The blocks ``(key path, start, stop)`` whose delta did not pay at ``previous``'s save.

    Such a block is stored whole in ``previous`` and, with other bytes, whole in the run's step
    before it: the save of ``previous`` could take a delta against a chunk one step old and
    did not keep it (adam's moments, whose every bit moves each step, ../shared/CODECS.md).
    Trying again would read that base (a GET of its whole object on an object store) for
    nothing, so a save tries only one in ``DELTA_RETRY`` of these blocks, picked by the new
    chunk id, and a block whose bytes come to pay is found within a few saves. One listing of
    the run's steps and one manifest read; empty if there is no step before ``previous`` or
    its manifest fails validation.
    """
    earlier = [s for s in list_steps(store, run=previous.run) if s < previous.step]
    if not earlier:
        return frozenset()
    try:
        before = read_manifest(store, earlier[-1], run=previous.run)
    except (StepNotFoundError, ManifestError):
        return frozenset()
    whole = {(leaf.path, r.start, r.stop): r.id for leaf in before.leaves for r in leaf.chunks
             if r.offset == 0 and r.base is None}
    return frozenset((leaf.path, r.start, r.stop) for leaf in previous.leaves for r in leaf.chunks
                     if r.offset == 0 and r.base is None
                     and whole.get((leaf.path, r.start, r.stop), r.id) != r.id)


def previous_manifest(store: Store, run: str, step: int | None = None) -> Manifest | None:
    """The manifest whose chunks a save of ``run`` reuses and deltas against.

    ``step``'s if given and still there, else the run's latest. Its chunks are stored
    (format.md §7) and stay stored while the caller holds a save lock (§8), so a save may
    reuse them without looking. None for a run without steps, or a manifest that fails
    validation (every chunk is then looked up on its own, and stored whole).
    """
    for candidate in dict.fromkeys((step, None)):
        try:
            return read_manifest(store, candidate, run=run)
        except StepNotFoundError:
            continue
        except ManifestError:
            return None
        except OSError as e:  # unreadable (a bad block, a permission): as one that fails
            if not unreadable(e):
                raise
            return None
    return None
