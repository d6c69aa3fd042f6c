"""Chunk ids and the chunk object encoding (format.md §3.1 and §3.2).

A chunk id is the xxh3-128 of the raw bytes, as 32 lowercase hex digits. A chunk object is a
16-byte header (magic, version, codec, element size, raw length) followed by the raw bytes, one
zstd frame of them, one zstd frame of their byte-shuffled form (HDF5's and blosc's shuffle
filter), or their byte planes, each stored raw or as its own zstd frame (codec 4; codec 5 first
moves each element's sign bit below its exponent, so a float's exponent fills one plane; the
byte transforms are in :mod:`casstore._shuffle`). zstandard, xxhash and numpy's copies release
the GIL, so these functions run in parallel in a thread pool. A header of a version or codec
this casstore does not know is a newer format, not damage (format.md §10).
"""

from __future__ import annotations

import re
import struct

import numpy as np
import xxhash
import zstandard

from ._buffers import BufferPool, thread_scratch
from ._errors import CorruptChunkError, UnsupportedFormatError
from ._format import READER_VERSION
from ._shuffle import interleave, move_sign, shuffle, unmove_sign, unshuffle
from ._zstd import check_frame, compressor, plane_compressor, unzstd

MAGIC = b"CAS1"
VERSION = 1
CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_SHUFFLE_ZSTD = 2
CODEC_PLANES = 4  # codec 3 is the XOR delta (format.md §3.2)
CODEC_EXPONENT_PLANES = 5  # codec 4 with the sign bit moved below the exponent (format.md §3.2)
PLANE_CODECS = (CODEC_PLANES, CODEC_EXPONENT_PLANES)
KNOWN_CODECS = (0, 1, 2, 3, 4, 5)  # format.md §3.2, §3.5; a writer never reuses a number
HEADER = struct.Struct("<4sBBHQ")  # format.md §3.2: magic, version, codec, element_size, length
MAX_ELEMENT_SIZE = 16
MAX_RAW_LENGTH = 2**31
DEFAULT_ZSTD_LEVEL = 1
MIN_SAVING = 1 / 8  # keep zstd only if it saves this fraction of the raw size
# Codec 5 keeps a plane's zstd frame if it saves this much: the plane under the exponent of a
# float that has one sign (adam's nu) holds 7 random bits a byte, which Huffman codes at 7/8.
MIN_PLANE_SAVING = 1 / 32
PLANES_ONLY_IF_SAVING = 1 / 4  # without ``shuffle``: codec 5 only where it saves this much
SAMPLE_BYTES = 64 * 1024
PLANE_SAMPLE_BYTES = 16 * 1024  # codecs 4, 5 judge each byte plane on two samples this size
_CHUNK_ID = re.compile(r"[0-9a-f]{32}")


def chunk_id(raw: memoryview | bytes) -> str:
    """Returns the content address of ``raw`` (format.md §3.1).

    Args:
      raw: the raw, uncompressed chunk bytes (any buffer; not copied).

    Returns:
      32 lowercase hex digits of xxh3-128.
    """
    return xxhash.xxh3_128_hexdigest(raw)


def is_chunk_id(text: object) -> bool:
    """True if ``text`` is a well-formed chunk id (32 lowercase hex digits)."""
    return isinstance(text, str) and _CHUNK_ID.fullmatch(text) is not None


def _candidates(element_size: int) -> tuple[int, ...]:
    return (CODEC_EXPONENT_PLANES, CODEC_ZSTD) if element_size > 1 else (CODEC_ZSTD,)


def plane_buffer(k: int, n: int, pool: BufferPool | None = None) -> np.ndarray:
    """Room for an object in codec 4's layout (format.md §3.2) of ``k`` planes of ``n``
    bytes: header, plane table, then the planes, which the caller writes into
    :func:`buffer_planes` before :func:`encode_planes` compresses them where they are.
    Taken from ``pool`` if given (a buffer a stored object no longer needs)."""
    size = HEADER.size + 4 * k + k * n
    return pool.take(size) if pool is not None else np.empty(size, np.uint8)


