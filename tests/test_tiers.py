"""Tiered checkpoints: a local tier in a temp dir and a persistent tier on SeaweedFS (and
fake-gcs-server): background persists of every N-th step moving only new chunks, restores
falling back per chunk, a replaced node, a stalled persistent tier, resume and retention."""

import contextlib
import dataclasses
import json
import logging
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from faultproxy import fault_proxy
from forkserver import LazyForkServer, multihost_env

import casstore
from casstore._copy_engine import share_of
from casstore._layout import chunk_id_of_key, chunk_key, is_object_key, manifest_key
from casstore._manifest import needed_objects
from casstore._repository import list_chunk_objects
from casstore.store import CountingStore, FsspecStore, LocalStore, MemoryStore

from conftest import in_mount_namespace, object_store

CHUNK = 32_768
DEADLINES = {"request_timeout_s": 0.5, "operation_timeout_s": 2.0}


def tree_for(step: int) -> dict:
    """A frozen base, a head trained a little every step, and a step counter."""
    base = np.random.default_rng(0).normal(size=(256, 64)).astype(np.float32)
    head = np.random.default_rng(1).normal(size=(64, 64)).astype(np.float32)
    head += np.float32(1e-3) * step
    return {"base": base, "head": head, "bias": np.full(64, step, np.int32), "step": step}


def assert_bit_exact(restored, step: int) -> None:
    expected = tree_for(step)
    for key in ("base", "head", "bias"):
        assert restored[key].tobytes() == expected[key].tobytes(), (step, key)
    assert restored["step"] == step


@pytest.fixture(params=["seaweedfs"])
def remote(request, object_servers):
    return object_store(object_servers[request.param])


def manager(local, remote, **kwargs):
    return casstore.CheckpointManager(local, persistent=remote, chunk_size_bytes=CHUNK,
                                      **kwargs)


def object_keys(store, steps, run="default") -> set[str]:
    return {k for s in steps for k in needed_objects(casstore.read_manifest(store, s, run=run))}


def test_every_nth_step_is_persisted_sending_only_new_chunks(tmp_path, object_servers):
    remote = CountingStore(object_store(object_servers["seaweedfs"]))
    with manager(tmp_path / "local", remote, persist_interval_steps=5, max_to_keep=3) as mngr:
        for step in range(30):
            assert mngr.save(step, tree_for(step))
            if step % 10 == 9:
                assert mngr.wait_until_persisted()
        assert mngr.wait_until_persisted()
        persisted = casstore.list_steps(remote)
        assert set(persisted) <= set(range(0, 30, 5))
        assert persisted[-1] == 25
        assert set(mngr.persister.dropped) | set(persisted) == set(range(0, 30, 5))
        assert mngr.all_steps() == sorted({27, 28, 29, *persisted})
        assert mngr.latest_step() == 29
    sent = [k for k in remote.keys_written if is_object_key(k)]
    assert len(sent) == len(set(sent))  # each object once
    assert set(sent) == object_keys(remote, persisted)  # exactly the persisted steps' objects
    sizes = {info.key: info.size for prefix in ("chunks/", "deltas/")
             for info in remote.inner.list(prefix)}
    infos = mngr.persister.persisted.values()
    assert sum(i.bytes_copied for i in infos) == sum(sizes[k] for k in sent)
    assert casstore.verify(remote).ok
    for step in persisted:
        assert_bit_exact(casstore.restore(remote, step), step)


@pytest.mark.parametrize("backend", ["seaweedfs", "fake-gcs"])
def test_a_manager_on_an_empty_local_dir_restores_the_newest_persisted_step(
        tmp_path, object_servers, backend):
    remote = object_store(object_servers[backend])
    with manager(tmp_path / "local", remote, persist_interval_steps=4) as mngr:
        for step in range(10):
            mngr.save(step, tree_for(step))
        mngr.wait_until_persisted()
        persisted = sorted(mngr.persister.persisted)
        # on a loaded machine step 4 may be dropped from the backlog (the newest wins), never 8
        assert sorted([*persisted, *mngr.persister.dropped]) == [0, 4, 8]
        assert persisted[-1] == 8
    shutil.rmtree(tmp_path / "local")  # the node was replaced
    with manager(tmp_path / "local", remote, persist_interval_steps=4) as fresh:
        assert fresh.latest_step() == 8
        assert fresh.all_steps() == persisted
        restored = fresh.restore()
        assert_bit_exact(restored, 8)
        assert fresh.metadata(8) is None
        assert not fresh.save(8, tree_for(8))  # not due: training resumes after step 8
        assert fresh.save(9, tree_for(9))
        fresh.wait_until_finished()
        assert_bit_exact(fresh.restore(9), 9)


