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
import re
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._chunking import Index, dtype_from_name
from ._delta import DeltaBases
from ._errors import CorruptChunkError, StoreTimeoutError, TargetMismatchError
from ._fallback import log_tiers, reread_chunk, with_fallback
from ._keypath import SCALAR_TYPES, matches, path_str, unflatten_plain
from ._manifest import ChunkRef, LeafEntry, Manifest
from ._pool import bounded_map
from ._repository import Url, read_manifest
from ._saved_sharding import saved_target
from .store import Store, open_store

tu = jax.tree_util
_ALIGN = 64  # bytes: jax's CPU client adopts buffers aligned so (DLPack import)


def restore(url: Url, step: int | None = None, *, run: str = "default", target: Any = None,
            paths: list[str] | None = None, partial: bool = False, strict: bool = True,
            sharding: str | None = None, transforms: dict[str, str | None] | None = None,
            fill_missing: bool = False, max_workers: int | None = None,
            fallback: Any = None) -> Any:
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
      transforms: with a target, renames of saved key paths: ``{regex: template}``. Each saved
        key path is matched (``re.fullmatch``) against the regexes in order; the first match
        gives the target key path ``match.expand(template)`` (``\\1``, ``\\g<name>``), and
        a template of None drops the saved leaf. Saved paths no regex matches keep their path.
        Like orbax's ``transforms`` (``Transform(original_key=...)``), written from the saved
        side: ``{r"layers/(\\d+)/w": r"blocks/\\1/kernel"}``.
      fill_missing: with a target, return target leaves that the checkpoint lacks (after
        ``transforms``) unchanged instead of failing: orbax's ``use_fallback``. Only concrete
        target leaves (jax or numpy arrays, Python scalars) can be filled.
      max_workers: threads fetching and decoding chunks (default the store's).
      fallback: None, or a URL / Store (or a list of them, tried in order) holding copies of
        the repository (the persistent tier, ``docs/tiers.md``): a manifest or chunk object
        missing from ``url``, or a chunk failing its checks there, is read from the first
        fallback with a good copy; the latest step is the latest of all of them. Logs the
        bytes read from each (INFO, logger ``casstore``); pass a :class:`FallbackStore` as
        ``url`` to read its ``bytes_read`` instead, or to write recovered objects back.

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
      StoreTimeoutError: the store did not answer within its deadline (names the object and,
        for a chunk, step, key path and chunk id).
      TargetMismatchError: target and checkpoint differ: target leaves missing from the
        checkpoint (and not filled), saved leaves the target lacks (without ``partial``),
        leaves of another shape or kind, or two saved leaves renamed to one key path. One
        error lists every such key path (its ``missing``, ``extra`` and ``mismatched``
        attributes), before any chunk is read. With ``strict=False`` only the number of axes
        must match. For ``sharding="saved"``: the devices here cannot host a saved mesh (names
        the key path, the saved mesh and the devices).
      ValueError: ``transforms`` or ``fill_missing`` without a target; ``sharding`` neither
        None nor ``"saved"``, or given with a target.
    """
    store = with_fallback(open_store(url), fallback)  # tiers: _fallback.py
    manifest = read_manifest(store, step, run=run)
    workers = max_workers or store.max_workers
    if sharding is not None:
        target = _saved_sharding_target(manifest, paths, store, sharding, target)
    if target is None:
        if transforms is not None or fill_missing:
            raise ValueError("transforms and fill_missing need a target")
        selected = [i for i, leaf in enumerate(manifest.leaves) if matches(leaf.path, paths)]
        _check_paths_found(manifest, paths, selected, store)
        arrays = [i for i in selected if manifest.leaves[i].kind == "array"]
        regions = read_regions(store, manifest, {i: _regions_for(manifest.leaves[i], None)
                                                 for i in arrays}, workers)
        values = {i: _plain_value(manifest.leaves[i], regions.get(i)) for i in selected}
        log_tiers(store, f"restore of step {manifest.step}")
        return unflatten_plain(manifest.tree, values, None if paths is None else set(selected))
    flat, treedef = tu.tree_flatten_with_path(target)
    plan = _match_target(manifest, flat, store, paths=paths, partial=partial, strict=strict,
                         transforms=transforms, fill_missing=fill_missing)
    targets = {i: t for t, i in plan if i is not None}
    requests = {i: _regions_for(manifest.leaves[i], t) for i, t in targets.items()
                if manifest.leaves[i].kind == "array"}
    if strict:  # each leaf placed as soon as its chunks are in
        placed = read_regions(store, manifest, requests, workers,
                              place=lambda i, regions: _place(manifest.leaves[i], regions,
                                                              targets[i]))
    else:
        fitted = _read_fitted(store, manifest, requests, workers)
        placed = {i: _place(manifest.leaves[i], regions, targets[i])
                  for i, regions in fitted.items()}
    log_tiers(store, f"restore of step {manifest.step}")
    return tu.tree_unflatten(treedef, [
        t if i is None else placed[i] if i in placed else _place(manifest.leaves[i], None, t)
        for t, i in plan])


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


def _target_shape(t: Any) -> tuple[int, ...] | None:
    return tuple(t.shape) if hasattr(t, "shape") and hasattr(t, "dtype") else None


def _match_target(manifest: Manifest, flat: list, store: Store, *, paths, partial: bool,
                  strict: bool, transforms, fill_missing: bool) -> list[tuple[Any, int | None]]:
    """Pairs each target leaf with its saved leaf index (None: return the target leaf as is).

    Collects every missing, extra and mismatched key path before raising one
    :class:`TargetMismatchError`; no chunk is read before the whole target matches.
    """
    by_path = _saved_by_target_path(manifest, transforms, store)
    plan: list[tuple[Any, int | None]] = []
    missing: list[tuple[str, str]] = []
    mismatched: list[tuple[str, str]] = []
    for keys, t in flat:
        path = path_str(keys)
        i = by_path.get(path)
        if not matches(path, paths) or (i is None and fill_missing and _is_concrete(t)):
            plan.append((t, None))
        elif i is None:
            missing.append((path, "not in the checkpoint" if not fill_missing else
                            f"not in the checkpoint, and the target leaf ({type(t).__name__}) "
                            "is abstract: fill_missing needs a concrete array or scalar"))
        elif (problem := _compatibility_problem(manifest.leaves[i], t, strict)) is not None:
            mismatched.append((path, problem))
        else:
            plan.append((t, i))
    used = {i for _, i in plan if i is not None} | {by_path[p] for p, _ in mismatched}
    extra = [] if partial else [(manifest.leaves[i].path, p) for p, i in by_path.items()
                                if i not in used and matches(p, paths)]
    if missing or extra or mismatched:
        raise _mismatch_report(manifest, store, missing, extra, mismatched)
    return plan


def _saved_by_target_path(manifest: Manifest, transforms, store: Store) -> dict[str, int]:
    """Target key path -> saved leaf index, after the ``transforms`` renames (None drops)."""
    rules = [(re.compile(k), v) for k, v in (transforms or {}).items()]
    out: dict[str, int] = {}
    for i, leaf in enumerate(manifest.leaves):
        path = leaf.path
        for regex, template in rules:
            if (m := regex.fullmatch(path)) is not None:
                path = None if template is None else m.expand(template)
                break
        if path is None:
            continue
        if path in out:
            raise _mismatch(f"transforms rename saved leaves {manifest.leaves[out[path]].path!r}"
                            f" and {leaf.path!r} to the same key path", manifest, store, path)
        out[path] = i
    return out


def _is_concrete(t: Any) -> bool:
    """True for target leaves that hold values: jax or numpy arrays and Python scalars."""
    return isinstance(t, (jax.Array, np.ndarray, np.generic, *SCALAR_TYPES))


def _mismatch_report(manifest: Manifest, store: Store, missing: list[tuple[str, str]],
                     extra: list[tuple[str, str]], mismatched: list[tuple[str, str]]):
    """One TargetMismatchError listing every problem key path, with the opt-ins that help."""
    lines = [f"target and checkpoint differ: {len(missing)} missing, {len(extra)} extra, "
             f"{len(mismatched)} mismatched key paths"]
    lines += [f"  missing {p!r}: {why}" for p, why in missing]
    lines += [f"  extra {saved!r}: in the checkpoint, not in the target"
              + (f" (renamed to {p!r})" if p != saved else "") for saved, p in extra]
    lines += [f"  mismatched {p!r}: {why}" for p, why in mismatched]
    hints = (["pass partial=True to restore a subtree"] if extra else []) + (
        ["fill_missing=True returns concrete target leaves the checkpoint lacks"]
        if missing else []) + (["transforms={saved regex: target path} renames saved leaves"]
                               if missing or extra else [])
    lines += [f"  hint: {h}" for h in hints] + ["  first difference at"]  # + the location
    first = (missing or extra or mismatched)[0]
    error = _mismatch("\n".join(lines), manifest, store, first[0])
    error.missing = tuple(p for p, _ in missing)
    error.extra = tuple(saved for saved, _ in extra)
    error.mismatched = tuple(mismatched)
    return error


def _compatibility_problem(entry: LeafEntry, t: Any, strict: bool) -> str | None:
    """Why target leaf ``t`` cannot take the saved leaf (shape or kind), or None if it can.

    Without ``strict`` an array target may differ from the saved shape in the axes' sizes.
    """
    shape = _target_shape(t)
    if shape is None:
        if not isinstance(t, SCALAR_TYPES):
            return f"unsupported target leaf of type {type(t).__name__}"
        if entry.kind == "array" and entry.shape != ():
            return f"target is a Python scalar, saved an array of shape {entry.shape}"
        return None
    saved = entry.shape[:-1] if entry.key_impl else entry.shape
    if entry.kind != "array" and shape != ():
        return f"target has shape {shape}, saved a {entry.kind}"
    if entry.kind == "array" and shape != saved and (strict or len(shape) != len(saved)):
        return f"target has shape {shape}, saved shape is {saved}"
    if jax.dtypes.issubdtype(t.dtype, jax.dtypes.prng_key) != bool(entry.key_impl):
        return "target and checkpoint disagree on whether this is a PRNG key array"
    return None


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
        value = _cast(host, entry, t.dtype)
        return _to_device(value, None) if isinstance(value, np.ndarray) else jax.device_put(value)
    if entry.kind == "scalar":
        return jax.device_put(host.astype(t.dtype), sharding)
    tail = entry.shape[len(t.shape):]
    shards, used = [], set()
    for d, index in sharding.addressable_devices_indices_map(tuple(t.shape)).items():
        region = _normalize(index, t.shape, tail)
        value = _cast(regions[region], entry, t.dtype)
        shared = region in used  # a replica: its buffer may not alias another device's
        used.add(region)
        shards.append(jax.device_put(value, d) if shared or not isinstance(value, np.ndarray)
                      else _to_device(value, d))
    return jax.make_array_from_single_device_arrays(tuple(t.shape), sharding, shards)


def _to_device(host: np.ndarray, device: Any) -> jax.Array:
    """``host`` on ``device`` (None: the default device), without a copy where jax allows.

    jax's CPU client can adopt a 64-byte-aligned C-contiguous buffer of a DLPack dtype in
    place, on the first CPU device; :func:`read_regions` allocates such buffers, and nothing
    else keeps a reference to them. Anything else is copied by ``jax.device_put``.
    """
    target = device or _default_device()
    if (target == jax.local_devices(backend="cpu")[0] and host.ctypes.data % _ALIGN == 0
            and host.flags.c_contiguous and host.dtype.type.__module__ == "numpy"
            and host.dtype.kind in "biufc" and host.dtype.byteorder in "=|<"):
        return jax.dlpack.from_dlpack(host, copy=False)
    return jax.device_put(host, target)


def _default_device() -> Any:
    """Where ``jax.device_put`` puts an array by default (``jax_default_device`` may name a
    platform, e.g. ``"cpu"``, or a device)."""
    default = jax.config.jax_default_device
    if default is None or isinstance(default, str):
        return jax.local_devices(backend=default)[0]
    return default


def read_regions(store: Store, manifest: Manifest, requests: dict[int, list[Index]],
                 max_workers: int, place: Callable[[int, dict], Any] | None = None
                 ) -> dict[int, Any]:
    """Reads index regions of array leaves into host arrays (format.md §6), leaf by leaf.

    Only the chunks whose blocks overlap a requested region are fetched, each once (a delta
    chunk with its base, format.md §3.5; a base that several deltas share once, held until the
    last of them is rebuilt), with at most ``2 * max_workers`` in flight, and verified
    (format.md §3.2) before its blocks are copied into every region they overlap. A chunk that
    overlaps in part is read whole.
    Chunks are fetched in leaf order, and as soon as a leaf's last chunk is in, ``place``
    turns its regions into the value returned for it (e.g. jax arrays on their devices) and
    its host buffers are released, so host memory holds the leaves in progress, not the
    state. Region buffers are 64-byte aligned, so jax's CPU client can adopt them in place.

    Args:
      requests: leaf index -> ``(start, stop)`` regions wanted (array leaves only).
      place: ``(leaf index, {region: host array}) -> value``, called once per leaf from a
        worker thread; None keeps the host arrays.

    Returns:
      leaf index -> ``place``'s value, or {region: host array of the region's shape,
      little-endian saved dtype} without ``place``.

    Raises:
      CorruptChunkError: a chunk is missing or fails its checks; names step, key path, chunk id.
    """
    out: dict[int, Any] = {}
    users: dict[str, list[tuple[int, ChunkRef]]] = collections.defaultdict(list)
    pending: dict[int, set[str]] = {}
    lock = threading.Lock()
    for i, regions in requests.items():
        entry = manifest.leaves[i]
        out[i] = {r: _empty_aligned([b - a for a, b in zip(*r)], _dtype(entry))
                  for r in regions}
        if entry.inline is not None:
            whole = np.frombuffer(entry.inline, _dtype(entry)).reshape(entry.shape)
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
        into = _destination(blocks, out)
        try:
            data, buffers.read = store.get_into(key, getattr(buffers, "read", None))
            raw = bases.decode(data, cid, first.base, first.raw_bytes, into)
        except (CorruptChunkError, FileNotFoundError) as e:
            raw = reread_chunk(store, key, first, into)  # tiers: a good copy elsewhere
            if raw is None:
                raise CorruptChunkError(
                    f"unusable chunk: {e}", url=store.url, run=manifest.run, step=manifest.step,
                    key_path=manifest.leaves[blocks[0][0]].path, chunk_id=cid) from e
        except StoreTimeoutError as e:
            raise e.at(run=manifest.run, step=manifest.step, chunk_id=cid,
                       key_path=manifest.leaves[blocks[0][0]].path) from e
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
    dtype = _dtype(entry)
    block = np.frombuffer(raw, dtype, math.prod(ref.shape), ref.offset).reshape(ref.shape)
    for region, buf in regions.items():
        if (both := _overlap((ref.start, ref.stop), region)) is not None:
            lo, hi = both
            buf[_slices(lo, hi, region[0])] = block[_slices(lo, hi, ref.start)]


def _empty_aligned(shape: list[int], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a 64-byte boundary."""
    n = math.prod(shape) * dtype.itemsize
    raw = np.empty(n + _ALIGN, np.uint8)
    offset = -raw.ctypes.data % _ALIGN
    return raw[offset:offset + n].view(dtype).reshape(shape)


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
