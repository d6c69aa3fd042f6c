"""Multi-process save and restore under jax.distributed (several local processes)."""

import os
import pathlib
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
from forkserver import LazyForkServer, multihost_env

import casstore

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the processes of every job (see run_job), forked after jax's import
JOBS = LazyForkServer(lambda: multihost_env(CASSTORE_MULTIHOST_TIMEOUT_S="8"))


@pytest.fixture(scope="module", autouse=True)
def _close_the_fork_server():
    yield
    JOBS.close()


def run_job(nproc: int, mode: str, repo, step: int, *more, timeout_s: float = 120,
            multihost_timeout_s: str = "8"):
    """Runs ``nproc`` worker processes; returns their (returncode, output) pairs. ``more``:
    further ``mode, step`` pairs the same processes run after the first. The processes are
    forked from this module's tests/forkserver.py server, which imported jax once for all."""
    port = free_port()
    env = multihost_env(CASSTORE_MULTIHOST_TIMEOUT_S=multihost_timeout_s)
    if nproc == 1:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    processes = [[WORKER, port, nproc, i, mode, repo, step, *more] for i in range(nproc)]
    outputs = [pathlib.Path(repo).parent / f"job-{port}-process-{i}.txt" for i in range(nproc)]
    return JOBS.run(processes, outputs, env=env, timeout_s=timeout_s)


def assert_ok(results):
    for code, out in results:
        assert code == 0, out[-3000:]
        assert "OK" in out, out[-3000:]


def test_save_with_2_and_4_processes_restore_with_4_2_and_1(tmp_path):
    repo = tmp_path / "repo"
    results = run_job(2, "save", repo, 1)
    assert_ok(results)
    # SaveInfo is the whole save's on every process (it was each process's own chunks, beside
    # the whole state's logical bytes): here, everything the new repository holds.
    chunks = [p.stat().st_size for p in (repo / "chunks").rglob("*") if p.is_file()]
    manifest = (repo / "runs" / "default" / "steps" / f"{1:016d}.manifest").stat().st_size
    assert {re.search(r"^saved .*", out, re.M).group() for _, out in results} == {
        f"saved {len(chunks)} {sum(chunks) + manifest}"}
    results = run_job(4, "save", repo, 2, "restore", 1)  # the restore reads what is stored
    assert_ok(results)
    assert all("restored 1" in out for _, out in results), results
    assert casstore.list_steps(repo) == [1, 2]
    results = run_job(2, "restore", repo, 1, "restore", 2)
    assert_ok(results)
    assert all("restored 1" in out and "restored 2" in out for _, out in results), results
    assert_ok(run_job(1, "restore", repo, 1))
    plain = casstore.restore(repo, 1)  # no jax.distributed, numpy
    np.testing.assert_array_equal(plain["state"]["w"],
                                  np.arange(64 * 48, dtype=np.float32).reshape(64, 48))
    leaf = next(x for x in casstore.read_manifest(repo, 1).leaves if x.path == "state/w")
    assert leaf.sharding == {"mesh": {"data": 4, "model": 2}, "spec": ["data", "model"]}
    # Step 2's processes each stored their own shards of "trained" as deltas against step 1's.
    steps = {s: {leaf.path: leaf for leaf in casstore.read_manifest(repo, s).leaves}
             for s in (1, 2)}
    bases = {r.id for r in steps[1]["state/trained"].chunks}
    refs = steps[2]["state/trained"].chunks
    assert len(refs) == 8, refs
    assert all(r.base in bases for r in refs), refs


def test_a_process_killed_before_commit_leaves_no_step(tmp_path):
    repo = tmp_path / "repo"
    assert_ok(run_job(2, "save", repo, 1))
    results = run_job(2, "crash", repo, 3)
    assert results[1][0] == 17, results[1][1][-2000:]
    assert results[0][0] == 3, results[0][1][-2000:]
    assert "save failed" in results[0][1], results[0][1][-2000:]
    assert "no manifest written (run 'default', step 3)" in results[0][1], results[0][1][-2000:]
    assert casstore.list_steps(repo) == [1]
    # Step 1 unharmed: every object it names is there and matches its hash, and its values
    # are the saved ones (test_save_with_2_and_4_processes... restores it on 1, 2 and 4).
    assert casstore.verify(repo).ok
    np.testing.assert_array_equal(casstore.restore(repo, 1)["state"]["w"],
                                  np.arange(64 * 48, dtype=np.float32).reshape(64, 48))


