"""What steps store, share and change, from manifests alone (no chunk data is read).

Every figure here comes from the chunk refs of validated manifests (format.md §4.3): a chunk's
stored size is its ref's ``stored_bytes``, a leaf's share of a pack (§3.4) is its block's share
of the pack's raw bytes. The repository order is the order the manifests were written
(``created``, then run and step), so a run's first step that reuses another run's chunks shows
them as shared, as they are on storage.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import msgpack

from ._chunking import dtype_from_name
from ._errors import ManifestError
from ._manifest import ChunkRef, LeafEntry, Manifest, encode_manifest
from ._repository import Url, list_steps, read_manifest
from ._scan import Problem, manifest_problem
from .store import open_store


def _block_bytes(leaf: LeafEntry, ref: ChunkRef) -> int:
    return math.prod(ref.shape) * dtype_from_name(leaf.dtype).itemsize


def leaf_stored_bytes(leaf: LeafEntry) -> int:
    """Stored bytes of a leaf: each distinct chunk once (blocks of equal bytes, such as the
    shards of a zero-initialised array, are one chunk), a pack's split by raw-byte share."""
    covered: dict[str, int] = collections.defaultdict(int)
    sizes = {}
    for r in leaf.chunks:
        covered[r.key] += _block_bytes(leaf, r)
        sizes[r.key] = r.stored_bytes, r.raw_bytes
    return sum(round(stored * min(1.0, covered[key] / raw))
               for key, (stored, raw) in sizes.items())


def is_packed(leaf: LeafEntry) -> bool:
    """True if a chunk of the leaf holds other bytes too (a pack, format.md §3.4)."""
    return any(r.raw_bytes != _block_bytes(leaf, r) for r in leaf.chunks)


@dataclasses.dataclass(frozen=True, slots=True)
class LeafDiff:
    """One key path compared between two steps.

    Attributes:
      path: the key path.
      status: ``"unchanged"``, ``"changed"``, ``"added"`` (only in B) or ``"removed"`` (only
        in A).
      bytes_a, bytes_b: logical bytes in A and B (0 where absent, and for scalars).
      changed_bytes: logical bytes of B's blocks whose chunk A does not hold at the same place
        (all of B for an added leaf, of A for a removed one, B's for a new shape or dtype).
      packed: the leaf sits in a pack (format.md §3.4) in A or B, so a change of any leaf of
        the pack marks it changed: chunk ids cannot tell which member changed.
    """

    path: str
    status: str
    bytes_a: int
    bytes_b: int
    changed_bytes: int
    packed: bool


def _blocks(leaf: LeafEntry) -> set[tuple]:
    return {(r.id, r.start, r.stop, r.offset) for r in leaf.chunks}


def _changes(a: LeafEntry, b: LeafEntry) -> tuple[bool, int]:
    """Whether leaf ``b`` differs from ``a``, and the logical bytes of ``b`` that differ."""
    if a.kind == b.kind == "scalar":
        return (a.scalar_type, repr(a.value)) != (b.scalar_type, repr(b.value)), 0
    if a.kind != b.kind or (a.shape, a.dtype, a.key_impl, a.inline) != (
            b.shape, b.dtype, b.key_impl, b.inline):
        return True, b.nbytes
    old = _blocks(a)
    changed = sum(_block_bytes(b, r) for r in b.chunks
                  if (r.id, r.start, r.stop, r.offset) not in old)
    return changed > 0, changed


def diff_manifests(a: Manifest, b: Manifest) -> list[LeafDiff]:
    """Compares two steps leaf by leaf by chunk ids and inline values; reads no chunk data.

    Returns:
      One :class:`LeafDiff` per key path in A or B: A's order, then B's added paths.
    """
    in_a = {leaf.path: leaf for leaf in a.leaves}
    in_b = {leaf.path: leaf for leaf in b.leaves}
    out = []
    for path, x in in_a.items():
        y = in_b.get(path)
        if y is None:
            out.append(LeafDiff(path, "removed", x.nbytes, 0, x.nbytes, is_packed(x)))
            continue
        changed, nbytes = _changes(x, y)
        out.append(LeafDiff(path, "changed" if changed else "unchanged", x.nbytes, y.nbytes,
                            nbytes, is_packed(x) or is_packed(y)))
    out += [LeafDiff(p, "added", 0, y.nbytes, y.nbytes, is_packed(y))
            for p, y in in_b.items() if p not in in_a]
    return out


