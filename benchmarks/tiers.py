"""Tiered checkpoints (issue 31): persisting, restoring through tiers, copying; as ratios.

README.md's ``tiers.py`` section says what each figure means."""

import functools
import math
import pathlib
import shutil
import sys
import types

import numpy as np

import casstore

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h

STEPS = 10
RCLONE = "rclone"  # the program compared with; the smoke test names a missing one
TARGETS = [  # (ratio key, numerator, denominator: figures of one run; description, limit)
    ("save_blocked", "save_blocked_on_s", "save_blocked_off_s",
     "blocked time per save(), persistence on / off", 1.1),
    ("persist_bytes", "persist_bytes", "persisted_new_chunk_bytes",
     "persist bytes / new-chunk bytes of the persisted steps", 1.02),
    ("restore_lost_local", "restore_lost_local_s", "restore_plain_s",
     "restore after losing the local tier / plain restore from S3", 1.1),
    ("half_gone_remote", "half_gone_remote_bytes", "state_bytes",
     "half the local chunks gone: remote bytes read / state bytes", 0.55),
    ("copy_s3_s3", "copy_s3_s3_s", "rclone_s3_s3_s",
     "casstore.copy / rclone copy --transfers 16, S3 to S3", 1.0),
    ("copy_local_s3", "copy_local_s3_s", "rclone_local_s3_s",
     "casstore.copy / rclone copy --transfers 16, local to S3", 1.0),
    ("copy_same_s3", "copy_same_s3_s", "rclone_same_s3_s",
     "casstore.copy / rclone copy --transfers 16, two buckets of one S3 (server-side)", 1.0),
]


def tiers(root: pathlib.Path, persistent, cfg, out: dict) -> pathlib.Path:
    """Figures 1-4; returns the local repository of every step, saved without persisting."""
    for on in h.rotated((False, True), cfg.r):
        tag = "on" if on else "off"
        mngr = casstore.CheckpointManager(root / tag, persistent=persistent if on else None,
                                          chunk_size_bytes=cfg.chunk,
                                          persist_interval_steps=cfg.n)
        h.settle(cfg.warm)
        blocked = sum(h.seconds(lambda m=mngr, s=s, t=t: m.save(s, t))[0]
                      for s, t in enumerate(cfg.trees))
        out[f"save_blocked_{tag}_s"] = blocked / len(cfg.trees)
        out[f"close_{tag}_s"] = h.seconds(mngr.close)[0]  # waits for saves and persists
        out[f"saves_{tag}_s"] = blocked + out[f"close_{tag}_s"]  # every step stored
        if on:
            persister = mngr.persister
    done = sorted(persister.persisted)
    manifests = [casstore.read_manifest(persistent, s) for s in done]
    usage = casstore.step_usage(manifests)
    out.update(persisted_steps=done, dropped_steps=sorted(persister.dropped),
               persist_bytes=sum(i.bytes_copied for i in persister.persisted.values()),
               persisted_new_chunk_bytes=sum(u.added_bytes for u in usage),
               local_repo_bytes=h.du(root / "off")[1], restored_raw_bytes=usage[-1].logical_bytes,
               restored_stored_bytes=usage[-1].stored_bytes)
    last, want = done[-1], cfg.trees[done[-1]]
    fresh = casstore.CheckpointManager(root / "replaced", persistent=persistent)
    for key in h.rotated(("restore_lost_local_s", "restore_plain_s"), cfg.r):
        h.verify_equal(want, h.phase(out, key, (lambda: fresh.restore(last)) if "lost" in key
                                     else (lambda: casstore.restore(persistent, last)),
                                     warm=cfg.warm), key)
    fresh.close()
    local = casstore.open_store(str(root / "on"))
    keys = sorted({c.key for leaf in manifests[-1].leaves for c in leaf.chunks})
    for key in keys[::2]:
        local.delete(key)
    tiered = casstore.FallbackStore(local, [persistent])
    h.verify_equal(want, casstore.restore(tiered, last), "restore with half the chunks gone")
    out.update(half_gone_deleted_objects=len(keys[::2]), half_gone_objects=len(keys),
               half_gone_remote_bytes=sum(v for k, v in tiered.bytes_read.items()
                                          if k != tiered.url))
    return root / "off"


