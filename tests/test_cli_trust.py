"""The ``casstore`` command line on a bad day (issue 30): a damaged repository, inputs checked
before anything changes, one-line errors with their exit codes, an unreachable store, and a
``--help`` that does not import jax. Run through click's CliRunner and as ``python -m``."""

import json
import os
import pathlib
import subprocess
import sys
import time
import zipfile

import msgpack
import numpy as np
import pytest
from test_cli import run, run_json, tree, write_repo

import casstore
import casstore.store
from casstore import _repair, cli
from casstore._layout import chunk_key, manifest_key

from conftest import repack


@pytest.fixture
def repo(tmp_path) -> str:
    url = str(tmp_path / "repo")
    write_repo(url)
    return url


DELTA_CHUNK = 64 * 1024


def trained(step: int) -> np.ndarray:
    """Weights after ``step`` small updates: steps 1.. store delta chunks on step 0's."""
    base = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32) * 0.02
    noise = np.random.default_rng(1).standard_normal(base.shape).astype(np.float32)
    touched = np.arange(base.size).reshape(base.shape) % 32 < step
    return np.where(touched, base + np.float32(2e-6) * step * noise, base)


@pytest.fixture
def delta_repo(tmp_path) -> str:
    """Six steps of one run; steps 1-5 hold delta chunks on step 0's chunks."""
    url = str(tmp_path / "delta")
    for step in range(6):
        casstore.save(url, step, {"w": trained(step), "n": step},
                      chunk_size_bytes=DELTA_CHUNK)
    refs = [r for s in range(1, 6) for leaf in casstore.read_manifest(url, s).leaves
            for r in leaf.chunks]
    assert refs, "the fixture wants delta chains"
    assert all(r.base is not None for r in refs), "the fixture wants delta chains"
    return url


def truncate_manifest(url: str, step: int, run: str = "default", keep: int | None = None
                      ) -> None:
    """Cuts a manifest short: to ``keep`` bytes, or half of it."""
    path = pathlib.Path(url) / "runs" / run / "steps" / f"{step:016d}.manifest"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2 if keep is None else keep])


def test_a_truncated_manifest_costs_its_step_only(delta_repo, tmp_path):
    truncate_manifest(delta_repo, 4)
    listed = run_json("ls", delta_repo, code=1)
    assert [r["step"] for r in listed["steps"]] == [0, 1, 2, 3, 5]
    assert [(p["run"], p["step"], p["kind"]) for p in listed["problems"]] == [
        ("default", 4, "manifest")]
    text = run("ls", delta_repo, code=1)
    assert "damaged" in text.stdout
    assert "step 4" in text.stderr
    assert "not msgpack" not in text.stderr.splitlines()[-1]
    usage = run_json("du", delta_repo, code=1)
    assert [s["step"] for s in usage["steps"]] == [0, 1, 2, 3, 5]
    report = run_json("verify", delta_repo, code=1)
    assert [(p["step"], p["kind"]) for p in report["problems"]] == [(4, "manifest")]
    assert report["manifests_damaged"] == 1
    assert report["chunks_ok"] == report["chunks_checked"]
    assert run_json("verify", delta_repo, 3)["ok"]  # step 3 itself is whole
    dry = run_json("gc", delta_repo, "--dry-run", code=1)
    assert dry["damaged_manifests"] == 1
    assert dry["manifests"] == 5
    before = sorted(p for p in pathlib.Path(delta_repo).rglob("*") if p.is_file())
    refused = run("gc", delta_repo, "--grace-period", "0", code=1)
    assert "gc refused" in refused.stderr
    assert "default@4" in refused.stderr
    assert sorted(p for p in pathlib.Path(delta_repo).rglob("*") if p.is_file()) == before
    copied = run_json("copy", delta_repo, tmp_path / "dst", "--steps", "3,5")
    assert sorted(s for _, s in copied["steps_copied"]) == [3, 5]
    assert casstore.verify(str(tmp_path / "dst")).ok
    shown = run("show", delta_repo, 5)  # its previous step is the damaged one
    assert "step 4" in shown.stderr
    assert "w" in shown.stdout


def rewrite_manifest(url: str, step: int, change) -> None:
    path = pathlib.Path(url) / "runs" / "default" / "steps" / f"{step:016d}.manifest"
    doc = msgpack.unpackb(path.read_bytes())
    change(doc)
    path.write_bytes(repack(doc))


@pytest.mark.parametrize("created", [float("nan"), float("inf"), 1e20, -1.0])
def test_a_manifest_of_an_impossible_time_is_a_damaged_manifest(delta_repo, created):
    """ls printed ValueError: Invalid value NaN (exit 2, bad input) for a NaN created."""
    rewrite_manifest(delta_repo, 4, lambda doc: doc.update(created=created))
    listed = run_json("ls", delta_repo, code=1)
    assert [(p["step"], p["kind"]) for p in listed["problems"]] == [(4, "manifest")]
    assert "created is not a time since the epoch" in listed["problems"][0]["message"]


@pytest.mark.parametrize("bad", [{"mesh": "x"}, msgpack.Timestamp(1, 0)])
def test_show_reports_a_sharding_it_cannot_read_as_a_damaged_manifest(delta_repo, bad):
    """show failed with 'str' has no attribute 'items' (exit 2); a Timestamp passed, and
    ``show --json`` failed printing it (exit 2): the field is checked at decode (exit 1)."""
    def damage(doc):
        next(x for x in doc["leaves"] if x["path"] == "w")["sharding"] = bad

    rewrite_manifest(delta_repo, 4, damage)
    for args in (["show", delta_repo, "4"], ["show", delta_repo, "4", "--json"]):
        shown = run(*args, code=1)
        assert "bad saved sharding" in shown.stdout + shown.stderr


