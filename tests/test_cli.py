"""The ``casstore`` command line, run through click's CliRunner (and once as ``python -m``)
against repositories the library wrote, locally and on a real S3 server."""

import io
import json
import os
import pathlib
import shutil
import socket
import stat
import subprocess
import sys
import warnings

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from click.testing import CliRunner
from rich.console import Console

import casstore
from casstore import cli
from casstore.cli import _output
from casstore.store import FsspecStore

from conftest import in_mount_namespace, repack

CHUNK = 256 * 1024  # small chunks: the frozen leaf spans 4 of them


def tree(seed: int, step: int, extra: bool = False) -> dict:
    """A train-state-like tree: a frozen 1 MiB leaf and a bf16 leaf that never change, a
    128 KiB leaf that changes every step (all above the pack threshold: exact chunk sizes),
    and a Python int."""
    t = {"frozen": np.arange(256 * 1024, dtype=np.float32).reshape(256, 1024),
         "bf": (np.arange(256 * 256) % 251).astype(ml_dtypes.bfloat16).reshape(256, 256),
         "w": np.random.default_rng([seed, step]).standard_normal((128, 256), np.float32),
         "step": step}
    if extra:
        t["extra"] = np.full((64, 512), 7, np.int32)
    return t


def write_repo(url) -> None:
    for step in range(3):
        casstore.save(url, step, tree(0, step, extra=step == 2), chunk_size_bytes=CHUNK)
    casstore.save(url, 0, tree(1, 0), run="b", chunk_size_bytes=CHUNK)


@pytest.fixture
def repo(tmp_path) -> str:
    url = str(tmp_path / "repo")
    write_repo(url)
    return url


def run(*args: str, code: int = 0):
    result = CliRunner().invoke(cli.main, [str(a) for a in args])
    assert result.exit_code == code, (result.output, result.stderr, result.exception)
    return result


def run_json(*args: str, code: int = 0):
    return json.loads(run(*args, "--json", code=code).stdout)


def stored(manifest: casstore.Manifest, path: str) -> int:
    (leaf,) = [leaf for leaf in manifest.leaves if leaf.path == path]
    return sum(r.stored_bytes for r in leaf.chunks)


def test_ls_reports_each_steps_added_and_shared_bytes(repo):
    rows = run_json("ls", repo)["steps"]
    assert [(r["run"], r["step"]) for r in rows] == [("default", 0), ("default", 1),
                                                       ("default", 2), ("b", 0)]
    for r in rows:
        m = casstore.read_manifest(repo, r["step"], run=r["run"])
        assert (r["leaves"], r["logical_bytes"], r["created"]) == (
            len(m.leaves), m.logical_bytes, m.created)
        assert r["stored_bytes"] == sum({c.id: c.stored_bytes for leaf in m.leaves
                                         for c in leaf.chunks}.values())
    m0 = casstore.read_manifest(repo, 0)
    unchanged = stored(m0, "frozen") + stored(m0, "bf")
    assert rows[0]["added_bytes"] == unchanged + stored(m0, "w")
    assert rows[0]["shared_bytes"] == 0
    assert rows[1]["added_bytes"] == stored(casstore.read_manifest(repo, 1), "w")
    assert rows[1]["shared_bytes"] == unchanged
    m2 = casstore.read_manifest(repo, 2)
    assert rows[2]["added_bytes"] == stored(m2, "w") + stored(m2, "extra")
    b0 = casstore.read_manifest(repo, 0, run="b")  # another run reuses the frozen chunks
    assert (rows[3]["added_bytes"], rows[3]["shared_bytes"]) == (stored(b0, "w"), unchanged)
    assert run_json("ls", repo, "--run", "b")["steps"] == rows[3:]
    text = run("ls", repo).stdout
    assert "default" in text
    assert "2 run(s), 4 step(s)" in text
    assert "MB" in text


def test_show_lists_leaves_with_chunks_bytes_and_sharing(repo):
    out = run_json("show", repo, 2)
    m = casstore.read_manifest(repo, 2)
    assert [x["path"] for x in out["leaves"]] == [leaf.path for leaf in m.leaves]
    for x, leaf in zip(out["leaves"], m.leaves):
        assert x["shape"] == list(leaf.shape)
        assert x["logical_bytes"] == leaf.nbytes
        assert x["chunks"] == len({c.id for c in leaf.chunks})
        assert x["stored_bytes"] == sum({c.id: c.stored_bytes for c in leaf.chunks}.values())
    by_path = {x["path"]: x for x in out["leaves"]}
    assert by_path["frozen"]["chunks"] == 4
    assert by_path["frozen"]["dtype"] == "float32"
    assert by_path["bf"]["dtype"] == "bfloat16"
    assert {p: x["shared_with_previous"] for p, x in by_path.items()} == {
        "frozen": "yes", "bf": "yes", "w": "no", "extra": "no", "step": "no"}
    assert out["previous_step"] == 1
    first = run_json("show", repo, 0)
    assert first["previous_step"] is None
    assert {x["shared_with_previous"] for x in first["leaves"]} == {None}
    assert "frozen" in run("show", repo, 2).stdout


def test_show_counts_a_chunk_several_blocks_of_a_leaf_share_once(tmp_path):
    """Eight equal shards of a zero-initialised moment are one chunk: show said 8 x its size."""
    url = str(tmp_path / "r")
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    zeros = jax.device_put(np.zeros((8, 4096), np.float32), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("x")))
    casstore.save(url, 0, {"mu": zeros})
    (ref_ids,) = [{r.id for r in leaf.chunks} for leaf in casstore.read_manifest(url, 0).leaves]
    assert len(ref_ids) == 1
    (leaf,) = run_json("show", url, 0)["leaves"]
    assert leaf["stored_bytes"] == casstore.usage(url).chunk_bytes


def test_du_reports_logical_versus_stored_for_repository_runs_and_steps(repo):
    out = run_json("du", repo)
    manifests = [casstore.read_manifest(repo, s, run=r) for r in ("default", "b")
                 for s in casstore.list_steps(repo, run=r)]
    assert out["logical_bytes"] == sum(m.logical_bytes for m in manifests)
    on_disk = sum(p.stat().st_size for d in ("chunks", "runs")
                  for p in (pathlib.Path(repo) / d).rglob("*") if p.is_file())
    assert out["stored_bytes"] == on_disk
    assert out["unreferenced_bytes"] == 0
    assert out["dedup_ratio"] == pytest.approx(out["logical_bytes"] / on_disk)
    runs = {r["run"]: r for r in out["runs"]}
    assert runs["b"]["steps"] == 1
    assert runs["default"]["steps"] == 3
    b0 = casstore.read_manifest(repo, 0, run="b")
    assert runs["b"]["unique_bytes"] == stored(b0, "w")  # frozen and bf are shared
    unique = {(s["run"], s["step"]): s["unique_bytes"] for s in out["steps"]}
    assert unique[("default", 1)] == stored(casstore.read_manifest(repo, 1), "w")
    assert "dedup" in run("du", repo).stdout


