"""Save stage 6, the commit: every process's chunk refs -> the manifest, written create-only.

Takes the :class:`~casstore._save_leaves.Prepared` tree, the bytes of its inline leaves and
the chunk refs of every array leaf (from all processes, after the agreement of
:mod:`casstore._multihost`); gives the committed step: the manifest (format.md §4) is
encoded, decoded again as a reader would (§4.4), and written create-only after every chunk it
references is stored (§7). Only process 0 runs this stage; with per-host local tiers the
others then write its bytes to their own (:func:`put_manifest_bytes`).
"""

from __future__ import annotations

import contextlib

from ._chunking import dtype_name
from ._errors import CasstoreError, StepAlreadyExistsError
from ._layout import manifest_key
from ._manifest import ChunkRef, LeafEntry, Manifest, decode_manifest, encode_manifest
from ._save_leaves import Prepared
from .store import Store


def check_absent(store: Store, run: str, step: int) -> None:
    """Raises StepAlreadyExistsError if ``step`` of ``run`` is committed; a save checks this
    first, so it refuses an existing step before writing anything (the create-only write of
    :func:`commit` is what makes it safe against a concurrent save)."""
    if store.exists(manifest_key(run, step)):
        raise StepAlreadyExistsError("step already exists", url=store.url, run=run, step=step)


def commit(store: Store, step: int, run: str, created: float, prepared: Prepared,
           inline: dict[int, bytes], refs: dict[int, list[ChunkRef]]) -> bytes:
    """Writes the manifest of ``step``; returns its bytes.

    Args:
      created: the save's start, seconds since the epoch.
      inline: the bytes of the leaves stored in the manifest, by leaf index.
      refs: the chunk refs of each array leaf, by leaf index, in any order.

    Raises:
      StepAlreadyExistsError: a concurrent save committed the step first.
      Any store error of the write, unless the manifest it stored is ours (a lost answer).
    """
    manifest = Manifest(run, step, created, prepared.metadata, prepared.node,
                        _entries(prepared, refs, inline))
    return _put_manifest(store, manifest_key(run, step), manifest)


def _entries(prepared: Prepared, refs: dict, inline: dict) -> tuple[LeafEntry, ...]:
    """The manifest's leaf entries, in leaf order (format.md §4.3)."""
    entries = dict(prepared.scalars)
    for i, a in prepared.arrays.items():
        entries[i] = LeafEntry(
            prepared.paths[i], "array", a.shape, dtype_name(a.dtype), a.is_jax, a.key_impl,
            a.sharding, inline.get(i), tuple(sorted(refs.get(i, ()), key=lambda r: r.start)))
    return tuple(entries[i] for i in range(len(prepared.paths)))


def put_manifest_bytes(store: Store, run: str, step: int, data: bytes | None) -> int:
    """A process other than 0 of a ``local_per_host`` save: writes the manifest process 0
    committed (``data``, its bytes) to this process's own local tier, create-only, after
    checking it decodes as ``step`` of ``run``; returns its size, bytes.

    Raises:
      CasstoreError: no manifest came from process 0, or this local tier holds process 0's
        own write of it (one directory given to several processes). As :func:`commit`
        otherwise.
    """
    if data is None:
        raise CasstoreError(f"process 0 sent no manifest of step {step} (run {run!r}) for "
                            f"the local tier {store.url!r}")
    decode_manifest(data, run=run, step=step, url=store.url)
    try:
        return len(_put_bytes(store, manifest_key(run, step), data, run, step))
    except StepAlreadyExistsError as e:
        if store.head(manifest_key(run, step), len(data) + 1) != data:
            raise
        raise CasstoreError(  # process 0's own write, seen here
            f"the local tier {store.url!r} already holds process 0's manifest of step {step} "
            f"(run {run!r}), byte for byte: with local_per_host each process needs a "
            "directory of its own, and this one looks shared with process 0") from e


def withdraw_manifest(store: Store, run: str, step: int, data: bytes | None) -> None:
    """Deletes this tier's manifest of ``step`` of ``run`` if it is ``data``, byte for byte
    (format.md §8: the step's chunks stay for GC): a ``local_per_host`` save that another
    process could not copy is withdrawn from every process's tier, so that none lists it."""
    key = manifest_key(run, step)
    with contextlib.suppress(FileNotFoundError):  # (another process's, in a shared one)
        if data is not None and store.head(key, len(data) + 1) == data:
            store.delete(key)


def _put_manifest(store: Store, key: str, manifest: Manifest) -> bytes:
    """Writes the manifest create-only after checking it decodes (format.md §4.4, §7)."""
    data = encode_manifest(manifest)
    decode_manifest(data, run=manifest.run, step=manifest.step, url=store.url)
    return _put_bytes(store, key, data, manifest.run, manifest.step)


def _put_bytes(store: Store, key: str, data: bytes, run: str, step: int) -> bytes:
    """Writes the checked manifest ``data`` create-only (format.md §7); returns it."""
    try:
        store.put_if_absent(key, data)
    except FileExistsError:
        raise StepAlreadyExistsError("step was committed by a concurrent save", url=store.url,
                                     run=run, step=step) from None
    except Exception:
        # The write may have been stored before the error (a lost response): if the manifest
        # there is ours, the commit happened.
        try:
            committed = store.head(key, len(data) + 1) == data
        except Exception:  # still unknown: report the original error
            committed = False
        if not committed:
            raise
    return data
