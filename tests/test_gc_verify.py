"""Garbage collection (safe against concurrent saves) and verify."""

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from unittest import mock

import numpy as np
import pytest

import casstore
from casstore._layout import chunk_key, manifest_key
from casstore.store import LocalStore, MemoryStore

from conftest import object_store, repack


def age_all(store: LocalStore, seconds: float) -> None:
    """Makes every object look ``seconds`` older (for the grace period)."""
    for info in store.list():
        path = store._path(info.key)
        os.utime(path, (info.mtime - seconds, info.mtime - seconds))


def test_gc_deletes_only_unreferenced_chunks_older_than_the_grace(tmp_path):
    store = LocalStore(tmp_path / "r")
    # whole chunks (no deltas): where the store takes raw chunks, zeros would be a delta of ones
    casstore.save(store, 1, {"a": np.arange(10_000), "b": np.ones(10_000)}, delta=False)
    casstore.save(store, 2, {"a": np.arange(10_000), "b": np.zeros(10_000)}, delta=False)
    casstore.delete(store, 1)  # b=ones is now unreferenced
    young = casstore.gc(store, grace_period_s=3600)
    assert young.deleted_chunks == 0
    assert young.young_unreferenced_chunks == 1
    age_all(store, 7200)
    dry = casstore.gc(store, grace_period_s=3600, dry_run=True)
    assert dry.deleted_chunks == 1
    assert dry.deleted_bytes > 0
    assert dry.dry_run
    assert len(list(store.list("chunks/"))) == 3
    info = casstore.gc(store, grace_period_s=3600)
    assert (info.deleted_chunks, info.deleted_bytes) == (1, dry.deleted_bytes)
    assert info.manifests == 1
    assert info.referenced_chunks == 2
    assert info.missing_chunks == 0
    assert len(list(store.list("chunks/"))) == 2
    np.testing.assert_array_equal(casstore.restore(store, 2)["b"], np.zeros(10_000))
    assert casstore.gc(store, grace_period_s=0).deleted_chunks == 0  # re-run is a no-op


def test_gc_keeps_the_chunks_of_a_run_and_of_chunks_moved_elsewhere_and_linked_back(tmp_path):
    """A run's directory and a chunk directory moved to another disk and symlinked back: every
    reader goes through the links, so GC (and the listings of ls and verify) must too; a
    link to an ancestor is walked once, not forever."""
    root = tmp_path / "repo"
    rng = np.random.default_rng(0)
    trees = {run: {"w": rng.standard_normal(5000).astype(np.float32)} for run in ("a", "b")}
    for run, tree in trees.items():
        casstore.save(root, 0, tree, run=run)
    moved = tmp_path / "other-disk"
    moved.mkdir()
    os.replace(root / "runs" / "b", moved / "b")
    os.symlink(moved / "b", root / "runs" / "b")
    some_chunks = next(p for p in sorted((root / "chunks").iterdir()) if p.is_dir())
    os.replace(some_chunks, moved / some_chunks.name)
    os.symlink(moved / some_chunks.name, some_chunks)
    os.symlink(root / "runs", root / "runs" / "b" / "loop")  # an ancestor: walked once
    assert casstore.list_runs(root) == ["a", "b"]
    info = casstore.gc(root, grace_period_s=0)
    assert (info.deleted_chunks, info.manifests, info.referenced_chunks) == (0, 2, 2)
    assert casstore.verify(root).ok
    for run, tree in trees.items():
        assert casstore.restore(root, 0, run=run)["w"].tobytes() == tree["w"].tobytes()


def _two_runs(root) -> dict:
    rng = np.random.default_rng(0)
    trees = {run: {"w": rng.standard_normal(5000).astype(np.float32)} for run in ("a", "b")}
    for run, tree in trees.items():
        casstore.save(root, 0, tree, run=run)
    return trees


def _files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("moved", ["runs", "runs/b"])
def test_gc_refuses_while_a_moved_directory_is_a_link_to_nothing(tmp_path, moved):
    """Its disk not mounted: walked past as a file, its runs looked deleted and GC deleted
    every chunk only they referenced (exploratory session's repro)."""
    root, disk = tmp_path / "repo", tmp_path / "other-disk"
    trees = _two_runs(root)
    disk.mkdir()
    os.replace(root / moved, disk / "moved")
    os.symlink(disk / "moved", root / moved)
    assert casstore.list_runs(root) == ["a", "b"]
    os.replace(disk, tmp_path / "unmounted")
    chunks = _files(root / "chunks")
    for call in (lambda: casstore.gc(root, grace_period_s=0), lambda: casstore.verify(root)):
        with pytest.raises(OSError, match="a link to nothing where the repository has a "
                                          "directory") as info:
            call()
        assert info.value.filename == str(root / moved)
    assert _files(root / "chunks") == chunks
    os.replace(tmp_path / "unmounted", disk)  # mounted again: every step restores
    for run, tree in trees.items():
        assert casstore.restore(root, 0, run=run)["w"].tobytes() == tree["w"].tobytes()