def _damage_local(local: LocalStore, step: int) -> tuple[list[str], list[str]]:
    """Deletes every other object of ``step`` and flips a byte in the rest; returns both."""
    keys = sorted(object_keys(local, [step]))
    deleted, corrupted = keys[::2], keys[1::2]
    for key in deleted:
        local.delete(key)
    for key in corrupted:
        path = local._path(key)
        with open(path, "rb") as f:
            data = bytearray(f.read())
        data[len(data) // 2] ^= 0x10
        with open(path, "wb") as f:
            f.write(bytes(data))
    return deleted, corrupted


def test_restore_takes_missing_and_damaged_local_chunks_from_the_persistent_tier(
        tmp_path, remote, caplog):
    local = LocalStore(tmp_path / "local")
    with manager(local, remote, persist_interval_steps=1) as mngr:
        for step in range(3):
            mngr.save(step, tree_for(step))
        mngr.wait_until_persisted()
        deleted, corrupted = _damage_local(local, 2)
        assert deleted
        assert corrupted
        with pytest.raises((casstore.CorruptChunkError, casstore.MissingChunkError),
                           match=r"chunk object missing|unusable chunk"):
            casstore.restore(local, 2)  # without the persistent tier
        assert_bit_exact(mngr.restore(2), 2)
        assert mngr.last_restore_bytes[remote.url] > 0
        assert mngr.last_restore_bytes[local.url] > 0
    # The plain API: fallback=, and a FallbackStore that reports bytes per tier.
    with caplog.at_level(logging.INFO, logger="casstore"):
        assert_bit_exact(casstore.restore(local, 2, fallback=remote), 2)
    assert f"bytes from {remote.url}" in caplog.text
    assert "restore of step 2" in caplog.text
    tiered = casstore.FallbackStore(local, [remote])
    assert_bit_exact(casstore.restore(tiered, 2), 2)
    remote_sizes = {k: remote.stat(k).size for k in deleted + corrupted}
    assert tiered.bytes_read[remote.url] >= sum(remote_sizes.values())
    assert tiered.objects_recovered >= len(deleted) + len(corrupted)
    assert tiered.bytes_read[local.url] > 0


@pytest.mark.parametrize("header_byte", [4, 5], ids=["version", "codec"])
def test_a_local_chunk_with_a_damaged_header_is_taken_from_the_other_tier(tmp_path,
                                                                          header_byte):
    # A header byte flipped to an unknown chunk version or codec reads as a newer writer's
    # chunk or damage; another tier's copy that decodes to the chunk id tells which.
    local, other = LocalStore(tmp_path / "local"), LocalStore(tmp_path / "other")
    casstore.save(local, 1, tree_for(1), chunk_size_bytes=CHUNK)
    casstore.copy(local, other)
    for key in object_keys(local, [1]):
        path = pathlib.Path(local._path(key))
        data = bytearray(path.read_bytes())
        data[header_byte] ^= 0x40
        path.write_bytes(bytes(data))
    with pytest.raises(casstore.UnsupportedFormatError,
                       match=r"chunk (header version|codec) \d+ \(or a damaged chunk\).*"
                             r"step 1, key path '[^']+'"):
        casstore.restore(local, 1)
    assert_bit_exact(casstore.restore(local, 1, fallback=other), 1)
    assert_bit_exact(casstore.restore(casstore.FallbackStore(local, [other], write_back=True),
                                      1), 1)
    assert_bit_exact(casstore.restore(local, 1), 1)  # written back


def test_a_persist_after_another_writer_saved_the_persisted_step_again_sends_every_object(
        tmp_path, remote):
    # The persister took the objects of the step it persisted last as present while a step of
    # that number was there; another writer had deleted it, collected its chunks and saved
    # another step 0, so step 1 was committed there without its chunks.
    local = LocalStore(tmp_path / "local")
    with manager(local, remote, persist_interval_steps=1, delta=False) as mngr:
        mngr.save(0, tree_for(0))
        assert mngr.wait_until_persisted()
        casstore.delete(remote, 0)
        assert casstore.gc(remote, grace_period_s=0).deleted_chunks
        casstore.save(remote, 0, tree_for(7), chunk_size_bytes=CHUNK)
        mngr.save(1, tree_for(0))  # the same values as the first step 0: the same chunks
        assert mngr.wait_until_persisted()
    assert casstore.list_steps(remote) == [0, 1]
    assert casstore.verify(remote).ok
    assert_bit_exact(casstore.restore(remote, 1), 0)


def test_write_back_repairs_the_local_tier(tmp_path, remote):
    local = LocalStore(tmp_path / "local")
    for step in range(2):
        casstore.save(local, step, tree_for(step), chunk_size_bytes=CHUNK)
    casstore.copy(local, remote)
    _damage_local(local, 1)
    assert not casstore.verify(local).ok
    assert_bit_exact(casstore.restore(casstore.FallbackStore(local, [remote], write_back=True),
                                      1), 1)
    assert casstore.verify(local).ok
    assert_bit_exact(casstore.restore(local, 1), 1)


def test_write_back_writes_nothing_a_fallback_holds_damaged(tmp_path, remote):
    """A chunk the local tier lacks and the persistent tier holds with a changed byte: the
    restore fails naming it, and the damaged copy is not written to the local tier (a later
    save there would reuse it unchecked)."""
    local = LocalStore(tmp_path / "local")
    casstore.save(local, 1, tree_for(1), chunk_size_bytes=CHUNK)
    casstore.copy(local, remote)
    key = sorted(object_keys(local, [1]))[0]
    local.delete(key)
    data = bytearray(remote.get(key))
    data[len(data) // 2] ^= 0x10
    remote.put(key, bytes(data))
    tiered = casstore.FallbackStore(local, [remote], write_back=True)
    tiers = re.escape(f"no tier has a usable copy ({local.url}, {remote.url})")
    with pytest.raises(casstore.CorruptChunkError,
                       match=rf"unusable chunk: .*; {tiers} .*step 1.*chunk id "
                       rf"'{chunk_id_of_key(key)}'\)$") as e:
        casstore.restore(tiered, 1)
    assert str(e.value).count(chunk_id_of_key(key)) == 1  # once, in the place
    assert not local.exists(key)
    assert tiered._held == {}  # forgotten, not kept


def test_write_back_commits_a_step_locally_only_once_its_objects_are_there(tmp_path, remote):
    """A step only the persistent tier holds: a restore of one leaf writes back that leaf's
    objects but not the step's manifest (the local tier would list a step it cannot restore);
    a full restore writes back the rest, then the manifest, and the local tier verifies."""
    local = LocalStore(tmp_path / "local")
    casstore.save(remote, 3, tree_for(3), chunk_size_bytes=CHUNK)
    tiered = casstore.FallbackStore(local, [remote], write_back=True)
    head = casstore.restore(tiered, 3, paths=["head"])
    assert head["head"].tobytes() == tree_for(3)["head"].tobytes()
    assert casstore.list_steps(local) == []
    assert list(list_chunk_objects(local))  # the head's chunks are there
    assert_bit_exact(casstore.restore(tiered, 3), 3)
    assert casstore.list_steps(local) == [3]
    assert casstore.verify(local).ok
    assert_bit_exact(casstore.restore(local, 3), 3)


def test_write_back_commits_no_step_while_gc_runs_on_the_local_tier(tmp_path, remote):
    """Step 1 only on the persistent tier, its chunks in the local tier unreferenced (step 0
    deleted by retention): a GC there that listed the manifests before a write-back deleted
    them under the step written back. Write-back commits under a save lock, and not at all
    while a GC holds its lock."""
    from casstore._locks import _put_lock

    local = LocalStore(tmp_path / "local")
    casstore.save(local, 0, tree_for(1), chunk_size_bytes=CHUNK)
    casstore.save(remote, 1, tree_for(1), chunk_size_bytes=CHUNK)
    casstore.delete(local, 0)
    gc = _put_lock(local, "gc")  # a GC sweeping the local tier
    tiered = casstore.FallbackStore(local, [remote], write_back=True)
    assert_bit_exact(casstore.restore(tiered, 1), 1)
    assert casstore.list_steps(local) == []
    assert [o.key for o in local.list("locks/")] == [gc]  # its save lock released
    local.delete(gc)
    assert_bit_exact(casstore.restore(tiered, 1), 1)
    assert casstore.list_steps(local) == [1]
    assert not list(local.list("locks/"))
    assert casstore.verify(local).ok


def test_write_back_holds_at_most_its_bound_of_unchecked_reads(tmp_path, remote, monkeypatch):
    """Reads through a write-back store that no restore checks (a copy's) are held up to
    HELD_BYTES, the oldest forgotten first, and none of them is written back."""
    import casstore._fallback

    monkeypatch.setattr(casstore._fallback, "HELD_BYTES", 3 * CHUNK)
    local = LocalStore(tmp_path / "local")
    casstore.save(remote, 0, tree_for(0), chunk_size_bytes=CHUNK)
    tiered = casstore.FallbackStore(local, [remote], write_back=True)
    casstore.copy(tiered, tmp_path / "other")
    assert 0 < sum(len(v) for v in tiered._held.values()) <= 3 * CHUNK
    assert list(list_chunk_objects(local)) == []
    assert_bit_exact(casstore.restore(tmp_path / "other", 0), 0)


def test_a_damaged_local_config_object_is_read_from_the_persistent_tier(tmp_path, remote,
                                                                       caplog):
    """Every reader refuses a repository whose config object is damaged; through the tiers
    the persistent tier's is read instead (and written back with ``write_back``)."""
    local = LocalStore(tmp_path / "local")
    casstore.save(local, 0, tree_for(0), chunk_size_bytes=CHUNK)
    casstore.copy(local, remote)
    (tmp_path / "local" / "config").write_bytes(b"\x00junk")
    with pytest.raises(casstore.ManifestError, match="config object"):
        casstore.restore(local, 0)
    with caplog.at_level(logging.WARNING, logger="casstore"):
        assert_bit_exact(casstore.restore(local, 0, fallback=remote), 0)
    assert "config object" in caplog.text
    assert_bit_exact(casstore.restore(casstore.FallbackStore(local, [remote], write_back=True),
                                      0), 0)
    assert casstore.verify(local).ok
    assert_bit_exact(casstore.restore(local, 0), 0)


def test_a_chunk_no_tier_has_intact_fails_naming_it(tmp_path, remote):
    local = LocalStore(tmp_path / "local")
    casstore.save(local, 1, tree_for(1), chunk_size_bytes=CHUNK)
    casstore.copy(local, remote)
    key = sorted(object_keys(local, [1]))[0]
    local.delete(key)
    remote.delete(key)
    with pytest.raises(casstore.MissingChunkError, match="no such object in any tier"):
        casstore.restore(local, 1, fallback=remote)


def test_a_manifest_or_config_damaged_on_the_persistent_tier_is_named_there(tmp_path, remote):
    """Errors about them named the local tier, healthy or without the step (a replaced node),
    and the advice to repair pointed there."""
    local = LocalStore(tmp_path / "local")
    casstore.save(local, 0, tree_for(0), chunk_size_bytes=CHUNK)
    casstore.copy(local, remote)
    key = manifest_key("default", 0)
    local.delete(key)
    remote.delete(key)
    remote.put(key, b"\x00junk")
    with pytest.raises(casstore.ManifestError, match=rf"url '{re.escape(remote.url)}'") as e:
        casstore.restore(local, 0, fallback=remote)
    assert e.value.url == remote.url
    local.put(key, b"\x01junk")
    with pytest.raises(casstore.ManifestError, match="damaged in every tier that has it "
                       rf"\({re.escape(local.url)}, {re.escape(remote.url)}\)"):
        casstore.restore(local, 0, fallback=remote)
    remote.delete("config")
    remote.put("config", b"\x00junk")
    with pytest.raises(casstore.ManifestError,
                       match=rf"config object.*repair.*url '{re.escape(remote.url)}'"):
        casstore.restore(tmp_path / "replaced", 0, fallback=remote)


def test_a_stalled_persistent_tier_never_blocks_save_and_its_error_names_step_and_url(
        tmp_path, object_servers):
    server = object_servers["seaweedfs"]
    url = server.url_for("stalled")
    with fault_proxy(server.endpoint_url) as proxy:
        remote = FsspecStore.from_url(url, **{**server.storage_options,
                                              "endpoint_url": proxy.endpoint_url}, **DEADLINES)
        remote.policy.backoff_s = 0.05
        # The 2 s deadline only from the stall on: on a loaded machine the manager's first
        # listing of the persistent tier once took longer before anything stalled.
        remote.policy.operation_timeout_s = 30.0
        mngr = manager(tmp_path / "local", remote, persist_interval_steps=1)
        mngr.save(0, tree_for(0))
        assert mngr.wait_until_persisted()
        remote.policy.operation_timeout_s = DEADLINES["operation_timeout_s"]
        proxy.set("stall")
        blocked = []
        error = None
        for step in range(1, 40):
            t0 = time.monotonic()
            try:
                mngr.save(step, tree_for(step))
            except (casstore.PersistError, casstore.StoreTimeoutError) as e:
                error = e
                break
            finally:
                blocked.append(time.monotonic() - t0)
            time.sleep(0.1)
        assert error is not None, "the stalled persist never surfaced"
        assert max(blocked) < 1.5, blocked  # a local save, never the 2 s persistent deadline
        assert error.step is not None
        assert f"step {error.step}" in str(error)
        assert error.url is not None
        assert error.url.startswith(remote.url.split("/")[0])
        assert error.step not in casstore.list_steps(FsspecStore.from_url(
            url, **server.storage_options))  # no partial step
        proxy.set(None)
        # Healed: the recovery gets deadlines of its own (its requests still time out at
        # 0.5 s, and are retried). Under a cold-cache suite on 3 workers, every connect to
        # the proxy once timed out for the whole 2 s.
        remote.policy.operation_timeout_s = remote.policy.request_timeout_s = 30.0
        with contextlib.suppress(casstore.PersistError, casstore.StoreTimeoutError):
            mngr.wait_until_persisted()  # a persist begun during the stall may fail too
        last = mngr.latest_step()
        assert mngr.save(last + 1, tree_for(last + 1))
        assert mngr.wait_until_persisted()
        assert last + 1 in casstore.list_steps(remote)
        mngr.close()


class HeldLocalStore(LocalStore):
    """A local tier whose writes wait while ``writes`` is clear: a local save held running."""

    def __init__(self, root):
        super().__init__(root)
        self.writes = threading.Event()
        self.writes.set()

    def _put(self, key, data, *, exclusive):
        self.writes.wait(30)
        super()._put(key, data, exclusive=exclusive)


@pytest.mark.parametrize("damage", ["replaced node", "damaged local chunk"])
def test_a_stalled_request_to_the_persistent_tier_during_a_restore_is_retried(
        tmp_path, object_servers, damage):
    """A fallback read ran inside the handler of the local tier's error, which replaced the
    botocore ReadTimeoutError's context, the error it was told transient by: one stalled
    request failed the restore at once, or named an intact persisted chunk unusable
    (exploratory session's repros). A plain restore from S3 retried it."""
    server = object_servers["seaweedfs"]
    with fault_proxy(server.endpoint_url, seed=3) as proxy:
        remote = FsspecStore.from_url(server.url_for("stall-once"), **{
            **server.storage_options, "endpoint_url": proxy.endpoint_url},
            request_timeout_s=0.5, operation_timeout_s=30.0)
        remote.policy.backoff_s = 0.05
        local = LocalStore(tmp_path / "local")
        with manager(local, remote, persist_interval_steps=1) as mngr:
            mngr.save(0, tree_for(0))
            assert mngr.wait_until_persisted()
        if damage == "replaced node":
            shutil.rmtree(tmp_path / "local")
        else:
            _damage_local(local, 0)
        with manager(tmp_path / "local", remote, persist_interval_steps=1) as mngr:
            proxy.set("stall", max_faults=1)  # one request stalls; every later one answers
            assert_bit_exact(mngr.restore(0), 0)
            assert proxy.faults["stall"] == 1
            proxy.set(None)


def _persist_during_a_held_save(tmp_path, remote, **policy):
    """A manager that persisted step 0, holding its save of step 3 (its write waits) while
    step 2 (saved beside it) is submitted for persisting; returns (manager, local tier, step
    2's objects the persistent tier lacks)."""
    local = HeldLocalStore(tmp_path / "local")
    mngr = manager(local, remote, persist_interval_steps=2)
    mngr.persister.policy = dataclasses.replace(mngr.persister.policy, **policy)
    mngr.save(0, tree_for(0))
    assert mngr.wait_until_persisted()
    casstore.save(local, 2, tree_for(2), chunk_size_bytes=CHUNK)
    new = object_keys(local, [2]) - object_keys(remote, [0])
    assert new
    local.writes.clear()
    mngr.save(3, tree_for(3))  # returns once staged; its write waits
    mngr.persister.submit(2)
    return mngr, local, new


def test_a_persist_waits_for_the_local_save_in_progress(tmp_path, remote):
    mngr, local, new = _persist_during_a_held_save(tmp_path, remote)
    time.sleep(1.0)
    assert casstore.list_steps(remote) == [0]
    assert not any(remote.exists(k) for k in new)  # no transfer started
    local.writes.set()
    assert mngr.wait_until_persisted()
    assert casstore.list_steps(remote) == [0, 2]
    assert_bit_exact(casstore.restore(remote, 2), 2)
    mngr.close()


def test_a_persist_waits_for_local_saves_at_most_yield_s(tmp_path, remote):
    mngr, local, _ = _persist_during_a_held_save(tmp_path, remote, yield_s=0.5)
    assert mngr.persister.wait(timeout_s=30)  # while step 3's save still waits
    assert casstore.list_steps(remote) == [0, 2]
    assert casstore.list_steps(local) == [0, 2]
    local.writes.set()
    mngr.close()
    assert casstore.list_steps(local) == [0, 2, 3]


def test_a_reopened_manager_persists_what_a_killed_one_left(tmp_path, remote):
    local = LocalStore(tmp_path / "local")
    with casstore.CheckpointManager(local, chunk_size_bytes=CHUNK) as plain:  # no tier yet
        for step in range(7):
            plain.save(step, tree_for(step))
    with manager(local, remote, persist_interval_steps=3) as mngr:
        assert mngr.wait_until_persisted()
        assert casstore.list_steps(remote)[-1] == 6  # the newest eligible step
    assert_bit_exact(casstore.restore(remote, 6), 6)


def test_persistent_retention_and_gc_run_on_the_persistent_tier(tmp_path, remote):
    with manager(tmp_path / "local", remote, persist_interval_steps=1, persistent_max_to_keep=2,
                 gc_after_retention=True, grace_period_s=0) as mngr:
        for step in range(5):
            mngr.save(step, tree_for(step))
            mngr.wait_until_persisted()
        assert casstore.list_steps(remote) == [3, 4]
        assert mngr.all_steps() == [0, 1, 2, 3, 4]  # local keeps all (max_to_keep=None)
    assert casstore.verify(remote).ok
    assert casstore.gc(remote, grace_period_s=0, dry_run=True).deleted_chunks == 0


def test_persistent_keep_period_keeps_every_kth_step_beside_the_latest(tmp_path, remote):
    with manager(tmp_path / "local", remote, persistent_max_to_keep=2,
                 persistent_keep_period=3, max_to_keep=1) as mngr:
        for step in range(8):
            mngr.save(step, tree_for(step))
            mngr.wait_until_persisted()
        assert casstore.list_steps(remote) == [0, 3, 6, 7]  # every 3rd, and the latest 2
        assert casstore.list_steps(tmp_path / "local") == [7]  # local retention: its own values
    for step in (0, 3):
        assert_bit_exact(casstore.restore(remote, step), step)


def test_persistent_best_n_ranks_the_metrics_saved_with_each_step(tmp_path, remote):
    best = casstore.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2)
    losses = [5.0, 1.0, 4.0, 2.0, 3.0]
    with manager(tmp_path / "local", remote, persistent_preservation_policy=best) as mngr:
        for step, loss in enumerate(losses):
            mngr.save(step, tree_for(step), metrics={"loss": loss})
            mngr.wait_until_persisted()
        assert casstore.list_steps(remote) == [1, 3]  # the two lowest losses
        assert mngr.all_steps() == [0, 1, 2, 3, 4]  # local keeps all (max_to_keep=None)
    # A new manager ranks the steps an earlier one persisted by their manifests' metrics.
    with manager(tmp_path / "local2", remote, persistent_preservation_policy=best) as mngr:
        mngr.save(5, tree_for(5), metrics={"loss": 1.5})
        mngr.wait_until_persisted()
    assert casstore.list_steps(remote) == [1, 5]
    assert_bit_exact(casstore.restore(remote, 5), 5)
    # A step someone else deleted there is forgotten, not a failed persist of the next one.
    with manager(tmp_path / "local3", remote, persistent_preservation_policy=best) as mngr:
        casstore.delete(remote, 1)
        for step, loss in ((6, 3.0), (7, 4.0)):
            mngr.save(step, tree_for(step), metrics={"loss": loss})
            assert mngr.wait_until_persisted()
        assert sorted(mngr.persister.persisted) == [6, 7]
    assert casstore.list_steps(remote) == [5, 6]


def test_a_step_deleted_from_the_persistent_tier_behind_the_manager_is_not_counted_kept(
        tmp_path, remote):
    """A step this manager persisted, then someone deleted there: LatestN counted it among
    the steps it keeps and deleted a good one (audit: [2, 3, 4], 3 deleted, 5 persisted left
    [4, 5]); it is now forgotten at the next retention."""
    with manager(tmp_path / "local", remote, persist_interval_steps=1,
                 persistent_max_to_keep=3) as mngr:
        for step in range(5):
            mngr.save(step, tree_for(step))
            mngr.wait_until_persisted()
        assert casstore.list_steps(remote) == [2, 3, 4]
        casstore.delete(remote, 3)
        mngr.save(5, tree_for(5))
        mngr.wait_until_persisted()
        assert casstore.list_steps(remote) == [2, 4, 5]
        assert 3 not in mngr.persister.steps()
    assert_bit_exact(casstore.restore(remote, 2), 2)


def test_a_step_persistent_retention_drops_at_once_leaves_nothing_assumed_there(tmp_path,
                                                                              remote):
    # Step 1 (the worse loss) is persisted, dropped by BestN at once and its own chunks
    # collected (grace 0); step 2 holds the same values: its chunks must be sent again, not
    # assumed there from step 1's persist.
    best = casstore.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=1)
    trees = [tree_for(0), tree_for(1), tree_for(1)]
    with manager(tmp_path / "local", remote, persistent_preservation_policy=best,
                 gc_after_retention=True, grace_period_s=0) as mngr:
        for step, loss in enumerate([2.0, 3.0, 1.0]):
            mngr.save(step, trees[step], metrics={"loss": loss})
            assert mngr.wait_until_persisted()
            if step == 1:
                assert casstore.list_steps(remote) == [0]
    assert casstore.list_steps(remote) == [2]
    assert casstore.verify(remote).ok
    restored = casstore.restore(remote, 2)
    assert restored["head"].tobytes() == trees[2]["head"].tobytes()


