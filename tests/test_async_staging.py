"""Asynchronous saves record the values at save() time, for every leaf kind and store kind;
staging stays within its cap; the manager does not list the store on every step."""

import threading
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import casstore
from casstore import _chunking, _staging
from casstore.store import CountingStore, MemoryStore, Store

from conftest import GatedStore, object_store


class Gated(Store):
    """Wraps a store and holds every chunk write until ``gate`` is set."""

    def __init__(self, inner: Store):
        self.inner, self.url, self.shuffle = inner, inner.url, inner.shuffle
        self.max_workers = inner.max_workers
        self.gate = threading.Event()

    def get(self, key):
        return self.inner.get(key)

    def exists(self, key):
        return self.inner.exists(key)

    def stat(self, key):
        return self.inner.stat(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def _put(self, key, data, *, exclusive):
        if key.startswith("chunks/"):
            assert self.gate.wait(60)
        (self.inner.put_if_absent if exclusive else self.inner.put)(key, data)

    def _delete(self, key):
        self.inner.delete(key)


def mesh():
    return jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])


def leaf_kinds():
    """(name, make, spoil): ``make()`` builds the leaf; ``spoil(leaf)`` returns what the caller
    has after overwriting (numpy, in place) or donating (jax, through a jitted step) it."""
    donate = jax.jit(lambda x: x * 0 - 7, donate_argnums=0)

    def overwrite(a):
        a[...] = -7
        return a

    big = np.arange(300_000, dtype=np.float32)
    return [
        ("numpy contiguous", lambda: np.arange(200_000, dtype=np.float32), overwrite),
        ("numpy strided", lambda: np.arange(400_000, dtype=np.float64)[::2], overwrite),
        ("numpy view of a larger buffer", lambda: big.copy()[1000:250_000], overwrite),
        ("numpy big-endian", lambda: np.arange(70_000, dtype=">i4"), overwrite),
        ("numpy 0-d", lambda: np.array(3.5, np.float32), overwrite),
        ("numpy small (packed)", lambda: np.arange(1000, dtype=np.int16), overwrite),
        ("numpy scalar", lambda: np.float32(2.5), lambda a: np.float32(-7)),
        ("jax cpu", lambda: jnp.arange(200_000, dtype=jnp.float32), donate),
        ("jax sharded", lambda: jax.device_put(
            jnp.arange(64 * 1024, dtype=jnp.float32).reshape(256, 256),
            NamedSharding(mesh(), P("data", "model"))), donate),
        ("typed prng keys", lambda: jax.random.split(jax.random.key(0), 4096),
         lambda k: jax.jit(lambda k: jax.random.split(k[0], k.shape[0]),
                           donate_argnums=0)(k)),
        ("python scalars, str, bytes", lambda: (3, 2.5, True, "text", b"\x00\x01"),
         lambda t: None),
    ]


def as_numpy(leaf):
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(leaf))
    if isinstance(leaf, tuple):
        return leaf
    return np.asarray(leaf)


@pytest.fixture(params=["local", "seaweedfs"])
def gated(request, tmp_path):
    inner = (object_store(request.getfixturevalue("object_servers")["seaweedfs"])
             if request.param == "seaweedfs" else casstore.LocalStore(tmp_path / "repo"))
    return Gated(inner)


@pytest.mark.parametrize(("name", "make", "spoil"), leaf_kinds(), ids=[k[0] for k in leaf_kinds()])
def test_overwrite_or_donate_after_save_returns_keeps_the_saved_values(gated, name, make,
                                                                       spoil):
    leaf = make()
    expected = as_numpy(leaf)
    expected = expected.copy() if isinstance(expected, np.ndarray) else expected
    with casstore.CheckpointManager(gated) as mngr:
        mngr.save(4, {"leaf": leaf, "other": np.ones(3)})
        spoiled = spoil(leaf)  # the chunk writes are still held: the save is in flight
        del leaf
        jax.block_until_ready(spoiled)
        gated.gate.set()
        mngr.wait_until_finished()
        restored = as_numpy(mngr.restore(4)["leaf"])
    if isinstance(expected, tuple):
        assert tuple(restored) == expected
    else:
        assert restored.dtype.str[1:] == expected.dtype.str[1:], name  # restored little-endian
        assert restored.astype(expected.dtype).tobytes() == expected.tobytes(), name


