"""AsyncCheckpointer: save returns once staged, the step keeps the values of the call, errors
surface from wait_until_finished."""

import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import casstore
import casstore._staging
from casstore.store import MemoryStore

from conftest import GatedStore


def test_numpy_buffers_overwritten_after_save_returns_keep_the_saved_values():
    store = GatedStore()
    big = np.arange(400_000, dtype=np.float32)  # chunked (256 KiB chunks below)
    small = np.arange(7, dtype=np.int16)  # packed
    with casstore.AsyncCheckpointer(store, run="r", chunk_size_bytes=256 * 1024) as ckptr:
        assert ckptr.save(3, {"big": big, "small": small}, metadata={"note": "a"}) is None
        assert ckptr.is_saving_in_progress()
        assert casstore.list_steps(store, run="r") == []
        big[:] = -1.0  # into the saved buffers
        small *= 0
        store.gate.set()
        ckptr.wait_until_finished()
        assert not ckptr.is_saving_in_progress()
        assert ckptr.last_save_info.step == 3
        assert ckptr.last_staging_peak_bytes > 0
    restored = casstore.restore(store, 3, run="r")
    np.testing.assert_array_equal(restored["big"], np.arange(400_000, dtype=np.float32))
    assert restored["small"].dtype == np.int16
    assert restored["small"].tolist() == list(range(7))
    assert casstore.read_manifest(store, 3, run="r").metadata == {"note": "a"}
    assert casstore.verify(store).ok


def test_jax_arrays_donated_or_deleted_after_save_returns_keep_the_saved_values():
    store = GatedStore()
    donating = jax.jit(lambda w: w * 3 + 1, donate_argnums=0)
    w = jnp.ones((512, 512), jnp.float32)
    b = jnp.arange(100_000, dtype=jnp.int32)
    with casstore.AsyncCheckpointer(store) as ckptr:
        ckptr.save(0, {"w": w, "b": b})
        assert casstore.list_steps(store) == []
        for _ in range(3):
            w = donating(w)  # the saved buffer is donated while the save is in flight
        b.delete()
        jax.block_until_ready(w)
        store.gate.set()
        ckptr.wait_until_finished()
    restored = casstore.restore(store, 0)
    np.testing.assert_array_equal(restored["w"], np.ones((512, 512), np.float32))
    np.testing.assert_array_equal(restored["b"], np.arange(100_000, dtype=np.int32))
    assert restored["w"].dtype == np.float32
    assert restored["b"].dtype == np.int32


def test_consecutive_saves_wait_for_each_other_and_all_commit(tmp_path):
    with casstore.AsyncCheckpointer(tmp_path) as ckptr:
        for step in range(3):
            ckptr.save(step, {"w": np.full(50_000, step, np.float32)})
        ckptr.wait_until_finished()
    assert casstore.list_steps(tmp_path) == [0, 1, 2]
    assert casstore.restore(tmp_path, 1)["w"][0] == 1.0


class FailingStore(MemoryStore):
    def _put(self, key, data, *, exclusive):
        if key.startswith("chunks/"):
            raise OSError("injected: disk full")
        super()._put(key, data, exclusive=exclusive)


def test_errors_surface_from_wait_until_finished_and_the_next_save():
    store = FailingStore()
    ckptr = casstore.AsyncCheckpointer(store)
    ckptr.save(0, {"w": np.ones(1000)})  # returns: the failure happens in the background
    with pytest.raises(OSError, match="disk full"):
        ckptr.wait_until_finished()
    ckptr.wait_until_finished()  # reported once
    ckptr.save(1, {"w": np.ones(1000)})
    with pytest.raises(OSError, match="disk full"):
        ckptr.save(2, {"w": np.ones(1000)})
    assert casstore.list_steps(store) == []
    ckptr.close()
    with pytest.raises(RuntimeError, match="AsyncCheckpointer is closed"):
        ckptr.save(3, {"w": np.ones(3)})


class SlowFailingStore(MemoryStore):
    def _put(self, key, data, *, exclusive):
        if key.startswith("chunks/"):
            time.sleep(1.0)  # the caller's wait is interrupted meanwhile
            raise OSError("injected: disk full")
        super()._put(key, data, exclusive=exclusive)


