"""Save stage 1, the leaves: a pytree -> its checked leaves (format.md §4.2, §4.3, §4.5).

Takes the caller's tree and metadata; gives a :class:`Prepared` (the tree structure, each
scalar leaf's manifest entry, each array leaf's :class:`ArrayInfo`) and the array to store for
each array leaf, by leaf index. Everything a save can refuse about a leaf or the metadata is
refused here, before anything is written. Nothing is read from the arrays.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import msgpack
import numpy as np

from ._chunking import dtype_name, is_key_array
from ._errors import UnsupportedLeafError
from ._keypath import flatten, is_valid_path
from ._manifest import MAX_ARRAY_BYTES, MAX_LEAVES, MAX_MANIFEST_BYTES, LeafEntry
from ._manifest_checks import MAX_METADATA_BYTES, metadata_problem, sharding_problem


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayInfo:
    """What the manifest records of an array leaf; the array itself is not kept.

    Attributes:
      shape, dtype: of the stored array (the key data, for typed PRNG keys).
      key_impl: the PRNG implementation name for typed key arrays, else None.
      sharding: the NamedSharding as ``{"mesh": {axis: size}, "spec": [...]}``, or None.
      is_jax: whether the leaf was a jax.Array.
      spread: whether other processes hold some of its shards (multi-process saves).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    key_impl: str | None
    sharding: dict | None
    is_jax: bool
    spread: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
    """A checked pytree: its structure, scalar entries and array descriptions, by leaf index."""

    node: dict
    paths: list[str]
    scalars: dict[int, LeafEntry]
    arrays: dict[int, ArrayInfo]
    metadata: Any

    @property
    def logical_bytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def prepare(tree: Any, metadata: Any = None) -> tuple[Prepared, dict[int, Any]]:
    """Flattens and checks ``tree`` before anything is written.

    Returns:
      ``(prepared, arrays)``: the checked description, and the array to store for each array
      leaf (numpy or jax; key data for typed PRNG keys), by leaf index.

    Raises:
      UnsupportedLeafError: a leaf cannot be stored; names its key path.
      ValueError: ``metadata`` that msgpack cannot encode, or that a reader would refuse
        (format.md §4.1: an extension type such as a Timestamp, nested over 256 deep, or
        over 1 MiB encoded).
    """
    node, leaves = flatten(tree)
    if len(leaves) > MAX_LEAVES:
        raise UnsupportedLeafError(f"the tree has {len(leaves)} leaves; a manifest holds at "
                                   f"most {MAX_LEAVES} (format.md §4.4): nothing was written")
    _check_paths([path for path, _ in leaves])
    metadata = snapshot(metadata)
    scalars: dict[int, LeafEntry] = {}
    values: dict[int, Any] = {}
    infos: dict[int, ArrayInfo] = {}
    for i, (path, value) in enumerate(leaves):
        if isinstance(value, (np.ndarray, np.generic, jax.Array)):
            values[i], infos[i] = _as_array(path, value)
        else:
            scalars[i] = _scalar_entry(path, value)
    inline = sum(len(e.value.encode() if isinstance(e.value, str) else e.value)
                 for e in scalars.values() if isinstance(e.value, (str, bytes)))
    if inline > MAX_MANIFEST_BYTES // 2:
        raise UnsupportedLeafError(f"the str and bytes leaves hold {inline} bytes, which the "
                                   f"manifest stores: they may take half of its limit of "
                                   f"{MAX_MANIFEST_BYTES} bytes (format.md §4.4), "
                                   f"{MAX_MANIFEST_BYTES // 2}; nothing was written")
    return Prepared(node, [p for p, _ in leaves], scalars, infos, metadata), values


def _check_paths(paths: list[str]) -> None:
    """Raises UnsupportedLeafError naming the first key path a manifest cannot hold: one two
    leaves share (a pytree node whose flatten gives two children one key; a manifest maps each
    key path to one leaf, format.md §4.4), or one of more than 4096 bytes (§5; named by its
    first 100 characters) or otherwise invalid."""
    seen: set[str] = set()
    for path in paths:
        if not is_valid_path(path):
            size = len(path.encode(errors="surrogatepass"))
            raise UnsupportedLeafError(
                f"a key path of {size} bytes; format.md §5 allows at most 4096" if size > 4096
                else "this key path is not valid (format.md §5: no NUL or lone surrogate)",
                key_path=path if size <= 4096 else path[:100] + "...")
        if path in seen:
            raise UnsupportedLeafError("two leaves have this key path (a pytree node gives two "
                                       "children the same key); each leaf needs its own",
                                       key_path=path)
        seen.add(path)


