"""Save-decision and preservation policies (orbax's names), alone and on CheckpointManager."""

import datetime
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

import casstore
import casstore._preemption
from casstore import (
    AnyPreservationPolicy,
    AnySavePolicy,
    BestN,
    ContinuousCheckpointingPolicy,
    CustomSteps,
    DecisionContext,
    EveryNSteps,
    FixedIntervalPolicy,
    InitialSavePolicy,
    LatestN,
    PolicyCheckpointInfo,
    PreemptionCheckpointingPolicy,
    PreservationContext,
    PreserveAll,
    SpecificStepsPolicy,
)
from casstore.store import MemoryStore

from conftest import GatedStore

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def infos(steps, metrics=None, seconds=None):
    metrics = metrics or [None] * len(steps)
    seconds = seconds or list(range(len(steps)))
    return [PolicyCheckpointInfo(s, m, T0 + datetime.timedelta(seconds=t))
            for s, m, t in zip(steps, metrics, seconds)]


def kept(policy, steps, metrics=None):
    flags = policy.should_preserve(infos(steps, metrics), context=PreservationContext())
    return [s for s, keep in zip(steps, flags) if keep]


def test_preservation_policies():
    steps = list(range(12))
    assert kept(LatestN(3), steps) == [9, 10, 11]
    assert kept(LatestN(None), steps) == steps
    assert kept(PreserveAll(), steps) == steps
    assert kept(EveryNSteps(4), steps) == [0, 4, 8]
    assert kept(EveryNSteps(4, max_to_keep=2), steps) == [4, 8]
    assert kept(EveryNSteps(5, exact_interval=False), [1, 3, 6, 7, 11, 20]) == [1, 6, 11, 20]
    assert kept(CustomSteps({2, 5}), steps) == [2, 5]
    assert kept(LatestN(2) | EveryNSteps(5), steps) == [0, 5, 10, 11]
    assert kept(AnyPreservationPolicy([LatestN(1), CustomSteps([3])]), steps) == [3, 11]
    losses = [{"loss": v} for v in (5.0, 1.0, None, 3.0, 2.0)]
    losses[2] = None
    best = BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2)
    assert kept(best, [0, 1, 2, 3, 4], losses) == [1, 2, 4]  # lowest losses, + no metrics
    best.keep_checkpoints_without_metrics = False
    assert kept(best, [0, 1, 2, 3, 4], losses) == [1, 4]
    highest = BestN(get_metric_fn=lambda m: m["loss"], n=1, keep_checkpoints_without_metrics=False)
    assert kept(highest, [0, 1, 2, 3, 4], losses) == [0]
    with pytest.raises(ValueError, match="n must be a positive int or None, not 0"):
        LatestN(0)
    with pytest.raises(ValueError, match="interval_steps must be a positive int"):
        EveryNSteps(0)


def test_a_policy_of_bad_arguments_is_refused_when_made_not_after_deleting_steps(tmp_path):
    """BestN(n=-1) kept none: retention deleted every step, the one just saved too; other bad
    arguments failed at a save, some after its commit and retention (exploratory session's
    repros)."""
    metric = lambda m: m["loss"]  # noqa: E731
    for bad, error, match in [
            (lambda: BestN(get_metric_fn=metric, n=-1), ValueError, "n must be a positive int"),
            (lambda: BestN(get_metric_fn=metric, n=1.5), ValueError, "not 1.5"),
            (lambda: BestN(get_metric_fn=1), TypeError, "get_metric_fn must be callable"),
            (lambda: CustomSteps("12"), TypeError, "steps must be a container of ints"),
            (lambda: SpecificStepsPolicy(5), TypeError, "steps must be a container of ints"),
            (lambda: ContinuousCheckpointingPolicy(minimum_interval_secs=-1), ValueError,
             "minimum_interval_secs must be a number >= 0"),
            (lambda: AnySavePolicy([5]), TypeError, r"policies\[0\] must be a policy"),
            (lambda: LatestN(2) | 5, TypeError, r"policies\[1\] must be a policy, an object "
                                                r"with a should_preserve\(\) method"),
            (lambda: casstore.CheckpointManager(tmp_path, preservation_policy=5), TypeError,
             "preservation_policy must be a policy"),
            (lambda: casstore.CheckpointManager(tmp_path, save_decision_policy=5), TypeError,
             "save_decision_policy must be a policy"),
            (lambda: casstore.CheckpointManager(tmp_path, max_to_keep=2, best_fn=1), TypeError,
             "best_fn must be callable")]:
        with pytest.raises(error, match=match):
            bad()
    assert not any(tmp_path.iterdir())
    assert BestN(get_metric_fn=metric, n=0).n == 0  # keeps none, as in orbax
    # numpy numbers and orbax's truthy flags, which worked before these checks (review)
    assert BestN(get_metric_fn=metric, n=np.int64(2), reverse=1).n == 2
    assert ContinuousCheckpointingPolicy(minimum_interval_secs=np.float32(1.5))
    assert ContinuousCheckpointingPolicy(minimum_interval_secs=np.int64(600))

    class Every3:  # any object with the method is a policy
        def should_save(self, step, previous_steps, *, context):
            return step.step % 3 == 0

    with casstore.CheckpointManager(MemoryStore(), save_decision_policy=Every3()) as mngr:
        assert run_loop(mngr, range(7)) == [0, 3, 6]


