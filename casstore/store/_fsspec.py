"""A store over any fsspec filesystem: s3://, gs://, memory://, ... (STYLE.md §3).

Bulk reads and writes go through fsspec's own batched calls (``fs.cat``, ``fs.pipe``), which
the async backends (s3fs, gcsfs) run concurrently. Create-only writes use
``pipe_file(mode="create")``: ``If-None-Match: *`` on s3fs, ``ifGenerationMatch=0`` on gcsfs
(a single-request upload below gcsfs's chunk size; manifests are small).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime

import fsspec

from .._errors import ObjectNotFoundError
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
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, read_only: bool = False,
                 url: str | None = None, batch_size: int = 64):
        self.fs = fs
        self.root = root.rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.url = url or f"{protocol}://{self.root}"
        self.read_only = read_only
        self.batch_size = batch_size

    @classmethod
    def from_url(cls, url: str, *, read_only: bool = False, **storage_options) -> FsspecStore:
        """Opens ``url`` (e.g. ``s3://bucket/repo``) with fsspec ``storage_options``."""
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
        return cls(fs, root, read_only=read_only, url=url.rstrip("/"))

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _missing(self, key: str) -> ObjectNotFoundError:
        return ObjectNotFoundError("no such object", url=f"{self.url}/{key}")

    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(check_key(key)))
        except FileNotFoundError:
            raise self._missing(key) from None

    def exists(self, key: str) -> bool:
        try:
            info = self.fs.info(self._path(check_key(key)))
        except FileNotFoundError:
            return False
        return info.get("type") != "directory"

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = posixpath.dirname(prefix)
        top = f"{self.root}/{base}" if base else self.root
        try:
            found = self.fs.find(top, detail=True)
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
            self.fs.pipe_file(self._path(key), data)
            return
        try:
            self.fs.pipe_file(self._path(key), data, mode="create")
        except Exception as e:  # narrowed by _is_exists_error; everything else re-raises
            if _is_exists_error(e):
                raise FileExistsError(f"{self.url}/{key} exists") from e
            raise

    def _delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        keys = [check_key(k) for k in keys]
        out: dict[str, bytes] = {}
        for i in range(0, len(keys), self.batch_size):
            batch = keys[i:i + self.batch_size]
            got = self.fs.cat([self._path(k) for k in batch], on_error="return")
            for key in batch:
                value = got.get(self._path(key), FileNotFoundError())
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
            self.fs.pipe({self._path(k): bytes(items[k]) for k in batch})
