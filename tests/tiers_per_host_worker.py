"""One process of a two-process JAX job saving through a tiered manager whose local tier is a
directory of its own (``local_per_host=True``); launched by test_tiers_per_host.py.

Usage: tiers_per_host_worker.py PORT PROCESS_ID LOCAL_BASE PERSISTENT_URL OPTIONS_JSON MODE
Process ``i`` saves into ``LOCAL_BASE/local-i``. MODE ``save``: saves steps 0 to 3, every
other one persisted, then restores step 3 on this process's devices. MODE ``reopen`` (after
``save``, e.g. with one local directory deleted: a replaced host): restores the latest step,
then saves steps 3 and 4 again. MODE ``hide``: saves steps 0 and 1 to local tiers that say
they lack the chunk of step 0's numpy leaf, so no process holds it, and prints
``PERSIST-ERROR <message>`` for the persist error its manager raised. MODE ``plain``: the
same directories without ``local_per_host``; saves step 0 and prints ``SAVE-ERROR <message>``
for the error its manager raised. MODE ``slow1``: saves steps 0 and 1, process 1's copy of each
manifest written 2 s late. MODE ``delete``: saves steps 0 to 2, deletes step 2 at once,
then saves steps 3 and 4. MODE ``down``: process 0 cannot write to the persistent tier;
saves step 0 and prints ``WAITED <wait_until_persisted(timeout_s=12)> <seconds>``. MODE
``stages``: saves steps 0 and 1 with a small jax leaf on process 0's devices only and a
small numpy leaf beside the state, and prints ``STAGES`` and whether step 1 restores
bit-exact (state, numpy leaf, the jax leaf's shards). MODE ``full1``: process 1's local
tier cannot write step 1's manifest (no space); saves steps 0 to 2, printing ``SAVE-ERROR
<step> <message>`` for step 1's; ``slowcopy`` likewise, process 1's copy of step 1's manifest
written 9 s late (the multi-process timeout is 6 s). MODE ``behind``: every write to the persistent
tier takes 1 s longer and local retention keeps 2 steps; saves steps 0 to 5, waits for the
persists, and prints ``DROPPED <steps process 0 dropped from its backlog>`` and ``DISK <the
steps on this process's local tier>``. MODE ``retain``: the persistent tier
keeps 1 step; saves steps 0 to 4, waits for each persist, and prints ``REMOTE <step> <the
persisted steps this process lists>``. Prints ``STEPS <all_steps()>``, ``LATEST <latest_step()>``,
``RESTORED <step> <bit-exact: True/False> <bytes read from the persistent tier>`` (``WHOLE``:
step 2 restored whole, as numpy), ``PERSISTED <steps>``, ``SENT <chunks> <bytes>`` (process 0:
every process's) and ``OK``.
"""

import contextlib
import json
import os
import sys
import time

port, pid, base, url, options, mode = sys.argv[1:]
pid = int(pid)
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
if mode == "slowcopy":
    os.environ["CASSTORE_MULTIHOST_TIMEOUT_S"] = "6"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import casstore  # noqa: E402
from casstore._codec import chunk_id  # noqa: E402
from casstore._layout import chunk_key  # noqa: E402
from casstore.store import LocalStore  # noqa: E402
from casstore.testing import FaultyStore  # noqa: E402


class SlowManifests(LocalStore):
    """Writes each manifest 2 s late (``slow1``: process 1's copy lands after process 0 has
    started the step's persist)."""

    def put_if_absent(self, key, data):
        if key.endswith(".manifest"):
            time.sleep(2)
        return super().put_if_absent(key, data)


class FullAtStep1(LocalStore):
    """Has no space for step 1's manifest (``full1``), or writes it 9 s late (``slowcopy``)."""

    def put_if_absent(self, key, data):
        if key.endswith("1.manifest") and mode == "full1":
            raise OSError(28, "No space left on device", key)
        if key.endswith("1.manifest"):
            time.sleep(9)
        return super().put_if_absent(key, data)