def test_best_n_ranks_nan_worst_and_of_equal_metrics_keeps_the_latest_as_orbax():
    nan = float("nan")
    losses = [{"loss": v} for v in (0.5, nan, 0.1, 0.3, np.float32(nan))]
    lowest = BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2)
    assert kept(lowest, [0, 1, 2, 3, 4], losses) == [2, 3]
    highest = BestN(get_metric_fn=lambda m: m["loss"], n=2)
    assert kept(highest, [0, 1, 2, 3, 4], losses) == [0, 3]
    # No number (another writer's stored metrics): ranked as a NaN, not a TypeError out of
    # every later save (exploratory session's repro); a 0-d array is a number.
    odd = [{"loss": v} for v in ("n/a", None, np.float32(0.1), np.array(0.3), [1.0, 2.0])]
    assert kept(lowest, [0, 1, 2, 3, 4], odd) == [2, 3]
    assert kept(highest, [0, 1, 2, 3, 4], odd) == [2, 3]
    # a tuple ranks by Python's comparison, as it did (review); mixed with numbers, it cannot
    pairs = [{"loss": v} for v in ((0.9, -1.0), (0.5, -2.0), (0.7, -0.1))]
    assert kept(highest, [0, 1, 2], pairs) == [0, 2]
    mixed = [{"loss": v} for v in ((0.9, -1.0), 0.5, "n/a", np.float32(0.7))]
    assert kept(highest, [0, 1, 2, 3], mixed) == [1, 3]
    arrays = [{"loss": np.array([v, v])} for v in (0.3, 0.1, 0.2)]  # no truth value: NaN
    assert kept(lowest, [0, 1, 2], arrays) == [1, 2]
    with pytest.raises(KeyError, match="loss") as info:
        kept(lowest, [0, 1, 2], [{"loss": 1.0}, {"acc": 2.0}, {"loss": 0.5}])
    assert "get_metric_fn of the metrics of step 1: {'acc': 2.0}" in info.value.__notes__[0]
    ties = [{"acc": 1.0}] * 4
    for reverse in (False, True):  # orbax 0.12 keeps [2, 3] in both modes
        best = BestN(get_metric_fn=lambda m: m["acc"], reverse=reverse, n=2)
        assert kept(best, [0, 1, 2, 3], ties) == [2, 3]
    with casstore.CheckpointManager(MemoryStore(), max_to_keep=2, best_fn=lambda m: m["loss"],
                                    best_mode="min") as mngr:
        run_loop(mngr, range(4), metrics=lambda s: losses[s])
        assert (mngr.all_steps(), mngr.best_step()) == ([2, 3], 2)
    with casstore.CheckpointManager(MemoryStore(), max_to_keep=2, best_fn=lambda m: m["acc"],
                                    best_mode="max") as mngr:
        run_loop(mngr, range(4), metrics=lambda s: ties[s])
        assert (mngr.all_steps(), mngr.best_step()) == ([2, 3], 3)


def test_best_n_with_room_for_all_keeps_all_and_with_n_0_none_as_orbax():
    losses = [{"loss": 1.0}, None, {"loss": 2.0}]
    dropping = BestN(get_metric_fn=lambda m: m["loss"], n=3,
                     keep_checkpoints_without_metrics=False)
    assert kept(dropping, [0, 1, 2], losses) == [0, 1, 2]  # orbax: [True, True, True]
    assert kept(dropping, [0, 1, 2, 3], [*losses, {"loss": 0.5}]) == [0, 2, 3]
    assert kept(BestN(get_metric_fn=lambda m: m["loss"], n=0), [0, 1, 2], losses) == []
    assert kept(BestN(get_metric_fn=lambda m: m["loss"], n=0,
                      keep_checkpoints_without_metrics=False), [0, 1, 2], losses) == []


