"""Save decisions agree across the processes of a jax.distributed job (2 local processes)."""

import pathlib
import re
import socket

import pytest
from forkserver import LazyForkServer, multihost_env

import casstore

WORKER = pathlib.Path(__file__).with_name("policies_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


JOBS = LazyForkServer(multihost_env)  # the processes of run_job, forked after jax's import


@pytest.fixture(scope="module", autouse=True)
def _close_the_fork_server():
    yield
    JOBS.close()


def run_job(mode: str, repo, timeout_s: float = 180) -> list[tuple[list[int], int]]:
    """Runs 2 worker processes; returns each one's (saved steps, step it stopped at)."""
    port = free_port()
    processes = [[WORKER, port, 2, i, mode, repo] for i in range(2)]
    outputs = [pathlib.Path(repo).parent / f"process-{i}.txt" for i in range(2)]
    results = []
    for code, out in JOBS.run(processes, outputs, timeout_s=timeout_s):
        assert code == 0, out[-3000:]
        assert "OK" in out, out[-3000:]
        found = re.search(r"SAVED \[([\d, ]*)\] STOPPED (\d+)", out)
        assert found, out[-3000:]
        saved = [int(s) for s in found[1].split(",") if s.strip()]
        results.append((saved, int(found[2])))
    return results


def test_sigterm_to_one_process_saves_every_process_at_jax_sync_point(tmp_path):
    (saved0, stop0), (saved1, stop1) = run_job("preemption", tmp_path / "repo")
    assert stop0 == stop1
    assert stop0 > 5
    assert saved0 == saved1 == [1, stop0]  # interval 1000: the first step (orbax's initial
    assert casstore.list_steps(tmp_path / "repo") == [1, stop0]  # save), then preemption's
    assert casstore.restore(tmp_path / "repo", stop0)["w"].tolist() == [stop0] * 4


def test_continuous_policy_follows_process_0_when_clocks_disagree(tmp_path):
    (saved0, _), (saved1, _) = run_job("continuous", tmp_path / "repo")
    assert saved0 == saved1 == [0]  # process 1 alone would have saved again
    assert casstore.list_steps(tmp_path / "repo") == [0]
