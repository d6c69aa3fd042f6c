"""restore(..., strict=False): pad or truncate each axis to the target's shape (orbax parity)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import casstore
from casstore.store import CountingStore, MemoryStore

V, D = 57, 16  # vocabulary, embedding width: one row of the table is 64 bytes
MESH = Mesh(np.array(jax.devices()), ("x",))


def saved_table(sharded: bool):
    """An embedding table saved with one row per chunk, and its store wrapped to count reads."""
    table = np.random.default_rng(0).standard_normal((V, D)).astype(np.float32)
    leaf = jax.device_put(table, NamedSharding(MESH, P(None, "x"))) if sharded else table
    store = CountingStore(MemoryStore())
    casstore.save(store, 0, {"embed": leaf, "bias": np.arange(4, dtype=np.float32)},
                  chunk_size_bytes=D * 4 // (8 if sharded else 1))
    return store, table


def chunk_ids_read(store) -> set[str]:
    return {k.replace("/", "")[len("chunks"):] for k in store.keys_read if k.startswith("chunks/")}


def target_leaf(shape, kind):
    if kind == "numpy":
        return np.zeros(shape, np.float32)
    if kind == "jax, no sharding":
        return jax.ShapeDtypeStruct(shape, np.float32)
    spec = P("x") if shape[0] % 8 == 0 else P(None, "x")  # 64 rows shard 8 ways; 54 do not
    return jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(MESH, spec))


@pytest.mark.parametrize("sharded_save", [False, True], ids=["saved numpy", "saved sharded"])
@pytest.mark.parametrize("kind", ["numpy", "jax, no sharding", "sharded over 8 devices"])
@pytest.mark.parametrize("rows", [V + 7, V - 3], ids=["grown vocabulary", "shrunk vocabulary"])
def test_vocabulary_change_pads_or_truncates_and_reads_only_kept_chunks(sharded_save, kind,
                                                                        rows):
    store, table = saved_table(sharded_save)
    manifest = casstore.read_manifest(store, 0)
    embed = manifest.leaves[[leaf.path for leaf in manifest.leaves].index("embed")]
    target = {"embed": target_leaf((rows, D), kind), "bias": np.zeros(4, np.float32)}
    with pytest.raises(casstore.TargetMismatchError, match="saved shape is"):
        casstore.restore(store, 0, target=target)  # strict by default
    store.reset()
    restored = casstore.restore(store, 0, target=target, strict=False)
    got = np.asarray(restored["embed"])
    kept = min(rows, V)
    assert got.shape == (rows, D)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got[:kept], table[:kept])
    assert not got[kept:].any()  # the new rows are zeros
    if kind == "sharded over 8 devices":
        assert restored["embed"].sharding == target["embed"].sharding
    # Only the chunks overlapping the kept rows were read, plus those of "bias" (inline in
    # the manifest with 64-byte chunks, two chunks with the sharded save's 8-byte ones).
    wanted = {r.id for r in embed.chunks if r.start[0] < kept}
    assert len(wanted) == (kept if not sharded_save else kept * 8)
    bias = {r.id for leaf in manifest.leaves if leaf.path == "bias" for r in leaf.chunks}
    assert len(bias) == (2 if sharded_save else 0)
    assert chunk_ids_read(store) == wanted | bias


def test_strict_false_keeps_the_rank_and_pads_every_axis():
    store = MemoryStore()
    cube = np.arange(2 * 3 * 4, dtype=np.int32).reshape(2, 3, 4)
    casstore.save(store, 0, {"c": cube, "tiny": np.arange(3, dtype=np.int8)})
    got = casstore.restore(store, 0, target={"c": np.ones((3, 2, 6), np.int64),
                                             "tiny": np.ones(5, np.int8)}, strict=False)
    expected = np.zeros((3, 2, 6), np.int64)
    expected[:2, :2, :4] = cube[:, :2, :]
    np.testing.assert_array_equal(got["c"], expected)
    assert got["c"].dtype == np.int64
    np.testing.assert_array_equal(got["tiny"], [0, 1, 2, 0, 0])  # an inline leaf
    with pytest.raises(casstore.TargetMismatchError, match="key path 'c'"):
        casstore.restore(store, 0, target={"c": np.ones((2, 12), np.int32),
                                           "tiny": np.ones(3, np.int8)}, strict=False)
