"""Smoke test: the save/restore benchmark runs end to end on a tiny state, so it does not rot."""

import importlib.util
import json
import math
import pathlib

import pytest

BENCH = pathlib.Path(__file__).parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_save_restore_benchmark_reports_every_figure_for_every_system(tmp_path, capsys):
    bench = load("save_restore")
    out = tmp_path / "result.json"
    result = bench.main(["--tiny", "--dir", str(tmp_path / "work"), "--json", str(out)])

    n_leaves = result["leaves"]
    for system in bench.SYSTEMS:
        figures = result["results"][system]
        for key in bench.FIGURE_KEYS:
            assert math.isfinite(figures[key]) and figures[key] >= 0, (system, key)
        # The bit-exact restore checks ran (they raise inside the benchmark on a mismatch).
        assert figures["verified_leaves"] == n_leaves, system
    casstore = result["results"]["casstore"]
    assert casstore["unchanged_save_new_chunks"] == 0
    assert casstore["unchanged_save_written_bytes"] < casstore["first_save_written_bytes"] / 10
    assert 0 < result["changed_leaves"] < n_leaves
    # Nothing is left behind in --dir.
    assert list((tmp_path / "work").iterdir()) == []

    printed = capsys.readouterr().out
    for _, label, _ in bench.FIGURES:
        assert f"| {label}" in printed
    assert json.loads(out.read_text())["results"].keys() == set(bench.SYSTEMS)


def test_restore_check_raises_on_a_flipped_bit():
    bench = load("harness")
    state = bench.train_state("tiny")
    restored = {k: v.copy() for k, v in bench.flatten(state).items()}
    restored["params/wpe"].view("uint32")[3, 5] ^= 1
    with pytest.raises(AssertionError, match="params/wpe differs"):
        bench.verify_equal(state, restored, "test", want_jax=False)
