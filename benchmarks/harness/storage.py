"""Where benchmarks write: scratch directories, sizes on disk, fsync, an S3 server, rclone."""

import concurrent.futures as cf
import contextlib
import http.client
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

HERE = pathlib.Path(__file__).resolve().parents[1]  # benchmarks/


def load_module(name: str, path: pathlib.Path) -> Any:
    """Imports the file at ``path`` as module ``name``, once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def du(path: pathlib.Path) -> tuple[int, int]:
    """(files, bytes) under ``path``, or of the file."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
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
    with tempfile.TemporaryDirectory(prefix=f"casstore-bench-{name}-", dir=base_dir,
                                     ignore_cleanup_errors=True) as root:
        yield pathlib.Path(root)


@contextlib.contextmanager
def s3_server(args: Any) -> Iterator[dict]:
    """Storage options of ``args.endpoint`` (``args.key`` and ``args.secret``, else anonymous)
    or of a fresh SeaweedFS on loopback (``tests/servers.py``) with its data under ``args.dir``."""
    if args.endpoint:
        yield ({"endpoint_url": args.endpoint, "key": args.key, "secret": args.secret}
               if args.key else {"endpoint_url": args.endpoint, "anon": True})
        return
    servers = load_module("casstore_test_servers", HERE.parent / "tests" / "servers.py")
    with scratch(args.dir, "s3") as tmp:
        if len(str(tmp / "weed-0" / "filer.sock")) > 100:  # sun_path holds 108 bytes
            raise ValueError(f"--dir {args.dir!r} is too long a path for SeaweedFS's sockets")
        with servers.seaweedfs_server(tmp) as server:
            yield server.storage_options


def s3_fs(options: dict, **kw: Any) -> Any:
    """A new s3fs filesystem (not fsspec's cached instance) of storage ``options``."""
    import fsspec

    return fsspec.filesystem("s3", skip_instance_cache=True, **options, **kw)


def new_bucket(options: dict) -> str:
    """A new bucket's name, with one small object written: SeaweedFS allocates a bucket's
    volumes at its first write (0.3-1 s), which no timed phase should pay for."""
    bucket, fs = f"casstore-bench-{uuid.uuid4().hex[:12]}", s3_fs(options)
    fs.mkdir(bucket)
    fs.pipe_file(f"{bucket}/warm-up", b"x")
    return bucket


def http_put_many(endpoint: str, root: str, items: dict[str, bytes]) -> None:
    """PUTs ``items`` under ``endpoint/root`` (anonymous S3) from 16 threads, faster than s3fs
    for many small objects."""
    url, local = urllib.parse.urlsplit(endpoint), threading.local()

    def put(key: str) -> None:
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        local.conn.request("PUT", f"/{root}/{key}", body=items[key])
        response = local.conn.getresponse()
        response.read()
        if response.status != 200:
            raise OSError(f"PUT {endpoint}/{root}/{key}: HTTP {response.status}")

    with cf.ThreadPoolExecutor(16) as pool:
        list(pool.map(put, items))


def rclone_env(name: str, options: dict) -> dict[str, str]:
    """``RCLONE_CONFIG_<NAME>_*`` variables defining rclone remote ``name`` as the S3 server of
    storage ``options`` (``endpoint_url``; ``key`` and ``secret``, or anonymous)."""
    var = f"RCLONE_CONFIG_{name.upper()}_"
    env = {f"{var}TYPE": "s3", f"{var}PROVIDER": "Other", f"{var}ENV_AUTH": "false",
           f"{var}ENDPOINT": options["endpoint_url"], f"{var}FORCE_PATH_STYLE": "true",
           f"{var}REGION": "us-east-1"}
    if options.get("key"):
        env.update({f"{var}ACCESS_KEY_ID": options["key"],
                    f"{var}SECRET_ACCESS_KEY": options.get("secret") or ""})
    return env


def rclone_copy(src: str, dst: str, env: dict[str, str], program: str = "rclone") -> None:
    """``rclone copy --transfers 16 SRC DST`` with the remotes of ``env``, without
    ``AWS_CA_BUNDLE`` (rclone refuses to start with it); RuntimeError if it fails."""
    env = {**{k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}, **env}
    proc = subprocess.run([program, "copy", "--transfers", "16", src, dst], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"rclone copy {src} {dst} failed ({proc.returncode}): "
                           f"{proc.stderr.strip()[-2000:]}")
