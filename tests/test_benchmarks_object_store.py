"""Smoke test: the object-storage benchmark (casstore vs plain s3fs on SeaweedFS) runs end to end
on a tiny state, with its own SeaweedFS servers, so it does not rot."""

import json
import math
import pathlib
import shutil
import tempfile

import servers

from conftest import load_benchmark


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def test_object_store_benchmark_reports_every_figure_and_its_checks_pass(tmp_path, capsys):
    bench = load_benchmark("object_store")
    out = tmp_path / "result.json"
    # SeaweedFS's unix socket paths must fit in 108 bytes: its data lives in a short directory.
    work = pathlib.Path(tempfile.mkdtemp(prefix="osb-"))
    try:
        result = bench.main(["--tiny", "--dir", str(work), "--json", str(out)])
        # The SeaweedFS data directories are removed.
        assert list(work.iterdir()) == []
    finally:
        shutil.rmtree(work, ignore_errors=True)

    n_leaves = result["leaves"]
    for system in bench.SYSTEMS:
        figures = result["results"][system]
        for key in bench.FIGURE_KEYS:
            if system == "s3fs" and key == "restore_numpy_s":
                continue  # plain s3fs restores into numpy in its only restore
            assert finite(figures[key]), (system, key, figures.get(key))
        for key in ("first_save_s", "restore_s", "first_save_stored_bytes",
                    "first_save_requests", "restore_requests"):
            assert figures[key] > 0, (system, key)
        # The bit-exact restore checks ran (they raise inside the benchmark on a mismatch).
        assert figures["verified_leaves"] == n_leaves, system
    casstore, plain = result["results"]["casstore"], result["results"]["s3fs"]
    # casstore stores the state once, then only what changed; plain s3fs rewrites everything.
    assert casstore["unchanged_save_new_chunks"] == 0
    assert casstore["unchanged_save_written_bytes"] < casstore["first_save_written_bytes"] / 10
    assert 0 < casstore["changed_save_written_bytes"] < casstore["first_save_written_bytes"]
    assert plain["changed_save_written_bytes"] == plain["first_save_written_bytes"]
    assert plain["first_save_stored_bytes"] == result["logical_bytes"]
    assert plain["first_save_request_ops"]["PutObject"] == n_leaves
    assert casstore["first_save_store_ops"]["put"] >= casstore["first_save_new_chunks"]
    assert casstore["restore_store_ops"]["get"] > 0
    assert [t["target"] for t in result["targets"]] == [t for t, _, _ in bench.TARGETS]

    printed = capsys.readouterr().out
    for _, label, _ in bench.FIGURES:
        assert f"| {label}" in printed
    assert json.loads(out.read_text())["results"].keys() == set(bench.SYSTEMS)


def test_object_store_diagnosis_on_an_existing_endpoint(capsys):
    """--diagnose against one SeaweedFS this test starts, passed as --endpoint."""
    bench = load_benchmark("object_store")
    work = pathlib.Path(tempfile.mkdtemp(prefix="osb-"))
    try:
        with servers.seaweedfs_server(work) as server:
            endpoint = server.storage_options["endpoint_url"]
            result = bench.main(["--tiny", "--diagnose", "--endpoint", endpoint])
            fs = server.fs()
            # Every system and variant removed its prefix; only the warm-up objects remain.
            buckets = [result["bucket"], result["diagnosis"]["bucket"]]
            left = [p for b in buckets for p in fs.find(b)]
            assert sorted(left) == sorted(f"{b}/warm-up" for b in buckets)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    assert result["server"] == endpoint
    diag = result["diagnosis"]["medians"]
    assert {name for name, _ in bench.DIAGNOSIS} == set(diag)
    for name, _ in bench.DIAGNOSIS:
        assert diag[name]["upload_s"] > 0, name
    casstore = diag["casstore"]
    # The timeline splits the save into setup, chunk puts and tail.
    assert casstore["chunk_puts"] == diag["encode_only"]["chunk_objects"]
    parts = casstore["setup_s"] + casstore["chunk_puts_s"] + casstore["tail_s"]
    assert math.isclose(parts, casstore["upload_s"], rel_tol=0.05, abs_tol=0.01)
    # casstore's S3 store sends no HEAD before each GET: half the requests of s3fs's default.
    assert "HeadObject" not in casstore["restore_request_ops"]
    assert casstore["restore_with_head_requests"] == 2 * casstore["restore_requests"]
    assert "| casstore.save, first save" in capsys.readouterr().out