def test_a_step_another_process_deleted_there_leaves_nothing_assumed_there(tmp_path, remote):
    with manager(tmp_path / "local", remote) as mngr:
        mngr.save(0, tree_for(0))
        assert mngr.wait_until_persisted()
        casstore.delete(remote, 0)  # another process: step 0 and its chunks gone
        assert casstore.gc(remote, grace_period_s=0).deleted_chunks > 0
        mngr.save(1, tree_for(0))  # the same values: every chunk must be sent again
        assert mngr.wait_until_persisted()
    assert casstore.list_steps(remote) == [1]
    assert casstore.verify(remote).ok
    assert_bit_exact(casstore.restore(remote, 1), 0)


@pytest.mark.parametrize("persistent", ["local", "local/inner", ".", "local://local",
                                        "file://local", "link", "link/inner"])
def test_a_persistent_tier_that_is_or_holds_the_local_one_is_refused(tmp_path, persistent):
    """However the same directory is spelled: a URL, or a symlink to it."""
    (tmp_path / "local").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "local")
    scheme, _, path = persistent.rpartition("://")
    url = f"{scheme}://{tmp_path / path}" if scheme else tmp_path / path
    with pytest.raises(ValueError, match="must be two repositories"):
        casstore.CheckpointManager(tmp_path / "local", persistent=url)
    assert not any((tmp_path / "local").iterdir())


