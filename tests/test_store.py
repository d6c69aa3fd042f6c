"""Every store backend passes the same contract suite (casstore.testing.StoreContract)."""

import concurrent.futures
import contextlib
import errno
import functools
import json
import os
import re

import numpy as np
import pytest

import casstore
from casstore import open_store
from casstore.store import CountingStore, FsspecStore, LocalStore, MemoryStore
from casstore.testing import StoreContract

from conftest import make_store, object_store


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store(self):
        return MemoryStore()

    def read_only_store(self, store):
        ro = MemoryStore(read_only=True)
        ro._objects = store._objects
        return ro


class TestLocalStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path):
        return LocalStore(tmp_path / "repo")

    def read_only_store(self, store):
        return LocalStore(store.root, read_only=True)

    def test_no_temp_files_left_and_hidden_from_list(self, store):
        store.put("a/b", b"1")
        with pytest.raises(FileExistsError, match="exists"):
            store.put_if_absent("a/b", b"2")
        assert os.listdir(os.path.join(store.root, "a")) == ["b"]
        open(os.path.join(store.root, "a", ".b.tmp"), "wb").close()  # a crashed writer's temp
        assert [i.key for i in store.list("a/")] == ["a/b"]


class TestFsspecMemoryStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path):
        return make_store("fsspec-memory", tmp_path)

    def read_only_store(self, store):
        return FsspecStore(store.fs, store.root, read_only=True)


class TestCountingStore(StoreContract):
    @pytest.fixture
    def store(self):
        return CountingStore(MemoryStore())

    def read_only_store(self, store):
        ro = MemoryStore(read_only=True)
        ro._objects = store.inner._objects
        return CountingStore(ro)

    def test_counts(self, store):
        store.put("a", b"123")
        store.get("a")
        store.get_many(["a", "a"])
        assert store.counts["put"] == 1
        assert store.counts["get"] == 3
        assert store.bytes_written == 3
        assert store.bytes_read == 9


def test_open_store_picks_backend(tmp_path):
    assert isinstance(open_store(tmp_path / "r"), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}/r"), LocalStore)
    assert isinstance(open_store("memory://casstore-open-test"), FsspecStore)
    s = MemoryStore()
    assert open_store(s) is s
    with pytest.raises(ValueError, match="anon: storage options and timeouts are for object"):
        open_store(tmp_path, anon=True)
    with pytest.raises(ValueError, match=r"request_timeout_s: .* takes only read_only"):
        open_store(tmp_path, request_timeout_s=5)


def test_a_url_that_names_no_repository_is_refused(tmp_path, monkeypatch):
    """'' and 'file://' were the current directory: save, copy and import wrote a repository
    there; 's3://' failed later in botocore (exploratory session's repros)."""
    monkeypatch.chdir(tmp_path)
    for url, why in [("", "no path"), ("file://", "no path"), ("s3://", "no bucket"),
                     ("gs:///", "no bucket"), ("a\0b", "a NUL character")]:
        with pytest.raises(ValueError, match=re.escape(f"invalid URL {url!r}: {why}")):
            casstore.save(url, 0, {"w": np.zeros(3)})
    with pytest.raises(TypeError, match="url must be a str path or URL"):
        open_store(b"repo")
    assert list(tmp_path.iterdir()) == []
    assert open_store(".").location() == f"{tmp_path}/"  # the current directory, on purpose


@pytest.fixture(params=["seaweedfs", "moto", "fake-gcs"])
def object_server(request, object_servers):
    return object_servers[request.param]


class TestObjectStores(StoreContract):
    """The contract on S3 (SeaweedFS, moto) and GCS (fake-gcs-server) through fsspec."""

    @pytest.fixture
    def store(self, object_server):
        return object_store(object_server)

    def read_only_store(self, store):
        return FsspecStore(store.fs, store.root, read_only=True)


def flaky(fn, failures: list[BaseException]):
    """``fn``, but raising the given exceptions on its first calls."""
    def wrapper(*args, **kwargs):
        if failures:
            raise failures.pop(0)
        return fn(*args, **kwargs)
    return wrapper


