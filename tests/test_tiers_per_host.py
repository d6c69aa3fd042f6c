"""Tiered checkpoints with a local tier per host (``local_per_host=True``, docs/tiers.md
"Per-host local tiers"): two ``jax.distributed`` processes, each with a local directory of its
own (tests/tiers_per_host_worker.py), persisting to SeaweedFS."""

import json
import pathlib
import shutil
import socket

import numpy as np
import pytest
from forkserver import LazyForkServer, multihost_env

import casstore
from casstore._coordinator import PART_BYTES, get_large, set_large
from casstore._layout import is_object_key
from casstore.store import MemoryStore

from conftest import object_store

# the processes of a job, forked after jax's import
JOBS = LazyForkServer(lambda: multihost_env(CASSTORE_MULTIHOST_TIMEOUT_S="20"))


@pytest.fixture(scope="module", autouse=True)
def _close_the_fork_server():
    yield
    JOBS.close()


def two_hosts(tmp_path, server, remote, mode: str) -> list[str]:
    """The outputs of the two processes of tests/tiers_per_host_worker.py (each exited with
    0), process ``i`` saving into ``tmp_path / f"local-{i}"`` and persisting to ``remote``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = pathlib.Path(__file__).with_name("tiers_per_host_worker.py")
    processes = [[worker, port, i, tmp_path, remote.url, json.dumps(server.storage_options),
                  mode] for i in range(2)]
    results = JOBS.run(processes, [tmp_path / f"{mode}-{i}.txt" for i in range(2)],
                       timeout_s=180)
    for code, out in results:
        assert code == 0, out[-3000:]
        assert "\nOK" in out, out[-3000:]
    return [out for _, out in results]


def lines(out: str, prefix: str) -> list[str]:
    """The lines of a worker's output that start with ``prefix``, without it."""
    return [x[len(prefix) + 1:] for x in out.splitlines() if x.startswith(prefix + " ")]


def objects(path) -> set[str]:
    return {info.key for info in casstore.open_store(path).list("") if is_object_key(info.key)}


