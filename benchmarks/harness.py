"""What every benchmark here shares: states, checks, timing, peak RSS, cache and memory hygiene,
scratch space, an S3 server, tables, JSON and the command line. Each benchmark script holds only
its scenario; they import this module by path (``benchmarks/`` is not a package).

States are GPT-2-shaped train states (HF ``GPT2LMHeadModel`` names): params plus adam ``mu``
and ``nu`` of the same shapes and an int32 ``count``. The small sizes are made with numpy (the
figures in README.md were measured on exactly these values); ``gpt2-xl`` (1.56B float32 params,
18.7 GB with adam, 1741 leaves) is made with ``jax.random`` on the chosen device, in seconds on
an accelerator and without a host copy.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import functools
import gc
import importlib.metadata
import importlib.util
import itertools
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import psutil
import zstandard

import casstore

HERE = pathlib.Path(__file__).resolve().parent

SIZES = {  # GPT-2 shapes: vocabulary, context, width, blocks
    "gpt2-xl": dict(vocab=50257, ctx=1024, width=1600, blocks=48),
    "gpt2": dict(vocab=50257, ctx=1024, width=768, blocks=12),
    "small": dict(vocab=50257, ctx=1024, width=256, blocks=12),  # 0.27 GB, for slow machines
    "tiny": dict(vocab=1000, ctx=64, width=64, blocks=3),
}
JAX_SIZES = ("gpt2-xl",)  # made with jax.random on the device, not with numpy
CHANGED_BLOCKS = 2  # changed_state gives the last blocks new values
KINDS = ("params", "mu", "nu")


def load_module(name: str, path: pathlib.Path):
    """Imports the file at ``path`` as module ``name`` once (``tests/servers.py``, a sibling)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- states ------------------------------------------------------------------------------------

def _gpt2_tree(make: Callable[[tuple[int, ...]], Any], vocab: int, ctx: int, width: int,
               blocks: int) -> dict:
    """GPT-2 parameter shapes (HF ``GPT2LMHeadModel`` naming); ``make(shape)`` fills leaves."""

    def ln() -> dict:
        return {"g": make((width,)), "b": make((width,))}

    def block() -> dict:
        return {"ln_1": ln(),
                "attn": {"c_attn": {"w": make((width, 3 * width)), "b": make((3 * width,))},
                         "c_proj": {"w": make((width, width)), "b": make((width,))}},
                "ln_2": ln(),
                "mlp": {"c_fc": {"w": make((width, 4 * width)), "b": make((4 * width,))},
                        "c_proj": {"w": make((4 * width, width)), "b": make((width,))}}}

    return {"wte": make((vocab, width)), "wpe": make((ctx, width)),
            "h": [block() for _ in range(blocks)], "ln_f": ln()}


def _numpy_filler(rng: np.random.Generator, kind: str) -> Callable[[tuple[int, ...]], np.ndarray]:
    """Random float32 leaves, generated in place: params and mu N(0, 0.02), nu |N(0, 1e-3)|."""

    def make(shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, np.float32)
        rng.standard_normal(dtype=np.float32, out=out)
        if kind == "nu":
            np.abs(out, out=out)
            out *= np.float32(1e-3)
        else:
            out *= np.float32(0.02)
        return out

    return make


@functools.partial(jax.jit, static_argnums=(1, 2))
def _jax_leaf(key: jax.Array, shape: tuple[int, ...], nu: bool) -> jax.Array:
    """One float32 leaf: N(0, 0.02), or |N(0, 1e-3)| for ``nu``. Compiled once per shape."""
    x = jax.random.normal(key, shape, jnp.float32)
    return jnp.abs(x) * jnp.float32(1e-3) if nu else x * jnp.float32(0.02)


def _jax_filler(seed: int, kind: str, device: jax.Device) -> Callable[[tuple[int, ...]], Any]:
    """As :func:`_numpy_filler`, made by ``jax.random`` on ``device`` (one key per leaf)."""
    key = jax.random.fold_in(jax.random.key(seed), KINDS.index(kind))
    counter = itertools.count()

    def make(shape: tuple[int, ...]) -> jax.Array:
        with jax.default_device(device):
            return _jax_leaf(jax.random.fold_in(key, next(counter)), shape, kind == "nu")

    return make