@pytest.mark.parametrize("alias", ["chunk directory", "run renamed and linked back"])
def test_gc_refuses_a_directory_reached_at_two_paths(tmp_path, alias):
    """A link to a sibling chunk directory listed its chunks under the link's name, referenced
    by no manifest, and GC deleted them through it; walking real directories first (the next
    fix) then took a run's directory renamed and linked back under its old name for an alias
    of the new one, whose name is no run, and GC deleted the run's chunks (exploratory
    session's repro, then the review's). One directory at two paths is refused."""
    root = tmp_path / "repo"
    trees = _two_runs(root)
    if alias == "chunk directory":
        os.symlink(sorted((root / "chunks").iterdir())[-1].name, root / "chunks" / "00")
    else:
        os.replace(root / "runs" / "b", root / "runs" / "b old")
        os.symlink("b old", root / "runs" / "b")
    chunks = _files(root / "chunks")
    for call in (lambda: casstore.gc(root, grace_period_s=0), lambda: casstore.verify(root)):
        with pytest.raises(OSError, match="one directory at two paths"):
            call()
    assert _files(root / "chunks") == chunks
    for run, tree in trees.items():
        assert casstore.restore(root, 0, run=run)["w"].tobytes() == tree["w"].tobytes()


def test_gc_keeps_the_chunks_of_a_run_linked_to_a_directory_elsewhere_in_the_repository(
        tmp_path):
    """A link to a directory inside the repository is no alias when no listing walks that
    directory otherwise: passing over every such link (an earlier fix for aliases) hid the
    run from GC, which deleted its chunks (exploratory session's repro)."""
    root = tmp_path / "repo"
    trees = _two_runs(root)
    (root / "archive").mkdir()
    os.replace(root / "runs" / "b", root / "archive" / "b")
    os.symlink(root / "archive" / "b", root / "runs" / "b")
    info = casstore.gc(root, grace_period_s=0)
    assert (info.deleted_chunks, info.manifests, info.referenced_chunks) == (0, 2, 2)
    assert casstore.verify(root).ok
    for run, tree in trees.items():
        assert casstore.restore(root, 0, run=run)["w"].tobytes() == tree["w"].tobytes()


_GC_AS_NOBODY = """
import sys, casstore
try:
    casstore.gc(sys.argv[1], grace_period_s=0)
except PermissionError as e:
    print("refused", e.filename)
"""


def test_gc_refuses_when_a_directory_cannot_be_listed(tmp_path):
    """os.walk skipped a directory it could not list (EACCES here; a bad block's EIO alike): the
    run looked deleted, and GC deleted its chunks. As root, run as ``nobody`` (root reads every
    directory), in a directory of its own."""
    base = pathlib.Path(tempfile.mkdtemp(prefix="casstore-unlistable-"))
    try:
        root = base / "repo"
        trees = _two_runs(root)
        chunks = _files(root / "chunks")
        steps = root / "runs" / "b" / "steps"
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "nobody:nogroup", str(base)], check=True)
            steps.chmod(0)
            out = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup",
                                  "--clear-groups", sys.executable, "-c", _GC_AS_NOBODY,
                                  str(root)], capture_output=True, text=True, timeout=120)
            assert out.stdout.strip() == f"refused {steps}", out.stderr[-3000:]
        else:
            steps.chmod(0)
            with pytest.raises(PermissionError) as info:
                casstore.gc(root, grace_period_s=0)
            assert info.value.filename == str(steps)
        steps.chmod(0o755)
        assert _files(root / "chunks") == chunks
        for run, tree in trees.items():
            assert casstore.restore(root, 0, run=run)["w"].tobytes() == tree["w"].tobytes()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_gc_at_a_disks_mount_point_passes_over_lost_and_found(tmp_path):
    """A repository at a disk's mount point holds lost+found, which only root reads: GC
    swept the whole root for temporary files and raised PermissionError there, and a manager
    with gc_after_retention failed its saves (review). Its sweep reads the repository's
    directories only. As root, run as ``nobody``."""
    base = pathlib.Path(tempfile.mkdtemp(prefix="casstore-mountpoint-"))
    try:
        _two_runs(base)
        (base / "lost+found").mkdir(mode=0o700)
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "nobody:nogroup", str(base)], check=True)
            os.chown(base / "lost+found", 0, 0)
            out = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup",
                                  "--clear-groups", sys.executable, "-c",
                                  "import sys, casstore; print(casstore.gc(sys.argv[1], "
                                  "grace_period_s=0).manifests)", str(base)],
                                 capture_output=True, text=True, timeout=120)
            assert out.stdout.strip() == "2", out.stderr[-3000:]
        else:
            (base / "lost+found").chmod(0)
            assert casstore.gc(base, grace_period_s=0).manifests == 2
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_gc_counts_every_run_and_refuses_on_a_bad_manifest(tmp_path):
    store = MemoryStore()
    casstore.save(store, 0, {"x": np.arange(5000)}, run="a")
    casstore.save(store, 0, {"x": np.arange(5000) + 1}, run="b")
    assert casstore.gc(store, grace_period_s=0).deleted_chunks == 0
    store.put("runs/b/steps/0000000000000001.manifest", b"garbage")
    with pytest.raises(casstore.ManifestError,
                       match=r"gc refused: 1 manifest\(s\) unreadable \(b@1\)"):
        casstore.gc(store, grace_period_s=0)
    assert len(list(store.list("chunks/"))) == 2


