"""Shared fixtures: one parametrized ``repo_store`` fixture over every store backend."""

import os

# 8 CPU devices for sharding tests; must be set before jax initializes its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import uuid  # noqa: E402

import fsspec  # noqa: E402
import pytest  # noqa: E402

from casstore.store import FsspecStore, LocalStore, MemoryStore  # noqa: E402

BACKENDS = ["memory", "local", "fsspec-memory"]


def make_store(kind: str, tmp_path):
    """A fresh, empty store of the given backend kind."""
    if kind == "memory":
        return MemoryStore()
    if kind == "local":
        return LocalStore(tmp_path / "repo")
    # fsspec's memory filesystem is process-global: give every test its own root.
    return FsspecStore(fsspec.filesystem("memory"), f"/casstore-test-{uuid.uuid4().hex}")


@pytest.fixture(params=BACKENDS)
def repo_store(request, tmp_path):
    """A fresh store, once per backend."""
    return make_store(request.param, tmp_path)