def test_the_default_policy_saves_the_first_step_and_counts_one_in_flight_as_orbax(
        tmp_path):
    """orbax 0.12's default adds InitialSavePolicy: with save_interval_steps=10 it saves steps
    1, 10, 20; and a step in flight counts as saved (no second 'initial' save)."""
    with casstore.CheckpointManager(MemoryStore(), save_interval_steps=10) as mngr:
        assert run_loop(mngr, range(1, 25)) == [1, 10, 20]
    gated = GatedStore()
    policy = InitialSavePolicy() | FixedIntervalPolicy(100)
    with casstore.CheckpointManager(gated, save_decision_policy=policy) as mngr:
        assert mngr.save(1, state(1))  # held at its chunk writes: in flight
        assert not mngr.should_save(2)  # was True: only committed steps were counted
        gated.gate.set()
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1]


def decide(policy, step, previous=(), seconds=None, **context):
    current = PolicyCheckpointInfo(step, None, T0 + datetime.timedelta(seconds=seconds or 0))
    return policy.should_save(current, infos(list(previous), seconds=[0] * len(previous)),
                              context=DecisionContext(**context))


def test_save_decision_policies():
    assert [s for s in range(10) if decide(FixedIntervalPolicy(4), s)] == [0, 4, 8]
    assert [s for s in range(10) if decide(SpecificStepsPolicy([3, 7]), s)] == [3, 7]
    assert decide(InitialSavePolicy(), 5)
    assert not decide(InitialSavePolicy(), 5, previous=[1])
    continuous = ContinuousCheckpointingPolicy(minimum_interval_secs=60)
    assert decide(continuous, 1)  # nothing saved yet
    assert not decide(continuous, 2, previous=[1], seconds=59)
    assert decide(continuous, 2, previous=[1], seconds=60)
    # the latest step dated ahead of this clock (its writer's ran fast): no waiting for it
    assert decide(continuous, 2, previous=[1], seconds=-3600)
    assert not decide(continuous, 2, previous=[1], seconds=600, is_saving_in_progress=True)
    assert decide(ContinuousCheckpointingPolicy(), 2, previous=[1])
    preemption = PreemptionCheckpointingPolicy()
    assert decide(preemption, 5, reached_preemption=True)
    assert not decide(preemption, 5)
    either = FixedIntervalPolicy(100) | PreemptionCheckpointingPolicy()
    assert isinstance(either, AnySavePolicy)
    assert [s for s in range(150) if decide(either, s, reached_preemption=s == 37)] == [0, 37, 100]
    with pytest.raises(ValueError, match="interval must be a positive int"):
        FixedIntervalPolicy(0)


def state(step):
    return {"w": np.full(100, step, np.float32)}


def run_loop(mngr, steps, metrics=None):
    saved = [s for s in steps if mngr.save(s, state(s), metrics=metrics and metrics(s))]
    mngr.wait_until_finished()
    return saved


def test_policies_on_the_manager_match_the_keyword_arguments():
    with casstore.CheckpointManager(MemoryStore(), max_to_keep=2, keep_period=4,
                                    save_interval_steps=2) as by_keywords:
        assert run_loop(by_keywords, range(13)) == [0, 2, 4, 6, 8, 10, 12]
    with casstore.CheckpointManager(MemoryStore(),
                                    save_decision_policy=FixedIntervalPolicy(2),
                                    preservation_policy=LatestN(2) | EveryNSteps(4)) as by_policy:
        assert run_loop(by_policy, range(13)) == [0, 2, 4, 6, 8, 10, 12]
    assert by_keywords.all_steps() == by_policy.all_steps() == [0, 4, 8, 10, 12]


def test_best_n_on_the_manager_and_best_step():
    losses = [3.0, 1.0, 2.0, 0.5, 4.0]
    policy = BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2)
    with casstore.CheckpointManager(MemoryStore(), preservation_policy=policy) as mngr:
        run_loop(mngr, range(5), metrics=lambda s: {"loss": losses[s]})
        assert mngr.all_steps() == [1, 3]
        assert mngr.best_step() == 3
    store = MemoryStore()
    with casstore.CheckpointManager(store, max_to_keep=2, best_fn=lambda m: m["loss"],
                                    best_mode="min") as mngr:
        run_loop(mngr, range(5), metrics=lambda s: {"loss": losses[s]})
        assert mngr.all_steps() == [1, 3]
    with casstore.CheckpointManager(store, max_to_keep=2, best_fn=lambda m: m["loss"],
                                    best_mode="min") as reopened:  # metrics read from manifests
        assert reopened.best_step() == 3


