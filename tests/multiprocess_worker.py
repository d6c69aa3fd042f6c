"""One process of a multi-process JAX job, launched by test_multiprocess.py.

Usage: multiprocess_worker.py PORT NUM_PROCESSES PROCESS_ID MODE REPO STEP [MODE STEP ...]
MODE is ``save`` (save the deterministic sharded state), ``restore`` (restore it onto another
mesh and check this process's shards bit-exact), ``crash`` (process 1 dies after writing its
first chunk) or ``own-disk`` (each process saves to ``REPO/host<PROCESS_ID>``, as to a disk of
its own). Modes ``early-fail``, ``other-step`` and ``other-tree`` (with ``manager-`` in front:
through an async CheckpointManager) save STEP with process 1 failing before the exchange (an
object leaf), saving STEP + 1, or saving ``w`` as int32, print each process's error, then save
STEP + 2 alike on every process. ``manager-asymmetric`` saves STEP to STEP + 5 through a
manager whose save() calls raise on one process only (see :func:`asymmetric_errors`) and prints
``CALLS <what each call returned or raised>``. ``manager-metrics`` saves STEP to STEP + 3
through a manager keeping the 2 best by a loss each process computes differently, and prints
``STEPS <all_steps()> <best_step()>``. ``overlap`` saves STEP to STEP + 3 of run ``train``
through a manager while ``casstore.save`` saves run ``eval``; ``slow-primary`` saves a
replicated state, which process 0 alone writes, slower than the timeout; ``latest`` restores the
latest step while another appears. Each further MODE STEP
pair (``save`` or ``restore``) runs after the first in the same processes: one interpreter start
and jax import per process for all of them. Prints ``OK`` once every one succeeded.
"""

import contextlib
import os
import sys
import time

port, nproc, pid, mode, repo, step, *more = sys.argv[1:]
nproc, pid, step = int(nproc), int(pid), int(step)
assert len(more) % 2 == 0, more
actions = [(mode, step)] + [(m, int(s)) for m, s in zip(more[::2], more[1::2])]
if nproc > 1:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // nproc}"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import casstore  # noqa: E402
from casstore._coordinator import kv_client  # noqa: E402
from casstore.store import LocalStore  # noqa: E402

if nproc > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                               process_id=pid)
assert len(jax.devices()) == 8


def expected(step: int) -> dict:
    """The global state's values, identical on every process."""
    w = np.arange(64 * 48, dtype=np.float32).reshape(64, 48) * step
    trained = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32) * 0.02
    # One weight per saved 16 x 24 block changes: later steps store small deltas, which fit
    # the restore budget (RestoreBudget) even in the first block a process saves.
    corner = (np.arange(64) % 16 == 0)[:, None] & (np.arange(48) % 24 == 0)[None]
    return {"w": w, "emb": (np.arange(40 * 8, dtype=np.int32) % 97).reshape(40, 8) + step,
            "b": np.full(48, step, np.float32),
            "trained": np.where(corner, trained * np.float32(1 + 1e-4 * step), trained)}


def shardings(kind: str) -> dict:
    devices = np.array(jax.devices())
    if kind == "save":
        mesh = Mesh(devices.reshape(4, 2), ("data", "model"))
        return {"w": NamedSharding(mesh, P("data", "model")),
                "emb": NamedSharding(mesh, P("data")), "b": NamedSharding(mesh, P()),
                "trained": NamedSharding(mesh, P("data", "model"))}
    mesh = Mesh(devices.reshape(2, 4), ("a", "b"))
    return {"w": NamedSharding(mesh, P("b", "a")), "emb": NamedSharding(mesh, P(None, "b")),
            "b": NamedSharding(mesh, P("b")), "trained": NamedSharding(mesh, P("a"))}


def global_state(step: int) -> dict:
    return {k: jax.make_array_from_callback(v.shape, s, lambda idx, v=v: v[idx])
            for (k, v), s in zip(expected(step).items(), shardings("save").values())}


