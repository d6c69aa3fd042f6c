"""CheckpointManager: periodic, asynchronous saves with retention (orbax's names and semantics).

``save`` stages the arrays (``_staging``: numpy blocks copied, accelerator blocks dispatched to
pinned host memory, CPU-device arrays viewed in place) and returns; hashing, compression,
upload, the manifest commit, retention and (optionally) garbage collection run on one
background thread. The manager keeps the list of its run's steps and reads it from the store
only on construction and :meth:`CheckpointManager.reload`.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import functools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax

from ._chunking import DEFAULT_CHUNK_SIZE_BYTES, DEFAULT_PACK_THRESHOLD_BYTES
from ._codec import DEFAULT_ZSTD_LEVEL
from ._errors import StoreTimeoutError
from ._fallback import FallbackStore
from ._gc import DEFAULT_GRACE_PERIOD_S, GcInfo, gc
from ._locks import check_write_access
from ._repository import Url, delete, list_steps, read_manifest
from ._restore import restore
from ._save import SaveInfo, inflight_window, plan_jobs, prepare, write
from ._staging import StagingStream
from ._tiers import PersistPolicy, start_persister
from .store import Store, open_store


def _finish_at_exit(ref: weakref.ref) -> None:
    """At interpreter exit, lets an in-flight background save finish (or fail) first."""
    manager = ref()
    if manager is not None and manager._pending is not None:
        manager._pending.exception()  # waits; a failed save has written no manifest


def _register_exit_hook(manager: CheckpointManager) -> None:
    # concurrent.futures forbids new thread pools once its own exit hook has run, and the save
    # uses pools; threading's exit hooks run in reverse order, so this one runs before it.
    register = getattr(threading, "_register_atexit", atexit.register)
    register(functools.partial(_finish_at_exit, weakref.ref(manager)))


class CheckpointManager:
    """Saves a run's steps periodically and keeps only what the retention policy says.

    Host memory of an asynchronous save: ``save`` returns once every array is staged, and the
    staged copies live until their chunks are stored. Numpy leaves are copied (their bytes
    once more in host memory); accelerator arrays are copied block by block to pinned host
    memory (their bytes once, in memory jax's pinned allocator keeps and reuses for the next
    save, as torch.distributed.checkpoint's pinned staging does); CPU-device jax arrays cost
    nothing (zero-copy views; jax copies a buffer donated while the save runs). Python scalars,
    str and bytes are immutable and read at ``save``. With ``max_staging_bytes`` the copies held
    at once never exceed that many bytes: ``save`` then stages what fits and waits for the
    background save to store chunks before staging more.

    The list of the run's steps is read from the store on construction and on :meth:`reload`
    only; saves and deletes through this manager keep it current, so :meth:`should_save` and
    :meth:`latest_step` make no request. Call :meth:`reload` when another process may have
    written or deleted steps of this run.

    Thread-safety: NOT thread-safe (call it from one training loop). At interpreter exit an
    in-flight background save is finished first; a save killed with the process leaves no
    manifest, never a partial step. Multi-process: every
    process of a ``jax.distributed`` job calls ``save`` with the same steps in the same order;
    process 0 commits. Saves of one manager never overlap: a save waits for the previous one.

    Retention (after each successful save): with ``best_fn``, keep the ``max_to_keep`` steps whose
    metrics score best (``best_mode`` ``"max"`` or ``"min"``), plus the steps without metrics if
    ``keep_checkpoints_without_metrics``; without it, keep the ``max_to_keep`` latest steps.
    Steps divisible by ``keep_period`` are always kept. Deleting a step deletes its manifest;
    with ``gc_after_retention`` garbage collection then frees the chunks no step references.

    Args:
      url: a path, an fsspec URL or a Store.
      run: the run this manager saves and restores.
      max_to_keep: steps to keep (None keeps all).
      keep_period: keep every step divisible by this, whatever ``max_to_keep`` says.
      best_fn: ``metrics -> float`` ranking steps for retention; None ranks by step.
      best_mode: ``"max"`` (higher is better) or ``"min"``.
      keep_checkpoints_without_metrics: with ``best_fn``, keep steps saved without metrics.
      save_interval_steps: ``should_save`` is true every this many steps.
      enable_async_checkpointing: return from ``save`` once arrays are on the host; False
        makes ``save`` return once the step is committed.
      gc_after_retention: run garbage collection after retention deleted steps.
      grace_period_s: the GC grace period, seconds.
      max_staging_bytes: the most host memory, bytes, that staged copies of an asynchronous
        save hold at once (None: no limit); at least ``chunk_size_bytes``.
      chunk_size_bytes, zstd_level, delta: as for :func:`casstore.save`; deltas are taken
        against the manager's latest step.
      persistent: None, or a URL or Store: the persistent tier (``docs/tiers.md``). Every
        eligible step is copied there in the background after its local commit, moving only
        the chunks it lacks; ``save`` never waits for it. :meth:`latest_step` and
        :meth:`all_steps` cover both tiers; :meth:`restore` reads each chunk from ``url`` and
        one missing or damaged there from the persistent tier.
      persist_interval_steps: a step divisible by this is persisted.
      persistent_max_to_keep: persisted steps kept on the persistent tier (None keeps all);
        ``gc_after_retention`` and ``grace_period_s`` apply to it too.
      **storage_options: passed to fsspec for URLs.

    Raises:
      ValueError: a retention or staging argument is out of range.

    Example:
      >>> import numpy as np, casstore
      >>> with casstore.CheckpointManager(casstore.MemoryStore(), max_to_keep=2) as mngr:
      ...     for step in range(4):
      ...         _ = mngr.save(step, {"w": np.full(3, step)})
      ...     mngr.wait_until_finished()
      ...     mngr.all_steps()
      [2, 3]
    """

    def __init__(self, url: Url, *, run: str = "default", max_to_keep: int | None = None,
                 keep_period: int | None = None,
                 best_fn: Callable[[dict], float] | None = None, best_mode: str = "max",
                 keep_checkpoints_without_metrics: bool = True, save_interval_steps: int = 1,
                 enable_async_checkpointing: bool = True, gc_after_retention: bool = False,
                 grace_period_s: float = DEFAULT_GRACE_PERIOD_S,
                 max_staging_bytes: int | None = None,
                 chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES,
                 zstd_level: int = DEFAULT_ZSTD_LEVEL, delta: bool = True,
                 persistent: Url | None = None, persist_interval_steps: int = 1,
                 persistent_max_to_keep: int | None = None, **storage_options):
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', not {best_mode!r}")
        for name, value in (("max_to_keep", max_to_keep), ("keep_period", keep_period),
                            ("save_interval_steps", save_interval_steps)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, not {value!r}")
        if max_staging_bytes is not None and max_staging_bytes < chunk_size_bytes:
            raise ValueError(f"max_staging_bytes={max_staging_bytes} is smaller than one chunk "
                             f"(chunk_size_bytes={chunk_size_bytes})")
        self.store: Store = open_store(url, **storage_options)
        self.run = run
        self.max_to_keep, self.keep_period = max_to_keep, keep_period
        self.best_fn, self.best_mode = best_fn, best_mode
        self.keep_checkpoints_without_metrics = keep_checkpoints_without_metrics
        self.save_interval_steps = save_interval_steps
        self.enable_async_checkpointing = enable_async_checkpointing
        self.gc_after_retention, self.grace_period_s = gc_after_retention, grace_period_s
        self.max_staging_bytes = max_staging_bytes
        self.chunk_size_bytes, self.zstd_level = chunk_size_bytes, zstd_level
        self.delta = delta
        self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="casstore-save")
        self._pending: cf.Future | None = None
        self._metrics: dict[int, Any] = {}
        self._closed = False
        self._writable = False  # write access checked by the first save
        self.last_save_blocking_s: float | None = None
        self.last_save_info: SaveInfo | None = None
        self.last_gc_info: GcInfo | None = None
        self.last_staging_peak_bytes: int | None = None
        self.last_restore_bytes: dict[str, int] | None = None
        self._steps: list[int] = list_steps(self.store, run=self.run)
        # tiers hook (_tiers.py): the persister, which resumes what a killed manager left
        self.persister = None if persistent is None else start_persister(
            self.store, persistent, run, self._steps, PersistPolicy(
                persist_interval_steps, persistent_max_to_keep, gc_after_retention,
                grace_period_s))
        _register_exit_hook(self)

    # -- saving ------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """True if ``step`` is due (every ``save_interval_steps``) and newer than the latest.

        Makes no request: the latest step is the one this manager knows (see the class
        docstring).
        """
        latest = self.latest_step()
        return (latest is None or step > latest) and step % self.save_interval_steps == 0

    def save(self, step: int, tree: Any, *, metrics: dict | None = None, metadata: Any = None,
             force: bool = False) -> bool:
        """Saves ``tree`` as ``step`` if it is due (or ``force``).

        Waits for the previous save, stages the arrays (see the class docstring for what is
        copied and what it costs in host memory), then saves in the background, or right away
        without async checkpointing. Once this returns the caller may overwrite its numpy
        arrays and donate or delete its jax arrays: the step holds the values at this call.
        ``last_save_blocking_s`` records how long this call blocked, in seconds.

        Args:
          step: the step number.
          tree: the pytree (see :func:`casstore.save`).
          metrics: msgpack-able metrics for ``best_fn``, stored in the manifest.
          metadata: user metadata, stored in the manifest.
          force: save even if ``should_save(step)`` is false.

        Returns:
          True if a save was started, False if the step was not due.

        Raises:
          Any error of the previous background save (never only logged); a store that stalls
            fails it within the store's deadline (StoreTimeoutError naming the step).
          StepAlreadyExistsError: ``force`` with an existing step (from the background save).
          UnsupportedLeafError: a leaf cannot be stored (raised here, before any write).
          PermissionError: the first save found the store not writable (a read-only store or
            credentials, checked by writing and deleting one lock object); nothing was stored.
          RuntimeError: the manager is closed.
        """
        t0 = time.perf_counter()
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")
        self.wait_until_finished()
        if not force and not self.should_save(step):
            return False
        if not self._writable:  # fail here, not at the next call, without write access
            check_write_access(self.store)
            self._writable = True
        prepared, arrays = prepare(tree, {"metrics": metrics, "user": metadata})
        inline, jobs = plan_jobs(prepared, arrays, self.chunk_size_bytes,
                                 DEFAULT_PACK_THRESHOLD_BYTES)
        del arrays
        stream = StagingStream(jobs, self.max_staging_bytes, self.chunk_size_bytes)
        self._pending = self._executor.submit(self._save_and_retain, step, prepared, inline,
                                              stream, metrics)
        try:
            stream.fill()
        finally:
            self.last_staging_peak_bytes = stream.peak_bytes
            self.last_save_blocking_s = time.perf_counter() - t0
        if not self.enable_async_checkpointing:
            self.wait_until_finished()
        return True

    def _save_and_retain(self, step: int, prepared: Any, inline: dict, stream: StagingStream,
                         metrics: Any) -> None:
        workers = self.store.max_workers
        try:
            self.last_save_info = write(
                self.store, step, prepared, inline, stream, run=self.run,
                zstd_level=self.zstd_level, shuffle=self.store.shuffle, max_workers=workers,
                window=inflight_window(workers, self.chunk_size_bytes), delta=self.delta,
                previous_step=self._steps[-1] if self._steps else None)  # tiers: local
        except StoreTimeoutError as e:  # surfaces on the next save(): name the step
            stream.abandon()
            raise e.at(run=self.run, step=step) from e
        except BaseException:
            stream.abandon()
            raise
        self._steps = sorted({*self._steps, step})
        if self.persister is not None and jax.process_index() == 0:  # tiers hook
            self.persister.submit(step)
        self._metrics[step] = metrics
        deleted = self._apply_retention()
        if deleted and self.gc_after_retention and jax.process_index() == 0:
            self.last_gc_info = gc(self.store, grace_period_s=self.grace_period_s)

    def wait_until_finished(self) -> None:
        """Blocks until the background save (and its retention) is done.

        Raises:
          The background save's error, if it failed (once; the next call succeeds).
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        if self.persister is not None:  # tiers hook: a failed persist surfaces, no wait
            self.persister.raise_error()

    def wait_until_persisted(self, timeout_s: float | None = None) -> bool:
        """Waits for the background save, then for the persists it queued (tiers).

        Returns:
          False if ``timeout_s`` seconds passed with a persist still running, else True.

        Raises:
          The background save's error; a persist's error (:class:`~casstore.PersistError` or
          :class:`~casstore.StoreTimeoutError`, naming the step and the persistent URL).
        """
        self.wait_until_finished()
        done = self.persister is None or self.persister.wait(timeout_s)
        self.wait_until_finished()
        return done

    def close(self) -> None:
        """Waits for the background save, then stops its thread. Idempotent.

        Raises:
          The background save's error, if it failed; the thread is stopped either way.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_until_finished()
        finally:
            self._executor.shutdown(wait=True)
            if self.persister is not None:  # tiers hook: finish the backlog
                self.persister.close()
        if self.persister is not None:
            self.persister.raise_error()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- retention ---------------------------------------------------------------------------

    def _metrics_of(self, step: int) -> Any:
        if step not in self._metrics:
            metadata = read_manifest(self._reader(), step, run=self.run).metadata  # tiers
            self._metrics[step] = metadata.get("metrics") if isinstance(metadata, dict) else None
        return self._metrics[step]

    def _steps_to_keep(self, steps: list[int]) -> set[int]:
        """The retention policy (see the class docstring)."""
        if self.max_to_keep is None:
            return set(steps)
        if self.best_fn is None:
            keep = set(steps[-self.max_to_keep:])
        else:
            scored = [s for s in steps if self._metrics_of(s) is not None]
            ranked = sorted(scored, key=lambda s: self.best_fn(self._metrics_of(s)),
                            reverse=self.best_mode == "max")
            keep = set(ranked[:self.max_to_keep])
            if self.keep_checkpoints_without_metrics:
                keep |= set(steps) - set(scored)
        if self.keep_period:
            keep |= {s for s in steps if s % self.keep_period == 0}
        return keep

    def _apply_retention(self) -> list[int]:
        """Deletes the steps the policy drops (process 0 only; every process forgets them)."""
        steps = list(self._steps)  # tiers: local steps; a pending persist keeps its step
        pending = self.persister.pending() if self.persister is not None else set()
        doomed = [s for s in steps if s not in self._steps_to_keep(steps) and s not in pending]
        for step in doomed:
            if jax.process_index() == 0:
                with contextlib.suppress(FileNotFoundError):  # already gone: the same outcome
                    delete(self.store, step, run=self.run)
            self._metrics.pop(step, None)
        self._steps = [s for s in self._steps if s not in doomed]
        return doomed

    # -- reading -----------------------------------------------------------------------------

    def all_steps(self, read: bool = False) -> list[int]:
        """The run's committed steps, ascending, as this manager knows them.

        Args:
          read: list the store first (as :meth:`reload` does) instead of answering from memory.
        """
        if read:
            self.reload()
        if self.persister is not None:  # tiers hook: both tiers
            return sorted({*self._steps, *self.persister.steps()})
        return list(self._steps)

    def latest_step(self) -> int | None:
        """The run's latest committed step as this manager knows it, or None; no request."""
        steps = self.all_steps()  # tiers: both tiers
        return steps[-1] if steps else None

    def reload(self) -> None:
        """Re-reads the run's steps from the store (one listing), after any save in flight.

        Use it when another process may have saved or deleted steps of this run.
        """
        self.wait_until_finished()
        self._steps = list_steps(self.store, run=self.run)
        if self.persister is not None:  # tiers hook
            self.persister.reload()

    def best_step(self) -> int | None:
        """The committed step whose metrics score best by ``best_fn``; the latest without one."""
        steps = self.all_steps()
        if self.best_fn is None:
            return steps[-1] if steps else None
        scored = [s for s in steps if self._metrics_of(s) is not None]
        if not scored:
            return None
        pick = max if self.best_mode == "max" else min
        return pick(scored, key=lambda s: self.best_fn(self._metrics_of(s)))

    def restore(self, step: int | None = None, *, target: Any = None,
                paths: list[str] | None = None, partial: bool = False, strict: bool = True,
                sharding: str | None = None, transforms: dict[str, str | None] | None = None,
                fill_missing: bool = False) -> Any:
        """Restores ``step`` (None: the latest), after any save in flight; see
        :func:`casstore.restore` for ``target``, ``paths``, ``partial``, ``strict``,
        ``sharding``, ``transforms`` and ``fill_missing``. With a persistent tier,
        ``last_restore_bytes`` then holds ``{url: stored bytes read}`` for each tier.
        """
        self.wait_until_finished()
        reader = self._reader()
        restored = restore(reader, step, run=self.run, target=target, paths=paths,
                           partial=partial, strict=strict, sharding=sharding,
                           transforms=transforms, fill_missing=fill_missing)
        self.last_restore_bytes = getattr(reader, "bytes_read", None)  # tiers hook
        return restored

    def metadata(self, step: int | None = None) -> Any:
        """The user metadata saved with ``step`` (None: the latest).

        Raises:
          StepNotFoundError: no such step.
        """
        self.wait_until_finished()
        metadata = read_manifest(self._reader(), step, run=self.run).metadata  # tiers
        return metadata.get("user") if isinstance(metadata, dict) else metadata

    def delete(self, step: int) -> None:
        """Deletes ``step`` (its manifest; GC frees its chunks).

        Raises:
          StepNotFoundError: no such step.
        """
        self.wait_until_finished()
        delete(self.store, step, run=self.run)
        self._metrics.pop(step, None)
        self._steps = [s for s in self._steps if s != step]

    def _reader(self) -> Store:
        """tiers hook: the store restores read, with the persistent tier as fallback."""
        if self.persister is None:
            return self.store
        return FallbackStore(self.store, [self.persister.persistent])

    def __repr__(self) -> str:
        return f"CheckpointManager({self.store!r}, run={self.run!r})"