_ALIASED_TIERS = """
import sys, casstore
src, bind = sys.argv[1], sys.argv[2]
for local, persistent in [(src + "/repo", bind + "/repo"), (src + "/new", bind + "/new/inner"),
                          (bind + "/new/x", src + "/new")]:
    try:
        casstore.CheckpointManager(local, persistent=persistent).close()
        print("accepted", local, persistent)
    except ValueError as e:
        print("refused", "must be two repositories" in str(e))
casstore.CheckpointManager(src + "/repo", persistent=bind + "/other").close()
print("two repositories accepted")
"""


def test_one_directory_at_two_paths_through_a_bind_mount_is_refused_as_both_tiers(tmp_path):
    """Local retention would delete the persisted steps. The mount is made in a mount
    namespace of the child process's own (``unshare``), as root or as a mapped root user."""
    (tmp_path / "src" / "repo").mkdir(parents=True)
    (tmp_path / "bind").mkdir()
    out = in_mount_namespace(f"mount --bind {tmp_path / 'src'} {tmp_path / 'bind'}",
                             _ALIASED_TIERS, tmp_path / "src", tmp_path / "bind", timeout=120)
    assert out.stdout.splitlines() == ["refused True"] * 3 + ["two repositories accepted"]


def test_delete_removes_a_step_from_both_tiers_and_a_persisted_only_one(tmp_path, remote):
    with manager(tmp_path / "local", remote, persist_interval_steps=2, max_to_keep=1) as mngr:
        for step in range(4):
            mngr.save(step, tree_for(step))
            assert mngr.wait_until_persisted()
        assert mngr.all_steps() == [0, 2, 3]
        assert casstore.list_steps(remote) == [0, 2]
        mngr.delete(0)  # on the persistent tier only
        mngr.delete(2)  # on both: step 2 was local too until step 3's retention
        assert mngr.all_steps() == [3]
        assert casstore.list_steps(remote) == []
        with pytest.raises(casstore.StepNotFoundError, match="step 2"):
            mngr.delete(2)
        mngr.reload()
        assert mngr.all_steps() == [3]
        assert mngr.latest_step() == 3