def diff_steps(url: Url, step_a: int, step_b: int, *, run: str = "default",
               run_b: str | None = None) -> list[LeafDiff]:
    """:func:`diff_manifests` of two committed steps (``run_b`` defaults to ``run``).

    Raises:
      StepNotFoundError: a step does not exist. ManifestError: its manifest is damaged.
    """
    store = open_store(url)
    return diff_manifests(read_manifest(store, step_a, run=run),
                          read_manifest(store, step_b, run=run_b or run))


@dataclasses.dataclass(frozen=True, slots=True)
class LeafInfo:
    """One leaf of a step, as ``casstore show`` lists it.

    Attributes:
      path: key path. kind: ``"array"`` or ``"scalar"``.
      shape: array shape (``()`` for scalars). dtype: saved dtype name, or the scalar's type.
      sharding: the saved sharding (format.md §4.6) or None.
      chunks: distinct chunks. inline: the bytes sit in the manifest (no chunk).
      logical_bytes: raw bytes. stored_bytes: its share of stored chunk bytes.
      shared_with_previous: ``"yes"``, ``"part"`` or ``"no"`` against the run's previous
        step; None for the first step or when the previous step's manifest is damaged.
    """

    path: str
    kind: str
    shape: tuple[int, ...]
    dtype: str | None
    sharding: object
    chunks: int
    logical_bytes: int
    stored_bytes: int
    inline: bool
    shared_with_previous: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class StepInfo:
    """The result of :func:`inspect_step`: one step, leaf by leaf.

    Attributes:
      run, step, created: the step (``created`` in seconds since the epoch).
      logical_bytes: raw bytes of its array leaves.
      previous_step: the run's step before it, or None.
      leaves: one :class:`LeafInfo` per leaf, in manifest order.
      problems: the previous step's manifest, if damaged (sharing then unknown).
    """

    run: str
    step: int
    created: float
    logical_bytes: int
    previous_step: int | None
    leaves: tuple[LeafInfo, ...]
    problems: tuple[Problem, ...]


def _shared(d: LeafDiff) -> str:
    if d.status == "unchanged":
        return "yes"
    return "part" if d.status == "changed" and d.changed_bytes < d.bytes_b else "no"


def inspect_step(url: Url, step: int | None = None, *, run: str = "default") -> StepInfo:
    """Each leaf of a step (None: the run's latest): shape, dtype, sharding, chunks, bytes,
    and sharing with the run's previous step. Reads two manifests, no chunk data.

    Raises:
      StepNotFoundError: the step does not exist. ManifestError: its manifest is damaged
      (a damaged previous step is reported in ``problems`` instead).
    """
    store = open_store(url)
    manifest = read_manifest(store, step, run=run)
    step = manifest.step
    earlier = [s for s in list_steps(store, run=run) if s < step]
    shared: dict[str, str] = {}
    problems: tuple[Problem, ...] = ()
    if earlier:
        try:
            previous = read_manifest(store, earlier[-1], run=run)
            shared = {d.path: _shared(d) for d in diff_manifests(previous, manifest)}
        except ManifestError as e:
            problems = (manifest_problem(run, earlier[-1], e),)
    leaves = tuple(LeafInfo(
        leaf.path, leaf.kind, tuple(leaf.shape), leaf.dtype or leaf.scalar_type, leaf.sharding,
        len({r.id for r in leaf.chunks}), leaf.nbytes, leaf_stored_bytes(leaf),
        leaf.inline is not None, shared.get(leaf.path)) for leaf in manifest.leaves)
    return StepInfo(run, step, manifest.created, manifest.logical_bytes,
                    earlier[-1] if earlier else None, leaves, problems)


def manifest_as_dict(manifest: Manifest) -> dict:
    """The manifest as format.md §4 lays it out, as plain dicts and lists (bytes stay bytes)."""
    return msgpack.unpackb(encode_manifest(manifest), raw=False, strict_map_key=False)
