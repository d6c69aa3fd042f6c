"""casstore: the cost of a save in a repository holding 200,000 chunks vs in a fresh one.

Issue 11 item 3, on local disk and on S3: full / fresh save time (target <= 2x) with the same
bytes written, and each save's fraction of the machine's limit. README.md's ``repo_size.py``."""

import contextlib
import os
import pathlib
import sys
import time
import uuid

import numpy as np

import casstore
from casstore._codec import chunk_id, decode_chunk, encode_chunk
from casstore._layout import CHUNKS_PREFIX, chunk_key
from casstore.store import LocalStore

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h

STORES, CHUNKS, CHUNK_RAW_BYTES, PUT_BATCH, SAMPLE = ("local", "s3"), 200_000, 64, 5000, 16
TREES = {"small": (12, 25_000), "large": (32, 1 << 20)}  # name -> (leaves, float32 elements)
TINY = {"chunks": 2000, "small": (12, 256), "large": (4, 1 << 16)}


def fill(put_many, count: int, seed: int) -> dict:
    """Puts ``count`` distinct random 64-byte chunk objects with ``put_many({key: object})``:
    the seconds it took and a sample of (id, raw) to check."""
    rng, sample, t0 = np.random.default_rng(seed), [], time.perf_counter()
    for start in range(0, count, PUT_BATCH):
        n = min(PUT_BATCH, count - start)
        data, items = rng.bytes(n * CHUNK_RAW_BYTES), {}
        for i in range(n):
            raw = data[i * CHUNK_RAW_BYTES:(i + 1) * CHUNK_RAW_BYTES]
            items[chunk_key(chunk_id(raw))] = encode_chunk(memoryview(raw))
            if (start == 0 and i < SAMPLE) or start + i == count - 1:
                sample.append((chunk_id(raw), raw))
        put_many(items)
    os.sync()
    return {"fill_s": time.perf_counter() - t0, "sample": sample}


@contextlib.contextmanager
def opener(kind: str, args):
    """``(new store, fast put_many of a store, the limit)`` on ``kind``."""
    size = 4 * TINY["large"][0] * TINY["large"][1] if args.tiny else 64 << 20
    if kind == "local":
        with h.scratch(args.dir, "repo-size") as root:
            yield (lambda: casstore.open_store(str(root / uuid.uuid4().hex[:12])),
                   lambda store: LocalStore(store.root, fsync=False).put_many,
                   h.limit.measure(size, base_dir=args.dir, drop=args.drop_caches))
        return
    with h.s3_server(args) as options:
        bucket = h.new_bucket(options)
        new = lambda: casstore.open_store(  # noqa: E731
            f"s3://{bucket}/repo-{uuid.uuid4().hex[:12]}", skip_instance_cache=True, **options)
        limit = h.limit.measure(size, fs=new().fs, prefix=f"{bucket}/limit")
        yield new, lambda store: store.put_many if options.get("key") else (
            lambda items: h.http_put_many(options["endpoint_url"], store.root, items)), limit


