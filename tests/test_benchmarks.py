"""Smoke test: the save/restore benchmark runs end to end on a tiny state, so it does not rot."""

import json
import math
import os

import pytest

from conftest import load_benchmark


def test_save_restore_benchmark_reports_every_figure_for_every_system(tmp_path, capsys):
    bench = load_benchmark("save_restore")
    out = tmp_path / "result.json"
    plot = tmp_path / "ratios.png"
    result = bench.main(["--tiny", "--dir", str(tmp_path / "work"), "--json", str(out),
                         "--plot", str(plot)])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the bar chart was drawn

    n_leaves = result["leaves"]
    for system in bench.SYSTEMS:
        figures = result["results"][system]
        for key, _, _ in bench.FIGURES:
            if key == "same_values_save_s" and not system.startswith("casstore"):
                assert key not in figures, system  # systems without dedup skip phase 3b
                continue
            assert math.isfinite(figures[key]), (system, key)
            assert figures[key] >= 0, (system, key)
        # The bit-exact restore checks ran (they raise inside the benchmark on a mismatch).
        assert figures["verified_leaves"] == n_leaves, system
    casstore = result["results"]["casstore"]
    assert casstore["unchanged_save_new_chunks"] == 0
    assert casstore["unchanged_save_written_bytes"] < casstore["first_save_written_bytes"] / 10
    assert 0 < result["changed_leaves"] < n_leaves
    # The default ("auto", docs/tuning.md) stores the random float32 state's byte planes,
    # smaller than raw chunks, where the cores encode faster than a local disk writes (4 cores
    # or more), and raw chunks where they do not.
    from casstore._compression import PLANES, choose
    from casstore.store import LocalStore
    raw = result["results"]["casstore-raw"]
    if choose("auto", LocalStore.write_bytes_per_s, LocalStore.read_bytes_per_s) is PLANES:
        assert casstore["first_save_disk_bytes"] < 0.95 * raw["first_save_disk_bytes"]
    else:
        assert casstore["first_save_disk_bytes"] <= 1.05 * raw["first_save_disk_bytes"]
    # Nothing is left behind in --dir.
    assert list((tmp_path / "work").iterdir()) == []

    # The machine's limit was measured in the run, and saves and the restore are judged by it.
    limit = result["limit"]
    assert limit["workers"] == len(os.sched_getaffinity(0))
    for rate in ("write", "read", "copy", "hash", "encode", "decode"):
        assert limit[f"{rate}_bps"] > 1e6, rate  # above 1 MB/s, whatever the load
    assert 0.5 < limit["encoded_fraction"] < 1  # codec 5 on N(0, 0.02) float32 keeps ~0.83
    assert set(result["limits"]) == {"first_save_s", "changed_save_s", "restore_s"}
    assert all(s > 0 for s in result["limits"].values())
    # The first save's limit is the slower of hashing + encoding and writing what casstore
    # wrote, or of hashing and writing it raw, whichever is faster (harness/limit.py).
    hash_s, encode_s, write_s = (result["logical_bytes"] / limit[f"{r}_bps"]
                                 for r in ("hash", "encode", "write"))
    stored_s = casstore["first_save_written_bytes"] / limit["write_bps"]
    assert math.isclose(result["limits"]["first_save_s"],
                        min(max(hash_s + encode_s, stored_s), max(hash_s, write_s)))
    # The restore's, page cache warm on both sides: the read from the page cache and the
    # decoding (the hash alone for raw chunks) share the cores, so they add up.
    assert not result["dropped_caches"]
    assert not limit["read_cold"]
    raw_b, stored_b = result["logical_bytes"], casstore["first_save_written_bytes"]
    decode_s = raw_b / limit["hash_bps" if stored_b >= raw_b else "decode_bps"]
    cpu_s = stored_b / limit["copy_bps"] + raw_b / limit["touch_bps"] + decode_s
    assert math.isclose(result["limits"]["restore_s"],
                        max(cpu_s, stored_b / limit["read_bps"] + decode_s))

    printed = capsys.readouterr().out
    for _, label, _ in bench.FIGURES:
        assert f"| {label}" in printed
    assert "casstore: limit / figure" in printed
    assert "| codec encode (codec 5)" in printed
    assert json.loads(out.read_text())["results"].keys() == set(bench.SYSTEMS)