def test_gc_waits_for_a_save_in_flight_and_saves_wait_for_gc(tmp_path):
    store = LocalStore(tmp_path / "r")
    casstore.save(store, 0, {"x": np.arange(1000)})
    gate = threading.Event()
    real_put = store._put

    def slow_put(key, data, *, exclusive):
        if key.startswith("chunks/"):
            gate.wait(10)
        real_put(key, data, exclusive=exclusive)

    store._put = slow_put
    saver = threading.Thread(target=casstore.save, args=(store, 1, {"y": np.arange(3000)}))
    saver.start()
    time.sleep(0.3)
    with pytest.raises(casstore.CasstoreError, match="saves kept running"):
        casstore.gc(store, grace_period_s=0, lock_timeout_s=0.5)
    gate.set()
    saver.join()
    assert casstore.gc(store, grace_period_s=0).deleted_chunks == 0
    assert casstore.list_steps(store) == [0, 1]


@pytest.mark.parametrize("backend", ["local", "memory", "seaweedfs"])
def test_stress_saves_while_gc_runs_in_a_loop(tmp_path, backend, request):
    """Threads save new steps (reusing old, deleted content) while GC loops with no grace."""
    if backend == "seaweedfs":
        store = object_store(request.getfixturevalue("object_servers")["seaweedfs"])
    else:
        store = LocalStore(tmp_path / "r") if backend == "local" else MemoryStore()
    stop = threading.Event()
    errors: list[BaseException] = []
    base = np.random.default_rng(0).normal(size=(256, 64)).astype(np.float32)
    deltas = []

    def trained(step: int) -> np.ndarray:  # changes in its low bits: stored as deltas
        return base[:64] * np.float32(1 + 1e-4 * step)

    def saver(worker: int) -> None:
        try:
            for i in range(12):
                step = worker * 100 + i
                tree = {"base": base, "head": np.full(2000, step, np.float32),
                        "old": np.full(2000, i % 3, np.float32),  # content that comes and goes
                        "trained": trained(step)}
                info = casstore.save(store, step, tree, run=f"w{worker}", chunk_size_bytes=8192)
                deltas.append(info.delta_chunks)
                if i % 2:
                    casstore.delete(store, step, run=f"w{worker}")
                time.sleep(0.05)  # a training step between saves
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    sweeps: list[casstore.GcInfo] = []

    def collector() -> None:
        while not stop.is_set():
            try:
                sweeps.append(casstore.gc(store, grace_period_s=0, lock_timeout_s=1))
            except casstore.CasstoreError as e:  # busy: saves kept running; try again
                if "saves kept running" not in str(e):
                    errors.append(e)
            except BaseException as e:
                errors.append(e)

    threads = [threading.Thread(target=saver, args=(w,)) for w in range(3)]
    gc_thread = threading.Thread(target=collector)
    gc_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    gc_thread.join()
    assert not errors, errors
    assert len(sweeps) >= 3, sweeps
    assert sum(s.deleted_chunks for s in sweeps) > 0, sweeps
    report = casstore.verify(store)
    assert report.ok, report.problems
    for worker in range(3):
        steps = casstore.list_steps(store, run=f"w{worker}")
        assert len(steps) == 6
        for step in steps:
            restored = casstore.restore(store, step, run=f"w{worker}")
            np.testing.assert_array_equal(restored["base"], base)
            assert restored["trained"].tobytes() == trained(step).tobytes()
            assert restored["head"][0] == step
            assert restored["old"][0] == (step % 100) % 3
    assert sum(deltas) >= 3 * 10, deltas  # GC ran against delta chunks and their bases


