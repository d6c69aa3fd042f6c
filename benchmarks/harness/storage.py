"""Where benchmarks write: scratch directories, sizes on disk, fsync, and an S3 server."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator

HERE = pathlib.Path(__file__).resolve().parents[1]  # benchmarks/


def load_module(name: str, path: pathlib.Path):
    """Imports the file at ``path`` as module ``name`` once (``tests/servers.py``, an example)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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


def test_servers():
    """``tests/servers.py``: the SeaweedFS launcher the test suite uses."""
    return load_module("casstore_test_servers", HERE.parent / "tests" / "servers.py")


@contextlib.contextmanager
def s3_server(endpoint: str | None, key: str | None, secret: str | None,
              base_dir: str | None) -> Iterator[dict]:
    """Storage options of an S3 server: ``endpoint``, or a fresh SeaweedFS on loopback.

    Raises:
      ValueError: ``base_dir`` is too long a path for SeaweedFS's unix sockets.
    """
    if endpoint:
        yield ({"endpoint_url": endpoint, "key": key, "secret": secret} if key
               else {"endpoint_url": endpoint, "anon": True})
        return
    with scratch(base_dir, "s3") as tmp:
        if len(str(tmp / "weed-0" / "filer.sock")) > 100:  # sun_path holds 108 bytes
            raise ValueError(f"--dir {base_dir!r} is too long a path for SeaweedFS's sockets")
        with test_servers().seaweedfs_server(tmp) as server:
            yield server.storage_options


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


def rclone_env(name: str, options: dict) -> dict[str, str]:
    """``RCLONE_CONFIG_<NAME>_*`` variables that define rclone remote ``name`` as the S3 server
    of storage ``options`` (``endpoint_url``, and ``key``/``secret`` or anonymous): no config
    file."""
    var = f"RCLONE_CONFIG_{name.upper()}_"
    env = {f"{var}TYPE": "s3", f"{var}PROVIDER": "Other", f"{var}ENV_AUTH": "false",
           f"{var}ENDPOINT": options["endpoint_url"], f"{var}FORCE_PATH_STYLE": "true",
           f"{var}REGION": "us-east-1"}
    if options.get("key"):
        env.update({f"{var}ACCESS_KEY_ID": options["key"],
                    f"{var}SECRET_ACCESS_KEY": options.get("secret") or ""})
    return env


def rclone_copy(src: str, dst: str, env: dict[str, str], transfers: int = 16,
                program: str = "rclone") -> None:
    """``rclone copy --transfers N SRC DST`` with the remotes of ``env`` (:func:`rclone_env`).

    ``AWS_CA_BUNDLE`` is not passed on: rclone's S3 backend fails to start with it (its HTTP
    transport takes no custom bundle), and the loopback servers speak plain HTTP.

    Raises:
      RuntimeError: rclone failed (the message ends with its stderr).
    """
    import subprocess

    env = {**{k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}, **env}
    proc = subprocess.run([program, "copy", "--transfers", str(transfers), src, dst], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"rclone copy {src} {dst} failed ({proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")
