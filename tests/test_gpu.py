"""The accelerator path on a real GPU (issue 12). Every test carries the ``gpu`` marker and is
skipped where jax has no GPU (CI, and these 2-core machines); run on a GPU machine with
``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu tests/test_gpu.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import casstore
from casstore import _chunking, _device_staging, _place

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpu():
    return jax.devices("gpu")[0]


def test_gpu_shards_are_copied_block_by_block_and_leave_no_host_copy(tmp_path, gpu):
    assert not _chunking.on_host(jax.device_put(jnp.zeros(1), gpu))
    x = jax.device_put(jnp.arange(3_000_000, dtype=jnp.float32), gpu)
    info = casstore.save(tmp_path, 0, {"x": x}, chunk_size_bytes=2**20)
    assert info.new_chunks == 12
    assert getattr(x, "_npy_value", None) is None
    target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=jax.sharding.SingleDeviceSharding(gpu))}
    entry = casstore.read_manifest(tmp_path, 0).leaves[0]
    assert _place.off_host(entry, target["x"])  # its host buffers are dropped once placed
    with jax.default_device(gpu):
        assert _place.off_host(entry, jax.ShapeDtypeStruct(x.shape, x.dtype))
    restored = casstore.restore(tmp_path, 0, target=target)["x"]
    assert restored.devices() == {gpu}
    assert bool(jnp.all(restored == x))


@pytest.mark.parametrize("staging", ["device", "pinned"])
@pytest.mark.parametrize("cap", [None, 4 * 2**20])
def test_async_save_survives_donation(tmp_path, gpu, monkeypatch, staging, cap):
    """Staged by a copy on the GPU (host copies made in the background), or, where the GPU has
    no room for one, by block copies to pinned host memory before save() returns."""
    if staging == "pinned":
        monkeypatch.setattr(_device_staging, "_stats", lambda device: {"bytes_limit": 0})
    else:
        assert _device_staging._room(gpu, _device_staging._used(gpu)) > 2**30
    step = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 1, t), donate_argnums=0)
    tree = {"w": jax.device_put(jnp.arange(4_000_000, dtype=jnp.float32), gpu),
            "b": {f"b{k}": jax.device_put(jnp.full(1000, k, jnp.float32), gpu)
                  for k in range(4)}}
    expected = jax.tree.map(lambda x: np.asarray(jax.device_get(x * 1)), tree)
    with casstore.CheckpointManager(tmp_path, max_staging_bytes=cap,
                                    chunk_size_bytes=2**20) as mngr:
        mngr.save(1, tree)
        tree = step(tree)  # donated right after save() returned
        jax.block_until_ready(tree)
        mngr.wait_until_finished()
        peak = mngr.last_staging_peak_bytes
        assert peak == 0 if staging == "device" else 0 < peak <= (cap or 2**25)
        restored = mngr.restore(1)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(got, want)


def test_gpu_saved_state_restores_onto_the_cpu_and_back(tmp_path, gpu):
    tree = {"a": jax.device_put(jnp.ones((512, 512), jnp.bfloat16), gpu),
            "k": jax.device_put(jax.random.key(3), gpu)}
    casstore.save(tmp_path, 0, tree)
    plain = casstore.restore(tmp_path, 0)
    assert plain["a"].dtype == np.dtype(jnp.bfloat16)
    assert plain["a"].astype(np.float32).sum() == 512 * 512
    on_gpu = casstore.restore(tmp_path, 0, target=jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=jax.sharding.SingleDeviceSharding(gpu)), tree))
    assert on_gpu["a"].devices() == {gpu}
    assert bool(jnp.all(jax.random.key_data(on_gpu["k"]) == jax.random.key_data(tree["k"])))


def test_a_second_save_of_the_same_gpu_arrays_copies_nothing_to_the_host(tmp_path, gpu,
                                                                         monkeypatch):
    from casstore import _save_plan

    copies = []
    real = _save_plan.start_host_copy
    monkeypatch.setattr(_save_plan, "start_host_copy",
                        lambda *a: copies.append(a[1:]) or real(*a))
    tree = {"w": jax.device_put(jnp.arange(3_000_000, dtype=jnp.float32), gpu),
            "b": jax.device_put(jnp.ones(1000, jnp.float32), gpu)}
    casstore.save(tmp_path, 0, tree, chunk_size_bytes=2**20)
    assert len(copies) == 12  # w's blocks (b's pack: _chunking.start_host_copies)
    copies.clear()
    with casstore.CheckpointManager(tmp_path, chunk_size_bytes=2**20) as mngr:
        mngr.save(1, tree)
        mngr.wait_until_finished()
        assert copies == [], copies
        assert mngr.last_save_info.new_chunks == 0
    copy = jax.tree.map(jnp.copy, tree)
    assert casstore.save(tmp_path, 2, copy, chunk_size_bytes=2**20).new_chunks == 0
    assert len(copies) == 12  # new arrays: copied and hashed
    restored = casstore.restore(tmp_path, 1)
    np.testing.assert_array_equal(restored["w"], np.asarray(tree["w"]))


def test_a_save_after_restoring_onto_the_gpu_copies_no_unchanged_block(tmp_path, gpu,
                                                                       monkeypatch):
    from casstore import _save_plan

    w = jax.device_put(jnp.arange(3_000_000, dtype=jnp.float32), gpu)
    casstore.save(tmp_path, 0, {"w": w, "v": w + 1}, chunk_size_bytes=2**20)
    sharding = jax.sharding.SingleDeviceSharding(gpu)
    target = {k: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding) for k in ("w", "v")}
    restored = casstore.restore(tmp_path, 0, target=target)
    restored["v"] = restored["v"] * 2  # trained: a new array
    copies = []
    real = _save_plan.start_host_copy
    monkeypatch.setattr(_save_plan, "start_host_copy",
                        lambda *a: copies.append(a[1:]) or real(*a))
    info = casstore.save(tmp_path, 1, restored, chunk_size_bytes=2**20)
    assert len(copies) == 12  # v's blocks only: w's ids were checked by the restore
    assert info.new_chunks == 12
    np.testing.assert_array_equal(casstore.restore(tmp_path, 1)["w"], np.asarray(w))