def test_a_deleted_base_chunk_is_one_missing_object_with_the_steps_needing_it(delta_repo):
    (w,) = [leaf for leaf in casstore.read_manifest(delta_repo, 1).leaves if leaf.path == "w"]
    base = w.chunks[0].base
    (pathlib.Path(delta_repo) / "chunks" / base[:2] / base[2:]).unlink()
    for flag in ("--read-data", "--no-read-data"):
        report = run_json("verify", delta_repo, flag, code=1)
        assert [(p["kind"], p["chunk_id"]) for p in report["problems"]] == [("missing", base)]
        assert report["problems"][0]["needed_by"] == [["default", s] for s in range(6)]
        assert "corrupt" not in report["problems"][0]["text"]
        assert report["chunks_missing"] == 1
        assert report["chunks_corrupt"] == 0
        assert report["chunks_unchecked"] == 5  # the deltas on it: one per later step
        assert report["chunks_checked"] == (report["chunks_ok"] + report["chunks_missing"]
                                            + report["chunks_corrupt"]
                                            + report["chunks_unchecked"])
    text = run("verify", delta_repo, code=1).stdout
    assert text.count("problem:") == 1
    assert "1 missing, 0 corrupt, 0 unsupported, 5 unchecked" in text  # they add up
    assert "default@5" in text
    dry = run_json("gc", delta_repo, "--dry-run", "--grace-period", "0", code=1)  # damage
    listed = sum(1 for d in ("chunks", "deltas")
                 for p in (pathlib.Path(delta_repo) / d).rglob("*") if p.is_file())
    assert dry["chunks"] == listed
    assert dry["missing_chunks"] == 1
    assert dry["chunks"] == (dry["referenced_chunks"] + dry["deleted_chunks"]
                             + dry["young_unreferenced_chunks"])
    said = run("gc", delta_repo, "--dry-run", code=1)
    assert f"of {listed} chunks listed, {dry['referenced_chunks']} referenced" in said.stdout
    assert "1 chunk object(s) referenced but missing" in said.stderr
    for step in (0, 3):
        with pytest.raises(casstore.MissingChunkError,
                           match=f"missing.*{base[2:]}.*step {step}") as info:
            casstore.restore(delta_repo, step)
        assert isinstance(info.value, FileNotFoundError)
        assert not isinstance(info.value, casstore.CorruptChunkError)
    assert casstore.restore(delta_repo, 3, paths=["n"])["n"] == 3


# --- validate everything first, then act (issue 30 item 4) ---


def test_rm_checks_every_step_before_deleting_any(repo):
    result = run("rm", repo, 1, 99, 2, code=2)
    assert "99" in result.stderr
    assert "nothing deleted" in result.stderr
    assert casstore.list_steps(repo) == [0, 1, 2]
    dry = run("rm", repo, 1, 2, "--dry-run")
    assert "would delete run 'default' step 2" in dry.stdout
    assert casstore.list_steps(repo) == [0, 1, 2]
    assert run_json("rm", repo, 1, 2) == {"schema_version": 1, "run": "default",
                                          "steps": [1, 2], "dry_run": False}
    assert casstore.list_steps(repo) == [0]


def test_copy_checks_runs_and_steps_before_creating_the_destination(repo, tmp_path):
    dst = tmp_path / "dst"
    result = run("copy", repo, dst, "--runs", "typo", code=2)
    assert "'typo'" in result.stderr
    assert "'default'" in result.stderr
    result = run("copy", repo, dst, "--runs", "b", "--steps", "0,7", code=2)
    assert "step(s) 7" in result.stderr
    assert "not a comma-separated" in run("copy", repo, dst, "--steps", "x", code=2).stderr
    assert not dst.exists()


def test_export_checks_its_output_path_before_reading(repo, tmp_path, monkeypatch):
    def no_reads(*args, **kwargs):
        raise AssertionError("export read the step before checking its output")

    monkeypatch.setattr(casstore, "restore", no_reads)
    result = run("export", repo, 2, tmp_path / "no" / "such" / "t.npz", code=2)
    assert "does not exist" in result.stderr
    assert "t.npz" in result.stderr
    existing = tmp_path / "t.npz"
    existing.write_bytes(b"keep me")
    result = run("export", repo, 2, existing, code=2)
    assert "--force" in result.stderr
    assert existing.read_bytes() == b"keep me"
    monkeypatch.undo()
    run("export", repo, 2, existing, "--paths", "w", "--force")
    with np.load(existing) as z:
        np.testing.assert_array_equal(z["w"], tree(0, 2)["w"])


def test_help_and_import_do_not_import_jax():
    code = ("import sys\nfrom casstore.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit as e:\n    assert e.code == 0\n"
            "import casstore\nassert casstore.__version__\n"
            "print(sorted(m for m in ('jax', 'numpy', 'fsspec') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(pathlib.Path(
                              cli.__file__).parents[2])})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert sorted(casstore.__all__) == casstore.__all__
    assert "verify" in dir(casstore)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        casstore.nope  # noqa: B018


def test_errors_are_one_line_with_their_exit_code(repo, tmp_path):
    result = run("show", repo, 99, code=cli.EXIT_USAGE)
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
    assert "no such step" in result.stderr
    assert "99" in result.stderr
    assert repo in result.stderr
    result = run("ls", tmp_path / "nowhere", code=cli.EXIT_NO_REPOSITORY)
    assert "no casstore repository" in result.stderr
    assert "nowhere" in result.stderr
    assert "endpoint_url" not in result.stderr  # a hint for object stores only
    assert not (tmp_path / "nowhere").exists()
    result = run("ls", "nosuchprotocol://bucket/repo", code=cli.EXIT_USAGE)
    assert result.stderr.startswith("casstore: error:")
    assert result.stderr.count("\n") == 1
    assert "nosuchprotocol" in result.stderr
    result = run("show", repo, 1, "--run", "no/such", code=2)
    assert "'no/such' has no steps" in result.stderr
    result = run("ls", repo, "-o", "anon=true", code=2)
    assert "anon: storage options and timeouts are for object stores" in result.stderr
    run("ls", repo, "-o", "novalue", code=2)
    usage = run("show", repo, code=2)  # click's own usage error: one line too
    assert usage.stderr.count("\n") == 1
    assert "--help" in usage.stderr
    debug = run("--debug", "show", repo, "99", code=2)  # the traceback, the same exit code
    assert "Traceback (most recent call last)" in debug.stderr
    assert "StepNotFoundError" in debug.stderr
    late = run("show", repo, "99", "--debug", code=2)  # a group option after the command
    assert "No such option '--debug'" in late.stderr
    assert "Traceback" not in late.stderr
    for command in ("ls", "verify", "show", "diff", "cat", "export"):
        extra = {"show": [1], "diff": [0, 1], "cat": [1], "export": [1, tmp_path / "x.npz"]}
        result = run(command, repo, *extra.get(command, []), "--run", "nope", code=2)
        assert result.stderr.startswith("casstore: error: run 'nope' has no steps"), command
    result = run("rm", repo, 7, code=2)
    assert "step(s) 7 not in run 'default'" in result.stderr
    truncate_manifest(repo, 1)
    result = run("show", repo, 1, code=cli.EXIT_PROBLEMS)
    assert "verify" in result.stderr
    assert "step 1" in result.stderr