def test_du_plot_draws_one_series_per_run(repo, tmp_path):
    png = tmp_path / "usage.png"
    assert "wrote" in run("du", repo, "--plot", png).stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 5000
    svg = tmp_path / "usage.svg"
    run("du", repo, "--plot", svg)
    text = svg.read_text()
    for kind in ("added", "shared"):
        assert text.count(f'id="{kind}-default"') == text.count(f'id="{kind}-b"') == 1
    usage = casstore.usage(repo).steps
    fig = cli.plot_usage(usage, str(tmp_path / "again.png"))
    for ax in fig.axes:
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert sorted(lines) == ["b", "default"]
        assert list(lines["default"].get_xdata()) == [0, 1, 2]
    added = fig.axes[0].get_lines()
    default = next(line for line in added if line.get_label() == "default")
    assert default.get_ydata()[1] == pytest.approx(
        stored(casstore.read_manifest(repo, 1), "w") / 1e6)
    result = run("du", repo, "--plot", tmp_path / "x.jpg", code=2)
    assert ".png or .svg" in result.stderr


def test_du_plot_of_a_repository_without_steps_draws_without_a_warning(tmp_path):
    casstore.save(tmp_path / "r", 0, {"a": np.ones(3)})
    casstore.delete(tmp_path / "r", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels" was one
        run("du", tmp_path / "r", "--plot", tmp_path / "empty.svg")
    assert (tmp_path / "empty.svg").stat().st_size > 0


def test_du_plot_without_matplotlib_names_the_extra(repo, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    result = run("du", repo, "--plot", tmp_path / "u.png", code=2)
    assert "casstore[plot]" in result.stderr
    assert not (tmp_path / "u.png").exists()


def test_diff_by_chunk_ids_reads_no_chunk_data(repo, tmp_path):
    shutil.copytree(repo, tmp_path / "manifests-only")
    shutil.rmtree(tmp_path / "manifests-only" / "chunks")
    out = run_json("diff", tmp_path / "manifests-only", 1, 2)
    assert out["counts"] == {"changed": 2, "added": 1, "removed": 0, "unchanged": 2}
    leaves = {x["path"]: x for x in out["leaves"]}
    assert leaves["w"]["status"] == "changed"
    assert leaves["w"]["changed_bytes"] == 128 * 256 * 4
    assert leaves["step"]["status"] == "changed"
    assert leaves["step"]["changed_bytes"] == 0
    assert leaves["extra"]["status"] == "added"
    assert leaves["extra"]["bytes_b"] == 64 * 512 * 4
    assert "frozen" not in leaves
    assert out["changed_bytes"] == 128 * 256 * 4 + 64 * 512 * 4
    full = run_json("diff", repo, 2, 1, "--all")
    assert {x["path"]: x["status"] for x in full["leaves"]} == {
        "frozen": "unchanged", "bf": "unchanged", "w": "changed", "step": "changed",
        "extra": "removed"}
    across = run_json("diff", repo, 0, 0, "--run-b", "b")
    assert across["b"] == {"run": "b", "step": 0}
    assert {x["path"] for x in across["leaves"]} == {"w"}
    assert "1 added" in run("diff", repo, 1, 2).stdout


def test_latest_names_the_newest_step_of_the_run_in_every_step_argument(repo, tmp_path):
    assert run_json("show", repo, "latest")["step"] == 2
    assert run_json("show", repo, "latest", "--run", "b")["step"] == 0
    assert json.loads(run("cat", repo, "latest").stdout)["step"] == 2
    diff = run_json("diff", repo, 1, "latest")
    assert (diff["b"], diff["counts"]["added"]) == ({"run": "default", "step": 2}, 1)
    assert run_json("diff", repo, "latest", 0, "--run-b", "b")["a"] == {"run": "default",
                                                                        "step": 2}
    assert run_json("verify", repo, "latest")["steps_checked"] == [["default", 2]]
    out = tmp_path / "latest.npz"
    run("export", repo, "latest", out, "--exclude", "bf")
    assert np.load(out)["extra"].shape == (64, 512)  # only step 2 has it
    bad = run("show", repo, "newest", code=2)
    assert "'newest' is neither a step number nor 'latest'" in bad.stderr
    empty = tmp_path / "empty"
    casstore.save(str(empty), 0, {"w": np.ones(2)}, run="other")
    assert "run 'default' has no steps" in run("show", empty, "latest", code=2).stderr
    # Nothing changed: the summary line, and no empty table under it.
    same = run("diff", repo, "latest", 2).stdout
    assert same.splitlines() == ["default@2 -> default@2: 0 changed, 0 added, 0 removed, "
                                 "5 unchanged; 0 bytes differ"]


def test_cat_prints_the_manifest(repo):
    out = json.loads(run("cat", repo, 2).stdout)
    m = casstore.read_manifest(repo, 2)
    assert (out["format"], out["run"], out["step"], out["created"]) == (
        "casstore.manifest", "default", 2, m.created)
    assert [x["path"] for x in out["leaves"]] == [leaf.path for leaf in m.leaves]
    assert [[c["id"] for c in x.get("chunks", [])] for x in out["leaves"]] == [
        [c.id for c in leaf.chunks] for leaf in m.leaves]


def test_cat_prints_metadata_with_bytes_and_keys_other_than_str(tmp_path):
    """Saves have always stored bytes and map keys other than str in metadata; a bytes key
    failed `cat` with "keys must be str, int, float, bool or None"."""
    casstore.save(tmp_path, 0, {"x": np.ones(2)},
                  metadata={"blob": b"\0\1", "e": {1: "a", 2.5: "b", b"k": None}})
    out = json.loads(run("cat", tmp_path, 0).stdout)
    assert out["metadata"] == {"blob": {"base64": "AAE="},
                               "e": {"map": [[1, "a"], [2.5, "b"], [{"base64": "aw=="}, None]]}}


def test_cat_keeps_every_metadata_entry_when_keys_render_alike(tmp_path):
    """int 1 and str "1" both printed as the JSON key "1" (a parser keeps one), and the bytes
    key b"x" as "base64:eA==", the text of another str key: a map with a key other than str
    prints as {"map": [[key, value], ...]} with typed keys; a str-keyed map as before, unless
    its one key is "base64" or "map" (it would read as bytes or as such a map)."""
    meta = {1: "int", "1": "str", b"x": "bytes", "base64:eA==": "lookalike",
            "plain": {"a": [1, b"\1"]}, "like": {"base64": "eA=="}, "blob": b"x",
            "tag": {"map": []}, "odd": {None: 0, True: 1, 2.5: 2}}
    casstore.save(tmp_path, 0, {"w": np.ones(2)}, metadata=meta)
    assert casstore.read_manifest(tmp_path, 0).metadata == meta
    text = run("cat", tmp_path, 0).stdout

    def unique(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), keys  # no JSON key printed twice
        return dict(pairs)

    out = json.loads(text, object_pairs_hook=unique)
    assert out["metadata"] == {"map": [
        [1, "int"], ["1", "str"], [{"base64": "eA=="}, "bytes"], ["base64:eA==", "lookalike"],
        ["plain", {"a": [1, {"base64": "AQ=="}]}], ["like", {"map": [["base64", "eA=="]]}],
        ["blob", {"base64": "eA=="}], ["tag", {"map": [["map", []]]}],
        ["odd", {"map": [[None, 0], [True, 1], [2.5, 2]]}]]}
    casstore.save(tmp_path, 1, {"w": np.ones(2)}, metadata={"lr": 0.1, "m": {"a": b"x"}})
    assert json.loads(run("cat", tmp_path, 1).stdout)["metadata"] == {  # str keys: as before
        "lr": 0.1, "m": {"a": {"base64": "eA=="}}}


def test_json_output_is_strict_json_with_nan_and_infinity_as_strings(tmp_path):
    url = str(tmp_path / "r")
    with casstore.CheckpointManager(url) as mngr:  # a diverged run's loss
        mngr.save(0, {"lr": float("inf"), "w": np.ones(2)}, metrics={"loss": float("nan")})

    def strict(text: str):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))

    out = strict(run("cat", url, 0).stdout)
    assert out["metadata"]["metrics"] == {"loss": "NaN"}
    assert [leaf.get("value") for leaf in out["leaves"] if leaf["path"] == "lr"] == ["Infinity"]


