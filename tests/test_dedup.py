"""Deduplication proven by counting store writes (CountingStore)."""

import jax.numpy as jnp
import numpy as np

import casstore
from casstore._layout import CHUNKS_PREFIX, DELTAS_PREFIX
from casstore.store import CountingStore, MemoryStore

CHUNK = 4096


def train_state(seed: int, frozen_seed: int = 0) -> dict:
    """A small train state: a frozen base (embeddings, 3 layers) and a trained head."""
    frozen = np.random.default_rng(frozen_seed)
    trained = np.random.default_rng(seed)
    base = {"embed": frozen.normal(size=(300, 16)).astype(np.float32),
            "layers": [{"w": frozen.normal(size=(64, 64)).astype(np.float32),
                        "b": frozen.normal(size=(64,)).astype(np.float32)} for _ in range(3)]}
    head = {"w": trained.normal(size=(64, 40)).astype(np.float32),
            "b": trained.normal(size=(40,)).astype(np.float32)}
    return {"params": {"base": base, "head": head}, "step": jnp.int32(seed)}


def chunk_writes(store: CountingStore) -> list[str]:
    """Keys of the chunk objects written (whole chunks and delta objects)."""
    return [k for k in store.keys_written if k.startswith((CHUNKS_PREFIX, DELTAS_PREFIX))]


def test_unchanged_tree_writes_only_a_manifest():
    store = CountingStore(MemoryStore())
    state = train_state(1)
    first = casstore.save(store, 1, state, chunk_size_bytes=CHUNK)
    assert first.new_chunks == len(chunk_writes(store)) > 10
    store.reset()
    info = casstore.save(store, 2, state, chunk_size_bytes=CHUNK)
    assert chunk_writes(store) == []
    lock, manifest = store.keys_written  # the save lock (deleted again), then the manifest
    assert lock.startswith("locks/save-")
    assert manifest == "runs/default/steps/0000000000000002.manifest"
    assert info.new_chunks == 0
    assert info.reused_chunks == first.new_chunks
    assert info.written_bytes == info.manifest_bytes == len(store.get(manifest))
    assert store.bytes_written - info.manifest_bytes < 200  # the lock object
    assert store.counts["exists"] == 1  # one existence check for the step, none per chunk
    assert not store.exists(lock)


def test_frozen_subtree_writes_only_changed_leaves():
    store = CountingStore(MemoryStore())
    casstore.save(store, 1, train_state(1), chunk_size_bytes=CHUNK)
    new = train_state(2)  # same frozen base, new head
    probe = CountingStore(MemoryStore())
    casstore.save(probe, 0, {"head": new["params"]["head"]}, chunk_size_bytes=CHUNK)
    store.reset()
    info = casstore.save(store, 2, new, chunk_size_bytes=CHUNK)
    assert sorted(chunk_writes(store)) == sorted(chunk_writes(probe))
    assert info.new_chunks == len(chunk_writes(probe))
    np.testing.assert_array_equal(casstore.restore(store, 2)["params"]["head"]["w"],
                                  new["params"]["head"]["w"])


def test_changing_rows_of_an_embedding_rewrites_only_their_chunks():
    store = CountingStore(MemoryStore())
    table = np.random.default_rng(0).normal(size=(1024, 64)).astype(np.float32)  # 256 KiB
    first = casstore.save(store, 1, {"embed": table}, chunk_size_bytes=16 * 1024)  # 64 rows
    table2 = table.copy()
    table2[70] += 1  # one row in the second chunk
    store.reset()
    info = casstore.save(store, 2, {"embed": table2}, chunk_size_bytes=16 * 1024)
    assert first.new_chunks == 16
    assert info.new_chunks == 1
    assert info.reused_chunks == 15
    assert len(chunk_writes(store)) == 1


