"""casstore vs orbax-checkpoint vs safetensors: save and restore a GPT-2-small train state.

Every system (``harness.peers``: casstore, casstore-bytes with ``compression="bytes"``,
casstore-raw with ``shuffle=False``, orbax,
safetensors) saves ``harness.train_state`` (1.49 GB; ``--size gpt2-xl``: 18.7 GB made on the
device) to local disk, then a state with the last 2 blocks new, then the unchanged state (the
same array objects, then copies of them), and restores it, checked bit-exact (AssertionError
otherwise); each figure beside its ratio to orbax's and, for saves and the restore, its
fraction of the machine's limit measured in the same
run (``harness.limit``). README.md's ``save_restore.py`` section describes every figure.

Usage::

    python benchmarks/save_restore.py [--dir DIR] [--repeat N] [--drop-caches] [--tiny]
                                      [--size gpt2|gpt2-xl|small|tiny] [--device default|cpu]
                                      [--systems casstore,orbax,safetensors] [--no-warm]
                                      [--json PATH] [--plot PNG]
"""

from __future__ import annotations

import functools
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h

SYSTEMS = ("casstore", "casstore-bytes", "casstore-raw", "orbax", "safetensors")
PEERS = {"casstore": lambda root: h.peers.Casstore(root / "repo"),
         "casstore-bytes": lambda root: h.peers.Casstore(root / "repo", compression="bytes"),
         "casstore-raw": lambda root: h.peers.Casstore(root / "repo", shuffle=False),
         "orbax": h.peers.Orbax, "safetensors": h.peers.Safetensors}
MAX_WARM_BYTES = 8 << 30  # warm at most this much memory before a phase (gpt2-xl: 3x = 56 GB)
FIGURES = [  # (key, label, unit): seconds "s", bytes "B", multiples "x"
    ("first_save_s", "1. first save", "s"),
    ("first_save_cpu_s", "1. ... CPU time, user + system", "s"),
    ("first_save_disk_bytes", "1. first save: bytes on disk", "B"),
    ("changed_save_s", "2. save, last 2 blocks + ln_f + count changed", "s"),
    ("changed_save_written_bytes", "2. ... bytes written", "B"),
    ("changed_save_vs_changed_zstd", "2. ... written / changed leaves' zstd-1 bytes", "x"),
    ("unchanged_save_s", "3. save of the unchanged state", "s"),
    ("unchanged_save_written_bytes", "3. ... bytes written", "B"),
    ("same_values_save_s", "3b. save of the same values in new arrays (casstore)", "s"),
    ("restore_s", "4. restore", "s"),
    ("restore_cpu_s", "4. ... CPU time, user + system", "s"),
    ("repo_bytes", "bytes on disk after the 3 saves", "B"),
    ("save_rss_extra_bytes", "5. peak extra RSS, first save", "B"),
    ("restore_rss_extra_bytes", "5. peak extra RSS, restore", "B"),
]
FIGURE_KEYS = [key for key, _, _ in FIGURES]


def bench(system: str, root: pathlib.Path, source: list, dev: jax.Device, abstract: object,
          drop: bool, warm: int) -> dict:
    """Runs the four phases of ``system`` in ``root``; returns its figures."""
    out: dict = {}
    phase = functools.partial(h.phase, out, warm=warm, drop=drop)
    with PEERS[system](root) as peer:
        states = peer.prepare(source if not peer.gives_jax else h.to_jax(source, dev))
        phase("first_save_s", lambda: peer.save(1, states[0]), rss="save_rss_extra_bytes")
        out["first_save_disk_bytes"] = peer.stored_bytes()
        out["first_save_written_bytes"] = peer.saved(1)["written_bytes"]
        for name, step in (("changed_save", 2), ("unchanged_save", 3)):
            phase(f"{name}_s", lambda s=step: peer.save(s, states[1]))
            out.update({f"{name}_{k}": v for k, v in peer.saved(step).items()})
        out["repo_bytes"] = peer.stored_bytes()
        if peer.dedups:  # the others rewrite everything, as in phase 3 (and gpt2-xl's 4th
            fresh = jax.tree.map(lambda x: x.copy(), states[1])  # orbax step fills 64 GiB)
            phase("same_values_save_s", lambda f=fresh: peer.save(4, f))
            del fresh
        restored = phase("restore_s", lambda: peer.restore(3, abstract),
                         rss="restore_rss_extra_bytes")
        out["verified_leaves"] = h.verify_equal(
            source[1], restored if peer.flat else h.flatten(restored), system, peer.gives_jax)
    return out


