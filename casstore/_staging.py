"""Staging for asynchronous saves: chunk jobs handed from the training loop to a background save.

The caller's thread runs :meth:`StagingStream.fill`: it takes each job of the save's stream
(:func:`casstore._save.plan_jobs`), makes it independent of the caller's buffers, and queues
it; the background save consumes the queue as an iterator. What a job needs depends on where
its bytes live:

- a numpy leaf's block is copied (the caller may overwrite its array once ``save`` returns),
  unless it is hashed and found among ``stored``, the chunks of the step the save reuses
  (a frozen base, an untouched embedding; given only after a save that reused more chunks
  than it wrote): then only its chunk id is handed over;
- a block of a device copy the save made (``_device_staging``) is the save's own: its host copy
  is made when the background save reads it;
- an accelerator's block was already copied to host memory by the stream (pinned memory where
  the device offers it: a DMA dispatched at once, as torch.distributed.checkpoint's
  ``async_with_pinned_mem`` staging does); a later donation of the array does not change it;
- a CPU device's block is a zero-copy view: jax arrays are immutable, and jax copies a donated
  buffer while a view of it is alive, so nothing is copied;
- small leaves (packs, inline) were copied when the stream was planned;
- a block or pack of jax arrays whose chunk id is remembered from an earlier save of the same
  array objects (:mod:`casstore._known_chunks`) is handed over as its id where ``stored``
  names it, and copied as above where it does not (while the caller's arrays are alive).

The copies held at once are bounded by ``max_bytes``: when the budget is spent, ``fill`` waits
for the background save to store chunks and release theirs, so a state larger than the budget
streams through it (``save`` blocks longer, host memory never exceeds the budget).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Collection, Iterable, Iterator

from ._codec import chunk_id
from ._errors import CasstoreError
from ._save import Job


class StagingStream:
    """A bounded, thread-safe hand-over of chunk jobs from a producer to one consumer.

    Args:
      jobs: the save's job stream; consumed by :meth:`fill` in the caller's thread.
      max_bytes: the most bytes of staged copies held at once; None for no limit (the whole
        state's numpy and accelerator bytes are then held until stored). Must be at least
        ``chunk_size_bytes``, the largest job.
      chunk_size_bytes: the largest raw size of one job, bytes.
      stored: chunk ids the background save will reuse without reading them (the previous
        manifest's).
      hash_numpy: hash numpy blocks at staging, so those among ``stored`` are not copied
        (False: they are copied unhashed).

    Raises:
      ValueError: ``max_bytes`` is smaller than one chunk.
    """

    def __init__(self, jobs: Iterable[Job], max_bytes: int | None, chunk_size_bytes: int,
                 stored: Collection[str] = frozenset(), hash_numpy: bool = False):
        if max_bytes is not None and max_bytes < chunk_size_bytes:
            raise ValueError(f"max_staging_bytes={max_bytes} is smaller than one chunk "
                             f"({chunk_size_bytes} bytes)")
        self._jobs, self._max, self._chunk = jobs, max_bytes, chunk_size_bytes
        self._stored, self._hash_numpy = stored, hash_numpy
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._used = self.peak_bytes = 0
        self._done = self._abandoned = False
        self._error: BaseException | None = None

    def fill(self) -> None:
        """Stages every job, waiting for budget when it is spent; returns once all are queued.

        Stops early, without error, if the consumer :meth:`abandon` ed the stream (its own
        error is reported by the background save).

        Raises:
          Whatever reading the caller's arrays raised; the consumer then fails too, so no
          manifest is written.
        """
        try:
            jobs = iter(self._jobs)
            while self._wait_for_budget():
                job = next(jobs, None)
                if job is None:
                    break
                self._put(_independent(job, self._stored, self._hash_numpy))
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()
            raise
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Drops the queue and fails the consumer at its next job with ``error``: the save
        failed in the caller's thread after staging (on another process)."""
        with self._cond:
            self._queue.clear()
            self._error, self._done = self._error or error, True
            self._cond.notify_all()

    def abandon(self) -> None:
        """Called by a consumer that stops early: drops the queue and stops :meth:`fill`."""
        with self._cond:
            self._abandoned = True
            self._queue.clear()
            self._cond.notify_all()

    def __iter__(self) -> Iterator[Job]:
        """The staged jobs, in order; waits for :meth:`fill`.

        Raises:
          CasstoreError: staging failed in the caller's thread (chained to its error).
        """
        while True:
            with self._cond:
                while not self._queue and not self._done:
                    self._cond.wait()
                if self._queue:
                    job = self._queue.popleft()
                elif self._error is not None:
                    raise CasstoreError("staging the arrays failed; nothing was committed"
                                        ) from self._error
                else:
                    return
            yield job

    def _wait_for_budget(self) -> bool:
        """Waits until one more chunk fits the budget; False if the consumer is gone."""
        with self._cond:
            while (self._max is not None and not self._abandoned
                   and self._used + self._chunk > self._max):
                self._cond.wait()
            return not self._abandoned

    def _put(self, job: Job) -> None:
        cost = job.nbytes if job.holds_copy else 0
        job.release = functools.partial(self._release, cost)
        with self._cond:
            self._used += cost
            self.peak_bytes = max(self.peak_bytes, self._used)
            self._queue.append(job)
            self._cond.notify_all()

    def _release(self, cost: int) -> None:
        with self._cond:
            self._used -= cost
            self._cond.notify_all()


def _independent(job: Job, stored: Collection[str], hash_numpy: bool) -> Job:
    """``job``, independent of memory the caller may change or donate: its chunk id alone if
    that chunk is among ``stored``, else a copy of its bytes (with the id, where it was hashed
    or remembered)."""
    if job.copy is not None:  # a remembered id: the copy, if at all, is made while x is alive
        return dataclasses.replace(job, copy=None) if job.chunk_id in stored else job.copy()
    if not job.caller_memory:
        return job
    # Copied first, then hashed: a caller (another thread) that writes its array meanwhile
    # must not get an id that does not name the bytes stored (a corrupt chunk that later
    # steps would dedup onto); the copy of a block that is stored already is dropped at once.
    copy = bytes(job.read())
    cid = chunk_id(copy) if hash_numpy else None
    if cid is not None and cid in stored:
        return Job(None, job.blocks, job.element_size, job.nbytes, chunk_id=cid)
    return Job(functools.partial(memoryview, copy), job.blocks, job.element_size,
               job.nbytes, holds_copy=True, chunk_id=cid)