def test_json_mode_errors_are_json_and_help_lists_exit_codes(repo, tmp_path):
    result = run("show", repo, 99, "--json", code=2)
    error = json.loads(result.stderr)
    assert error["schema_version"] == cli.JSON_SCHEMA_VERSION
    assert error["error"]["code"] == 2
    assert error["error"]["type"] == "StepNotFoundError"
    assert "no such step" in error["error"]["message"]
    assert json.loads(run("ls", tmp_path / "none", "--json", code=10).stderr)["error"]["code"] == 10
    assert "COMMAND [ARGS]" in run(code=2).stdout  # bare casstore: its help, exit 2
    bogus = run("bogus", code=2).stderr
    assert bogus.startswith("casstore: error: No such command 'bogus'; see '")
    assert bogus.endswith(" --help'\n")
    assert bogus.count("\n") == 1
    for args in ([], ["verify"], ["export"]):
        text = run(*args, "--help").stdout
        assert "Exit codes:" in text, args
        assert "10  no casstore repository" in text, args
        assert args == [] or "Examples:" in text


@pytest.mark.parametrize("url", ["s3://bucket/repo", "gs://bucket/repo", "memory://repo"])
def test_unknown_storage_options_are_refused_before_any_request(url, monkeypatch):
    def no_store(*args, **kwargs):
        raise AssertionError("a store was opened")

    monkeypatch.setattr(casstore, "open_store", no_store)
    result = run("ls", url, "-o", "bogus_option=1", code=2)
    assert "unknown storage option(s) bogus_option" in result.stderr
    assert url.split("://")[0] + "://" in result.stderr
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize(("url", "credentials"), [
    ("s3://bucket/ckpts", ["-o", "key=a", "-o", "secret=b"]),
    ("gs://bucket/ckpts", ["-o", "token=anon"]),
])
def test_a_closed_port_fails_within_seconds_naming_the_endpoint(url, credentials):
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(cli.__file__).parents[2])}
    env.pop("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", None)  # gcsfs's default, as users run it
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "casstore", "ls", url, "-o",
                           "endpoint_url=http://127.0.0.1:9", *credentials],
                          capture_output=True, text=True, timeout=120, env=env)
    elapsed = time.monotonic() - t0
    assert proc.returncode == cli.EXIT_UNREACHABLE, proc.stderr
    assert "127.0.0.1:9" in proc.stderr
    assert "endpoint" in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert elapsed < 30, elapsed  # the store's 60 s deadline is for servers that answer


def test_repair_from_another_copy_as_docs_recovery_says(delta_repo, tmp_path):
    good = tmp_path / "good"
    run("copy", delta_repo, good)
    w = next(leaf for leaf in casstore.read_manifest(delta_repo, 2).leaves if leaf.path == "w")
    base, delta = w.chunks[0].base, w.chunks[1]
    (pathlib.Path(delta_repo) / "chunks" / base[:2] / base[2:]).unlink()  # missing
    victim = pathlib.Path(delta_repo) / delta.key  # corrupt
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    report = run_json("verify", delta_repo, code=1)
    assert sorted(p["kind"] for p in report["problems"]) == ["corrupt", "missing"]
    for p in report["problems"]:  # step 1 of docs/recovery.md's repair
        if p["kind"] == "corrupt":
            (pathlib.Path(delta_repo) / delta.key).unlink()
    steps = sorted({s for p in report["problems"] for _, s in p["needed_by"]})
    run("rm", delta_repo, *steps)
    run("copy", good, delta_repo, "--steps", ",".join(map(str, steps)))
    assert run_json("verify", delta_repo)["ok"]
    assert casstore.restore(delta_repo, 2)["w"].tobytes() == trained(2).tobytes()


def test_junk_tensor_files_are_named_without_library_advice(repo, tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"this is not a zip file at all")
    result = run("import", junk, repo, 9, code=2)
    assert "junk.npz" in result.stderr
    assert "not an .npz archive" in result.stderr
    assert "pickle" not in result.stderr
    assert result.stderr.count("\n") == 1
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    result = run("import", bad, repo, 9, code=2)
    assert "bad.safetensors" in result.stderr
    assert "not a valid .safetensors" in result.stderr
    with pytest.raises(casstore.TensorFileError, match=r"junk\.npz") as info:
        casstore.import_tensors(junk, repo, 9)
    assert isinstance(info.value, ValueError)
    assert casstore.list_steps(repo) == [0, 1, 2]


def test_tensor_names_that_make_no_pytree_and_npz_members_that_are_no_arrays_are_refused(
        tmp_path):
    """Names mixing int elements with names at one level, or giving one int key twice, are
    a TensorFileError naming the file (was jax's sort error, or one tensor silently lost); an
    .npz member that is not a .npy array is refused (was stored as a bytes leaf)."""
    from safetensors.numpy import save_file

    repo = tmp_path / "repo"
    for i, names in enumerate([("m/[0]", "m/x"), ("[1]", "[=1]"), ("[=3]", "a")]):
        path = tmp_path / f"names{i}.safetensors"
        save_file({n: np.full(2, j, np.float32) for j, n in enumerate(names)}, str(path))
        with pytest.raises(casstore.TensorFileError, match=rf"names{i}\.safetensors") as info:
            casstore.import_tensors(path, repo, i)
        assert "one type" in str(info.value)
    npz = tmp_path / "extra.npz"
    np.savez(npz, x=np.arange(3))
    with zipfile.ZipFile(npz, "a") as z:
        z.writestr("README.txt", "hello")
    with pytest.raises(casstore.TensorFileError, match=r"'README\.txt' is not a \.npy array"):
        casstore.import_tensors(npz, repo, 5)
    assert casstore.list_steps(repo) == []
    fine = tmp_path / "fine.safetensors"
    save_file({"[0]": np.zeros(1, np.float32), "[2]": np.ones(1, np.float32)}, str(fine))
    casstore.import_tensors(fine, repo, 6)  # sequence indices with a gap: a list, None there
    back = casstore.restore(repo, 6)
    assert [None if x is None else x.tolist() for x in back] == [[0.0], None, [1.0]]


