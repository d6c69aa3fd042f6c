"""Test helpers that third-party stores can reuse: the store contract suite.

Subclass :class:`StoreContract` in a pytest module and provide a ``store`` fixture that yields a
fresh, empty, writable store; every backend must pass the same tests (zarr's ``StoreTests``,
restic's backend ``Suite``).
"""

from __future__ import annotations

import re
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
        assert store.head("empty", 10) == b""
        assert store.exists("empty")

    def test_get_missing_raises_object_not_found(self, store: Store):
        with pytest.raises(ObjectNotFoundError) as info:
            store.get("no/such/key")
        assert isinstance(info.value, FileNotFoundError)
        assert "no/such/key" in str(info.value)

    def test_head_gives_the_first_bytes(self, store: Store):
        data = bytes(range(256)) * 40
        store.put("h/obj", data)
        assert store.head("h/obj", 100) == data[:100]
        assert store.head("h/obj", len(data) + 1) == data
        with pytest.raises(ObjectNotFoundError, match="no/such/key"):
            store.head("no/such/key", 10)

    def test_get_into_reads_at_most_max_bytes_plus_one(self, store: Store):
        data = bytes(range(256)) * 40
        store.put("h/obj", data)
        for max_bytes, want in ((None, data), (len(data), data), (len(data) - 1, data),
                                (99, data[:100])):
            view, _ = store.get_into("h/obj", None, max_bytes)
            assert bytes(view) == want, max_bytes
        with pytest.raises(ObjectNotFoundError, match="no/such/key"):
            store.get_into("no/such/key", None, 10)

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

    def test_stat_gives_size_and_mtime_of_one_object(self, store: Store):
        before = time.time() - 5
        store.put("chunks/ab/1", b"12345")
        store.put("chunks/ab/12", b"1")  # a key the first is a prefix of
        info = store.stat("chunks/ab/1")
        assert (info.key, info.size) == ("chunks/ab/1", 5)
        assert before <= info.mtime <= time.time() + 5
        with pytest.raises(ObjectNotFoundError):
            store.stat("chunks/ab/2")
        with pytest.raises(ObjectNotFoundError):
            store.stat("chunks/ab")  # a directory-like prefix is no object

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
        with pytest.raises(ValueError, match=re.escape(f"invalid store key {key!r}")):
            store.put(key, b"1")
        for read in (store.get, store.exists, store.stat, lambda k: store.head(k, 1)):
            with pytest.raises(ValueError, match=re.escape(f"invalid store key {key!r}")):
                read(key)  # a local store read '../x' outside its root

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
        assert store.get("r/1") == b"1"
        assert not store.exists("r/2")


class FaultyStore(Store):
    """Wraps a store and injects faults, driven by a seed, for reliability tests.

    Each call of a chosen operation fails with probability ``rate``, in one of these ways:
    ``error`` (raise ``ConnectionResetError`` before doing anything), ``timeout`` (raise
    ``TimeoutError``), ``stored_then_error`` (writes only: perform the write, then raise as if
    the response was lost), ``slow`` (sleep ``delay_s``, then succeed), for ``list``,
    ``list_misses_recent`` (omit objects modified in the last ``recent_s`` seconds), and, for
    ``get``, ``truncated`` (return the first half of the object's bytes, as a client does
    with a response without Content-Length whose connection ended early; not in ``KINDS``,
    so name it in ``kinds``).

    Args:
      inner: the store to wrap.
      seed: seeds the fault decisions, so a failing run can be replayed.
      rate: probability of a fault per call, in [0, 1].
      ops: the operations that may fail (``get``, ``put``, ``put_if_absent``, ``exists``,
        ``stat``, ``delete``, ``list``).
      kinds: the kinds of faults to choose from.
      delay_s: the delay of ``slow`` faults, seconds.
      recent_s: what ``list_misses_recent`` counts as recent, seconds.

    Attributes:
      injected: a list of ``(operation, kind, key)`` of every fault injected.
      calls: a ``collections.Counter`` of the calls per operation, faulty ones included.
    """

    KINDS = ("error", "timeout", "stored_then_error", "slow", "list_misses_recent")

    def __init__(self, inner: Store, *, seed: int, rate: float = 0.1,
                 ops: tuple[str, ...] = ("get", "put", "put_if_absent", "exists", "stat",
                                         "delete", "list"),
                 kinds: tuple[str, ...] = KINDS, delay_s: float = 0.01, recent_s: float = 5.0):
        import collections
        import random
        import threading
        self.inner, self.url, self.read_only = inner, inner.url, inner.read_only
        self.max_workers = inner.max_workers
        self.shuffle = inner.shuffle
        self.rate, self.ops, self.kinds = rate, ops, kinds
        self.delay_s, self.recent_s = delay_s, recent_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.injected: list[tuple[str, str, str]] = []
        self.calls: collections.Counter[str] = collections.Counter()

    def _fault(self, op: str, key: str, allowed: tuple[str, ...]) -> str | None:
        kinds = [k for k in self.kinds if k in allowed]
        with self._lock:
            self.calls[op] += 1
            if op not in self.ops or not kinds or self._rng.random() >= self.rate:
                return None
            kind = self._rng.choice(kinds)
            self.injected.append((op, kind, key))
        if kind == "slow":
            time.sleep(self.delay_s)
            return None
        if kind == "error":
            raise ConnectionResetError(f"injected fault: {op} {key}")
        if kind == "timeout":
            raise TimeoutError(f"injected fault: {op} {key}")
        return kind

    def get(self, key: str) -> bytes:
        kind = self._fault("get", key, ("error", "timeout", "slow", "truncated"))
        data = self.inner.get(key)
        return data[:len(data) // 2] if kind == "truncated" else data

    def exists(self, key: str) -> bool:
        self._fault("exists", key, ("error", "timeout", "slow"))
        return self.inner.exists(key)

    def stat(self, key: str):
        self._fault("stat", key, ("error", "timeout", "slow"))
        return self.inner.stat(key)

    def list(self, prefix: str = ""):
        kind = self._fault("list", prefix, ("error", "timeout", "slow", "list_misses_recent"))
        now = time.time()
        for info in self.inner.list(prefix):
            if kind == "list_misses_recent" and now - info.mtime < self.recent_s:
                continue
            yield info

    def _put(self, key: str, data, *, exclusive: bool) -> None:
        op = "put_if_absent" if exclusive else "put"
        kind = self._fault(op, key, ("error", "timeout", "slow", "stored_then_error"))
        (self.inner.put_if_absent if exclusive else self.inner.put)(key, data)
        if kind == "stored_then_error":
            raise ConnectionResetError(f"injected fault after storing: {op} {key}")

    def _delete(self, key: str) -> None:
        kind = self._fault("delete", key, ("error", "timeout", "slow", "stored_then_error"))
        self.inner.delete(key)
        if kind == "stored_then_error":
            raise ConnectionResetError(f"injected fault after deleting: delete {key}")