def buffer_planes(buffer: np.ndarray, k: int) -> np.ndarray:
    """The ``(k, n)`` planes region of a :func:`plane_buffer`."""
    return buffer[HEADER.size + 4 * k:].reshape(k, -1)


def _worth_compressing(plane: np.ndarray, level: int, saving: float) -> bool:
    """Whether zstd saves at least the fraction ``saving`` of a byte plane: judged whole up to
    64 KiB, else on two samples of 16 KiB (the start and the middle)."""
    n = len(plane)
    if n <= 4 * PLANE_SAMPLE_BYTES:
        return True  # the caller compresses it whole and keeps what saves
    middle = n // 2
    size = sum(len(plane_compressor(level).compress(s)) for s in (
        plane[:PLANE_SAMPLE_BYTES], plane[middle:middle + PLANE_SAMPLE_BYTES]))
    return size <= 2 * PLANE_SAMPLE_BYTES * (1 - saving)


def encode_planes(buffer: np.ndarray, k: int, level: int,
                  codec: int = CODEC_PLANES) -> memoryview:
    """Finishes an object in codec 4's layout (format.md §3.2) in ``buffer``, a
    :func:`plane_buffer` whose ``k`` planes are filled, and returns it: a view of ``buffer``.

    Each plane that is worth it (:func:`_worth_compressing`) is compressed as its own zstd
    frame and kept if the frame saves 1/8 of the plane (1/32 for codec 5); every other plane is
    stored as is, so the random low mantissa bytes of floats cost no pass of zstd's match
    finder. A kept frame is decompressed again and compared with its plane first (restic's
    verify-after-encode). The planes are then moved down over the room the frames saved, so no
    copy of the whole object is made. ``codec`` is the header's: 4; 5, whose planes the caller
    has passed through :func:`move_sign`; or 3 for a delta (format.md §3.5).

    Raises:
      CorruptChunkError: a zstd frame does not decode back to its plane.
    """
    planes = buffer_planes(buffer, k)
    n = planes.shape[1]
    position = start = HEADER.size + 4 * k
    lengths = []
    saving = MIN_PLANE_SAVING if codec == CODEC_EXPONENT_PLANES else MIN_SAVING
    for j, plane in enumerate(planes):
        frame = (plane_compressor(level).compress(plane)
                 if _worth_compressing(plane, level, saving) else None)
        if frame is not None and len(frame) <= n * (1 - saving):
            check_frame(frame, plane)
            stored = np.frombuffer(frame, np.uint8)
        else:
            stored = plane
        if stored is not plane or position != start + j * n:
            buffer[position:position + len(stored)] = stored  # numpy copes with the overlap
        lengths.append(len(stored))
        position += len(stored)
    HEADER.pack_into(buffer, 0, MAGIC, VERSION, codec, k, k * n)
    struct.pack_into(f"<{k}I", buffer, HEADER.size, *lengths)
    return memoryview(buffer)[:position]


def planes_object(planes: np.ndarray, level: int, codec: int = CODEC_PLANES) -> memoryview:
    """:func:`encode_planes` of a copy of the ``(k, n)`` byte planes ``planes`` (for codec 5
    the planes before :func:`move_sign`, which is applied to the copy)."""
    k, n = planes.shape
    buffer = plane_buffer(k, n)
    copy = buffer_planes(buffer, k)
    copy[...] = planes
    if codec == CODEC_EXPONENT_PLANES:
        move_sign(copy)
    return encode_planes(buffer, k, level, codec)


