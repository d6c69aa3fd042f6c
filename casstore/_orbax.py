"""Migration from orbax: one orbax checkpoint (every item of it) written as a casstore step.

orbax itself reads the checkpoint (``orbax-checkpoint`` must be installed; casstore does not
depend on it otherwise), arrays to host numpy arrays in their saved dtype, so the import needs
neither the devices nor the mesh the checkpoint was written from. The tree is then saved with
:func:`casstore.save`: a checkpoint is committed by its manifest, written last.

Items of a ``CheckpointManager`` step: pytree items (``StandardSave``, ``PyTreeSave``) and JSON
items (``JsonSave``) are imported; any other item (``ArraySave``, ``ProtoSave``, a dataset
iterator's handler, ...) makes the import refuse, naming it, before anything is written.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from ._errors import CasstoreError
from ._repository import Url
from ._save import SaveInfo, save
from ._target import on_concrete_mesh

_METADATA = "_METADATA"  # the file orbax's PyTree handler writes into every item directory
_STEP_METADATA = "_CHECKPOINT_METADATA"  # a manager step's: names each item's handler
_JSON_FILE = "metadata"  # JsonCheckpointHandler's default file name
_METRICS = "metrics"  # the item (and file) of a manager step's metrics
_PYTREE_HANDLERS = ("StandardCheckpointHandler", "PyTreeCheckpointHandler")
_JSON_HANDLERS = ("JsonCheckpointHandler",)


class OrbaxReadError(CasstoreError):
    """orbax cannot read the checkpoint :func:`casstore.import_orbax` was given (damaged,
    partial, or not of the ``target`` given); the message names the directory and orbax's
    error."""


class UnsupportedItemError(CasstoreError, ValueError):
    """An orbax step holds items :func:`casstore.import_orbax` cannot import.

    Attributes:
      items: item name -> the orbax handler that wrote it (its class name, or None if the step
        does not say).
    """

    def __init__(self, message: str, items: dict[str, str | None]):
        super().__init__(message)
        self.items = items


def import_orbax(orbax_dir: str | os.PathLike, url: Url, step: int, *, run: str = "default",
                 item: str | None = None, target: Any = None,
                 metadata: Any = None) -> SaveInfo:
    """Reads one orbax checkpoint with orbax and writes it as casstore step ``step`` of ``run``.

    What becomes the step's tree:

    - a ``StandardCheckpointer`` / ``PyTreeCheckpointer`` directory: its pytree;
    - a ``CheckpointManager`` step directory (``<root>/<step>``) with one item: that item;
    - a step with several items (``item_names=`` / ``ocp.args.Composite``): a dict
      ``{item name: item}``, as orbax's ``Composite`` restore gives them, so
      ``restore(url, step)["state"]`` or ``paths=["extra"]`` reads one;
    - with ``item=``: that item only.

    A pytree item keeps its arrays' shapes, dtypes and bits; orbax's Python scalars come back
    as 0-d numpy arrays of their saved dtype (int64, float64) and are stored as such. A JSON
    item (``ocp.args.JsonSave``) becomes leaves: dicts and lists as containers, str / int /
    float / bool / None as Python scalar leaves (restored as the same Python values). The
    metrics a manager step holds (its ``metrics`` item: ``save(..., metrics=)`` with a
    ``best_fn``) become the step's metrics, as :meth:`casstore.CheckpointManager.save` stores
    them (``{"metrics": ..., "user": metadata}``), so a ``best_fn`` ranks imported steps; the
    step's custom metadata is not imported: pass ``metadata=``.

    orbax's tree metadata keeps dict keys as strings and typed PRNG keys as their ``uint32``
    key data, and orbax itself needs the restore's target to give them back: without
    ``target``, an int dict key ``0`` is imported as the key ``"0"`` and a ``jax.random.key``
    as its key data (shape ``(2,)`` for threefry), which a restore into the state's abstract
    tree then refuses as mismatched. Pass ``target`` (e.g. ``jax.eval_shape`` of the state,
    or ``nnx.state(nnx.eval_shape(...))``) and orbax restores through it, as its
    ``StandardRestore`` does: the step then holds the target's keys and key types.

    Args:
      orbax_dir: the checkpoint or step directory (local or any path orbax's ``etils.epath``
        opens, e.g. gs://).
      url: the casstore repository: a path, an fsspec URL or a Store.
      step: the casstore step to write (usually the orbax step).
      run: the casstore run name.
      item: import only this item of a manager step (``"default"`` for a manager with a single
        unnamed item).
      target: None, or the abstract tree (``jax.ShapeDtypeStruct`` leaves; with a sharding,
        arrays are restored onto it, else to host memory) of the one pytree item imported (a
        plain checkpoint, a step of one item, or ``item``), restored through it by orbax for
        its structure, dict keys and key types. Arrays keep their saved dtypes: a target's
        narrower one (int32 for int64 where jax's x64 is off) is not cast to; a restore into
        the target casts and refuses values that do not fit.
      metadata: user metadata for the casstore manifest.

    Returns:
      The :class:`casstore.SaveInfo` of the save.

    Raises:
      ImportError: orbax-checkpoint is not installed.
      FileNotFoundError: ``orbax_dir`` (or its ``item``) holds no orbax checkpoint.
      OrbaxReadError: orbax cannot read it (a damaged or partial checkpoint, or a ``target``
        it does not fit), or an item name (``item``, or one its metadata gives) is a path, not
        a directory name of the step; names the directory and orbax's error or the name.
        Nothing was written.
      ValueError: ``target`` given for a step of several items without ``item``.
      UnsupportedItemError: an item (``item``, or any item of the step without it) was written
        by an orbax handler other than the pytree and JSON ones; names every such item and its
        handler. Nothing was written.
      StepAlreadyExistsError: the casstore step exists; nothing was written.
      UnsupportedLeafError: a leaf is of a type casstore cannot store (e.g. a JSON integer
        beyond 64 bits); names its key path; nothing was written.
    """
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError("import_orbax needs orbax-checkpoint: pip install "
                          "orbax-checkpoint") from e
    from etils import epath  # orbax's path library (local, gs://, ...), installed with it

    root = epath.Path(os.fspath(orbax_dir))
    items = _items(root, item)
    if target is not None and len(items) - (_METRICS in items and item is None) != 1:
        raise ValueError(f"target= is the tree of one item; {str(root)!r} holds "
                         f"{sorted(items)}: pass item= too")
    try:
        metrics = _pop_metrics(items) if item is None else None
        trees = {name: _read(ocp, kind, path, target) for name, (kind, path) in items.items()}
    except UnsupportedItemError:
        raise
    except Exception as e:  # orbax's, tensorstore's and json's own errors on a damaged one
        raise OrbaxReadError(f"{str(root)!r}: orbax cannot read it: {type(e).__name__}: {e}; "
                             "nothing was written") from e
    tree = trees.popitem()[1] if len(trees) == 1 else trees
    if metrics is not None:  # as CheckpointManager.save(metrics=) stores them
        metadata = {"metrics": metrics, "user": metadata}
    return save(url, step, tree, run=run, metadata=metadata)


def _pop_metrics(items: dict) -> Any:
    """The JSON of orbax ``CheckpointManager``'s metrics item (a save's ``metrics=`` where it
    has a ``best_fn``), taken out of ``items``; None if the step has none."""
    found = items.get(_METRICS)
    if found is None or found[0] != "json" or len(items) == 1:
        return None
    del items[_METRICS]
    return json.loads(_json_file(found[1]).read_text())


def _read(ocp, kind: str, path, target: Any) -> Any:
    """One item's tree: a pytree item through orbax (through ``target`` if given), a JSON item
    as Python values."""
    if kind == "json":
        return json.loads(_json_file(path).read_text())
    checkpointer = ocp.PyTreeCheckpointer()
    item_metadata = checkpointer.metadata(path).item_metadata  # None: orbax could not read it
    if item_metadata is None:
        raise ValueError(f"orbax reads no tree metadata there ({str(path / _METADATA)!r}, "
                         "or the manifest.ocdbt its arrays are found by, is missing or damaged)")
    tree_metadata = item_metadata.tree
    if target is not None:
        return checkpointer.restore(path, args=ocp.args.PyTreeRestore(
            item=target, restore_args=_target_args(ocp, target, tree_metadata)))
    restore_args = jax.tree.map(
        lambda m: ocp.RestoreArgs(restore_type=np.ndarray)
        if isinstance(m, ocp.metadata.ArrayMetadata) else ocp.RestoreArgs(), tree_metadata)
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))


def _target_args(ocp, target: Any, tree_metadata: Any) -> Any:
    """orbax's restore arguments for ``target``: its structure and key types, and its
    shardings where it gives them, but every array in its saved dtype. orbax's own
    (``StandardRestore``) cast to the target's dtype, so ``jax.eval_shape`` of a state with
    jax's x64 off wrapped int64 values into int32, and put a leaf without a sharding on the
    saved mesh, which a machine of other devices does not have."""
    saved = {_plain_path(kp): getattr(m, "dtype", None)
             for kp, m in jax.tree_util.tree_flatten_with_path(tree_metadata)[0]}

    def args(kp, leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):  # on an AbstractMesh: jax.set_mesh's mesh
            leaf, problem = on_concrete_mesh(leaf)
            if problem is not None:
                raise ValueError(f"target leaf {jax.tree_util.keystr(kp)}: {problem}")
        dtype, sharding = saved.get(_plain_path(kp)), getattr(leaf, "sharding", None)
        if getattr(leaf, "dtype", None) is None:
            return ocp.RestoreArgs()  # a Python value: restored as saved
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # a jax array by nature
            return ocp.ArrayRestoreArgs(sharding=sharding or jax.sharding.SingleDeviceSharding(
                jax.local_devices(backend="cpu")[0]))
        if sharding is None or dtype is None or jax.dtypes.canonicalize_dtype(dtype) != dtype:
            return ocp.RestoreArgs(restore_type=np.ndarray)  # no cast: x64 off holds no int64
        return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=leaf.shape)

    return jax.tree_util.tree_map_with_path(args, target)


def _plain_path(kp: tuple) -> tuple[str, ...]:
    """A key path as orbax's metadata spells it: dict keys as strings (``0`` -> ``"0"``)."""
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in kp)