def test_verify_finds_a_deleted_chunk_and_a_flipped_byte(tmp_path):
    store = LocalStore(tmp_path / "r")
    casstore.save(store, 1, {"p": {"w": np.arange(50_000.0)}, "q": np.ones(30_000)}, delta=False)
    casstore.save(store, 2, {"p": {"w": np.arange(50_000.0)}, "q": np.zeros(30_000)}, delta=False)
    assert casstore.verify(store).ok
    manifest = casstore.read_manifest(store, 1)
    w_id = manifest.leaves[0].chunks[0].id
    q_id = manifest.leaves[1].chunks[0].id
    store.delete(chunk_key(w_id))
    data = bytearray(store.get(chunk_key(q_id)))
    data[-1] ^= 0xFF
    store.put(chunk_key(q_id), bytes(data))
    report = casstore.verify(store)
    found = [(p.needed_by, p.step, p.key_path, p.chunk_id, p.kind) for p in report.problems]
    # once per object, with every step that needs it; missing is not corrupt
    assert found == [((("default", 1), ("default", 2)), None, "p/w", w_id, "missing"),
                     ((("default", 1),), 1, "q", q_id, "corrupt")]
    assert report.problems[0].message == "chunk missing"
    assert "needed by default@1, default@2" in str(report.problems[0])
    assert report.problems[1].message.startswith("chunk corrupt:")
    assert (report.chunks_missing, report.chunks_corrupt, report.chunks_unchecked) == (1, 1, 0)
    assert report.chunks_checked == report.chunks_ok + 2
    assert not casstore.verify(store, 2).ok
    assert casstore.verify(store, 2, read_data=False)
    only_existence = casstore.verify(store, read_data=False)
    assert [p.kind for p in only_existence.problems] == ["missing"]
    assert w_id in str(only_existence.problems[0])
    assert only_existence.chunks_ok == only_existence.chunks_checked - 1


def test_gc_counts_add_up_with_a_missing_chunk_and_a_damaged_manifest(tmp_path):
    store = LocalStore(tmp_path / "r")
    for step in range(3):
        casstore.save(store, step, {"a": np.arange(40_000) + step, "b": np.ones(40_000)},
                      delta=False)
    casstore.delete(store, 0)
    gone = casstore.read_manifest(store, 1).leaves[0].chunks[0].id
    store.delete(chunk_key(gone))
    info = casstore.gc(store, dry_run=True, grace_period_s=0)
    assert info.missing_chunks == 1
    assert info.deleted_chunks == 1
    assert info.chunks == len(list(store.list("chunks/"))) + len(list(store.list("deltas/")))
    assert info.chunks == (info.referenced_chunks + info.deleted_chunks
                           + info.young_unreferenced_chunks)
    assert info.referenced_chunks <= info.chunks
    store.put(manifest_key("default", 2), store.get(manifest_key("default", 2))[:100])
    dry = casstore.gc(store, dry_run=True, grace_period_s=0)
    assert (dry.damaged_manifests, dry.manifests) == (1, 1)
    assert dry.chunks == dry.referenced_chunks + dry.deleted_chunks + dry.young_unreferenced_chunks
    with pytest.raises(casstore.ManifestError, match=r"gc refused.*default@2"):
        casstore.gc(store, grace_period_s=0)
    assert casstore.gc(store, dry_run=True, grace_period_s=0) == dataclasses.replace(
        dry, seconds=mock.ANY)  # nothing was deleted


def test_verify_of_a_run_without_steps_is_a_not_found_problem_naming_the_runs(tmp_path):
    casstore.save(tmp_path / "r", 1, {"w": np.arange(4.0)})
    casstore.save(tmp_path / "r", 1, {"w": np.arange(4.0)}, run="eval")
    report = casstore.verify(tmp_path / "r", run="evl")
    assert not report.ok
    assert [(p.kind, p.run, p.step) for p in report.problems] == [("not found", "evl", None)]
    assert "run has no steps (runs: 'default', 'eval')" in str(report.problems[0])
    assert casstore.verify(tmp_path / "r", run="eval").ok