def planes_of(payload: memoryview, element_size: int, raw_length: int,
              expected_id: str, codec: int = CODEC_PLANES, unmove: bool = True,
              scratch: bool = False) -> list[np.ndarray]:
    """The ``element_size`` byte planes of a codec-4, codec-5 or delta payload (format.md §3.2,
    §3.5), after checking its plane table; a plane stored as is is a view of ``payload``, not a
    copy. For codec 5
    the sign bit is moved back (:func:`unmove_sign`), so the planes are ``shuffle``'s, unless
    ``unmove`` is False (for :func:`interleave`'s ``moved``, which does it block by block).
    With ``scratch`` the zstd planes are decoded into this thread's scratch buffer
    (:func:`~casstore._buffers.thread_scratch`), so they are valid only until the thread's next
    call here; else into new arrays."""
    k, n = element_size, raw_length // element_size
    table = 4 * k
    if len(payload) < table:
        raise CorruptChunkError(f"byte-plane payload of {len(payload)} bytes is shorter than its "
                                f"plane table of {table}", chunk_id=expected_id)
    lengths = struct.unpack_from(f"<{k}I", payload)
    if max(lengths) > n or sum(lengths) != len(payload) - table:
        raise CorruptChunkError(f"plane lengths {list(lengths)} do not fit {n}-byte "
                                f"planes in a {len(payload)}-byte payload", chunk_id=expected_id)
    room = thread_scratch(n * sum(length != n for length in lengths)) if scratch else None
    planes = []
    position, used = table, 0
    for length in lengths:
        stored = payload[position:position + length]
        position += length
        if length == n:
            planes.append(np.frombuffer(stored, np.uint8))
        elif room is None:
            planes.append(np.frombuffer(unzstd(stored, n, expected_id), np.uint8))
        else:
            planes.append(unzstd(stored, n, expected_id, room[used:used + n]))
            used += n
    if codec == CODEC_EXPONENT_PLANES and unmove:
        planes[-1], planes[-2] = unmove_sign(planes[-1], planes[-2])
    return planes


def _encode(raw: memoryview | np.ndarray, codec: int, level: int, element_size: int,
            pool: BufferPool | None = None) -> bytes | memoryview:
    """The chunk object of codec 1, 2, 4 or 5 for the raw bytes ``raw``, not yet verified for
    codecs 1 and 2 (codecs 4 and 5 verify each frame as they make it).

    For codec 2 every byte plane ends a zstd block, so no block mixes the exponent bytes with
    the random mantissa bytes (on a 64 KiB chunk: 0.84 of the size instead of 0.91).
    """
    n = memoryview(raw).nbytes
    if codec in PLANE_CODECS:
        buffer = plane_buffer(element_size, n // element_size, pool)
        planes = shuffle(raw, element_size, out=buffer_planes(buffer, element_size))
        if codec == CODEC_EXPONENT_PLANES:
            move_sign(planes)
        return encode_planes(buffer, element_size, level, codec)
    shuffled = codec == CODEC_SHUFFLE_ZSTD
    parts = [HEADER.pack(MAGIC, VERSION, codec, element_size if shuffled else 0, n)]
    if not shuffled:
        return parts[0] + compressor(level).compress(raw)
    stream = compressor(level).compressobj(size=n)
    for plane in shuffle(raw, element_size):
        parts += [stream.compress(plane), stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)]
    parts.append(stream.flush())
    return b"".join(parts)


def _min_saving(codec: int, shuffle: bool) -> float:
    """The fraction of the raw size ``codec`` must save to be kept (format.md §3.2)."""
    return PLANES_ONLY_IF_SAVING if codec in PLANE_CODECS and not shuffle else MIN_SAVING


def _choose_codec(raw: memoryview, level: int, element_size: int, shuffle: bool) -> int:
    """The codec whose output of two 64 KiB samples (start, middle) is smallest among those
    that save their minimum (:func:`_min_saving`), or raw if none does. Chunks under 256 KiB are
    judged whole instead, by :func:`encode_chunk`.
    """
    n = len(raw)
    step = SAMPLE_BYTES - SAMPLE_BYTES % element_size
    middle = n // 2 - (n // 2) % element_size
    samples = (raw[:step], raw[middle:middle + step])
    best, best_size = CODEC_RAW, 2 * step
    for codec in _candidates(element_size):
        size = sum(len(_encode(s, codec, level, element_size)) - HEADER.size for s in samples)
        if size <= 2 * step * (1 - _min_saving(codec, shuffle)) and size <= best_size:
            best, best_size = codec, size
    return best


