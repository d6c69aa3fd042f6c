"""A persist shared by the processes of a ``jax.distributed`` job (``docs/tiers.md``, Limits).

Process 0 runs the backlog of a :class:`~casstore._tiers.Persister`; for each step it persists
it starts a round (:class:`~casstore._multihost.Rounds`), sends its share of the step's missing
objects, gathers the others' posts, writes the manifest, and posts the round's outcome (the step
committed, or why not). Every other process sends its share of each round, posts what it sent,
then waits for that outcome: so its ``wait_until_persisted`` returns once process 0 has
committed the step (or failed it). Process 0 raises a failed persist (naming the process at
fault), and the save agreement fails that save on every process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable

from ._copy import CopyInfo, copy_selected
from ._errors import ManifestError, StepNotFoundError
from ._locks import Lease, save_lock
from ._multihost import Rounds
from ._repository import read_manifest
from .store import Store


def persist_shared(rounds: Rounds, local: Store, persistent: Store, run: str, step: int,
                   present: dict[str, int], known: int | None, persisted: set[int],
                   gate: Callable[[], None], lease: Lease | None = None) -> CopyInfo:
    """Process 0's part of a shared persist of ``step`` of ``run`` from ``local`` to
    ``persistent``: a round, its own share, the others' posts, then the manifest (every object
    in ``present`` by then: no transfer), then the round's outcome.

    Args:
      present: the objects known to be on the persistent tier; updated with the others'.
      known: the persisted step whose objects ``present`` holds, told to the others.
      persisted: the steps on the persistent tier as process 0 knows them, told to the others.
      gate: runs before each object's transfer (the persist yields to local saves).

    Raises:
      what failed: a process's share (CasstoreError naming it), or the manifest's write; the
        others are told, and nothing is committed.
    """
    t0 = time.perf_counter()
    rounds.start(step, known, persisted)
    try:
        try:
            own = copy_selected(local, persistent, [(run, step)], present, probe=True,
                                share=(0, rounds.count), gate=gate)
        except BaseException:
            with contextlib.suppress(Exception):  # the round ends either way: no manifest
                rounds.gather()
            raise
        theirs, chunks, nbytes = rounds.gather()  # raises if one failed: no manifest
        present.update(theirs)
        last = copy_selected(local, persistent, [(run, step)], present, probe=True,
                             lease=lease)
    except BaseException as e:
        with contextlib.suppress(Exception):
            rounds.outcome(f"{type(e).__name__}: {e}")
        raise
    rounds.outcome(None)
    chunks += own.chunks_copied + last.chunks_copied
    nbytes += own.bytes_copied + last.bytes_copied
    return dataclasses.replace(
        last, chunks_copied=chunks, bytes_copied=nbytes,
        chunks_skipped=last.chunks_skipped - chunks + last.chunks_copied,
        bytes_skipped=last.bytes_skipped - nbytes + last.bytes_copied,
        seconds=time.perf_counter() - t0)


def send_share(rounds: Rounds, local: Store, persistent: Store, run: str, step: int,
               known: int | None, gate: Callable[[], None]) -> CopyInfo:
    """A process other than 0: sends its share of the round for ``step`` and posts what it
    sent; returns its share's counts.

    Raises:
      its share's error (posted first: process 0 names it).
    """
    try:
        with save_lock(persistent):
            present = objects_of(persistent, run, known)  # what process 0 assumes there
            assumed = set(present)
            info = copy_selected(local, persistent, [(run, step)], present, probe=True,
                                 gate=gate, share=(rounds.index, rounds.count))
    except BaseException as e:
        rounds.post({}, None, f"{type(e).__name__}: {e}")
        raise
    rounds.post({k: n for k, n in present.items() if k not in assumed}, info, None)
    return info


def objects_of(persistent: Store, run: str, step: int | None) -> dict[str, int]:
    """The chunk objects of the persisted ``step`` (process 0 found its manifest there, which
    keeps GC off them), from that manifest on the persistent tier; none if it is gone or there
    is no such step."""
    if step is None:
        return {}
    try:
        manifest = read_manifest(persistent, step, run=run)
    except (StepNotFoundError, ManifestError):
        return {}
    return {r.key: r.stored_bytes for leaf in manifest.leaves for r in leaf.chunks}
