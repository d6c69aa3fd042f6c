"""Bounded concurrency for the chunk pipelines of save and restore, sized by the machine."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any


def usable_cores() -> int:
    """The cores this process may run on, now: ``len(os.sched_getaffinity(0))``, at least 1.

    The affinity mask, not the machine's core count: a process pinned by ``taskset``, a cgroup
    cpuset (containers, Slurm, Kubernetes CPU pinning) or a launcher that gives each rank its
    own cores sees only its share. Where the platform has no affinity (macOS, Windows),
    ``os.cpu_count()``.
    """
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_workers(per_core: int, cap: int) -> int:
    """Worker threads for a pipeline: ``per_core`` per usable core (:func:`usable_cores`), at
    most ``cap``.

    Hashing, compression and numpy copies release the GIL, so CPU-bound stages scale with the
    cores; requests to an object store wait on latency, so they take several threads per core.
    ``cap`` bounds memory, not CPU: each worker of a save holds up to two chunks in flight and
    each worker of a restore one chunk's read buffer.

    Args:
      per_core: threads per usable core, at least 1.
      cap: the most threads.

    Returns:
      ``min(cap, per_core * usable_cores())``, at least 1.
    """
    return max(1, min(cap, per_core * usable_cores()))


def bounded_map(fn: Callable[[Any], Any], items: Iterable, max_workers: int,
                window: int | None = None) -> list:
    """``[fn(x) for x in items]`` in a thread pool, with at most ``window`` items in flight.

    Items are pulled from ``items`` lazily, only when the window has room, so the memory they
    hold (a chunk or two each) stays bounded by the window, not by the number of items, and a
    generator's side effects (starting a device-to-host copy) run just ahead of the workers.
    The first exception cancels what is still pending and is re-raised once the running tasks
    have finished. A ``KeyboardInterrupt`` (Ctrl-C in the calling thread) is re-raised at once:
    the running tasks are not waited for, and the store requests they have in flight (or
    start later) are cancelled through the call's :class:`Scope`, so the threads end soon
    and a script exits without waiting for a stalled store's deadlines. A stage that must not
    act after that (a save's uploads, a copy's manifests) checks for it itself. ``fn`` may
    return a :class:`concurrent.futures.Future` (a second stage it started on another pool,
    such as an upload, whose tasks should run :func:`in_scope`): the item then keeps its place
    in the window until that future is done, and its result is what is collected.

    Args:
      max_workers: threads.
      window: items submitted and not yet collected (default ``2 * max_workers``; at least 1).

    Raises:
      KeyboardInterrupt: as soon as it reaches the calling thread; pending items never start.
    """
    window = max(1, window or 2 * max_workers)
    out: list = []
    pending: collections.deque[cf.Future] = collections.deque()
    pool = cf.ThreadPoolExecutor(max(1, min(max_workers, window)))
    scope = current_scope() or Scope()
    task = in_scope(fn, scope)
    try:
        for item in items:
            pending.append(pool.submit(task, item))
            if len(pending) >= window:
                out.append(_result(pending.popleft()))
        while pending:
            out.append(_result(pending.popleft()))
    except BaseException as e:  # Ctrl-C: do not wait for the running tasks
        interrupted = isinstance(e, KeyboardInterrupt)
        if interrupted:
            scope.abandon()
        pool.shutdown(wait=not interrupted, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return out


def _result(future: cf.Future) -> Any:
    """The future's result, or the result of the future it returned."""
    out = future.result()
    return out.result() if isinstance(out, cf.Future) else out


class Scope:
    """The store requests that the worker threads of one call (a save, restore, copy, ...)
    have in flight, so that a Ctrl-C in the calling thread can cancel them.

    A worker runs its task with the call's scope as its :func:`current_scope`
    (:func:`in_scope`); ``FsspecStore`` tracks each request it sends on an async filesystem
    there. :meth:`abandon` cancels those in flight and every one tracked afterwards: a
    cancelled request raises :class:`concurrent.futures.CancelledError` in its thread, which
    is not retried. An object store never keeps part of a cancelled upload as an object (a PUT
    or a GCS upload is stored whole or not at all; an unfinished S3 multipart upload is no
    object).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: set[cf.Future] = set()
        self.abandoned = False

    def track(self, future: cf.Future) -> None:
        """Adds a request's future; cancels it at once if the scope is abandoned."""
        with self._lock:
            self._inflight.add(future)
            abandoned = self.abandoned
        if abandoned:
            future.cancel()

    def untrack(self, future: cf.Future) -> None:
        """Drops a request's future once it has ended."""
        with self._lock:
            self._inflight.discard(future)

    def abandon(self) -> None:
        """Cancels every request in flight now or tracked later."""
        with self._lock:
            self.abandoned = True
            inflight = list(self._inflight)
        for future in inflight:
            future.cancel()


_local = threading.local()


def current_scope() -> Scope | None:
    """The :class:`Scope` of the call the calling thread works for, or None."""
    return getattr(_local, "scope", None)


def in_scope(fn: Callable[..., Any], scope: Scope | None) -> Callable[..., Any]:
    """``fn``, run with ``scope`` as its thread's :func:`current_scope` (``fn`` if None)."""
    if scope is None:
        return fn

    def run(*args: Any) -> Any:
        outer, _local.scope = current_scope(), scope
        try:
            return fn(*args)
        finally:
            _local.scope = outer

    return run