def test_a_damaged_repository_on_s3(object_servers):
    server = object_servers["seaweedfs"]
    url = server.url_for("damaged")
    store = casstore.store.FsspecStore.from_url(url, **server.storage_options)
    write_repo(store)
    opts = [a for k, v in server.storage_options.items()
            for a in ("-o", f"{k}={v if isinstance(v, str) else json.dumps(v)}")]
    key = "runs/default/steps/0000000000000001.manifest"
    store.put(key, store.get(key)[:100])
    (w,) = [leaf for leaf in casstore.read_manifest(store, 2).leaves if leaf.path == "w"]
    gone = w.chunks[0]  # w changes every step: only step 2 needs it
    store.delete(gone.key)
    listed = run_json("ls", url, *opts, code=1)
    assert [(r["run"], r["step"]) for r in listed["steps"]] == [
        ("default", 0), ("default", 2), ("b", 0)]
    assert [(p["step"], p["kind"]) for p in listed["problems"]] == [(1, "manifest")]
    report = run_json("verify", url, *opts, code=1)
    assert sorted(p["kind"] for p in report["problems"]) == ["manifest", "missing"]
    (missing,) = [p for p in report["problems"] if p["kind"] == "missing"]
    assert missing["chunk_id"] == gone.id
    assert missing["needed_by"] == [["default", 2]]
    assert run_json("verify", url, 0, *opts)["ok"]
    with pytest.raises(casstore.MissingChunkError, match="step 2"):
        casstore.restore(store, 2)


def test_commands_that_read_manifests_do_not_import_jax(repo):
    code = ("import sys\nfrom casstore.cli import main\n"
            "for args in (['ls'], ['du'], ['verify'], ['show', '1'], ['diff', '0', '2'],\n"
            "             ['cat', '1'], ['gc', '--dry-run']):\n"
            "    try:\n        main([args[0], sys.argv[1], *args[1:]])\n"
            "    except SystemExit as e:\n        assert e.code == 0, (args, e.code)\n"
            "print('jax' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, repo], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(pathlib.Path(
                              cli.__file__).parents[2])})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "False"


def test_the_cli_uses_casstores_public_names_only():
    import ast

    for path in pathlib.Path(cli.__file__).parent.glob("*.py"):
        tree_ = ast.parse(path.read_text())
        for node in ast.walk(tree_):
            if isinstance(node, ast.ImportFrom):
                assert node.level in (0, 1), (path.name, node.module)  # no "from .." imports
                assert node.level == 1 or not (node.module or "").startswith("casstore.") or (
                    node.module == "casstore.store"), (path.name, node.module)
            elif isinstance(node, ast.Import):
                assert all(a.name in ("casstore", "casstore.store") or not a.name.startswith(
                    "casstore") for a in node.names), path.name
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                assert not (node.value.id == "casstore" and node.attr.startswith("_")
                            and not node.attr.startswith("__")), (
                    path.name, node.attr)
        assert len(path.read_text().splitlines()) <= 450, path.name


def test_repair_command_fixes_missing_corrupt_and_manifest_damage(delta_repo, tmp_path):
    good = tmp_path / "good"
    run("copy", delta_repo, good)
    assert run_json("repair", good, delta_repo)["problems"] == []  # nothing to do
    w = next(leaf for leaf in casstore.read_manifest(delta_repo, 2).leaves if leaf.path == "w")
    base, delta = w.chunks[0].base, w.chunks[1]
    (pathlib.Path(delta_repo) / "chunks" / base[:2] / base[2:]).unlink()
    victim = pathlib.Path(delta_repo) / delta.key
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    truncate_manifest(delta_repo, 4)
    plan = run_json("repair", good, delta_repo, "--dry-run", code=1)
    assert sorted(p["kind"] for p in plan["problems"]) == ["corrupt", "manifest", "missing"]
    assert plan["deleted_objects"] == [delta.key]
    assert plan["unrepairable"] == []
    assert [s for _, s in plan["steps"]] == list(range(6))  # the base is in every step
    assert victim.read_bytes() == bytes(data)  # a dry run changes nothing
    done = run("repair", good, delta_repo)
    assert "copied back 6 step(s)" in done.stdout
    assert done.stdout.strip().endswith("ok")
    assert casstore.verify(delta_repo).ok
    for step in range(6):
        assert casstore.restore(delta_repo, step)["w"].tobytes() == trained(step).tobytes()
    casstore.delete(str(good), 5)  # a step the good copy lacks is left alone, and reported
    (pathlib.Path(delta_repo) / "runs" / "default" / "steps" / f"{5:016d}.manifest"
     ).write_bytes(b"junk")
    info = casstore.repair(str(good), delta_repo)
    assert [(p.kind, p.step) for p in info.unrepairable] == [("manifest", 5)]
    assert info.why == {("default", 5): "GOOD lacks the step"}
    assert not info.ok
    said = run("repair", good, delta_repo, code=1)
    assert "casstore: unrepairable: default@5: GOOD lacks the step" in said.stderr
    assert run_json("repair", good, delta_repo, code=1)["why"] == [
        {"run": "default", "step": 5, "why": "GOOD lacks the step"}]
    assert info.steps == ()
    assert 5 in casstore.list_steps(delta_repo)


def test_ls_with_a_persistent_tier_says_where_each_step_lives(object_servers, tmp_path):
    server = object_servers["seaweedfs"]
    url, local = server.url_for("cli-tiers"), str(tmp_path / "local")
    remote = casstore.open_store(url, **server.storage_options)
    with casstore.CheckpointManager(local, persistent=remote, persist_interval_steps=2,
                                    max_to_keep=2, chunk_size_bytes=64 * 1024) as mngr:
        for step in range(5):  # persists 0, 2, 4; keeps 3 and 4 locally
            mngr.save(step, tree(0, step))
            mngr.wait_until_finished()
            assert mngr.wait_until_persisted()
    assert casstore.list_steps(local) == [3, 4]
    assert casstore.list_steps(remote) == [0, 2, 4]
    opts = [a for k, v in server.storage_options.items()
            for a in ("-p", f"{k}={v if isinstance(v, str) else json.dumps(v)}")]
    listed = run_json("ls", local, "--persistent", url, *opts)
    assert listed["persistent"] == url
    assert [(r["step"], r["where"]) for r in listed["steps"]] == [
        (0, "persistent"), (2, "persistent"), (3, "local"), (4, "both")]
    m2 = casstore.read_manifest(remote, 2)  # a persistent-only step's figures: its manifest's
    assert (listed["steps"][1]["leaves"], listed["steps"][1]["logical_bytes"]) == (
        len(m2.leaves), m2.logical_bytes)
    assert listed["steps"][0]["shared_bytes"] == 0 < listed["steps"][1]["shared_bytes"]
    text = run("ls", local, "--persistent", url, *opts).stdout
    assert f"{local} + {url}: 1 run(s), 4 step(s)" in text
    assert "persistent" in text
    assert "where" not in run_json("ls", local)["steps"][0]  # without --persistent: as before
    run("ls", local, "--persistent", url, code=cli.EXIT_ACCESS_DENIED)  # no -p credentials
    replaced = str(tmp_path / "replaced")  # a new node: an empty local tier (exit 10 before)
    listed = run_json("ls", replaced, "--persistent", url, *opts)
    assert [(r["step"], r["where"]) for r in listed["steps"]] == [
        (0, "persistent"), (2, "persistent"), (4, "persistent")]
    run("ls", replaced, code=cli.EXIT_NO_REPOSITORY)  # without a persistent tier: none there
    assert "note" not in run("ls", local, "--persistent", url, *opts).stderr
    mistyped = run("ls", local, "--persistent", url + "-typo", *opts)  # listed all as local
    assert f"no casstore repository at '{url}-typo' yet" in mistyped.stderr
    assert ": 1 run(s), 2 step(s)" in mistyped.stdout  # the local steps 3 and 4 alone


