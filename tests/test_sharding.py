"""Sharded arrays on 8 CPU devices: save along shard boundaries, restore onto any sharding."""

import mmap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import casstore
from casstore._layout import CHUNKS_PREFIX
from casstore._place import off_host
from casstore._restore import read_regions
from casstore.store import CountingStore, MemoryStore

DEVICES = jax.devices()


def mesh(shape, names):
    return Mesh(np.array(DEVICES[:int(np.prod(shape))]).reshape(shape), names)


def shardings():
    m42, m24, m8 = mesh((4, 2), ("data", "model")), mesh((2, 4), ("a", "b")), mesh((8,), ("x",))
    return {
        "4x2 data,model": NamedSharding(m42, P("data", "model")),
        "2x4 b,a": NamedSharding(m24, P("b", "a")),
        "8 x,None": NamedSharding(m8, P("x")),
        "8 None,x": NamedSharding(m8, P(None, "x")),
        "replicated": NamedSharding(m8, P()),
        "single device": SingleDeviceSharding(DEVICES[3]),
    }


def evenly_shardable(shape, sharding) -> bool:
    """Whether jax accepts ``sharding`` for an array of ``shape`` (it refuses a NamedSharding
    whose mesh axes do not divide the dimensions they split)."""
    try:
        sharding.shard_shape(shape)
    except ValueError:
        return False
    return True


def test_eight_devices_are_available():
    assert len(DEVICES) == 8, "conftest sets --xla_force_host_platform_device_count=8"


@pytest.mark.parametrize(("shape", "dtype"), [((16, 8), np.float32), ((17, 9), np.int32),
                                          ((8, 6, 3), jnp.bfloat16), ((5, 3), np.uint8)])
def test_save_on_one_mesh_restore_on_every_sharding(shape, dtype):
    store = MemoryStore()
    value = (np.arange(np.prod(shape)) % 251).reshape(shape).astype(dtype)
    spec = P("data", "model")
    try:
        x = jax.device_put(value, NamedSharding(mesh((4, 2), ("data", "model")), spec))
    except ValueError:  # uneven shape jax refuses to shard on this mesh: shard the first axis
        x = jax.device_put(value, NamedSharding(mesh((8,), ("x",)), P()))
    casstore.save(store, 0, {"x": x, "plain": np.ones(3)}, chunk_size_bytes=64)
    for name, sharding in shardings().items():
        target = {"x": jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding),
                  "plain": np.zeros(3)}
        if not evenly_shardable(shape, sharding):  # jax's refusal, named for the key path
            with pytest.raises(casstore.TargetMismatchError,
                               match=r"'x': its sharding does not split shape"):
                casstore.restore(store, 0, target=target)
            continue
        restored = casstore.restore(store, 0, target=target)
        assert restored["x"].sharding == sharding, name
        assert np.asarray(restored["x"]).tobytes() == value.astype(x.dtype).tobytes(), name
    as_numpy = casstore.restore(store, 0)
    assert as_numpy["x"].tobytes() == value.astype(x.dtype).tobytes()


def test_each_unique_shard_is_written_once_by_replica_zero():
    store = CountingStore(MemoryStore())
    m = mesh((4, 2), ("data", "model"))
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8),
                       NamedSharding(m, P("data")))  # replicated over "model"
    info = casstore.save(store, 0, {"x": x}, pack_threshold_bytes=0)
    leaf = casstore.read_manifest(store, 0).leaves[0]
    assert len(leaf.chunks) == 4
    assert info.new_chunks == 4
    assert [r.start for r in leaf.chunks] == [(0, 0), (2, 0), (4, 0), (6, 0)]
    assert leaf.sharding == {"mesh": {"data": 4, "model": 2}, "spec": ["data"]}
    store.reset()
    casstore.save(store, 1, {"x": x}, pack_threshold_bytes=0)  # unchanged: dedups fully
    assert [k for k in store.keys_written if k.startswith(CHUNKS_PREFIX)] == []


