"""The one place that turns chunk ids, runs and steps into store keys (format.md §2)."""

from __future__ import annotations

import re

from ._codec import is_chunk_id

CONFIG_KEY = "config"
CHUNKS_PREFIX = "chunks/"
RUNS_PREFIX = "runs/"
MAX_STEP = 10**16
_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")
_MANIFEST = re.compile(r"runs/([A-Za-z0-9][A-Za-z0-9._\-]{0,127})/steps/(\d{16})\.manifest")


def check_run(run: str) -> str:
    """Returns ``run`` if it is a valid run name, else raises ``ValueError``."""
    if not isinstance(run, str) or not _RUN.fullmatch(run):
        raise ValueError(f"invalid run name {run!r}: use letters, digits, '.', '_', '-' "
                         "(at most 128, starting with a letter or digit)")
    return run


def check_step(step: int) -> int:
    """Returns ``step`` if it is an int in ``[0, 10**16)``, else raises ``ValueError``."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < MAX_STEP:
        raise ValueError(f"invalid step {step!r}: steps are integers in [0, 10**16)")
    return step


def chunk_key(chunk_id: str) -> str:
    """``chunks/<2 hex>/<30 hex>`` for a chunk id (format.md §2)."""
    if not is_chunk_id(chunk_id):
        raise ValueError(f"invalid chunk id {chunk_id!r}")
    return f"{CHUNKS_PREFIX}{chunk_id[:2]}/{chunk_id[2:]}"


def chunk_id_of_key(key: str) -> str | None:
    """The chunk id a key under ``chunks/`` names, or None for any other key."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] + "/" == CHUNKS_PREFIX and len(parts[1]) == 2:
        cid = parts[1] + parts[2]
        return cid if is_chunk_id(cid) else None
    return None


def steps_prefix(run: str) -> str:
    """The prefix under which a run's manifests live."""
    return f"{RUNS_PREFIX}{check_run(run)}/steps/"


def manifest_key(run: str, step: int) -> str:
    """``runs/<run>/steps/<step:016d>.manifest`` (format.md §2)."""
    return f"{steps_prefix(run)}{check_step(step):016d}.manifest"


def parse_manifest_key(key: str) -> tuple[str, int] | None:
    """``(run, step)`` for a manifest key, or None for any other key (ignored by readers)."""
    m = _MANIFEST.fullmatch(key)
    return (m.group(1), int(m.group(2))) if m else None


LOCKS_PREFIX = "locks/"


def lock_key(kind: str, token: str) -> str:
    """``locks/<kind>-<token>`` for a save or gc lock (format.md §8)."""
    if kind not in ("save", "gc") or not re.fullmatch(r"[0-9a-f]{32}", token):
        raise ValueError(f"invalid lock {kind!r} {token!r}")
    return f"{LOCKS_PREFIX}{kind}-{token}"


def lock_kind(key: str) -> str | None:
    """``"save"`` or ``"gc"`` for a lock key, None for any other key."""
    m = re.fullmatch(r"locks/(save|gc)-[0-9a-f]{32}", key)
    return m.group(1) if m else None