def test_each_host_stores_its_part_restores_locally_and_sends_each_object_once(
        tmp_path, object_servers):
    server = object_servers["seaweedfs"]
    remote = object_store(server)
    outs = two_hosts(tmp_path, server, remote, "save")
    # each local tier holds the step's manifest and its own part: process 0 rows 0-31 of
    # state/w, process 1 rows 32-63, both the replicated state/b and the numpy state/n
    manifests = [casstore.read_manifest(tmp_path / f"local-{i}", 3) for i in range(2)]
    assert manifests[0] == manifests[1]
    held = [objects(tmp_path / f"local-{i}") for i in range(2)]
    for leaf in manifests[0].leaves:
        for ref in leaf.chunks:
            if leaf.path == "state/w":
                owner = 0 if ref.start[0] < 32 else 1
                assert ref.key in held[owner], (leaf.path, ref.start)
                assert ref.key not in held[1 - owner], (leaf.path, ref.start)
            else:
                assert ref.key in held[0], leaf.path
                assert ref.key in held[1], leaf.path
    # so verify on one host's directory reports the other host's chunks missing (by design)
    report = casstore.verify(tmp_path / "local-1")
    assert {p.kind for p in report.problems} == {"missing"}
    assert {p.key_path for p in report.problems} == {"state/w"}
    # step 3 restores bit-exact on both hosts from their local tiers alone
    for out in outs:
        assert lines(out, "RESTORED") == ["3 True 0"], out[-3000:]
        # whole on one process (another topology): the other host's 32 rows of state/w (6,144
        # raw bytes, and the objects' headers) from the persistent tier, the rest local
        step, exact, remote_bytes = lines(out, "WHOLE")[0].split()
        assert (step, exact) == ("2", "True"), out[-3000:]
        assert 32 * 48 * 4 < int(remote_bytes) < 32 * 48 * 4 + 200, remote_bytes
        assert lines(out, "STEPS")[-1] == "[0, 1, 2, 3]"
        assert lines(out, "PERSISTED") == ["[0, 2]"]
    assert casstore.list_steps(remote) == [0, 2]
    assert casstore.verify(remote).ok
    # every object there was sent once, by one of the hosts that hold it; both sent some
    stored = {info.key: info.size for info in remote.list("") if is_object_key(info.key)}
    sent = [[int(n) for n in lines(out, "SENT")[0].split()] for out in outs]
    assert sent[0] == [len(stored), sum(stored.values())], (sent, len(stored))
    assert 0 < sent[1][0] < sent[0][0], sent
    for step in (0, 2):
        assert (casstore.read_manifest(remote, step)
                == casstore.read_manifest(tmp_path / "local-0", step))

    # (b) host 1 is replaced: its local directory is empty when the job restarts
    shutil.move(tmp_path / "local-1", tmp_path / "old-1")
    outs = two_hosts(tmp_path, server, remote, "reopen")
    for i, out in enumerate(outs):
        assert lines(out, "LATEST") == ["2"], out[-3000:]  # the newest persisted step
        assert lines(out, "STEPS")[0] == "[0, 2]"
        step, exact, remote_bytes = lines(out, "RESTORED")[0].split()
        assert (step, exact) == ("2", "True"), out[-3000:]
        # host 0 still has its chunks (step 2's manifest there was dropped: not on host 1)
        assert (int(remote_bytes) > 10_000) == (i == 1), (i, remote_bytes)
        # steps 3 and 4 are saved again from there, 4 persisted
        assert lines(out, "STEPS")[-1] == "[0, 2, 3, 4]"
    assert casstore.list_steps(remote) == [0, 2, 4]
    assert casstore.verify(remote).ok
    restored = casstore.restore(remote, 4)
    assert restored["state"]["w"].tobytes() == (
        np.arange(64 * 48, dtype=np.float32).reshape(64, 48) * 5).tobytes()

    # (c) host 1's old disk comes back: its step 3 is the first job's, host 0's the second's.
    # Both listed step 3, and each host restored its own save of it; a step is on every host
    # only where every host holds the same manifest.
    shutil.rmtree(tmp_path / "local-1")
    shutil.move(tmp_path / "old-1", tmp_path / "local-1")
    for out in two_hosts(tmp_path, server, remote, "look"):
        assert lines(out, "STEPS")[0] == "[0, 2, 4]", out[-3000:]
        assert lines(out, "RESTORED")[0].split()[:2] == ["4", "True"], out[-3000:]


def test_an_object_on_no_host_and_not_persisted_fails_the_persist_naming_it(
        tmp_path, object_servers):
    server = object_servers["seaweedfs"]
    remote = object_store(server)
    outs = two_hosts(tmp_path, server, remote, "hide")
    hidden = lines(outs[0], "HIDDEN")[0]
    error = lines(outs[0], "PERSIST-ERROR")
    assert error, outs[0][-3000:]
    assert hidden in error[0], error  # the object, the step and the URL
    assert "step 0" in error[0], error
    assert remote.url in error[0], error
    assert casstore.list_steps(remote) == []  # no manifest written
    assert lines(outs[0], "PERSISTED") == ["[]"]  # (process 1 counts its share's sends)
    for out in outs:  # both list the local steps only
        assert lines(out, "STEPS")[-1] == "[0, 1]", out[-3000:]


def test_a_host_whose_copy_of_the_manifest_lands_late_still_takes_part_in_its_persist(
        tmp_path, object_servers):
    # process 0 starts step 0's persist as soon as it committed; process 1 writes its copy of
    # the manifest 2 s later and must wait for it before it says what it holds
    server = object_servers["seaweedfs"]
    remote = object_store(server)
    outs = two_hosts(tmp_path, server, remote, "slow1")
    for out in outs:
        assert not lines(out, "PERSIST-ERROR"), out[-3000:]
        assert lines(out, "PERSISTED") == ["[0]"], out[-3000:]
    assert casstore.list_steps(remote) == [0]
    assert casstore.verify(remote).ok


