"""Restoring a checkpoint, with or without an abstract target (format.md §3.2, §4, §6).

Reads the manifest (validated), then fetches every needed chunk concurrently, verifies its
length and chunk id, and copies its blocks into the leaves' host arrays; a chunk shared by
several leaves (a pack) is fetched once. With a target, leaves are matched by key path, cast to
the target dtype and placed with the target's sharding; with ``strict=False`` each axis is
truncated or zero-padded to the target's shape. ``sharding="saved"`` builds the target from
the manifest's saved shardings (``_saved_sharding``).
"""

from __future__ import annotations

from typing import Any

import jax

from ._coordinator import agreed_latest
from ._fallback import log_tiers, with_fallback
from ._keypath import prefix_matcher, unflatten_plain, unmatched
from ._known_chunks import remember_restored
from ._manifest import Manifest
from ._place import off_host, place, plain_value, saved_dtype
from ._read import read_fitted, read_regions, regions_for
from ._repository import Url, latest_step, read_manifest
from ._saved_sharding import saved_target
from ._target import match_target, mismatch
from .store import Store, open_store

tu = jax.tree_util


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
      step: the step; None means the latest committed step (in a ``jax.distributed`` job
        restoring arrays that span processes, process 0's latest, which every process takes
        from the coordinator: every process must then call ``restore`` alike).
      run: the run name.
      target: None, or a pytree like the saved one whose leaves say what to return:
        ``jax.ShapeDtypeStruct`` (a jax.Array of that dtype, placed with its ``sharding`` or on
        the default device), a jax.Array (same, with its sharding), a numpy array (numpy, of its
        dtype), the class ``np.ndarray`` (numpy of the saved shape and dtype: orbax's
        ``restore_type=np.ndarray``; typed PRNG keys, which numpy cannot hold, come back as
        jax keys), a Python scalar, or :data:`casstore.PLACEHOLDER` (``...``:
        returned as ``...``, the leaf, or every saved leaf under its key path, not read).
        Get one without allocating memory with :func:`casstore.abstract_tree` (keeps each
        array's sharding), ``jax.eval_shape``, ``nnx.eval_shape`` or ``eqx.filter_eval_shape``
        (a sharding on an AbstractMesh, which these give under ``jax.set_mesh``, is taken on
        the mesh ``jax.set_mesh`` makes active at the restore). Leaves are matched by key path.

        Dtypes: where the target asks for another dtype than the saved one, values are cast as
        numpy casts them (floats round to nearest, floats to integers truncate toward zero);
        a value the target dtype cannot hold (an integer out of range, NaN or infinity into an
        integer, a finite float that would overflow, an imaginary part into a real dtype)
        raises TargetMismatchError instead of wrapping. With ``jax_enable_x64`` off jax holds
        64-bit dtypes in 32 bits: a ``jax.ShapeDtypeStruct`` of such a dtype without a
        sharding whose saved values need the 64 bits (int64, uint64, float64 or complex128
        leaves; Python scalars that do not fit) comes back as numpy of the asked dtype, as
        orbax does; with a sharding (or a jax.Array target) it raises TargetMismatchError
        naming the key path, both dtypes and the x64 setting. Saved dtypes that fit the
        32-bit type exactly come back as jax arrays of it.
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
        side: ``{r"layers/\\[(\\d+)\\]/w": r"blocks/[\\1]/kernel"}`` (a list index is
        ``[0]`` in a key path, format.md §5).
      fill_missing: with a target, return target leaves that the checkpoint lacks (after
        ``transforms``) unchanged instead of failing: orbax's ``use_fallback``. Only concrete
        target leaves (jax or numpy arrays, Python scalars) can be filled.
      max_workers: threads fetching and decoding chunks (default the store's
        ``read_threads``: fewer for a step of encoded chunks on local disk).
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
      MissingChunkError: a chunk object (or a delta chunk's base) is missing (a
        FileNotFoundError; names step, key path and chunk id).
      CorruptChunkError: a chunk's bytes fail the checks (names step, key path
        and chunk id).
      StoreTimeoutError: the store did not answer within its deadline (names the object and,
        for a chunk, step, key path and chunk id).
      TargetMismatchError: target and checkpoint differ: target leaves missing from the
        checkpoint (and not filled), saved leaves the target lacks (without ``partial``),
        leaves of another shape or kind, a 64-bit dtype jax cannot hold on a sharding (see
        ``target``), or two saved leaves renamed to one key path. One
        error lists every such key path (its ``missing``, ``extra`` and ``mismatched``
        attributes), before any chunk is read. With ``strict=False`` only the number of axes
        must match. Also raised, naming the key path, while placing a leaf whose saved values
        the target dtype cannot hold (see ``target``). For ``sharding="saved"``: the devices
        here cannot host a saved mesh (names the key path, the saved mesh and the devices).
      ValueError: ``transforms`` or ``fill_missing`` without a target; ``transforms`` with a
        key that is no str regular expression or a template neither str nor None; ``sharding``
        neither None nor ``"saved"``, or given with a target.
      TypeError: ``paths`` is one string, not a list of them.
      CasstoreError: ``step`` None in a multi-process job (see ``step``) and process 0 did not
        post its latest step in time.
    """
    store = with_fallback(open_store(url), fallback)
    if step is None:  # in a multi-process job of global arrays: process 0's
        step = agreed_latest(lambda: latest_step(store, run=run), target)
    manifest = read_manifest(store, step, run=run)
    workers = max_workers or store.read_threads(manifest.encoded())
    if sharding is not None:
        target = _saved_sharding_target(manifest, paths, store, sharding, target)
    if target is None:
        if transforms is not None or fill_missing:
            raise ValueError("transforms and fill_missing need a target")
        selected = _selected(manifest, paths, store)
        arrays = [i for i in selected if manifest.leaves[i].kind == "array"]
        regions = read_regions(store, manifest, {i: regions_for(manifest.leaves[i], None)
                                                 for i in arrays}, workers)
        values = {i: plain_value(manifest.leaves[i], regions.get(i)) for i in selected}
        log_tiers(store, f"restore of step {manifest.step}")
        return unflatten_plain(manifest.tree, values, None if paths is None else set(selected))
    flat, treedef = tu.tree_flatten_with_path(target)
    plan = match_target(manifest, flat, store, paths=paths, partial=partial, strict=strict,
                        transforms=transforms, fill_missing=fill_missing)
    targets = {i: t for t, i in plan if i is not None}
    requests = {i: regions_for(manifest.leaves[i], t) for i, t in targets.items()
                if manifest.leaves[i].kind == "array"}

    def fail(message: str, path: str) -> Exception:
        return mismatch(message, manifest, store, path)

    # the caller's settings: a context's (jax.enable_x64, jax.default_device) is thread-local
    x64, device = jax.config.jax_enable_x64, jax.config.jax_default_device

    def place_leaf(i: int, regions: dict | None) -> Any:
        entry = manifest.leaves[i]
        with jax.enable_x64(x64), jax.default_device(device):  # on a worker thread too
            value = place(entry, regions, targets[i], fail)
        if entry.kind == "array":  # a later save of value need not read it back
            remember_restored(value, entry, saved_dtype(entry))
        return value

    # each leaf placed as soon as its chunks are in
    temporary = {i for i in requests if off_host(manifest.leaves[i], targets[i])}
    placed = (read_regions if strict else read_fitted)(store, manifest, requests, workers,
                                                       place=place_leaf, temporary=temporary)
    log_tiers(store, f"restore of step {manifest.step}")
    return tu.tree_unflatten(treedef, [
        t if i is None else placed[i] if i in placed else place_leaf(i, None)
        for t, i in plan])


def _saved_sharding_target(manifest: Manifest, paths, store: Store, sharding: Any,
                           target: Any) -> Any:
    """The abstract target for ``sharding="saved"``, pruned to ``paths`` (format.md §6)."""
    if sharding != "saved" or target is not None:
        raise ValueError(f"sharding must be None or 'saved' without a target, got {sharding!r}"
                         + (" with a target" if target is not None else ""))
    selected = _selected(manifest, paths, store)
    return saved_target(manifest, None if paths is None else set(selected), store)


def _selected(manifest: Manifest, paths, store: Store) -> list[int]:
    """The indices of the saved leaves ``paths`` selects (all for None).

    Raises:
      TargetMismatchError: a path selects no leaf, naming it.
    """
    match = prefix_matcher(paths)
    selected = [i for i, leaf in enumerate(manifest.leaves) if match(leaf.path)]
    for p in unmatched(paths, (manifest.leaves[i].path for i in selected))[:1]:
        raise mismatch("no leaf matches the requested path", manifest, store, p)
    return selected