def test_a_forced_save_of_a_persisted_step_is_refused_on_a_replaced_node(tmp_path, remote):
    with manager(tmp_path / "local", remote) as mngr:
        mngr.save(0, tree_for(0))
        assert mngr.wait_until_persisted()
    shutil.rmtree(tmp_path / "local")  # the node is replaced
    with manager(tmp_path / "local", remote) as mngr:
        assert not mngr.save(0, tree_for(5))  # not due: step 0 is the latest
        with pytest.raises(casstore.StepAlreadyExistsError, match=r"persistent tier.*step 0"):
            mngr.save(0, tree_for(5), force=True)
        assert casstore.list_steps(tmp_path / "local") == []
        assert_bit_exact(mngr.restore(0), 0)


def test_a_replaced_node_saves_on_the_interval_of_the_persisted_run(tmp_path):
    # The save decision saw only the (empty) local tier: a run without steps, whose first
    # step is always saved, so the step after the persisted one was saved off the interval.
    options = {"persistent": str(tmp_path / "persistent"), "save_interval_steps": 5,
               "persist_interval_steps": 5}
    with casstore.CheckpointManager(tmp_path / "local", **options) as mngr:
        for step in range(13):
            mngr.save(step, tree_for(step))
    assert casstore.list_steps(tmp_path / "persistent")[-1] == 10  # 5 may lose to 10
    shutil.rmtree(tmp_path / "local")  # the node is replaced
    with casstore.CheckpointManager(tmp_path / "local", **options) as mngr:
        assert mngr.latest_step() == 10
        assert [s for s in range(11, 21) if mngr.should_save(s)] == [15, 20]
        assert not mngr.save(11, tree_for(11))
        assert mngr.save(15, tree_for(15))
    assert casstore.list_steps(tmp_path / "local") == [15]


def test_delete_waits_for_a_running_persist_so_the_step_does_not_come_back(
        tmp_path, object_servers):
    server = object_servers["seaweedfs"]
    with fault_proxy(server.endpoint_url) as proxy:
        remote = FsspecStore.from_url(server.url_for("deleting"), **{
            **server.storage_options, "endpoint_url": proxy.endpoint_url})
        with manager(tmp_path / "local", remote) as mngr:
            proxy.set("trickle", rate_bytes_s=100_000)  # step 0's persist takes ~1 s
            mngr.save(0, tree_for(0))
            mngr.wait_until_finished()
            deadline = time.monotonic() + 10
            while mngr.persister._running != 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert mngr.persister._running == 0  # persisting, slowly
            mngr.delete(0)
            assert mngr.wait_until_persisted()
            assert mngr.all_steps() == []
        assert casstore.list_steps(remote) == []
        assert casstore.list_steps(tmp_path / "local") == []


def test_local_retention_never_deletes_a_step_whose_persist_is_pending(tmp_path, object_servers):
    server = object_servers["seaweedfs"]
    url = server.url_for("pending")
    with fault_proxy(server.endpoint_url) as proxy:
        remote = FsspecStore.from_url(url, **{**server.storage_options,
                                              "endpoint_url": proxy.endpoint_url})
        mngr = manager(tmp_path / "local", remote, persist_interval_steps=2, max_to_keep=1)
        proxy.set("trickle", rate_bytes_s=200_000)
        held = False
        for step in range(5):
            mngr.save(step, tree_for(step))
            mngr.wait_until_finished()
            local_steps = casstore.list_steps(tmp_path / "local")
            assert mngr.persister.pending() <= set(local_steps), local_steps
            held = held or len(local_steps) > 1  # max_to_keep=1 waited for a persist
        assert held
        proxy.set(None)
        assert mngr.wait_until_persisted()
        mngr.save(5, tree_for(5))
        mngr.close()
        assert casstore.list_steps(tmp_path / "local") == [5]
        assert 4 in casstore.list_steps(remote)