def test_restoring_one_device_shard_reads_only_its_chunks():
    store = CountingStore(MemoryStore())
    value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    x = jax.device_put(value, NamedSharding(mesh((8,), ("x",)), P("x")))
    casstore.save(store, 0, {"x": x}, chunk_size_bytes=4 * 32 * 4)  # 2 chunks per shard
    manifest = casstore.read_manifest(store, 0)
    assert len(manifest.leaves[0].chunks) == 16
    # The region device 3 holds under a (4,)-way target sharding: rows 16..32.
    target = NamedSharding(Mesh(np.array(DEVICES[:4]), ("x",)), P("x"))
    index = target.devices_indices_map((64, 32))[DEVICES[1]]
    region = ((index[0].start, 0), (index[0].stop, 32))
    store.reset()
    got = read_regions(store, manifest, {0: [region]}, max_workers=4)[0][region]
    np.testing.assert_array_equal(got, value[16:32])
    wanted = {r.id for r in manifest.leaves[0].chunks if 16 <= r.start[0] < 32}
    read = {k.replace("/", "")[len("chunks"):] for k in store.keys_read}
    assert len(wanted) == 4
    assert read == wanted
    # A region that straddles chunk boundaries reads the partly overlapping chunks whole.
    store.reset()
    got = read_regions(store, manifest, {0: [((6, 5), (9, 7))]}, max_workers=4)[0]
    np.testing.assert_array_equal(got[((6, 5), (9, 7))], value[6:9, 5:7])
    assert len(store.keys_read) == 2


def _bottom(array: np.ndarray):
    while isinstance(array, np.ndarray):
        array = array.base
    return array.obj if isinstance(array, memoryview) else array


def test_host_regions_dropped_once_placed_are_mapped_on_their_own():
    # A leaf restored onto a GPU drops its host regions once placed: they are mapped on their
    # own, so each goes back to the OS then; regions a restore keeps come from malloc.
    value = np.arange(3 * 2**18, dtype=np.float32).reshape(3, 2**18)  # 3 MiB
    store = MemoryStore()
    casstore.save(store, 0, {"w": value, "b": np.ones(4, np.float32)}, chunk_size_bytes=2**20)
    manifest = casstore.read_manifest(store, 0)
    requests = {0: [((0,), (4,))], 1: [((0, 0), value.shape)]}
    bottoms = {}

    def place(i, regions):
        bottoms[i] = {r: type(_bottom(buf)) for r, buf in regions.items()}
        return {r: buf.copy() for r, buf in regions.items()}

    for temporary, kind in (({0, 1}, mmap.mmap), (set(), type(None))):
        got = read_regions(store, manifest, requests, 2, place=place, temporary=temporary)
        np.testing.assert_array_equal(got[1][((0, 0), value.shape)], value)
        np.testing.assert_array_equal(got[0][((0,), (4,))], np.ones(4, np.float32))
        assert bottoms[1] == {((0, 0), value.shape): kind}
        assert bottoms[0] == {((0,), (4,)): type(None)}  # under MMAP_BYTES: malloc
    target = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype,
                                        sharding=SingleDeviceSharding(DEVICES[0])),
              "b": np.zeros(4, np.float32)}
    entries = {leaf.path: leaf for leaf in manifest.leaves}
    assert not off_host(entries["w"], target["w"])  # a CPU device keeps the buffer (zero-copy)
    assert not off_host(entries["b"], target["b"])


def test_typed_keys_and_mixed_tree_on_a_mesh():
    m = mesh((8,), ("x",))
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(m, P("x")))
    tree = {"keys": keys, "w": jax.device_put(jnp.ones((8, 4)), NamedSharding(m, P("x"))),
            "b": jnp.zeros(4), "n": np.arange(3)}
    store = MemoryStore()
    casstore.save(store, 0, tree)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                          if isinstance(x, jax.Array) else x, tree)
    restored = casstore.restore(store, 0, target=target)
    assert restored["keys"].sharding == keys.sharding
    np.testing.assert_array_equal(jax.random.key_data(restored["keys"]),
                                  jax.random.key_data(keys))