def _sharding_info(x: Any) -> dict | None:
    """The NamedSharding of a jax.Array as ``{"mesh": {axis: size}, "spec": [...]}``; None for
    other shardings, and for one format.md §6.1 cannot describe (which a reader refuses)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
    info = {"mesh": {str(k): int(v) for k, v in sharding.mesh.shape.items()}, "spec": spec}
    return None if sharding_problem(info, len(x.shape)) else info


def _scalar_entry(path: str, value: Any) -> LeafEntry:
    """A Python scalar stored inline (format.md §4.3); bool is checked before int."""
    kind = next(t for t in (bool, int, float, complex, str, bytes) if isinstance(value, t))
    if kind is int and not -2**63 <= value < 2**63:
        raise UnsupportedLeafError("int does not fit in 64 bits", key_path=path)
    if kind in (str, bytes) and len(value) > 2**20:
        raise UnsupportedLeafError(f"{kind.__name__} longer than 1 MiB", key_path=path)
    if kind is str and not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError as e:
            raise UnsupportedLeafError(f"str is not valid Unicode ({e.reason} at position "
                                       f"{e.start})", key_path=path) from None
    stored = ([float(value.real), float(value.imag)] if kind is complex
              else str.__str__(value) if kind is str  # a (str, Enum)'s value, not its name
              else kind(value))
    return LeafEntry(path, "scalar", scalar_type=kind.__name__, value=stored)


def _as_array(path: str, value: Any) -> tuple[Any, ArrayInfo]:
    """The array to store for a leaf (key data for typed keys) and what the manifest says."""
    key_impl = None
    if isinstance(value, jax.core.Tracer):
        raise UnsupportedLeafError(f"a traced value ({type(value).__name__}) has no data to "
                                   "store: save outside jax.jit, vmap and grad, or use "
                                   "jax.experimental.io_callback", key_path=path)
    if isinstance(value, jax.Array) and value.is_deleted():
        raise UnsupportedLeafError("this jax array was deleted (or donated to a jitted "
                                   "function) before the save", key_path=path)
    if is_key_array(value):
        key_impl = str(jax.random.key_impl(value))
        value = jax.random.key_data(value)
    elif isinstance(value, np.generic):
        value = np.asarray(value)
    elif isinstance(value, np.ma.MaskedArray):  # its data alone would come back, unmasked
        raise UnsupportedLeafError("a masked array's mask cannot be stored; save its .data "
                                   "and np.ma.getmaskarray(...) as two leaves", key_path=path)
    if dtype_name(value.dtype) is None:
        raise UnsupportedLeafError(f"arrays of dtype {value.dtype} cannot be stored",
                                   key_path=path)
    extent = math.prod(d for d in value.shape if d) * value.dtype.itemsize
    if extent > MAX_ARRAY_BYTES:  # a zero-size one too: a reader refuses such a manifest
        raise UnsupportedLeafError(f"an array of shape {tuple(value.shape)} spans {extent} "
                                   f"bytes, past casstore's limit of 2**48", key_path=path)
    is_jax = isinstance(value, jax.Array)
    # decided alike on every process, from the devices: one held by process 0 alone is
    # written by it; any other by each process for its shards (one on process 1's devices
    # alone is fully addressable there, not on process 0, which holds none of it)
    spread = is_jax and any(d.process_index != 0 for d in value.sharding.device_set)
    return value, ArrayInfo(tuple(value.shape), np.dtype(value.dtype), key_impl,
                            _sharding_info(value), is_jax, spread)



def _unpackable_at(value: Any, at: str = "") -> str:
    """Where in ``value`` msgpack first fails, as ``['key'][0]`` ('' for ``value`` itself)."""
    items = (value.items() if isinstance(value, dict) else
             enumerate(value) if isinstance(value, list | tuple) else ())
    for k, v in items:
        try:
            msgpack.packb(v, use_bin_type=True, default=_python_scalar)
        except (TypeError, ValueError, OverflowError):
            return _unpackable_at(v, f"{at}[{k!r}]")
    return at


def snapshot(value: Any, what: str = "metadata") -> Any:
    """``value`` as the manifest stores it (msgpack: tuples become lists; numpy and jax
    scalars, such as a loss, Python numbers): a copy, so a caller's later change to its
    object does not reach a save in flight.

    Raises:
      ValueError: ``value`` is not msgpack-serializable, or not metadata a reader reads
        (format.md §4.1, :func:`~casstore._manifest_checks.metadata_problem`; names ``what``
        and where in it).
    """
    try:
        data = msgpack.packb(value, use_bin_type=True, default=_python_scalar)
    except (TypeError, ValueError, OverflowError) as e:
        where = _unpackable_at(value)
        raise ValueError(f"{what} is not msgpack-serializable{' at ' + where if where else ''}"
                         f": {e} (arrays: pass Python numbers or lists, e.g. .tolist())") from e
    if len(data) > MAX_METADATA_BYTES:
        raise ValueError(f"{what} is {len(data)} bytes encoded; the limit is 1 MiB")
    try:
        copy = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except TypeError as e:  # a tuple key reads back as a list, which no dict takes
        raise ValueError(f"{what} cannot be saved: a dict key that is a tuple or list ({e}); "
                         "keys are str, int, float, bool, None or bytes") from e
    problem = metadata_problem(copy)
    if problem is not None:
        raise ValueError(f"{what} cannot be saved: {problem.replace('metadata', what, 1)}")
    return copy


def _python_scalar(value: Any) -> Any:
    """msgpack's hook for what it cannot encode: a numpy or jax scalar (0-d) as a Python one."""
    if isinstance(value, np.generic | np.ndarray | jax.Array) and np.ndim(value) == 0:
        return value.item()
    raise TypeError(f"cannot serialize {type(value).__name__!r} object")