def test_the_example_persists_every_nth_step_and_prints_the_bytes(tmp_path):
    example = pathlib.Path(__file__).parents[1] / "examples" / "finetune_minilm.py"
    local, remote = tmp_path / "local", tmp_path / "remote"
    # Batches of 8, as test_example.py runs it: what each step persists does not depend on it.
    out = subprocess.run([sys.executable, str(example), "--url", str(local), "--steps", "3",
                          "--persistent", str(remote), "--persist-interval", "2",
                          "--batch-size", "8"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = re.findall(r"^\s*(\d+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s.*x\s+[\d.]+(?:\s+([\d.]+))?$",
                      out.stdout, re.M)
    persisted = {int(step): float(mb) for step, _, mb in rows if mb}
    assert [int(r[0]) for r in rows] == [0, 1, 2]
    assert set(persisted) == {0, 2}
    assert casstore.list_steps(remote) == [0, 2]
    stored = sum(i.size for i in list_chunk_objects(LocalStore(remote)))
    assert abs(sum(persisted.values()) - stored / 1e6) < 0.02  # rounding of the printed MB
    assert_same = casstore.restore(remote, 2), casstore.restore(local, 2)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(
        *(jax.tree.leaves(t) for t in assert_same)))


def test_an_unreachable_persistent_tier_leaves_the_local_tier_working(tmp_path, object_servers):
    server = object_servers["seaweedfs"]
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    remote = FsspecStore.from_url(server.url_for("unreachable"), **{
        **server.storage_options, "endpoint_url": f"http://127.0.0.1:{port}"}, **DEADLINES)
    remote.policy.backoff_s = 0.05
    with pytest.raises(casstore.PersistError,
                       match="could not be listed and the local tier has no step"):
        manager(tmp_path / "local", remote)  # a replaced node must not start over
    casstore.save(tmp_path / "local", 0, tree_for(0))  # with a local step it starts
    mngr = manager(tmp_path / "local", remote, persist_interval_steps=1)
    errors = []
    for step in range(1, 4):
        try:
            mngr.save(step, tree_for(step), force=True)
        except (casstore.PersistError, casstore.StoreTimeoutError) as e:
            errors.append(e)
    with contextlib.suppress(casstore.PersistError, casstore.StoreTimeoutError):
        mngr.close()
    assert errors
    assert all(f"127.0.0.1:{port}" in str(e) or remote.url in str(e)
                          for e in errors)
    assert casstore.list_steps(tmp_path / "local")  # saves went on locally
    for step in casstore.list_steps(tmp_path / "local"):
        assert_bit_exact(casstore.restore(tmp_path / "local", step), step)
    # the manager restores its latest step without asking the unreachable tier for it
    mngr = manager(tmp_path / "local", remote, persist_interval_steps=1)
    latest = mngr.latest_step()
    assert_bit_exact(mngr.restore(), latest)
    assert mngr.metadata() is None
    with contextlib.suppress(casstore.PersistError, casstore.StoreTimeoutError):
        mngr.close()


def test_a_tier_unreachable_at_start_is_listed_before_the_next_persist(tmp_path,
                                                                       object_servers):
    """Persisted steps 0 and 5 of another node; this one starts from its local step 3 while the
    tier stalls, then persists 5: listing the tier first, it refuses to put a second step 5
    there (it persisted the local 5 over nothing: it knew no steps)."""
    server = object_servers["seaweedfs"]
    url = server.url_for("late")
    direct = FsspecStore.from_url(url, **server.storage_options)
    with manager(tmp_path / "a", direct, persist_interval_steps=5) as mngr:
        for step in (0, 5):
            mngr.save(step, tree_for(step), force=True)
    casstore.save(tmp_path / "b", 3, tree_for(3))
    with fault_proxy(server.endpoint_url) as proxy:
        remote = FsspecStore.from_url(url, **{**server.storage_options,
                                              "endpoint_url": proxy.endpoint_url}, **DEADLINES)
        remote.policy.backoff_s = 0.05
        proxy.set("stall")
        mngr = manager(tmp_path / "b", remote, persist_interval_steps=5)
        proxy.set(None)
        assert mngr.all_steps() == [3]  # unknown yet
        with pytest.raises((casstore.PersistError, casstore.StoreTimeoutError),
                           match=rf"url '{re.escape(remote.url)}', run 'default'"):
            mngr.save(4, tree_for(4), force=True)  # the listing's error, on the next save
        mngr.save(5, {**tree_for(5), "head": tree_for(5)["head"] + 1}, force=True)
        with pytest.raises(casstore.PersistError, match="another step of this number"):
            mngr.wait_until_persisted()
        assert mngr.all_steps() == [0, 3, 5]  # listed again
        with contextlib.suppress(casstore.PersistError):
            mngr.close()
    assert_bit_exact(casstore.restore(direct, 5), 5)  # not replaced


def test_a_killed_saves_lock_postpones_gc_after_retention_instead_of_blocking(tmp_path,
                                                                              object_servers,
                                                                              monkeypatch):
    """A process killed mid-save leaves its save lock for hours; GC after retention (either
    tier) must neither wait 600 s for it in the background nor hold up close()."""
    from casstore._gc import RetentionGc
    from casstore._locks import _put_lock

    # Each retention GC waits this long for the dead locks before it postpones (2 s: 6 waits
    # were most of this test's 11 s); no save of this process is in flight when one runs.
    monkeypatch.setattr(RetentionGc, "LOCK_WAIT_S", 0.5)
    remote = object_store(object_servers["seaweedfs"])
    casstore.save(remote, 0, tree_for(0))
    dead = [_put_lock(remote, "save"), _put_lock(casstore.open_store(tmp_path / "local"),
                                                 "save")]
    t0 = time.monotonic()
    with manager(tmp_path / "local", remote, max_to_keep=1, persistent_max_to_keep=1,
                 gc_after_retention=True, grace_period_s=0) as mngr:
        for step in range(1, 4):
            mngr.save(step, tree_for(step))
            mngr.wait_until_persisted()
        assert mngr.last_gc_info is None  # postponed on both tiers
        assert mngr.persister.last_gc_info is None
        remote.delete(dead[0])
        casstore.open_store(tmp_path / "local").delete(dead[1])
        mngr.save(4, tree_for(4))
        mngr.wait_until_persisted()
        assert mngr.last_gc_info.deleted_chunks > 0  # then done
        assert mngr.persister.last_gc_info.deleted_chunks > 0
    assert time.monotonic() - t0 < 120
    assert casstore.list_steps(remote) == [4]
    assert casstore.verify(remote).ok
    assert_bit_exact(casstore.restore(remote, 4), 4)


class RefusingStore(MemoryStore):
    """A persistent tier that lists but refuses every write, at once."""

    def _put(self, key, data, *, exclusive):
        raise OSError("injected: the persistent tier refuses writes")


def test_a_synchronous_save_that_raises_a_persist_error_has_saved_nothing(tmp_path):
    """enable_async_checkpointing=False: a persist's error surfaces at the start of the next
    call, which then saves nothing; never after a commit (the caller would retry a saved step)."""
    mngr = manager(tmp_path / "local", RefusingStore(), enable_async_checkpointing=False)
    outcomes = []
    for step in range(30):
        try:
            mngr.save(step, tree_for(step), force=True)
            outcomes.append("saved")
        except casstore.PersistError:
            outcomes.append("refused")
        assert (step in casstore.list_steps(tmp_path / "local")) == (outcomes[-1] == "saved")
    assert "refused" in outcomes
    assert "saved" in outcomes
    with contextlib.suppress(casstore.PersistError):
        mngr.close()


def test_a_step_that_is_no_int_is_a_value_error_with_a_persistent_tier(tmp_path):
    """A float, a negative or a bool step is a ValueError before the tiers see it (a jax
    scalar once leaked TypeError: unhashable from them); an integer jax or numpy scalar is
    its int."""
    with manager(tmp_path / "local", MemoryStore()) as mngr:
        for step in (6.0, -1, np.bool_(True), jax.numpy.float32(6)):
            with pytest.raises(ValueError, match="invalid step"):
                mngr.save(step, tree_for(6), force=True)
        assert mngr.all_steps() == []
        assert mngr.save(jax.numpy.int32(6), tree_for(6), force=True)
        assert mngr.save(np.int64(7), tree_for(7), force=True)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [6, 7]
        assert all(type(s) is int for s in mngr.all_steps())


def test_storage_options_reach_the_persistent_tier_given_as_a_url(tmp_path, object_servers):
    """A local path and an s3:// URL: the options (endpoint, keys) are the persistent tier's;
    they went to the local tier only, which refused them for a path."""
    server = object_servers["seaweedfs"]
    url = server.url_for("options")
    with casstore.CheckpointManager(tmp_path / "local", persistent=url,
                                    **server.storage_options) as mngr:
        mngr.save(0, tree_for(0))
        assert mngr.wait_until_persisted()
    assert_bit_exact(casstore.restore(casstore.open_store(url, **server.storage_options), 0), 0)
    with pytest.raises(ValueError, match="storage_options are for fsspec URLs, and none of"):
        casstore.CheckpointManager(tmp_path / "local", persistent=tmp_path / "other",
                                   **server.storage_options)


# the processes of two_processes, forked after jax's import
JOBS = LazyForkServer(lambda: multihost_env(CASSTORE_MULTIHOST_TIMEOUT_S="8"))


@pytest.fixture(scope="module", autouse=True)
def _close_the_fork_server():
    yield
    JOBS.close()


def two_processes(tmp_path, server, remote, *args: str) -> list[str]:
    """The outputs of the two processes of tests/tiers_multiprocess_worker.py (each exited
    with 0), saving into ``tmp_path / "local"`` and persisting to ``remote``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = pathlib.Path(__file__).with_name("tiers_multiprocess_worker.py")
    processes = [[worker, port, i, tmp_path / "local", remote.url,
                  json.dumps(server.storage_options), *args] for i in range(2)]
    results = JOBS.run(processes, [tmp_path / f"process-{i}.txt" for i in range(2)],
                       timeout_s=180)
    for code, out in results:
        assert code == 0, out[-3000:]
    return [out for _, out in results]


def line_of(out: str, prefix: str) -> str:
    """The first line of a worker's output that starts with ``prefix``."""
    return next(x for x in out.splitlines() if x.startswith(prefix))


def test_two_jax_processes_each_persist_a_share_and_process_0_commits(tmp_path,
                                                                        object_servers):
    server = object_servers["seaweedfs"]
    remote = object_store(server)
    sent, lookups, steps = [], [], []
    outs = two_processes(tmp_path, server, remote, "5")
    for out in outs:
        assert "OK" in out, out[-3000:]
        steps.append(line_of(out, "STEPS "))
        line = line_of(out, "SENT ")
        sent.append([int(n) for n in line.rsplit(" ", 2)[1:]])  # chunks, bytes
        lookups.append(int(line_of(out, "LOOKUPS ")[8:]))
    persisted = casstore.list_steps(remote)
    # Process 1 looks up each object of its share once per round, except those of the step
    # persisted before (process 0 tells it which; the frozen leaf's chunks are there).
    manifests = [casstore.read_manifest(remote, step) for step in persisted]
    refs = [{r.key for leaf in m.leaves for r in leaf.chunks} for m in manifests]
    share = [{k for k in needed_objects(m) if share_of(k, 2) == 1} for m in manifests]
    assert lookups[1] == sum(len(mine - known) for mine, known in zip(share, [set(), *refs]))
    assert lookups[1] < sum(map(len, share)), (lookups, [len(x) for x in share])
    # Both processes sent objects; process 0's counts are every process's (its own included).
    assert sent[1][0] > 0, sent
    assert sent[0][0] > sent[1][0], sent
    stored = {info.key: info.size for info in remote.list("") if is_object_key(info.key)}
    assert sent[0][1] == sum(stored.values()), (sent, len(stored))  # each object sent once
    assert set(persisted) <= {0, 2, 4}
    assert persisted[-1] == 4
    # Process 1 knows the persisted steps as process 0 does (told at each round and the end).
    assert steps[0] == steps[1] == f"STEPS {persisted}", steps
    rounds = [int(k) for k in line_of(outs[0], "ROUNDS ")[7:].strip("[]").split(", ")]
    assert len(rounds) <= 2, rounds  # the last round and the stop: earlier ones deleted
    assert casstore.verify(remote).ok
    for step in persisted:
        restored = casstore.restore(remote, step)
        w = np.arange(64 * 48, dtype=np.float32).reshape(64, 48) * step
        assert restored["state"]["w"].tobytes() == w.tobytes()
        assert restored["state"]["b"].tobytes() == np.full(48, step, np.float32).tobytes()


def test_wait_until_persisted_returns_on_every_process_once_process_0_committed(
        tmp_path, object_servers):
    # Process 0 writes each manifest 2 s after the shares are in: process 1's
    # wait_until_persisted() must still return only once the newest eligible step is there.
    server = object_servers["seaweedfs"]
    remote = object_store(server)
    seen = [line_of(out, "SEEN ") for out in two_processes(tmp_path, server, remote, "5",
                                                            "slow0")]
    assert seen[0] == seen[1], seen
    assert seen[1].endswith("4]"), seen  # steps 0, 2 and 4 are eligible; the newest wins


def test_when_one_process_cannot_send_its_share_no_step_appears_and_both_say_so(
        tmp_path, object_servers):
    server = object_servers["seaweedfs"]
    remote = object_store(server)
    errors = [line_of(out, "PERSIST-ERROR")
              for out in two_processes(tmp_path, server, remote, "1", "fail1")]
    assert "process 1" in errors[0], errors  # process 0 names who failed, step and URL
    assert "step 0" in errors[0], errors
    assert "read-only" in errors[1].lower() or "read only" in errors[1].lower(), errors
    assert casstore.list_steps(remote) == []  # no manifest without every share
    assert casstore.list_steps(tmp_path / "local") == [0]  # the local tier has the step


@pytest.mark.parametrize(("kwargs", "named"), [({"persist_interval_steps": 0}, "persist_interval"),
                                           ({"persist_interval_steps": None}, "persist_interval"),
                                           ({"persistent_max_to_keep": 0}, "persistent_max"),
                                           ({"persistent_keep_period": 0}, "persistent_keep"),
                                           ({"persistent_max_to_keep": 2,
                                             "persistent_preservation_policy":
                                                 casstore.LatestN(1)}, "replaces")])
def test_bad_tier_arguments_are_refused_naming_them(tmp_path, kwargs, named):
    with pytest.raises(ValueError, match=named):
        casstore.CheckpointManager(tmp_path / "local", persistent=tmp_path / "remote", **kwargs)


def test_with_half_the_local_chunks_gone_only_those_are_read_remotely(tmp_path, remote):
    local = LocalStore(tmp_path / "local")
    casstore.save(local, 1, tree_for(1), chunk_size_bytes=CHUNK, delta=False)
    casstore.copy(local, remote)
    keys = sorted(object_keys(local, [1]))
    gone = keys[::2]
    sizes = {k: local.stat(k).size for k in keys}
    for key in gone:
        local.delete(key)
    tiered = casstore.FallbackStore(local, [remote])
    assert_bit_exact(casstore.restore(tiered, 1), 1)
    assert tiered.bytes_read[remote.url] == sum(sizes[k] for k in gone)
    assert tiered.objects_recovered == len(gone)
    assert not any(local.exists(k) for k in gone)  # no write-back unless asked


def test_a_damaged_local_base_of_a_delta_is_taken_from_the_persistent_tier(tmp_path, remote):
    """Step 1 is local only and stores a delta on a chunk of step 0, which is persisted. With
    that base damaged locally, a restore of step 1 pairs the local delta with the persistent
    tier's base (and, with ``write_back``, puts the base back locally)."""
    w = np.random.default_rng(3).normal(size=(256, 64)).astype(np.float32)
    trees = [{"w": np.where(np.arange(256)[:, None] == s, w + 1, w)} for s in range(2)]
    local = LocalStore(tmp_path / "local")
    with manager(local, remote, persist_interval_steps=2) as mngr:
        for step, state in enumerate(trees):
            mngr.save(step, state)
        mngr.wait_until_finished()
    assert casstore.list_steps(remote) == [0]
    ref = next(r for leaf in casstore.read_manifest(local, 1).leaves for r in leaf.chunks
               if r.base is not None)
    base = pathlib.Path(local.root) / chunk_key(ref.base)
    data = bytearray(base.read_bytes())
    data[len(data) // 2] ^= 0x10
    base.write_bytes(bytes(data))
    with manager(local, remote, persist_interval_steps=2) as mngr:
        assert mngr.restore(1)["w"].tobytes() == trees[1]["w"].tobytes()
    assert not casstore.verify(local).ok
    tiers = casstore.FallbackStore(local, [remote], write_back=True)
    assert casstore.restore(tiers, 1)["w"].tobytes() == trees[1]["w"].tobytes()
    assert casstore.verify(local).ok  # the base written back, the local delta kept


def test_a_damaged_local_delta_is_named_alone_not_the_intact_persistent_base(
        tmp_path, remote, caplog):
    """The pair of the local (damaged) delta and the persistent base failed first, and its
    warning named both tiers: "copies of deltas/... in LOCAL and REMOTE unusable", though
    the persistent tier's copies are intact and the restore takes them."""
    w = np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)
    changed = w.copy()
    changed[::16] *= np.float32(1 + 1e-4)
    local = LocalStore(tmp_path / "local")
    casstore.save(local, 0, {"w": w})
    casstore.save(local, 1, {"w": changed})
    casstore.copy(local, remote)
    ref = next(r for leaf in casstore.read_manifest(local, 1).leaves for r in leaf.chunks
               if r.base is not None)
    path = pathlib.Path(local.root) / ref.key
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="casstore"):
        restored = casstore.restore(casstore.FallbackStore(local, [remote]), 1)
    assert restored["w"].tobytes() == changed.tobytes()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"the copy of {ref.key} in {local.url} unusable" in warnings[0]
    assert remote.url not in warnings[0]