def bench_store(kind: str, args, trees: dict, chunks: int) -> dict:
    """Fills a repository of ``kind``, then times each tree's save in it and in fresh ones."""
    out: dict = {"store": kind}
    with opener(kind, args) as (new_store, filler, limit):
        def new() -> object:  # a repository with a config and step 0 of a one-leaf tree
            store = new_store()
            casstore.save(store, 0, {"x": np.zeros(4, np.float32)})
            return store

        full = new()
        out["chunks_before_fill"] = sum(1 for _ in full.list(CHUNKS_PREFIX))
        filled = fill(filler(full), chunks, seed=1)
        for cid, raw in filled["sample"]:
            got = decode_chunk(full.get(chunk_key(cid)), cid, len(raw))
            h.check(bytes(got) == raw, f"chunk {cid} does not decode to its bytes")
        out.update(fill_s=filled["fill_s"], limit=limit,
                   chunks_listed=sum(1 for _ in full.list(CHUNKS_PREFIX)))
        h.check(out["chunks_listed"] == out["chunks_before_fill"] + chunks, out["chunks_listed"])
        step, seed = 1, 100
        for name, (leaves, elements) in trees.items():
            saves: dict[str, list[dict]] = {"fresh": [], "full": []}
            for r in range(args.repeat):
                seed += 1
                rng = np.random.default_rng(seed)
                tree = {f"layer{i:03d}": rng.standard_normal(elements, dtype=np.float32)
                        for i in range(leaves)}
                for where in h.rotated(("fresh", "full"), r):
                    store, step = (full, step + 1) if where == "full" else (new(), step)
                    fig: dict = {}
                    info = h.phase(fig, "s", lambda s=store, n=(step if where == "full" else 1),
                                   t=tree: casstore.save(s, n, t), drop=args.drop_caches)
                    saves[where].append({"s": fig["s"], "written_bytes": info.written_bytes,
                                         "new_chunks": info.new_chunks})
            for where, runs in saves.items():
                out.update({f"{name}_{where}_{k}": v for k, v in h.medians(runs).items()})
            out[f"{name}_limit_s"] = h.limit.save_s(limit, leaves * elements * 4,
                                                    out[f"{name}_fresh_written_bytes"])
            out[f"{name}_ratio"] = h.ratio(out[f"{name}_full_s"], out[f"{name}_fresh_s"])
            out[f"{name}_same_bytes"] = all(a["written_bytes"] == b["written_bytes"]
                                            for a, b in zip(saves["fresh"], saves["full"]))
            out[f"{name}_saves"] = saves
    return out


def run(args) -> dict:
    """Every store of ``args.stores``."""
    chunks = args.chunks or (TINY["chunks"] if args.tiny else CHUNKS)
    trees = {n: (TINY if args.tiny else TREES)[n] for n in TREES}
    return {"chunks": chunks, "trees": {n: {"leaves": lv, "elements": el, "bytes": lv * el * 4}
                                        for n, (lv, el) in trees.items()},
            "repeat": args.repeat, "server": args.endpoint or "seaweedfs on 127.0.0.1",
            "results": {kind: bench_store(kind, args, trees, chunks) for kind in args.stores}}


def table(result: dict) -> list[str]:
    """The figures, a column per store, the limits, then the targets."""
    res = result["results"]
    row = lambda label, key, unit: [label, *(h.fmt(res[k][key], unit) for k in res)]  # noqa
    rows = [row("chunks in the full repository", "chunks_listed", "n"),
            row("filling it (s)", "fill_s", "s")]
    for name, tree in result["trees"].items():
        rows += [row(f"save of {h.fmt(tree['bytes'], 'B')} ({name}), {w} repository (s)",
                     f"{name}_{w}_s", "s") for w in ("fresh", "full")]
        rows += [row("... full / fresh (x)", f"{name}_ratio", "x"),
                 row("... machine's limit (s)", f"{name}_limit_s", "s"),
                 ["... limit / figure, fresh and full", *(" / ".join(h.fmt(h.ratio(
                     r[f"{name}_limit_s"], r[f"{name}_{w}_s"]), "x") for w in ("fresh", "full"))
                     for r in res.values())]]
        rows += [row(f"... bytes written, {w}", f"{name}_{w}_written_bytes", "B")
                 for w in ("fresh", "full")]
    lines = h.md_table(["figure", *res], rows)
    for k, r in res.items():
        lines += h.limit_lines(r["limit"], f"The machine's limit, {k} store, this run")
    met = lambda r, n: r[f"{n}_ratio"] <= 2 and r[f"{n}_same_bytes"]  # noqa: E731
    lines += ["", *(f"- target, {k}, {n} tree: full / fresh <= 2x with the same bytes written: "
                    f"{r[f'{n}_ratio']:.3g}x, bytes {'equal' if r[f'{n}_same_bytes'] else 'DIFFER'}"
                    f" ({'met' if met(r, n) else 'NOT met'})"
                    for k, r in res.items() for n in result["trees"])]
    return [*lines, f"- median of {result['repeat']} save(s) each; S3 server: {result['server']}"]


main = h.command(__doc__, run, table, "dir", "repeat", "tiny", "drop-caches", "endpoint", "key",
                 "secret", extra=(("--stores", {"type": h.subset(STORES), "default": "local,s3"}),
                                  ("--chunks", {"type": int, "help": f"default {CHUNKS}"})))

if __name__ == "__main__":
    main()
