"""Restoring a checkpoint, with or without an abstract target (format.md §3.2, §4, §6).

Reads the manifest (validated), then fetches every needed chunk concurrently, verifies its
length and chunk id, and copies its blocks into the leaves' host arrays; a chunk shared by
several leaves (a pack) is fetched once. With a target, leaves are matched by key path, cast to
the target dtype and placed with the target's sharding; with ``strict=False`` each axis is
truncated or zero-padded to the target's shape. ``sharding="saved"`` builds the target from
the manifest's saved shardings (``_saved_sharding``).
"""

from __future__ import annotations

import collections
import math
from typing import Any

import jax
import numpy as np

from ._chunking import Index, dtype_from_name
from ._codec import decode_chunk
from ._errors import CorruptChunkError, TargetMismatchError
from ._keypath import SCALAR_TYPES, matches, path_str, unflatten_plain
from ._layout import chunk_key
from ._manifest import ChunkRef, LeafEntry, Manifest
from ._pool import bounded_map
from ._repository import Url, read_manifest
from ._saved_sharding import saved_target
from .store import Store, open_store

tu = jax.tree_util


def restore(url: Url, step: int | None = None, *, run: str = "default", target: Any = None,
            paths: list[str] | None = None, partial: bool = False, strict: bool = True,
            sharding: str | None = None, max_workers: int | None = None) -> Any:
    """Restores checkpoint ``step`` of ``run``.

    Reads the manifest, then only the chunks of the selected leaves, each verified against its
    chunk id and length before use. Nothing is written.

    Args:
      url: a path, an fsspec URL or a Store.
      step: the step; None means the latest committed step.
      run: the run name.
      target: None, or a pytree like the saved one whose leaves say what to return:
        ``jax.ShapeDtypeStruct`` (a jax.Array of that dtype, placed with its ``sharding`` or on
        the default device), a jax.Array (same, with its sharding), a numpy array (numpy, of its
        dtype), or a Python scalar. Get one without allocating memory with ``jax.eval_shape``,
        ``nnx.eval_shape`` or ``eqx.filter_eval_shape``. Leaves are matched by key path;
        dtypes are cast where the target asks for another dtype.
      paths: key-path prefixes (format.md §5, e.g. ``["params"]``) to read; None reads all.
        Without a target, only the matching subtrees are returned. With a target, target leaves
        outside ``paths`` are returned unchanged.
      partial: with a target, allow the checkpoint to have leaves the target lacks.
      strict: with a target, require each array leaf's shape to equal the saved shape. False
        truncates or zero-pads every axis to the target's shape instead, as orbax's
        ``strict=False`` does (e.g. an embedding table whose vocabulary grew): only the chunks
        overlapping the kept region are read, and sharded targets work as usual. The number
        of axes must still match.
      sharding: None, or ``"saved"`` (without a target) to return jax.Arrays laid out as saved,
        as orbax does without a target: each leaf saved as a jax.Array with a NamedSharding is
        placed on a mesh of the saved axis names and sizes over the first devices here, with
        the saved PartitionSpec, each device reading only its chunks; other jax.Arrays go to
        the default device, numpy leaves stay numpy. The containers are those returned
        without a target.
      max_workers: threads fetching and decoding chunks (default the store's).

    Returns:
      Without a target: the saved tree as plain dict / list / tuple containers (namedtuples and
      dataclass-like nodes as dicts) with numpy arrays, Python scalars, None, and typed PRNG key
      arrays as jax arrays (jax.Arrays as saved with ``sharding="saved"``). With a target: the
      target's tree structure with restored leaves.

    Raises:
      StepNotFoundError: the step (or any step, for None) does not exist.
      ManifestError: the manifest is malformed (names step and key path), or for
        ``sharding="saved"`` a leaf's saved sharding is.
      CorruptChunkError: a chunk is missing, or its bytes fail the checks (names step, key path
        and chunk id).
      TargetMismatchError: a target leaf is not in the checkpoint, has another shape (with
        ``strict``; another number of axes in any case) or kind, or (without ``partial``) the
        checkpoint has leaves the target lacks; for ``sharding="saved"``, the devices here
        cannot host a saved mesh (names the key path, the saved mesh and the devices).
      ValueError: ``sharding`` is neither None nor ``"saved"``, or is given with a target.
    """
    store = open_store(url)
    manifest = read_manifest(store, step, run=run)
    workers = max_workers or store.max_workers
    if sharding is not None:
        target = _saved_sharding_target(manifest, paths, store, sharding, target)
    if target is None:
        selected = [i for i, leaf in enumerate(manifest.leaves) if matches(leaf.path, paths)]
        _check_paths_found(manifest, paths, selected, store)
        arrays = [i for i in selected if manifest.leaves[i].kind == "array"]
        regions = read_regions(store, manifest, {i: _regions_for(manifest.leaves[i], None)
                                                 for i in arrays}, workers)
        values = {i: _plain_value(manifest.leaves[i], regions.get(i)) for i in selected}
        return unflatten_plain(manifest.tree, values, None if paths is None else set(selected))
    flat, treedef = tu.tree_flatten_with_path(target)
    by_path = {leaf.path: i for i, leaf in enumerate(manifest.leaves)}
    plan: list[tuple[Any, int | None]] = []
    for keys, t in flat:
        path = path_str(keys)
        if not matches(path, paths):
            plan.append((t, None))
            continue
        if path not in by_path:
            raise _mismatch("target leaf is not in the checkpoint", manifest, store, path)
        _check_compatible(manifest.leaves[by_path[path]], t, manifest, store, strict)
        plan.append((t, by_path[path]))
    if not partial:
        _check_no_extra(manifest, {i for _, i in plan if i is not None}, paths, store)
    regions = (read_regions if strict else _read_fitted)(
        store, manifest, {i: _regions_for(manifest.leaves[i], t)
                                             for t, i in plan if i is not None
                                             and manifest.leaves[i].kind == "array"}, workers)
    return tu.tree_unflatten(treedef, [
        t if i is None else _place(manifest.leaves[i], regions.get(i), t) for t, i in plan])