@pytest.mark.parametrize(("damage", "error"), [
    ("truncated", "not msgpack"),
    # the scalar leaf "step" (0) as 1: still a valid manifest, which its digest refuses
    ("a scalar leaf's bit flipped", "its bytes do not match its digest"),
])
def test_a_damaged_local_manifest_of_a_persisted_step_is_read_from_the_persistent_tier(
        tmp_path, remote, damage, error):
    local = LocalStore(tmp_path / "local")
    with manager(local, remote) as mngr:
        mngr.save(0, tree_for(0))
        assert mngr.wait_until_persisted()
    path = pathlib.Path(local.root) / manifest_key("default", 0)
    data = path.read_bytes()
    if damage == "truncated":
        data = data[:50]
    else:
        at = data.index(b"\xa5value\x00") + len(b"\xa5value")
        data = data[:at] + b"\x01" + data[at + 1:]
    path.write_bytes(data)
    with pytest.raises(casstore.ManifestError,
                       match=rf"invalid manifest: {error}.*url '{re.escape(local.url)}'"
                       r".*step 0\)"):
        casstore.restore(local, 0)
    assert casstore.verify(local).manifests_damaged == 1
    assert_bit_exact(casstore.restore(local, 0, fallback=remote), 0)
    with manager(local, remote) as mngr:
        assert_bit_exact(mngr.restore(0), 0)


