"""Cutting array leaves into chunks along shard boundaries (format.md §3.3 and §3.4).

:func:`unique_shards` gives the unique shards of a leaf (``replica_id == 0``), as host numpy
views where numpy can read them in place; :func:`start_host_copy` copies a block of an
accelerator's shard to host memory; :func:`grid` cuts a shard into blocks of at most
``chunk_size_bytes`` on stable boundaries, and :func:`block_bytes` gives a block's raw
little-endian bytes, copying only when the input is not C-contiguous little-endian.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Mapping
from numbers import Integral, Real
from typing import Any

import ml_dtypes
import numpy as np

from ._errors import UnsupportedLeafError
from ._lazy import LazyModule

jax = LazyModule("jax")  # imported on first use: reading manifests needs no jax
jnp = LazyModule("jax.numpy")

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


@functools.cache  # a few names, asked once per leaf of every manifest read
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


def on_host(x: jax.Array) -> bool:
    """True if every device of ``x`` is a CPU device, whose buffers numpy can view in place."""
    return all(d.platform == "cpu" for d in x.devices())


class CastView:
    """An array seen in another dtype (a stored dtype, format.md §4.6), cast block by block.

    Slicing casts only the slice: on the host for a numpy source, on the device for a jax
    source (a lazily dispatched op, so :func:`start_host_copy` copies the cast block). The save
    path treats it as the array it wraps: :func:`unique_shards` gives a CastView per shard.
    A cast that can lose more than rounding (a narrower integer, a float with a smaller range)
    checks each slice: an integer out of range, or a finite float that overflows (to infinity
    or NaN, or past the largest value of a float without infinity, which saturates), raises
    :class:`~casstore.UnsupportedLeafError` naming the key path, so the save fails and commits
    nothing. That costs one pass over the slice where it is cast (on an accelerator, one
    reduction and a wait per block).

    Attributes:
      source: a numpy array, or a jax.Array (a whole leaf, or one single-device shard).
      dtype: the stored dtype.
      path: the leaf's key path, for errors.
    """

    def __init__(self, source: np.ndarray | jax.Array, dtype: np.dtype, path: str = ""):
        self.source, self.dtype, self.path = source, np.dtype(dtype), path

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape)

    @property
    def ndim(self) -> int:
        return len(self.source.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.source.shape) * self.dtype.itemsize

    def devices(self) -> set:
        """The source's devices (a jax source only)."""
        return self.source.devices()

    def __getitem__(self, index: Any) -> np.ndarray | jax.Array:
        """``source[index]`` cast to ``dtype``; only that slice is copied.

        Raises:
          UnsupportedLeafError: the slice holds a value ``dtype`` cannot hold (class doc).
        """
        return self._checked(self.source[index])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The whole array cast (used only for small leaves, which are packed or inlined)."""
        out = self._checked(np.asarray(self.source))
        return out if dtype is None else out.astype(dtype)

    def _checked(self, block: Any) -> Any:
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below
            out = block.astype(self.dtype)
        if block.size == 0 or lossless(block.dtype, self.dtype):
            return out
        if jax.dtypes.issubdtype(self.dtype, np.integer):  # int4 too; from integers only
            info, low, high = jax.dtypes.iinfo(self.dtype), int(block.min()), int(block.max())
            if info.min <= low and high <= info.max:  # as Python ints: uint64 to int64 too
                return out
            why = f"values in [{low}, {high}], out of its range"
        elif not overflowed(block, out):
            return out
        else:
            why = "NaN or infinities it has no such value for, or finite values beyond its range"
        raise UnsupportedLeafError(
            f"cannot store this leaf as {self.dtype.name}: its {block.dtype} values hold {why}; "
            "store it in a wider dtype; nothing was committed", key_path=self.path)


def lossless(source: Any, target: Any) -> bool:
    """True if every ``source`` value casts exactly to ``target``: numpy's ``can_cast(...,
    "safe")``, trusted for numpy's own dtypes only. ml_dtypes registers lossy casts as safe
    (float8 to another float8 or to int4, int8 to float8), so a cast from or to one of its
    types (bfloat16, float8, int4, ...) is checked value by value, except into float32 and
    wider (complex too), which holds each of their values exactly."""
    source, target = np.dtype(source), np.dtype(target)
    if source.kind in "biufc" and target.kind in "biufc":
        return np.can_cast(source, target, "safe")
    # ml_dtypes' types (at most 16 bits, 8 of exponent) all fit float32 exactly, NaN and inf too
    return target.kind in "fc" and target.itemsize >= 4 and source.itemsize <= 2 and any(
        jax.dtypes.issubdtype(source, kind) for kind in (np.floating, np.integer))


def overflowed(block: Any, out: Any) -> bool:
    """True if ``out``, the cast of ``block`` (numpy or jax) to a float dtype, changed a value
    beyond rounding: a finite value became infinite or NaN, or saturated (a dtype without
    infinity, float4_e2m1fn), a NaN is no NaN there (float4_e2m1fn has none), or an infinity
    is not that infinity there (float8_e4m3fn has none)."""
    xp = np if isinstance(block, np.ndarray) else jnp
    finite = xp.isfinite(block)
    lost = finite & ~xp.isfinite(out)
    if (bound := saturation_bound(out.dtype)) is not None:
        limit, tie_overflows = bound
        integer = jax.dtypes.issubdtype(block.dtype, np.integer)  # abs(int8(-128)) wraps:
        magnitude = xp.abs(block.astype(np.float32) if integer else block)
        lost |= finite & (magnitude >= limit if tie_overflows else magnitude > limit)
    if not bool(xp.all(finite)):
        lost |= xp.isnan(block) & ~xp.isnan(out)
        with np.errstate(invalid="ignore"):  # NaN compared with 0: False, as meant here
            lost |= xp.isinf(block) & ~(xp.isinf(out) & ((out > 0) == (block > 0)))
    return bool(xp.any(lost))


@functools.cache  # per dtype: asked for each block cast
def saturation_bound(dtype: np.dtype) -> tuple[float, bool] | None:
    """For a float dtype without infinity (float8_e4m3fn, float4_e2m1fn): half an ulp above
    its largest value, past which a cast gives NaN or saturates instead of overflowing, and
    whether a value equal to it does too; None for a dtype with infinity."""
    if np.dtype(dtype).kind == "c":
        return None  # complex64 and complex128 have infinity
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isinf(np.array(np.inf, np.float32).astype(dtype).astype(np.float32)):
            return None
    top = np.array(ml_dtypes.finfo(dtype).max, dtype)
    bits = top.view(f"u{top.itemsize}")
    below = (bits - 1).view(dtype)  # the next value down
    half_up = float(top.astype(np.float64)) * 1.5 - float(below.astype(np.float64)) * 0.5
    return half_up, bool(bits & 1)  # a tie rounds to even: up if the largest value is odd


def is_host_data(data: Any) -> bool:
    """True for shard data numpy reads in place: a numpy array, or a CastView of one."""
    return isinstance(data.source if isinstance(data, CastView) else data, np.ndarray)


def unique_shards(leaf: np.ndarray | jax.Array | CastView, replicas: bool = False
                  ) -> list[tuple[tuple[int, ...], Any]]:
    """The unique addressable shards of a leaf as ``(origin, data)`` pairs, by origin.

    ``origin`` is the shard's first index in the global array. ``data`` is a numpy array for a
    numpy leaf (the leaf itself) and for a CPU device's shard (a read-only zero-copy view), and
    the shard's single-device jax.Array on an accelerator, to be copied block by block with
    :func:`start_host_copy`. Only ``replica_id == 0`` shards are returned; shards held only by
    other processes are not. With ``replicas``, every addressable shard of a distinct origin
    instead, its lowest ``replica_id`` (a ``local_per_host`` save: each process stores what it
    needs to restore its own shards). A CastView gives a CastView of each of its source's
    shards.
    """
    if isinstance(leaf, CastView):
        return [(o, CastView(data, leaf.dtype, leaf.path))
                for o, data in unique_shards(leaf.source, replicas)]
    if not isinstance(leaf, jax.Array):
        return [((0,) * leaf.ndim, leaf)]
    out = {}
    for shard in sorted(leaf.addressable_shards, key=lambda shard: shard.replica_id):
        origin = tuple(s.indices(d)[0] for s, d in zip(shard.index, leaf.shape))
        if (shard.replica_id == 0 or replicas) and origin not in out:
            data = shard.data
            out[origin] = np.asarray(data) if on_host(data) else data
    return sorted(out.items(), key=lambda item: item[0])


def start_host_copy(x: jax.Array, start: tuple[int, ...], stop: tuple[int, ...]) -> jax.Array:
    """Dispatches the copy of ``x[start:stop]`` (one accelerator shard) to host memory.

    Returns at once with a new array; ``np.asarray`` of it waits for the copy. Where the device
    offers pinned host memory (``memory_kind="pinned_host"``: GPUs and TPUs) the block goes
    there by DMA and ``np.asarray`` of the result is zero-copy; jax's pinned-host allocator
    keeps and reuses that memory across saves. Elsewhere the block is copied on the device and
    its host transfer started. Either way the host copy belongs to the new array, never to
    ``x`` (``np.asarray(x)`` would cache a host copy of all of ``x`` on ``x`` for as long as it
    lives), and a later donation of ``x`` does not change it.
    """
    whole = isinstance(x, jax.Array) and not any(start) and tuple(stop) == x.shape
    # a whole-array block takes no slice: jax's indexing costs ~0.4 ms a call even where it
    # returns x itself, and a save of GPT-2-XL's state copies 1,300 such blocks
    piece = x if whole or not x.ndim else x[tuple(slice(a, b) for a, b in zip(start, stop))]
    device = next(iter(x.devices()))
    if "pinned_host" in {m.kind for m in device.addressable_memories()}:
        return jax.device_put(piece, jax.sharding.SingleDeviceSharding(
            device, memory_kind="pinned_host"))
    piece = jnp.copy(piece) if piece is x else piece
    piece.copy_to_host_async()
    return piece


def start_host_copies(xs: list[jax.Array]) -> list[jax.Array]:
    """:func:`start_host_copy` of each whole array of ``xs``: where every device offers pinned
    host memory, dispatched in one ``jax.device_put`` (a call per array costs more than a small
    array's copy: the packs of GPT-2-XL's state are 1,750 small leaves)."""
    devices = [next(iter(x.devices())) for x in xs]
    if xs and all("pinned_host" in {m.kind for m in d.addressable_memories()}
                  for d in set(devices)):
        return jax.device_put(xs, [jax.sharding.SingleDeviceSharding(d, memory_kind="pinned_host")
                                   for d in devices])
    return [start_host_copy(x, (0,) * x.ndim, x.shape) for x in xs]


def check_options(*, zstd_level: object = 3, max_workers: object = None,
                  pack_threshold_bytes: object = 0, delta: object = True,
                  shuffle: object = None, dtypes: object = None) -> None:
    """Raises ValueError naming a save option out of its range or of another type (a level zstd
    does not have, which failed midway in a save that compressed, or was ignored by one that
    did not; 0 workers, taken as the default; ``delta="no"``, taken as true)."""
    for name, value, low, high in (("zstd_level", zstd_level, -(2**17), 22),
                                   ("max_workers", max_workers, 1, 4096)):
        if value is None and name == "max_workers":
            continue
        try:
            number = operator.index(value)  # numpy ints too
        except TypeError:
            number = None
        if isinstance(value, bool) or number is None or not low <= number <= high:
            raise ValueError(f"{name} must be an int in [{low}, {high}], not {value!r}")
    if (isinstance(pack_threshold_bytes, bool) or not isinstance(pack_threshold_bytes, Real)
            or not 0 <= pack_threshold_bytes <= 2**31):
        raise ValueError(f"pack_threshold_bytes must be a number of bytes in [0, 2**31], not "
                         f"{pack_threshold_bytes!r}")
    for name, value in (("delta", delta), ("shuffle", shuffle)):  # an int flag (1) too
        if not isinstance(value, bool | np.bool_ | Integral) and not (name == "shuffle"
                                                                   and value is None):
            raise ValueError(f"{name} must be a bool{' or None' * (name == 'shuffle')}, not "
                             f"{value!r}")
    if dtypes is not None and not isinstance(dtypes, Mapping):
        raise ValueError(f"dtypes must be a mapping of key path prefix -> dtype, not "
                         f"{dtypes!r}")


def check_chunk_size(chunk_size_bytes: object) -> int:
    """``chunk_size_bytes`` if it is an int in [1, 2**31] (format.md §3.2's largest chunk),
    else ValueError naming it (a save also needs it to hold one element of every array leaf:
    ``_save_plan.plan_jobs``)."""
    if (isinstance(chunk_size_bytes, bool) or not isinstance(chunk_size_bytes, int)
            or not 1 <= chunk_size_bytes <= 2**31):
        raise ValueError(f"chunk_size_bytes must be an int in [1, 2**31], not "
                         f"{chunk_size_bytes!r}")
    return chunk_size_bytes


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
