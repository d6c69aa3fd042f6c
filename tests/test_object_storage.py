"""Object storage: commit races, cross-cloud copy, and an interrupted copy finishing on re-run."""

import re
import threading
import uuid

import fsspec
import jax.numpy as jnp
import numpy as np
import pytest

import casstore
from casstore.store import CountingStore, FsspecStore, LocalStore
from casstore.store._retry import CHECKSUM_ATTEMPTS

from conftest import BACKENDS, object_store


@pytest.mark.parametrize("repo_store", BACKENDS, indirect=True)  # moto too: create-only
def test_concurrent_saves_of_one_step_exactly_one_wins(repo_store):
    """Several threads save the same step with different trees: one commits, the rest get
    StepAlreadyExistsError, and the winner's checkpoint restores bit-exact."""
    trees = [{"w": np.full((300, 50), i, np.float32), "i": i} for i in range(4)]
    barrier = threading.Barrier(len(trees))
    outcome: dict[int, object] = {}

    def save(i: int) -> None:
        barrier.wait()
        try:
            outcome[i] = casstore.save(repo_store, 7, trees[i])
        except casstore.StepAlreadyExistsError as e:
            outcome[i] = e

    threads = [threading.Thread(target=save, args=(i,)) for i in range(len(trees))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, o in outcome.items() if isinstance(o, casstore.SaveInfo)]
    assert len(winners) == 1, outcome
    assert len(outcome) == len(trees), outcome
    restored = casstore.restore(repo_store, 7)
    assert restored["i"] == winners[0]
    np.testing.assert_array_equal(restored["w"], trees[winners[0]]["w"])


def test_copy_local_to_s3_to_gcs_to_local(tmp_path, object_servers):
    src = LocalStore(tmp_path / "src")
    base = np.random.default_rng(0).normal(size=(500, 64)).astype(np.float32)
    for step in range(3):
        casstore.save(src, step, {"base": base, "head": jnp.full((40,), step, jnp.float32),
                                  "step": step}, run="a")
    casstore.save(src, 0, {"base": base, "other": np.arange(7)}, run="b")
    s3 = object_store(object_servers["seaweedfs"])
    gcs = object_store(object_servers["fake-gcs"])
    back = LocalStore(tmp_path / "back")
    first = casstore.copy(src, s3)
    assert len(first.steps_copied) == 4
    assert first.chunks_skipped == 0
    assert casstore.copy(src, s3).chunks_copied == 0  # nothing left to send
    casstore.copy(s3, gcs, runs=["a"], steps=[1, 2])
    assert casstore.list_runs(gcs) == ["a"]
    assert casstore.list_steps(gcs, run="a") == [1, 2]
    casstore.copy(gcs, back)
    for step in (1, 2):
        restored = casstore.restore(back, step, run="a")
        np.testing.assert_array_equal(restored["base"], base)
        np.testing.assert_array_equal(restored["head"], np.full(40, step, np.float32))
    assert casstore.verify(back).ok
    assert casstore.verify(s3).ok


class FailingAfter(CountingStore):
    """Fails every chunk write after the first ``ok`` ones (a dropped connection)."""

    def __init__(self, inner, ok: int):
        super().__init__(inner)
        self.ok = ok

    def _put(self, key, data, *, exclusive):
        if key.startswith("chunks/"):
            if self.ok <= 0:
                raise ConnectionResetError("injected: connection reset")
            self.ok -= 1
        super()._put(key, data, exclusive=exclusive)