def test_processes_saving_to_disks_of_their_own_commit_nothing(tmp_path):
    """A per-host disk is not one repository: process 0 does not see process 1's chunks, so
    it refuses to commit a manifest naming them, and both processes say why. The state's first
    leaf is zeros: process 1's first chunk, which process 0 looked up alone, was then on
    process 0's disk too (by content), and the step committed there unrestorable."""
    repo = tmp_path / "repo"
    results = run_job(2, "own-disk", repo, 1)
    assert [code for code, _ in results] == [3, 3], results
    assert "process 1 stored chunk object 'chunks/" in results[0][1], results[0][1][-2000:]
    assert "process 0 does not see it" in results[1][1], results[1][1][-2000:]
    assert casstore.list_steps(repo / "host0") == []
    assert casstore.list_steps(repo / "host1") == []


@pytest.mark.parametrize("mode", ["early-fail", "other-step", "other-tree", "local-array",
                                  "manager-early-fail", "manager-other-step"])
def test_processes_that_do_not_save_alike_commit_nothing_and_stay_in_step(tmp_path, mode):
    """Process 1 fails before the exchange (an object leaf), saves another step, or another
    tree. Before: its later saves paired with process 0's previous one, committing steps of
    wrong values silently, or the mismatch committed. Now that save fails on both processes,
    nothing is committed, and the next save, alike on both, commits the right values."""
    repo = tmp_path / "repo"
    results = run_job(2, mode, repo, 1, "restore", 3)  # then restored by the same processes
    assert_ok(results)
    outputs = [out for _, out in results]
    assert all("restored 3" in out for out in outputs), outputs
    assert all("first save failed" in out for out in outputs), outputs
    if "other-step" in mode:
        expected = "process 1 saves run 'default' step 2 where process 0 saves run 'default' step 1"
        assert expected in outputs[0], outputs[0][-2000:]
    if "other-tree" in mode:
        assert "process 1 saves another tree" in outputs[0], outputs[0][-2000:]
    if "local-array" in mode:  # jnp.asarray on each process: named, not a bad manifest
        expected = "key path 'state/count' is a jax array each process holds on its own"
        assert all(expected in out for out in outputs), outputs
    if "early-fail" in mode:
        assert "UnsupportedLeafError" in outputs[1], outputs[1][-2000:]
        assert "process 1: UnsupportedLeafError" in outputs[0], outputs[0][-2000:]
    assert casstore.list_steps(repo) == [3]


def test_a_save_beside_a_managers_background_save_loses_neither(tmp_path):
    """Process 0 forgot the keys of every save numbered below the one it gathered: the
    manager's save still in flight then timed out on every process, and its step was lost."""
    repo = tmp_path / "repo"
    results = run_job(2, "overlap", repo, 0)
    assert_ok(results)
    for _, out in results:
        assert "STEPS [0, 1, 2, 3] [0, 1, 2, 3]" in out, out[-2000:]


def test_a_save_longer_on_process_0_than_the_timeout_commits_on_every_process(tmp_path):
    """Process 0 writes every replicated block; the others waited for its outcome the
    multi-process timeout only, and raised while it committed. They now wait while it beats."""
    repo = tmp_path / "repo"
    results = run_job(2, "slow-primary", repo, 0, multihost_timeout_s="4")
    assert_ok(results)
    assert "SAVED 6 True" in results[0][1], results[0][1][-2000:]  # longer than the timeout
    assert "SAVED 6" in results[1][1], results[1][1][-2000:]
    assert casstore.list_steps(repo) == [0]


def test_process_0_commits_nothing_once_another_process_gave_up_waiting(tmp_path):
    """Process 1 timed out waiting for process 0 and let go of its save lock; process 0,
    late, then gathered its refs and committed a step naming chunks a GC may have deleted
    meanwhile (process 1 raised while process 0 committed)."""
    repo = tmp_path / "repo"
    results = run_job(2, "late-primary", repo, 0, multihost_timeout_s="3")
    assert_ok(results)
    assert "FAILED process 0 did not say within 3 s" in results[1][1], results[1][1][-2000:]
    assert "process 1 gave up waiting for process 0" in results[0][1], results[0][1][-2000:]
    assert casstore.list_steps(repo) == []


