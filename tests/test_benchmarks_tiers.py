"""Smoke test: the tiers benchmark (issue 31) runs end to end on the tiny workload with its own
two SeaweedFS servers and without rclone, and its byte ratios, which do not depend on timing,
meet their targets."""

import json
import math
import pathlib
import shutil
import tempfile

from conftest import load_benchmark

TIMES = ("save_blocked_on_s", "save_blocked_off_s", "restore_lost_local_s", "restore_plain_s",
         "copy_local_s3_s", "copy_s3_s3_s")


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
    printed = capsys.readouterr().out
    assert "rclone-not-installed-here is not on PATH" in printed
    assert "S3 to S3: n/a (rclone not run)" in printed
    assert "persist bytes / new-chunk bytes of the persisted steps: 1 (met)" in printed
