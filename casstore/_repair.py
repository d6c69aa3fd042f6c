"""Repair a damaged repository from another copy of it (docs/recovery.md).

Chunks are named by the hash of their bytes, so any copy of a repository that holds a step
holds exactly the same objects for it. :func:`repair` runs :func:`~casstore.verify` on the
damaged copy, puts the good copy's config object in place of a damaged or missing one, and
for each step that needs a damaged object (or whose manifest is damaged) writes the good
copy's objects in place of the missing and corrupt ones, then the good copy's manifest in
place of a damaged one (format.md §7: objects first). It deletes no step: before it writes
anything it has read and checked (decoded, against its chunk id) every object it will write,
and a step the good copy cannot give back whole is left as it is.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from ._delta import DeltaBases, read_object
from ._errors import CorruptChunkError, ManifestError, UnsupportedFormatError
from ._framing import check_framing
from ._layout import CONFIG_KEY, chunk_key, manifest_key
from ._locks import save_lock
from ._manifest import DIGEST_BYTES, decode_manifest, needed_objects
from ._pool import bounded_map
from ._repository import (
    Url,
    list_chunk_objects,
    parse_config,
    read_config_bytes,
    read_manifest_bytes,
)
from ._scan import CONFIG, CORRUPT, MANIFEST, MISSING, UNSUPPORTED, Problem
from ._verify import verify
from .store import Store, open_store

log = logging.getLogger("casstore")


@dataclasses.dataclass(frozen=True, slots=True)
class RepairInfo:
    """The result of :func:`repair`.

    Attributes:
      problems: what verify found in the damaged repository before the repair.
      deleted_objects: store keys of corrupt objects replaced by the good copy's (or, for a
        dry run, to replace).
      steps: ``(run, step)`` pairs mended from the good copy (or to mend).
      unrepairable: problems the good copy cannot fix: a step it lacks, holds damaged (its
        manifest, or an object the step needs that the damaged copy lacks or holds damaged)
        or holds as another step of that number (its manifest differs), or a format newer
        than this casstore.
      ok: the damaged repository verifies clean afterwards (False for a dry run with
        problems).
      dry_run: nothing was changed.
      seconds: wall time.
      config_restored: the damaged copy's config object (damaged, or missing where steps
        exist) was replaced by the good copy's (or, for a dry run, would be).
      why: ``(run, step)`` -> why the good copy cannot give that step back, one line, for each
        step an unrepairable problem names.
    """

    problems: tuple[Problem, ...]
    deleted_objects: tuple[str, ...]
    steps: tuple[tuple[str, int], ...]
    unrepairable: tuple[Problem, ...]
    ok: bool
    dry_run: bool
    seconds: float
    config_restored: bool = False
    why: dict[tuple[str, int], str] = dataclasses.field(default_factory=dict)


def repair(good_url: Url, damaged_url: Url, *, dry_run: bool = False,
           read_data: bool = True) -> RepairInfo:
    """Repairs ``damaged_url`` from ``good_url``, another copy of the same repository.

    Verifies the damaged copy. A damaged config object, or a missing one where steps exist,
    is replaced by the good copy's (format.md §2.1: it holds no per-step data). For a step
    that needs a missing or corrupt object, or whose manifest is damaged, the good copy's
    manifest of the step is read; every object it needs that the damaged copy lacks or holds
    corrupt (with ``read_data``, the objects of a step whose manifest is damaged are read
    there too) is read from the good copy, decoded and checked against its chunk id. Only
    then is anything written: those objects, then the good manifest in place of a damaged
    one. A step the good copy cannot give back (it lacks the step, its manifest there is
    damaged or differs from the damaged copy's readable one, or an object is missing or
    corrupt there too), and a config object damaged in the good copy too, are left alone and
    reported in ``unrepairable``. No step is deleted: a failure part way leaves every step
    as it was or mended. The writes hold a save lock (no GC meanwhile), and a damaged
    manifest is replaced only if it is still there as read: a step deleted, or deleted and
    saved again, while the repair runs is left as it is now (a warning names it; not in
    ``steps``).

    Args:
      good_url, damaged_url: paths, fsspec URLs or Stores.
      dry_run: report the plan; change nothing.
      read_data: verify reads every chunk (False: checks only that objects exist, which
        finds missing objects and damaged manifests but not corrupt bytes).

    Returns:
      A :class:`RepairInfo`.

    Raises:
      CorruptChunkError, ObjectNotFoundError: the good copy lost or changed an object after
        the check above (the manifest of a step that needs it is not written).
      StoreTimeoutError, StoreUnreachableError, AccessDeniedError: a store failed.
    """
    t0 = time.perf_counter()
    good, damaged = open_store(good_url), open_store(damaged_url)
    report = verify(damaged, read_data=read_data)
    config = _good_config(good) if any(p.kind == CONFIG for p in report.problems) else None
    plan = _Plan(good, damaged, report.problems, read_data)
    fixable = [p for p in report.problems if (_object_problem(p) and p.key in plan.sent)
               or (p.kind == MANIFEST and set(p.needed_by) <= plan.mended.keys())
               or (p.kind == CONFIG and config is not None)]
    unrepairable = tuple(p for p in report.problems if p not in fixable)
    # nothing fixable: nothing is written, not even the steps that could be taken back
    objects = tuple(sorted(plan.corrupt & plan.sent)) if fixable else ()
    steps = tuple(sorted(plan.mended)) if fixable else ()
    why = {rs: plan.why.get(rs, "of a format newer than this casstore" if p.kind == UNSUPPORTED
                            else "GOOD cannot give it back")
           for p in unrepairable for rs in p.needed_by if rs not in plan.mended}
    if dry_run or not fixable:
        return RepairInfo(report.problems, objects, steps, unrepairable,
                          report.ok, dry_run, time.perf_counter() - t0, config is not None, why)
    if config is not None:  # first: the steps' manifests are validated against it
        damaged.put(CONFIG_KEY, config)
    if changed := plan.write():
        steps = tuple(rs for rs in steps if rs not in changed)
    after = verify(damaged, read_data=read_data)
    return RepairInfo(report.problems, objects, steps, unrepairable, after.ok, False,
                      time.perf_counter() - t0, config is not None, why)


class _Plan:
    """What a repair writes, checked before anything is written.

    Attributes:
      mended: ``(run, step)`` -> the good copy's manifest (bytes) of each step to mend.
      sent: object keys to write from the good copy (each read and checked there).
      corrupt: object keys the damaged copy holds corrupt.
      broken: steps whose manifest is damaged in the damaged copy (written from the good).
      why: ``(run, step)`` -> why the good copy cannot give the step back.
    """

    def __init__(self, good: Store, damaged: Store, problems: tuple[Problem, ...],
                 read_data: bool):
        self.good, self.damaged = good, damaged
        self.corrupt = {p.key for p in problems if _object_problem(p) and p.kind != MISSING}
        self.broken = {rs for p in problems if p.kind == MANIFEST for rs in p.needed_by}
        steps = sorted({rs for p in problems if _object_problem(p) or p.kind == MANIFEST
                        for rs in p.needed_by})
        present = {info.key for info in list_chunk_objects(damaged)} if steps else set()
        self.info: dict[str, tuple] = {}
        self.theirs: dict[tuple[str, int], bytes] = {}  # damaged manifests, as planned
        self.mended, needs, self.why = {}, {}, {}
        for run, step in steps:
            found = self._good_manifest(run, step)
            if found is not None:
                self.mended[run, step], needs[run, step] = found
                self.info.update(needs[run, step])
        unsure: set[str] = set()  # deltas whose base is damaged too: sent, not called corrupt
        if read_data:  # the objects of a damaged manifest's step: unchecked by verify
            failed = _failing(damaged, {k for rs in self.broken & needs.keys()
                                        for k in needs[rs] if k in present}, self.info)
            unsure = {k for k in failed if self.info[k][1] is not None and chunk_key(
                self.info[k][1]) in (failed | self.corrupt | (self.info.keys() - present))}
            self.corrupt |= failed - unsure
        # Deltas on a base missing or corrupt here: verify could not check them (its
        # "unchecked"), so they are sent from the good copy with the base.
        unsure |= {k for k in present & self.info.keys() if self.info[k][1] is not None
                   and chunk_key(self.info[k][1]) in self.corrupt | (self.info.keys() - present)}
        wanted = {rs: {k for k in needs[rs] if k not in present or k in self.corrupt | unsure}
                  for rs in needs}
        bad = _failing(good, set().union(*wanted.values()), self.info)
        for rs in self.mended:
            if lost := len(wanted[rs] & bad):
                self.why[rs] = f"{lost} object(s) it needs are missing or corrupt in GOOD too"
        self.mended = {rs: m for rs, m in self.mended.items() if not wanted[rs] & bad}
        self.sent = set().union(*(wanted[rs] for rs in self.mended))

    def _good_manifest(self, run: str, step: int) -> tuple[bytes, dict] | None:
        """The good copy's manifest of the step and the objects it needs; None if the good
        copy cannot give the step back: it lacks it, or it is damaged there, or it is not the
        damaged copy's (another step of this number: a readable manifest that differs, or a
        damaged one that is not the good one cut short or with a few bytes changed)."""
        try:
            data = read_manifest_bytes(self.good, run, step)
            needed = needed_objects(decode_manifest(data, run=run, step=step,
                                                    url=self.good.url))
        except FileNotFoundError:
            self.why[run, step] = "GOOD lacks the step"
            return None
        except ManifestError as e:  # damaged, over the size limit, or newer
            self.why[run, step] = f"its manifest in GOOD does not read: {e}"
            return None
        try:
            theirs = read_manifest_bytes(self.damaged, run, step)
        except (FileNotFoundError, ManifestError) as e:  # gone since, or over the size limit
            self.why[run, step] = f"its manifest here cannot be compared with GOOD's: {e}"
            return None
        if (run, step) not in self.broken and theirs != data:
            self.why[run, step] = ("GOOD holds another step of this number (its manifest "
                                   "differs: another history of the run)")
        elif (run, step) in self.broken and not _damaged_copy(theirs, data):
            self.why[run, step] = ("its manifest here is too damaged to tell whether GOOD's "
                                   "step is the same (docs/recovery.md: replace it by hand)")
        else:
            self.theirs[run, step] = theirs
            return data, needed
        return None

    def write(self) -> set[tuple[str, int]]:
        """The checked objects (framing checked again as they pass), then the manifests of
        the steps whose manifest was damaged, under a save lock (format.md §8: no GC deletes
        what they need meanwhile). A damaged manifest is replaced only if it is still the
        bytes the plan read: a step deleted since (and its chunks perhaps collected), or
        deleted and saved again, is left as it is now, not brought back or overwritten.

        Returns:
          The steps left so, each named in a warning.
        """
        def send(key: str) -> None:
            cid, base, raw_length, _ = self.info[key]
            data = read_object(self.good, key, raw_length)
            check_framing(data, cid, raw_length, delta=base is not None)
            self.damaged.put(key, data)

        changed = set()
        with save_lock(self.damaged):
            bounded_map(send, sorted(self.sent), self.damaged.max_workers)
            for run, step in sorted(self.broken & self.mended.keys()):
                try:
                    now = read_manifest_bytes(self.damaged, run, step)
                except (FileNotFoundError, ManifestError):
                    now = None
                if now != self.theirs[run, step]:
                    changed.add((run, step))
                    log.warning("casstore: repair leaves run %r step %d as it is: it was "
                                "deleted or saved again while the repair ran", run, step)
                    continue
                self.damaged.put(manifest_key(run, step), self.mended[run, step])
        return changed


_CREATED = b"\xa7created\xcb"  # a manifest's created key, then its float64 (format.md §4)
_DIGEST = b"\xa6digest\xc4\x10"  # its digest key, then 16 bytes: the manifest's last field


def _damaged_copy(damaged: bytes, good: bytes) -> bool:
    """True if ``damaged`` is ``good`` damaged: cut short after its ``created`` time (a prefix
    that holds it: before it, two saves' manifests of a step look alike) or with at most 1 byte
    in 100 changed (the same length) and its ``created`` time or its digest (format.md §4.1)
    as in ``good`` (two saves of one tree give manifests of one length that differ in a few
    bytes: those, and the chunk ids of the leaves that changed). Anything else may be another
    step of this number: repair leaves it (docs/recovery.md)."""
    at = good.find(_CREATED)
    if len(damaged) != len(good):
        return at >= 0 and at + len(_CREATED) + 8 <= len(damaged) < len(good) and (
            good.startswith(damaged))
    changed = np.count_nonzero(np.frombuffer(damaged, np.uint8) != np.frombuffer(good, np.uint8))
    created = slice(at + len(_CREATED), at + len(_CREATED) + 8)
    same_created = at >= 0 and damaged[created] == good[created]
    same_digest = good[-DIGEST_BYTES - 9:-DIGEST_BYTES] == _DIGEST and (
        damaged[-DIGEST_BYTES:] == good[-DIGEST_BYTES:])
    return changed <= max(1, len(good) // 100) and (same_created or same_digest)


def _object_problem(p: Problem) -> bool:
    """A chunk or delta object missing, corrupt, or of a format this casstore does not read
    (damage to its header, or a newer encoding: the good copy's, checked, holds the same
    bytes either way)."""
    return p.kind in (MISSING, CORRUPT) or (p.kind == UNSUPPORTED and p.key is not None)


def _failing(store: Store, keys: set[str], info: dict[str, tuple]) -> set[str]:
    """The ``keys`` whose objects in ``store`` are missing or fail their chunk id check (read
    and decoded, a delta on its base, as ``copy(..., verify=True)`` does)."""
    bases = DeltaBases(store, [info[key][:2] for key in keys])

    def fails(key: str) -> bool:
        cid, base, raw_length, _ = info[key]
        try:
            bases.decode(bases.read(key, cid, base, raw_length), cid, base, raw_length)
        except (CorruptChunkError, FileNotFoundError, UnsupportedFormatError):
            return True
        return False

    keys = sorted(keys)
    return {key for key, bad in zip(keys, bounded_map(fails, keys, store.max_workers)) if bad}


def _good_config(good: Store) -> bytes | None:
    """The good copy's config object, or None if it is missing, damaged or of a newer
    format."""
    try:
        data = read_config_bytes(good)
        parse_config(data, good.url)
    except (FileNotFoundError, ManifestError):  # UnsupportedFormatError is a ManifestError
        return None
    return data
