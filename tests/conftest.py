"""Shared fixtures: every store backend, including real S3 and GCS servers on loopback."""

import os

# 8 CPU devices for sharding tests; must be set before jax initializes its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported
# jax's persistent compilation cache, for the test processes and the processes they start:
# the examples and benchmarks compile the same train steps in several tests (a third of
# those tests' time on the second run; the cache is keyed by jax's version, flags and devices).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(__file__)), ".cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import contextlib
import importlib.util
import pathlib
import shlex
import subprocess
import sys
import threading
import uuid

import fsspec
import msgpack
import pytest
import servers

from casstore._manifest import pack_with_digest
from casstore.store import FsspecStore, LocalStore, MemoryStore

LOCAL_BACKENDS = ["memory", "local", "fsspec-memory"]
OBJECT_BACKENDS = ["seaweedfs", "moto", "fake-gcs"]
BACKENDS = LOCAL_BACKENDS + OBJECT_BACKENDS
# What ``repo_store`` gives a test: each store code path once. moto and SeaweedFS are one path
# in casstore (s3fs on an S3 endpoint); their answers differ where a create-only write finds
# the key present (FileExistsError on moto, as on AWS; a 412 PreconditionFailed on SeaweedFS,
# casstore/store/_clients.py is_exists_error), so a test that reaches that answer asks for
# every server: ``@pytest.mark.parametrize("repo_store", BACKENDS, indirect=True)``. moto's
# server runs in the test process, on its GIL: its tests took twice SeaweedFS's time.
STORE_BACKENDS = [b for b in BACKENDS if b != "moto"]


def make_store(kind: str, tmp_path):
    """A fresh, empty store of a local backend kind."""
    if kind == "memory":
        return MemoryStore()
    if kind == "local":
        return LocalStore(tmp_path / "repo")
    # fsspec's memory filesystem is process-global: give every test its own root.
    return FsspecStore(fsspec.filesystem("memory"), f"/casstore-test-{uuid.uuid4().hex}")


@pytest.fixture(scope="session")
def object_servers(tmp_path_factory):
    """SeaweedFS, moto and fake-gcs-server, started once per session on free loopback ports.

    With CASSTORE_TEST_S3_ENDPOINT / CASSTORE_TEST_GCS_ENDPOINT set, those servers stand in for
    the S3 ones / the GCS one. A server that cannot start fails every test that uses it.
    """
    root = tmp_path_factory.mktemp("servers")
    with contextlib.ExitStack() as stack:
        if os.environ.get("CASSTORE_TEST_S3_ENDPOINT"):
            s3 = stack.enter_context(servers.external_s3())
            found = {"seaweedfs": s3, "moto": s3}
        else:
            found = {"seaweedfs": stack.enter_context(servers.seaweedfs(root)),
                     "moto": stack.enter_context(servers.moto_server())}
        found["fake-gcs"] = stack.enter_context(
            servers.external_gcs() if os.environ.get("CASSTORE_TEST_GCS_ENDPOINT")
            else servers.fake_gcs(root))
        yield found


class GatedStore(MemoryStore):
    """A memory store that holds every chunk write until ``gate`` is set (at most 60 s), so a
    test can act while a save is in flight."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def _put(self, key, data, *, exclusive):
        if key.startswith("chunks/"):
            assert self.gate.wait(60)
        super()._put(key, data, exclusive=exclusive)


def object_store(server: servers.ObjectServer, **kwargs) -> FsspecStore:
    """A store in a fresh bucket of ``server``."""
    return FsspecStore.from_url(server.url(), **server.storage_options, **kwargs)


@pytest.fixture(params=STORE_BACKENDS)
def repo_store(request, tmp_path):
    """A fresh store, once per store code path (:data:`STORE_BACKENDS`; the object-storage
    ones on real servers), or once per backend where a test parametrizes it with BACKENDS."""
    if request.param in OBJECT_BACKENDS:
        return object_store(request.getfixturevalue("object_servers")[request.param])
    return make_store(request.param, tmp_path)


# SeaweedFS enforcing an ``admin`` and a read-only ``reader`` identity (servers.py).
seaweedfs_identities = pytest.fixture(scope="session")(servers.s3_seaweedfs_identities)


def _has_gpu() -> bool:
    import jax
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests run only where jax sees a GPU (issue 12; reason names the marker)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not _has_gpu():
        skip = pytest.mark.skip(reason="gpu marker: jax sees no GPU on this machine")
        for item in gpu_items:
            item.add_marker(skip)


def load_benchmark(name: str):
    """The module ``benchmarks/<name>.py``, imported from its file (benchmarks/ is scripts, not
    a package), so a test can call its ``main`` and helpers."""
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_mount_namespace(mount: str, script: str, *args: object,
                       timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs Python ``script`` (no single quote in it) with ``args`` after the shell command
    ``mount``, in a mount namespace of the child process's own (``unshare``, as root or as a
    mapped root user): the mount is its alone, and goes with it. Asserts it exited 0."""
    user = [] if os.geteuid() == 0 else ["--map-root-user"]
    command = " ".join([f"{mount} && {shlex.quote(sys.executable)} -c '{script}'",
                        *(shlex.quote(str(a)) for a in args)])
    out = subprocess.run(["unshare", *user, "--mount", "sh", "-c", command],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def repack(doc: dict) -> bytes:
    """msgpack bytes of a decoded manifest or config ``doc`` after a test changed it: a
    manifest's ``digest`` (format.md §4.1) is computed again, as a writer of those fields
    would have, so what the test changed reaches the checks behind the digest."""
    if "digest" not in doc:
        return msgpack.packb(doc, use_bin_type=True)
    return pack_with_digest({k: v for k, v in doc.items() if k != "digest"})
