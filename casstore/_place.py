"""Turning restored host regions into what each target leaf asks for (format.md §6).

:func:`place` builds a leaf's value from its verified host regions: numpy, a Python scalar, a
jax array on the default device, or a jax array assembled from per-device shards of the
target's sharding. Every dtype change goes through :func:`cast`, which refuses values the
target dtype cannot hold instead of wrapping or overflowing them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._buffers import ALIGN, empty_aligned
from ._chunking import Index, dtype_from_name, lossless, overflowed
from ._errors import ManifestError
from ._manifest import LeafEntry
from ._target import is_numpy_class, returns_numpy, target_shape

CAST_BLOCK = 1 << 20  # elements a cast converts and checks at a time
Fail = Callable[[str, str], Exception]  # (message, key path) -> the error to raise


def saved_dtype(entry: LeafEntry) -> np.dtype:
    """The little-endian dtype of an array leaf's stored bytes."""
    return dtype_from_name(entry.dtype).newbyteorder("<")


def plain_value(entry: LeafEntry, regions: dict[Index, np.ndarray] | None) -> Any:
    """A leaf restored without a target: numpy, a Python scalar, or typed PRNG keys."""
    if entry.kind == "scalar":
        return complex(*entry.value) if entry.scalar_type == "complex" else entry.value
    host = next(iter(regions.values()))
    return keys(host, entry) if entry.key_impl else host


def keys(host: np.ndarray, entry: LeafEntry) -> jax.Array:
    """Typed PRNG keys of ``entry.key_impl`` from their key data.

    Raises:
      ManifestError: jax knows no such implementation (names it and the key path).
    """
    try:
        return jax.random.wrap_key_data(host, impl=entry.key_impl)
    except (ValueError, TypeError) as e:
        raise ManifestError(f"PRNG key implementation {entry.key_impl!r} of the saved keys: "
                            f"{e}", key_path=entry.path) from e


def place(entry: LeafEntry, regions: dict[Index, np.ndarray] | None, t: Any,
          fail: Fail) -> Any:
    """Builds what target leaf ``t`` asks for from the restored regions (or scalar value).

    Args:
      entry: the saved leaf.
      regions: ``{(start, stop): host array}`` as :func:`casstore._read.read_regions` gives
        them (one whole region, or one per distinct shard of ``t``'s sharding); None for a
        scalar leaf.
      t: the target leaf (see :mod:`casstore._target`).
      fail: makes the error raised for values the target's dtype cannot hold.

    Returns:
      numpy for numpy targets, ``np.ndarray`` and jax targets :func:`returns_numpy` picks, a
      Python scalar of ``type(t)`` for scalar targets, else a jax.Array of ``t``'s dtype (as
      jax holds it) on ``t``'s sharding (in its memory kind, e.g. ``pinned_host``) or the
      default device, weakly typed where ``t`` is (``weak_type``: a Python scalar's
      type, which jax promotes to the other operand's dtype: ``lr * bf16_params`` stays
      bfloat16).
    """
    value = _build(entry, regions, t, fail)
    if getattr(t, "weak_type", False) and isinstance(value, jax.Array):
        from jax._src.lax.lax import _convert_element_type  # no public way to weaken a type

        placed = value.sharding
        value = _convert_element_type(value, weak_type=True)
        if value.sharding != placed:  # a computation's output: in device memory, not a
            value = jax.device_put(value, placed)  # pinned_host target's (weak_type kept)
    return value