def encode_chunk(raw: memoryview, *, level: int = DEFAULT_ZSTD_LEVEL, element_size: int = 1,
                 shuffle: bool = True, pool: BufferPool | None = None) -> bytes | memoryview:
    """Encodes raw chunk bytes as a chunk object (format.md §3.2).

    Plain zstd (codec 1) is tried and, with ``element_size > 1`` (an array chunk of that
    itemsize), the byte planes with the sign bit moved below the exponent (codec 5,
    :func:`move_sign`): each plane of the byte-shuffled bytes that zstd shrinks by 1/32 as its
    own zstd frame, the others as they are (about 0.831 of the raw size on N(0, 0.02) float32
    and 0.800 on adam's nu, where plain zstd keeps 0.92). The smaller output is kept if it
    saves at least 1/8 of the size, otherwise the raw bytes are stored (codec 0). Chunks of
    256 KiB or more are judged on two 64 KiB samples first, and each plane over 64 KiB on two
    16 KiB samples, so incompressible data costs no full compression. Codecs 2 and 4 are only
    read, no longer written. A zstd payload (each zstd plane of codec 5) is decompressed again
    and its hash compared with its input's before it is returned (restic's
    verify-after-encode), so a faulty compressor cannot store wrong bytes.

    Args:
      raw: raw bytes, at most 2**31.
      level: zstd compression level.
      element_size: bytes per array element, 1 to 16; codec 5 is tried only if it is above 1
        and divides ``len(raw)``.
      shuffle: keep codec 5 wherever it saves 1/8; False keeps it only where it saves 1/4
        (adam's moments, low-entropy floats: there it is both smaller than zstd and faster
        to encode and decode), so barely compressible floats such as trained weights are
        stored raw and cost no shuffle (local disk's default until 2026-11-23,
        docs/design-notes.md).
      pool: where codec 5 takes its buffer (:class:`~casstore._buffers.BufferPool`; the
        caller gives it back once the object is stored), or None for a new one.

    Returns:
      The chunk object: 16-byte header plus payload; for codec 5 a memoryview of the buffer
      it was built in (:func:`encode_planes`), else bytes.

    Raises:
      ValueError: ``raw`` is longer than 2**31 bytes, or ``element_size`` is not in [1, 16].
      CorruptChunkError: the compressed payload does not decode back to its input.
    """
    n = len(raw)
    if n > MAX_RAW_LENGTH:
        raise ValueError(f"chunk of {n} bytes exceeds the {MAX_RAW_LENGTH}-byte limit")
    if not 1 <= element_size <= MAX_ELEMENT_SIZE:
        raise ValueError(f"element_size {element_size} is not in [1, {MAX_ELEMENT_SIZE}]")
    if n == 0 or n % element_size:
        element_size = 1
    if n >= 4 * SAMPLE_BYTES:
        codecs = (_choose_codec(raw, level, element_size, shuffle),)
    else:
        codecs = _candidates(element_size)
    best = None
    for codec in (c for c in codecs if c != CODEC_RAW):
        data = _encode(raw, codec, level, element_size, pool)
        if len(data) - HEADER.size <= n * (1 - _min_saving(codec, shuffle)) and (
                best is None or len(data) < len(best)):
            data, best = best, data
        if pool is not None and data is not None:
            pool.give(data)  # not kept: its buffer serves a later chunk
    if best is None:
        return raw_object(raw, pool)
    if best[5] == CODEC_ZSTD:
        check_frame(memoryview(best)[HEADER.size:], np.frombuffer(raw, np.uint8))
    return best


