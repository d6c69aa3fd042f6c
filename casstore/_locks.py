"""Save and GC locks: garbage collection never runs while a save is in flight (format.md §8).

A save puts a ``locks/save-*`` object, then looks for ``locks/gc-*``; GC puts ``locks/gc-*``,
then looks for ``locks/save-*``. On a store with read-after-write listings (local disk, S3,
GCS), at least one of two racing parties sees the other. GC that sees a save withdraws its lock
and retries later; a save that sees GC keeps its lock and waits for GC to finish its sweep.
Save locks not re-put for ``STALE_LOCK_S`` belong to dead processes and are ignored (restic's
stale-lock rule; a long save or copy re-puts its lock). The GC lock is a lease, as restic
refreshes its locks: GC re-puts it every ``GC_LOCK_REFRESH_S``, saves ignore a GC lock not
refreshed for ``GC_LOCK_STALE_S`` (so a killed GC holds saves up for minutes, not hours), and
GC deletes only while every refresh came within half that time, so its lock never looked
stale while it swept.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import msgpack

from ._errors import AccessDeniedError, CasstoreError, ReadOnlyStoreError
from ._layout import LOCKS_PREFIX, lock_key, lock_kind
from .store import Store

STALE_LOCK_S = 6 * 3600.0
SAVE_LOCK_REFRESH_S = STALE_LOCK_S / 8  # 45 min: two refreshes in a row may fail (STALE / 2)
GC_LOCK_REFRESH_S = 60.0
GC_LOCK_STALE_S = 600.0  # seconds; leaves room for clock skew between hosts and the store
POLL_S = 0.1
MAX_LOCK_BYTES = 2**16  # a lock object is about 100 bytes; a reader reads no more (§8)
WAIT_NOTICE_S = 5.0  # seconds gc waits for saves before it says which locks it waits for

log = logging.getLogger("casstore")
# Locks this process may have left, by store (_identity): deleted at its next lock there.
_leftovers: dict[tuple[str, str], set[str]] = {}
_leftovers_lock = threading.Lock()


class GcBusyError(CasstoreError):
    """GC found saves holding their locks until its lock timeout; it did nothing."""


def _live(store: Store, kind: str, own: tuple[str, float] | None = None) -> list[str]:
    """Keys of the locks of ``kind`` that are not stale (see the module docstring): put less
    than the stale time ago, and no further in the future than that (a clock set back, or a
    copy of the repository made with future times: else it held the others off until then).

    Ages are on the store's clock where ``own``, ``(key, time.monotonic() of its put)`` of
    the caller's own lock, is listed: its time is the store's then (on this machine's clock,
    a client behind the store's by more than the stale age took a fresh lock for stale);
    else on this machine's."""
    infos, stale = list(store.list(LOCKS_PREFIX)), _timing(kind)[1]
    mine = next((i.mtime for i in infos if own is not None and i.key == own[0]), None)
    now = time.time() if mine is None else mine + time.monotonic() - own[1]
    return [info.key for info in infos
            if lock_kind(info.key) == kind and abs(now - info.mtime) < stale]


def _put_lock(store: Store, kind: str, key: str | None = None) -> str:
    key = key or lock_key(kind, uuid.uuid4().hex)
    store.put(key, msgpack.packb({"kind": kind, "created": time.time(),
                                  "host": socket.gethostname(), "pid": os.getpid()}))
    return key


def _timing(kind: str) -> tuple[float, float]:
    """(refresh, stale) seconds of a lock of ``kind``: a lock not re-put for ``stale`` is
    ignored as a dead process's (read at each call: tests shorten them)."""
    return (GC_LOCK_REFRESH_S, GC_LOCK_STALE_S) if kind == "gc" else (SAVE_LOCK_REFRESH_S,
                                                                      STALE_LOCK_S)


class Lease:
    """A lock kept fresh: re-put every refresh period from a background thread (restic
    refreshes its locks so), so that no one takes it for a dead process's while its holder
    works. A GC lock is re-put every ``GC_LOCK_REFRESH_S``, a save lock (a save or copy of
    many hours) every ``SAVE_LOCK_REFRESH_S``. Times are wall-clock: a suspended process
    counts its sleep as the others do.

    Attributes:
      key: the lock object.
      kind: ``"gc"`` or ``"save"``.
    """

    def __init__(self, store: Store, kind: str):
        self.store, self.kind, self.key = store, kind, lock_key(kind, uuid.uuid4().hex)
        self._last, self._broken = time.time(), False
        self.unsure = False  # a put raised: it may land after the release (a lost answer)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, daemon=True,
                                        name=f"casstore-{kind}-lock")

    def put(self) -> None:
        """Puts the lock; the lease counts from the moment before the put (its ``created``
        time), not from :meth:`start`: a holder paused between the two may have let the lock
        turn stale for others meanwhile, and :meth:`check` must say so."""
        put_at = time.time()
        try:
            _put_lock(self.store, self.kind, self.key)
        except BaseException:
            self.unsure = True
            raise
        self._last = put_at

    def start(self) -> None:
        """Starts the refreshes, after :meth:`put`."""
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(_timing(self.kind)[0]):
            with contextlib.suppress(Exception):  # the lease runs out unless a later put lands
                put_at = time.time()
                self.unsure = True  # until the put answers
                _put_lock(self.store, self.kind, self.key)
                self.unsure = False
                self._broken |= put_at - self._last > _timing(self.kind)[1] / 2
                self._last = put_at

    def check(self) -> None:
        """Raises unless every refresh came within half the stale time since the lock was
        taken; GC calls it before each delete, a save or copy before each commit.

        Raises:
          CasstoreError: a refresh came late or not at all (the process was paused, or the
            store did not answer): for a GC lock, saves may have ignored it, so GC deletes
            nothing more; for a save lock, GC may have deleted chunks the step needs, so
            nothing more is committed.
        """
        if not self._broken and time.time() - self._last <= _timing(self.kind)[1] / 2:
            return
        if self.kind == "gc":
            raise CasstoreError(f"garbage collection could not keep its lock {self.key!r} "
                                f"fresh (url {self.store.url!r}); it stopped deleting, and "
                                "running it again finishes the work")
        raise CasstoreError(f"the save lock {self.key!r} (url {self.store.url!r}) was not "
                            "kept fresh: garbage collection may have deleted chunks this "
                            "step needs; nothing more is committed, save or copy again")

    def stop(self) -> None:
        """Stops the refreshes; a put in flight ends first (it must not bring the lock back
        once released)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def check_write_access(store: Store, run: str, step: int) -> None:
    """Puts and deletes a save lock, so that missing write access shows now, before anything
    else is written (a CheckpointManager's first save of ``run``'s ``step``, which then runs
    in the background).

    Raises:
      PermissionError: the store is read-only (ReadOnlyStoreError, naming the run and step) or
        the server refused the write (AccessDeniedError); nothing was stored.
    """
    refuse_read_only(store, run, step)
    store.delete(_put_lock(store, "save"))


def refuse_read_only(store: Store, run: str, step: int) -> None:
    """Raises ReadOnlyStoreError naming ``run`` and ``step`` if ``store`` is read-only, before
    a save writes anything (its first write would be a lock, which names neither)."""
    if store.read_only:
        raise ReadOnlyStoreError(f"{store.read_only_reason}; nothing was saved", url=store.url,
                                 run=run, step=step)


def _held_by(store: Store, keys: list[str]) -> str:
    """Who holds the save locks ``keys``: host, pid and age of each (read from the lock
    objects), and what to do about a lock whose process is dead."""
    now, held = time.time(), []
    for key in keys[:5]:
        try:
            info = msgpack.unpackb(store.head(key, MAX_LOCK_BYTES + 1))
            held.append(f"{key} (host {info.get('host')!r}, pid {info.get('pid')}, "
                        f"{now - float(info.get('created')):.0f} s old)")
        except Exception:  # gone meanwhile, or not a lock this casstore wrote: its key only
            held.append(key)
    return (f"held by {', '.join(held)}{' and more' if len(keys) > 5 else ''}: a lock whose "
            f"process was killed is ignored {STALE_LOCK_S / 3600:g} h after it was taken, or "
            "delete its object once sure that process is gone (docs/reliability.md)")


@contextlib.contextmanager
def save_lock(store: Store) -> Iterator[Lease]:
    """Holds a save lock for the body, after any GC that holds its lock has finished, and
    keeps it fresh (:class:`Lease`, whose ``check`` the body calls before each commit).

    The lock is put, then GC locks are looked for (format.md §8); after waiting for a GC it
    is put again and GC locks looked for again: the lock is not refreshed while it waits,
    and a GC that began meanwhile may have found it stale (a wait of hours on a long GC)."""
    delete_leftovers(store)
    lease = Lease(store, "save")
    stored = True  # a put whose answer was lost may be stored all the same
    try:
        try:
            lease.put()
        except AccessDeniedError:
            stored = False  # refused: there is no lock to delete (read-only keys)
            raise
        since = put_at = time.monotonic()
        while gc := _live(store, "gc", (lease.key, put_at)):
            while gc:
                if since is not None and time.monotonic() - since > WAIT_NOTICE_S:
                    since = None  # said once
                    log.warning("casstore: a save to %s waits for garbage collection to "
                                "finish (lock %s); a GC lock not refreshed for %g s is "
                                "ignored", store.url, ", ".join(gc), GC_LOCK_STALE_S)
                time.sleep(POLL_S)
                gc = _live(store, "gc", (lease.key, put_at))
            lease.put()  # fresh again, then look for GCs again
            put_at = time.monotonic()
        lease.start()
        yield lease
    finally:
        lease.stop()
        if stored:
            _release(store, lease.key, lease.unsure)


@contextlib.contextmanager
def save_lock_unless_gc(store: Store) -> Iterator[bool]:
    """A save lock held for the body if no GC holds its lock once it is put (yields True),
    else none (yields False, at once): for best-effort writes that need not wait for a GC (a
    restore writing a step back into its primary tier). The body must be short: the lock is
    not refreshed."""
    delete_leftovers(store)
    key = lock_key("save", uuid.uuid4().hex)
    try:
        _put_lock(store, "save", key)
    except AccessDeniedError:
        raise  # refused: no lock stored
    except BaseException:
        _release(store, key, True)  # an answer lost: the lock may be stored, or land later
        raise
    try:
        yield not _live(store, "gc", (key, time.monotonic()))
    finally:
        _release(store, key)


def _release(store: Store, key: str, unsure: bool = False) -> None:
    """Deletes lock ``key`` (or the lock a put may have stored though it raised). A failure is
    logged, naming the lock left behind, never raised: it would hide the body's own outcome
    (a committed step, or the error that matters). Such a lock, and with ``unsure`` (a put of
    it raised, and may land after this delete) this one whatever happens, is deleted again
    before this process's next lock on the store (:func:`delete_leftovers`): left until it
    turned stale, a save lock kept every GC away for 6 hours after a store outage of
    seconds, and a manager's retention stopped freeing space meanwhile."""
    try:
        store.delete(key)
    except (ReadOnlyStoreError, NotADirectoryError):
        return  # nor was a lock put: refused before any request, or no such directory
    except Exception as e:
        if getattr(e, "errno", None) == errno.EROFS and not _exists(store, key):
            return  # a read-only filesystem, which refused the put too
        unsure = True
        log.warning("casstore: could not delete lock %s/%s (%s): this process deletes it "
                    "before its next save or GC there, else it stays until it turns stale",
                    store.url, key, e)
    if unsure:
        with _leftovers_lock:
            _leftovers.setdefault(_identity(store), set()).add(key)