def test_interrupted_copy_finishes_on_rerun_sending_only_the_rest(tmp_path, object_servers):
    src = LocalStore(tmp_path / "src")
    tree = {f"w{i}": np.full((200, 100), i, np.float32) for i in range(10)}
    casstore.save(src, 1, tree, chunk_size_bytes=40_000)
    n_chunks = len(casstore.read_manifest(src, 1).chunk_ids())
    dst_url = object_servers["moto"].url()
    options = object_servers["moto"].storage_options
    flaky = FailingAfter(FsspecStore.from_url(dst_url, **options), ok=4)
    with pytest.raises(ConnectionResetError, match="injected: connection reset"):
        casstore.copy(src, flaky, max_workers=1)
    assert casstore.list_steps(flaky) == []  # no manifest without all chunks
    again = CountingStore(FsspecStore.from_url(dst_url, **options))
    info = casstore.copy(src, again)
    assert info.chunks_skipped == 4
    assert info.chunks_copied == n_chunks - 4
    assert len([k for k in again.keys_written if k.startswith("chunks/")]) == n_chunks - 4
    restored = casstore.restore(again, 1)
    for key, value in tree.items():
        np.testing.assert_array_equal(restored[key], value)


def test_copy_verifies_chunks_in_transit(tmp_path):
    src = LocalStore(tmp_path / "src")
    casstore.save(src, 1, {"x": np.arange(100_000)})
    cid = next(iter(casstore.read_manifest(src, 1).chunk_ids()))
    path = src._path(f"chunks/{cid[:2]}/{cid[2:]}")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[-1] ^= 1
    with open(path, "wb") as f:
        f.write(bytes(data))
    dst = LocalStore(tmp_path / "dst")
    with pytest.raises(casstore.CorruptChunkError, match="source chunk unusable") as info:
        casstore.copy(src, dst, verify=True)
    assert info.value.chunk_id == cid
    assert info.value.key_path == "x"
    assert casstore.list_steps(dst) == []


@pytest.mark.parametrize("name", ["moto", "fake-gcs"])
def test_a_save_into_a_bucket_that_does_not_exist_says_so(object_servers, name):
    """SeaweedFS answers such a write with Access Denied (AccessDeniedError); these two
    answered NoSuchBucket / 404, which leaked as a bare FileNotFoundError."""
    server = object_servers[name]
    store = casstore.open_store(f"{server.protocol}://no-such-bucket-{name}/repo",
                                **server.storage_options)
    with pytest.raises(casstore.ObjectNotFoundError,
                       match=rf"bucket does not exist.*no-such-bucket-{name}/repo"):
        casstore.save(store, 0, {"w": np.ones(3)})


def test_a_byte_changed_in_an_upload_to_gcs_is_sent_again_never_committed(object_servers):
    """gcsfs compares the MD5 GCS reports for each upload with what it sent (casstore opens
    it with consistency="md5"): a flipped byte is sent again. Without it, fake-gcs-server
    stored the flipped bytes and the save committed a step that did not restore."""
    from faultproxy import fault_proxy

    server = object_servers["fake-gcs"]
    url = server.url()
    direct = FsspecStore.from_url(url, **server.storage_options)
    assert direct.fs.consistency == "md5"
    casstore.save(direct, 0, {"n": 1})
    w = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
    with fault_proxy(server.endpoint_url) as proxy:
        through = FsspecStore.from_url(url, **{**server.storage_options,
                                               "endpoint_url": proxy.endpoint_url},
                                       request_timeout_s=2, operation_timeout_s=20)
        through.policy.backoff_s = 0.05
        # fewer flips than CHECKSUM_ATTEMPTS: every chunk gets through (with a fraction of all
        # uploads instead, one of the 13 chunks was flipped every time in 30% of runs)
        proxy.set("flip", only=b"/upload/", max_faults=CHECKSUM_ATTEMPTS - 1)
        casstore.save(through, 1, {"w": w}, chunk_size_bytes=65536)
        assert proxy.faults["flip"] == CHECKSUM_ATTEMPTS - 1
    assert casstore.verify(direct).ok
    np.testing.assert_array_equal(casstore.restore(direct, 1)["w"], w)


