"""A local-directory store with restic's durable write recipe (STYLE.md §3).

Every write goes to a temp file in the target directory, is fsynced, then renamed into place
(or hard-linked, for create-only writes), and the directory is fsynced, so after ``put``
returns the object survives a crash and readers never see a partial object.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator

import numpy as np

from .._buffers import mapped
from .._errors import ObjectNotFoundError, unreadable
from ._base import ObjectInfo, Store, check_key

# where a repository holds directories (format.md §2): a link to nothing there is no object
_DIRECTORIES = ("chunks", "deltas", "locks", "runs")
_DIRECTORY = re.compile(rf"({'|'.join(_DIRECTORIES)})(/[^/]+)?|runs/[^/]+/steps")
_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{32}\.tmp")  # a write's temporary file (_put)


def _walk(top: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(top)`` in sorted order, without hidden directories, into directories that are
    symlinks too (a run or the chunks moved to another disk and linked back: every reader
    opens paths through them, so GC must see what they hold), each directory once: a link
    back to an ancestor (a loop) is not walked again.

    Raises:
      OSError: a directory could not be listed (a bad block's EIO, EACCES), ``top`` is a
        link to nothing (its disk not mounted), or one directory is reached at two paths (a
        link to a sibling; a run's directory renamed and linked back under its old name):
        what it holds would look deleted, or be listed under one of its names only, and GC
        would take for garbage, or delete through one name, the chunks the other's keys need.
    """
    def failed(e: OSError) -> None:
        if not isinstance(e, FileNotFoundError):
            raise e
        if os.path.islink(e.filename or ""):
            raise _dangling(e.filename) from e
        # else deleted while listing, or no such prefix: nothing there

    seen: dict[tuple[int, int], str] = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True, onerror=failed):
        try:
            st = os.stat(dirpath)
        except FileNotFoundError:  # deleted while listing
            dirnames[:] = []
            continue
        if (first := seen.get((st.st_dev, st.st_ino))) is not None:
            dirnames[:] = []
            if dirpath.startswith(first + os.sep):
                continue  # a link to an ancestor: walked there
            raise OSError(f"one directory at two paths, {first} and {dirpath} (a symlink): not "
                          "listed, or GC could delete through one name what the other needs")
        seen[(st.st_dev, st.st_ino)] = dirpath
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        yield dirpath, dirnames, filenames


