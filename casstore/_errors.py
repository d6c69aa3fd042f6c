"""The exception hierarchy (STYLE.md §5).

Every error is a :class:`CasstoreError` and also the builtin it means, so plain
``except FileNotFoundError`` works. Errors carry the step, key path, chunk id and URL they are
about as attributes and name them in the message.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable


def warn_read_again(what: str, url: str) -> None:
    """Logs (WARNING, logger ``casstore``) that object ``what`` at ``url`` failed its checks
    as first read and passed when read again: damaged on its way, not in storage."""
    logging.getLogger("casstore").warning(
        "casstore: %s at %s failed its checks as first read and passed when read again "
        "(damaged on its way, not in storage)", what, url)


class CasstoreError(Exception):
    """Base class of every error casstore raises on purpose."""


def _where(**parts: object) -> str:
    """Formats the non-empty context parts as ``" (step 3, key path 'a/b')"``."""
    shown = [f"{name.replace('_', ' ')} {value!r}" for name, value in parts.items()
             if value is not None]
    return f" ({', '.join(shown)})" if shown else ""


class _Located(CasstoreError):
    """An error about a place in a repository: step, key path, chunk id, URL."""

    def __init__(self, message: str, *, step: int | None = None, key_path: str | None = None,
                 chunk_id: str | None = None, url: str | None = None, run: str | None = None):
        self.step, self.key_path, self.chunk_id, self.url, self.run = (
            step, key_path, chunk_id, url, run)
        self.message = message  # without the place, for an error that wraps this one
        where = _where(url=url, run=run, step=step, key_path=key_path, chunk_id=chunk_id)
        super().__init__(message + where)


class ObjectNotFoundError(_Located, FileNotFoundError):
    """A store key does not exist."""


class StepNotFoundError(_Located, FileNotFoundError):
    """The requested step (or any step, for ``step=None``) does not exist in the run."""


class StepAlreadyExistsError(_Located, FileExistsError, ValueError):
    """A save found the step already committed; nothing was changed. Also a ``ValueError``,
    which orbax raises for a step that exists, so code written for orbax catches it."""


class CorruptChunkError(_Located, ValueError):
    """A chunk's bytes do not decode to its recorded length and content address."""


class MissingChunkError(_Located, FileNotFoundError):
    """A chunk object (or the base chunk a delta chunk is stored against, format.md §3.5) that
    a manifest references does not exist: deleted by hand, by a GC without locks, or lost.

    Not corruption: the bytes that exist are intact. Carries ``key`` (the missing object's
    store key) beside the step, key path and chunk id of the first user that needed it; repair
    it by copying the step from another copy of the repository (docs/recovery.md).
    """

    def __init__(self, message: str, *, key: str | None = None, **where):
        self.key = key
        super().__init__(f"{message}; object {key!r}" if key else message, **where)


class ManifestError(_Located, ValueError):
    """A manifest or config object is malformed, out of limits or of an unknown version."""


class TargetMismatchError(_Located, ValueError):
    """The restore target disagrees with the checkpoint (structure, shape or kind).

    Attributes:
      missing: target key paths the checkpoint lacks.
      extra: saved key paths the target lacks.
      mismatched: ``(key path, reason)`` pairs of leaves of another shape or kind.
      key_path: the first of them.
    """

    missing: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, str], ...] = ()


class UnsupportedLeafError(_Located, TypeError):
    """A leaf of the pytree to save is neither an array nor a plain Python scalar or string."""


class ReadOnlyStoreError(_Located, PermissionError):
    """A write was attempted on a store opened with ``read_only=True``."""


class StoreTimeoutError(_Located, TimeoutError):
    """A store operation on one object found no answer within its deadline, retries included.

    Raised by object stores (``open_store``'s ``operation_timeout_s``) when a request stalls,
    trickles or keeps failing transiently (5xx, 503 SlowDown, 429) until the deadline. Carries
    ``url`` (the store), ``key`` (the object) and, when raised by a save or restore, the step,
    key path and chunk id.
    """

    def __init__(self, message: str, *, key: str | None = None, **where):
        super().__init__(f"{message}; object {key!r}" if key else message, **where)
        self.key, self.message = key, message  # the object apart: at() names it once

    def at(self, **where) -> StoreTimeoutError:
        """A copy of this error placed at a run, step, key path or chunk id (its cause: this)."""
        now = {"url": self.url, "run": self.run, "step": self.step, "key_path": self.key_path,
               "chunk_id": self.chunk_id}
        located = StoreTimeoutError(self.message, key=self.key, **{**now, **where})
        located.__cause__ = self
        return located