def chunk_files(repo) -> list[pathlib.Path]:
    return sorted(p for p in (pathlib.Path(repo) / "chunks").rglob("*") if p.is_file())


def test_verify_exit_codes_and_json(repo):
    out = run_json("verify", repo)
    report = casstore.verify(repo)
    assert out["ok"]
    assert out["problems"] == []
    assert sorted(map(tuple, out["steps_checked"])) == sorted(report.steps_checked)
    assert (out["chunks_checked"], out["bytes_read"]) == (report.chunks_checked,
                                                          report.bytes_read)
    assert run_json("verify", repo, 1, "--run", "default")["steps_checked"] == [["default", 1]]
    missing = run("verify", repo, 99, code=2)  # a step that does not exist is no damage (1)
    assert "step 99 of run 'default' does not exist" in missing.stderr
    assert "(steps: 0, 1, 2)" in missing.stderr
    victim = chunk_files(repo)[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = run_json("verify", repo, code=1)
    chunk_id = victim.parent.name + victim.name
    assert not bad["ok"]
    assert {p["chunk_id"] for p in bad["problems"]} == {chunk_id}
    assert len(bad["problems"]) == len(casstore.verify(repo).problems)
    assert run_json("verify", repo, "--no-read-data")["ok"]  # the object exists
    assert chunk_id in run("verify", repo, code=1).stdout
    victim.unlink()
    assert run_json("verify", repo, "--no-read-data", code=1)["problems"][0]["message"] == (
        "chunk missing")


def test_verify_names_every_key_path_of_a_damaged_pack_so_one_export_excludes_them(tmp_path):
    """A pack chunk holds several small leaves (format.md §3.4): verify named one of them, so
    the recovery (export --exclude each damaged key path) failed once per other member."""
    url = str(tmp_path / "r")
    small = [np.full(1000, i, np.float32) for i in range(3)]
    casstore.save(url, 0, {"a": small[0], "b": {"c": small[1]}, "d": small[2],
                           "big": np.ones(100_000, np.float32)})
    leaves = casstore.read_manifest(url, 0).leaves
    (pack,) = {leaf.chunks[0].id for leaf in leaves if leaf.path != "big"}
    victim = pathlib.Path(url) / "chunks" / pack[:2] / pack[2:]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    (problem,) = casstore.verify(url).problems
    assert (problem.key_path, problem.key_paths) == ("a", ("a", "b/c", "d"))
    assert "key paths 'a', 'b/c', 'd'" in run("verify", url, code=1).stdout
    (found,) = run_json("verify", url, code=1)["problems"]
    assert (found["key_path"], found["key_paths"]) == ("a", ["a", "b/c", "d"])
    out = tmp_path / "out.npz"
    run("export", url, 0, out, *[a for k in found["key_paths"] for a in ("--exclude", k)])
    assert list(np.load(out)) == ["big"]


def test_gc_and_rm(repo):
    result = run("rm", repo, 0, 1)
    assert "deleted run 'default' step 1" in result.stdout
    assert casstore.list_steps(repo) == [2]
    dry = run_json("gc", repo, "--dry-run", "--grace-period", "0")
    lib = casstore.gc(repo, dry_run=True, grace_period_s=0)
    assert dry["dry_run"]
    assert dry["deleted_chunks"] == lib.deleted_chunks == 2
    assert dry["deleted_bytes"] == lib.deleted_bytes
    assert run_json("gc", repo)["deleted_chunks"] == 0  # younger than the default 1h grace
    before = len(chunk_files(repo))
    done = run_json("gc", repo, "--grace-period", "0s")
    assert done["deleted_chunks"] == 2
    assert len(chunk_files(repo)) == before - 2
    assert casstore.verify(repo).ok
    assert "would delete 0 chunks" in run("gc", repo, "--dry-run").stdout
    result = run("gc", repo, "--grace-period", "soon", code=2)
    assert "duration" in result.stderr


def test_gc_names_the_save_lock_it_waits_for(repo):
    """A save or copy killed with SIGKILL leaves its save lock; gc says whose it is."""
    from casstore._locks import _put_lock

    key = _put_lock(casstore.open_store(repo), "save")  # as a killed save leaves it
    result = run("gc", repo, "--lock-timeout", "1s", code=cli.EXIT_BUSY)  # not a usage error
    assert "saves kept running for 1 s; garbage collection did nothing" in result.stderr
    assert f"held by {key} (host {socket.gethostname()!r}, pid {os.getpid()}," in (
        result.stderr)
    assert "delete its object once sure that process is gone" in result.stderr
    assert casstore.verify(repo).ok


def test_copy_between_local_repositories(repo, tmp_path):
    dst = tmp_path / "copy"
    out = run_json("copy", repo, dst, "--runs", "default", "--steps", "1,2")
    assert sorted(map(tuple, out["steps_copied"])) == [("default", 1), ("default", 2)]
    assert casstore.list_runs(str(dst)) == ["default"]
    assert casstore.list_steps(str(dst)) == [1, 2]
    again = run_json("copy", repo, dst)
    assert sorted(map(tuple, again["steps_copied"])) == [("b", 0), ("default", 0)]
    assert again["chunks_skipped"] > 0
    restored = casstore.restore(str(dst), 2)
    np.testing.assert_array_equal(restored["w"], tree(0, 2)["w"])
    assert "copied 0 step(s)" in run("copy", repo, dst).stdout
    # a repeated --steps adds to the list (it copied the last one alone: exploratory session)
    out = run_json("copy", repo, tmp_path / "again", "--runs", "default", "--steps", "1",
                   "--steps", "2")
    assert sorted(map(tuple, out["steps_copied"])) == [("default", 1), ("default", 2)]


def test_parse_storage_options():
    assert cli.parse_options(None, None, ("anon=true", "endpoint_url=http://h:1", "n=3",
                                           "key=a=b")) == {
        "anon": True, "endpoint_url": "http://h:1", "n": 3, "key": "a=b"}


def restored_arrays(url, step, run="default") -> dict:
    t = casstore.restore(url, step, run=run)
    return {k: np.asarray(v) for k, v in t.items()}


def test_export_safetensors_reads_back_bit_exact(repo, tmp_path):
    out = tmp_path / "s2.safetensors"
    assert "wrote 5 tensors" in run("export", repo, 2, out).stdout
    want = restored_arrays(repo, 2)
    got = dict(safetensors.deserialize(out.read_bytes()))
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert got[name]["shape"] == list(array.shape)
        assert got[name]["data"] == array.tobytes(), name
    assert got["bf"]["dtype"] == "BF16"
    assert got["step"]["dtype"] == "I64"
    part = tmp_path / "part.safetensors"
    run("export", repo, 2, part, "--paths", "w", "--paths", "frozen")
    loaded = safetensors.numpy.load_file(str(part))
    assert sorted(loaded) == ["frozen", "w"]
    np.testing.assert_array_equal(loaded["w"], want["w"])
    assert loaded["w"].tobytes() == want["w"].tobytes()
    # a prefix that selects nothing (a typo) is refused, as restore(paths=) refuses it: the
    # file lacked what was asked in, or (--exclude) held what was asked out, exit 0
    for option, typo in (("--paths", "frozn"), ("--exclude", "bf16")):
        result = run("export", repo, 2, tmp_path / "typo.safetensors", "--paths", "w",
                     option, typo, code=2)
        assert "no leaf matches the requested path (paths or exclude)" in result.stderr
        assert f"key path {typo!r}" in result.stderr
        assert not (tmp_path / "typo.safetensors").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_an_exported_file_gets_the_mode_the_umask_gives_any_new_file(repo, tmp_path, umask):
    previous = os.umask(umask)
    try:
        for name in ("w.safetensors", "w.npz"):
            run("export", repo, 1, tmp_path / name, "--paths", "w")
            assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name
    finally:
        os.umask(previous)


def test_export_npz_and_dtypes_it_cannot_hold(repo, tmp_path):
    out = tmp_path / "w.npz"
    run("export", repo, 1, out, "--paths", "w", "--paths", "step")
    with np.load(out, allow_pickle=False) as z:
        assert z["w"].tobytes() == tree(0, 1)["w"].tobytes()
        assert int(z["step"]) == 1
    result = run("export", repo, 1, tmp_path / "all.npz", code=2)
    assert "key path 'bf'" in result.stderr
    assert "--dtype float32" in result.stderr
    result = run("export", repo, 1, tmp_path / "w.pt", code=2)
    assert ".safetensors or .npz" in result.stderr
    result = run("export", repo, 1, tmp_path / "n.npz", "--paths", "nothing", code=2)
    assert "nothing" in result.stderr


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
def test_an_export_cut_short_leaves_the_output_as_it_was(repo, tmp_path, monkeypatch, fmt):
    """The .npz was written straight under its name: an export killed (or out of disk space)
    part way left a partial file there, which a --force export also made of a complete one,
    and which np.load could even take for a whole archive. Now every format is written under
    a temporary name, then renamed into place."""
    out = tmp_path / f"w.{fmt}"
    casstore.export_tensors(repo, 1, out, paths=["w", "step"])
    before = out.read_bytes()
    if fmt == "npz":
        real = np.lib.format.write_array

        def cut(f, array, **kw):
            real(f, array, **kw)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(np.lib.format, "write_array", cut)
    else:
        def cut(arrays, path, metadata=None):
            pathlib.Path(path).write_bytes(b"partial")
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(safetensors.numpy, "save_file", cut)
    for name in (out, tmp_path / f"new.{fmt}"):
        with pytest.raises(OSError, match="No space left"):
            casstore.export_tensors(repo, 1, name, paths=["w", "step"], force=True)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo", f"w.{fmt}"]


def test_export_of_a_whole_tree_skips_and_lists_what_a_file_cannot_hold(repo, tmp_path):
    url = str(tmp_path / "strings")
    state = {"note": "hello", "x": np.ones(3), "n": 7, "opt": {"mu": np.zeros(2)},
             "bf": np.arange(4).astype(ml_dtypes.bfloat16)}
    casstore.save(url, 0, state)
    out = run_json("export", url, 0, tmp_path / "s.safetensors")
    assert out["skipped"] == [{"path": "note", "reason": "a str leaf"}]
    assert out["tensors"] == 4
    text = run("export", url, 0, tmp_path / "s.safetensors", "--force")
    assert "skipped 'note'" in text.stderr
    assert "skipped 1 leaves" in text.stdout
    loaded = safetensors.numpy.load_file(tmp_path / "s.safetensors")
    assert sorted(loaded) == ["bf", "n", "opt/mu", "x"]
    assert int(loaded["n"]) == 7
    npz = tmp_path / "cast.npz"
    out = run_json("export", url, 0, npz, "--dtype", "float32", "--exclude", "opt")
    with np.load(npz, allow_pickle=False) as z:
        assert sorted(z.files) == ["bf", "n", "x"]
        assert z["bf"].dtype == np.float32
        np.testing.assert_array_equal(z["bf"], np.arange(4, dtype=np.float32))
        assert z["x"].dtype == np.float32
        assert z["n"].dtype == np.int64
    info = casstore.export_tensors(url, 0, tmp_path / "api.npz", dtype="float32",
                                   paths=["bf"])
    assert (info.tensors, info.skipped) == (1, ())
    casstore.save(url, 1, {"lr": 0.5, "n": 3})  # a Python float is a floating-point leaf too
    casstore.export_tensors(url, 1, tmp_path / "lr.npz", dtype="float32")
    with np.load(tmp_path / "lr.npz", allow_pickle=False) as z:
        assert (z["lr"].dtype, float(z["lr"]), z["n"].dtype) == (np.float32, 0.5, np.int64)


def test_export_refuses_an_unknown_dtype_and_values_it_would_overflow(tmp_path):
    url = str(tmp_path / "r")
    casstore.save(url, 0, {"w": np.array([1.0, 70000.0], np.float32), "v": np.ones(2)})
    for name in ("bf16", "fp32", "half", "int32"):  # astype(None) wrote float64 with exit 0
        result = run("export", url, 0, tmp_path / f"{name}.npz", "--dtype", name, code=2)
        assert f"dtype {name!r} is not a floating-point dtype; one of float16, bfloat16" in (
            result.stderr)
        assert not (tmp_path / f"{name}.npz").exists()
    result = run("export", url, 0, tmp_path / "h.npz", "--dtype", "float16", code=2)
    assert "key path 'w'" in result.stderr
    assert "float32 values overflow float16" in result.stderr
    run("export", url, 0, tmp_path / "h.npz", "--dtype", "float16", "--paths", "v")
    with np.load(tmp_path / "h.npz", allow_pickle=False) as z:
        assert z["v"].dtype == np.float16
    casstore.save(url, 1, {"c": np.ones(2, np.complex128)})  # --dtype would not cast it
    result = run("export", url, 1, tmp_path / "c.safetensors", code=2)
    assert "cannot hold dtype complex128: leave it out (--exclude) or use .npz" in result.stderr
    casstore.save(url, 2, {"i4": np.arange(4, dtype=ml_dtypes.int4)})  # neither format holds it
    for suffix in (".safetensors", ".npz"):
        result = run("export", url, 2, tmp_path / f"i4{suffix}", code=2)
        assert "cannot hold dtype int4: leave it out (--exclude) (key path 'i4')" in (
            result.stderr)


def test_export_refuses_a_dtype_the_file_cannot_hold_before_reading_any_chunk(tmp_path):
    """The refusal came after the whole step was read (minutes for a large model); the chunks
    here are deleted, so a read would raise MissingChunkError instead."""
    url = tmp_path / "r"
    casstore.save(url, 0, {"a": np.ones((256, 256), np.float32), "v": np.ones(3),
                           "z": np.zeros(8, ml_dtypes.float4_e2m1fn)})
    shutil.rmtree(url / "chunks")
    for out in ("out.safetensors", "out.npz"):
        with pytest.raises(casstore.UnsupportedLeafError,
                           match=r"hold dtype float4_e2m1fn.*key path 'z'"):
            casstore.export_tensors(url, 0, tmp_path / out)
    with pytest.raises(casstore.MissingChunkError):  # cast, it fits: the step is read
        casstore.export_tensors(url, 0, tmp_path / "out.npz", dtype="float32")
    assert not list(tmp_path.glob("out.*"))


def test_leaf_names_numpy_or_safetensors_give_a_meaning_keep_their_values(tmp_path):
    """np.load found member 'x.npy' (tensor x) for the name 'x.npy'; np.savez took 'file' and
    'allow_pickle' for its own arguments; '__metadata__' is the safetensors header's key."""
    url = tmp_path / "r"
    tree = {"x": np.ones(3), "x.npy": np.zeros(3), "allow_pickle": np.arange(3),
            "file": np.arange(2, dtype=np.int8)}
    casstore.save(url, 0, tree)
    assert casstore.export_tensors(url, 0, tmp_path / "o.npz").tensors == 4
    with np.load(tmp_path / "o.npz", allow_pickle=False) as z:  # what numpy users read
        assert sorted(z.files) == sorted(tree)
    casstore.import_tensors(tmp_path / "o.npz", url, 1)
    back = casstore.restore(url, 1)
    assert sorted(back) == sorted(tree)
    for name, value in tree.items():
        assert back[name].dtype == value.dtype
        assert back[name].tobytes() == value.tobytes(), name
    casstore.save(url, 2, {"__metadata__": np.arange(3), "w": np.ones(2)})
    with pytest.raises(casstore.UnsupportedLeafError, match="keeps its metadata under this "
                       r"name: leave the leaf out \(--exclude\) or use .npz") as e:
        casstore.export_tensors(url, 2, tmp_path / "o.safetensors")
    assert e.value.key_path == "__metadata__"
    assert not (tmp_path / "o.safetensors").exists()


def test_an_export_imported_back_restores_into_the_exported_trees_structure(tmp_path):
    """Elements that hold no tensor (None, optax's EmptyState) leave gaps in a list's indices:
    the import made such a list a dict of int keys ('opt/[1]/mu' came back as 'opt/[=1]/mu'),
    so the step no longer restored into the training state's structure."""
    import optax

    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    state = {"params": params, "l": [None, np.ones(2)],
             "opt": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)).init(params)}
    url = tmp_path / "r"
    casstore.save(url, 0, state)
    for step, suffix in enumerate((".npz", ".safetensors"), 1):
        casstore.export_tensors(url, 0, tmp_path / f"s{suffix}")
        casstore.import_tensors(tmp_path / f"s{suffix}", url, step)
        assert ([leaf.path for leaf in casstore.read_manifest(url, step).leaves]
                == [leaf.path for leaf in casstore.read_manifest(url, 0).leaves])
        back = casstore.restore(url, step, target=jax.eval_shape(lambda: state))
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(a, b)  # (float64 as the target's float32)


