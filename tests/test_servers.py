"""The test servers of servers.py: they start, serve fsspec, keep the create-only semantics that
shared/TESTING-SERVERS.md records, and fail loudly (never hang, never skip) when they can't start.
"""

import http.server
import re
import socket
import threading
import time

import botocore.exceptions
import pytest
import servers


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """The three servers, started here (not through conftest) so their startup is tested."""
    root = tmp_path_factory.mktemp("test-servers")
    with (servers.seaweedfs_server(root / "seaweedfs") as seaweedfs, servers.moto_server() as moto,
          servers.fake_gcs_server(root / "fake-gcs") as gcs):
        yield {"seaweedfs": seaweedfs, "moto": moto, "fake-gcs": gcs}


@pytest.fixture(params=["seaweedfs", "moto", "fake-gcs"])
def server(request, started) -> servers.ObjectServer:
    return started[request.param]


def test_startup_times(started, capsys):
    with capsys.disabled():
        print("\nstartup:", ", ".join(f"{s.name} {s.startup_s:.2f} s" for s in started.values()))
    assert all(s.startup_s < 30 for s in started.values())


def test_put_get_list_round_trip(server):
    fs = server.fs()
    root = server.url_for("roundtrip").split("://", 1)[1]
    fs.pipe_file(f"{root}/a/x", b"hello")
    with fs.open(f"{root}/a/y", "wb") as f:
        f.write(b"world" * 1000)
    assert fs.cat_file(f"{root}/a/x") == b"hello"
    assert fs.cat_file(f"{root}/a/y", start=0, end=5) == b"world"
    assert sorted(fs.ls(f"{root}/a", detail=False)) == [f"{root}/a/x", f"{root}/a/y"]
    assert fs.info(f"{root}/a/y")["size"] == 5000
    fs.rm_file(f"{root}/a/x")
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/a/x")


def test_urls_are_fresh_prefixes_in_one_bucket(server):
    a, b = server.url_for("r"), server.url_for("r")
    assert a != b
    assert a.startswith(f"{server.protocol}://{server.bucket}/r-")
    assert b.rsplit("/", 1)[0] == a.rsplit("/", 1)[0]
    assert server.new_bucket() != server.new_bucket()


# What s3fs says for S3's 412 PreconditionFailed; gcsfs names only the upload URL.
S3_PRECONDITION = "At least one of the pre-conditions you specified did not hold"


def _second_create(server, match: str) -> tuple[BaseException, bytes]:
    fs = server.fs()
    path = server.url_for("create").split("://", 1)[1] + "/manifest"
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(OSError, match=match) as info:
        fs.pipe_file(path, b"second", mode="create")
    return info.value, fs.cat_file(path)


def _client_error_code(error: BaseException) -> str:
    assert isinstance(error.__cause__, botocore.exceptions.ClientError)
    return error.__cause__.response["Error"]["Code"]


def test_create_only_on_moto_raises_file_exists(started):
    error, data = _second_create(started["moto"], S3_PRECONDITION)
    assert type(error) is FileExistsError
    assert _client_error_code(error) == "PreconditionFailed"
    assert data == b"first"


def test_create_only_on_seaweedfs_raises_oserror_einval_caused_by_precondition_failed(started):
    """SeaweedFS omits the ``Condition`` field s3fs keys on: no FileExistsError, EINVAL."""
    error, data = _second_create(started["seaweedfs"], S3_PRECONDITION)
    assert type(error) is OSError
    assert error.errno == 22
    assert _client_error_code(error) == "PreconditionFailed"
    assert data == b"first"


def test_create_only_on_fake_gcs_raises_file_exists(started):
    gcs = started["fake-gcs"]
    error, data = _second_create(gcs, re.escape(f"{gcs.endpoint_url}/upload/storage/v1/b/"))
    assert type(error) is FileExistsError
    assert data == b"first"


def test_fake_gcs_resumable_exclusive_open_overwrites(started):
    """The known hole: gcsfs ``open("xb")`` (resumable upload) does not stop a second create on
    fake-gcs-server. If this starts failing, update TESTING-SERVERS.md."""
    fs = started["fake-gcs"].fs()
    path = started["fake-gcs"].url_for("xb").split("://", 1)[1] + "/manifest"
    for data in (b"first", b"second"):
        with fs.open(path, "xb") as f:
            f.write(data)
    assert fs.cat_file(path) == b"second"