class TensorFileError(_Located, ValueError):
    """A .safetensors or .npz file is not valid (or holds what casstore cannot store); ``url``
    is the file's path."""


class StoreUnreachableError(_Located, ConnectionError):
    """No server answers at the store's endpoint: the connection was refused or the host name
    does not resolve. Raised within a few seconds (a server that accepts and then stalls gets
    :class:`StoreTimeoutError` at its deadline instead). Carries ``url``; the message names the
    endpoint the client tried."""


class AccessDeniedError(_Located, PermissionError):
    """The storage server refused a request: the credentials lack the permission (HTTP 403,
    S3 ``AccessDenied``), e.g. a write with read-only keys. Not retried."""


class UnsupportedFormatError(ManifestError):
    """The repository, a manifest or a chunk uses a format feature, codec or version that this
    casstore does not read (format.md §10): written by a newer casstore, so upgrade it.

    Raised before any chunk of the step is read. A :class:`ManifestError` (so a
    ``ValueError``), as the unknown versions it replaces were. Attributes: ``feature`` (what
    is unknown, e.g. ``"feature 'codec-9'"``, ``"chunk codec 9"`` or ``"version 3"``),
    ``needs`` (the casstore version the writer says reads it, or None where not recorded) and
    ``reader`` (this casstore's format reader version), besides the URL, run, step and chunk
    id.
    """

    def __init__(self, feature: str, *, needs: str | None, reader: str, **where):
        self.feature, self.needs, self.reader = feature, needs, reader
        upgrade = f"casstore >= {needs} reads it" if needs else "a newer casstore may read it"
        super().__init__(f"unsupported format {feature}: this casstore reads the format of "
                         f"casstore {reader}; {upgrade}", **where)


class PersistError(CasstoreError, OSError):
    """Persisting a step to the persistent tier failed; ``step`` and ``url`` say which and
    where (the cause is chained). The local tier has the step; a later persist or a reopened
    manager tries the newest steps again."""

    def __init__(self, message: str, *, step: int | None, url: str, run: str):
        self.step, self.url, self.run = step, url, run
        where = f", step {step}" if step is not None else ""
        super().__init__(f"{message} (url {url!r}, run {run!r}{where})")


# Failures of a whole store, not of one object: no other object's read would escape them.
STORE_FAILURES = (StoreTimeoutError, StoreUnreachableError, AccessDeniedError)


# What an operating system says of one file it cannot read: a bad block (EIO), a damaged
# inode (EUCLEAN, Linux's), a permission (EACCES, EPERM), a link to itself (ELOOP).
_UNREADABLE = {errno.EIO, errno.EACCES, errno.EPERM, errno.ELOOP, getattr(errno, "EUCLEAN", 117)}


def unreadable(e: BaseException) -> bool:
    """Whether ``e`` says that one object could not be read though it is there: an OSError of
    one of those errnos, not an error casstore raised (each names its own kind). Not a
    failure of the whole store, which every other read would meet too (a timeout, refused
    credentials, a FUSE mount gone, an NFS handle gone stale: s3fs raises EINVAL for an
    expired token)."""
    return (isinstance(e, OSError) and not isinstance(e, CasstoreError)
            and e.errno in _UNREADABLE)


def not_here(e: BaseException) -> bool:
    """Whether ``e`` says that a store has no usable copy of one object: missing there, or
    :func:`unreadable` there; another copy may serve."""
    return isinstance(e, FileNotFoundError) or unreadable(e)


def located(e: BaseException, step: int | None, url: str, run: str) -> BaseException:
    """The error to surface for a failed persist of ``step`` to ``url``, naming the step and
    URL (a tiered manager's, ``_tiers``)."""
    if isinstance(e, StoreTimeoutError):
        return e.at(run=run, step=step)
    if isinstance(e, PersistError):
        return e
    error = PersistError(f"persisting to the persistent tier failed: {type(e).__name__}: {e}",
                         step=step, url=url, run=run)
    error.__cause__ = e
    return error


def close_quietly(close: Callable[[], None], error: BaseException | None) -> None:
    """``close()`` at the end of a ``with`` block that ``error`` is leaving (None: none), so
    that a background save's error does not replace the caller's: it is then added to
    ``error`` as a note (orbax's managers let it replace the caller's)."""
    if error is None:
        close()
        return
    try:
        close()
    except Exception as e:
        error.add_note(f"casstore: closing the checkpointer then failed too: "
                       f"{type(e).__name__}: {e}")
