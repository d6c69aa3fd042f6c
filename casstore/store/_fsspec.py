"""A store over any fsspec filesystem: s3://, gs://, memory://, ... (STYLE.md §3).

Bulk reads and writes go through fsspec's own batched calls (``fs.cat``, ``fs.pipe``), which
the async backends (s3fs, gcsfs) run concurrently. Create-only writes use
``pipe_file(mode="create")``: ``If-None-Match: *`` on s3fs, ``ifGenerationMatch=0`` on gcsfs
(a single-request upload below gcsfs's chunk size; manifests are small).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import posixpath
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

import fsspec

from .._errors import AccessDeniedError, CasstoreError, ObjectNotFoundError
from ._base import ObjectInfo, Store, check_key


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
        code = getattr(e, "code", None)  # gcsfs HttpError
        if isinstance(code, int) and (code >= 500 or code == 429):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        if type(e).__module__.split(".")[0] in ("aiohttp", "urllib3"):
            return True
    return False


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
      retries: retries of a call that failed with a transient error (:func:`is_transient`).
      backoff_s, max_backoff_s: the first retry waits about ``backoff_s`` seconds, doubling
        up to ``max_backoff_s``, each wait jittered by a factor in [0.5, 1.5].

    Saves and restores run 16 requests at once (``max_workers``; 8 for local disk): an object
    store's latency, not its bandwidth, bounds one request. Saves try the byte-shuffle codec
    (``shuffle``), since object storage bills and sends every byte.
    """

    max_workers = 16
    shuffle = True

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, read_only: bool = False,
                 url: str | None = None, batch_size: int = 64, retries: int = 6,
                 backoff_s: float = 0.2, max_backoff_s: float = 10.0):
        self.fs = fs
        self.root = root.rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.url = url or f"{protocol}://{self.root}"
        self.read_only = read_only
        self.batch_size = batch_size
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s

    def _retry(self, key: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, retried on transient errors with bounded exponential backoff and jitter.

        A permanent error (or the last transient one) is raised with the object's URL added;
        a refused request (s3fs maps 403 AccessDenied and bad keys to PermissionError) becomes
        :class:`~casstore.AccessDeniedError`, whose message names that URL.
        """
        for attempt in itertools.count():
            try:
                return fn()
            except PermissionError as e:
                if isinstance(e, CasstoreError):
                    raise
                raise AccessDeniedError(f"the server refused access: {e}",
                                        url=f"{self.url}/{key}") from e
            except Exception as e:  # classified by is_transient; anything else is re-raised
                if attempt >= self.retries or not is_transient(e):
                    if not isinstance(e, FileNotFoundError) and hasattr(e, "add_note"):
                        e.add_note(f"casstore: while accessing {self.url}/{key}")
                    raise
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                time.sleep(delay * random.uniform(0.5, 1.5))

    @classmethod
    def from_url(cls, url: str, *, read_only: bool = False, **storage_options) -> FsspecStore:
        """Opens ``url`` (e.g. ``s3://bucket/repo``) with fsspec ``storage_options``."""
        protocol = url.split("://")[0]
        if protocol in ("s3", "s3a", "gs", "gcs"):
            # Listings must be fresh: another process may have just committed a step.
            storage_options.setdefault("use_listings_cache", False)
        if protocol in ("s3", "s3a"):
            # s3fs sends a HEAD before every GET to decide on a ranged concurrent download
            # (objects over 50 MiB); chunks are 16 MiB by default, so one GET is enough.
            storage_options.setdefault("max_concurrency", 1)
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
        return cls(fs, root, read_only=read_only, url=url.rstrip("/"))

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _missing(self, key: str) -> ObjectNotFoundError:
        return ObjectNotFoundError("no such object", url=f"{self.url}/{key}")

    def get(self, key: str) -> bytes:
        path = self._path(check_key(key))
        try:
            return self._retry(key, lambda: self.fs.cat_file(path))
        except FileNotFoundError:
            pass
        # s3fs sizes objects through its listings cache, which may predate the object.
        self.fs.invalidate_cache(path)
        try:
            return self._retry(key, lambda: self.fs.cat_file(path))
        except FileNotFoundError:
            raise self._missing(key) from None

    def exists(self, key: str) -> bool:
        try:
            info = self._retry(key, lambda: self.fs.info(self._path(check_key(key))))
        except FileNotFoundError:
            return False
        return info.get("type") != "directory"

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = posixpath.dirname(prefix)
        top = f"{self.root}/{base}" if base else self.root
        self.fs.invalidate_cache(top)  # a listing must show what other processes just wrote
        try:
            found = self._retry(prefix, lambda: self.fs.find(top, detail=True))
        except FileNotFoundError:
            return
        start = len(self.root.lstrip("/")) + 1  # some filesystems add or drop a leading "/"
        for path in sorted(found):
            info = found[path]
            key = path.lstrip("/")[start:]
            if key.startswith(prefix) and info.get("type") != "directory":
                yield ObjectInfo(key, int(info.get("size") or 0), _mtime(info))

    def _put(self, key: str, data: bytes | memoryview, *, exclusive: bool) -> None:
        data = bytes(data) if isinstance(data, memoryview) else data
        if not exclusive:
            self._retry(key, lambda: self.fs.pipe_file(self._path(key), data))
            return
        attempts = []

        def create() -> None:
            attempts.append(1)
            try:
                self.fs.pipe_file(self._path(key), data, mode="create")
            except Exception as e:  # narrowed by _is_exists_error; everything else re-raises
                if not _is_exists_error(e):
                    raise
                # A retried create may find the object its own failed attempt stored.
                if len(attempts) > 1 and self.fs.cat_file(self._path(key)) == data:
                    return
                raise FileExistsError(f"{self.url}/{key} exists") from e

        self._retry(key, create)

    def _delete(self, key: str) -> None:
        try:
            self._retry(key, lambda: self.fs.rm_file(self._path(key)))
        except FileNotFoundError:
            pass

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        keys = [check_key(k) for k in keys]
        out: dict[str, bytes] = {}
        for i in range(0, len(keys), self.batch_size):
            batch = keys[i:i + self.batch_size]
            got = self._retry(batch[0], lambda b=batch: self.fs.cat(
                [self._path(k) for k in b], on_error="return"))
            for key in batch:
                value = got.get(self._path(key), FileNotFoundError())
                if isinstance(value, BaseException) and not isinstance(value, FileNotFoundError):
                    # once more alone: retried if transient, else raised naming its URL
                    value = self._retry(key, lambda k=key: self.fs.cat_file(self._path(k)))
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
            self._retry(batch[0], lambda b=batch: self.fs.pipe(
                {self._path(k): bytes(items[k]) for k in b}))