def test_restore_check_raises_on_a_flipped_bit():
    bench = load_benchmark("save_restore").h
    state = bench.train_state("tiny")
    restored = {k: v.copy() for k, v in bench.flatten(state).items()}
    restored["params/wpe"].view("uint32")[3, 5] ^= 1
    with pytest.raises(AssertionError, match="params/wpe differs"):
        bench.verify_equal(state, restored, "test", want_jax=False)


def test_gpt2_xl_state_has_the_issue_12_shape_without_being_built():
    """1.56B float32 params + adam mu and nu = 18.7 GB in 1741 leaves (jax.eval_shape only)."""
    import jax

    harness = load_benchmark("save_restore").h
    shapes = jax.eval_shape(lambda: harness.train_state("gpt2-xl", device=jax.devices()[0]))
    leaves = jax.tree.leaves(shapes)
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["params"]))
    assert len(leaves) == 1741
    assert params == 1_557_611_200
    assert sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves) == 3 * 4 * params + 4
    assert {str(x.dtype) for x in jax.tree.leaves(shapes["params"])} == {"float32"}


def test_jax_built_state_is_reproducible_and_changed_state_keeps_unchanged_leaves():
    """The jax.random builder (used for gpt2-xl), run on the tiny shapes."""
    import jax
    import numpy as np

    harness = load_benchmark("save_restore").h
    harness.states.JAX_SIZES = ("tiny",)
    try:
        dev = jax.devices("cpu")[0]
        a, b = harness.train_state("tiny", device=dev), harness.train_state("tiny", device=dev)
    finally:
        harness.states.JAX_SIZES = ("gpt2-xl",)
    flat_a = harness.flatten(a)
    assert all(isinstance(x, jax.Array) for k, x in flat_a.items() if k != "opt_state/count")
    assert harness.verify_equal(a, harness.flatten(b), "same seed", want_jax=False) == 121
    assert np.all(np.asarray(a["opt_state"]["nu"]["wte"]) >= 0)
    assert not harness.same_bytes(a["params"]["wte"], a["opt_state"]["mu"]["wte"])
    changed = harness.changed_state(a)
    same = [k for k, x in harness.flatten(changed).items() if x is flat_a[k]]
    n_changed, _, _ = harness.changed_zstd_bytes(a, changed)
    assert n_changed == 121 - len(same) == 79


def test_tuning_benchmark_changes_one_setting_per_variant(tmp_path, capsys):
    bench = load_benchmark("tuning")
    result = bench.main(["--tiny", "--dir", str(tmp_path / "work")])
    res = result["results"]
    assert set(res) == set(bench.VARIANTS)
    for name, figures in res.items():
        for key, _, _ in bench.COLUMNS:
            assert math.isfinite(figures[key]), (name, key)
            assert figures[key] >= 0, (name, key)
        assert 0 < figures["changed_written_bytes"] < figures["stored_bytes"], name
    # Byte planes store the random float32 state in fewer bytes than it has; chunk size and
    # workers do not change what is stored for leaves under 4 MiB.
    assert res["compression bytes"]["stored_bytes"] < 0.95 * result["logical_bytes"]
    assert res["4 workers"]["stored_bytes"] == res["1 worker"]["stored_bytes"]
    assert res["chunk 4 MiB"]["objects"] == res["chunk 64 MiB"]["objects"]
    for kind in ("safetensors", "npz"):  # both exports hold at least the state's bytes
        assert res["default"][f"export_{kind}_file_bytes"] >= result["logical_bytes"]
    # The machine's limit on local disk, measured in the run: every variant's saves and
    # restore are positive, finite fractions of it (limit / figure).
    assert result["limit"]["store"] == "local disk"
    assert set(result["limits"]) == {k for k, _ in bench.LIMITED}
    for name, fractions in result["fractions"].items():
        assert fractions.keys() == result["limits"].keys(), name
        for key, fraction in fractions.items():
            assert math.isfinite(fraction), (name, key)
            assert fraction > 0, (name, key)
            assert math.isclose(fraction, result["limits"][key] / res[name][key]), (name, key)
    printed = capsys.readouterr().out
    assert "| bytes, zstd 9 |" in printed
    assert "| limit / save | limit / changed save | limit / restore |" in printed
    assert "| local disk write, fsync" in printed
    assert list((tmp_path / "work").iterdir()) == []
