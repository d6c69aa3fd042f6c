"""Verify a repository: manifests parse, chunks exist, and (optionally) chunks decode right.

restic's ``check`` and ``check --read-data``: every problem is reported, not just the first,
and each damaged object once, with the steps that need it. A missing object is reported as
missing (kind ``"missing"``), never as corruption; a delta chunk whose base is missing or
corrupt cannot be rebuilt: the base is the one problem, the delta counts in
``chunks_unchecked``.
"""

from __future__ import annotations

import dataclasses
import struct
import threading
import time
from collections.abc import Callable

from ._codec import HEADER, MAX_RAW_LENGTH
from ._delta import DeltaBases, read_again
from ._errors import (
    STORE_FAILURES,
    CasstoreError,
    CorruptChunkError,
    ManifestError,
    UnsupportedFormatError,
    unreadable,
)
from ._layout import CONFIG_KEY, check_step, chunk_key, manifest_key
from ._manifest import ChunkRef, Manifest
from ._pool import bounded_map
from ._repository import Url, check_config, list_chunk_objects, run_names
from ._scan import (
    CONFIG,
    CORRUPT,
    MANIFEST,
    MISSING,
    NOT_FOUND,
    UNSUPPORTED,
    Problem,
    scan_manifests,
)
from .store import Store, open_store


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyReport:
    """The result of :func:`verify`. Its counts add up:
    ``chunks_checked == chunks_ok + chunks_missing + chunks_corrupt + chunks_unsupported +
    chunks_unchecked`` and ``len(problems) == manifests_damaged + manifests_unsupported +
    chunks_missing + chunks_corrupt + chunks_unsupported`` (plus one ``"not found"`` problem
    when the step, run or repository asked for does not exist, one ``"unsupported"`` problem for a
    repository whose config object is of a newer format, or one ``"config"`` problem for a
    config object that is damaged, or missing where steps exist).

    Attributes:
      problems: every problem found, one per damaged manifest or object.
      steps_checked: ``(run, step)`` pairs whose manifests were read.
      chunks_checked: distinct chunk objects (chunks, delta objects and the bases of delta
        chunks) the checked steps need.
      bytes_read: stored bytes of the chunk and delta objects read, bases of deltas included,
        each object once (0 without ``read_data``).
      seconds: wall time.
      chunks_ok: objects found intact (without ``read_data``: found at all; a base that no
        step references whole is checked through the deltas on it).
      chunks_missing: objects that do not exist.
      chunks_corrupt: objects whose bytes fail their checks (``read_data`` only).
      chunks_unsupported: objects of a newer format (an unknown chunk codec): not damage,
        upgrade casstore (``read_data`` only).
      chunks_unchecked: delta objects not read because their base is missing, or not
        rebuilt because their base is corrupt (the base is the problem).
      manifests_damaged: manifests that did not read or validate (damaged).
      manifests_unsupported: manifests of a newer format (not damage: upgrade casstore).
    """

    problems: tuple[Problem, ...]
    steps_checked: tuple[tuple[str, int], ...]
    chunks_checked: int
    bytes_read: int
    seconds: float
    chunks_ok: int = 0
    chunks_missing: int = 0
    chunks_corrupt: int = 0
    chunks_unchecked: int = 0
    manifests_damaged: int = 0
    chunks_unsupported: int = 0
    manifests_unsupported: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def unsupported(self) -> tuple[Problem, ...]:
        """The problems of kind ``"unsupported"``: a newer format, not damage."""
        return tuple(p for p in self.problems if p.kind == UNSUPPORTED)


