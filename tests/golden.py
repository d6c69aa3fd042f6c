"""The golden v1 repository under tests/golden/v1: its content and how it was made.

Run ``python tests/golden.py`` only to create it anew for a NEW format version; the v1 files
are committed and must keep loading forever (test_golden.py).
"""

import pathlib

import jax
import ml_dtypes
import numpy as np

GOLDEN = pathlib.Path(__file__).parent / "golden" / "v1"


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


if __name__ == "__main__":
    import casstore
    for step in (1, 2):
        casstore.save(GOLDEN, step, golden_tree(step), metadata={"note": "golden v1"},
                      chunk_size_bytes=4096)
    print(sorted(p.relative_to(GOLDEN).as_posix() for p in GOLDEN.rglob("*") if p.is_file()))
