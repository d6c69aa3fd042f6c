"""Copy checkpoints between repositories (local, S3, GCS, any pair), moving only missing chunks.

Follows the commit rule of format.md §7 at the destination: a step's chunks are all stored
(each verified against its chunk id as it passes) before its manifest is written create-only,
so an interrupted copy leaves no partial step, and running it again sends only what is missing.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from ._delta import DeltaBases
from ._errors import CorruptChunkError, StepNotFoundError, StoreTimeoutError
from ._layout import chunk_key, manifest_key
from ._locks import save_lock
from ._manifest import Manifest
from ._pool import bounded_map
from ._repository import (
    Url,
    ensure_config,
    list_chunk_objects,
    list_runs,
    list_steps,
    read_manifest,
)
from .store import open_store


@dataclasses.dataclass(frozen=True, slots=True)
class CopyInfo:
    """What one :func:`copy` did.

    Attributes:
      steps_copied: ``(run, step)`` pairs whose manifests were written at the destination.
      steps_skipped: ``(run, step)`` pairs the destination already had.
      chunks_copied, bytes_copied: chunk objects sent (stored bytes).
      chunks_skipped, bytes_skipped: referenced chunks the destination already had.
      seconds: wall time.
    """

    steps_copied: tuple[tuple[str, int], ...]
    steps_skipped: tuple[tuple[str, int], ...]
    chunks_copied: int
    bytes_copied: int
    chunks_skipped: int
    bytes_skipped: int
    seconds: float


def copy(src_url: Url, dst_url: Url, *, steps: list[int] | None = None,
         runs: list[str] | None = None, max_workers: int | None = None) -> CopyInfo:
    """Copies checkpoints from one repository to another.

    Lists the destination's chunks once, then for each selected step: reads and validates the
    source manifest, copies the chunk objects the destination lacks, delta objects and their
    bases included (reading each from the source, checking its length and chunk id, a delta
    rebuilt on its base, and writing it as read), and writes the manifest last, create-only.
    The destination holds a save lock meanwhile, so its garbage collection cannot interfere.

    Args:
      src_url, dst_url: paths, fsspec URLs or Stores.
      steps: the steps to copy (in every selected run); None copies all.
      runs: the runs to copy; None copies every run of the source.
      max_workers: concurrent chunk transfers (default the destination store's).

    Returns:
      A :class:`CopyInfo`.

    Raises:
      StepNotFoundError: a step named in ``steps`` is in none of the selected runs.
      CorruptChunkError: a source chunk fails its checks (nothing more of that step is written;
        its manifest is not written).
      ManifestError: a source manifest is invalid.
      StoreTimeoutError: either store did not answer within its deadline (names the object and,
        for a chunk, run, step, key path and chunk id); the step's manifest is not written.
    """
    t0 = time.perf_counter()
    src, dst = open_store(src_url), open_store(dst_url)
    selected = [(run, step) for run in (runs if runs is not None else list_runs(src))
                for step in list_steps(src, run=run) if steps is None or step in steps]
    for step in steps or ():
        if not any(s == step for _, s in selected):
            raise StepNotFoundError("step not in the source", url=src.url, step=step)
    ensure_config(dst)
    copied, skipped_steps = [], []
    counts = {"copied": 0, "bytes_copied": 0, "skipped": 0, "bytes_skipped": 0}
    lock = threading.Lock()
    with save_lock(dst):
        present = {info.key: info.size for info in list_chunk_objects(dst)}
        for run, step in selected:
            key = manifest_key(run, step)
            if dst.exists(key):
                skipped_steps.append((run, step))
                continue
            manifest = read_manifest(src, step, run=run)
            needed = _needed_objects(manifest)
            # A base and the deltas on it side by side, read from the source once for all.
            missing = sorted((k for k in needed if k not in present),
                             key=lambda k: needed[k][1] or needed[k][0])
            bases = DeltaBases(src, [needed[k][:2] for k in missing])
            with lock:
                counts["skipped"] += len(needed) - len(missing)
                counts["bytes_skipped"] += sum(present[k] for k in needed if k in present)

            def transfer(obj: str, run=run, step=step, needed=needed, bases=bases) -> None:
                cid, base, raw_length, path = needed[obj]
                try:
                    data = bases.read(obj, cid, base)
                    bases.decode(data, cid, base, raw_length)
                    dst.put(obj, data)
                except CorruptChunkError as e:
                    raise CorruptChunkError(f"source chunk unusable: {e}", url=src.url, run=run,
                                            step=step, key_path=path, chunk_id=cid) from e
                except StoreTimeoutError as e:
                    raise e.at(run=run, step=step, key_path=path, chunk_id=cid) from e
                with lock:
                    present[obj] = len(data)
                    counts["copied"] += 1
                    counts["bytes_copied"] += len(data)

            bounded_map(transfer, missing, max_workers or dst.max_workers)
            try:
                dst.put_if_absent(key, src.get(key))
                copied.append((run, step))
            except FileExistsError:  # written concurrently by someone else
                skipped_steps.append((run, step))
    return CopyInfo(tuple(copied), tuple(skipped_steps), counts["copied"], counts["bytes_copied"],
                    counts["skipped"], counts["bytes_skipped"], time.perf_counter() - t0)


def _needed_objects(manifest: Manifest) -> dict[str, tuple[str, str | None, int, str]]:
    """Object key -> ``(chunk id, base or None, raw bytes, key path)`` for every object a
    restore of ``manifest`` reads: chunk objects, delta objects and their bases (format.md
    §3.5)."""
    needed = {}
    for leaf in manifest.leaves:
        for r in leaf.chunks:
            needed[r.key] = (r.id, r.base, r.raw_bytes, leaf.path)
            if r.base is not None:
                needed.setdefault(chunk_key(r.base), (r.base, None, r.raw_bytes, leaf.path))
    return needed
