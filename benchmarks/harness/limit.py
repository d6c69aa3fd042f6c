"""The machine's limit, measured in the same run as the figures it judges (issue 33 item 1).

Per run, on a sample of N(0, 0.02) float32 values (the train states' params) cut into objects
of 16 MiB: the store's write (local disk: one file per object, each fsynced, then the
directory) from ``2 x workers`` threads (at least 4) and read (after dropping the page cache
where permitted, else warm) from as many and from twice as many threads, the faster of the two
(a disk reads faster with more requests in flight, and casstore's restores read from
``4 x workers`` threads on local disk), and on one thread each: a page-cache copy
(``np.copyto``), a first touch of new memory (``np.ones``: the page faults and zeroing a
restore pays for the arrays it returns), the xxh3-128 chunk id (``casstore._codec.chunk_id``),
and casstore's codec encode and decode with its hash check (``encode_chunk(...,
element_size=4)``: the byte planes of codec 5; ``decode_chunk`` into a destination). Each
per-core rate is the best of 3 and is multiplied by the workers,
``len(os.sched_getaffinity(0))``.

A state of ``R`` raw bytes that casstore stores in ``S`` bytes cannot be saved in less than

    save_s = min(max(R (1/hash + 1/encode) / workers, S / write),   # encoded, as casstore does
                 max(R / hash / workers, R / write))                  # or stored raw

nor restored in less than

    restore_s = max((S / copy + R / touch + R / decode) / workers, S / read)

or, where ``read`` is a local disk's read from a warm page cache,

    restore_s = max((S / copy + R / touch + R / decode) / workers, S / read + R / decode / workers)

where ``decode`` is the hash alone for a state stored raw (``S >= R``: codec 0 has nothing to
decode, and its chunks are read straight into their destination), and ``read`` counts unless
the restore found the page cache warm and the limit's read did not (a cold read is no bound on
a warm one; a warm read is one on a cold one). A read from the disk overlaps the decoding; a
read from a warm page cache is the kernel copying on the same cores that decode, so the two add
up (README.md, "A warm restore's limit: the read and the hash add up").

A figure's fraction of the limit is ``limit_s / figure_s``: 1.0 runs at the machine's limit.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import pathlib
import time
from collections.abc import Callable, Iterable

import numpy as np

from casstore._codec import chunk_id, decode_chunk, encode_chunk

from .report import fmt
from .storage import fsync_path
from .timing import drop_caches

OBJECT_BYTES = 16 << 20
Sink = tuple[Callable[[dict[str, bytes]], None], Callable[[list[str]], None]]


def workers() -> int:
    """The cores this process may run on (``os.sched_getaffinity``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _best_rate(nbytes: int, fn: Callable[[], object], tries: int = 3) -> float:
    """Bytes per second of ``fn`` processing ``nbytes``: the best of ``tries`` runs."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9)


def disk_sink(root: pathlib.Path, threads: int) -> Sink:
    """``(put_many, get_many)`` of files under ``root``: each written and fsynced, then the
    directory fsynced; read back with ``readinto`` from ``threads`` threads."""
    root.mkdir(parents=True, exist_ok=True)

    def put(item: tuple[str, bytes]) -> None:
        with open(root / item[0], "wb") as f:
            f.write(item[1])
            f.flush()
            os.fsync(f.fileno())

    def get(key: str) -> None:
        path = root / key
        with open(path, "rb") as f:
            f.readinto(bytearray(path.stat().st_size))

    def put_many(objects: dict[str, bytes]) -> None:
        with cf.ThreadPoolExecutor(threads) as pool:
            list(pool.map(put, objects.items()))
        fsync_path(root)

    def get_many(keys: list[str]) -> None:
        with cf.ThreadPoolExecutor(threads) as pool:
            list(pool.map(get, keys))

    return put_many, get_many


def measure(root: pathlib.Path, nbytes: int = 256 << 20, *, drop: bool = False,
            sink: Sink | None = None, store: str = "local disk") -> dict:
    """Measures the limit's rates (bytes per second; per core ones times the workers) on
    ``nbytes`` (rounded down to whole objects of at most 16 MiB, at least 4 of them) written
    under ``root`` (removed by the caller), or through ``sink`` (e.g. an S3 bucket's
    ``fs.pipe`` / ``fs.cat``, read twice). Returns a dict of the rates, ``workers``,
    ``threads``, ``read_threads`` (of the faster read), ``read_cold`` (the page cache was
    dropped before the read), ``encoded_fraction`` (encoded / raw bytes of the sample) and
    ``store``."""
    n_workers, threads = workers(), max(4, 2 * workers())
    size = max(64 << 10, min(OBJECT_BYTES, nbytes // 4)) // 4 * 4
    count = max(4, nbytes // size)
    raw = np.empty(count * size // 4, np.float32)
    np.random.default_rng(0).standard_normal(dtype=np.float32, out=raw)
    raw *= np.float32(0.02)
    flat = raw.view(np.uint8)
    blocks = [memoryview(flat[i * size:(i + 1) * size]) for i in range(count)]
    total, out = count * size, np.empty_like(flat)
    rates = {"copy": _best_rate(total, lambda: np.copyto(out, flat)),
             "touch": _best_rate(total, lambda: np.ones(total, np.uint8)),
             "hash": _best_rate(total, lambda: [chunk_id(b) for b in blocks])}
    encoded: list = []
    rates["encode"] = _best_rate(total, lambda: encoded.__setitem__(
        slice(None), [encode_chunk(b, element_size=4) for b in blocks]))
    ids = [chunk_id(b) for b in blocks]
    rates["decode"] = _best_rate(total, lambda: [
        decode_chunk(e, i, size, out=out[k * size:(k + 1) * size])
        for k, (e, i) in enumerate(zip(encoded, ids))])
    limit = {f"{k}_bps": v * n_workers for k, v in rates.items()}
    put_many, get_many = sink or disk_sink(root / "limit", threads)
    objects = {f"limit-{k:04d}": bytes(b) for k, b in enumerate(blocks)}
    limit["write_bps"] = _best_rate(total, lambda: put_many(objects), tries=1)
    reads = []
    for n in (threads, 2 * threads):
        cold = drop_caches() if drop else False
        get = get_many if sink else disk_sink(root / "limit", n)[1]
        reads.append(_best_rate(total, lambda g=get: g(list(objects)), tries=1))
    limit["read_bps"] = max(reads)
    limit.update(workers=n_workers, threads=threads, read_threads=(threads, 2 * threads)[
                     reads.index(max(reads))], sample_bytes=total, object_bytes=size,
                 read_cold=cold, store=store,
                 encoded_fraction=sum(len(e) for e in encoded) / total)
    return limit


def save_s(limit: dict, raw: float, stored: float) -> float:
    """The fastest save of ``raw`` bytes stored as ``stored`` bytes (seconds; module doc)."""
    encoded = max(raw * (1 / limit["hash_bps"] + 1 / limit["encode_bps"]),
                  stored / limit["write_bps"])
    return min(encoded, max(raw / limit["hash_bps"], raw / limit["write_bps"]))


def restore_s(limit: dict, raw: float, stored: float, cold: bool = False) -> float:
    """The fastest restore of ``stored`` bytes into ``raw`` bytes (seconds; module doc);
    ``cold``: the page cache was dropped before the restore (an object store's reads: True)."""
    decode = limit["hash_bps"] if stored >= raw else limit["decode_bps"]
    cpu = stored / limit["copy_bps"] + raw / limit["touch_bps"] + raw / decode
    if limit["store"] == "local disk" and not limit["read_cold"]:  # from the page cache: CPU
        return max(cpu, stored / limit["read_bps"] + raw / decode)  # on the decoding cores
    counted = cold or not limit["read_cold"]
    return max(cpu, stored / limit["read_bps"] if counted else 0.0)


def medians(limits: Iterable[dict]) -> dict:
    """The median of each rate over several runs' limits (other fields from the last)."""
    limits = list(limits)
    out = dict(limits[-1])
    for key in out:
        if key.endswith("_bps"):
            out[key] = float(np.median([lim[key] for lim in limits]))
    return out


def rows(limit: dict) -> list[list[str]]:
    """Markdown table rows ``[what, MB/s]`` of a limit."""
    per_core = f"1 thread x {limit['workers']} workers"
    read = ("" if limit["store"] != "local disk" else ", page cache dropped"
            if limit["read_cold"] else ", warm page cache")
    return [[f"{limit['store']} write{', fsync' if limit['store'] == 'local disk' else ''} "
             f"({limit['threads']} threads)", fmt(limit["write_bps"], "MB")],
            [f"{limit['store']} read{read} ({limit.get('read_threads', limit['threads'])} "
             "threads)", fmt(limit["read_bps"], "MB")],
            *([f"{name} ({per_core})", fmt(limit[f"{key}_bps"], "MB")] for key, name in (
                ("copy", "page-cache copy"), ("touch", "first touch of new memory"),
                ("hash", "xxh3-128 hash"),
                ("encode", "codec encode (codec 5)"), ("decode", "codec decode + hash check"))),
            ["codec 5's encoded / raw bytes of the sample", f"{limit['encoded_fraction']:.3f}"]]