@pytest.fixture
def accelerator_path(monkeypatch):
    """Treats CPU devices as accelerators: jax arrays are then copied block by block into
    pinned host memory (the path a GPU takes), which CPU devices of jax also offer."""
    monkeypatch.setattr(_chunking, "on_host", lambda x: False)


def test_staging_cap_smaller_than_the_state_streams_it_bit_exact(accelerator_path):
    chunk = 64 * 1024
    rng = np.random.default_rng(0)
    state = {f"layer{i}": jnp.asarray(rng.standard_normal((256, 256)).astype(np.float32))
             for i in range(6)}  # 6 x 256 KiB of accelerator arrays
    state["np"] = rng.standard_normal((512, 256)).astype(np.float32)  # 512 KiB, copied
    store = Gated(MemoryStore())
    cap = 4 * chunk
    with casstore.CheckpointManager(store, max_staging_bytes=cap,
                                    chunk_size_bytes=chunk) as mngr:
        done = threading.Event()
        saver = threading.Thread(target=lambda: (mngr.save(1, state), done.set()))
        saver.start()
        # save() cannot return while the writes are held: the state does not fit the cap.
        assert not done.wait(1.0)
        store.gate.set()
        saver.join(60)
        assert done.is_set()
        assert 0 < mngr.last_staging_peak_bytes <= cap
        mngr.wait_until_finished()
        restored = mngr.restore(1)
    for key, value in state.items():
        assert restored[key].tobytes() == np.asarray(value).tobytes(), key


def test_without_a_cap_save_returns_before_any_chunk_is_written(accelerator_path):
    store = Gated(MemoryStore())
    x = jnp.arange(1_000_000, dtype=jnp.float32)
    donate = jax.jit(lambda v: v + 1, donate_argnums=0)
    with casstore.CheckpointManager(store) as mngr:
        mngr.save(1, {"x": x})  # returns although every chunk write is held
        assert mngr.last_staging_peak_bytes == x.nbytes
        x = donate(x)
        jax.block_until_ready(x)
        store.gate.set()
        mngr.wait_until_finished()
        np.testing.assert_array_equal(mngr.restore(1)["x"], np.arange(1_000_000,
                                                                      dtype=np.float32))


def test_the_accelerator_path_leaves_no_host_copy_on_the_saved_array(accelerator_path,
                                                                     tmp_path):
    x = jnp.arange(100_000, dtype=jnp.float32)
    casstore.save(tmp_path, 0, {"x": x}, chunk_size_bytes=64 * 1024)
    assert getattr(x, "_npy_value", None) is None  # np.asarray(x) would have cached one
    assert all(getattr(s.data, "_npy_value", None) is None for s in x.addressable_shards)
    np.testing.assert_array_equal(casstore.restore(tmp_path, 0)["x"], np.asarray(x))


def test_a_staging_cap_below_one_chunk_is_refused():
    with pytest.raises(ValueError, match="smaller than one chunk"):
        casstore.CheckpointManager(MemoryStore(), max_staging_bytes=1024,
                                   chunk_size_bytes=4096)


def test_a_failing_background_save_does_not_leave_save_blocked():
    class Broken(MemoryStore):
        def _put(self, key, data, *, exclusive):
            if key.startswith("chunks/"):
                raise PermissionError("denied")
            super()._put(key, data, exclusive=exclusive)

    big = {f"a{i}": np.full(64 * 1024, i, np.float32) for i in range(16)}  # 4 MiB, cap 1 MiB
    mngr = casstore.CheckpointManager(Broken(), max_staging_bytes=2**20,
                                      chunk_size_bytes=256 * 1024)
    mngr.save(1, big)  # returns: the background save failed and abandoned the stream
    with pytest.raises(PermissionError, match="denied"):
        mngr.wait_until_finished()
    assert mngr.latest_step() is None
    assert casstore.list_steps(mngr.store) == []
    mngr.close()


