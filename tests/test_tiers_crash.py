"""A tiered manager killed with SIGKILL at random moments (during saves and persists) leaves no
partial step on either tier, and a manager reopened on the same tiers persists what the killed
one left. The full count runs with ``-m slow``."""

import os
import random

import pytest
from crash_worker import ForkServer, tree_for
from tiers_worker import INTERVAL

import casstore
from casstore.store import LocalStore

from conftest import object_store

WORKER = os.path.join(os.path.dirname(__file__), "tiers_worker.py")


def assert_restores(store, step: int) -> None:
    restored = casstore.restore(store, step)
    expected = tree_for(step)
    for key in ("base", "head", "trained", "small"):
        assert restored[key].tobytes() == expected[key].tobytes(), (step, key)


def kill_worker(workers: ForkServer, local: str, remote, first: int, options: dict,
                rng: random.Random) -> None:
    workers.kill_during([local, remote.url, first, options], rng.uniform(0.2, 1.5))


def run_trials(tmp_path, server, trials: int, seed: int):
    """Kills the worker ``trials`` times; after each kill every visible step of each tier
    restores bit-exact (new ones, and a sample of the earlier ones) and both tiers verify.
    Returns the local tier's steps and the persistent tier's store."""
    local, remote = LocalStore(tmp_path / "local"), object_store(server)
    rng = random.Random(seed)
    checked: dict[str, set[int]] = {"local": set(), "remote": set()}
    # The killed processes: children of one fork server, forked after its imports.
    workers = ForkServer(WORKER, tmp_path / "worker-stderr.txt")
    try:
        for trial in range(trials):
            kill_worker(workers, str(tmp_path / "local"), remote, 1000 * trial,
                        server.storage_options, rng)
            for name, store in (("local", local), ("remote", remote)):
                steps = casstore.list_steps(store)
                if name == "remote":
                    assert all(s % INTERVAL == 0 for s in steps), steps
                new = sorted(set(steps) - checked[name])
                for step in new + rng.sample(sorted(set(steps) & checked[name]),
                                             min(2, len(set(steps) & checked[name]))):
                    assert_restores(store, step)
                if steps:
                    report = casstore.verify(store, read_data=False)
                    assert report.ok, (name, report.problems)
                checked[name] |= set(new)
    finally:
        workers.close()
    return casstore.list_steps(local), remote


def resume_and_check(tmp_path, server_store) -> None:
    """A manager reopened on both tiers persists the newest eligible local step left over."""
    local = LocalStore(tmp_path / "local")
    eligible = [s for s in casstore.list_steps(local) if s % INTERVAL == 0]
    with casstore.CheckpointManager(local, persistent=server_store,
                                    persist_interval_steps=INTERVAL) as mngr:
        assert mngr.wait_until_persisted()
    remote_steps = casstore.list_steps(server_store)
    if eligible:
        assert max(eligible) in remote_steps
        assert_restores(server_store, max(eligible))
    assert casstore.verify(server_store).ok


@pytest.mark.parametrize("trials", [3])
def test_sigkill_during_tiered_saves_and_persists(tmp_path, object_servers, trials):
    local_steps, remote = run_trials(tmp_path, object_servers["seaweedfs"], trials, seed=11)
    assert local_steps
    resume_and_check(tmp_path, remote)


@pytest.mark.slow
def test_sigkill_during_tiered_saves_and_persists_full_count(tmp_path, object_servers):
    local_steps, remote = run_trials(tmp_path, object_servers["seaweedfs"], 60, seed=12)
    assert local_steps
    resume_and_check(tmp_path, remote)
