"""Several processes on one repository, GC meanwhile; an interpreter exit during an async save."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from forkserver import LazyForkServer
from save_worker import tree_for

import casstore

WORKER = os.path.join(os.path.dirname(__file__), "save_worker.py")
# The saving processes of the GC test, forked from a server that imported jax, numpy and
# casstore; the interpreter-exit tests start interpreters of their own, whose exit they test.
WRITERS = LazyForkServer(lambda: dict(os.environ))


@pytest.fixture(scope="module", autouse=True)
def _close_the_fork_server():
    yield
    WRITERS.close()


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def assert_restores(url, run: str, step: int) -> None:
    restored = casstore.restore(url, step, run=run)
    expected = tree_for(run, step)
    assert restored["run"] == run
    assert restored["step"] == step
    for key in ("base", "head"):
        assert restored[key].tobytes() == expected[key].tobytes(), (run, step, key)


def test_processes_saving_into_one_repository_while_gc_runs(tmp_path):
    url = str(tmp_path / "repo")
    casstore.save(url, 0, tree_for("seed", 0), run="seed")
    stop, gc_runs, errors = threading.Event(), [], []

    def collect() -> None:
        while not stop.is_set():
            try:
                gc_runs.append(casstore.gc(url, grace_period_s=0, lock_timeout_s=1))
            except casstore.CasstoreError as e:
                if "saves kept running" not in str(e):
                    errors.append(e)

    collector = threading.Thread(target=collect)
    collector.start()
    writers = [[WORKER, url, f"p{i}", 0, 6] for i in range(3)]
    racers = [[WORKER, url, "shared", 5, 1] for _ in range(2)]
    try:
        results = WRITERS.run(writers + racers, [tmp_path / f"process-{i}.txt" for i in range(5)],
                              timeout_s=300)
    finally:
        stop.set()
        collector.join()
    for code, out in results:
        assert code == 0, out[-3000:]
    assert not errors
    assert gc_runs
    race = [next(line.split()[0] for line in out.splitlines()
                 if line.startswith(("saved ", "exists "))) for _, out in results[3:]]
    assert sorted(race) == ["exists", "saved"]  # exactly one of the two same-step saves won
    for i in range(3):
        assert casstore.list_steps(url, run=f"p{i}") == list(range(6))
        for step in range(6):
            assert_restores(url, f"p{i}", step)
    assert_restores(url, "shared", 5)
    assert_restores(url, "seed", 0)
    assert casstore.verify(url).ok


def test_interpreter_exit_waits_for_the_async_save_in_flight(tmp_path):
    url = str(tmp_path / "repo")
    proc = start(url, "default", "1", "1", "--exit-during-async-save")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "returned" in out, err[-3000:]
    assert casstore.list_steps(url) == [1]
    restored = casstore.restore(url, 1)
    np.testing.assert_array_equal(restored["big"], np.arange(2_000_000, dtype=np.int64))
    assert_restores(url, "default", 1)


FAILING_AT_EXIT = """
import numpy as np, casstore
from casstore.store import MemoryStore
class Full(MemoryStore):
    def _put(self, key, data, *, exclusive):
        if key.startswith("chunks/"):
            raise OSError(28, "injected: no space left")
        super()._put(key, data, exclusive=exclusive)
casstore.CheckpointManager(Full(), enable_async_checkpointing=True).save(7, {"w": np.ones(1000)})
print("returned")
"""


def test_a_save_that_fails_at_interpreter_exit_is_logged_not_lost_silently():
    proc = subprocess.run([sys.executable, "-c", FAILING_AT_EXIT], capture_output=True,
                          text=True, timeout=300)
    assert "returned" in proc.stdout, proc.stderr[-3000:]
    assert "background save of step 7 to memory:" in proc.stderr, proc.stderr[-3000:]
    assert "failed at exit, nothing was committed" in proc.stderr
    assert "injected: no space left" in proc.stderr
