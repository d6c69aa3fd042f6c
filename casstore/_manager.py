"""CheckpointManager: periodic, asynchronous saves with retention (orbax's names and semantics).

Save decisions and retention are policies (``_policies``, ``_preservation``: orbax's
``save_decision_policy`` / ``preservation_policy``), preemption notices come from
``_preemption``, each save is written in the background by an ``AsyncCheckpointer``. The run's
steps are listed when the manager is made and by ``reload``, not on every call.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

from ._async_save import AsyncCheckpointer
from ._chunking import DEFAULT_CHUNK_SIZE_BYTES
from ._codec import DEFAULT_ZSTD_LEVEL
from ._coordinator import agreed_latest, processes
from ._errors import StepAlreadyExistsError, StepNotFoundError, close_quietly
from ._fallback import FallbackStore
from ._gc import DEFAULT_GRACE_PERIOD_S, RetentionGc
from ._layout import check_step
from ._multihost import SaveAgreement
from ._policies import (
    DecisionContext,
    PolicyCheckpointInfo,
    PreemptionCheckpointingPolicy,
    SaveDecisionPolicy,
    split_metadata,
    utc_now,
)
from ._preemption import PreemptionNotice
from ._preservation import (
    PreservationPolicy,
    best_of,
    find,
    manager_policies,
    persistent_preservation,
)
from ._repository import Url, deleted, list_steps, read_manifest
from ._restore import restore
from ._retention import StepDetails, retain
from ._save import SaveInfo
from ._save_leaves import snapshot
from ._tiers import PersistPolicy
from ._tiers_open import start_persister
from .store import Store, check_misspelt, open_store, split_options


class CheckpointManager:
    """Saves a run's steps when a policy says so and keeps the steps a policy keeps.

    Save decisions (:meth:`should_save`, and :meth:`save` without ``force``): a step newer than the
    latest (committed or in flight) is saved when ``save_decision_policy`` says so; by default
    every ``save_interval_steps`` steps, a run's first step and at jax's preemption sync point
    (orbax's defaults). Retention, after each successful save: the steps ``preservation_policy``
    does not keep are deleted (their manifests; with ``gc_after_retention`` garbage collection then
    frees the chunks no step references). The default policy follows orbax's keyword arguments:
    with ``best_fn``, the ``max_to_keep`` steps whose metrics score best (``best_mode`` ``"max"``
    or ``"min"``), plus the steps without metrics if ``keep_checkpoints_without_metrics``; without
    it the ``max_to_keep`` latest; steps divisible by ``keep_period`` always. Policies are
    casstore's classes with orbax's names (``LatestN``, ``BestN``, ``EveryNSteps``, ...),
    composable with ``|``.

    Preemption: :meth:`reached_preemption` tells the loop the job will be stopped (jax's sync
    point; in one process, SIGTERM, with ``PreemptionCheckpointingPolicy()`` in the save
    policy); the first step after it the loop had not asked about yet is saved.

    Saving: ``save`` stages the arrays and returns (see :class:`casstore.AsyncCheckpointer` for
    what is copied and what it costs in host memory, and ``max_staging_bytes``); the commit,
    retention and GC run on one background thread. Saves never overlap. The run's steps are
    listed on construction and :meth:`reload` only, and kept current by this manager's saves and
    deletes, so :meth:`should_save` and :meth:`latest_step` make no request; call :meth:`reload`
    when another process may have written or deleted steps of this run.

    Thread-safety: NOT thread-safe (one training loop). An in-flight save is finished at exit,
    where its error is only logged (end a job with :meth:`close`); a killed one leaves no
    partial step. Multi-process: every process calls ``save`` with the same steps in order, on
    one repository (process 0 commits), or with ``local_per_host`` on a local tier each.

    Args:
      url: a path, an fsspec URL or a Store.
      run: the run this manager saves and restores.
      save_decision_policy: when to save (a ``SaveDecisionPolicy``); not with
        ``save_interval_steps``.
      preservation_policy: which steps to keep (a ``PreservationPolicy``); not with
        ``max_to_keep``, ``keep_period`` or ``best_fn``.
      max_to_keep: steps to keep (None keeps all): ``LatestN`` / ``BestN``'s ``n``.
      keep_period: keep every step divisible by this: ``EveryNSteps(keep_period)``.
      best_fn: ``metrics -> float`` ranking steps: ``BestN(get_metric_fn=best_fn)``.
      best_mode: ``"max"`` (higher is better) or ``"min"``.
      keep_checkpoints_without_metrics: with ``best_fn``, keep steps saved without metrics.
      save_interval_steps: save every this many steps: ``FixedIntervalPolicy`` (default 1).
      enable_async_checkpointing: return from ``save`` once arrays are on the host; False
        makes ``save`` return once the step is committed.
      gc_after_retention: run garbage collection after retention deleted steps (postponed to
        the next retention when other saves still hold locks after 2 s).
      grace_period_s: the GC grace period, seconds.
      max_staging_bytes, chunk_size_bytes, zstd_level, delta: as for
        :class:`casstore.AsyncCheckpointer`; deltas are taken against the latest step.
      persistent: None, or a URL or Store: the persistent tier (``docs/tiers.md``). Every
        eligible step is copied there in the background after its local commit, moving only
        the chunks it lacks; ``save`` never waits for it. :meth:`latest_step` and
        :meth:`all_steps` cover both tiers; :meth:`restore` reads each chunk from ``url`` and
        one missing or damaged there from the persistent tier. With several ``jax.distributed``
        processes each sends a share of every persisted step and process 0 commits it.
      persist_interval_steps: a step divisible by this is persisted.
      persistent_max_to_keep: persisted steps kept on the persistent tier (``LatestN``; None
        keeps all); ``gc_after_retention`` and ``grace_period_s`` apply to it too.
      persistent_keep_period: also keep persisted steps divisible by this (``EveryNSteps``).
      persistent_preservation_policy: which persisted steps the persistent tier keeps, as
        ``preservation_policy`` (e.g. ``BestN`` on the metrics saved with each step); not with
        the two arguments above.
      local_per_host: with several ``jax.distributed`` processes, ``url`` is each process's own
        local tier (docs/tiers.md, "Per-host local tiers"), holding the manifest and what the
        process needs to restore its part (its shards, replicas too, and numpy leaves); at
        construction each deletes its local steps not on every process. Needs ``persistent``;
        no deltas. False: one local tier all processes read (disks of their own fail a save).
      **storage_options: passed to fsspec for ``url`` and ``persistent``, each where it is an
        fsspec URL (e.g. a local path and ``s3://...``: to the persistent tier only).

    Raises:
      ValueError: a retention or staging argument is out of range, a policy is given
        together with the keyword arguments it replaces, the two tiers overlap, or
        ``local_per_host`` comes without ``persistent`` or a local filesystem as ``url``.
      CasstoreError: (``local_per_host``) a process did not post its local steps in time.

    Example:
      >>> import numpy as np, casstore
      >>> with casstore.CheckpointManager(casstore.MemoryStore(), max_to_keep=2) as mngr:
      ...     for step in range(4):
      ...         _ = mngr.save(step, {"w": np.full(3, step)})
      ...     mngr.wait_until_finished()
      ...     mngr.all_steps()
      [2, 3]
    """

    def __init__(self, url: Url, *, run: str = "default",
                 save_decision_policy: SaveDecisionPolicy | None = None,
                 preservation_policy: PreservationPolicy | None = None,
                 max_to_keep: int | None = None, keep_period: int | None = None,
                 best_fn: Callable[[Any], float] | None = None, best_mode: str = "max",
                 keep_checkpoints_without_metrics: bool = True,
                 save_interval_steps: int | None = None,
                 enable_async_checkpointing: bool = True, gc_after_retention: bool = False,
                 grace_period_s: float = DEFAULT_GRACE_PERIOD_S,
                 max_staging_bytes: int | None = None,
                 chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES,
                 zstd_level: int = DEFAULT_ZSTD_LEVEL, delta: bool = True,
                 persistent: Url | None = None, persist_interval_steps: int = 1,
                 persistent_max_to_keep: int | None = None,
                 persistent_keep_period: int | None = None,
                 persistent_preservation_policy: PreservationPolicy | None = None,
                 local_per_host: bool = False, **storage_options):
        if local_per_host and persistent is None:
            raise ValueError("local_per_host=True needs a persistent tier (persistent=...)")
        self.save_decision_policy, self.preservation_policy = manager_policies(
            save_decision_policy, preservation_policy, save_interval_steps=save_interval_steps,
            max_to_keep=max_to_keep, keep_period=keep_period, best_fn=best_fn,
            best_mode=best_mode, keep_checkpoints_without_metrics=keep_checkpoints_without_metrics)
        check_misspelt(storage_options, CheckpointManager.__init__)
        local_options, remote_options = split_options(storage_options, url, persistent)
        self._saver = AsyncCheckpointer(url, run=run, max_staging_bytes=max_staging_bytes,
                                        chunk_size_bytes=chunk_size_bytes, zstd_level=zstd_level,
                                        delta=delta and not local_per_host, **local_options)
        self.store, self.run = self._saver.store, run  # the Store of ``url``
        self.enable_async_checkpointing = enable_async_checkpointing
        self.gc_after_retention, self.grace_period_s = gc_after_retention, grace_period_s
        self.local_per_host = local_per_host  # each process deletes on its own local tier
        self._collect = RetentionGc(self.store, grace_period_s)  # short waits on save locks
        self._preemption_saved = False
        self._details = StepDetails(  # {step: (metrics, saved at)}
            lambda step: read_manifest(self._reader(), step, run=self.run), self._forget)
        self._saving: int | None = None  # the step of the save in flight
        self.last_save_blocking_s = self.last_gc_info = self.last_restore_bytes = None
        self._steps: list[int] = list_steps(self.store, run=self.run)
        self.persister = None if persistent is None else start_persister(  # tiers, _tiers.py
            self.store, open_store(persistent, **remote_options), run, self._steps, PersistPolicy(
                persist_interval_steps, persistent_preservation(
                    persistent_preservation_policy, persistent_max_to_keep,
                    persistent_keep_period), gc_after_retention, grace_period_s,
                local_per_host=local_per_host))
        self._steps = self.persister.local_steps if self.persister else self._steps  # agreed
        # last: a signal handler is installed only once nothing else can fail
        preemption = find(self.save_decision_policy, PreemptionCheckpointingPolicy)
        self._notice = PreemptionNotice(preemption.signals if preemption else (), owner=self)

    @property
    def last_save_info(self) -> SaveInfo | None:
        """The :class:`casstore.SaveInfo` of the last committed save."""
        return self._saver.last_save_info

    @property
    def last_staging_peak_bytes(self) -> int | None:
        """The most bytes of staged copies the last save held at once."""
        return self._saver.last_staging_peak_bytes

    # -- deciding ----------------------------------------------------------------------------

    def reached_preemption(self, step: int) -> bool:
        """True once the job was told it will be stopped (class docstring): the loop asks it at
        every step, on every process, then waits for the save and stops. Makes no request."""
        return self._notice.reached(check_step(step))

    def should_save(self, step: int) -> bool:
        """True if ``step`` is newer than the latest step (the newest this manager knows, the
        one in flight included: no listing) and the save decision policy says so; a policy
        that asks an earlier manager's step its save time reads that manifest once."""
        step = check_step(step)
        # in flight first: a save that commits in between is then among the known steps
        in_flight = self._saving if self._saver.is_saving_in_progress() else None
        latest = max((s for s in (self.latest_step(), in_flight) if s is not None), default=None)
        if latest is not None and step <= latest:
            return False
        context = DecisionContext(
            is_saving_in_progress=self._saver.is_saving_in_progress(),
            reached_preemption=self.reached_preemption(step) and not self._preemption_saved)
        # both tiers (a replaced node's steps are persisted) and the save in flight (as orbax)
        saved = self._infos(self.all_steps()) + [PolicyCheckpointInfo(in_flight)] * (
            in_flight is not None and in_flight not in self._steps)
        return bool(self.save_decision_policy.should_save(PolicyCheckpointInfo(step), saved,
                                                          context=context))

    # -- saving ------------------------------------------------------------------------------

    def save(self, step: int, tree: Any, *, metrics: dict | None = None, metadata: Any = None,
             force: bool = False) -> bool:
        """Saves ``tree`` as ``step`` if it is due (or ``force``).

        Decides first (a save still in flight counts for :class:`ContinuousCheckpointingPolicy`),
        then waits for the previous save, stages the arrays and saves in the background (or
        right away without async checkpointing). Once this returns the caller may overwrite its
        numpy arrays and donate or delete its jax arrays: the step holds the values at this
        call. ``last_save_blocking_s``: how long the last call that saved blocked, seconds.

        Args:
          step: the step number (an int, or an integer numpy or jax scalar).
          tree: the pytree (see :func:`casstore.save`).
          metrics, metadata: for the preservation policy, and the user's: stored in the manifest
            as they are at this call (msgpack; numpy and jax scalars become Python numbers).
          force: save even if ``should_save(step)`` is false.

        Returns:
          True if a save was started, False if the step was not due.

        Raises:
          Any error of the previous background save (never only logged); a store that stalls
            fails it within the store's deadline (StoreTimeoutError naming the step). With a
            persistent tier, a failed persist's error (PersistError or StoreTimeoutError, naming
            step and URL), from the next save that is due; it then saves nothing.
          StepAlreadyExistsError: ``force`` with a step the manager lists (raised here; orbax too)
            or that another process saved meanwhile (from the next call).
          UnsupportedLeafError: a leaf cannot be stored (raised here, before any write).
          PermissionError: the first save found the store not writable; nothing was stored.
          RuntimeError: the manager is closed. ValueError: ``step`` is not an int in [0, 10**16).
        """
        t0, step = time.perf_counter(), check_step(step)
        if self._saver.closed:
            raise RuntimeError("CheckpointManager is closed")
        if not force and not self.should_save(step):
            if not self._saver.is_saving_in_progress():
                self._saver.wait_until_finished()  # a failed save's error, though not due
            return False
        agreement, done = SaveAgreement(self.local_per_host), None  # an error: on every process
        try:  # persists yield to this save until its commit (_tiers)
            with agreement.early():
                if self.persister is not None:  # a failed persist's error (maybe process 0)
                    self.persister.raise_error()
                preempted = self.reached_preemption(step)  # noted once the save is under way
                done = self.persister.local_save(step) if self.persister is not None else None
                self._saver.wait_until_finished()  # the previous save's error, if it failed
                if step in self._steps:  # else the next call raised it, and saved nothing
                    raise StepAlreadyExistsError("step already exists", url=self.store.url,
                                                 run=self.run, step=step)
            self._saving, metrics = step, snapshot(metrics, f"metrics (step {step})")
            metadata = snapshot(metadata, f"metadata (step {step})")  # named as the caller's
            agreement.propose(metrics, utc_now(), self.persister and self.persister.pending)
            self._saver._start(step, tree, {"metrics": metrics, "user": metadata},
                              previous_step=self._steps[-1] if self._steps else None,
                              then=lambda _: self._committed(step, *agreement.agreed()),
                              agreement=agreement)
            self._preemption_saved |= preempted
        finally:
            if done is not None:  # the background write's future, None if not started
                done(self._saver._pending)
        if not self.enable_async_checkpointing:  # the save's error; a persist's comes next call
            self._saver.wait_until_finished()
        self.last_save_blocking_s = time.perf_counter() - t0  # a synchronous save's included
        return True

    def _committed(self, step: int, metrics: Any, started: datetime.datetime, pending) -> None:
        """After the commit, on the background thread: the step list, retention and GC."""
        self._steps = sorted({*self._steps, step})
        self._details[step] = (metrics, started)
        if self.persister is not None:  # queued on process 0, noted on the others (pending:
            self.persister.submit(step, pending)  # process 0's pending persists, there)
        try:  # retention (:meth:`_deletes`; every process forgets): pending persists stay
            doomed = retain(self.store, self.run, self.preservation_policy, self._steps,
                            self._details, self.persister.pending() if self.persister else set(),
                            self._deletes(), self._forget)
            if self.gc_after_retention and self._deletes():
                self.last_gc_info = self._collect(bool(doomed)) or self.last_gc_info
        except Exception as e:  # raised by a later call: it must not read as a failed save
            e.add_note(f"casstore: step {step} was committed; retention or GC then failed")
            raise

    def wait_until_finished(self) -> None:
        """Blocks until the background save (and its retention) is done.

        Raises:
          The background save's error, if it failed (once; the next call succeeds); else a
          failed persist's (PersistError or StoreTimeoutError, naming step and URL), at once.
        """
        self._saver.wait_until_finished()
        if self.persister is not None:
            self.persister.raise_error()

    def wait_until_persisted(self, timeout_s: float | None = None) -> bool:
        """Waits for the background save, then for its persists (tiers; process 0 runs them).

        Returns:
          False if ``timeout_s`` seconds passed with a persist still running, else True.

        Raises:
          The background save's error; a persist's (PersistError or StoreTimeoutError).
        """
        self.wait_until_finished()
        done = self.persister is None or self.persister.wait(timeout_s)
        self.wait_until_finished()
        return done

    def close(self) -> None:
        """Waits for the background save and the persist backlog, then stops the threads and
        puts back any signal handler it installed. Idempotent.

        Raises:
          The background save's error, else a persist's; the threads stop either way.
        """
        try:
            self._saver.close()
        finally:
            self._notice.close()
            if self.persister is not None:  # finish the backlog
                self.persister.close()
        if self.persister is not None:
            self.persister.raise_error()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        close_quietly(self.close, error)

    # -- retention ---------------------------------------------------------------------------

    def _deletes(self) -> bool:  # on the local tier: process 0, or each with local_per_host
        return self.local_per_host or processes()[1] == 0

    def _forget(self, step: int) -> None:
        """Forgets ``step``, deleted by retention or by another process."""
        self._steps = [s for s in self._steps if s != step]

    def _infos(self, steps: list[int] | None = None) -> list[PolicyCheckpointInfo]:
        return [PolicyCheckpointInfo(s, details=self._details) for s in steps or self._steps]

    # -- reading -----------------------------------------------------------------------------

    def all_steps(self, read: bool = False) -> list[int]:
        """The run's committed steps, ascending, as this manager knows them.

        Args:
          read: list the store first (as :meth:`reload` does) instead of answering from memory.
        """
        if read:
            self.reload()
        return sorted({*self._steps, *(self.persister.steps() if self.persister else ())})

    def latest_step(self) -> int | None:
        """The run's latest committed step as this manager knows it, or None; no request."""
        return max(self.all_steps(), default=None)  # both tiers

    def reload(self) -> None:
        """Re-reads the run's steps (one listing), after any save in flight: use it when
        another process, or ``casstore.delete``, may have saved or deleted steps of this run."""
        self.wait_until_finished()
        self._steps = list_steps(self.store, run=self.run)
        self._details.clear()  # a step saved again elsewhere ranks by its new metrics
        if self.persister is not None:
            self.persister.reload()

    def best_step(self) -> int | None:
        """The committed step whose metrics rank best by the preservation policy's ``BestN``
        (``best_fn``; a NaN metric ranks worst, and of equal metrics the latest step is best);
        the latest step without one; None if no step has metrics."""
        return best_of(self.preservation_policy, self._infos(self.all_steps()))

    def restore(self, step: int | None = None, *, target: Any = None,
                paths: list[str] | None = None, partial: bool = False, strict: bool = True,
                sharding: str | None = None, transforms: dict[str, str | None] | None = None,
                fill_missing: bool = False) -> Any:
        """Restores ``step`` (None: :meth:`latest_step`; process 0's for arrays spanning
        processes), after any save in flight; other arguments as :func:`casstore.restore`'s.
        With a persistent tier, ``last_restore_bytes`` then holds ``{url: stored bytes read}``
        by tier (a failed save's or persist's error is raised by the next ``save()``)."""
        self._saver._join()
        reader = self._reader()
        step = agreed_latest(self.latest_step, target) if step is None else step  # alike
        restored = restore(reader, step, run=self.run, target=target, paths=paths, strict=strict,
                           partial=partial, sharding=sharding, transforms=transforms,
                           fill_missing=fill_missing)
        self.last_restore_bytes = getattr(reader, "bytes_read", None)
        return restored

    def metadata(self, step: int | None = None) -> Any:
        """The user metadata saved with ``step`` (None: :meth:`latest_step`): by this manager's
        ``save(..., metadata=)``, or by ``casstore.save(..., metadata=)`` or ``import_orbax``
        (a dict of exactly the keys ``metrics`` and ``user`` reads as a manager's: its ``user``).

        Raises:
          StepNotFoundError: no such step.
        """
        self._saver._join()  # as restore()
        step = self.latest_step() if step is None else step
        return split_metadata(read_manifest(self._reader(), step, run=self.run).metadata)[1]

    def delete(self, step: int) -> None:
        """Deletes ``step`` (its manifest; GC frees its chunks) from every tier that has it (a
        persist of it is dropped or waited for first). With several processes, process 0
        deletes and every process forgets the step.

        Raises:
          StepNotFoundError: neither this manager nor a tier knows the step.
        """
        step = check_step(step)
        self.wait_until_finished()
        found = [step in self.all_steps(), self.persister is not None and self.persister.delete(
            step), self._deletes() and deleted(self.store, step, self.run)]
        self._details.pop(step, None)
        self._steps = [s for s in self._steps if s != step]
        if not any(found):
            raise StepNotFoundError("no such step", url=self.store.url, run=self.run, step=step)

    def _reader(self) -> Store:
        """The store restores read: with the persistent tier as fallback where there is one."""
        return self.store if self.persister is None else FallbackStore(
            self.store, [self.persister.persistent])

    def __repr__(self) -> str:
        return f"CheckpointManager({self.store!r}, run={self.run!r})"
