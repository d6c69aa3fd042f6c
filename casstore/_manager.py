"""CheckpointManager: periodic, asynchronous saves with retention (orbax's names and semantics).

``save`` copies the device arrays to host memory and returns; hashing, compression, upload,
the manifest commit, retention and (optionally) garbage collection run on one background thread.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import functools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax

from ._chunking import host_snapshot
from ._gc import DEFAULT_GRACE_PERIOD_S, GcInfo, gc
from ._locks import check_write_access
from ._repository import Url, delete, list_steps, read_manifest
from ._restore import restore
from ._save import SaveInfo, save
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


def _snapshot(tree: Any) -> Any:
    """The tree with every jax.Array replaced by a host copy of its unique shards."""
    return jax.tree.map(lambda x: host_snapshot(x) if isinstance(x, jax.Array) else x, tree)


class CheckpointManager:
    """Saves a run's steps periodically and keeps only what the retention policy says.

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
      **storage_options: passed to fsspec for URLs.

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
                 grace_period_s: float = DEFAULT_GRACE_PERIOD_S, **storage_options):
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', not {best_mode!r}")
        for name, value in (("max_to_keep", max_to_keep), ("keep_period", keep_period),
                            ("save_interval_steps", save_interval_steps)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, not {value!r}")
        self.store: Store = open_store(url, **storage_options)
        self.run = run
        self.max_to_keep, self.keep_period = max_to_keep, keep_period
        self.best_fn, self.best_mode = best_fn, best_mode
        self.keep_checkpoints_without_metrics = keep_checkpoints_without_metrics
        self.save_interval_steps = save_interval_steps
        self.enable_async_checkpointing = enable_async_checkpointing
        self.gc_after_retention, self.grace_period_s = gc_after_retention, grace_period_s
        self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="casstore-save")
        self._pending: cf.Future | None = None
        self._metrics: dict[int, Any] = {}
        self._closed = False
        self._writable = False  # write access checked by the first save
        self.last_save_blocking_s: float | None = None
        self.last_save_info: SaveInfo | None = None
        self.last_gc_info: GcInfo | None = None
        _register_exit_hook(self)

    # -- saving ------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """True if ``step`` is due (every ``save_interval_steps``) and newer than the latest."""
        latest = self.latest_step()
        return (latest is None or step > latest) and step % self.save_interval_steps == 0

    def save(self, step: int, tree: Any, *, metrics: dict | None = None, metadata: Any = None,
             force: bool = False) -> bool:
        """Saves ``tree`` as ``step`` if it is due (or ``force``).

        Waits for the previous save, copies every jax.Array to host memory (so the caller may
        overwrite or donate its buffers as soon as this returns), then saves in the background
        (or right away without async checkpointing). ``last_save_blocking_s`` records how long
        this call blocked, in seconds.

        Args:
          step: the step number.
          tree: the pytree (see :func:`casstore.save`).
          metrics: msgpack-able metrics for ``best_fn``, stored in the manifest.
          metadata: user metadata, stored in the manifest.
          force: save even if ``should_save(step)`` is false.

        Returns:
          True if a save was started, False if the step was not due.

        Raises:
          Any error of the previous background save (never only logged).
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
        snapshot = _snapshot(tree)
        wrapped = {"metrics": metrics, "user": metadata}
        self._pending = self._executor.submit(self._save_and_retain, step, snapshot, wrapped,
                                              metrics)
        self.last_save_blocking_s = time.perf_counter() - t0
        if not self.enable_async_checkpointing:
            self.wait_until_finished()
        return True

    def _save_and_retain(self, step: int, tree: Any, metadata: dict, metrics: Any) -> None:
        self.last_save_info = save(self.store, step, tree, run=self.run, metadata=metadata)
        self._metrics[step] = metrics
        deleted = self._apply_retention()
        if deleted and self.gc_after_retention:
            self.last_gc_info = gc(self.store, grace_period_s=self.grace_period_s)

    def wait_until_finished(self) -> None:
        """Blocks until the background save (and its retention) is done.

        Raises:
          The background save's error, if it failed (once; the next call succeeds).
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

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

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- retention ---------------------------------------------------------------------------

    def _metrics_of(self, step: int) -> Any:
        if step not in self._metrics:
            metadata = read_manifest(self.store, step, run=self.run).metadata
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
        steps = self.all_steps()
        doomed = [s for s in steps if s not in self._steps_to_keep(steps)]
        for step in doomed:
            delete(self.store, step, run=self.run)
            self._metrics.pop(step, None)
        return doomed

    # -- reading -----------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The run's committed steps, ascending."""
        return list_steps(self.store, run=self.run)

    def latest_step(self) -> int | None:
        """The run's latest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

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
                paths: list[str] | None = None, partial: bool = False) -> Any:
        """Restores ``step`` (None: the latest), after any save in flight; see
        :func:`casstore.restore` for ``target``, ``paths`` and ``partial``."""
        self.wait_until_finished()
        return restore(self.store, step, run=self.run, target=target, paths=paths,
                       partial=partial)

    def metadata(self, step: int | None = None) -> Any:
        """The user metadata saved with ``step`` (None: the latest).

        Raises:
          StepNotFoundError: no such step.
        """
        self.wait_until_finished()
        metadata = read_manifest(self.store, step, run=self.run).metadata
        return metadata.get("user") if isinstance(metadata, dict) else metadata

    def delete(self, step: int) -> None:
        """Deletes ``step`` (its manifest; GC frees its chunks).

        Raises:
          StepNotFoundError: no such step.
        """
        self.wait_until_finished()
        delete(self.store, step, run=self.run)
        self._metrics.pop(step, None)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.store!r}, run={self.run!r})"
