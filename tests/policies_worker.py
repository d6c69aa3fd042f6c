"""One process of a 2-process JAX job, launched by test_policies_multiprocess.py.

Usage: policies_worker.py PORT NUM_PROCESSES PROCESS_ID MODE REPO
MODE is ``preemption`` (process 1 receives SIGTERM at step 5; every process saves at jax's
preemption sync point and stops) or ``continuous`` (process 1's clock runs a day ahead, so its
own ContinuousCheckpointingPolicy decision differs from process 0's). Prints the steps it
saved (``SAVED [...]``), where it stopped (``STOPPED n``) and ``OK``.
"""

import datetime
import os
import signal
import sys
import time

port, nproc, pid, mode, repo = sys.argv[1:]
nproc, pid = int(nproc), int(pid)
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                           process_id=pid)

import casstore  # noqa: E402
import casstore._policies  # noqa: E402


def preemption() -> None:
    saved, step = [], 0
    with casstore.CheckpointManager(repo, save_interval_steps=1000) as mngr:
        for step in range(1, 2000):
            if pid == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, to one process
            if mngr.save(step, {"w": np.full(4, step)}):
                saved.append(step)
            if mngr.reached_preemption(step):
                mngr.wait_until_finished()
                break
            time.sleep(0.01)
    print("SAVED", saved, "STOPPED", step, flush=True)


def continuous() -> None:
    if pid == 1:
        ahead = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
        casstore._policies.utc_now = lambda: ahead
    policy = casstore.ContinuousCheckpointingPolicy(minimum_interval_secs=3600)
    with casstore.CheckpointManager(repo, save_decision_policy=policy) as mngr:
        saved = []
        for step in range(6):
            if mngr.save(step, {"w": np.full(4, step)}):
                saved.append(step)
            mngr.wait_until_finished()  # no save in flight: only the clocks differ
    print("SAVED", saved, "STOPPED", 5, flush=True)


{"preemption": preemption, "continuous": continuous}[mode]()
jax.distributed.shutdown()
print("OK", flush=True)