@pytest.mark.parametrize(("leaves", "command"), [
    (1000, ["show"]),  # rich's table
    (2500, ["show"]),  # past PLAIN_ROWS, plain lines
    (1000, ["show", "--json"]), (1000, ["cat"])])  # exited 0, their output cut short
def test_output_cut_short_by_its_reader_exits_as_sigpipe_not_as_damage(tmp_path, leaves,
                                                                       command):
    """`casstore show URL | head -1`: rich exited 1, the code of a damaged repository. The
    plain table of a long step exits the same way, and so do JSON and `cat`, which wrote
    their text in one write that the reader's exit cut short without an error: exit 0."""
    url = str(tmp_path / "many")
    # 1000 leaves print 116 kB, past what the pipe (64 KiB) and the reader's buffer take, so
    # the rest is written after the close. show takes 3 s of CPU for them in rich's table.
    casstore.save(url, 0, {f"leaf{i}": np.ones(3) for i in range(leaves)})
    proc = subprocess.Popen([sys.executable, "-m", "casstore", command[0], url, "0",
                             *command[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip()
    proc.stdout.close()  # as head does after its line
    assert proc.wait(timeout=120) == 141
    assert proc.stderr.read() == b""


def test_casstores_own_storage_options_are_typed(repo):
    """-o read_only=False parsed as the string 'False', which is true: rm refused as
    read-only; a timeout of '60s' or 'inf' ended in a TypeError naming no option."""
    for bad, message in (("read_only=maybe", "read_only='maybe': true or false"),
                         ("operation_timeout_s=60s", "operation_timeout_s='60s': a number"),
                         ("request_timeout_s=inf", "request_timeout_s='inf': a number"),
                         ("request_timeout_s=0", "request_timeout_s='0': a number")):
        result = run("ls", "s3://bucket/x", "-o", bad, code=2)
        assert message in result.stderr, result.stderr
    run("rm", repo, 2, "-o", "read_only=False")  # refused as read-only before
    assert casstore.list_steps(repo) == [0, 1]
    run("rm", repo, 1, "-o", "read_only=yes", code=12)
    with pytest.raises(ValueError, match="positive and finite"):
        casstore.open_store("s3://bucket/x", anon=True, request_timeout_s=float("inf"))


def test_ls_persistent_names_a_step_damaged_on_both_tiers_once(tmp_path):
    local, persist = str(tmp_path / "local"), str(tmp_path / "persist")
    for step in range(3):
        casstore.save(local, step, {"w": np.arange(20000, dtype=np.float32) + step})
    casstore.copy(local, persist)
    truncate_manifest(local, 2)
    truncate_manifest(persist, 2)
    listed = run_json("ls", local, "--persistent", persist, code=1)
    assert [(p["run"], p["step"]) for p in listed["problems"]] == [("default", 2)]
    assert [r["step"] for r in listed["steps"]] == [0, 1]


def test_a_damaged_or_missing_config_object_is_reported_and_repaired(delta_repo, tmp_path):
    """The config object holds no per-step data, but every reader refuses a repository whose
    config is damaged: verify reports it (and still checks every step), repair puts the good
    copy's in its place, and a restore names the way out."""
    good = tmp_path / "good"
    run("copy", delta_repo, good)
    config = pathlib.Path(delta_repo) / "config"
    config.write_bytes(b"\x00junk")
    with pytest.raises(casstore.ManifestError, match="casstore repair GOOD_COPY URL"):
        casstore.restore(delta_repo, 2)
    report = run_json("verify", delta_repo, code=1)
    assert [p["kind"] for p in report["problems"]] == ["config"]
    assert len(report["steps_checked"]) == 6
    assert report["chunks_ok"] == report["chunks_checked"] > 0
    one_run = run_json("verify", delta_repo, "--run", "default", code=1)
    assert ([p["kind"] for p in one_run["problems"]], one_run["steps_checked"]) == (
        ["config"], report["steps_checked"])
    missing = run_json("verify", delta_repo, "9", code=1)  # both said, not a usage error
    assert [(p["kind"], p["step"]) for p in missing["problems"]] == [("config", None),
                                                                     ("not found", 9)]
    typo = run_json("verify", delta_repo, "--run", "defualt", code=1)  # both said here too
    assert [(p["kind"], p["run"]) for p in typo["problems"]] == [("config", None),
                                                                 ("not found", "defualt")]
    assert "run has no steps (runs: 'default')" in typo["problems"][1]["message"]
    plan = run_json("repair", good, delta_repo, "--dry-run", code=1)
    assert (plan["config_restored"], plan["steps"], plan["unrepairable"]) == (True, [], [])
    assert config.read_bytes() == b"\x00junk"  # a dry run changes nothing
    done = run("repair", good, delta_repo)
    assert "config object from GOOD" in done.stdout
    assert done.stdout.strip().endswith("ok")
    assert config.read_bytes() == (good / "config").read_bytes()
    assert casstore.restore(delta_repo, 2)["w"].tobytes() == trained(2).tobytes()
    config.unlink()  # missing where steps exist: the same problem
    missing = casstore.verify(delta_repo)
    assert [(p.kind, "missing" in p.message) for p in missing.problems] == [("config", True)]
    for reader in (lambda: casstore.restore(delta_repo, 2), lambda: casstore.list_steps(
            delta_repo), lambda: casstore.copy(delta_repo, str(tmp_path / "elsewhere")),
                   lambda: casstore.gc(delta_repo)):  # not taken for an empty repository
        with pytest.raises(casstore.ManifestError, match=r"missing, but steps exist.*repair"):
            reader()
    assert not (tmp_path / "elsewhere").exists()
    one_run = run_json("verify", delta_repo, "--run", "default", "--no-read-data", code=1)
    assert [p["kind"] for p in one_run["problems"]] == ["config"]
    assert casstore.repair(str(good), delta_repo).ok
    (good / "config").write_bytes(b"junk too")  # no good config to take: unrepairable
    config.write_bytes(b"\x00junk")
    info = casstore.repair(str(good), delta_repo)
    assert ([p.kind for p in info.unrepairable], info.config_restored, info.ok) == (
        ["config"], False, False)
    assert config.read_bytes() == b"\x00junk"
    run("verify", tmp_path / "nowhere", code=cli.EXIT_NO_REPOSITORY)  # still no repository


@pytest.mark.parametrize("lock_stalls", [False, True])
def test_ctrl_c_stops_a_copy_to_a_stalled_store_at_once(tmp_path, object_servers, lock_stalls):
    """Ctrl-C stops a copy whose uploads wait on a stalled store: it releases the save lock
    and exits with 130 without waiting for the uploads' deadlines. Where the lock's release
    stalls too, a second Ctrl-C exits at once. Either way the destination has no step (its
    manifest is written last); without the second, no save lock is left either."""
    import signal

    from faultproxy import fault_proxy

    from casstore.store import FsspecStore

    server = object_servers["seaweedfs"]
    src, url = tmp_path / "src", server.url_for("interrupted")
    casstore.save(str(src), 0, {"w": np.arange(100_000.0)}, chunk_size_bytes=65_536)
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(cli.__file__).parents[2])}
    with fault_proxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.endpoint_url,
                   "request_timeout_s": 30.0, "operation_timeout_s": 60.0}
        proxy.set("stall", only=b"/chunks/")  # the uploads, in the copy's worker threads
        proc = subprocess.Popen(
            [sys.executable, "-m", "casstore", "copy", str(src), url,
             *(a for k, v in options.items() for a in ("-o", f"{k}={json.dumps(v)}"))],
            stderr=subprocess.PIPE, text=True, env=env)
        try:
            deadline = time.monotonic() + 60
            while proxy.faults["stall"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)
            if lock_stalls:
                proxy.set("stall")  # every request from now on: the lock's release too
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            assert "press Ctrl-C again to quit now" in proc.stderr.readline()
            if lock_stalls:
                time.sleep(1.0)
                assert proc.poll() is None  # releasing the lock
                t0 = time.monotonic()
                proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == 130
            assert time.monotonic() - t0 < 10
            assert "aborted" in proc.stderr.read()
        finally:
            proc.kill()
            proc.wait()
    direct = FsspecStore.from_url(url, **server.storage_options)
    assert casstore.list_steps(direct) == []
    locks = [o.key for o in direct.list("locks/") if "save-" in o.key]
    assert len(locks) == lock_stalls


