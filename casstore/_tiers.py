"""Tiered checkpoints: persisting a manager's local steps to a persistent tier in the background.

A :class:`Persister` runs one background thread that copies committed steps of one run from
the local tier (where every save goes) to the persistent tier (an object store), each through
the copy engine (``_copy.copy_selected``): only the chunk objects the persistent tier lacks are
sent, then the step's manifest is written there create-only, so a persist killed midway leaves
no partial step (format.md §7). ``docs/tiers.md`` describes the whole feature.

Backlog: at most one step is persisting and one is queued. A step submitted while another is
queued replaces it (the newest pending step wins); the replaced step stays on the local tier
only, and is listed in :attr:`Persister.dropped`. So a persistent tier slower than the save
interval costs neither memory nor local disk: local retention only keeps the two pending steps.

Priority: a persist yields to the local saves (:meth:`Persister.local_save`, from the
manager's ``save`` call to its local commit): each object transfer starts only while no local
save runs (a transfer in flight finishes), so persisting takes the time between saves rather
than CPU from them. A step's persist yields for at most ``PersistPolicy.yield_s`` seconds in
all, so saves that never pause still let it through.

Several ``jax.distributed`` processes share each persist (:class:`Rounds`, docs/tiers.md
"Limits"): each sends its share of the step's missing objects, and process 0 writes the
manifest once every process has posted without error (format.md §7). The local tier is one
that every process reads (one machine or a shared filesystem), or with
``PersistPolicy.local_per_host`` one per process, each holding that process's part of every
step: then each object is sent by one of the processes that hold it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Collection

from ._coordinator import processes, timeout_ms
from ._copy import CopyInfo, copy_selected
from ._errors import (
    PersistError,
    StepAlreadyExistsError,
    located,
)
from ._exit import finish_at_exit, forget_at_exit
from ._gc import DEFAULT_GRACE_PERIOD_S, GcInfo, RetentionGc
from ._layout import manifest_key
from ._locks import save_lock
from ._manifest import Manifest, needed_objects
from ._persist_rounds import Rounds, persist_shared, send_share
from ._policies import manifest_details
from ._preservation import PreservationPolicy
from ._repository import deleted, ensure_config, list_steps, read_manifest, still_committed
from ._retention import StepDetails, dropped
from .store import Store

log = logging.getLogger("casstore")


@dataclasses.dataclass(frozen=True, slots=True)
class PersistPolicy:
    """How a manager persists: ``interval_steps`` (a step divisible by it is persisted),
    ``preservation_policy`` (which persisted steps the persistent tier keeps: a
    ``PreservationPolicy`` as the manager's local one, e.g. ``LatestN``, ``EveryNSteps``,
    ``BestN``; None keeps all), ``gc_after_retention`` and ``grace_period_s`` (garbage
    collection of the persistent tier after its retention deleted steps), ``yield_s`` (the most
    seconds a step's persist waits, in all, for local saves to finish: module docstring),
    ``local_per_host`` (each process of a ``jax.distributed`` job has a local tier of its own:
    docs/tiers.md, "Per-host local tiers")."""

    interval_steps: int = 1
    preservation_policy: PreservationPolicy | None = None
    gc_after_retention: bool = False
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S
    yield_s: float = 60.0
    local_per_host: bool = False

    def __post_init__(self):
        if not isinstance(n := self.interval_steps, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"persist_interval_steps must be a positive int, not {n!r}")


class Persister:
    """Copies committed local steps of ``run`` to ``persistent`` on a background thread.

    Args:
      local, persistent: the two tiers' stores.
      run: the run persisted.
      policy: a :class:`PersistPolicy`.

    Attributes:
      persisted: ``{step: CopyInfo}`` of the persists this object did (``bytes_copied``: the
        stored bytes of chunk objects sent; chunks the tier had are not sent). With several
        processes, process 0's counts every process's objects, and another process's counts
        its share.
      dropped: steps replaced in the backlog by newer ones (never persisted).
      last_gc_info: the persistent tier's last :class:`GcInfo`, if GC ran.
    """

    def __init__(self, local: Store, persistent: Store, run: str, policy: PersistPolicy,
                 remote_steps: set[int] | BaseException, rounds: Rounds | None = None):
        self.local, self.persistent, self.run, self.policy = local, persistent, run, policy
        self.persisted: dict[int, CopyInfo] = {}
        self.dropped: list[int] = []
        self.last_gc_info: GcInfo | None = None
        self._error: BaseException | None = None
        self._deleted: set[int] = set()  # by delete(): their persists' errors do not count
        self._unlisted = isinstance(remote_steps, BaseException)  # listed before a persist
        if self._unlisted:  # the local tier works on; surfaces on save()
            self._error, remote_steps = remote_steps, set()
        self._remote_steps: set[int] = remote_steps
        self._collect = RetentionGc(persistent, policy.grace_period_s)  # short lock waits
        # (the last persisted step's manifest, its objects): assumed on the persistent tier
        # while that manifest is there (the copy writes the local manifest's bytes as they are)
        self._known: tuple[Manifest | None, dict[str, int]] = (None, {})
        self._doomed = False  # the last retention deleted steps: GC due
        # step -> (metrics, save time), for retention: a step's manifest there read once; one
        # damaged there, or deleted there by someone else (then forgotten), ranks as new
        self._details = StepDetails(lambda step: read_manifest(persistent, step, run=run),
                                    lambda step: self._remote_steps.discard(step))
        self._running: int | None = None
        self._queued: int | None = None
        self._local_saves = 0  # running on the local tier: persists yield to them
        # another process: the newest step it expects process 0 to persist, and the newest
        # round process 0 has ended (committed or failed)
        self._expected, self._through = None, -1.0
        self._noted: dict[int, int] = {}  # local_per_host, another process: step -> order
        self._notes = itertools.count()
        # the local steps (with local_per_host: those every process holds; start_persister)
        self.local_steps: list[int] = []
        self._closed = self._configured = False
        self._cond = threading.Condition()
        self.rounds = rounds or (Rounds(run) if processes()[0] > 1 else None)
        follower = self.rounds is not None and not self.rounds.is_leader
        self._thread = threading.Thread(target=self._follow if follower else self._loop,
                                        name="casstore-persist", daemon=True)
        self._thread.start()
        finish_at_exit(self, _drain_at_exit)  # an in-flight persist ends before the exit

    def eligible(self, step: int) -> bool:
        """Whether ``step`` is one the policy persists."""
        return step % self.policy.interval_steps == 0

    def submit(self, step: int, before: Collection[int] | None = None) -> None:
        """Queues a committed local step for persisting if the policy says so (see the module
        docstring for the backlog rule). Never waits on the persistent tier. On a process other
        than 0 (which runs the backlog), notes the step: :meth:`wait` waits until process 0 has
        ended its round or a later one; ``before``: process 0's :meth:`pending` steps when it
        committed ``step``, the only noted ones it may still persist (it dropped the others
        from its backlog), so this process's retention keeps no more than process 0's."""
        follower = self.rounds is not None and not self.rounds.is_leader
        if follower and before is not None:
            with self._cond:
                self._noted = {s: n for s, n in self._noted.items() if s in before}
        if not self.eligible(step) or step in self._remote_steps:
            return
        if follower:
            with self._cond:
                self._expected = max(step, self._expected or step)
                if self.policy.local_per_host:
                    self._noted[step] = next(self._notes)
                self._cond.notify_all()
            return
        with self._cond:
            if self._queued is not None and self._queued != step:
                self.dropped.append(self._queued)
                log.warning("casstore: persisting to %s fell behind; step %d will not be "
                            "persisted (step %d replaces it)", self.persistent.url,
                            self._queued, step)
            self._queued = step
            self._cond.notify_all()

    def local_save(self, step: int) -> Callable[[cf.Future | None], None]:
        """Counts a local save of ``step`` as running (persists yield to it: module docstring);
        returns ``done(future)``: finished when ``future`` (its write) is, or now if None.

        Raises:
          StepAlreadyExistsError: ``step`` is on the persistent tier (a second save of it
            would leave the tiers with two different steps of one number).
        """
        if step in self._remote_steps:
            raise StepAlreadyExistsError("step already exists on the persistent tier",
                                         url=self.persistent.url, run=self.run, step=step)
        with self._cond:
            self._local_saves += 1
            self._deleted.discard(step)  # a save of that number again: its persist counts
        return lambda future: self._local_done() if future is None else (
            future.add_done_callback(self._local_done))

    def _local_done(self, _: object = None) -> None:
        with self._cond:
            self._local_saves -= 1
            self._cond.notify_all()

    def _yielder(self) -> Callable[[], None]:
        """One step's gate: waits while a local save runs, until ``yield_s`` from now."""
        deadline = time.monotonic() + self.policy.yield_s

        def gate() -> None:
            with self._cond:
                self._cond.wait_for(lambda: not self._local_saves, deadline - time.monotonic())

        return gate

    def resume(self, local_steps: list[int]) -> None:
        """Submits the eligible local steps newer than the newest persisted one (what a killed
        manager left), oldest first, so the backlog rule keeps the newest."""
        newest = max(self._remote_steps, default=-1)
        for step in sorted(local_steps):
            if step > newest:
                self.submit(step)

    def reload(self) -> None:
        """Re-lists the persistent tier's steps, whose metrics are then read again (another
        process may have changed them)."""
        self._remote_steps = set(list_steps(self.persistent, run=self.run))
        self._details.clear()

    def pending(self) -> set[int]:
        """The steps persisting or queued: local retention must keep them (with
        ``local_per_host``, on a process other than 0: the steps it noted that process 0 may
        still persist, see :meth:`submit` and :meth:`_passed`)."""
        with self._cond:
            return {*self._noted, *(s for s in (self._running, self._queued) if s is not None)}

    def delete(self, step: int) -> bool:
        """For the manager's ``delete``: drops ``step`` from the backlog, waits for its persist,
        deletes it there (process 0), then forgets it; returns whether it was there. A
        persist of it that fails meanwhile (with several processes, another one may have
        deleted its part first) does not fail the next save."""
        with self._cond:
            self._deleted.add(step)
            if step in (self._queued, self._expected):  # _expected: process 0 drops it too
                self._queued = None if self._queued == step else self._queued
                self._expected = None if self._expected == step else self._expected
                self._cond.notify_all()
            self._cond.wait_for(lambda: self._running != step)
        try:  # first: if it raises (the tier unreachable), the step stays known to be there
            found = processes()[1] == 0 and deleted(self.persistent, step, self.run)
        except Exception as e:
            e.add_note(f"casstore: step {step} stays on the persistent tier {self.persistent.url}")
            raise
        with self._cond:
            self._remote_steps.discard(step)
            self._details.pop(step, None)
        return found

    def steps(self) -> set[int]:
        """The steps known to be on the persistent tier."""
        return set(self._remote_steps)

    def raise_error(self) -> None:
        """Raises the last persist's error, once, without waiting (a :class:`PersistError` or a
        :class:`~casstore.StoreTimeoutError`, naming step and URL)."""
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def wait(self, timeout_s: float | None = None) -> bool:
        """Waits until nothing is persisting or queued (on a process other than 0: until
        process 0 has ended the round of the newest step :meth:`submit` noted, or a later one,
        or the rounds); False if ``timeout_s`` passed first."""
        def idle() -> bool:
            return (self._running is None and self._queued is None
                    and (self._expected is None or self._through >= self._expected))

        with self._cond:
            return self._cond.wait_for(idle, timeout_s)

    def close(self) -> None:
        """Waits for the backlog, then stops the thread, idempotent (with several processes:
        process 0 ends the rounds, and the others wait for that, at most the timeout)."""
        self.wait(self._bound())
        with self._cond:
            closing, self._closed = not self._closed, True
            self._cond.notify_all()
        if closing and self.rounds is not None and self.rounds.is_leader:
            self.rounds.stop(self.steps())
        self._thread.join(None if self.rounds is None else timeout_ms() / 1000)
        forget_at_exit(self, _drain_at_exit)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued is not None or self._closed)
                if self._queued is None:
                    return
                self._running, self._queued = self._queued, None
            step, k = self._running, self.rounds and self.rounds.k
            try:
                self._persist(step)
            except BaseException as e:  # surfaces on the next save()
                if self.rounds is not None and self.rounds.k == k:  # failed before its round
                    with contextlib.suppress(Exception):
                        self.rounds.abort(step, self.steps())
                self._fail(e, step)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _bound(self) -> float | None:
        """How long closing waits for the backlog: for ever on process 0, the multi-process
        timeout on the others (process 0 may be gone)."""
        follower = self.rounds is not None and not self.rounds.is_leader
        return timeout_ms() / 1000 if follower else None

    def _fail(self, e: BaseException, step: int) -> None:
        """Records a failed persist of ``step``: it surfaces on the next save()."""
        error = located(e, step, self.persistent.url, self.run)
        with self._cond:
            if step in self._deleted:
                log.info("casstore: step %s was deleted while it persisted: %s", step, error)
                return
            log.warning("casstore: %s", error)
            self._error = error

    def _persist(self, step: int) -> None:
        if self._unlisted:  # unreachable when the manager was made: its steps first
            self.reload()
            self._unlisted = False
        if not self.local.exists(manifest_key(self.run, step)):
            return  # deleted locally before its turn (not by retention, which waits for it)
        if not self._configured:
            ensure_config(self.persistent)
            self._configured = True
        with save_lock(self.persistent) as lease:
            present = self._still_there()
            if self.rounds is None:
                info = copy_selected(self.local, self.persistent, [(self.run, step)], present,
                                     probe=True, gate=self._yielder(), lease=lease)
                self._committed(step, present)
            else:  # the others learn the steps there after retention (its round's outcome)
                info = persist_shared(self.rounds, self.local, self.persistent, self.run,
                                      step, present, self._known[0].step if present else None,
                                      self.steps(), self._yielder(), lease,
                                      self.policy.local_per_host,
                                      functools.partial(self._committed, step, present))
        self.persisted[step] = info
        if self.policy.gc_after_retention:  # outside the save lock, which GC waits for
            try:
                self.last_gc_info = self._collect(self._doomed) or self.last_gc_info
            except Exception as e:
                raise PersistError(f"step {step} is persisted; GC there then failed: {e!r}",
                                   step=step, url=self.persistent.url, run=self.run) from e

    def _committed(self, step: int, present: dict[str, int]) -> set[int]:
        """After ``step``'s manifest is written: notes it, runs retention on the persistent
        tier (which may delete this very step; GC follows in :meth:`_persist`); returns the
        steps there.

        Raises:
          PersistError: retention failed (the step is persisted).
        """
        self._remote_steps.add(step)
        manifest = read_manifest(self.local, step, run=self.run)
        self._details[step] = manifest_details(manifest)
        known = {k: present[k] for k in needed_objects(manifest) if k in present}
        try:
            self._doomed = self._retain()
        except Exception as e:
            raise PersistError(f"step {step} is persisted; retention there then failed: "
                               f"{e!r}", step=step, url=self.persistent.url, run=self.run) from e
        self._known = (manifest, known) if step in self._remote_steps else (None, {})
        return self.steps()

    def _still_there(self) -> dict[str, int]:
        """The objects of the last step persisted, if its manifest is still the one on the
        persistent tier: a step there keeps GC off its objects (another process may have
        deleted it, or deleted it and saved another step under its number)."""
        manifest, objects = self._known
        if manifest is None or not still_committed(self.persistent, manifest):
            return {}
        return dict(objects)

    def _retain(self) -> bool:
        """Deletes the persisted steps the persistent policy drops; returns whether any."""
        if (policy := self.policy.preservation_policy) is None:
            return False
        self._remote_steps &= set(list_steps(self.persistent, run=self.run))  # others deleted
        doomed = dropped(policy, sorted(self._remote_steps), self._details)
        for step in doomed:
            deleted(self.persistent, step, self.run)  # already gone: the same outcome
            self._remote_steps.discard(step)
            self._details.pop(step, None)
        return bool(doomed)

    def _passed(self, step: int) -> None:
        """Another process, under the lock: process 0 ended the round of ``step``, so it no
        longer persists that step, nor any noted before it (dropped from its backlog)."""
        if (n := self._noted.pop(step, None)) is not None:
            self._noted = {s: m for s, m in self._noted.items() if m > n}

    def _follow(self) -> None:
        """A process other than 0: sends its share of each step process 0 starts a round for
        (:func:`send_share`) and waits for process 0's outcome, until process 0 ends the rounds
        (or, after the manager closed, stops answering); takes process 0's persisted steps as
        its own at each round and at the end. Process 0 raises a failed persist (the save
        agreement fails that save everywhere); this process raises its own share's error, or
        the lack of an outcome. With ``local_per_host`` it waits for its own copy of the step
        (:meth:`submit` after its save: it writes the manifest once process 0 committed, when
        process 0 may have started the round already), at most the multi-process timeout."""
        while (got := self.rounds.next_step(lambda: self._closed)) is not None:
            step, known, persisted, aborted = got
            self._remote_steps = persisted - self._deleted  # (its own delete() may be newer)
            if step is None:
                break
            if aborted:  # process 0's persist failed before the round: it raises that
                with self._cond:
                    self._through = step
                    self._passed(step)
                    self._cond.notify_all()
                continue
            with self._cond:
                self._running = step
                if self.policy.local_per_host:  # its copy of the manifest first (its save's)
                    self._cond.wait_for(lambda s=step: s in self._noted, timeout_ms() / 1000)
            try:
                self.persisted[step] = send_share(self.rounds, self.local, self.persistent,
                                                  self.run, step, known, self._yielder(),
                                                  self.policy.local_per_host)
                error, persisted = self.rounds.wait_outcome()
                if error is None:  # else process 0 raises it
                    self._remote_steps = (self._remote_steps | {step} if persisted is None
                                          else persisted) - self._deleted  # after retention
            except BaseException as e:  # it also surfaces here on save()
                self._fail(e, step)
            finally:
                with self._cond:
                    self._running, self._through = None, step
                    self._passed(step)
                    self._cond.notify_all()
        with self._cond:
            self._through = math.inf  # no round left to wait for
            self._cond.notify_all()


def _drain_at_exit(p: Persister) -> None:
    """At exit: waits for local saves in flight (they queue persists), then the backlog."""
    if not p._closed:
        with p._cond:
            p._cond.wait_for(lambda: not p._local_saves, p._bound())
        p.wait(p._bound())
