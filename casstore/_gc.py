"""Garbage collection: plan, stats, execute (format.md §8; restic's PlanPrune / Execute).

Under the GC lock (no save in flight, see ``_locks``), list the chunks first, then every
manifest of every run; a chunk is garbage if no manifest references it (a delta chunk also
references its base, format.md §3.5) and it is older than the grace period. Listing chunks
before manifests means a chunk written after the listing is never a candidate, and the grace
period spares young chunks of any writer the locks did not see.
Deleting is idempotent, so an interrupted GC is safe to run again.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import time

from ._errors import CasstoreError, ManifestError
from ._locks import GcBusyError, Lease, gc_lock
from ._pool import bounded_map
from ._repository import Url, check_config, list_chunk_objects
from ._scan import UNSUPPORTED, require_intact, scan_manifests
from .store import Store, open_store

DEFAULT_GRACE_PERIOD_S = 3600.0
LEFTOVER_AGE_S = 3600.0  # a temporary file untouched this long is no write in flight
log = logging.getLogger("casstore")


@dataclasses.dataclass(frozen=True, slots=True)
class GcInfo:
    """What one :func:`gc` found and did. Its counts add up:
    ``chunks == referenced_chunks + deleted_chunks + young_unreferenced_chunks``.

    Attributes:
      manifests: manifests read (all runs).
      chunks: chunk objects listed (under ``chunks/`` and, for delta chunks, ``deltas/``).
      referenced_chunks: listed chunk objects that at least one manifest references (a delta
        chunk references its delta object and its base's chunk object, format.md §3.5).
      deleted_chunks, deleted_bytes: garbage deleted (or, for a dry run, that would be).
      young_unreferenced_chunks: unreferenced chunks spared because they are within the grace
        period.
      missing_chunks: referenced chunk objects that do not exist (a damaged repository, not
        part of ``chunks``; see verify).
      dry_run: nothing was deleted.
      seconds: wall time.
      damaged_manifests: manifests that did not read (a dry run only: a real gc refuses).
        Chunks only they reference count as garbage in a dry run's figures.
      newer_manifests: those of ``damaged_manifests`` that are of a newer format (not
        damage: upgrade casstore).
      leftover_bytes: bytes of temporary files that writers killed mid-write left in a local
        directory, deleted once untouched for the grace period and at least
        ``LEFTOVER_AGE_S`` (1 hour: a younger one may be a write in flight); 0 for a dry run
        and an object store.
    """

    manifests: int
    chunks: int
    referenced_chunks: int
    deleted_chunks: int
    deleted_bytes: int
    young_unreferenced_chunks: int
    missing_chunks: int
    dry_run: bool
    seconds: float
    damaged_manifests: int = 0
    leftover_bytes: int = 0
    newer_manifests: int = 0


def gc(url: Url, *, grace_period_s: float = DEFAULT_GRACE_PERIOD_S, dry_run: bool = False,
       lock_timeout_s: float = 600.0, max_workers: int | None = None) -> GcInfo:
    """Deletes chunks that no manifest of any run references and that are older than the grace.

    Takes the GC lock (waiting up to ``lock_timeout_s`` for saves in flight to finish; new saves
    wait for GC), lists ``chunks/``, then reads every manifest, then deletes the garbage with
    bounded concurrency.

    Args:
      url: a path, an fsspec URL or a Store.
      grace_period_s: spare unreferenced chunks modified less than this many seconds ago.
      dry_run: report what would be deleted (count and bytes) and delete nothing (no lock
        is taken either).
      lock_timeout_s: how long to wait for saves in flight.
      max_workers: concurrent deletes (default the store's).

    Returns:
      A :class:`GcInfo`.

    Raises:
      ManifestError: not a dry run, and a manifest does not read (named, with every other
        one); GC refuses to delete anything, since it cannot know what those steps reference.
      CasstoreError: saves still in flight after ``lock_timeout_s``; or the GC lock could not
        be refreshed in time (its lease, format.md §8), so GC stopped deleting midway (what it
        deleted was garbage; running it again finishes).
      ReadOnlyStoreError: not a dry run on a read-only store.
    """
    t0 = time.perf_counter()
    for name, value in (("grace_period_s", grace_period_s), ("lock_timeout_s", lock_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
            raise ValueError(f"{name} must be a number of seconds >= 0, not {value!r}")
    store = open_store(url)
    if not check_config(store):
        return GcInfo(0, 0, 0, 0, 0, 0, 0, dry_run, time.perf_counter() - t0)
    if dry_run:
        return _collect(store, grace_period_s, None, max_workers, t0)
    with gc_lock(store, lock_timeout_s) as lease:
        return _collect(store, grace_period_s, lease, max_workers, t0)


def _collect(store: Store, grace_period_s: float, lease: Lease | None,
             max_workers: int | None, t0: float) -> GcInfo:
    """Marks and sweeps; ``lease`` None is a dry run (nothing deleted)."""
    dry_run, leftovers = lease is None, 0
    now = time.time()
    chunks = {info.key: info for info in list_chunk_objects(store)}  # before the manifests
    scan = scan_manifests(store, max_workers=max_workers)
    if not dry_run:
        require_intact(scan, "gc")
    referenced = set().union(*(m.object_keys() for m in scan.manifests))
    garbage = [key for key, info in chunks.items()
               if key not in referenced and now - info.mtime >= grace_period_s]
    young = sum(1 for key in chunks if key not in referenced) - len(garbage)
    missing = sorted(referenced - chunks.keys())
    if dry_run:  # no lock keeps saves out: a step committed since the listing added objects
        found = bounded_map(store.exists, missing, max_workers or store.max_workers)
        missing = [key for key, there in zip(missing, found, strict=True) if not there]
    if not dry_run:
        def sweep(key: str) -> None:
            lease.check()  # never delete once saves may have taken the lock for stale
            store.delete(key)
            try:  # a process paused during the delete: a save may have reused the chunk
                lease.check()
            except CasstoreError as e:
                raise CasstoreError(f"{e}; {key} was deleted after the lock went stale: if "
                                    "a save reused it, `casstore verify` names the step, and "
                                    "`casstore repair` takes it from another copy") from e

        bounded_map(sweep, garbage, max_workers or store.max_workers)
        lease.check()
        # a killed local write's temp files; a younger one may be a write in flight
        leftovers = store.sweep_leftovers(max(grace_period_s, LEFTOVER_AGE_S))
    return GcInfo(len(scan.manifests), len(chunks), len(referenced & chunks.keys()),
                  len(garbage), sum(chunks[key].size for key in garbage), young,
                  len(missing), dry_run, time.perf_counter() - t0,
                  len(scan.damaged), leftovers,
                  sum(p.kind == UNSUPPORTED for p in scan.damaged))


class RetentionGc:
    """GC after retention deleted steps (a manager's ``gc_after_retention``, per tier), run on
    a background thread: it waits at most ``LOCK_WAIT_S`` for save locks (the other processes
    of a multi-process save release theirs just after the commit; a process killed while
    saving leaves one for up to 6 hours), so a busy repository is left for the next
    retention, which tries again even if it deletes nothing (a warning after ``WARN_AFTER``
    postponements in a row: the lock of a killed save). A GC that refuses because a
    manifest does not read (:class:`ManifestError`, naming it) is also left for the next
    retention, with a warning once per message: the saves and retention go on (the save
    after which it ran is committed; nothing is deleted that the manifest may need).

    Args:
      store: the tier.
      grace_period_s: as :func:`gc`'s.
    """

    LOCK_WAIT_S = 2.0
    WARN_AFTER = 10  # postponements in a row before a warning: space is not being freed

    def __init__(self, store: Store, grace_period_s: float):
        self.store, self.grace_period_s, self.due = store, grace_period_s, False
        self.refusals: set[str] = set()  # warned of
        self.postponed = 0  # in a row

    def __call__(self, deleted: bool) -> GcInfo | None:
        """Collects if ``deleted`` or a collection is still due; None if none ran."""
        self.due |= deleted
        if not self.due:
            return None
        try:
            info = gc(self.store, grace_period_s=self.grace_period_s,
                      lock_timeout_s=self.LOCK_WAIT_S)
        except GcBusyError as e:
            self.postponed += 1
            (log.warning if self.postponed == self.WARN_AFTER else log.info)(
                "casstore: gc after retention postponed%s: %s", f" {self.postponed} times in "
                "a row, so retention frees no space" if self.postponed >= self.WARN_AFTER
                else "", e)
            return None
        except ManifestError as e:  # a damaged manifest (in any run): collect nothing
            if str(e) not in self.refusals:
                self.refusals.add(str(e))
                log.warning("casstore: gc after retention skipped: %s", e)
            return None
        self.due, self.postponed = False, 0
        return info