def test_a_thousand_should_save_calls_make_no_listing():
    store = CountingStore(MemoryStore())
    with casstore.CheckpointManager(store, save_interval_steps=100, max_to_keep=2) as mngr:
        lists_after_construction = store.counts["list"]
        store.reset()
        due = [s for s in range(1000) if mngr.should_save(s)]
        assert store.counts["list"] == 0
        assert sum(store.counts.values()) == 0
        assert due == list(range(1000))  # no step yet: any is the first (InitialSavePolicy)
        for step in (0, 100, 200):
            mngr.save(step, {"w": np.full(10, step)})
        mngr.wait_until_finished()
        saving_requests = store.counts["list"]
        store.reset()
        assert [s for s in range(1000) if mngr.should_save(s)] == list(range(300, 1000, 100))
        assert store.counts["list"] == 0
        assert mngr.all_steps() == [100, 200]
        assert mngr.latest_step() == 200
    assert lists_after_construction <= 1  # none at all in a repository not created yet
    # each save lists the locks (save lock) and nothing that grows with the steps or chunks
    assert saving_requests <= 3 * 3


def test_reload_sees_steps_written_by_another_writer():
    store = MemoryStore()
    with casstore.CheckpointManager(store) as mngr:
        casstore.save(store, 7, {"w": np.ones(3)})
        assert mngr.latest_step() is None
        assert mngr.should_save(5)
        mngr.reload()
        assert mngr.latest_step() == 7
        assert not mngr.should_save(5)
        assert mngr.all_steps(read=True) == [7]


def fill_with_chunks(store: Store, n: int) -> None:
    """Stores ``n`` distinct valid chunk objects that no manifest references."""
    from casstore._codec import chunk_id, encode_chunk
    from casstore._layout import chunk_key
    raws = [memoryview(i.to_bytes(8, "little") * 4) for i in range(n)]
    store.put_many({chunk_key(chunk_id(raw)): encode_chunk(raw) for raw in raws})  # concurrent


@pytest.mark.parametrize("backend", ["local", "seaweedfs"])
def test_save_requests_do_not_grow_with_the_chunks_in_the_repository(backend, tmp_path,
                                                                     request):
    def open_repo(name):
        if backend == "local":
            return CountingStore(casstore.LocalStore(tmp_path / name))
        return CountingStore(object_store(request.getfixturevalue("object_servers")[backend]))

    rng = np.random.default_rng(1)
    tree = {"a": rng.standard_normal(300_000).astype(np.float32), "b": np.arange(10)}
    counts, written = [], []
    # 1000 stored chunks: a request per stored chunk shows at any count (3000 took 14 s of
    # PUTs to SeaweedFS on the loaded 2 cores).
    for name, extra in (("fresh", 0), ("full", 1000)):
        store = open_repo(name)
        casstore.save(store, 0, {"w": np.zeros(5)})
        fill_with_chunks(store, extra)
        store.reset()
        info = casstore.save(store, 1, tree, chunk_size_bytes=256 * 1024)
        counts.append(dict(store.counts))
        written.append(info.written_bytes)
        np.testing.assert_array_equal(casstore.restore(store, 1)["a"], tree["a"])
    assert counts[0] == counts[1]  # the same requests, one by one, whatever the repository holds
    assert written[0] == written[1]


def test_chunks_of_the_latest_step_are_reused_without_a_request():
    store = CountingStore(MemoryStore())
    tree = {"frozen": np.arange(1_000_000, dtype=np.float32), "head": np.zeros(10)}
    casstore.save(store, 0, tree, chunk_size_bytes=2**20)
    store.reset()
    info = casstore.save(store, 1, tree | {"head": np.ones(10)}, chunk_size_bytes=2**20)
    # the 4 frozen chunks come from step 0's manifest; only the changed head's pack is looked up
    assert store.counts["stat"] == 1
    assert store.counts["put"] == 2
    assert info.new_chunks == 1
    assert info.reused_chunks == 4


