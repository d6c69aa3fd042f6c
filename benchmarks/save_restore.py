"""casstore vs orbax-checkpoint vs safetensors: save and restore a GPT-2-small train state.

README.md's ``save_restore.py`` section describes every figure."""

import functools
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h

PEERS = {"casstore": lambda root: h.peers.Casstore(root / "repo"),
         "casstore-bytes": lambda root: h.peers.Casstore(root / "repo", compression="bytes"),
         "casstore-raw": lambda root: h.peers.Casstore(root / "repo", shuffle=False),
         "orbax": h.peers.Orbax, "safetensors": h.peers.Safetensors}
SYSTEMS = tuple(PEERS)
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
TARGETS = [  # (text, key, scale: casstore's figure / scale, or None: casstore / orbax; limit)
    ("changed save writes <= 1.1x the changed leaves' zstd-1 bytes",
     "changed_save_vs_changed_zstd", 1, 1.1),
    ("unchanged save takes <= 0.05x orbax's time", "unchanged_save_s", None, 0.05),
    ("unchanged save writes < 1 MB", "unchanged_save_written_bytes", 1e6, 1.0),
    ("first save takes <= 0.8x orbax's time", "first_save_s", None, 0.8),
    ("restore takes <= 0.8x orbax's time", "restore_s", None, 0.8),
    ("first save stores <= 0.9x orbax's bytes", "first_save_disk_bytes", None, 0.9)]


def bench(system: str, root: pathlib.Path, source: list, dev: jax.Device, args, warm: int,
          changed_zstd: int) -> dict:
    """``system``'s figures: the saves of steps 1-3 (4: copies), the restore of step 3."""
    out: dict = {}
    phase = functools.partial(h.phase, out, warm=warm, drop=args.drop_caches)
    with PEERS[system](root) as peer:
        states = peer.prepare(source if not peer.gives_jax else h.to_jax(source, dev))
        phase("first_save_s", lambda: peer.save(1, states[0]), rss="save_rss_extra_bytes")
        out["first_save_disk_bytes"] = peer.stored_bytes()
        out["first_save_written_bytes"] = peer.saved(1)["written_bytes"]
        h.peers.save_steps(peer, states, phase, out)
        out["repo_bytes"] = peer.stored_bytes()
        if peer.dedups:  # the others rewrite everything, as in step 3 (and a 4th orbax step
            fresh = jax.tree.map(lambda x: x.copy(), states[1])  # of gpt2-xl fills 64 GiB)
            phase("same_values_save_s", lambda: peer.save(4, fresh))
            del fresh
        restored = phase("restore_s", lambda: peer.restore(3, h.abstract_of(source[1], dev)),
                         rss="restore_rss_extra_bytes")
        out["verified_leaves"] = h.verify_equal(source[1], restored, system, peer.gives_jax)
    out["changed_save_vs_changed_zstd"] = out["changed_save_written_bytes"] / changed_zstd
    return out


def run(args) -> dict:
    """Every system ``args.repeat`` times (rotating), the limit once per repeat."""
    dev = h.device(args.device)
    source, result = h.two_states("tiny" if args.tiny else args.size, dev)
    logical = result["logical_bytes"]
    warm = 0 if args.no_warm else min(3 * logical, 8 << 30)  # gpt2-xl: 3x is 56 GB

    runs, res, lim = h.limit.interleaved(args, logical, args.systems, lambda system, root: bench(
        system, root, source, dev, args, warm, result["changed_zstd_bytes"]))
    dropped = all(r["dropped_caches"] for rs in runs.values() for r in rs)
    ours = next((res[s] for s in SYSTEMS[:3] if s in res), {})  # the bytes casstore stores
    stored = lambda k, raw: ours.get(f"{k}_written_bytes", raw * lim["encoded_fraction"])  # noqa
    limits = {f"{k}_s": h.limit.save_s(lim, r, stored(k, r))
              for k, r in (("first_save", logical), ("changed_save", result["changed_raw_bytes"]))}
    limits["restore_s"] = h.limit.restore_s(lim, logical, ours.get("first_save_written_bytes",
                                            logical), cold=dropped and lim["read_cold"])
    return {**result, "device": str(dev), "repeat": args.repeat, "warmed_bytes": warm,
            "dropped_caches": dropped, "results": res, "runs": runs, "limit": lim,
            "limits": limits}


def table(result: dict) -> list[str]:
    """The medians with ratios to orbax and fractions of the limit, the limit, notes, targets."""
    res = result["results"]
    lines = [*h.figure_table(res, FIGURES, [s for s in SYSTEMS if s in res], "orbax",
                             result["limits"]), *h.limit_lines(result["limit"]), "",
             f"- state: {result['logical_bytes'] / 1e6:.1f} MB in {result['leaves']} leaves "
             f"({result['size']}, on {result['device']}); the second save changes "
             f"{result['changed_leaves']} leaves, {result['changed_raw_bytes'] / 1e6:.1f} MB "
             f"raw, {result['changed_zstd_bytes'] / 1e6:.1f} MB zstd level 1"]
    if "casstore" in res:
        c = res["casstore"]
        lines.append(f"- casstore first save wrote {c['first_save_written_bytes'] / 1e6:.1f} MB; "
                     f"changed save: {c['changed_save_new_chunks']:.0f} new chunks, "
                     f"{c['changed_save_reused_chunks']:.0f} reused; unchanged save: "
                     f"{c['unchanged_save_new_chunks']:.0f} new chunks")
    if {"casstore", "orbax"} <= set(res):
        c, vs = res["casstore"], lambda k: h.ratio(res["casstore"][k], res["orbax"][k])
        lines += h.target_lines([(text, c[key] / scale if scale else vs(key), limit)
                                 for text, key, scale, limit in TARGETS])
    return [*lines, f"- median of {result['repeat']} run(s); restores verified bit-exact; page "
            f"cache dropped before each phase: {h.yes(result['dropped_caches'])}; memory "
            f"warmed: {h.yes(result['warmed_bytes'])}"]


main = h.command(__doc__, run, table, "dir", "repeat", "tiny", "drop-caches", "no-warm",
                 "device", "plot", plot_of=("casstore", "orbax", "results"), extra=(
                     ("--size", {"choices": tuple(h.SIZES), "default": "gpt2"}),
                     ("--systems", {"type": h.subset(SYSTEMS), "default": ",".join(SYSTEMS)})))

if __name__ == "__main__":
    main()
