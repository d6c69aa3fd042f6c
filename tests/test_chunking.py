"""The chunk grid (format.md §3.3) and the chunk object encoding (§3.2)."""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from casstore import CorruptChunkError
from casstore._chunking import block_bytes, grid
from casstore._codec import (
    CODEC_RAW,
    CODEC_SHUFFLE_ZSTD,
    CODEC_ZSTD,
    HEADER,
    MAGIC,
    chunk_id,
    decode_chunk,
    encode_chunk,
    shuffle,
    unshuffle,
)

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


def _trained_like(n: int, dtype=np.float32) -> np.ndarray:
    """Values like trained weights: N(0, 0.02), whose mantissas are random."""
    return (np.random.default_rng(1).standard_normal(n) * 0.02).astype(dtype)


@given(data=st.binary(max_size=400), element_size=st.sampled_from([1, 2, 3, 4, 8, 16]))
def test_shuffle_is_the_hdf5_byte_shuffle_and_unshuffle_inverts_it(data, element_size):
    raw = data[:len(data) - len(data) % element_size]
    n = len(raw) // element_size
    expected = bytes(raw[i * element_size + j] for j in range(element_size) for i in range(n))
    assert shuffle(raw, element_size).tobytes() == expected
    assert unshuffle(expected, element_size).tobytes() == raw


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("n", [4000, 2**20])  # judged whole / judged on samples
def test_float_chunks_use_the_shuffle_codec_and_store_fewer_bytes(dtype, n):
    raw = memoryview(_trained_like(n, dtype).view(np.uint8))
    element_size = np.dtype(dtype).itemsize
    data = encode_chunk(raw, element_size=element_size)
    _, _, codec, stored_size, length = HEADER.unpack_from(data)
    assert (codec, stored_size, length) == (CODEC_SHUFFLE_ZSTD, element_size, len(raw))
    assert len(data) <= 0.875 * len(raw)
    assert len(data) < len(encode_chunk(raw))  # plain zstd, or raw, is larger
    assert len(encode_chunk(raw, element_size=element_size, shuffle=False)) == len(
        encode_chunk(raw))
    assert bytes(decode_chunk(data, chunk_id(raw), len(raw))) == bytes(raw)


def test_shuffle_is_not_used_when_plain_zstd_is_smaller_or_sizes_do_not_divide():
    text = memoryview(np.frombuffer(b"the quick brown fox jumps " * 4000, np.uint32)).cast("B")
    assert HEADER.unpack_from(encode_chunk(text, element_size=4))[2] == CODEC_ZSTD
    odd = memoryview(np.zeros(1001, np.uint8))
    data = encode_chunk(odd, element_size=4)
    assert HEADER.unpack_from(data)[2:4] == (CODEC_ZSTD, 0)
    noise = memoryview(np.random.default_rng(0).integers(0, 256, 2**19, np.uint8))
    assert HEADER.unpack_from(encode_chunk(noise, element_size=4))[2] == CODEC_RAW
    with pytest.raises(ValueError, match="element_size"):
        encode_chunk(odd, element_size=17)


@pytest.mark.parametrize("codec,element_size", [(CODEC_SHUFFLE_ZSTD, 0), (CODEC_SHUFFLE_ZSTD, 1),
                                                (CODEC_SHUFFLE_ZSTD, 3), (CODEC_SHUFFLE_ZSTD, 17),
                                                (CODEC_ZSTD, 4), (CODEC_RAW, 4)])
def test_decode_rejects_an_element_size_that_does_not_fit_the_codec(codec, element_size):
    raw = memoryview(_trained_like(1000)).cast("B")
    payload = encode_chunk(raw, element_size=4)[HEADER.size:]
    data = HEADER.pack(MAGIC, 1, codec, element_size, len(raw)) + payload
    with pytest.raises(CorruptChunkError, match="element size"):
        decode_chunk(data, chunk_id(raw), len(raw))


def test_a_shuffled_chunk_with_the_wrong_element_size_fails_its_hash_check():
    raw = memoryview(_trained_like(1000)).cast("B")
    data = bytearray(encode_chunk(raw, element_size=4))
    data[6] = 2  # the element size: the frame decodes, but unshuffles into other bytes
    with pytest.raises(CorruptChunkError, match="chunk id"):
        decode_chunk(bytes(data), chunk_id(raw), len(raw))


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
