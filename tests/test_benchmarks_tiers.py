"""Smoke test: the tiers benchmark (issue 31) runs end to end on the tiny workload with its own
two SeaweedFS servers and without rclone, its byte ratios, which do not depend on timing, meet
their targets, and its saves, restores and copies are fractions of the machine's limit."""

import json
import math
import pathlib
import shutil
import tempfile

from conftest import load_benchmark

TIMES = ("save_blocked_on_s", "save_blocked_off_s", "restore_lost_local_s", "restore_plain_s",
         "copy_local_s3_s", "copy_s3_s3_s")
JUDGED = ("saves_off_s", "saves_on_s", "restore_lost_local_s", "restore_plain_s",
          "copy_local_s3_s", "copy_s3_s3_s")  # the figures judged by the limit that ran


def test_tiers_benchmark_reports_its_ratios_and_the_byte_ratios_meet_their_targets(
        tmp_path, capsys, monkeypatch):
    bench = load_benchmark("tiers")
    monkeypatch.setattr(bench, "RCLONE", "rclone-not-installed-here")  # rclone is optional
    out = tmp_path / "result.json"
    work = pathlib.Path(tempfile.mkdtemp(prefix="tb-"))  # SeaweedFS's sockets: a short path
    try:
        result = bench.main(["--tiny", "--dir", str(work), "--json", str(out)])
        assert list(work.iterdir()) == []  # the servers' data and the local tiers are removed
    finally:
        shutil.rmtree(work, ignore_errors=True)

    written = json.loads(out.read_text())["ratios"]
    assert written.keys() == result["ratios"].keys()
    assert written["persist_bytes"] == result["ratios"]["persist_bytes"]
    f, ratios = result["figures"], result["ratios"]
    assert result["state_bytes"] == (1 << 20) + (64 << 10)
    assert result["steps"] == 10
    for key in TIMES:
        assert math.isfinite(f[key]), key
        assert f[key] > 0, key
    # Every eligible step (step % 3 == 0) was persisted or dropped by the backlog rule; the
    # last one always persists.
    assert set(f["persisted_steps"]) | set(f["dropped_steps"]) == {0, 3, 6, 9}
    assert f["persisted_steps"][-1] == 9
    # A persist sends only the chunks the persistent tier lacks: exactly the new ones.
    assert f["persist_bytes"] == f["persisted_new_chunk_bytes"] > 1 << 19  # the base at least
    assert ratios["persist_bytes"] == 1.0
    # Half the step's chunk objects deleted locally: about half the state comes from S3
    # (stored bytes, a little compressed), never more than the target.
    assert f["half_gone_deleted_objects"] == math.ceil(f["half_gone_objects"] / 2)
    assert 0.3 < ratios["half_gone_remote"] <= 0.55
    assert ratios["half_gone_remote"] == f["half_gone_remote_bytes"] / result["state_bytes"]
    for key in ("save_blocked", "restore_lost_local"):
        assert math.isfinite(ratios[key]), key
        assert ratios[key] > 0, key
    # Without rclone the comparisons are n/a, and the output says why.
    assert f["rclone"] is None
    assert math.isnan(ratios["copy_s3_s3"])
    assert math.isnan(ratios["copy_local_s3"])
    assert math.isnan(ratios["copy_same_s3"])
    assert [t["target"] for t in result["targets"]] == [t[3] for t in bench.TARGETS]
    # The machine's limit, measured in the run on local disk and on both servers; every save,
    # restore and copy that ran is a positive, finite fraction of it (limit / figure).
    limit, limits, fractions = result["limit"], result["limits"], result["fractions"]
    assert set(limit) == {"local disk", "S3 A", "S3 B"}
    for name, rates in limit.items():
        for rate in ("hash", "encode", "decode"):
            assert rates[f"{rate}_bps"] > 1e6, (name, rate)  # above 1 MB/s, whatever the load
        assert min(rates["write_bps"], rates["read_bps"]) > 0, name  # S3: 1 MiB, 4 objects
    assert set(fractions) == set(limits) >= set(JUDGED)
    for key in JUDGED:
        assert math.isfinite(fractions[key]), key
        assert fractions[key] > 0, key
        assert math.isclose(fractions[key], limits[key] / f[key]), key
    # A copy moves the stored bytes at the slower of the source's read and the destination's
    # write; without rclone its figures, and so their fractions, are n/a.
    assert math.isclose(limits["copy_s3_s3_s"], f["local_repo_bytes"] / min(
        limit["S3 A"]["read_bps"], limit["S3 B"]["write_bps"]))
    assert limits["rclone_s3_s3_s"] == limits["copy_s3_s3_s"]
    assert math.isnan(fractions["rclone_s3_s3_s"])
    assert f["restored_stored_bytes"] > 0
    assert f["restored_raw_bytes"] >= result["state_bytes"]
    assert json.loads(out.read_text())["fractions"].keys() == fractions.keys()
    printed = capsys.readouterr().out
    assert "| machine's limit (s) | limit / figure |" in printed
    assert "The machine's limit, S3 B, this run" in printed
    assert "rclone-not-installed-here is not on PATH" in printed
    assert "S3 to S3: n/a (rclone not run)" in printed
    assert "persist bytes / new-chunk bytes of the persisted steps: 1 (met)" in printed