def _fillers(seed: int, device: jax.Device | None) -> Callable[[str], Callable]:
    """``kind -> make(shape)``: numpy leaves, or jax leaves on ``device`` if it is given."""
    if device is not None:
        return lambda kind: _jax_filler(seed, kind, device)
    rng = np.random.default_rng(seed)  # one stream for all kinds, in order: params, mu, nu
    return lambda kind: _numpy_filler(rng, kind)


def train_state(size: str, seed: int = 0, device: jax.Device | None = None) -> dict:
    """Params, adam mu and nu (random, like a state mid-training) and the step count.

    Sizes in :data:`JAX_SIZES` are made on ``device`` (default: jax's default device) with
    ``jax.random``; the others with numpy, whatever ``device`` says.
    """
    shape = SIZES[size]
    if size in JAX_SIZES:
        device = device or jax.devices()[0]
    fill = _fillers(seed, device if size in JAX_SIZES else None)
    return {"params": _gpt2_tree(fill("params"), **shape),
            "opt_state": {"count": np.int32(1000),
                          "mu": _gpt2_tree(fill("mu"), **shape),
                          "nu": _gpt2_tree(fill("nu"), **shape)}}


def changed_state(state: dict, seed: int = 1) -> dict:
    """``state`` with new random values in the last blocks and ln_f (params, mu, nu) and count + 1.

    Unchanged leaves are the same objects as in ``state``; ``state`` is not modified. New leaves
    are made like ``state``'s: with jax on its device if it holds jax arrays, else with numpy.
    """
    wpe = state["params"]["wpe"]
    fill = _fillers(seed, next(iter(wpe.devices())) if isinstance(wpe, jax.Array) else None)
    blocks = len(state["params"]["h"])
    changed = range(max(0, blocks - CHANGED_BLOCKS), blocks)

    def renew(tree: dict, kind: str) -> dict:
        make = fill(kind)
        fresh = lambda x: make(x.shape)  # noqa: E731
        out = dict(tree, h=list(tree["h"]), ln_f=jax.tree.map(fresh, tree["ln_f"]))
        for i in changed:
            out["h"][i] = jax.tree.map(fresh, tree["h"][i])
        return out

    opt = state["opt_state"]
    return {"params": renew(state["params"], "params"),
            "opt_state": {"count": np.int32(opt["count"] + 1), "mu": renew(opt["mu"], "mu"),
                          "nu": renew(opt["nu"], "nu")}}


def state_bytes(tree: Any) -> int:
    """Raw bytes of all leaves (no host copy of device arrays)."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def device(name: str) -> jax.Device:
    """``"default"``: jax's default device (an accelerator when there is one); ``"cpu"``."""
    return jax.devices("cpu")[0] if name == "cpu" else jax.devices()[0]


def to_jax(states: list[Any], dev: jax.Device, copy: bool = False) -> list[Any]:
    """The states as jax arrays on ``dev``; a leaf shared by several states is put once.

    With ``copy``, every leaf gets a fresh buffer even if it already is on ``dev`` (the caller
    may delete or donate it).
    """
    cache: dict[int, jax.Array] = {}

    def put(x: Any) -> jax.Array:
        if id(x) not in cache:
            cache[id(x)] = jax.device_put(x, dev, may_alias=False if copy else None)
        return cache[id(x)]

    return jax.block_until_ready([jax.tree.map(put, s) for s in states])


def abstract_of(tree: Any, dev: jax.Device) -> Any:
    """``jax.ShapeDtypeStruct`` leaves on ``dev``: a restore target."""
    sharding = jax.sharding.SingleDeviceSharding(dev)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
                        tree)


def host_array(x: Any) -> np.ndarray:
    """A host copy of a leaf. For a jax array, of a temporary device copy: ``np.asarray`` would
    cache its host copy on the array itself and keep it for the array's lifetime."""
    return np.asarray(x.copy() if isinstance(x, jax.Array) else x)