def out_of_step(mode: str, step: int) -> None:
    """The modes where the processes do not save alike, then do."""
    kind = mode.removeprefix("manager-")
    state = global_state(step)
    mine = step + 1 if kind == "other-step" and pid == 1 else step
    if kind == "local-array":  # on each process, its own: not one global array
        state = dict(state, count=jax.numpy.asarray(step))
    elif pid == 1 and kind != "other-step":
        state = dict(state, w=state["w"].astype(np.int32)) if kind == "other-tree" else dict(
            state, bad=object())
    mngr = casstore.CheckpointManager(repo, chunk_size_bytes=2048) if mode != kind else None
    try:
        if mngr is None:
            casstore.save(repo, mine, {"state": state, "step": mine}, chunk_size_bytes=2048)
        else:
            mngr.save(mine, {"state": state, "step": mine}, force=True)
            mngr.wait_until_finished()
        print("first save returned", flush=True)
    except (casstore.CasstoreError, TypeError) as e:
        print("first save failed:", type(e).__name__, e, flush=True)
    good = {"state": global_state(step + 2), "step": step + 2}
    if mngr is None:
        casstore.save(repo, step + 2, good, chunk_size_bytes=2048)
    else:
        mngr.save(step + 2, good, force=True)
        mngr.close()
    print("second save returned", flush=True)


def subset_mesh(step: int) -> None:
    """``sub`` lives on process 1's devices only (a pipeline stage on another host)."""
    ones = [d for d in jax.devices() if d.process_index == 1]
    sharding = NamedSharding(Mesh(np.array(ones), ("x",)), P("x"))
    sub = np.arange(len(ones) * 6, dtype=np.float32).reshape(len(ones), 6) + step
    tree = {"sub": jax.make_array_from_callback(sub.shape, sharding, lambda idx: sub[idx],
                                               dtype=np.float32),
            "state": global_state(step)}
    casstore.save(repo, step, tree, chunk_size_bytes=2048)
    # restored onto its sharding: process 0 holds none of it, and gets an array all the same
    got = casstore.restore(repo, step, paths=["sub"], target={"sub": jax.ShapeDtypeStruct(
        sub.shape, np.float32, sharding=sharding)})["sub"]
    assert (got.shape, len(got.addressable_shards) > 0) == (sub.shape, pid == 1)
    assert all(np.array_equal(np.asarray(s.data), sub[s.index]) for s in got.addressable_shards)


def ranked_by_metrics(step: int) -> None:
    """``manager-metrics``: each process passes its own metrics (opposite rankings); every
    process must keep the steps process 0's metrics keep, which are the ones on disk."""
    with casstore.CheckpointManager(repo, chunk_size_bytes=2048, max_to_keep=2,
                                    best_fn=lambda m: m["loss"], best_mode="min") as mngr:
        for s in range(step, step + 4):
            loss = float(s if pid == 0 else -s)
            mngr.save(s, {"state": global_state(s), "step": s}, metrics={"loss": loss})
            mngr.wait_until_finished()
        print("STEPS", mngr.all_steps(), mngr.best_step(), flush=True)


def overlapping(step: int) -> None:
    """A manager's background saves of run "train", each still writing on process 0 (slow
    chunk writes) when process 1 has posted its chunks and the job saves run "eval" with
    casstore.save: process 0 deleted the coordinator's keys of every save numbered below the
    one it gathered, process 1's post of the manager's save too, which then waited out the
    timeout on every process and lost its step."""
    store = LocalStore(repo)
    real_put = store._put

    def slow_put(key, data, *, exclusive):
        time.sleep(0.05 if pid == 0 and key.startswith("chunks/") else 0)
        real_put(key, data, exclusive=exclusive)

    store._put = slow_put
    with casstore.CheckpointManager(store, run="train", chunk_size_bytes=2048) as mngr:
        for s in range(step, step + 4):
            mngr.save(s, {"state": global_state(s), "step": s})
            casstore.save(repo, s, {"b": global_state(s)["b"]}, run="eval")
    print("STEPS", casstore.list_steps(repo, run="train"), casstore.list_steps(repo, run="eval"),
          flush=True)


