"""Smoke test: the benchmarks run end to end on a tiny state, so they do not rot."""

import importlib.util
import pathlib

BENCH = pathlib.Path(__file__).parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_save_restore_benchmark_tiny(tmp_path, capsys):
    bench = load("save_restore")
    result = bench.main(["--tiny", "--dir", str(tmp_path), "--json", str(tmp_path / "r.json")])
    for system in ("casstore", "orbax", "safetensors"):
        figures = result["results"][system]
        assert set(bench.FIGURES) <= set(figures), system
        assert all(v >= 0 for v in figures.values())
    casstore_figures = result["results"]["casstore"]
    # Dedup is visible even at this size: the unchanged save writes only a manifest.
    assert casstore_figures["unchanged_save_bytes"] < casstore_figures["first_save_bytes"] / 10
    assert "| first_save (s) |" in capsys.readouterr().out
    assert (tmp_path / "r.json").exists()
