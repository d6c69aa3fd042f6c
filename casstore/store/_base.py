"""The Store interface: a handful of primitives, the rest derived (STYLE.md §3).

A store maps relative ``/``-separated ASCII keys to immutable byte objects. Missing keys raise
:class:`~casstore.ObjectNotFoundError` (a ``FileNotFoundError``) everywhere; there is no other
missing-key convention.
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import dataclasses
import os
import re
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from .._errors import ObjectNotFoundError, ReadOnlyStoreError, not_here
from .._pool import default_workers

_SEGMENT = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*")


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object found by :meth:`Store.list`.

    Attributes:
      key: the object's key, relative to the store root.
      size: its length in bytes.
      mtime: its last modification time, seconds since the epoch (UTC).
    """

    key: str
    size: int
    mtime: float


def stored_size(store: Store, key: str) -> int | None:
    """``key``'s size in ``store`` in bytes (one :meth:`Store.stat`); None where the store
    lacks it, or cannot stat it (a damaged inode's EIO or EUCLEAN: a writer stores it again).

    Raises:
      OSError: the store failed (a timeout, an unreachable or refusing store).
    """
    try:
        return store.stat(key).size
    except OSError as e:
        if not_here(e):
            return None
        raise


def nested(a: Store, b: Store) -> bool:
    """Whether stores ``a`` and ``b`` are one repository or one lies inside the other, however
    spelled (:meth:`Store.location`): local paths also compared as directories, by device and
    inode, so one directory reached at two paths through a bind mount (or an NFS export
    mounted twice) is found too."""
    x, y = a.location(), b.location()
    ends = _endpoint(a), _endpoint(b)
    if None not in ends and ends[0] != ends[1]:  # two services: s3://ckpt/run on each is
        return False  # two buckets (where one is the provider's own, it may be the other)
    return x.startswith(y) or y.startswith(x) or _inside(x, y) or _inside(y, x)


def _endpoint(store: Store) -> tuple[str, str, int | None] | None:
    """The endpoint an fsspec store's client was given (``endpoint_url``, or in its
    ``client_kwargs``), as ``(scheme, host, port)`` however spelled; None where none was
    given (the provider's own, or the environment's), or for a store of another kind."""
    options = getattr(getattr(store, "fs", None), "storage_options", None) or {}
    url = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get(
        "endpoint_url")
    if not url:
        return None
    parts = urllib.parse.urlsplit(str(url).strip().lower())
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, parts.hostname or "", port


def _inside(inner: str, outer: str) -> bool:
    """Whether local directory ``inner`` is ``outer`` or lies inside it where their paths do
    not say so: one directory reached at two paths through a bind mount, or an NFS export
    mounted twice. Compared by ``(st_dev, st_ino)``: the deepest existing directory of
    ``outer`` against each existing ancestor of ``inner``, the names below them alike. False
    for object store locations."""
    if not (inner.startswith("/") and outer.startswith("/")):
        return False
    top, below = _deepest(outer.rstrip("/") or "/")
    here, names = _deepest(inner.rstrip("/") or "/")
    found = _identity(top)
    while found is not None:
        if _identity(here) == found and names[:len(below)] == below:
            return True
        parent = os.path.dirname(here)
        if parent == here:
            return False
        here, names = parent, [os.path.basename(here), *names]
    return False


def _deepest(path: str) -> tuple[str, list[str]]:
    """``path``'s deepest existing ancestor (or itself), and the names of the rest below it."""
    names: list[str] = []
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path, names = os.path.dirname(path), [os.path.basename(path), *names]
    return path, names


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_key(key: str) -> str:
    """Returns ``key`` if it is a valid store key, else raises ``ValueError``.

    Valid keys are relative, ``/``-separated, ASCII; each segment is letters, digits, ``_``,
    ``-`` and ``.``, and does not start with ``.`` (so no ``..`` and no hidden temp names).
    """
    if not isinstance(key, str) or not key or not all(
            _SEGMENT.fullmatch(s) for s in key.split("/")):
        raise ValueError(f"invalid store key {key!r}")
    return key


