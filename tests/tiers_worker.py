"""Saves steps through a tiered manager until killed; launched by test_tiers_crash.py.

Usage: tiers_worker.py LOCAL PERSISTENT_URL FIRST_STEP STORAGE_OPTIONS_JSON. Prints "ready"
once the manager is open (it may already be persisting what an earlier, killed worker left).
"""

import json
import sys
import time

from crash_worker import tree_for

import casstore

INTERVAL = 2  # every other step is persisted

if __name__ == "__main__":
    local, url, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
    persistent = casstore.open_store(url, **json.loads(sys.argv[4]))
    mngr = casstore.CheckpointManager(local, persistent=persistent, max_to_keep=4,
                                      persist_interval_steps=INTERVAL,
                                      chunk_size_bytes=64 * 1024)
    print("ready", flush=True)
    for step in range(first, first + 1000):
        mngr.save(step, tree_for(step), force=True)
        time.sleep(0.02)  # a training step: persists yield to saves and run in between
