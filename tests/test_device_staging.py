"""Device staging (casstore._device_staging): an async save copies accelerator arrays on their
devices where there is room and makes their host copies in the background. CPU devices of jax
stand in for accelerators here (on_host patched false, room patched); tests/test_gpu.py runs
the same on a GPU."""

import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import casstore
from casstore import _chunking, _device_staging, _known_chunks, _save_plan

from conftest import GatedStore

ROOMY = {"bytes_limit": 2**40, "bytes_in_use": 0, "peak_bytes_in_use": 0}


@pytest.fixture
def host_copies(monkeypatch):
    """CPU devices taken for accelerators with room for a copy; returns the names of the threads
    that started host copies (block copies and batched whole copies)."""
    for module in (_chunking, _save_plan, _device_staging):
        monkeypatch.setattr(module, "on_host", lambda x: False)
    monkeypatch.setattr(_device_staging, "_stats", lambda device: dict(ROOMY))
    monkeypatch.setattr(_device_staging, "_after_copy", {})
    threads = []
    block, batch = _save_plan.start_host_copy, _save_plan.start_host_copies
    monkeypatch.setattr(_save_plan, "start_host_copy", lambda *a: threads.append(
        threading.current_thread().name) or block(*a))
    monkeypatch.setattr(_save_plan, "start_host_copies", lambda xs: threads.append(
        threading.current_thread().name) or batch(xs))
    return threads


def state(seed=0):
    rng = np.random.default_rng(seed)
    return {"big": jnp.asarray(rng.standard_normal(5 * 2**15).astype(np.float32)),  # 5 blocks
            "few": jnp.asarray(rng.standard_normal(3 * 2**14).astype(np.float32)),  # 2 blocks
            "small": {f"b{k}": jnp.full(1000, k, jnp.float32) for k in range(4)},  # a pack
            "sharded": jax.device_put(jnp.asarray(rng.standard_normal((256, 256), np.float32)),
                                      NamedSharding(jax.make_mesh((4, 2), ("d", "m")),
                                                    P("d", "m")))}


@pytest.mark.parametrize("cap", [None, 2**18])
def test_save_returns_before_any_host_copy_and_keeps_the_values_through_donation(host_copies,
                                                                                 cap):
    tree = state()
    expected = jax.tree.map(np.array, tree)
    store = GatedStore()
    with casstore.CheckpointManager(store, chunk_size_bytes=2**17,
                                    max_staging_bytes=cap) as mngr:
        mngr.save(1, tree)  # chunk writes are held: the save is in flight
        assert mngr.last_staging_peak_bytes == 0  # nothing staged in host memory by save()
        caller = threading.current_thread().name
        assert caller not in host_copies
        tree = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 7, t), donate_argnums=0)(tree)
        jax.block_until_ready(tree)
        store.gate.set()
        mngr.wait_until_finished()
        assert host_copies
        assert caller not in host_copies
        restored = mngr.restore(1)
    for (path, value), want in zip(jax.tree_util.tree_leaves_with_path(restored),
                                   jax.tree.leaves(expected)):
        assert np.asarray(value).tobytes() == want.tobytes(), path


def test_the_ids_hashed_from_a_device_copy_are_remembered_for_the_callers_arrays(host_copies):
    tree = state()
    with casstore.CheckpointManager(GatedStore(), chunk_size_bytes=2**17) as mngr:
        mngr._saver.store.gate.set()
        mngr.save(1, tree)
        mngr.wait_until_finished()
        assert all(_known_chunks.remembered(x) for x in jax.tree.leaves(tree))
        host_copies.clear()
        mngr.save(2, tree)  # the same arrays: neither copied nor read back
        mngr.wait_until_finished()
        assert host_copies == []
        assert mngr.last_save_info.new_chunks == 0


def test_without_room_on_the_device_save_stages_host_copies_itself(host_copies, monkeypatch):
    monkeypatch.setattr(_device_staging, "_stats", lambda device: {**ROOMY, "bytes_limit": 0})
    tree = state()
    store = GatedStore()
    with casstore.CheckpointManager(store, chunk_size_bytes=2**17) as mngr:
        mngr.save(1, tree)
        assert mngr.last_staging_peak_bytes > 0
        assert threading.current_thread().name in host_copies
        store.gate.set()
    np.testing.assert_array_equal(casstore.restore(store, 1)["big"], np.asarray(tree["big"]))


def test_numpy_leaves_are_still_copied_by_save_and_jax_leaves_on_the_device(host_copies):
    w = np.arange(100_000, dtype=np.float32)
    x = jnp.arange(100_000, dtype=jnp.float32) * 2
    store = GatedStore()
    with casstore.CheckpointManager(store, chunk_size_bytes=2**17) as mngr:
        mngr.save(1, {"w": w, "x": x})
        assert mngr.last_staging_peak_bytes == w.nbytes  # w's copy; x's is on its device
        w[:] = -1  # overwritten once save() returned
        store.gate.set()
    restored = casstore.restore(store, 1)
    np.testing.assert_array_equal(restored["w"], np.arange(100_000, dtype=np.float32))
    np.testing.assert_array_equal(restored["x"], np.asarray(x))


