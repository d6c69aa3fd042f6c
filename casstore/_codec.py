"""Chunk ids and the chunk object encoding (format.md §3.1 and §3.2).

A chunk id is the xxh3-128 of the raw bytes, as 32 lowercase hex digits. A chunk object is a
16-byte header (magic, version, codec, raw length) followed by the raw bytes or one zstd frame.
zstandard and xxhash release the GIL, so these functions run in parallel in a thread pool.
"""

from __future__ import annotations

import re
import struct
import threading

import xxhash
import zstandard

from ._errors import CorruptChunkError

MAGIC = b"CAS1"
VERSION = 1
CODEC_RAW = 0
CODEC_ZSTD = 1
HEADER = struct.Struct("<4sBBHQ")  # format.md §3.2: magic, version, codec, reserved, raw_length
MAX_RAW_LENGTH = 2**31
DEFAULT_ZSTD_LEVEL = 1
MIN_SAVING = 1 / 8  # keep zstd only if it saves this fraction of the raw size
SAMPLE_BYTES = 64 * 1024
_CHUNK_ID = re.compile(r"[0-9a-f]{32}")
_local = threading.local()


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


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """A per-thread compressor: zstandard contexts must not be shared between threads."""
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def _worth_compressing(raw: memoryview, level: int) -> bool:
    """Whether zstd is likely to save 1/8: tried on two 64 KiB samples of large chunks first."""
    n = len(raw)
    if n < 4 * SAMPLE_BYTES:
        return True
    samples = (raw[:SAMPLE_BYTES], raw[n // 2:n // 2 + SAMPLE_BYTES])
    packed = sum(len(_compressor(level).compress(s)) for s in samples)
    return packed <= 2 * SAMPLE_BYTES * (1 - MIN_SAVING)


def encode_chunk(raw: memoryview, *, level: int = DEFAULT_ZSTD_LEVEL) -> bytes:
    """Encodes raw chunk bytes as a chunk object (format.md §3.2).

    zstd at ``level`` is kept only if it saves at least 1/8 of the size (for large chunks,
    judged first on two 64 KiB samples, so incompressible data such as trained float weights
    costs no full compression); otherwise the raw bytes are stored (codec 0). A zstd payload is
    decoded again and compared before it is returned (restic's verify-after-encode), so a faulty
    compressor cannot store wrong bytes.

    Args:
      raw: raw bytes, at most 2**31.
      level: zstd compression level.

    Returns:
      The chunk object: 16-byte header plus payload.

    Raises:
      ValueError: ``raw`` is longer than 2**31 bytes.
      CorruptChunkError: the compressed payload does not decode back to ``raw``.
    """
    n = len(raw)
    if n > MAX_RAW_LENGTH:
        raise ValueError(f"chunk of {n} bytes exceeds the {MAX_RAW_LENGTH}-byte limit")
    packed = _compressor(level).compress(raw) if _worth_compressing(raw, level) else None
    if packed is not None and len(packed) <= n * (1 - MIN_SAVING):
        if _decompressor().decompress(packed, max_output_size=n) != raw:
            raise CorruptChunkError("zstd output does not decode back to its input")
        return HEADER.pack(MAGIC, VERSION, CODEC_ZSTD, 0, n) + packed
    return b"".join((HEADER.pack(MAGIC, VERSION, CODEC_RAW, 0, n), raw))


def decode_chunk(data: bytes, expected_id: str, raw_length: int) -> memoryview:
    """Decodes and verifies a chunk object read from storage (format.md §3.2).

    Checks the header, that the raw length equals ``raw_length``, that a zstd frame declares
    exactly that content size (so a frame that would expand further is rejected before it is
    decompressed), and that the decoded bytes hash to ``expected_id``.

    Args:
      data: the chunk object's bytes, as read.
      expected_id: the chunk id the manifest gives.
      raw_length: the raw byte count the manifest gives.

    Returns:
      The raw bytes, ``raw_length`` long.

    Raises:
      CorruptChunkError: any check fails (the message says which; the caller adds step and
        key path).
    """
    if len(data) < HEADER.size:
        raise CorruptChunkError(f"chunk object of {len(data)} bytes is shorter than its header",
                                chunk_id=expected_id)
    magic, version, codec, reserved, length = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or reserved != 0:
        raise CorruptChunkError("bad chunk header", chunk_id=expected_id)
    if length != raw_length:
        raise CorruptChunkError(f"chunk header says {length} raw bytes, manifest says "
                                f"{raw_length}", chunk_id=expected_id)
    payload = memoryview(data)[HEADER.size:]
    if codec == CODEC_RAW:
        raw = payload
    elif codec == CODEC_ZSTD:
        raw = memoryview(_unzstd(payload, raw_length, expected_id))
    else:
        raise CorruptChunkError(f"unknown chunk codec {codec}", chunk_id=expected_id)
    if len(raw) != raw_length:
        raise CorruptChunkError(f"chunk decodes to {len(raw)} bytes, expected {raw_length}",
                                chunk_id=expected_id)
    if chunk_id(raw) != expected_id:
        raise CorruptChunkError("chunk bytes do not match their chunk id", chunk_id=expected_id)
    return raw


def _unzstd(payload: memoryview, raw_length: int, expected_id: str) -> bytes:
    """Decompresses one zstd frame whose declared content size must equal ``raw_length``."""
    try:
        declared = zstandard.frame_content_size(payload)
        if declared != raw_length:
            raise CorruptChunkError(f"zstd frame declares {declared} bytes, expected "
                                    f"{raw_length}", chunk_id=expected_id)
        return _decompressor().decompress(payload, max_output_size=raw_length)
    except zstandard.ZstdError as e:
        raise CorruptChunkError(f"zstd frame does not decode: {e}", chunk_id=expected_id) from e
