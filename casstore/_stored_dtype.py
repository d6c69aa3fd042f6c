"""Save stage 1b, stored dtypes: checked leaves -> the same leaves in the dtypes asked for.

Takes a :class:`~casstore._save_leaves.Prepared` tree, its arrays and the ``dtypes`` of
:func:`casstore.save` (key-path prefix -> dtype, format.md §4.6); gives the same tree with each
selected leaf's :class:`~casstore._save_leaves.ArrayInfo` recording the stored dtype, and its
array replaced by a :class:`~casstore._chunking.CastView` of that dtype. The plan then cuts
the leaf on the stored dtype's grid (format.md §3.3) and slices it one block at a time
(``block_bytes`` on the host, ``start_host_copy`` on an accelerator), so each block is cast as
its chunk is written and no full-size copy is made. This is orbax's ``SaveArgs(dtype=...)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ._chunking import CastView, dtype_from_name, dtype_name
from ._errors import UnsupportedLeafError
from ._keypath import matches
from ._save_leaves import Prepared


def stored_as(prepared: Prepared, arrays: dict[int, Any],
              dtypes: dict[str, Any] | None) -> tuple[Prepared, dict[int, Any]]:
    """A save's prepared tree and arrays, with the leaves ``dtypes`` selects cast lazily.

    Args:
      prepared: the checked tree (:func:`casstore._save_leaves.prepare`).
      arrays: the array to store for each array leaf (numpy or jax), by leaf index.
      dtypes: key-path prefix (format.md §5) -> dtype its array leaves are stored in; where
        several prefixes match a leaf, the longest wins. None or empty stores every leaf as is.

    Returns:
      ``(prepared, arrays)`` where each leaf under a prefix records the stored dtype and is a
      :class:`~casstore._chunking.CastView` of its array (same shape and sharding).

    Raises:
      UnsupportedLeafError: a cast that changes the kind of dtype (bool, integer, floating,
        complex; e.g. float to int), of a PRNG key array, to a PRNG key dtype, to a dtype
        format.md §4.5 does not allow, or between two dtypes numpy does not cast between
        (int4 to uint4, float8_e8m0fnu to float8_e4m3fn); names the key path. A leaf under
        a prefix can keep its dtype through a longer prefix mapped to None (or to its own
        dtype; for a PRNG key array, its key dtype or its key data's):
        ``{"params": bf16, "params/step": None}``.
      ValueError: a prefix that is not a string, or that matches no array leaf.

    A value the stored dtype cannot hold (an integer out of its range, a finite float beyond
    its range) is found as the leaf is cast, block by block: :class:`~casstore._chunking.
    CastView` raises UnsupportedLeafError naming the key path then, and nothing is committed.
    """
    if not dtypes:
        return prepared, arrays
    for prefix in dtypes:
        if not isinstance(prefix, str):
            raise ValueError(f"dtypes keys are key-path prefixes (str), got {prefix!r}")
    infos, arrays = dict(prepared.arrays), dict(arrays)
    used: set[str] = set()
    for i, info in prepared.arrays.items():
        path = prepared.paths[i]
        prefix = max((p for p in dtypes if matches(path, [p])), key=len, default=None)
        if prefix is None:
            continue
        used.add(prefix)
        stored = _check_cast(path, info.dtype, info.key_impl, dtypes[prefix])
        if stored != info.dtype:
            infos[i] = dataclasses.replace(info, dtype=stored)
            arrays[i] = CastView(arrays[i], stored, path)
    if unused := [p for p in dtypes if p not in used]:
        raise ValueError(f"dtypes prefix {unused[0]!r} matches no array leaf")
    return dataclasses.replace(prepared, arrays=infos), arrays


def _check_cast(path: str, source: np.dtype, key_impl: str | None, wanted: Any) -> np.dtype:
    """The stored dtype for a leaf of dtype ``source`` (a typed key array's: its key data's,
    with ``key_impl``); raises if the cast is refused. ``wanted`` None keeps the leaf as it is,
    and so does, for a key array, its own key dtype or its key data's dtype."""
    def refuse(why: str) -> UnsupportedLeafError:
        name = getattr(wanted, "__name__", wanted)
        return UnsupportedLeafError(f"cannot store this leaf as {name}: {why}", key_path=path)

    if wanted is None:
        return source
    if isinstance(wanted, str):
        wanted = dtype_from_name(wanted) or wanted
    try:
        is_key = jax.dtypes.issubdtype(wanted, jax.dtypes.prng_key)
        stored = None if is_key else np.dtype(wanted)
    except TypeError as e:
        raise refuse(str(e)) from e
    if key_impl is not None:
        if stored == source or (is_key and wanted == jax.random.key(0, impl=key_impl).dtype):
            return source  # kept: a key array is stored as its key data
        raise refuse(f"it is a PRNG key array ({key_impl}), stored as its key data: map this "
                     f"key path to None (or {source.name}) to keep it")
    if is_key:
        raise refuse("PRNG key dtypes are kept only by typed key arrays")
    if dtype_name(stored) is None:
        raise refuse("not a dtype of format.md §4.5")
    if _kind(stored) != _kind(source):
        raise refuse(f"casting {source} ({_kind(source)}) to {_kind(stored)} would change "
                     f"what the values mean; map this key path to None (or {source.name}) to "
                     "keep it")
    try:  # a pair ml_dtypes does not cast (int4 to uint4, float8_e8m0fnu to float8_e4m3fn)
        np.zeros(1, source).astype(stored)
    except TypeError as e:
        raise refuse(f"numpy cannot cast {source} to {stored.name} ({e}); map this key path "
                     f"to None (or {source.name}) to keep it") from e
    return stored


def _kind(dtype: np.dtype) -> str:
    """bool, integer, floating or complex (jax's view, which knows the ml_dtypes types)."""
    kinds = {"bool": np.bool_, "integer": np.integer, "floating": np.floating,
             "complex": np.complexfloating}
    return next((k for k, t in kinds.items() if jax.dtypes.issubdtype(dtype, t)), "other")
