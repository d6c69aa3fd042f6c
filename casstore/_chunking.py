"""Cutting array leaves into chunks along shard boundaries (format.md §3.3 and §3.4).

:func:`shards_of` gives the unique shards of a leaf (``replica_id == 0``) as host numpy views,
:func:`grid` cuts a shard into blocks of at most ``chunk_size_bytes`` on stable boundaries, and
:func:`block_bytes` gives a block's raw little-endian bytes, copying only when the input is not
C-contiguous little-endian.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import ml_dtypes
import numpy as np

DEFAULT_CHUNK_SIZE_BYTES = 16 * 2**20
DEFAULT_PACK_THRESHOLD_BYTES = 64 * 2**10
INLINE_LIMIT_BYTES = 64

DTYPE_NAMES = (
    "bool", "int2", "int4", "int8", "int16", "int32", "int64", "uint2", "uint4", "uint8",
    "uint16", "uint32", "uint64", "float16", "bfloat16", "float32", "float64", "complex64",
    "complex128", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn",
)  # format.md §4.5

Index = tuple[tuple[int, ...], tuple[int, ...]]  # (start, stop) per dimension


def dtype_from_name(name: str) -> np.dtype | None:
    """The numpy dtype for a format.md §4.5 name, or None if unknown here or not allowed."""
    if name not in DTYPE_NAMES:
        return None
    scalar_type = getattr(ml_dtypes, name, None) or getattr(np, "bool_" if name == "bool"
                                                            else name, None)
    return np.dtype(scalar_type) if scalar_type is not None else None


def dtype_name(dtype: np.dtype) -> str | None:
    """The format.md §4.5 name of ``dtype`` (any byte order), or None if not storable."""
    name = np.dtype(dtype).name
    return name if name in DTYPE_NAMES and dtype_from_name(name) is not None else None


def is_key_array(x: Any) -> bool:
    """True for a typed PRNG key array (``jax.random.key``)."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True, eq=False)
class HostArray:
    """A host copy of a jax.Array's unique addressable shards, taken for an asynchronous save.

    It stands in for the jax.Array when saving: same shape, dtype, shard boundaries and
    sharding, so an asynchronous save writes exactly the chunks a synchronous one would.

    Attributes:
      shape, dtype: of the global array (key data for typed PRNG keys).
      shards: ``((start, stop), host copy)`` of each addressable ``replica_id == 0`` shard.
      sharding: the jax sharding, for the manifest's display field.
      is_fully_addressable: whether this process held every shard.
      key_impl: the PRNG implementation name for typed key arrays, else None.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    shards: tuple[tuple[Index, np.ndarray], ...]
    sharding: Any
    is_fully_addressable: bool
    key_impl: str | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole array (only for fully addressable arrays)."""
        out = np.empty(self.shape, self.dtype)
        for (start, stop), data in self.shards:
            out[tuple(slice(a, b) for a, b in zip(start, stop))] = data
        return out if dtype is None else out.astype(dtype)


def host_snapshot(x: jax.Array) -> HostArray:
    """Host arrays of the unique addressable shards of ``x`` (typed keys as key data).

    After it returns, the caller may overwrite or donate ``x``. An accelerator's shards are
    copied to host memory (all transfers are started before any is awaited). A CPU device's
    shard is taken as a zero-copy view, as orbax does: the view holds the buffer, so jax copies
    instead of reusing it if the caller donates ``x`` while the save runs.
    """
    key_impl = None
    if is_key_array(x):
        key_impl, x = str(jax.random.key_impl(x)), jax.random.key_data(x)
    unique = [s for s in x.addressable_shards if s.replica_id == 0]
    for s in unique:
        s.data.copy_to_host_async()  # start every transfer before waiting on any
    # np.asarray gives a host copy of an accelerator buffer, a read-only view of a CPU one.
    shards = tuple((index, host) for index, host in shards_of(x))
    return HostArray(tuple(x.shape), np.dtype(x.dtype), shards, x.sharding,
                     x.is_fully_addressable, key_impl)


def shards_of(leaf: np.ndarray | jax.Array | HostArray) -> list[tuple[Index, np.ndarray]]:
    """The unique shards of an array as ``((start, stop), host array)`` pairs.

    A jax.Array yields one entry per addressable shard with ``replica_id == 0`` (on CPU the
    host array is a view of the device buffer); a numpy array is one shard covering all of it.
    Shards held only by other processes are not returned.
    """
    if isinstance(leaf, HostArray):
        return list(leaf.shards)
    if not isinstance(leaf, jax.Array):
        return [(((0,) * leaf.ndim, tuple(leaf.shape)), leaf)]
    out = []
    for shard in leaf.addressable_shards:
        if shard.replica_id == 0:
            index = tuple(s.indices(d)[:2] for s, d in zip(shard.index, leaf.shape))
            out.append(((tuple(a for a, _ in index), tuple(b for _, b in index)),
                        np.asarray(shard.data)))
    return sorted(out, key=lambda item: item[0])


def grid(shape: tuple[int, ...], itemsize: int, chunk_size_bytes: int) -> list[Index]:
    """Cuts an array of ``shape`` into C-contiguous blocks of at most ``chunk_size_bytes``.

    The rule of format.md §3.3: take the smallest axis ``k`` whose trailing block
    ``itemsize * prod(shape[k+1:])`` fits, cut axis ``k`` into runs of
    ``max(1, chunk_size_bytes // that)`` and every earlier axis into single indices.

    Returns:
      ``(start, stop)`` index pairs relative to the array, in C order; empty if it has no
      elements; one block ``((), ())`` for a 0-d array.
    """
    if math.prod(shape) == 0:
        return []
    n = len(shape)
    k = next(k for k in range(n + 1) if k == n or itemsize * math.prod(shape[k + 1:])
             <= chunk_size_bytes)
    if k == n:  # 0-d
        return [((), ())]
    run = max(1, chunk_size_bytes // (itemsize * math.prod(shape[k + 1:])))
    blocks = []
    for outer in itertools.product(*(range(d) for d in shape[:k])):
        for a in range(0, shape[k], run):
            start = (*outer, a, *([0] * (n - k - 1)))
            stop = (*(i + 1 for i in outer), min(a + run, shape[k]), *shape[k + 1:])
            blocks.append((start, stop))
    return blocks


def block_bytes(array: np.ndarray, start: tuple[int, ...], stop: tuple[int, ...]) -> memoryview:
    """The raw bytes of ``array[start:stop]``: C order, little-endian (format.md §3.3).

    Zero-copy for a block of a C-contiguous little-endian array; otherwise the block alone is
    copied, so memory stays bounded by one block.
    """
    piece = array[tuple(slice(a, b) for a, b in zip(start, stop))]
    if piece.dtype.byteorder == ">":
        piece = piece.astype(piece.dtype.newbyteorder("<"))
    piece = np.ascontiguousarray(piece)
    return memoryview(piece.reshape(-1).view(np.uint8))
