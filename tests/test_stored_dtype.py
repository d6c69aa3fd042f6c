"""save(..., dtypes=...): array leaves stored in another dtype per key-path prefix (orbax's
SaveArgs(dtype=...))."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import casstore
import casstore._chunking
import casstore._save_plan
from casstore._chunking import CastView
from casstore.store import CountingStore, MemoryStore

MESH = Mesh(np.array(jax.devices("cpu")).reshape(4, 2), ("data", "model"))
SHARDED = NamedSharding(MESH, P("data", "model"))
CHUNK = 1 << 14  # 16 KiB: the large leaves span several chunks


def float32_tree():
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return {"params": {"dense": {"kernel": normal(128, 96), "bias": normal(96)},
                       "embed": jax.device_put(normal(256, 64), SHARDED),
                       "scale": normal(4)},  # 16 bytes: inline in the manifest
            "opt": {"mu": normal(128, 96)}}


def chunk_bytes(store, step):
    """(raw bytes, stored bytes, chunk count) of the distinct chunks of ``params``."""
    refs = {r.id: r for leaf in casstore.read_manifest(store, step).leaves
            if leaf.path.startswith("params/") for r in leaf.chunks}
    return (sum(r.raw_bytes for r in refs.values()), sum(r.stored_bytes for r in refs.values()),
            len(refs))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_float32_params_stored_in_half_precision(dtype):
    tree = float32_tree()
    store = CountingStore(MemoryStore())
    # Raw chunks (shuffle=False), so that stored bytes follow raw bytes exactly.
    casstore.save(store, 0, tree, chunk_size_bytes=CHUNK, shuffle=False)
    info = casstore.save(store, 1, tree, chunk_size_bytes=CHUNK, dtypes={"params": dtype},
                         shuffle=False)
    manifest = casstore.read_manifest(store, 1)
    stored = {leaf.path: leaf.dtype for leaf in manifest.leaves}
    assert stored == {"params/dense/kernel": np.dtype(dtype).name,
                      "params/dense/bias": np.dtype(dtype).name,
                      "params/embed": np.dtype(dtype).name,
                      "params/scale": np.dtype(dtype).name, "opt/mu": "float32"}
    embed = next(leaf for leaf in manifest.leaves if leaf.path == "params/embed")
    assert embed.sharding == {"mesh": {"data": 4, "model": 2}, "spec": ["data", "model"]}
    # Bytes halved: the raw bytes exactly, the stored ones up to each chunk's 16-byte header.
    raw32, stored32, _ = chunk_bytes(store, 0)
    raw16, stored16, n = chunk_bytes(store, 1)
    assert raw16 * 2 == raw32
    assert stored16 <= stored32 / 2 + 16 * n
    assert info.new_chunks == n  # "opt" deduplicated against step 0
    # Restore without a target returns the stored dtype, equal to a whole-array cast.
    plain = casstore.restore(store, 1)
    for name, value in [("kernel", tree["params"]["dense"]["kernel"]),
                        ("embed", np.asarray(tree["params"]["embed"]))]:
        got = plain["params"]["dense"][name] if name == "kernel" else plain["params"][name]
        assert got.dtype == dtype
        assert got.tobytes() == value.astype(dtype).tobytes()
    np.testing.assert_array_equal(plain["opt"]["mu"], tree["opt"]["mu"])
    # A target asking for float32 gets float32 (the stored values, widened), on its sharding.
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SHARDED)
                          if isinstance(x, jax.Array) else x, tree)
    back = casstore.restore(store, 1, target=target)
    assert back["params"]["embed"].dtype == np.float32
    assert back["params"]["embed"].sharding == SHARDED
    np.testing.assert_array_equal(np.asarray(back["params"]["embed"]),
                                  np.asarray(tree["params"]["embed"]).astype(dtype)
                                  .astype(np.float32))


def test_stored_bytes_dedup_with_themselves_and_with_a_native_save():
    tree = float32_tree()
    store = MemoryStore()
    casstore.save(store, 0, tree, chunk_size_bytes=CHUNK, dtypes={"params": jnp.bfloat16})
    again = casstore.save(store, 1, tree, chunk_size_bytes=CHUNK,
                          dtypes={"params": jnp.bfloat16})
    assert again.new_chunks == 0
    # The same values saved as bfloat16 arrays are cut and named the same way.
    native = {"params": jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree["params"]),
              "opt": tree["opt"]}
    info = casstore.save(store, 2, native, chunk_size_bytes=CHUNK)
    assert info.new_chunks == 0
    assert ([leaf.chunks for leaf in casstore.read_manifest(store, 0).leaves]
            == [leaf.chunks for leaf in casstore.read_manifest(store, 2).leaves])


def test_large_leaves_are_cast_one_block_at_a_time(monkeypatch):
    whole: list[tuple[int, ...]] = []
    original = CastView.__array__

    def record(self, *args, **kwargs):
        whole.append(self.shape)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CastView, "__array__", record)
    tree = float32_tree()
    blocks: list[int] = []
    original_getitem = CastView.__getitem__
    monkeypatch.setattr(CastView, "__getitem__",
                        lambda self, i: blocks.append(1) or original_getitem(self, i))
    casstore.save(MemoryStore(), 0, tree, chunk_size_bytes=CHUNK,
                  dtypes={"params": jnp.float16})
    # Only the small leaves (packed or inline) were cast whole; the kernel (48 KiB as float32,
    # 24 KiB stored) and the embedding shards were sliced per block.
    assert sorted(whole) == [(4,), (96,)]
    assert len(blocks) == 2 + 8  # two kernel blocks, one per embedding shard


def test_the_accelerator_path_casts_each_block_on_its_device(monkeypatch):
    """With on_host() false (as on a GPU), shards are copied block by block by
    start_host_copy; the cast then runs on the device before the copy, and the chunks are the
    ones the host path writes."""
    tree = float32_tree()
    host = MemoryStore()
    casstore.save(host, 0, tree, chunk_size_bytes=CHUNK, dtypes={"params": jnp.bfloat16})
    copies = []
    start_host_copy = casstore._save_plan.start_host_copy

    def recording(x, start, stop):
        copies.append(type(x).__name__)
        return start_host_copy(x, start, stop)

    for module in (casstore._chunking, casstore._save_plan):
        monkeypatch.setattr(module, "on_host", lambda x: False)
    monkeypatch.setattr(casstore._save_plan, "start_host_copy", recording)
    device = MemoryStore()
    casstore.save(device, 0, tree, chunk_size_bytes=CHUNK, dtypes={"params": jnp.bfloat16})
    assert copies.count("CastView") == 8  # one block per embedding shard
    assert ([leaf.chunks for leaf in casstore.read_manifest(host, 0).leaves]
            == [leaf.chunks for leaf in casstore.read_manifest(device, 0).leaves])


@pytest.mark.parametrize("keep", [None, "own"])
def test_a_longer_prefix_keeps_a_leaf_in_its_own_dtype(keep):
    """A prefix mapped to None, or to the leaf's own dtype, keeps it. For a typed PRNG key
    array (every flax nnx state with an Rngs stream holds one) that is its key dtype or its
    key data's: before, every mapping was refused, so ``{"": bf16}`` could not be narrowed to
    leave the key out, and None meant float64 (numpy's default dtype)."""
    key = jax.random.key(7)
    tree = {"params": {"w": np.ones((4, 4), np.float32), "step": np.arange(20, dtype=np.int32),
                       "half": np.ones(3, np.float32)},
            "rngs": {"key": key, "old": jax.random.key(1, impl="rbg")}}
    own = {"params/step": np.int32, "params/half": np.float32, "rngs/key": key.dtype,
           "rngs/old": np.uint32}
    store = MemoryStore()
    casstore.save(store, 0, tree, dtypes={"": "bfloat16", **(
        dict.fromkeys(own) if keep is None else own)})
    assert {leaf.path: leaf.dtype for leaf in casstore.read_manifest(store, 0).leaves} == {
        "params/w": "bfloat16", "params/step": "int32", "params/half": "float32",
        "rngs/key": "uint32", "rngs/old": "uint32"}
    restored = casstore.restore(store, 0, target=casstore.abstract_tree(tree))
    assert jax.random.key_impl(restored["rngs"]["old"]) == jax.random.key_impl(
        tree["rngs"]["old"])
    np.testing.assert_array_equal(jax.random.key_data(restored["rngs"]["key"]),
                                  jax.random.key_data(key))


@pytest.mark.parametrize(("dtypes", "path", "message"), [
    ({"params/w": np.int8}, "params/w", "as int8: casting float32 .floating. to integer"),
    ({"": jnp.bfloat16}, "count", "int32 .integer. to floating"),
    ({"params/w": np.float32, "params/c": np.float32}, "params/c", "complex. to floating"),
    ({"rng": jnp.float32}, "rng", r"PRNG key array \(threefry2x32\), stored as its key data: "
                                  r"map this key path to None \(or uint32\) to keep it \(key path"),
    ({"rng": jax.random.key(0, impl="rbg").dtype}, "rng", "PRNG key array"),
    ({"params/w": jax.random.key(0).dtype}, "params/w", "PRNG key dtypes"),
    ({"params": "float128"}, "params/c", "as float128: not a dtype of format.md"),
    # pairs ml_dtypes does not cast: numpy's bare TypeError, after the config was written
    ({"small/q": "uint4"}, "small/q", "numpy cannot cast int4 to uint4"),
    ({"small/e": "float8_e4m3fn"}, "small/e", "cannot cast float8_e8m0fnu to float8_e4m3fn"),
])
def test_refused_casts_name_the_key_path_and_write_nothing(dtypes, path, message):
    tree = {"params": {"w": np.ones((8, 8), np.float32), "c": np.ones(3, np.complex64)},
            "count": np.int32(3), "rng": jax.random.key(0),
            "small": {"q": np.arange(4, dtype=ml_dtypes.int4),
                      "e": np.ones(4, ml_dtypes.float8_e8m0fnu)}}
    store = CountingStore(MemoryStore())
    with pytest.raises(casstore.UnsupportedLeafError, match=message) as e:
        casstore.save(store, 0, tree, dtypes=dtypes)
    assert e.value.key_path == path
    assert repr(path) in str(e.value)
    assert store.keys_written == []


OUT_OF_RANGE = [  # (values, stored dtype, message): a cast that would lose more than rounding
    (np.array([5, 2**20], np.int32), np.int16, r"int32 values hold values in \[5, 1048576\]"),
    (np.array([1, -1], np.int32), np.uint16, r"values in \[-1, 1\], out of its range"),
    (np.array([1.0, 70000.0], np.float32), np.float16, "beyond its range"),
    (np.array([1.0, 1e30], np.float32), "float8_e4m3fn", "beyond its range"),
    (np.array([1.0, 100.0], np.float32), "float4_e2m1fn", "beyond its range"),  # saturates
    (np.array([1, -1], np.int32), np.uint32, r"values in \[-1, 1\]"),  # the same width
    (np.array([1, 4_000_000_000], np.uint32), np.int32, r"\[1, 4000000000\]"),
    (np.array([1, 8], np.int8), "int4", r"values in \[1, 8\]"),
    (np.array([1.0, np.nan], np.float32), "float4_e2m1fn", "NaN or infinities"),
]


@pytest.mark.parametrize("accelerator_path", [False, True])
@pytest.mark.parametrize("size", [2, 40_000])  # packed whole, or cut into blocks
@pytest.mark.parametrize(("values", "dtype", "message"), OUT_OF_RANGE)
def test_values_the_stored_dtype_cannot_hold_are_refused_not_wrapped(
        monkeypatch, accelerator_path, size, values, dtype, message):
    if accelerator_path:  # as on a GPU: each block cast on its device, then copied
        for module in (casstore._chunking, casstore._save_plan):
            monkeypatch.setattr(module, "on_host", lambda x: False)
    leaf = np.resize(values, size)  # both values, repeated
    store = MemoryStore()
    with pytest.raises(casstore.UnsupportedLeafError, match=message) as e:
        casstore.save(store, 0, {"w": jnp.asarray(leaf) if accelerator_path else leaf},
                      dtypes={"w": dtype}, chunk_size_bytes=CHUNK)
    assert e.value.key_path == "w"
    assert casstore.list_steps(store) == []


def test_values_the_stored_dtype_holds_are_rounded_as_numpy_casts_them():
    tree = {"f": np.array([1.0, 65504.0, 1e-9, 0.1, np.nan, -np.inf], np.float32),
            "i": np.array([-2**31, 2**31 - 1], np.int64), "n": np.array([-8, 7, 0], np.int8)}
    store = MemoryStore()
    casstore.save(store, 0, tree, dtypes={"f": np.float16, "i": np.int32, "n": "int4"})
    got = casstore.restore(store, 0)
    assert got["f"].tobytes() == tree["f"].astype(np.float16).tobytes()  # 1e-9 rounds to 0
    assert got["i"].tolist() == tree["i"].tolist()
    assert (str(got["n"].dtype), got["n"].astype(np.int8).tolist()) == ("int4", [-8, 7, 0])


def test_a_complex_narrowing_casts_without_a_warning():
    import warnings

    store, value = MemoryStore(), np.array([1 + 2j, -0.5j], np.complex128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's ComplexWarning came from the check
        casstore.save(store, 0, {"c": value}, dtypes={"c": np.complex64})
    assert casstore.restore(store, 0)["c"].tolist() == value.astype(np.complex64).tolist()


def test_a_prefix_matching_no_array_leaf_is_an_error():
    store = CountingStore(MemoryStore())
    with pytest.raises(ValueError, match="'parms' matches no array leaf"):
        casstore.save(store, 0, {"params": np.ones(3)}, dtypes={"parms": jnp.bfloat16})
    assert store.keys_written == []