def _build(entry: LeafEntry, regions: dict[Index, np.ndarray] | None, t: Any,
           fail: Fail) -> Any:
    """:func:`place` but for the weak type."""
    if entry.kind == "scalar":
        value = plain_value(entry, None)
        host = (np.asarray(value) if (target_shape(t) is not None or is_numpy_class(t))
                and not isinstance(value, str | bytes) else value)  # text stays text
    else:
        host = next(iter(regions.values())) if len(regions) == 1 else None
    if is_numpy_class(t):
        return plain_value(entry, regions) if entry.kind == "array" else host
    if target_shape(t) is None:
        return _scalar(host.item() if isinstance(host, np.ndarray) else host, type(t), entry,
                       fail)
    if isinstance(t, np.ndarray | np.generic) or returns_numpy(entry, t):
        return np.asarray(cast(host, entry, t.dtype, fail))
    dtype = t.dtype if entry.key_impl else jax.dtypes.canonicalize_dtype(t.dtype)
    sharding = getattr(t, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        value = cast(host, entry, dtype, fail)
        return to_device(value, None) if isinstance(value, np.ndarray) else jax.device_put(value)
    if entry.kind == "scalar":
        return jax.device_put(cast(host, entry, dtype, fail), sharding)
    tail = entry.shape[len(t.shape):]
    memory_kind = getattr(sharding, "memory_kind", None)  # e.g. "pinned_host" (offloaded)
    if len(sharding.device_set) == 1 and sharding.is_fully_addressable:  # one jax call
        value = cast(next(iter(regions.values())), entry, dtype, fail)
        default = next(iter(sharding.device_set)).default_memory().kind
        return (to_device(value, sharding) if isinstance(value, np.ndarray)
                and memory_kind in (None, default) else jax.device_put(value, sharding))
    shards, used = [], set()
    for d, index in sharding.addressable_devices_indices_map(tuple(t.shape)).items():
        region = normalize(index, t.shape, tail)
        value = cast(regions[region], entry, dtype, fail)
        shared = region in used  # a replica: its buffer may not alias another device's
        used.add(region)
        if memory_kind is not None and memory_kind != d.default_memory().kind:
            d = jax.sharding.SingleDeviceSharding(d, memory_kind=memory_kind)
        shards.append(jax.device_put(value, d) if shared or not isinstance(value, np.ndarray)
                      or not isinstance(d, jax.Device) else to_device(value, d))
    # dtype: where this process holds none of the array (another process's pipeline stage)
    return jax.make_array_from_single_device_arrays(tuple(t.shape), sharding, shards,
                                                    dtype=dtype)


def off_host(entry: LeafEntry, t: Any) -> bool:
    """True if :func:`place` puts array leaf ``entry`` on devices other than the CPU (GPUs,
    TPUs) for target leaf ``t``, so its host regions are dropped once it is placed. Call it in
    the caller's thread (``jax.default_device`` and ``jax.enable_x64`` are thread-local)."""
    if (entry.kind != "array" or target_shape(t) is None or isinstance(t, np.ndarray | np.generic)
            or returns_numpy(entry, t)):
        return False
    sharding = getattr(t, "sharding", None)
    devices = (sharding.device_set if isinstance(sharding, jax.sharding.Sharding)
               else {_default_device()})
    return any(d.platform != "cpu" for d in devices)


def normalize(index: tuple, shape: tuple[int, ...], tail: tuple[int, ...]) -> Index:
    """A device's index (slices into ``shape``) as ``(start, stop)``, with ``tail`` (the key
    data axes of a PRNG key leaf) taken whole."""
    bounds = [s.indices(d)[:2] for s, d in zip(index, shape, strict=True)]
    return (tuple(a for a, _ in bounds) + (0,) * len(tail),
            tuple(b for _, b in bounds) + tuple(tail))


def cast(host: np.ndarray, entry: LeafEntry, dtype: Any, fail: Fail) -> Any:
    """A host region as typed PRNG keys (for key leaves) or cast to ``dtype``.

    A cast keeps every value the target dtype can hold, as numpy casts it (floats round to
    nearest, floats to integers truncate toward zero). Values it cannot hold are refused, never
    wrapped or overflowed: integers out of the target integer's range, NaN or infinite floats
    into integers, finite values that would become infinite or NaN (or saturate) in a float
    dtype, NaN or infinities into a float dtype without them (float4_e2m1fn), values
    other than 0 and 1 into bool, complex numbers with an imaginary part into a real dtype.
    The check costs one pass over the region, for casts that can lose a value only.

    Raises:
      the error ``fail`` makes (a TargetMismatchError naming the key path and both dtypes).
    """
    if entry.key_impl:
        out = keys(host, entry)  # an implementation jax does not know: ManifestError
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and out.dtype != dtype:
            raise fail(f"the target asks for PRNG keys {dtype}, saved {out.dtype} keys "
                       f"({entry.key_impl!r})", entry.path)
        return out
    dtype = np.dtype(dtype)
    if host.dtype == dtype:
        return host
    if (why := _unrepresentable(host, dtype)) is not None:
        raise fail(f"the saved {host.dtype} values hold {why}, which {dtype} cannot hold; "
                   "ask for a dtype that holds them", entry.path)
    real = _kind(host.dtype) == "c" and _kind(dtype) != "c"  # imaginary parts checked 0
    out = empty_aligned(host.shape, dtype)  # adopted by jax's CPU client, not copied again
    check = _kind(dtype) in "fc" and not lossless(host.real.dtype if real else host.dtype,
                                                   dtype)
    flat_in, flat_out = host.reshape(-1), out.reshape(-1)  # host: a C-contiguous region
    for start in range(0, max(host.size, 1), CAST_BLOCK):  # block temporaries, not leaf-sized
        block, cast_block = flat_in[start:start + CAST_BLOCK], flat_out[start:start + CAST_BLOCK]
        block = block.real if real else block
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused below
                np.copyto(cast_block, block, casting="unsafe")
        except TypeError as e:  # a pair ml_dtypes does not cast (int4 to int2)
            raise fail(f"the saved {block.dtype} values cannot be cast to {dtype} ({e})",
                       entry.path) from e
        if check and overflowed(block, cast_block):
            raise fail(f"the saved {block.dtype} values hold values {dtype} has none of: they "
                       "overflow it (they would become inf or NaN, or saturate), or are NaN "
                       "or infinities, or zero and negatives for an unsigned float "
                       "(float8_e8m0fnu); ask for a wider dtype", entry.path)
    return out


def _kind(dtype: np.dtype) -> str:
    """``b`` bool, ``i`` integer, ``f`` floating, ``c`` complex (jax's view, which knows the
    ml_dtypes types such as bfloat16 and int4)."""
    kinds = {"b": np.bool_, "i": np.integer, "f": np.floating, "c": np.complexfloating}
    return next((k for k, t in kinds.items() if jax.dtypes.issubdtype(dtype, t)), "?")


def _unrepresentable(host: np.ndarray, dtype: np.dtype) -> str | None:
    """What in ``host`` a cast to ``dtype`` cannot keep (checked before the cast), or None."""
    source, target = _kind(host.dtype), _kind(dtype)
    if host.size == 0 or lossless(host.dtype, dtype):
        return None
    if source == "c" and target != "c":
        if np.any(host.imag != 0):
            return "an imaginary part"
        host, source = host.real, "f"
    if target in "fc":
        return None  # float overflow is checked on the cast values
    if target == "b":
        return None if np.all((host == 0) | (host == 1)) else "values other than 0 and 1"
    info = jax.dtypes.iinfo(dtype)
    if source == "f" and not np.all(np.isfinite(host)):
        return "NaN or infinity"
    low, high = host.min(), host.max()
    # truncated toward zero as astype does; through float: int() of a bfloat16 wraps
    exact = int if source in "bi" else (lambda v: math.trunc(float(v)))
    if exact(low) < info.min or exact(high) > info.max:
        return f"values in [{low}, {high}]"
    return None


def _scalar(value: Any, kind: type, entry: LeafEntry, fail: Fail) -> Any:
    """``value`` as a Python scalar of ``kind`` (the target leaf's type); a complex value into
    a real type only without an imaginary part, as for array targets (:func:`cast`)."""
    if isinstance(value, complex) and not issubclass(kind, complex):
        if value.imag != 0:
            raise fail(f"the saved value {value!r} has an imaginary part, which a "
                       f"{kind.__name__} cannot hold", entry.path)
        value = value.real
    if kind is bool and value not in (0, 1):
        raise fail(f"the saved value {value!r} is not a bool (0 or 1)", entry.path)
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise fail(f"the saved value {value!r} cannot be a {kind.__name__}: {e}",
                   entry.path) from e


def to_device(host: np.ndarray, device: Any) -> jax.Array:
    """``host`` on ``device`` (a device, a sharding of one device, or None: the default
    device), without a copy where jax allows.

    jax's CPU client adopts a 64-byte-aligned C-contiguous buffer in place
    (``jax.device_put(..., may_alias=True)``); :func:`casstore._read.read_regions` allocates
    such buffers, and nothing else keeps a reference to them. Anything else is copied.
    Not ``jax.dlpack.from_dlpack``: it adopts too, but the numpy array it holds is released
    by numpy's DLPack deleter, which takes the GIL on whichever XLA thread drops the buffer
    last; when that is a computation finishing while the interpreter exits, the thread is
    ended inside C++ and the process aborts ("terminate called without an active
    exception", seen on recipe_flax_linen.py under load). ``device_put`` hands its reference
    to jax, which releases it when Python next holds the GIL.
    """
    target = device or _default_device()
    platform = next(iter(target.device_set)).platform if isinstance(
        target, jax.sharding.Sharding) else target.platform
    if (platform == "cpu" and host.ctypes.data % ALIGN == 0 and host.flags.c_contiguous
            and host.dtype.byteorder in "=|<"):
        return jax.device_put(host, target, may_alias=True)
    return jax.device_put(host, target)


def _default_device() -> Any:
    """Where ``jax.device_put`` puts an array by default (``jax_default_device`` may name a
    platform, e.g. ``"cpu"``, or a device)."""
    default = jax.config.jax_default_device
    if default is None or isinstance(default, str):
        return jax.local_devices(backend=default)[0]
    return default
