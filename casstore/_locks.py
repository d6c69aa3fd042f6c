"""Save and GC locks: garbage collection never runs while a save is in flight (format.md §8).

A save puts a ``locks/save-*`` object, then looks for ``locks/gc-*``; GC puts ``locks/gc-*``,
then looks for ``locks/save-*``. On a store with read-after-write listings (local disk, S3,
GCS), at least one of two racing parties sees the other. A save that sees GC withdraws its lock
and waits, so GC always makes progress; GC waits for the saves it sees to finish. Locks older
than ``STALE_LOCK_S`` belong to dead processes and are ignored (restic's stale-lock rule).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections.abc import Iterator

import msgpack

from ._errors import CasstoreError
from ._layout import LOCKS_PREFIX, lock_key, lock_kind
from .store import Store

STALE_LOCK_S = 6 * 3600.0
POLL_S = 0.2


def _live(store: Store, kind: str) -> list[str]:
    """Keys of the locks of ``kind`` younger than STALE_LOCK_S."""
    now = time.time()
    return [info.key for info in store.list(LOCKS_PREFIX)
            if lock_kind(info.key) == kind and now - info.mtime < STALE_LOCK_S]


def _put_lock(store: Store, kind: str) -> str:
    key = lock_key(kind, uuid.uuid4().hex)
    store.put(key, msgpack.packb({"kind": kind, "created": time.time(),
                                  "host": socket.gethostname(), "pid": os.getpid()}))
    return key


@contextlib.contextmanager
def save_lock(store: Store) -> Iterator[None]:
    """Holds a save lock for the body; waits (withdrawn) while a GC holds its lock."""
    while True:
        key = _put_lock(store, "save")
        if not _live(store, "gc"):
            break
        store.delete(key)
        time.sleep(POLL_S)
    try:
        yield
    finally:
        store.delete(key)


@contextlib.contextmanager
def gc_lock(store: Store, timeout_s: float) -> Iterator[None]:
    """Holds the GC lock for the body, after every save in flight has finished.

    Raises:
      CasstoreError: saves were still in flight after ``timeout_s`` seconds; nothing deleted.
    """
    key = _put_lock(store, "gc")
    try:
        deadline = time.monotonic() + timeout_s
        while busy := _live(store, "save"):
            if time.monotonic() > deadline:
                raise CasstoreError(f"{len(busy)} saves still in flight after {timeout_s:g} s; "
                                    f"garbage collection did nothing (url {store.url!r})")
            time.sleep(POLL_S)
        yield
    finally:
        store.delete(key)