def test_verify_reports_a_garbage_manifest(tmp_path):
    store = MemoryStore()
    casstore.save(store, 1, {"x": np.arange(10)})
    store.put("runs/default/steps/0000000000000002.manifest", b"\xc1junk")
    report = casstore.verify(store)
    assert [(p.step, p.message.split(":")[0]) for p in report.problems] == [
        (2, "manifest unreadable")]


def test_verify_reports_progress_up_to_the_bytes_it_reads(tmp_path):
    store = LocalStore(tmp_path / "r")
    for step in range(3):
        casstore.save(store, step, {"a": np.arange(60_000) * (step + 1), "b": np.ones(9_000)})
    calls = []
    report = casstore.verify(store, progress=lambda done, total: calls.append((done, total)))
    assert len(calls) == report.chunks_checked == report.chunks_ok
    assert calls[-1] == (report.bytes_read, report.bytes_read)
    assert report.bytes_read > 0
    assert [d for d, _ in sorted(calls)] == sorted(d for d, _ in calls)


def test_verify_reports_refs_that_disagree_on_an_objects_length():
    """One flipped bit in a manifest (the second ref to a pack: 600 -> 604 raw bytes) still
    validates; verify checked each object with its first ref and said ok, restore refused."""
    import msgpack

    store = MemoryStore()
    casstore.save(store, 0, {"layer": {"b": np.ones(100, np.float32),
                                       "s": np.arange(50, dtype=np.int32)}})
    key = manifest_key("default", 0)
    doc = msgpack.unpackb(store.get(key))
    refs = [leaf["chunks"][0] for leaf in doc["leaves"]]
    assert refs[0]["id"] == refs[1]["id"]  # one pack
    refs[1]["raw_bytes"] += 4
    store.delete(key)
    store.put(key, repack(doc))
    for read_data in (True, False):
        report = casstore.verify(store, read_data=read_data)
        assert [(p.kind, p.chunk_id) for p in report.problems] == [("manifest", refs[0]["id"])]
        assert report.manifests_damaged == 1  # was 0: a problem counted nowhere
    with pytest.raises(casstore.CorruptChunkError, match="disagree on the chunk's length"):
        casstore.restore(store, 0)
    # across steps, the message says which steps give which length
    casstore.save(store, 1, {"layer": {"b": np.ones(100, np.float32),
                                       "s": np.arange(50, dtype=np.int32)}})
    [problem] = casstore.verify(store).problems
    assert "2 raw lengths (600 bytes: default@0, default@1; 604 bytes: default@0)" in (
        problem.message)


@pytest.mark.parametrize("wrong", [0, 1])
def test_verify_of_one_step_calls_a_wrong_raw_length_a_damaged_manifest(wrong, caplog):
    """A manifest (with a valid digest) gives a whole chunk 4 raw bytes more than it holds.
    ``verify(url, step)`` sees only that step's ref, so no refs disagree: it decoded the chunk
    with the manifest's length and called the healthy object corrupt. Now the object decodes to
    its id with its header's length, so the manifest is the problem; checking every step, the
    disagreement is the one problem whichever step's ref verify reads the object with."""
    import msgpack

    store = MemoryStore()
    for step in (0, 1):
        casstore.save(store, step, {"s": np.arange(100_000, dtype=np.int32)})
    key = manifest_key("default", wrong)
    doc = msgpack.unpackb(store.get(key))
    [ref] = doc["leaves"][0]["chunks"]
    ref["raw_bytes"] += 4
    store.delete(key)
    store.put(key, repack(doc))
    report = casstore.verify(store, wrong)
    assert [(p.kind, p.step) for p in report.problems] == [("manifest", wrong)]
    assert "gives the chunk 400004 raw bytes; the object holds 400000" in (
        report.problems[0].message)
    assert (report.manifests_damaged, report.chunks_corrupt) == (1, 0)
    assert report.chunks_ok == report.chunks_checked == 1
    assert "failed its checks" not in caplog.text  # no read-again warning: nothing was damaged
    assert casstore.verify(store, 1 - wrong).ok
    [problem] = casstore.verify(store).problems
    assert problem.kind == "manifest"
    assert "2 raw lengths" in problem.message
    with pytest.raises(casstore.CorruptChunkError, match="manifest says 400004"):
        casstore.restore(store, wrong)


