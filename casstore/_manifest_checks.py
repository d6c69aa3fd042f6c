"""Manifest checks beyond a field's type, shared by the reader and the writer: the chunk
blocks' tiling of an array (format.md §4.3), user ``metadata`` (§4.1) and a leaf's saved
``sharding`` (§6.1).

Each function says what is wrong (None when nothing is), and each caller raises its own error
(:class:`~casstore.ManifestError` at read, ``ValueError`` at save), so a step is never written
that no reader reads. The input may be hostile (format.md §4.4), so no check's work grows as
a product of its parts: the tiling's is its refs plus its grid's cells, the metadata's at most
1 MiB of nodes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from ._keypath import MAX_DEPTH

MAX_METADATA_BYTES = 2**20  # encoded (format.md §4.1)
MAX_MESH_AXES = 16
MAX_MESH_DEVICES = 2**20
MAX_GRID_CELLS = 4_000_000
OVERLAP = "chunk blocks overlap or leave gaps"
_SCALARS = (type(None), bool, int, float, str, bytes)  # msgpack's own, less extension types


def metadata_problem(value: Any) -> str | None:
    """What makes ``value`` (as msgpack decodes it) other than format.md §4.1's metadata: nil,
    bool, int, float, str, bin, list and maps with keys of those scalar types (what casstore
    has always written; no extension type, such as a Timestamp), nested at most 256 deep (as
    the tree, §4.2), at most 1 MiB encoded; None if it is that. The work is bounded by 1 MiB
    of nodes whatever ``value`` holds: every node encodes to at least a byte (a str or bytes
    to one a character or byte), so a walk past that many is refused before it goes on.

    Returns:
      The problem, naming where in the metadata it is (``metadata['a'][0]``), or None.
    """
    stack: list[tuple[Any, tuple]] = [(value, ())]
    least = 1  # a lower bound of the encoded size: a byte a node pushed, and each str's chars
    while stack:
        node, at = stack.pop()
        if type(node) in (str, bytes):
            least += len(node)
        if least > MAX_METADATA_BYTES:
            return "metadata is over 1 MiB encoded"
        if type(node) in _SCALARS:
            continue
        where = "metadata" + "".join(f"[{k!r}]" for k in at)
        if type(node) not in (list, dict):
            return (f"{where} is of type {type(node).__name__} (format.md §4.1 allows nil, "
                    "bool, int, float, str, bytes, list and maps)")
        if len(at) >= MAX_DEPTH:
            return f"metadata is nested over {MAX_DEPTH} deep"
        least += len(node)
        if least > MAX_METADATA_BYTES:
            return "metadata is over 1 MiB encoded"
        if type(node) is dict:
            key = next((k for k in node if type(k) not in _SCALARS), None)
            if key is not None:
                return (f"{where} has a key of type {type(key).__name__}; map keys are nil, "
                        "bool, int, float, str or bytes")
            least += sum(1 + len(k) if type(k) in (str, bytes) else 1 for k in node)
            stack.extend((v, (*at, k)) for k, v in node.items())
        else:
            stack.extend((v, (*at, i)) for i, v in enumerate(node))
    if len(msgpack.packb(value, use_bin_type=True)) > MAX_METADATA_BYTES:
        return "metadata is over 1 MiB encoded"
    return None


def sharding_problem(info: Any, ndim: int) -> str | None:
    """What makes ``info`` other than a saved sharding of an array of ``ndim`` dimensions
    (format.md §6.1): nil, or a map with ``mesh`` (1 to 16 axes, non-empty str names, int sizes
    >= 1, multiplying to at most 2**20) and ``spec`` (at most one entry per dimension, each nil,
    an axis name or a list of them, every named axis in ``mesh``, none used twice); None if it
    is that. The problem is one of ``"not a map with mesh and spec"``, ``"mesh axes"`` and
    ``"partition spec"``."""
    if info is None:
        return None
    if not (type(info) is dict and type(info.get("mesh")) is dict
            and type(info.get("spec")) is list):
        return "not a map with mesh and spec"
    mesh, spec = info["mesh"], info["spec"]
    if not (0 < len(mesh) <= MAX_MESH_AXES and all(
            type(k) is str and k and type(v) is int and v > 0 for k, v in mesh.items())
            and math.prod(mesh.values()) <= MAX_MESH_DEVICES):
        return "mesh axes"
    if len(spec) > ndim:
        return "partition spec"
    used = [a for p in spec for a in (p if type(p) is list else [p]) if a is not None]
    if not (all(type(a) is str and a in mesh for a in used)
            and len(used) == len(set(used))):
        return "partition spec"
    return None


def tiling_problem(shape: tuple[int, ...], refs: Sequence[Any]) -> str | None:
    """What keeps the blocks of ``refs`` (objects with ``start`` and ``stop``, tuples of
    ``len(shape)`` ints, each block non-empty) from tiling ``shape`` exactly (format.md §4.3):
    a block outside it, volumes that do not sum to its element count, or two blocks that
    overlap (given the sum, a gap is an overlap elsewhere); None if they tile it.

    The work is the refs times the dimensions plus the cells of the grid the blocks' edges
    make (at most 4,000,000), never their product: each cell is marked once, and the first
    block over a marked cell is refused. Blocks of one cell each (every regular grid) are
    checked at once.
    """
    if math.prod(shape) == 0:
        return "chunks given for an empty array" if refs else None
    if not refs:
        return "array without chunks"
    if not all(all(b <= d for b, d in zip(r.stop, shape)) for r in refs):
        return "block out of bounds"
    if sum(math.prod(b - a for a, b in zip(r.start, r.stop)) for r in refs) != math.prod(shape):
        return OVERLAP
    if len(refs) == 1:  # most leaves: one block inside the bounds, of the array's volume
        return None
    edges = [np.array(sorted({0, d, *(r.start[i] for r in refs), *(r.stop[i] for r in refs)}))
             for i, d in enumerate(shape)]
    grid = tuple(len(e) - 1 for e in edges)
    if math.prod(grid) > MAX_GRID_CELLS:
        return "chunk grid too irregular to validate"
    if len(refs) > math.prod(grid):
        return OVERLAP  # two blocks share a cell
    index = [np.array([r.start for r in refs]), np.array([r.stop for r in refs])]
    lo, hi = ([np.searchsorted(e, x[:, i]) for i, e in enumerate(edges)] for x in index)
    if all(np.array_equal(a + 1, b) for a, b in zip(lo, hi)):
        # each block's cell, in C order (np.ravel_multi_index takes at most 63 dimensions)
        strides = [math.prod(grid[i + 1:]) for i in range(len(grid))]
        cells = np.unique(sum(a * s for a, s in zip(lo, strides)))
        return OVERLAP if len(cells) < len(refs) else None
    covered = np.zeros(grid, dtype=bool)
    for a, b in zip(zip(*(x.tolist() for x in lo)), zip(*(x.tolist() for x in hi))):
        block = covered[tuple(map(slice, a, b))]
        if block.any():
            return OVERLAP
        block[...] = True
    return None