def _exists(store: Store, key: str) -> bool:
    """Whether ``key`` is there; True where that cannot be told."""
    try:
        return store.exists(key)
    except Exception:
        return True


def _identity(store: Store) -> tuple[str, str]:
    """What tells two stores apart: the URL, and for an fsspec store its root and options
    (two S3 services hold ``s3://bucket/repo`` each, told apart by ``endpoint_url``)."""
    options = getattr(getattr(store, "fs", None), "storage_options", None) or {}
    return store.url, repr((getattr(store, "root", None),
                            sorted(options.items(), key=lambda item: item[0])))


def delete_leftovers(store: Store) -> None:
    """Deletes the locks this process may have left on ``store`` (a delete that failed, or a
    put that raised: :func:`_release`); one that fails again is kept for the next call. Each
    was the lock of a save or GC that has ended: no one else holds it (its key is random)."""
    if not _leftovers:  # nearly always: no store identity to work out before each save
        return
    with _leftovers_lock:
        keys = _leftovers.pop(_identity(store), set())
    failed = set()
    for key in sorted(keys):
        try:
            store.delete(key)
            log.info("casstore: deleted lock %s/%s, left by an earlier failed request",
                     store.url, key)
        except Exception:
            failed.add(key)
    if failed:
        with _leftovers_lock:
            _leftovers.setdefault(_identity(store), set()).update(failed)


