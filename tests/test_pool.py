"""Worker counts follow the cores this process may use (casstore/_pool.py, Store.max_workers);
a Ctrl-C stops the pipelines without waiting for their work in flight."""

import concurrent.futures as cf
import os
import threading
import time

import fsspec
import numpy as np
import pytest

import casstore
import casstore._save
from casstore import _pool
from casstore.store import CountingStore, FsspecStore, LocalStore, MemoryStore

from conftest import GatedStore


@pytest.fixture
def cores(monkeypatch):
    """Sets the affinity mask ``os.sched_getaffinity`` reports to ``n`` cores."""
    def pin(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)
    return pin


def test_usable_cores_is_the_affinity_mask_not_the_machine(cores):
    cores(3)
    assert _pool.usable_cores() == 3
    assert _pool.default_workers(2, cap=32) == 6
    assert _pool.default_workers(8, cap=16) == 16  # the cap bounds memory


def test_store_workers_follow_the_cores_at_each_access(cores, tmp_path):
    """A store's pools are sized when a save or restore asks, from the mask at that moment:
    2 threads per core on local disk and memory, 5 on object stores, each under its cap."""
    local, memory = LocalStore(tmp_path / "repo"), MemoryStore()
    remote = FsspecStore(fsspec.filesystem("memory"), "/casstore-test-pool")
    cores(1)
    assert (local.max_workers, memory.max_workers, remote.max_workers) == (2, 2, 5)
    cores(6)
    assert (local.max_workers, memory.max_workers, remote.max_workers) == (12, 12, 30)
    cores(64)
    assert (local.max_workers, remote.max_workers) == (LocalStore.max_workers_cap,
                                                       FsspecStore.max_workers_cap) == (32, 64)


def test_a_worker_count_set_on_a_store_is_kept(cores):
    cores(4)
    store = MemoryStore()
    store.max_workers = 3
    cores(16)
    assert store.max_workers == 3
    assert CountingStore(store).max_workers == 3  # wrappers take the inner store's


def test_bounded_map_gives_a_ctrl_c_back_at_once_and_starts_nothing_after_it():
    """KeyboardInterrupt in the calling thread is raised without waiting for the running task
    (a request on a stalled store), and the queued items never run; any other exception still
    waits for the running tasks."""
    for error in (KeyboardInterrupt, ValueError):
        started, release, ran = threading.Event(), threading.Event(), []

        def work(x, started=started, release=release, ran=ran):
            started.set()
            assert release.wait(30)
            ran.append(x)

        def items(started=started, error=error):
            yield 0
            yield 1  # queued behind 0: one worker
            assert started.wait(10)
            raise error

        t0 = time.monotonic()
        if error is ValueError:
            threading.Timer(1.0, release.set).start()
        with pytest.raises(error):
            _pool.bounded_map(work, items(), max_workers=1, window=4)
        seconds = time.monotonic() - t0
        release.set()
        time.sleep(0.3)
        assert ran == [0]  # 1 was cancelled
        if error is KeyboardInterrupt:
            assert seconds < 5, seconds
        else:  # it waited for 0
            assert seconds >= 0.9, seconds


def test_a_ctrl_c_cancels_the_requests_of_the_call_and_of_its_second_pool():
    """What a worker (and a task it hands to another pool, run ``in_scope``) has in flight is
    cancelled by a Ctrl-C in the calling thread, and so is what it tracks afterwards; a worker
    of another call, outside the scope, keeps its request."""
    requests, tracked, finished, theirs = [], threading.Event(), threading.Event(), []
    second = cf.ThreadPoolExecutor(1)

    def request() -> cf.Future:
        future = cf.Future()
        _pool.current_scope().track(future)
        requests.append(future)
        return future

    def work(x):
        assert _pool.current_scope() is not None
        request()
        second.submit(_pool.in_scope(request, _pool.current_scope())).result()
        tracked.set()
        time.sleep(1.0)
        request()  # after the Ctrl-C: cancelled at once
        finished.set()

    def items():
        yield 0
        assert tracked.wait(10)
        raise KeyboardInterrupt

    def background(x):  # another call's worker, as a background save's
        future = cf.Future()
        _pool.current_scope().track(future)
        theirs.append(future)
        time.sleep(3.0)

    other_call = threading.Thread(target=_pool.bounded_map, args=(background, [0], 1))
    other_call.start()
    with pytest.raises(KeyboardInterrupt):
        _pool.bounded_map(work, items(), max_workers=1)
    assert _pool.current_scope() is None  # the calling thread works for no call
    assert finished.wait(30)
    second.shutdown()
    other_call.join()
    assert len(requests) == 3
    assert all(f.cancelled() for f in requests)
    assert len(theirs) == 1
    assert not theirs[0].cancelled()


def test_a_ctrl_c_during_a_save_waits_for_no_upload_and_starts_none(monkeypatch):
    """A save stopped by Ctrl-C while its chunk uploads wait on the store raises at once,
    starts no upload after that (an encoding still running may read a numpy leaf its caller
    writes to once the call returns) and commits nothing."""
    store, started = GatedStore(), []
    put = store._put

    def counted(key, data, *, exclusive):
        if key.startswith("chunks/"):
            started.append(key)
        put(key, data, exclusive=exclusive)

    store._put = counted
    plan_jobs = casstore._save.plan_jobs

    def interrupted(*args, **kwargs):
        inline, jobs = plan_jobs(*args, **kwargs)

        def stream():
            for i, job in enumerate(jobs):
                if i == 2:  # two jobs in flight, their uploads held at the gate
                    deadline = time.monotonic() + 10
                    while len(started) < 2 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    raise KeyboardInterrupt
                yield job
        return inline, stream()

    monkeypatch.setattr(casstore._save, "plan_jobs", interrupted)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        casstore.save(store, 0, {"w": np.arange(16 * 1024.0)}, chunk_size_bytes=8192,
                      max_workers=2)
    assert time.monotonic() - t0 < 10  # the gate holds the uploads for 60 s
    assert len(started) == 2
    store.gate.set()
    time.sleep(0.5)
    assert len(started) == 2
    assert casstore.list_steps(store) == []
