"""Saves steps in a loop until killed; launched by test_crash.py.

Usage: crash_worker.py URL FIRST_STEP [STORAGE_OPTIONS_JSON]. Prints "ready" once imported.
"""

import json
import sys

import numpy as np

import casstore


def tree_for(step: int) -> dict:
    """Deterministic content per step, shared with the test that checks it."""
    rng = np.random.default_rng(step)
    weights = np.random.default_rng(0).standard_normal(200_000).astype(np.float32) * 0.02
    return {"base": np.arange(200_000, dtype=np.float32),
            "head": rng.standard_normal(300_000).astype(np.float32),
            "trained": weights * np.float32(1 + 1e-4 * (step % 997)),  # stored as deltas
            "small": np.full(50, step, np.int32), "step": step}


if __name__ == "__main__":
    url, first = sys.argv[1], int(sys.argv[2])
    options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    store = casstore.open_store(url, **options)
    save = casstore.save  # imported (with jax, 0.6 s) before "ready": kills land in saves
    print("ready", flush=True)
    for step in range(first, first + 1000):
        save(store, step, tree_for(step), chunk_size_bytes=64 * 1024)
