"""Saves steps through a tiered manager until killed; launched by test_tiers_crash.py.

Usage: tiers_worker.py LOCAL PERSISTENT_URL FIRST_STEP STORAGE_OPTIONS_JSON. Prints "ready"
once the manager is open (it may already be persisting what an earlier, killed worker left).
       tiers_worker.py --fork-server: the same for each JSON list ``[LOCAL, PERSISTENT_URL,
       FIRST_STEP, STORAGE_OPTIONS]`` read on stdin, in a forked child that prints "ready PID"
       (crash_worker.fork_server).
"""

import json
import sys
import time

from crash_worker import fork_server, tree_for

import casstore

INTERVAL = 2  # every other step is persisted


def save_until_killed(local: str, url: str, first: int, options: dict,
                      ready: str = "ready") -> None:
    persistent = casstore.open_store(url, **options)
    mngr = casstore.CheckpointManager(local, persistent=persistent, max_to_keep=4,
                                      persist_interval_steps=INTERVAL,
                                      chunk_size_bytes=64 * 1024)
    print(ready, flush=True)
    for step in range(first, first + 1000):
        mngr.save(step, tree_for(step), force=True)
        time.sleep(0.02)  # a training step: persists yield to saves and run in between


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork-server"]:
        fork_server(save_until_killed)
    else:
        save_until_killed(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