class Store(abc.ABC):
    """A flat, synchronous key -> bytes object store.

    Subclasses implement ``get``, ``_put``, ``exists``, ``_delete`` and ``list``; ``put``,
    ``put_if_absent`` and ``delete`` check ``read_only`` first. ``get_many`` and ``put_many``
    run over a thread pool of ``max_workers`` by default; backends with bulk calls override them.
    Stores are thread-safe: one store may be used from many threads at once.

    Attributes:
      url: where the store lives (a path or URL without credentials).
      read_only: if true, every write raises :class:`~casstore.ReadOnlyStoreError`.
      read_only_reason: what that error says first (why the store refuses writes).
      max_workers: the concurrency of bulk operations and of saves and restores: unless set
        on the instance, ``workers_per_core`` threads per core this process may use
        (``os.sched_getaffinity``, read at each access, so a process pinned after import
        gets its share), at most ``max_workers_cap``. Set it on an instance, or pass
        ``max_workers=`` to a call, to change it.
      workers_per_core: threads per usable core (a class attribute): 2 for local disk and
        memory, where hashing and compression bound a save, so the CPU-bound encoders keep
        every core busy while as many threads wait on writes.
      max_workers_cap: the most threads however many cores (a class attribute): 32 for local
        disk and memory. It bounds memory, not CPU: a save keeps two chunks in flight per
        worker and each thread of a restore holds one chunk's read buffer.
      read_workers: the threads of a restore's chunk reads: ``max_workers`` if set on the
        instance, else ``read_workers_per_core`` (a class attribute; None: as
        ``workers_per_core``) per usable core, at most ``max_read_workers_cap`` (a class
        attribute; None: ``max_workers_cap``). 4 a core, at most 16, for local disk: a raw
        chunk is read straight into its destination (no buffer, no copy), so its threads
        mostly wait on the disk, which reads faster with more requests in flight; a step of
        encoded chunks is read by at most ``max_workers`` (:meth:`read_threads`).
      shuffle: whether saves may use the byte-plane codec (codec 5, format.md §3.2) for
        barely compressible floats: trained float32 chunks are stored about 18% smaller
        (0.82 of raw, where plain zstd keeps 0.92) where ``compression`` picks byte planes.
        True on every store; set it False on a store (or pass ``shuffle=False`` to a save)
        to keep such floats raw and use codec 5 only where it saves 1/4 (adam's moments).
      compression: which codec saves write unless told (``"auto"``, ``"speed"`` or
        ``"bytes"``; docs/tuning.md): ``"auto"`` picks, from the throughputs below and the
        codec's per core, whichever of byte planes and raw chunks makes the save faster.
      write_bytes_per_s, read_bytes_per_s: the throughput ``compression`` counts on for this
        store, bytes per second (class attributes: 100 MB/s, an object store over the
        network, unless a backend measured better; set them on an instance from
        ``benchmarks/harness/limit.py``'s figures for a store of known speed).
      put_copies: whether ``put`` has written or copied the bytes when it returns and keeps
        no reference to them (a class attribute), so a save may reuse the buffer of an
        object it stored for the next one. False unless a backend says so.
      cheap_stat: whether ``exists`` costs microseconds, not a request (a class attribute;
        local disk): a save then checks that every chunk of the run's latest step it would
        reuse is still there, and writes again one that was lost (format.md §7). False
        unless a backend says so.
    """

    url: str
    read_only: bool = False
    read_only_reason: str = "store is read-only"
    shuffle: bool = True
    put_copies: bool = False
    cheap_stat: bool = False
    compression: str = "auto"
    write_bytes_per_s: float = 100e6
    read_bytes_per_s: float = 100e6
    workers_per_core: int = 2
    read_workers_per_core: int | None = None
    max_workers_cap: int = 32
    max_read_workers_cap: int | None = None

    @property
    def max_workers(self) -> int:
        """Threads of bulk operations, saves and restores (see the class docstring)."""
        return self._workers(self.workers_per_core)

    @property
    def read_workers(self) -> int:
        """Threads of a restore's chunk reads (see the class docstring)."""
        return self._workers(self.read_workers_per_core or self.workers_per_core,
                             self.max_read_workers_cap)

    def read_threads(self, encoded: bool = False) -> int:
        """Threads of a restore's chunk reads: :attr:`read_workers`, or for a step whose chunks
        are mostly encoded (:meth:`~casstore._manifest.Manifest.encoded`) at most
        :attr:`max_workers`. A reader of an encoded chunk decodes it on the CPU and holds the
        object and its decoded planes (about 32 MiB for a 16 MiB chunk of byte planes), so
        readers beyond the CPU's add memory, not speed. On the 2-core machine (GPT-2-small's
        1.49 GB state stored as byte planes, into numpy, fresh processes, 6 rounds), 4 readers
        took a median 1.98 s warm and 2.49 s cold with 1550-1568 MiB of extra RSS, and 8
        readers (4 a core, a local disk's ``read_workers``) 2.16 s and 2.64 s with 1675-1692
        MiB. Raw chunks are read straight into their leaves: their readers wait on the disk,
        and more of them keep it busy."""
        return min(self.read_workers, self.max_workers) if encoded else self.read_workers

    def _workers(self, per_core: int, cap: int | None = None) -> int:
        """``max_workers`` as set on the instance, else ``per_core`` threads a usable core, at
        most ``cap`` (None: ``max_workers_cap``)."""
        chosen = getattr(self, "_max_workers", None)
        return chosen or default_workers(per_core, cap or self.max_workers_cap)

    @max_workers.setter
    def max_workers(self, value: int) -> None:
        self._max_workers = value

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Returns the object's bytes. Raises ObjectNotFoundError if ``key`` is absent."""

    def head(self, key: str, nbytes: int) -> bytes:
        """Returns the object's first ``nbytes`` bytes, or all of it if it is shorter: one
        ranged read where the backend has them (fsspec's ``head``), so a reader bounds what a
        damaged object can make it hold. This default reads the whole object with :meth:`get`.

        Raises:
          ObjectNotFoundError: ``key`` is absent.
        """
        return self.get(key)[:nbytes]

    def get_into(self, key: str, buffer: np.ndarray | None, max_bytes: int | None = None
                 ) -> tuple[memoryview, np.ndarray]:
        """Reads an object, into ``buffer`` where the backend can (a uint8 array, reused).

        Readers of many large objects (a restore's chunks) pass each thread's buffer back in,
        so reading allocates no new memory per object; the returned view is valid until the
        buffer is reused. With ``max_bytes``, at most ``max_bytes + 1`` bytes are read (the
        reader refuses an object that long: a damaged object of many GB is not held). This
        default returns a view of :meth:`get`'s bytes, or of :meth:`head`'s with ``max_bytes``.

        Returns:
          ``(view of the object's bytes, the buffer to pass next time)``.

        Raises:
          ObjectNotFoundError: ``key`` is absent.
        """
        data = self.get(key) if max_bytes is None else self.head(key, max_bytes + 1)
        return memoryview(data), buffer

    def get_split(self, key: str, head: bytearray, body: memoryview | np.ndarray) -> bool:
        """Reads an object of exactly ``len(head) + len(body)`` bytes in one scatter read: its
        first bytes into ``head``, the rest into ``body`` (a restore reads a raw chunk's
        payload straight into its destination, without a copy). False, with nothing read, where
        the object has another size or the backend cannot; the caller then reads it with
        :meth:`get_into`. This default returns False.

        Raises:
          ObjectNotFoundError: ``key`` is absent (where the backend reads at all).
        """
        return False

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """True if ``key`` exists. Errors other than "not found" (auth, network) propagate."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Yields every object whose key starts with ``prefix`` (a plain string prefix)."""

    def stat(self, key: str) -> ObjectInfo:
        """The size and modification time of one object, without listing a whole prefix.

        Backends override this with one metadata request (``os.stat``, a HEAD); this default
        filters a listing of the key's prefix.

        Raises:
          ObjectNotFoundError: ``key`` is absent.
        """
        for info in self.list(check_key(key)):
            if info.key == key:
                return info
        raise ObjectNotFoundError("no such object", url=f"{self.url}/{key}")

    @abc.abstractmethod
    def _put(self, key: str, data: bytes, *, exclusive: bool) -> None:
        """Writes ``data`` atomically; with ``exclusive``, raises FileExistsError if present."""

    @abc.abstractmethod
    def _delete(self, key: str) -> None:
        """Deletes ``key``; a missing key is not an error."""

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Writes a whole object atomically: readers see all of it or nothing.

        Raises:
          ReadOnlyStoreError: the store is read-only.
          ValueError: ``key`` is not a valid key.
        """
        self._check_writable(key)
        self._put(check_key(key), data, exclusive=False)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        """Writes a whole object atomically, only if ``key`` does not exist yet (create-only).
        On an object store, an object of exactly ``data`` found there is taken as this write's
        own (an earlier send of it whose answer was lost) and the write succeeds.

        Raises:
          FileExistsError: ``key`` exists (on an object store: with other bytes); it is left
            unchanged.
          ReadOnlyStoreError: the store is read-only.
        """
        self._check_writable(key)
        self._put(check_key(key), data, exclusive=True)

    def sweep_leftovers(self, older_than_s: float) -> int:
        """Deletes what a killed writer left that no listing shows, once ``older_than_s``
        seconds old (GC calls it while it holds its lock); returns the bytes freed. None here:
        an object store keeps no part of an upload that did not complete (``LocalStore``
        overrides it for its temporary files)."""
        return 0

    def location(self) -> str:
        """Where the objects are, spelled one way for comparing two stores (a local
        directory's real path: symlinks, ``file://`` and ``local://`` resolved; else the URL,
        its protocol spelled one way: ``gs://`` for ``gcs://``),
        ending in ``/``."""
        return self.url.rstrip("/") + "/"

    def server_side_copy(self, src: Store, key: str, size: int | None = None) -> int | None:
        """Copies object ``key`` of ``src`` to the same key here without its bytes passing
        through this process, where both stores are on one service that copies objects
        itself (S3's CopyObject, GCS's rewrite: :class:`FsspecStore`); None where they are not
        (this default), and the caller reads and writes the object instead. ``size``, the
        object's size in bytes where the caller knows it (a manifest's ``stored_bytes``),
        saves looking it up.

        Returns:
          the object's size in bytes, or None (nothing was done).

        Raises:
          FileNotFoundError: ``src`` has no object ``key``.
          ReadOnlyStoreError: this store is read-only.
        """
        return None

    def delete(self, key: str) -> None:
        """Deletes ``key``. Idempotent: deleting a missing key succeeds.

        Raises:
          ReadOnlyStoreError: the store is read-only.
        """
        self._check_writable(key)
        self._delete(check_key(key))

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        """Returns ``{key: bytes}`` for all ``keys``, fetched concurrently.

        Raises:
          ObjectNotFoundError: one of the keys is absent.
        """
        keys = list(keys)
        if len(keys) <= 1:
            return {k: self.get(k) for k in keys}
        with cf.ThreadPoolExecutor(min(self.max_workers, len(keys))) as pool:
            return dict(zip(keys, pool.map(self.get, keys)))

    def put_many(self, items: Mapping[str, bytes | memoryview]) -> None:
        """Writes every ``{key: bytes}`` item (each atomically), concurrently."""
        if len(items) <= 1:
            for key, data in items.items():
                self.put(key, data)
            return
        with cf.ThreadPoolExecutor(min(self.max_workers, len(items))) as pool:
            list(pool.map(self.put, items.keys(), items.values()))

    def _check_writable(self, key: str) -> None:
        if self.read_only:
            raise ReadOnlyStoreError(f"{self.read_only_reason}; cannot write {key!r}",
                                     url=self.url)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}{', read_only=True' if self.read_only else ''})"