def test_verify_of_a_live_repository_reports_no_step_committed_during_it(monkeypatch):
    """verify lists the chunks, then reads the manifests: a step committed in between named
    chunks the listing lacked, and was reported missing (exit 1) though whole."""
    from casstore import _verify

    store = MemoryStore()
    casstore.save(store, 0, {"w": np.zeros(4096, np.float32)})
    scan = _verify.scan_manifests

    def commit_then_scan(*args, **kwargs):
        casstore.save(store, 1, {"w": np.ones(4096, np.float32)})  # another process, now
        return scan(*args, **kwargs)

    monkeypatch.setattr(_verify, "scan_manifests", commit_then_scan)
    report = casstore.verify(store, read_data=False)
    assert report.ok, report.problems
    assert sorted(report.steps_checked) == [("default", 0), ("default", 1)]


def test_gc_deletes_the_temporary_files_of_a_killed_local_write(tmp_path):
    """A save killed between writing a chunk's temporary file and renaming it leaves a file
    no listing shows; gc deletes it once past the grace period, and nothing else."""
    url = tmp_path / "repo"
    casstore.save(url, 0, {"w": np.arange(1000.0)})
    chunk = next((url / "chunks").rglob("*"))
    chunk = chunk if chunk.is_file() else next(p for p in chunk.rglob("*") if p.is_file())
    old = chunk.parent / f".{chunk.name}.{'a' * 32}.tmp"
    young = chunk.parent / f".{chunk.name}.{'b' * 32}.tmp"
    old.write_bytes(b"x" * 100)
    young.write_bytes(b"y" * 10)
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert casstore.gc(url, dry_run=True).leftover_bytes == 0
    info = casstore.gc(url)  # grace period: 1 hour
    assert (info.leftover_bytes, old.exists(), young.exists()) == (100, False, True)
    assert casstore.verify(url).ok


def test_gc_with_no_grace_period_spares_a_temporary_file_being_written(tmp_path):
    """grace_period_s=0 frees unreferenced chunks at once, but a temporary file younger than
    LEFTOVER_AGE_S may be another process's write before its rename (a save lock, a chunk):
    deleting it failed that write (CI, test_processes)."""
    url = tmp_path / "repo"
    casstore.save(url, 0, {"w": np.arange(1000.0)})
    (url / "locks").mkdir(exist_ok=True)
    in_flight = url / "locks" / f".save-{'c' * 32}.{'d' * 32}.tmp"
    in_flight.write_bytes(b"lock")
    os.utime(in_flight, (time.time() - 600, time.time() - 600))
    assert casstore.gc(url, grace_period_s=0).leftover_bytes == 0
    assert in_flight.exists()
    os.utime(in_flight, (time.time() - 3700, time.time() - 3700))
    assert casstore.gc(url, grace_period_s=0).leftover_bytes == 4
    assert not in_flight.exists()


_OVERSIZED = r"""
import json, sys
import casstore
root, out = sys.argv[1], {}
try:
    out["verify"] = [[p.kind, p.key_path, p.key, p.message] for p in casstore.verify(root).problems]
    casstore.restore(root, 0)
except casstore.CorruptChunkError as e:
    out["restore"] = [e.key_path, str(e)]
except casstore.ManifestError as e:
    out["restore"] = [None, str(e)]
# VmHWM: this interpreter's own peak (ru_maxrss keeps the forking pytest worker's across exec)
with open("/proc/self/status") as status:
    out["peak"] = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
print(json.dumps(out))
"""


def _oversized(root) -> dict:
    """verify and restore of repository ``root`` in a process of their own: what they report
    and the process's peak RSS."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _OVERSIZED, str(root)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_an_oversized_chunk_object_is_corrupt_and_not_read_whole(tmp_path):
    """A chunk object far larger than any encoding of its chunk (format.md §3.2: a 4 MiB chunk
    in a 3 GB sparse file) is reported corrupt by verify and refused by restore, naming the
    key path, without reading it: the process stays far below the object's size."""
    root = tmp_path / "r"
    x = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    casstore.save(root, 0, {"big": x})
    ref = casstore.read_manifest(root, 0).leaves[0].chunks[0]
    os.truncate(root / ref.key, 3_000_000_000)  # sparse: no disk used
    got = _oversized(root)
    assert [p[:3] for p in got["verify"]] == [["corrupt", "big", ref.key]]
    assert "larger than" in got["verify"][0][3]
    assert got["restore"][0] == "big"
    assert "larger than" in got["restore"][1]
    assert got["peak"] < 1_000_000_000, got["peak"]


