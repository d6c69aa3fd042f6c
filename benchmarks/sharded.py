"""casstore vs orbax-checkpoint on a sharded state: save, restore onto the same and another mesh.

The state lives on 8 CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set
before jax is imported). It is about 1.14 GB of random float32 values made with numpy:

- ``a``, ``b``: 8192x8192, ``P('data', 'model')`` on ``Mesh((4, 2), ('data', 'model'))``;
- ``rows``: 16384x4096, ``P('data', None)``; ``cols``: 4096x16384, ``P(None, 'model')``;
- ``rep``: 4096x4096, replicated ``P()``.

Both systems save it to local disk in the same run (casstore: ``casstore.save``; orbax:
``ocp.StandardCheckpointer().save`` timed through ``wait_until_finished``), then restore it
with an abstract target (``jax.ShapeDtypeStruct`` with a sharding) onto the same sharding and
onto a different mesh, ``Mesh((8,), ('x',))`` with ``P('x')`` for every leaf. Every restore is
compared bit for bit with the numpy source, and its sharding with the target's, outside the
timed region (a mismatch raises ``AssertionError``).

Also measured (casstore only):

- bytes read from the store (``CountingStore.bytes_read``) for the region of ONE device under
  the saved sharding of ``a``, versus the whole of ``a`` (``casstore._restore.read_regions``);
- peak extra RSS (peak minus the RSS on entry, sampled every 2 ms and cross-checked with the
  kernel's VmHWM) of the restore onto the other mesh; it includes the restored state itself.

Usage::

    python benchmarks/sharded.py [--dir DIR] [--repeat N] [--drop-caches] [--tiny]
                                 [--json PATH]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import casstore  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from save_restore import PeakRss  # noqa: E402  (one RSS sampler for every benchmark)

from casstore._restore import read_regions  # noqa: E402
from casstore.store import CountingStore, LocalStore  # noqa: E402

# name -> (shape, spec on the save mesh). Shapes are divided by TINY_DIV with --tiny.
LEAVES: dict[str, tuple[tuple[int, int], P]] = {
    "a": ((8192, 8192), P("data", "model")),
    "b": ((8192, 8192), P("data", "model")),
    "rows": ((16384, 4096), P("data", None)),
    "cols": ((4096, 16384), P(None, "model")),
    "rep": ((4096, 4096), P()),
}
TINY_DIV = 64
SINGLE_LEAF = "a"  # the leaf of the single-shard bytes-read figure
SYSTEMS = ("casstore", "orbax")
# (key, label) of the timed figures, each reported per system and as casstore / orbax.
TIMED = (("save_s", "save (s)"),
         ("restore_same_s", "restore, same mesh (s)"),
         ("restore_other_s", "restore, other mesh (8,) P('x') (s)"))


# ---------------------------------------------------------------------------------- helpers


def settle(warm_bytes: int, drop: bool) -> None:
    """Before a timed phase: collect garbage, trim the heap, write back dirty pages, optionally
    drop the page cache (needs root), and touch ``warm_bytes`` of memory and free it again.

    The warming matters on these VMs: memory left free for a few seconds goes back to the host
    and touching it again is slow, which would be charged to whichever phase came first.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    os.sync()
    if drop:
        with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    if warm_bytes:
        touched = np.ones(warm_bytes, np.uint8)
        del touched


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Runs ``fn`` and returns (wall seconds, its result)."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


# ---------------------------------------------------------------------------- state, checks


def meshes() -> tuple[Mesh, Mesh]:
    """The save mesh (4, 2) ('data', 'model') and the other mesh (8,) ('x',)."""
    devices = np.array(jax.devices())
    assert devices.size == 8, f"need 8 devices, got {devices.size}: was jax imported earlier?"
    return Mesh(devices.reshape(4, 2), ("data", "model")), Mesh(devices, ("x",))


def make_state(tiny: bool, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, jax.Array]]:
    """The numpy source and the sharded jax state built from it with make_array_from_callback."""
    save_mesh, _ = meshes()
    rng = np.random.default_rng(seed)
    source, state = {}, {}
    for name, (shape, spec) in LEAVES.items():
        shape = tuple(d // TINY_DIV for d in shape) if tiny else shape
        source[name] = rng.standard_normal(shape, dtype=np.float32)
        state[name] = jax.make_array_from_callback(
            shape, NamedSharding(save_mesh, spec), lambda idx, x=source[name]: x[idx])
    return source, state


def targets(source: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """Abstract targets: the saved sharding, and P('x') on the (8,) mesh for every leaf."""
    save_mesh, other_mesh = meshes()
    same = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                    sharding=NamedSharding(save_mesh, LEAVES[k][1]))
            for k, v in source.items()}
    other = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(other_mesh, P("x")))
             for k, v in source.items()}
    return same, other