def copies(local: pathlib.Path, a: tuple, b: tuple, cfg, out: dict) -> None:
    """Figure 5: casstore.copy, then rclone (where on PATH), local to S3 (server ``a``: its
    storage options and a bucket), S3 (a) to S3 (``b``), and between two buckets of a."""
    (a_opts, a_bucket), (b_opts, b_bucket) = a, b
    src, dst = f"s3://{a_bucket}/copy-src", f"s3://{b_bucket}/copy-dst"
    s3 = lambda url, o: casstore.open_store(url, skip_instance_cache=True, **o)  # noqa: E731
    phase = functools.partial(h.phase, out, warm=cfg.warm, probes=[h.peers.server_cpu])
    phase("copy_local_s3_s", lambda: casstore.copy(str(local), s3(src, a_opts)))
    # untimed: server B grows its volumes for this much data here, not in the first timed copy
    casstore.copy(s3(src, a_opts), s3(f"s3://{b_bucket}/warm-up", b_opts))
    out["rclone"] = shutil.which(RCLONE)
    if out["rclone"] is None:
        phase("copy_s3_s3_s", lambda: casstore.copy(s3(src, a_opts), s3(dst, b_opts)))
        out.update(dict.fromkeys(("rclone_local_s3_s", "rclone_s3_s3_s", "rclone_same_s3_s",
                                  "copy_same_s3_s"), math.nan))
        return
    env = {**h.rclone_env("a", a_opts), **h.rclone_env("b", b_opts)}
    rclone = functools.partial(h.rclone_copy, env=env, program=out["rclone"])
    phase("rclone_local_s3_s", lambda: rclone(str(local), f"a:{a_bucket}/rc"))
    for key in h.rotated(("copy_s3_s3_s", "rclone_s3_s3_s"), cfg.r):  # who goes first
        phase(key, (lambda: casstore.copy(s3(src, a_opts), s3(dst, b_opts))) if "copy" in key
              else (lambda: rclone(f"a:{src[5:]}", f"b:{b_bucket}/rc")))
    same = h.new_bucket(a_opts)  # the same server: both copy each object server-side
    for key in h.rotated(("copy_same_s3_s", "rclone_same_s3_s"), cfg.r):
        phase(key, (lambda: casstore.copy(s3(src, a_opts), s3(f"s3://{same}/cs", a_opts)))
              if "copy" in key else (lambda: rclone(f"a:{src[5:]}", f"a:{same}/rc")))
    a_fs, b_fs = h.s3_fs(a_opts), h.s3_fs(b_opts)
    copied = (len(a_fs.find(f"{a_bucket}/rc")), len(b_fs.find(f"{b_bucket}/rc")))
    h.check(copied == (h.du(local)[0], len(a_fs.find(src[5:]))), f"rclone copied {copied}")


def limits(lim: dict, f: dict, raw: int) -> dict:
    """The limit (seconds) of one run's figures ``f``: the saves hash ``raw`` bytes and store
    the local repository; a persist or copy (rclone's too) moves its stored bytes at the
    slower of the source's read and the destination's write."""
    disk, a, b = lim["local disk"], lim["S3 A"], lim["S3 B"]
    save = h.limit.save_s(disk, raw, f["local_repo_bytes"])
    restore = h.limit.restore_s(a, f["restored_raw_bytes"], f["restored_stored_bytes"], cold=True)
    moves = {"local_s3": (disk, a), "s3_s3": (a, b), "same_s3": (a, a)}
    return {"saves_off_s": save, "saves_on_s": max(save, h.limit.move_s(f["persist_bytes"],
                                                                         disk, a)),
            "restore_lost_local_s": restore, "restore_plain_s": restore,
            **{f"{who}_{k}_s": h.limit.move_s(f["local_repo_bytes"], src, dst)
               for who in ("copy", "rclone") for k, (src, dst) in moves.items()}}