def test_transient_errors_are_retried_and_permanent_ones_are_not(tmp_path):
    import errno

    store = make_store("fsspec-memory", tmp_path)
    store.policy.backoff_s = 0.001
    store.put("a", b"1")
    import gcsfs.retry
    import requests

    store.fs.cat_file = flaky(store.fs.cat_file, [OSError(errno.EREMOTEIO, "InternalError"),
                                                   ConnectionResetError("reset"),
                                                   TimeoutError("slow"),
                                                   requests.exceptions.ProxyError(),  # GCS 502
                                                   gcsfs.retry.HttpError({"code": 408}),
                                                   # gcsfs parsing a JSON reply cut short
                                                   json.JSONDecodeError("Expecting ':'", "{", 1),
                                                   UnicodeDecodeError("utf-8", b"\x9e", 0, 1,
                                                                      "invalid start byte")])
    assert store.get("a") == b"1"
    store.fs.cat_file = flaky(store.fs.cat_file, [PermissionError(13, "AccessDenied")])
    with pytest.raises(PermissionError, match="refused access") as info:
        store.get("a")
    assert store.url in "".join(getattr(info.value, "__notes__", [store.url]))
    store.policy.retries = 2
    store.fs.cat_file = flaky(store.fs.cat_file, [TimeoutError()] * 3)
    with pytest.raises(TimeoutError, match=rf"while accessing {re.escape(store.url)}/a$"):
        store.get("a")
    # botocore's read timeout, whose aiohttp cause an ``except`` block may have replaced as
    # its context (a tiered restore's fallback read): transient by its class
    import aiohttp
    import botocore.exceptions

    store.policy.retries = 5
    timeout = botocore.exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:9")
    timeout.__context__ = FileNotFoundError("the local tier's error")
    store.fs.cat_file = flaky(store.fs.cat_file, [timeout])
    assert store.get("a") == b"1"
    # an invalid URL is permanent: 'http://' was retried until its 60 s deadline
    invalid = [aiohttp.InvalidUrlClientError("http:///a") for _ in range(2)]
    store.fs.cat_file = flaky(store.fs.cat_file, invalid)
    with pytest.raises(aiohttp.InvalidUrlClientError):
        store.get("a")
    assert len(invalid) == 1  # one attempt
    invalid.clear()  # fsspec's memory filesystem is one instance, which later tests use


def test_a_create_that_stored_its_bytes_then_failed_is_not_a_conflict(tmp_path):
    store = make_store("fsspec-memory", tmp_path)
    store.policy.backoff_s = 0.001
    real = store.fs.pipe_file

    def stores_then_fails(path, data, **kwargs):
        real(path, data, **kwargs)
        store.fs.pipe_file = real
        raise TimeoutError("response lost")

    store.fs.pipe_file = stores_then_fails
    store.put_if_absent("m", b"mine")  # the retry finds its own bytes: success
    with pytest.raises(FileExistsError, match="exists"):
        store.put_if_absent("m", b"other")


def test_a_leading_tilde_is_the_home_directory(tmp_path, monkeypatch):
    import numpy as np

    import casstore

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for url in ("~/ckpts", "file://~/ckpts2"):
        assert open_store(url).url == str(tmp_path / "home" / url.split("/")[-1])
    casstore.save("~/ckpts", 0, {"w": np.arange(3.0)})
    assert (tmp_path / "home" / "ckpts" / "config").is_file()
    assert not (tmp_path / "~").exists()
    assert casstore.list_steps(str(tmp_path / "home" / "ckpts")) == [0]
    np.testing.assert_array_equal(casstore.restore("~/ckpts", 0)["w"], np.arange(3.0))


def test_local_get_split_reads_head_and_body_in_one_read_or_nothing(tmp_path):
    store = LocalStore(tmp_path)
    store.put("obj", b"HEAD" + bytes(range(200)))
    head, body = bytearray(4), bytearray(200)
    assert store.get_split("obj", head, body)
    assert (bytes(head), bytes(body)) == (b"HEAD", bytes(range(200)))
    other = bytearray(199)
    assert not store.get_split("obj", bytearray(4), other)  # another size: nothing read
    assert other == bytearray(199)
    with pytest.raises(FileNotFoundError, match="no such object"):
        store.get_split("missing", bytearray(4), bytearray(1))
    assert not MemoryStore().get_split("obj", bytearray(4), bytearray(1))  # not supported


def test_local_get_split_reads_on_past_what_one_preadv_returns(tmp_path, monkeypatch):
    """One preadv(2) reads at most 2 GiB - 4 KiB: raw chunks over 1 GiB were read whole into
    a buffer and copied instead (a restore took twice the state). Here a preadv reads 7 bytes
    at most, as the kernel's cap would at 2 GiB, and the float32 body is read all the same."""
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: preadv(
        fd, [memoryview(b)[:7] for b in buffers[:1]], offset))
    store = LocalStore(tmp_path)
    values = np.arange(50, dtype=np.float32)
    store.put("obj", b"HEAD" + values.tobytes())
    head, body = bytearray(4), np.zeros(50, np.float32)
    assert store.get_split("obj", head, body)
    assert bytes(head) == b"HEAD"
    np.testing.assert_array_equal(body, values)


def test_restores_read_from_4_threads_a_core_on_local_disk_unless_told(tmp_path, monkeypatch):
    from casstore import FallbackStore
    from casstore._pool import usable_cores

    store = LocalStore(tmp_path)
    assert store.read_workers == min(16, 4 * usable_cores())
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert (store.read_workers, store.max_workers) == (16, 32)  # reads: at most 16 threads
    monkeypatch.undo()
    assert MemoryStore().read_workers == MemoryStore().max_workers  # as its other pools
    assert FallbackStore(store, [MemoryStore()]).read_workers == store.read_workers
    store.max_workers = 3
    assert store.read_workers == 3