def _saved_sharding_target(manifest: Manifest, paths, store: Store, sharding: Any,
                           target: Any) -> Any:
    """The abstract target for ``sharding="saved"``, pruned to ``paths`` (format.md §6)."""
    if sharding != "saved" or target is not None:
        raise ValueError(f"sharding must be None or 'saved' without a target, got {sharding!r}"
                         + (" with a target" if target is not None else ""))
    selected = [i for i, leaf in enumerate(manifest.leaves) if matches(leaf.path, paths)]
    _check_paths_found(manifest, paths, selected, store)
    return saved_target(manifest, None if paths is None else set(selected), store)


def _plain_value(entry: LeafEntry, regions: dict[Index, np.ndarray] | None) -> Any:
    """A leaf restored without a target: numpy, a Python scalar, or typed PRNG keys."""
    if entry.kind == "scalar":
        return complex(*entry.value) if entry.scalar_type == "complex" else entry.value
    return _cast(next(iter(regions.values())), entry, _dtype(entry))


def _mismatch(message: str, manifest: Manifest, store: Store, path: str | None = None):
    return TargetMismatchError(message, url=store.url, run=manifest.run, step=manifest.step,
                               key_path=path)


def _check_paths_found(manifest: Manifest, paths, selected: list[int], store: Store) -> None:
    for p in paths or ():
        if not any(matches(manifest.leaves[i].path, [p]) for i in selected):
            raise _mismatch("no leaf matches the requested path", manifest, store, p)


def _check_no_extra(manifest: Manifest, used: set[int], paths, store: Store) -> None:
    extra = [leaf.path for i, leaf in enumerate(manifest.leaves)
             if i not in used and matches(leaf.path, paths)]
    if extra:
        shown = ", ".join(repr(p) for p in extra[:5]) + (", ..." if len(extra) > 5 else "")
        raise _mismatch(f"the checkpoint has {len(extra)} leaves the target lacks ({shown}); "
                        "pass partial=True to restore a subtree", manifest, store, extra[0])


def _target_shape(t: Any) -> tuple[int, ...] | None:
    return tuple(t.shape) if hasattr(t, "shape") and hasattr(t, "dtype") else None


