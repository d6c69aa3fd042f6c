"""A store over any fsspec filesystem: s3://, gs://, memory://, ... (STYLE.md §3).

Bulk reads and writes go through fsspec's own batched calls (``fs.cat``, ``fs.pipe``), which
the async backends (s3fs, gcsfs) run concurrently. Create-only writes use
``pipe_file(mode="create")``: ``If-None-Match: *`` on s3fs, ``ifGenerationMatch=0`` on gcsfs
(a single-request upload below gcsfs's chunk size; manifests are small).

Deadlines (docs/reliability.md, "Deadlines"): every request has connect and read timeouts of
``request_timeout_s`` (botocore ``Config`` for s3fs, aiohttp ``ClientTimeout`` for gcsfs), and
each operation on one object has an overall deadline of ``operation_timeout_s`` across its
retries, enforced on fsspec's event loop (``asyncio.wait_for``), which also bounds a response
that trickles in. casstore's retry loop is the only one: s3fs, botocore and gcsfs make one
attempt per call.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import itertools
import posixpath
import random
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem

from .._errors import AccessDeniedError, CasstoreError, ObjectNotFoundError
from .._pool import default_workers
from ._adaptive import AdaptiveLimit
from ._base import ObjectInfo, Store, check_key
from ._reach import no_answer, retry_deadline

DEFAULT_REQUEST_TIMEOUT_S = 20.0
DEFAULT_OPERATION_TIMEOUT_S = 60.0


def _is_exists_error(exc: BaseException) -> bool:
    """True if ``exc`` says a create-only write found the object present.

    s3fs raises FileExistsError on moto and AWS; on SeaweedFS it raises OSError(EINVAL) whose
    cause is a botocore ClientError with code ``PreconditionFailed`` (TESTING-SERVERS.md).
    """
    if isinstance(exc, FileExistsError):
        return True
    cause = exc.__cause__
    code = getattr(cause, "response", {}).get("Error", {}).get("Code") if cause else None
    return code in ("PreconditionFailed", "412")


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
    """True for errors worth retrying: 5xx, 429/503 SlowDown, timeouts, connection resets.

    Not found, already exists, permission and credential errors are permanent (restic's
    ``IsPermanentError``). The exception and its causes are inspected, since s3fs and gcsfs wrap
    botocore / HTTP errors in OSError.
    """
    seen = [exc, exc.__cause__, exc.__context__]
    if isinstance(exc, _PERMANENT):
        return False
    for e in (x for x in seen if x is not None):
        if isinstance(e, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
            return True
        response = getattr(e, "response", None)  # botocore ClientError
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if response.get("Error", {}).get("Code") in _TRANSIENT_CODES or status >= 500 or (
                    status == 429):
                return True
        code = _http_status(e)
        if isinstance(code, int) and (code >= 500 or code == 429):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        if type(e).__module__.split(".")[0] in ("aiohttp", "urllib3"):
            return True
    return False


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


def _one_attempt_options(protocol: str, request_timeout_s: float, options: dict) -> dict:
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
    # Our own instance: the settings below must not leak into a user's cached filesystem.
    options.setdefault("skip_instance_cache", True)
    return options


def _one_attempt(fs: fsspec.AbstractFileSystem) -> None:
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


def _mtime(info: dict) -> float:
    """The modification time, seconds since the epoch, from an fsspec info dict."""
    for name in ("mtime", "LastModified", "updated", "created"):
        value = info.get(name)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return 0.0


class FsspecStore(Store):
    """A store at ``root`` on an fsspec filesystem ``fs``.

    Args:
      fs: the filesystem instance.
      root: the repository root on ``fs``, without protocol (e.g. ``bucket/path``).
      read_only: refuse writes.
      url: the URL shown in messages (no credentials); defaults to ``protocol://root``.
      batch_size: the largest number of objects in one ``fs.cat`` / ``fs.pipe`` call.
      retries: the most retries of a call that failed with a transient error
        (:func:`is_transient`); None retries until the operation's deadline.
      backoff_s, max_backoff_s: the first retry waits about ``backoff_s`` seconds, doubling
        up to ``max_backoff_s``, each wait jittered by a factor in [0.5, 1.5].
      request_timeout_s: the longest one request waits to connect or for the next bytes of an
        answer, seconds (set in the client library by :meth:`from_url`).
      operation_timeout_s: the deadline of one operation on one object (get, put, create,
        list, delete), seconds, retries and backoff included; it also bounds a response that
        trickles in; one attempt gets at most half of it, so a request that trickles leaves
        time for a retry. On expiry :class:`~casstore.StoreTimeoutError` names the URL and key.
        Enforced for async filesystems (s3fs, gcsfs, ...); a synchronous one (memory://) runs
        without a deadline. After an operation timed out, the next ones get one
        ``request_timeout_s`` each until the store answers again, so a save that failed
        releases its lock quickly.

    Saves and restores run 8 requests per usable core at once, at least 16 and at most 64
    (``max_workers``; 2 threads per core for local disk): an object store's latency, not its
    bandwidth, bounds one request. Requests in flight are capped by an
    :class:`AdaptiveLimit`: a store answering 503 SlowDown, 429 or timing out gets fewer at once.
    """

    max_workers = max(16, default_workers(io_per_core=8, cap=64))

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, read_only: bool = False,
                 url: str | None = None, batch_size: int = 64, retries: int | None = None,
                 backoff_s: float = 0.2, max_backoff_s: float = 10.0,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 operation_timeout_s: float = DEFAULT_OPERATION_TIMEOUT_S):
        if not (request_timeout_s > 0 and operation_timeout_s > 0):
            raise ValueError("request_timeout_s and operation_timeout_s must be positive")
        self.fs = fs
        self.root = root.rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.url = url or f"{protocol}://{self.root}"
        self.read_only = read_only
        self.batch_size = batch_size
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        self.request_timeout_s, self.operation_timeout_s = request_timeout_s, operation_timeout_s
        self.limit = AdaptiveLimit(self.max_workers)
        self._unanswered = False  # the last operation to end timed out

    def _call(self, method: str, *args, timeout: float, **kwargs) -> Any:
        """``fs.<method>(*args, **kwargs)``, cancelled after ``timeout`` seconds on an async
        filesystem (fsspec's ``sync`` runs it under ``asyncio.wait_for``)."""
        if isinstance(self.fs, AsyncFileSystem) and not self.fs.asynchronous:
            kwargs["timeout"] = max(timeout, 0.001)  # 0 would mean "no timeout"
        return getattr(self.fs, method)(*args, **kwargs)

    def _attempt(self, fn: Callable[[float], Any], deadline: float) -> Any:
        """``fn(seconds left)`` in a slot of the adaptive limit, both before ``deadline``."""
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

    def _retry(self, key: str, fn: Callable[[float], Any]) -> Any:
        """``fn(seconds left)``, retried on transient errors with exponential backoff and
        jitter until the operation's deadline (see the class docstring).

        A permanent error (or the last transient one, when ``retries`` ran out) is raised with
        the object's URL added; a deadline that passed raises StoreTimeoutError. A refused
        request (s3fs maps 403 AccessDenied and bad keys to PermissionError) becomes
        :class:`~casstore.AccessDeniedError`, whose message names that URL.
        """
        budget = self.operation_timeout_s
        if self._unanswered:
            budget = min(budget, self.request_timeout_s)
        deadline = time.monotonic() + budget
        for attempt in itertools.count():
            try:  # one attempt gets at most half the deadline: a trickle leaves time to retry
                result = self._attempt(fn, min(deadline, time.monotonic() + budget / 2))
            except PermissionError as e:
                if isinstance(e, CasstoreError):
                    raise
                raise AccessDeniedError(f"the server refused access: {e}",
                                        url=f"{self.url}/{key}") from e
            except Exception as e:  # classified by is_transient; anything else is re-raised
                last, deadline = e, min(deadline, retry_deadline(e))  # refused: within seconds
                if not is_transient(e) or (self.retries is not None and attempt >= self.retries):
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
        raise no_answer(budget, last, key=key, url=self.url) from last

    @classmethod
    def from_url(cls, url: str, *, read_only: bool = False,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 operation_timeout_s: float = DEFAULT_OPERATION_TIMEOUT_S,
                 **storage_options) -> FsspecStore:
        """Opens ``url`` (e.g. ``s3://bucket/repo``) with fsspec ``storage_options``.

        For s3:// and gs:// it sets the client library's connect and read timeouts to
        ``request_timeout_s`` and turns its own retries off (casstore retries, see the class
        docstring); ``config_kwargs`` (s3fs) or ``requests_timeout`` (gcsfs) given in
        ``storage_options`` take precedence.
        """
        protocol = url.split("://")[0]
        if protocol in ("s3", "s3a", "gs", "gcs"):
            # Listings must be fresh: another process may have just committed a step.
            storage_options.setdefault("use_listings_cache", False)
            storage_options = _one_attempt_options(protocol, request_timeout_s, storage_options)
        if protocol in ("s3", "s3a"):
            # s3fs sends a HEAD before every GET to decide on a ranged concurrent download
            # (objects over 50 MiB); chunks are 16 MiB by default, so one GET is enough.
            storage_options.setdefault("max_concurrency", 1)
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
        _one_attempt(fs)
        return cls(fs, root, read_only=read_only, url=url.rstrip("/"),
                   request_timeout_s=request_timeout_s, operation_timeout_s=operation_timeout_s)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _missing(self, key: str) -> ObjectNotFoundError:
        return ObjectNotFoundError("no such object", url=f"{self.url}/{key}")

    def get(self, key: str) -> bytes:
        path = self._path(check_key(key))
        try:
            return self._retry(key, lambda t: self._call("cat_file", path, timeout=t))
        except FileNotFoundError:
            pass
        # s3fs sizes objects through its listings cache, which may predate the object.
        self.fs.invalidate_cache(path)
        try:
            return self._retry(key, lambda t: self._call("cat_file", path, timeout=t))
        except FileNotFoundError:
            raise self._missing(key) from None

    def exists(self, key: str) -> bool:
        try:
            path = self._path(check_key(key))
            info = self._retry(key, lambda t: self._call("info", path, timeout=t))
        except FileNotFoundError:
            return False
        return info.get("type") != "directory"

    def stat(self, key: str) -> ObjectInfo:
        """One object's size and mtime: a single HEAD on S3 (s3fs's ``info`` follows a missing
        key with a LIST, to look for a directory), ``fs.info`` elsewhere."""
        path = self._path(check_key(key))
        if hasattr(self.fs, "call_s3"):  # s3fs
            bucket, name, _ = self.fs.split_path(path)
            info = self._retry(key, lambda t: self._head(bucket, name, key, t))
            return ObjectInfo(key, int(info["ContentLength"]), info["LastModified"].timestamp())
        try:
            info = self._retry(key, lambda t: self._call("info", path, timeout=t))
        except FileNotFoundError:
            raise self._missing(key) from None
        if info.get("type") == "directory":
            raise self._missing(key)
        return ObjectInfo(key, int(info.get("size") or 0), _mtime(info))

    def _head(self, bucket: str, name: str, key: str, timeout: float) -> dict:
        try:
            return self._call("call_s3", "head_object", Bucket=bucket, Key=name,
                              timeout=timeout)
        except FileNotFoundError:
            raise self._missing(key) from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Lists the prefix's directory, then each matching subdirectory in full.

        Each subdirectory is one operation with its own deadline, so a listing of ``chunks/``
        is 256 bounded operations of about 1/256 of the chunks each, not one that grows with
        the repository until it runs past ``operation_timeout_s``.
        """
        base = posixpath.dirname(prefix)
        top = f"{self.root}/{base}" if base else self.root
        self.fs.invalidate_cache(top)  # a listing must show what other processes just wrote
        try:
            entries = self._retry(prefix, lambda t: self._call("ls", top, detail=True,
                                                               timeout=t))
        except FileNotFoundError:
            return
        for entry in sorted(entries, key=lambda e: e["name"]):
            key = self._key(entry["name"])
            if entry.get("type") != "directory":
                yield from self._matching({entry["name"]: entry}, prefix)
            elif (key + "/").startswith(prefix) or prefix.startswith(key + "/"):
                self.fs.invalidate_cache(entry["name"])
                try:
                    found = self._retry(key, lambda t, d=entry["name"]: self._call(
                        "find", d, detail=True, timeout=t))
                except FileNotFoundError:  # emptied since the directory was listed
                    continue
                yield from self._matching(found, prefix)

    def _key(self, path: str) -> str:
        """The store key of a path the filesystem returned (with or without a leading "/")."""
        return path.lstrip("/")[len(self.root.lstrip("/")) + 1:]

    def _matching(self, found: dict, prefix: str) -> Iterator[ObjectInfo]:
        for path in sorted(found):
            info, key = found[path], self._key(path)
            if key.startswith(prefix) and info.get("type") != "directory":
                yield ObjectInfo(key, int(info.get("size") or 0), _mtime(info))

    def _put(self, key: str, data: bytes | memoryview, *, exclusive: bool) -> None:
        data = bytes(data) if isinstance(data, memoryview) else data
        if not exclusive:
            path = self._path(key)
            self._retry(key, lambda t: self._call("pipe_file", path, data, timeout=t))
            return
        attempts = []

        def create(timeout: float) -> None:
            attempts.append(1)
            t0 = time.monotonic()
            try:
                self._call("pipe_file", self._path(key), data, mode="create", timeout=timeout)
            except Exception as e:  # narrowed by _is_exists_error; everything else re-raises
                if not _is_exists_error(e):
                    raise
                # A retried create may find the object its own failed attempt stored.
                left = timeout - (time.monotonic() - t0)
                if len(attempts) > 1 and self._call("cat_file", self._path(key),
                                                    timeout=left) == data:
                    return
                raise FileExistsError(f"{self.url}/{key} exists") from e

        self._retry(key, create)

    def _delete(self, key: str) -> None:
        try:
            self._retry(key, lambda t: self._call("rm_file", self._path(key), timeout=t))
        except FileNotFoundError:
            pass

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        keys = [check_key(k) for k in keys]
        out: dict[str, bytes] = {}
        for i in range(0, len(keys), self.batch_size):
            batch = keys[i:i + self.batch_size]
            got = self._retry(batch[0], lambda t, b=batch: self._call(
                "cat", [self._path(k) for k in b], on_error="return", timeout=t))
            for key in batch:
                value = got.get(self._path(key), FileNotFoundError())
                if isinstance(value, BaseException) and not isinstance(value, FileNotFoundError):
                    # once more alone: retried if transient, else raised naming its URL
                    value = self._retry(key, lambda t, k=key: self._call(
                        "cat_file", self._path(k), timeout=t))
                if isinstance(value, FileNotFoundError):
                    raise self._missing(key) from value
                if isinstance(value, BaseException):
                    raise value
                out[key] = value
        return out

    def put_many(self, items: Mapping[str, bytes | memoryview]) -> None:
        for key in items:
            self._check_writable(key)
            check_key(key)
        keys = list(items)
        for i in range(0, len(keys), self.batch_size):
            batch = keys[i:i + self.batch_size]
            self._retry(batch[0], lambda t, b=batch: self._call(
                "pipe", {self._path(k): bytes(items[k]) for k in b}, timeout=t))