@pytest.mark.parametrize("manager", [False, True])
def test_a_wait_interrupted_by_ctrl_c_leaves_the_save_to_the_next_call(manager, request):
    """wait_until_finished forgot the save before it waited: after Ctrl-C there, the next
    wait (or close) returned at once without its error, and nothing was committed."""
    # A run started in the background by a non-interactive shell (or nohup) inherits SIGINT
    # ignored, and Python then installs no KeyboardInterrupt handler (test_deadlines.py too).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    store = SlowFailingStore()
    saver = (casstore.CheckpointManager(store) if manager
             else casstore.AsyncCheckpointer(store))
    saver.save(0, {"w": np.ones(1000)})
    main = threading.main_thread().ident
    threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        saver.wait_until_finished()
    with pytest.raises(OSError, match="disk full"):
        saver.wait_until_finished()
    saver.close()
    assert casstore.list_steps(store) == []


def test_a_staging_error_is_raised_once_and_the_step_can_be_saved_again(monkeypatch):
    def failing(job, stored, hash_numpy):  # reading the caller's numpy block fails, once
        monkeypatch.setattr(casstore._staging, "_independent", independent)
        raise RuntimeError("injected: reading the block failed")

    independent = casstore._staging._independent
    monkeypatch.setattr(casstore._staging, "_independent", failing)
    store = MemoryStore()
    with casstore.CheckpointManager(store) as mngr:
        with pytest.raises(RuntimeError, match="injected"):
            mngr.save(0, {"x": np.ones(100_000)})
        assert mngr.save(0, {"x": np.arange(3.0)})  # raised the same error again, saved nothing
        mngr.wait_until_finished()
    assert casstore.list_steps(store) == [0]
    np.testing.assert_array_equal(casstore.restore(store, 0)["x"], [0.0, 1.0, 2.0])


def test_a_deleted_jax_array_is_refused_naming_its_key_path():
    deleted = jnp.ones(100_000)
    deleted.delete()
    store = MemoryStore()
    with pytest.raises(casstore.UnsupportedLeafError, match=r"deleted.*key path 'a/x'"):
        casstore.save(store, 0, {"a": {"x": deleted}})
    assert casstore.list_steps(store) == []


def test_a_traced_value_is_refused_naming_its_key_path():
    """save inside jax.jit met the tracer with jax's ConcretizationTypeError, naming no leaf."""
    store, errors = MemoryStore(), []

    @jax.jit
    def step(w):
        with pytest.raises(casstore.UnsupportedLeafError) as e:
            casstore.save(store, 0, {"params": {"w": w}, "step": 1})
        errors.append(e.value)
        return w

    step(jnp.ones(4))
    assert errors[0].key_path == "params/w"
    assert "traced value" in str(errors[0])
    assert casstore.list_steps(store) == []


def test_an_existing_step_and_bad_arguments_are_refused():
    store = MemoryStore()
    casstore.save(store, 5, {"w": np.ones(3)})
    with casstore.AsyncCheckpointer(store) as ckptr:
        with pytest.raises(ValueError, match="invalid step"):
            ckptr.save(-1, {"w": np.ones(3)})
        with pytest.raises(casstore.UnsupportedLeafError,
                           match=r"cannot store a leaf.*\(key path 'w'\)"):
            ckptr.save(6, {"w": object()})
        ckptr.save(5, {"w": np.zeros(3)})
        with pytest.raises(casstore.StepAlreadyExistsError,
                           match=r"step already exists.*step 5\)"):
            ckptr.wait_until_finished()
    assert casstore.restore(store, 5)["w"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="smaller than one chunk"):
        casstore.AsyncCheckpointer(store, max_staging_bytes=10, chunk_size_bytes=1024)


def test_closed_savers_leave_no_exit_hook_behind(tmp_path):
    """Each AsyncCheckpointer and CheckpointManager registered an interpreter-exit hook that
    stayed after close(): a job opening one per evaluation grew by 3 objects a manager, and
    ran every hook at exit."""
    hooks = threading._threading_atexits  # the exit hooks threading runs (CPython)
    casstore.AsyncCheckpointer(str(tmp_path / "a")).close()  # the first registers them
    casstore.CheckpointManager(str(tmp_path / "m"), persistent=str(tmp_path / "p")).close()
    before = len(hooks)
    for i in range(20):
        with casstore.AsyncCheckpointer(str(tmp_path / "a")) as saver:
            saver.save(i, {"w": np.full(100, float(i))})
        with casstore.CheckpointManager(str(tmp_path / "m"), persistent=str(tmp_path / "p"),
                                        persist_interval_steps=1) as mngr:
            mngr.save(i, {"w": np.full(100, float(i))})
    assert len(hooks) == before
    assert casstore.list_steps(str(tmp_path / "p")) == list(range(20))
