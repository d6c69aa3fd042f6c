"""Saving a pytree as a content-addressed checkpoint (format.md §3, §4 and §7).

The write path is a stream. :func:`prepare` flattens and checks the tree; :func:`plan_jobs`
turns it into chunk jobs, yielded lazily: host views of numpy and CPU-device arrays, and for
accelerator shards a device-to-host copy of each block started only as the block enters the
pipeline. :func:`write` refuses an existing step, takes the save lock, learns which chunks exist
from the run's latest manifest (never from a listing of ``chunks/``, whose size grows with the
repository), hashes and compresses the new chunks on one pool of threads and uploads them on
another, with a bounded number of bytes in flight, and finally writes the manifest create-only.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import msgpack
import numpy as np

from ._chunking import (
    DEFAULT_CHUNK_SIZE_BYTES,
    DEFAULT_PACK_THRESHOLD_BYTES,
    INLINE_LIMIT_BYTES,
    block_bytes,
    dtype_name,
    grid,
    is_host_data,
    is_key_array,
    on_host,
    start_host_copy,
    unique_shards,
)
from ._codec import DEFAULT_ZSTD_LEVEL, chunk_id, encode_chunk
from ._delta import RestoreBudget, base_bytes, encode_delta
from ._errors import (
    CorruptChunkError,
    ManifestError,
    StepAlreadyExistsError,
    StepNotFoundError,
    StoreTimeoutError,
    UnsupportedLeafError,
)
from ._keypath import flatten
from ._layout import check_run, check_step, chunk_key, delta_key, manifest_key
from ._locks import save_lock
from ._manifest import ChunkRef, LeafEntry, Manifest, decode_manifest, encode_manifest
from ._multihost import SaveAgreement
from ._pool import bounded_map
from ._repository import Url, ensure_config, list_runs, list_steps, read_manifest
from ._stored_dtype import stored_as
from .store import Store, open_store

MAX_METADATA_BYTES = 2**20
# Of the blocks whose delta did not pay at the previous save (unpaid_blocks), one in this many
# tries again.
DELTA_RETRY = 4


@dataclasses.dataclass(frozen=True, slots=True)
class SaveInfo:
    """What one :func:`save` did.

    Attributes:
      step, run: the checkpoint written.
      logical_bytes: raw bytes of all array leaves, in their stored dtypes.
      written_bytes: bytes actually uploaded: new chunk objects plus the manifest.
      new_chunks: chunks uploaded by this save.
      reused_chunks: chunk refs satisfied by chunks already stored (or uploaded earlier in the
        same save).
      manifest_bytes: size of the manifest object.
      seconds: wall time of the save.
      delta_chunks: new chunks stored as deltas against the run's previous step (format.md
        §3.5).
      delta_saved_bytes: bytes those deltas saved against storing the same chunks whole:
        their whole size estimated on the samples the codec choice is made on, minus the
        deltas' encoded size.
    """

    step: int
    run: str
    logical_bytes: int
    written_bytes: int
    new_chunks: int
    reused_chunks: int
    manifest_bytes: int
    seconds: float
    delta_chunks: int = 0
    delta_saved_bytes: int = 0

    @property
    def dedup_ratio(self) -> float:
        """``logical_bytes / written_bytes``: how many times smaller the save was than the state."""
        return self.logical_bytes / max(self.written_bytes, 1)


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayInfo:
    """What the manifest records of an array leaf; the array itself is not kept.

    Attributes:
      shape, dtype: of the stored array (the key data, for typed PRNG keys).
      key_impl: the PRNG implementation name for typed key arrays, else None.
      sharding: the NamedSharding as ``{"mesh": {axis: size}, "spec": [...]}``, or None.
      is_jax: whether the leaf was a jax.Array.
      spread: whether other processes hold some of its shards (multi-process saves).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    key_impl: str | None
    sharding: dict | None
    is_jax: bool
    spread: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
    """A checked pytree: its structure, scalar entries and array descriptions, by leaf index."""

    node: dict
    paths: list[str]
    scalars: dict[int, LeafEntry]
    arrays: dict[int, ArrayInfo]
    metadata: Any

    @property
    def logical_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