def check(restored: dict, source: dict[str, np.ndarray], target: dict, what: str) -> int:
    """Asserts every leaf is bit-exact with the source and has the target's sharding; returns
    the number of leaves checked."""
    assert set(restored) == set(source), what
    for k, x in source.items():
        r = restored[k]
        assert isinstance(r, jax.Array), (what, k, type(r))
        assert r.sharding.is_equivalent_to(target[k].sharding, x.ndim), (what, k, r.sharding)
        got = np.asarray(r)
        assert got.dtype == x.dtype and got.shape == x.shape, (what, k)
        assert np.array_equal(got.view(np.uint32), x.view(np.uint32)), f"{what}: {k} differs"
    return len(source)


# ---------------------------------------------------------------------------------- systems


def bench_casstore(root: pathlib.Path, state: dict, source: dict, same: dict, other: dict,
                   warm: int, drop: bool) -> dict:
    """casstore: save step 1, restore it onto the same sharding and onto the other mesh."""
    out: dict[str, Any] = {}
    settle(warm, False)
    out["save_s"], _ = timed(lambda: casstore.save(root, 1, state))
    settle(warm, drop)
    out["restore_same_s"], r = timed(
        lambda: jax.block_until_ready(casstore.restore(root, 1, target=same)))
    out["checked_same"] = check(r, source, same, "casstore same mesh")
    del r
    settle(warm, drop)
    with PeakRss() as rss:
        out["restore_other_s"], r = timed(
            lambda: jax.block_until_ready(casstore.restore(root, 1, target=other)))
    out["restore_other_rss_extra_bytes"] = rss.extra
    out["checked_other"] = check(r, source, other, "casstore other mesh")
    del r
    out.update(single_shard_bytes(root, state[SINGLE_LEAF]))
    return out


def single_shard_bytes(root: pathlib.Path, saved: jax.Array) -> dict:
    """Bytes read from the store for the region of one device (the first) under the saved
    sharding of leaf SINGLE_LEAF, versus the whole leaf; also checks the single region."""
    store = CountingStore(LocalStore(root))
    manifest = casstore.read_manifest(store, 1)
    leaf = next(i for i, e in enumerate(manifest.leaves) if e.path == SINGLE_LEAF)
    shape = manifest.leaves[leaf].shape
    index = saved.sharding.devices_indices_map(saved.shape)[jax.devices()[0]]
    bounds = [s.indices(d)[:2] for s, d in zip(index, shape)]
    region = (tuple(a for a, _ in bounds), tuple(b for _, b in bounds))
    whole = ((0,) * len(shape), tuple(shape))
    out = {}
    for name, r in (("single", region), ("whole", whole)):
        store.reset()
        got = read_regions(store, manifest, {leaf: [r]}, max_workers=4)[leaf][r]
        out[f"{name}_bytes_read"] = store.bytes_read
        out[f"{name}_chunks_read"] = store.counts["get"]
        out[f"{name}_raw_bytes"] = got.nbytes
        expect = np.asarray(saved)[tuple(slice(a, b) for a, b in zip(*r))]
        assert np.array_equal(got.view(np.uint32), expect.view(np.uint32)), name
    out["single_region"] = [list(region[0]), list(region[1])]
    out["single_over_whole"] = out["single_bytes_read"] / out["whole_bytes_read"]
    return out


