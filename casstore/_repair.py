"""Repair a damaged repository from another copy of it (docs/recovery.md).

Chunks are named by the hash of their bytes, so any copy of a repository that holds a step
holds exactly the same objects for it. :func:`repair` runs :func:`~casstore.verify` on the
damaged copy, puts the good copy's config object in place of a damaged or missing one,
deletes its corrupt objects and the steps that need a damaged object, and copies those steps
back from the good copy with :func:`~casstore.copy` (which sends only the objects the
destination lacks), once it has checked each of those objects in the good copy against its
chunk id.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from ._copy import copy, needed_objects
from ._delta import DeltaBases
from ._errors import CorruptChunkError, ManifestError
from ._layout import CONFIG_KEY
from ._repository import Url, delete, list_steps, parse_config, read_manifest
from ._scan import CONFIG, CORRUPT, MANIFEST, MISSING, Problem
from ._verify import verify
from .store import Store, open_store


@dataclasses.dataclass(frozen=True, slots=True)
class RepairInfo:
    """The result of :func:`repair`.

    Attributes:
      problems: what verify found in the damaged repository before the repair.
      deleted_objects: store keys of corrupt objects deleted (or, for a dry run, to delete).
      steps: ``(run, step)`` pairs copied back from the good copy (or to copy).
      unrepairable: problems the good copy cannot fix: a step it lacks or holds damaged (its
        manifest, or an object the step needs that the damaged copy lacks), or a format newer
        than this casstore.
      ok: the damaged repository verifies clean afterwards (False for a dry run with
        problems).
      dry_run: nothing was changed.
      seconds: wall time.
      config_restored: the damaged copy's config object (damaged, or missing where steps
        exist) was replaced by the good copy's (or, for a dry run, would be).
    """

    problems: tuple[Problem, ...]
    deleted_objects: tuple[str, ...]
    steps: tuple[tuple[str, int], ...]
    unrepairable: tuple[Problem, ...]
    ok: bool
    dry_run: bool
    seconds: float
    config_restored: bool = False


def repair(good_url: Url, damaged_url: Url, *, dry_run: bool = False,
           read_data: bool = True) -> RepairInfo:
    """Repairs ``damaged_url`` from ``good_url``, another copy of the same repository.

    Verifies the damaged copy. A damaged config object, or a missing one where steps exist,
    is replaced by the good copy's (format.md §2.1: it holds no per-step data). A step that
    needs a missing or corrupt object, or whose manifest is damaged, is deleted there and
    copied again from the good copy, after its corrupt objects are deleted (``copy`` skips
    objects and steps that exist). Before anything is changed, each object the damaged copy
    lacks is read from the good copy, decoded and checked against its chunk id (as
    ``copy(..., verify=True)`` does): a step the good copy cannot give back (it lacks the
    step, its manifest there is damaged, or an object the step needs is missing or corrupt
    there too), and a config object that is damaged in the good copy too, are left alone and
    reported in ``unrepairable``; nothing of them is deleted.

    Args:
      good_url, damaged_url: paths, fsspec URLs or Stores.
      dry_run: report the plan; change nothing.
      read_data: verify reads every chunk (False: checks only that objects exist, which
        finds missing objects and damaged manifests but not corrupt bytes).

    Returns:
      A :class:`RepairInfo`.

    Raises:
      CorruptChunkError, MissingChunkError: the good copy lost or truncated an object after
        the check above, where a step needs it (that step's manifest is then not written).
      StoreTimeoutError, StoreUnreachableError, AccessDeniedError: a store failed.
    """
    t0 = time.perf_counter()
    good, damaged = open_store(good_url), open_store(damaged_url)
    report = verify(damaged, read_data=read_data)
    config = _good_config(good) if any(p.kind == CONFIG for p in report.problems) else None
    runs = {run for p in report.problems for run, _ in p.needed_by}
    held = {run: set(list_steps(good, run=run)) for run in runs}
    fixable = [p for p in report.problems if p.kind in (MISSING, CORRUPT, MANIFEST)
               and p.needed_by and all(s in held[r] for r, s in p.needed_by)]
    spoilt = _damaged_in_good(good, fixable)  # left alone: nothing of them is deleted
    fixable = [p for p in fixable if not spoilt & set(p.needed_by)]
    fixable += [p for p in report.problems if p.kind == CONFIG and config is not None]
    unrepairable = tuple(p for p in report.problems if p not in fixable)
    objects = tuple(sorted({p.key for p in fixable if p.kind == CORRUPT and p.key}))
    steps = tuple(sorted({rs for p in fixable for rs in p.needed_by}))
    if dry_run or not fixable:
        return RepairInfo(report.problems, objects, steps, unrepairable,
                          report.ok, dry_run, time.perf_counter() - t0, config is not None)
    if config is not None:  # first: a copy into the damaged copy validates its config
        damaged.put(CONFIG_KEY, config)
    for key in objects:
        damaged.delete(key)
    by_run = collections.defaultdict(list)
    for run, step in steps:
        delete(damaged, step, run=run)
        by_run[run].append(step)
    for run, run_steps in by_run.items():
        copy(good, damaged, runs=[run], steps=run_steps)  # its objects checked above
    after = verify(damaged, read_data=read_data)
    return RepairInfo(report.problems, objects, steps, unrepairable, after.ok, False,
                      time.perf_counter() - t0, config is not None)


def _damaged_in_good(good: Store, problems: list[Problem]) -> set[tuple[str, int]]:
    """The ``(run, step)`` pairs of ``problems`` that the good copy cannot give back: its
    manifest of the step is damaged, or an object the step needs that the damaged copy lacks
    (a problem's key) is missing there too or fails its chunk id check (read and decoded
    here, a delta on its base, as ``copy(..., verify=True)`` does)."""
    spoilt, info, users = set(), {}, collections.defaultdict(set)
    for run, step in sorted({rs for p in problems for rs in p.needed_by}):
        try:
            needed = needed_objects(read_manifest(good, step, run=run))
        except ManifestError:
            spoilt.add((run, step))
            continue
        info.update(needed)
        for key in needed:
            users[key].add((run, step))
    wanted = sorted({p.key for p in problems if p.kind in (MISSING, CORRUPT)} & info.keys())
    bases = DeltaBases(good, [info[key][:2] for key in wanted])
    for key in wanted:
        cid, base, raw_length, _ = info[key]
        try:
            bases.decode(bases.read(key, cid, base), cid, base, raw_length)
        except (CorruptChunkError, FileNotFoundError):
            spoilt |= users[key]
    return spoilt


def _good_config(good: Store) -> bytes | None:
    """The good copy's config object, or None if it is missing, damaged or of a newer
    format."""
    try:
        data = good.get(CONFIG_KEY)
        parse_config(data, good.url)
    except (FileNotFoundError, ManifestError):  # UnsupportedFormatError is a ManifestError
        return None
    return data
