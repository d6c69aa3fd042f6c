"""AsyncCheckpointer: one save at a time in the background, after the arrays are staged.

This is the staging and background half of :class:`casstore.CheckpointManager` (which adds
save decisions and retention on top) and, on its own, orbax's ``AsyncCheckpointer``: ``save``
stages the arrays (``_staging``: numpy blocks copied, accelerator arrays copied on their devices
where there is room (``_device_staging``) or else their blocks dispatched to pinned host
memory, CPU-device arrays viewed in place) and returns; hashing, compression, upload and
the manifest commit run on one background thread; :meth:`AsyncCheckpointer.wait_until_finished`
waits for them and raises their error.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._chunking import (
    DEFAULT_CHUNK_SIZE_BYTES,
    DEFAULT_PACK_THRESHOLD_BYTES,
    check_chunk_size,
    check_options,
)
from ._codec import DEFAULT_ZSTD_LEVEL
from ._device_staging import copy_on_device
from ._errors import CasstoreError, StoreTimeoutError, close_quietly
from ._exit import finish_at_exit, forget_at_exit
from ._layout import check_run, check_step
from ._locks import check_write_access
from ._manifest import Manifest
from ._multihost import SaveAgreement
from ._repository import Url, read_manifest
from ._save import SaveInfo, inflight_window, plan_jobs, prepare, write
from ._save_encode import lost_chunks
from ._staging import StagingStream
from .store import Store, check_misspelt, open_store

log = logging.getLogger("casstore")


def _finish_at_exit(saver: AsyncCheckpointer) -> None:
    """At interpreter exit, lets an in-flight background save finish (or fail) first."""
    if saver._pending is not None:
        error = saver._pending.exception()  # waits; a failed save has written no manifest
        if error is not None:  # nobody is left to raise it to
            log.error("casstore: the background save of step %s to %s failed at exit, nothing "
                      "was committed: %s", saver._pending_step, saver.store.url, error,
                      exc_info=error)


class AsyncCheckpointer:
    """Saves steps in the background, one at a time (orbax's ``AsyncCheckpointer``).

    ``save`` returns once every array is staged; the step is committed in the background and
    :meth:`wait_until_finished` waits for it and raises its error. Once ``save`` returns the
    caller may overwrite its numpy arrays and donate or delete its jax arrays: the step holds
    the values at the call. Host memory: numpy leaves are copied (their bytes once more),
    except, after a save that reused more chunks than it wrote, for blocks that hash to a
    chunk of the previous step (the manager's saves: a frozen base is hashed, not copied);
    accelerator arrays are copied on their devices where each device has room for the copy
    beside the process's peak use so far (one dispatch; their host copies are made in the
    background, the device copy freed as they are), else block by block to pinned host memory
    before ``save`` returns; neither for blocks saved before from the same array objects whose
    chunks the previous step stores (their ids are remembered: :func:`casstore.save`);
    CPU-device jax arrays are zero-copy views (jax copies a buffer donated while the save
    runs); Python scalars, str and bytes are read at ``save``. With ``max_staging_bytes`` the
    host copies ``save`` holds at once never exceed that many bytes (the background save's
    host copies of device copies are bounded by its in-flight window, as a plain save's):
    ``save`` then stages what fits and waits for the background save to store chunks before
    staging more.

    Thread-safety: NOT thread-safe (call it from one thread). At interpreter exit an in-flight
    save is finished first (an error it ends with is logged, level ERROR, logger ``casstore``:
    nothing is left to raise it to, and the exit status stays the script's, so end a job with
    :meth:`close` or :meth:`wait_until_finished`; Python 3.12.0-3.12.2, which pyproject.toml
    excludes, start no thread then, CPython gh-113964); a save killed with the process leaves
    no manifest, never a partial step. Multi-process: every process of a ``jax.distributed``
    job calls ``save`` with the same steps in the same order; process 0 commits.

    Args:
      url: a path, an fsspec URL or a Store.
      run: the run the steps are saved in.
      max_staging_bytes: the most host memory, bytes, that staged copies hold at once (None:
        no limit); at least ``chunk_size_bytes``.
      chunk_size_bytes, zstd_level, delta: as for :func:`casstore.save`.
      **storage_options: passed to fsspec for URLs.

    Raises:
      ValueError: ``max_staging_bytes`` is smaller than one chunk, ``chunk_size_bytes`` is
        not an int in [1, 2**31], or ``run`` is invalid.

    Example:
      >>> import numpy as np, casstore
      >>> store = casstore.MemoryStore()
      >>> with casstore.AsyncCheckpointer(store) as ckptr:
      ...     w = np.zeros(3)
      ...     ckptr.save(0, {"w": w})
      ...     w += 1  # the step keeps the zeros
      ...     ckptr.wait_until_finished()
      >>> casstore.restore(store, 0)["w"].tolist()
      [0.0, 0.0, 0.0]
    """

    def __init__(self, url: Url, *, run: str = "default", max_staging_bytes: int | None = None,
                 chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES,
                 zstd_level: int = DEFAULT_ZSTD_LEVEL, delta: bool = True, **storage_options):
        if max_staging_bytes is not None and max_staging_bytes < chunk_size_bytes:
            raise ValueError(f"max_staging_bytes={max_staging_bytes} is smaller than one chunk "
                             f"(chunk_size_bytes={chunk_size_bytes})")
        check_misspelt(storage_options, AsyncCheckpointer.__init__)
        self.store: Store = open_store(url, **storage_options)
        self.run = check_run(run)
        check_chunk_size(chunk_size_bytes)
        check_options(zstd_level=zstd_level, delta=delta)
        self.max_staging_bytes = max_staging_bytes
        self.chunk_size_bytes, self.zstd_level, self.delta = chunk_size_bytes, zstd_level, delta
        self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="casstore-save")
        self._pending: cf.Future | None = None
        self._pending_step: int | None = None  # the step of _pending
        self._closed = False
        self._writable = False  # write access checked by the first save
        self.last_save_blocking_s: float | None = None
        self.last_save_info: SaveInfo | None = None
        self._committed: Manifest | None = None  # this object's last committed manifest
        self.last_staging_peak_bytes: int | None = None
        finish_at_exit(self, _finish_at_exit)

    def save(self, step: int, tree: Any, *, metadata: Any = None) -> None:
        """Starts saving ``tree`` as ``step``; returns once its arrays are staged.

        Waits for the previous save first. ``last_save_blocking_s`` records how long this call
        blocked, in seconds; ``last_save_info`` holds the :class:`casstore.SaveInfo` of the
        last save once :meth:`wait_until_finished` returned.

        Args:
          step: the step number, ``0 <= step < 10**16`` (an int, or an integer numpy or jax
            scalar).
          tree: the pytree (see :func:`casstore.save`).
          metadata: user metadata stored in the manifest (as :func:`casstore.save`'s).

        Raises:
          Any error of the previous background save (never only logged).
          UnsupportedLeafError: a leaf cannot be stored (raised here, before any write).
          ValueError: an invalid ``step``.
          PermissionError: the first save found the store not writable; nothing was stored.
          RuntimeError: the checkpointer is closed.
        """
        self._start(step, tree, metadata)

    def _start(self, step: int, tree: Any, metadata: Any, *, previous_step: int | None = None,
              then: Callable[[SaveInfo], None] | None = None,
              agreement: SaveAgreement | None = None) -> None:
        """:meth:`save` for :class:`CheckpointManager`: ``metadata`` is the manifest's as is.

        Args:
          previous_step: the run's latest committed step as the caller knows it (the base of
            deltas); None reads it from the store.
          then: called on the background thread with the save's info after the commit (the
            manager's retention); its error is the save's.
          agreement: the save's agreement between processes, made when the caller's save was
            called (None: made here, first).
        """
        t0, agreement = time.perf_counter(), agreement or SaveAgreement()
        with agreement.early():  # an error here fails this save on every process
            self._prepare_start(step, tree, metadata, previous_step, then, agreement, t0)

    def _prepare_start(self, step: int, tree: Any, metadata: Any, previous_step: int | None,
                       then: Callable[[SaveInfo], None] | None, agreement: SaveAgreement,
                       t0: float) -> None:
        """:meth:`_start`'s checks, staging and the background write."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        step = check_step(step)
        self.wait_until_finished()
        if not self._writable:  # fail here, not at the next call, without write access
            check_write_access(self.store, self.run, step)
            self._writable = True
        prepared, arrays = prepare(tree, metadata)
        # Blocks whose chunk the previous step stores are handed over as ids: blocks of jax
        # arrays whose id is remembered (_known_chunks) and, hashed here, numpy blocks over the
        # pack threshold (smaller numpy leaves are packed: copied anyway). Hashing numpy blocks
        # here pays where blocks repeat, so only after a save that reused more chunks than it
        # wrote (a frozen base); after one that did not (every leaf trained) they are copied
        # unhashed.
        previous, info = self._committed, self.last_save_info  # no request on this path
        if previous is not None and previous_step is not None and previous.step != previous_step:
            previous = None  # the manager's latest is another (its own retention deleted ours)
        if (previous is None and previous_step is not None  # a reopened manager: read once
                and any(isinstance(getattr(a, "source", a), jax.Array) for a in arrays.values())):
            previous = self._committed = self._read_committed(previous_step)
        hash_numpy = (previous is not None and info is not None
                      and info.reused_chunks > info.new_chunks
                      and any(isinstance(a, np.ndarray)
                              and a.nbytes > DEFAULT_PACK_THRESHOLD_BYTES
                              for a in arrays.values()))
        # without a cap, a shard of a few chunks is copied whole: one dispatch, no slices
        whole = 0 if self.max_staging_bytes is not None else 4 * self.chunk_size_bytes
        # accelerator arrays copied on their devices, where there is room, are the save's own:
        # their host copies are made in the background (_device_staging)
        arrays, later = copy_on_device(arrays)
        inline, jobs = plan_jobs(prepared, arrays, self.chunk_size_bytes,
                                 DEFAULT_PACK_THRESHOLD_BYTES, whole, later, agreement.per_host)
        del arrays
        # Lost chunks are staged with their bytes; the writer checks again under the save lock
        # (a collection in between may lose more: such a save fails and the next stages all).
        stored = ({r.id for leaf in previous.leaves for r in leaf.chunks}
                  - (lost_chunks(self.store, previous) if self.store.cheap_stat else set())
                  if previous else ())
        stream = StagingStream(jobs, self.max_staging_bytes, self.chunk_size_bytes, stored,
                               hash_numpy)
        self._pending_step = step
        self._pending = self._executor.submit(self._write, step, prepared, inline, stream,
                                              previous_step, then, previous, agreement)
        try:
            stream.fill()
            agreement.all_started()  # every process's call got this far, or each raises
        except BaseException as e:  # raised here, so not again by the next call: let it fail now
            stream.fail(e)
            pending, self._pending = self._pending, None
            cf.wait([pending])
            raise
        finally:
            self.last_staging_peak_bytes = stream.peak_bytes
            self.last_save_blocking_s = time.perf_counter() - t0

    def _read_committed(self, step: int) -> Manifest | None:
        """``step``'s manifest, read back after its commit (in the background); None if it
        cannot be read (the next save then copies its numpy blocks, as without it)."""
        try:
            return read_manifest(self.store, step, run=self.run)
        except (CasstoreError, OSError):
            return None

    def _write(self, step: int, prepared: Any, inline: dict, stream: StagingStream,
               previous_step: int | None, then: Callable[[SaveInfo], None] | None,
               previous: Manifest | None = None, agreement: SaveAgreement | None = None
               ) -> None:
        """The background half of a save: stores and commits ``stream``, then reads the
        committed manifest back for the next save's staging."""
        workers = self.store.max_workers
        try:
            self.last_save_info = write(
                self.store, step, prepared, inline, stream, run=self.run,
                zstd_level=self.zstd_level, shuffle=None, max_workers=workers,
                window=inflight_window(workers, self.chunk_size_bytes), delta=self.delta,
                previous_step=previous_step, previous=previous, agreement=agreement)
        except BaseException as e:  # the next save copies its blocks (its previous may be gone)
            stream.abandon()
            self._committed = None
            if isinstance(e, StoreTimeoutError):  # surfaces from wait_until_finished: the step
                raise e.at(run=self.run, step=step) from e
            raise
        self._committed = self._read_committed(step)
        if then is not None:
            then(self.last_save_info)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def is_saving_in_progress(self) -> bool:
        """True while a background save is running (no wait, no error)."""
        return self._pending is not None and not self._pending.done()

    def wait_until_finished(self) -> None:
        """Blocks until the background save is committed.

        Raises:
          The background save's error, if it failed (once; the next call succeeds); a store
            that stalls fails it within the store's deadline (StoreTimeoutError naming the
            step). StepAlreadyExistsError: the step existed; nothing was written.
        """
        if (pending := self._pending) is None:
            return
        # Forgotten only once it has ended: a wait that Ctrl-C (or a signal handler's
        # sys.exit) interrupts leaves the save for the next call to wait for and raise.
        error = pending.exception()
        self._pending = None
        if error is not None:
            if getattr(error, "step", None) is None:  # raised by a later call: say which step
                error.add_note(f"casstore: raised by the background save of step "
                               f"{self._pending_step} (url {self.store.url!r})")
            raise error

    def _join(self) -> None:
        """Blocks until the background save has ended, committed or not; an error it ended
        with stays for the next :meth:`wait_until_finished` or ``save`` to raise."""
        if (pending := self._pending) is not None:
            cf.wait([pending])

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
            forget_at_exit(self, _finish_at_exit)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        close_quietly(self.close, error)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.store!r}, run={self.run!r})"
