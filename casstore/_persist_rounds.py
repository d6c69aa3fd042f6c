"""A persist shared by the processes of a ``jax.distributed`` job (``docs/tiers.md``, Limits).

Process 0 runs the backlog of a :class:`~casstore._tiers.Persister`; for each step it persists
it starts a round (:class:`Rounds`), sends its share of the step's missing
objects, gathers the others' posts, writes the manifest, and posts the round's outcome (the step
committed, or why not). Every other process sends its share of each round, posts what it sent,
then waits for that outcome: so its ``wait_until_persisted`` returns once process 0 has
committed the step (or failed it). Process 0 raises a failed persist (naming the process at
fault), and the save agreement fails that save on every process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable

import msgpack

from ._coordinator import get_large, kv_client, processes, set_large, timeout_ms
from ._copy import CopyInfo, copy_selected
from ._copy_engine import share_of
from ._errors import CasstoreError, ManifestError, StepNotFoundError
from ._locks import Lease, save_lock
from ._manifest import needed_objects
from ._repository import read_manifest
from .store import Store

_managers = itertools.count()  # SPMD: managers are opened in the same order everywhere

class Rounds:
    """The exchange of a shared persist between the processes of a ``jax.distributed`` job, on
    the coordinator's key-value store (as :class:`SaveAgreement`'s).

    Round ``k`` of a manager: process 0 sets ``round/k`` to the step (or None: stop) and the
    steps it knows on the persistent tier, which the others take as theirs; every other
    process sends its share and sets ``done/k/<process>`` to the objects it sent or found there
    and its counts, or its error; process 0 waits for them all (at most the multi-process
    timeout, ``CASSTORE_MULTIHOST_TIMEOUT_S``), writes the manifest or not, and sets
    ``outcome/k`` to None or its error, which the others wait for. Managers are opened in the
    same order on every process (SPMD), so their counter names the same rounds everywhere.
    """

    def __init__(self, run: str):
        self.count, self.index = processes()
        self.is_leader = self.index == 0
        self.tag = f"casstore/persist/{next(_managers)}/{run}"
        self.k = 0

    def start(self, step: int, known: int | None, persisted: set[int]) -> None:
        """Process 0: starts the next round, for ``step``; ``known``: the persisted step whose
        objects it takes to be there (the others need not look them up), or None;
        ``persisted``: the steps on the persistent tier as it knows them (the others take
        them as theirs)."""
        self._announce(step, known, persisted)

    def stop(self, persisted: set[int]) -> None:
        """Process 0: ends the rounds (the others' persist threads end), telling the others
        the persisted steps as :meth:`start` does."""
        self._announce(None, None, persisted)

    def abort(self, step: int, persisted: set[int]) -> None:
        """Process 0: its persist of ``step`` failed before the round began (the persistent
        tier's config object or lock): the others pass that round without sending (process 0
        raises the error), so their ``wait_until_persisted`` returns."""
        self._announce(step, None, persisted, aborted=True)
        self.k += 1

    def _announce(self, step: int | None, known: int | None, persisted: set[int],
                  aborted: bool = False) -> None:
        kv_client().key_value_set_bytes(f"{self.tag}/round/{self.k}", msgpack.packb(
            {"step": step, "known": known, "persisted": sorted(persisted),
             "aborted": aborted}))

    def gather(self) -> tuple[dict[str, int], int, int]:
        """Process 0: the other processes' posts of this round: ``(objects there, chunks
        copied, bytes copied)``.

        Raises:
          CasstoreError: a process failed or did not post within the timeout, naming it (the
            persist loop raises it as a :class:`PersistError` naming step and URL).
        """
        client, k = kv_client(), self.k
        self.k += 1
        forget = [f"{self.tag}/{part}/{k - 1}"
                  for part in ("round", "done", "outcome", "held")]
        present, chunks, nbytes, failed = {}, 0, 0, []
        for p in range(1, self.count):
            try:
                post = msgpack.unpackb(client.blocking_key_value_get_bytes(
                    f"{self.tag}/done/{k}/{p}", timeout_ms()))
            except Exception as e:  # jax's runtime error for a timeout or a dead peer
                failed.append(f"process {p}: no answer within {timeout_ms() / 1000:g} s ({e})")
                continue
            if post["error"]:
                failed.append(f"process {p}: {post['error']}")
                continue
            present.update(post["present"])
            chunks, nbytes = chunks + post["chunks"], nbytes + post["bytes"]
        if failed:
            raise CasstoreError("other processes did not send their share; no manifest "
                                "written: " + "; ".join(failed))
        for key in forget if k else ():  # each process finished round k - 1 before it posted
            client.key_value_delete(key)
        return present, chunks, nbytes

    def next_step(self, closed) -> tuple[int | None, int | None, set[int], bool] | None:
        """Another process: ``(step, known, persisted, aborted)`` of the next round
        (:meth:`start`; :meth:`abort`: aborted, then passed here), waiting for it; ``step`` is
        None once process 0 ends the rounds (:meth:`stop`). None if the timeout after
        ``closed()`` turned true passed first."""
        client, gave_up = kv_client(), None
        while True:
            try:
                value = client.blocking_key_value_get_bytes(f"{self.tag}/round/{self.k}", 1000)
            except Exception:  # no round yet (or the coordinator is gone)
                if closed():
                    gave_up = gave_up or time.monotonic() + timeout_ms() / 1000
                    if time.monotonic() > gave_up:
                        return None
                time.sleep(0.05)
                continue
            got = msgpack.unpackb(value)  # as start() or stop() announced it
            self.k += got["aborted"]  # a round without posts
            return got["step"], got["known"], set(got["persisted"]), got["aborted"]

    def outcome(self, error: str | None, persisted: set[int] | None = None) -> None:
        """Process 0, after :meth:`gather`: the round's outcome, its manifest written (None) or
        why not, and the steps on the persistent tier after its retention there (None: not
        known, the others add the step to theirs)."""
        kv_client().key_value_set_bytes(f"{self.tag}/outcome/{self.k - 1}", msgpack.packb(
            {"error": error, "persisted": None if persisted is None else sorted(persisted)}))

    def wait_outcome(self) -> tuple[str | None, set[int] | None]:
        """Another process, after :meth:`post`: process 0's outcome of that round, ``(error,
        persisted)`` (:meth:`outcome`'s; error None: the step is committed), waiting at most
        the multi-process timeout.

        Raises:
          CasstoreError: process 0 posted none within the timeout.
        """
        try:
            value = kv_client().blocking_key_value_get_bytes(f"{self.tag}/outcome/{self.k - 1}",
                                                             timeout_ms())
        except Exception as e:  # jax's runtime error for a timeout or a dead coordinator
            raise CasstoreError(f"process 0 posted no outcome of the persist within "
                                f"{timeout_ms() / 1000:g} s ({e})") from e
        got = msgpack.unpackb(value)
        return got["error"], None if got["persisted"] is None else set(got["persisted"])

    def post(self, present: dict[str, int], info: CopyInfo | None, error: str | None) -> None:
        """Another process: what it sent or found for this round, or its error."""
        kv_client().key_value_set_bytes(f"{self.tag}/done/{self.k}/{self.index}", msgpack.packb(
            {"error": error, "present": present, "chunks": info.chunks_copied if info else 0,
             "bytes": info.bytes_copied if info else 0}))
        self.k += 1

    def agree(self, value: object) -> list:
        """Every process's ``value`` (msgpack), in process order: posts this process's and
        waits for the others' (at most the multi-process timeout). A manager's exchange at
        open, once (``local_per_host``: the local steps each process holds).

        Raises:
          CasstoreError: a process did not post within the timeout, naming it.
        """
        client = kv_client()
        client.key_value_set_bytes(f"{self.tag}/open/{self.index}", msgpack.packb(value))
        values = []
        for p in range(self.count):
            try:
                values.append(msgpack.unpackb(client.blocking_key_value_get_bytes(
                    f"{self.tag}/open/{p}", timeout_ms())))
            except Exception as e:  # jax's runtime error for a timeout or a dead peer
                raise CasstoreError(f"process {p} did not say which steps its local tier "
                                    f"holds within {timeout_ms() / 1000:g} s ({e})") from e
        return values

    def holders(self, held: list[str] | None, error: str | None) -> dict[str, int] | None:
        """``local_per_host``: posts which of this round's objects this process's local tier
        holds (``held``), or its error, and gathers every process's post; returns which
        process sends each object held somewhere (of its holders, the one a CRC32 of the key
        picks: :func:`share_of`), so each is sent once. None where another process failed,
        on a process other than 0 (process 0 raises it).

        Raises:
          CasstoreError: on process 0, a process failed or did not post within the timeout.
        """
        client, key = kv_client(), f"{self.tag}/held/{self.k}"
        set_large(client, f"{key}/{self.index}", msgpack.packb({"held": held, "error": error}))
        posts, failed = [], []
        for p in range(self.count):
            try:
                posts.append(msgpack.unpackb(get_large(client, f"{key}/{p}")))
            except CasstoreError as e:
                posts.append({"held": [], "error": f"no answer ({e})"})
            if posts[-1]["error"]:
                failed.append(f"process {p}: {posts[-1]['error']}")
        if failed:
            if not self.is_leader:
                return None
            raise CasstoreError("processes could not say which objects their local tiers "
                                "hold; no manifest written: " + "; ".join(failed))
        by: dict[str, list[int]] = {}
        for p, post in enumerate(posts):
            for k in post["held"]:
                by.setdefault(k, []).append(p)
        return {k: ps[share_of(k, len(ps))] for k, ps in by.items()}


def _send_held(rounds: Rounds, local: Store, persistent: Store, run: str, step: int,
               present: dict[str, int], gate: Callable[[], None]
               ) -> tuple[CopyInfo | None, dict[str, int], set[str]]:
    """``local_per_host``: finds which of ``step``'s objects not in ``present`` (known on the
    persistent tier) this process's own local tier holds, agrees with the others who sends
    each (:meth:`Rounds.holders`) and sends its own; returns ``(its counts, the objects it
    sent or found there, the step's objects held by no process)``. ``(None, {}, set())``
    where another process failed (on a process other than 0).

    Raises:
      what failed here (posted first), or (process 0) another process's failure.
    """
    try:
        needed = needed_objects(read_manifest(local, step, run=run))
        held = sorted(k for k in needed if k not in present and local.exists(k))
    except BaseException as e:
        rounds.holders(None, f"{type(e).__name__}: {e}")
        raise
    owner = rounds.holders(held, None)
    if owner is None:
        return None, {}, set()
    mine = {k for k, p in owner.items() if p == rounds.index}
    # the engine sends what is not in `present`: every object but this process's is put there
    others = dict(present) | {k: 0 for k in needed if k not in mine and k not in present}
    info = copy_selected(local, persistent, [(run, step)], others, probe=True, share=(0, 1),
                         gate=gate)
    return info, {k: others[k] for k in mine if k in others}, {
        k for k in needed if k not in owner and k not in present}


def persist_shared(rounds: Rounds, local: Store, persistent: Store, run: str, step: int,
                   present: dict[str, int], known: int | None, persisted: set[int],
                   gate: Callable[[], None], lease: Lease | None = None,
                   per_host: bool = False, committed: Callable[[], set[int]] | None = None
                   ) -> CopyInfo:
    """Process 0's part of a shared persist of ``step`` of ``run`` from ``local`` to
    ``persistent``: a round, its own share, the others' posts, then the manifest (every object
    in ``present`` by then: no transfer), ``committed()``, then the round's outcome.

    Args:
      present: the objects known to be on the persistent tier; updated with the others'.
      known: the persisted step whose objects ``present`` holds, told to the others.
      persisted: the steps on the persistent tier as process 0 knows them, told to the others.
      gate: runs before each object's transfer (the persist yields to local saves).
      per_host: each process reads its own local tier (``local_per_host``): each object is
        sent by one of the processes that hold it (:func:`_send_held`), and an object held
        by none must be on the persistent tier already.
      committed: runs once the manifest is written (retention there); returns the steps on
        the persistent tier then, which the outcome tells the others (so their lists drop
        what retention deleted). If it raises, the outcome still says committed.

    Raises:
      what failed: a process's share (CasstoreError naming it), or the manifest's write; the
        others are told, and nothing is committed. What ``committed`` raised, after the
        outcome.
    """
    t0 = time.perf_counter()
    rounds.start(step, known, persisted)
    try:
        unheld: set[str] = set()
        try:
            if per_host:
                own, sent, unheld = _send_held(rounds, local, persistent, run, step,
                                               dict(present), gate)
                present.update(sent)
            else:
                own = copy_selected(local, persistent, [(run, step)], present, probe=True,
                                    share=(0, rounds.count), gate=gate)
        except BaseException:
            with contextlib.suppress(Exception):  # the round ends either way: no manifest
                rounds.gather()
            raise
        theirs, chunks, nbytes = rounds.gather()  # raises if one failed: no manifest
        present.update(theirs)
        for k in sorted(unheld):  # on no process's local tier: the persistent tier has it?
            if not persistent.exists(k):
                raise CasstoreError(f"object {k!r} of step {step} is on no process's local "
                                    f"tier and not on the persistent tier {persistent.url!r}"
                                    "; no manifest written")
            present[k] = 0
        last = copy_selected(local, persistent, [(run, step)], present, probe=True,
                             lease=lease)
    except BaseException as e:
        with contextlib.suppress(Exception):
            rounds.outcome(f"{type(e).__name__}: {e}")
        raise
    persisted_now = None
    try:
        persisted_now = committed() if committed else None
    finally:
        rounds.outcome(None, persisted_now)
    chunks += own.chunks_copied + last.chunks_copied
    nbytes += own.bytes_copied + last.bytes_copied
    return dataclasses.replace(
        last, chunks_copied=chunks, bytes_copied=nbytes,
        chunks_skipped=last.chunks_skipped - chunks + last.chunks_copied,
        bytes_skipped=last.bytes_skipped - nbytes + last.bytes_copied,
        seconds=time.perf_counter() - t0)


def send_share(rounds: Rounds, local: Store, persistent: Store, run: str, step: int,
               known: int | None, gate: Callable[[], None], per_host: bool = False
               ) -> CopyInfo:
    """A process other than 0: sends its share of the round for ``step`` and posts what it
    sent; returns its share's counts. ``per_host``: as :func:`persist_shared`'s.

    Raises:
      its share's error (posted first: process 0 names it).
    """
    try:
        with save_lock(persistent):
            present = objects_of(persistent, run, known)  # what process 0 assumes there
            assumed = set(present)
            if per_host:
                info, sent, _ = _send_held(rounds, local, persistent, run, step, present, gate)
                info = info or CopyInfo((), (), 0, 0, 0, 0, 0.0)
            else:
                info = copy_selected(local, persistent, [(run, step)], present, probe=True,
                                     gate=gate, share=(rounds.index, rounds.count))
                sent = {k: n for k, n in present.items() if k not in assumed}
    except BaseException as e:
        rounds.post({}, None, f"{type(e).__name__}: {e}")
        raise
    rounds.post(sent, info, None)
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