def test_a_step_of_encoded_chunks_is_read_by_at_most_max_workers_threads(tmp_path, monkeypatch):
    from casstore import FallbackStore, _restore
    from casstore._pool import usable_cores

    cores = usable_cores()
    store = LocalStore(tmp_path / "repo")
    assert store.read_threads(False) == store.read_workers == min(16, 4 * cores)
    assert store.read_threads(True) == min(16, 2 * cores) == min(store.read_workers,
                                                                 store.max_workers)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert (store.read_threads(False), store.read_threads(True)) == (16, 16)
    monkeypatch.undo()
    fsspec_store = casstore.open_store("memory://threads")
    assert fsspec_store.read_threads(True) == fsspec_store.read_threads(False)  # waits on I/O
    assert FallbackStore(store, [MemoryStore()]).read_threads(True) == store.read_workers

    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((512, 1024)) * 0.02).astype(np.float32)
    casstore.save(store, 1, {"w": weights}, compression="bytes", chunk_size_bytes=2**19)
    casstore.save(store, 2, {"w": rng.integers(0, 2**32, weights.shape, np.uint32)},
                  chunk_size_bytes=2**19)  # random bits: stored raw
    assert casstore.read_manifest(store, 1).encoded()
    assert not casstore.read_manifest(store, 2).encoded()
    threads = []
    read_regions = _restore.read_regions
    monkeypatch.setattr(_restore, "read_regions", lambda *a: threads.append(a[-1])
                        or read_regions(*a))
    assert casstore.restore(store, 1)["w"].tobytes() == weights.tobytes()
    casstore.restore(store, 2)
    casstore.restore(store, 1, max_workers=3)
    assert threads == [store.read_threads(True), store.read_workers, 3]


def test_a_directory_or_a_device_in_place_of_a_local_object_is_no_object(tmp_path):
    """A directory leaked IsADirectoryError; a symlink to /dev/zero was read until memory ran
    out. Both are 'no such object', for a chunk and for a manifest alike; a restore says the
    step does not exist, or, for the symlink, which the listing has, that its manifest is
    listed but does not read."""
    store = LocalStore(tmp_path / "r")
    casstore.save(store, 0, {"w": np.arange(100_000.0)})
    manifest = tmp_path / "r" / "runs" / "default" / "steps" / "0000000000000000.manifest"
    for replace, says in ((lambda p: p.mkdir(), "no such step; the run has no committed step"),
                          (lambda p: p.symlink_to("/dev/zero"), "its manifest is listed but "
                           "is no object that reads")):
        manifest.unlink() if manifest.is_file() or manifest.is_symlink() else manifest.rmdir()
        replace(manifest)
        for read in (store.get, lambda k: store.get_into(k, None)):
            with pytest.raises(casstore.ObjectNotFoundError, match="no such object"):
                read("runs/default/steps/0000000000000000.manifest")
        with pytest.raises(casstore.StepNotFoundError,
                           match=rf"{says}.*url '{re.escape(store.url)}'.*step 0\)"):
            casstore.restore(store, 0)


def test_a_fifo_in_place_of_a_local_object_is_no_object_and_no_read_waits_for_it(tmp_path):
    """Opening a FIFO for reading waits for a writer: verify and restore of a step with a FIFO
    at a chunk's key, and any read of a FIFO config or manifest, hung for good. Each call
    runs in a thread, so a hang fails the test after 60 s instead of blocking the suite."""
    store = LocalStore(tmp_path / "r")
    casstore.save(store, 0, {"w": np.arange(100_000.0)})
    [chunk] = [o.key for o in store.list("chunks/")]

    def error_of(call, *args) -> Exception:
        with pytest.raises(casstore.CasstoreError) as error:
            call(*args)
        return error.value

    def release_readers():  # a reader a FIFO blocks gets its EOF once a writer came and went
        for key in (chunk, "config"):
            with contextlib.suppress(OSError):
                os.close(os.open(store._path(key), os.O_WRONLY | os.O_NONBLOCK))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit = functools.partial(_submitted, pool.submit, release_readers)
        for key, restore_error, kinds in ((chunk, "chunk object missing", ["missing"]),
                                          ("config", "config object missing",
                                           ["config", "missing"])):
            os.unlink(store._path(key))
            os.mkfifo(store._path(key))
            for read in (store.get, lambda k: store.get_into(k, None)):
                with pytest.raises(casstore.ObjectNotFoundError, match="not a regular file"):
                    pool.submit(read, key).result(timeout=60)
            report = pool.submit(casstore.verify, store, 0).result(timeout=60)
            assert sorted(p.kind for p in report.problems) == kinds
            error = pool.submit(error_of, casstore.restore, store, 0).result(timeout=60)
            assert restore_error in str(error)


