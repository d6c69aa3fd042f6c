"""The sharding recorded at save, rebuilt for ``restore(..., sharding="saved")`` (format.md §6).

:func:`saved_target` turns a manifest into an abstract target: each leaf that was a jax.Array
with a ``NamedSharding`` becomes a ``jax.ShapeDtypeStruct`` on a mesh of the saved axis names
and sizes over the current devices, with the saved ``PartitionSpec``; the normal target path
then reads per device only its chunks. The manifest's ``sharding`` field comes from storage;
it was validated at decode (:func:`~casstore._manifest_checks.sharding_problem`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ._chunking import dtype_from_name
from ._errors import ManifestError, TargetMismatchError
from ._keypath import unflatten_plain
from ._manifest import LeafEntry, Manifest
from ._manifest_checks import sharding_problem
from .store import Store


def saved_target(manifest: Manifest, keep: set[int] | None, store: Store) -> Any:
    """An abstract target that restores each leaf as it was saved.

    Args:
      manifest: the validated manifest.
      keep: leaf indices to include (the tree is pruned as ``paths`` prunes it); None: all.
      store: the store, for messages.

    Returns:
      Plain dict / list / tuple containers (format.md §4.2) whose leaves are: a
      ``jax.ShapeDtypeStruct`` with a ``NamedSharding`` for a jax.Array saved with one (typed
      PRNG keys with their key dtype), one without a sharding (the default device) for other
      jax.Arrays, a zero-strided numpy array of the saved shape and dtype for numpy leaves,
      and the Python value for scalars.

    Raises:
      ManifestError: a leaf's saved sharding is malformed (names the key path).
      TargetMismatchError: the current devices cannot host a saved mesh: fewer devices than
        its axis sizes multiply to; names the key path, the saved mesh and the devices there.
    """
    meshes: dict[tuple, Mesh] = {}
    values = {i: _abstract_leaf(entry, meshes, manifest, store)
              for i, entry in enumerate(manifest.leaves) if keep is None or i in keep}
    return unflatten_plain(manifest.tree, values, keep)


def _abstract_leaf(entry: LeafEntry, meshes: dict, manifest: Manifest, store: Store) -> Any:
    if entry.kind == "scalar":
        return complex(*entry.value) if entry.scalar_type == "complex" else entry.value
    dtype = dtype_from_name(entry.dtype)
    if not entry.jax:
        return np.broadcast_to(np.zeros((), dtype), entry.shape)  # allocates nothing
    shape = entry.shape
    if entry.key_impl:
        shape, dtype = shape[:-1], jax.eval_shape(lambda: jax.random.key(0, impl=entry.key_impl)
                                                  ).dtype
    if entry.sharding is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    axes, spec = _parse(entry, len(entry.shape), manifest, store)
    spec = PartitionSpec(*spec[:len(shape)])  # key data's spec names its key axis too (None)
    if axes not in meshes:
        meshes[axes] = _mesh(axes, entry, manifest, store)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(meshes[axes], spec))


def _parse(entry: LeafEntry, ndim: int, manifest: Manifest,
           store: Store) -> tuple[tuple[tuple[str, int], ...], PartitionSpec]:
    """The saved mesh axes ``((name, size), ...)`` and PartitionSpec, validated (again: a
    manifest read from storage was, at decode, by the same rule)."""
    problem = sharding_problem(entry.sharding, ndim)
    if problem is not None:
        raise ManifestError(f"invalid manifest: bad saved sharding ({problem}): "
                            f"{entry.sharding!r}", url=store.url, run=manifest.run,
                            step=manifest.step, key_path=entry.path)
    mesh, spec = entry.sharding["mesh"], entry.sharding["spec"]
    return tuple(mesh.items()), PartitionSpec(*(tuple(p) if isinstance(p, list) else p
                                                for p in spec))


def _mesh(axes: tuple[tuple[str, int], ...], entry: LeafEntry, manifest: Manifest,
          store: Store) -> Mesh:
    """A mesh of the saved axis names and sizes over the first devices that fit it."""
    devices = jax.devices()
    needed = math.prod(size for _, size in axes)
    if needed > len(devices):
        raise TargetMismatchError(
            f"the saved mesh {dict(axes)} needs {needed} devices; the devices here are "
            f"{len(devices)} {devices[0].platform} devices, which cannot host it: pass a target "
            "with the sharding to use", url=store.url, run=manifest.run, step=manifest.step,
            key_path=entry.path)
    return jax.make_mesh(tuple(s for _, s in axes), tuple(n for n, _ in axes),
                         axis_types=(AxisType.Auto,) * len(axes), devices=devices[:needed])