def test_second_run_from_the_same_base_writes_only_its_own_part():
    store = CountingStore(MemoryStore())
    casstore.save(store, 0, train_state(1), run="lr-1e-3", chunk_size_bytes=CHUNK)
    other = train_state(99)
    probe = CountingStore(MemoryStore())
    casstore.save(probe, 0, {"head": other["params"]["head"]}, chunk_size_bytes=CHUNK)
    store.reset()
    casstore.save(store, 0, other, run="lr-3e-4", chunk_size_bytes=CHUNK)
    assert sorted(chunk_writes(store)) == sorted(chunk_writes(probe))
    assert casstore.list_runs(store) == ["lr-1e-3", "lr-3e-4"]
    assert casstore.list_steps(store, run="lr-3e-4") == [0]


def test_identical_leaves_in_one_save_are_stored_once():
    store = CountingStore(MemoryStore())
    x = np.arange(100_000, dtype=np.float32)
    info = casstore.save(store, 0, {"a": x, "b": x.copy(), "c": [x]}, chunk_size_bytes=2**20)
    assert info.new_chunks == 1
    assert info.reused_chunks == 2
    assert len(chunk_writes(store)) == 1


def test_small_leaves_are_packed_not_one_object_each():
    store = CountingStore(MemoryStore())
    tree = {f"bias{i}": np.full(100, i, np.float32) for i in range(50)}  # 400 B each
    tree["count"] = np.int32(3)  # inline
    info = casstore.save(store, 0, tree)
    assert info.new_chunks == 1
    assert len(chunk_writes(store)) == 1
    manifest = casstore.read_manifest(store, 0)
    count = next(leaf for leaf in manifest.leaves if leaf.path == "count")
    assert count.inline is not None
    assert count.chunks == ()
    restored = casstore.restore(store, 0)
    for i in range(50):
        np.testing.assert_array_equal(restored[f"bias{i}"], tree[f"bias{i}"])
    store.reset()
    tree["count"] = np.int32(4)  # a changed inline counter does not rewrite the pack
    assert casstore.save(store, 1, tree).new_chunks == 0


def nnx_like(head_bias: float) -> dict:
    """Leaves as flax nnx's state gives them: each Variable a node holding one leaf
    (``.../bias/value``); two frozen layers' small leaves and a trained head."""
    var = lambda x: {"value": x}  # noqa: E731
    layer = lambda i: {"ln": {"scale": var(np.full(128, i, np.float32)),  # noqa: E731
                              "bias": var(np.full(128, -i, np.float32))},
                       "dense": {"kernel": var(np.full((128, 256), i, np.float32)),
                                 "bias": var(np.full(256, i + 0.5, np.float32))}}
    return {"layers": {"0": layer(1), "1": layer(2)},
            "head": {"bias": var(np.full(10 * 4, head_bias, np.float32))}}


def test_a_node_holding_one_leaf_packs_as_that_leaf():
    """A node holding one leaf (nnx's ``bias/value``, or ``layer_i/w``) is packed with its
    parent's other small leaves, not one object each (it was: 10,000 leaves
    ``layer_i/w`` of 1 KiB took 15.6 s to save on local disk, one pack 3.0 s); a changed small
    leaf still rewrites only its own module's pack."""
    store = CountingStore(MemoryStore())
    casstore.save(store, 0, nnx_like(0.0), delta=False)
    packs = {leaf.path: leaf.chunks[0].id for leaf in casstore.read_manifest(store, 0).leaves
             if leaf.chunks and leaf.chunks[0].offset is not None and "kernel" not in leaf.path}
    for i in ("0", "1"):  # ln's scale and bias share a pack; the dense bias is its module's
        assert packs[f"layers/{i}/ln/scale/value"] == packs[f"layers/{i}/ln/bias/value"]
        assert packs[f"layers/{i}/dense/bias/value"] != packs[f"layers/{i}/ln/bias/value"]
    assert len(set(packs.values())) == 5  # 2 ln, 2 dense biases, the head
    store.reset()
    assert casstore.save(store, 1, nnx_like(1.0), delta=False).new_chunks == 1  # the head's
    assert len(chunk_writes(store)) == 1

    flat = CountingStore(MemoryStore())
    tree = {f"layer_{i}": {"w": np.full(256, i, np.float32)} for i in range(300)}
    assert casstore.save(flat, 0, tree).new_chunks == 1
    restored = casstore.restore(flat, 0)
    assert all(np.array_equal(restored[k]["w"], v["w"]) for k, v in tree.items())


