"""A save's reused encode buffers and the block-wise sign move: the same bytes as before."""

from __future__ import annotations

import numpy as np
import pytest

import casstore
from casstore import _save_encode
from casstore._buffers import MIN_POOLED_BYTES, BufferPool
from casstore._shuffle import interleave, move_sign, shuffle, unmove_sign
from casstore.store import LocalStore, MemoryStore


def test_a_pool_hands_back_given_buffers_of_the_same_size_only():
    pool = BufferPool()
    a = pool.take(MIN_POOLED_BYTES)
    pool.give(memoryview(a)[:10])  # a view of a pooled-size buffer gives the buffer back
    assert pool.take(MIN_POOLED_BYTES) is a
    assert pool.reused == 1
    assert pool.take(MIN_POOLED_BYTES + 1) is not a
    small = pool.take(100)
    pool.give(small)
    pool.give(b"x" * MIN_POOLED_BYTES)  # bytes are not reused
    assert pool.take(100) is not small
    assert pool.reused == 1


def test_a_pool_keeps_at_most_max_free_buffers_dropping_the_oldest():
    """A size nothing takes again (a delta's, where whole chunks are raw) cannot pile up."""
    pool = BufferPool(max_free=2)
    buffers = [np.empty(MIN_POOLED_BYTES + i, np.uint8) for i in range(3)]
    for b in buffers:
        pool.give(b)
    assert pool.take(MIN_POOLED_BYTES) is not buffers[0]  # dropped: the oldest
    assert pool.take(MIN_POOLED_BYTES + 1) is buffers[1]
    assert pool.take(MIN_POOLED_BYTES + 2) is buffers[2]
    assert pool.reused == 2
    pool.give(buffers[0])
    pool.give(buffers[1])
    assert pool.take(MIN_POOLED_BYTES + 1) is buffers[1]  # taking frees a place
    pool.give(buffers[2])
    assert pool.take(MIN_POOLED_BYTES) is buffers[0]


@pytest.mark.parametrize("n", [8, 1000, 3 * 256 * 1024 + 5, 600_001])
def test_the_block_wise_sign_move_and_its_fused_inverse_match_the_whole_plane_ones(n):
    raw = np.random.default_rng(n).standard_normal(n).astype(np.float32).view(np.uint8)
    planes = shuffle(raw, 4)
    moved = move_sign(planes.copy())
    hi, lo = planes[-1].astype(np.uint16), planes[-2].astype(np.uint16)
    top = (((hi << 1) | (lo >> 7)) & 0xFF).astype(np.uint8)  # the 8 exponent bits
    below = ((lo & 0x7F) | (hi & 0x80)).astype(np.uint8)  # the sign above 7 mantissa bits
    assert np.array_equal(moved[-1], top)
    assert np.array_equal(moved[-2], below)
    assert np.array_equal(interleave(list(moved), moved=True), raw)
    back = unmove_sign(moved[-1], moved[-2])
    assert np.array_equal(back[0], planes[-1])
    assert np.array_equal(back[1], planes[-2])


def _objects(store) -> dict[str, bytes]:
    return {info.key: store.get(info.key) for info in store.list("chunks")}


def test_a_save_reusing_its_buffers_stores_the_same_objects_and_restores_bit_exact(
        tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    tree = {f"w{i}": (rng.standard_normal(300_000) * 0.02).astype(np.float32) for i in range(6)}
    tree["nu"] = (rng.standard_normal(300_000) * 1e-3).astype(np.float32) ** 2
    tree["half"] = rng.standard_normal(300_000).astype(np.float16)
    tree["ints"] = rng.integers(0, 2**31, 300_000).astype(np.int32)  # stored raw
    pools = []
    made = _save_encode.BufferPool

    def recording(**kwargs):
        pools.append(made(**kwargs))
        return pools[-1]

    monkeypatch.setattr(_save_encode, "BufferPool", recording)
    local, memory = LocalStore(tmp_path / "repo"), MemoryStore()
    for store in (local, memory):
        casstore.save(store, 1, tree, chunk_size_bytes=2**20, max_workers=2, shuffle=True)
    assert len(pools) == 1
    assert pools[0].reused > 0
    assert _objects(local) == _objects(memory)
    restored = casstore.restore(local, 1)
    for key, value in tree.items():
        assert restored[key].tobytes() == value.tobytes(), key
