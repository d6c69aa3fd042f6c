"""The retry and deadline policy of object-store requests (docs/reliability.md, "Deadlines").

What is worth retrying (:func:`is_transient`) and what says the store is overloaded
(:func:`is_congestion`), read from the exception and its causes; the loop that runs one
operation on one object with retries, exponential backoff and jitter within its deadline, each
attempt in a slot of an :class:`~casstore.store._adaptive.AdaptiveLimit`
(:class:`RetryPolicy`); and the client-library settings that leave that loop the only one:
per-request connect and read timeouts, one attempt per call (:func:`one_attempt_options`,
:func:`one_attempt`). The store adapter (:mod:`casstore.store._fsspec`) calls the filesystem;
this module decides how often and for how long.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import itertools
import json
import math
import random
import time
import types
from collections.abc import Callable
from typing import Any

import fsspec

from .._errors import AccessDeniedError, CasstoreError, CorruptChunkError
from .._layout import LOCKS_PREFIX
from ._adaptive import AdaptiveLimit
from ._reach import UNREACHABLE_S, is_unreachable, no_answer, retry_deadline

DEFAULT_REQUEST_TIMEOUT_S = 20.0
DEFAULT_OPERATION_TIMEOUT_S = 60.0

_TRANSIENT_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout",
                    "Throttling", "ThrottlingException", "RequestLimitExceeded", "503", "500"}
_TRANSIENT_ERRNOS = {errno.EREMOTEIO, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                     errno.EAGAIN, errno.EBUSY, errno.EPIPE}
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
              NotADirectoryError)


def _http_status(exc: BaseException) -> object:
    """The HTTP status of an aiohttp ``ClientResponseError`` (``status``) or gcsfs ``HttpError``
    (``code``); None for other errors."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else getattr(exc, "code", None)


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: 5xx, 408, 429/503 SlowDown, timeouts, connection
    resets, and the HTTP clients' own errors (aiohttp, urllib3, requests).

    Not found, already exists, permission and credential errors are permanent (restic's
    ``IsPermanentError``). The exception and its causes are inspected, since s3fs and gcsfs wrap
    botocore / HTTP errors in OSError.
    """
    seen = [exc, exc.__cause__, exc.__context__]
    if is_checksum_mismatch(exc):
        return True  # the next transfer's bytes may arrive intact
    if isinstance(exc, _PERMANENT):
        return False
    for e in (x for x in seen if x is not None):
        if isinstance(e, ValueError) and type(e).__module__.startswith("aiohttp"):
            return False  # an invalid URL (InvalidURL): no retry makes it valid
        if isinstance(e, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
            return True
        response = getattr(e, "response", None)  # botocore ClientError
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if response.get("Error", {}).get("Code") in _TRANSIENT_CODES or status >= 500 or (
                    status in (408, 429)):
                return True
        code = _http_status(e)
        if isinstance(code, int) and (code >= 500 or code in (408, 429)):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        # the HTTP clients' own errors (gcsfs turns a 502 into requests' ProxyError), and
        # botocore's of the connection (a read or connect timeout, a connection closed): these
        # are told by their class, not by the error they wrap, which an exception raised in an
        # ``except`` block replaces as its __context__
        if type(e).__module__.split(".")[0] in ("aiohttp", "urllib3", "requests") or any(
                c.__name__ == "HTTPClientError" and c.__module__.startswith("botocore")
                for c in type(e).__mro__):
            return True
        if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):  # a reply cut short or
            return True  # changed on its way (gcsfs parses its JSON replies)
    return False


def is_denied(exc: BaseException) -> bool:
    """True if the store refused the request's credentials or permissions: a PermissionError
    (s3fs maps 403 AccessDenied and bad keys to it), gcsfs's ``HttpError`` of a 401 or 403,
    or the ``OSError("Forbidden: ...")`` gcsfs raises for a 403."""
    return isinstance(exc, PermissionError) or (
        type(exc).__name__ == "HttpError" and _http_status(exc) in (401, 403)) or (
        type(exc) is OSError and str(exc).startswith("Forbidden: "))


_CHECKSUM_CODES = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"}
CHECKSUM_ATTEMPTS = 3  # transfers of one object whose bytes fail their checksum


def is_stored_mismatch(exc: BaseException) -> bool:
    """True if ``exc`` says an upload was stored with other bytes than were sent: gcsfs's
    ``ChecksumError`` (``consistency="md5"``), raised after GCS answered the upload."""
    return any(type(e).__name__ == "ChecksumError"
               for e in (exc, exc.__cause__, exc.__context__) if e is not None)


def is_checksum_mismatch(exc: BaseException) -> str | None:
    """``"upload"`` if the store refused an upload whose body does not match the checksum sent
    with it (S3 ``BadDigest``: botocore sends a CRC32C or CRC32 with every ``PutObject``),
    or an upload that GCS stored with other bytes than were sent (gcsfs's ``ChecksumError``);
    ``"download"`` if a download's body does not match the checksum the store keeps (botocore's
    ``FlexibleChecksumError``), else None. The exception and its causes are inspected."""
    for e in (exc, exc.__cause__, exc.__context__):
        if e is None:
            continue
        if type(e).__name__ == "ChecksumError":  # gcsfs: after an upload (is_stored_mismatch)
            return "upload"
        if type(e).__name__ == "FlexibleChecksumError":
            return "download"
        response = getattr(e, "response", None)  # botocore ClientError
        if isinstance(response, dict) and response.get("Error", {}).get("Code") in (
                _CHECKSUM_CODES):
            return "upload"
    return None


_CONGESTION_CODES = {"SlowDown", "ServiceUnavailable", "Throttling", "ThrottlingException",
                     "RequestLimitExceeded", "TooManyRequests", "503", "429"}


def is_congestion(exc: BaseException) -> bool:
    """True if ``exc`` says the store is overloaded: 503 SlowDown, 429, or a timeout."""
    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
            return True
        response = getattr(e, "response", None)  # botocore ClientError
        if isinstance(response, dict) and (
                response.get("Error", {}).get("Code") in _CONGESTION_CODES
                or response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (429, 503)):
            return True
        if _http_status(e) in (429, 503):
            return True
    return False


def one_attempt_options(protocol: str, request_timeout_s: float, options: dict) -> dict:
    """``options`` plus per-request timeouts and no client-side retries for s3fs and gcsfs."""
    options = dict(options)
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", request_timeout_s)
        config.setdefault("read_timeout", request_timeout_s)
        config.setdefault("retries", {"total_max_attempts": 1})
        options["config_kwargs"] = config
    elif protocol in ("gs", "gcs"):
        import aiohttp  # gcsfs's HTTP client

        options.setdefault("requests_timeout", aiohttp.ClientTimeout(
            sock_connect=request_timeout_s, sock_read=request_timeout_s))
        # gcsfs >= 2025.x asks the storage-control API for the bucket's layout before the first
        # request (ExtendedGcsFileSystem), retrying for 60 s by default, and falls back to plain
        # JSON-API access when it fails: bound that, so a refused endpoint fails in seconds.
        options.setdefault("retry_timeout", min(request_timeout_s, UNREACHABLE_S))
        # each upload's MD5 as GCS stored it, compared with what was sent (gcsfs raises
        # ChecksumError after the upload): a byte changed on its way is sent again
        options.setdefault("consistency", "md5")
    # Our own instance: the settings below must not leak into a user's cached filesystem.
    options.setdefault("skip_instance_cache", True)
    return options


def one_attempt(fs: fsspec.AbstractFileSystem) -> None:
    """Turns off the client library's own retry loop on ``fs`` (this instance only).

    s3fs retries ``fs.retries`` times (its ``_error_wrapper``); gcsfs wraps ``_request`` in
    ``retry_request`` with 6 attempts fixed when the class is defined, so the instance gets the
    undecorated method (``inspect.unwrap``; a no-op should a later gcsfs drop the decorator).
    """
    if hasattr(fs, "retries"):
        fs.retries = 1
    request = getattr(type(fs), "_request", None)
    if request is not None and inspect.unwrap(request) is not request:
        fs._request = types.MethodType(inspect.unwrap(request), fs)


class RetryPolicy:
    """Retries and deadlines of one store's operations; thread-safe.

    Args:
      url: the store's URL, for messages (no credentials).
      max_in_flight: the most requests at once while the store answers everything (the
        store's ``max_workers``); fewer while it throttles (:class:`AdaptiveLimit`). Requests
        for lock objects (``locks/``, format.md §8: one put and one delete per save or GC) go
        past the limit, so that a lock is never left waiting behind chunk requests, as when
        a save stopped by Ctrl-C releases its lock while its abandoned uploads still hold
        every slot on a stalled store.
      retries, backoff_s, max_backoff_s, request_timeout_s, operation_timeout_s: as
        :class:`~casstore.store.FsspecStore`'s; attributes that may be changed later.

    Raises:
      ValueError: a timeout that is not positive.
    """

    def __init__(self, url: str, max_in_flight: int, *, retries: int | None = None,
                 backoff_s: float = 0.2, max_backoff_s: float = 10.0,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 operation_timeout_s: float = DEFAULT_OPERATION_TIMEOUT_S):
        if not (0 < request_timeout_s < math.inf and 0 < operation_timeout_s < math.inf):
            raise ValueError("request_timeout_s and operation_timeout_s must be positive and "
                             f"finite, not {request_timeout_s!r} and {operation_timeout_s!r}")
        self.url = url
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        self.request_timeout_s, self.operation_timeout_s = request_timeout_s, operation_timeout_s
        self.limit = AdaptiveLimit(max_in_flight)
        self._unanswered = False  # the last operation to end timed out

    def _attempt(self, fn: Callable[[float], Any], deadline: float, limited: bool) -> Any:
        """``fn(seconds left)`` in a slot of the adaptive limit (if ``limited``), both before
        ``deadline``."""
        if not limited:
            return fn(deadline - time.monotonic())
        epoch = self.limit.acquire(deadline)
        if epoch is None or deadline <= time.monotonic():
            if epoch is not None:
                self.limit.release(epoch, congested=False)
            raise TimeoutError("no free request slot before the deadline")
        try:
            result = fn(deadline - time.monotonic())
        except Exception as e:
            self.limit.release(epoch, congested=is_congestion(e))
            raise
        self.limit.release(epoch, congested=False)
        return result

    def run(self, key: str, fn: Callable[[float], Any]) -> Any:
        """``fn(seconds left)``, retried on transient errors with exponential backoff and
        jitter until the operation's deadline (see :class:`~casstore.store.FsspecStore`).

        A permanent error (or the last transient one, when ``retries`` ran out) is raised with
        the object's URL added; a deadline that passed raises StoreTimeoutError. A refused
        request (:func:`is_denied`: S3's 403 AccessDenied and bad keys, GCS's 401 and 403)
        becomes :class:`~casstore.AccessDeniedError`, whose message names that URL. Bytes that fail
        their transfer checksum (:func:`is_checksum_mismatch`) are sent or fetched again, up
        to :data:`CHECKSUM_ATTEMPTS` times in all; then an upload raises the store's refusal
        (with the URL added) and a download raises :class:`~casstore.CorruptChunkError` naming
        that URL (a restore then takes the chunk from another tier, where there is one).
        """
        budget = self.operation_timeout_s
        if self._unanswered:
            budget = min(budget, self.request_timeout_s)
        deadline, refused, mismatches = time.monotonic() + budget, None, 0
        limited = not key.startswith(LOCKS_PREFIX)
        for attempt in itertools.count():
            try:  # one attempt gets at most half the deadline: a trickle leaves time to retry
                result = self._attempt(fn, min(deadline, time.monotonic() + budget / 2),
                                       limited)
            except Exception as e:  # classified by is_transient; anything else is re-raised
                if isinstance(e, CasstoreError) and isinstance(e, PermissionError):
                    raise
                if is_denied(e):
                    raise AccessDeniedError(f"the server refused access: {e}",
                                            url=f"{self.url}/{key}") from e
                mismatch = is_checksum_mismatch(e)
                mismatches += mismatch is not None
                if mismatch == "download" and (mismatches >= CHECKSUM_ATTEMPTS or (
                        time.monotonic() + self.backoff_s >= deadline)):
                    raise CorruptChunkError(
                        f"the object's bytes failed their transfer checksum {mismatches} "
                        f"time(s): {e}", url=f"{self.url}/{key}") from e
                last, deadline = e, min(deadline, retry_deadline(e))  # refused: within seconds
                refused = e if is_unreachable(e) else refused  # a later attempt may time out
                if not is_transient(e) or mismatches >= CHECKSUM_ATTEMPTS or (
                        self.retries is not None and attempt >= self.retries):
                    if not isinstance(e, FileNotFoundError) and hasattr(e, "add_note"):
                        e.add_note(f"casstore: while accessing {self.url}/{key}")
                    raise
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                delay *= random.uniform(0.5, 1.5)
                if time.monotonic() + delay >= deadline:
                    break
                time.sleep(delay)
            else:
                self._unanswered = False
                return result
        self._unanswered = True
        raise no_answer(budget, refused or last, key=key, url=self.url) from last


async def outcome(coro: Any) -> tuple[Any, Exception | None]:
    """``coro``'s (value, None) or (None, error), for ``asyncio.wait_for`` to run: the task it
    wraps ``coro`` in, cancelled by a caller that gave up (Ctrl-C) and ending with another
    error (a client's own for a cut request), is then no "Task exception was never
    retrieved" traceback: wait_for does not read that error."""
    try:
        return await coro, None
    except Exception as e:
        return None, e