def _check_compatible(entry: LeafEntry, t: Any, manifest: Manifest, store: Store,
                      strict: bool = True) -> None:
    """Checks shape and kind of a target leaf against the saved leaf before any chunk is read.

    Without ``strict`` an array target may differ from the saved shape in the axes' sizes.
    """
    shape = _target_shape(t)
    if shape is None:
        if not isinstance(t, SCALAR_TYPES):
            raise _mismatch(f"unsupported target leaf of type {type(t).__name__}", manifest,
                            store, entry.path)
        if entry.kind == "array" and entry.shape != ():
            raise _mismatch(f"target is a Python scalar, saved an array of shape "
                            f"{entry.shape}", manifest, store, entry.path)
        return
    saved = entry.shape[:-1] if entry.key_impl else entry.shape
    if entry.kind != "array" and shape != ():
        raise _mismatch(f"target has shape {shape}, saved a {entry.kind}", manifest, store,
                        entry.path)
    if entry.kind == "array" and shape != saved and (strict or len(shape) != len(saved)):
        raise _mismatch(f"target has shape {shape}, saved shape is {saved}", manifest, store,
                        entry.path)
    is_key = jax.dtypes.issubdtype(t.dtype, jax.dtypes.prng_key)
    if is_key != bool(entry.key_impl):
        raise _mismatch("target and checkpoint disagree on whether this is a PRNG key array",
                        manifest, store, entry.path)


def _cast(host: np.ndarray, entry: LeafEntry, dtype: Any) -> Any:
    """A host region as typed PRNG keys (for key leaves) or cast to ``dtype``."""
    if entry.key_impl:
        return jax.random.wrap_key_data(host, impl=entry.key_impl)
    return host if host.dtype == dtype else host.astype(dtype)


def _regions_for(entry: LeafEntry, t: Any) -> list[Index]:
    """The index regions of the saved array that target leaf ``t`` needs on this process.

    One region per distinct addressable shard for a jax target with a sharding (format.md §6),
    else the whole array. Regions are in the target's shape, which may reach past the saved
    shape with ``strict=False`` (:func:`_read_fitted` clips them).
    """
    shape = _target_shape(t)  # differs from the saved shape only for strict=False
    whole = ((0,) * len(entry.shape), entry.shape if shape is None or entry.kind != "array"
             else shape + entry.shape[len(shape):])
    sharding = getattr(t, "sharding", None)
    if entry.kind != "array" or not isinstance(sharding, jax.sharding.Sharding) or isinstance(
            t, np.ndarray):
        return [whole]
    tail = entry.shape[len(t.shape):]  # the key-data dimensions of PRNG key leaves
    indices = sharding.addressable_devices_indices_map(tuple(t.shape)).values()
    return list(dict.fromkeys(_normalize(index, t.shape, tail) for index in indices))


def _normalize(index: tuple, shape: tuple[int, ...], tail: tuple[int, ...]) -> Index:
    bounds = [s.indices(d)[:2] for s, d in zip(index, shape)]
    return (tuple(a for a, _ in bounds) + (0,) * len(tail),
            tuple(b for _, b in bounds) + tuple(tail))