def run(args) -> dict:
    """Runs every system ``args.repeat`` times (rotating), each repeat after measuring the
    machine's limit; returns medians, all runs and the limit. Raises AssertionError if a
    restore was not bit-exact."""
    result = {"environment": h.environment("orbax-checkpoint", "safetensors", "zstandard",
                                           "xxhash", "tensorstore")}
    dev, size = h.device(args.device), "tiny" if args.tiny else args.size
    (t, source) = h.seconds(lambda: [h.train_state(size, device=dev)])
    source.append(jax.block_until_ready(h.changed_state(source[0])))
    logical = h.state_bytes(source[0])
    n_changed, changed_raw, changed_zstd = h.changed_zstd_bytes(*source)
    warm = 0 if args.no_warm else min(3 * logical, MAX_WARM_BYTES)
    limits = []

    def one(system: str) -> dict:
        if system == args.systems[0]:
            with h.scratch(args.dir, "limit") as root:
                limits.append(h.limit.measure(root, min(logical, 256 << 20),
                                              drop=args.drop_caches))
        with h.scratch(args.dir, system) as root:
            figures = bench(system, root, source, dev, h.abstract_of(source[1], dev),
                            args.drop_caches, warm)
        figures["changed_save_vs_changed_zstd"] = (figures["changed_save_written_bytes"]
                                                   / changed_zstd)
        return figures

    runs, res = h.interleave(args.systems, args.repeat, one)
    result.update(size=size, shape=h.SIZES[size], changed_blocks=h.CHANGED_BLOCKS,
                  device=str(dev), logical_bytes=logical, leaves=len(jax.tree.leaves(source[0])),
                  changed_leaves=n_changed, changed_raw_bytes=changed_raw,
                  changed_zstd_bytes=changed_zstd, generate_s=t, repeat=args.repeat,
                  drop_caches_requested=args.drop_caches, warmed_bytes=warm,
                  dropped_caches=all(r["dropped_caches"] for rs in runs.values() for r in rs),
                  results=res, runs=runs, limit=h.limit.medians(limits))
    result["limits"] = limit_seconds(result)
    return result


def limit_seconds(result: dict) -> dict[str, float]:
    """The machine's limit (seconds) of the first and the changed save (of the changed leaves)
    and of the restore, for the bytes casstore stores (casstore-bytes' or casstore-raw's where
    casstore did not run; the limit's sample's encoded fraction where none did)."""
    lim, res, raw = result["limit"], result["results"], result["logical_bytes"]
    ours = res.get("casstore") or res.get("casstore-bytes") or res.get("casstore-raw") or {}
    raw_of = {"first_save": raw, "changed_save": result["changed_raw_bytes"]}
    out = {f"{k}_s": h.limit.save_s(lim, r, ours.get(f"{k}_written_bytes",
                                                     r * lim["encoded_fraction"]))
           for k, r in raw_of.items()}
    out["restore_s"] = h.limit.restore_s(lim, raw, ours.get("first_save_written_bytes", raw),
                                         cold=result["dropped_caches"] and lim["read_cold"])
    return out


TARGETS = [  # (description, casstore's figure from the medians, limit)
    ("changed save writes <= 1.1x the changed leaves' zstd-1 bytes",
     lambda r: r["casstore"]["changed_save_vs_changed_zstd"], 1.1),
    ("unchanged save takes <= 0.05x orbax's time",
     lambda r: h.ratio(r["casstore"]["unchanged_save_s"], r["orbax"]["unchanged_save_s"]), 0.05),
    ("unchanged save writes < 1 MB", lambda r: r["casstore"]["unchanged_save_written_bytes"]
     / 1e6, 1.0),
    ("first save takes <= 0.8x orbax's time",
     lambda r: h.ratio(r["casstore"]["first_save_s"], r["orbax"]["first_save_s"]), 0.8),
    ("restore takes <= 0.8x orbax's time",
     lambda r: h.ratio(r["casstore"]["restore_s"], r["orbax"]["restore_s"]), 0.8),
    ("first save stores <= 0.9x orbax's bytes", lambda r: h.ratio(
        r["casstore"]["first_save_disk_bytes"], r["orbax"]["first_save_disk_bytes"]), 0.9),
]


def table(result: dict) -> str:
    """The medians as a markdown table with ratios to orbax and fractions of the limit, the
    limit's rates, then notes and targets."""
    res = result["results"]
    lines = h.figure_table(res, FIGURES, [s for s in SYSTEMS if s in res], "orbax",
                           result["limits"]) + h.limit_lines(result["limit"])
    lines += ["", f"- state: {result['logical_bytes'] / 1e6:.1f} MB in {result['leaves']} "
              f"leaves ({result['size']}, on {result['device']}); the second save changes "
              f"{result['changed_leaves']} leaves, {result['changed_raw_bytes'] / 1e6:.1f} MB "
              f"raw, {result['changed_zstd_bytes'] / 1e6:.1f} MB zstd level 1"]
    if "casstore" in res:
        c = res["casstore"]
        lines.append(f"- casstore first save wrote {c['first_save_written_bytes'] / 1e6:.1f} MB; "
                     f"changed save: {c['changed_save_new_chunks']:.0f} new chunks, "
                     f"{c['changed_save_reused_chunks']:.0f} reused; unchanged save: "
                     f"{c['unchanged_save_new_chunks']:.0f} new chunks")
    if {"casstore", "orbax"} <= set(res):
        lines += h.target_lines([(text, fig(res), lim) for text, fig, lim in TARGETS])
    lines.append(f"- median of {result['repeat']} run(s); restores verified bit-exact; page "
                 f"cache dropped before each phase: {'yes' if result['dropped_caches'] else 'no'}"
                 f"; memory warmed: {'yes' if result['warmed_bytes'] else 'no'}; "
                 f"{h.machine_note(result)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = h.parser(__doc__, "dir", "repeat", "tiny", "drop-caches", "no-warm", "device", "plot",
                  tiny="same as --size tiny (3 blocks of width 64)")
    ap.add_argument("--size", choices=tuple(h.SIZES), default="gpt2",
                    help="gpt2 (1.49 GB), gpt2-xl (18.7 GB, made on the device), small "
                         "(0.27 GB) or tiny (2.6 MB)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="a subset of " + ",".join(SYSTEMS))
    args = h.parse(ap, argv)
    args.systems = tuple(s for s in SYSTEMS if s in args.systems.split(","))
    if not args.systems:
        ap.error("need at least one known system")
    return h.report(run(args), table, args, ("casstore", "orbax"))


if __name__ == "__main__":
    main()