def _submitted(submit, release, *args) -> concurrent.futures.Future:
    """``submit(*args)``, whose ``result(timeout)`` calls ``release`` before it raises
    TimeoutError (so that a hung call ends and the pool can shut down)."""
    future = submit(*args)
    result = future.result

    def released(timeout=None):
        try:
            return result(timeout)
        except concurrent.futures.TimeoutError:
            release()
            raise

    future.result = released
    return future


def test_a_url_with_an_empty_path_segment_is_refused():
    """SeaweedFS and GCS store s3://b/a//b's keys under a/b, so its listings never matched
    the keys written: saves returned, and no step was ever listed."""
    for url in ("s3://bucket/a//b", "gs://bucket//a", "s3://bucket/a//"):
        if url.endswith("//"):
            assert open_store(url, anon=True) is not None  # only trailing: the same URL
            continue
        with pytest.raises(ValueError, match="empty path segment"):
            open_store(url, anon=True) if url.startswith("s3") else open_store(url)


def test_a_url_with_a_dot_or_dot_dot_segment_is_refused_on_object_stores():
    """moto stores s3://b/d/./r's keys as written, fake-gcs-server under d/r (a save there
    returned and its URL listed no step), SeaweedFS refuses them with a bare 400."""
    for url in ("s3://bucket/d/./r", "gs://bucket/../r", "s3://bucket/d/.."):
        with pytest.raises(ValueError, match=r"a '\.' or '\.\.' path segment"):
            open_store(url, anon=True) if url.startswith("s3") else open_store(url)
    assert open_store("s3://bucket/d.r/x..y", anon=True) is not None  # dots inside names


def test_a_gcs_token_naming_a_missing_credentials_file_is_refused_at_once(tmp_path):
    """gcsfs takes a token string that is not an existing file for an access token and asks
    Google about it: a typo in the path failed with a connection error (no network) or an
    invalid-token error, never naming the file."""
    missing = str(tmp_path / "missing.json")
    for token in (missing, "creds.json"):
        with pytest.raises(FileNotFoundError, match=r"token '.*json' for 'gs://bucket/r': "
                                                    r"no such credentials file"):
            open_store("gs://bucket/r", token=token)
    (tmp_path / "missing.json").write_text("{}")  # exists: gcsfs reads it (and refuses {})
    with pytest.raises(KeyError, match="refresh_token"):
        open_store("gs://bucket/r", token=missing)


def test_a_full_disk_names_the_file_and_keeps_what_was_stored(tmp_path, monkeypatch):
    """ENOSPC from the disk (here from fsync, where delayed allocation reports it) names the
    object's file, not only the errno; the failed save leaves no temp file and the earlier
    step restores."""
    store = LocalStore(tmp_path / "repo")
    casstore.save(store, 0, {"a": np.arange(10.0)})

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left on device: '") as caught:
        casstore.save(store, 1, {"a": np.arange(100_000.0)})
    monkeypatch.undo()
    assert caught.value.errno == errno.ENOSPC
    assert caught.value.filename.startswith(str(tmp_path / "repo") + os.sep)
    assert not [p for p in (tmp_path / "repo").rglob("*") if p.name.endswith(".tmp")]
    assert casstore.list_steps(store) == [0]
    assert casstore.restore(store, 0)["a"].tolist() == list(np.arange(10.0))


def test_an_object_whose_backend_gives_no_modification_time_counts_as_just_written():
    """GC's grace period and the stale-lock age read the time a listing gives; where the
    fsspec backend gives none it fails safe (the object is spared, the lock is live)."""
    import time

    from casstore.store._fsspec import _mtime
    now = time.time()
    assert now - 1 <= _mtime({"name": "x", "size": 3}) <= time.time()
    assert _mtime({"last_modified": "2026-01-02T03:04:05Z"}) == 1767323045.0
    assert _mtime({"mtime": 12.5}) == 12.5


def test_a_step_number_of_non_ascii_digits_is_no_step(tmp_path):
    """Python's ``\\d`` matches every script's digits: a stray file under steps/ named with
    Arabic-Indic ones was listed as the latest step, which no reader could then open
    (exploratory session's repro); format.md §2's step is 16 ASCII digits."""
    casstore.save(tmp_path, 1, {"a": np.arange(4.0)})
    steps = tmp_path / "runs" / "default" / "steps"
    (steps / ("0" * 15 + "\u0669.manifest")).write_bytes((steps / f"{1:016d}.manifest")
                                                        .read_bytes())
    assert casstore.list_steps(tmp_path) == [1]
    assert casstore.restore(tmp_path)["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