def flat_name(path: tuple) -> str:
    """A key path as ``params/h/0/attn/c_attn/w`` (the safetensors tensor name)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def flatten(tree: Any) -> dict[str, Any]:
    """``{flat_name(key path): leaf}`` for every leaf of ``tree``."""
    return {flat_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def _on_accelerator(x: Any) -> bool:
    return isinstance(x, jax.Array) and any(d.platform != "cpu" for d in x.devices())


def same_bytes(a: Any, b: Any) -> bool:
    """True if ``a`` and ``b`` have the same dtype, shape and bytes. Arrays on an accelerator are
    compared there (the other side is put on its device), without a host copy."""
    if a is b:
        return True
    if np.dtype(a.dtype) != np.dtype(b.dtype) or np.shape(a) != np.shape(b):
        return False
    as_uint = np.dtype(f"u{np.dtype(a.dtype).itemsize}")
    if _on_accelerator(a) or _on_accelerator(b):
        dev = next(iter((a if _on_accelerator(a) else b).devices()))
        x, y = (jax.device_put(v, dev) for v in (a, b))
        return bool(jnp.array_equal(x.view(as_uint), y.view(as_uint)))
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


def changed_zstd_bytes(old: dict, new: dict) -> tuple[int, int, int]:
    """(leaves that differ, their raw bytes, their zstd level-1 size) between two states."""
    level1 = zstandard.ZstdCompressor(level=1)
    old_flat, count, raw, packed = flatten(old), 0, 0, 0
    for name, b in flatten(new).items():
        if not same_bytes(old_flat[name], b):
            data = np.ascontiguousarray(host_array(b)).tobytes()
            count, raw, packed = count + 1, raw + len(data), packed + len(level1.compress(data))
    return count, raw, packed


def verify_equal(expected: dict, restored: dict[str, Any], system: str, want_jax: bool) -> int:
    """Raises AssertionError unless every leaf of ``restored`` (flat) matches bit for bit;
    returns the number of leaves checked."""
    want = flatten(expected)
    if set(want) != set(restored):
        raise AssertionError(f"{system}: restored keys differ: "
                             f"{sorted(set(want) ^ set(restored))[:5]}")
    for name, e in want.items():
        got = restored[name]
        if want_jax and not isinstance(got, jax.Array):
            raise AssertionError(f"{system}: {name} restored as {type(got).__name__}")
        if not same_bytes(e, got):
            raise AssertionError(f"{system}: {name} differs from the saved state")
    return len(want)


def check(condition: bool, detail: Any) -> None:
    """Raises AssertionError with ``detail`` unless ``condition`` (also under ``python -O``)."""
    if not condition:
        raise AssertionError(str(detail))


# -- measuring ---------------------------------------------------------------------------------

def _clear_hwm() -> bool:
    """Resets the kernel's peak-RSS counter (VmHWM) of this process; False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakRss:
    """Peak RSS of this process minus its RSS on entry, as ``extra`` (bytes).

    A thread samples RSS every ``interval_s``; where the kernel allows it, its VmHWM (reset on
    entry) catches peaks between samples.
    """

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s

    def __enter__(self) -> PeakRss:
        self.proc = psutil.Process()
        self.hwm_reset = _clear_hwm()
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        hwm = _hwm() if self.hwm_reset else None
        self.peak = max(self.peak, hwm or 0, self.proc.memory_info().rss)
        self.extra = self.peak - self.base


