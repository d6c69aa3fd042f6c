"""The transfer of a copy (:func:`casstore.copy`, and the manager's persist): every object the
destination lacks through one bounded pool, and each step's manifest written create-only, in
step order, once its objects are in (format.md §7's commit rule)."""

from __future__ import annotations

import dataclasses
import threading
import zlib
from collections.abc import Callable

from ._delta import DeltaBases, read_again, read_object
from ._errors import CorruptChunkError, StepAlreadyExistsError, StoreTimeoutError, warn_read_again
from ._framing import check_framing
from ._layout import manifest_key
from ._locks import Lease
from ._manifest import Manifest
from .store import Store, stored_size


@dataclasses.dataclass(frozen=True, slots=True)
class CopyProgress:
    """Where a :func:`copy` stands, passed to its ``progress`` callback.

    Attributes:
      chunks_done, chunks_total: objects sent (or, for a persist, found there) so far, and
        to send in all.
      bytes_done: stored bytes sent so far.
      steps_done, steps_total: manifests written so far, and to write in all.
    """

    chunks_done: int
    chunks_total: int
    bytes_done: int
    steps_done: int
    steps_total: int

@dataclasses.dataclass(slots=True)
class Step:
    """A step a copy writes: its manifest (as stored at the source) and the objects it waits for."""

    run: str
    step: int
    manifest: Manifest
    data: bytes  # the manifest as stored at the source, written as is
    waiting: set[str]  # object keys not yet at the destination

def same_step(dst: Store, run: str, step: int, there: bytes, ours: bytes) -> None:
    """Raises StepAlreadyExistsError unless the destination's manifest ``there`` is ``ours``."""
    if there != ours:
        raise StepAlreadyExistsError(
            "the destination has another step of this number (its manifest differs from the "
            "source's: another history of the run, a newer casstore's format, or a damaged "
            "manifest); it is left as it is", url=dst.url, run=run, step=step)

class Engine:
    """The shared state of one copy: objects sent, manifests committed in step order."""

    def __init__(self, src: Store, dst: Store, plan: list[Step], needed: dict, total: int,
                 verify: bool, progress: Callable[[CopyProgress], None] | None, probe: bool,
                 gate: Callable[[], None] | None, lease: Lease | None):
        self.src, self.dst, self.plan, self.needed = src, dst, plan, needed
        self.gate, self.lease = gate, lease
        self.total, self.verify, self.progress, self.probe = total, verify, progress, probe
        self.bases: DeltaBases | None = None
        self.sizes: dict[str, int] = {}  # stored bytes of the objects the manifests give
        self.sent, self.bytes_sent = {}, 0  # stored bytes of each object sent, and their sum
        self.recheck = False  # a step may have become ready while another thread committed
        self.found: dict[str, int] = {}  # probed and found at the destination
        self.committed, self.raced = [], []  # (run, step) written, and written by another
        self.unusable: dict[str, tuple[str, dict]] = {}  # source objects: (message, where)
        self.not_copied: list[tuple[str, int]] = []  # steps that need an unusable object
        self.next = 0  # index in plan of the next manifest to write
        self.stopped = False  # Ctrl-C: the caller went on without the transfers in flight
        self.lock = threading.Lock()  # guards sent and waiting
        self.commit_lock = threading.Lock()  # one writer of manifests (and of progress)

    def transfer(self, obj: str) -> None:
        cid, base, raw_length, path, s = self.needed[obj]
        if self.gate is not None:
            self.gate()
        try:
            if self.probe and self._found(obj):
                return
            size = None if self.verify else self.dst.server_side_copy(self.src, obj,
                                                                       self.sizes.get(obj))
            if size is not None:
                self._done(obj, self.sent, size)
                return
            data = self.bases.read(obj, cid, base, raw_length)
            try:
                if self.verify:
                    self.bases.decode(data, cid, base, raw_length)
                else:
                    check_framing(data, cid, raw_length, delta=base is not None)
            except CorruptChunkError:  # damaged at the source only if it fails again
                data = read_object(self.src, obj, raw_length)  # with verify, its base too
                if self.verify:
                    read_again(self.src, obj, cid, base, raw_length, data=data)
                else:
                    check_framing(data, cid, raw_length, delta=base is not None)
                    warn_read_again(f"chunk object {obj}", self.src.url)
            if self.stopped:
                return
            self.dst.put(obj, data)
        except (CorruptChunkError, FileNotFoundError) as e:  # the other steps go on
            where = {"url": self.src.url, "run": s.run, "step": s.step, "key_path": path,
                     "chunk_id": cid}
            with self.lock:
                self.unusable[obj] = (f"source chunk unusable: {e}", where)
            self.commit_ready(wait=False)
            return
        except StoreTimeoutError as e:
            raise e.at(run=s.run, step=s.step, key_path=path, chunk_id=cid) from e
        self._done(obj, self.sent, len(data))

    def _found(self, obj: str) -> bool:
        if (size := stored_size(self.dst, obj)) is None:
            return False
        self._done(obj, self.found, size)
        return True

    def _done(self, obj: str, record: dict[str, int], size: int) -> None:
        with self.lock:
            record[obj] = size
            self.bytes_sent += size if record is self.sent else 0
            for step in self.plan[self.next:]:
                step.waiting.discard(obj)
        self.commit_ready(wait=False)

    def commit_ready(self, wait: bool = True) -> None:
        """Writes, in step order, the manifests whose objects are all in. With ``wait=False``
        a thread that finds another one committing leaves its step to that one (which looks
        again before it lets go), instead of waiting for the manifest write in flight."""
        while True:
            self.recheck = True  # before trying: the holder looks again after letting go
            if not self.commit_lock.acquire(blocking=wait):
                return
            try:
                self.recheck = False
                self._commit_ready_steps()
                self._report()
            finally:
                self.commit_lock.release()
            if not self.recheck:
                return

    def _commit_ready_steps(self) -> None:
        while self.next < len(self.plan) and not self.stopped:
            s = self.plan[self.next]
            with self.lock:
                if s.waiting & self.unusable.keys():  # never complete: not written
                    self.not_copied.append((s.run, s.step))
                    self.next += 1
                    continue
                if s.waiting:
                    break
            try:
                if self.lease is not None:
                    self.lease.check()  # GC kept off the objects all along
                self.dst.put_if_absent(manifest_key(s.run, s.step), s.data)
                self.committed.append((s.run, s.step))
            except FileExistsError:  # written concurrently by someone else
                same_step(self.dst, s.run, s.step, self.dst.get(manifest_key(s.run, s.step)),
                           s.data)
                self.raced.append((s.run, s.step))
            except StoreTimeoutError as e:
                raise e.at(run=s.run, step=s.step) from e
            self.next += 1

    def _report(self) -> None:
        if self.progress is not None:
            with self.lock:
                state = CopyProgress(len(self.sent) + len(self.found), self.total,
                                     self.bytes_sent, self.next, len(self.plan))
            self.progress(state)

def share_of(key: str, count: int) -> int:
    """Which of ``count`` processes sends object ``key`` in a shared persist (a CRC32 of the
    key: about as many objects each, whoever wrote them)."""
    return zlib.crc32(key.encode()) % count
