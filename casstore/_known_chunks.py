"""Chunk ids of the blocks of live jax arrays, remembered from the save that hashed them or
the restore that checked them.

A ``jax.Array`` never changes its value while the object lives: jax itself caches the host
copy that ``np.asarray`` makes on the array (``_npy_value``) on that promise, and a donated
array is deleted, not changed. So a chunk (a block of one leaf, or a pack of small leaves,
format.md §3.3, §3.4) whose bytes a save hashed has the same content address at every later
save of the same array objects, in the same stored dtypes and bounds. Such a save plans the
chunk with its remembered id and no bytes: where the repository stores it (the run's latest
manifest names it) nothing is copied from the device or hashed again, which is what a save of
a frozen base or an unchanged state costs on an accelerator (a device-to-host copy of every
block, then a hash of it); where it does not, the save copies and hashes the block as any
other. A restore that placed a chunk's bytes unchanged into a jax array (no cast, the saved
shape) remembers its id too, so the first save after resuming from a checkpoint does not read
a frozen base back from the device either. numpy arrays are mutable and are never remembered.

Entries hold weak references only, so a remembered array is freed as soon as the caller drops
it; entries of freed arrays are swept as the table grows.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import jax

from ._chunking import CastView
from ._manifest import LeafEntry

# (id(array), stored dtype, start, stop, byte offset) of every block of a chunk
Key = tuple[tuple[int, Any, tuple, tuple, int], ...]

_lock = threading.Lock()
_ids: dict[Key, tuple[tuple[weakref.ref, ...], str]] = {}
_swept_at = 1024  # the table's size after its last sweep, at least this
_arrays: dict[int, weakref.ref] = {}  # id(array) of every array with an entry in _ids
_originals: dict[int, weakref.ref] = {}  # id(copy) -> the array a device copy stands in for


class Members:
    """The blocks of one chunk as the table names them: weak references to their arrays.

    Attributes:
      key: the table's key.
      refs: a weak reference to each block's jax.Array, in ``key``'s order.
    """

    __slots__ = ("key", "refs")

    def __init__(self, key: Key, refs: tuple[weakref.ref, ...]):
        self.key, self.refs = key, refs

    def alive(self) -> bool:
        """True while every array is alive and not deleted (donated)."""
        return all((a := r()) is not None and not a.is_deleted() for r in self.refs)


def members(blocks: Sequence[tuple[Any, tuple, tuple, int]]) -> Members | None:
    """The table's name of a chunk of ``(leaf, start, stop, byte offset)`` blocks; None unless
    every leaf is a jax.Array (or a stored-dtype CastView of one)."""
    key, refs = [], []
    for leaf, start, stop, offset in blocks:
        array, dtype = (leaf.source, leaf.dtype) if isinstance(leaf, CastView) else (
            leaf, getattr(leaf, "dtype", None))
        if not isinstance(array, jax.Array):
            return None
        ref = _originals.get(id(array))
        if ref is not None and (original := ref()) is not None:
            array = original  # a save's device copy (_device_staging) is named as its source
        key.append((id(array), dtype, tuple(start), tuple(stop), offset))
        refs.append(weakref.ref(array))
    return Members(tuple(key), tuple(refs))


def known(chunk: Members | None) -> str | None:
    """The chunk id remembered for ``chunk``, if its arrays are the ones it was hashed from and
    are alive; else None."""
    if chunk is None:
        return None
    with _lock:
        entry = _ids.get(chunk.key)
    if entry is None or not chunk.alive() or any(r() is not a()
                                                 for r, a in zip(entry[0], chunk.refs)):
        return None  # alive: a() is an array, so a dead r() (None) is not it
    return entry[1]


def remember(chunk: Members | None, cid: str) -> None:
    """Remembers ``cid`` as the id of ``chunk``'s bytes (hashed from those arrays); no-op for
    None or a chunk whose arrays are gone."""
    global _swept_at
    if chunk is None or not chunk.alive():
        return
    with _lock:
        _ids[chunk.key] = chunk.refs, cid
        _arrays.update((k[0], r) for k, r in zip(chunk.key, chunk.refs))
        if len(_ids) > 2 * _swept_at:
            for key in [k for k, (refs, _) in _ids.items()
                        if any(r() is None for r in refs)]:
                del _ids[key]
            for k in [k for k, r in _arrays.items() if r() is None]:
                del _arrays[k]
            _swept_at = max(1024, len(_ids))


def remembered(array: jax.Array) -> bool:
    """True if an id is remembered for a chunk of ``array`` (a save or restore hashed it)."""
    with _lock:
        ref = _arrays.get(id(array))
    return ref is not None and ref() is array


def stand_in(copy: jax.Array, original: jax.Array) -> None:
    """Names ``copy`` (a device copy a save made of ``original``) as ``original`` in this
    table for as long as ``copy`` lives, so the ids hashed from it are ``original``'s."""
    _originals[id(copy)] = weakref.ref(original)
    weakref.finalize(copy, _originals.pop, id(copy), None)


def size() -> int:
    """Entries in the table (those of freed arrays included until the next sweep)."""
    with _lock:
        return len(_ids)


def remember_restored(value: Any, entry: LeafEntry, saved_dtype: Any) -> None:
    """Remembers the ids of the chunks a restore placed into ``value``: each chunk that holds
    one whole block of the array leaf ``entry`` (not a pack of several leaves), where
    ``value`` is a jax.Array of the saved shape and dtype ``saved_dtype`` (no cast, no pad or
    truncation: its bytes are the chunks' bytes, whose ids the restore checked)."""
    if (entry.kind != "array" or not isinstance(value, jax.Array)
            or tuple(value.shape) != tuple(entry.shape) or value.dtype != saved_dtype):
        return
    for ref in entry.chunks:
        if ref.offset == 0 and ref.raw_bytes == value.dtype.itemsize * math.prod(
                b - a for a, b in zip(ref.start, ref.stop)):
            remember(members([(value, ref.start, ref.stop, 0)]), ref.id)