def gc_when(store: Store, key: str, locks: bool, monkeypatch, before=lambda: None) -> Store:
    """A store that, right after a save first reads ``key``, calls ``before()`` and then runs a
    whole garbage collection (grace period 0), with casstore's locks on or off."""
    from casstore import _gc, _save
    if not locks:
        import contextlib
        unlocked = type("Unlocked", (), {"check": lambda self: None})()  # no lease to check
        monkeypatch.setattr(_save, "save_lock", lambda store: contextlib.nullcontext(unlocked))
        monkeypatch.setattr(_gc, "gc_lock",
                            lambda store, timeout: contextlib.nullcontext(unlocked))
    outcome = []

    def collect():
        try:
            outcome.append(casstore.gc(store, grace_period_s=0, lock_timeout_s=1))
        except casstore.CasstoreError as e:
            outcome.append(e)

    class Racing(CountingStore):
        def _race(self, touched):
            if touched == key and not outcome:
                before()
                t = threading.Thread(target=collect)
                t.start()
                t.join()

        def stat(self, k):
            info = super().stat(k)
            self._race(k)
            return info

        def get(self, k):
            data = super().get(k)
            self._race(k)
            return data

        def head(self, k, nbytes):  # a manifest is read by head (bounded), not get
            data = super().head(k, nbytes)
            self._race(k)
            return data

    racing = Racing(store)
    racing.outcome = outcome
    return racing


@pytest.mark.parametrize("locks", [True, False], ids=["locks", "no-locks"])
@pytest.mark.parametrize("path", ["looked-up chunk", "latest manifest"])
def test_gc_racing_a_save_breaks_the_step_only_without_locks(tmp_path, monkeypatch, locks,
                                                             path):
    from casstore._layout import chunk_key, manifest_key
    store = casstore.LocalStore(tmp_path / "repo")
    w = np.arange(50_000, dtype=np.float32)
    casstore.save(store, 0, {"w": w}, run="a")
    cid = casstore.read_manifest(store, 0, run="a").leaves[0].chunks[0].id
    if path == "looked-up chunk":
        casstore.save(store, 0, {"other": np.ones(3)}, run="keep")  # a save here looks chunks up
        casstore.delete(store, 0, run="a")  # w's chunk is now unreferenced
        racing, run = gc_when(store, chunk_key(cid), locks, monkeypatch), "b"
    else:  # retention deletes the step whose manifest the save just read, then GC runs
        racing = gc_when(store, manifest_key("a", 0), locks, monkeypatch,
                         before=lambda: casstore.delete(store, 0, run="a"))
        run = "a"
    casstore.save(racing, 1, {"w": w}, run=run)
    assert racing.outcome, "the race did not happen"
    report = casstore.verify(store)
    if locks:
        assert isinstance(racing.outcome[0], casstore.CasstoreError)  # GC gave way to the save
        assert report.ok
        np.testing.assert_array_equal(casstore.restore(store, 1, run=run)["w"], w)
    else:
        assert racing.outcome[0].deleted_chunks >= 1
        assert not report.ok  # the committed step references a chunk GC deleted
        with pytest.raises(casstore.MissingChunkError, match="chunk object missing"):
            casstore.restore(store, 1, run=run)


def test_the_first_save_into_an_empty_repository_looks_up_no_chunk():
    store = CountingStore(MemoryStore())
    tree = {"w": np.arange(1_000_000, dtype=np.float32), "head": np.zeros(10)}
    info = casstore.save(store, 0, tree, chunk_size_bytes=2**20)
    assert store.counts["stat"] == 0
    assert info.new_chunks == 5
    # Another run in the same repository still finds the chunks the first one stored.
    store.reset()
    info = casstore.save(store, 0, tree | {"head": np.ones(10)}, run="other",
                         chunk_size_bytes=2**20)
    assert store.counts["stat"] == 5
    assert info.reused_chunks == 4
    assert info.new_chunks == 1
    np.testing.assert_array_equal(casstore.restore(store, 0, run="other")["w"], tree["w"])