def raw_object(raw: memoryview | bytes, pool: BufferPool | None = None) -> bytes | memoryview:
    """The codec-0 object of ``raw`` (format.md §3.2): header, then the bytes as they are; in
    a buffer of ``pool`` if given (a memoryview of it), else new bytes."""
    header = HEADER.pack(MAGIC, VERSION, CODEC_RAW, 0, len(raw))
    if pool is None:
        return b"".join((header, raw))
    buffer = pool.take(HEADER.size + len(raw))
    buffer[:HEADER.size] = np.frombuffer(header, np.uint8)
    buffer[HEADER.size:] = np.frombuffer(raw, np.uint8)
    return memoryview(buffer)


def max_object_bytes(raw_length: int) -> int:
    """The most bytes a valid chunk or delta object of ``raw_length`` raw bytes takes (format.md
    §3.2, §3.5): the header, then the largest payload of any codec: byte planes (codecs 3, 4,
    5: a plane table of at most 16 entries, each plane at most its ``n`` bytes, so at most the
    raw length in all) or one zstd frame (codecs 1, 2: at most zstd's ``ZSTD_COMPRESSBOUND``).
    A reader reads at most one byte more of an object (:func:`check_size`); the manifest's
    ``stored_bytes`` is no bound: another writer may have stored the chunk in another codec."""
    n = raw_length
    zstd_bound = n + (n >> 8) + ((128 << 10) - n >> 11 if n < 128 << 10 else 0)
    return HEADER.size + max(4 * MAX_ELEMENT_SIZE + n, zstd_bound)


def check_size(data: bytes | memoryview, expected_id: str, raw_length: int) -> None:
    """Raises CorruptChunkError if ``data`` (an object, or its first
    ``max_object_bytes(raw_length) + 1`` bytes as read) is larger than any valid encoding of
    ``raw_length`` raw bytes (:func:`max_object_bytes`)."""
    if len(data) > (most := max_object_bytes(raw_length)):
        raise CorruptChunkError(f"object larger than the {most} bytes any encoding of its "
                                f"{raw_length} raw bytes takes (format.md §3.2; not read "
                                "further)", chunk_id=expected_id)


def refuse_newer(version: int, codec: int, chunk_id: str) -> None:
    """Raises UnsupportedFormatError for a chunk header (magic and non-zero version checked)
    of another version or an unknown codec: a newer writer's, not damage (format.md §10)."""
    if version != VERSION or codec not in KNOWN_CODECS:
        what = f"chunk header version {version}" if version != VERSION else f"chunk codec {codec}"
        raise UnsupportedFormatError(f"{what} (or a damaged chunk)", needs=None,
                                     reader=READER_VERSION, chunk_id=chunk_id)


def check_header(data: bytes | memoryview, expected_id: str, raw_length: int
                 ) -> tuple[int, int]:
    """Checks a chunk object's header (format.md §3.2) as :func:`decode_chunk` does; returns
    its ``(codec, element_size)``. Raises as :func:`decode_chunk` for a bad header."""
    if len(data) < HEADER.size:
        raise CorruptChunkError(f"chunk object of {len(data)} bytes is shorter than its header",
                                chunk_id=expected_id)
    check_size(data, expected_id, raw_length)
    magic, version, codec, element_size, length = HEADER.unpack_from(data)
    if magic != MAGIC or version == 0:
        raise CorruptChunkError("bad chunk header", chunk_id=expected_id)
    refuse_newer(version, codec, expected_id)
    if codec in (CODEC_SHUFFLE_ZSTD, *PLANE_CODECS):
        bad = not 2 <= element_size <= MAX_ELEMENT_SIZE or length % element_size
    else:
        bad = element_size != 0
    if bad:
        raise CorruptChunkError(f"bad element size {element_size} for codec {codec} and "
                                f"{length} raw bytes", chunk_id=expected_id)
    if length != raw_length or length > MAX_RAW_LENGTH:
        raise CorruptChunkError(f"chunk header says {length} raw bytes, manifest says "
                                f"{raw_length} (at most {MAX_RAW_LENGTH})", chunk_id=expected_id)
    return codec, element_size