def test_external_endpoints_replace_the_servers(started, monkeypatch):
    """With CASSTORE_TEST_*_ENDPOINT set the fixtures start nothing and use those servers."""
    moto, gcs = started["moto"], started["fake-gcs"]
    monkeypatch.setenv("CASSTORE_TEST_S3_ENDPOINT", moto.endpoint_url)
    monkeypatch.setenv("CASSTORE_TEST_S3_KEY", "k")
    monkeypatch.setenv("CASSTORE_TEST_S3_SECRET", "s")
    monkeypatch.setenv("CASSTORE_TEST_GCS_ENDPOINT", gcs.endpoint_url)
    for fixture in (servers.s3_seaweedfs(None), servers.s3_moto(), servers.gcs_fake(None)):
        found = next(fixture)  # a fixture body: its value, then the rest of it at close()
        try:
            assert found.name.startswith("external-")
            fs, path = found.fs(), found.url_for("ext").split("://", 1)[1] + "/x"
            fs.pipe_file(path, b"x")
            assert fs.cat_file(path) == b"x"
        finally:
            fixture.close()
    assert found.storage_options == {"endpoint_url": gcs.endpoint_url, "token": "anon"}


@pytest.fixture
def taken_port():
    """A loopback port held by a bound socket (not listening: probes are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_fake_gcs_on_a_taken_port_fails_fast_with_its_log(tmp_path, taken_port):
    t0 = time.monotonic()
    with (pytest.raises(servers.ServerError, match="address already in use") as info,
          servers.fake_gcs_server(tmp_path, port=taken_port)):
        pass
    assert info.value.exited
    assert time.monotonic() - t0 < 10


def test_moto_on_a_taken_port_fails_fast(taken_port, monkeypatch):
    """Not a case the fixture meets (it binds port 0), but start() must not hang on it."""
    died = []  # werkzeug's bind failure ends moto's serving thread with SystemExit
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_type))
    t0 = time.monotonic()
    with (pytest.raises(servers.ServerError, match="thread died"),
          servers.moto_server(port=taken_port)):
        pass
    assert time.monotonic() - t0 < 8
    assert died == [SystemExit]


def test_seaweedfs_exiting_after_another_server_answered_its_probe_fails(tmp_path):
    """Another HTTP server on the S3 port answers 200 at once; weed exits ~0.2 s later."""
    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=other.serve_forever, args=(0.05,), daemon=True).start()
    taken: set[int] = set()
    ports = {c: servers._free_port(taken, plus_10000=True) for c in servers.SEAWEED_COMPONENTS}
    ports["s3"] = other.server_address[1]
    try:
        with (pytest.raises(servers.ServerError, match="another process answered on its port")
              as info, servers.seaweedfs_server(tmp_path, ports=ports)):
            pass
    finally:
        other.shutdown()
        other.server_close()
    assert "is not available" in str(info.value)  # weed's own words, from the log tail


def test_a_port_taken_between_choosing_and_binding_is_retried(tmp_path, taken_port,
                                                              monkeypatch):
    real, calls = servers._free_port, []

    def first_taken(*args, **kwargs):
        calls.append(1)
        return taken_port if len(calls) == 1 else real(*args, **kwargs)

    monkeypatch.setattr(servers, "_free_port", first_taken)
    with servers.fake_gcs_server(tmp_path) as gcs:
        assert not gcs.endpoint_url.endswith(f":{taken_port}")
        assert len(calls) == 2
        assert gcs.fs().ls("") == []
    assert (tmp_path / "gcs-0" / "server.log").read_text()  # the failed first attempt's log


def test_a_server_that_never_answers_times_out_without_retries(tmp_path, taken_port):
    t0 = time.monotonic()
    with pytest.raises(servers.ServerError, match=r"not ready after 0\.3 s"):
        servers._spawn(["sleep", "30"], tmp_path / "log", f"http://127.0.0.1:{taken_port}/", 0.3)
    assert time.monotonic() - t0 < 10  # the sleep (30 s) was stopped by SIGTERM, not waited for