def test_unchanged_numpy_blocks_are_handed_over_by_chunk_id_not_copied(gated, monkeypatch):
    from casstore import _staging

    staged = []  # (handed over by id, raw bytes) of every numpy block staging saw
    independent = _staging._independent

    def spy(job, stored, hash_numpy):
        out = independent(job, stored, hash_numpy)
        if job.caller_memory:
            staged.append((out.read is None, job.nbytes))
        return out

    monkeypatch.setattr(_staging, "_independent", spy)
    rng = np.random.default_rng(0)
    base = rng.normal(size=4 * 2**14).astype(np.float32)  # 4 chunks of 64 KiB
    head = rng.normal(size=2**15).astype(np.float32)  # 2 chunks
    first = {"base": base.copy(), "head": head.copy()}
    with casstore.CheckpointManager(gated, chunk_size_bytes=2**16) as mngr:
        gated.gate.set()
        for step in (1, 2):  # the first save wrote every chunk, so the second copies unhashed
            staged.clear()
            mngr.save(step, {"base": base, "head": head})
            mngr.wait_until_finished()
            assert sorted(staged) == [(False, 2**16)] * 6, step
        assert mngr.last_save_info.reused_chunks == 6  # the second reused them all: now hash
        gated.gate.clear()
        base[-10:] = 5.0  # the last of base's chunks changes, the other three do not
        head += 1.0
        expected = {"base": base.copy(), "head": head.copy()}
        staged.clear()
        mngr.save(3, {"base": base, "head": head})
        assert sorted(staged) == [(False, 2**16)] * 3 + [(True, 2**16)] * 3
        base[:] = -7.0  # the caller overwrites everything while the save is in flight
        head[:] = -7.0
        gated.gate.set()
        mngr.wait_until_finished()
        assert mngr.last_save_info.reused_chunks == 3
        for step, want in ((1, first), (3, expected)):
            got = mngr.restore(step)
            for k in want:
                assert got[k].tobytes() == want[k].tobytes(), (step, k)


def test_a_chunk_staged_as_stored_but_gone_fails_the_save_by_name():
    from casstore._save_encode import ChunkWriter

    writer = ChunkWriter(MemoryStore(), None, 1, False, delta=False)
    with pytest.raises(casstore.CasstoreError, match=r"another process deleted.*save again"):
        writer.write(None, 4, None, "0" * 32)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_previous_step_deleted_and_collected_meanwhile_never_commits_a_broken_step(tmp_path,
                                                                                  where):
    """The manager stages a frozen base by chunk id against the manifest it read after its
    last commit. Another process deleting that step and collecting its chunks made the next
    save commit a step naming missing chunks. Now, on local disk, where a save checks the
    chunks it reuses (a stat each), it finds them gone and stores them again; on a store
    without cheap checks (fsspec's memory filesystem, as an object store) that save fails,
    and the next one works."""
    url = str(tmp_path / "r") if where == "local" else f"memory://r-{uuid.uuid4().hex}"
    rng = np.random.default_rng(0)
    base = rng.normal(size=8 * 2**14).astype(np.float32)  # 8 chunks of 64 KiB, frozen
    head = rng.normal(size=2**14).astype(np.float32)
    with casstore.CheckpointManager(url, max_to_keep=1, chunk_size_bytes=2**16) as mngr:
        for step in (0, 1):  # the second reuses the base: the third stages it by id
            mngr.save(step, {"base": base, "head": head + step})
            mngr.wait_until_finished()
        casstore.delete(url, 1)  # another process, e.g. `casstore rm` then `casstore gc`
        assert casstore.gc(url, grace_period_s=0).deleted_chunks == 10  # the base, 2 heads
        mngr.save(2, {"base": base, "head": head + 2})
        if where == "local":
            mngr.wait_until_finished()
            assert mngr.last_save_info.new_chunks == 9  # the base again, and the head
        else:
            with pytest.raises(casstore.CasstoreError, match="another process deleted"):
                mngr.wait_until_finished()
            assert casstore.list_steps(url) == []
            mngr.save(2, {"base": base, "head": head + 2}, force=True)
    assert casstore.list_steps(url) == [2]
    assert casstore.verify(url).ok
    got = casstore.restore(url, 2)
    assert got["base"].tobytes() == base.tobytes()
    assert got["head"].tobytes() == (head + 2).tobytes()