def test_a_jax_default_device_context_places_every_leaf_there():
    """jax.default_device is thread-local; the leaves are placed on worker threads."""
    store = MemoryStore()
    casstore.save(store, 0, {"a": np.ones((256, 256), np.float32),
                             "b": np.zeros((300, 300), np.float32), "s": 1.0})
    target = {"a": jax.ShapeDtypeStruct((256, 256), jnp.float32),
              "b": jax.ShapeDtypeStruct((300, 300), jnp.float32),
              "s": jax.ShapeDtypeStruct((), jnp.float32)}
    device = jax.devices()[3]
    with jax.default_device(device):
        restored = casstore.restore(store, 0, target=target)
    assert {k: v.devices() for k, v in restored.items()} == {k: {device} for k in target}


def test_targets_in_pinned_host_memory_are_placed_there():
    """Host-offloaded state (memory_kind="pinned_host"): abstract_tree keeps the memory kind
    and the restore places each shard in it (it failed inside jax after reading)."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    state = {"mu": jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8),
                                  NamedSharding(mesh, P("a", "b"), memory_kind="pinned_host")),
             "nu": jax.device_put(np.ones(8, np.float32), SingleDeviceSharding(
                 jax.devices()[1], memory_kind="pinned_host"))}
    store = MemoryStore()
    casstore.save(store, 0, state)
    restored = casstore.restore(store, 0, target=casstore.abstract_tree(state))
    for key, live in state.items():
        assert restored[key].sharding == live.sharding
        assert restored[key].sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(np.asarray(restored[key]), np.asarray(live))


@pytest.mark.parametrize("kind", ["pinned_host", "unpinned_host"])
def test_weakly_typed_targets_in_host_memory_stay_there(kind):
    """A weakly typed target (a learning rate or step scalar: abstract_tree keeps weak_type)
    in host memory: weakening the type is a computation, whose output landed in device
    memory (every scalar, and arrays on unpinned_host)."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    store = MemoryStore()
    casstore.save(store, 0, {"w": np.arange(128, dtype=np.float32).reshape(8, 16), "lr": 0.5})
    target = {"w": jax.ShapeDtypeStruct((8, 16), jnp.float32, weak_type=True, sharding=(
                  NamedSharding(mesh, P("a", "b"), memory_kind=kind))),
              "lr": jax.ShapeDtypeStruct((), jnp.float32, weak_type=True,
                                         sharding=NamedSharding(mesh, P(), memory_kind=kind))}
    restored = casstore.restore(store, 0, target=target)
    for key, t in target.items():
        assert restored[key].sharding == t.sharding, key
        assert restored[key].sharding.memory_kind == kind, key
        assert restored[key].weak_type, key
    assert float(restored["lr"]) == 0.5
    live = {"count": jax.device_put(jnp.asarray(3.0), NamedSharding(mesh, P(), memory_kind=kind))}
    casstore.save(store, 1, live)
    again = casstore.restore(store, 1, target=casstore.abstract_tree(live))["count"]
    assert (again.sharding.memory_kind, again.weak_type) == (kind, True)


def test_a_target_sharding_that_does_not_split_its_shape_names_the_key_path():
    """A ShapeDtypeStruct takes a sharding that does not divide its shape; restore raised
    jax's IndivisibleError from the read planning, naming no leaf. Now one
    TargetMismatchError names it, before any chunk is read (strict=False padding too)."""
    store = CountingStore(MemoryStore())
    tree = {"params": {"embed": np.ones((10, 4), np.float32), "head": np.ones((8, 4), np.float32)}}
    casstore.save(store, 0, tree)
    x8 = NamedSharding(mesh((8,), ("x",)), P("x"))
    for rows, strict in ((10, True), (12, False)):
        target = {"params": {"embed": jax.ShapeDtypeStruct((rows, 4), np.float32, sharding=x8),
                             "head": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=x8)}}
        store.keys_read.clear()
        with pytest.raises(casstore.TargetMismatchError,
                           match=rf"(?s)1 mismatched.*'params/embed': its sharding does not split "
                                 rf"shape \({rows}, 4\): array axis 0 is partitioned 8 times"):
            casstore.restore(store, 0, target=target, strict=strict)
        assert not [k for k in store.keys_read if k.startswith(CHUNKS_PREFIX)]
