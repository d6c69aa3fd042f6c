"""CheckpointManager: async save, retention policies, errors from the background."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import casstore
from casstore.store import MemoryStore

from conftest import GatedStore


def state(step: int) -> dict:
    return {"w": jnp.full((64, 64), step, jnp.float32), "step": step}


def test_async_save_then_overwrite_keeps_the_old_values():
    """save() returns while the step is still in flight; writing into the saved numpy buffers
    and deleting the saved jax array must not change what the step holds."""
    store = GatedStore()
    x = jnp.arange(1_000_000, dtype=jnp.float32)
    big, small = np.arange(300_000, dtype=np.int64), np.arange(5)  # chunked / packed
    with casstore.CheckpointManager(store) as mngr:
        assert mngr.save(0, {"x": x, "big": big, "small": small})
        assert mngr.last_save_blocking_s is not None
        assert casstore.list_steps(store) == []  # not committed yet: chunk writes are held
        big[:] = -1  # the caller moves on, into the very buffers it saved
        small[:] = -1
        x.delete()
        store.gate.set()
        mngr.wait_until_finished()
        restored = mngr.restore(0)
    np.testing.assert_array_equal(restored["x"], np.arange(1_000_000, dtype=np.float32))
    np.testing.assert_array_equal(restored["big"], np.arange(300_000))
    assert restored["small"].tolist() == [0, 1, 2, 3, 4]


def test_donated_buffers_do_not_change_the_checkpoint():
    donating = jax.jit(lambda w: w * 3 + 1, donate_argnums=0)
    store = GatedStore()
    w = jnp.ones((256, 256))
    with casstore.CheckpointManager(store) as mngr:
        mngr.save(1, {"w": w})
        for _ in range(3):
            w = donating(w)  # the saved buffer is donated while the save is still running
        jax.block_until_ready(w)
        store.gate.set()
        mngr.wait_until_finished()
        np.testing.assert_array_equal(mngr.restore(1)["w"], np.ones((256, 256)))


def test_max_to_keep_and_keep_period():
    store = MemoryStore()
    with casstore.CheckpointManager(store, max_to_keep=2, keep_period=4) as mngr:
        for step in range(10):
            mngr.save(step, state(step))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0, 4, 8, 9]
        assert mngr.latest_step() == 9


def test_best_fn_keeps_the_best_steps():
    with casstore.CheckpointManager(MemoryStore(), max_to_keep=2, best_fn=lambda m: m["acc"],
                                    best_mode="max") as mngr:
        for step, acc in enumerate([0.5, 0.9, 0.1, 0.8, 0.3]):
            mngr.save(step, state(step), metrics={"acc": acc})
        mngr.save(5, state(5))  # no metrics: kept by keep_checkpoints_without_metrics
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 3, 5]
        assert mngr.best_step() == 1
    with casstore.CheckpointManager(MemoryStore(), max_to_keep=1, best_fn=lambda m: m["loss"],
                                    best_mode="min",
                                    keep_checkpoints_without_metrics=False) as mngr:
        for step, loss in enumerate([3.0, 1.0, 2.0]):
            mngr.save(step, state(step), metrics={"loss": loss})
        mngr.save(3, state(3))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1]


def test_a_damaged_manifest_of_an_old_step_does_not_stop_best_fn_retention(tmp_path, caplog):
    """Reopened with best_fn, the manager read the damaged step's metrics for retention after
    each save: every other save() raised its ManifestError and saved nothing, and best_step()
    raised too. Now the step ranks as one without metrics (kept: nothing unreadable is
    deleted), with one warning naming it, and every other step works."""
    kwargs = {"max_to_keep": 2, "best_fn": lambda m: m["loss"], "best_mode": "min"}
    with casstore.CheckpointManager(tmp_path, **kwargs) as mngr:
        for step in range(3):
            mngr.save(step, state(step), metrics={"loss": 1.0 / (step + 1)})
    path = tmp_path / "runs" / "default" / "steps" / f"{1:016d}.manifest"
    path.write_bytes(path.read_bytes()[:40])
    with casstore.CheckpointManager(tmp_path, **kwargs) as mngr:
        for step, loss in zip(range(3, 7), [0.04, 0.01, 0.03, 0.02]):
            assert mngr.save(step, state(step), metrics={"loss": loss})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 4, 6]
        assert mngr.best_step() == 4
    assert casstore.list_steps(tmp_path) == [1, 4, 6]
    warnings = [r.getMessage() for r in caplog.records if "ranks step 1" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "not msgpack" in warnings[0]


def test_gc_after_retention_skips_while_a_manifest_does_not_read_and_saves_go_on(tmp_path,
                                                                              caplog):
    """GC refuses while any manifest (here another run's) does not read; after retention
    that refusal failed every other save() (raised by the next call, which saved nothing).
    Now GC is skipped with one warning, and runs once the manifest is gone."""
    casstore.save(tmp_path, 0, {"w": np.ones(1000)}, run="other")
    path = tmp_path / "runs" / "other" / "steps" / f"{0:016d}.manifest"
    path.write_bytes(path.read_bytes()[:30])
    with casstore.CheckpointManager(tmp_path, max_to_keep=1, gc_after_retention=True,
                                    grace_period_s=0) as mngr:
        for step in range(4):
            assert mngr.save(step, state(step))
            mngr.wait_until_finished()
        assert mngr.all_steps() == [3]
        assert mngr.last_gc_info is None
        skipped = [r for r in caplog.records if "gc after retention skipped" in r.getMessage()]
        assert len(skipped) == 1
        assert "other@0" in skipped[0].getMessage()
        path.unlink()
        mngr.save(4, state(4))
        mngr.wait_until_finished()
        assert mngr.last_gc_info.deleted_chunks > 0  # the steps retention deleted meanwhile
    assert casstore.verify(tmp_path).ok


def test_should_save_and_interval(tmp_path):
    with casstore.CheckpointManager(tmp_path, save_interval_steps=5) as mngr:
        saved = [step for step in range(12) if mngr.save(step, state(step))]
        mngr.wait_until_finished()
        assert saved == [0, 5, 10]
        assert mngr.all_steps() == [0, 5, 10]
        assert not mngr.should_save(10)
        assert not mngr.should_save(3)
        assert mngr.save(3, state(3), force=True)


def test_a_forced_save_of_a_step_the_manager_lists_is_refused_in_that_call(tmp_path):
    """It returned True, and its StepAlreadyExistsError came from the next save, which then
    saved nothing (orbax raises in the forced call)."""
    with casstore.CheckpointManager(tmp_path) as mngr:
        mngr.save(0, state(0))
        mngr.save(1, state(1))
        with pytest.raises(casstore.StepAlreadyExistsError,
                           match=r"step already exists .*step 1\)"):
            mngr.save(1, state(9), force=True)
        assert mngr.save(2, state(2))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0, 1, 2]
        assert mngr.restore(1)["w"].tobytes() == state(1)["w"].tobytes()


def test_metadata_and_delete(tmp_path):
    with casstore.CheckpointManager(tmp_path) as mngr:
        mngr.save(0, state(0), metadata={"lr": 0.1}, metrics={"loss": 1.0})
        assert mngr.metadata(0) == {"lr": 0.1}
        mngr.delete(0)
        assert mngr.all_steps() == []
        with pytest.raises(casstore.StepNotFoundError, match="no such step"):
            mngr.delete(0)


def test_metadata_of_steps_saved_without_the_manager_is_theirs_and_holds_no_metrics(tmp_path):
    casstore.save(tmp_path, 0, state(0), metadata={"epoch": 3, "metrics": {"loss": -1.0}})
    casstore.save(tmp_path, 1, state(1), metadata=[1, 2])
    with casstore.CheckpointManager(tmp_path, max_to_keep=2, best_fn=lambda m: m["loss"],
                                    best_mode="min", keep_checkpoints_without_metrics=False
                                    ) as mngr:
        assert mngr.metadata(0) == {"epoch": 3, "metrics": {"loss": -1.0}}
        assert mngr.metadata(1) == [1, 2]
        mngr.save(2, state(2), metrics={"loss": 0.5}, metadata={"epoch": 4})
        mngr.wait_until_finished()
        assert mngr.metadata(2) == {"epoch": 4}
        assert mngr.best_step() == 2  # step 0's "metrics" key is user metadata, not a metric
        assert mngr.all_steps() == [2]  # steps without metrics dropped, as asked


class FailingStore(MemoryStore):
    """Fails every chunk write after ``ok_puts`` successful ones."""

    def __init__(self, ok_puts: int):
        super().__init__()
        self.ok_puts = ok_puts

    def _put(self, key, data, *, exclusive):
        if key.startswith("chunks/"):
            if self.ok_puts <= 0:
                raise OSError("injected: disk full")
            self.ok_puts -= 1
        super()._put(key, data, exclusive=exclusive)


def test_background_errors_surface_from_wait_and_next_save():
    store = FailingStore(ok_puts=0)
    mngr = casstore.CheckpointManager(store)
    assert mngr.save(0, state(0))  # returns: the failure happens in the background
    with pytest.raises(OSError, match="disk full"):
        mngr.wait_until_finished()
    assert casstore.list_steps(store) == []
    mngr.save(1, state(1))
    with pytest.raises(OSError, match="disk full"):
        mngr.save(2, state(2))
    mngr.close()  # the failure was raised by save(2) above: closing raises nothing more
    with pytest.raises(RuntimeError, match="CheckpointManager is closed"):
        mngr.save(3, state(3))
    assert casstore.list_steps(store) == []


def test_restore_and_metadata_leave_a_failed_saves_error_to_save_and_wait():
    """restore() of a good step after a background save failed restores it, and the failure
    still surfaces from wait_until_finished (restore raised it and used it up: a caller that
    retried the restore never heard that the step was not saved)."""
    store = FailingStore(ok_puts=10**6)
    with casstore.CheckpointManager(store) as mngr:
        mngr.save(0, state(0), metadata={"note": "zero"})
        mngr.wait_until_finished()
        store.ok_puts = 0
        mngr.save(1, state(1))
        np.testing.assert_array_equal(mngr.restore(0)["w"], state(0)["w"])
        assert mngr.metadata(0) == {"note": "zero"}
        with pytest.raises(OSError, match="disk full"):
            mngr.wait_until_finished()
        assert mngr.all_steps() == [0]


def test_a_background_error_raised_by_a_later_call_names_its_step_and_what_failed():
    """The error of step 1's background save, raised by save(2), says it is step 1's; a
    failed retention after a commit says the step was committed (it read as a failed save)."""
    store = FailingStore(ok_puts=10**6)
    with casstore.CheckpointManager(store, max_to_keep=1) as mngr:
        mngr.save(0, state(0))
        mngr.wait_until_finished()
        store.ok_puts = 0
        mngr.save(1, state(1))
        with pytest.raises(OSError, match="disk full") as info:
            mngr.save(2, state(2))
        assert "raised by the background save of step 1" in "\n".join(info.value.__notes__)
        store.ok_puts = 10**6

        def refuse(key):
            raise ConnectionResetError(f"injected: delete {key}")

        store._delete = refuse
        mngr.save(3, state(3))
        with pytest.raises(ConnectionResetError, match="injected: delete") as info:
            mngr.wait_until_finished()
        assert "casstore: step 3 was committed; retention or GC then failed" in info.value.__notes__
        assert casstore.list_steps(store) == [0, 3]
        del store._delete


def test_close_raises_pending_error_and_stops_the_thread():
    store = FailingStore(ok_puts=0)
    before = {t.name for t in threading.enumerate()}
    mngr = casstore.CheckpointManager(store)
    mngr.save(0, state(0))
    with pytest.raises(OSError, match="injected: disk full"):
        mngr.close()
    after = {t.name for t in threading.enumerate() if t.name.startswith("casstore-save")}
    assert after <= before
    mngr.close()  # idempotent


def test_gc_after_retention_frees_old_chunks():
    store = MemoryStore()
    with casstore.CheckpointManager(store, max_to_keep=1, gc_after_retention=True,
                                    grace_period_s=0) as mngr:
        for step in range(3):
            mngr.save(step, {"w": np.full((1000,), step, np.float32)})
        mngr.wait_until_finished()
        assert mngr.last_gc_info.deleted_chunks == 1
    assert casstore.list_steps(store) == [2]
    assert len(list(store.list("chunks/"))) == 1
    assert casstore.verify(store).ok


def test_should_save_is_false_for_older_steps_while_a_save_commits():
    # should_save read the latest step before asking whether a save was in flight: a save
    # that committed in between counted as neither (True for 174 of 399 steps checked here)
    with casstore.CheckpointManager(MemoryStore()) as mngr:
        wrong = []
        for step in range(10, 2000, 10):
            mngr.save(step, {"w": np.full(3, step)})
            while mngr._saver.is_saving_in_progress():
                if mngr.should_save(step - 5):
                    wrong.append(step)
                    break
        assert wrong == []


def test_a_step_deleted_by_another_process_is_forgotten_and_retention_goes_on(tmp_path):
    def save(mngr, step):
        mngr.save(step, {"w": np.full(3, step)}, metrics={"acc": step})
        mngr.wait_until_finished()

    best = {"max_to_keep": 2, "best_fn": lambda m: m["acc"]}
    with casstore.CheckpointManager(tmp_path, **best) as mngr:
        for step in range(2):
            save(mngr, step)
    with casstore.CheckpointManager(tmp_path, **best) as mngr:
        casstore.delete(tmp_path, 0)  # e.g. `casstore rm` while the job trains
        save(mngr, 2)  # raised StepNotFoundError for step 0 though step 2 committed
        save(mngr, 3)
        assert mngr.all_steps() == casstore.list_steps(tmp_path) == [2, 3]
        assert mngr.best_step() == 3


class SlowStore(MemoryStore):
    def _put(self, key, data, *, exclusive):
        if key.startswith("chunks/"):
            time.sleep(0.3)
        super()._put(key, data, exclusive=exclusive)


def test_a_synchronous_saves_blocking_time_counts_the_whole_save():
    """It was taken before the synchronous wait: 0.056 s for a save that took 1 s."""
    with casstore.CheckpointManager(SlowStore(), enable_async_checkpointing=False,
                                    chunk_size_bytes=64 * 1024) as mngr:
        t0 = time.perf_counter()
        mngr.save(0, {"w": np.arange(3 * 16 * 1024, dtype=np.float32)})  # 3 chunks
        took = time.perf_counter() - t0
        assert took >= 0.3  # a chunk write at least
        assert 0.9 * took <= mngr.last_save_blocking_s <= took


def test_a_save_after_another_writer_saved_the_previous_step_again_stores_every_chunk(
        repo_store):
    """Another writer deletes the manager's latest step, collects its chunks and saves another
    step under the same number: the manager's next save must not take the chunks of the
    manifest it remembers as stored (format.md §7 lets a save reuse only the chunks of a
    manifest it read during that save). It committed a step whose chunks were gone on object
    stores (only a store with cheap stats looked them up)."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((128, 128), np.float32))
    b = rng.standard_normal((128, 128), np.float32)
    with casstore.CheckpointManager(repo_store, chunk_size_bytes=16384, delta=False) as mngr:
        mngr.save(1, {"w": a})
        mngr.wait_until_finished()
        casstore.delete(repo_store, 1)
        assert casstore.gc(repo_store, grace_period_s=0).deleted_chunks
        casstore.save(repo_store, 1, {"w": b}, chunk_size_bytes=16384)
        mngr.save(2, {"w": a})
        if not repo_store.cheap_stat:  # the jax array's blocks were staged as ids only, as
            # stored by step 1 (with cheap stats, staging looks them up and keeps the bytes)
            with pytest.raises(casstore.CasstoreError, match=r"staged as stored by the run's "
                               r"previous step.*nothing was committed: save again"):
                mngr.wait_until_finished()
            assert casstore.list_steps(repo_store) == [1]
            mngr.save(2, {"w": a})
        mngr.wait_until_finished()
    assert casstore.verify(repo_store).ok
    np.testing.assert_array_equal(casstore.restore(repo_store, 2)["w"], np.asarray(a))
    np.testing.assert_array_equal(casstore.restore(repo_store, 1)["w"], b)


def _block_whose_save_fails(kind: str, leave_with_error: bool) -> None:
    """A with block whose one save fails in the background (another writer committed its
    step after the manager listed the steps), left by an error or not."""
    store = MemoryStore()
    make = casstore.CheckpointManager if kind == "manager" else casstore.AsyncCheckpointer
    with make(store) as saver:
        casstore.save(store, 6, {"x": np.zeros(2)})  # another writer's step 6
        saver.save(6, {"x": np.ones(2)})
        if leave_with_error:
            raise RuntimeError("the training loop's own error")


@pytest.mark.parametrize("kind", ["manager", "checkpointer"])
def test_a_with_block_left_by_an_error_keeps_it_and_notes_a_failed_background_save(kind):
    """A background save that failed replaced the error leaving the with block (exploratory
    session's repro); the caller's error is raised, with the save's as a note. A block left
    normally still raises the save's error."""
    with pytest.raises(RuntimeError, match="own error") as e:
        _block_whose_save_fails(kind, leave_with_error=True)
    assert any("closing the checkpointer then failed too: StepAlreadyExistsError" in n
               for n in e.value.__notes__), e.value.__notes__
    with pytest.raises(casstore.StepAlreadyExistsError, match="step 6"):
        _block_whose_save_fails(kind, leave_with_error=False)


def test_metrics_msgpack_cannot_store_name_the_step_and_the_entry(tmp_path):
    with casstore.CheckpointManager(tmp_path) as mngr, pytest.raises(
            ValueError, match=r"metrics \(step 7\) is not msgpack-serializable at "
                              r"\['per_class_acc'\]: .*\.tolist\(\)"):
        mngr.save(7, {"x": np.ones(2)}, metrics={"loss": 0.5, "per_class_acc": jnp.ones(3)})
    with casstore.CheckpointManager(tmp_path) as mngr, pytest.raises(  # not ['user']['arr']
            ValueError, match=r"metadata \(step 7\) is not msgpack-serializable at \['arr'\]"):
        mngr.save(7, {"x": np.ones(2)}, metadata={"arr": np.zeros(3)})
    assert casstore.list_steps(tmp_path) == []


def test_a_misspelt_keyword_is_refused_not_passed_to_the_filesystem(tmp_path):
    """With an fsspec URL every other keyword is a storage option, and fsspec's memory
    filesystem takes any: CheckpointManager("memory://...", max_to_kep=1) kept every step
    (exploratory session's repro)."""
    for make, typo, meant in [(casstore.CheckpointManager, "max_to_kep", "max_to_keep"),
                              (casstore.AsyncCheckpointer, "chunk_sise_bytes",
                               "chunk_size_bytes")]:
        with pytest.raises(TypeError, match=rf"unexpected keyword argument '{typo}': did you "
                                            rf"mean '{meant}'\?"):
            make("memory://casstore-typo", **{typo: 1})
    with casstore.CheckpointManager("memory://casstore-typo-ok", skip_instance_cache=True) as m:
        m.save(0, {"w": np.zeros(2)})  # a storage option of fsspec's own still reaches it
        m.wait_until_finished()
        assert m.all_steps() == [0]