def test_restore_of_a_subtree_reads_only_its_chunks():
    store = CountingStore(MemoryStore())
    state = train_state(1)
    casstore.save(store, 1, state, chunk_size_bytes=CHUNK)
    head_ids = {r.id for leaf in casstore.read_manifest(store, 1).leaves
                if leaf.path.startswith("params/head") for r in leaf.chunks}
    store.reset()
    head = casstore.restore(store, 1, paths=["params/head"])
    read = {k.replace("/", "")[len("chunks"):] for k in store.keys_read
            if k.startswith(CHUNKS_PREFIX)}
    assert read == head_ids
    assert set(head) == {"params"}
    assert set(head["params"]) == {"head"}


def _codecs(store) -> set[int]:
    from casstore._codec import HEADER
    return {HEADER.unpack_from(store.get(info.key))[2] for info in store.list(CHUNKS_PREFIX)}


def test_the_codec_follows_the_store_default_or_the_shuffle_argument_and_dedup_ignores_it(
        tmp_path, monkeypatch):
    from casstore import _compression
    from casstore._codec import CODEC_EXPONENT_PLANES, CODEC_RAW
    from casstore.store import FsspecStore, LocalStore
    # 8 cores encode faster than a local disk writes, so every store's default ("auto") is
    # byte planes; with fewer cores a local disk takes raw chunks (tests/test_compression.py).
    monkeypatch.setattr(_compression, "usable_cores", lambda: 8)
    state = {"w": (np.random.default_rng(0).standard_normal((512, 512)) * 0.02).astype(
        np.float32)}  # 1 MiB of values like trained weights
    stores = [MemoryStore(), LocalStore(tmp_path / "repo"),
              FsspecStore.from_url("memory://casstore-codec-default")]
    assert all(store.shuffle for store in stores)  # byte planes by default, on every store
    for store in stores:
        assert casstore.save(store, 1, state).written_bytes < 0.875 * state["w"].nbytes
        assert _codecs(store) == {CODEC_EXPONENT_PLANES}
    raw = MemoryStore()
    assert casstore.save(raw, 1, state, shuffle=False).written_bytes > state["w"].nbytes
    assert _codecs(raw) == {CODEC_RAW}
    # Chunk ids cover the raw bytes: the other codec finds every chunk already stored.
    assert casstore.save(raw, 2, state).new_chunks == 0
    assert casstore.save(CountingStore(stores[0]), 2, state, shuffle=False).new_chunks == 0
    for store in (*stores, raw):
        np.testing.assert_array_equal(casstore.restore(store, 1)["w"], state["w"])


def test_without_shuffle_byte_planes_are_kept_only_where_they_save_a_quarter():
    """``shuffle=False``: float32 holding bfloat16-rounded values (two zero byte planes)
    compress to about half in byte planes, more than zstd manages: codec 5 even without
    shuffle. Trained-weight-like values (0.83 in planes) stay raw."""
    from casstore._codec import CODEC_EXPONENT_PLANES, CODEC_RAW, HEADER, PLANES_ONLY_IF_SAVING
    x = (np.random.default_rng(0).standard_normal(1 << 18) * 0.02).astype(np.float32)
    rounded = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    store = MemoryStore()
    casstore.save(store, 1, {"rounded": rounded, "weights": x}, shuffle=False)
    stored = {leaf.path: leaf.chunks[0] for leaf in casstore.read_manifest(store, 1).leaves}
    codec = {p: HEADER.unpack_from(store.get(r.key))[2] for p, r in stored.items()}
    assert codec == {"rounded": CODEC_EXPONENT_PLANES, "weights": CODEC_RAW}
    assert stored["rounded"].stored_bytes <= (1 - PLANES_ONLY_IF_SAVING) * rounded.nbytes
    restored = casstore.restore(store, 1)
    assert restored["rounded"].tobytes() == rounded.tobytes()