def test_a_bool_tensor_of_bytes_other_than_0_and_1_is_refused_naming_it(tmp_path):
    """Stored as they were, numpy counted 3 True of [2, 255, 1, 0] and jax 2 of the same."""
    for suffix in (".safetensors", ".npz"):
        path = tmp_path / f"m{suffix}"
        mask = np.array([2, 255, 1, 0], np.uint8).view(bool)
        if suffix == ".npz":
            np.savez(path, mask=mask, ok=np.array([True, False]))
        else:
            safetensors.numpy.save_file({"mask": mask, "ok": np.array([True, False])}, str(path))
        with pytest.raises(casstore.TensorFileError, match=rf"'mask' of dtype bool.*'{path}'"):
            casstore.import_tensors(path, tmp_path / "r", 0)
        assert not (tmp_path / "r").exists()


def test_an_npz_array_of_a_dtype_casstore_does_not_store_is_named_with_its_file(tmp_path):
    """The error named the repository (url) and not the file at fault."""
    path = tmp_path / "s.npz"
    np.savez(path, names=np.array(["a", "b"]), w=np.ones(2))
    result = run("import", path, tmp_path / "r", 0, code=cli.EXIT_USAGE)
    assert f"tensor 'names' has dtype <U1, which casstore does not store (url '{path}')" in (
        result.stderr)
    assert not (tmp_path / "r").exists()


