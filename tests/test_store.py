"""Every store backend passes the same contract suite (casstore.testing.StoreContract)."""

import os

import pytest

from casstore import open_store
from casstore.store import CountingStore, FsspecStore, LocalStore, MemoryStore
from casstore.testing import StoreContract

from conftest import make_store


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store(self):
        return MemoryStore()

    def read_only_store(self, store):
        ro = MemoryStore(read_only=True)
        ro._objects = store._objects
        return ro


class TestLocalStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path):
        return LocalStore(tmp_path / "repo")

    def read_only_store(self, store):
        return LocalStore(store.root, read_only=True)

    def test_no_temp_files_left_and_hidden_from_list(self, store):
        store.put("a/b", b"1")
        with pytest.raises(FileExistsError):
            store.put_if_absent("a/b", b"2")
        assert os.listdir(os.path.join(store.root, "a")) == ["b"]
        open(os.path.join(store.root, "a", ".b.tmp"), "wb").close()  # a crashed writer's temp
        assert [i.key for i in store.list("a/")] == ["a/b"]


class TestFsspecMemoryStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path):
        return make_store("fsspec-memory", tmp_path)

    def read_only_store(self, store):
        return FsspecStore(store.fs, store.root, read_only=True)


class TestCountingStore(StoreContract):
    @pytest.fixture
    def store(self):
        return CountingStore(MemoryStore())

    def read_only_store(self, store):
        ro = MemoryStore(read_only=True)
        ro._objects = store.inner._objects
        return CountingStore(ro)

    def test_counts(self, store):
        store.put("a", b"123")
        store.get("a")
        store.get_many(["a", "a"])
        assert store.counts["put"] == 1 and store.counts["get"] == 3
        assert store.bytes_written == 3 and store.bytes_read == 9


def test_open_store_picks_backend(tmp_path):
    assert isinstance(open_store(tmp_path / "r"), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}/r"), LocalStore)
    assert isinstance(open_store("memory://casstore-open-test"), FsspecStore)
    s = MemoryStore()
    assert open_store(s) is s
    with pytest.raises(ValueError):
        open_store(tmp_path, anon=True)
