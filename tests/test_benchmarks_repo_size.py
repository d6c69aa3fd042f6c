"""Smoke test: the repository-size benchmark (a save in a repository full of chunks vs in a fresh
one, local disk and SeaweedFS) runs end to end at tiny sizes, so it does not rot."""

import json
import math
import pathlib
import shutil
import tempfile

from conftest import load_benchmark


def test_repo_size_benchmark_reports_every_figure_and_its_checks_pass(tmp_path, capsys):
    bench = load_benchmark("repo_size")
    out = tmp_path / "result.json"
    # SeaweedFS's unix socket paths must fit in 108 bytes: its data lives in a short directory.
    work = pathlib.Path(tempfile.mkdtemp(prefix="rsb-"))
    try:
        result = bench.main(["--tiny", "--chunks", "300", "--dir", str(work),
                             "--json", str(out)])
        assert list(work.iterdir()) == []  # repositories and server data are removed
    finally:
        shutil.rmtree(work, ignore_errors=True)

    assert result["chunks"] == 300
    assert set(result["results"]) == set(bench.STORES)
    for kind, r in result["results"].items():
        # The filled chunks were listed (and a sample decoded) on top of step 0's.
        assert r["chunks_listed"] == result["chunks"] + r["chunks_before_fill"], kind
        assert r["fill_s"] > 0
        for name, tree in result["trees"].items():
            for where in ("fresh", "full"):
                assert r[f"{name}_{where}_s"] > 0, (kind, name, where)
                # Every save stores the whole tree anew: all its chunks are new.
                assert r[f"{name}_{where}_new_chunks"] > 0
                assert r[f"{name}_{where}_written_bytes"] > tree["bytes"] / 2, (kind, name)
            assert r[f"{name}_same_bytes"] is True, (kind, name)
            assert (r[f"{name}_fresh_written_bytes"] == r[f"{name}_full_written_bytes"])
            assert math.isclose(r[f"{name}_ratio"],
                                r[f"{name}_full_s"] / r[f"{name}_fresh_s"])

        # Each store's limit was measured on it in the run, and the saves are judged by it.
        assert r["limit"]["store"] == {"local": "local disk", "s3": "S3"}[kind]
        assert all(r[f"{name}_limit_s"] > 0 for name in result["trees"])

    printed = capsys.readouterr().out
    assert "| ... full / fresh (x) |" in printed
    assert "| ... limit / figure, fresh and full |" in printed
    assert printed.count("- target, ") == len(bench.STORES) * len(result["trees"])
    assert json.loads(out.read_text())["results"].keys() == set(bench.STORES)


def test_filled_chunks_are_valid_chunk_objects_under_chunks(tmp_path):
    import casstore
    from casstore._codec import decode_chunk
    from casstore._layout import chunk_id_of_key

    bench = load_benchmark("repo_size")
    store = casstore.open_store(str(tmp_path / "repo"))
    filled = bench.fill(store.put_many, 40, seed=3)
    keys = [info.key for info in store.list("chunks/")]
    assert len(keys) == 40
    assert len(filled["sample"]) == bench.SAMPLE + 1
    for key in keys:
        cid = chunk_id_of_key(key)
        assert cid is not None, key
        raw = decode_chunk(store.get(key), cid, bench.CHUNK_RAW_BYTES)
        assert len(raw) == bench.CHUNK_RAW_BYTES