def test_an_async_checkpointer_stages_a_frozen_base_by_chunk_id_as_the_manager_does(tmp_path):
    """AsyncCheckpointer dropped its last committed manifest at every save (it knows no
    "previous step" of the run as the manager does): each save copied and hashed the frozen
    base again, and an unchanged jax array's remembered ids went unused."""
    url = str(tmp_path / "r")
    rng = np.random.default_rng(0)
    base = rng.normal(size=8 * 2**14).astype(np.float32)  # 8 chunks of 64 KiB, frozen
    frozen = jnp.asarray(rng.normal(size=8 * 2**14).astype(np.float32))
    with casstore.AsyncCheckpointer(url, chunk_size_bytes=2**16) as ckptr:
        for step in range(3):  # the second reuses the base: the third stages it by id
            ckptr.save(step, {"base": base, "frozen": frozen, "head": np.full(10, step)})
            ckptr.wait_until_finished()
        assert ckptr.last_staging_peak_bytes < 2**16  # the head alone was copied
        casstore.delete(url, 2)  # another process, then a collection: the next save's
        casstore.delete(url, 1)  # previous step is gone, and its ids are staged anyway
        casstore.gc(url, grace_period_s=0)
        ckptr.save(3, {"base": base, "frozen": frozen, "head": np.full(10, 3)})
        ckptr.wait_until_finished()  # on local disk the writer finds them gone: stored again
    assert casstore.verify(url).ok
    got = casstore.restore(url, 3)
    assert got["base"].tobytes() == base.tobytes()
    assert got["frozen"].tobytes() == np.asarray(frozen).tobytes()


def test_a_previous_step_deleted_but_not_collected_is_reused_by_lookup(tmp_path):
    url = str(tmp_path / "r")
    base = np.random.default_rng(0).normal(size=8 * 2**14).astype(np.float32)
    with casstore.CheckpointManager(url, max_to_keep=1, chunk_size_bytes=2**16) as mngr:
        for step in (0, 1):
            mngr.save(step, {"base": base, "head": np.full(10, step)})
            mngr.wait_until_finished()
        casstore.delete(url, 1)  # its chunks stay (no gc): the staged ids are still stored
        mngr.save(2, {"base": base, "head": np.full(10, 2)})
    assert casstore.verify(url).ok
    assert casstore.restore(url, 2)["base"].tobytes() == base.tobytes()


