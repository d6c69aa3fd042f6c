"""How much a repository stores and shares, per step, per run and in all (``casstore du``,
``casstore ls``), from manifests and one listing; no chunk data is read.

Every figure comes from the chunk refs of validated manifests (format.md §4.3): a chunk's
stored size is its ref's ``stored_bytes``. The repository order is the order the manifests
were written (``created``, then run and step), so a run's first step that reuses another run's
chunks shows them as shared, as they are on storage. A damaged manifest is left out of the
figures and reported in ``problems`` (see :func:`~casstore.scan_manifests`).
"""

from __future__ import annotations

import collections
import dataclasses

from ._layout import RUNS_PREFIX, chunk_key
from ._manifest import Manifest
from ._repository import Url, list_chunk_objects
from ._scan import Problem, scan_manifests
from .store import open_store


def object_sizes(manifests: list[Manifest], store: Url | None = None) -> dict[str, int]:
    """Stored bytes of every chunk object the manifests reference, by key (format.md §2).

    A delta chunk references its delta object and its base's chunk object (format.md §3.5).
    With ``store``, the sizes it lists (one listing): the bytes really stored, also of a base
    no given manifest references whole (its step was deleted) and of a chunk stored in
    another encoding than a copied manifest says. Without, the sizes the manifests give, and
    such a base counts 0 bytes.
    """
    refs = [r for m in manifests for leaf in m.leaves for r in leaf.chunks]
    sizes = {chunk_key(r.base): 0 for r in refs if r.base is not None}
    sizes.update({r.key: r.stored_bytes for r in refs})
    if store is not None:
        listed = {info.key: info.size for info in list_chunk_objects(open_store(store))}
        sizes.update({key: listed[key] for key in sizes if key in listed})
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


def step_usage(manifests: list[Manifest], sizes: dict[str, int] | None = None
               ) -> list[StepUsage]:
    """One :class:`StepUsage` per manifest, in the given (repository) order; ``sizes`` as
    :func:`object_sizes` gives them (None: from the manifests alone)."""
    size = sizes if sizes is not None else object_sizes(manifests)
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


def run_usage(manifests: list[Manifest], sizes: dict[str, int] | None = None
              ) -> list[RunUsage]:
    """One :class:`RunUsage` per run, sorted by run name; ``sizes`` as :func:`object_sizes`
    gives them (None: from the manifests alone)."""
    size = sizes if sizes is not None else object_sizes(manifests)
    ids: dict[str, set[str]] = collections.defaultdict(set)
    for m in manifests:
        ids[m.run] |= m.object_keys()
    runs_of = collections.Counter(c for chunk_ids in ids.values() for c in chunk_ids)
    return [RunUsage(run, sum(m.run == run for m in manifests),
                     sum(m.logical_bytes for m in manifests if m.run == run),
                     sum(size[c] for c in ids[run]),
                     sum(size[c] for c in ids[run] if runs_of[c] == 1)) for run in sorted(ids)]


@dataclasses.dataclass(frozen=True, slots=True)
class RepositoryUsage:
    """The result of :func:`usage` (bytes; stored bytes are object sizes on the store).

    Attributes:
      url: the repository.
      logical_bytes: raw bytes of every readable step's array leaves.
      stored_bytes: ``chunk_bytes + manifest_bytes``, as listed.
      chunk_bytes: every object under ``chunks/`` and ``deltas/``.
      manifest_bytes: every object under ``runs/``.
      unreferenced_bytes: chunk objects no readable manifest references (garbage for gc
        once past its grace period; with damaged manifests, possibly theirs).
      runs: one :class:`RunUsage` per run, by name.
      steps: one :class:`StepUsage` per readable step, in repository order.
      problems: one :class:`~casstore.Problem` per damaged manifest.
    """

    url: str
    logical_bytes: int
    stored_bytes: int
    chunk_bytes: int
    manifest_bytes: int
    unreferenced_bytes: int
    runs: tuple[RunUsage, ...]
    steps: tuple[StepUsage, ...]
    problems: tuple[Problem, ...]

    @property
    def dedup_ratio(self) -> float | None:
        """Logical over stored bytes, or None for an empty repository."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else None


def usage(url: Url, *, max_workers: int | None = None) -> RepositoryUsage:
    """Logical versus stored bytes of a repository: in all, per run and per step.

    Lists ``chunks/``, ``deltas/`` and ``runs/`` once and reads every manifest (in
    parallel); a damaged manifest is reported, not raised.

    Args:
      url: a path, an fsspec URL or a Store.
      max_workers: concurrent manifest reads (default the store's).

    Returns:
      A :class:`RepositoryUsage`; all zero where there is no repository.

    Raises:
      ManifestError: the repository's config object is damaged or of an unknown version.
      StoreTimeoutError, StoreUnreachableError, AccessDeniedError: the store failed.
    """
    store = open_store(url)
    scan = scan_manifests(store, max_workers=max_workers)
    manifests = list(scan.manifests)
    listed = {info.key: info.size for info in list_chunk_objects(store)}
    referenced = object_sizes(manifests)
    referenced.update({key: listed[key] for key in referenced if key in listed})
    chunk_bytes = sum(listed.values())
    unreferenced = sum(size for key, size in listed.items() if key not in referenced)
    manifest_bytes = sum(info.size for info in store.list(RUNS_PREFIX))
    return RepositoryUsage(store.url, sum(m.logical_bytes for m in manifests),
                           chunk_bytes + manifest_bytes, chunk_bytes, manifest_bytes,
                           unreferenced, tuple(run_usage(manifests, referenced)),
                           tuple(step_usage(manifests, referenced)), scan.damaged)