def seconds(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Runs ``fn`` and returns (wall seconds, its result)."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def timed(out: dict, key: str, fn: Callable[[], Any]) -> Any:
    """Runs ``fn``; sets ``out[key]`` to its wall time, ``out[key_cpu_s]`` to the CPU time
    (user + system, all threads) the process spent meanwhile and ``out[key_disk_read_bytes]``
    to the bytes it read from storage devices meanwhile (``/proc/self/io``'s ``read_bytes``:
    page-cache hits are not counted, so a warm phase that reads 0 was warm). Returns ``fn``'s
    result."""
    proc = psutil.Process()
    c0, io0 = proc.cpu_times(), proc.io_counters()
    out[key], result = seconds(fn)
    c1, io1 = proc.cpu_times(), proc.io_counters()
    name = key.removesuffix("_s")
    out[name + "_cpu_s"] = (c1.user + c1.system) - (c0.user + c0.system)
    out[name + "_disk_read_bytes"] = io1.read_bytes - io0.read_bytes
    return result


def medians(runs: list[dict]) -> dict:
    """Per key of ``runs[0]``: the median over ``runs`` of a number, else the last run's value."""
    def median(values: list) -> Any:
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return statistics.median(values)
        return values[-1]

    return {key: median([r[key] for r in runs]) for key in runs[0]}


def rotated(items: tuple, r: int) -> tuple:
    """``items`` rotated by ``r``: the order of systems in repeat ``r``."""
    return items[r % len(items):] + items[:r % len(items)]


_drop_refused = False


def drop_caches() -> bool:
    """Drops the OS page cache so the next phase reads from disk; True if it did.

    Needs root (writing ``/proc/sys/vm/drop_caches``). Where that is not permitted, says so
    once on stderr and returns False: the phases then run with a warm page cache.
    """
    global _drop_refused
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        if not _drop_refused:
            print(f"note: the page cache was not dropped ({e.strerror}: writing "
                  "/proc/sys/vm/drop_caches needs root); phases read with a warm cache",
                  file=sys.stderr)
        _drop_refused = True
        return False


def settle(warm_bytes: int = 0, drop: bool = False) -> bool:
    """Before a phase: free garbage, give freed heap back, write back dirty pages, optionally
    drop the page cache (:func:`drop_caches`), warm memory. Returns whether the cache was
    dropped.

    ``warm_bytes`` of memory are touched and freed again (untimed), so the phase finds warm free
    pages for its buffers and the page cache. On this project's VMs memory left free for a
    few seconds is handed back to the host, and touching it again runs at ~0.5 GB/s: without
    warming, a 1.5 GB write took 4.2 s instead of 1.1 s, charged to whichever phase came first.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    os.sync()
    dropped = drop_caches() if drop else False
    if warm_bytes:
        touched = np.ones(warm_bytes, np.uint8)
        del touched
    return dropped


def du(path: pathlib.Path) -> tuple[int, int]:
    """(files, bytes) under ``path`` (or of the file)."""
    if path.is_file():
        return 1, path.stat().st_size
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def fsync_path(path: pathlib.Path) -> None:
    """fsyncs a file or a directory (after writing into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def scratch(base_dir: str | None, name: str) -> Iterator[pathlib.Path]:
    """A fresh temporary directory (inside ``base_dir`` if given), removed afterwards."""
    if base_dir is not None:
        os.makedirs(base_dir, exist_ok=True)
    root = pathlib.Path(tempfile.mkdtemp(prefix=f"casstore-bench-{name}-", dir=base_dir))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- an S3 server ------------------------------------------------------------------------------

def test_servers():
    """``tests/servers.py``: the SeaweedFS launcher the test suite uses."""
    return load_module("casstore_test_servers", HERE.parent / "tests" / "servers.py")


@contextlib.contextmanager
def s3_server(endpoint: str | None, key: str | None, secret: str | None,
              base_dir: str | None) -> Iterator[dict]:
    """Storage options of an S3 server: ``endpoint``, or a fresh SeaweedFS on loopback."""
    if endpoint:
        yield ({"endpoint_url": endpoint, "key": key, "secret": secret} if key
               else {"endpoint_url": endpoint, "anon": True})
        return
    if base_dir is not None:
        os.makedirs(base_dir, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="casstore-bench-s3-", dir=base_dir))
    if len(str(tmp / "weed-0" / "filer.sock")) > 100:  # sun_path holds 108 bytes
        shutil.rmtree(tmp)
        raise ValueError(f"--dir {base_dir!r} is too long a path for SeaweedFS's unix sockets")
    try:
        with test_servers().seaweedfs_server(tmp) as server:
            yield server.storage_options
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def new_bucket(options: dict) -> str:
    """Creates a bucket and writes one small object into it; returns the bucket's name.

    SeaweedFS allocates a new bucket's volumes at its first write (0.3-1 s): that write happens
    here, untimed, so no timed phase pays for it.
    """
    import fsspec

    bucket = f"casstore-bench-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    fs.mkdir(bucket)
    fs.pipe_file(f"{bucket}/warm-up", b"x")
    return bucket


# -- reporting ---------------------------------------------------------------------------------

def environment(*dists: str) -> dict:
    """Date, machine, versions of casstore, jax, numpy and ``dists``, casstore's git commit."""
    versions = {}
    for dist in ("casstore", "jax", "jaxlib", "numpy", *dists):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    sha = None
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        src = pathlib.Path(casstore.__file__).parent
        sha = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=src, check=True,
                             capture_output=True, text=True).stdout.strip() or None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "memory_bytes": psutil.virtual_memory().total,
            "platform": platform.platform(), "python": platform.python_version(),
            "casstore_path": os.path.dirname(casstore.__file__), "casstore_git": sha,
            "versions": versions}