def test_a_policy_and_the_keywords_it_replaces_are_refused():
    with pytest.raises(ValueError, match="preservation_policy= replaces max_to_keep="):
        casstore.CheckpointManager(MemoryStore(), preservation_policy=LatestN(1), max_to_keep=2)
    with pytest.raises(ValueError, match="save_decision_policy= replaces save_interval_steps="):
        casstore.CheckpointManager(MemoryStore(), save_decision_policy=FixedIntervalPolicy(1),
                                   save_interval_steps=5)
    with pytest.raises(ValueError, match="replaces best_mode=, keep_checkpoints_without_metrics="):
        casstore.CheckpointManager(MemoryStore(), preservation_policy=LatestN(1),
                                   best_mode="min", keep_checkpoints_without_metrics=False)
    with pytest.raises(ValueError, match="best_mode must be 'max' or 'min'"):
        casstore.CheckpointManager(MemoryStore(), best_mode="up")
    for bad in ({"save_interval_steps": 0}, {"max_to_keep": 0}, {"keep_period": -1},
                {"max_to_keep": 2.0}, {"max_to_keep": 0, "best_fn": len}):
        name = next(iter(bad))  # named as the caller wrote it, not as the policy's field
        with pytest.raises(ValueError, match=f"^{name} must be a positive int or None, not "):
            casstore.CheckpointManager(MemoryStore(), **bad)


def test_continuous_checkpointing_skips_steps_while_a_save_is_in_flight():
    store = GatedStore()
    with casstore.CheckpointManager(store,
                                    save_decision_policy=ContinuousCheckpointingPolicy()) as mngr:
        assert mngr.save(0, state(0))
        assert [s for s in range(1, 6) if mngr.save(s, state(s))] == []  # none blocks
        store.gate.set()
        mngr.wait_until_finished()
        assert mngr.save(6, state(6))
        assert not mngr.save(6, state(6))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0, 6]
    with casstore.CheckpointManager(
            store, save_decision_policy=ContinuousCheckpointingPolicy(minimum_interval_secs=3600)
            ) as mngr:  # the latest step's time comes from its manifest
        assert not mngr.should_save(7)


