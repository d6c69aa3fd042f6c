"""One process of a two-process JAX job saving through a tiered manager; launched by
test_tiers.py. Both processes write to one local tier (a directory both see); every other
step is persisted once committed, each process sending its share of the step's objects and
process 0 writing the manifest.

Usage: tiers_multiprocess_worker.py PORT PROCESS_ID LOCAL PERSISTENT_URL OPTIONS_JSON STEPS
       [fail1 | slow0]
Prints ``SENT <steps persisted> <chunks> <bytes>`` (this process's share), ``LOOKUPS <n>``
(objects it looked up on the persistent tier), ``STEPS <all_steps()>`` and ``OK``. With
``fail1`` process 1 opens the persistent tier read-only, so its share fails; each process then
prints ``PERSIST-ERROR <message>`` for the error its manager raised. With ``slow0`` process 0
writes each manifest on the persistent tier 2 s late, and each process prints ``SEEN <steps
there>`` as soon as its ``wait_until_persisted()`` returns.
"""

import json
import os
import sys
import time

port, pid, local, url, options, steps, *mode = sys.argv[1:]
pid, steps = int(pid), int(steps)
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import casstore  # noqa: E402
from casstore._coordinator import kv_client  # noqa: E402
from casstore.store import CountingStore  # noqa: E402


class SlowManifests(CountingStore):
    """Writes each manifest 2 s late (``slow0``: process 0 commits long after the shares)."""

    def put_if_absent(self, key, data):
        if key.endswith(".manifest"):
            time.sleep(2)
        return super().put_if_absent(key, data)


def expected(step: int) -> dict:
    """The global state's values, identical on every process (test_tiers.py checks them):
    ``frozen`` is the same at every step."""
    return {"w": np.arange(64 * 48, dtype=np.float32).reshape(64, 48) * step,
            "b": np.full(48, step, np.float32),
            "frozen": np.arange(64 * 48, dtype=np.float32).reshape(64, 48) + 0.5}


jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid)
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
SHARDINGS = {"w": NamedSharding(mesh, P("data", "model")), "b": NamedSharding(mesh, P()),
             "frozen": NamedSharding(mesh, P("data", "model"))}

counting = SlowManifests if mode == ["slow0"] and pid == 0 else CountingStore
persistent = counting(casstore.open_store(url, read_only=mode == ["fail1"] and pid == 1,
                                          **json.loads(options)))
try:
    with casstore.CheckpointManager(local, persistent=persistent, persist_interval_steps=2,
                                    max_to_keep=1) as mngr:
        for step in range(steps):
            values = expected(step)
            state = {k: jax.make_array_from_callback(v.shape, s, lambda idx, v=v: v[idx])
                     for (k, v), s in zip(values.items(), SHARDINGS.values())}
            assert mngr.save(step, {"state": state, "step": step}, force=True)
        mngr.wait_until_persisted()
        if mode == ["slow0"]:
            print("SEEN", casstore.list_steps(persistent.inner), flush=True)
except (casstore.PersistError, casstore.ReadOnlyStoreError) as e:
    print("PERSIST-ERROR", str(e).replace("\n", " "), flush=True)
infos = mngr.persister.persisted  # final once closed: process 0 ended the rounds
print("SENT", sorted(infos), sum(i.chunks_copied for i in infos.values()),
      sum(i.bytes_copied for i in infos.values()), flush=True)
print("LOOKUPS", persistent.counts["stat"], flush=True)  # objects probed on the tier
print("STEPS", mngr.all_steps(), flush=True)  # both tiers, as this process knows them
if pid == 0:  # the coordinator keeps the last rounds' keys only (was: every round's)
    rounds = {key.rsplit("/", 1)[-1] if "/done/" not in key else key.rsplit("/", 2)[-2]
              for key, _ in kv_client().key_value_dir_get_bytes("casstore/persist/")}
    print("ROUNDS", sorted(map(int, rounds)), flush=True)
jax.distributed.shutdown()
print("OK", flush=True)
