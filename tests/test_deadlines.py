"""Deadlines: real servers behind a misbehaving network (tests/faultproxy.py) never hang a
save, restore, copy, gc or the manager; each either succeeds bit-exact or fails with
StoreTimeoutError within the bound of docs/reliability.md, and no partial step appears."""

import json
import os
import pathlib
import re
import signal
import socket
import time

import numpy as np
import pytest
from faultproxy import FAULTS, fault_proxy
from forkserver import LazyForkServer

import casstore
from casstore.store import FsspecStore, MemoryStore

# Small deadlines keep the suite fast; the defaults are measured by benchmarks/deadlines.py.
REQUEST_S, OPERATION_S = 0.5, 2.0
DEADLINES = {"request_timeout_s": REQUEST_S, "operation_timeout_s": OPERATION_S}
# The bound of docs/reliability.md: one operation's deadline, then the failed save's lock
# release and in-flight requests at one request timeout each; 3 s of slack for a busy 2-core
# machine (scheduling, the proxy's threads, the server). Without deadlines a stalled store
# hangs forever, and casstore retries until the operation's deadline, so this still fails.
BOUND_S = OPERATION_S + 2 * REQUEST_S + 3.0
CHUNK = 16_384  # bytes: a trickled 16 KiB answer takes 4 s, past one attempt's 1 s


