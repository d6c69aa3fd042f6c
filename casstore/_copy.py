"""Copy checkpoints between repositories (local, S3, GCS, any pair), moving only missing chunks.

The destination follows format.md §7's commit rule: a step's objects are all stored before its
manifest is written create-only, so an interrupted copy leaves no partial step and running it again
sends only what is missing. Manifests are read and validated first, every object the destination
lacks is assigned to the first step that needs it, the objects of all steps go through one bounded
pool, and each step's manifest is written, in step order, once its objects are in.

- ``verify=False`` (the default) checks each object's framing without decoding it (format.md §3.2:
  header, the raw length the manifest gives, a raw chunk's payload length, the plane table of
  codecs 3-5, each zstd frame's declared size): a truncated, mis-sized or foreign object is
  refused, a changed byte inside a payload is not. A byte changed in transit is seen by the store:
  S3 checks the CRC32C botocore sends with each upload (and botocore each download against the
  stored checksum; then the object moves again, then the copy fails, :mod:`casstore.store._retry`);
  on GCS each upload's stored MD5 is compared with what was sent (gcsfs ``consistency="md5"``).
  Damage at the source is seen by every restore and ``verify`` of the destination (the chunk id is
  checked on every read).
- ``verify=True`` decodes every object (a delta on its base) and checks it against its chunk id
  before it is sent: nothing damaged at the source reaches the destination.

Between two paths of one S3 or GCS service with the same credentials
(:meth:`~casstore.store.Store.server_side_copy`), the service copies each object (S3 CopyObject,
GCS rewrite), as rclone does within one remote: no byte reaches this process, and each object's
size (a HEAD) is checked instead of its framing: one cut short is read and checked as above;
``verify=True`` decodes instead.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import time
from collections.abc import Callable

from ._copy_engine import CopyProgress, Engine, Step, same_step, share_of
from ._delta import DeltaBases
from ._errors import (
    CorruptChunkError,
    ObjectNotFoundError,
    StepNotFoundError,
)
from ._layout import check_step, manifest_key
from ._locks import Lease, save_lock
from ._manifest import Manifest, needed_objects
from ._pool import bounded_map
from ._repository import (
    Url,
    check_config,
    ensure_config,
    list_chunk_objects,
    list_runs,
    list_steps,
    read_decoded,
    still_committed,
)
from .store import Store, nested, open_store

log = logging.getLogger("casstore")

@dataclasses.dataclass(frozen=True, slots=True)
class CopyInfo:
    """What one :func:`copy` did. Each chunk object the selected steps need is counted once:
    either copied, or skipped because the destination had it before the copy began (an object
    that a step the destination has lacks there is copied).

    Attributes:
      steps_copied: ``(run, step)`` pairs whose manifests were written at the destination.
      steps_skipped: ``(run, step)`` pairs the destination already had (the source's
        manifest, byte for byte).
      chunks_copied, bytes_copied: chunk and delta objects sent, and their stored bytes.
      chunks_skipped, bytes_skipped: objects the steps need that the destination already had.
      seconds: wall time.
    """

    steps_copied: tuple[tuple[str, int], ...]
    steps_skipped: tuple[tuple[str, int], ...]
    chunks_copied: int
    bytes_copied: int
    chunks_skipped: int
    bytes_skipped: int
    seconds: float


def copy(src_url: Url, dst_url: Url, *, steps: list[int] | None = None,
         runs: list[str] | None = None, max_workers: int | None = None, verify: bool = False,
         progress: Callable[[CopyProgress], None] | None = None) -> CopyInfo:
    """Copies checkpoints from one repository to another.

    Lists the selected runs and steps and reads and validates their manifests at the source
    while it takes a save lock at the destination and lists its chunk objects once (nothing is
    written if a step is missing or a manifest invalid), then sends the objects the
    destination lacks (delta objects and their bases included) through one pool of
    ``max_workers`` threads across all steps, and writes each step's manifest create-only, in
    step order, once its objects are in. The lock keeps the destination's garbage collection
    out meanwhile. An object the destination holds under its key is not sent again, even
    damaged (:func:`~casstore.verify` finds it, :func:`~casstore.repair` replaces it). Between
    two paths of one S3 or GCS service (same endpoint, credentials) the service copies each
    object unless ``verify``: :meth:`~casstore.store.Store.server_side_copy`.

    Args:
      src_url, dst_url: paths, fsspec URLs or Stores.
      steps: the steps to copy (in every selected run); None copies all.
      runs: the runs to copy; None copies every run of the source.
      max_workers: concurrent object transfers (default the destination store's).
      verify: decode each object and check its chunk id before sending it (see the module
        docstring for what the default, a framing check, guarantees).
      progress: called with a :class:`CopyProgress` after each object sent and each manifest
        written, from the copying threads (one call at a time).

    Returns:
      A :class:`CopyInfo`.

    Raises:
      StepNotFoundError: the source is no casstore repository, a run named in ``runs`` has no
        step in it, or a step named in ``steps`` is in none of the selected runs (nothing is
        written).
      ValueError: the two are one repository, or one lies inside the other (nothing is
        written).
      TypeError, ValueError: ``steps`` or ``runs`` is not a list, or a step not an int.
      CorruptChunkError: a source object fails its checks or is missing (names run, step, key
        path and chunk id of the first, and the steps not copied); no manifest that needs it
        is written, and every other selected step is copied first. A step deleted from the
        source since its manifest was read (a live source's retention) is not copied, and
        named in a warning, not in this error.
      ManifestError: a source manifest is invalid (nothing is written); its subclass
        UnsupportedFormatError: a source object is of a newer format than this casstore's.
      StepAlreadyExistsError: the destination has a selected step whose manifest is not the
        source's (another step of that number; nothing is written), or one was written there
        concurrently (the steps before it are copied).
      StoreTimeoutError: either store did not answer within its deadline (names the object and,
        for a chunk, run, step, key path and chunk id); manifests that need it are not written.
    """
    if progress is not None and not callable(progress):  # else step 0 was copied, then this
        raise TypeError(f"progress must be callable, not {progress!r}")
    src, dst = open_store(src_url), open_store(dst_url)
    if nested(src, dst):
        raise ValueError(f"cannot copy {src.url!r} to {dst.url!r}: one repository, or one "
                         "inside the other")
    if not check_config(src):  # else an empty repository was made at the destination
        raise StepNotFoundError("no casstore repository here: nothing to copy", url=src.url)
    with cf.ThreadPoolExecutor(1) as pool:
        source = pool.submit(lambda: (selected := select_steps(src, steps=steps, runs=runs),
                                      read_manifests(src, selected)))
        if not check_config(dst):
            source.result()  # a run or step not in the source: nothing written, not a config
            ensure_config(dst)
        with save_lock(dst) as lease:
            present = {info.key: info.size for info in list_chunk_objects(dst)}
            selected, manifests = source.result()
            return copy_selected(src, dst, selected, present, max_workers=max_workers,
                                 verify=verify, progress=progress, manifests=manifests,
                                 lease=lease)


def select_steps(src: Store, *, steps: list[int] | None = None,
                 runs: list[str] | None = None) -> list[tuple[str, int]]:
    """The ``(run, step)`` pairs of the source a copy selects, in run then step order.

    Raises:
      StepNotFoundError: a run in ``runs`` has no committed step, or a step in ``steps`` is
        in none of the selected runs.
      TypeError, ValueError: ``steps`` or ``runs`` is not a list; a step not an int in [0, 1e16).
    """
    if isinstance(steps, str | bytes | int) or isinstance(runs, str | bytes):
        raise TypeError(f"steps and runs are lists (steps=[1], runs=['a']): {steps=}, {runs=}")
    steps = None if steps is None else [check_step(step) for step in steps]
    all_runs = list_runs(src)
    for run in runs or ():
        if run not in all_runs:
            raise StepNotFoundError(f"run {run!r} has no committed step in the source "
                                    f"(runs there: {', '.join(all_runs) or 'none'})",
                                    url=src.url, run=run)
    selected = [(run, step) for run in (dict.fromkeys(runs) if runs is not None else all_runs)
                for step in list_steps(src, run=run) if steps is None or step in steps]
    for step in steps or ():
        if not any(s == step for _, s in selected):
            raise StepNotFoundError("step not in the source", url=src.url, step=step)
    return selected


def copy_selected(src: Store, dst: Store, selected: list[tuple[str, int]],
                  present: dict[str, int], *, max_workers: int | None = None,
                  verify: bool = False, probe: bool = False,
                  progress: Callable[[CopyProgress], None] | None = None,
                  share: tuple[int, int] | None = None, gate: Callable[[], None] | None = None,
                  manifests: list[tuple[bytes, Manifest]] | None = None,
                  lease: Lease | None = None) -> CopyInfo:
    """The engine of :func:`copy` (and of the manager's persist): copies ``selected`` steps
    from ``src`` to ``dst`` given ``present``, destination object keys and sizes known to be
    there, which it updates with what it sends or finds. With ``probe``, an object not in
    ``present`` is looked up (one ``stat``) before it is sent, so ``present`` may hold only
    what is known, not everything. With ``share=(i, n)`` it sends only the objects of share
    ``i`` of ``n`` (:func:`share_of`) and writes no manifest: ``n`` processes each send
    theirs, then one copies with every object in ``present``, writing the manifests. ``gate``
    runs before each object's transfer (a persist waiting for local saves). ``manifests``: the
    selected steps' (:func:`read_manifests`), if read already. The caller holds the
    destination's save lock (``lease``: checked before each manifest is written)."""
    t0 = time.perf_counter()
    plan, skipped_steps, kept = _plan(src, dst, selected, manifests)
    needed: dict[str, tuple[str, str | None, int, str, Step]] = {}
    # a step the destination has may lack objects there (deleted or lost): they go first
    there = [Step(m.run, m.step, m, b"", set()) for m in kept]
    for s in there + plan:
        for obj, (cid, base, raw, path) in needed_objects(s.manifest).items():
            if s in plan or obj not in present:
                needed.setdefault(obj, (cid, base, raw, path, s))
    order = {id(s): i for i, s in enumerate(there + plan)}
    # In step order (a step's manifest goes up as soon as its objects are in), and within a
    # step a base beside the deltas on it.
    missing = sorted((k for k in needed if k not in present
                      and (share is None or share_of(k, share[1]) == share[0])),
                     key=lambda k: (order[id(needed[k][4])], needed[k][1] or needed[k][0]))
    skipped = [k for k in needed if k in present]  # and those of the steps already there:
    skipped += [k for k in dict.fromkeys(k for m in kept for k in needed_objects(m))
                if k not in needed]
    for s in plan:
        s.waiting = {k for k in needed_objects(s.manifest) if k not in present}
    engine = Engine(src, dst, plan if share is None else [], needed, len(missing), verify,
                     progress, probe, gate, lease)
    engine.sizes = {r.key: r.stored_bytes for s in plan for leaf in s.manifest.leaves
                    for r in leaf.chunks}  # a delta's base: looked up if copied server-side
    engine.commit_ready()
    # with verify, a base the deltas share is read once for all; without, none is decoded
    engine.bases = DeltaBases(src, [needed[k][:2] for k in missing] if verify else [])
    try:
        bounded_map(engine.transfer, missing, max_workers or dst.max_workers)
    except KeyboardInterrupt:
        engine.stopped = True  # the transfers left running send and commit nothing more
        raise
    engine.commit_ready()
    if damaged := _damaged(src, engine):
        message, where = next(((m, w) for m, w in engine.unusable.values() if (
            w["run"], w["step"]) in damaged), next(iter(engine.unusable.values())))
        names = ", ".join(f"{run}@{step}" for run, step in damaged[:10])
        raise CorruptChunkError(f"{message}; {len(engine.unusable)} source object(s) unusable: "
                                f"{len(damaged)} step(s) not copied ({names}), the "
                                f"other {len(engine.committed)} copied", **where)
    present.update(engine.sent | engine.found)
    skipped += list(engine.found)
    return CopyInfo(tuple(engine.committed), tuple(skipped_steps + engine.raced),
                    len(engine.sent), sum(engine.sent.values()), len(skipped),
                    sum(present[k] for k in skipped), time.perf_counter() - t0)


def read_manifests(src: Store, selected: list[tuple[str, int]]
                   ) -> list[tuple[bytes, Manifest]]:
    """The selected steps' manifests as stored and decoded (validated), all read at once.

    Raises:
      StepNotFoundError: a step was deleted from the source since it was listed.
      ManifestError: a manifest is invalid.
    """
    def read(pair: tuple[str, int]) -> tuple[bytes, Manifest]:
        run, step = pair
        try:
            return read_decoded(src, run, step)
        except FileNotFoundError:
            raise StepNotFoundError("step deleted from the source during the copy",
                                    url=src.url, run=run, step=step) from None

    return bounded_map(read, selected, src.max_workers)


def _plan(src: Store, dst: Store, selected: list[tuple[str, int]],
          manifests: list[tuple[bytes, Manifest]] | None
          ) -> tuple[list[Step], list[tuple[str, int]], list[Manifest]]:
    """Reads (unless given) and validates the selected steps' manifests; a step the destination
    has is skipped if its manifest is the source's, byte for byte (a copy writes them as is),
    else StepAlreadyExistsError. Returns ``(steps to copy, steps skipped, their manifests)``."""
    have = {(run, step) for run in dict.fromkeys(r for r, _ in selected)
            for step in list_steps(dst, run=run)}
    if manifests is None:
        manifests = read_manifests(src, selected)
    there = _manifests_there(dst, [manifest_key(run, step) for run, step in selected
                                   if (run, step) in have])
    skipped = [pair for pair in selected if manifest_key(*pair) in there]
    kept, plan = [], []
    for (run, step), (data, manifest) in zip(selected, manifests):
        if (run, step) in skipped:
            same_step(dst, run, step, there[manifest_key(run, step)], data)
            kept.append(manifest)
        else:
            plan.append(Step(run, step, manifest, data, set()))
    return plan, skipped, kept


def _damaged(src: Store, engine: Engine) -> list[tuple[str, int]]:
    """The steps an unusable source object kept from being copied, less those deleted from
    the source (or saved again there) since their manifests were read, each named in a
    warning: a live source's retention and GC are no damage (as for ``verify``)."""
    damaged = []
    for s in (s for s in engine.plan if (s.run, s.step) in engine.not_copied):
        if still_committed(src, s.manifest):
            damaged.append((s.run, s.step))
        else:
            log.warning("casstore: run %r step %d, deleted from %s during the copy, was not "
                        "copied", s.run, s.step, src.url)
    return damaged


def _manifests_there(dst: Store, keys: list[str]) -> dict[str, bytes]:
    """The destination's manifests at ``keys``, less those deleted since listed (then copied)."""
    try:
        return dst.get_many(keys)
    except ObjectNotFoundError:
        return {k: dst.get(k) for k in keys if dst.exists(k)}  # (a race again: it raises)