def test_the_lists_of_one_file_hold_a_bounded_number_of_missing_positions(tmp_path):
    """The bound was a list's: 40 names "a{i}/[65536]" (a file of 2.5 kB) made 40 lists of
    65,537 elements, a minute's import and a manifest of 21 MB."""
    from casstore._tensorfile import MAX_GAPS
    path = tmp_path / "gaps.safetensors"
    safetensors.numpy.save_file({f"a{i}/[{MAX_GAPS}]": np.zeros(0, np.int8) for i in range(40)},
                                str(path))
    casstore.import_tensors(path, tmp_path / "r", 0)
    back = casstore.restore(tmp_path / "r", 0)
    (listed,) = [v for v in back.values() if isinstance(v, list)]  # the budget: one such list
    assert len(listed) == MAX_GAPS + 1
    assert listed[:2] == [None, None]
    others = [v for v in back.values() if not isinstance(v, list)]
    assert [list(v) for v in others] == [[MAX_GAPS]] * 39  # the rest: dicts of int keys
    paths = [leaf.path for leaf in casstore.read_manifest(tmp_path / "r", 0).leaves]
    assert sum(p.endswith(f"/[={MAX_GAPS}]") for p in paths) == 39


def test_import_names_that_are_no_key_path_of_a_pytree_name_the_file(tmp_path):
    """An index past 64 bits and a NUL raised a bare OverflowError or TypeError."""
    for name, says in (("layers/[18446744073709551616]/w", "does not fit in 64 bits"),
                       ("a\0b", "contains NUL")):
        path = tmp_path / "bad.safetensors"
        safetensors.numpy.save_file({name: np.ones(2, np.float32)}, str(path))
        with pytest.raises(casstore.TensorFileError, match=rf"{says}.*url '{path}'"):
            casstore.import_tensors(path, tmp_path / "r", 0)


