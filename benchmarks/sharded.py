"""casstore vs orbax-checkpoint on a sharded state: save, restore onto the same and another mesh.

1.14 GB of float32 in 5 leaves sharded over 8 CPU devices (``XLA_FLAGS``, set before jax is
imported) on ``Mesh((4, 2), ('data', 'model'))``, saved to local disk by both systems
(``harness.peers``) and restored onto the same sharding and onto ``Mesh((8,), ('x',))`` with
``P('x')``, checked bit-exact and for their sharding (AssertionError otherwise); saves and
restores also as fractions of the machine's limit (``harness.limit``). casstore only: the bytes
read for one device's region of ``a`` vs all of ``a`` (``casstore._restore.read_regions``) and
the peak extra RSS of the restore onto the other mesh. README.md's ``sharded.py`` section.

Usage::

    python benchmarks/sharded.py [--dir DIR] [--repeat N] [--drop-caches] [--tiny]
                                 [--json PATH] [--plot PNG]
"""

from __future__ import annotations

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
TINY_DIV, SINGLE_LEAF, SYSTEMS = 64, "a", ("casstore", "orbax")
PEERS = {"casstore": lambda root: h.peers.Casstore(root / "repo"), "orbax": h.peers.Orbax}
TIMED = [("save_s", "save", "s"), ("restore_same_s", "restore, same mesh", "s"),
         ("restore_other_s", "restore, other mesh (8,) P('x')", "s"),
         ("restore_other_rss_extra_bytes", "peak extra RSS, restore onto other mesh", "B")]


def state_and_targets(tiny: bool) -> tuple[dict, dict, dict, dict]:
    """The numpy source, the sharded state made from it, and the two abstract targets."""
    devices = np.array(jax.devices())
    assert devices.size == 8, f"need 8 devices, got {devices.size}: was jax imported earlier?"
    save_mesh, other_mesh = Mesh(devices.reshape(4, 2), ("data", "model")), Mesh(devices, ("x",))
    rng, source, state, same, other = np.random.default_rng(0), {}, {}, {}, {}
    for name, (shape, spec) in LEAVES.items():
        shape = tuple(d // TINY_DIV for d in shape) if tiny else shape
        source[name] = x = rng.standard_normal(shape, dtype=np.float32)
        state[name] = jax.make_array_from_callback(shape, NamedSharding(save_mesh, spec),
                                                   lambda idx, x=x: x[idx])
        same[name] = jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(save_mesh, spec))
        other[name] = jax.ShapeDtypeStruct(shape, x.dtype,
                                           sharding=NamedSharding(other_mesh, P("x")))
    return source, state, same, other


def check(restored: dict, source: dict, target: dict, what: str) -> int:
    """Raises AssertionError unless every leaf is bit-exact and has the target's sharding;
    returns the number of leaves checked."""
    for k, x in source.items():
        h.check(restored[k].sharding.is_equivalent_to(target[k].sharding, x.ndim), (what, k))
    return h.verify_equal(source, restored, what, True)


def single_shard_bytes(root: pathlib.Path, saved: jax.Array) -> dict:
    """Bytes and chunks read from the store for the first device's region of SINGLE_LEAF
    under its saved sharding, versus the whole leaf; checks both regions' values."""
    store = CountingStore(LocalStore(root))
    manifest = casstore.read_manifest(store, 1)
    leaf = next(i for i, e in enumerate(manifest.leaves) if e.path == SINGLE_LEAF)
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
    """Saves step 1, restores it onto the same sharding and the other mesh; returns figures."""
    source, state, same, other = made
    out: dict = {}
    phase = functools.partial(h.phase, out, warm=warm)
    with PEERS[system](root) as peer:
        phase("save_s", lambda: peer.save(1, state))
        out["stored_bytes"] = peer.stored_bytes()
        r = phase("restore_same_s", lambda: peer.restore(1, same), drop=drop)
        out["checked_same"] = check(r, source, same, f"{system} same mesh")
        del r
        r = phase("restore_other_s", lambda: peer.restore(1, other), drop=drop,
                  rss="restore_other_rss_extra_bytes")
        out["checked_other"] = check(r, source, other, f"{system} other mesh")
        del r
    if system == "casstore":
        out.update(single_shard_bytes(root / "repo", state[SINGLE_LEAF]))
    return out


def run(args) -> dict:
    """Runs both systems ``args.repeat`` times (rotating), measuring the limit once per
    repeat; returns medians under ``figures`` and every run."""
    result = {"environment": h.environment("orbax-checkpoint")}
    made = state_and_targets(args.tiny)
    state_bytes = h.state_bytes(made[0])
    warm, limits = 0 if args.tiny else 2 * state_bytes, []

    def one(system: str) -> dict:
        if system == SYSTEMS[0]:
            with h.scratch(args.dir, "limit") as root:
                limits.append(h.limit.measure(root, min(state_bytes, 256 << 20),
                                              drop=args.drop_caches))
        with h.scratch(args.dir, f"sharded-{system}") as root:
            return bench(system, root, made, warm, args.drop_caches)

    runs, figures = h.interleave(SYSTEMS, args.repeat, one)
    lim, stored = h.limit.medians(limits), figures["casstore"]["stored_bytes"]
    restore = h.limit.restore_s(lim, state_bytes, stored, cold=args.drop_caches and
                                lim["read_cold"])
    result.update(tiny=args.tiny, repeat=args.repeat, drop_caches=args.drop_caches,
                  state_bytes=state_bytes, figures=figures, runs=runs, limit=lim,
                  leaves={k: {"shape": list(v.shape), "spec": str(LEAVES[k][1])}
                          for k, v in made[0].items()},
                  limits={"save_s": h.limit.save_s(lim, state_bytes, stored),
                          "restore_same_s": restore, "restore_other_s": restore},
                  checks_passed=all(r["checked_same"] == r["checked_other"] == len(LEAVES)
                                    for rs in runs.values() for r in rs))
    return result


def table(result: dict) -> str:
    """The medians with casstore / orbax ratios and the limit, then casstore's bytes read."""
    c = result["figures"]["casstore"]
    lines = [f"state: {result['state_bytes'] / 1e9:.3f} GB in {len(LEAVES)} leaves on "
             f"{jax.device_count()} devices; checks passed: {result['checks_passed']}; "
             f"{h.machine_note(result)}", "",
             *h.figure_table(result["figures"], TIMED, list(SYSTEMS), "orbax", result["limits"]),
             *h.limit_lines(result["limit"]), ""]
    rows = [[f"{name} {'shard (1 of 8 devices)' if name == 'single' else 'array'}",
             h.fmt(c[f"{name}_bytes_read"], "B"), h.fmt(c[f"{name}_chunks_read"], "n"),
             h.fmt(c[f"{name}_raw_bytes"], "B")] for name in ("single", "whole")]
    rows.append(["single / whole", f"{c['single_over_whole']:.4f}", "", ""])
    lines += h.md_table(["casstore bytes read, leaf `a`", "stored bytes", "chunks", "raw bytes"],
                        rows)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = h.parser(__doc__, "dir", "repeat", "tiny", "drop-caches", "plot",
                  tiny=f"arrays {TINY_DIV}x smaller per axis",
                  drop_caches="drop the page cache before each restore (needs root)")
    args = h.parse(ap, argv)
    return h.report(run(args), table, args, ("casstore", "orbax", "figures"))


if __name__ == "__main__":
    sys.exit(0 if main()["checks_passed"] else 1)