def _dangling(path: str) -> OSError:
    """The error for a link to nothing where a repository has a directory (not a
    FileNotFoundError: the directory is not known to be gone)."""
    return OSError(errno.ENOLINK, "a link to nothing where the repository has a directory (on "
                   "a disk not mounted?): not listed, or GC would take what it holds for "
                   "garbage", path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    """A store in a local directory, durable and atomic per object.

    Writes: temp file ``.<name>.<random>.tmp`` in the same directory, write all bytes, fsync,
    close, then ``os.replace`` (``put``) or ``os.link`` (``put_if_absent``, atomic create-only
    on POSIX), then fsync the directory. Temp names start with ``.`` and are never listed.

    Args:
      root: the directory; created on first write.
      read_only: refuse writes.
      fsync: fsync files and directories (turn off only for throwaway data).
    """

    put_copies = True  # ``_put`` writes the bytes to a file before it returns
    cheap_stat = True  # ``exists`` is one stat(2): about 5 us with Python's overhead
    # Measured on the 2-core machine (issue 33): 1.23 GB of 16 MiB chunk files written with
    # fsync in 0.49 s on 4 threads; read back from the page cache at about 4.5 GB/s a core.
    write_bytes_per_s = 2.5e9
    read_bytes_per_s = 4e9
    # Restores read with 4 threads a core: a cold 1.49 GB restore took 1.18 s on 4 threads
    # and 1.05 s on 8 (medians of 4, page cache dropped, the 2-core machine).
    read_workers_per_core = 4
    # At most 16: on the H100 machine's 16 cores, a cold restore of an 18.7 GB state onto the
    # GPU took 13.7 s on 16 threads and 14.0 s on 32, with 1.26 GB and 1.97 GB of extra host
    # memory (each thread keeps a chunk's read buffer; more chunks are in flight).
    max_read_workers_cap = 16

    def __init__(self, root: str | os.PathLike, *, read_only: bool = False, fsync: bool = True):
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self.read_only = read_only
        self.fsync = fsync

    def location(self) -> str:
        return os.path.realpath(self.root).rstrip("/") + "/"

    def _path(self, key: str) -> str:
        """The file of ``key``; ValueError for an invalid key ('../x' would read outside)."""
        return os.path.join(self.root, *check_key(key).split("/"))

    def get(self, key: str) -> bytes:
        return self.head(key, -1)

    def head(self, key: str, nbytes: int) -> bytes:
        """The first ``nbytes`` bytes (-1: all of them); no more than the file holds is
        allocated."""
        fd, info = _open_regular(self._path(key))
        with open(fd, "rb") as f:
            return f.read(nbytes if nbytes < 0 else min(nbytes, info.st_size))

    def get_into(self, key: str, buffer: np.ndarray | None, max_bytes: int | None = None
                 ) -> tuple[memoryview, np.ndarray]:
        fd, info = _open_regular(self._path(key))
        size = info.st_size if max_bytes is None else min(info.st_size, max_bytes + 1)
        with open(fd, "rb", buffering=0) as f:
            if buffer is None or buffer.size < size:
                buffer = mapped(size)
            view = memoryview(buffer)[:size]
            got = 0
            while got < size:  # one read(2) returns at most 2 GiB - 4 KiB on Linux
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        if got != size:  # the object is immutable: a short read means it changed under us
            raise OSError(errno.EIO, f"short read: {got} of {size} bytes", self._path(key))
        return view, buffer

    def get_split(self, key: str, head: bytearray, body: memoryview | np.ndarray) -> bool:
        parts = [memoryview(head), memoryview(body).cast("B")]
        total = sum(p.nbytes for p in parts)
        if not hasattr(os, "preadv"):
            return False
        fd, info = _open_regular(self._path(key))
        got = 0
        try:
            if info.st_size != total:
                return False
            while got < total:  # one preadv(2) reads at most 2 GiB - 4 KiB on Linux
                rest = [p[max(0, got - at):] for p, at in zip(parts, (0, len(head)))]
                if not (n := os.preadv(fd, [p for p in rest if p.nbytes], got)):
                    break
                got += n
        finally:
            os.close(fd)
        if got != total:  # the object is immutable: a short read means it changed under us
            raise OSError(errno.EIO, f"short read: {got} of {total} bytes", self._path(key))
        return True

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def stat(self, key: str) -> ObjectInfo:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise ObjectNotFoundError("no such object", url=self._path(key))
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def sweep_leftovers(self, older_than_s: float) -> int:
        """Deletes the temporary files (``.<name>.<hex>.tmp``, see ``_put``) of writers killed
        before their rename, once older than ``older_than_s`` seconds; returns their bytes."""
        freed, now = 0, time.time()
        tops = [self.root, *(os.path.join(self.root, d) for d in _DIRECTORIES)]
        for dirpath, dirnames, filenames in (x for top in tops for x in _walk(top)):
            if dirpath == self.root:  # its own files; of its directories, the repository's
                dirnames[:] = []  # (at a disk's mount point, lost+found is root's only)
            for name in filenames:
                path = os.path.join(dirpath, name)
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(path)
                    if _TEMPORARY.fullmatch(name) and now - st.st_mtime >= older_than_s:
                        os.unlink(path)
                        freed += st.st_size
        return freed

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        for dirpath, _, filenames in _walk(self._path(base) if base else self.root):
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            for name in sorted(filenames):
                key = name if rel == "." else f"{rel}/{name}"
                if name.startswith(".") or not key.startswith(prefix):
                    continue
                try:  # a name that is no regular file (a FIFO, a link to nothing) is listed
                    st = os.lstat(os.path.join(dirpath, name))  # too: a reader names it
                    st = os.stat(os.path.join(dirpath, name)) if stat.S_ISLNK(st.st_mode) else st
                except FileNotFoundError:  # deleted while listing, or a link to nothing
                    if not os.path.lexists(os.path.join(dirpath, name)):
                        continue
                    if _DIRECTORY.fullmatch(key):
                        raise _dangling(os.path.join(dirpath, name)) from None
                except OSError as e:  # a damaged inode (EIO, EUCLEAN): listed, its reader
                    if not unreadable(e):  # names it; young: no GC deletes it
                        raise
                    yield ObjectInfo(key, 0, time.time())
                    continue
                yield ObjectInfo(key, st.st_size, st.st_mtime)

    def _put(self, key: str, data: bytes | memoryview, *, exclusive: bool) -> None:
        path = self._path(key)
        directory = os.path.dirname(path)
        self._makedirs(directory)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        try:
            try:
                with open(tmp, "wb") as f:
                    written = f.write(data)
                    if written != len(memoryview(data).cast("B")):
                        raise OSError(f"short write to {tmp}: {written} bytes")
                    if self.fsync:
                        os.fsync(f.fileno())
            except OSError as e:  # a full disk or quota (ENOSPC, EDQUOT) names no file
                if e.filename is not None or e.errno is None:
                    raise
                raise OSError(e.errno, e.strerror, path) from e
            if exclusive:
                os.link(tmp, path)  # raises FileExistsError if present
            else:
                os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        if self.fsync:
            _fsync_dir(directory)

    def _makedirs(self, directory: str) -> None:
        """Creates missing directories and fsyncs each new one's parent."""
        if os.path.isdir(directory):
            return
        parent = os.path.dirname(directory)
        self._makedirs(parent)
        try:
            os.mkdir(directory)
        except FileExistsError:
            return
        if self.fsync:
            _fsync_dir(parent)

    def _delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            return
        if self.fsync:
            _fsync_dir(os.path.dirname(self._path(key)))


def _open_regular(path: str) -> tuple[int, os.stat_result]:
    """A descriptor open for reading on ``path`` and its stat. An object is a regular file, so
    a device, a FIFO or a socket there (a symlink to ``/dev/zero`` would be read forever) is
    no object; the open does not block (``O_NONBLOCK``: opening a FIFO would wait for a writer
    forever), which changes nothing for a regular file's reads.

    Raises:
      ObjectNotFoundError: nothing is at ``path``, or it is not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise ObjectNotFoundError("no such object", url=path) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise ObjectNotFoundError("no such object (not a regular file)", url=path)
    return fd, info
