"""A process that saves steps into a repository; launched by test_processes.py.

Usage: save_worker.py URL RUN FIRST_STEP COUNT [--exit-during-async-save]
Prints one line per step: "saved STEP" or "exists STEP".
"""

import sys
import time

import numpy as np

import casstore
from casstore.store import LocalStore


def tree_for(run: str, step: int) -> dict:
    """Deterministic content per run and step; every run shares the "base" leaf."""
    rng = np.random.default_rng([step, sum(map(ord, run))])
    return {"base": np.arange(100_000, dtype=np.float32),
            "head": rng.standard_normal(50_000).astype(np.float32), "run": run, "step": step}


class SlowStore(LocalStore):
    """Chunk writes take 50 ms each, so the interpreter exits while a save is in flight."""

    def _put(self, key, data, *, exclusive):
        if key.startswith("chunks/"):
            time.sleep(0.05)
        super()._put(key, data, exclusive=exclusive)


if __name__ == "__main__":
    url, run, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if "--exit-during-async-save" in sys.argv:
        mngr = casstore.CheckpointManager(SlowStore(url), run=run)
        mngr.save(first, tree_for(run, first) | {"big": np.arange(2_000_000, dtype=np.int64)})
        print("returned", flush=True)
        sys.exit(0)  # no close(): the interpreter must wait for the save in flight
    for step in range(first, first + count):
        try:
            casstore.save(url, step, tree_for(run, step), run=run, chunk_size_bytes=32 * 1024)
            print("saved", step, flush=True)
        except casstore.StepAlreadyExistsError:
            print("exists", step, flush=True)
