"""Save stage 4, uploads: chunk jobs -> stored chunks and their refs, on two thread pools.

Takes the plan's stream of :class:`~casstore._save_plan.Job` and a
:class:`~casstore._save_encode.ChunkWriter`; gives ``(leaf index, ChunkRef)`` for every block
of every job, once each new object is stored. One pool reads, hashes and encodes (the
writer), another puts the objects, and at most a window of jobs is in flight from read to
upload, so the bytes held stay bounded (format.md §7: chunks are stored before the manifest).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
from collections.abc import Iterable, Iterator

from ._errors import StoreTimeoutError
from ._known_chunks import remember
from ._manifest import ChunkRef
from ._pool import bounded_map, current_scope, in_scope
from ._save_encode import ChunkWriter
from ._save_plan import Job

# The most raw bytes a save keeps in flight by default, however many workers: with the encoded
# copies and the workers' zstd frames, a save's extra host memory stays under 2 GB (issue 12;
# 32 workers on the H100 machine's 16 cores held 1 GiB and peaked at 2.16 GB).
MAX_DEFAULT_INFLIGHT_BYTES = 768 << 20


def default_inflight_bytes(max_workers: int, chunk_size_bytes: int) -> int:
    """Raw bytes a save keeps in flight by default: two chunks per worker thread, at most
    ``MAX_DEFAULT_INFLIGHT_BYTES`` (but one chunk)."""
    return max(chunk_size_bytes,
               min(2 * max_workers * chunk_size_bytes, MAX_DEFAULT_INFLIGHT_BYTES))


def inflight_window(max_workers: int, chunk_size_bytes: int,
                    max_inflight_bytes: int | None = None) -> int:
    """Chunk jobs a save keeps in flight: ``max_inflight_bytes`` (default two chunks per
    worker) in chunks of at most ``chunk_size_bytes``.

    Raises:
      ValueError: ``max_inflight_bytes`` is less than one chunk (it was a window of none,
        taken as the default: a bound raised instead of lowered).
    """
    if max_inflight_bytes is None:
        max_inflight_bytes = default_inflight_bytes(max_workers, chunk_size_bytes)
    if not isinstance(max_inflight_bytes, int) or max_inflight_bytes < chunk_size_bytes:
        raise ValueError(f"max_inflight_bytes={max_inflight_bytes!r} is less than one chunk "
                         f"(chunk_size_bytes={chunk_size_bytes}): give at least that")
    return max_inflight_bytes // chunk_size_bytes


def store_chunks(jobs: Iterable[Job], writer: ChunkWriter, max_workers: int, window: int,
                 paths: list[str]) -> dict[int, list[ChunkRef]]:
    """Runs the jobs through two bounded thread pools; returns the chunk refs by leaf index.

    ``max_workers`` threads read, hash and encode; as many others upload, so the CPU work of
    later chunks overlaps the writes of earlier ones instead of waiting behind them (on a
    2-core VM's disk: 4.0 s instead of 5.4 s for a byte-plane save of the GPT-2-small state).
    A job holds its place in ``window`` until its upload is done, so the raw and encoded bytes
    in flight stay bounded as before.
    """

    def encode(job: Job) -> list[tuple[int, ChunkRef]] | cf.Future:
        i, start, stop, offset = job.blocks[0]
        block = (paths[i], start, stop) if len(job.blocks) == 1 and offset == 0 else None
        release = job.release
        try:
            with _naming(paths[i]):
                if job.copy is not None and not writer.is_stored(job.chunk_id):
                    job = job.copy()  # a remembered id the repository lacks: read and hash
                raw = job.read() if job.read is not None else None
                cid, stored, base, upload = writer.write(raw, job.element_size, block,
                                                         job.chunk_id)
                remember(job.members, cid)
        finally:
            if release is not None:
                release()
        refs = [(i, ChunkRef(cid, a, b, off, job.nbytes, stored, base))
                for i, a, b, off in job.blocks]
        return refs if upload is None else uploads.submit(in_scope(put, current_scope()),
                                                          paths[i], upload, refs)

    def put(path: str, upload: tuple[str, bytes], refs: list) -> list[tuple[int, ChunkRef]]:
        with _naming(path):
            writer.store.put(*upload)
        writer.stored(upload[1])
        return refs

    uploads = cf.ThreadPoolExecutor(max_workers)
    try:
        done = bounded_map(encode, jobs, max_workers, window)
    except BaseException as e:
        # No upload starts from here on (after a Ctrl-C, an encoding still running may read a
        # numpy leaf its caller writes to once we return); after a Ctrl-C none in flight is
        # waited for either.
        uploads.shutdown(wait=not isinstance(e, KeyboardInterrupt), cancel_futures=True)
        raise
    uploads.shutdown()
    refs: dict[int, list[ChunkRef]] = collections.defaultdict(list)
    for pairs in done:
        for i, ref in pairs:
            refs[i].append(ref)
    return refs


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    """Names the key path ``path`` in any exception raised in the body."""
    try:
        yield
    except StoreTimeoutError as e:
        raise e.at(key_path=path) from e
    except Exception as e:
        if hasattr(e, "add_note"):  # Python >= 3.11
            e.add_note(f"while saving key path {path!r}")
        raise
