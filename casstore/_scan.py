"""Reading a possibly damaged repository: every manifest that can be read, and a
:class:`Problem` for each that cannot (restic's ``check`` keeps going the same way).

One listing of ``runs/`` finds the manifests (format.md §2); each is read and validated
(§4.4) on its own, so a truncated or garbled manifest costs its own step, not the others.
Store failures (a timeout, access denied) are not damage: they propagate.
"""

from __future__ import annotations

import dataclasses

from ._errors import (
    STORE_FAILURES,
    CasstoreError,
    ManifestError,
    UnsupportedFormatError,
    unreadable,
)
from ._format import READER_VERSION
from ._layout import RUNS_PREFIX, manifest_key, parse_manifest_key
from ._manifest import Manifest
from ._pool import bounded_map
from ._repository import Url, check_config, read_decoded
from .store import Store, open_store

# Problem.kind values: what is wrong, and so what to do (docs/recovery.md).
MISSING = "missing"  # a referenced object does not exist
CORRUPT = "corrupt"  # an object's bytes fail their checks
MANIFEST = "manifest"  # a manifest does not read or validate
UNSUPPORTED = "unsupported"  # a newer format than this casstore reads: upgrade, not damage
NOT_FOUND = "not found"  # the step or repository asked for does not exist
CONFIG = "config"  # the config object is damaged, or missing where steps exist
@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a repository, reported once per damaged object.

    Attributes:
      run, step: the step at fault (a damaged manifest, or an object only it needs), or
        None for an object several steps need (see ``needed_by``).
      key_path: a key path that needs the object (the first of ``key_paths``), or None.
      chunk_id: the chunk at fault, or None for a manifest.
      message: what is wrong, one line.
      kind: ``"missing"``, ``"corrupt"``, ``"manifest"``, ``"config"`` (the repository's
        config object is damaged, or missing where steps exist: every reader refuses the
        repository until it is restored), ``"unsupported"`` (a format feature newer than
        this casstore: upgrade, the data is not damaged) or ``"not found"``.
      needed_by: ``(run, step)`` of every checked step that needs the object, sorted.
      key: the damaged object's store key (format.md §2), or None for a manifest.
      key_paths: every key path that needs the object, in the checked steps' leaf order: the
        members of a pack chunk (format.md §3.4), leaves of equal bytes, the leaves whose
        delta chunks need a base; ``(key_path,)`` when only that one is known, else empty.
    """

    run: str | None
    step: int | None
    key_path: str | None
    chunk_id: str | None
    message: str
    kind: str = CORRUPT
    needed_by: tuple[tuple[str, int], ...] = ()
    key: str | None = None
    key_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.key_paths and self.key_path is not None:
            object.__setattr__(self, "key_paths", (self.key_path,))

    def __str__(self) -> str:
        named = [f"{k} {v!r}" for k, v in (("run", self.run), ("step", self.step)) if v is not None]
        if len(self.key_paths) > 1:  # one --exclude each recovers the rest (docs/recovery.md)
            named.append("key paths " + ", ".join(map(repr, self.key_paths)))
        elif self.key_path is not None:
            named.append(f"key path {self.key_path!r}")
        if self.chunk_id is not None:
            named.append(f"chunk {self.chunk_id!r}")
        where = ", ".join(named)
        if self.needed_by:
            where += ("; " if where else "") + "needed by " + ", ".join(
                f"{r}@{s}" for r, s in self.needed_by)
        return f"{self.message} ({where})" if where else self.message


@dataclasses.dataclass(frozen=True, slots=True)
class ManifestScan:
    """The result of :func:`scan_manifests`.

    Attributes:
      manifests: every manifest that read and validated, in repository order (``created``,
        then run and step: the order the steps were written).
      damaged: one :class:`Problem` (kind ``"manifest"`` or ``"unsupported"``) per manifest
        that did not.
      listed: manifests listed (``len(manifests) + len(damaged)`` plus any deleted between
        the listing and the read).
    """

    manifests: tuple[Manifest, ...]
    damaged: tuple[Problem, ...]
    listed: int


def manifest_problem(run: str, step: int, error: Exception) -> Problem:
    """The :class:`Problem` for a manifest that failed to read with ``error``.

    This is the one place that tells an unsupported (newer) format from damage.
    """
    unsupported = type(error).__name__ == "UnsupportedFormatError"  # format.md's policy
    kind = UNSUPPORTED if unsupported else MANIFEST
    what = "needs a newer casstore" if unsupported else "manifest unreadable"
    return Problem(run, step, getattr(error, "key_path", None), None, f"{what}: {error}", kind,
                   ((run, step),))


def scan_manifests(url: Url, *, runs: list[str] | None = None, step: int | None = None,
                   max_workers: int | None = None, require_config: bool = True
                   ) -> ManifestScan:
    """Reads every manifest of ``runs`` (None: all) that can be read; reports the rest.

    Args:
      url: a path, an fsspec URL or a Store.
      runs: the runs to read; None reads every run.
      step: only this step of each run; None reads every step.
      max_workers: concurrent manifest reads (default the store's).
      require_config: read nothing unless the config object exists and validates; False
        reads the manifests whatever it holds (:func:`~casstore.verify`, which reports a
        damaged or missing config object itself).

    Returns:
      A :class:`ManifestScan`; empty where there is no repository.

    Raises:
      ManifestError: the repository's config object is damaged or of an unknown version
        (``require_config`` only).
      StoreTimeoutError, StoreUnreachableError, AccessDeniedError: the store failed.
    """
    store = open_store(url)
    if require_config and not check_config(store):
        return ManifestScan((), (), 0)
    keys = [(parsed, info.size) for info in store.list(RUNS_PREFIX)
            if (parsed := parse_manifest_key(info.key)) is not None
            and (runs is None or parsed[0] in runs) and (step is None or parsed[1] == step)]
    results = bounded_map(lambda ks: _read(store, *ks), keys, max_workers or store.max_workers)
    manifests = [r for r in results if isinstance(r, Manifest)]
    damaged = tuple(r for r in results if isinstance(r, Problem))
    return ManifestScan(tuple(sorted(manifests, key=lambda m: (m.created, m.run, m.step))),
                        damaged, len(keys))


def _read(store: Store, parsed: tuple[str, int], size: int) -> Manifest | Problem | None:
    """One manifest (``size`` bytes as listed), the Problem that stops it, or None if it was
    deleted since listing."""
    run, step = parsed
    try:
        return read_decoded(store, run, step, size)[1]
    except STORE_FAILURES:
        raise
    except FileNotFoundError as e:  # deleted since, unless still listed (a FIFO, a dead link)
        key = manifest_key(run, step)
        if not any(info.key == key for info in store.list(key)):
            return None
        return manifest_problem(run, step, ManifestError(
            f"listed, but no object that reads (not a regular file?): {e}", url=store.url,
            run=run, step=step))
    except (CasstoreError, ValueError) as e:
        return manifest_problem(run, step, e)
    except OSError as e:  # a bad block or a permission: this object, not the store
        if not unreadable(e):
            raise
        return manifest_problem(run, step, ManifestError(
            f"{type(e).__name__}: {e}", url=store.url, run=run, step=step))


def require_intact(scan: ManifestScan, what: str) -> None:
    """Raises ManifestError naming every damaged manifest if ``scan`` has any.

    Args:
      what: the operation refused, for the message (e.g. ``"gc"``).
    """
    steps = ", ".join(f"{p.run}@{p.step}" for p in scan.damaged)
    if scan.damaged and all(p.kind == UNSUPPORTED for p in scan.damaged):  # not damage
        raise UnsupportedFormatError(f"in {len(scan.damaged)} manifest(s) ({steps}), so "
                                     f"{what} refused; first: {scan.damaged[0].message}",
                                     needs=None, reader=READER_VERSION)
    if scan.damaged:
        raise ManifestError(f"{what} refused: {len(scan.damaged)} manifest(s) unreadable "
                            f"({steps}); first: {scan.damaged[0].message} (see "
                            "docs/recovery.md)")


def is_repository(url: Url) -> bool:
    """True if ``url`` holds a casstore repository (its config object, format.md §2.1).

    Raises:
      ManifestError: the config object is damaged or of an unknown version.
      StoreTimeoutError, StoreUnreachableError, AccessDeniedError: the store failed.
    """
    return check_config(open_store(url))
