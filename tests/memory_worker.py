"""Measures the peak extra host memory of one save or restore of a 2 GiB state; launched by
test_memory.py in a process of its own (forked from tests/forkserver.py). RSS is sampled every
5 ms during the operation; the figure is its peak minus the RSS just before the operation, once
jax's backend has started (a save of numpy leaves starts it too, for ``jax.process_count``).

Usage: memory_worker.py save-numpy|save-numpy-planes|save-jax|save-accelerator-path|restore-jax|
       restore-jax-bfloat16|restore-jax-padded|import-safetensors URL [LEAVES [LEAF_ELEMENTS]]
Prints one JSON line: {"state_bytes", "extra_peak_bytes", "inflight_bytes", "workers"}, and for a
restore "encoded" (whether the step's chunks are mostly encoded), "readers" (its reader threads)
and "check".
"""

import contextlib
import json
import os
import sys
import threading

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax
import numpy as np

import casstore
from casstore import _chunking
from casstore._chunking import DEFAULT_CHUNK_SIZE_BYTES
from casstore._repository import read_manifest
from casstore._save_upload import default_inflight_bytes

LEAVES = int(sys.argv[3]) if len(sys.argv) > 3 else 8  # of 256 MiB: 2 GiB by default
LEAF_ELEMENTS = int(sys.argv[4]) if len(sys.argv) > 4 else 64 * 2**20  # float32 elements


def high_water_mark() -> int:
    """The process's peak RSS since the last reset (Linux's VmHWM), in bytes; then resets it
    to the RSS now. It sees a peak no sampler does: one inside a call that holds the GIL."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return kib * 1024


@contextlib.contextmanager
def peak_extra_rss(out: dict):
    """Sets ``out["extra_peak_bytes"]``: the peak RSS during the body above the RSS before,
    sampled every 5 ms and, where Linux lets a process reset it, its VmHWM."""
    import gc

    import psutil
    gc.collect()
    proc = psutil.Process()
    hwm = os.access("/proc/self/clear_refs", os.W_OK)
    if hwm:
        high_water_mark()
    base = top = proc.memory_info().rss
    done = threading.Event()

    def sample():
        nonlocal top
        while not done.wait(0.005):
            top = max(top, proc.memory_info().rss)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join()
        top = max(top, proc.memory_info().rss, high_water_mark() if hwm else 0)
        out["extra_peak_bytes"] = top - base


def state(kind: str) -> dict:
    """LEAVES leaves of 256 MiB of random floats in [0, 1): the first drawn, the others that
    one rotated by a different count of elements each, so no chunk of one is a chunk of
    another. A copy takes a fifth of a draw's CPU (0.47 s a leaf on the loaded 2 cores)."""
    first = np.random.default_rng(0).random(LEAF_ELEMENTS, dtype=np.float32)
    tree = {f"w{i}": np.roll(first, i * 1_000_003) if i else first for i in range(LEAVES)}
    del first
    if not kind.startswith("save-numpy"):
        tree = {k: jax.device_put(v) for k, v in tree.items()}  # host copies are dropped
    return jax.block_until_ready(tree)


if __name__ == "__main__":
    kind, url = sys.argv[1], sys.argv[2]
    jax.devices()  # jax's runtime is not the operation's: 308 MB on a 16-core machine's CPU
    store = casstore.open_store(url)
    inflight = default_inflight_bytes(store.max_workers, DEFAULT_CHUNK_SIZE_BYTES)
    if kind.startswith("restore-jax"):  # -bfloat16: the float32 leaves cast as restored;
        dtype = jax.numpy.bfloat16 if kind.endswith("bfloat16") else np.float32
        pad = int(kind.endswith("padded"))  # -padded: one element longer, strict=False
        target = {f"w{i}": jax.ShapeDtypeStruct((LEAF_ELEMENTS + pad,), dtype)
                  for i in range(LEAVES)}
        with peak_extra_rss(result := {}):
            restored = casstore.restore(store, 0, target=target, strict=not pad)
            jax.block_until_ready(restored)
        result["check"] = float(restored[f"w{LEAVES - 1}"][-1 - pad].astype(np.float32))
        result["pad"] = float(restored[f"w{LEAVES - 1}"][-1]) if pad else None
        result["result_bytes"] = sum(a.nbytes for a in restored.values())
        result["encoded"] = read_manifest(store, 0).encoded()
        result["readers"] = store.read_threads(result["encoded"])
    elif kind == "import-safetensors":  # URL.safetensors (the caller wrote it) into URL
        with peak_extra_rss(result := {}):
            result["tensors"] = casstore.import_tensors(f"{url}.safetensors", store, 0).tensors
        result["check"] = float(casstore.restore(store, 0)[f"w{LEAVES - 1}"][-1])
    else:
        if kind == "save-accelerator-path":  # what a GPU takes: block copies to pinned memory
            _chunking.on_host = lambda x: False
        tree = state(kind)
        step = 0
        if kind == "save-numpy-delta":  # a sparse change of step 0's state: stored as deltas
            for v in tree.values():
                v[::1000] += np.float32(1)
            step = 1
        with peak_extra_rss(result := {}):  # -planes: byte planes whatever the machine
            info = casstore.save(store, step, tree,
                                 compression="bytes" if kind.endswith("planes") else None)
        result["delta_chunks"] = info.delta_chunks
        result["check"] = float(np.asarray(tree[f"w{LEAVES - 1}"])[-1])
    print(json.dumps({"state_bytes": LEAVES * LEAF_ELEMENTS * 4, "inflight_bytes": inflight,
                      "workers": store.max_workers, **result}))
