"""The ``jax.distributed`` job as casstore sees it: how many processes, which one this is, and
the coordinator's key-value store, on which the processes exchange what a save
(:mod:`casstore._multihost`) and a shared persist (:mod:`casstore._persist_rounds`) need.
In a single-process job nothing here starts jax's backends.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import msgpack

from ._errors import CasstoreError


def timeout_ms() -> int:
    """How long to wait for the other processes: ``CASSTORE_MULTIHOST_TIMEOUT_S`` (default 600)."""
    return int(float(os.environ.get("CASSTORE_MULTIHOST_TIMEOUT_S", "600")) * 1000)


def processes() -> tuple[int, int]:
    """This process's ``(jax.process_count(), jax.process_index())``, without starting jax's
    backends where nothing has.

    A process that has not started them and has not called ``jax.distributed.initialize``
    holds no jax array, so it is one process of one: ``(1, 0)``. Asking jax there would start
    every backend, on a GPU machine the GPU's client, which by jax's default preallocates 75% of
    the GPU's memory, in a process that only saves numpy leaves (a data loader, an evaluation
    on the CPU). A multi-process save needs ``jax.distributed`` anyway (its key-value store:
    :func:`kv_client`), so a job of several processes without it (a TPU pod whose processes
    never call it) is refused once its backend has started, as before.
    """
    from jax._src import distributed, xla_bridge  # no public way to ask without starting them
    if distributed.global_state.client is None and not xla_bridge.backends_are_initialized():
        return 1, 0
    return jax.process_count(), jax.process_index()


def kv_client():
    """The ``jax.distributed`` coordinator's key-value store client.

    Raises:
      CasstoreError: ``jax.distributed`` is not initialized.
    """
    from jax._src.distributed import global_state  # the only handle on the KV store
    if global_state.client is None:
        raise CasstoreError("jax.distributed is not initialized in a multi-process job")
    return global_state.client


PART_BYTES = 4 << 20  # a value's part on the coordinator's key-value store


def set_large(client, key: str, data: bytes) -> None:
    """Sets ``data`` on the coordinator's key-value store in parts of at most ``PART_BYTES``
    (``key/0``, ``key/1``, ..., then their number at ``key/n``): a manifest of many leaves,
    or the list of a step's objects, is several MiB, and each part is one gRPC message."""
    count = max(1, -(-len(data) // PART_BYTES))
    for n in range(count):
        client.key_value_set_bytes(f"{key}/{n}", data[n * PART_BYTES:(n + 1) * PART_BYTES])
    client.key_value_set_bytes(f"{key}/n", msgpack.packb(count))


def get_large(client, key: str) -> bytes:
    """The value :func:`set_large` set under ``key``, waiting for it at most
    :func:`timeout_ms`.

    Raises:
      CasstoreError: it did not come in time.
    """
    try:
        count = msgpack.unpackb(client.blocking_key_value_get_bytes(f"{key}/n", timeout_ms()))
        return b"".join(client.blocking_key_value_get_bytes(f"{key}/{n}", timeout_ms())
                        for n in range(count))
    except Exception as e:  # jax's runtime error for a timeout or a dead peer
        raise CasstoreError(f"no value at {key!r} on the coordinator within "
                            f"{timeout_ms() / 1000:g} s ({e})") from e


def posted(client, key: str, end: float, late: str) -> list[str]:
    """The list of errors posted at ``key``, waiting until ``end`` (``time.monotonic``);
    ``[late + the wait]`` if none came."""
    try:
        return msgpack.unpackb(client.blocking_key_value_get_bytes(
            key, max(1, int((end - time.monotonic()) * 1000))))
    except Exception as e:  # jax's runtime error for a timeout or a dead peer
        return [f"{late} within {timeout_ms() / 1000:g} s ({e})"]


def try_get(client, key: str) -> str | None:
    """The value at ``key``, or None if none is set (jax raises for a key not set)."""
    try:
        return client.key_value_try_get(key)
    except Exception:  # jax's runtime error: not found
        return None


_latest_count = itertools.count()  # SPMD: every process restores the latest step alike


def agreed_latest(latest: Callable[[], int | None], target: Any) -> int | None:
    """``latest()``, the latest step; in a multi-process job restoring arrays that span
    processes (a ``target`` leaf whose sharding is not fully addressable), process 0's, which
    the others take from the key-value store: each listing on its own, a step committed in
    between gave one global array the shards of two steps.

    Raises:
      CasstoreError: on a process other than 0, process 0 could not list the steps, or did
        not post its answer within :func:`timeout_ms`.
    """
    count, index = processes()
    if count == 1 or not any(_spans(leaf) for leaf in jax.tree.leaves(target)):
        return latest()
    client, key = kv_client(), f"casstore/latest/{next(_latest_count)}"
    if index == 0:
        try:
            step, error = latest(), None
        except Exception as e:
            step, error = None, f"{type(e).__name__}: {e}"
        client.key_value_set_bytes(key, msgpack.packb([step, error]))
        if error is None:
            return step
        raise CasstoreError(f"cannot list the latest step: {error}")
    try:
        step, error = msgpack.unpackb(client.blocking_key_value_get_bytes(key, timeout_ms()))
    except Exception as e:  # jax's runtime error for a timeout or a dead peer
        raise CasstoreError(f"process 0 did not say which step is the latest within "
                            f"{timeout_ms() / 1000:g} s ({e})") from e
    if error is not None:
        raise CasstoreError(f"process 0 could not list the latest step: {error}")
    return step


def _spans(leaf: Any) -> bool:
    """True for a target leaf placed on devices of several processes (on an AbstractMesh:
    of the mesh ``jax.set_mesh`` made active, where the restore places it)."""
    sharding = getattr(leaf, "sharding", None)
    if isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh):
        mesh = jax.sharding.get_mesh()
        return not mesh.empty and len({d.process_index for d in mesh.devices.flat}) > 1
    try:
        return not sharding.is_fully_addressable
    except AttributeError:  # no sharding
        return False
