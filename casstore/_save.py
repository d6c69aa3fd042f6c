"""Saving a pytree as a content-addressed checkpoint: the save pipeline, stage by stage.

:func:`save` is the list of its stages, each a module with one job (format.md §3, §4, §7, §8;
the data flow is drawn in docs/design-notes.md, "The save pipeline"):

1. :mod:`casstore._save_leaves`: the tree -> its checked leaves (nothing written yet);
   :mod:`casstore._stored_dtype` then casts the leaves ``dtypes`` selects, lazily;
2. :mod:`casstore._save_plan`: leaves -> a lazy stream of chunk jobs (§3.3, §3.4);
3. :mod:`casstore._save_encode`: a job's bytes -> chunk id and the object to store, if the
   repository lacks it (§3.1, §3.2, §3.5, §8);
4. :mod:`casstore._save_upload`: the stream through two bounded thread pools -> stored chunks
   and their refs (§7: chunks before the manifest);
5. :mod:`casstore._multihost`: every process's refs -> process 0, and the outcome back (§7);
6. :mod:`casstore._save_commit`: refs -> the manifest, written create-only (§4, §7).

:func:`write` is stages 3 to 6, which the manager's background save runs on its own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

from ._chunking import (
    DEFAULT_CHUNK_SIZE_BYTES,
    DEFAULT_PACK_THRESHOLD_BYTES,
    check_chunk_size,
    check_options,
)
from ._codec import DEFAULT_ZSTD_LEVEL
from ._compression import chunk_settings
from ._errors import CasstoreError, StoreTimeoutError
from ._layout import check_run, check_step, manifest_key
from ._locks import refuse_read_only, save_lock
from ._manifest import Manifest
from ._multihost import SaveAgreement
from ._repository import Url, ensure_config, list_runs, still_committed
from ._save_commit import check_absent, commit, put_manifest_bytes, withdraw_manifest
from ._save_encode import ChunkWriter, previous_manifest
from ._save_leaves import Prepared, prepare
from ._save_plan import Job, plan_jobs
from ._save_upload import inflight_window, store_chunks
from ._stored_dtype import stored_as
from .store import Store, open_store


@dataclasses.dataclass(frozen=True, slots=True)
class SaveInfo:
    """What one :func:`save` did; with several ``jax.distributed`` processes, the whole save
    (every process's chunks), the same on every process.

    Attributes:
      step, run: the checkpoint written.
      logical_bytes: raw bytes of all array leaves, in their stored dtypes.
      written_bytes: bytes actually uploaded: new chunk objects plus the manifest (once per
        local tier with a manager's ``local_per_host``).
      new_chunks: chunks uploaded by this save.
      reused_chunks: chunks the save cut its leaves into (a pack of small leaves is one) that
        were stored already, or uploaded earlier in the same save (identical blocks).
      manifest_bytes: size of the manifest object.
      seconds: wall time of the save.
      delta_chunks: new chunks stored as deltas against the run's previous step (format.md
        §3.5).
      delta_saved_bytes: bytes those deltas saved against storing the same chunks whole:
        their whole size estimated on the samples the codec choice is made on, minus the
        deltas' encoded size.
    """

    step: int
    run: str
    logical_bytes: int
    written_bytes: int
    new_chunks: int
    reused_chunks: int
    manifest_bytes: int
    seconds: float
    delta_chunks: int = 0
    delta_saved_bytes: int = 0

    @property
    def dedup_ratio(self) -> float:
        """``logical_bytes / written_bytes``: how many times smaller the save was than the state."""
        return self.logical_bytes / max(self.written_bytes, 1)



def save(url: Url, step: int, tree: Any, *, run: str = "default", metadata: Any = None,
         chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES,
         pack_threshold_bytes: int = DEFAULT_PACK_THRESHOLD_BYTES,
         zstd_level: int = DEFAULT_ZSTD_LEVEL, shuffle: bool | None = None,
         dtypes: dict[str, Any] | None = None, max_workers: int | None = None,
         max_inflight_bytes: int | None = None, delta: bool = True,
         compression: str | None = None) -> SaveInfo:
    """Saves ``tree`` as checkpoint ``step`` of ``run``.

    Writes, in this order (format.md §7): the config object if the repository is new; every
    chunk the repository lacks; then the manifest, create-only. Which chunks exist is learned
    from the run's latest manifest and, for any other chunk, one ``stat`` of its key, so the
    cost of a save follows the size of the state, not of the repository. Arrays are cut along
    shard boundaries into chunks of at most ``chunk_size_bytes`` (format.md §3.3); leaves of at
    most ``pack_threshold_bytes`` are packed together and leaves of at most 64 bytes are stored
    inline in the manifest (§3.4).

    The chunks stream through ``max_workers`` threads that read, hash and encode them and as
    many that upload them, with at most ``max_inflight_bytes`` of blocks in flight from read to
    upload, so encoding overlaps writing and host memory does not grow with the state:
    numpy and CPU-device arrays are read in place (no copy), and an accelerator's shards are
    copied to host memory one block at a time, each copy started as its block enters the
    window, so device-to-host copies of later blocks overlap hashing and writing of earlier
    ones. The caller's arrays must not change until this returns. A jax array saved again as
    the same object (a frozen base, an unchanged state) is neither copied nor hashed again
    where the run's latest step stores its chunks: the ids hashed from it at an earlier save
    in this process are remembered while it lives (``casstore._known_chunks``). This takes jax
    arrays as immutable, as jax does; an array whose buffer is written behind jax's back (a
    DLPack view of a tensor another library then writes in place) must be saved as a new
    array.

    Args:
      url: a path, an fsspec URL or a Store.
      step: the step number, ``0 <= step < 10**16``: an int, or an integer numpy or jax scalar
        (such as a train state's ``step``), stored as its int.
      tree: a pytree (dict / list / tuple / namedtuple / registered dataclasses, flax and equinox
        nodes) whose leaves are numpy or jax arrays of the dtypes of format.md §4.5 (typed PRNG
        keys included), Python bool / int / float / complex / str / bytes, or None.
      run: the run name.
      metadata: user metadata stored in the manifest (format.md §4.1: None, bool, int, float,
        str, bytes, list or tuple, dict with keys of those scalar types; nested at most 256
        deep, at most 1 MiB encoded).
      chunk_size_bytes: the largest chunk, bytes (default 16 MiB).
      pack_threshold_bytes: leaves up to this size are packed (default 64 KiB).
      zstd_level: zstd compression level (the chunk id does not depend on it).
      shuffle: True: the byte-plane codec on array chunks (codec 5, format.md §3.2) wherever
        it saves 1/8: each byte plane that compresses (the exponent bytes of floats, the
        sign bit moved below them) as a zstd frame, the others as is; about 18% fewer bytes
        on trained float32 for about 2x the CPU time of the save and of its restores. False
        keeps codec 5 only where it saves 1/4 (adam's moments) and stores barely
        compressible floats raw. None (the default): ``compression`` decides, unless the
        store's ``shuffle`` is set False (then as False).
      compression: with ``shuffle`` None, how the codec is chosen (docs/tuning.md):
        ``"auto"`` the encoding (byte planes or raw chunks) whose save is fastest on this
        store, from the store's ``write_bytes_per_s``, the codec's measured throughput per
        core and the cores: raw chunks on a local disk with fewer than 4 cores, byte planes
        on an object store; ``"speed"`` the one whose save plus one restore is fastest;
        ``"bytes"`` byte planes everywhere (the fewest bytes). None: the store's
        ``compression`` (``"auto"``). Chunk ids do not depend on it, so it never breaks
        dedup.
      dtypes: key-path prefix (format.md §5, e.g. ``"params"``; ``""`` is the whole tree) ->
        the dtype (or its format.md §4.5 name) its array leaves are stored in, as orbax's
        ``SaveArgs(dtype=...)``; the longest matching prefix wins. Each block is cast as its
        chunk is written (no full-size copy; on an accelerator, on the device before its host
        copy), chunks are cut and named by the stored bytes (so they dedup with any save of
        the same stored values), the manifest records the stored dtype (format.md §4.6), and
        restore returns it unless the target asks for another. E.g. ``{"params":
        jnp.bfloat16}`` halves a float32 model's bytes. Casts stay within a kind (bool,
        integer, floating, complex); a leaf under a prefix keeps its dtype through a longer
        prefix mapped to None (or to its own dtype; a PRNG key array, stored as its key data,
        to its key dtype or its key data's): ``{"": jnp.bfloat16, "opt_state/count": None,
        "rngs": None}``. None stores every leaf in its own dtype.
      max_workers: threads for hashing and compression, and as many for uploads (default the
        store's, which follows the number of cores).
      max_inflight_bytes: raw bytes of blocks read but not yet uploaded, at most (default two
        chunks per worker, at most 768 MiB: 512 MiB with 16 workers and 16 MiB chunks); the
        encoded copies add at most as much again, and each worker holds up to half a chunk
        more while it compresses (a zstd frame and its verification).
      delta: store a changed block as the XOR with the same block (same key path and bounds)
        of the run's latest step when that saves 1/8 of the block stored whole, 1/4 of a block
        that would be stored raw (format.md §3.5): about 0.3 of the raw size on fine-tuned
        float32 weights, where the block alone takes 0.83.
        Each such block costs one read of its base chunk (from the store) at save, and a
        restore reads the delta and its base, so a save takes deltas only while their bytes
        stay within 0.15 of its step's bytes stored whole (:class:`RestoreBudget`): a restore
        reads at most about 1.15x what it would without deltas, and where deltas save little
        (pretraining) most blocks are stored whole. A block whose delta did not pay at the previous
        save (stored whole there and at the step before) tries again only one save in four
        (:func:`unpaid_blocks`), so adam's moments do not cost a read of their base per save.
        Manifests with deltas are format version 2, which casstore before 2026-11 refuses to
        read. False stores every new chunk whole.

    Returns:
      A :class:`SaveInfo`; its ``logical_bytes`` count the stored dtypes.

    Raises:
      StepAlreadyExistsError: the step exists (checked first, and again by the create-only
        manifest write); nothing visible changes.
      UnsupportedLeafError: a leaf cannot be stored, or not in the dtype ``dtypes`` asks for (a
        cast to another kind of dtype, such as float to int; a PRNG key array; a non-key leaf
        to a key dtype); names its key path. Raised before any write. Also, as the leaf is
        written, for a value the stored dtype cannot hold (an integer out of its range, a
        finite float beyond its range: never wrapped or overflowed); no manifest is written.
      ValueError: invalid ``step``, ``run``, ``chunk_size_bytes`` (an int in [1, 2**31],
        at least one element of every array leaf), ``metadata`` that msgpack cannot encode
        or format.md §4.1 does not allow (an extension type: the message says where),
        a ``dtypes`` prefix that matches no array leaf, an unknown ``compression``, a
        ``max_inflight_bytes`` of less than one chunk, ``zstd_level`` (an int up to 22),
        ``max_workers`` (at least 1), ``pack_threshold_bytes`` or a ``delta`` or ``shuffle``
        that is no bool.
      ManifestError: the repository's config object is damaged or of an unknown version.
      StoreTimeoutError: an object store did not answer within its deadline (``open_store``'s
        ``operation_timeout_s``); nothing is committed (unless the manifest write was stored
        and only its answer was lost: then the step is complete).
    """
    t0, agreement = time.perf_counter(), SaveAgreement()  # first, on every process (stage 5)
    with agreement.early():
        store, step = open_store(url), check_step(step)
        manifest_key(check_run(run), step)
        check_chunk_size(chunk_size_bytes)
        check_options(zstd_level=zstd_level, max_workers=max_workers, delta=delta,
                      pack_threshold_bytes=pack_threshold_bytes, shuffle=shuffle, dtypes=dtypes)
        # 1. the leaves, checked and in their stored dtypes
        prepared, arrays = stored_as(*prepare(tree, metadata), dtypes)
        # 2. the plan: inline leaves now, chunk jobs as a lazy stream
        inline, jobs = plan_jobs(prepared, arrays, chunk_size_bytes, pack_threshold_bytes)
        workers = int(max_workers or store.max_workers)  # a numpy int too
        window = inflight_window(workers, chunk_size_bytes, max_inflight_bytes)
    del arrays  # the jobs hold what they still need
    try:  # 3 to 6: encode, upload, agree, commit
        return write(store, step, prepared, inline, jobs, run=run, zstd_level=zstd_level,
                     shuffle=shuffle, compression=compression, max_workers=workers,
                     window=window, delta=delta, t0=t0, agreement=agreement)
    except StoreTimeoutError as e:  # the key path is known where it stalled, the step here
        raise e.at(run=run, step=step) from e
    except OSError as e:
        if not isinstance(e, CasstoreError):  # a full disk names its file, not the step
            e.add_note(f"casstore: while saving step {step} (run {run!r}) to {store.url}")
        raise


def write(store: Store, step: int, prepared: Prepared, inline: dict[int, bytes],
          jobs: Iterable[Job], *, run: str, zstd_level: int, shuffle: bool | None,
          max_workers: int, window: int, delta: bool = True, previous_step: int | None = None,
          t0: float | None = None, compression: str | None = None,
          previous: Manifest | None = None, agreement: SaveAgreement | None = None
          ) -> SaveInfo:
    """Stores the chunks of ``jobs`` and commits the step (stages 3 to 6 of :func:`save`).

    Args:
      jobs: the chunks, consumed lazily with at most ``window`` in flight.
      shuffle, compression, delta: as :func:`save`'s.
      previous_step: a step of ``run`` known to be committed (the manager's latest), whose
        manifest tells which chunks exist and is the base of deltas; None reads the run's
        latest.
      previous: that manifest, read already (the one ``jobs`` were staged against: jobs
        without bytes name chunks it references); None reads it here.
      agreement: the save's agreement between processes, made when the save was called
        (None: made here).

    Raises:
      As :func:`save`.
    """
    t0 = time.perf_counter() if t0 is None else t0
    agreement = agreement or SaveAgreement()
    agreement.describe(run, step, prepared.node, prepared.paths, prepared.arrays)
    with agreement.early():
        refuse_read_only(store, run, step)
        shuffle, compress = chunk_settings(store, shuffle, compression, max_workers)
        created = time.time()
        check_absent(store, run, step)
    with agreement.early(), save_lock(store) as lease:
        with agreement.committing():
            if agreement.is_primary or agreement.per_host:  # per_host: each its own tier
                ensure_config(store)
            if previous is not None and not still_committed(store, previous):
                previous = None  # deleted (or saved again) since: its chunks not known stored
            previous = previous or previous_manifest(store, run, previous_step)
            # No committed step anywhere: no chunk to reuse, so none is looked up (one HEAD per
            # chunk saved on an object store).
            lookup = previous is not None or bool(list_runs(store))
            # 3. encoding, as each job's bytes are read
            writer = ChunkWriter(store, previous, zstd_level, shuffle, delta, lookup, compress,
                                 window)
            # 4. uploads: every chunk this process stores, before any manifest
            refs = store_chunks(jobs, writer, max_workers, window, prepared.paths)
            # 5. the agreement: every process's refs (and counts) on process 0
            agreement.counts = [writer.written, writer.new, writer.reused, writer.deltas,
                                writer.delta_saved]
            every_refs = agreement.gather_refs(refs, store)
            # 6. the commit, on process 0 (the outcome is posted as `committing` ends)
            if every_refs is not None:
                lease.check()  # GC kept off the chunks all along
                agreement.manifest = commit(store, step, run, created, prepared, inline,
                                            every_refs)
                agreement.manifest_bytes = len(agreement.manifest)
        if agreement.per_host:  # process 0's manifest on every process's tier, or on none
            agreement.confirm_copies(
                lambda: agreement.is_primary or put_manifest_bytes(store, run, step,
                                                                   agreement.manifest),
                lambda: withdraw_manifest(store, run, step, agreement.manifest))
    written, new, reused, deltas, saved = agreement.totals or agreement.counts
    manifest_bytes = agreement.manifest_bytes  # written once, or to each tier (per_host)
    written += manifest_bytes * (agreement.count if agreement.per_host else 1)
    return SaveInfo(step, run, prepared.logical_bytes, written, new, reused, manifest_bytes,
                    time.perf_counter() - t0, deltas, saved)