def test_sigterm_saves_the_next_step_once_and_the_loop_stops():
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        policy = FixedIntervalPolicy(100) | PreemptionCheckpointingPolicy()
        with casstore.CheckpointManager(MemoryStore(), save_decision_policy=policy) as mngr:
            saved, stopped_at = [], None
            for step in range(1, 50):
                if step == 5:
                    os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
                if mngr.save(step, state(step)):
                    saved.append(step)
                if mngr.reached_preemption(step):
                    mngr.wait_until_finished()
                    stopped_at = step
                    break
            assert saved == [stopped_at]
            assert 5 <= stopped_at <= 7
            assert not mngr.should_save(stopped_at + 1)  # one preemption save, not one per step
            assert mngr.restore(stopped_at)["w"][0] == stopped_at
        assert calls == [signal.SIGTERM]  # the handler it replaced was called too
        assert signal.getsignal(signal.SIGTERM) is not None
        assert signal.getsignal(signal.SIGTERM).__name__ == "<lambda>"  # put back at close
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_notice_between_a_steps_save_and_its_reached_preemption_saves_the_next_step():
    """docs/orbax.md's loop with SIGTERM landing after save(250) returned (say, while the
    loop logs): step 250 was already decided, so the notice is reached at 251, which is
    saved; before, reached_preemption(250) was true and the loop stopped with no save."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        policy = FixedIntervalPolicy(100) | PreemptionCheckpointingPolicy()
        with casstore.CheckpointManager(MemoryStore(), save_decision_policy=policy) as mngr:
            for step in range(1, 1000):
                mngr.save(step, state(step))
                if step == 250:
                    os.kill(os.getpid(), signal.SIGTERM)
                if mngr.reached_preemption(step):
                    mngr.wait_until_finished()
                    break
            assert step == 251
            assert mngr.all_steps() == [100, 200, 251]
            assert mngr.restore(251)["w"][0] == 251
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_notice_after_the_loop_went_back_to_an_earlier_step_is_reached_there():
    """A loop that rolled back (restored step 500 after running to 1000, in one process) and
    gets the notice at step 600 saves step 600, or 601 if it already asked about 600."""
    from casstore._preemption import PreemptionNotice

    for asked_first in (False, True):
        notice = PreemptionNotice()
        assert not any(notice.reached(s) for s in [*range(1001), *range(500, 600)])
        if asked_first:
            assert not notice.reached(600)  # save(600) decided before the notice came
        notice.signal_received = signal.SIGTERM
        assert [s for s in range(600, 603) if notice.reached(s)] == (
            [601, 602] if asked_first else [600, 601, 602])


def test_managers_closed_in_any_order_put_back_the_first_handler():
    def original(signum, frame):
        calls.append("original")

    calls = []
    previous = signal.signal(signal.SIGTERM, original)
    try:
        for order in ((0, 1), (1, 0)):
            managers = [casstore.CheckpointManager(
                MemoryStore(), save_decision_policy=PreemptionCheckpointingPolicy())
                for _ in range(2)]
            managers[order[0]].close()
            os.kill(os.getpid(), signal.SIGTERM)  # the one open: recorded, then forwarded
            assert calls == ["original"]
            assert managers[order[1]].reached_preemption(1)
            assert not managers[order[0]].reached_preemption(1)  # closed: no longer listening
            managers[order[1]].close()
            assert signal.getsignal(signal.SIGTERM) is original, order
            calls.clear()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_manager_dropped_unclosed_puts_back_the_handler_it_replaced():
    """Its handler outlived it: SIGTERM was recorded for no one and no longer stopped the job."""
    import gc

    def original(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, original)
    try:
        mngr = casstore.CheckpointManager(MemoryStore(),
                                          save_decision_policy=PreemptionCheckpointingPolicy())
        mngr.save(0, state(0))
        mngr.wait_until_finished()
        assert signal.getsignal(signal.SIGTERM) is not original
        del mngr
        gc.collect()
        assert signal.getsignal(signal.SIGTERM) is original
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_manager_closed_in_another_thread_lets_sigterm_stop_the_job(tmp_path):
    """close() from a thread other than the main one raised "signal only works in main
    thread" and left the handler in place, which then swallowed SIGTERM: the job no longer
    stopped. Its handler now puts back the default when the signal comes, and re-raises it."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, signal, threading, time
        import numpy as np, casstore
        mngr = casstore.CheckpointManager(casstore.MemoryStore(), save_decision_policy=(
            casstore.PreemptionCheckpointingPolicy()))
        mngr.save(0, {"w": np.zeros(2)})
        closer = threading.Thread(target=mngr.close)
        closer.start()
        closer.join()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("still running after SIGTERM")
        """))
    root = str(pathlib.Path(__file__).parents[1])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert "signal only works in main thread" not in proc.stderr


def test_the_default_policy_saves_at_jax_preemption_sync_point(monkeypatch):
    assert not casstore._preemption.reached_sync_point(3)  # no jax.distributed here
    monkeypatch.setattr(casstore._preemption, "reached_sync_point", lambda step: step == 7)
    before = signal.getsignal(signal.SIGTERM)
    with casstore.CheckpointManager(MemoryStore(), save_interval_steps=5) as mngr:
        assert signal.getsignal(signal.SIGTERM) == before  # keywords install no handler
        assert run_loop(mngr, range(12)) == [0, 5, 7, 10]
        assert not mngr.reached_preemption(6)
        assert mngr.reached_preemption(11)


def test_a_signal_policy_needs_the_main_thread():
    errors = []

    def make():
        try:
            casstore.CheckpointManager(MemoryStore(),
                                       save_decision_policy=PreemptionCheckpointingPolicy())
        except ValueError as e:
            errors.append(e)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert "main thread" in str(errors[0])


def test_a_preemption_save_that_raises_leaves_the_next_step_to_save():
    """A leaf the save refuses at the step after the notice: that call raises and saves
    nothing, and the next step is still saved (once)."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        policy = FixedIntervalPolicy(100) | PreemptionCheckpointingPolicy()
        with casstore.CheckpointManager(MemoryStore(), save_decision_policy=policy) as mngr:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not mngr.reached_preemption(1) and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(casstore.UnsupportedLeafError, match="'bad'"):
                mngr.save(1, {**state(1), "bad": object()})
            assert mngr.save(2, state(2))
            assert not mngr.save(3, state(3))
            mngr.wait_until_finished()
            assert mngr.all_steps() == [2]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_metrics_and_metadata_are_taken_as_they_are_at_save():
    """A dict the loop updates in place each step, and numpy and jax scalar losses: each step
    is ranked and stored with its own values."""
    with casstore.CheckpointManager(MemoryStore(), max_to_keep=2, best_fn=lambda m: m["loss"],
                                    best_mode="min") as mngr:
        metrics, meta = {}, {"lr": 0.1}
        for step, loss in enumerate([np.float32(1.0), jnp.float32(5.0), 6.0, 7.0]):
            metrics["loss"] = loss
            mngr.save(step, state(step), metrics=metrics, metadata=meta)
            meta["lr"] = -1.0  # while the save may still be running
        mngr.wait_until_finished()
        assert (mngr.all_steps(), mngr.best_step()) == ([0, 1], 0)
        assert casstore.read_manifest(mngr.store, 0).metadata == {
            "metrics": {"loss": 1.0}, "user": {"lr": 0.1}}


