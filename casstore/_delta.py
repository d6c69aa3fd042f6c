"""Delta chunks: a chunk stored as the XOR of its bytes with a base chunk's (format.md §3.5).

Between two steps of training a float's sign, exponent and high mantissa bits rarely change,
so the XOR of a block with the same block one step earlier is mostly zero bytes in the high
byte planes. In byte planes (codec 4's layout: each plane stored as is or as a zstd frame) it
takes about 0.29 of the raw size on fully fine-tuned float32 weights, where the block alone
takes 0.83 (the XOR delta of ZipLLM and ZipNN; ../shared/CODECS.md). The chunk id stays the
hash of the raw bytes, so every reader checks the bytes it rebuilds against it.

The base of a delta is always a chunk stored whole (chains have depth 1), so a restore reads
at most two objects per chunk. XOR commutes with the byte shuffle, so both sides work on byte
planes: a codec-4, 5 or 2 base is only decompressed into its planes, and the rebuilt
planes are interleaved once, XORed on the way.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
from collections.abc import Iterable

import numpy as np

from ._buffers import BufferPool
from ._codec import (
    CODEC_EXPONENT_PLANES,
    CODEC_RAW,
    CODEC_SHUFFLE_ZSTD,
    CODEC_ZSTD,
    HEADER,
    MAGIC,
    MAX_ELEMENT_SIZE,
    PLANE_CODECS,
    SAMPLE_BYTES,
    _min_saving,
    buffer_planes,
    check_header,
    check_size,
    chunk_id,
    decode_chunk,
    encode_planes,
    interleave,
    max_object_bytes,
    plane_buffer,
    planes_object,
    planes_of,
    refuse_newer,
    shuffle,
)
from ._errors import CorruptChunkError, warn_read_again
from ._layout import chunk_key
from ._zstd import compressor, unzstd
from .store import Store

CODEC_DELTA = 3
# A delta is kept if it saves this fraction of the chunk stored whole: 1/8 against a compressed
# whole chunk (which costs a decode too), 1/4 against a raw one (which costs only a copy).
MIN_SAVING = 1 / 8
MIN_SAVING_AGAINST_RAW = 1 / 4
# A save's deltas may add at most this fraction to the bytes a restore of its step reads. It is
# below the 1.25x restore time issue 15 allows because a delta also costs a second decode
# (docs/design-notes.md, "A save bounds what its deltas cost a restore").
MAX_RESTORE_OVERHEAD = 0.15


class RestoreBudget:
    """Bounds what one save's deltas add to the bytes a restore of its step reads.

    A restore reads a delta chunk's base and its delta object: about the chunk's whole size
    (the base is the same block, stored whole) plus the delta's. So where deltas save little
    (pretraining, where every bit below the exponent moves each step, a delta keeps 0.7 to 0.9
    of the chunk) a step of deltas would restore reading almost twice its whole size. The save
    books the size of every chunk its step references stored whole (:meth:`add_whole`) and
    takes a delta only while the deltas' bytes stay within ``fraction`` of the whole bytes
    booked so far, that chunk's included (:meth:`take`); the deltas that save most per byte of
    overhead are not sought out, the save takes them in the order its chunks come. A new
    delta is booked at its samples' estimate to decide whether to encode it, then at its
    encoded size (:meth:`settle`); the size its chunk would have whole is the samples'
    estimate (:func:`encode_delta`). Thread-safe.

    Args:
      fraction: the bound, e.g. 0.15: a step restores reading at most 1.15x the bytes of its
        chunks stored whole (those of its delta chunks as estimated when they were saved).
    """

    def __init__(self, fraction: float = MAX_RESTORE_OVERHEAD):
        self.fraction = fraction
        self.whole_bytes = self.delta_bytes = 0
        self.lock = threading.Lock()

    def add_whole(self, nbytes: int) -> None:
        """Books a chunk of ``nbytes`` stored bytes that the step reads whole."""
        with self.lock:
            self.whole_bytes += nbytes

    def add_delta(self, nbytes: int) -> None:
        """Books a delta object of ``nbytes`` the step reuses: its base's size unknown, it is
        booked as ``nbytes`` of whole bytes and of delta bytes, erring on the side of fewer
        new deltas."""
        with self.lock:
            self.whole_bytes += nbytes
            self.delta_bytes += nbytes

    def take(self, delta: int, whole: int) -> bool:
        """Books a new delta of ``delta`` bytes for a chunk of ``whole`` bytes stored whole,
        if the bound allows it; returns whether it did."""
        with self.lock:
            if self.delta_bytes + delta > self.fraction * (self.whole_bytes + whole):
                return False
            self.delta_bytes += delta
            self.whole_bytes += whole
            return True

    def settle(self, estimate: int, whole: int, actual: int | None) -> bool:
        """Settles a delta that :meth:`take` booked as ``(estimate, whole)`` once it is
        encoded: keeps it at its ``actual`` encoded size if the bound still allows that and
        returns True; else, or if ``actual`` is None (the delta is not kept), withdraws it,
        ``whole`` included (its chunk is then stored whole and booked by :meth:`add_whole`),
        and returns False."""
        with self.lock:
            self.delta_bytes -= estimate
            if actual is not None and (self.delta_bytes + actual
                                       <= self.fraction * self.whole_bytes):
                self.delta_bytes += actual
                return True
            self.whole_bytes -= whole
            return False


def base_bytes(data: bytes | memoryview, base_id: str, raw_length: int,
               element_size: int) -> np.ndarray | list[np.ndarray]:
    """A whole chunk object's bytes in the cheapest form its codec gives.

    The ``element_size`` byte planes (a list, ``shuffle``'s rows) of a codec-4, 5 or 2 object
    of that element size, only decompressed (and codec 5's sign bit moved back; other planes
    stored as is are views of ``data``); else the raw bytes (a 1-D uint8 array; a view of
    ``data`` for a raw chunk).
    The base is not hashed: the chunk rebuilt on top of it is checked against its own id.

    Raises:
      CorruptChunkError: the object's header, plane table or zstd frames are invalid, or its
        length is not ``raw_length``.
    """
    k = element_size
    codec, size = check_header(data, base_id, raw_length)  # (an element size of 2 to 16)
    payload = memoryview(data)[HEADER.size:]
    if codec in PLANE_CODECS and size == k:
        return planes_of(payload, k, raw_length, base_id, codec)
    if codec == CODEC_SHUFFLE_ZSTD and size == k:
        return list(np.frombuffer(unzstd(payload, raw_length, base_id), np.uint8).reshape(k, -1))
    if codec == CODEC_RAW and len(payload) == raw_length:
        return np.frombuffer(payload, np.uint8)
    return np.frombuffer(decode_chunk(data, base_id, raw_length), np.uint8)


def _xor(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a ^ b`` of two uint8 arrays, on 8-byte words where the length allows."""
    word = np.uint64 if len(a) % 8 == 0 else np.uint8
    result = np.bitwise_xor(a.view(word), b.view(word),
                            out=None if out is None else out.view(word))
    return result.view(np.uint8)


def _samples(planes: np.ndarray) -> np.ndarray:
    """Two slices of every plane of ``planes`` (k, n), the start and the middle, 64 KiB in all
    (the whole planes below 256 KiB): what the choice between delta and whole is made on."""
    k, n = planes.shape
    if k * n < 4 * SAMPLE_BYTES:
        return planes
    m = SAMPLE_BYTES // k
    return np.concatenate([planes[:, :m], planes[:, n // 2:n // 2 + m]], axis=1)


def _planes_size(planes: np.ndarray, level: int, codec: int = CODEC_DELTA) -> int:
    """Payload bytes of ``planes`` in the codec-4 layout, as ``codec`` (3 or 5) stores them."""
    return len(planes_object(planes, level, codec)) - HEADER.size


def _whole_size(raw_sample: np.ndarray, planes_sample: np.ndarray, level: int,
                shuffle: bool | None) -> int:
    """Estimated payload bytes of the sampled chunk stored whole, as encode_chunk decides: the
    smallest of zstd and codec 5 among those that save their minimum (``_min_saving``, which
    depends on ``shuffle``), else raw; raw for ``shuffle`` None (a save that stores whole
    chunks uncompressed, casstore._compression)."""
    n = raw_sample.size
    if shuffle is None:
        return n
    sizes = [(CODEC_ZSTD, len(compressor(level).compress(raw_sample)))]
    if planes_sample.shape[0] > 1:
        sizes.append((CODEC_EXPONENT_PLANES,
                      _planes_size(planes_sample, level, CODEC_EXPONENT_PLANES)))
    return min([n] + [size for codec, size in sizes
                      if size <= n * (1 - _min_saving(codec, shuffle))])


def encode_delta(raw: memoryview, base: np.ndarray | list[np.ndarray], element_size: int,
                 level: int, shuffle_whole: bool | None, budget: RestoreBudget | None = None,
                 pool: BufferPool | None = None) -> tuple[memoryview, int] | None:
    """Encodes ``raw`` as a delta object against a base chunk (format.md §3.5), if that pays.

    Args:
      raw: the chunk's raw bytes.
      base: the base chunk's bytes, as :func:`base_bytes` returns them.
      element_size: bytes per element, 1 to 16, dividing ``len(raw)`` (1: one plane).
      level: zstd level.
      shuffle_whole: the save's ``shuffle``, which decides how the chunk would be stored
        whole (encode_chunk); the delta is compared with that. None: whole chunks are
        stored raw (codec 0).
      budget: the save's :class:`RestoreBudget`, asked for the delta's estimated bytes once
        the delta pays, then settled with its encoded size; None asks nothing.
      pool: the save's encode buffers: the delta's buffer is taken from it, and given back
        when the delta does not pay (the caller gives back a delta object once stored).

    Returns:
      ``(delta object, bytes saved)``, or None when the delta would not save 1/8 of the chunk
      stored whole (1/4 if it would be stored raw) or ``budget`` refuses it. Whether to encode
      the delta is decided on estimates of both sizes from the same two samples of every
      plane (:func:`_samples`), scaled to the chunk; the encoded delta must then save as much
      against the whole estimate (where the block changed away from the samples it may not)
      and fit the budget at its encoded size. Bytes saved: the whole estimate minus the
      delta's encoded payload.

    Raises:
      CorruptChunkError: a compressed plane does not decode back to its input.
    """
    n, k = len(raw), element_size
    new = np.frombuffer(raw, np.uint8)
    buffer = plane_buffer(k, n // k, pool)
    x = buffer_planes(buffer, k)
    if isinstance(base, list):  # a codec-4, 5 or 2 base: k > 1
        shuffle(new, k, out=x)
        for j in range(k):
            np.bitwise_xor(x[j], base[j], out=x[j])
    elif k > 1:
        shuffle(_xor(new, base), k, out=x)
    else:
        _xor(new, base, out=x.reshape(-1))
    samples = _samples(new.reshape(-1, k).T)
    whole = _whole_size(interleave(list(samples)), np.ascontiguousarray(samples), level,
                        shuffle_whole)
    delta = _planes_size(_samples(x), level)
    saving = MIN_SAVING_AGAINST_RAW if whole >= samples.size else MIN_SAVING
    scale = n / samples.size
    estimate, whole_estimate = round(delta * scale), round(whole * scale)
    pays = delta <= (1 - saving) * whole and (
        budget is None or budget.take(estimate, whole_estimate))
    if pays:
        encoded = encode_planes(buffer, k, level, CODEC_DELTA)
        actual = len(encoded) - HEADER.size
        pays = actual <= (1 - saving) * whole_estimate  # not where the samples missed changes
        if budget is not None:
            pays = budget.settle(estimate, whole_estimate, actual if pays else None)
    if not pays:
        if pool is not None:
            pool.give(buffer)
        return None
    return encoded, whole_estimate - actual


def decode_delta(data: bytes | memoryview, base: bytes | memoryview, expected_id: str,
                 base_id: str, raw_length: int, out: np.ndarray | None = None) -> memoryview:
    """Rebuilds and verifies a chunk stored as a delta (format.md §3.5).

    Args:
      data: the delta object's bytes, as read.
      base: the base chunk object's bytes, as read.
      expected_id, base_id: the chunk ids the manifest gives for the chunk and its base.
      raw_length: the raw byte count the manifest gives (the base has the same).
      out: as :func:`decode_chunk`'s: where to rebuild the bytes, or None for a new buffer.

    Returns:
      The chunk's raw bytes, checked against ``expected_id`` (a view of ``out`` if given).

    Raises:
      CorruptChunkError: the delta's header, plane table or frames are invalid, the base is
        unusable, or the rebuilt bytes do not hash to ``expected_id`` (the message says
        whether the base alone still decodes to its own id).
    """
    check_size(data, expected_id, raw_length)
    if len(data) < HEADER.size:
        raise CorruptChunkError(f"delta object of {len(data)} bytes is shorter than its header",
                                chunk_id=expected_id)
    magic, version, codec, k, length = HEADER.unpack_from(data)
    if magic != MAGIC or version == 0:
        raise CorruptChunkError("bad delta object header", chunk_id=expected_id)
    refuse_newer(version, codec, expected_id)
    if codec != CODEC_DELTA:
        raise CorruptChunkError(f"codec {codec} in a delta object", chunk_id=expected_id)
    if not 1 <= k <= MAX_ELEMENT_SIZE or length % k or length != raw_length:
        raise CorruptChunkError(f"delta header says element size {k} and {length} raw bytes, "
                                f"manifest says {raw_length} raw bytes", chunk_id=expected_id)
    x = planes_of(memoryview(data)[HEADER.size:], k, raw_length, expected_id)
    try:
        based = base_bytes(base, base_id, raw_length, k)
    except CorruptChunkError as e:
        raise CorruptChunkError(f"its base chunk {base_id} is corrupt: {e}",
                                chunk_id=expected_id) from e
    if isinstance(based, list):
        raw = interleave(x, xor=based, out=out)
    else:
        raw = interleave(x, out=out)
        _xor(raw, based, out=raw)
    if chunk_id(raw) != expected_id:
        try:
            decode_chunk(base, base_id, raw_length)
            where = "the delta object is corrupt (its base chunk checks out)"
        except CorruptChunkError as e:
            where = f"its base chunk {base_id} is corrupt: {e}"
        raise CorruptChunkError(f"rebuilt bytes do not match their chunk id: {where}",
                                chunk_id=expected_id)
    return memoryview(raw)


class DeltaBases:
    """Reads and decodes the chunk objects of one pass (restore, verify, copy), each base once.

    A base chunk that several objects of the pass need (the deltas on it, and the base's own
    chunk object where the pass reads that too) is read by its first user and held until its
    last user has it, so deltas that share a base (blocks that were identical when it was
    stored) cost one read of it; a base with one user is not held. Thread-safe.

    Args:
      store: where the objects are.
      objects: ``(chunk id, base chunk id or None)`` of every object the pass will read
        through :meth:`read` or decode through :meth:`decode`; a base used n times, n times.

    Attributes:
      bytes_read: stored bytes of the objects read from ``store`` here (:meth:`read`, and
        the bases :meth:`decode` read), each base once.
    """

    def __init__(self, store: Store, objects: Iterable[tuple[str, str | None]]):
        objects = list(objects)
        self.store = store
        self.bytes_read = 0
        self.bases = {base for _, base in objects if base is not None}
        self.left = collections.Counter(
            base or cid for cid, base in objects if (base or cid) in self.bases)
        self.held: dict[str, cf.Future] = {}
        self.lock = threading.Lock()

    def read(self, key: str, cid: str, base: str | None, raw_length: int) -> bytes:
        """The bytes of object ``key`` (chunk ``cid`` of ``raw_length`` raw bytes, a delta on
        ``base`` if given), as stored: at most one byte more than any valid encoding takes
        (:func:`read_object`).

        Raises:
          ObjectNotFoundError: the object is missing.
        """
        if base is None and cid in self.bases:
            return self._base(cid, raw_length)
        return self._counted(read_object(self.store, key, raw_length))

    def _counted(self, data: bytes) -> bytes:
        with self.lock:
            self.bytes_read += len(data)
        return data

    def decode(self, data: bytes | memoryview, cid: str, base: str | None,
               raw_length: int, out: np.ndarray | None = None) -> memoryview:
        """The verified raw bytes of a chunk object: :func:`decode_chunk`, or for a delta on
        ``base`` :func:`decode_delta` against the base read here (into ``out`` if given).

        Raises:
          CorruptChunkError: as those functions do.
          ObjectNotFoundError: the base is missing (every user waiting on it gets the error).
        """
        if base is None:
            return decode_chunk(data, cid, raw_length, out)
        return decode_delta(data, self._base(base, raw_length), cid, base, raw_length, out)

    def _base(self, base: str, raw_length: int) -> bytes:
        """The base chunk object's bytes, read once while it has users left."""
        with self.lock:
            future = self.held.get(base)
            owner = future is None
            if owner:
                future = self.held[base] = cf.Future()
        if owner:
            try:
                future.set_result(self._counted(read_object(self.store, chunk_key(base),
                                                            raw_length)))
            except BaseException as e:
                future.set_exception(e)
        try:
            return future.result()
        finally:
            with self.lock:
                self.left[base] -= 1
                if self.left[base] <= 0:
                    self.held.pop(base, None)


def read_again(store: Store, key: str, cid: str, base: str | None, raw_length: int,
               out: np.ndarray | None = None, data: bytes | None = None,
               warn: bool = True) -> memoryview:
    """Chunk object ``key`` (a delta on ``base`` if given), which failed its checks as first
    read, read from ``store`` once more (its base too; ``data``: the object's bytes, read
    again by the caller) and decoded: a body damaged or cut short on its way (a response
    without Content-Length that ended early) passes now, and a warning says so (unless
    ``warn`` is False). Returns the raw bytes (as :func:`decode_chunk`, ``out`` likewise).

    Raises:
      CorruptChunkError: the stored object (or its base) is damaged: it failed again.
      FileNotFoundError: it is gone.
    """
    data = read_object(store, key, raw_length) if data is None else data
    raw = (decode_chunk(data, cid, raw_length, out) if base is None else
           decode_delta(data, read_object(store, chunk_key(base), raw_length), cid, base,
                        raw_length, out))
    if warn:
        warn_read_again(f"chunk object {key}", store.url)
    return raw


def read_object(store: Store, key: str, raw_length: int) -> bytes:
    """Chunk or delta object ``key`` of a chunk of ``raw_length`` raw bytes, as stored, or its
    first ``max_object_bytes(raw_length) + 1`` bytes if it is larger than any valid encoding
    (one read: a damaged object of many GB is not held; its decoder refuses it)."""
    return store.head(key, max_object_bytes(raw_length) + 1)