def slow_primary(step: int) -> None:
    """A replicated state, which process 0 alone writes (replica 0 is on it), to a slow disk:
    process 1 posted its empty part at once and waited for the outcome the timeout only, so
    its save raised while process 0's committed."""
    store = LocalStore(repo)
    real_put, timeout_s = store._put, float(os.environ["CASSTORE_MULTIHOST_TIMEOUT_S"])

    def slow_put(key, data, *, exclusive):
        time.sleep(timeout_s / 4 if key.startswith("chunks/") else 0)
        real_put(key, data, exclusive=exclusive)

    store._put = slow_put
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P())
    state = {f"w{i}": jax.device_put(np.full((256, 8), i, np.float32), replicated)
             for i in range(6)}
    t0 = time.monotonic()  # one chunk at a time: 1.5 times the timeout
    info = casstore.save(store, step, state, pack_threshold_bytes=0, max_workers=1)
    print("SAVED", info.new_chunks, time.monotonic() - t0 > timeout_s, flush=True)


def late_primary(step: int) -> None:
    """Process 0 comes to the save after process 1 gave up waiting for its outcome (an
    evaluation only process 0 runs): process 1's lock is gone then, so a GC may have deleted
    the chunks it reused; process 0 committed them all the same, gathering refs still posted."""
    state = {k: jax.make_array_from_callback(v.shape, s, lambda idx, v=v: v[idx])
             for (k, v), s in zip(expected(step).items(), shardings("save").values())}
    if pid == 0:
        time.sleep(1.5 * float(os.environ["CASSTORE_MULTIHOST_TIMEOUT_S"]))
    try:
        casstore.save(repo, step, {"state": state}, chunk_size_bytes=2048)
        print("SAVED", flush=True)
    except casstore.CasstoreError as e:
        print("FAILED", e, flush=True)


def latest_alike(mode: str, step: int) -> None:
    """Restores the latest step (None) into a global array, process 0 before step STEP + 1's
    manifest appears (a trainer commits it meanwhile: the test hid it), process 1 after:
    each took its own listing's, and the array held the shards of two steps."""
    from jax.experimental import multihost_utils
    sharding, context = shardings("save")["w"], contextlib.nullcontext()
    if mode == "latest-abstract":  # jax.eval_shape under jax.set_mesh gives such targets
        sharding = NamedSharding(sharding.mesh.abstract_mesh, sharding.spec)
        context = jax.set_mesh(shardings("save")["w"].mesh)
    target = {"w": jax.ShapeDtypeStruct((64, 48), np.float32, sharding=sharding)}
    with context:
        if pid == 0:
            restored = casstore.restore(repo, target=target)
            os.rename(f"{repo}/hidden.manifest",
                      f"{repo}/runs/default/steps/{step + 1:016d}.manifest")
        multihost_utils.sync_global_devices("committed meanwhile")
        if pid == 1:
            restored = casstore.restore(repo, target=target)
    print("VALUES", sorted({float(np.asarray(s.data).max())
                            for s in restored["w"].addressable_shards}), flush=True)