def _lose_chunk(root, manifest, path: str) -> str:
    """Deletes the chunk object of key path ``path``'s first chunk; returns its id."""
    ref = next(leaf for leaf in manifest.leaves if leaf.path == path).chunks[0]
    (root / ref.key).unlink()
    return ref.id


def test_a_save_on_local_disk_writes_again_a_chunk_lost_since_the_previous_step(tmp_path):
    """format.md §7 lets a save reuse the latest step's chunks unchecked; on local disk, where
    a check costs a stat, a lost one is written again, so the new step restores."""
    root = tmp_path / "repo"
    state = train_state(1)
    casstore.save(str(root), 0, state, chunk_size_bytes=CHUNK)
    lost = _lose_chunk(root, casstore.read_manifest(str(root), 0), "params/base/embed")
    info = casstore.save(str(root), 1, state, chunk_size_bytes=CHUNK)
    assert info.new_chunks == 1
    assert lost in casstore.read_manifest(str(root), 1).chunk_ids()
    assert casstore.verify(str(root), 1).ok
    restored = casstore.restore(str(root), 1)
    np.testing.assert_array_equal(restored["params"]["base"]["embed"],
                                  state["params"]["base"]["embed"])
    # An object store is not checked (a request per chunk): the step reuses it unchecked.
    memory = MemoryStore()
    casstore.save(memory, 0, state, chunk_size_bytes=CHUNK)
    ref = casstore.read_manifest(memory, 0).leaves[0].chunks[0]
    memory.delete(ref.key)
    assert casstore.save(memory, 1, state, chunk_size_bytes=CHUNK).new_chunks == 0


def test_a_save_on_local_disk_writes_again_a_chunk_cut_short_since_the_previous_step(
        tmp_path):
    """A chunk object of the latest step cut short (a crash of the disk, not of casstore):
    the save found it by its key and committed a step whose restore raised CorruptChunkError
    (an exploratory session's fuzz). Its size is not the manifest's: written again."""
    root = tmp_path / "repo"
    state = train_state(1)
    casstore.save(str(root), 0, state, chunk_size_bytes=CHUNK)
    ref = next(leaf for leaf in casstore.read_manifest(str(root), 0).leaves
               if leaf.path == "params/base/embed").chunks[0]
    path = root / ref.key
    path.write_bytes(path.read_bytes()[: ref.stored_bytes // 2])
    info = casstore.save(str(root), 1, state, chunk_size_bytes=CHUNK)
    assert info.new_chunks == 1
    assert path.stat().st_size == ref.stored_bytes
    assert casstore.verify(str(root), 1).ok
    restored = casstore.restore(str(root), 1)
    np.testing.assert_array_equal(restored["params"]["base"]["embed"],
                                  state["params"]["base"]["embed"])


def test_a_manager_on_local_disk_writes_again_a_chunk_lost_since_its_last_step(tmp_path):
    """The same through an asynchronous manager, for numpy leaves (their blocks are hashed at
    staging) and jax leaves (handed over by remembered chunk id, without a copy)."""
    root = tmp_path / "repo"
    state = train_state(1)
    state["params"]["base"]["embed"] = jnp.asarray(state["params"]["base"]["embed"])
    with casstore.CheckpointManager(str(root), enable_async_checkpointing=True) as mngr:
        for step in (0, 1):
            mngr.save(step, state)
            mngr.wait_until_finished()
        manifest = casstore.read_manifest(str(root), 1)
        _lose_chunk(root, manifest, "params/base/embed")
        _lose_chunk(root, manifest, "params/base/layers/[0]/w")
        mngr.save(2, state)
        mngr.wait_until_finished()
        assert mngr.last_save_info.new_chunks == 2
    assert casstore.verify(str(root), 2).ok
    restored = casstore.restore(str(root), 2)
    for path in (("embed",), ("layers", 0, "w")):
        want, got = state["params"]["base"], restored["params"]["base"]
        for k in path:
            want, got = want[k], got[k]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
