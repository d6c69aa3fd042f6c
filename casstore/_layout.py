"""The one place that turns chunk ids, runs and steps into store keys (format.md §2)."""

from __future__ import annotations

import contextlib
import operator
import re

from ._codec import is_chunk_id

CONFIG_KEY = "config"
CHUNKS_PREFIX = "chunks/"
DELTAS_PREFIX = "deltas/"
RUNS_PREFIX = "runs/"
MAX_STEP = 10**16
_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")
_MANIFEST = re.compile(r"runs/([A-Za-z0-9][A-Za-z0-9._\-]{0,127})/steps/([0-9]{16})\.manifest")


def check_run(run: str) -> str:
    """Returns ``run`` if it is a valid run name, else raises ``ValueError``."""
    if not isinstance(run, str) or not _RUN.fullmatch(run):
        raise ValueError(f"invalid run name {run!r}: use letters, digits, '.', '_', '-' "
                         "(at most 128, starting with a letter or digit)")
    return run


def check_step(step: int) -> int:
    """``step`` as an int, if it is an integer in ``[0, 10**16)``: a Python int, or an integer
    numpy or jax scalar (a 0-d array, such as a train state's ``step``), read with
    ``operator.index``.

    Raises:
      ValueError: anything else, bools and floats included.
    """
    if not (isinstance(step, bool) or getattr(getattr(step, "dtype", None), "kind", "") == "b"):
        with contextlib.suppress(TypeError):
            value = operator.index(step)
            if 0 <= value < MAX_STEP:
                return value
    raise ValueError(f"invalid step {step!r}: steps are integers in [0, 10**16)")


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


def delta_key(chunk_id: str, base: str) -> str:
    """``deltas/<2 hex>/<30 hex>.<32 hex base>``: chunk ``chunk_id`` stored as a delta against
    the chunk ``base`` (format.md §2, §3.5)."""
    if not (is_chunk_id(chunk_id) and is_chunk_id(base)) or chunk_id == base:
        raise ValueError(f"invalid delta {chunk_id!r} against {base!r}")
    return f"{DELTAS_PREFIX}{chunk_id[:2]}/{chunk_id[2:]}.{base}"


def object_key(chunk_id: str, base: str | None = None) -> str:
    """The key of the object holding chunk ``chunk_id``: whole, or as a delta against ``base``."""
    return chunk_key(chunk_id) if base is None else delta_key(chunk_id, base)


def is_object_key(key: str) -> bool:
    """Whether ``key`` is a key :func:`object_key` can return (a chunk or a delta object)."""
    if chunk_id_of_key(key) is not None:
        return True
    parts = key.split("/")
    if len(parts) != 3 or parts[0] + "/" != DELTAS_PREFIX or len(parts[1]) != 2:
        return False
    cid, dot, base = parts[2].partition(".")
    return dot == "." and is_chunk_id(parts[1] + cid) and is_chunk_id(base) and (
        parts[1] + cid != base)


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