@dataclasses.dataclass(slots=True)
class Job:
    """One chunk to store.

    Attributes:
      read: returns the chunk's raw bytes (waiting for a device-to-host copy if one runs).
      blocks: ``(leaf index, start, stop, byte offset)`` of every block the chunk holds.
      element_size: bytes per element (1 for a pack of mixed dtypes).
      nbytes: raw length, bytes.
      caller_memory: ``read`` views memory the caller may overwrite (a numpy leaf's buffer).
      holds_copy: ``read`` reads a copy made for this job (a pack, a device-to-host copy).
      release: called once the chunk is stored or has failed (frees a staging budget).
    """

    read: Callable[[], memoryview]
    blocks: list[tuple[int, tuple[int, ...], tuple[int, ...], int]]
    element_size: int
    nbytes: int
    caller_memory: bool = False
    holds_copy: bool = False
    release: Callable[[], None] | None = None


class _ChunkWriter:
    """Uploads chunks that the repository does not have yet; thread-safe.

    ``previous`` is the run's latest manifest (or None). Its chunks are stored (format.md §8),
    so they are reused without looking; with ``lookup``, any other id is looked up with one
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
    once in a :class:`RestoreBudget`, which a delta must fit.
    """

    def __init__(self, store: Store, previous: Manifest | None, zstd_level: int, shuffle: bool,
                 delta: bool, lookup: bool = True):
        refs = [(leaf.path, r) for leaf in previous.leaves for r in leaf.chunks] if previous else []
        self.store, self.zstd_level, self.shuffle, self.lookup = store, zstd_level, shuffle, lookup
        self.previous = previous
        self.unpaid: frozenset | None = None
        self.unpaid_lock = threading.Lock()
        self.known: dict[str, tuple[int, str | None]] = {
            r.id: (r.stored_bytes, r.base) for _, r in refs}
        self.bases = {(path, r.start, r.stop): r for path, r in refs if delta and r.offset == 0}
        self.inflight: dict[str, cf.Future] = {}
        self.lock = threading.Lock()
        self.new = self.reused = self.written = self.deltas = self.delta_saved = 0
        self.budget = RestoreBudget()
        self.booked: set[str] = set()  # chunks of the step the budget has, each once

    def write(self, raw: memoryview, element_size: int, block: tuple[str, tuple, tuple] | None
              ) -> tuple[str, int, str | None, tuple[str, bytes] | None]:
        """Encodes ``raw`` (elements of ``element_size`` bytes; the whole block ``(key path,
        start, stop)`` of one leaf, or None for a pack) if the repository lacks it; returns
        ``(chunk id, stored bytes, base chunk id or None, upload)``, where ``upload`` is the
        ``(key, object)`` the caller must put, or None if the chunk is stored or put by another
        block with the same id."""
        cid = chunk_id(raw)
        with self.lock:
            stored = self.known.get(cid)
            future = self.inflight.get(cid) if stored is None else None
            owner = stored is None and future is None
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

    def _encode_if_absent(self, cid: str, raw: memoryview, element_size: int,
                          block: tuple | None) -> tuple[int, str | None, tuple[str, bytes] | None]:
        """``(stored bytes, base, (key, object) to upload or None)``; a stored chunk is not
        re-encoded."""
        key = chunk_key(cid)
        if self.lookup:
            try:
                size = self.store.stat(key).size
                self.budget.add_whole(size)
                return size, None, None
            except FileNotFoundError:
                pass
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
        data = encode_chunk(raw, level=self.zstd_level, element_size=element_size,
                            shuffle=self.shuffle)
        self.budget.add_whole(len(data))
        return len(data), None, (key, data)

    def _unpaid(self) -> frozenset:
        """:func:`unpaid_blocks` of the previous manifest, read once."""
        with self.unpaid_lock:
            if self.unpaid is None:
                self.unpaid = unpaid_blocks(self.store, self.previous)
            return self.unpaid

    def _delta(self, raw: memoryview, element_size: int, base: str) -> tuple[bytes, int] | None:
        """:func:`encode_delta` against chunk ``base``, read from the store; None if it does
        not pay, or if the base is missing or fails its checks (the block is then stored whole:
        a damaged earlier step must not stop new saves; ``verify`` reports it)."""
        k = element_size if len(raw) % element_size == 0 else 1
        try:
            data = self.store.get(chunk_key(base))
            return encode_delta(raw, base_bytes(data, base, len(raw), k), k, self.zstd_level,
                                self.shuffle, self.budget)
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
    return None


