"""The chunk grid (format.md §3.3) and the chunk object encoding (§3.2)."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from casstore import CorruptChunkError
from casstore._chunking import block_bytes, grid
from casstore._codec import CODEC_RAW, CODEC_ZSTD, HEADER, chunk_id, decode_chunk, encode_chunk

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple)


@given(shape=shapes, itemsize=st.sampled_from([1, 2, 4, 8, 16]),
       chunk=st.integers(1, 3000))
def test_grid_tiles_the_shape_with_bounded_contiguous_blocks(shape, itemsize, chunk):
    blocks = grid(shape, itemsize, chunk)
    covered = np.zeros(shape, np.int32)
    offsets = []
    for start, stop in blocks:
        covered[tuple(slice(a, b) for a, b in zip(start, stop))] += 1
        volume = math.prod(b - a for a, b in zip(start, stop))
        assert volume * itemsize <= max(chunk, itemsize)
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        offsets.append((sum(a * s for a, s in zip(start, strides)), volume))
    assert np.all(covered == 1)
    # C-contiguous: each block starts where the previous one ended.
    position = 0
    for offset, volume in offsets:
        assert offset == position
        position += volume
    assert grid(shape, itemsize, chunk) == blocks  # stable


def test_block_bytes_is_zero_copy_for_contiguous_input():
    a = np.arange(100, dtype=np.float32).reshape(10, 10)
    view = block_bytes(a, (2, 0), (4, 10))
    assert np.shares_memory(np.frombuffer(view, np.uint8), a)
    assert bytes(view) == a[2:4].tobytes()
    be = a.astype(">f4")
    assert bytes(block_bytes(be, (2, 0), (4, 10))) == a[2:4].tobytes()


def test_encode_decode_roundtrip_and_codec_choice():
    compressible = memoryview(np.zeros(10_000, np.float32)).cast("B")
    noise = memoryview(np.random.default_rng(0).integers(0, 256, 10_000, np.uint8)).cast("B")
    for raw, codec in ((compressible, CODEC_ZSTD), (noise, CODEC_RAW)):
        data = encode_chunk(raw)
        assert HEADER.unpack_from(data)[2] == codec
        assert bytes(decode_chunk(data, chunk_id(raw), len(raw))) == bytes(raw)
    assert len(encode_chunk(compressible)) < 200


def test_chunk_id_ignores_the_compression_level():
    raw = memoryview(np.arange(5000, dtype=np.int64) % 7).cast("B")
    a, b = encode_chunk(raw, level=1), encode_chunk(raw, level=19)
    assert a != b
    for data in (a, b):
        decode_chunk(data, chunk_id(raw), len(raw))


@pytest.mark.parametrize("mutate", [
    lambda d: d[:10], lambda d: b"XXXX" + d[4:], lambda d: d[:5] + b"\x07" + d[6:],
    lambda d: d[:-1] + bytes([d[-1] ^ 1])])
def test_decode_rejects_damaged_objects(mutate):
    raw = memoryview(np.zeros(1000, np.int16)).cast("B")
    with pytest.raises(CorruptChunkError):
        decode_chunk(mutate(encode_chunk(raw)), chunk_id(raw), len(raw))


def test_decode_rejects_wrong_length_and_id():
    raw = memoryview(b"abc" * 100)
    data = encode_chunk(raw)
    with pytest.raises(CorruptChunkError, match="manifest says"):
        decode_chunk(data, chunk_id(raw), 299)
    with pytest.raises(CorruptChunkError, match="chunk id"):
        decode_chunk(data, "0" * 32, 300)
