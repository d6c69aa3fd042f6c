"""Read-only credentials enforced by a real server (SeaweedFS with ``-s3.config``): with the
reader's keys every read works, and every write fails at once with a PermissionError naming
the URL, leaving the bucket's objects as they were."""

import time

import numpy as np
import pytest

import casstore
from casstore.store import FsspecStore, MemoryStore


def tree_for(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((256, 64)).astype(np.float32),
            "b": np.full(16, step, np.int32), "step": step}


def assert_tree(restored: dict, step: int) -> None:
    expected = tree_for(step)
    assert restored["w"].tobytes() == expected["w"].tobytes()
    assert restored["b"].tobytes() == expected["b"].tobytes()
    assert restored["step"] == step


@pytest.fixture(scope="module")
def repo(seaweedfs_identities) -> str:
    """A repository written with the admin keys: steps 1 and 2 of ``default``, 5 of ``other``."""
    url = seaweedfs_identities.url_for("read-only")
    admin = FsspecStore.from_url(url, **seaweedfs_identities.options_for("admin"))
    casstore.save(admin, 1, tree_for(1))
    casstore.save(admin, 2, tree_for(2))
    casstore.save(admin, 5, tree_for(5), run="other")
    return url


def store_as(server, url: str, identity: str) -> FsspecStore:
    store = FsspecStore.from_url(url, **server.options_for(identity))
    store.policy.backoff_s = 5.0  # a retried request would wait at least 2.5 s
    return store


def objects(server, url: str) -> dict[str, bytes]:
    """Every object under ``url`` and its bytes, read with the admin keys."""
    admin = store_as(server, url, "admin")
    return {info.key: admin.get(info.key) for info in admin.list()}


def test_the_reader_keys_cannot_write_to_the_server(seaweedfs_identities, repo):
    reader = store_as(seaweedfs_identities, repo, "reader")
    with pytest.raises(casstore.AccessDeniedError, match="refused access") as info:
        reader.put("probe", b"1")
    assert isinstance(info.value, PermissionError)
    assert f"{repo}/probe" in str(info.value)
    assert "probe" not in objects(seaweedfs_identities, repo)


def test_reads_work_with_read_only_keys(seaweedfs_identities, repo):
    before = objects(seaweedfs_identities, repo)
    reader = store_as(seaweedfs_identities, repo, "reader")
    assert casstore.list_steps(reader) == [1, 2]
    assert casstore.list_runs(reader) == ["default", "other"]
    assert casstore.read_manifest(reader, 5, run="other").step == 5
    assert_tree(casstore.restore(reader, 1), 1)
    assert_tree(casstore.restore(reader, run="other"), 5)
    report = casstore.verify(reader)
    assert report.ok
    assert len(report.steps_checked) == 3
    assert casstore.gc(reader, dry_run=True).deleted_chunks == 0
    copy = MemoryStore()
    casstore.copy(reader, copy)
    assert casstore.list_runs(copy) == ["default", "other"]
    assert_tree(casstore.restore(copy, 2), 2)
    with casstore.CheckpointManager(reader) as mngr:  # a manager that only reads
        assert mngr.all_steps() == [1, 2]
        assert_tree(mngr.restore(), 2)
    assert objects(seaweedfs_identities, repo) == before


WRITES = {
    "save": lambda store: casstore.save(store, 3, tree_for(3)),
    "save-existing-run": lambda store: casstore.save(store, 6, tree_for(6), run="other"),
    "delete": lambda store: casstore.delete(store, 1),
    "gc": lambda store: casstore.gc(store, grace_period_s=0),
}


@pytest.mark.parametrize("write", WRITES)
def test_writes_fail_at_once_naming_the_url(seaweedfs_identities, repo, write, caplog):
    before = objects(seaweedfs_identities, repo)
    reader = store_as(seaweedfs_identities, repo, "reader")
    t0 = time.perf_counter()
    with pytest.raises(PermissionError, match="refused access") as info:
        WRITES[write](reader)
    # the refused lock was never stored: no advice to delete it by hand
    assert "could not delete lock" not in caplog.text
    # Refused once, not retried: retries would go on to the 60 s operation deadline; 10 s
    # leaves a busy 2-core machine room for the one request.
    assert time.perf_counter() - t0 < 10.0
    assert isinstance(info.value, casstore.AccessDeniedError)
    assert repo in str(info.value)
    assert objects(seaweedfs_identities, repo) == before


def test_manager_save_fails_in_the_call_with_read_only_keys(seaweedfs_identities, repo):
    before = objects(seaweedfs_identities, repo)
    reader = store_as(seaweedfs_identities, repo, "reader")
    with casstore.CheckpointManager(reader, max_to_keep=1) as mngr:
        assert mngr.should_save(3)
        t0 = time.perf_counter()
        with pytest.raises(PermissionError, match="refused access") as info:
            mngr.save(3, tree_for(3))  # asynchronous, yet refused here, not at the next call
        assert time.perf_counter() - t0 < 10.0  # not retried to the 60 s deadline
        assert repo in str(info.value)
        assert mngr.all_steps() == [1, 2]  # retention did not run either
    assert objects(seaweedfs_identities, repo) == before


def test_manager_save_fails_in_the_call_on_a_read_only_store(tmp_path):
    casstore.save(tmp_path, 1, tree_for(1))
    store = casstore.open_store(tmp_path, read_only=True)
    with (casstore.CheckpointManager(store) as mngr,
          pytest.raises(casstore.ReadOnlyStoreError,
                        match=r"read-only; nothing was saved.*step 2\)")):
        mngr.save(2, tree_for(2))
    assert casstore.list_steps(tmp_path) == [1]


@pytest.mark.parametrize(("refusal", "says"), [("forbidden", "does not have storage.objects"),
                                               ("unauthorized", "Invalid Credentials, 401")])
def test_gcs_refusing_access_is_named_as_such(object_servers, refusal, says, caplog):
    """GCS's 403 (an objectViewer account writing) came as gcsfs's OSError("Forbidden") and
    its 401 as an HttpError: neither was an AccessDeniedError (the CLI exited 2, not 12, and a
    refused save advised deleting a lock that was never stored)."""
    from click.testing import CliRunner
    from faultproxy import fault_proxy

    from casstore import cli
    server = object_servers["fake-gcs"]
    url = server.url_for("refused")
    casstore.save(FsspecStore.from_url(url, **server.storage_options), 1, tree_for(1))
    with fault_proxy(server.endpoint_url) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.endpoint_url}
        refused = FsspecStore.from_url(url, **options)
        refused.policy.backoff_s = 5.0  # a retried request would wait at least 2.5 s
        proxy.set(refusal, only=b"POST")  # writes (uploads are POSTs); reads go through
        t0 = time.perf_counter()
        with pytest.raises(casstore.AccessDeniedError, match=says) as info:
            casstore.save(refused, 2, tree_for(2))
        assert time.perf_counter() - t0 < 10.0  # refused once, not retried
        assert url in str(info.value)
        assert "could not delete lock" not in caplog.text
        assert casstore.list_steps(refused) == [1]
        proxy.set(refusal)
        args = ["ls", url, *(a for k, v in options.items() for a in ("-o", f"{k}={v}"))]
        result = CliRunner().invoke(cli.main, args)
        assert result.exit_code == cli.EXIT_ACCESS_DENIED, result.output
        assert "check the credentials" in result.stderr