@pytest.mark.parametrize("mode", ["latest", "latest-abstract"])
def test_every_process_restores_the_same_latest_step(tmp_path, mode):
    """Each process took the latest step of its own listing: a step committed between two
    processes' restore calls gave one global array the shards of steps 0 and 1. The target's
    sharding on a mesh, or on an AbstractMesh under jax.set_mesh."""
    repo = tmp_path / "repo"
    casstore.save(repo, 0, {"w": np.zeros((64, 48), np.float32)})
    casstore.save(repo, 1, {"w": np.ones((64, 48), np.float32)})
    (repo / "runs" / "default" / "steps" / f"{1:016d}.manifest").rename(repo / "hidden.manifest")
    results = run_job(2, mode, repo, 0)
    assert_ok(results)
    for _, out in results:
        assert "VALUES [0.0]" in out, out[-2000:]
    assert casstore.list_steps(repo) == [0, 1]


def test_a_manager_save_that_raises_on_one_process_fails_on_every_process(tmp_path):
    """A save() call that raised on one process only (a background save's error raised by the
    next call on one process and by the one after on the other; a retention error, process 0's
    alone) took a save number there and not elsewhere: the processes paired other saves and
    none committed again, or failed every other save in turn. Each call now fails or succeeds
    on every process alike, and the run goes on."""
    repo = tmp_path / "repo"
    results = run_job(2, "manager-asymmetric", repo, 1, "restore", 6)
    assert_ok(results)
    calls = [next(x for x in out.splitlines() if x.startswith("CALLS ")) for _, out in results]
    assert calls[0] == calls[1] == "CALLS 1:True 2:raised 3:True 4:True 5:raised 6:True", calls
    assert "KV ['5']" in results[0][1], results[0][1][-2000:]  # saves 0-4's keys deleted
    assert casstore.list_steps(repo) == [6]
    raised = [[x for x in out.splitlines() if x.startswith("RAISED ")] for _, out in results]
    assert "injected: process 1's disk" in raised[0][0], raised  # the save of step 1 failed
    assert "injected: process 1's disk" in raised[1][0], raised
    assert "OSError injected: process 0's retention" in raised[0][1], raised
    assert ("the save call failed on other processes; nothing was saved: process 0: OSError: "
            "injected: process 0's retention") in raised[1][1], raised


def test_processes_with_different_metrics_keep_the_steps_process_0_keeps(tmp_path):
    """Process 0 alone deletes the steps retention drops; each process dropped from its own
    step list the steps its own metrics ranked out, so with other metrics process 1 listed
    deleted steps as its latest and best. Every process now ranks by process 0's metrics."""
    repo = tmp_path / "repo"
    results = run_job(2, "manager-metrics", repo, 1)
    assert_ok(results)
    lines = [next(x for x in out.splitlines() if x.startswith("STEPS ")) for _, out in results]
    assert lines[0] == lines[1] == "STEPS [1, 2] 1", lines  # process 0's loss: the step
    assert casstore.list_steps(repo) == [1, 2]


def test_an_array_on_another_processs_devices_only_is_saved(tmp_path):
    """A leaf on process 1's devices alone: process 1 took it as not spread (fully addressable
    there) and left it to process 0, which holds none of it: 'array without chunks'."""
    repo = tmp_path / "repo"
    assert_ok(run_job(2, "subset-mesh", repo, 4))
    restored = casstore.restore(repo, 4)
    np.testing.assert_array_equal(restored["sub"],
                                  np.arange(4 * 6, dtype=np.float32).reshape(4, 6) + 4)
    np.testing.assert_array_equal(restored["state"]["w"], np.arange(
        64 * 48, dtype=np.float32).reshape(64, 48) * 4)


NUMPY_ONLY = """
import sys
import numpy as np
import casstore
from jax._src import xla_bridge
root, tree = sys.argv[1], {"w": np.arange(12.0).reshape(3, 4), "n": np.int64(2**40)}
casstore.save(root + "/plain", 1, tree)
assert casstore.restore(root + "/plain", 1)["n"] == 2**40
with casstore.CheckpointManager(root + "/local", persistent=root + "/persistent",
                                persist_interval_steps=1, max_to_keep=1) as mngr:
    mngr.save(1, tree)
    mngr.wait_until_finished()
    np.testing.assert_array_equal(mngr.restore(1)["w"], tree["w"])
print("started" if xla_bridge.backends_are_initialized() else "none started")
"""


def test_a_process_of_numpy_leaves_starts_none_of_jaxs_backends(tmp_path):
    """A save asks how many processes the job has; where nothing has started jax's backends,
    asking jax would start them all (on a GPU machine, preallocating most of the GPU's memory
    for a process that saves numpy leaves), so a process without jax.distributed and without
    started backends counts as one."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", NUMPY_ONLY, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["none", "started"], out.stdout
    assert casstore.list_steps(tmp_path / "persistent") == [1]
