"""Worker counts follow the cores this process may use (casstore/_pool.py, Store.max_workers)."""

import os

import fsspec
import pytest

from casstore import _pool
from casstore.store import CountingStore, FsspecStore, LocalStore, MemoryStore


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
    2 threads per core on local disk and memory, 8 on object stores, each under its cap."""
    local, memory = LocalStore(tmp_path / "repo"), MemoryStore()
    remote = FsspecStore(fsspec.filesystem("memory"), "/casstore-test-pool")
    cores(1)
    assert (local.max_workers, memory.max_workers, remote.max_workers) == (2, 2, 8)
    cores(6)
    assert (local.max_workers, memory.max_workers, remote.max_workers) == (12, 12, 48)
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
