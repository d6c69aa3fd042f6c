"""Reading the chunks a restore needs into host arrays (format.md §3.2, §3.5, §6).

Takes, per array leaf, the index regions a target needs (:func:`regions_for`), fetches every
chunk overlapping them once, verifies its length and chunk id, and copies (or decodes straight)
its blocks into 64-byte-aligned host arrays; :func:`read_fitted` does the same for regions that
reach past the saved shape (``strict=False``), zero-padding them.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable, Collection
from typing import Any

import jax
import numpy as np

from ._buffers import empty_aligned
from ._chunking import Index
from ._codec import HEADER, max_object_bytes, verify_raw
from ._delta import DeltaBases
from ._errors import (
    CorruptChunkError,
    MissingChunkError,
    StoreTimeoutError,
    UnsupportedFormatError,
)
from ._fallback import FallbackStore, confirm_chunk, reread_chunk
from ._manifest import ChunkRef, LeafEntry, Manifest
from ._place import normalize, saved_dtype
from ._pool import bounded_map
from ._target import is_numpy_class, target_shape
from .store import Store


def regions_for(entry: LeafEntry, t: Any) -> list[Index]:
    """The index regions of the saved array that target leaf ``t`` needs on this process.

    One region per distinct addressable shard for a jax target with a sharding (format.md §6),
    else the whole array. Regions are in the target's shape, which may reach past the saved
    shape with ``strict=False`` (:func:`read_fitted` clips them).
    """
    shape = target_shape(t)  # differs from the saved shape only for strict=False
    whole = ((0,) * len(entry.shape), entry.shape if shape is None or entry.kind != "array"
             else shape + entry.shape[len(shape):])
    sharding = getattr(t, "sharding", None)
    if entry.kind != "array" or not isinstance(sharding, jax.sharding.Sharding) or isinstance(
            t, np.ndarray) or is_numpy_class(t):
        return [whole]
    tail = entry.shape[len(t.shape):]  # the key-data dimensions of PRNG key leaves
    indices = sharding.addressable_devices_indices_map(tuple(t.shape)).values()
    return list(dict.fromkeys(normalize(index, t.shape, tail) for index in indices))


def read_regions(store: Store, manifest: Manifest, requests: dict[int, list[Index]],
                 max_workers: int, place: Callable[[int, dict], Any] | None = None,
                 temporary: Collection[int] = (),
                 given: dict[int, dict[Index, np.ndarray]] | None = None) -> dict[int, Any]:
    """Reads index regions of array leaves into host arrays (format.md §6), leaf by leaf.

    Only the chunks whose blocks overlap a requested region are fetched, each once (a delta
    chunk with its base, format.md §3.5; a base that several deltas share once, held until the
    last of them is rebuilt), with at most ``2 * max_workers`` in flight, no further than one
    byte past the largest encoding of its chunk (format.md §3.2: a larger object is corrupt),
    and verified before its blocks are copied into every region they overlap. A chunk that
    overlaps in part is read whole.
    Chunks are fetched in leaf order, and as soon as a leaf's last chunk is in, ``place``
    turns its regions into the value returned for it (e.g. jax arrays on their devices) and
    its host buffers are released, so host memory holds the leaves in progress, not the
    state. Region buffers are 64-byte aligned, so jax's CPU client can adopt them in place.

    Args:
      requests: leaf index -> ``(start, stop)`` regions wanted (array leaves only).
      place: ``(leaf index, {region: host array}) -> value``, called once per leaf from a
        worker thread; None keeps the host arrays.
      temporary: leaves whose host arrays ``place`` does not keep (it puts them on a GPU):
        their large buffers are mapped on their own, so memory goes back to the OS as each
        leaf is placed.
      given: leaf index -> {region: array of the region's shape and the saved dtype, possibly
        a strided view} to read those regions into instead of new buffers.

    Returns:
      leaf index -> ``place``'s value, or {region: host array of the region's shape,
      little-endian saved dtype} without ``place``.

    Raises:
      CorruptChunkError: a chunk fails its checks; names step, key path, chunk id.
      MissingChunkError: a chunk object (or a delta chunk's base) is missing; names the same.
    """
    out: dict[int, Any] = {}
    users: dict[str, list[tuple[int, ChunkRef]]] = collections.defaultdict(list)
    pending: dict[int, set[str]] = {}
    lock = threading.Lock()
    for i, regions in requests.items():
        entry = manifest.leaves[i]
        mine = (given or {}).get(i, {})
        out[i] = {r: mine[r] if r in mine else empty_aligned(
            [b - a for a, b in zip(*r)], saved_dtype(entry), i in temporary) for r in regions}
        if entry.inline is not None:
            whole = np.frombuffer(entry.inline, saved_dtype(entry)).reshape(entry.shape)
            for (start, stop), buf in out[i].items():
                buf[...] = whole[tuple(slice(a, b) for a, b in zip(start, stop))]
        needed = [ref for ref in entry.chunks if entry.inline is None
                  and any(_overlap((ref.start, ref.stop), r) for r in regions)]
        for ref in needed:
            users[ref.key].append((i, ref))
        pending[i] = {ref.key for ref in needed}

    def finish(i: int) -> None:
        if place is not None:
            out[i] = place(i, out[i])

    buffers = threading.local()  # one read buffer per worker thread, reused chunk after chunk
    bases = DeltaBases(store, [(refs[0][1].id, refs[0][1].base) for refs in users.values()
                               if refs[0][1].base is not None])  # objects: read into buffers

    def fetch(key: str) -> None:
        blocks = users[key]
        first = blocks[0][1]
        cid = first.id
        into, failed = _destination(blocks, out), None
        try:
            if into is not None and first.base is None and _read_in_place(store, key, first,
                                                                          into):
                raw = into
            else:
                data, buffers.read = store.get_into(key, getattr(buffers, "read", None),
                                                    max_object_bytes(first.raw_bytes))
                raw = bases.decode(data, cid, first.base, first.raw_bytes, into)
                confirm_chunk(store, key, first.base)  # a tier's copy: now written back
        except (FileNotFoundError, CorruptChunkError, UnsupportedFormatError) as e:
            failed = e  # read again below, outside this handler: its errors keep their own
        except StoreTimeoutError as e:
            raise e.at(run=manifest.run, step=manifest.step, chunk_id=cid,
                       key_path=manifest.leaves[blocks[0][0]].path) from e
        except OSError as e:  # unreadable there (a bad block, a permission): the place named
            e.add_note(f"casstore: reading chunk {cid} of key path "
                       f"{manifest.leaves[blocks[0][0]].path!r} (run {manifest.run!r}, step "
                       f"{manifest.step}) from {store.url}")
            raise
        if failed is not None:
            try:  # read again; with tiers, a good copy elsewhere (a header of an unknown
                # codec or version is a newer writer's or damage: another copy tells)
                raw = reread_chunk(store, key, first, into,
                                   isinstance(failed, FileNotFoundError))
            except StoreTimeoutError as t:
                raise t.at(run=manifest.run, step=manifest.step, chunk_id=cid,
                           key_path=manifest.leaves[blocks[0][0]].path) from t
            if raw is None:
                raise _unusable(failed, store, manifest, blocks[0][0], cid) from failed
        for i, ref in blocks if into is None else ():
            _copy_block(raw, ref, manifest.leaves[i], out[i], store, manifest)
        done = []
        with lock:
            for i in dict.fromkeys(i for i, _ in blocks):
                pending[i].discard(key)
                if not pending[i]:
                    done.append(i)
        for i in done:
            finish(i)

    for i in [i for i, ids in pending.items() if not ids]:
        finish(i)
    bounded_map(fetch, users, max_workers)
    return out


def _unusable(e: Exception, store: Store, manifest: Manifest, leaf: int,
              cid: str) -> MissingChunkError | CorruptChunkError | UnsupportedFormatError:
    """The error for a chunk no tier has a good copy of: missing (the object or its delta
    base does not exist), corrupt, or of a chunk format this casstore does not read, located
    at its step, key path and chunk id; through tiers, naming every tier (the error's ``url``
    is the primary's)."""
    tiers = ([store.primary, *store.fallbacks] if isinstance(store, FallbackStore) else [])
    where = f"; no tier has a usable copy ({', '.join(t.url for t in tiers)})" if tiers else ""
    at = {"url": store.url, "run": manifest.run, "step": manifest.step,
          "key_path": manifest.leaves[leaf].path, "chunk_id": cid}
    if isinstance(e, UnsupportedFormatError):
        return UnsupportedFormatError(e.feature + where, needs=e.needs, reader=e.reader, **at)
    missing = isinstance(e, FileNotFoundError)
    error = MissingChunkError if missing else CorruptChunkError
    same_place = getattr(e, "url", None) is None and getattr(e, "chunk_id", None) == cid
    return error(f"{'chunk object missing' if missing else 'unusable chunk'}: "
                 f"{e.message if same_place else e}{where}", **at)


def _read_in_place(store: Store, key: str, ref: ChunkRef, into: np.ndarray) -> bool:
    """Reads a raw chunk's payload straight into its destination ``into`` and verifies it
    there: True if it did; False where the store cannot or the object is not a raw chunk of
    that length (then it is read and decoded as usual). A chunk the manifest says is stored
    in another size (compressed) is not tried, so it is opened once. Raises as
    :func:`verify_raw`."""
    if ref.stored_bytes != HEADER.size + ref.raw_bytes:
        return False
    head = bytearray(HEADER.size)
    return (store.get_split(key, head, into)
            and verify_raw(head, into, ref.id, ref.raw_bytes))


def _destination(blocks: list[tuple[int, ChunkRef]], out: dict[int, Any]) -> np.ndarray | None:
    """The bytes a chunk's only block fills in the only region it overlaps, if that region
    holds all of the block and they are contiguous there (a whole leaf, or rows of one), so
    the chunk is decoded straight into them; else None."""
    if len(blocks) != 1 or blocks[0][1].offset:
        return None
    i, ref = blocks[0]
    block = (ref.start, ref.stop)
    overlapping = [(r, buf, both) for r, buf in out[i].items()
                   if (both := _overlap(block, r)) is not None]
    if len(overlapping) != 1 or overlapping[0][2] != block:
        return None
    region, buf, _ = overlapping[0]
    view = buf[(*_slices(ref.start, ref.stop, region[0]), ...)]  # a view, even of a 0-d buf
    if not view.flags.c_contiguous or view.nbytes != ref.raw_bytes:
        return None
    return view.reshape(-1).view(np.uint8)


def _copy_block(raw: memoryview, ref: ChunkRef, entry: LeafEntry, regions: dict,
                store: Store, manifest: Manifest) -> None:
    """Copies one block of a verified chunk into every region of a leaf it overlaps."""
    if ref.raw_bytes != len(raw):  # the first ref's length was checked by decode_chunk
        raise CorruptChunkError("chunk refs disagree on the chunk's length", url=store.url,
                                run=manifest.run, step=manifest.step, key_path=entry.path,
                                chunk_id=ref.id)
    dtype = saved_dtype(entry)
    block = np.frombuffer(raw, dtype, math.prod(ref.shape), ref.offset).reshape(ref.shape)
    for region, buf in regions.items():
        if (both := _overlap((ref.start, ref.stop), region)) is not None:
            lo, hi = both
            buf[_slices(lo, hi, region[0])] = block[_slices(lo, hi, ref.start)]


def read_fitted(store: Store, manifest: Manifest, requests: dict[int, list[Index]],
                max_workers: int, place: Callable[[int, dict], Any] | None = None,
                temporary: Collection[int] = ()) -> dict[int, Any]:
    """:func:`read_regions` for regions that may reach past the saved shape (``strict=False``).

    Each region is clipped to the saved array, the clipped part is read (so only chunks that
    overlap the kept region are fetched) straight into a zeroed buffer of the region's shape
    (zero-padded, as orbax pads; not copied into it after, which held 2x the leaf), and each
    leaf is placed as soon as its chunks are in, as :func:`read_regions` places it
    (``place``, ``temporary`` and the result likewise).
    """
    clipped = {i: {r: _clip(r, manifest.leaves[i].shape) for r in regions}
               for i, regions in requests.items()}
    padded: dict[int, dict[Index, np.ndarray]] = {}  # zeroed, each read into where it is kept
    views: dict[int, dict[Index, np.ndarray]] = {}
    for i, c in clipped.items():
        for region, kept in c.items():
            if kept != region and kept not in views.get(i, {}):
                buf = _zeroed(region, saved_dtype(manifest.leaves[i]), i in temporary)
                padded.setdefault(i, {})[region] = buf
                views.setdefault(i, {})[kept] = buf[_slices(*kept, region[0])]

    def fit(i: int, got: dict[Index, np.ndarray]) -> Any:
        out, mine = {}, padded.get(i, {})
        for region, kept in clipped[i].items():
            out[region] = mine.get(region, got[kept])
            if kept != region and region not in mine:  # a second region keeping the same part
                out[region] = _zeroed(region, got[kept].dtype, i in temporary)
                out[region][_slices(*kept, region[0])] = got[kept]
        return out if place is None else place(i, out)

    return read_regions(store, manifest, {i: list(dict.fromkeys(c.values()))
                                          for i, c in clipped.items()}, max_workers,
                        place=fit, temporary=temporary, given=views)


def _zeroed(region: Index, dtype: np.dtype, own_mapping: bool) -> np.ndarray:
    """A zeroed 64-byte-aligned buffer of ``region``'s shape (jax's CPU client adopts it)."""
    buf = empty_aligned([b - a for a, b in zip(*region)], dtype, own_mapping)
    buf.fill(0)
    return buf


def _clip(region: Index, shape: tuple[int, ...]) -> Index:
    """``region`` clipped to an array of ``shape`` (possibly empty, never inverted)."""
    start = tuple(min(a, d) for a, d in zip(region[0], shape))
    return start, tuple(max(s, min(b, d)) for s, b, d in zip(start, region[1], shape))


def _overlap(a: Index, b: Index) -> Index | None:
    """The intersection of two index regions, or None if they do not overlap."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x, y) for x, y in zip(a[1], b[1]))
    return (lo, hi) if all(x < y for x, y in zip(lo, hi)) else None


def _slices(lo: tuple[int, ...], hi: tuple[int, ...], origin: tuple[int, ...]) -> tuple:
    return tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, origin))