def test_repair_leaves_alone_what_the_good_copy_holds_damaged_too(delta_repo, tmp_path):
    """A chunk the damaged copy lacks and the good copy holds with one byte changed: repair
    reads and checks it before changing anything, and leaves every step that needs it as it
    was (manifests kept, the problems reported unrepairable, a dry run saying the same); once
    the good copy is mended, the same repair fixes everything."""
    good = tmp_path / "good"
    casstore.copy(delta_repo, str(good))
    w = {s: next(leaf for leaf in casstore.read_manifest(delta_repo, s).leaves
                 if leaf.path == "w") for s in (0, 5)}
    lost, fixable = w[0].chunks[0], w[5].chunks[1]  # the base every step needs; a delta of 5
    assert fixable.base is not None
    for ref in (lost, fixable):
        (pathlib.Path(delta_repo) / ref.key).unlink()
    bad = good / lost.key
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    manifests = {s: (pathlib.Path(delta_repo) / manifest_key("default", s)).read_bytes()
                 for s in range(6)}
    for dry_run in (True, False):
        info = casstore.repair(str(good), delta_repo, dry_run=dry_run)
        assert info.steps == ()
        assert {(p.kind, p.chunk_id) for p in info.unrepairable} == {
            ("missing", lost.id), ("missing", fixable.id)}
        assert set(info.why) == {("default", s) for s in range(6)}
        # step 0 needs the base; steps 1-5 also a delta on it, which GOOD cannot check either
        assert info.why[("default", 0)] == (
            "1 object(s) it needs are missing or corrupt in GOOD too")
        assert {info.why[("default", s)] for s in range(1, 6)} == {
            "2 object(s) it needs are missing or corrupt in GOOD too"}
        assert not info.ok
    assert {s: (pathlib.Path(delta_repo) / manifest_key("default", s)).read_bytes()
            for s in range(6)} == manifests  # nothing deleted
    assert not (pathlib.Path(delta_repo) / lost.key).exists()  # nothing damaged copied
    bad.write_bytes(bytes(data[:-1] + bytes([data[-1] ^ 0xFF])))  # the good copy mended
    info = casstore.repair(str(good), delta_repo)
    assert info.ok
    assert casstore.restore(delta_repo, 5)["w"].tobytes() == trained(5).tobytes()


def flip_last_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_repair_mends_what_it_can_and_deletes_no_step(tmp_path):
    """Run ``a``'s step has a truncated manifest and lost a chunk that the good copy lost too;
    run ``b``'s step has a corrupt chunk the good copy holds intact. ``b`` is mended; ``a`` is
    reported unrepairable and left as it was (its manifest kept, nothing of it deleted)."""
    good, damaged = tmp_path / "good", tmp_path / "damaged"
    rng = np.random.default_rng(0)
    trees = {name: {"x": rng.standard_normal((4000, 16)).astype(np.float32)} for name in "ab"}
    for name, state in trees.items():
        casstore.save(str(good), 0, state, run=name, chunk_size_bytes=64_000)
    casstore.copy(str(good), str(damaged))
    lost = casstore.read_manifest(str(good), 0, run="a").leaves[0].chunks[1].key
    for copy in (good, damaged):
        (copy / lost).unlink()
    truncate_manifest(str(damaged), 0, run="a")
    a_manifest = (damaged / manifest_key("a", 0)).read_bytes()
    corrupt = casstore.read_manifest(str(good), 0, run="b").leaves[0].chunks[0].key
    flip_last_byte(damaged / corrupt)
    for dry_run in (True, False):
        info = casstore.repair(str(good), str(damaged), dry_run=dry_run)
        assert info.steps == (("b", 0),)
        assert info.deleted_objects == (corrupt,)
        assert [(p.kind, p.run, p.step) for p in info.unrepairable] == [("manifest", "a", 0)]
        assert info.why == {("a", 0): "1 object(s) it needs are missing or corrupt in GOOD too"}
        assert not info.ok
    assert (damaged / manifest_key("a", 0)).read_bytes() == a_manifest
    assert casstore.restore(str(damaged), 0, run="b")["x"].tobytes() == trees["b"][
        "x"].tobytes()
    assert [p.kind for p in casstore.verify(str(damaged)).problems] == ["manifest"]