def _sharding_info(x: Any) -> dict | None:
    """The NamedSharding of a jax.Array as ``{"mesh": {axis: size}, "spec": [...]}``."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
    return {"mesh": {str(k): int(v) for k, v in sharding.mesh.shape.items()}, "spec": spec}


def _scalar_entry(path: str, value: Any) -> LeafEntry:
    """A Python scalar stored inline (format.md §4.3); bool is checked before int."""
    kind = next(t for t in (bool, int, float, complex, str, bytes) if isinstance(value, t))
    if kind is int and not -2**63 <= value < 2**63:
        raise UnsupportedLeafError("int does not fit in 64 bits", key_path=path)
    if kind in (str, bytes) and len(value) > 2**20:
        raise UnsupportedLeafError(f"{kind.__name__} longer than 1 MiB", key_path=path)
    stored = [float(value.real), float(value.imag)] if kind is complex else kind(value)
    return LeafEntry(path, "scalar", scalar_type=kind.__name__, value=stored)


def _as_array(path: str, value: Any) -> tuple[Any, ArrayInfo]:
    """The array to store for a leaf (key data for typed keys) and what the manifest says."""
    key_impl = None
    if is_key_array(value):
        key_impl = str(jax.random.key_impl(value))
        value = jax.random.key_data(value)
    elif isinstance(value, np.generic):
        value = np.asarray(value)
    if dtype_name(value.dtype) is None:
        raise UnsupportedLeafError(f"arrays of dtype {value.dtype} cannot be stored",
                                   key_path=path)
    is_jax = isinstance(value, jax.Array)
    return value, ArrayInfo(tuple(value.shape), np.dtype(value.dtype), key_impl,
                            _sharding_info(value), is_jax,
                            is_jax and not value.is_fully_addressable)


def prepare(tree: Any, metadata: Any = None) -> tuple[Prepared, dict[int, Any]]:
    """Flattens and checks ``tree`` before anything is written.

    Returns:
      ``(prepared, arrays)``: the checked description, and the array to store for each array
      leaf (numpy or jax; key data for typed PRNG keys), by leaf index.

    Raises:
      UnsupportedLeafError: a leaf cannot be stored; names its key path.
      ValueError: ``metadata`` that msgpack cannot encode, or over 1 MiB encoded.
    """
    node, leaves = flatten(tree)
    _check_metadata(metadata)
    scalars: dict[int, LeafEntry] = {}
    values: dict[int, Any] = {}
    infos: dict[int, ArrayInfo] = {}
    for i, (path, value) in enumerate(leaves):
        if isinstance(value, (np.ndarray, np.generic, jax.Array)):
            values[i], infos[i] = _as_array(path, value)
        else:
            scalars[i] = _scalar_entry(path, value)
    return Prepared(node, [p for p, _ in leaves], scalars, infos, metadata), values


def default_inflight_bytes(max_workers: int, chunk_size_bytes: int) -> int:
    """Raw bytes a save keeps in flight by default: two chunks per worker thread."""
    return 2 * max_workers * chunk_size_bytes


def inflight_window(max_workers: int, chunk_size_bytes: int,
                    max_inflight_bytes: int | None = None) -> int:
    """Chunk jobs a save keeps in flight: ``max_inflight_bytes`` (default two chunks per
    worker) in chunks of at most ``chunk_size_bytes``."""
    inflight = max_inflight_bytes or default_inflight_bytes(max_workers, chunk_size_bytes)
    return inflight // chunk_size_bytes


def save(url: Url, step: int, tree: Any, *, run: str = "default", metadata: Any = None,
         chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES,
         pack_threshold_bytes: int = DEFAULT_PACK_THRESHOLD_BYTES,
         zstd_level: int = DEFAULT_ZSTD_LEVEL, shuffle: bool | None = None,
         dtypes: dict[str, Any] | None = None, max_workers: int | None = None,
         max_inflight_bytes: int | None = None, delta: bool = True) -> SaveInfo:
    """Saves ``tree`` as checkpoint ``step`` of ``run``.

    Writes, in this order (format.md §7): the config object if the repository is new; every
    chunk the repository lacks; then the manifest, create-only. Which chunks exist is learned
    from the run's latest manifest and, for any other chunk, one ``stat`` of its key, so the
    cost of a save follows the size of the state, not of the repository. Arrays are cut along
    shard boundaries into chunks of at most ``chunk_size_bytes`` (format.md §3.3); leaves of at
    most ``pack_threshold_bytes`` are packed together and leaves of at most 64 bytes are stored
    inline in the manifest (§3.4).

    The chunks stream through ``max_workers`` threads that read, hash and encode them and as
    many that upload them, with at most ``max_inflight_bytes`` of blocks in flight from read to
    upload, so encoding overlaps writing and host memory does not grow with the state:
    numpy and CPU-device arrays are read in place (no copy), and an accelerator's shards are
    copied to host memory one block at a time, each copy started as its block enters the
    window, so device-to-host copies of later blocks overlap hashing and writing of earlier
    ones. The caller's arrays must not change until this returns.

    Args:
      url: a path, an fsspec URL or a Store.
      step: the step number, ``0 <= step < 10**16``.
      tree: a pytree (dict / list / tuple / namedtuple / registered dataclasses, flax and equinox
        nodes) whose leaves are numpy or jax arrays of the dtypes of format.md §4.5 (typed PRNG
        keys included), Python bool / int / float / complex / str / bytes, or None.
      run: the run name.
      metadata: user metadata stored in the manifest (msgpack types: None, bool, int, float, str,
        bytes, list, dict; at most 1 MiB encoded).
      chunk_size_bytes: the largest chunk, bytes (default 16 MiB).
      pack_threshold_bytes: leaves up to this size are packed (default 64 KiB).
      zstd_level: zstd compression level (the chunk id does not depend on it).
      shuffle: also try the byte-plane codec on array chunks (codec 5, format.md §3.2): each
        byte plane that compresses (the exponent bytes of floats, the sign bit moved below
        them) as a zstd frame, the others as is; about 17% fewer bytes on trained float32 for
        about 2x the CPU time of the save and of its restores. None: the store's ``shuffle``
        (True unless set False on the store). False keeps codec 5 only where it saves 1/4
        (adam's moments) and stores barely compressible floats raw.
      dtypes: key-path prefix (format.md §5, e.g. ``"params"``; ``""`` is the whole tree) ->
        the dtype (or its format.md §4.5 name) its array leaves are stored in, as orbax's
        ``SaveArgs(dtype=...)``; the longest matching prefix wins. Each block is cast as its
        chunk is written (no full-size copy; on an accelerator, on the device before its host
        copy), chunks are cut and named by the stored bytes (so they dedup with any save of
        the same stored values), the manifest records the stored dtype (format.md §4.6), and
        restore returns it unless the target asks for another. E.g. ``{"params":
        jnp.bfloat16}`` halves a float32 model's bytes. Casts stay within a kind (bool,
        integer, floating, complex); a leaf under a prefix keeps its dtype through a longer
        prefix naming it. None stores every leaf in its own dtype.
      max_workers: threads for hashing and compression, and as many for uploads (default the
        store's, which follows the number of cores).
      max_inflight_bytes: raw bytes of blocks read but not yet uploaded, at most (default two
        chunks per worker: 512 MiB with 16 workers and 16 MiB chunks); the encoded copies
        add at most as much again, and each worker holds up to half a chunk more while it
        compresses (a zstd frame and its verification).
      delta: store a changed block as the XOR with the same block (same key path and bounds)
        of the run's latest step when that saves 1/8 of the block stored whole, 1/4 of a block
        that would be stored raw (format.md §3.5): about 0.3 of the raw size on fine-tuned
        float32 weights, where the block alone takes 0.83.
        Each such block costs one read of its base chunk (from the store) at save, and a
        restore reads the delta and its base, so a save takes deltas only while their bytes
        stay within 0.15 of its step's bytes stored whole (:class:`RestoreBudget`): a restore
        reads at most about 1.15x what it would without deltas, and where deltas save little
        (pretraining) most blocks are stored whole. A block whose delta did not pay at the previous
        save (stored whole there and at the step before) tries again only one save in four
        (:func:`unpaid_blocks`), so adam's moments do not cost a read of their base per save.
        Manifests with deltas are format version 2, which casstore before 2026-11 refuses to
        read. False stores every new chunk whole.

    Returns:
      A :class:`SaveInfo`; its ``logical_bytes`` count the stored dtypes.

    Raises:
      StepAlreadyExistsError: the step exists (checked first, and again by the create-only
        manifest write); nothing visible changes.
      UnsupportedLeafError: a leaf cannot be stored, or not in the dtype ``dtypes`` asks for (a
        cast to another kind of dtype, such as float to int; a PRNG key array; a non-key leaf
        to a key dtype); names its key path. Raised before any write.
      ValueError: invalid ``step``, ``run``, ``metadata`` that msgpack cannot encode, or a
        ``dtypes`` prefix that matches no array leaf.
      ManifestError: the repository's config object is damaged or of an unknown version.
      StoreTimeoutError: an object store did not answer within its deadline (``open_store``'s
        ``operation_timeout_s``); nothing is committed (unless the manifest write was stored
        and only its answer was lost: then the step is complete).
    """
    t0 = time.perf_counter()
    store = open_store(url)
    manifest_key(check_run(run), check_step(step))
    prepared, arrays = stored_as(*prepare(tree, metadata), dtypes)
    workers = max_workers or store.max_workers
    inline, jobs = plan_jobs(prepared, arrays, chunk_size_bytes, pack_threshold_bytes)
    del arrays  # the jobs hold what they still need
    window = inflight_window(workers, chunk_size_bytes, max_inflight_bytes)
    return write(store, step, prepared, inline, jobs, run=run, zstd_level=zstd_level,
                 shuffle=store.shuffle if shuffle is None else shuffle, max_workers=workers,
                 window=window, delta=delta, t0=t0)


def write(store: Store, step: int, prepared: Prepared, inline: dict[int, bytes],
          jobs: Iterable[Job], *, run: str, zstd_level: int, shuffle: bool, max_workers: int,
          window: int, delta: bool = True, previous_step: int | None = None,
          t0: float | None = None) -> SaveInfo:
    """Stores the chunks of ``jobs`` and commits the step (the second half of :func:`save`).

    Args:
      jobs: the chunks, consumed lazily with at most ``window`` in flight.
      delta: as :func:`save`'s.
      previous_step: a step of ``run`` known to be committed (the manager's latest), whose
        manifest tells which chunks exist and is the base of deltas; None reads the run's
        latest.

    Raises:
      As :func:`save`.
    """
    t0 = time.perf_counter() if t0 is None else t0
    created = time.time()
    key = manifest_key(run, step)
    if store.exists(key):
        raise StepAlreadyExistsError("step already exists", url=store.url, run=run, step=step)
    agreement = SaveAgreement()
    manifest_bytes = 0
    with save_lock(store):
        with agreement.reporting_errors():
            if agreement.is_primary:
                ensure_config(store)
            previous = previous_manifest(store, run, previous_step)
            # No committed step anywhere: no chunk to reuse, so none is looked up (one HEAD
            # per chunk saved on an object store).
            lookup = previous is not None or bool(list_runs(store))
            writer = _ChunkWriter(store, previous, zstd_level, shuffle, delta, lookup)
            refs: dict[int, list[ChunkRef]] = collections.defaultdict(list)
            for i, ref in _run_jobs(jobs, writer, max_workers, window, prepared.paths):
                refs[i].append(ref)
            if agreement.is_primary:
                for posted in agreement.gather([], None)[1:]:
                    for i, *ref in posted:
                        refs[i].append(ChunkRef(ref[0], tuple(ref[1]), tuple(ref[2]), *ref[3:]))
                manifest = Manifest(run, step, created, prepared.metadata, prepared.node,
                                    _entries(prepared, refs, inline))
                manifest_bytes = _commit(store, key, manifest)
        if agreement.is_primary:
            agreement.publish_outcome(None)
        else:
            agreement.gather([[i, r.id, r.start, r.stop, r.offset, r.raw_bytes, r.stored_bytes,
                               r.base] for i, rs in refs.items() for r in rs], None)
            agreement.wait_outcome()
    return SaveInfo(step, run, prepared.logical_bytes, writer.written + manifest_bytes,
                    writer.new, writer.reused, manifest_bytes, time.perf_counter() - t0,
                    writer.deltas, writer.delta_saved)


def _commit(store: Store, key: str, manifest: Manifest) -> int:
    """Writes the manifest create-only after checking it decodes (format.md §4.4, §7)."""
    data = encode_manifest(manifest)
    decode_manifest(data, run=manifest.run, step=manifest.step, url=store.url)
    try:
        store.put_if_absent(key, data)
    except FileExistsError:
        raise StepAlreadyExistsError("step was committed by a concurrent save", url=store.url,
                                     run=manifest.run, step=manifest.step) from None
    except Exception:
        # The write may have been stored before the error (a lost response): if the manifest
        # there is ours, the commit happened.
        try:
            committed = store.get(key) == data
        except Exception:  # still unknown: report the original error
            committed = False
        if not committed:
            raise
    return len(data)


def _check_metadata(metadata: Any) -> None:
    try:
        size = len(msgpack.packb(metadata, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"metadata is not msgpack-serializable: {e}") from e
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {size} bytes encoded; the limit is 1 MiB")


def plan_jobs(prepared: Prepared, arrays: dict[int, Any], chunk_size_bytes: int,
              pack_threshold_bytes: int) -> tuple[dict[int, bytes], Iterator[Job]]:
    """This process's chunk jobs; returns ``(inline bytes by leaf index, jobs)``.

    Small leaves are read now: inline bytes and packs are copies. Larger leaves become a lazy
    stream of one job per block of every unique shard; an accelerator block's host copy is
    started when the stream yields its job. Arrays that span several processes are written by
    every process for its own ``replica_id == 0`` shards; everything else (numpy, fully
    addressable jax arrays) only by process 0.
    """
    primary = jax.process_index() == 0
    infos = prepared.arrays
    mine = {i: a for i, a in arrays.items() if infos[i].spread or primary}
    small = {i: a for i, a in mine.items() if not infos[i].spread
             and infos[i].nbytes <= min(pack_threshold_bytes, chunk_size_bytes)}
    small_raw = _small_bytes(small)
    inline = {i: raw for i, raw in small_raw.items() if len(raw) <= INLINE_LIMIT_BYTES}
    packs = _pack_jobs({i: raw for i, raw in small_raw.items() if i not in inline},
                       prepared.paths, infos, chunk_size_bytes)
    large = [(i, a) for i, a in mine.items() if i not in small]
    blocks = (job for i, a in large for job in _block_jobs(i, a, chunk_size_bytes))
    return inline, _chain(packs, blocks)


def _chain(first: list[Job], rest: Iterator[Job]) -> Iterator[Job]:
    yield from first
    yield from rest


def _small_bytes(small: dict[int, Any]) -> dict[int, bytes]:
    """The raw bytes of small leaves, copied; accelerator copies all start before any waits."""
    host = {i: a if not isinstance(a, jax.Array) else np.asarray(a) if on_host(a)
            else start_host_copy(a, (0,) * a.ndim, a.shape) for i, a in small.items()}
    return {i: bytes(block_bytes(np.asarray(h), (0,) * h.ndim, h.shape))
            for i, h in host.items()}


def _entries(prepared: Prepared, refs: dict, inline: dict) -> tuple[LeafEntry, ...]:
    """The manifest's leaf entries, in leaf order (format.md §4.3)."""
    entries = dict(prepared.scalars)
    for i, a in prepared.arrays.items():
        entries[i] = LeafEntry(
            prepared.paths[i], "array", a.shape, dtype_name(a.dtype), a.is_jax, a.key_impl,
            a.sharding, inline.get(i), tuple(sorted(refs.get(i, ()), key=lambda r: r.start)))
    return tuple(entries[i] for i in range(len(prepared.paths)))


def _block_jobs(i: int, array: Any, chunk_size_bytes: int) -> Iterator[Job]:
    """One job per block of every unique shard of a large array (format.md §3.3), lazily."""
    caller_memory = not isinstance(array, jax.Array)
    for origin, shard in unique_shards(array):
        itemsize = shard.dtype.itemsize
        for start, stop in grid(tuple(shard.shape), itemsize, chunk_size_bytes):
            g_start = tuple(o + a for o, a in zip(origin, start))
            g_stop = tuple(o + b for o, b in zip(origin, stop))
            nbytes = math.prod(b - a for a, b in zip(start, stop)) * itemsize
            blocks = [(i, g_start, g_stop, 0)]
            if is_host_data(shard):
                read = functools.partial(block_bytes, shard, start, stop)
                yield Job(read, blocks, itemsize, nbytes, caller_memory)
            else:
                copy = start_host_copy(shard, start, stop)
                yield Job(functools.partial(_read_copy, copy), blocks, itemsize, nbytes,
                          holds_copy=True)


def _read_copy(copy: jax.Array) -> memoryview:
    """The raw bytes of a block whose host copy :func:`start_host_copy` started."""
    host = np.asarray(copy)
    return block_bytes(host, (0,) * host.ndim, host.shape)


def _pack_jobs(raws: dict[int, bytes], paths: list[str], infos: dict[int, ArrayInfo],
               chunk_size_bytes: int) -> list[Job]:
    """Packs the small leaves of each parent node, in leaf order, into chunks (format.md §3.4).

    Grouping by parent keeps a changed small leaf from rewriting unrelated frozen ones.
    """
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for i in raws:
        groups[paths[i].rpartition("/")[0]].append(i)
    jobs: list[Job] = []
    for members in groups.values():
        parts: list[bytes] = []
        blocks: list = []
        size = 0
        for i in members:
            if parts and size + len(raws[i]) > chunk_size_bytes:
                jobs.append(_pack_job(parts, blocks, infos))
                parts, blocks, size = [], [], 0
            blocks.append((i, (0,) * len(infos[i].shape), infos[i].shape, size))
            parts.append(raws[i])
            size += len(raws[i])
        jobs.append(_pack_job(parts, blocks, infos))
    return jobs


def _pack_job(parts: list[bytes], blocks: list, infos: dict[int, ArrayInfo]) -> Job:
    """A pack's job; its element size is the leaves' itemsize if they all share one, else 1."""
    sizes = {infos[i].dtype.itemsize for i, *_ in blocks}
    data = b"".join(parts)
    return Job(functools.partial(memoryview, data), blocks,
               sizes.pop() if len(sizes) == 1 else 1, len(data), holds_copy=True)


def _run_jobs(jobs: Iterable[Job], writer: _ChunkWriter, max_workers: int, window: int,
              paths: list[str]) -> list[tuple[int, ChunkRef]]:
    """Runs the jobs through two bounded thread pools; returns (leaf index, chunk ref) pairs.

    ``max_workers`` threads read, hash and encode; as many others upload, so the CPU work of
    later chunks overlaps the writes of earlier ones instead of waiting behind them (on a
    2-core VM's disk: 4.0 s instead of 5.4 s for a byte-plane save of the GPT-2-small state).
    A job holds its place in ``window`` until its upload is done, so the raw and encoded bytes
    in flight stay bounded as before.
    """

    def encode(job: Job) -> list[tuple[int, ChunkRef]] | cf.Future:
        i, start, stop, offset = job.blocks[0]
        block = (paths[i], start, stop) if len(job.blocks) == 1 and offset == 0 else None
        try:
            with _naming(paths[i]):
                cid, stored, base, upload = writer.write(job.read(), job.element_size, block)
        finally:
            if job.release is not None:
                job.release()
        refs = [(i, ChunkRef(cid, a, b, off, job.nbytes, stored, base))
                for i, a, b, off in job.blocks]
        return refs if upload is None else uploads.submit(put, paths[i], upload, refs)

    def put(path: str, upload: tuple[str, bytes], refs: list) -> list[tuple[int, ChunkRef]]:
        with _naming(path):
            writer.store.put(*upload)
        return refs

    with cf.ThreadPoolExecutor(max_workers) as uploads:
        try:
            done = bounded_map(encode, jobs, max_workers, window)
        except BaseException:
            uploads.shutdown(cancel_futures=True)
            raise
    return [pair for pairs in done for pair in pairs]


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    """Names the key path ``path`` in any exception raised in the body."""
    try:
        yield
    except StoreTimeoutError as e:
        raise e.at(key_path=path) from e
    except Exception as e:
        if hasattr(e, "add_note"):  # Python >= 3.11
            e.add_note(f"while saving key path {path!r}")
        raise
