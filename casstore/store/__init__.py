"""Stores: where casstore keeps its objects (local disk, memory, any fsspec URL)."""

from __future__ import annotations

import difflib
import inspect
import os
from typing import Any

from ._base import ObjectInfo as ObjectInfo
from ._base import Store as Store
from ._base import nested as nested
from ._base import stored_size as stored_size
from ._clients import unknown_storage_options as unknown_storage_options
from ._fsspec import FsspecStore as FsspecStore
from ._local import LocalStore as LocalStore
from ._memory import MemoryStore as MemoryStore
from ._wrappers import CountingStore as CountingStore


def open_store(url: str | os.PathLike | Store, *, read_only: bool = False,
               request_timeout_s: float | None = None, operation_timeout_s: float | None = None,
               **storage_options) -> Store:
    """Opens the store at ``url``.

    A plain path or ``file://`` URL gives a :class:`LocalStore` (fsynced, atomic writes; a
    leading ``~`` is the home directory, as in fsspec and the shell); any
    other URL (``s3://``, ``gs://``, ``memory://``, ...) gives an :class:`FsspecStore` opened
    with ``storage_options``; a :class:`Store` is returned as it is.

    Args:
      url: a path, an fsspec URL or a Store.
      read_only: open for reading only (ignored for a Store instance).
      request_timeout_s: for object stores, the longest one request waits to connect or for
        the next bytes of an answer, seconds (default 20).
      operation_timeout_s: for object stores, the deadline of one operation on one object
        (get, put, create, list, delete) across its retries, seconds (default 60); on expiry
        it raises :class:`~casstore.StoreTimeoutError`. See docs/reliability.md, "Deadlines".
      **storage_options: passed to fsspec (e.g. ``endpoint_url``, ``anon``, ``key``).

    Returns:
      The Store.

    Raises:
      ValueError: ``storage_options`` or timeouts given for a local path or a Store instance;
        for s3:// and gs://, a storage option the client library does not take (it would
        ignore it: :func:`unknown_storage_options`), or a timeout that is not a positive
        number; ``url`` is empty (``""``, ``"file://"``: ``"."`` is the current directory),
        holds a NUL, or is an s3:// or gs:// URL without a bucket.
      TypeError: ``url`` is bytes or another type, not a str, PathLike or Store.
    """
    timeouts = {name: value for name, value in (("request_timeout_s", request_timeout_s),
                                                ("operation_timeout_s", operation_timeout_s))
                if value is not None}
    if isinstance(url, Store):
        if storage_options or timeouts:
            raise ValueError("storage_options cannot apply to an already opened Store")
        return url
    if not isinstance(url, str | os.PathLike):
        raise TypeError(f"url must be a str path or URL, a PathLike or a Store, not {url!r}")
    url = os.fspath(url)
    _check_url(url)
    if not is_fsspec_url(url):
        if storage_options or timeouts:
            given = ", ".join([*storage_options, *timeouts])
            raise ValueError(f"{given}: storage options and timeouts are for object stores "
                             f"(fsspec URLs), not the local path {url!r}, which takes only "
                             "read_only")
        return LocalStore(os.path.expanduser(url.removeprefix("file://")), read_only=read_only)
    return FsspecStore.from_url(url, read_only=read_only, **timeouts, **storage_options)


def _check_url(url: object) -> None:
    """Raises for a URL that names no repository: bytes, an empty path (the current directory
    by accident: '.' says it on purpose), a NUL, an object store URL without a bucket."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str path or URL, a PathLike or a Store, not {url!r}")
    protocol, sep, path = url.partition("://")
    why = ("no path (use '.' for the current directory)" if url in ("", "file://")
           else "a NUL character" if "\0" in url
           else "no bucket" if protocol in ("s3", "s3a", "gs", "gcs") and sep
           and not path.strip("/") else None)
    if why:
        raise ValueError(f"invalid URL {url!r}: {why}")


def is_fsspec_url(url: object) -> bool:
    """True for a URL fsspec opens (``s3://...``, ``gs://...``), False for a local path (``file://``
    included), a Store or None: what ``storage_options`` apply to."""
    if not isinstance(url, str | os.PathLike) or isinstance(url, Store):
        return False
    url = os.fspath(url)
    return "://" in url and not url.startswith("file://")


def check_misspelt(options: dict, function: Any) -> None:
    """Raises TypeError for a storage option whose name is close to one of ``function``'s own
    keyword arguments: a misspelt one (``max_to_kep=1``) would reach the filesystem, which
    may ignore it (fsspec's memory filesystem takes any), and the call would go on without
    it."""
    names = [n for n, p in inspect.signature(function).parameters.items()
             if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD]
    for option in options:
        if close := difflib.get_close_matches(option, names, n=1, cutoff=0.8):
            raise TypeError(f"{function.__qualname__}() got an unexpected keyword argument "
                            f"{option!r}: did you mean {close[0]!r}? (other keywords are "
                            "storage options, for fsspec URLs)")


def split_options(options: dict, *urls: object) -> list[dict]:
    """``options`` for each of ``urls`` that is an fsspec URL, ``{}`` for each other one (a
    local path, a Store, None).

    Raises:
      ValueError: ``options`` given and none of ``urls`` is an fsspec URL.
    """
    if options and not any(map(is_fsspec_url, urls)):
        raise ValueError(f"storage_options are for fsspec URLs, and none of {urls!r} is one")
    return [options if is_fsspec_url(url) else {} for url in urls]
