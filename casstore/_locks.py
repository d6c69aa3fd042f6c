"""Save and GC locks: garbage collection never runs while a save is in flight (format.md §8).

A save puts a ``locks/save-*`` object, then looks for ``locks/gc-*``; GC puts ``locks/gc-*``,
then looks for ``locks/save-*``. On a store with read-after-write listings (local disk, S3,
GCS), at least one of two racing parties sees the other. GC that sees a save withdraws its lock
and retries later; a save that sees GC keeps its lock and waits for GC to finish its sweep.
Locks older than ``STALE_LOCK_S`` belong to dead processes and are ignored (restic's
stale-lock rule).
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
POLL_S = 0.1


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


def check_write_access(store: Store) -> None:
    """Puts and deletes a save lock, so that missing write access shows now, before anything
    else is written (a CheckpointManager's first save, which then runs in the background).

    Raises:
      PermissionError: the store is read-only (ReadOnlyStoreError) or the server refused the
        write (AccessDeniedError); nothing was stored.
    """
    store.delete(_put_lock(store, "save"))


@contextlib.contextmanager
def save_lock(store: Store) -> Iterator[None]:
    """Holds a save lock for the body, after any GC that holds its lock has finished."""
    key = _put_lock(store, "save")
    try:
        while _live(store, "gc"):
            time.sleep(POLL_S)
        yield
    finally:
        store.delete(key)


@contextlib.contextmanager
def gc_lock(store: Store, timeout_s: float) -> Iterator[None]:
    """Holds the GC lock for the body, taken at a moment no save is in flight.

    GC yields to saves: if it finds a save lock after putting its own, it withdraws and tries
    again, so saves never wait for a GC that has not started sweeping.

    Raises:
      CasstoreError: no moment without saves came within ``timeout_s`` seconds; nothing done.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if not _live(store, "save"):
            key = _put_lock(store, "gc")
            if not _live(store, "save"):
                break
            store.delete(key)
        if time.monotonic() > deadline:
            raise CasstoreError(f"saves kept running for {timeout_s:g} s; garbage collection "
                                f"did nothing (url {store.url!r})")
        time.sleep(POLL_S)
    try:
        yield
    finally:
        store.delete(key)