def verify_raw(header: bytes | memoryview, raw: memoryview | np.ndarray, expected_id: str,
               raw_length: int) -> bool:
    """For a chunk object read in two parts (its header, then its payload straight into a
    restore's destination ``raw``): True if the header is a raw chunk's (codec 0) of
    ``raw_length`` bytes and ``raw`` hashes to ``expected_id``; False for another codec (the
    caller reads the object whole and decodes it).

    Raises:
      CorruptChunkError, UnsupportedFormatError: as :func:`decode_chunk`, for a bad header or
        raw bytes that do not match their chunk id.
    """
    if check_header(header, expected_id, raw_length)[0] != CODEC_RAW:
        return False
    if chunk_id(raw) != expected_id:
        raise CorruptChunkError("chunk bytes do not match their chunk id", chunk_id=expected_id)
    return True


def decode_chunk(data: bytes | memoryview, expected_id: str, raw_length: int,
                 out: np.ndarray | None = None) -> memoryview:
    """Decodes and verifies a chunk object read from storage (format.md §3.2).

    Checks the header (an element size only with codecs 2, 4 and 5, dividing the raw length),
    that the raw length equals ``raw_length``, that a zstd frame declares exactly that content
    size (so a frame that would expand further is rejected before it is decompressed), for
    codecs 4 and 5 that the plane table fits the payload and each zstd plane declares exactly
    one plane's size, and that the decoded bytes hash to ``expected_id``.

    Args:
      data: the chunk object's bytes, as read.
      expected_id: the chunk id the manifest gives.
      raw_length: the raw byte count the manifest gives.
      out: a contiguous uint8 array of ``raw_length`` bytes to decode into (a restore's
        destination: a zstd frame is decoded and byte planes are interleaved straight into
        it, raw and shuffled bytes copied), or None. Its contents are undefined if this
        raises.

    Returns:
      The raw bytes, ``raw_length`` long: a view of ``out`` if given, else of ``data`` for a
      raw chunk, else of a new buffer.

    Raises:
      CorruptChunkError: any check fails (the message says which; the caller adds step and
        key path).
      UnsupportedFormatError: the header has the magic but a version or codec number this
        casstore does not know (a newer writer's chunk, or damage to those bytes)."""
    codec, element_size = check_header(data, expected_id, raw_length)
    payload = memoryview(data)[HEADER.size:]
    if codec == CODEC_RAW:
        raw = payload
    elif codec == CODEC_ZSTD:
        raw = memoryview(unzstd(payload, raw_length, expected_id, out))
    elif codec == CODEC_SHUFFLE_ZSTD:
        raw = memoryview(unshuffle(unzstd(payload, raw_length, expected_id), element_size))
    elif codec in PLANE_CODECS:
        raw = memoryview(interleave(
            planes_of(payload, element_size, raw_length, expected_id, codec, unmove=False,
                      scratch=True), out=out, moved=codec == CODEC_EXPONENT_PLANES))
    else:  # codec 3: a delta object, read only by _delta.decode_delta
        raise CorruptChunkError(f"codec {codec} is a delta object", chunk_id=expected_id)
    if len(raw) != raw_length:
        raise CorruptChunkError(f"chunk decodes to {len(raw)} bytes, expected {raw_length}",
                                chunk_id=expected_id)
    if out is not None and codec in (CODEC_RAW, CODEC_SHUFFLE_ZSTD):
        out[...] = np.frombuffer(raw, np.uint8)
        raw = memoryview(out)
    if chunk_id(raw) != expected_id:
        raise CorruptChunkError("chunk bytes do not match their chunk id", chunk_id=expected_id)
    return raw
