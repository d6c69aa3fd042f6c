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

import pathlib  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import casstore  # noqa: E402
from casstore._restore import read_regions  # noqa: E402
from casstore.store import CountingStore, LocalStore  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h  # noqa: E402

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
    h.settle(warm)
    out["save_s"], _ = h.seconds(lambda: casstore.save(root, 1, state))
    h.settle(warm, drop)
    out["restore_same_s"], r = h.seconds(
        lambda: jax.block_until_ready(casstore.restore(root, 1, target=same)))
    out["checked_same"] = check(r, source, same, "casstore same mesh")
    del r
    h.settle(warm, drop)
    with h.PeakRss() as rss:
        out["restore_other_s"], r = h.seconds(
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

        h.settle(warm)
        out["save_s"], _ = h.seconds(save)
        h.settle(warm, drop)
        out["restore_same_s"], r = h.seconds(
            lambda: jax.block_until_ready(ckptr.restore(path, same)))
        out["checked_same"] = check(r, source, same, "orbax same mesh")
        del r
        h.settle(warm, drop)
        with h.PeakRss() as rss:
            out["restore_other_s"], r = h.seconds(
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
        for system in h.rotated(SYSTEMS, rep):
            with h.scratch(base_dir, f"sharded-{system}") as root:
                res = benches[system](root, state, source, same, other, warm, drop)
            res["load_after_run"] = _load()
            runs[system].append(res)
    figures = {s: h.medians(runs[s]) for s in SYSTEMS}
    checks_passed = all(r["checked_same"] == r["checked_other"] == len(LEAVES)
                        for s in SYSTEMS for r in runs[s])
    env = h.environment("orbax-checkpoint")
    return {
        "date": env["date"], "environment": env, "versions": env["versions"],
        "tiny": tiny, "repeat": repeat, "drop_caches": drop,
        "state_bytes": state_bytes,
        "leaves": {k: {"shape": list(v.shape), "spec": str(LEAVES[k][1])}
                   for k, v in source.items()},
        "load_before": load_before, "load_after": _load(),
        "figures": figures, "runs": runs, "checks_passed": checks_passed,
    }


def table(result: dict) -> str:
    """The markdown table of the medians."""
    c, o = result["figures"]["casstore"], result["figures"]["orbax"]
    rss = "restore_other_rss_extra_bytes"
    rows = [[label, h.fmt(c[key], "s"), h.fmt(o[key], "s"), h.fmt(h.ratio(c[key], o[key]), "x")]
            for key, label in TIMED]
    rows.append(["peak extra RSS, restore onto other mesh", h.fmt(c[rss], "B"),
                 h.fmt(o[rss], "B"), h.fmt(h.ratio(c[rss], o[rss]), "x")])
    lines = h.md_table(["figure", "casstore", "orbax", "casstore / orbax"], rows) + [""]
    rows = [[f"{name} {'shard (1 of 8 devices)' if name == 'single' else 'array'}",
             h.fmt(c[f"{name}_bytes_read"], "B"), h.fmt(c[f"{name}_chunks_read"], "n"),
             h.fmt(c[f"{name}_raw_bytes"], "B")] for name in ("single", "whole")]
    rows.append(["single / whole", f"{c['single_over_whole']:.4f}", "", ""])
    lines += h.md_table(["casstore bytes read, leaf `a`", "stored bytes", "chunks", "raw bytes"],
                        rows)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = h.parser(__doc__, "dir", "repeat", "tiny", "drop-caches", "json",
                  tiny=f"arrays {TINY_DIV}x smaller per axis",
                  drop_caches="drop the page cache before each restore (needs root)")
    args = h.parse(ap, argv)
    result = run(args.dir, args.repeat, args.tiny, args.drop_caches)
    print(f"state: {result['state_bytes'] / 1e9:.3f} GB in {len(LEAVES)} leaves on "
          f"{jax.device_count()} devices; load {result['load_before']} -> "
          f"{result['load_after']}; checks passed: {result['checks_passed']}")
    return h.report(result, table(result), args.json)


if __name__ == "__main__":
    sys.exit(0 if main()["checks_passed"] else 1)