def tree_for(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.normal(size=6 * CHUNK // 4).astype(np.float32),
            "b": np.full(4000, step, np.int32), "step": step}


def assert_bit_exact(restored, step: int) -> None:
    expected = tree_for(step)
    for key in ("w", "b"):
        assert restored[key].tobytes() == expected[key].tobytes(), (step, key)
    assert restored["step"] == step


def options(server, endpoint_url: str) -> dict:
    return {**server.storage_options, "endpoint_url": endpoint_url}


@pytest.fixture(params=["seaweedfs", "fake-gcs"])
def proxied(request, object_servers):
    """``(proxy, store through the proxy, the same store direct)`` on a fresh repository."""
    server = object_servers[request.param]
    url = server.url_for("deadlines")
    with fault_proxy(server.endpoint_url) as proxy:
        store = FsspecStore.from_url(url, **options(server, proxy.endpoint_url), **DEADLINES)
        store.policy.backoff_s = 0.05
        yield proxy, store, FsspecStore.from_url(url, **server.storage_options)


def timed(fn, *args, **kwargs):
    """``(result or StoreTimeoutError, seconds)``; any other error fails the test."""
    t0 = time.monotonic()
    try:
        result = fn(*args, **kwargs)
    except casstore.StoreTimeoutError as e:
        result = e
    return result, time.monotonic() - t0


@pytest.mark.parametrize("fault", FAULTS)
def test_save_restore_copy_gc_succeed_or_time_out_under(fault, proxied):
    proxy, store, direct = proxied
    casstore.save(direct, 0, tree_for(0), chunk_size_bytes=CHUNK)
    proxy.set(fault, fraction=0.25)
    saved, seconds = timed(casstore.save, store, 1, tree_for(1), chunk_size_bytes=CHUNK)
    assert seconds < BOUND_S, (fault, seconds)
    restored, seconds = timed(casstore.restore, store, 0)
    assert seconds < BOUND_S, (fault, seconds)
    if not isinstance(restored, Exception):
        assert_bit_exact(restored, 0)
    copy_dst = MemoryStore()
    copied, seconds = timed(casstore.copy, store, copy_dst, steps=[0])
    assert seconds < 2 * BOUND_S, (fault, seconds)  # the listing, then the step's chunks
    collected, seconds = timed(casstore.gc, store, grace_period_s=0, lock_timeout_s=1)
    assert seconds < 2 * BOUND_S, (fault, seconds)  # the GC lock, then the sweep
    assert proxy.faults[fault] > 0
    proxy.set(None)
    # Whatever happened, what is visible is complete: step 0 survives, and step 1 exists if
    # its save returned (promise 3), restoring bit-exact; the copy made whole steps only.
    steps = casstore.list_steps(direct)
    assert 0 in steps, steps
    assert isinstance(saved, Exception) or 1 in steps, steps
    for step in steps:
        assert_bit_exact(casstore.restore(direct, step), step)
    assert casstore.list_steps(copy_dst) == ([] if isinstance(copied, Exception) else [0])
    for step in casstore.list_steps(copy_dst):
        assert_bit_exact(casstore.restore(copy_dst, step), step)
    assert casstore.verify(direct).ok
    print(fault, {"save": saved, "restore": type(restored).__name__, "copy": copied,
                  "gc": collected, "faults": dict(proxy.faults), "requests": proxy.requests})


def test_a_stalled_store_fails_save_restore_copy_and_gc_within_the_bound(proxied):
    proxy, store, direct = proxied
    casstore.save(direct, 0, tree_for(0), chunk_size_bytes=CHUNK)
    proxy.set("stall")
    for fn, args in ((casstore.save, (store, 1, tree_for(1))), (casstore.restore, (store, 0)),
                     (casstore.copy, (store, MemoryStore())), (casstore.gc, (store,))):
        error, seconds = timed(fn, *args)
        assert isinstance(error, casstore.StoreTimeoutError), (fn.__name__, error)
        assert seconds < BOUND_S, (fn.__name__, seconds)
        assert store.url in str(error), error
        assert error.key, error
        if fn is casstore.save:  # the step it was saving
            assert (error.step, error.run) == (1, "default"), error
    proxy.set(None)
    assert casstore.list_steps(direct) == [0]
    assert casstore.verify(direct).ok
    assert_bit_exact(casstore.restore(store, 0), 0)  # it answers again: so do we


def test_a_restore_that_times_out_names_step_key_path_and_object(proxied):
    proxy, store, direct = proxied
    casstore.save(direct, 3, tree_for(3), chunk_size_bytes=CHUNK)
    proxy.set("trickle")  # the manifest (1 KiB) comes through, the 16 KiB chunks do not
    with pytest.raises(casstore.StoreTimeoutError,
                       match=r"no answer within the .* deadline") as info:
        casstore.restore(store, 3)
    error = info.value
    assert error.step == 3, error
    assert error.key_path == "w", error
    assert error.key.startswith("chunks/")
    assert error.key[7:].replace("/", "") == error.chunk_id
    assert f"step {3!r}" in str(error)
    assert error.key in str(error)


@pytest.mark.parametrize("protocol", ["s3", "gs"])
def test_save_to_an_endpoint_that_never_answers_raises_within_the_bound(protocol):
    """The issue's headline: TCP connections are accepted, nothing is ever answered."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)  # the kernel completes handshakes; nobody reads
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        creds = {"key": "k", "secret": "s"} if protocol == "s3" else {"token": "anon"}
        store = casstore.open_store(f"{protocol}://bucket/repo", endpoint_url=endpoint,
                                    **creds, **DEADLINES)
        error, seconds = timed(casstore.save, store, 0, {"w": np.ones(1000, np.float32)})
    assert isinstance(error, casstore.StoreTimeoutError)
    assert isinstance(error, TimeoutError)
    assert seconds < BOUND_S
    assert f"{protocol}://bucket/repo" in str(error)


def test_throttling_slows_a_save_down_instead_of_failing_it(object_servers):
    server = object_servers["seaweedfs"]
    url = server.url_for("slowdown")
    with fault_proxy(server.endpoint_url, seed=1) as proxy:
        store = FsspecStore.from_url(url, **options(server, proxy.endpoint_url),
                                     request_timeout_s=REQUEST_S, operation_timeout_s=10.0)
        store.policy.backoff_s = 0.02
        proxy.set("slowdown", max_in_flight=4)  # 503 SlowDown above 4 requests at once
        tree = {f"w{i}": np.full(CHUNK // 4, i, np.float32) for i in range(60)}
        info = casstore.save(store, 1, tree, chunk_size_bytes=CHUNK, pack_threshold_bytes=0)
        assert proxy.faults["slowdown"] > 0
        assert info.new_chunks == 60
        assert store.policy.limit.limit < store.max_workers  # fewer requests in flight
        proxy.set(None)
    restored = casstore.restore(FsspecStore.from_url(url, **server.storage_options), 1)
    assert all(restored[k].tobytes() == v.tobytes() for k, v in tree.items())


def test_manager_surfaces_a_stalled_background_save_and_recovers(object_servers):
    server = object_servers["seaweedfs"]
    url = server.url_for("manager")
    with fault_proxy(server.endpoint_url) as proxy:
        store = FsspecStore.from_url(url, **options(server, proxy.endpoint_url), **DEADLINES)
        store.policy.operation_timeout_s = 30.0  # OPERATION_S from the stall on (a loaded
        mngr = casstore.CheckpointManager(store)  # machine once took longer before it)
        mngr.save(0, tree_for(0))
        mngr.wait_until_finished()
        store.policy.operation_timeout_s = OPERATION_S
        proxy.set("stall")
        t0 = time.monotonic()
        assert mngr.save(1, tree_for(1), force=True)  # returns at once: the save is queued
        assert time.monotonic() - t0 < 0.75 * OPERATION_S  # a save that waited would not be
        with pytest.raises(casstore.StoreTimeoutError,
                           match=r"no answer within the .* deadline") as info:
            mngr.save(2, tree_for(2))
        assert time.monotonic() - t0 < BOUND_S
        assert info.value.step == 1
        assert "step 1" in str(info.value)
        proxy.set(None)
        assert mngr.save(2, tree_for(2))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0, 2]
        assert mngr.latest_step() == 2
        assert_bit_exact(mngr.restore(2), 2)
        mngr.close()


# The scripts a user stops with Ctrl-C, forked from a server that imported jax, numpy and
# casstore (an interpreter start and imports: 2 s of CPU each on the loaded 2 cores).
SCRIPTS = LazyForkServer(lambda: {**os.environ,
                                  "PYTHONPATH": str(pathlib.Path(casstore.__file__).parents[1])})


@pytest.fixture(scope="module", autouse=True)
def _close_the_fork_server():
    yield
    SCRIPTS.close()


def first_time(output: pathlib.Path, pid: int) -> str:
    """The time INTERRUPTED printed, once it did; "" if its process ended without it, or did
    not print it within 60 s."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = output.read_text() if output.exists() else ""
        printed = re.search(r"^\d+\.\d+$", text, re.M)
        if printed:
            return printed[0]
        if SCRIPTS.wait([pid], 0) != [None]:
            return ""
        time.sleep(0.02)
    return ""


# A script a user stops with Ctrl-C: it prints the time at which the call raised it.
INTERRUPTED = r"""
import json, signal, sys, time
import numpy as np
import casstore
# Ctrl-C as in a terminal, even where this test runs in a background job (whose children
# inherit SIGINT ignored, POSIX "Signal Handling" in the shell's chapter).
signal.signal(signal.SIGINT, signal.default_int_handler)
op, url, options, local = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
store = casstore.open_store(url, **options)
try:
    if op == "save":
        casstore.save(store, 1, {"w": np.arange(200_000.0)}, chunk_size_bytes=16_384)
    elif op == "restore":
        casstore.restore(store, 0)
    elif op == "copy-from":
        casstore.copy(store, local)
    else:
        casstore.copy(local, store)
except KeyboardInterrupt:
    print(time.monotonic(), flush=True)
"""


@pytest.mark.parametrize(("op", "backend"), [
    (op, backend) for op in ("save", "restore", "copy-from") for backend in ("seaweedfs",
                                                                            "fake-gcs")]
    + [("copy-to", "seaweedfs")])  # GCS names an upload's object in its body, not its URL
def test_ctrl_c_stops_save_restore_and_copy_on_a_stalled_store_at_once(op, backend, tmp_path,
                                                                       object_servers):
    """Ctrl-C in a script or a notebook stops a save, restore or copy (from the store, or to
    it) whose chunk requests wait in worker threads on a stalled store: the call raises
    KeyboardInterrupt within seconds instead of at the requests' 30 s deadline, the script
    then exits within seconds too (the requests are cancelled, not waited for when Python
    joins the worker threads at exit), and no new step and no save lock are left behind."""
    server = object_servers[backend]
    url, local = server.url_for("ctrl-c"), tmp_path / "local"
    direct = FsspecStore.from_url(url, **server.storage_options)
    casstore.save(direct, 0, tree_for(0), chunk_size_bytes=CHUNK)  # what the restore reads
    casstore.save(str(local), 5, tree_for(5), chunk_size_bytes=CHUNK)  # what the copy sends
    script, output = tmp_path / "interrupted.py", tmp_path / "interrupted.txt"
    script.write_text(INTERRUPTED)
    with fault_proxy(server.endpoint_url) as proxy:
        # Lookups, uploads (S3) and reads of chunk objects, which worker threads make, not
        # listings, which the calling thread makes: S3 names the object in the path, GCS
        # after "/o/" with "%2F".
        proxy.set("stall", only=re.compile(rb"/chunks/|/o/[^? ]*chunks"))
        opts = {**options(server, proxy.endpoint_url), "request_timeout_s": 30.0,
                "operation_timeout_s": 60.0}
        [pid] = SCRIPTS.start([[script, op, url, json.dumps(opts), local]], [output])
        try:
            deadline = time.monotonic() + 60
            while proxy.faults["stall"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proxy.faults["stall"] > 0, "the call never reached the store"
            time.sleep(0.5)
            t0 = time.monotonic()
            os.kill(pid, signal.SIGINT)
            line = first_time(output, pid)
            assert line, (f"{op} did not raise KeyboardInterrupt (exit "
                          f"{SCRIPTS.wait([pid], 60, kill=True)[0]}): {output.read_text()}")
            assert float(line) - t0 < 10, (op, float(line) - t0)
            if SCRIPTS.wait([pid], 10) == [None]:
                pytest.fail(f"{op}: the script did not exit within 10 s of raising "
                            "KeyboardInterrupt (its stalled requests were waited for)")
        finally:
            SCRIPTS.wait([pid], 0, kill=True)
    assert casstore.list_steps(direct) == [0]
    assert casstore.list_steps(str(local)) == [5]
    assert [o.key for o in direct.list("locks/") if "save-" in o.key] == []


def test_a_request_the_busy_event_loop_cannot_end_still_times_out():
    """A request whose timeout cannot fire because something holds fsspec's event loop (a
    blocking call on the loop thread) still raises a timeout a second after it, as fsspec's
    ``sync`` did, instead of waiting for the loop to come free."""
    from fsspec.asyn import AsyncFileSystem
    from fsspec.exceptions import FSTimeoutError

    class BlockedLoop(AsyncFileSystem):
        async def _info(self, path, **kwargs):
            time.sleep(4.0)  # holds the loop thread: asyncio.wait_for cannot fire meanwhile
            return {"name": path, "size": 1, "type": "file"}

    store = FsspecStore(BlockedLoop(skip_instance_cache=True), "root", retries=0,
                        request_timeout_s=0.2, operation_timeout_s=0.4)
    t0 = time.monotonic()
    with pytest.raises(FSTimeoutError, match=rf"while accessing {re.escape(store.url)}/k$"):
        store.stat("k")
    assert time.monotonic() - t0 < 3.5  # 0.2 s + 1 s of grace, not the loop's 4 s
    time.sleep(4.0)  # let the loop come free before the next test uses it


def test_a_request_abandoned_by_ctrl_c_that_then_fails_leaves_no_asyncio_traceback(caplog):
    """Ctrl-C during a save to S3 printed "Task exception was never retrieved" tracebacks: the
    abandoned request's task ended with an error that nothing read."""
    import asyncio
    import gc
    import threading

    from fsspec.asyn import AsyncFileSystem

    class FailsOnceCancelled(AsyncFileSystem):
        async def _info(self, path, **kwargs):
            try:
                await asyncio.sleep(5.0)
            except asyncio.CancelledError:  # as a client that ends a cut request with an error
                raise FileNotFoundError(path) from None

    store = FsspecStore(FailsOnceCancelled(skip_instance_cache=True), "root", retries=0,
                        request_timeout_s=10.0, operation_timeout_s=20.0)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # even run in background
    try:
        threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident,
                                                   signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            store.stat("k")
    finally:
        signal.signal(signal.SIGINT, previous)
    time.sleep(0.5)  # the task ends on the loop's thread
    gc.collect()  # asyncio logs an unread task error when the task is collected
    assert "exception was never retrieved" not in caplog.text
