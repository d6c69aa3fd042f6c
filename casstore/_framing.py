"""Checking a stored chunk or delta object's framing without decoding it (format.md §3.2,
§3.5): what a copy checks of each object it passes on without ``verify``."""

from __future__ import annotations

import struct
from collections.abc import Callable

import zstandard

from ._codec import HEADER, MAGIC, MAX_ELEMENT_SIZE, check_size, refuse_newer
from ._errors import CorruptChunkError

_CODEC_RAW, _CODEC_ZSTD, _CODEC_SHUFFLE, _CODEC_DELTA = 0, 1, 2, 3
_PLANES = (3, 4, 5)


def check_framing(data: bytes | memoryview, cid: str, raw_length: int, *,
                  delta: bool = False) -> None:
    """Checks a stored chunk or delta object's framing without decoding it (format.md §3.2,
    §3.5): its size (:func:`~casstore._codec.check_size`), header, raw length, payload length
    of a raw chunk, plane table, and the content size of each zstd frame.

    Raises:
      CorruptChunkError: a check fails (names the chunk id).
      UnsupportedFormatError: another header version or an unknown codec (a newer writer's).
    """
    def bad(why: str) -> CorruptChunkError:
        return CorruptChunkError(f"bad chunk object: {why}", chunk_id=cid)

    check_size(data, cid, raw_length)
    if len(data) < HEADER.size:
        raise bad(f"{len(data)} bytes, shorter than the header")
    magic, version, codec, k, length = HEADER.unpack_from(data)
    if magic != MAGIC or version == 0:
        raise bad("wrong magic or version")
    refuse_newer(version, codec, cid)
    if length != raw_length:
        raise bad(f"header says {length} raw bytes, manifest says {raw_length}")
    if delta != (codec == _CODEC_DELTA):
        raise bad(f"codec {codec} in a {'delta' if delta else 'chunk'} object")
    payload = memoryview(data)[HEADER.size:]
    if codec == _CODEC_RAW:
        if k != 0 or len(payload) != raw_length:
            raise bad(f"raw payload of {len(payload)} bytes for {raw_length}")
    elif codec in (_CODEC_ZSTD, _CODEC_SHUFFLE):
        if (k != 0) if codec == _CODEC_ZSTD else not 2 <= k <= MAX_ELEMENT_SIZE:
            raise bad(f"element size {k} for codec {codec}")
        _check_frame_size(payload, raw_length, bad)
    elif codec in _PLANES:
        if not (1 if codec == _CODEC_DELTA else 2) <= k <= MAX_ELEMENT_SIZE or length % k:
            raise bad(f"element size {k} for codec {codec} and {length} raw bytes")
        _check_planes(payload, k, raw_length // k, bad)
    else:
        raise bad(f"unknown codec {codec}")


def _check_planes(payload: memoryview, k: int, n: int, bad: Callable) -> None:
    if len(payload) < 4 * k:
        raise bad("payload shorter than its plane table")
    lengths = struct.unpack_from(f"<{k}I", payload)
    if max(lengths) > n or sum(lengths) != len(payload) - 4 * k:
        raise bad(f"plane lengths {list(lengths)} do not fit the payload")
    position = 4 * k
    for length in lengths:
        if length < n:
            _check_frame_size(payload[position:position + length], n, bad)
        position += length


def _check_frame_size(frame: memoryview, size: int, bad: Callable) -> None:
    """Checks that ``frame`` begins with one whole zstd frame declaring ``size`` content bytes:
    its blocks are walked by their 3-byte headers (RFC 8878 §3.1.1.2), none decoded, so a
    frame cut short (a body that ended early) is refused. Bytes after it are ignored, as a
    reader ignores them (format.md §3.2)."""
    try:
        declared = zstandard.frame_content_size(frame)
        position = zstandard.frame_header_size(frame)
        checksum = zstandard.get_frame_parameters(frame).has_checksum
    except zstandard.ZstdError as e:
        raise bad(f"not a zstd frame: {e}") from e
    if declared != size:
        raise bad(f"zstd frame declares {declared} bytes, expected {size}")
    last = False
    while not last:
        if position + 3 > len(frame):
            raise bad(f"zstd frame cut short at {len(frame)} bytes")
        header = int.from_bytes(frame[position:position + 3], "little")
        last, kind = bool(header & 1), (header >> 1) & 3
        if kind == 3:
            raise bad("reserved zstd block type")
        position += 3 + (1 if kind == 1 else header >> 3)  # an RLE block holds one byte
    if position + 4 * checksum > len(frame):
        raise bad(f"zstd frame of {position + 4 * checksum} bytes cut short at {len(frame)}")
