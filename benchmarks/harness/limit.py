"""The machine's limit (README.md, "The machine's limit"), measured in the same run as the
figures it judges: its rates, and the fastest save, restore and copy they allow."""

import concurrent.futures as cf
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from casstore._codec import chunk_id, decode_chunk, encode_chunk

from .storage import fsync_path, scratch
from .timing import drop_caches, interleave


def _rate(nbytes: int, fn: Callable[[], object], tries: int = 3) -> float:
    """Bytes per second of ``fn`` processing ``nbytes``: the best of ``tries`` runs."""
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / max(best, 1e-9)


def _local(root: Any, objects: dict[str, bytes], threads: int) -> tuple[Callable, Callable]:
    """``(put_many(), get_many(n))`` of ``objects`` as files under ``root``: each written and
    fsynced from ``threads`` threads, then the directory fsynced; read back from ``n``."""
    def put(item: tuple[str, bytes]) -> None:
        with open(root / item[0], "wb") as f:
            f.write(item[1])
            f.flush()
            os.fsync(f.fileno())

    def get(key: str) -> None:
        with open(root / key, "rb") as f:
            f.readinto(bytearray(os.fstat(f.fileno()).st_size))

    def pool(n: int, fn: Callable, items: Any) -> None:
        with cf.ThreadPoolExecutor(n) as ex:
            list(ex.map(fn, items))

    return (lambda: (pool(threads, put, objects.items()), fsync_path(root)),
            lambda n: pool(n, get, objects))


def measure(nbytes: int, *, base_dir: str | None = None, drop: bool = False, fs: Any = None,
            prefix: str = "") -> dict:
    """The limit's rates (bytes per second) on ``min(nbytes, 256 MiB)`` of N(0, 0.02) float32
    in at least 4 objects: the CPU's on one thread times the workers; local disk's under
    ``base_dir`` from ``2 x workers`` threads (at least 4; reads also from twice as many, the
    faster), the page cache dropped with ``drop`` where permitted (``read_cold``); or an S3
    filesystem ``fs``'s under ``prefix`` (removed afterwards), one ``fs.pipe`` and ``fs.cat``."""
    n_workers = len(os.sched_getaffinity(0))  # the cores this process may run on
    threads = max(4, 2 * n_workers)
    nbytes = min(nbytes, 256 << 20)
    size = max(64 << 10, min(16 << 20, nbytes // 4)) // 4 * 4
    count = max(4, nbytes // size)
    raw = np.random.default_rng(0).standard_normal(count * size // 4, dtype=np.float32)
    raw *= np.float32(0.02)
    flat, total = raw.view(np.uint8), count * size
    blocks = [memoryview(flat[i * size:(i + 1) * size]) for i in range(count)]
    out = np.empty_like(flat)
    encoded = [encode_chunk(b, element_size=4) for b in blocks]
    ids = [chunk_id(b) for b in blocks]
    lim = {f"{k}_bps": v * n_workers for k, v in {
        "copy": _rate(total, lambda: np.copyto(out, flat)),
        "touch": _rate(total, lambda: np.ones(total, np.uint8)),
        "hash": _rate(total, lambda: [chunk_id(b) for b in blocks]),
        "encode": _rate(total, lambda: [encode_chunk(b, element_size=4) for b in blocks]),
        "decode": _rate(total, lambda: [decode_chunk(e, i, size, out=out[k * size:(k + 1) * size])
                                        for k, (e, i) in enumerate(zip(encoded, ids))])}.items()}
    objects = {f"limit-{k:04d}": bytes(b) for k, b in enumerate(blocks)}
    with contextlib.ExitStack() as stack:
        if fs is None:
            put_many, get_many = _local(stack.enter_context(scratch(base_dir, "limit")),
                                        objects, threads)
        else:
            stack.callback(fs.rm, prefix, recursive=True)
            put_many = lambda: fs.pipe({f"{prefix}/{k}": v for k, v in objects.items()})  # noqa: E731
            get_many = lambda n: fs.cat([f"{prefix}/{k}" for k in objects])  # noqa: E731
        lim["write_bps"] = _rate(total, put_many, tries=1)
        reads = {}
        for n in (threads, 2 * threads):
            cold = drop_caches() if drop else False
            reads[n] = _rate(total, lambda n=n: get_many(n), tries=1)
    lim["read_threads"] = max(reads, key=reads.get)
    lim.update(read_bps=reads[lim["read_threads"]], workers=n_workers, threads=threads,
               sample_bytes=total, object_bytes=size, read_cold=cold,
               store="S3" if fs is not None else "local disk",
               encoded_fraction=sum(len(e) for e in encoded) / total)
    return lim


def save_s(lim: dict, raw: float, stored: float) -> float:
    """The fastest save of ``raw`` bytes stored as ``stored``: hashing and encoding overlapped
    with writing what it stores, or hashing and writing raw, whichever is faster."""
    encoded = max(raw * (1 / lim["hash_bps"] + 1 / lim["encode_bps"]), stored / lim["write_bps"])
    return min(encoded, max(raw / lim["hash_bps"], raw / lim["write_bps"]))


def restore_s(lim: dict, raw: float, stored: float, cold: bool = False) -> float:
    """The fastest restore of ``stored`` bytes into ``raw``: copying, first touch and decoding
    (the hash alone for a state stored raw) overlapped with the read, which counts unless the
    restore was warm and the limit's read was not; a read from a warm local page cache is CPU
    work on the decoding cores, so the decoding adds to it."""
    decode = lim["hash_bps"] if stored >= raw else lim["decode_bps"]
    cpu = stored / lim["copy_bps"] + raw / lim["touch_bps"] + raw / decode
    if lim["store"] == "local disk" and not lim["read_cold"]:
        return max(cpu, stored / lim["read_bps"] + raw / decode)
    return max(cpu, stored / lim["read_bps"] if cold or not lim["read_cold"] else 0.0)


def move_s(nbytes: float, src: dict, dst: dict) -> float:
    """The fastest copy of ``nbytes`` stored bytes: the source's read or the destination's
    write, the slower."""
    return nbytes / min(src["read_bps"], dst["write_bps"])


def interleaved(args: Any, nbytes: int, systems: tuple[str, ...],
                run_one: Callable[[str, Any], dict],
                measure_one: Callable[[], dict] | None = None) -> tuple[dict, dict, dict]:
    """:func:`harness.timing.interleave` of ``run_one(system, root)``, ``root`` a fresh scratch
    directory under ``args.dir``, with the limit measured once per repeat (by default on local
    disk under ``args.dir``): (runs, medians, the median of each rate)."""
    def in_scratch(system: str) -> dict:
        with scratch(args.dir, system.replace(" ", "-")) as root:
            return run_one(system, root)

    measure_one = measure_one or (lambda: measure(nbytes, base_dir=args.dir,
                                                  drop=args.drop_caches))
    runs, res, limits = interleave(systems, args.repeat, in_scratch, measure_one)
    rates = {k: float(np.median([lim[k] for lim in limits])) for k in limits[-1]
             if k.endswith("_bps")}
    return runs, res, {**limits[-1], **rates}
