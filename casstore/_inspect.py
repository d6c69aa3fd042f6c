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

from ._chunking import dtype_from_name
from ._layout import chunk_key
from ._manifest import ChunkRef, LeafEntry, Manifest
from ._repository import Url
from ._scan import require_intact, scan_manifests


def load_manifests(url: Url, *, runs: list[str] | None = None,
                   max_workers: int | None = None) -> list[Manifest]:
    """Reads every committed manifest of ``runs`` (None: all runs) in repository order.

    For a repository that may be damaged, :func:`~casstore.scan_manifests` reads the rest.

    Returns:
      Manifests sorted by ``(created, run, step)``: the order their steps were written.

    Raises:
      ManifestError: a manifest or the config object is invalid (names every bad manifest).
    """
    scan = scan_manifests(url, runs=runs, max_workers=max_workers)
    require_intact(scan, "reading every manifest")
    return list(scan.manifests)


def object_sizes(manifests: list[Manifest]) -> dict[str, int]:
    """Stored bytes of every chunk object the manifests reference, by key (format.md §2).

    A delta chunk references its delta object and its base's chunk object (format.md §3.5).
    A base's size is known from a manifest that references that chunk whole; a base that no
    given manifest references whole (its step was deleted) counts 0 bytes.
    """
    refs = [r for m in manifests for leaf in m.leaves for r in leaf.chunks]
    sizes = {chunk_key(r.base): 0 for r in refs if r.base is not None}
    sizes.update({r.key: r.stored_bytes for r in refs})
    return sizes


@dataclasses.dataclass(frozen=True, slots=True)
class StepUsage:
    """The storage of one step (bytes are stored chunk bytes unless named logical).

    Attributes:
      run, step, created: which step; ``created`` in seconds since the epoch.
      leaves: leaf count. logical_bytes: raw bytes of its array leaves.
      stored_bytes: its distinct chunks.
      added_bytes: its chunks that no earlier step (repository order) references.
      shared_bytes: its chunks that an earlier step references (``stored - added``).
      unique_bytes: its chunks that no other step references: what deleting it frees.
    """

    run: str
    step: int
    created: float
    leaves: int
    logical_bytes: int
    stored_bytes: int
    added_bytes: int
    shared_bytes: int
    unique_bytes: int


def step_usage(manifests: list[Manifest]) -> list[StepUsage]:
    """One :class:`StepUsage` per manifest, in the given (repository) order."""
    size = object_sizes(manifests)
    users = collections.Counter(key for m in manifests for key in m.object_keys())
    seen: set[str] = set()
    out = []
    for m in manifests:
        ids = m.object_keys()
        added = sum(size[c] for c in ids - seen)
        stored = sum(size[c] for c in ids)
        out.append(StepUsage(m.run, m.step, m.created, len(m.leaves), m.logical_bytes, stored,
                             added, stored - added, sum(size[c] for c in ids if users[c] == 1)))
        seen |= ids
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class RunUsage:
    """The storage of one run: its steps' logical bytes, the stored bytes of the distinct
    chunks they reference, and of those referenced by no other run (``unique_bytes``)."""

    run: str
    steps: int
    logical_bytes: int
    stored_bytes: int
    unique_bytes: int


def run_usage(manifests: list[Manifest]) -> list[RunUsage]:
    """One :class:`RunUsage` per run, sorted by run name."""
    size = object_sizes(manifests)
    ids: dict[str, set[str]] = collections.defaultdict(set)
    for m in manifests:
        ids[m.run] |= m.object_keys()
    runs_of = collections.Counter(c for chunk_ids in ids.values() for c in chunk_ids)
    return [RunUsage(run, sum(m.run == run for m in manifests),
                     sum(m.logical_bytes for m in manifests if m.run == run),
                     sum(size[c] for c in ids[run]),
                     sum(size[c] for c in ids[run] if runs_of[c] == 1)) for run in sorted(ids)]


def _block_bytes(leaf: LeafEntry, ref: ChunkRef) -> int:
    return math.prod(ref.shape) * dtype_from_name(leaf.dtype).itemsize


def leaf_stored_bytes(leaf: LeafEntry) -> int:
    """Stored bytes of a leaf: its chunks' stored sizes, a pack's split by raw-byte share."""
    return sum(round(r.stored_bytes * _block_bytes(leaf, r) / r.raw_bytes) for r in leaf.chunks)


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
