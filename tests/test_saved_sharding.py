"""restore(url, step, sharding="saved"): jax.Arrays laid out as saved, without a target."""

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import casstore
from casstore import _restore
from casstore._layout import manifest_key
from casstore._manifest import encode_manifest
from casstore.store import CountingStore, LocalStore, MemoryStore

MESH = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def saved_tree():
    rng = np.random.default_rng(0)
    put = lambda x, spec: jax.device_put(x, NamedSharding(MESH, spec))  # noqa: E731
    return {"params": {"w": put(rng.standard_normal((64, 32)).astype(np.float32),
                                P("data", "model")),
                       "emb": put(rng.standard_normal((16, 8)).astype(jnp.bfloat16),
                                  P(None, ("data", "model"))),
                       "b": put(np.arange(32, dtype=np.int32), P("model"))},
            "rng": put(jax.random.split(jax.random.key(7), 8), P("data")),
            "one_device": jax.device_put(jnp.arange(5.0), jax.devices()[3]),
            "host": np.arange(6, dtype=np.int16).reshape(2, 3),
            "step": 12, "layers": [None, np.ones(2)]}


def test_a_4x2_mesh_restores_bit_exact_on_its_saved_sharding(monkeypatch):
    tree = saved_tree()
    store = CountingStore(MemoryStore())
    casstore.save(store, 0, tree, chunk_size_bytes=256)
    requests = []
    read = _restore.read_regions
    monkeypatch.setattr(_restore, "read_regions",
                        lambda s, m, req, w, **kw: requests.append(req) or read(s, m, req, w,
                                                                                **kw))
    store.reset()
    got = casstore.restore(store, 0, sharding="saved")
    for leaf in [("params", "w"), ("params", "emb"), ("params", "b"), ("rng",)]:
        want, have = tree[leaf[0]], got[leaf[0]]
        if len(leaf) == 2:
            want, have = want[leaf[1]], have[leaf[1]]
        assert isinstance(have, jax.Array), leaf
        assert have.sharding == want.sharding, leaf
        assert have.dtype == want.dtype, leaf
        if leaf == ("rng",):
            want, have = jax.random.key_data(want), jax.random.key_data(have)
        assert np.asarray(have).tobytes() == np.asarray(want).tobytes(), leaf
    assert got["one_device"].sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
    np.testing.assert_array_equal(got["one_device"], tree["one_device"])
    assert type(got["host"]) is np.ndarray
    assert got["host"].dtype == np.int16
    np.testing.assert_array_equal(got["host"], tree["host"])
    assert got["step"] == 12
    assert got["layers"][0] is None
    # Each device's region of "params/w" was requested on its own, every chunk read once.
    manifest = casstore.read_manifest(store, 0)
    w = [leaf.path for leaf in manifest.leaves].index("params/w")
    regions = {(tuple(s.start for s in index), tuple(s.stop for s in index))
               for index in tree["params"]["w"].sharding.devices_indices_map((64, 32)).values()}
    assert len(requests) == 1
    assert set(requests[0][w]) == regions
    assert len(regions) == 8
    chunk_reads = [k for k in store.keys_read if k.startswith("chunks/")]
    assert len(chunk_reads) == len(set(chunk_reads)) == len(manifest.chunk_ids())
    # The default without a target stays numpy.
    assert type(casstore.restore(store, 0)["params"]["w"]) is np.ndarray


def test_paths_prune_the_saved_sharding_restore():
    store = MemoryStore()
    tree = saved_tree()
    casstore.save(store, 0, tree)
    got = casstore.restore(store, 0, sharding="saved", paths=["params/w", "layers"])
    assert set(got) == {"params", "layers"}
    assert set(got["params"]) == {"w"}
    assert got["params"]["w"].sharding == tree["params"]["w"].sharding
    with pytest.raises(casstore.TargetMismatchError, match="'nope'"):
        casstore.restore(store, 0, sharding="saved", paths=["nope"])


def test_the_manager_restores_onto_the_saved_sharding(tmp_path):
    tree = saved_tree()
    with casstore.CheckpointManager(tmp_path / "repo") as manager:
        manager.save(3, tree)
        got = manager.restore(sharding="saved")
    assert got["params"]["w"].sharding == tree["params"]["w"].sharding
    np.testing.assert_array_equal(got["params"]["w"], tree["params"]["w"])


def test_sharding_argument_is_checked():
    store = MemoryStore()
    casstore.save(store, 0, {"w": np.ones(3)})
    with pytest.raises(ValueError, match="'saved'"):
        casstore.restore(store, 0, sharding="replicated")
    with pytest.raises(ValueError, match="with a target"):
        casstore.restore(store, 0, sharding="saved", target={"w": np.ones(3)})


@pytest.mark.parametrize("bad", [
    {"mesh": {"data": 4}, "spec": ["model"]},  # an axis the mesh lacks
    {"mesh": {"data": 0}, "spec": []},
    {"mesh": {"data": 4}, "spec": ["data", "data"]},
    {"mesh": {"a": 2}, "spec": [None, None, "a"]},  # more entries than axes
    ["data"],
])
def test_a_malformed_saved_sharding_is_a_manifest_error(bad):
    store = MemoryStore()
    casstore.save(store, 0, {"w": jax.device_put(jnp.ones((8, 4)),
                                                 NamedSharding(MESH, P("data")))})
    manifest = casstore.read_manifest(store, 0)
    leaf = dataclasses.replace(manifest.leaves[0], sharding=bad)
    store.put(manifest_key("default", 0),
              encode_manifest(dataclasses.replace(manifest, leaves=(leaf,))))
    for restore in (lambda: casstore.restore(store, 0, sharding="saved"),
                    lambda: casstore.restore(store, 0), lambda: casstore.read_manifest(store, 0)):
        with pytest.raises(casstore.ManifestError, match="bad saved sharding") as e:
            restore()  # checked when the manifest is read, as every field (format.md §4.4)
        assert e.value.key_path == "w"


FOUR_DEVICES = """
import sys, casstore
assert len(__import__("jax").devices()) == 4
try:
    casstore.restore(sys.argv[1], 0, sharding="saved")
except casstore.TargetMismatchError as e:
    print("ERROR", e.key_path, e)
"""


def test_a_mesh_the_devices_cannot_host_is_a_clear_error(tmp_path):
    store = LocalStore(tmp_path / "repo")
    casstore.save(store, 0, {"params": {"w": jax.device_put(
        jnp.ones((8, 4)), NamedSharding(MESH, P("data", "model")))}})
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", FOUR_DEVICES, str(tmp_path / "repo")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ERROR params/w "), done.stdout
    assert "the saved mesh {'data': 4, 'model': 2} needs 8 devices" in done.stdout
    assert "4 cpu devices" in done.stdout
    assert "key path 'params/w'" in done.stdout