def asymmetric_errors(step: int) -> None:
    """Process 1's background save of STEP fails at once while process 0's still writes, so
    only the next call, on each process whenever its save is done, raises it; process 0 alone
    deletes the steps retention drops, and its delete fails after the commit of STEP + 3. The
    processes fell out of step for good, or failed every other save in turn."""
    store = LocalStore(repo)
    real_put, real_delete, refuse_delete = store._put, store._delete, [pid == 0]

    def put(key, data, *, exclusive):
        if saving[0] == step and key.startswith("chunks/"):
            if pid == 1:
                raise OSError("injected: process 1's disk")
            time.sleep(0.05)  # process 0 is still writing when process 1 has failed
        real_put(key, data, exclusive=exclusive)

    def delete(key):
        if refuse_delete[0] and key.startswith("runs/"):
            refuse_delete[0] = False
            raise OSError("injected: process 0's retention")
        real_delete(key)

    store._put, store._delete, saving, calls = put, delete, [None], []
    with casstore.CheckpointManager(store, chunk_size_bytes=2048, max_to_keep=1) as mngr:
        for s in range(step, step + 6):
            saving[0] = s
            try:
                calls.append(f"{s}:{mngr.save(s, {'state': global_state(s), 'step': s})}")
            except (OSError, casstore.CasstoreError) as e:
                calls.append(f"{s}:raised")
                print("RAISED", s, type(e).__name__, e, flush=True)
            time.sleep(0.2)  # a training step: the background save ends meanwhile, or not
    print("CALLS", " ".join(calls), flush=True)
    if pid == 0:  # the coordinator keeps the keys of the last save only (was: of every save)
        keys = kv_client().key_value_dir_get_bytes("casstore/save/")
        print("KV", sorted({key.split("/")[2] for key, _ in keys}), flush=True)


def main() -> None:
    for action, action_step in actions:
        run(action, action_step)
    if nproc > 1:
        jax.distributed.shutdown()
    print("OK", flush=True)


def run(mode: str, step: int) -> None:
    """One action: a save, restore, crash or own-disk of ``step``, or one of the other modes."""
    if mode == "manager-metrics":
        ranked_by_metrics(step)
        return
    if mode == "manager-asymmetric":
        asymmetric_errors(step)
        return
    if mode == "subset-mesh":
        subset_mesh(step)
        return
    if mode == "overlap":
        overlapping(step)
        return
    if mode == "slow-primary":
        slow_primary(step)
        return
    if mode == "late-primary":
        late_primary(step)
        return
    if mode in ("latest", "latest-abstract"):
        latest_alike(mode, step)
        return
    if mode.removeprefix("manager-") in ("early-fail", "other-step", "other-tree",
                                         "local-array"):
        out_of_step(mode, step)
        return
    values = expected(step)
    if mode in ("save", "crash", "own-disk"):
        state = {k: jax.make_array_from_callback(v.shape, s, lambda idx, v=v: v[idx])
                 for (k, v), s in zip(values.items(), shardings("save").values())}
        if mode == "own-disk":  # first, blocks of zeros alike on every host (a fresh moment)
            state["a_zeros"] = jax.device_put(np.zeros((64, 48), np.float32),
                                              shardings("save")["w"])
        store = LocalStore(f"{repo}/host{pid}" if mode == "own-disk" else repo)
        if mode == "crash" and pid == 1:
            real_put = store._put

            def put_then_die(key, data, *, exclusive):
                real_put(key, data, exclusive=exclusive)
                os._exit(17)  # killed after writing one chunk, before the commit

            store._put = put_then_die
        try:
            info = casstore.save(store, step, {"state": state, "step": step},
                                 chunk_size_bytes=2048)
        except casstore.CasstoreError as e:
            print("save failed:", e, flush=True)
            if mode == "own-disk":  # both alive: process 0, the coordinator, waits for 1
                jax.distributed.shutdown()
            os._exit(3)  # skip jax.distributed's shutdown barrier, which waits for the dead peer
        print("saved", info.new_chunks, info.written_bytes, flush=True)
    else:
        assert mode == "restore", mode
        target = {"state": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)
                            for (k, v), s in zip(values.items(), shardings("restore").values())},
                  "step": 0}
        restored = casstore.restore(repo, step, target=target)
        assert restored["step"] == step
        for key, array in restored["state"].items():
            assert array.sharding == target["state"][key].sharding
            for shard in array.addressable_shards:
                got = np.asarray(shard.data)
                assert got.tobytes() == values[key][shard.index].tobytes(), (key, shard.index)
        print("restored", step, flush=True)


main()