@pytest.mark.parametrize("meanwhile", ["deleted", "saved again"])
def test_repair_leaves_a_step_deleted_or_saved_again_while_it_runs(tmp_path, monkeypatch,
                                                                   caplog, meanwhile):
    """Repair read step 1's damaged manifest, then put GOOD's over whatever was there when it
    wrote, under no lock: a step deleted meanwhile (its chunks perhaps collected) came back,
    and a training job's new step 1, saved after `casstore rm`, was replaced by the old one
    and verified clean."""
    good, damaged = str(tmp_path / "good"), str(tmp_path / "damaged")
    rng = np.random.default_rng(0)
    for step in range(2):
        casstore.save(good, step, {"w": rng.standard_normal(5000).astype(np.float32)})
    casstore.copy(good, damaged)
    truncate_manifest(damaged, 1)
    new = np.full(5000, 42.0, np.float32)
    write = _repair._Plan.write

    def after_the_trainer(plan):
        casstore.delete(damaged, 1)
        if meanwhile == "saved again":
            casstore.save(damaged, 1, {"w": new})
        return write(plan)

    monkeypatch.setattr(_repair._Plan, "write", after_the_trainer)
    info = casstore.repair(good, damaged)
    assert info.steps == ()
    assert "repair leaves run 'default' step 1 as it is" in caplog.text
    if meanwhile == "deleted":
        assert casstore.list_steps(damaged) == [0]
    else:
        np.testing.assert_array_equal(casstore.restore(damaged, 1)["w"], new)
    assert casstore.verify(damaged).ok


def test_repair_refuses_a_good_copy_whose_step_is_another_step(tmp_path):
    """The good copy's step 0 is another checkpoint (another history of the run): the damaged
    step is unrepairable and stays as it was, its intact leaf still restoring its values."""
    good, damaged = tmp_path / "good", tmp_path / "damaged"
    rng = np.random.default_rng(1)
    mine, theirs = ({"w": rng.standard_normal((4000, 16)).astype(np.float32),
                     "b": rng.standard_normal((3000, 16)).astype(np.float32)} for _ in "12")
    casstore.save(str(damaged), 0, mine, chunk_size_bytes=64_000)
    casstore.save(str(good), 0, theirs, chunk_size_bytes=64_000)
    w = next(leaf for leaf in casstore.read_manifest(str(damaged), 0).leaves if leaf.path == "w")
    (damaged / w.chunks[0].key).unlink()
    info = casstore.repair(str(good), str(damaged))
    assert (info.steps, [p.kind for p in info.unrepairable], info.ok) == ((), ["missing"], False)
    assert info.why == {("default", 0): "GOOD holds another step of this number (its manifest "
                                        "differs: another history of the run)"}
    assert casstore.restore(str(damaged), 0, paths=["b"])["b"].tobytes() == mine["b"].tobytes()
    assert not (damaged / w.chunks[0].key).exists()  # none of the other step's objects
    # A damaged manifest that is not the good one cut short: the other step is not put there
    casstore.save(str(damaged), 1, mine, chunk_size_bytes=64_000)
    casstore.save(str(good), 1, theirs, chunk_size_bytes=64_000)
    truncate_manifest(str(damaged), 1, keep=100)  # before its created time: alike, refused
    before = (damaged / manifest_key("default", 1)).read_bytes()
    info = casstore.repair(str(good), str(damaged))
    assert ("default", 1) not in info.steps
    assert ("manifest", 1) in [(p.kind, p.step) for p in info.unrepairable]
    assert (damaged / manifest_key("default", 1)).read_bytes() == before