def test_an_oversized_config_object_is_refused_and_not_read_whole(tmp_path):
    """A config object of 2 GB (sparse: the real one, then zeros) is refused by every command
    with an error naming its size limit, without reading it whole."""
    root = tmp_path / "r"
    casstore.save(root, 0, {"x": np.arange(100, dtype=np.float32)})
    os.truncate(root / "config", 2_000_000_000)
    got = _oversized(root)
    assert [p[0] for p in got["verify"]] == ["config"]
    assert "larger than" in got["verify"][0][3]
    assert got["restore"][0] is None
    assert "larger than" in got["restore"][1]
    assert got["peak"] < 1_000_000_000, got["peak"]
    store = MemoryStore()
    casstore.save(store, 0, {"x": np.arange(100, dtype=np.float32)})
    store.put("config", store.get("config") + bytes(3 << 20))
    with pytest.raises(casstore.ManifestError, match="larger than"):
        casstore.list_steps(store)


class _Largest(MemoryStore):
    """A MemoryStore recording the most bytes one read returned."""

    largest = 0

    def _note(self, data):
        self.largest = max(self.largest, len(data))
        return data

    def get(self, key):
        return self._note(super().get(key))

    def head(self, key, nbytes):
        return self._note(MemoryStore.get(self, key)[:nbytes])  # as a ranged read


@pytest.mark.parametrize("which", ["chunk", "delta", "base"])
def test_an_oversized_chunk_or_delta_object_in_memory_is_corrupt_and_read_bounded(which):
    """On any store, verify and restore read at most the largest valid encoding of a chunk
    (plus a byte) of a chunk object, a delta object or a delta's base that is larger."""
    store = _Largest()
    x = np.random.default_rng(0).standard_normal(16_384).astype(np.float32)
    casstore.save(store, 0, {"w": x})
    y = x.copy()
    y[:10] += 1
    casstore.save(store, 1, {"w": y})
    ref = casstore.read_manifest(store, 1).leaves[0].chunks[0]
    assert ref.base is not None  # a delta on step 0's chunk
    key = {"chunk": casstore.read_manifest(store, 0).leaves[0].chunks[0].key, "delta": ref.key,
           "base": chunk_key(ref.base)}[which]
    store.put(key, store.get(key) + bytes(16 << 20))
    store.largest = 0
    report = casstore.verify(store)
    assert [(p.kind, p.key_path, p.key) for p in report.problems] == [("corrupt", "w", key)]
    assert "larger than" in report.problems[0].message
    step = 1 if which == "delta" else 0
    with pytest.raises(casstore.CorruptChunkError, match="larger than") as info:
        casstore.restore(store, step)
    assert info.value.key_path == "w"
    assert store.largest < 1 << 20


@pytest.mark.parametrize("kind", ["dangling link", "fifo"])
def test_a_manifest_that_is_no_regular_file_is_damage_and_gc_keeps_its_chunks(tmp_path, kind):
    """A manifest replaced by a link to an unmounted volume, or by a FIFO: ls and verify left
    its step out (exit 0), and gc deleted the step's chunks, lost when the volume came back
    (exploratory session's repro)."""
    casstore.save(tmp_path, 0, {"w": np.zeros(1000, np.float32)})
    casstore.save(tmp_path, 1, {"w": np.ones(1000, np.float32)})
    path = tmp_path / manifest_key("default", 1)
    kept = path.read_bytes()
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(tmp_path / "elsewhere", path)
    chunks = sorted(p.name for p in (tmp_path / "chunks").rglob("*") if p.is_file())
    assert casstore.list_steps(tmp_path) == [0, 1]
    report = casstore.verify(tmp_path)
    assert not report.ok
    assert [(p.kind, p.step) for p in report.problems] == [("manifest", 1)]
    assert "no object that reads" in report.problems[0].message
    with pytest.raises(casstore.ManifestError, match=r"gc refused.*default@1"):
        casstore.gc(tmp_path, grace_period_s=0)
    assert sorted(p.name for p in (tmp_path / "chunks").rglob("*") if p.is_file()) == chunks
    path.unlink()
    path.write_bytes(kept)  # the volume came back: the step restores
    assert casstore.restore(tmp_path, 1)["w"].tolist() == [1.0] * 1000


