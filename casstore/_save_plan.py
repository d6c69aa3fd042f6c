"""Save stage 2, the plan: checked leaves -> a lazy stream of chunk jobs (format.md §3.3, §3.4).

Takes a :class:`~casstore._save_leaves.Prepared` tree and its arrays (after
:func:`~casstore._stored_dtype.stored_as`); gives the bytes of the leaves stored inline in the
manifest and an iterator of :class:`Job`, one per chunk this process stores: a pack of small
leaves, or one block of one shard of a large leaf. A job reads its bytes only when the
pipeline runs it (a view of a numpy or CPU-device array, or the host copy of an accelerator
block, started as the stream yields the job), so host memory does not grow with the state.
A chunk of jax arrays whose id :mod:`casstore._known_chunks` remembers is planned with that
id and no bytes; the encoding stage reads it only if the repository lacks the chunk.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from ._chunking import (
    INLINE_LIMIT_BYTES,
    block_bytes,
    grid,
    is_host_data,
    on_host,
    start_host_copies,
    start_host_copy,
    unique_shards,
)
from ._coordinator import processes
from ._known_chunks import Members, known, members
from ._save_leaves import ArrayInfo, Prepared

# Shards whose host copies one jax.device_put call starts (async staging without a cap).
WHOLE_SHARDS_PER_CALL = 64


@dataclasses.dataclass(slots=True)
class Job:
    """One chunk to store.

    Attributes:
      read: returns the chunk's raw bytes (waiting for a device-to-host copy if one runs);
        None for a chunk that staging found stored (``chunk_id``) and did not copy.
      blocks: ``(leaf index, start, stop, byte offset)`` of every block the chunk holds.
      element_size: bytes per element (1 for a pack of mixed dtypes).
      nbytes: raw length, bytes.
      caller_memory: ``read`` views memory the caller may overwrite (a numpy leaf's buffer).
      holds_copy: ``read`` reads a copy made for this job (a pack, a device-to-host copy).
      release: called once the chunk is stored or has failed (frees a staging budget).
      chunk_id: the chunk's id where staging hashed the bytes already, or where
        :mod:`casstore._known_chunks` remembers it, else None.
      members: the chunk's blocks as :mod:`casstore._known_chunks` names them (jax arrays
        only), so the id hashed from its bytes is remembered there; else None.
      copy: for a job planned without bytes from a remembered id: gives the job with its bytes
        (an accelerator's host copy started), for when the repository lacks the chunk.
    """

    read: Callable[[], memoryview] | None
    blocks: list[tuple[int, tuple[int, ...], tuple[int, ...], int]]
    element_size: int
    nbytes: int
    caller_memory: bool = False
    holds_copy: bool = False
    release: Callable[[], None] | None = None
    chunk_id: str | None = None
    members: Members | None = None
    copy: Callable[[], Job] | None = None



def plan_jobs(prepared: Prepared, arrays: dict[int, Any], chunk_size_bytes: int,
              pack_threshold_bytes: int, whole_shard_bytes: int = 0,
              later: Collection[int] = frozenset(), per_host: bool = False
              ) -> tuple[dict[int, bytes], Iterator[Job]]:
    """This process's chunk jobs; returns ``(inline bytes by leaf index, jobs)``.

    Inline leaves are read now. Packs and larger leaves become a lazy stream of jobs: a pack
    is read (a copy) when the stream yields it, its accelerator leaves' host copies started
    in one call with those of the packs after it, up to ``chunk_size_bytes`` of them, so the
    copies held at once stay within what the consumer takes (``max_staging_bytes``) plus one
    chunk; a block of every unique shard of a larger leaf is a job of its own, and an
    accelerator block's host copy is started when the stream yields its job; with
    ``whole_shard_bytes`` (a staging without a cap), each accelerator shard of at most that
    many bytes is copied whole instead, many shards per call (:func:`_whole_shard_jobs`).
    The arrays of ``later`` (leaf indices) are device copies only the save holds
    (:mod:`casstore._device_staging`): their host copies are made when the pipeline reads the
    jobs, not as the stream yields them (a shard of at most ``whole_shard_bytes`` copied whole
    at its first block's read, a larger one block by block; a pack of them at its read).
    Arrays that span several processes are
    written by every process for its own ``replica_id == 0`` shards; everything else (numpy,
    fully addressable jax arrays) only by process 0. With ``per_host`` (each process saves to
    a local tier of its own) every process writes what it needs to restore its own part: all
    its addressable shards (replicas too, one per origin) and every numpy leaf; jax arrays on
    process 0's devices only (not spread) stay process 0's.
    """
    primary = processes()[1] == 0
    infos = prepared.arrays
    for i, info in infos.items():  # grid() cuts on whole elements
        if info.dtype.itemsize > chunk_size_bytes:
            raise ValueError(f"chunk_size_bytes={chunk_size_bytes} is smaller than one element "
                             f"of key path {prepared.paths[i]!r} ({info.dtype}, "
                             f"{info.dtype.itemsize} bytes)")
    mine = {i: a for i, a in arrays.items()
            if infos[i].spread or primary or (per_host and not infos[i].is_jax)}
    small = {i: a for i, a in mine.items() if not infos[i].spread
             and infos[i].nbytes <= min(pack_threshold_bytes, chunk_size_bytes)}
    inline = _small_bytes({i: a for i, a in small.items()
                           if infos[i].nbytes <= INLINE_LIMIT_BYTES})
    # per_host: packs of the leaves every process writes (numpy) only, so that every process
    # cuts the same packs; a small jax leaf only process 0 holds is a chunk of its own
    packed = {i: a for i, a in small.items()
              if i not in inline and not (per_host and infos[i].is_jax)}
    packs = _pack_jobs(packed, prepared.paths, infos, chunk_size_bytes, later)
    large = [(i, a) for i, a in mine.items() if i not in inline and i not in packed]
    blocks = (_whole_shard_jobs(large, chunk_size_bytes, whole_shard_bytes, later, per_host)
              if whole_shard_bytes else (job for i, a in large for job in _block_jobs(
                  i, a, chunk_size_bytes, i in later, per_host)))
    return inline, _chain(packs, blocks)


def _chain(first: Iterator[Job], rest: Iterator[Job]) -> Iterator[Job]:
    """The jobs of ``first``, then those of ``rest`` as it yields them."""
    yield from first
    yield from rest


def _on_device(a: Any) -> bool:
    """True for a jax array whose bytes need a host copy."""
    return isinstance(a, jax.Array) and not on_host(a)


def _small_bytes(small: dict[int, Any], started: dict[int, jax.Array] | None = None
                 ) -> dict[int, bytes]:
    """The raw bytes of small leaves, copied; ``started`` holds host copies started already
    (taken from it), the other accelerator copies all start in one call before any waits."""
    started = started if started is not None else {}
    host = {i: started.pop(i) for i in list(small) if i in started}
    rest = [i for i in small if i not in host and _on_device(small[i])]
    if rest:
        host.update(zip(rest, start_host_copies([small[i] for i in rest])))
    host.update({i: np.asarray(a) if isinstance(a, jax.Array) else a
                 for i, a in small.items() if i not in host})
    return {i: bytes(block_bytes(np.asarray(host[i]), (0,) * host[i].ndim, host[i].shape))
            for i in small}


def _block_jobs(i: int, array: Any, chunk_size_bytes: int, later: bool = False,
                replicas: bool = False) -> Iterator[Job]:
    """One job per block of every unique shard of a large array (format.md §3.3), lazily; with
    ``later``, each block copied to the host when the pipeline reads it; ``replicas``: as
    :func:`unique_shards`'."""
    for origin, shard in unique_shards(array, replicas):
        yield from _shard_jobs(i, array, shard, _blocks(array, origin, shard, chunk_size_bytes),
                               later=True if later else None)


def _whole_shard_jobs(large: list[tuple[int, Any]], chunk_size_bytes: int,
                      whole_shard_bytes: int, later: Collection[int] = frozenset(),
                      replicas: bool = False) -> Iterator[Job]:
    """The jobs of ``large``'s blocks, each accelerator shard of at most ``whole_shard_bytes``
    copied whole (no slice per block), the copies of up to ``WHOLE_SHARDS_PER_CALL`` such
    shards started in one ``jax.device_put``: with a call per shard, staging GPT-2-XL's 1,741
    shards of new arrays blocked ``save()`` 0.85 s on an H100 machine. For a staging without a
    cap, which holds every copy until it is stored. The shards of ``later``'s arrays are copied
    when the pipeline reads them (:func:`plan_jobs`)."""
    shards = [(i, a, origin, shard) for i, a in large
              for origin, shard in unique_shards(a, replicas)]
    cuts: dict[int, list] = {}  # each shard's _blocks, worked out once

    def cuts_of(k: int) -> list:
        if k not in cuts:
            _, a, origin, shard = shards[k]
            cuts[k] = list(_blocks(a, origin, shard, chunk_size_bytes))
        return cuts[k]

    @functools.cache
    def copied(k: int) -> bool:  # copied whole: a block's id is not remembered
        shard = shards[k][3]
        return (_on_device(shard) and shard.nbytes <= whole_shard_bytes
                and shards[k][0] not in later and any(cid is None for *_, cid in cuts_of(k)))

    started: dict[int, jax.Array] = {}
    for k, (i, a, _, shard) in enumerate(shards):
        if k not in started and copied(k):
            ahead = [j for j in range(k, min(k + WHOLE_SHARDS_PER_CALL, len(shards)))
                     if copied(j)]
            started.update(zip(ahead, start_host_copies([shards[j][3] for j in ahead])))
        deferred = (None if i not in later or not _on_device(shard) else HostCopy(shard)
                    if shard.nbytes <= whole_shard_bytes else True)
        yield from _shard_jobs(i, a, shard, cuts_of(k), started.pop(k, None), deferred)
        del cuts[k]


def _blocks(array: Any, origin: tuple, shard: Any, chunk_size_bytes: int
            ) -> Iterator[tuple[tuple, tuple, tuple, tuple, Members | None, str | None]]:
    """``(start, stop, global start, global stop, chunk, remembered id)`` of each block of one
    shard: its bounds within the shard and within the array, the chunk as
    :mod:`casstore._known_chunks` names it, and its id there or None."""
    for start, stop in grid(tuple(shard.shape), shard.dtype.itemsize, chunk_size_bytes):
        g_start = tuple(o + a for o, a in zip(origin, start))
        g_stop = tuple(o + b for o, b in zip(origin, stop))
        chunk = members([(array, g_start, g_stop, 0)])
        yield start, stop, g_start, g_stop, chunk, known(chunk)


def _shard_jobs(i: int, array: Any, shard: Any, cuts: Iterable[tuple],
                whole: jax.Array | None = None, later: HostCopy | bool | None = None
                ) -> Iterator[Job]:
    """One job per block of one shard (``cuts``: its :func:`_blocks`), lazily: a block whose
    id :mod:`casstore._known_chunks` remembers comes without bytes (its ``copy`` reads them);
    with ``whole``, the shard's host copy (started), the others read views of it; with
    ``later`` (a device copy only the save holds), the reads copy to the host: views of the
    shard's :class:`HostCopy`, or (True) a host copy of each block."""
    itemsize = shard.dtype.itemsize
    for start, stop, g_start, g_stop, chunk, cid in cuts:
        blocks = [(i, g_start, g_stop, 0)]
        nbytes = math.prod(b - a for a, b in zip(start, stop)) * itemsize
        job = functools.partial(_block_job, array, shard, start, stop, blocks, itemsize,
                                nbytes, chunk)
        if cid is not None:
            yield Job(None, blocks, itemsize, nbytes, chunk_id=cid, members=chunk, copy=job)
        elif whole is not None:
            yield Job(functools.partial(_read_copy, whole, start, stop), blocks, itemsize,
                      nbytes, holds_copy=True, members=chunk)
        elif later is not None and not is_host_data(shard):
            read = (functools.partial(later.read, start, stop) if isinstance(later, HostCopy)
                    else functools.partial(_read_now, job))
            yield Job(read, blocks, itemsize, nbytes, members=chunk)
        else:
            yield job()


def _block_job(array: Any, shard: Any, start: tuple, stop: tuple, blocks: list, itemsize: int,
               nbytes: int, chunk: Members | None) -> Job:
    """The job of one block with its bytes: a view of host data, or an accelerator block's host
    copy, started now."""
    if is_host_data(shard):
        read = functools.partial(block_bytes, shard, start, stop)
        return Job(read, blocks, itemsize, nbytes, not isinstance(array, jax.Array),
                   members=chunk)
    copy = start_host_copy(shard, start, stop)
    return Job(functools.partial(_read_copy, copy, (0,) * len(start),
                                 tuple(b - a for a, b in zip(start, stop))),
               blocks, itemsize, nbytes, holds_copy=True, members=chunk)


def _read_copy(copy: jax.Array, start: tuple, stop: tuple) -> memoryview:
    """The raw bytes of ``copy[start:stop]``, a host copy :func:`start_host_copy` started."""
    return block_bytes(np.asarray(copy), start, stop)


def _read_now(make: Callable[[], Job]) -> memoryview:
    """The raw bytes of the job ``make`` gives (its host copy made now, in the pipeline)."""
    return make().read()


class HostCopy:
    """The host copy of one device shard that only the save holds, made at the first read of
    one of its blocks (in the pipeline's threads); the device shard is let go then."""

    def __init__(self, shard: jax.Array):
        self._shard: jax.Array | None = shard
        self._host: tuple[jax.Array, np.ndarray] | None = None
        self._lock = threading.Lock()

    def read(self, start: tuple, stop: tuple) -> memoryview:
        """The raw bytes of ``shard[start:stop]``."""
        with self._lock:
            if self._host is None:
                assert self._shard is not None
                copy = start_host_copy(self._shard, (0,) * self._shard.ndim, self._shard.shape)
                self._host, self._shard = (copy, np.asarray(copy)), None
        return block_bytes(self._host[1], start, stop)


def _pack_jobs(small: dict[int, Any], paths: list[str], infos: dict[int, ArrayInfo],
               chunk_size_bytes: int, later: Collection[int] = frozenset()) -> Iterator[Job]:
    """Packs the small leaves of each parent node, in leaf order, into chunks (format.md §3.4),
    lazily: a pack's leaves are read when it is yielded, the host copies of its accelerator
    leaves and of the next packs' (up to ``chunk_size_bytes``) started in one call; a pack of
    ``later``'s leaves only (device copies the save holds) is read when the pipeline reads it.

    Grouping by parent keeps a changed small leaf from rewriting unrelated frozen ones.
    """
    packs = list(_packs(small, paths, infos, chunk_size_bytes))
    on_device = {i for i, a in small.items() if _on_device(a)}
    started: dict[int, jax.Array] = {}
    for k, group in enumerate(packs):
        blocks, offset = [], 0
        for i in group:
            blocks.append((i, (0,) * len(infos[i].shape), infos[i].shape, offset))
            offset += infos[i].nbytes
        sizes = {infos[i].dtype.itemsize for i in group}
        itemsize = sizes.pop() if len(sizes) == 1 else 1
        chunk = members([(small[i], start, stop, off) for i, start, stop, off in blocks])
        cid = known(chunk)
        if cid is not None:  # the pack's copy reads it, if the repository lacks the chunk
            yield Job(None, blocks, itemsize, offset, chunk_id=cid, members=chunk,
                      copy=functools.partial(_read_pack, blocks, small, itemsize, chunk))
            continue
        if all(i in later for i in group):  # holds its own leaves only: freed once stored
            own = {i: small[i] for i in group}
            yield Job(functools.partial(_read_now, functools.partial(
                _read_pack, blocks, own, itemsize, None)), blocks, itemsize, offset, members=chunk)
            continue
        if any(i in on_device and i not in started for i in group):
            ahead = [i for i in _ahead(packs[k:], infos, chunk_size_bytes)
                     if i in on_device and i not in started and (i in group or i not in later)]
            if ahead:
                started.update(zip(ahead, start_host_copies([small[i] for i in ahead])))
        yield _read_pack(blocks, small, itemsize, chunk, started)


def _packs(small: dict[int, Any], paths: list[str], infos: dict[int, ArrayInfo],
           chunk_size_bytes: int) -> Iterator[list[int]]:
    """The leaf indices of each pack: small leaves grouped by parent node (:func:`_group`), in
    leaf order, at most ``chunk_size_bytes`` a pack."""
    below = collections.Counter(path[:k] for path in paths for k, c in enumerate(path)
                                if c == "/")  # leaves under each inner node, by its key path
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for i in small:
        groups[_group(paths[i], below)].append(i)
    for group in groups.values():
        batch: list[int] = []
        size = 0
        for i in group:
            if batch and size + infos[i].nbytes > chunk_size_bytes:
                yield batch
                batch, size = [], 0
            batch.append(i)
            size += infos[i].nbytes
        yield batch


def _group(path: str, below: collections.Counter) -> str:
    """The key path of the node whose small leaves a leaf at ``path`` is packed with
    (format.md §3.4): its parent, where a node holding this leaf alone counts as the leaf, so
    flax nnx's ``.../bias/value`` packs with its module's other leaves as linen's
    ``.../bias`` does, and ``{"layer_0": {"w": ...}, "layer_1": ...}`` packs as one group."""
    node = path
    while "/" in node and below[parent := node.rpartition("/")[0]] == 1:
        node = parent
    return node.rpartition("/")[0]


def _ahead(packs: list[list[int]], infos: dict[int, ArrayInfo], limit: int) -> list[int]:
    """The leaves of the first pack and of the packs after it, up to ``limit`` bytes."""
    out, size = list(packs[0]), sum(infos[i].nbytes for i in packs[0])
    for group in packs[1:]:
        size += sum(infos[i].nbytes for i in group)
        if size > limit:
            break
        out += group
    return out


def _read_pack(blocks: list, small: dict[int, Any], itemsize: int, chunk: Members | None,
               started: dict[int, jax.Array] | None = None) -> Job:
    """The job of a pack of ``blocks``, its leaves read (copied) now."""
    raws = _small_bytes({i: small[i] for i, *_ in blocks}, started)
    data = b"".join(raws[i] for i, *_ in blocks)
    return Job(functools.partial(memoryview, data), blocks, itemsize, len(data),
               holds_copy=True, members=chunk)