def test_an_export_to_a_path_under_home_writes_there(tmp_path, monkeypatch):
    """'~/out.npz' was checked as $HOME/out.npz and written as ./~/out.npz (or failed)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    casstore.save(tmp_path / "r", 0, {"w": np.ones(3)})
    casstore.export_tensors(tmp_path / "r", 0, "~/out.npz")
    assert (tmp_path / "home" / "out.npz").is_file()
    assert not (tmp_path / "~").exists()
    with pytest.raises(FileExistsError, match="exists; pass force=True"):
        casstore.export_tensors(tmp_path / "r", 0, "~/out.npz")


def test_a_tree_that_is_one_array_exports_and_imports_back_as_that_array(tmp_path):
    """Its key path is empty: the file's one tensor is named "", which imports as the array
    itself, not as {"": array}."""
    url = tmp_path / "r"
    casstore.save(url, 0, np.arange(5.0))
    for step, suffix in enumerate((".npz", ".safetensors"), 1):
        casstore.export_tensors(url, 0, tmp_path / f"root{suffix}")
        casstore.import_tensors(tmp_path / f"root{suffix}", url, step)
        back = casstore.restore(url, step)
        assert isinstance(back, np.ndarray)
        assert back.tobytes() == np.arange(5.0).tobytes()
    assert [leaf.path for leaf in casstore.read_manifest(url, 1).leaves] == [""]


def test_import_safetensors_and_npz_restore_bit_exact(repo, tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"encoder.layer.0.weight": rng.standard_normal((64, 32), np.float32),
               "head/kernel": rng.standard_normal((32, 2), np.float32),
               "layers/[0]/b": np.arange(5, dtype=np.int16),
               "layers/[1]/b": np.arange(6, dtype=np.int16)}
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    url = str(tmp_path / "imported")
    out = run_json("import", path, url, 3, "--run", "ft")
    assert out["tensors"] == 4
    assert casstore.list_steps(url, run="ft") == [3]
    got = casstore.restore(url, 3, run="ft")
    assert got["encoder.layer.0.weight"].tobytes() == tensors["encoder.layer.0.weight"].tobytes()
    assert got["head"]["kernel"].tobytes() == tensors["head/kernel"].tobytes()
    assert isinstance(got["layers"], list)
    assert got["layers"][1]["b"].dtype == np.int16
    assert sorted(leaf.path for leaf in casstore.read_manifest(url, 3, run="ft").leaves) == sorted(
        tensors)
    # a round trip through export keeps every key path, dtype (bfloat16 too) and bit
    exported = tmp_path / "s2.safetensors"
    run("export", repo, 2, exported)
    run("import", exported, url, 0)
    want, back = restored_arrays(repo, 2), restored_arrays(url, 0)
    assert sorted(back) == sorted(want)
    for name in want:
        assert back[name].dtype == want[name].dtype or name == "step"
        assert back[name].tobytes() == want[name].tobytes(), name
    npz = tmp_path / "t.npz"
    np.savez(npz, a=np.arange(4.0), **{"n/[0]": np.ones(2, np.uint8)})
    run("import", npz, url, 1)
    got = casstore.restore(url, 1)
    assert got["a"].tobytes() == np.arange(4.0).tobytes()
    assert got["n"][0].dtype == np.uint8
    result = run("import", npz, url, 1, code=2)
    assert "step already exists" in result.stderr


def test_progress_bars_only_on_a_terminal(repo, tmp_path, monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(cli._output, "console", Console(file=buffer, force_terminal=True, width=100,
                                                     highlight=False, markup=False))
    assert run("verify", repo).exit_code == 0
    run("export", repo, 2, tmp_path / "t.safetensors")
    run("copy", repo, tmp_path / "c")
    assert "ok: 4 step(s)" in buffer.getvalue()
    assert "wrote 5 tensors" in buffer.getvalue()
    assert casstore.list_steps(str(tmp_path / "c")) == [0, 1, 2]
    plain = run("verify", repo).stdout
    assert "\x1b[" not in plain
    assert "verifying" not in plain


def test_tilde_urls_and_python_dash_m(repo, tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(pathlib.Path(
        cli.__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-m", "casstore", "ls", "~/repo", "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["steps"]) == 4
    proc = subprocess.run([sys.executable, "-m", "casstore", "show", "~/repo", "9"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("casstore: error: no such step")


def test_commands_on_s3(object_servers, tmp_path):
    server = object_servers["seaweedfs"]
    url = server.url_for("cli")
    write_repo(FsspecStore.from_url(url, **server.storage_options))
    opts = [a for k, v in server.storage_options.items() for a in ("-o", f"{k}={json.dumps(v)}"
                                                                   if not isinstance(v, str)
                                                                   else f"{k}={v}")]
    store = FsspecStore.from_url(url, **server.storage_options)
    rows = run_json("ls", url, *opts)["steps"]
    assert [(r["run"], r["step"]) for r in rows] == [("default", 0), ("default", 1),
                                                       ("default", 2), ("b", 0)]
    assert rows[1]["shared_bytes"] > 0
    assert rows[1]["added_bytes"] == stored(
        casstore.read_manifest(store, 1), "w")
    shown = run_json("show", url, 1, *opts)
    assert [x["path"] for x in shown["leaves"]] == [
        leaf.path for leaf in casstore.read_manifest(store, 1).leaves]
    checked = run_json("verify", url, *opts)
    assert checked["ok"]
    assert checked["chunks_checked"] == casstore.verify(store).chunks_checked
    local = tmp_path / "from-s3"
    copied = run_json("copy", url, local, *opts)
    assert len(copied["steps_copied"]) == 4
    assert casstore.verify(str(local)).ok
    back = server.url_for("back")
    run_json("copy", local, back, *opts)
    assert casstore.list_runs(FsspecStore.from_url(back, **server.storage_options)) == [
        "b", "default"]
    run("rm", url, 0, 1, *opts)
    dry = run_json("gc", url, "--dry-run", "--grace-period", "0", *opts)
    assert dry["deleted_chunks"] == 2 == casstore.gc(store, dry_run=True,
                                                      grace_period_s=0).deleted_chunks
    assert run_json("gc", url, "--grace-period", "0", *opts)["deleted_chunks"] == 2
    assert run_json("verify", url, *opts)["ok"]
    result = run("ls", url, code=cli.EXIT_ACCESS_DENIED)  # no credentials: one line, the URL
    assert result.stderr.count("\n") == 1
    assert url in result.stderr
    assert "check the credentials" in result.stderr


def test_gcs_credentials_google_auth_cannot_find_exit_as_refused_access():
    """gcsfs's errors for missing or expired Google credentials are google-auth's: exit 12 and
    the credentials hint, as botocore's NoCredentialsError (they were exit 2, "bad input")."""
    from google.auth import exceptions

    from casstore.cli import _app
    for error in (exceptions.DefaultCredentialsError("Your default credentials were not "
                                                     "found"),
                  exceptions.RefreshError("invalid_grant")):
        assert _app.exit_code_of(error) == cli.EXIT_ACCESS_DENIED
        assert "check the credentials" in _app.describe(error)


