"""A save of the same jax array objects again neither copies them to the host nor hashes them
(casstore._known_chunks), and never lets that skip store less than the step needs."""

import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import casstore
from casstore import _chunking, _known_chunks, _save_encode, _save_plan
from casstore.store import LocalStore, MemoryStore

from conftest import GatedStore, object_store

CHUNK = 64 * 1024


@pytest.fixture
def counts(monkeypatch):
    """Counts the host copies started for device blocks and the chunk ids hashed at encoding,
    with CPU devices taken for accelerators (the path a GPU takes)."""
    monkeypatch.setattr(_chunking, "on_host", lambda x: False)
    seen = {"copies": 0, "hashes": 0}

    def counted(name, real):
        def wrapper(*args, **kwargs):
            seen[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(_save_plan, "start_host_copy",
                        counted("copies", _save_plan.start_host_copy))
    monkeypatch.setattr(_save_encode, "chunk_id", counted("hashes", _save_encode.chunk_id))
    return seen


def state(seed=0):
    rng = np.random.default_rng(seed)
    tree = {f"layer{i}": {"w": jnp.asarray(rng.standard_normal((256, 200), np.float32)),
                          "b": jnp.asarray(rng.standard_normal(200, np.float32))}
            for i in range(4)}
    tree["sharded"] = jax.device_put(jnp.asarray(rng.standard_normal((64, 512), np.float32)),
                                     NamedSharding(jax.make_mesh((4, 2), ("a", "b"),
                                                                 devices=jax.devices("cpu")[:8]),
                                                   P("a", "b")))
    tree["np"] = rng.standard_normal(30_000).astype(np.float32)  # numpy: hashed every time
    return tree


def assert_restores(store, step, tree):
    restored = casstore.restore(store, step)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(tree),
                                 jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))


@pytest.fixture(params=["local", "seaweedfs"])
def store(request, tmp_path):
    if request.param == "seaweedfs":
        return object_store(request.getfixturevalue("object_servers")["seaweedfs"])
    return LocalStore(tmp_path / "repo")