def _place(entry: LeafEntry, regions: dict[Index, np.ndarray] | None, t: Any) -> Any:
    """Builds what target leaf ``t`` asks for from the restored regions (or scalar value)."""
    if entry.kind == "scalar":
        value = _plain_value(entry, None)
        host = np.asarray(value) if _target_shape(t) is not None else value
    else:
        host = next(iter(regions.values())) if len(regions) == 1 else None
    if _target_shape(t) is None:
        return type(t)(host.item() if isinstance(host, np.ndarray) else host)
    if isinstance(t, np.ndarray | np.generic):
        return np.asarray(_cast(host, entry, t.dtype))
    sharding = getattr(t, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        return jax.device_put(_cast(host, entry, t.dtype))
    if entry.kind == "scalar":
        return jax.device_put(host.astype(t.dtype), sharding)
    tail = entry.shape[len(t.shape):]
    shards = [jax.device_put(_cast(regions[_normalize(index, t.shape, tail)], entry, t.dtype), d)
              for d, index in sharding.addressable_devices_indices_map(tuple(t.shape)).items()]
    return jax.make_array_from_single_device_arrays(tuple(t.shape), sharding, shards)


def read_regions(store: Store, manifest: Manifest, requests: dict[int, list[Index]],
                 max_workers: int) -> dict[int, dict[Index, np.ndarray]]:
    """Reads index regions of array leaves into host arrays (format.md §6).

    Only the chunks whose blocks overlap a requested region are fetched, each once, with at
    most ``2 * max_workers`` in flight, and verified (format.md §3.2) before its blocks are
    copied into every region they overlap. A chunk that overlaps in part is read whole.

    Args:
      requests: leaf index -> ``(start, stop)`` regions wanted (array leaves only).

    Returns:
      leaf index -> {region: host array of the region's shape, little-endian saved dtype}.

    Raises:
      CorruptChunkError: a chunk is missing or fails its checks; names step, key path, chunk id.
    """
    out: dict[int, dict[Index, np.ndarray]] = {}
    users: dict[str, list[tuple[int, ChunkRef]]] = collections.defaultdict(list)
    for i, regions in requests.items():
        entry = manifest.leaves[i]
        out[i] = {r: np.empty([b - a for a, b in zip(*r)], _dtype(entry)) for r in regions}
        if entry.inline is not None:
            whole = np.frombuffer(entry.inline, _dtype(entry)).reshape(entry.shape)
            for (start, stop), buf in out[i].items():
                buf[...] = whole[tuple(slice(a, b) for a, b in zip(start, stop))]
            continue
        for ref in entry.chunks:
            if any(_overlap((ref.start, ref.stop), r) for r in regions):
                users[ref.id].append((i, ref))

    def fetch(cid: str) -> None:
        blocks = users[cid]
        try:
            raw = decode_chunk(store.get(chunk_key(cid)), cid, blocks[0][1].raw_bytes)
        except (CorruptChunkError, FileNotFoundError) as e:
            raise CorruptChunkError(f"unusable chunk: {e}", url=store.url, run=manifest.run,
                                    step=manifest.step, key_path=manifest.leaves[blocks[0][0]].path,
                                    chunk_id=cid) from e
        for i, ref in blocks:
            if ref.raw_bytes != len(raw):  # the first ref's length was checked by decode_chunk
                raise CorruptChunkError("chunk refs disagree on the chunk's length",
                                        url=store.url, run=manifest.run, step=manifest.step,
                                        key_path=manifest.leaves[i].path, chunk_id=cid)
            dtype = _dtype(manifest.leaves[i])
            block = np.frombuffer(raw, dtype, math.prod(ref.shape), ref.offset).reshape(ref.shape)
            for region, buf in out[i].items():
                if (both := _overlap((ref.start, ref.stop), region)) is not None:
                    lo, hi = both
                    buf[_slices(lo, hi, region[0])] = block[_slices(lo, hi, ref.start)]

    bounded_map(fetch, users, max_workers)
    return out


def _read_fitted(store: Store, manifest: Manifest, requests: dict[int, list[Index]],
                 max_workers: int) -> dict[int, dict[Index, np.ndarray]]:
    """:func:`read_regions` for regions that may reach past the saved shape (``strict=False``).

    Each region is clipped to the saved array, the clipped part is read (so only chunks that
    overlap the kept region are fetched), and the result is zero-padded back to the region's
    shape, as orbax pads.
    """
    clipped = {i: {r: _clip(r, manifest.leaves[i].shape) for r in regions}
               for i, regions in requests.items()}
    got = read_regions(store, manifest, {i: list(dict.fromkeys(c.values()))
                                         for i, c in clipped.items()}, max_workers)
    out: dict[int, dict[Index, np.ndarray]] = {}
    for i, regions in clipped.items():
        out[i] = {}
        for region, kept in regions.items():
            buf = got[i][kept]
            if kept != region:
                buf = np.zeros([b - a for a, b in zip(*region)], buf.dtype)
                buf[_slices(*kept, region[0])] = got[i][kept]
            out[i][region] = buf
    return out


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


def _dtype(entry: LeafEntry) -> np.dtype:
    return dtype_from_name(entry.dtype).newbyteorder("<")
