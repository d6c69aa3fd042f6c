"""tiers.py's figure 5: ``casstore.copy`` against ``rclone copy --transfers 16`` of a repository,
local disk to S3, S3 to S3, and between two buckets of one S3 server (both server-side)."""

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