def run(args) -> dict:
    """``args.repeat`` runs, each on two fresh S3 servers (``--endpoint``: two buckets on it);
    figures and ratios are medians of each run's."""
    base, head = (1 << 20, 64 << 10) if args.tiny else (256 << 20, 16 << 20)
    rng = lambda seed, n: np.random.default_rng(seed).normal(0, 0.02, n // 4)  # noqa: E731
    frozen = rng(0, base).astype(np.float32)  # one array in every step's tree
    trees = [{"base": frozen, "head": rng(1 + s, head).astype(np.float32), "step": s}
             for s in range(STEPS)]
    runs, lims, run_limits = [], [], []
    for r in range(args.repeat):
        out: dict = {}
        cfg = types.SimpleNamespace(trees=trees, chunk=base // 16, n=args.persist_interval, r=r,
                                    warm=0 if args.no_warm else 3 * (base + head))
        with h.s3_server(args) as a_opts, h.s3_server(args) as b_opts, \
                h.scratch(args.dir, "tiers") as root:
            a, b = (a_opts, h.new_bucket(a_opts)), (b_opts, h.new_bucket(b_opts))
            lims.append({"local disk": h.limit.measure(base + head, base_dir=args.dir), **{
                f"S3 {n}": h.limit.measure(base + head, fs=h.s3_fs(o), prefix=f"{bk}/limit")
                for n, (o, bk) in (("A", a), ("B", b))}})
            persistent = casstore.open_store(f"s3://{a[1]}/persistent", **a_opts)
            copies(tiers(root, persistent, cfg, out), a, b, cfg, out)
        out["state_bytes"] = base + head
        run_limits.append(limits(lims[-1], out, base + STEPS * head))
        runs.append({**out, **{f"{key}_ratio": h.ratio(out[num], out[den])
                               for key, num, den, _, _ in TARGETS}})
    out, lim_s = h.medians(runs), h.medians(run_limits)
    ratios = {key: out[f"{key}_ratio"] for key, *_ in TARGETS}
    return {"tiny": args.tiny, "steps": STEPS, "base_bytes": base, "head_bytes": head,
            "state_bytes": base + head, "chunk_size_bytes": base // 16,
            "persist_interval": args.persist_interval,
            "server": args.endpoint or "two SeaweedFS (weed mini) on 127.0.0.1, fresh per run",
            "repeat": args.repeat, "figures": out, "runs": runs, "ratios": ratios,
            "limit": h.medians(lims), "limits": lim_s,
            "fractions": {k: h.ratio(v, out[k]) for k, v in lim_s.items()},
            "targets": [{"target": text, "key": key, "ratio": ratios[key], "limit": limit}
                        for key, _, _, text, limit in TARGETS]}


def table(result: dict) -> list[str]:
    """The figures with the limit and limit / figure, the limit's rates, the targets."""
    f, lim, frac = result["figures"], result["limits"], result["fractions"]
    unit = lambda k: {"s": "s", "bytes": "B", "ratio": "x"}.get(k.split("_")[-1], "n")  # noqa
    lines = h.md_table(["figure", "value", "machine's limit (s)", "limit / figure"], [
        [k, h.fmt(v, unit(k)), *((h.fmt(lim[k], "s"), h.fmt(frac[k], "x")) if k in lim else
                                 ("", ""))] for k, v in f.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and "disk_read" not in k])
    for name, rates in result["limit"].items():
        lines += h.limit_lines(rates, f"The machine's limit, {name}, this run (medians)")
    lines += ["", *h.target_lines([(t["target"], t["ratio"], t["limit"])
                                   for t in result["targets"]], na="n/a (rclone not run)")]
    if f["rclone"] is None:
        lines.append(f"- {RCLONE} is not on PATH: the rclone comparisons were not run (n/a)")
    return [*lines, f"- {result['steps']} steps of {result['base_bytes'] / 2**20:g} MiB base + "
            f"{result['head_bytes'] / 2**20:g} MiB head; persisted steps "
            f"{f['persisted_steps']}; median of {result['repeat']} run(s); server: "
            f"{result['server']}"]


main = h.command(__doc__, run, table, "repeat", "tiny", "dir", "no-warm", "endpoint", "key",
                 "secret", extra=(("--persist-interval", {"type": int, "default": 3}),))

if __name__ == "__main__":
    main()
