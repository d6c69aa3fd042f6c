"""Verify a repository: manifests parse, chunks exist, and (optionally) chunks decode right.

restic's ``check`` and ``check --read-data``: every problem is reported, not just the first.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from ._delta import DeltaBases
from ._errors import CasstoreError, UnsupportedFormatError
from ._layout import RUNS_PREFIX, chunk_key, parse_manifest_key
from ._manifest import ChunkRef, Manifest, decode_manifest
from ._pool import bounded_map
from ._repository import Url, check_config, list_chunk_objects
from .store import open_store


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong: where (run, step, key path, chunk id, any may be None) and what.

    ``kind`` is ``"damage"`` (missing, corrupt or invalid) or ``"unsupported"``: an object of a
    newer format this casstore does not read (:class:`~casstore.UnsupportedFormatError`,
    format.md §10), which is no sign of damage; upgrade casstore.
    """

    run: str | None
    step: int | None
    key_path: str | None
    chunk_id: str | None
    message: str
    kind: str = "damage"

    def __str__(self) -> str:
        where = ", ".join(f"{k} {v!r}" for k, v in (("run", self.run), ("step", self.step), (
            "key path", self.key_path), ("chunk", self.chunk_id)) if v is not None)
        return f"{self.message} ({where})" if where else self.message


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyReport:
    """The result of :func:`verify`.

    Attributes:
      ok: no problem found.
      problems: every problem found.
      steps_checked: ``(run, step)`` pairs whose manifests were read.
      chunks_checked: distinct chunk objects (chunks and delta objects) checked for existence.
      bytes_read: chunk bytes read and decoded (0 without ``read_data``).
      seconds: wall time.
    """

    problems: tuple[Problem, ...]
    steps_checked: tuple[tuple[str, int], ...]
    chunks_checked: int
    bytes_read: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def unsupported(self) -> tuple[Problem, ...]:
        """The problems of kind ``"unsupported"``: a newer format, not damage."""
        return tuple(p for p in self.problems if p.kind == "unsupported")


def verify(url: Url, step: int | None = None, *, run: str | None = None, read_data: bool = True,
           max_workers: int | None = None) -> VerifyReport:
    """Checks that checkpoints are restorable, reporting every problem found.

    Lists ``chunks/`` and ``deltas/`` once; then, for each selected manifest: it must parse and
    validate (format.md §4.4); every chunk it references must exist, and for a delta chunk its
    base too (§3.5); with ``read_data`` each distinct chunk object is read once and must decode
    to its length and chunk id (§3.2), a delta rebuilt on its base (a base shared by
    deltas read once for all of them). Nothing is written.

    Args:
      url: a path, an fsspec URL or a Store.
      step: one step to check; None checks every step.
      run: one run to check; None checks every run.
      read_data: read and decode every referenced chunk (slow: reads the data).
      max_workers: concurrent chunk reads (default the store's).

    Returns:
      A :class:`VerifyReport` naming each bad step, key path and chunk id. A config object,
      manifest or chunk of a newer format (:class:`~casstore.UnsupportedFormatError`) is a
      problem of kind ``"unsupported"``, never reported as damage.

    Raises:
      ManifestError: the repository's config object is damaged.
    """
    t0 = time.perf_counter()
    store = open_store(url)
    problems: list[Problem] = []
    try:
        exists = check_config(store)
    except UnsupportedFormatError as e:
        return VerifyReport((_unsupported(run, step, None, e),), (), 0, 0,
                            time.perf_counter() - t0)
    if not exists:
        return VerifyReport((Problem(run, step, None, None, "no casstore repository here"),),
                            (), 0, 0, time.perf_counter() - t0)
    present = {info.key for info in list_chunk_objects(store)}
    manifests: list[Manifest] = []
    for info in store.list(RUNS_PREFIX):
        parsed = parse_manifest_key(info.key)
        if parsed is None or (run is not None and parsed[0] != run) or (
                step is not None and parsed[1] != step):
            continue
        try:
            manifests.append(decode_manifest(store.get(info.key), run=parsed[0], step=parsed[1],
                                             url=store.url))
        except UnsupportedFormatError as e:
            problems.append(_unsupported(parsed[0], parsed[1], None, e))
        except (CasstoreError, FileNotFoundError) as e:
            problems.append(Problem(parsed[0], parsed[1], getattr(e, "key_path", None), None,
                                    f"manifest unreadable: {e}"))
    if step is not None and not manifests and not problems:
        problems.append(Problem(run, step, None, None, "no such step"))
    # object key -> every (run, step, key path, chunk ref) that references it
    users: dict[str, list[tuple[str, int, str, ChunkRef]]] = collections.defaultdict(list)
    for m in manifests:
        for leaf in m.leaves:
            for ref in leaf.chunks:
                users[ref.key].append((m.run, m.step, leaf.path, ref))
                if ref.key not in present:
                    problems.append(Problem(m.run, m.step, leaf.path, ref.id, "chunk missing"))
                elif ref.base is not None and chunk_key(ref.base) not in present:
                    problems.append(Problem(m.run, m.step, leaf.path, ref.id,
                                            f"base chunk {ref.base} of a delta chunk missing"))
    bytes_read = 0
    if read_data:
        # deltas on one base side by side, so each base is held only while they are checked
        readable = sorted((k for k in users if k in present),
                          key=lambda k: users[k][0][3].base or users[k][0][3].id)
        bases = DeltaBases(store, [(users[k][0][3].id, users[k][0][3].base) for k in readable])

        def check(key: str) -> tuple[int, list[Problem]]:
            ref = users[key][0][3]
            try:
                data = bases.read(key, ref.id, ref.base)
                bases.decode(data, ref.id, ref.base, ref.raw_bytes)
                return len(data), []
            except UnsupportedFormatError as e:
                return 0, [_unsupported(r, s, p, e) for r, s, p, _ in users[key]]
            except (CasstoreError, FileNotFoundError) as e:
                return 0, [Problem(r, s, p, ref.id, f"chunk corrupt: {e}")
                           for r, s, p, _ in users[key]]

        for n, found in bounded_map(check, readable, max_workers or store.max_workers):
            bytes_read += n
            problems += found
    return VerifyReport(tuple(problems), tuple((m.run, m.step) for m in manifests), len(users),
                        bytes_read, time.perf_counter() - t0)


def _unsupported(run: str | None, step: int | None, key_path: str | None,
                 e: UnsupportedFormatError) -> Problem:
    """A problem of kind ``"unsupported"`` for ``e`` (format.md §10): not damage."""
    return Problem(run, step, key_path, e.chunk_id, str(e), kind="unsupported")
