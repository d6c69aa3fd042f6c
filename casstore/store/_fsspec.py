"""A store over any fsspec filesystem: s3://, gs://, memory://, ... (STYLE.md §3).

Bulk reads and writes go through fsspec's own batched calls (``fs.cat``, ``fs.pipe``), which
the async backends (s3fs, gcsfs) run concurrently. Create-only writes use
``pipe_file(mode="create")``: ``If-None-Match: *`` on s3fs, ``ifGenerationMatch=0`` on gcsfs
(a single-request upload below gcsfs's chunk size; manifests are small).

This module is the adapter: it turns store operations into filesystem calls, each given the
seconds left before its deadline (enforced on fsspec's event loop with ``asyncio.wait_for``,
which also bounds a response that trickles in). How often a call is retried and for how long
is the policy of :mod:`casstore.store._retry` (docs/reliability.md, "Deadlines"): every
request has connect and read timeouts of ``request_timeout_s`` (botocore ``Config`` for s3fs,
aiohttp ``ClientTimeout`` for gcsfs), each operation on one object an overall deadline of
``operation_timeout_s`` across its retries, and casstore's retry loop is the only one: s3fs,
botocore and gcsfs make one attempt per call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import functools
import os
import posixpath
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.exceptions import FSTimeoutError

from .._errors import ObjectNotFoundError, StoreTimeoutError, StoreUnreachableError
from .._pool import current_scope
from . import _clients
from ._base import ObjectInfo, Store, check_key
from ._retry import (
    DEFAULT_OPERATION_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    RetryPolicy,
    is_stored_mismatch,
    one_attempt,
    one_attempt_options,
    outcome,
)

OBJECT_PROTOCOLS = ("s3", "s3a", "gs", "gcs")


def _mtime(info: dict) -> float:
    """The modification time, seconds since the epoch, from an fsspec info dict; now where it
    gives none (fails safe: GC's grace period then spares the object, and a lock is live)."""
    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(name)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return time.time()


class FsspecStore(Store):
    """A store at ``root`` on an fsspec filesystem ``fs``.

    Args:
      fs: the filesystem instance.
      root: the repository root on ``fs``, without protocol (e.g. ``bucket/path``).
      read_only: refuse writes.
      url: the URL shown in messages (no credentials); defaults to ``protocol://root``.
      batch_size: the largest number of objects in one ``fs.cat`` / ``fs.pipe`` call.
      retries: the most retries of a call that failed with a transient error
        (:func:`~casstore.store._retry.is_transient`); None retries until the operation's
        deadline.
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

    Saves and restores run 5 requests per usable core at once (``workers_per_core``; 2 for
    local disk), at most 64 (``max_workers_cap``): an object store's latency, not its
    bandwidth, bounds one request, so the requests in flight outnumber the cores (more were
    slower on 2 cores: benchmarks/README.md, "botocore's connection pool, and 5 requests a
    core"). Requests in flight are capped by an
    :class:`~casstore.store._adaptive.AdaptiveLimit`: a store answering 503 SlowDown, 429 or
    timing out gets fewer at once.

    Attributes:
      policy: the :class:`~casstore.store._retry.RetryPolicy` every operation runs under; its
        ``retries``, ``backoff_s``, ``max_backoff_s`` and timeouts may be changed on it, and
        its ``limit`` is the adaptive limit.

    Raises:
      ValueError: a timeout that is not positive.
    """

    workers_per_core = 5
    max_workers_cap = 64

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, read_only: bool = False,
                 url: str | None = None, batch_size: int = 64, retries: int | None = None,
                 backoff_s: float = 0.2, max_backoff_s: float = 10.0,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 operation_timeout_s: float = DEFAULT_OPERATION_TIMEOUT_S):
        self.fs = fs
        self.root = root.rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.url = url or f"{protocol}://{self.root}"
        self.read_only = read_only
        self.batch_size = batch_size
        self.put_options: dict | None = None  # put_options(fs), at the first upload
        self.policy = RetryPolicy(
            self.url, self.max_workers, retries=retries, backoff_s=backoff_s,
            max_backoff_s=max_backoff_s, request_timeout_s=request_timeout_s,
            operation_timeout_s=operation_timeout_s)

    def _call(self, method: str | Callable, *args, timeout: float, **kwargs) -> Any:
        """``fs.<method>(*args, **kwargs)``; on an async filesystem its coroutine
        ``fs._<method>`` (or ``method(fs, ...)``, a coroutine function) runs on fsspec's event
        loop, as fsspec's ``sync`` runs it, cancelled after ``timeout`` seconds or when the
        calling thread's call is abandoned (Ctrl-C, :class:`~casstore._pool.Scope`), and
        raises ``FSTimeoutError`` for a timeout (also where the loop, busy, fails to end the
        request within a second after it)."""
        if not isinstance(self.fs, AsyncFileSystem) or self.fs.asynchronous:
            return getattr(self.fs, method)(*args, **kwargs)
        scope = current_scope()
        if scope is not None and scope.abandoned:
            name = getattr(method, "__name__", method)
            raise cf.CancelledError(f"the call was stopped (Ctrl-C): {name} not sent")
        timeout = max(timeout, 0.001)
        call = (getattr(self.fs, f"_{method}") if isinstance(method, str)
                else functools.partial(method, self.fs))
        coro = asyncio.wait_for(outcome(call(*args, **kwargs)), timeout)
        future = asyncio.run_coroutine_threadsafe(coro, self.fs.loop)
        if scope is not None:
            scope.track(future)
        try:
            value, error = future.result(timeout + 1.0)
            if error is not None:
                raise error
            return value
        except (TimeoutError, cf.TimeoutError) as e:  # as fsspec's sync does
            future.cancel()
            raise FSTimeoutError from e
        except BaseException:  # Ctrl-C in this thread: the request is not waited for
            future.cancel()
            raise
        finally:
            if scope is not None:
                scope.untrack(future)

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

        Raises:
          ValueError: the path holds an empty segment (``a//b``), or on S3 and GCS a ``.`` or
            ``..`` segment (servers differ on such keys); on S3 and GCS, a storage option the
            client library does not take (:func:`~casstore.store.unknown_storage_options`); a
            timeout that is not a positive number.
          FileNotFoundError: on GCS, a ``token`` that names a credentials file (a path, or a
            name ending ``.json``) that does not exist.
        """
        protocol = url.partition("://")[0]
        storage_options = _clients.checked_options(url, storage_options, request_timeout_s,
                                                   operation_timeout_s)
        token = storage_options.get("token")
        if (protocol in ("gs", "gcs") and isinstance(token, str) and ("/" in token or
                token.endswith(".json")) and not os.path.exists(os.path.expanduser(token))):
            raise FileNotFoundError(f"token {token!r} for {url!r}: no such credentials file "
                                    "(gcsfs would send it to Google as an access token)")
        if protocol in OBJECT_PROTOCOLS:
            # Listings must be fresh: another process may have just committed a step.
            storage_options.setdefault("use_listings_cache", False)
            storage_options = one_attempt_options(protocol, request_timeout_s, storage_options)
        if protocol in ("s3", "s3a"):
            # s3fs sends a HEAD before every GET to decide on a ranged concurrent download
            # (objects over 50 MiB); chunks are 16 MiB by default, so one GET is enough.
            storage_options.setdefault("max_concurrency", 1)
            # botocore opens at most 10 connections: fewer than the requests a save runs at
            # once on 3 cores or more, and none left for a lock's release (which goes past
            # the adaptive limit, _retry) while stalled chunk requests hold them all.
            storage_options["config_kwargs"].setdefault("max_pool_connections",
                                                        cls.max_workers_cap + 16)
            _clients.no_tls_setup(storage_options)
            if "profile" not in storage_options:  # a profile is a session's own setting
                storage_options.setdefault("session", _clients.shared_aio_session())
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
        one_attempt(fs)
        return cls(fs, root, read_only=read_only, url=url.rstrip("/"),
                   request_timeout_s=request_timeout_s, operation_timeout_s=operation_timeout_s)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _missing(self, key: str) -> ObjectNotFoundError:
        return ObjectNotFoundError("no such object", url=f"{self.url}/{key}")

    def get(self, key: str) -> bytes:
        return self._cat(key)

    def head(self, key: str, nbytes: int) -> bytes:
        """One GET on S3 whose body is read only up to ``nbytes`` (all of it, so botocore
        checks it against the checksum the store keeps, where the object is no longer: a
        ranged GET gets no checksum); one ranged GET (``Range: bytes=0-{nbytes - 1}``) on GCS
        and elsewhere. GCS refuses every range of an empty object (416), so a refused read of
        an object that a HEAD finds empty gives ``b""``."""
        if hasattr(self.fs, "_call_s3") and not self.fs.asynchronous:
            return self._cat(key, _clients.s3_head, nbytes=nbytes)
        try:
            return self._cat(key, start=0, end=nbytes)
        except (FileNotFoundError, PermissionError, StoreTimeoutError, StoreUnreachableError):
            raise
        except Exception:
            if self.stat(key).size:
                raise
            return b""

    def _cat(self, key: str, method: str | Callable = "cat_file", **options) -> bytes:
        path = self._path(check_key(key))
        read = lambda t: self._call(method, path, timeout=t, **options)  # noqa: E731
        try:
            return self.policy.run(key, read)
        except FileNotFoundError:
            pass
        # s3fs sizes objects through its listings cache, which may predate the object.
        self.fs.invalidate_cache(path)
        try:
            return self.policy.run(key, read)
        except FileNotFoundError:
            raise self._missing(key) from None

    def exists(self, key: str) -> bool:
        try:
            path = self._path(check_key(key))
            info = self.policy.run(key, lambda t: self._call("info", path, timeout=t))
        except FileNotFoundError:
            return False
        return info.get("type") != "directory"

    def stat(self, key: str) -> ObjectInfo:
        """One object's size and mtime: a single HEAD on S3 (s3fs's ``info`` follows a missing
        key with a LIST, to look for a directory), ``fs.info`` elsewhere."""
        path = self._path(check_key(key))
        if hasattr(self.fs, "call_s3"):  # s3fs
            bucket, name, _ = self.fs.split_path(path)
            info = self.policy.run(key, lambda t: self._head_object(bucket, name, key, t))
            return ObjectInfo(key, int(info["ContentLength"]), info["LastModified"].timestamp())
        try:
            info = self.policy.run(key, lambda t: self._call("info", path, timeout=t))
        except FileNotFoundError:
            raise self._missing(key) from None
        if info.get("type") == "directory":
            raise self._missing(key)
        return ObjectInfo(key, int(info.get("size") or 0), _mtime(info))

    def _head_object(self, bucket: str, name: str, key: str, timeout: float) -> dict:
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
            entries = self.policy.run(prefix, lambda t: self._call("ls", top, detail=True,
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
                    found = self.policy.run(key, lambda t, d=entry["name"]: self._call(
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

    def _body(self, data: bytes | memoryview) -> bytes | _clients.Body:
        """A new body for one upload attempt: a :class:`~casstore.store._clients.Body` on s3fs
        (except for objects it uploads in parts, which it slices), else bytes."""
        view = memoryview(data)
        if hasattr(self.fs, "call_s3") and view.nbytes < _clients.S3FS_SINGLE_PUT_BYTES:
            return _clients.Body(view if view.contiguous else bytes(view))
        return bytes(data) if isinstance(data, memoryview) else data

    def _put(self, key: str, data: bytes | memoryview, *, exclusive: bool) -> None:
        try:
            self._write(key, data, exclusive)
        except FileNotFoundError as e:  # S3's NoSuchBucket, GCS's 404 on an upload
            raise ObjectNotFoundError("cannot write: the bucket does not exist (create it "
                                      f"first): {e}", url=f"{self.url}/{key}") from e

    def _write(self, key: str, data: bytes | memoryview, exclusive: bool) -> None:
        options = self._options_for(memoryview(data).nbytes)
        if not exclusive:
            path = self._path(key)
            self.policy.run(key, lambda t: self._call("pipe_file", path, self._body(data),
                                                      timeout=t, **options))
            return
        ours: list[int] = []
        if self.fs.protocol in ("gs", ("gs", "gcs")):  # gcsfs: in one request, whose
            options = {**options, "chunksize": memoryview(data).nbytes + 1}  # precondition
            # fake-gcs-server honours (a resumable upload's it ignores, TESTING-SERVERS.md)

        def create(timeout: float) -> None:
            t0 = time.monotonic()
            if ours:  # an earlier attempt stored it, then failed its checksum: rewrite ours
                return self._call("pipe_file", self._path(key), self._body(data),
                                  timeout=timeout, **options)
            try:
                self._call("pipe_file", self._path(key), self._body(data), mode="create",
                           timeout=timeout, **options)
            except Exception as e:  # narrowed by is_exists_error; everything else re-raises
                ours.extend([1] if is_stored_mismatch(e) else [])
                if not _clients.is_exists_error(e):
                    raise
                # A create may find the object its own earlier attempt stored: casstore's
                # retry's, or aiohttp's, which resends a PUT whose connection closed unanswered.
                left = timeout - (time.monotonic() - t0)
                if self._call("cat_file", self._path(key), timeout=left) == bytes(data):
                    return
                raise FileExistsError(f"{self.url}/{key} exists") from e

        try:
            self.policy.run(key, create)
        except BaseException:
            if ours:  # never leave our damaged bytes where a reader takes them for a commit
                with contextlib.suppress(Exception):
                    self._delete(key)
            raise

    def location(self) -> str:
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        if "file" in protocols:
            return os.path.realpath(self.root).rstrip("/") + "/"
        return f"{protocols[0]}://{self.root.strip('/')}/"  # gcs:// as gs://, s3a:// as s3://

    def server_side_copy(self, src: Store, key: str, size: int | None = None) -> int | None:
        """:meth:`Store.server_side_copy` where ``src`` is on a filesystem of the same kind with
        the same endpoint and credentials (:func:`~casstore.store._clients.same_service`): on
        s3fs one CopyObject (an object of 5 GiB or more: ``fs.cp_file``, a HEAD then a copy in
        parts), elsewhere ``fs.cp_file`` (one rewrite on gcsfs), after a ``stat`` of the source:
        an object of another size than ``size`` (cut short) is not copied (None: the caller
        reads it, and names the damage)."""
        if not isinstance(src, FsspecStore) or not _clients.same_service(src.fs, self.fs):
            return None
        self._check_writable(key)
        found = src.stat(key).size
        if size is not None and found != size:
            return None  # cut short (or replaced): the caller reads it and names the damage
        size = found
        from_path, to_path = src._path(key), self._path(key)
        if hasattr(self.fs, "call_s3") and size < _clients.S3_COPY_OBJECT_BYTES:
            (bucket, name, _), (to_bucket, to_name, _) = map(self.fs.split_path,
                                                              (from_path, to_path))
            self.policy.run(key, lambda t: self._call(
                "call_s3", "copy_object", Bucket=to_bucket, Key=to_name,
                CopySource={"Bucket": bucket, "Key": name}, timeout=t))
        else:
            self.policy.run(key, lambda t: self._call("cp_file", from_path, to_path, timeout=t))
        return size

    def _delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.policy.run(key, lambda t: self._call("rm_file", self._path(key), timeout=t))

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        keys = [check_key(k) for k in keys]
        out: dict[str, bytes] = {}
        for i in range(0, len(keys), self.batch_size):
            batch = keys[i:i + self.batch_size]
            # cat_ranges, not cat, which takes "[...]" in a path as a glob pattern
            got = self.policy.run(batch[0], lambda t, b=batch: self._call(
                "cat_ranges", [self._path(k) for k in b], [None] * len(b), [None] * len(b),
                on_error="return", timeout=t))
            for key, value in zip(batch, got, strict=True):
                if isinstance(value, BaseException) and not isinstance(value, FileNotFoundError):
                    # once more alone: retried if transient, else raised naming its URL
                    value = self.policy.run(key, lambda t, k=key: self._call(
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
            options = self._options_for(max(memoryview(items[k]).nbytes for k in batch))
            self.policy.run(batch[0], lambda t, b=batch, o=options: self._call(
                "pipe", {self._path(k): self._body(items[k]) for k in b}, timeout=t, **o))

    def _options_for(self, nbytes: int) -> dict:
        """:attr:`put_options` for an upload of ``nbytes`` sent in one request: s3fs uploads
        an object of 100 MiB or more in parts, which would get botocore's default checksum and
        not match the upload's."""
        if self.put_options is None:
            self.put_options = _clients.put_options(self.fs)
        return self.put_options if nbytes < _clients.S3FS_SINGLE_PUT_BYTES else {}