def test_repair_tells_a_flipped_byte_from_another_save_of_the_same_tree(tmp_path):
    """Two saves of one tree (one leaf of 40 changed) give manifests of one length that differ
    in under 1 byte in 100: a bit flipped in one, repair took the other save's manifest for
    it and the step restored the other save's values, with ok=True (exploratory session's
    repro). A copy damaged in its created time or its digest is still mended."""
    good, damaged = tmp_path / "good", tmp_path / "damaged"
    trees = [{f"layer{i}": np.full(16, float(i + (i == 0) * k), np.float32) for i in range(40)}
             for k in (1, 2)]
    casstore.save(damaged, 5, trees[0])
    casstore.save(good, 5, trees[1])
    key = damaged / manifest_key("default", 5)
    data = bytearray(key.read_bytes())
    other = (good / manifest_key("default", 5)).read_bytes()
    assert len(data) == len(other)
    assert sum(a != b for a, b in zip(data, other)) <= len(data) // 100
    data[len(data) // 2] ^= 1
    key.write_bytes(bytes(data))
    info = casstore.repair(good, damaged)
    assert (info.steps, info.ok) == ((), False)
    assert key.read_bytes() == bytes(data)  # left as it was
    # a true copy damaged where two saves differ: its created time, or its digest
    for at in (other.index(b"\xa7created\xcb") + 12, len(other) - 3):
        copy = bytearray(other)
        copy[at] ^= 1
        key.write_bytes(bytes(copy))
        info = casstore.repair(good, damaged)
        assert (info.steps, info.ok) == ((("default", 5),), True), at
        assert key.read_bytes() == other


def test_repair_of_a_damaged_manifest_checks_the_objects_of_its_step(delta_repo, tmp_path):
    """verify cannot read the objects of a step whose manifest is damaged; repair reads them
    after taking the good copy's manifest, and replaces one that is corrupt."""
    good = tmp_path / "good"
    casstore.copy(delta_repo, str(good))
    only_4 = (casstore.read_manifest(delta_repo, 4).chunk_ids()
              - casstore.read_manifest(delta_repo, 3).chunk_ids()
              - casstore.read_manifest(delta_repo, 5).chunk_ids())
    ref = next(r for leaf in casstore.read_manifest(delta_repo, 4).leaves for r in leaf.chunks
               if r.id in only_4)
    flip_last_byte(pathlib.Path(delta_repo) / ref.key)
    truncate_manifest(delta_repo, 4)
    assert [p.kind for p in casstore.verify(delta_repo).problems] == ["manifest"]
    info = casstore.repair(str(good), delta_repo)
    assert (info.steps, info.deleted_objects, info.unrepairable) == (
        (("default", 4),), (ref.key,), ())
    assert info.ok
    assert casstore.restore(delta_repo, 4)["w"].tobytes() == trained(4).tobytes()


@pytest.mark.parametrize("base_damage", ["missing", "corrupt"])
def test_one_repair_mends_a_damaged_delta_on_a_damaged_base(delta_repo, tmp_path, base_damage):
    """verify cannot check a delta whose base is missing or corrupt (it counts it
    "unchecked"): repair sends such deltas from the good copy with their base, in one pass."""
    good = tmp_path / "good"
    casstore.copy(delta_repo, str(good))
    ref = next(r for leaf in casstore.read_manifest(delta_repo, 2).leaves for r in leaf.chunks
               if r.base is not None)
    base = pathlib.Path(delta_repo) / chunk_key(ref.base)
    if base_damage == "missing":
        base.unlink()
    else:
        flip_last_byte(base)
    flip_last_byte(pathlib.Path(delta_repo) / ref.key)
    info = casstore.repair(str(good), delta_repo)
    assert (info.unrepairable, info.ok) == ((), True)
    assert casstore.verify(delta_repo).ok
    for step in range(6):
        assert casstore.restore(delta_repo, step)["w"].tobytes() == trained(step).tobytes()


def test_repair_replaces_a_chunk_whose_header_reads_as_a_newer_format(delta_repo, tmp_path):
    """A changed version byte reads as a newer format ("unsupported"); the good copy's object
    of the same chunk id checks out, so it is written in its place."""
    good = tmp_path / "good"
    casstore.copy(delta_repo, str(good))
    ref = next(leaf for leaf in casstore.read_manifest(delta_repo, 0).leaves
               if leaf.path == "w").chunks[0]
    victim = pathlib.Path(delta_repo) / ref.key
    data = bytearray(victim.read_bytes())
    data[4] = 9  # the header's version (format.md §3.2)
    victim.write_bytes(bytes(data))
    assert [p.kind for p in casstore.verify(delta_repo).problems] == ["unsupported"]
    info = casstore.repair(str(good), delta_repo)
    assert (info.deleted_objects, info.unrepairable, info.ok) == ((ref.key,), (), True)
    assert victim.read_bytes() == (good / ref.key).read_bytes()


def test_copy_refusing_a_step_the_destination_holds_otherwise_names_steps(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    for step in (1, 2):
        casstore.save(src, step, {"a": np.full(3, step)})
    casstore.save(dst, 1, {"a": np.zeros(3)})
    refused = run("copy", src, dst, code=2)
    assert "another step of this number" in refused.stderr
    assert refused.stderr.rstrip().endswith("to copy the other steps, name them with --steps")
    run("copy", src, dst, "--steps", "2")
    assert casstore.list_steps(dst) == [1, 2]


def test_repair_reports_a_manifest_over_the_size_limit_and_mends_the_other_steps(tmp_path):
    """A manifest past the size limit (a sparse file: never read) in GOOD, or in the damaged
    copy, leaves its step unrepairable with the reason; the other steps are still mended."""
    from casstore._manifest import MAX_MANIFEST_BYTES

    for where in ("good", "damaged"):
        damaged, good = tmp_path / where / "damaged", tmp_path / where / "good"
        for step in range(3):
            w = np.arange(50_000, dtype=np.float32) * (step + 1)
            casstore.save(str(damaged), step, {"w": w}, delta=False)
        casstore.copy(str(damaged), str(good))
        lost = [casstore.read_manifest(str(damaged), s).leaves[0].chunks[0].key for s in (0, 2)]
        for key in lost:
            (damaged / key).unlink()
        os.truncate((good if where == "good" else damaged) / manifest_key("default", 2),
                    MAX_MANIFEST_BYTES + 1)
        info = casstore.repair(str(good), str(damaged))
        assert info.steps == (("default", 0),), where
        assert (damaged / lost[0]).exists()
        assert list(info.why) == [("default", 2)]
        assert "exceeds the size limit" in info.why["default", 2]


def test_repair_says_a_manifest_too_damaged_to_compare_is_not_called_another_history(tmp_path):
    damaged, good = tmp_path / "damaged", tmp_path / "good"
    for step in range(2):
        casstore.save(str(damaged), step, {"w": np.full(1000, step, np.float32)})
    casstore.copy(str(damaged), str(good))
    (damaged / manifest_key("default", 1)).write_bytes(b"")
    info = casstore.repair(str(good), str(damaged))
    assert info.why == {("default", 1): "its manifest here is too damaged to tell whether "
                                        "GOOD's step is the same (docs/recovery.md: replace it "
                                        "by hand)"}


def test_a_repair_that_can_fix_nothing_says_it_copied_nothing_back(tmp_path):
    """Step 1's manifest gives a chunk shared with step 0 another raw length (one problem both
    steps need); GOOD lacks step 0, so nothing is fixable: nothing is written, and the report
    says so (it said step 1 was copied back)."""
    damaged, good = tmp_path / "damaged", tmp_path / "good"
    shared = np.ones(100_000, np.float32)
    for step in (0, 1):
        casstore.save(str(damaged), step, {"b": shared, "s": np.arange(100_000) + step})
    casstore.copy(str(damaged), str(good))
    casstore.delete(str(good), 0)
    key = damaged / manifest_key("default", 1)
    doc = msgpack.unpackb(key.read_bytes())
    first = {r.id for leaf in casstore.read_manifest(str(damaged), 0).leaves
             for r in leaf.chunks}
    ref = next(c for leaf in doc["leaves"] for c in leaf["chunks"] if c["id"] in first)
    ref["raw_bytes"] += 4
    key.write_bytes(before := repack(doc))
    info = casstore.repair(str(good), str(damaged))
    assert (info.steps, info.deleted_objects, info.ok) == ((), (), False)
    assert "copied back 0 step(s)" in run("repair", good, damaged, code=1).stdout
    assert key.read_bytes() == before
