"""Test helpers that third-party stores can reuse: the store contract suite.

Subclass :class:`StoreContract` in a pytest module and provide a ``store`` fixture that yields a
fresh, empty, writable store; every backend must pass the same tests (zarr's ``StoreTests``,
restic's backend ``Suite``).
"""

from __future__ import annotations

import time

import pytest

from ._errors import ObjectNotFoundError, ReadOnlyStoreError
from .store import Store


class StoreContract:
    """The behaviour every :class:`~casstore.Store` must have.

    Subclasses define a ``store`` fixture (a fresh, empty, writable store) and may override
    ``read_only_store(store)`` to return a read-only view of the same location.
    """

    def read_only_store(self, store: Store) -> Store:
        """A read-only store on the same objects as ``store``."""
        raise NotImplementedError

    def test_put_get_roundtrip(self, store: Store):
        store.put("a/b/c", b"hello")
        assert store.get("a/b/c") == b"hello"
        store.put("a/b/c", memoryview(b"again"))
        assert store.get("a/b/c") == b"again"

    def test_empty_object(self, store: Store):
        store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.exists("empty")

    def test_get_missing_raises_object_not_found(self, store: Store):
        with pytest.raises(ObjectNotFoundError) as info:
            store.get("no/such/key")
        assert isinstance(info.value, FileNotFoundError)
        assert "no/such/key" in str(info.value)

    def test_put_if_absent_is_create_only(self, store: Store):
        store.put_if_absent("m/1", b"first")
        with pytest.raises(FileExistsError):
            store.put_if_absent("m/1", b"second")
        assert store.get("m/1") == b"first"

    def test_exists_and_idempotent_delete(self, store: Store):
        assert not store.exists("x/y")
        store.put("x/y", b"1")
        assert store.exists("x/y")
        store.delete("x/y")
        assert not store.exists("x/y")
        store.delete("x/y")  # deleting a missing key succeeds
        with pytest.raises(ObjectNotFoundError):
            store.get("x/y")

    def test_list_gives_keys_sizes_and_mtimes(self, store: Store):
        before = time.time() - 5
        store.put("chunks/ab/1", b"12345")
        store.put("chunks/ab/2", b"1")
        store.put("chunks/cd/3", b"")
        store.put("runs/x", b"xyz")
        found = {info.key: info for info in store.list("chunks/")}
        assert set(found) == {"chunks/ab/1", "chunks/ab/2", "chunks/cd/3"}
        assert [found[k].size for k in sorted(found)] == [5, 1, 0]
        assert all(before <= info.mtime <= time.time() + 5 for info in found.values())
        assert {i.key for i in store.list("chunks/ab")} == {"chunks/ab/1", "chunks/ab/2"}
        assert {i.key for i in store.list()} == set(found) | {"runs/x"}
        assert list(store.list("nothing/")) == []

    def test_get_many_and_put_many(self, store: Store):
        items = {f"k/{i:03d}": bytes([i]) * i for i in range(40)}
        store.put_many(items)
        assert store.get_many(items) == items
        with pytest.raises(ObjectNotFoundError):
            store.get_many(["k/001", "k/missing"])

    @pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a", "a/.hidden", "é",
                                     "a\\b", "a/"])
    def test_invalid_keys_are_refused(self, store: Store, key: str):
        with pytest.raises(ValueError):
            store.put(key, b"1")

    def test_read_only_refuses_writes(self, store: Store):
        store.put("r/1", b"1")
        try:
            ro = self.read_only_store(store)
        except NotImplementedError:
            pytest.fail("StoreContract subclasses must implement read_only_store")
        assert ro.get("r/1") == b"1"
        for write in (lambda: ro.put("r/2", b"2"), lambda: ro.put_if_absent("r/2", b"2"),
                      lambda: ro.delete("r/1"), lambda: ro.put_many({"r/3": b"3"})):
            with pytest.raises(ReadOnlyStoreError) as info:
                write()
            assert isinstance(info.value, PermissionError)
        assert store.get("r/1") == b"1" and not store.exists("r/2")