def verify(url: Url, step: int | None = None, *, run: str | None = None, read_data: bool = True,
           max_workers: int | None = None,
           progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Checks that checkpoints are restorable, reporting every problem found.

    Lists ``chunks/`` and ``deltas/`` once; then reads each selected manifest, which must
    parse and validate (format.md §4.4); every object a step needs must exist: its chunks, and
    for a delta chunk its base (§3.5); with ``read_data`` each distinct object is read once and
    must decode to its length and chunk id (§3.2), a delta rebuilt on its base (a base shared by
    deltas read once for all of them). Nothing is written.

    Args:
      url: a path, an fsspec URL or a Store.
      step: one step to check; None checks every step.
      run: one run to check; None checks every run.
      read_data: read and decode every referenced chunk (slow: reads the data).
      max_workers: concurrent chunk reads (default the store's).
      progress: called as ``progress(bytes_done, bytes_total)`` (stored bytes) after each
        object is read, from worker threads; ``bytes_total`` is known once the manifests are.

    Returns:
      A :class:`VerifyReport` naming each damaged manifest and object, and the steps that
      need it. An object that decodes to its chunk id with the raw length of its own header,
      where a manifest gives another, is whole: the manifest is reported damaged (kind
      ``"manifest"``), as are refs of several steps that disagree on an object's length.
      A damaged config object (format.md §2.1), or a missing one where steps exist, is a
      problem of kind ``"config"`` (every reader refuses such a repository; its steps are
      checked all the same, and :func:`~casstore.repair` restores the config object from
      another copy); one of a newer format is the one problem, of kind ``"unsupported"``.

    Raises:
      StoreTimeoutError, StoreUnreachableError, AccessDeniedError: the store did not
        answer or refused (not reported as damage).
      ValueError: ``step`` is not a non-negative int (as every other function refuses it).
    """
    t0 = time.perf_counter()
    step = None if step is None else check_step(step)
    if progress is not None and not callable(progress):  # else raised after all the reading
        raise TypeError(f"progress must be callable, not {progress!r}")
    store = open_store(url)
    config = _config_problem(store, run, step)
    if config is not None and config.kind != CONFIG:  # a newer format, or no repository
        return VerifyReport((config,), (), 0, 0, time.perf_counter() - t0)
    present = {info.key for info in list_chunk_objects(store)}
    scan = scan_manifests(store, runs=None if run is None else [run], step=step,
                          max_workers=max_workers, require_config=False)
    problems = [*([config] if config else []), *scan.damaged]
    if step is not None and not scan.listed:
        problems.append(Problem(run, step, None, None, "no such step", NOT_FOUND))
    elif run is not None and not scan.listed:
        runs = ", ".join(map(repr, run_names(store))) or "none"
        problems.append(Problem(run, None, None, None, f"run has no steps (runs: {runs})",
                                NOT_FOUND))
    users = _users(scan.manifests)
    # a live repository: a step committed after the listing, or deleted (and collected)
    # after its manifest was read, is no damage: both are looked up again before reporting
    missing = sorted(k for k in users if k not in present and _still_missing(store, k, users[k]))
    problems += [_problem(k, users[k], "chunk missing", MISSING) for k in missing]
    disagree = [_problem(k, u, f"the manifests give it {len(u.lengths)} raw lengths ("
                         + "; ".join(f"{n} bytes: {', '.join(f'{r}@{s}' for r, s in sorted(at))}"
                                     for n, at in sorted(u.lengths.items()))
                         + "): a damaged manifest, whose step a restore refuses", MANIFEST)
                for k, u in users.items() if len(u.lengths) > 1]
    problems += disagree
    blocked = [k for k, u in users.items() if k in present and u.ref is not None
               and u.ref.base is not None and chunk_key(u.ref.base) not in present]
    found, bytes_read, on_bad_base = [], 0, 0
    if read_data:
        readable = [k for k in users if k in present and k not in blocked]
        bytes_read, found, on_bad_base = _read_all(store, users, readable, max_workers,
                                                   progress)
        problems += found
    n_missing = len(missing) + sum(p.kind == MISSING for p in found)  # gone since the listing
    n_wrong_length = sum(p.kind == MANIFEST for p in found)  # whole objects, manifest wrong
    n_corrupt = sum(p.kind == CORRUPT for p in found)
    n_unsupported = sum(p.kind == UNSUPPORTED for p in found)
    n_unchecked = len(blocked) + on_bad_base
    n_newer = sum(p.kind == UNSUPPORTED for p in scan.damaged)
    return VerifyReport(tuple(problems), tuple((m.run, m.step) for m in scan.manifests),
                        len(users), bytes_read, time.perf_counter() - t0,
                        chunks_ok=len(users) - n_missing - n_corrupt - n_unsupported
                        - n_unchecked, chunks_missing=n_missing, chunks_corrupt=n_corrupt,
                        chunks_unchecked=n_unchecked, chunks_unsupported=n_unsupported,
                        manifests_damaged=len(scan.damaged) - n_newer + len(disagree)
                        + n_wrong_length,
                        manifests_unsupported=n_newer)


def _config_problem(store: Store, run: str | None = None, step: int | None = None
                   ) -> Problem | None:
    """What is wrong with the repository's config object (format.md §2.1), or None if it
    validates: ``"unsupported"`` (a newer format), ``"config"`` (damaged, or missing while a
    manifest exists: every reader refuses the repository) or ``"not found"`` (missing, and
    no manifest either: no repository). ``run`` and ``step`` are what was asked for."""
    try:
        if check_config(store):
            return None
    except UnsupportedFormatError as e:  # a newer repository: upgrade, nothing is damaged
        return Problem(run, step, None, None, f"needs a newer casstore: {e}", UNSUPPORTED)
    except ManifestError as e:  # damaged, or missing while steps exist
        return Problem(None, None, None, None, f"config object: {e}", CONFIG, key=CONFIG_KEY)
    return Problem(run, step, None, None, "no casstore repository here", NOT_FOUND)


@dataclasses.dataclass(slots=True)
class _Users:
    """Who needs one object: a ref that reads it (None for a base no step references whole),
    the first key path that needs it, and every (run, step) and key path that do (the
    members of a pack chunk, format.md §3.4: each needs an --exclude of its own)."""

    ref: ChunkRef | None
    key_path: str
    steps: set[tuple[str, int]]
    chunk_id: str
    # the raw lengths the refs give, and the steps that give each
    lengths: dict[int, set[tuple[str, int]]] = dataclasses.field(default_factory=dict)
    key_paths: dict[str, None] = dataclasses.field(default_factory=dict)  # in leaf order


def _users(manifests: tuple[Manifest, ...]) -> dict[str, _Users]:
    """Object key -> its users, for every object the manifests need (bases of deltas too)."""
    users: dict[str, _Users] = {}
    for m in manifests:
        for leaf in m.leaves:
            for ref in leaf.chunks:
                keys = [(ref.key, ref, ref.id)]
                if ref.base is not None:
                    keys.append((chunk_key(ref.base), None, ref.base))
                for key, reader, cid in keys:
                    u = users.setdefault(key, _Users(reader, leaf.path, set(), cid))
                    u.ref = u.ref or reader
                    u.steps.add((m.run, m.step))
                    u.key_paths[leaf.path] = None
                    # a base has its deltas' raw length
                    u.lengths.setdefault(ref.raw_bytes, set()).add((m.run, m.step))
    return users


def _still_missing(store: Store, key: str, u: _Users) -> bool:
    """True if object ``key`` is still absent and a step that needs it is still there."""
    return not store.exists(key) and _needed(store, u)


def _needed(store: Store, u: _Users) -> bool:
    """True if a step that needs the object of ``u`` is still committed (none may be: another
    process deleted and collected them while verify ran)."""
    return any(store.exists(manifest_key(run, step)) for run, step in sorted(u.steps))


def _intact_length(store: Store, key: str, ref: ChunkRef) -> int | None:
    """The raw length in the header of object ``key`` if it is not the one ``ref`` gives and
    the object decodes to ``ref``'s id with it (the object is whole; the manifest that gave
    ``ref`` is wrong); else None."""
    try:
        length = HEADER.unpack_from(store.head(key, HEADER.size))[4]
        if length == ref.raw_bytes or length > MAX_RAW_LENGTH:
            return None
        read_again(store, key, ref.id, ref.base, length, warn=False)
    except (CasstoreError, FileNotFoundError, struct.error):
        return None
    return length


def _problem(key: str, u: _Users, message: str, kind: str) -> Problem:
    """The one problem of object ``key``; run and step are set where only one step needs it."""
    run, step = next(iter(u.steps)) if len(u.steps) == 1 else (None, None)
    return Problem(run, step, u.key_path, u.chunk_id, message, kind, tuple(sorted(u.steps)),
                   key, tuple(u.key_paths))


def _read_all(store: Store, users: dict[str, _Users], keys: list[str], max_workers: int | None,
              progress: Callable[[int, int], None] | None) -> tuple[int, list[Problem], int]:
    """Reads and decodes each object once.

    A base that no step references whole is read through the deltas on it (DeltaBases), so
    only objects with a reading ref are read here. A delta whose base is corrupt is not
    itself damaged: the base gets the one problem (with every step that needs it) and the
    delta counts as unchecked.

    Returns:
      The stored bytes read (each object once, bases too), one problem per bad object, and
      the number of deltas left unchecked.
    """
    keys = [k for k in keys if users[k].ref is not None]
    # deltas on one base side by side, so each base is held only while they are checked
    keys.sort(key=lambda k: users[k].ref.base or users[k].ref.id)
    bases = DeltaBases(store, [(users[k].ref.id, users[k].ref.base) for k in keys])
    total = sum(users[k].ref.stored_bytes for k in keys)
    done, lock = [0], threading.Lock()

    def check(key: str) -> tuple[str, Problem | None]:
        """(the key at fault, its problem or None)."""
        ref = users[key].ref
        try:
            data = bases.read(key, ref.id, ref.base, ref.raw_bytes)
            try:
                bases.decode(data, ref.id, ref.base, ref.raw_bytes)
            except CorruptChunkError:  # damaged in storage only if it fails again
                read_again(store, key, ref.id, ref.base, ref.raw_bytes)
            found = None
        except STORE_FAILURES:
            raise  # the store failed; the object may be fine
        except FileNotFoundError as e:  # deleted since the listing: damage if still needed
            found = (_problem(key, users[key], f"chunk missing: {e}", MISSING)
                     if _needed(store, users[key]) else None)
        except UnsupportedFormatError as e:  # a newer writer's codec: not damage
            if ref.base is not None and e.chunk_id == ref.base:
                key = chunk_key(ref.base)  # the base is of that format, not this delta
            found = _problem(key, users[key], f"needs a newer casstore: {e}", UNSUPPORTED)
        except CasstoreError as e:
            if ref.base is not None and f"base chunk {ref.base} is corrupt" in str(e):
                key = chunk_key(ref.base)  # the base is at fault, not this delta
            found = _problem(key, users[key], f"chunk corrupt: {e}", CORRUPT)
            if key == ref.key and (length := _intact_length(store, key, ref)) is not None:
                found = None if len(users[key].lengths) > 1 else _problem(  # (reported above)
                    key, users[key], f"the manifest gives the chunk {ref.raw_bytes} raw bytes; "
                    f"the object holds {length}, which decode to its id: a damaged manifest, "
                    "whose step a restore refuses", MANIFEST)
        except OSError as e:  # a bad block or a permission: this object, not the store
            if not unreadable(e):
                raise
            found = _problem(key, users[key], f"chunk unreadable: {type(e).__name__}: {e}",
                             CORRUPT)
        if progress is not None:
            with lock:
                done[0] += ref.stored_bytes
                progress(done[0], total)
        return key, found

    results = bounded_map(check, keys, max_workers or store.max_workers)
    problems: dict[str, Problem] = {}
    unchecked = 0
    for key, (fault, found) in zip(keys, results):
        if found is None:
            continue
        unchecked += fault != key
        if fault not in problems or fault == key:  # a base's own read names it best
            problems[fault] = found
    return bases.bytes_read, list(problems.values()), unchecked