def test_a_small_leaf_on_process_0_only_beside_packed_numpy_leaves_saves_and_restores(
        tmp_path, object_servers):
    """Process 0 packed its own small jax leaf with the numpy leaves, the other process the
    numpy leaves alone: their packs differed, and every save failed as if the processes had
    saved different numpy values (exploratory session's repro). (That refusal now names the
    key path too.)"""
    server = object_servers["seaweedfs"]
    for out in two_hosts(tmp_path, server, object_store(server), "stages"):
        assert lines(out, "STAGES") == ["True True True"], out[-3000:]


def test_a_step_deleted_on_every_process_while_it_persists_fails_no_save(tmp_path,
                                                                         object_servers):
    """Process 1 deleted its copy of step 2 before its part of the step's persist round: the
    persist failed, and its error (then process 1's own) failed the next two saves on every
    process, which saved nothing (exploratory session's repro)."""
    server = object_servers["seaweedfs"]
    remote = object_store(server)
    for out in two_hosts(tmp_path, server, remote, "delete"):
        assert "ERROR" not in out, out[-3000:]
        assert lines(out, "STEPS")[-1] == "[0, 1, 3, 4]", out[-3000:]
    assert casstore.list_steps(remote) == [0, 4]


@pytest.mark.parametrize(("mode", "why"), [
    ("full1", "process 1: OSError: [Errno 28] No space left"),
    ("slowcopy", "process 1 did not say whether it wrote its copy within 6 s")])
def test_a_manifest_copy_one_host_cannot_write_withdraws_the_step_on_every_host(
        tmp_path, object_servers, mode, why):
    """Process 1's disk could not take its copy of step 1's manifest: its save failed while
    process 0's succeeded, so the processes listed different steps (process 0: [0, 1, 2]).
    A copy written after the multi-process timeout (``slowcopy``) left the step on process 1
    alone, and every later save failed (exploratory session's repro)."""
    server = object_servers["seaweedfs"]
    remote = object_store(server)
    for out in two_hosts(tmp_path, server, remote, mode):
        error = lines(out, "SAVE-ERROR")
        assert len(error) == 1, out[-3000:]
        assert error[0].startswith("1 "), error
        assert why in error[0], error
        assert "withdrawn from every process" in error[0], error
        assert lines(out, "LISTED") == ["[0, 2]"], out[-3000:]
        assert lines(out, "STEPS")[-1] == "[0, 2]", out[-3000:]
        assert lines(out, "PERSISTED") in (["[0, 2]"], ["[]"]), out[-3000:]
    assert casstore.list_steps(remote) == [0, 2]


def test_a_step_process_0_drops_from_its_backlog_leaves_every_host_alike(tmp_path,
                                                                         object_servers):
    """The persistent tier slower than the saves: process 0 dropped steps from its backlog
    (the newest pending step wins) and its retention deleted them, while the other process
    kept every step noted since the last round (10 of 10 against process 0's 2 in an
    exploratory session's run), so the hosts listed different steps."""
    server = object_servers["seaweedfs"]
    outs = two_hosts(tmp_path, server, object_store(server), "behind")
    assert lines(outs[0], "DROPPED") not in (["[]"], []), outs[0][-3000:]
    disks = [lines(out, "DISK") for out in outs]
    assert disks[0] == disks[1], disks
    assert [lines(out, "STEPS")[-1] for out in outs] == [disks[0][0]] * 2


def test_every_process_stops_listing_a_step_as_soon_as_persistent_retention_deletes_it(
        tmp_path, object_servers):
    """Process 0 runs the persistent tier's retention; the other process listed the steps it
    deleted there until the next persist round (after step 2's persist: [0, 2])."""
    server = object_servers["seaweedfs"]
    remote = object_store(server)
    for out in two_hosts(tmp_path, server, remote, "retain"):
        assert lines(out, "REMOTE") == ["0 [0]", "1 [0]", "2 [2]", "3 [2]", "4 [4]"], \
            out[-3000:]
    assert casstore.list_steps(remote) == [4]


def test_wait_until_persisted_returns_everywhere_when_process_0_fails_before_the_round(
        tmp_path, object_servers):
    """Process 0's persist failed before it started the step's round (the persistent tier
    refused its config object): the other process's wait_until_persisted() waited for a round
    that never came (here 12 s, then False; without a timeout, for ever)."""
    server = object_servers["seaweedfs"]
    outs = two_hosts(tmp_path, server, object_store(server), "down")
    assert lines(outs[0], "WAITED") == [], outs[0][-3000:]  # process 0 raised its error
    result, seconds = lines(outs[1], "WAITED")[0].split()
    assert result == "True", outs[1][-3000:]
    assert float(seconds) < 4, seconds  # process 0 closes (ends the rounds) after 6 s