class Hiding(LocalStore):
    """Says it lacks ``hidden`` (``hide``: the object is on no process's local tier)."""

    hidden = ""

    def exists(self, key):
        return key != self.hidden and super().exists(key)

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid)
# process 0's 4 devices hold rows 0-31 of "w", process 1's rows 32-63; "b" is on all 8
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
SHARDINGS = {"w": NamedSharding(mesh, P("data", "model")), "b": NamedSharding(mesh, P())}


def expected(step: int) -> dict:
    """The state's values at ``step``, the same on every process."""
    return {"w": np.arange(64 * 48, dtype=np.float32).reshape(64, 48) * (step + 1),
            "b": np.full(48 * 64, step, np.float32),
            "n": np.arange(128 * 160, dtype=np.int32).reshape(128, 160) + step}


def tree(step: int) -> dict:
    values = expected(step)
    state = {k: jax.make_array_from_callback(values[k].shape, s, lambda idx, v=values[k]: v[idx])
             for k, s in SHARDINGS.items()}
    return {"state": {**state, "n": values["n"]}, "step": step}


def restored_exactly(mngr, step: int) -> bool:
    """Restores ``step`` onto this process's devices; True if every value is bit-exact."""
    got = mngr.restore(step, target=casstore.abstract_tree(tree(step)))
    values, ok = expected(step), got["step"] == step
    for k in SHARDINGS:
        for shard in got["state"][k].addressable_shards:
            ok &= np.asarray(shard.data).tobytes() == values[k][shard.index].tobytes()
    return bool(ok and got["state"]["n"].tobytes() == values["n"].tobytes())


persistent = casstore.open_store(url, **json.loads(options))
if mode == "behind":  # a persistent tier slower than the saves: process 0 drops steps
    persistent = FaultyStore(persistent, seed=0, rate=1.0, ops=("put", "put_if_absent"),
                             kinds=("slow",), delay_s=1.0)
if mode == "down" and pid == 0:  # process 0 cannot write there: its persists fail at once
    persistent = FaultyStore(persistent, seed=0, rate=1.0, ops=("put", "put_if_absent"),
                             kinds=("error",))
local = os.path.join(base, f"local-{pid}")
if mode == "slow1" and pid == 1:
    local = SlowManifests(local)
if mode in ("full1", "slowcopy") and pid == 1:
    local = FullAtStep1(local)
if mode == "hide":
    local = Hiding(local)
    local.hidden = chunk_key(chunk_id(expected(0)["n"].tobytes()))
    print("HIDDEN", local.hidden, flush=True)
mngr = casstore.CheckpointManager(local, persistent=persistent, persist_interval_steps=2,
                                  local_per_host=mode != "plain",
                                  persistent_max_to_keep=1 if mode == "retain" else None,
                                  max_to_keep=2 if mode == "behind" else None)
print("STEPS", mngr.all_steps(), flush=True)
print("LATEST", mngr.latest_step(), flush=True)
if mode in ("reopen", "look"):
    latest = mngr.latest_step()
    exact = restored_exactly(mngr, latest)
    print("RESTORED", latest, exact, mngr.last_restore_bytes.get(persistent.url, 0),
          flush=True)
if mode == "stages":  # a pipeline's layout: a small leaf on process 0's devices only
    stage = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("x",)), P())
    assert {d.process_index for d in stage.device_set} == {0}

    def staged(step: int) -> dict:
        return {**tree(step), "small": np.full(300, step, np.float32),  # packed
                "stage0": jax.make_array_from_callback(  # (packed with it before: refused)
                    (256,), stage, lambda i: np.arange(256, dtype=np.float32)[i] + step,
                    dtype=np.float32)}

    for step in range(2):
        assert mngr.save(step, staged(step))
    got, values = mngr.restore(1, target=casstore.abstract_tree(staged(1))), expected(1)
    stage0 = np.arange(256, dtype=np.float32) + 1
    print("STAGES", all(np.asarray(s.data).tobytes() == values[k][s.index].tobytes()
                        for k in SHARDINGS for s in got["state"][k].addressable_shards)
          and got["state"]["n"].tobytes() == values["n"].tobytes(),
          got["small"].tobytes() == np.full(300, 1, np.float32).tobytes(),
          all(np.asarray(s.data).tobytes() == stage0[s.index].tobytes()
              for s in got["stage0"].addressable_shards), flush=True)
