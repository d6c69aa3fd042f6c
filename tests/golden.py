"""The golden repositories under tests/golden: their content and how they were made.

``v1`` is the first format; ``v2-features`` was written by the casstore of 2026-11-25 with
every feature it writes: codec 5 chunks, delta chunks, packed small leaves, two runs, bfloat16
and a leaf sharded over 8 devices, and the ``features`` / ``min_reader`` fields (format.md §10).
``v3-digest`` holds v1's tree (inline arrays and every scalar kind) as written on 2026-11-28,
when manifests gained their ``digest`` (format.md §4.1).
Run ``python tests/golden.py v1|v2|v3`` only to create one anew for a NEW format version; the
committed files must keep loading forever, bit-exact (test_golden.py). The v2 values are made
by integer arithmetic and exact conversions, so they are the same bits on every machine.
"""

import pathlib

import jax
import ml_dtypes
import numpy as np

GOLDEN = pathlib.Path(__file__).parent / "golden" / "v1"
GOLDEN_V2 = pathlib.Path(__file__).parent / "golden" / "v2-features"
GOLDEN_V3 = pathlib.Path(__file__).parent / "golden" / "v3-digest"
V2_STEPS = {"pretrain": (1, 2), "finetune": (3, 4)}  # run -> steps; each step deltas on the last
V2_CHUNK = 16 * 1024


def golden_tree(step: int) -> dict:
    """The deterministic tree saved at ``step`` (1 and 2) of run ``default``."""
    base = np.arange(3000, dtype=np.float32).reshape(100, 30) / 7
    return {
        "params": {"embed": base, "layers": [
            {"w": (base[:30] * (i + 1)).astype(ml_dtypes.bfloat16),
             "b": np.full(30, i, np.float16)} for i in range(2)]},
        "opt": ({"count": np.int32(step), "mu": {"embed": base * step}}, None),
        "misc": {"flag": True, "name": "golden/[v1]", "lr": 1e-3, "z": 1 - 2j, "raw": b"\x00\x01",
                 "big_int": -(2**40), "i4": np.arange(-8, 8, dtype=ml_dtypes.int4),
                 "f8": np.linspace(-2, 2, 9).astype(ml_dtypes.float8_e4m3fn),
                 "be": np.arange(6, dtype=">i8").reshape(2, 3), "empty": np.zeros((0, 4)),
                 "key": jax.random.key(42), "ints": {7: np.uint16(7), -1: 0.5}},
    }


def _floats(n: int, seed: int, scale_log2: int = -6) -> np.ndarray:
    """``n`` float32 in ``(-2**scale_log2, 2**scale_log2)`` that look random: a 32-bit
    xorshift of the index, whose top 23 bits times a power of two are exact float32s."""
    x = (np.arange(n, dtype=np.uint64) * 2654435761 + seed * 40503 + 1) & 0xFFFFFFFF
    for shift in (13, -17, 5):
        x ^= (x << np.uint64(-shift) if shift < 0 else x >> np.uint64(shift)) & 0xFFFFFFFF
    signed = (x >> np.uint64(9)).astype(np.int64) - 2**22
    return (signed * 2.0 ** (scale_log2 - 22)).astype(np.float32)


def _trained(base: np.ndarray, step: int) -> np.ndarray:
    """``base`` after ``step`` sparse updates: one element in 32 per step has its lowest
    mantissa bits flipped, so the next step's chunks are stored as small deltas."""
    bits = base.view(np.uint32).copy()
    touched = np.arange(bits.size).reshape(bits.shape) % 32 < step
    bits[touched] ^= np.uint32(step * 5 & 0x7F)
    return bits.view(np.float32)


def golden_v2_tree(run: str, step: int, sharding=None) -> dict:
    """The deterministic tree saved at ``step`` of ``run`` (:data:`V2_STEPS`) in v2-features.

    ``sharding`` (a NamedSharding over 8 devices) puts ``w_sharded`` on devices as the save
    did; None gives it as numpy, as a restore without target returns it.
    """
    import jax

    seed = 0 if run == "pretrain" else 1
    w = _trained(_floats(128 * 128, seed).reshape(128, 128), step)  # 64 KiB: 4 chunks
    w_sharded = _trained(_floats(128 * 64, seed + 10).reshape(128, 64), step)  # 8 shards
    layers = [{"scale": np.full(256, 1 + i / 8, np.float32) + _floats(256, i, -10),
               "bias": _floats(256, 20 + i + step, -12)} for i in range(3)]  # packs
    return {
        "params": {"w": w, "w_sharded": w_sharded if sharding is None
                   else jax.device_put(w_sharded, sharding),
                   "emb_bf16": _floats(96 * 64, seed + 30).reshape(96, 64).astype(
                       ml_dtypes.bfloat16), "layers": layers},
        "opt": {"nu": np.abs(_floats(8192, seed + 40 + step, -14)),  # adam's nu: one sign
                "count": np.int32(step)},
        "step": step, "name": f"golden/{run}",
    }


def _write_v2() -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import casstore
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    for run, steps in V2_STEPS.items():
        for step in steps:
            casstore.save(GOLDEN_V2, step, golden_v2_tree(run, step, sharding), run=run,
                          metadata={"note": "golden v2-features"}, chunk_size_bytes=V2_CHUNK)


if __name__ == "__main__":
    import os
    import sys
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import casstore
    if sys.argv[1:] == ["v3"]:
        casstore.save(GOLDEN_V3, 1, golden_tree(1), metadata={"note": "golden v3-digest"},
                      chunk_size_bytes=4096)
        print(sorted(p.relative_to(GOLDEN_V3).as_posix() for p in GOLDEN_V3.rglob("*")))
        sys.exit()
    if sys.argv[1:] == ["v2"]:
        _write_v2()
        print(sorted(p.relative_to(GOLDEN_V2).as_posix() for p in GOLDEN_V2.rglob("*")))
        sys.exit()
    for step in (1, 2):
        casstore.save(GOLDEN, step, golden_tree(step), metadata={"note": "golden v1"},
                      chunk_size_bytes=4096)
    print(sorted(p.relative_to(GOLDEN).as_posix() for p in GOLDEN.rglob("*") if p.is_file()))