def test_without_local_per_host_a_disk_per_host_fails_the_first_save_as_before(
        tmp_path, object_servers):
    server = object_servers["seaweedfs"]
    remote = object_store(server)
    outs = two_hosts(tmp_path, server, remote, "plain")
    errors = [lines(out, "SAVE-ERROR") for out in outs]
    assert "process 0 does not see it" in errors[0][0], errors
    assert "process 0 did not commit the step" in errors[1][0], errors
    assert casstore.list_steps(tmp_path / "local-0") == []
    assert casstore.list_steps(remote) == []


def test_local_per_host_needs_a_persistent_tier_and_a_local_filesystem(tmp_path):
    with pytest.raises(ValueError, match="local_per_host=True needs a persistent tier"):
        casstore.CheckpointManager(tmp_path / "local", local_per_host=True)
    with pytest.raises(ValueError, match="local_per_host needs a local tier on a local file"):
        casstore.CheckpointManager(MemoryStore(), persistent=tmp_path / "remote",
                                   local_per_host=True)


def test_local_per_host_in_one_process_saves_and_persists_as_without_it(tmp_path):
    remote = MemoryStore()
    with casstore.CheckpointManager(tmp_path / "local", persistent=remote,
                                    persist_interval_steps=2, local_per_host=True) as mngr:
        for step in range(3):
            mngr.save(step, {"w": np.full((64, 64), step, np.float32)})
        mngr.wait_until_persisted()
        assert mngr.all_steps() == [0, 1, 2]
        assert casstore.list_steps(remote) == [0, 2]
        assert mngr.restore(2)["w"].tobytes() == np.full((64, 64), 2, np.float32).tobytes()
        assert casstore.verify(tmp_path / "local").ok


class FakeKv:
    """The coordinator's key-value store, as the few calls casstore makes see it."""

    def __init__(self):
        self.values = {}

    def key_value_set_bytes(self, key, value):
        assert len(value) <= PART_BYTES or key.endswith("/n")
        self.values[key] = bytes(value)

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key not in self.values:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
        return self.values[key]


def test_a_manifest_larger_than_a_part_goes_over_the_key_value_store_in_parts(monkeypatch):
    monkeypatch.setenv("CASSTORE_MULTIHOST_TIMEOUT_S", "0.01")
    kv, data = FakeKv(), np.random.default_rng(0).bytes(2 * PART_BYTES + 5)
    set_large(kv, "casstore/save/7/manifest", data)
    assert len(kv.values) == 4  # 3 parts and their number
    assert get_large(kv, "casstore/save/7/manifest") == data
    set_large(kv, "empty", b"")
    assert get_large(kv, "empty") == b""
    with pytest.raises(casstore.CasstoreError, match="no value at 'missing' on the coordinator"):
        get_large(kv, "missing")


def test_a_directory_shared_by_mistake_is_named_as_such(tmp_path):
    """Process 1 writing process 0's manifest into a directory process 0 also uses found it
    there: "step was committed by a concurrent save", on every save (exploratory session's
    repro). Its own bytes there now mean one directory given to both."""
    from casstore._layout import manifest_key
    from casstore._save_commit import put_manifest_bytes

    casstore.save(tmp_path, 0, {"w": np.ones(4)})
    data = (tmp_path / manifest_key("default", 0)).read_bytes()
    with pytest.raises(casstore.CasstoreError, match="looks shared with process 0"):
        put_manifest_bytes(casstore.open_store(tmp_path), "default", 0, data)
    casstore.save(tmp_path / "other", 0, {"w": np.zeros(4)})
    other = (tmp_path / "other" / manifest_key("default", 0)).read_bytes()
    with pytest.raises(casstore.StepAlreadyExistsError, match="concurrent save"):
        put_manifest_bytes(casstore.open_store(tmp_path), "default", 0, other)