def test_after_reload_a_step_saved_again_elsewhere_ranks_by_its_new_metrics(tmp_path):
    """Another writer deleted step 1 (acc 0.9) and saved it again with acc 0.0: after reload()
    the manager still ranked it by 0.9, kept it and deleted step 2 (acc 0.1); the persistent
    tier's retention did the same (exploratory session's repro)."""
    a = casstore.CheckpointManager(tmp_path, max_to_keep=2, best_fn=lambda m: m["acc"])
    a.save(1, {"x": np.zeros(2)}, metrics={"acc": 0.9})
    a.save(2, {"x": np.zeros(2)}, metrics={"acc": 0.1})
    a.wait_until_finished()
    assert a.best_step() == 1
    casstore.delete(tmp_path, 1)
    with casstore.CheckpointManager(tmp_path) as b:
        b.save(1, {"x": np.ones(2)}, metrics={"acc": 0.0}, force=True)
    a.reload()
    assert a.best_step() == 2
    a.save(3, {"x": np.zeros(2)}, metrics={"acc": 0.5})
    a.close()
    assert casstore.list_steps(tmp_path) == [2, 3]


def test_after_reload_the_persistent_tier_ranks_a_step_saved_again_by_its_new_metrics(
        tmp_path):
    remote = tmp_path / "remote"
    mngr = casstore.CheckpointManager(tmp_path / "local", persistent=remote,
                                      persistent_preservation_policy=casstore.BestN(
                                          get_metric_fn=lambda m: m["acc"], n=2))
    mngr.save(1, {"x": np.zeros(2)}, metrics={"acc": 0.9})
    mngr.save(2, {"x": np.zeros(2)}, metrics={"acc": 0.1})
    assert mngr.wait_until_persisted(30)
    casstore.delete(remote, 1)
    casstore.save(remote, 1, {"x": np.ones(2)}, metadata={"metrics": {"acc": 0.0}, "user": None})
    mngr.reload()
    mngr.save(3, {"x": np.zeros(2)}, metrics={"acc": 0.5})
    assert mngr.wait_until_persisted(30)
    mngr.close()
    assert casstore.list_steps(remote) == [2, 3]


def test_a_retention_that_fails_midway_lists_no_step_it_deleted():
    """Retention deleted step 0, then failed on step 1: the manager still listed step 0, and
    restore(0) of a listed step raised StepNotFoundError (exploratory session's repro)."""
    from casstore.testing import FaultyStore

    class RefusesStep1(FaultyStore):
        refuse = False

        def _delete(self, key):
            if self.refuse and key.endswith("0000000000000001.manifest"):
                raise PermissionError(f"denied: delete {key}")
            return super()._delete(key)

    class LatestOnly:
        on = False

        def should_preserve(self, infos, *, context):
            return [not self.on or i == len(infos) - 1 for i in range(len(infos))]

    store, policy = RefusesStep1(MemoryStore(), seed=0, rate=0.0), LatestOnly()
    mngr = casstore.CheckpointManager(store, preservation_policy=policy)
    for step in range(3):
        mngr.save(step, {"x": np.full(2, step)})
    mngr.wait_until_finished()
    policy.on = store.refuse = True
    mngr.save(3, {"x": np.full(2, 3)})
    with pytest.raises(PermissionError, match="denied"):
        mngr.wait_until_finished()
    assert mngr.all_steps() == casstore.list_steps(store) == [1, 2, 3]