def machine_note(result: dict) -> str:
    """The report line's tail on where and when it ran: cores, memory, load average (1 min)
    before and after, date and casstore's commit, from ``result["environment"]`` and its
    ``load_before`` / ``load_after``."""
    env = result["environment"]
    return (f"{env['cpus']} cores, {env['memory_bytes'] / 2**30:.0f} GiB; load average "
            f"{result['load_before'][0]:.2f} before, {result['load_after'][0]:.2f} after; "
            f"{env['date']}; casstore {env['casstore_git'] or env['versions'].get('casstore')}")


def fmt(value: float, unit: str) -> str:
    """A figure for a table: ``s`` seconds, ``x`` a ratio, ``B`` bytes (B / kB / MB), ``MB``
    bytes in MB, ``n`` a count; NaN as ``n/a``."""
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if unit == "s":
        return f"{value:.3f}"
    if unit == "x":
        return f"{value:.3f}" if value >= 0.01 else f"{value:.2e}"
    if unit == "MB":
        return f"{value / 1e6:.2f}"
    if unit == "n":
        return f"{value:.0f}"
    if value >= 1e6:
        return f"{value / 1e6:.1f} MB"
    return f"{value / 1e3:.1f} kB" if value >= 1e3 else f"{value:.0f} B"


def ratio(a: float, b: float) -> float:
    """``a / b``, NaN if ``b`` is 0 or either is NaN."""
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of a markdown table: the first column left-aligned, the others right-aligned."""
    return (["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
            + ["| " + " | ".join(row) + " |" for row in rows])


OPTIONS = {  # the command-line options benchmarks share: name -> argparse keywords
    "dir": dict(default=None,
                help="where to write (a fresh temp dir inside it; default: under /tmp)"),
    "repeat": dict(type=int, default=1, help="runs per system; medians are shown"),
    "tiny": dict(action="store_true", help="a tiny state, the smoke test's setting"),
    "drop-caches": dict(action="store_true",
                        help="drop the OS page cache before each timed phase (needs root)"),
    "no-warm": dict(action="store_true",
                    help="do not warm memory before each timed phase (harness.settle)"),
    "device": dict(choices=("default", "cpu"), default="default",
                   help="where the state lives: jax's default device (an accelerator when "
                        "there is one) or the CPU"),
    "json": dict(default=None, help="also write all figures as JSON here"),
}


def parser(doc: str, *names: str, **helps: str) -> argparse.ArgumentParser:
    """An argument parser with the shared options ``names`` (keys of :data:`OPTIONS`);
    ``helps`` replace their help texts, keyed by the option's dest (``drop_caches``)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name in names:
        spec = dict(OPTIONS[name])
        spec["help"] = helps.get(name.replace("-", "_"), spec["help"])
        ap.add_argument(f"--{name}", **spec)
    return ap


def parse(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parses ``argv``; exits with a usage error if ``--repeat`` is below 1."""
    args = ap.parse_args(argv)
    if getattr(args, "repeat", 1) < 1:
        ap.error("--repeat must be >= 1")
    return args


def report(result: dict, text: str, json_path: str | None) -> dict:
    """Prints ``text`` (the tables) and writes ``result`` as JSON to ``json_path`` if given."""
    print(text)
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result