if mode == "down":  # process 0's persist of step 0 fails before its round
    assert mngr.save(0, tree(0))
    mngr.wait_until_finished()
    t0 = time.monotonic()
    with contextlib.suppress(casstore.PersistError):  # process 0's
        print("WAITED", mngr.wait_until_persisted(timeout_s=12), time.monotonic() - t0,
              flush=True)
    if pid == 0:
        time.sleep(6)  # closing ends the rounds, which lets the others' waits return too
    with contextlib.suppress(casstore.PersistError):
        mngr.close()
    jax.distributed.shutdown()
    print("OK", flush=True)
    sys.exit(0)
if mode in ("full1", "slowcopy"):  # step 1 is on no process's list: each raises its save's error
    for step in range(3):
        assert mngr.save(step, tree(step))
        try:
            mngr.wait_until_finished()
        except casstore.CasstoreError as e:
            print("SAVE-ERROR", step, str(e).replace("\n", " "), flush=True)
    print("LISTED", casstore.list_steps(os.path.join(base, f"local-{pid}")), flush=True)
if mode == "behind":  # every process keeps what process 0 keeps
    for step in range(6):
        assert mngr.save(step, tree(step))
        mngr.wait_until_finished()
    assert mngr.wait_until_persisted(timeout_s=60)
    print("DROPPED", sorted(mngr.persister.dropped), flush=True)
    print("DISK", casstore.list_steps(os.path.join(base, f"local-{pid}")), flush=True)
if mode == "retain":  # process 0's retention there: every process's list drops the step
    for step in range(5):
        assert mngr.save(step, tree(step))
        assert mngr.wait_until_persisted(timeout_s=60)
        print("REMOTE", step, sorted(mngr.persister.steps()), flush=True)
if mode == "delete":  # step 2 deleted on every process right after its save
    for step in range(3):
        assert mngr.save(step, tree(step))
        if step == 0:
            mngr.wait_until_persisted()
    mngr.wait_until_finished()
    mngr.delete(2)
steps = {"save": range(4), "reopen": range(3, 5), "hide": range(2), "plain": range(1),
         "slow1": range(2), "look": range(0), "stages": range(0), "retain": range(0),
         "full1": range(0), "slowcopy": range(0), "behind": range(0),
         "delete": range(3, 5)}[mode]
for step in steps:
    assert mngr.save(step, tree(step), force=True)
try:
    mngr.wait_until_persisted()
except casstore.PersistError as e:
    print("PERSIST-ERROR", str(e).replace("\n", " "), flush=True)
except casstore.CasstoreError as e:
    print("SAVE-ERROR", str(e).replace("\n", " "), flush=True)
if mode == "save":
    exact = restored_exactly(mngr, 3)
    print("RESTORED", 3, exact, mngr.last_restore_bytes.get(persistent.url, 0), flush=True)
    # another topology: every value on this process, as numpy (the other host's rows of
    # state/w come from the persistent tier)
    got, values = mngr.restore(2)["state"], expected(2)
    exact = all(got[k].tobytes() == values[k].tobytes() for k in values)
    print("WHOLE", 2, exact, mngr.last_restore_bytes.get(persistent.url, 0), flush=True)
mngr.close()
infos = mngr.persister.persisted
print("PERSISTED", sorted(infos), flush=True)
print("SENT", sum(i.chunks_copied for i in infos.values()),
      sum(i.bytes_copied for i in infos.values()), flush=True)
print("STEPS", mngr.all_steps(), flush=True)
jax.distributed.shutdown()
print("OK", flush=True)
