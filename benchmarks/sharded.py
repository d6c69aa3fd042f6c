"""casstore vs orbax-checkpoint on a sharded state: save, restore onto the same and another mesh.

README.md's ``sharded.py`` section describes every figure."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import functools
import pathlib
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import casstore
from casstore._restore import read_regions
from casstore.store import CountingStore, LocalStore

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h

LEAVES = {"a": ((8192, 8192), P("data", "model")), "b": ((8192, 8192), P("data", "model")),
          "rows": ((16384, 4096), P("data", None)), "cols": ((4096, 16384), P(None, "model")),
          "rep": ((4096, 4096), P())}  # name -> (shape, spec on the save mesh)
TINY_DIV, SYSTEMS = 64, ("casstore", "orbax")
PEERS = {"casstore": lambda root: h.peers.Casstore(root / "repo"), "orbax": h.peers.Orbax}
TIMED = [("save_s", "save", "s"), ("restore_same_s", "restore, same mesh", "s"),
         ("restore_other_s", "restore, other mesh (8,) P('x')", "s"),
         ("restore_other_rss_extra_bytes", "peak extra RSS, restore onto other mesh", "B")]


def state_and_targets(tiny: bool) -> tuple[dict, dict, dict, dict]:
    """The numpy source, the sharded state made from it, and the two abstract targets."""
    devices = np.array(jax.devices())
    h.check(devices.size == 8, f"need 8 devices, got {devices.size}: was jax imported earlier?")
    save_mesh, other_mesh = Mesh(devices.reshape(4, 2), ("data", "model")), Mesh(devices, ("x",))
    rng, source, state, same, other = np.random.default_rng(0), {}, {}, {}, {}
    for name, (shape, spec) in LEAVES.items():
        shape = tuple(d // TINY_DIV for d in shape) if tiny else shape
        source[name] = x = rng.standard_normal(shape, dtype=np.float32)
        saved = NamedSharding(save_mesh, spec)
        state[name] = jax.make_array_from_callback(shape, saved, lambda idx, x=x: x[idx])
        same[name] = jax.ShapeDtypeStruct(shape, x.dtype, sharding=saved)
        other[name] = jax.ShapeDtypeStruct(shape, x.dtype,
                                           sharding=NamedSharding(other_mesh, P("x")))
    return source, state, same, other


def single_shard_bytes(root: pathlib.Path, saved: jax.Array) -> dict:
    """Bytes and chunks read for device 0's region of leaf ``a`` and for all of it, checked."""
    store = CountingStore(LocalStore(root))
    manifest = casstore.read_manifest(store, 1)
    leaf = next(i for i, e in enumerate(manifest.leaves) if e.path == "a")
    shape = manifest.leaves[leaf].shape
    index = saved.sharding.devices_indices_map(saved.shape)[jax.devices()[0]]
    bounds = [s.indices(d)[:2] for s, d in zip(index, shape)]
    out = {}
    for name, r in (("single", (tuple(a for a, _ in bounds), tuple(b for _, b in bounds))),
                    ("whole", ((0,) * len(shape), tuple(shape)))):
        store.reset()
        got = read_regions(store, manifest, {leaf: [r]}, max_workers=4)[leaf][r]
        out.update({f"{name}_bytes_read": store.bytes_read, f"{name}_raw_bytes": got.nbytes,
                    f"{name}_chunks_read": store.counts["get"]})
        expect = np.asarray(saved)[tuple(slice(a, b) for a, b in zip(*r))]
        h.check(np.array_equal(got.view(np.uint32), expect.view(np.uint32)), name)
    out["single_over_whole"] = out["single_bytes_read"] / out["whole_bytes_read"]
    return out


def bench(system: str, root: pathlib.Path, made: tuple, warm: int, drop: bool) -> dict:
    """Saves step 1 and restores it onto both meshes, checked bit-exact and for sharding."""
    source, state, same, other = made
    out: dict = {}
    phase = functools.partial(h.phase, out, warm=warm)
    with PEERS[system](root) as peer:
        phase("save_s", lambda: peer.save(1, state))
        out["stored_bytes"] = peer.stored_bytes()
        for where, target in (("same", same), ("other", other)):
            r = phase(f"restore_{where}_s", lambda t=target: peer.restore(1, t), drop=drop,
                      rss="restore_other_rss_extra_bytes" if where == "other" else None)
            for k, x in source.items():
                h.check(r[k].sharding.is_equivalent_to(target[k].sharding, x.ndim), (where, k))
            out[f"checked_{where}"] = h.verify_equal(source, r, f"{system} {where} mesh", True)
            del r
    if system == "casstore":
        out.update(single_shard_bytes(root / "repo", state["a"]))
    return out


def run(args) -> dict:
    """Both systems ``args.repeat`` times (rotating), the limit once per repeat."""
    made = state_and_targets(args.tiny)
    state_bytes = h.state_bytes(made[0])

    warm = 0 if args.tiny else 2 * state_bytes
    runs, figures, lim = h.limit.interleaved(args, state_bytes, SYSTEMS, lambda system, root: bench(
        system, root, made, warm, args.drop_caches))
    stored = figures["casstore"]["stored_bytes"]
    restore = h.limit.restore_s(lim, state_bytes, stored, cold=args.drop_caches and
                                lim["read_cold"])
    return {"tiny": args.tiny, "repeat": args.repeat, "drop_caches": args.drop_caches,
            "state_bytes": state_bytes, "figures": figures, "runs": runs, "limit": lim,
            "leaves": {k: {"shape": list(v.shape), "spec": str(LEAVES[k][1])}
                       for k, v in made[0].items()},
            "limits": {"save_s": h.limit.save_s(lim, state_bytes, stored),
                       "restore_same_s": restore, "restore_other_s": restore},
            "checks_passed": all(r["checked_same"] == r["checked_other"] == len(LEAVES)
                                 for rs in runs.values() for r in rs)}


def table(result: dict) -> list[str]:
    """The medians with casstore / orbax ratios and the limit, then casstore's bytes read."""
    c = result["figures"]["casstore"]
    rows = [[f"{name} {'shard (1 of 8 devices)' if name == 'single' else 'array'}",
             h.fmt(c[f"{name}_bytes_read"], "B"), h.fmt(c[f"{name}_chunks_read"], "n"),
             h.fmt(c[f"{name}_raw_bytes"], "B")] for name in ("single", "whole")]
    return [
        f"state: {result['state_bytes'] / 1e9:.3f} GB in {len(LEAVES)} leaves on "
        f"{jax.device_count()} devices; checks passed: {result['checks_passed']}", "",
        *h.figure_table(result["figures"], TIMED, list(SYSTEMS), "orbax", result["limits"]),
        *h.limit_lines(result["limit"]), "",
        *h.md_table(["casstore bytes read, leaf `a`", "stored bytes", "chunks", "raw bytes"],
                    [*rows, ["single / whole", f"{c['single_over_whole']:.4f}", "", ""]])]


main = h.command(__doc__, run, table, "dir", "repeat", "tiny", "drop-caches", "plot",
                 plot_of=("casstore", "orbax", "figures"))

if __name__ == "__main__":
    sys.exit(0 if main()["checks_passed"] else 1)
