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
        for key, _, _ in bench.FIGURES:
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
    # The limit was measured on a server of the same kind in the run; saves and restores are
    # judged by it.
    assert result["limit"]["store"] == "S3"
    assert result["limit"]["read_bps"] > 0
    assert set(result["limits"]) == {"first_save_s", "changed_save_s", "restore_s",
                                     "restore_numpy_s"}
    assert all(s > 0 for s in result["limits"].values())

    printed = capsys.readouterr().out
    for _, label, _ in bench.FIGURES:
        assert f"| {label}" in printed
    assert json.loads(out.read_text())["results"].keys() == set(bench.SYSTEMS)


def test_object_store_benchmark_on_an_existing_endpoint_cleans_up_after_itself(capsys):
    """--endpoint of one SeaweedFS this test starts: every prefix is removed afterwards."""
    bench = load_benchmark("object_store")
    work = pathlib.Path(tempfile.mkdtemp(prefix="osb-"))
    try:
        with servers.seaweedfs_server(work) as server:
            endpoint = server.storage_options["endpoint_url"]
            result = bench.main(["--tiny", "--endpoint", endpoint])
            fs = server.fs()
            # Every system, and the limit's measurement, removed its prefix; only the warm-up
            # objects remain.
            buckets = result["buckets"]
            left = [p for b in buckets for p in fs.find(b)]
            assert len(buckets) == 3
            assert sorted(left) == sorted(f"{b}/warm-up" for b in buckets)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    assert result["server"] == endpoint
    assert result["limit"]["store"] == "S3"
    assert result["limit"]["write_bps"] > 0
    # casstore's S3 store sends no HEAD before each GET (s3fs's cat does).
    casstore = result["results"]["casstore"]
    assert "HeadObject" not in casstore["restore_request_ops"]
    assert casstore["restore_request_ops"]["GetObject"] == casstore["restore_requests"]
    assert "casstore: limit / figure" in capsys.readouterr().out