def test_a_block_written_by_another_thread_during_staging_is_never_stored_corrupt(monkeypatch):
    """Staging hashed the caller's live block, then copied it: a write between the two
    stored bytes under another block's id (verify: corrupt; later steps deduped onto it)."""
    chunk = 256 * 1024
    x = np.zeros(16 * chunk // 4, np.float32)
    hashed = _staging.chunk_id
    armed = []

    def hash_then_write(raw):  # "another thread" writes just after staging hashes the block
        cid = hashed(raw)
        if armed:
            armed.clear()
            x[:10] = 99.0
        return cid

    monkeypatch.setattr(_staging, "chunk_id", hash_then_write)
    store = MemoryStore()
    with casstore.CheckpointManager(store, chunk_size_bytes=chunk) as mngr:
        for step in (0, 1):  # the second reuses every chunk: staging now hashes numpy blocks
            mngr.save(step, {"x": x})
            mngr.wait_until_finished()
        x[:] = 1.0
        armed.append(True)
        mngr.save(2, {"x": x})
        mngr.wait_until_finished()
        assert not armed  # the write happened during staging
        x[:] = 1.0
        mngr.save(3, {"x": x})
    assert casstore.verify(store).ok
    for step in (2, 3):
        assert set(np.unique(casstore.restore(store, step)["x"])) <= {1.0, 99.0}
    np.testing.assert_array_equal(casstore.restore(store, 3)["x"], np.ones_like(x))


def test_packs_are_read_as_the_staging_budget_allows_not_all_at_once(monkeypatch):
    """Small leaves (packed) were all copied, twice, before staging began: 256 MiB of 60 kB
    leaves took 531 MiB of extra memory with max_staging_bytes of 4 MiB (now 23 MiB)."""
    from casstore import _save_plan

    events = []
    read_pack = _save_plan._read_pack
    monkeypatch.setattr(_save_plan, "_read_pack",
                        lambda *a: events.append("read") or read_pack(*a))

    class Recording(MemoryStore):
        def _put(self, key, data, *, exclusive):
            if key.startswith("chunks/"):
                events.append("put")
            super()._put(key, data, exclusive=exclusive)

    rng = np.random.default_rng(0)
    tree = {f"b{i:02d}": rng.standard_normal(15_000).astype(np.float32) for i in range(64)}
    store = Recording()
    with casstore.CheckpointManager(store, chunk_size_bytes=2**20,
                                    max_staging_bytes=2**20) as mngr:
        mngr.save(0, tree)
    reads = [i for i, e in enumerate(events) if e == "read"]
    assert len(reads) == 4  # 16 leaves of 60 kB a pack
    assert events.index("put") < reads[-1]  # a pack was stored before the last was read
    restored = casstore.restore(store, 0)
    assert all(restored[k].tobytes() == v.tobytes() for k, v in tree.items())


def test_shards_of_a_few_chunks_are_copied_whole_many_per_call_and_survive_donation(
        accelerator_path, monkeypatch):
    from casstore import _save_plan

    monkeypatch.setattr(_save_plan, "on_host", lambda x: False)
    blocks, wholes = [], []
    block_copy, whole_copies = _save_plan.start_host_copy, _save_plan.start_host_copies
    monkeypatch.setattr(_save_plan, "start_host_copy", lambda x, a, b: blocks.append(
        (tuple(a), tuple(b))) or block_copy(x, a, b))
    monkeypatch.setattr(_save_plan, "start_host_copies", lambda xs: wholes.append(
        sorted(x.size for x in xs)) or whole_copies(xs))
    chunk = 2**17  # float32 blocks of 2**15 elements; leaves up to 64 KiB are packed
    rng = np.random.default_rng(0)
    tree = {"few": jnp.asarray(rng.standard_normal(3 * 2**14 + 5).astype(np.float32)),
            "many": jnp.asarray(rng.standard_normal(5 * 2**15).astype(np.float32)),
            "one": jnp.asarray(rng.standard_normal(25_600).astype(np.float32)),
            "sharded": jax.device_put(jnp.asarray(rng.standard_normal((256, 256), np.float32)),
                                      NamedSharding(mesh(), P("data", "model")))}
    expected = {k: np.array(v) for k, v in tree.items()}
    store = GatedStore()
    with casstore.CheckpointManager(store, chunk_size_bytes=chunk) as mngr:
        mngr.save(1, tree)  # the chunk writes are held: the save is in flight
        # few (2 blocks, at most 4 chunks), one (1 block) and sharded's 8 shards (on 8
        # devices): copied whole, in one call; many (5 blocks, over 4 chunks): a copy a block
        assert wholes == [[64 * 128] * 8 + [25_600, 3 * 2**14 + 5]]
        assert sorted(blocks) == [((a,), (a + 2**15,)) for a in range(0, 5 * 2**15, 2**15)]
        tree = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 7, t), donate_argnums=0)(tree)
        jax.block_until_ready(tree)
        store.gate.set()
        mngr.wait_until_finished()
        assert mngr.last_save_info.new_chunks == 2 + 5 + 1 + 8
        restored = mngr.restore(1)
    for k, v in expected.items():
        assert restored[k].tobytes() == v.tobytes(), k


def test_small_accelerator_leaves_are_copied_a_chunk_of_packs_per_call(accelerator_path,
                                                                       monkeypatch):
    from casstore import _save_plan

    monkeypatch.setattr(_save_plan, "on_host", lambda x: False)
    calls = []
    real = _save_plan.start_host_copies
    monkeypatch.setattr(_save_plan, "start_host_copies",
                        lambda xs: calls.append(len(xs)) or real(xs))
    tree = {f"layer{p}": {f"b{k}": jnp.full(1000, p * 10 + k, jnp.float32) for k in range(4)}
            for p in range(10)}  # 10 packs of 4 leaves, 16 kB a pack
    store = MemoryStore()
    with casstore.CheckpointManager(store, chunk_size_bytes=2**16) as mngr:
        mngr.save(1, tree)
    assert calls == [16, 16, 8]  # 4 packs (64 kB) a call, then the 2 left
    restored = casstore.restore(store, 1)
    for p in range(10):
        for k in range(4):
            np.testing.assert_array_equal(restored[f"layer{p}"][f"b{k}"], p * 10 + k)