def test_a_second_save_of_the_same_jax_arrays_copies_and_hashes_only_the_numpy_leaf(store,
                                                                                    counts):
    tree = state()
    first = casstore.save(store, 1, tree, chunk_size_bytes=CHUNK)
    assert counts["copies"] >= 4 * 4 + 8
    assert counts["hashes"] == first.new_chunks
    counts.update(copies=0, hashes=0)
    second = casstore.save(store, 2, tree, chunk_size_bytes=CHUNK)
    numpy_chunks = -(-tree["np"].nbytes // CHUNK)
    assert (counts["copies"], counts["hashes"]) == (0, numpy_chunks)
    assert second.new_chunks == 0
    assert second.reused_chunks == first.new_chunks + first.reused_chunks
    assert_restores(store, 2, tree)


def test_new_arrays_with_the_same_values_are_copied_and_hashed_again(counts):
    store, tree = MemoryStore(), state()
    casstore.save(store, 1, tree, chunk_size_bytes=CHUNK)
    copied = jax.tree.map(lambda x: x.copy() if isinstance(x, np.ndarray) else jnp.copy(x), tree)
    counts.update(copies=0, hashes=0)
    info = casstore.save(store, 2, copied, chunk_size_bytes=CHUNK)
    assert counts["copies"] >= 4 * 4 + 8
    assert counts["hashes"] == info.reused_chunks
    assert info.new_chunks == 0


def test_remembered_chunks_that_the_repository_lost_are_read_and_stored_again(tmp_path, counts):
    tree = state()
    first = casstore.save(tmp_path, 1, tree, chunk_size_bytes=CHUNK)
    casstore.delete(tmp_path, 1)
    assert casstore.gc(tmp_path, grace_period_s=0).deleted_chunks > 0
    counts.update(copies=0, hashes=0)
    again = casstore.save(tmp_path, 2, tree, chunk_size_bytes=CHUNK)
    assert again.new_chunks == first.new_chunks
    assert counts["copies"] > 0
    assert casstore.verify(tmp_path, 2).ok
    assert_restores(tmp_path, 2, tree)


def test_a_stored_dtype_and_a_chunk_size_are_part_of_what_is_remembered(tmp_path, counts):
    tree = {"w": jnp.linspace(-1, 1, 100_000, dtype=jnp.float32)}
    casstore.save(tmp_path, 1, tree, chunk_size_bytes=CHUNK, dtypes={"": jnp.bfloat16})
    counts.update(copies=0, hashes=0)
    casstore.save(tmp_path, 2, tree, chunk_size_bytes=CHUNK, dtypes={"": jnp.bfloat16})
    assert counts == {"copies": 0, "hashes": 0}
    for step, kwargs in ((3, {"chunk_size_bytes": CHUNK}),
                         (4, {"chunk_size_bytes": CHUNK // 2, "dtypes": {"": jnp.bfloat16}})):
        counts.update(copies=0, hashes=0)
        info = casstore.save(tmp_path, step, tree, **kwargs)
        assert counts["copies"] > 0, step
        assert counts["hashes"] > 0, step
        assert info.new_chunks > 0, step
    np.testing.assert_array_equal(casstore.restore(tmp_path, 2)["w"],
                                  np.asarray(tree["w"].astype(jnp.bfloat16)))
    np.testing.assert_array_equal(casstore.restore(tmp_path, 3)["w"], np.asarray(tree["w"]))
    np.testing.assert_array_equal(casstore.restore(tmp_path, 4)["w"],
                                  np.asarray(tree["w"].astype(jnp.bfloat16)))


def test_an_async_save_of_remembered_arrays_survives_their_donation(counts):
    """Arrays remembered from a save to another repository: this one lacks their chunks, so
    staging copies them while they are alive; the stored ones are handed over as ids."""
    donate = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 7, t), donate_argnums=0)
    tree = {k: v for k, v in state().items() if k != "np"}
    expected = jax.tree.map(np.array, tree)
    casstore.save(MemoryStore(), 1, tree, chunk_size_bytes=CHUNK)  # remembered there
    store = GatedStore()
    store.gate.set()
    with casstore.CheckpointManager(store, chunk_size_bytes=CHUNK) as mngr:
        mngr.save(1, {"old": tree["layer0"]})  # this repository stores layer0 only
        mngr.wait_until_finished()
        store.gate.clear()
        counts.update(copies=0, hashes=0)
        mngr.save(2, tree)
        assert counts["copies"] == 3 * 4 + 8  # w's and sharded's blocks but layer0's, at staging
        tree = donate(tree)  # the chunk writes are held: the save is in flight
        jax.block_until_ready(tree)
        store.gate.set()
        mngr.wait_until_finished()
        assert mngr.last_save_info.new_chunks == 3 * (4 + 1) + 8  # 4 blocks of w, a pack of b
    assert_restores(store, 2, expected)


def test_the_table_holds_no_array_alive_and_is_swept(tmp_path, monkeypatch):
    # A fresh table: arrays that earlier tests in this process keep alive stay in it (rightly)
    # and would move the size after a sweep by however many there are.
    for name, value in (("_ids", {}), ("_arrays", {}), ("_swept_at", 1024)):
        monkeypatch.setattr(_known_chunks, name, value)
    x = jnp.arange(300_000, dtype=jnp.float32)
    ref = weakref.ref(x)
    casstore.save(tmp_path, 0, {"x": x}, chunk_size_bytes=CHUNK)
    del x
    gc.collect()
    assert ref() is None
    store = MemoryStore()
    for step in range(40):  # 40 saves x about 100 blocks of new arrays
        # Each save's blocks have other bounds: a freed array's id is reused by the next one,
        # and with the same bounds its entries would be overwritten rather than swept.
        casstore.save(store, step, {"x": jnp.full(100 * 1024, step, jnp.float32)},
                      chunk_size_bytes=4096 + 4 * step)
    assert _known_chunks.size() <= 2 * 1024 + 100


def test_threads_saving_the_same_arrays_agree(tmp_path):
    tree = state()
    errors = []

    def save(step):
        try:
            casstore.save(tmp_path, step, tree, chunk_size_bytes=CHUNK)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=save, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for step in range(4):
        assert_restores(tmp_path, step, tree)


def test_a_reopened_manager_hands_remembered_chunks_over_by_id(tmp_path, counts):
    tree = {k: v for k, v in state().items() if k != "np"}
    with casstore.CheckpointManager(tmp_path, chunk_size_bytes=CHUNK) as mngr:
        mngr.save(1, tree)
    counts.update(copies=0, hashes=0)
    with casstore.CheckpointManager(tmp_path, chunk_size_bytes=CHUNK) as mngr:
        mngr.save(2, tree)  # its first save: the latest manifest is read once, at staging
        mngr.wait_until_finished()
        assert counts == {"copies": 0, "hashes": 0}
        assert mngr.last_save_info.new_chunks == 0
    assert_restores(tmp_path, 2, tree)


def test_a_save_after_a_restore_reads_no_unchanged_restored_array_back(tmp_path, counts):
    """Resuming from a checkpoint: the restored arrays hold the chunks' checked bytes, so the
    next save of a frozen one copies and hashes nothing of it."""
    tree = {k: v for k, v in state().items() if k not in ("np", "sharded")}
    casstore.save(tmp_path, 1, tree, chunk_size_bytes=CHUNK)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    restored = casstore.restore(tmp_path, 1, target=target)
    restored["layer0"]["w"] = restored["layer0"]["w"] + 1  # trained: a new array
    counts.update(copies=0, hashes=0)
    info = casstore.save(tmp_path, 2, restored, chunk_size_bytes=CHUNK)
    assert counts == {"copies": 4, "hashes": 4}  # layer0's w; each b is a pack of one leaf,
    assert info.new_chunks == 4  # whose chunk holds its bytes alone: remembered too
    assert_restores(tmp_path, 2, restored)


def test_a_restore_that_casts_or_pads_remembers_nothing(tmp_path, counts):
    w = jnp.arange(60_000, dtype=jnp.float32)
    casstore.save(tmp_path, 1, {"w": w}, chunk_size_bytes=CHUNK)
    # int32: the same itemsize, so the same block bounds as the saved float32 chunks
    casts = casstore.restore(tmp_path, 1, target={"w": jax.ShapeDtypeStruct(w.shape,
                                                                            jnp.int32)})
    pads = casstore.restore(tmp_path, 1, target={"w": jax.ShapeDtypeStruct((70_000,),
                                                                           jnp.float32)},
                            strict=False)
    for step, tree in ((2, casts), (3, pads)):
        counts.update(copies=0, hashes=0)
        info = casstore.save(tmp_path, step, tree, chunk_size_bytes=CHUNK)
        assert counts["hashes"] == info.new_chunks + info.reused_chunks, step
        assert_restores(tmp_path, step, tree)
