"""Migration from orbax: one orbax checkpoint written as a casstore step.

orbax itself reads the checkpoint (``orbax-checkpoint`` must be installed; casstore does not
depend on it otherwise), arrays to host numpy arrays in their saved dtype, so the import needs
neither the devices nor the mesh the checkpoint was written from. The tree is then saved with
:func:`casstore.save`: a checkpoint is committed by its manifest, written last.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from ._repository import Url
from ._save import SaveInfo, save

_METADATA = "_METADATA"  # the file orbax's PyTree handler writes into every item directory


def import_orbax(orbax_dir: str | os.PathLike, url: Url, step: int, *, run: str = "default",
                 item: str | None = None, metadata: Any = None) -> SaveInfo:
    """Reads one orbax checkpoint with orbax and writes it as casstore step ``step`` of ``run``.

    Args:
      orbax_dir: a directory (local or any path orbax's ``etils.epath`` opens, e.g. gs://)
        orbax wrote one pytree into: that of
        ``ocp.StandardCheckpointer().save(path, tree)`` / ``ocp.PyTreeCheckpointer``, or a
        ``ocp.CheckpointManager`` step directory (``<root>/<step>``) whose item is taken from
        ``item`` or, when the step has exactly one item, found.
      url: the casstore repository: a path, an fsspec URL or a Store.
      step: the casstore step to write (usually the orbax step).
      run: the casstore run name.
      item: the item name inside a CheckpointManager step (``"default"`` for a manager with a
        single unnamed item, or the name given in ``ocp.args.Composite``).
      metadata: user metadata for the casstore manifest.

    Returns:
      The :class:`casstore.SaveInfo` of the save. Arrays keep their saved shapes, dtypes and
      bits; orbax's Python scalars come back as 0-d numpy arrays of their saved dtype (int64,
      float64) and are stored as such.

    Raises:
      ImportError: orbax-checkpoint is not installed.
      FileNotFoundError: ``orbax_dir`` (or its item) holds no orbax pytree checkpoint.
      StepAlreadyExistsError: the casstore step exists; nothing was written.
      UnsupportedLeafError: a leaf orbax restored is of a type casstore cannot store.
    """
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError("import_orbax needs orbax-checkpoint: pip install "
                          "orbax-checkpoint") from e
    path = _item_dir(os.fspath(orbax_dir), item)
    checkpointer = ocp.PyTreeCheckpointer()
    tree_metadata = checkpointer.metadata(path).item_metadata.tree
    restore_args = jax.tree.map(
        lambda m: ocp.RestoreArgs(restore_type=np.ndarray)
        if isinstance(m, ocp.metadata.ArrayMetadata) else ocp.RestoreArgs(), tree_metadata)
    tree = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    return save(url, step, tree, run=run, metadata=metadata)


def _item_dir(orbax_dir: str, item: str | None):
    """The directory holding the pytree: ``orbax_dir``, or its item ``item`` (or only item)."""
    from etils import epath  # orbax's path library (local, gs://, ...), installed with it

    root = epath.Path(orbax_dir)
    if item is not None:
        path = root / item
    elif (root / _METADATA).exists():
        path = root
    else:
        items = sorted(d.name for d in root.iterdir() if (d / _METADATA).exists())
        if len(items) != 1:
            raise FileNotFoundError(f"{orbax_dir!r} is not an orbax pytree checkpoint and holds "
                                    f"{len(items)} items ({items}); pass item=")
        path = root / items[0]
    if not (path / _METADATA).exists():
        raise FileNotFoundError(f"{str(path)!r} is not an orbax pytree checkpoint "
                                f"(no {_METADATA})")
    return path