def _items(root, item: str | None) -> dict[str | None, tuple[str, Any]]:
    """The items to import: name (None for a plain checkpoint) -> (kind, directory).

    Raises:
      FileNotFoundError, UnsupportedItemError: as :func:`import_orbax`.
    """
    handlers = _handlers(root)
    if item is not None:
        _check_item(item, "item=")
    if item is None and (root / _METADATA).exists() and not handlers:
        return {None: ("pytree", root)}
    names = [item] if item is not None else sorted(handlers) or _item_dirs(root)
    if not names:
        raise FileNotFoundError(f"{str(root)!r} is not an orbax checkpoint: no {_METADATA} "
                                f"and no item directories")
    for name in names:
        if not (root / name).is_dir():
            raise FileNotFoundError(f"{str(root / name)!r} is not an orbax pytree checkpoint "
                                    f"or item (no such directory)")
    kinds = {name: _kind(root / name, handlers.get(name)) for name in names}
    refused = {name: handlers.get(name) for name, kind in kinds.items() if kind is None}
    if refused:
        importable = sorted(set(names) - set(refused))
        raise UnsupportedItemError(
            f"{str(root)!r}: import_orbax imports pytree and JSON items only, not "
            + ", ".join(f"{n!r} ({h or 'unknown handler'})" for n, h in refused.items())
            + (f"; pass item= to import one of {importable}" if importable else ""), refused)
    return {name: (kinds[name], root / name) for name in names}


