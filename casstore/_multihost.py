"""Save stage 5, the agreement between the processes of a multi-process JAX job (format.md §7).

Takes each process's chunk refs, once its chunks are stored; gives process 0 every process's
refs, only if all of them succeeded, and gives every process the outcome of process 0's
commit. Every process writes the chunks of its own shards, then posts its chunk refs (or its
error) to the ``jax.distributed`` coordinator's key-value store. Process 0 waits for every
process, and only if all succeeded writes the manifest; it then posts the outcome, which the
others wait for. A process that dies before posting makes process 0 time out: no manifest is
written. With per-host local tiers (``SaveAgreement(per_host=True)``) process 0 sends the
committed manifest's bytes with the outcome, for each process to write to its own. This
follows orbax's use of the same key-value store for its multi-host barriers.
In a single-process job every step of the exchange is a no-op.

A save runs its chunk and commit stages inside :meth:`SaveAgreement.committing` and calls
:meth:`SaveAgreement.gather_refs` between them; nothing else of the exchange is in the save.

:class:`~casstore._persist_rounds.Rounds` is the other exchange on the same store: the rounds
of a manager's shared persist to its persistent tier.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import Any

import msgpack
import xxhash

from ._coordinator import get_large, kv_client, posted, processes, set_large, timeout_ms, try_get
from ._errors import CasstoreError
from ._manifest import ChunkRef
from .store import Store

_save_counter = itertools.count()  # SPMD: every process calls save() in the same order
_forgotten = [0]  # saves numbered below this have no key left on the coordinator (process 0)
_live: set[int] = set()  # the numbers of this process's saves in flight, until each is done
# (finish(), or its agreement collected): a manager's in the background beside a casstore.save


class SaveAgreement:
    """One save's exchange between processes; a no-op in a single-process job.

    Made first thing in every save call, so that every process numbers its saves alike even
    when one fails before the exchange (:meth:`early`). Each post names the save (run, step
    and a digest of the tree's key paths, shapes and dtypes: :meth:`describe`), and process 0
    refuses a save that the processes do not all describe alike, as when they are out of step.
    """

    def __init__(self, per_host: bool = False):
        self.count, self.index = processes()
        # each process saves to a local tier of its own (docs/tiers.md, "Per-host local
        # tiers"): no check_shared, refs deduplicated, the manifest's bytes sent to the others
        self.per_host = per_host and self.count > 1
        self.manifest: bytes | None = None  # the committed manifest (per_host)
        self.number = next(_save_counter) if self.count > 1 else 0
        self.tag = f"casstore/save/{self.number}" if self.count > 1 else ""
        if self.count > 1:
            _live.add(self.number)
            weakref.finalize(self, _live.discard, self.number)
        self._posted = False  # this process posted its refs (or its error)
        self._started = False  # this process posted how its save call went (start_verdict)
        self._published = False  # process 0 posted the outcome
        self.save: list = []  # [run, step, tree digest], as describe() gives it
        self.spread: list[str] = []  # describe()
        self.paths: list[str] = []  # describe(): the key path of each leaf
        self.details: tuple | None = None  # a manager's (metrics, save time): propose()
        # this process's (written bytes, new, reused, delta chunks, delta-saved bytes), posted
        # with its refs; their sums over every process, which process 0 posts with the outcome
        self.counts: list[int] = [0] * 5
        self.totals: list[int] | None = None
        self.manifest_bytes = 0  # process 0's manifest, as it posts it with the outcome
        self.pending_of: Callable[[], Collection[int]] | None = None  # propose()
        self.pending: list[int] | None = None  # process 0's pending persists, as posted

    @property
    def is_primary(self) -> bool:
        """True on the process that writes the manifest (process 0)."""
        return self.index == 0

    def describe(self, run: str, step: int, node: dict, paths: list[str],
                 arrays: dict[int, Any]) -> None:
        """Names this save in every post: ``run``, ``step`` and a digest of the tree (``node``,
        ``paths``, and each array leaf's shape, dtype and key implementation)."""
        shapes = [[i, list(a.shape), a.dtype.name, a.key_impl] for i, a in sorted(arrays.items())]
        self.save = [run, step, xxhash.xxh3_64_hexdigest(msgpack.packb([node, paths, shapes]))]
        self.paths = paths
        # jax leaves whose shards this process writes itself: alike on every process for a
        # global array; a per-process one (jnp.asarray(0) on each) is spread on some only
        self.spread = sorted(paths[i] for i, a in arrays.items() if a.is_jax and a.spread)

    def propose(self, metrics: Any, started: datetime.datetime,
                pending_of: Callable[[], Collection[int]] | None = None) -> None:
        """A manager's save: its ``metrics``, save time and (with a persistent tier) how to
        read its pending persists. Process 0 posts its own with the outcome and the others
        take them (:meth:`agreed`), so every process ranks and ages the step alike even where
        the metrics each process computed differ, and retains what process 0 may persist."""
        self.details, self.pending_of = (metrics, started), pending_of

    def agreed(self) -> tuple[Any, datetime.datetime, list[int] | None]:
        """The committed save's metrics, save time (UTC) and pending persists: process 0's,
        after the commit (the pending ones None on process 0, which has its own)."""
        return (*self.details, self.pending)

    def _client(self):
        return kv_client()

    def gather(self, refs: list, error: str | None) -> list[list]:
        """Posts this process's refs (or error); on process 0 returns every process's refs.

        Raises:
          CasstoreError: on process 0, another process reported an error, or describes
            another save (another run, step or tree: the processes are not saving alike).
        """
        if self.count == 1:
            return [refs]
        client = self._client()
        self._posted = True
        oldest = min(_live.copy(), default=self.number)  # (a copy: other threads add saves)
        client.key_value_set_bytes(f"{self.tag}/refs/{self.index}",
                                   msgpack.packb({"error": error, "refs": refs,
                                                  "save": self.save, "spread": self.spread,
                                                  "counts": self.counts, "oldest": oldest}))
        if not self.is_primary:
            return []
        posts = [msgpack.unpackb(self._wait(client, f"{self.tag}/refs/{p}", p),
                                 strict_map_key=False) for p in range(self.count)]
        self._forget_earlier(client, min(post["oldest"] for post in posts))
        failed = [f"process {p}: {post['error']}" for p, post in enumerate(posts)
                  if post["error"]]
        failed += [f"process {p} {self._other(post['save'])}" for p, post in enumerate(posts)
                   if not post["error"] and post["save"] != self.save]
        failed += [f"process {p} gave up waiting for process 0 (its chunks are no longer kept "
                   "from GC)" for p in range(1, self.count)
                   if try_get(client, f"{self.tag}/gave_up/{p}") is not None]
        if not failed and (local := _per_process([post["spread"] for post in posts])):
            failed = [f"key path {local[0]!r} is a jax array each process holds on its own "
                      "devices, not one global array: save it as numpy (np.asarray) or give it "
                      "a sharding over every process's devices"]
        if failed:
            raise CasstoreError("save failed on other processes; no manifest written: "
                                + "; ".join(failed))
        self.totals = [sum(c) for c in zip(*(post["counts"] for post in posts))]
        return [post["refs"] for post in posts]

    def _forget_earlier(self, client, oldest: int) -> None:
        """Process 0, once every process posted this save: deletes the keys of the saves
        numbered below ``oldest``, the oldest save any process had in flight when it posted
        (a manager's runs in the background while the job calls ``casstore.save``), so that
        the coordinator does not hold every save's refs for the life of the job."""
        for k in range(_forgotten[0], oldest):
            client.key_value_delete(f"casstore/save/{k}")
        _forgotten[0] = max(_forgotten[0], oldest)

    def _other(self, save: list) -> str:
        """How another process's save differs from this one's (for an error)."""
        (run, step, _), (my_run, my_step, _) = save, self.save
        if [run, step] != [my_run, my_step]:
            return (f"saves run {run!r} step {step} where process {self.index} saves run "
                    f"{my_run!r} step {my_step}: every process must call save alike")
        return ("saves another tree (key paths, shapes or dtypes differ): every process must "
                "save the same tree")

    def _wait(self, client, key: str, process: int, what: str = "report its chunks") -> bytes:
        try:
            return client.blocking_key_value_get_bytes(key, timeout_ms())
        except Exception as e:  # jax raises its runtime error type for timeouts and dead peers
            run, step = self.save[:2] if self.save else (None, None)
            raise CasstoreError(f"process {process} did not {what} within "
                                f"{timeout_ms() / 1000:g} s; no manifest written (run "
                                f"{run!r}, step {step})") from e

    @contextlib.contextmanager
    def early(self) -> Iterator[None]:
        """Around what a save checks before its chunks: an error there is posted (as
        :meth:`committing` posts one), so the other processes fail this save too instead of
        pairing their next save with this process's next one."""
        try:
            yield
        except BaseException as e:
            self._start_verdict(f"{type(e).__name__}: {e}")
            self.abandon(f"{type(e).__name__}: {e}")
            self.finish()
            raise

    def _start_verdict(self, error: str | None) -> None:
        """Posts, once, whether this process's save call failed (``error``) or got through."""
        if self.count > 1 and not self._started:
            self._started = True
            self._client().key_value_set_bytes(f"{self.tag}/started/{self.index}",
                                               msgpack.packb(error))

    def all_started(self) -> None:
        """The end of an asynchronous save's call (its checks and staging), on every process:
        waits until each process's call got this far or failed, so that the calls fail alike.
        A call that raised on one process only (a previous save's retention error, a failed
        persist's, a leaf it could not stage) would otherwise return on the others, whose
        background saves then fail, raised by their next call and not by that process's: the
        processes would fail every other save in turn.

        Raises:
          CasstoreError: another process's call failed (naming it and its error), or did not
            end within :func:`timeout_ms`.
        """
        if self.count == 1:
            return
        self._start_verdict(None)
        client, failed = self._client(), []
        for p in range(self.count):
            if p != self.index:
                error = msgpack.unpackb(self._wait(client, f"{self.tag}/started/{p}", p,
                                                   "end its save call"))
                failed += [f"process {p}: {error}"] if error else []
        if failed:
            raise CasstoreError("the save call failed on other processes; nothing was saved: "
                                + "; ".join(failed))

    def abandon(self, error: str) -> None:
        """Posts ``error`` as this process's part of the save, unless it posted already."""
        if self.count == 1:
            return
        if self.is_primary:
            self.publish_outcome(error)
        elif not self._posted:
            self.gather([], error)

    @contextlib.contextmanager
    def committing(self) -> Iterator[SaveAgreement]:
        """The agreement around a save's chunk and commit stages.

        An error in the body is posted to the other processes (so none waits for this one or
        commits without it) and re-raised. When the body ends without error, process 0 posts
        that the step is committed and the others wait for that.

        Raises:
          CasstoreError: on a process other than 0, process 0 did not commit the step (or
            committed another save), or did not say so within :func:`timeout_ms`.
        """
        beating = threading.Event()
        if self.count > 1 and self.is_primary:
            threading.Thread(target=self._beat, args=(beating,), daemon=True).start()
        try:
            yield self
        except BaseException as e:
            self.abandon(f"{type(e).__name__}: {e}")
            self.finish()
            raise
        finally:
            beating.set()  # the outcome follows
        try:
            if self.is_primary:
                self.publish_outcome(None)
            else:
                self.wait_outcome()
        finally:
            if not self.per_host:  # per_host: once the copies are confirmed (confirm_copies)
                self.finish()

    def _beat(self, stop: threading.Event) -> None:
        """Process 0 until it posts the outcome: counts ``{tag}/alive`` up every quarter of
        :func:`timeout_ms`, so the others wait for the outcome as long as its save goes on (it
        writes every replicated block: it may take longer than the timeout beyond theirs)."""
        with contextlib.suppress(Exception):  # the job ends: nothing left to tell
            while not stop.wait(timeout_ms() / 4000):
                self._client().key_value_increment(f"{self.tag}/alive", 1)

    def finish(self) -> None:
        """This process reads no key of this save any more: process 0 may delete them once
        every process said so (:meth:`_forget_earlier`)."""
        _live.discard(self.number)

    def gather_refs(self, refs: dict[int, list[ChunkRef]], store: Store
                    ) -> dict[int, list[ChunkRef]] | None:
        """Every process's chunk refs on process 0; elsewhere posts ``refs`` and returns None.

        Args:
          refs: this process's chunk refs, by leaf index (extended in place on process 0).
          store: the repository saved to; on process 0's first save to it, one chunk of each
            other process is looked up there (:func:`check_shared`), unless ``per_host``:
            then a block several processes stored (a replica, a leaf every process saves) is
            taken once, from the lowest process.

        Returns:
          On process 0, ``refs`` with every other process's refs added (after waiting for all
          of them); None on the others, which have nothing left to do but wait for the outcome.

        Raises:
          CasstoreError: on process 0, another process reported an error or did not report
            within :func:`timeout_ms`, or process 0 does not see its chunks, or (``per_host``)
            two processes stored one block of a leaf with different bytes.
        """
        if self.is_primary:
            seen = {(i, r.start): r for i, rs in refs.items() for r in rs}
            mine = {r.key for rs in refs.values() for r in rs}
            for p, posted in enumerate(self.gather([], None)[1:], 1):
                theirs = [(i, ChunkRef(ref[0], tuple(ref[1]), tuple(ref[2]), *ref[3:]))
                          for i, *ref in posted]
                if not self.per_host:  # objects process 0 did not store (by content) too
                    check_shared(store, p, sorted({r.key for _, r in theirs} - mine)[:4])
                for i, ref in theirs:
                    if self.per_host and (i, ref.start) in seen:
                        _same_block(seen[i, ref.start], ref, p, self.save, self.paths[i])
                        continue
                    seen[i, ref.start] = ref
                    refs.setdefault(i, []).append(ref)
            return refs
        self.gather([[i, r.id, r.start, r.stop, r.offset, r.raw_bytes, r.stored_bytes, r.base]
                     for i, rs in refs.items() for r in rs], None)
        return None

    def publish_outcome(self, error: str | None) -> None:
        """Process 0 tells the others whether the manifest was committed, naming the save."""
        if self.count > 1 and self.is_primary and not self._published:
            self._published = True
            client, sent = self._client(), False
            if self.per_host and error is None and self.manifest is not None:
                set_large(client, f"{self.tag}/manifest", self.manifest)
                sent = True
            client.key_value_set_bytes(f"{self.tag}/outcome", msgpack.packb(
                {"error": error, "save": self.save, "details": self.details and [
                    self.details[0], self.details[1].timestamp()], "manifest": sent,
                 "totals": self.totals, "manifest_bytes": self.manifest_bytes,
                 "pending": sorted(self.pending_of()) if self.pending_of else None}))

    def confirm_copies(self, write: Callable[[], object], withdraw: Callable[[], None]) -> None:
        """``per_host``, after the commit: writes this process's copy of the manifest (``write``;
        process 0's is the commit) and posts whether it could; process 0 takes every post, at
        most :func:`timeout_ms` in all, and posts the verdict, which the others wait for (twice
        that long). Where a copy failed or came late, every process withdraws its own
        (``withdraw``): they all list the same steps and fail this save alike.

        Raises:
          CasstoreError: a process could not write its copy or did not say so in time, naming
            it and its error (the step is withdrawn everywhere).
        """
        failed, client = [], self._client()
        try:
            write()
        except BaseException as e:
            failed.append(f"process {self.index}: {type(e).__name__}: {e}")
        if self.is_primary:
            end = time.monotonic() + timeout_ms() / 1000
            for p in range(1, self.count):
                failed += posted(client, f"{self.tag}/copied/{p}", end,
                                  f"process {p} did not say whether it wrote its copy")
            client.key_value_set_bytes(f"{self.tag}/verdict", msgpack.packb(failed))
        else:
            client.key_value_set_bytes(f"{self.tag}/copied/{self.index}", msgpack.packb(failed))
            failed += posted(client, f"{self.tag}/verdict", time.monotonic() + 2 * timeout_ms()
                              / 1000, "process 0 did not say whether every copy is written")
        self.finish()
        if failed:
            try:
                withdraw()
            except Exception as e:  # this process's list then differs until it reopens
                failed.append(f"process {self.index} could not withdraw its copy: {e!r}")
            raise CasstoreError(f"not every process wrote its copy of the manifest of step "
                                f"{self.save[1]} (run {self.save[0]!r}) in time, so the step is"
                                " withdrawn from every process's local tier: "
                                + "; ".join(dict.fromkeys(failed)))

    def wait_outcome(self) -> None:
        """Other processes wait for process 0's commit, and take the details it proposed
        (:meth:`propose`) and (``per_host``) the manifest's bytes, :attr:`manifest`.

        Raises:
          CasstoreError: it failed, it was of another save, or no outcome came in time.
        """
        if self.count == 1 or self.is_primary:
            return
        client, beats = self._client(), None
        while True:  # as long as process 0's save goes on (_beat)
            try:
                outcome = msgpack.unpackb(client.blocking_key_value_get_bytes(
                    f"{self.tag}/outcome", timeout_ms()))
                break
            except Exception as e:  # jax's runtime error for a timeout or a dead process 0
                now = try_get(client, f"{self.tag}/alive")
                if now is None or now == beats:  # its refs withdrawn: its lock goes, so
                    with contextlib.suppress(Exception):  # a GC may delete what it reused
                        client.key_value_set(f"{self.tag}/gave_up/{self.index}", "1")
                    raise CasstoreError(f"process 0 did not say within "
                                        f"{timeout_ms() / 1000:g} s whether it committed the "
                                        "step, and its save showed no sign of going on") from e
                beats = now
        if outcome["error"]:
            raise CasstoreError(f"process 0 did not commit the step: {outcome['error']}")
        if outcome["save"] != self.save:
            raise CasstoreError(f"process 0 committed another save: process 0 "
                                f"{self._other(outcome['save'])}")
        if outcome["details"] is not None:
            metrics, timestamp = outcome["details"]
            self.details = (metrics, datetime.datetime.fromtimestamp(timestamp,
                                                                     datetime.UTC))
        self.totals, self.manifest_bytes = outcome["totals"], outcome["manifest_bytes"]
        self.pending = outcome["pending"]
        if outcome.get("manifest"):
            self.manifest = get_large(self._client(), f"{self.tag}/manifest")


def _same_block(ours: ChunkRef, theirs: ChunkRef, process: int, save: list, path: str
                ) -> None:
    """Process 0 of a ``per_host`` save: refuses two refs of one block with different chunks
    (the processes saved different values where they must be equal: the manifest would name
    one, and the other's local tier would lack it)."""
    if (ours.id, ours.base) != (theirs.id, theirs.base):
        raise CasstoreError(
            f"process {process} stored the block at {list(theirs.start)} of key path {path!r} "
            f"with other bytes than process 0 (chunk {theirs.id} against {ours.id}; run "
            f"{save[0]!r}, step {save[1]}): with local_per_host every process must save equal "
            "values of each numpy leaf and replica; no manifest written")


def _per_process(spread: list[list[str]]) -> list[str]:
    """The key paths some processes write their own shards of and others do not."""
    return sorted(set().union(*spread) - set.intersection(*map(set, spread)))


_seen_shared: set[str] = set()  # URLs where process 0 saw another process's chunk


def check_shared(store: Store, process: int, keys: list[str]) -> None:
    """Process 0, before it commits: raises unless it sees ``keys``, chunk objects that
    ``process`` stored or found in the repository and process 0's save did not store itself
    (a block of zeros both stored would be on a disk of each), at ``store``. Every process must
    save to one repository (a shared filesystem or an object store); with a disk of its own
    per host, the manifest would name chunks that process 0's repository lacks. Looked up until
    a save had such objects, once per URL.

    Raises:
      CasstoreError: process 0 does not see an object (nothing is committed).
    """
    if store.url in _seen_shared or not keys:
        return
    for key in keys:
        if not store.exists(key):
            raise CasstoreError(
                f"process {process} stored chunk object {key!r} but process 0 does not see it "
                f"at {store.url!r}: every process of a multi-process save must write to one "
                "repository that all of them read (a shared filesystem or an object store), "
                "not a disk of its own; no manifest written")
    _seen_shared.add(store.url)
