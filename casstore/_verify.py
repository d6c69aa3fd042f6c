"""Verify a repository: manifests parse, chunks exist, and (optionally) chunks decode right.

restic's ``check`` and ``check --read-data``: every problem is reported, not just the first.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from ._codec import decode_chunk
from ._errors import CasstoreError
from ._layout import CHUNKS_PREFIX, RUNS_PREFIX, chunk_id_of_key, chunk_key, parse_manifest_key
from ._manifest import Manifest, decode_manifest
from ._pool import bounded_map
from ._repository import Url, check_config
from .store import open_store


@dataclasses.dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong: where (run, step, key path, chunk id, any may be None) and what."""

    run: str | None
    step: int | None
    key_path: str | None
    chunk_id: str | None
    message: str

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
      chunks_checked: distinct chunk ids checked for existence.
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


def verify(url: Url, step: int | None = None, *, run: str | None = None, read_data: bool = True,
           max_workers: int | None = None) -> VerifyReport:
    """Checks that checkpoints are restorable, reporting every problem found.

    Lists ``chunks/`` once; then, for each selected manifest: it must parse and validate
    (format.md §4.4); every chunk it references must exist with at least a header's size; with
    ``read_data`` each distinct chunk is read once and must decode to its length and chunk id
    (format.md §3.2). Nothing is written.

    Args:
      url: a path, an fsspec URL or a Store.
      step: one step to check; None checks every step.
      run: one run to check; None checks every run.
      read_data: read and decode every referenced chunk (slow: reads the data).
      max_workers: concurrent chunk reads (default the store's).

    Returns:
      A :class:`VerifyReport` naming each bad step, key path and chunk id.

    Raises:
      ManifestError: the repository's config object is damaged or of an unknown version.
    """
    t0 = time.perf_counter()
    store = open_store(url)
    problems: list[Problem] = []
    if not check_config(store):
        return VerifyReport((Problem(run, step, None, None, "no casstore repository here"),),
                            (), 0, 0, time.perf_counter() - t0)
    sizes = {cid: info.size for info in store.list(CHUNKS_PREFIX)
             if (cid := chunk_id_of_key(info.key)) is not None}
    manifests: list[Manifest] = []
    for info in store.list(RUNS_PREFIX):
        parsed = parse_manifest_key(info.key)
        if parsed is None or (run is not None and parsed[0] != run) or (
                step is not None and parsed[1] != step):
            continue
        try:
            manifests.append(decode_manifest(store.get(info.key), run=parsed[0], step=parsed[1],
                                             url=store.url))
        except (CasstoreError, FileNotFoundError) as e:
            problems.append(Problem(parsed[0], parsed[1], getattr(e, "key_path", None), None,
                                    f"manifest unreadable: {e}"))
    if step is not None and not manifests and not problems:
        problems.append(Problem(run, step, None, None, "no such step"))
    # chunk id -> every (run, step, key path, raw length) that references it
    users: dict[str, list[tuple[str, int, str, int]]] = collections.defaultdict(list)
    for m in manifests:
        for leaf in m.leaves:
            for ref in leaf.chunks:
                users[ref.id].append((m.run, m.step, leaf.path, ref.raw_bytes))
                if ref.id not in sizes:
                    problems.append(Problem(m.run, m.step, leaf.path, ref.id, "chunk missing"))
    bytes_read = 0
    if read_data:
        def check(cid: str) -> tuple[int, list[Problem]]:
            try:
                data = store.get(chunk_key(cid))
                decode_chunk(data, cid, users[cid][0][3])
                return len(data), []
            except (CasstoreError, FileNotFoundError) as e:
                return 0, [Problem(r, s, p, cid, f"chunk corrupt: {e}")
                           for r, s, p, _ in users[cid]]

        for n, found in bounded_map(check, [c for c in users if c in sizes],
                                    max_workers or store.max_workers):
            bytes_read += n
            problems += found
    return VerifyReport(tuple(problems), tuple((m.run, m.step) for m in manifests), len(users),
                        bytes_read, time.perf_counter() - t0)