def test_a_copy_the_device_refuses_is_not_made_and_save_stages_on_the_host(host_copies,
                                                                          monkeypatch):
    tree = state()
    real = jax.device_put

    def refuse(*args, may_alias=None, **kwargs):
        if may_alias is False:  # the save's copy
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return real(*args, may_alias=may_alias, **kwargs)

    monkeypatch.setattr(jax, "device_put", refuse)
    store = GatedStore()
    with casstore.CheckpointManager(store, chunk_size_bytes=2**17) as mngr:
        mngr.save(1, tree)
        assert mngr.last_staging_peak_bytes > 0
        store.gate.set()
    np.testing.assert_array_equal(casstore.restore(store, 1)["big"], np.asarray(tree["big"]))


def test_room_is_the_limit_less_the_peak_and_a_margin(monkeypatch):
    stats = {"bytes_limit": 100 * 2**30, "bytes_in_use": 10 * 2**30,
             "peak_bytes_in_use": 40 * 2**30}
    monkeypatch.setattr(_device_staging, "_stats", lambda device: stats)
    monkeypatch.setattr(_device_staging, "_after_copy", {})
    used = _device_staging._used("gpu")
    assert used == 40 * 2**30
    assert _device_staging._room("gpu", used) == 55 * 2**30
    # a peak that a save's copy set (nothing higher since) counts as the peak before it
    _device_staging._after_copy["gpu"] = (40 * 2**30, 25 * 2**30)
    assert _device_staging._used("gpu") == 25 * 2**30
    stats["peak_bytes_in_use"] += 1  # a higher peak since: the step's, as far as we know
    assert _device_staging._used("gpu") == 40 * 2**30 + 1
    stats["bytes_in_use"] = 50 * 2**30
    assert _device_staging._used("gpu") == 50 * 2**30
    monkeypatch.setattr(_device_staging, "_stats", lambda device: {})  # no statistics
    assert _device_staging._used("cpu") is None

    def broken():
        raise RuntimeError("UNIMPLEMENTED")

    monkeypatch.undo()
    assert _device_staging._stats(types.SimpleNamespace(memory_stats=broken)) == {}
    assert _device_staging._stats(types.SimpleNamespace(memory_stats=lambda: None)) == {}


def test_a_copy_is_made_only_if_every_device_has_room_for_its_part(host_copies, monkeypatch):
    sharded = state()["sharded"]  # 256 KiB over 8 devices: 32 KiB on each
    limits = dict.fromkeys(jax.devices(), int(2**15 / (1 - _device_staging.MARGIN)) + 1)
    monkeypatch.setattr(_device_staging, "_stats", lambda device: {
        "bytes_limit": limits[device], "bytes_in_use": 0, "peak_bytes_in_use": 0})
    arrays, copied = _device_staging.copy_on_device({0: sharded, 1: sharded})
    assert copied == {0, 1}
    assert arrays[0] is arrays[1]  # one copy of an array saved as two leaves
    assert arrays[0] is not sharded
    assert arrays[0].sharding == sharded.sharding
    np.testing.assert_array_equal(np.asarray(arrays[0]), np.asarray(sharded))
    limits[jax.devices()[5]] -= 2
    arrays, copied = _device_staging.copy_on_device({0: sharded})
    assert copied == set()
    assert arrays[0] is sharded


def test_packs_of_copies_only_are_read_in_the_background_beside_a_mixed_pack(host_copies,
                                                                            monkeypatch):
    """A pack that holds a numpy leaf is read by save(), its device leaves copied then; the
    packs of device copies only are not (they are read, and copied, in the background)."""
    sizes = []
    real = _save_plan.start_host_copies
    monkeypatch.setattr(_save_plan, "start_host_copies", lambda xs: (
        sizes.append((threading.current_thread().name, len(xs))), real(xs))[1])
    tree = {"a": {"n": np.ones(1000, np.float32), "d": jnp.zeros(1000, jnp.float32)},
            **{f"p{k:02d}": {"x": jnp.full(1000, k, jnp.float32),
                             "y": jnp.full(1000, -k, jnp.float32)} for k in range(10)}}
    store = GatedStore()
    with casstore.CheckpointManager(store, chunk_size_bytes=2**17) as mngr:
        mngr.save(1, tree)
        caller = threading.current_thread().name
        assert [n for name, n in sizes if name == caller] == [1]  # "d", with "n"'s pack
        store.gate.set()
    assert sorted(n for name, n in sizes if name != caller) == [2] * 10
    restored = casstore.restore(store, 1)
    assert all((restored[f"p{k:02d}"]["y"] == -k).all() for k in range(10))