def _item_dirs(root) -> list[str]:
    """A step's item directories where its metadata names no handlers (an older orbax): every
    directory, so one of an unknown kind is refused by name rather than dropped; none if no
    directory is an item casstore knows (``root`` is no checkpoint).

    Raises:
      FileNotFoundError: ``root`` holds checkpoints (a manager's directory, or the parent of
        several checkpoints), not the items of one.
    """
    dirs = sorted(d.name for d in root.iterdir()
                  if d.is_dir() and ".orbax-checkpoint-tmp" not in d.name)
    inner = [name for name in dirs if (root / name / _STEP_METADATA).exists()]
    if inner:
        raise FileNotFoundError(f"{str(root)!r} holds orbax checkpoints, not one: pass one of "
                                f"{inner[:5]}{' ...' if len(inner) > 5 else ''}")
    return dirs if any(_kind(root / name, None) for name in dirs) else []


def _handlers(root) -> dict[str, str]:
    """Item name -> handler class name, from a manager step's metadata ({} without it)."""
    path = root / _STEP_METADATA
    if not path.exists():
        return {}
    try:
        handlers = json.loads(path.read_text()).get("item_handlers")
    except (ValueError, AttributeError) as e:  # not JSON, or not a JSON object
        raise OrbaxReadError(f"{str(path)!r}: orbax's step metadata does not read: {e}; "
                             "nothing was written") from e
    if not isinstance(handlers, dict):
        return {}
    for name in handlers:
        _check_item(name, f"{str(path)!r} names an item")
    return {name: str(h).rsplit(".", 1)[-1] for name, h in handlers.items()}


def _check_item(name: str, where: str) -> None:
    """Raises OrbaxReadError unless ``name`` is an item's directory name: a path ('../x', '/x')
    would read a directory outside the checkpoint."""
    if not name or name in (".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise OrbaxReadError(f"{where} {name!r}, which is no item directory's name; nothing "
                             "was written")


def _json_file(path):
    """A JSON item's file: ``metadata``, or the one file there (a handler's ``filename=``).

    Raises:
      UnsupportedItemError: neither (names the files there).
    """
    if (path / _JSON_FILE).is_file():
        return path / _JSON_FILE
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name != "commit_success.txt")
    if len(files) != 1:
        raise UnsupportedItemError(f"{str(path)!r}: a JSON item holds one file, found "
                                   f"{[p.name for p in files]}",
                                   {path.name: "JsonCheckpointHandler"})
    return files[0]


def _kind(path, handler: str | None) -> str | None:
    """"pytree", "json", or None for an item casstore cannot import."""
    if handler is not None:
        return ("pytree" if handler in _PYTREE_HANDLERS else
                "json" if handler in _JSON_HANDLERS else None)
    if (path / _METADATA).exists():
        return "pytree"
    return "json" if (path / _JSON_FILE).is_file() else None