def _unreadable(path: pathlib.Path) -> None:
    """Makes the object at ``path`` unreadable with a real filesystem error other than a
    missing file, as a bad disk block's EIO or a file's EACCES is to its reader: a symlink to
    itself, which every open and stat refuses (ELOOP)."""
    path.unlink()
    path.symlink_to(path.name)


def test_unreadable_local_objects_are_read_from_the_persistent_tier_and_named_without_it(
        tmp_path, remote, caplog):
    local = LocalStore(tmp_path / "local")
    with manager(local, remote, persist_interval_steps=1) as mngr:
        for step in range(3):
            mngr.save(step, tree_for(step))
            assert mngr.wait_until_persisted()
    base = next(leaf for leaf in casstore.read_manifest(local, 1).leaves if leaf.path == "base")
    chunk = base.chunks[0]
    _unreadable(pathlib.Path(local._path(chunk.key)))  # of the frozen base: in every step
    _unreadable(pathlib.Path(local.root) / manifest_key("default", 2))
    with pytest.raises(OSError, match="Too many levels of symbolic links") as info:
        casstore.restore(local, 1)
    assert not isinstance(info.value, FileNotFoundError)
    assert f"reading chunk {chunk.id} of key path 'base' (run 'default', step 1)" in " ".join(
        info.value.__notes__)
    with pytest.raises(OSError, match="Too many levels") as info:
        casstore.restore(local, 2)
    assert "reading the manifest of run 'default', step 2" in " ".join(info.value.__notes__)
    report = casstore.verify(local)  # each named as a problem: verify does not raise
    assert sorted((p.kind, p.step, p.chunk_id) for p in report.problems) == [
        ("corrupt", None, chunk.id), ("manifest", 2, None)]
    assert all("Too many levels" in p.message for p in report.problems)
    with pytest.raises(casstore.ManifestError, match=r"gc refused.*default@2"):
        casstore.gc(local, grace_period_s=0)
    with caplog.at_level(logging.WARNING, logger="casstore"):
        for step in (1, 2):
            assert_bit_exact(casstore.restore(local, step, fallback=remote), step)
    assert f"{chunk.key} in {local.url} unreadable" in caplog.text
    assert f"{manifest_key('default', 2)} in {local.url} unreadable" in caplog.text
    # A save whose run's latest manifest and a reused chunk are unreadable stores it again.
    casstore.save(local, 3, tree_for(3), chunk_size_bytes=CHUNK)
    assert_bit_exact(casstore.restore(local, 3), 3)
    with manager(local, remote, persist_interval_steps=1) as mngr:
        assert mngr.all_steps() == [0, 1, 2, 3]
        assert_bit_exact(mngr.restore(2), 2)


def test_a_fallback_store_is_a_read_only_view(tmp_path):
    """exists() answers for every tier, so a save through the view would skip the chunks only
    a fallback holds and leave the primary a step it cannot restore: refused."""
    local, remote = LocalStore(tmp_path / "local"), LocalStore(tmp_path / "remote")
    casstore.save(remote, 0, tree_for(0))
    with pytest.raises(casstore.ReadOnlyStoreError,
                       match=r"a FallbackStore is a read view of its tiers; save to its primary;"
                       rf" nothing was saved \(url '{re.escape(local.url)}', run 'default', "
                       r"step 1\)"):
        casstore.save(casstore.FallbackStore(local, [remote]), 1, tree_for(0))
    assert casstore.list_steps(local) == []


def test_a_save_in_flight_at_interpreter_exit_is_persisted_before_the_process_ends(tmp_path):
    """The persister's exit hook ran before the saver's (threading's hooks run in reverse):
    it found nothing queued, the saver's hook then committed the step and queued its persist,
    and the process ended with the persist half done (audit). Now the step is on both tiers."""
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    child = ("import sys, numpy as np, casstore\n"
             "m = casstore.CheckpointManager(sys.argv[1], persistent=sys.argv[2],\n"
             "                              chunk_size_bytes=1 << 20)\n"
             "m.save(0, {'w': np.arange(4 << 20, dtype=np.float32)})\n"
             "print('exits without waiting', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", child, str(local), str(persistent)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert casstore.list_steps(local) == [0]
    assert casstore.list_steps(persistent) == [0]
    assert casstore.verify(persistent).ok


def test_a_delete_the_persistent_tier_refuses_names_the_step_and_that_tier(tmp_path):
    """A refused delete there raised the store's error naming only the object (exploratory
    session's repro); the step stays on that tier and in the manager's list."""
    from casstore.testing import FaultyStore

    remote = FaultyStore(casstore.open_store(tmp_path / "remote"), seed=0, rate=0.0,
                         ops=("delete",), kinds=("error",))
    mngr = casstore.CheckpointManager(tmp_path / "local", persistent=remote)
    mngr.save(0, {"x": np.ones(2)})
    assert mngr.wait_until_persisted(30)
    remote.rate = 1.0
    with pytest.raises(ConnectionResetError, match="injected fault: delete") as e:
        mngr.delete(0)
    assert e.value.__notes__ == [f"casstore: step 0 stays on the persistent tier {remote.url}"]
    assert 0 in mngr.all_steps()
    assert casstore.list_steps(tmp_path / "remote") == [0]
    remote.rate = 0.0
    mngr.close()