def test_a_read_only_filesystem_exits_as_refused_access():
    """gc, import, copy and rm into a repository on a read-only mount exited 2 ("usage or
    input error") with EROFS (exploratory session's repro); exit 12 means a store that refuses
    writes (``EXIT_CODES``), as EACCES does."""
    import errno

    from casstore.cli import _app
    error = OSError(errno.EROFS, "Read-only file system", "/mnt/ckpt/chunks/ab")
    assert _app.exit_code_of(error) == cli.EXIT_ACCESS_DENIED
    assert _app.exit_code_of(OSError(errno.EIO, "I/O error")) == cli.EXIT_STORE_FAILED


# run as sh -c "... -c 'SCRIPT'": no single quote in it
_FULL_DISK = """
import os, subprocess, sys
import numpy as np
import casstore
repo, cli = sys.argv[1] + "/repo", [sys.executable, "-m", "casstore"]
rng = np.random.default_rng(0)
casstore.save(repo, 0, {"w": rng.integers(0, 2**31, 1 << 18, dtype=np.int32)})
try:  # 10 MB on a disk of 8 MiB: fails midway, its chunks left unreferenced
    casstore.save(repo, 1, {f"l{i}": rng.integers(0, 2**31, 25600, dtype=np.int32)
                            for i in range(100)})
except OSError as e:
    print("save", e.errno, any("while saving step 1 (run" in n for n in e.__notes__))
fd = os.open(sys.argv[1] + "/other.log", os.O_WRONLY | os.O_CREAT)  # another writer takes
try:  # the rest
    while True:
        os.write(fd, b"x" * 4096)
except OSError:
    os.close(fd)
gc = subprocess.run([*cli, "gc", repo, "--grace-period", "0"], capture_output=True, text=True)
print("gc", gc.returncode, "free a few kilobytes" in gc.stderr, "No space" in gc.stderr)
os.unlink(sys.argv[1] + "/other.log")
gc = subprocess.run([*cli, "gc", repo, "--grace-period", "0"], capture_output=True, text=True)
print("gc", gc.returncode, gc.stderr.strip()[-300:])
print("steps", casstore.list_steps(repo), casstore.verify(repo).ok)
"""


def test_a_full_disk_exits_15_and_says_how_to_let_gc_free_it(tmp_path):
    """gc on a disk a failed save filled exited 2, "usage or input error", with no way out
    (exploratory session's repro): it writes its lock before deleting anything. A tmpfs of
    8 MiB, mounted in a mount namespace of the child process's own (``unshare``)."""
    out = in_mount_namespace(f"mount -t tmpfs -o size=8m tmpfs {tmp_path}", _FULL_DISK, tmp_path)
    lines = out.stdout.splitlines()
    assert lines[:2] == ["save 28 True", f"gc {cli.EXIT_STORE_FAILED} True True"], out.stdout
    assert lines[2].startswith("gc 0"), out.stdout
    assert lines[3] == "steps [0] True", out.stdout


def test_copy_and_repair_refuse_storage_options_no_path_takes(repo, tmp_path):
    for command in ("copy", "repair"):
        result = run(command, repo, tmp_path / f"{command}-dst", "-o", "anon=true", code=2)
        assert "storage options (-o/-O) are for fsspec URLs" in result.stderr
        result = run(command, repo, tmp_path / f"{command}-dst", "-O", "anon=true", code=2)
        assert "take none" in result.stderr
        # -o for a local SRC beside -O for DST would be dropped silently (DST takes -O only)
        result = run(command, repo, "s3://bucket/dst", "-o", "endpoint_url=http://127.0.0.1:9",
                     "-O", "anon=true", code=2)
        assert "-o is for SRC, a local path here" in result.stderr
    assert not (tmp_path / "copy-dst").exists()


def test_usage_counts_a_delta_base_no_kept_step_stores_whole(tmp_path):
    """Retention deleted the step that wrote the base; the kept steps' deltas still need it
    and gc keeps it, but du and ls counted it 0 bytes (13% short here)."""
    url = str(tmp_path / "r")
    rng = np.random.default_rng(0)
    frozen = rng.standard_normal(600_000).astype(np.float32)
    w = rng.standard_normal(100_000).astype(np.float32)
    # One worker: a delta must fit the step's RestoreBudget as booked so far, and with several
    # workers w's delta could be judged before the frozen chunk was booked (then refused: 1 in
    # 30 runs on a loaded machine).
    store = casstore.open_store(url)
    store.max_workers = 1
    with casstore.CheckpointManager(store, max_to_keep=2, gc_after_retention=True,
                                    grace_period_s=0) as mngr:
        for step in range(5):
            w = w + np.float32(1e-5) * rng.standard_normal(w.shape).astype(np.float32)
            mngr.save(step, {"frozen": frozen, "w": w})
    assert any(r.base for leaf in casstore.read_manifest(url, 4).leaves for r in leaf.chunks)
    u = casstore.usage(url)
    assert u.unreferenced_bytes == 0
    assert u.runs[0].stored_bytes == u.chunk_bytes  # every stored object, the base included
    listed = run_json("ls", url)["steps"]
    assert sum(s["added_bytes"] for s in listed) == u.chunk_bytes
    assert sum(s["added_bytes"] for s in run_json("du", url)["steps"]) == u.chunk_bytes


def test_text_tables_escape_control_characters_of_key_paths(tmp_path):
    """A key path may hold any character but NUL: a newline split a row over two lines, and
    an ESC reached the terminal."""
    url = str(tmp_path / "r")
    casstore.save(url, 0, {"new\nline": np.ones(3), "osc\x1b]0;title\x07": np.ones(4)})
    out = run("show", url, 0).stdout
    assert "new\\nline" in out
    assert "osc\\x1b]0;title\\x07" in out
    assert "\x1b" not in out
    assert "\x07" not in out


