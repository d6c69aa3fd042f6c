"""The GC lock is a lease: a dead GC's lock stops holding saves up once it is stale, and a GC
that cannot keep its lock fresh stops deleting."""

import os
import threading
import time

import numpy as np
import pytest

import casstore
from casstore import _locks
from casstore._layout import CHUNKS_PREFIX, chunk_id_of_key
from casstore.store import LocalStore, MemoryStore


def test_a_live_gc_lock_holds_a_save_and_a_stale_one_does_not(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(_locks, "WAIT_NOTICE_S", 0.2)
    store = LocalStore(tmp_path / "repo")
    casstore.save(store, 0, {"w": np.zeros(3)})
    key = _locks._put_lock(store, "gc")  # as a GC that was SIGKILLed while sweeping left it
    done = threading.Event()
    saver = threading.Thread(target=lambda: (casstore.save(store, 1, {"w": np.ones(3)}),
                                             done.set()))
    with caplog.at_level("WARNING", logger="casstore"):
        saver.start()
        assert not done.wait(1.0)  # a fresh GC lock: the save waits for GC, and says so
    assert f"waits for garbage collection to finish (lock {key})" in caplog.text
    old = time.time() - _locks.GC_LOCK_STALE_S - 5
    os.utime(store._path(key), (old, old))  # ten minutes without a refresh: a dead GC
    assert done.wait(10)
    saver.join()
    assert casstore.list_steps(store) == [0, 1]


@pytest.mark.parametrize("kind", ["gc", "save"])
def test_a_lock_dated_further_in_the_future_than_its_stale_age_holds_no_one(tmp_path, kind):
    """A killed GC's lock stamped a day ahead (a clock set back, a copy made with ``cp -p`` from
    a host ahead) held every save off for that day plus ten minutes (exploratory session's
    repro); a save lock so dated held GC off alike. Within the stale age it still holds."""
    store = LocalStore(tmp_path / "repo")
    casstore.save(store, 0, {"w": np.zeros(3)})
    key = _locks._put_lock(store, kind)
    for ahead, live in ((_locks._timing(kind)[1] / 2, [key]), (24 * 3600 + 5, [])):
        future = time.time() + ahead
        os.utime(store._path(key), (future, future))
        assert _locks._live(store, kind) == live
    casstore.save(store, 1, {"w": np.ones(3)})  # neither waits
    assert casstore.gc(store, lock_timeout_s=1).manifests == 2


def test_a_live_gc_lock_holds_a_save_whose_clock_is_behind_the_stores(tmp_path, monkeypatch):
    """Lock ages are on the store's clock, read off the caller's own lock: on this machine's,
    a client an hour behind the store took a GC lock put a second ago for one from the
    future, stale, and saved during the sweep (review of the fix above)."""
    import types

    store = LocalStore(tmp_path / "repo")
    casstore.save(store, 0, {"w": np.zeros(3)})
    key = _locks._put_lock(store, "gc")  # a GC sweeping now, as the store's clock says
    behind = types.SimpleNamespace(time=lambda: time.time() - 3600, monotonic=time.monotonic,
                                   sleep=time.sleep)
    monkeypatch.setattr(_locks, "time", behind)
    done = threading.Event()
    saver = threading.Thread(target=lambda: (casstore.save(store, 1, {"w": np.ones(3)}),
                                             done.set()))
    saver.start()
    assert not done.wait(1.0)  # it waits for the GC
    store.delete(key)  # the GC ends
    assert done.wait(10)
    saver.join()
    assert casstore.list_steps(store) == [0, 1]


def test_a_save_that_waited_for_a_long_gc_puts_its_lock_again_before_it_starts(tmp_path,
                                                                                 monkeypatch):
    """A save waits for a GC without refreshing its lock: after a wait longer than the stale
    age, the next GC took the live save's lock for a dead process's and deleted a chunk the
    save then found present and reused (a committed step without it)."""
    monkeypatch.setattr(_locks, "STALE_LOCK_S", 2.0)
    monkeypatch.setattr(_locks, "SAVE_LOCK_REFRESH_S", 3600.0)  # no refresh within the test
    store = LocalStore(tmp_path / "repo")
    gc = _locks._put_lock(store, "gc")  # a live GC, running longer than STALE_LOCK_S
    ages = []

    def save():
        with _locks.save_lock(store):
            (key,) = [info.key for info in store.list("locks/") if "save-" in info.key]
            ages.append(time.time() - store.stat(key).mtime)

    saver = threading.Thread(target=save)
    saver.start()
    time.sleep(2.5)  # the save's first put is now stale
    assert not ages  # still waiting for the GC
    store.delete(gc)
    saver.join(30)
    assert len(ages) == 1
    assert ages[0] < 1.0, ages  # put again after the wait: a GC finds it live


def test_a_gc_paused_between_its_lock_and_its_lease_deletes_nothing(tmp_path, monkeypatch):
    """The GC lease counted from its start, after the check for saves: a GC paused there past
    the stale age (a saver meanwhile ignored its lock and reused a chunk) passed its checks
    and went on deleting. It counts from the put now, and its first check refuses."""
    monkeypatch.setattr(_locks, "GC_LOCK_STALE_S", 1.0)
    monkeypatch.setattr(_locks, "GC_LOCK_REFRESH_S", 3600.0)  # no refresh within the test
    live, calls = _locks._live, []

    def paused_after_the_put(store, kind, own=None):  # the look for saves after the put
        calls.append(kind)
        if len(calls) == 2:
            time.sleep(0.8)  # past half the stale age: a save may have ignored the lock
        return live(store, kind, own)

    monkeypatch.setattr(_locks, "_live", paused_after_the_put)
    with _locks.gc_lock(LocalStore(tmp_path / "repo"), timeout_s=10) as lease, pytest.raises(
            casstore.CasstoreError, match="could not keep its lock"):
        lease.check()


def test_a_save_lock_held_for_longer_than_the_stale_age_stays_live(tmp_path, monkeypatch):
    """A copy of terabytes holds its save lock for hours: it is re-put, so GC never takes it
    for a dead process's and sweeps chunks the copy counted on; none is left after it."""
    monkeypatch.setattr(_locks, "SAVE_LOCK_REFRESH_S", 0.1)
    monkeypatch.setattr(_locks, "STALE_LOCK_S", 3.0)
    store = LocalStore(tmp_path / "repo")
    with _locks.save_lock(store):
        (key,) = [info.key for info in store.list("locks/")]
        first = store.stat(key).mtime
        time.sleep(3.5)  # past the stale age: re-put meanwhile
        assert store.stat(key).mtime > first
        assert _locks._live(store, "save") == [key]
    assert not list(store.list("locks/"))


def test_gc_refreshes_its_lock_while_it_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(_locks, "GC_LOCK_REFRESH_S", 0.05)
    store = LocalStore(tmp_path / "repo")
    casstore.save(store, 0, {"w": np.zeros(3)})
    with _locks.gc_lock(store, 5) as lease:
        first = store.stat(lease.key).mtime
        deadline = time.monotonic() + 10  # refreshes every 0.05 s; a loaded machine may lag
        while store.stat(lease.key).mtime == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.stat(lease.key).mtime > first
        lease.check()
    assert not list(store.list("locks/"))


def test_gc_that_cannot_refresh_its_lock_stops_deleting(tmp_path, monkeypatch):
    monkeypatch.setattr(_locks, "GC_LOCK_REFRESH_S", 0.02)
    monkeypatch.setattr(_locks, "GC_LOCK_STALE_S", 0.4)  # lease: refreshes within 0.2 s

    class Stalling(LocalStore):
        """Refreshes of the GC lock fail once GC starts deleting; deletes take 50 ms."""
        deleting = False

        def _put(self, key, data, *, exclusive):
            if self.deleting and key.startswith("locks/gc-"):
                raise ConnectionResetError("store unreachable")
            super()._put(key, data, exclusive=exclusive)

        def _delete(self, key):
            if key.startswith(CHUNKS_PREFIX):
                type(self).deleting = True
                time.sleep(0.05)
            super()._delete(key)

    store = Stalling(tmp_path / "repo")
    for step in range(20):
        casstore.save(store, step, {"w": np.full(1000, step)})
        casstore.delete(store, step)
    garbage = [i for i in store.list(CHUNKS_PREFIX) if chunk_id_of_key(i.key)]
    with pytest.raises(casstore.CasstoreError, match="could not keep its lock"):
        casstore.gc(store, grace_period_s=0, max_workers=1)
    left = [i for i in store.list(CHUNKS_PREFIX) if chunk_id_of_key(i.key)]
    assert 0 < len(left) < len(garbage)  # it stopped midway, not before and not after


def test_gc_paused_during_a_delete_names_the_chunk_it_deleted_late(tmp_path, monkeypatch):
    """A GC process paused (SIGSTOP, a suspended VM) while a delete is in flight: the delete
    lands after the lock went stale, when a save may have reused the chunk. GC said only
    that it "stopped deleting"; it names the chunk and what to do."""
    monkeypatch.setattr(_locks, "GC_LOCK_REFRESH_S", 0.02)
    monkeypatch.setattr(_locks, "GC_LOCK_STALE_S", 0.4)

    class Paused(LocalStore):
        """The first chunk delete takes 1 s, and no lock refresh lands meanwhile."""
        paused = False

        def _put(self, key, data, *, exclusive):
            while self.paused and key.startswith("locks/gc-"):
                time.sleep(0.01)
            super()._put(key, data, exclusive=exclusive)

        def _delete(self, key):
            if key.startswith(CHUNKS_PREFIX) and self.paused is False:
                type(self).paused = True
                time.sleep(1.0)
                type(self).paused = None
            super()._delete(key)

    store = Paused(tmp_path / "repo")
    for step in range(3):
        casstore.save(store, step, {"w": np.full(1000, step)})
        casstore.delete(store, step)
    with pytest.raises(casstore.CasstoreError, match=r"could not keep its lock.*; chunks/"
                       r"[0-9a-f/]+ was deleted after the lock went stale.*casstore verify"):
        casstore.gc(store, grace_period_s=0, max_workers=1)
    left = [i for i in store.list(CHUNKS_PREFIX) if chunk_id_of_key(i.key)]
    assert len(left) == 2  # nothing more after it


class LockFaults(MemoryStore):
    """Lock writes are stored, then answer with an error (a lost answer); or lock deletes
    fail. ``faults`` counts down the failures to inject."""

    def __init__(self, fail: str, faults: int = 1):
        super().__init__()
        self.fail, self.faults = fail, faults

    def _put(self, key, data, *, exclusive):
        super()._put(key, data, exclusive=exclusive)
        if self.fail == "put" and key.startswith("locks/") and self.faults > 0:
            self.faults -= 1
            raise TimeoutError("injected: the answer to the lock's write was lost")

    def _delete(self, key):
        if self.fail == "delete" and key.startswith("locks/") and self.faults > 0:
            self.faults -= 1
            raise TimeoutError("injected: deleting the lock failed")
        super()._delete(key)


def locks(store) -> list[str]:
    return [info.key for info in store.list("locks/")]


def test_a_lock_whose_write_answer_was_lost_is_not_left_behind():
    store = LockFaults("put", faults=0)
    casstore.save(store, 0, {"w": np.ones(3)})
    store.faults = 1
    with pytest.raises(TimeoutError, match="injected"):
        casstore.save(store, 1, {"w": np.ones(3)})
    assert locks(store) == []
    store.faults = 1
    with pytest.raises(TimeoutError, match="injected"):
        casstore.gc(store, grace_period_s=0)
    assert locks(store) == []


def test_a_lock_that_cannot_be_deleted_is_logged_not_raised_over_a_committed_save(caplog):
    store = LockFaults("delete", faults=0)
    casstore.save(store, 0, {"w": np.ones(3)})
    store.faults = 1
    info = casstore.save(store, 1, {"w": np.ones(3) * 2})  # raised TimeoutError, though saved
    assert info.step == 1
    assert casstore.list_steps(store) == [0, 1]
    (left,) = locks(store)
    assert "could not delete lock memory:" in caplog.text
    assert left in caplog.text


@pytest.mark.parametrize("then", ["save", "gc", "manager"])
def test_a_lock_left_by_a_failed_delete_is_deleted_by_the_next_save_or_gc(then):
    """A store outage of seconds as a save released its lock left the lock for 6 hours: every
    GC meanwhile gave up (GcBusyError), and a manager's retention freed no space."""
    store = LockFaults("delete", faults=0)
    casstore.save(store, 0, {"w": np.full(100, 1.0)})
    store.faults = 1
    casstore.save(store, 1, {"w": np.full(100, 2.0)})
    assert len(locks(store)) == 1  # left: its delete failed
    if then == "save":
        casstore.save(store, 2, {"w": np.full(100, 3.0)})
    elif then == "gc":
        casstore.delete(store, 0)
        assert casstore.gc(store, grace_period_s=0, lock_timeout_s=1).deleted_chunks == 1
    else:  # the retention GC of the next save, which keeps 1 step
        with casstore.CheckpointManager(store, max_to_keep=1, gc_after_retention=True,
                                        grace_period_s=0) as mngr:
            mngr.save(2, {"w": np.full(100, 3.0)})
        assert len(list(store.list("chunks/"))) == 1  # steps 0 and 1's chunks collected
    assert locks(store) == []


class SlowChunks(LocalStore):
    """Each chunk object's write takes ``delay_s``: a save paused (a suspended VM) meanwhile."""

    delay_s = 0.0

    def _put(self, key, data, *, exclusive):
        if key.startswith(CHUNKS_PREFIX):
            time.sleep(self.delay_s)
        super()._put(key, data, exclusive=exclusive)


def test_a_save_or_copy_whose_lock_was_not_kept_fresh_commits_nothing(tmp_path, monkeypatch):
    """Its lock not re-put for half the stale age (the process was paused, or the store did
    not answer): GC may have deleted chunks it counted on, so no manifest is written."""
    monkeypatch.setattr(_locks, "STALE_LOCK_S", 1.0)
    monkeypatch.setattr(_locks, "SAVE_LOCK_REFRESH_S", 3600.0)  # as if paused: never re-put
    store = SlowChunks(tmp_path / "repo")
    store.delay_s = 0.6
    with pytest.raises(casstore.CasstoreError, match="not kept fresh"):
        casstore.save(store, 0, {"w": np.ones(1000)})
    assert casstore.list_steps(store) == []
    store.delay_s = 0.0
    casstore.save(store, 0, {"w": np.ones(1000)})
    dst = SlowChunks(tmp_path / "dst")
    dst.delay_s = 0.6
    with pytest.raises(casstore.CasstoreError, match="not kept fresh"):
        casstore.copy(store, dst)
    assert casstore.list_steps(dst) == []
    assert not list(dst.list("locks/"))


def test_a_save_to_a_read_only_store_warns_of_no_lock_left_behind(tmp_path, caplog):
    casstore.save(tmp_path / "repo", 0, {"w": np.zeros(3)})
    store = casstore.open_store(tmp_path / "repo", read_only=True)
    with caplog.at_level("WARNING", logger="casstore"), pytest.raises(
            casstore.ReadOnlyStoreError, match="read-only"):
        casstore.save(store, 1, {"w": np.ones(3)})
    assert "lock" not in caplog.text  # none was put, so none stays


def test_a_lock_object_is_read_no_further_than_its_size_limit():
    """Naming who holds a save lock reads at most MAX_LOCK_BYTES + 1 bytes of its object: a
    damaged lock of many MB is named by its key alone, not read whole (format.md §8)."""
    import msgpack

    class Recording(MemoryStore):
        largest = 0

        def get(self, key):
            data = super().get(key)
            self.largest = max(self.largest, len(data))
            return data

        def head(self, key, nbytes):
            data = MemoryStore.get(self, key)[:nbytes]  # as a ranged read
            self.largest = max(self.largest, len(data))
            return data

    store = Recording()
    lock = msgpack.packb({"kind": "save", "created": time.time(), "host": "h", "pid": 1})
    store.put("locks/save-" + "0" * 32, lock)
    store.put("locks/save-" + "1" * 32, lock + bytes(8 << 20))
    held = _locks._held_by(store, ["locks/save-" + "0" * 32, "locks/save-" + "1" * 32])
    assert "locks/save-" + "0" * 32 + " (host 'h', pid 1," in held
    assert held.count("(host") == 1  # the damaged one by its key alone
    assert store.largest <= _locks.MAX_LOCK_BYTES + 1


def test_retention_gc_warns_once_when_a_lock_keeps_it_from_freeing_space(monkeypatch, caplog):
    """A live save lock of another process (or one a killed process left for 6 hours) made
    every retention GC give up, logged at INFO only: disk grew past max_to_keep silently."""
    from casstore._gc import RetentionGc

    monkeypatch.setattr(RetentionGc, "LOCK_WAIT_S", 0.05)
    store = MemoryStore()
    casstore.save(store, 0, {"w": np.full(100, 1.0)})
    _locks._put_lock(store, "save")
    retention = RetentionGc(store, grace_period_s=0)
    with caplog.at_level("WARNING", logger="casstore"):
        for _ in range(RetentionGc.WARN_AFTER + 3):
            assert retention(True) is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"postponed {RetentionGc.WARN_AFTER} times in a row" in warning
    assert "frees no space" in warning


class LatePut(MemoryStore):
    """The first lock write times out unanswered and lands later (``land``), after the save
    that sent it gave up and deleted the lock."""

    def __init__(self):
        super().__init__()
        self.late, self.armed = None, False

    def _put(self, key, data, *, exclusive):
        if key.startswith("locks/") and self.armed and self.late is None:
            self.late = (key, data)
            raise TimeoutError("injected: the lock's write went unanswered")
        super()._put(key, data, exclusive=exclusive)

    def land(self):
        super()._put(*self.late, exclusive=False)


@pytest.mark.parametrize("holder", ["save", "write-back"])
def test_a_lock_whose_put_lands_after_the_save_gave_up_is_deleted_by_the_next_gc(holder):
    """holder "write-back": the lock of a restore writing chunks back into its local tier."""
    store = LatePut()
    casstore.save(store, 0, {"w": np.full(100, 1.0)})
    store.armed = True

    def hold():
        if holder == "save":
            casstore.save(store, 1, {"w": np.full(100, 2.0)})
        else:
            with _locks.save_lock_unless_gc(store):
                pass

    with pytest.raises(TimeoutError, match="injected"):
        hold()
    store.land()
    assert len(locks(store)) == 1
    assert casstore.gc(store, grace_period_s=0, lock_timeout_s=1).dry_run is False
    assert locks(store) == []


def test_a_lock_left_on_one_store_is_deleted_there_not_on_another_of_the_same_url(tmp_path):
    """Two S3 services hold s3://bucket/repo each: a leftover lock of one was "deleted" on the
    other (the URL alone named the store), and stayed where it was."""
    import fsspec

    from casstore.store import FsspecStore

    fs = fsspec.filesystem("file", auto_mkdir=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = (FsspecStore(fs, str(tmp_path / name), url="s3://bucket/repo") for name in "ab")
    casstore.save(a, 0, {"w": np.full(100, 1.0)})
    casstore.save(b, 0, {"w": np.full(100, 1.0)})
    delete = a._delete
    a._delete = lambda key: (_ for _ in ()).throw(ConnectionError("injected: outage"))
    casstore.save(a, 1, {"w": np.full(100, 2.0)})
    a._delete = delete
    casstore.save(b, 1, {"w": np.full(100, 2.0)})  # leaves a's leftover alone
    assert len(locks(a)) == 1
    casstore.gc(a, grace_period_s=0, lock_timeout_s=1)  # deletes it first
    assert locks(a) == locks(b) == []
