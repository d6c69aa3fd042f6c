"""Storing array leaves in another dtype, chosen per key-path prefix (format.md §3.3, §4.3).

:func:`stored_as` replaces each selected array leaf of a save by a stand-in of the stored dtype
whose host shards are :class:`CastView` objects: the save path cuts them on the stored dtype's
grid (format.md §3.3) and :func:`~casstore._chunking.block_bytes` slices them one block at a
time, so each block is cast as its chunk is written and no full-size copy is made. This is
orbax's ``SaveArgs(dtype=...)``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from ._chunking import HostArray, dtype_from_name, dtype_name, shards_of
from ._errors import UnsupportedLeafError
from ._keypath import matches


class CastView:
    """A host array seen in another dtype; each slice taken is cast on its own.

    Attributes:
      source: the host (numpy) array, any dtype.
      dtype: the dtype slices are cast to.
    """

    def __init__(self, source: np.ndarray, dtype: np.dtype):
        self.source, self.dtype = source, dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape)

    @property
    def ndim(self) -> int:
        return len(self.source.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.source.shape) * self.dtype.itemsize

    def __getitem__(self, index: Any) -> np.ndarray:
        """``source[index]`` cast to ``dtype`` (a copy of that slice only)."""
        return np.asarray(self.source[index]).astype(self.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole array cast (used only for small leaves, which are packed or inlined)."""
        out = np.asarray(self.source).astype(self.dtype)
        return out if dtype is None else out.astype(dtype)


def stored_as(arrays: dict[int, tuple[Any, str | None]], leaves: list[tuple[str, Any]],
              dtypes: dict[str, Any] | None) -> dict[int, tuple[Any, str | None]]:
    """The save's ``(array, key_impl)`` by leaf index, with selected leaves cast lazily.

    Args:
      arrays: ``(array, key_impl)`` of each array leaf by leaf index (numpy, jax.Array or
        HostArray).
      leaves: ``(key path, value)`` of every leaf, by leaf index.
      dtypes: key-path prefix (format.md §5) -> dtype its array leaves are stored in; where
        several prefixes match a leaf, the longest wins. None or empty stores every leaf as is.

    Returns:
      ``arrays`` with each leaf under a prefix replaced by a stand-in of the stored dtype: a
      :class:`CastView` for numpy, a :class:`HostArray` of ``CastView`` shards (same sharding)
      for jax arrays.

    Raises:
      UnsupportedLeafError: a cast that changes the kind of dtype (bool, integer, floating,
        complex; e.g. float to int), of a PRNG key array, to a PRNG key dtype, or to a dtype
        format.md §4.5 does not allow; names the key path. A leaf under a prefix can keep its
        dtype through a longer prefix: ``{"params": bf16, "params/step": np.int32}``.
      ValueError: a prefix that is not a string, or that matches no array leaf.
    """
    if not dtypes:
        return arrays
    for prefix in dtypes:
        if not isinstance(prefix, str):
            raise ValueError(f"dtypes keys are key-path prefixes (str), got {prefix!r}")
    out = dict(arrays)
    used: set[str] = set()
    for i, (array, key_impl) in arrays.items():
        path = leaves[i][0]
        prefix = max((p for p in dtypes if matches(path, [p])), key=len, default=None)
        if prefix is None:
            continue
        used.add(prefix)
        stored = _check_cast(path, array.dtype, key_impl, dtypes[prefix])
        if stored != array.dtype:
            out[i] = (_view(array, stored), None)
    if unused := [p for p in dtypes if p not in used]:
        raise ValueError(f"dtypes prefix {unused[0]!r} matches no array leaf")
    return out


def _check_cast(path: str, source: np.dtype, key_impl: str | None, wanted: Any) -> np.dtype:
    """The stored dtype for a leaf of dtype ``source``; raises if the cast is refused."""
    def refuse(why: str) -> UnsupportedLeafError:
        name = getattr(wanted, "__name__", wanted)
        return UnsupportedLeafError(f"cannot store this leaf as {name}: {why}", key_path=path)

    try:
        if isinstance(wanted, str):
            wanted = dtype_from_name(wanted) or wanted
        if jax.dtypes.issubdtype(wanted, jax.dtypes.prng_key):
            raise refuse("PRNG key dtypes are kept only by typed key arrays")
        stored = np.dtype(wanted)
    except TypeError as e:
        raise refuse(str(e)) from e
    if key_impl is not None:
        raise refuse("it is a PRNG key array, stored as its key data")
    if dtype_name(stored) is None:
        raise refuse("not a dtype of format.md §4.5")
    if _kind(stored) != _kind(source):
        raise refuse(f"casting {source} ({_kind(source)}) to {_kind(stored)} would change "
                     f"what the values mean; map this key path to {source.name} to keep it")
    return stored


def _kind(dtype: np.dtype) -> str:
    """bool, integer, floating or complex (jax's view, which knows the ml_dtypes types)."""
    kinds = {"bool": np.bool_, "integer": np.integer, "floating": np.floating,
             "complex": np.complexfloating}
    return next((k for k, t in kinds.items() if jax.dtypes.issubdtype(dtype, t)), "other")


def _view(array: Any, stored: np.dtype) -> CastView | HostArray:
    if not isinstance(array, jax.Array | HostArray):
        return CastView(array, stored)
    shards = tuple((index, CastView(host, stored)) for index, host in shards_of(array))
    return HostArray(tuple(array.shape), stored, shards, array.sharding,
                     array.is_fully_addressable)