def test_a_long_table_prints_plainly_one_aligned_row_a_leaf(tmp_path, monkeypatch):
    """`show` of a step of 20,000 leaves took 43 s, all of it in rich's table."""
    url = str(tmp_path / "r")
    tree = {"a": np.ones(3), "longer_name": np.zeros(40, np.int8), "new\nline": np.ones(2)}
    casstore.save(url, 0, tree)
    monkeypatch.setattr(_output, "PLAIN_ROWS", 2)
    lines = run("show", url, 0).stdout.splitlines()
    assert lines[0].startswith(f"{url} run 'default' step 0: 3 leaves")
    header, rule, *rows = lines[1:]
    assert header.split() == ["key", "path", "shape", "dtype", "sharding", "chunks", "logical",
                              "stored", "shared"]
    assert set(rule) == {"-", " "}
    assert [r.split()[0] for r in rows] == ["a", "longer_name", "new\\nline"]
    assert [r.split()[2] for r in rows] == ["float64", "int8", "float64"]
    dtype_at = header.index("dtype")
    assert all(r[dtype_at:].startswith(("float64", "int8")) for r in rows)


def test_a_step_of_a_newer_format_is_named_as_such_not_as_damage(tmp_path):
    import msgpack

    from casstore._layout import manifest_key
    url = str(tmp_path / "repo")
    for step in (0, 1):
        casstore.save(url, step, {"w": np.ones(3)})
    key = tmp_path / "repo" / manifest_key("default", 1)
    doc = msgpack.unpackb(key.read_bytes())
    doc.update(features=[*doc["features"], "future-thing"], min_reader="9.0.0")
    key.write_bytes(repack(doc))
    result = run("ls", url, code=14)  # upgrade: nothing is damaged
    assert "casstore: newer format:" in result.stderr
    assert "upgrade casstore" in result.stderr
    assert "casstore: damaged" not in result.stderr


def test_ls_persistent_lists_a_step_damaged_on_one_tier_once_and_needs_a_repository(tmp_path):
    """A step whose manifest is damaged locally and intact on the persistent tier is one row,
    where it is intact, and the damage is still reported (exit 1); two paths with no
    repository exit 10 (was an empty table and 0)."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    for step in (0, 1):
        casstore.save(local, step, {"w": np.full(3, step)})
    casstore.copy(local, remote)
    key = local / "runs" / "default" / "steps" / f"{1:016d}.manifest"
    key.write_bytes(key.read_bytes()[:40])
    listing = run_json("ls", local, "--persistent", remote, code=1)
    assert [(s["step"], s["where"]) for s in listing["steps"]] == [(0, "both"),
                                                                 (1, "persistent")]
    assert [p["step"] for p in listing["problems"]] == [1]
    result = run("ls", local, "--persistent", remote, code=1)
    assert "2 step(s), 1 damaged" in result.stdout
    run("ls", tmp_path / "none", "--persistent", tmp_path / "none2", code=10)


def test_du_plot_folder_read_only_hint_and_repair_of_a_newer_step(tmp_path):
    """du --plot into a folder that does not exist is refused before the work; a store
    opened read_only=true is named as such, not blamed on credentials; repair whose only
    problem left is a newer-format step exits 14 (upgrade), not 1 (damaged)."""
    import msgpack

    from casstore._layout import manifest_key
    good, newer = tmp_path / "good", tmp_path / "newer"
    for step in (0, 1):
        casstore.save(good, step, {"w": np.full(3, step)})
    result = run("du", good, "--plot", tmp_path / "nodir" / "u.svg", code=2)
    assert "its folder does not exist" in result.stderr
    result = run("copy", good, "memory://ro-target", "-O", "read_only=true", code=12)
    assert "drop that option" in result.stderr
    assert "credentials" not in result.stderr
    casstore.copy(good, newer)
    key = newer / manifest_key("default", 1)
    doc = msgpack.unpackb(key.read_bytes())
    doc.update(features=[*doc["features"], "future-thing"], min_reader="9.0.0")
    key.write_bytes(repack(doc))
    run("repair", good, newer, code=14)


def test_ls_and_cat_print_what_a_reader_takes_at_the_edges_of_the_format(tmp_path, monkeypatch):
    """A ``created`` just below year 10000 UTC is year 10000 east of UTC: ls failed with
    "year 10000 is out of range" (exit 2); a msgpack Timestamp in a tree node's field no
    reader checks failed cat's JSON; a tree node's ``type`` must be a str (format.md §4.2)
    (exploratory session's repros)."""
    import time

    import msgpack

    url = tmp_path / "repo"
    casstore.save(url, 1, {"a": np.arange(4.0)})
    path = url / "runs" / "default" / "steps" / f"{1:016d}.manifest"
    doc = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    doc["created"] = 253402300000.0  # 9999-12-31T23:46:40 UTC
    doc["tree"]["note"] = msgpack.Timestamp(0)
    path.write_bytes(repack(doc))
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        assert "9999-12-31 23:46:40 UTC" in run("ls", url).stdout
    finally:
        monkeypatch.undo()
        time.tzset()
    assert json.loads(run("cat", url, 1).stdout)["tree"]["note"] == "1970-01-01T00:00:00+00:00"
    doc["tree"]["note"] = msgpack.Timestamp(2**40)  # past year 9999 (review)
    path.write_bytes(repack(doc))
    assert json.loads(run("cat", url, 1).stdout)["tree"]["note"] == {"timestamp": [2**40, 0]}
    doc["tree"]["type"] = msgpack.Timestamp(0)
    path.write_bytes(repack(doc))
    with pytest.raises(casstore.ManifestError, match="bad tree node"):
        casstore.read_manifest(url, 1)


def test_inspect_step_of_none_is_the_latest_step(repo):
    """It failed with a bare TypeError comparing None (exploratory session's repro), where
    diff_steps already took None for the latest."""
    latest = casstore.inspect_step(repo, None)
    assert (latest.step, latest.previous_step) == (2, 1)
    assert latest == casstore.inspect_step(repo, 2)


def test_a_step_is_written_in_ascii_digits_only(repo, tmp_path):
    """Python's int() read '0_1' as step 1 and a fullwidth one (U+FF11) as 1: 'casstore rm URL 0_1'
    deleted step 1 (exploratory session's repro)."""
    for args, said in [(("rm", repo, "0_1"), "'0_1' is not a step number"),
                       (("show", repo, "\uff11"), "'\uff11' is neither a step number nor"),
                       (("export", repo, "0_1", tmp_path / "x.npz"), "'0_1' is neither a step"),
                       (("copy", repo, tmp_path / "dst", "--steps", "0_1"),
                        "--steps '0_1' is not a comma-separated list of steps")]:
        assert said in run(*args, code=2).stderr
    assert casstore.list_steps(repo) == [0, 1, 2]
    assert not (tmp_path / "dst").exists()
