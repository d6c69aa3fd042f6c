"""Smoke test: the async-save and GC benchmark runs end to end on tiny states (does not rot)."""

import json
import math
import statistics

from conftest import load_benchmark


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_async_gc_benchmark_reports_every_figure_and_its_checks_pass(tmp_path, capsys):
    bench = load_benchmark("async_gc")
    out = tmp_path / "result.json"
    result = bench.main(["--tiny", "--dir", str(tmp_path / "work"), "--json", str(out)])

    saves = bench.ASYNC_SAVES
    for system in bench.SYSTEMS:
        figures = result["async"][system]
        for key, _, _ in bench.ASYNC_FIGURES:
            if system == "orbax" and key == "reported_blocking_s":
                assert math.isnan(figures[key])  # orbax has no such figure
                continue
            if key == "rss_extra_bytes":  # RSS may not grow at all on a tiny state
                assert figures[key] >= 0, (system, figures[key])
                continue
            assert positive(figures[key]), (system, key, figures[key])
        assert figures["saves_measured"] == saves
        steps = result["async_runs"][system][0]["saves"]
        assert figures["first_blocking_s"] == steps[0]["blocking_s"]
        assert figures["later_blocking_s"] == statistics.median(s["blocking_s"] for s in steps[1:])
        # The bit-exact restore checks ran (they raise inside the benchmark on a mismatch).
        assert figures["verified_steps"] == saves, system
        assert figures["proof_verified"], system
        for save in result["async_runs"][system][0]["saves"]:
            assert save["blocking_s"] <= save["total_s"], (system, save)
    assert positive(result["host_copy_s"])
    casstore = result["async"]["casstore"]
    assert casstore["reported_blocking_s"] <= casstore["blocking_s"]
    # casstore, like orbax, holds zero-copy views of CPU buffers while the save runs, so jax
    # copies instead of donating them in place (unique_shards in casstore/_chunking.py).
    assert not casstore["buffers_donated_in_place"]

    gc = result["gc"]
    assert gc["steps"] == bench.GC_STEPS
    assert len(gc["kept_steps"]) == bench.GC_KEEP
    for part in ("dry_run", "gc"):
        for key, _, _ in bench.GC_FIGURES:
            assert positive(gc[part][key]), (part, key, gc[part][key])
        assert gc[part]["manifests"] == bench.GC_KEEP
    assert gc["gc"]["deleted_chunks"] == gc["chunks_before"] - gc["chunks_after"]
    assert gc["gc"]["deleted_bytes"] == gc["bytes_before"] - gc["bytes_after"]
    assert gc["young_dry_run_spared"] == gc["gc"]["deleted_chunks"]
    assert gc["second_gc_deleted"] == 0
    assert gc["verify_ok"]
    assert gc["restored_steps"] == bench.GC_KEEP
    # Nothing is left behind in --dir.
    assert list((tmp_path / "work").iterdir()) == []

    # The first save's total is judged by the machine's limit, measured in the run.
    assert result["limit"]["workers"] >= 1
    assert result["limit"]["encode_bps"] > 0
    assert 0 < result["limits"]["first_total_s"] < math.inf

    printed = capsys.readouterr().out
    for _, label, _ in bench.ASYNC_FIGURES:
        assert f"| {label}" in printed
    assert "casstore: limit / figure" in printed
    for _, label, _ in bench.GC_FIGURES:
        assert f"| {label} |" in printed
    assert json.loads(out.read_text())["async"].keys() == set(bench.SYSTEMS)
