"""Save processes killed with SIGKILL at random moments never leave a visible partial step and
never harm earlier steps. The full count runs with ``-m slow``."""

import os
import random
import time

import pytest
from crash_worker import ForkServer, tree_for

import casstore
from casstore.store import LocalStore

from conftest import object_store

WORKER = os.path.join(os.path.dirname(__file__), "crash_worker.py")


@pytest.fixture
def workers(tmp_path):
    """The saving processes: children of one crash_worker.py fork server (forked after its
    imports, not an interpreter started per kill)."""
    server = ForkServer(WORKER, tmp_path / "worker-stderr.txt")
    yield server
    server.close()


def kill_during_saves(workers: ForkServer, url: str, first_step: int, rng: random.Random,
                      options=None) -> None:
    workers.kill_during([url, first_step, options or {}], rng.uniform(0.0, 0.6))


def assert_restores(store, step: int) -> None:
    restored = casstore.restore(store, step)
    expected = tree_for(step)
    for key in ("base", "head", "trained", "small"):
        assert restored[key].tobytes() == expected[key].tobytes(), (step, key)


def run_trials(workers, store, url: str, trials: int, seed: int, options=None,
               where: str | None = None, capsys=None) -> list[int]:
    """Kills a saving process ``trials`` times. After each kill, every new step and a sample of
    the earlier ones restore bit-exact, no earlier step is missing, and every chunk of every
    step exists; at the end every step restores and verify reads all data. Returns the steps
    committed. With ``where`` (and pytest's ``capsys``), prints the figures every 50 trials
    and at the end."""
    rng, t0 = random.Random(seed), time.perf_counter()
    seen: list[int] = []
    for trial in range(trials):
        kill_during_saves(workers, url, 1000 * trial, rng, options)
        steps = casstore.list_steps(store)
        assert set(seen) <= set(steps)  # earlier steps survive every crash
        new = sorted(set(steps) - set(seen))
        for step in new + rng.sample(seen, min(3, len(seen))):
            assert_restores(store, step)
        if steps:  # a kill before the first commit leaves no repository to verify
            report = casstore.verify(store, read_data=False)
            assert report.ok, report.problems
        seen += new
        if where and (trial + 1) % 50 == 0 and trial + 1 < trials:
            report_trials(capsys, where, trial + 1, seen, t0)
    for step in seen:
        assert_restores(store, step)
    if seen:  # every kill may have come before the first commit: then nothing exists
        assert casstore.verify(store).ok
    if len(seen) > 1:  # later steps store "trained" as deltas against earlier ones
        latest = casstore.read_manifest(store, max(seen))
        assert any(r.base for leaf in latest.leaves if leaf.path == "trained"
                   for r in leaf.chunks)
    if where:
        report_trials(capsys, where, trials, seen, t0, final=True)
    return seen


def report_trials(capsys, where: str, trials: int, steps: list[int], t0: float,
                  final: bool = False) -> None:
    """Prints a campaign's figures to the terminal, past pytest's capture."""
    checked = "all restored and verified" if final else "each restored after its trial"
    with capsys.disabled():
        print(f"\n[campaign] SIGKILL {where}: {trials} trials, {len(steps)} steps committed, "
              f"{checked}, {time.perf_counter() - t0:.0f} s", flush=True)


def test_sigkill_during_local_saves(tmp_path, workers):
    # A smoke run of the campaign (500 trials under -m slow): 6 kills at random moments.
    url = str(tmp_path / "repo")
    run_trials(workers, LocalStore(url), url, 6, seed=1)


def test_sigkill_during_s3_saves(object_servers, workers):
    server = object_servers["seaweedfs"]
    store = object_store(server)
    run_trials(workers, store, store.url, 4, seed=2, options=server.storage_options)


@pytest.mark.slow
def test_sigkill_during_local_saves_full_count(tmp_path, capsys, workers):
    url = str(tmp_path / "repo")
    assert len(run_trials(workers, LocalStore(url), url, 500, seed=3, where="local",
                          capsys=capsys)) > 0


@pytest.mark.slow
def test_sigkill_during_s3_saves_full_count(object_servers, capsys, workers):
    server = object_servers["seaweedfs"]
    store = object_store(server)
    steps = run_trials(workers, store, store.url, 100, seed=4, options=server.storage_options,
                       where="S3 (SeaweedFS)", capsys=capsys)
    assert len(steps) > 0
