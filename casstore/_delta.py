"""Delta chunks: a chunk stored as the XOR of its bytes with a base chunk's (format.md §3.5).

Between two steps of training a float's sign, exponent and high mantissa bits rarely change,
so the XOR of a block with the same block one step earlier is mostly zero bytes in the
high byte planes. Byte-shuffled (as codec 2) and zstd-compressed, it takes 0.29 of the raw
size on fully fine-tuned float32 weights, where the block alone takes 0.83 (the XOR delta of
ZipLLM and ZipNN; figures in ../shared/CODECS.md and benchmarks/README.md). The chunk id stays
the hash of the raw bytes, so every reader checks the bytes it rebuilds against it.

The base of a delta is always a chunk stored whole (chains have depth 1), so a restore reads
at most two objects per chunk. XOR commutes with the byte shuffle, so both sides work on
shuffled planes: a codec-2 base is decompressed straight into its planes, and the result is
unshuffled once.
"""

from __future__ import annotations

import numpy as np
import xxhash

from ._codec import (
    CODEC_SHUFFLE_ZSTD,
    HEADER,
    MAGIC,
    MAX_ELEMENT_SIZE,
    SAMPLE_BYTES,
    VERSION,
    _decompressor,
    _encode,
    _unzstd,
    chunk_id,
    decode_chunk,
    shuffle,
    unshuffle,
)
from ._errors import CorruptChunkError

CODEC_DELTA = 3
MIN_SAVING = 1 / 4  # store a delta only if it is at most 3/4 of the chunk's own encoding


def base_planes(data: bytes | memoryview, base_id: str, raw_length: int,
                element_size: int) -> np.ndarray:
    """``shuffle(raw, element_size)`` of a whole chunk object, as a uint8 array.

    A codec-2 object of the same element size is only decompressed; any other is decoded
    (and checked against ``base_id``) and shuffled. The fast path does not hash the base:
    the chunk rebuilt on top of it is checked against its own id.

    Raises:
      CorruptChunkError: the object's header or zstd frame is invalid, or its length is not
        ``raw_length``.
    """
    if len(data) >= HEADER.size:
        magic, version, codec, size, length = HEADER.unpack_from(data)
        if (magic, version, codec, size, length) == (MAGIC, VERSION, CODEC_SHUFFLE_ZSTD,
                                                      element_size, raw_length):
            payload = memoryview(data)[HEADER.size:]
            return np.frombuffer(_unzstd(payload, raw_length, base_id), np.uint8)
    raw = decode_chunk(data, base_id, raw_length)
    return shuffle(raw, element_size).reshape(-1) if element_size > 1 else np.frombuffer(
        raw, np.uint8)


def _sampled_size(planes: np.ndarray, level: int) -> float:
    """Estimated codec-2 size of shuffled ``planes`` (k, n), from two slices of every plane
    (the start and the middle, 64 KiB in all) when the chunk is 256 KiB or more."""
    k, n = planes.shape
    m = SAMPLE_BYTES // k
    if k * n < 4 * SAMPLE_BYTES:
        sample = planes
    else:
        sample = np.concatenate([planes[:, :m], planes[:, n // 2:n // 2 + m]], axis=1)
    size = len(_encode(np.ascontiguousarray(sample).reshape(-1), CODEC_SHUFFLE_ZSTD, level, k))
    return min(size - HEADER.size, sample.size) * (k * n) / sample.size


def encode_delta(raw: memoryview, base: np.ndarray, element_size: int,
                 level: int) -> tuple[bytes, int] | None:
    """Encodes ``raw`` as a delta object against a base chunk (format.md §3.5), if that pays.

    Args:
      raw: the chunk's raw bytes.
      base: the base chunk's bytes as :func:`base_planes` returns them (same length as raw).
      element_size: bytes per element, 1 to 16, dividing ``len(raw)`` (1: no shuffle).
      level: zstd level.

    Returns:
      ``(delta object, estimated bytes saved)``, or None when the delta would not be at most
      3/4 of the chunk's own codec-2 encoding. Both sizes are estimated on the same samples
      as :func:`~casstore._codec.encode_chunk`'s codec choice.

    Raises:
      CorruptChunkError: the compressed delta does not decode back to its input.
    """
    n, k = len(raw), element_size
    new = (shuffle(raw, k) if k > 1 else np.frombuffer(raw, np.uint8)).reshape(k, -1)
    x = np.bitwise_xor(new, base.reshape(k, -1))
    whole, delta = _sampled_size(new, level), _sampled_size(x, level)
    if delta > (1 - MIN_SAVING) * whole:
        return None
    body = _encode(x.reshape(-1), CODEC_SHUFFLE_ZSTD, level, k)
    payload = memoryview(body)[HEADER.size:]
    decoded = _decompressor().decompress(payload, max_output_size=n)
    if xxhash.xxh3_128_digest(decoded) != xxhash.xxh3_128_digest(x):
        raise CorruptChunkError("zstd output does not decode back to its input")
    data = HEADER.pack(MAGIC, VERSION, CODEC_DELTA, k, n) + payload
    return data, max(0, round(whole) + HEADER.size - len(data))


def _xor_unshuffle(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """``unshuffle(a ^ b, k)``; the XOR runs on 8-byte words where the length allows."""
    word = np.uint64 if len(a) % 8 == 0 else np.uint8
    x = np.bitwise_xor(a.view(word), b.view(word)).view(np.uint8)
    return unshuffle(x, k) if k > 1 else x


def decode_delta(data: bytes | memoryview, base: bytes | memoryview, expected_id: str,
                 base_id: str, raw_length: int) -> memoryview:
    """Rebuilds and verifies a chunk stored as a delta (format.md §3.5).

    Args:
      data: the delta object's bytes, as read.
      base: the base chunk object's bytes, as read.
      expected_id, base_id: the chunk ids the manifest gives for the chunk and its base.
      raw_length: the raw byte count the manifest gives (the base has the same).

    Returns:
      The chunk's raw bytes, checked against ``expected_id``.

    Raises:
      CorruptChunkError: the delta's header or frame is invalid, the base is unusable, or the
        rebuilt bytes do not hash to ``expected_id`` (the message says whether the base alone
        still decodes to its own id).
    """
    if len(data) < HEADER.size:
        raise CorruptChunkError(f"delta object of {len(data)} bytes is shorter than its header",
                                chunk_id=expected_id)
    magic, version, codec, k, length = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or codec != CODEC_DELTA:
        raise CorruptChunkError(f"bad delta object header (codec {codec})", chunk_id=expected_id)
    if not 1 <= k <= MAX_ELEMENT_SIZE or length % k or length != raw_length:
        raise CorruptChunkError(f"delta header says element size {k} and {length} raw bytes, "
                                f"manifest says {raw_length} raw bytes", chunk_id=expected_id)
    x = np.frombuffer(_unzstd(memoryview(data)[HEADER.size:], raw_length, expected_id), np.uint8)
    try:
        raw = _xor_unshuffle(x, base_planes(base, base_id, raw_length, k), k)
    except CorruptChunkError as e:
        raise CorruptChunkError(f"its base chunk {base_id} is corrupt: {e}",
                                chunk_id=expected_id) from e
    if chunk_id(raw) != expected_id:
        try:
            decode_chunk(base, base_id, raw_length)
            where = "the delta object is corrupt (its base chunk checks out)"
        except CorruptChunkError as e:
            where = f"its base chunk {base_id} is corrupt: {e}"
        raise CorruptChunkError(f"rebuilt bytes do not match their chunk id: {where}",
                                chunk_id=expected_id)
    return memoryview(raw)
