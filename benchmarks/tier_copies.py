"""tiers.py's figure 5: ``casstore.copy`` against ``rclone copy --transfers 16`` of a repository,
local disk to S3, S3 to S3, and between two buckets of one S3 server (both server-side); and
the machine's limit of each of tiers.py's saves, restores and copies."""

import functools
import math
import pathlib
import shutil

import harness as h

import casstore


def copies(local: pathlib.Path, a: tuple, b: tuple, cfg, out: dict, program: str) -> None:
    """casstore.copy, then rclone (``program``, where on PATH), local to S3 (server ``a``: its
    storage options and a bucket), S3 (a) to S3 (``b``), and between two buckets of a."""
    (a_opts, a_bucket), (b_opts, b_bucket) = a, b
    src, dst = f"s3://{a_bucket}/copy-src", f"s3://{b_bucket}/copy-dst"
    s3 = lambda url, o: casstore.open_store(url, skip_instance_cache=True, **o)  # noqa: E731
    phase = functools.partial(h.phase, out, warm=cfg.warm, probes=[h.peers.server_cpu])
    phase("copy_local_s3_s", lambda: casstore.copy(str(local), s3(src, a_opts)))
    # untimed: server B grows its volumes for this much data here, not in the first timed copy
    casstore.copy(s3(src, a_opts), s3(f"s3://{b_bucket}/warm-up", b_opts))
    out["rclone"] = shutil.which(program)
    if out["rclone"] is None:
        phase("copy_s3_s3_s", lambda: casstore.copy(s3(src, a_opts), s3(dst, b_opts)))
        for key in ("rclone_local_s3_s", "rclone_s3_s3_s", "rclone_same_s3_s", "copy_same_s3_s"):
            out[key] = math.nan
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


def measure(base_dir: str | None, a: tuple, b: tuple, nbytes: int) -> dict:
    """The limit's rates (``harness.limit.measure``) on local disk under ``base_dir`` and on
    servers ``a`` and ``b`` (their storage options and a bucket), as ``local disk``, ``S3 A``
    and ``S3 B``."""
    return {"local disk": h.limit.measure(nbytes, base_dir=base_dir), **{
        f"S3 {n}": h.limit.measure(nbytes, fs=h.s3_fs(o), prefix=f"{bucket}/limit")
        for n, (o, bucket) in (("A", a), ("B", b))}}


def limits(lim: dict, f: dict, raw: int) -> dict:
    """The machine's limit (seconds) of one run's save, restore and copy figures ``f`` on the
    rates ``lim`` of :func:`measure` (README.md's ``tiers.py``): the saves hash ``raw`` bytes
    and store the local repository; a persist or copy moves its stored bytes at the slower of
    the source's read and the destination's write (rclone's copies: the same limit)."""
    disk, a, b = lim["local disk"], lim["S3 A"], lim["S3 B"]
    save = h.limit.save_s(disk, raw, f["local_repo_bytes"])
    restore = h.limit.restore_s(a, f["restored_raw_bytes"], f["restored_stored_bytes"], cold=True)
    return {"saves_off_s": save, "saves_on_s": max(save, h.limit.move_s(f["persist_bytes"], disk,
                                                                         a)),
            "restore_lost_local_s": restore, "restore_plain_s": restore,
            **{f"{who}_{k}_s": h.limit.move_s(f["local_repo_bytes"], src, dst)
               for who in ("copy", "rclone")
               for k, (src, dst) in {"local_s3": (disk, a), "s3_s3": (a, b),
                                     "same_s3": (a, a)}.items()}}