@contextlib.contextmanager
def gc_lock(store: Store, timeout_s: float) -> Iterator[Lease]:
    """Holds the GC lock for the body, taken at a moment no save is in flight; yields its
    lease, whose ``check()`` GC calls before each delete.

    GC yields to saves: if it finds a save lock after putting its own, it withdraws and tries
    again, so saves never wait for a GC that has not started sweeping.

    Raises:
      GcBusyError: no moment without saves came within ``timeout_s`` seconds; nothing done.
    """
    delete_leftovers(store)
    start = time.monotonic()
    told = False
    while True:
        if not (saves := _live(store, "save")):
            lease = Lease(store, "gc")
            try:
                lease.put()
            except AccessDeniedError:
                raise  # refused: no lock stored (read-only keys)
            except BaseException as e:
                _release(store, lease.key, True)  # an answer lost: the lock may be stored
                if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
                    e.add_note("casstore: garbage collection writes its lock object before it "
                               "deletes anything: on a full disk, free a few kilobytes first")
                raise
            if not (saves := _live(store, "save", (lease.key, time.monotonic()))):
                break
            _release(store, lease.key, lease.unsure)
        waited = time.monotonic() - start
        if waited >= timeout_s or (not told and waited > WAIT_NOTICE_S):
            told = True
            held = _held_by(store, saves)
            if waited > timeout_s:
                raise GcBusyError(f"saves kept running for {timeout_s:g} s; garbage "
                                  f"collection did nothing (url {store.url!r}); {held}")
            log.warning("casstore: gc of %s waits for saves in flight (up to %g s); %s",
                        store.url, timeout_s, held)
        time.sleep(POLL_S)
    lease.start()
    try:
        yield lease
    finally:
        lease.stop()
        _release(store, lease.key, lease.unsure)