def bench_orbax(root: pathlib.Path, state: dict, source: dict, same: dict, other: dict,
                warm: int, drop: bool) -> dict:
    """orbax StandardCheckpointer: save, restore onto the same sharding and the other mesh."""
    import orbax.checkpoint as ocp

    out: dict[str, Any] = {}
    path = root.absolute() / "1"
    with ocp.StandardCheckpointer() as ckptr:
        def save() -> None:
            ckptr.save(path, state)
            ckptr.wait_until_finished()

        settle(warm, False)
        out["save_s"], _ = timed(save)
        settle(warm, drop)
        out["restore_same_s"], r = timed(
            lambda: jax.block_until_ready(ckptr.restore(path, same)))
        out["checked_same"] = check(r, source, same, "orbax same mesh")
        del r
        settle(warm, drop)
        with PeakRss() as rss:
            out["restore_other_s"], r = timed(
                lambda: jax.block_until_ready(ckptr.restore(path, other)))
        out["restore_other_rss_extra_bytes"] = rss.extra
        out["checked_other"] = check(r, source, other, "orbax other mesh")
        del r
    return out


# ------------------------------------------------------------------------------------- run


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(base_dir: str | None, repeat: int, tiny: bool, drop: bool) -> dict:
    """Runs both systems ``repeat`` times (order alternating) and returns every figure, with
    medians under ``figures``."""
    source, state = make_state(tiny)
    same, other = targets(source)
    state_bytes = sum(x.nbytes for x in source.values())
    warm = 0 if tiny else 2 * state_bytes
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    benches = {"casstore": bench_casstore, "orbax": bench_orbax}
    load_before = _load()
    for rep in range(repeat):
        order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
        for system in order:
            root = pathlib.Path(tempfile.mkdtemp(prefix=f"sharded-{system}-", dir=base_dir))
            try:
                res = benches[system](root, state, source, same, other, warm, drop)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            res["load_after_run"] = _load()
            runs[system].append(res)
    figures = {s: {k: statistics.median(r[k] for r in runs[s])
                   for k in runs[s][0] if isinstance(runs[s][0][k], int | float)}
               for s in SYSTEMS}
    checks_passed = all(r["checked_same"] == r["checked_other"] == len(LEAVES)
                        for s in SYSTEMS for r in runs[s])
    return {
        "date": datetime.date.today().isoformat(),
        "tiny": tiny, "repeat": repeat, "drop_caches": drop,
        "state_bytes": state_bytes,
        "leaves": {k: {"shape": list(v.shape), "spec": str(LEAVES[k][1])}
                   for k, v in source.items()},
        "load_before": load_before, "load_after": _load(),
        "versions": {p: importlib.metadata.version(p)
                     for p in ("casstore", "jax", "orbax-checkpoint", "numpy")},
        "figures": figures, "runs": runs, "checks_passed": checks_passed,
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def table(result: dict) -> str:
    """The markdown table of the medians."""
    c, o = result["figures"]["casstore"], result["figures"]["orbax"]
    lines = ["| figure | casstore | orbax | casstore / orbax |", "|---|---:|---:|---:|"]
    for key, label in TIMED:
        lines.append(f"| {label} | {c[key]:.3f} | {o[key]:.3f} | {c[key] / o[key]:.3f} |")
    lines.append(f"| peak extra RSS, restore onto other mesh | "
                 f"{_mb(c['restore_other_rss_extra_bytes'])} | "
                 f"{_mb(o['restore_other_rss_extra_bytes'])} | "
                 f"{c['restore_other_rss_extra_bytes'] / o['restore_other_rss_extra_bytes']:.3f} |")
    lines += ["", "| casstore bytes read, leaf `a` | stored bytes | chunks | raw bytes |",
              "|---|---:|---:|---:|"]
    for name in ("single", "whole"):
        lines.append(f"| {name} {'shard (1 of 8 devices)' if name == 'single' else 'array'} | "
                     f"{_mb(c[f'{name}_bytes_read'])} | {c[f'{name}_chunks_read']:.0f} | "
                     f"{_mb(c[f'{name}_raw_bytes'])} |")
    lines.append(f"| single / whole | {c['single_over_whole']:.4f} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", help="parent of the scratch directories (default: system temp)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per system; medians reported")
    ap.add_argument("--tiny", action="store_true", help=f"arrays {TINY_DIV}x smaller per axis")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache before each restore (needs root)")
    ap.add_argument("--json", help="write every figure to this file")
    args = ap.parse_args(argv)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    result = run(args.dir, args.repeat, args.tiny, args.drop_caches)
    print(f"state: {result['state_bytes'] / 1e9:.3f} GB in {len(LEAVES)} leaves on "
          f"{jax.device_count()} devices; load {result['load_before']} -> "
          f"{result['load_after']}; checks passed: {result['checks_passed']}")
    print(table(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["checks_passed"] else 1)