@pytest.mark.parametrize("step", [True, 1.0, -1, 2.5, "1"])
def test_verify_refuses_a_step_every_other_function_refuses(tmp_path, step):
    """verify(url, True) and verify(url, 1.0) checked step 1; -1 and 2.5 gave a "no such
    step" problem (exploratory session)."""
    casstore.save(tmp_path, 1, {"w": np.ones(3)})
    with pytest.raises(ValueError, match="invalid step"):
        casstore.verify(tmp_path, step)
    assert casstore.verify(tmp_path, np.int64(1)).ok


def test_a_dry_run_beside_a_save_reports_no_missing_chunk(tmp_path, monkeypatch):
    """A dry run takes no lock: a step committed between its chunk listing and its manifest
    scan counted its new chunks as referenced but missing, and `casstore gc --dry-run`
    reported a healthy repository as damaged (exit 1) during training."""
    import casstore._gc as gc_module
    url = str(tmp_path / "r")
    casstore.save(url, 0, {"w": np.arange(100_000, dtype=np.float32)})
    scan = gc_module.scan_manifests

    def scan_after_a_save(store, **kwargs):  # another process's save, at the worst moment
        casstore.save(url, 1, {"w": np.arange(100_000, dtype=np.float32) + 1})
        return scan(store, **kwargs)

    monkeypatch.setattr(gc_module, "scan_manifests", scan_after_a_save)
    info = casstore.gc(url, dry_run=True, grace_period_s=0)
    assert (info.manifests, info.missing_chunks) == (2, 0)
    monkeypatch.setattr(gc_module, "scan_manifests", scan)
    (key,) = {ref.key for leaf in casstore.read_manifest(url, 1).leaves for ref in leaf.chunks}
    os.unlink(tmp_path / "r" / key)  # now one is missing for real: still reported
    assert casstore.gc(url, dry_run=True, grace_period_s=0).missing_chunks == 1


def test_verify_beside_retention_reports_no_chunk_of_a_step_deleted_meanwhile(tmp_path,
                                                                              monkeypatch):
    """Another process deleted a step and collected its chunks after verify read the
    manifests: verify reported them missing (ok False, `casstore verify` exit 1), naming a
    step that no longer exists."""
    import casstore._verify as verify_module
    url = str(tmp_path / "r")
    for step in range(3):
        casstore.save(url, step, {"w": np.random.default_rng(step).standard_normal(100_000)})
    read_all = verify_module._read_all

    def read_all_after_retention(*args, **kwargs):
        casstore.delete(url, 0)
        casstore.gc(url, grace_period_s=0)
        return read_all(*args, **kwargs)

    monkeypatch.setattr(verify_module, "_read_all", read_all_after_retention)
    report = casstore.verify(url)
    assert report.ok, report.problems
    assert casstore.list_steps(url) == [1, 2]
    monkeypatch.setattr(verify_module, "_read_all", read_all)
    (key,) = {ref.key for leaf in casstore.read_manifest(url, 2).leaves for ref in leaf.chunks}
    os.unlink(tmp_path / "r" / key)  # one a committed step needs: still reported
    assert casstore.verify(url).chunks_missing == 1


def test_a_failure_of_the_whole_store_is_raised_not_reported_as_damaged_objects(tmp_path):
    """An expired token (s3fs raises OSError EINVAL for S3's InvalidToken), a FUSE mount gone
    (ENOTCONN), an NFS handle gone stale (ESTALE) fail every read: verify reported every
    manifest and chunk damaged, and copy took a step for deleted during the copy and left
    it out (review of the unreadable-object fix); a bad block's EIO is one object's."""
    import errno

    class Failing(MemoryStore):
        error: OSError | None = None

        def get(self, key):
            if self.error is not None and key != "config":
                raise self.error
            return super().get(key)

        def head(self, key, nbytes):
            if self.error is not None and key != "config":
                raise self.error
            return super().head(key, nbytes)

    store = Failing()
    casstore.save(store, 0, {"w": np.arange(1000.0)})
    for code in (errno.EINVAL, errno.ENOTCONN, errno.ESTALE):
        store.error = OSError(code, os.strerror(code))
        with pytest.raises(OSError, match=re.escape(os.strerror(code))):
            casstore.verify(store)
        with pytest.raises(OSError, match=re.escape(os.strerror(code))):
            casstore.copy(store, tmp_path / f"copy-{code}")
    store.error = OSError(errno.EIO, "Input/output error")  # one object's: named, not raised
    assert {p.kind for p in casstore.verify(store).problems} == {"manifest"}