def test_a_create_stored_with_bytes_that_failed_their_checksum_is_rewritten_or_removed(
        monkeypatch):
    """A create-only put (a manifest) that GCS stored, then failed its MD5 check, is ours:
    the retry rewrites it (a second create would find it and call it a conflict); if every
    attempt fails it is removed, never left as a damaged commit."""
    class ChecksumError(Exception):  # gcsfs.checkers raises one of this name
        pass

    store = FsspecStore(fsspec.filesystem("memory"), f"/casstore-{uuid.uuid4().hex}")
    store.policy.backoff_s = 0.001
    real, failures = store.fs.pipe_file, [1]

    def stores_flipped_then_fails(path, data, **kwargs):
        real(path, bytes(data)[:-1] + b"?", **kwargs)
        if failures[0]:
            failures[0] -= 1
            raise ChecksumError("MD5 checksum failed")

    monkeypatch.setattr(store.fs, "pipe_file", lambda path, data, **kw: (  # fsspec's one
        stores_flipped_then_fails(path, data, **kw) if failures[0] else real(path, data, **kw)))
    store.put_if_absent("m", b"mine")
    assert store.get("m") == b"mine"
    failures[0] = 99
    with pytest.raises(ChecksumError, match=rf"while accessing {re.escape(store.url)}/n$"):
        store.put_if_absent("n", b"never")
    assert not store.exists("n")


def test_a_plain_http_endpoint_loads_no_ca_bundle_and_https_keeps_verification(
        object_servers, monkeypatch):
    """aiobotocore loads the CA bundle into an SSL context for each client it makes (30-66 ms of
    CPU), which a client of an http:// endpoint never uses: it is not loaded there, and a
    store of an https:// endpoint keeps botocore's verification."""
    import ssl
    loads = []
    original = ssl.SSLContext.load_verify_locations
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations",
                        lambda self, *a, **k: (loads.append(a), original(self, *a, **k))[1])
    server = object_servers["seaweedfs"]
    assert server.storage_options["endpoint_url"].startswith("http://")
    url = server.url()  # the fixture makes the bucket with a client of its own
    loads.clear()
    store = FsspecStore.from_url(url, **server.storage_options)
    casstore.save(store, 1, {"w": np.arange(6.0)})
    np.testing.assert_array_equal(casstore.restore(store, 1)["w"], np.arange(6.0))
    assert loads == []
    assert store.fs.client_kwargs["verify"] is False
    secure = FsspecStore.from_url("s3://bucket/repo", endpoint_url="https://s3.example.invalid",
                                  key="k", secret="s")
    assert "verify" not in secure.fs.client_kwargs
    mine = FsspecStore.from_url("s3://bucket/repo", endpoint_url="http://127.0.0.1:1",
                                client_kwargs={"verify": "/my/ca.pem"}, key="k", secret="s")
    assert mine.fs.client_kwargs["verify"] == "/my/ca.pem"


@pytest.mark.parametrize("name", ["seaweedfs", "moto", "fake-gcs"])
def test_a_create_only_write_whose_first_answer_was_lost_is_done(object_servers, name,
                                                                  monkeypatch):
    """aiohttp resends, once, a PUT whose kept-alive connection closed unanswered: the server
    had stored the first, the second got 412, and a save raised "step was committed by a
    concurrent save" for its own step. Sent twice here, as aiohttp does on such a loss."""
    store = object_store(object_servers[name])
    real = store._call

    def sent_twice(method, *args, **kwargs):
        if kwargs.get("mode") == "create":
            real(method, *args, **kwargs)  # stored; its answer lost
            if hasattr(args[1], "seek"):  # s3fs's body: the same bytes sent again (a body
                args[1].seek(0)  # read to its end sent none, and SeaweedFS waited 20 s)
        return real(method, *args, **kwargs)

    monkeypatch.setattr(store, "_call", sent_twice)
    casstore.save(store, 1, {"w": np.arange(6.0)})
    assert casstore.list_steps(store) == [1]
    np.testing.assert_array_equal(casstore.restore(store, 1)["w"], np.arange(6.0))
    store.put_if_absent("m", b"mine")
    with pytest.raises(FileExistsError):  # another writer's bytes: still refused
        store.put_if_absent("m", b"other")
    assert store.get("m") == b"mine"


