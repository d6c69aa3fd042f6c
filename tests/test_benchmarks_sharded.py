"""Smoke test: the sharded benchmark runs end to end on a tiny state (does not rot).

It runs as a subprocess because the benchmark must set XLA_FLAGS (8 host devices) before jax
is imported, and this test process may already have imported jax.
"""

import json
import math
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]
TIMED = ("save_s", "restore_same_s", "restore_other_s")
BYTES = ("single_bytes_read", "whole_bytes_read", "single_raw_bytes", "whole_raw_bytes",
         "single_chunks_read", "whole_chunks_read", "single_over_whole",
         "restore_other_rss_extra_bytes")


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_sharded_benchmark_reports_every_figure_and_its_checks_pass(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/sharded.py", "--tiny", "--dir", str(tmp_path / "work"),
         "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["checks_passed"] is True
    for system in ("casstore", "orbax"):
        figures = result["figures"][system]
        for key in TIMED:
            assert positive(figures[key]), (system, key, figures[key])
        assert figures["checked_same"] == figures["checked_other"] == len(result["leaves"])
        assert "restore_other_rss_extra_bytes" in figures
    casstore_figures = result["figures"]["casstore"]
    for key in BYTES[:-1]:
        assert positive(casstore_figures[key]), (key, casstore_figures[key])
    # One device's region is an eighth of the array and never needs more bytes than the whole.
    assert casstore_figures["single_raw_bytes"] * 8 == casstore_figures["whole_raw_bytes"]
    assert casstore_figures["single_bytes_read"] <= casstore_figures["whole_bytes_read"]
    assert len(result["environment"]["load_before"]) == 3
    # Save and restores are judged by the machine's limit, measured in the run.
    assert set(result["limits"]) == set(TIMED)
    assert all(0 < result["limits"][k] < math.inf for k in TIMED)
    assert "casstore: limit / figure" in proc.stdout
    assert "| save (s) |" in proc.stdout