@pytest.mark.parametrize("name", ["seaweedfs", "moto", "fake-gcs"])
def test_a_create_only_write_above_gcsfs_chunk_size_still_refuses_an_existing_object(
        object_servers, name):
    """A manifest may take up to 256 MiB; gcsfs sends 50 MiB or more as a resumable upload,
    whose ifGenerationMatch=0 fake-gcs-server ignores: two concurrent saves of one step with
    a 55 MiB manifest both returned there, the second replacing the first. Every create-only
    write to GCS is now one request."""
    store = object_store(object_servers[name])
    first = np.random.default_rng(0).bytes(51 * 2**20)
    store.put_if_absent("big", first)
    with pytest.raises(FileExistsError):
        store.put_if_absent("big", b"x" + first)
    assert store.get("big") == first


@pytest.mark.parametrize("name", ["seaweedfs", "moto", "fake-gcs"])
def test_a_prefix_with_brackets_reads_many_objects_and_copies_again(object_servers, name,
                                                                    tmp_path):
    """fsspec's cat took "exp[lr=0.1]" as a glob pattern: get_many raised a bare
    FileNotFoundError for an object that exists, and a copy run again (it reads the
    destination's manifests so) crashed."""
    server = object_servers[name]
    url = f"{server.url_for('sweep')}/exp[lr=0.1]"
    store = FsspecStore.from_url(url, **server.storage_options)
    store.put("k/1", b"one")
    assert store.get_many(["k/1"]) == {"k/1": b"one"}
    with pytest.raises(casstore.ObjectNotFoundError):
        store.get_many(["k/1", "k/2"])
    casstore.save(tmp_path / "src", 1, {"w": np.arange(6.0)})
    for _ in range(2):
        casstore.copy(tmp_path / "src", store)
    assert casstore.list_steps(store) == [1]


@pytest.mark.parametrize("name", ["moto", "fake-gcs"])
def test_storage_options_the_client_would_ignore_are_refused(object_servers, name):
    """open_store passed any keyword on to fsspec, which ignored those it does not know: a
    misspelt endpoint_url (then AWS's), FsspecStore's own max_workers; a timeout given as a
    string failed later with a bare TypeError."""
    server = object_servers[name]
    url = server.url_for("options")
    for bad, says in (({"endpont_url": "http://typo"}, "unknown storage option.s. endpont_url"),
                      ({"max_workers": 2}, "unknown storage option.s. max_workers"),
                      ({"request_timeout_s": "5"}, "request_timeout_s='5': a positive number")):
        with pytest.raises(ValueError, match=says):
            casstore.open_store(url, **{**server.storage_options, **bad})
    casstore.open_store(url, **server.storage_options)  # every option the fixture gives


def test_a_gcs_endpoint_ending_in_a_slash_finds_the_repository(object_servers):
    """gcsfs joined "//storage/v1" to it: 404s, read as an empty repository (a resumed job
    would have started over)."""
    server = object_servers["fake-gcs"]
    url = server.url_for("slash")
    casstore.save(casstore.open_store(url, **server.storage_options), 7, {"w": np.arange(3.0)})
    slashed = {**server.storage_options,
               "endpoint_url": server.storage_options["endpoint_url"] + "/"}
    assert casstore.list_steps(casstore.open_store(url, **slashed)) == [7]


def test_one_repository_named_by_two_protocol_spellings_is_refused_as_both_tiers(
        object_servers, tmp_path):
    """gs:// and gcs:// (s3:// and s3a://) name one repository: as local and persistent tier,
    local retention deleted the persisted steps."""
    for name, other in (("fake-gcs", "gcs"), ("moto", "s3a")):
        server = object_servers[name]
        url = server.url_for("alias")
        alias = other + url[url.index("://"):]
        with pytest.raises(ValueError, match="must be two repositories"):
            casstore.CheckpointManager(url, persistent=alias, **server.storage_options)
