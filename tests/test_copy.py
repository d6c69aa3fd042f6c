"""casstore.copy: counts, checks before writing, one pool across steps, per-step commits in
order, framing checks and verify=True, progress, and bytes changed in transit (local directories
and SeaweedFS)."""

import threading
import time

import numpy as np
import pytest
from faultproxy import fault_proxy

import casstore
import casstore._copy
from casstore._layout import manifest_key, parse_manifest_key
from casstore._repository import list_chunk_objects
from casstore.store import CountingStore, FsspecStore, LocalStore, MemoryStore
from casstore.store._retry import CHECKSUM_ATTEMPTS

from conftest import GatedStore, object_store

ROWS = 2_000  # rows of 64 float32: 512 KB a leaf; 64 KB chunks -> 8 chunks a leaf


def shared_steps(store, n=4):
    """n steps sharing a frozen base, each with its own head; returns the trees."""
    rng = np.random.default_rng(0)
    base = rng.normal(size=(ROWS, 64)).astype(np.float32)
    trees = []
    for step in range(n):
        tree = {"base": base, "head": rng.normal(size=(500, 64)).astype(np.float32)}
        casstore.save(store, step, tree, chunk_size_bytes=64_000, delta=False)
        trees.append(tree)
    return trees


@pytest.fixture(params=["local", "seaweedfs"])
def dst(request, tmp_path):
    if request.param == "local":
        return LocalStore(tmp_path / "dst")
    return object_store(request.getfixturevalue("object_servers")["seaweedfs"])


def test_a_different_step_of_the_same_number_at_the_destination_is_refused(tmp_path, dst):
    """A step the destination has is skipped only if its manifest is the source's: another
    step of that number (another history of the run) is an error, and nothing is written."""
    src = LocalStore(tmp_path / "src")
    trees = shared_steps(src, n=3)
    other = {"base": trees[0]["base"] + 1, "head": trees[0]["head"]}
    casstore.save(dst, 1, other, chunk_size_bytes=64_000, delta=False)
    before = {i.key for i in list_chunk_objects(dst)}
    with pytest.raises(casstore.StepAlreadyExistsError, match=r"another step.*step 1"):
        casstore.copy(src, dst)
    assert {i.key for i in list_chunk_objects(dst)} == before  # no chunk sent
    assert casstore.list_steps(dst) == [1]
    restored = casstore.restore(dst, 1)
    np.testing.assert_array_equal(restored["base"], other["base"])
    casstore.copy(src, dst, steps=[0, 2])  # the other steps copy as usual
    assert casstore.list_steps(dst) == [0, 1, 2]


def test_a_different_step_written_there_during_the_copy_is_an_error(tmp_path):
    src, elsewhere = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "elsewhere")
    shared_steps(src, n=3)
    casstore.save(elsewhere, 0, {"x": np.arange(10)})
    theirs = elsewhere.get(manifest_key("default", 0))

    class Racing(LocalStore):
        """Another writer commits its step 0 just before the copy's manifest write."""

        def put_if_absent(self, key, data):
            if key == manifest_key("default", 0) and not self.exists(key):
                super().put_if_absent(key, theirs)
            return super().put_if_absent(key, data)

    dst = Racing(tmp_path / "dst")
    with pytest.raises(casstore.StepAlreadyExistsError, match=r"another step.*step 0"):
        casstore.copy(src, dst)
    assert dst.get(manifest_key("default", 0)) == theirs
    assert casstore.list_steps(dst) == [0]  # steps 1 and 2 wait for step 0, in step order


def test_counts_each_needed_object_once_copied_or_already_there(tmp_path, dst):
    src = LocalStore(tmp_path / "src")
    trees = shared_steps(src)
    objects = {i.key: i.size for i in list_chunk_objects(src)}
    first = casstore.copy(src, dst)
    assert first.chunks_skipped == 0
    assert first.bytes_skipped == 0
    assert first.chunks_copied == len(objects)
    assert first.bytes_copied == sum(objects.values())
    assert {i.key: i.size for i in list_chunk_objects(dst)} == objects
    again = casstore.copy(src, dst)
    assert again.chunks_copied == 0
    assert again.steps_copied == ()
    assert len(again.steps_skipped) == len(trees)
    # the skipped steps' objects count as skipped, each once
    assert again.chunks_skipped == len(objects)
    assert again.bytes_skipped == sum(objects.values())
    partly = casstore.copy(src, LocalStore(tmp_path / "partly"), steps=[0])
    both = casstore.copy(src, tmp_path / "partly", steps=[0, 1])
    step0 = casstore.read_manifest(src, 0).chunk_ids()
    step1 = casstore.read_manifest(src, 1).chunk_ids()
    assert both.steps_skipped == (("default", 0),)
    assert both.chunks_skipped == len(step0) == partly.chunks_copied
    assert both.chunks_copied == len(step1 - step0)
    for step, tree in enumerate(trees):
        restored = casstore.restore(dst, step)
        for key, value in tree.items():
            np.testing.assert_array_equal(restored[key], value)


def test_a_copy_sends_again_the_objects_a_step_there_lost_and_counts_each_once(tmp_path, dst):
    """A step the destination has (same manifest) is skipped, but its objects missing there
    (deleted, lost) were counted neither copied nor skipped, and the destination stayed
    unrestorable while the copy reported success. A run named twice was copied, then reported
    skipped too (its manifests "written concurrently")."""
    src = LocalStore(tmp_path / "src")
    trees = shared_steps(src, n=2)
    casstore.copy(src, dst)
    [lost, *_] = sorted(casstore.read_manifest(src, 1).object_keys()
                        - casstore.read_manifest(src, 0).object_keys())
    dst.delete(lost)
    assert not casstore.verify(dst, read_data=False).ok
    again = casstore.copy(src, dst, runs=["default", "default"])
    objects = {i.key: i.size for i in list_chunk_objects(src)}
    assert (again.steps_copied, again.steps_skipped) == ((), (("default", 0), ("default", 1)))
    assert (again.chunks_copied, again.bytes_copied) == (1, objects[lost])
    assert again.chunks_skipped == len(objects) - 1
    assert again.bytes_skipped == sum(objects.values()) - objects[lost]
    assert casstore.verify(dst).ok
    restored = casstore.restore(dst, 1)
    assert restored["head"].tobytes() == trees[1]["head"].tobytes()
    fresh = casstore.copy(src, tmp_path / "fresh", runs=["default", "default"])
    assert (fresh.steps_copied, fresh.steps_skipped) == ((("default", 0), ("default", 1)), ())


def test_a_later_copy_skips_what_an_earlier_one_sent(tmp_path):
    src, dst = LocalStore(tmp_path / "src"), LocalStore(tmp_path / "dst")
    shared_steps(src)
    first = casstore.copy(src, dst, steps=[0])
    second = casstore.copy(src, dst, steps=[1, 2])
    step0 = casstore.read_manifest(src, 0).chunk_ids()
    later = casstore.read_manifest(src, 1).chunk_ids() | casstore.read_manifest(src, 2).chunk_ids()
    assert first.chunks_copied == len(step0)
    assert second.chunks_skipped == len(step0 & later)
    assert second.chunks_copied == len(later - step0)


@pytest.mark.parametrize(("kwargs", "error", "named"), [
    ({"runs": ["typo"]}, casstore.StepNotFoundError, "typo"),
    ({"steps": [0, 99]}, casstore.StepNotFoundError, "99"),
    # steps="1" ended in "'in <string>' requires string as left operand, not int"
    ({"steps": "1"}, TypeError, "steps='1'"), ({"steps": 1}, TypeError, "steps=1"),
    ({"runs": "default"}, TypeError, "runs='default'"),
    ({"steps": [0, 1.0]}, ValueError, "invalid step 1.0")])
def test_a_missing_run_or_step_fails_before_anything_is_written(tmp_path, kwargs, error,
                                                                named):
    src = LocalStore(tmp_path / "src")
    shared_steps(src, n=2)
    with pytest.raises(error, match=named):
        casstore.copy(src, tmp_path / "dst", **kwargs)
    assert not (tmp_path / "dst").exists()



def test_an_invalid_source_manifest_fails_before_anything_is_written(tmp_path):
    """The source's manifests are read while the destination is set up: a damaged one still
    stops the copy before the destination gets anything, not even its config object."""
    src = LocalStore(tmp_path / "src")
    shared_steps(src, n=2)
    src.put(manifest_key("default", 1), b"\x93not a manifest")
    with pytest.raises(casstore.ManifestError, match="step 1"):
        casstore.copy(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
    existing = LocalStore(tmp_path / "existing")
    casstore.copy(src, existing, steps=[0])
    before = sorted(info.key for info in existing.list(""))
    with pytest.raises(casstore.ManifestError, match="step 1"):
        casstore.copy(src, existing)
    assert sorted(info.key for info in existing.list("")) == before  # the lock released too

class Recording(CountingStore):
    """Records each put with the number of puts in flight at its start."""

    def __init__(self, inner, delay_s=0.0):
        super().__init__(inner)
        self.delay_s, self.in_flight, self.peak = delay_s, 0, 0
        self.order: list[str] = []
        self.guard = threading.Lock()

    def _put(self, key, data, *, exclusive):
        with self.guard:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            time.sleep(self.delay_s)
            super()._put(key, data, exclusive=exclusive)
        finally:
            with self.guard:
                self.in_flight -= 1
                self.order.append(key)


def test_steps_of_one_new_chunk_each_go_through_one_pool(tmp_path):
    src = MemoryStore()
    for step in range(8):
        casstore.save(src, step, {"w": np.full(1000, step, np.float32)})
    dst = Recording(MemoryStore(), delay_s=0.05)
    info = casstore.copy(src, dst, max_workers=8)
    assert info.chunks_copied == 8
    assert len(info.steps_copied) == 8
    assert dst.peak > 1  # chunks of different steps were in flight together


def test_manifests_are_written_in_step_order_as_soon_as_their_chunks_are_in(tmp_path):
    src = MemoryStore()
    shared_steps(src, n=4)
    dst = Recording(MemoryStore())
    casstore.copy(src, dst, max_workers=1)
    manifests = [(i, parse_manifest_key(k)[1]) for i, k in enumerate(dst.order)
                 if parse_manifest_key(k)]
    assert [s for _, s in manifests] == [0, 1, 2, 3]
    for position, step in manifests:  # every object of the step came before, none after
        needed = {r.key for leaf in casstore.read_manifest(src, step).leaves for r in leaf.chunks}
        assert needed <= set(dst.order[:position])
    chunk_positions = [i for i, k in enumerate(dst.order) if k.startswith("chunks/")]
    assert manifests[0][0] < chunk_positions[-1]  # step 0 committed before the last chunk


def test_a_destination_step_deleted_while_the_copy_plans_is_copied_again(tmp_path):
    """Retention deleted a destination step between the copy's listing and its read of that
    step's manifest: the copy raised a bare ObjectNotFoundError and copied nothing."""
    src = LocalStore(tmp_path / "src")
    for step in range(3):
        casstore.save(src, step, {"w": np.full(1000, step, np.float32)})
    casstore.copy(src, tmp_path / "dst", steps=[0, 1])

    class Deleting(LocalStore):  # step 0 goes just as the copy reads what the destination has
        def get_many(self, keys):
            self.delete(manifest_key("default", 0))
            return super().get_many(keys)

    info = casstore.copy(src, Deleting(tmp_path / "dst"))
    assert info.steps_copied == (("default", 0), ("default", 2))
    assert info.steps_skipped == (("default", 1),)
    for step in range(3):
        assert (casstore.restore(tmp_path / "dst", step)["w"] == step).all()


def test_progress_reports_objects_bytes_and_steps(tmp_path):
    src = MemoryStore()
    shared_steps(src, n=3)
    seen = []
    info = casstore.copy(src, MemoryStore(), progress=seen.append)
    last = seen[-1]
    assert last.chunks_done == last.chunks_total == info.chunks_copied
    assert last.bytes_done == info.bytes_copied
    assert last.steps_done == last.steps_total == 3
    assert [p.chunks_done for p in seen] == sorted(p.chunks_done for p in seen)


def _damage(store, step, how, run="default"):
    cid = sorted(casstore.read_manifest(store, step, run=run).chunk_ids())[0]
    path = store._path(f"chunks/{cid[:2]}/{cid[2:]}")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data = data[:-10] if how == "truncate" else data[:-1] + bytes([data[-1] ^ 1])
    with open(path, "wb") as f:
        f.write(bytes(data))
    return cid


def test_the_framing_check_refuses_a_truncated_object_without_decoding(tmp_path):
    src = LocalStore(tmp_path / "src")
    casstore.save(src, 1, {"x": np.arange(100_000)})
    cid = _damage(src, 1, "truncate")
    with pytest.raises(casstore.CorruptChunkError, match="bad chunk object") as info:
        casstore.copy(src, tmp_path / "dst")
    assert info.value.chunk_id == cid
    assert info.value.step == 1
    assert casstore.list_steps(tmp_path / "dst") == []


@pytest.mark.parametrize("array", [np.arange(10.0), np.zeros(100_000),
                                   np.random.default_rng(0).normal(0, 0.02, 300_000)
                                   .astype(np.float32)], ids=["tiny", "zeros", "planes"])
def test_the_framing_check_finds_a_zstd_frame_cut_short_and_takes_what_readers_take(array):
    """Each zstd frame's blocks are walked (RFC 8878 §3.1.1.2): a body that ended early
    anywhere, even inside a frame whose header is intact, is refused; the whole object passes,
    and so do bytes after a frame within its stored length, which readers ignore (format.md
    §3.2): copy refused a chunk that restore and verify took (exploratory session's repro).
    Past the last plane of codec 5 they break its plane table, which readers refuse too."""
    from casstore._codec import chunk_id, decode_chunk, encode_chunk
    from casstore._framing import check_framing

    raw = memoryview(array.tobytes())
    data = bytes(encode_chunk(raw, element_size=array.itemsize))
    assert data[5] != 0  # zstd frames (codec 1 or 5), not raw bytes
    check_framing(data, chunk_id(raw), len(raw))
    for damaged in [data[:n] for n in (len(data) - 1, len(data) - 4, len(data) * 2 // 3,
                                       len(data) // 2)]:
        with pytest.raises(casstore.CorruptChunkError, match="bad chunk object"):
            check_framing(damaged, chunk_id(raw), len(raw))
    longer = data + b"\0" * 8
    try:
        decoded = decode_chunk(longer, chunk_id(raw), len(raw))
    except casstore.CorruptChunkError:
        with pytest.raises(casstore.CorruptChunkError, match="bad chunk object"):
            check_framing(longer, chunk_id(raw), len(raw))
    else:
        assert bytes(decoded) == bytes(raw)
        check_framing(longer, chunk_id(raw), len(raw))
    assert (data[5] == 1) == (array.size < 300_000)  # both ways are met: codec 1 and 5


def test_steps_that_need_an_unusable_object_are_left_out_and_the_rest_copied(tmp_path):
    """A recovery copies the healthy rest: the steps of other runs, and later steps of the
    same run that do not need the damaged object, commit; the error names what was not."""
    src = LocalStore(tmp_path / "src")
    rng = np.random.default_rng(0)
    for run in ("a", "b"):
        casstore.save(src, 0, {"x": rng.normal(size=50_000)}, run=run)
    casstore.save(src, 1, {"x": rng.normal(size=50_000)}, run="a")  # needs none of step 0's
    cid = _damage(src, 0, "truncate", run="a")
    with pytest.raises(casstore.CorruptChunkError,
                       match=r"1 step\(s\) not copied \(a@0\), the other 2 copied") as info:
        casstore.copy(src, tmp_path / "dst")
    assert (info.value.run, info.value.step, info.value.chunk_id) == ("a", 0, cid)
    assert casstore.list_steps(tmp_path / "dst", run="a") == [1]
    assert casstore.list_steps(tmp_path / "dst", run="b") == [0]
    for run, step in (("a", 1), ("b", 0)):
        assert casstore.restore(tmp_path / "dst", step, run=run)["x"].tobytes() == (
            casstore.restore(src, step, run=run)["x"].tobytes())
    assert casstore.verify(tmp_path / "dst").ok


def test_a_step_the_source_deletes_during_the_copy_is_not_called_damage(tmp_path, monkeypatch,
                                                                        caplog):
    """The README's `casstore copy` after each save, from a live source: its retention deleted
    step 0 and its GC collected the chunk after the copy read the manifests. The copy raised
    CorruptChunkError ("source chunk unusable ... run casstore verify"), though verify of the
    source is clean. The step is named in a warning; the rest is copied."""
    src, dst = LocalStore(tmp_path / "src"), tmp_path / "dst"
    rng = np.random.default_rng(0)
    for step in range(3):
        casstore.save(src, step, {"x": rng.normal(size=50_000)}, delta=False)
    copy_selected = casstore._copy.copy_selected

    def after_the_sources_retention(*args, **kwargs):
        casstore.delete(src, 0)
        casstore.gc(src, grace_period_s=0)
        return copy_selected(*args, **kwargs)

    monkeypatch.setattr(casstore._copy, "copy_selected", after_the_sources_retention)
    info = casstore.copy(src, dst)
    assert info.steps_copied == (("default", 1), ("default", 2))
    assert "step 0, deleted from" in caplog.text
    assert casstore.verify(src).ok
    assert casstore.verify(dst).ok


def test_verify_true_refuses_a_changed_byte_the_framing_check_lets_through(tmp_path):
    src = LocalStore(tmp_path / "src")
    casstore.save(src, 1, {"x": np.random.default_rng(0).normal(size=50_000)})
    cid = _damage(src, 1, "flip")
    with pytest.raises(casstore.CorruptChunkError) as info:
        casstore.copy(src, tmp_path / "checked", verify=True)
    assert info.value.chunk_id == cid
    assert casstore.list_steps(tmp_path / "checked") == []
    casstore.copy(src, tmp_path / "fast")  # framing intact: passed on as stored
    with pytest.raises(casstore.CorruptChunkError, match=cid):
        casstore.restore(tmp_path / "fast", 1)  # and caught by the id check on every read


@pytest.fixture
def flipping_s3(object_servers):
    """``(proxy, the store through a proxy that flips bytes in transit, the same store
    direct)`` on a fresh SeaweedFS bucket; small deadlines keep a failing test short."""
    server = object_servers["seaweedfs"]
    url = server.url()
    with fault_proxy(server.endpoint_url) as proxy:
        through = FsspecStore.from_url(url, **{**server.storage_options,
                                               "endpoint_url": proxy.endpoint_url},
                                       request_timeout_s=2, operation_timeout_s=10)
        through.policy.backoff_s = 0.05
        yield proxy, through, FsspecStore.from_url(url, **server.storage_options)


def _stored_checksums(store: FsspecStore, key: str) -> tuple:
    """(CRC32C, CRC32) the S3 store keeps for ``key`` (base64; None where it keeps none)."""
    bucket, prefix, _ = store.fs.split_path(store.root)
    head = store.fs.call_s3("head_object", Bucket=bucket, Key=f"{prefix}/{key}",
                            ChecksumMode="ENABLED")
    return head.get("ChecksumCRC32C"), head.get("ChecksumCRC32")


def test_s3_uploads_carry_a_crc32c_that_the_store_keeps(tmp_path, object_servers):
    """With awscrt installed (the s3 extra), every upload of a save, a copy and a single put
    carries a CRC32C (not botocore's default CRC32), and the store keeps it for downloads; a
    client told to send checksums only where required gets none forced on it."""
    import base64

    from awscrt.checksums import crc32c

    server = object_servers["seaweedfs"]
    store = FsspecStore.from_url(server.url(), **server.storage_options)
    x = np.random.default_rng(0).normal(size=50_000).astype(np.float32)
    casstore.save(tmp_path / "src", 0, {"x": x})
    casstore.copy(tmp_path / "src", store)
    casstore.save(store, 1, {"x": x + 1})
    keys = [info.key for info in store.list("")]
    assert len(keys) >= 5  # config, 2 manifests, 2 chunks
    for key in keys:
        want = base64.b64encode(crc32c(store.get(key)).to_bytes(4, "big")).decode()
        assert _stored_checksums(store, key) == (want, None), key
    plain = FsspecStore.from_url(server.url(), **server.storage_options, config_kwargs={
        "request_checksum_calculation": "when_required"})
    plain.put("k", b"data")
    assert _stored_checksums(plain, "k") == (None, None)


def test_a_byte_flipped_in_transit_to_s3_is_refused_by_the_store(tmp_path, flipping_s3):
    """The framing-only copy sends each object with a CRC32C the store checks: a changed byte
    is refused, retried, and never stored."""
    proxy, through, direct = flipping_s3
    x = np.random.default_rng(0).normal(size=50_000).astype(np.float32)  # one chunk object
    casstore.save(tmp_path / "src", 0, {"x": x})
    proxy.set("flip", only=b"/chunks/")
    with pytest.raises(OSError, match="did not match"):
        casstore.copy(tmp_path / "src", through)
    assert proxy.faults["flip"] == CHECKSUM_ATTEMPTS  # sent 3 times, refused 3 times
    assert casstore.list_steps(direct) == []
    assert list(list_chunk_objects(direct)) == []  # nothing damaged (or at all) was stored
    proxy.set(None)
    casstore.copy(tmp_path / "src", through)
    assert casstore.restore(direct, 0)["x"].tobytes() == x.tobytes()


def test_a_byte_flipped_in_transit_from_s3_fails_the_copy_and_a_tier_has_the_chunk(
        tmp_path, flipping_s3):
    """A download is checked against the CRC32C the store keeps, without decoding: the copy
    names the chunk and writes no step; a tiered restore takes the chunk from the other tier."""
    proxy, through, direct = flipping_s3
    trees = shared_steps(LocalStore(tmp_path / "local"), n=1)
    casstore.copy(tmp_path / "local", direct)
    proxy.set("flip", only=b"/chunks/")
    with pytest.raises(casstore.CorruptChunkError, match="transfer checksum 3 time") as info:
        casstore.copy(through, tmp_path / "back")
    assert info.value.step == 0
    assert info.value.chunk_id in casstore.read_manifest(direct, 0).chunk_ids()
    assert casstore.list_steps(tmp_path / "back") == []
    with pytest.raises(casstore.CorruptChunkError, match="transfer checksum"):
        casstore.restore(through, 0)
    tiered = casstore.FallbackStore(through, [tmp_path / "local"])
    restored = casstore.restore(tiered, 0)
    assert all(restored[k].tobytes() == trees[0][k].tobytes() for k in trees[0])
    assert tiered.objects_recovered == len(casstore.read_manifest(direct, 0).chunk_ids())


def test_a_copy_reads_the_manifests_of_its_steps_at_once(tmp_path):
    """Planning reads the selected manifests concurrently: on a remote store, a copy of many
    steps does not pay one round trip per step in turn."""
    class SlowManifests(MemoryStore):
        def __init__(self):
            super().__init__()
            self.in_flight = self.peak = 0
            self.lock = threading.Lock()

        def head(self, key, nbytes):
            if key.endswith(".manifest"):
                with self.lock:
                    self.in_flight += 1
                    self.peak = max(self.peak, self.in_flight)
                time.sleep(0.2)
                with self.lock:
                    self.in_flight -= 1
            return super().head(key, nbytes)

    src = SlowManifests()
    for step in range(8):
        casstore.save(src, step, {"x": np.arange(10.0) + step})
    dst = MemoryStore()
    assert casstore.copy(src, dst).steps_copied == tuple(("default", s) for s in range(8))
    assert src.peak > 1
    assert casstore.restore(dst, 7)["x"].tolist() == (np.arange(10.0) + 7).tolist()


def test_a_copy_stopped_by_ctrl_c_commits_nothing_its_transfers_finish_later(monkeypatch):
    """Ctrl-C returns from copy without waiting for the transfers in flight; when they end
    later (after the caller released the destination's lock) they write no manifest, though
    every object of the step is then there."""
    src, dst, arrived = MemoryStore(), GatedStore(), []
    casstore.save(src, 0, {"w": np.arange(4096.0)}, chunk_size_bytes=16_384, delta=False)
    assert len(list(list_chunk_objects(src))) == 2
    real, put = casstore._copy.bounded_map, dst._put

    def counted(key, data, *, exclusive):
        arrived.append(key)
        put(key, data, exclusive=exclusive)

    dst._put = counted

    def interrupted(fn, items, max_workers, *args):
        if fn.__name__ != "transfer":
            return real(fn, items, max_workers, *args)
        items = list(items)

        def stream():
            yield from items  # both objects in flight, held at the gate
            deadline = time.monotonic() + 10
            while len(arrived) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            raise KeyboardInterrupt
        return real(fn, stream(), 2)

    monkeypatch.setattr(casstore._copy, "bounded_map", interrupted)
    with pytest.raises(KeyboardInterrupt):
        casstore.copy(src, dst)
    dst.gate.set()  # the two transfers end now
    deadline = time.monotonic() + 10
    while len(list(list_chunk_objects(dst))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert len(list(list_chunk_objects(dst))) == 2
    assert casstore.list_steps(dst) == []


# moto takes casstore's S3 path as SeaweedFS does (one CopyObject either way): once, into
# another bucket (docs/tiers.md names the three servers).
@pytest.mark.parametrize(("server", "where"), [
    ("seaweedfs", "another prefix"), ("seaweedfs", "another bucket"), ("moto", "another bucket"),
    ("fake-gcs", "another prefix"), ("fake-gcs", "another bucket")])
def test_a_copy_within_one_service_is_server_side(tmp_path, object_servers, monkeypatch,
                                                  server, where):
    """Between two paths of one S3 or GCS service reached with the same options, the service
    copies every chunk object (CopyObject, rewrite): this process reads none of them; the
    counts are those of any copy and the destination restores bit-exact. ``verify=True``
    reads every object through the process instead."""
    srv = object_servers[server]
    src = object_store(srv)
    trees = shared_steps(src, n=3)
    url = srv.url() if where == "another prefix" else (
        f"{srv.protocol}://{srv.new_bucket()}/repo")
    dst = FsspecStore.from_url(url, **srv.storage_options, request_timeout_s=7)
    assert dst.fs is not src.fs  # another client (other timeouts): one service all the same
    chunk_reads = []
    cat_file = src.fs._cat_file

    async def counting(path, *args, **kwargs):
        chunk_reads.extend([path] if "/chunks/" in path else [])
        return await cat_file(path, *args, **kwargs)

    monkeypatch.setattr(src.fs, "_cat_file", counting)
    monkeypatch.setattr(dst.fs, "_cat_file", counting)
    s3_head = casstore.store._clients.s3_head  # S3's reads bounded by a size (FsspecStore.head)

    async def counting_heads(fs, path, *args, **kwargs):
        chunk_reads.extend([path] if "/chunks/" in path else [])
        return await s3_head(fs, path, *args, **kwargs)

    monkeypatch.setattr(casstore.store._clients, "s3_head", counting_heads)
    info = casstore.copy(src, dst)
    objects = {o.key: o.size for o in list_chunk_objects(src)}
    assert chunk_reads == []
    assert (info.chunks_copied, info.bytes_copied) == (len(objects), sum(objects.values()))
    assert {o.key: o.size for o in list_chunk_objects(dst)} == objects
    for step, tree in enumerate(trees):
        got = casstore.restore(dst, step)
        assert all(got[k].tobytes() == tree[k].tobytes() for k in tree)
    chunk_reads.clear()  # the restores read dst's chunks
    checked = FsspecStore.from_url(srv.url(), **srv.storage_options)
    casstore.copy(src, checked, verify=True)
    assert sorted(chunk_reads) == sorted(f"{src.root}/{k}" for k in objects)


@pytest.mark.parametrize("server", ["seaweedfs", "fake-gcs"])
def test_a_chunk_cut_short_at_the_source_is_not_copied_by_the_service(object_servers, server):
    """A chunk object cut to half its bytes was copied by the service (CopyObject, rewrite)
    and its step committed, which verify then called corrupt (exploratory session's repro);
    the size check sends it through this process, which refuses it as a copy to another
    service does."""
    srv = object_servers[server]
    src = object_store(srv)
    casstore.save(src, 0, {"w": np.arange(4096, dtype=np.float32)})
    (key,) = [o.key for o in list_chunk_objects(src)]
    data = src.get(key)
    src.put(key, data[:len(data) // 2])
    dst = FsspecStore.from_url(srv.url(), **srv.storage_options)
    with pytest.raises(casstore.CorruptChunkError, match=r"step 0"):
        casstore.copy(src, dst)
    assert casstore.list_steps(dst) == []


def test_a_server_side_copy_needs_the_same_endpoint_and_credentials(object_servers):
    """Stores whose options differ in more than client settings (timeouts, pools), or whose
    aiobotocore sessions differ, are not one service to a copy: it reads and writes their
    objects itself."""
    from casstore.store._clients import same_service

    server = object_servers["seaweedfs"]
    opts = server.storage_options
    a = FsspecStore.from_url(server.url(), **opts, skip_instance_cache=True)
    b = FsspecStore.from_url(server.url(), **opts, request_timeout_s=3, skip_instance_cache=True)
    other = FsspecStore.from_url(server.url(), **{**opts, "endpoint_url": opts[
        "endpoint_url"].replace("127.0.0.1", "localhost")})
    assert a.fs is not b.fs
    assert same_service(a.fs, b.fs)
    assert not same_service(a.fs, other.fs)
    own_session = FsspecStore.from_url(server.url(), **opts, session=None)  # its own credentials
    assert not same_service(a.fs, own_session.fs)
    assert other.server_side_copy(a, "config") is None
    assert MemoryStore().server_side_copy(a, "config") is None


def test_the_cli_copies_server_side_and_reads_every_object_with_verify(object_servers,
                                                                        monkeypatch):
    """``casstore copy`` within one service copies server-side, also through the counting
    wrapper a terminal gets (its progress counts the copied bytes); ``--verify`` reads and
    decodes every object."""
    from click.testing import CliRunner

    from casstore import cli

    server = object_servers["seaweedfs"]
    src = object_store(server)
    shared_steps(src, n=2)
    objects = {o.key: o.size for o in list_chunk_objects(src)}
    opts = [f"-o{k}={v}" for k, v in server.storage_options.items()]
    wrapped = []

    def counting(store):
        wrapped.append(CountingStore(store))
        return wrapped[-1]

    monkeypatch.setattr("casstore.cli._check.counted", counting)  # as on a terminal
    gets = []
    cat_file = type(src.fs)._cat_file

    async def spy(fs, path, *args, **kwargs):  # any client the command makes
        gets.extend([path] if "/chunks/" in path else [])
        return await cat_file(fs, path, *args, **kwargs)

    monkeypatch.setattr(type(src.fs), "_cat_file", spy)
    s3_head = casstore.store._clients.s3_head  # S3's reads bounded by a size (FsspecStore.head)

    async def spy_heads(fs, path, *args, **kwargs):
        gets.extend([path] if "/chunks/" in path else [])
        return await s3_head(fs, path, *args, **kwargs)

    monkeypatch.setattr(casstore.store._clients, "s3_head", spy_heads)
    for flags, reads in (([], 0), (["--verify"], len(objects))):
        dst = server.url()
        gets.clear()
        result = CliRunner().invoke(cli.main, ["copy", src.url, dst, *opts, *flags])
        assert result.exit_code == 0, result.output
        assert len(gets) == reads
        assert wrapped[-1].bytes_written >= sum(objects.values())
        got = FsspecStore.from_url(dst, **server.storage_options)
        assert {o.key: o.size for o in list_chunk_objects(got)} == objects


def test_a_server_side_copy_of_delta_chains_and_of_a_lost_object(object_servers):
    """Within one service: delta objects and their bases (whose size no manifest gives: looked
    up) are copied and counted like any; a source object that is gone fails the steps that
    need it, naming it, and the other steps are copied."""
    server = object_servers["seaweedfs"]
    src = object_store(server)
    base = np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)
    trees = [{"w": np.where(np.arange(base.size).reshape(base.shape) % 32 < s,
                            base + np.float32(1e-6) * s, base)} for s in range(3)]
    for step, tree in enumerate(trees):
        casstore.save(src, step, tree, chunk_size_bytes=65_536)
    assert any(r.base for leaf in casstore.read_manifest(src, 2).leaves for r in leaf.chunks)
    dst = object_store(server, request_timeout_s=7)
    info = casstore.copy(src, dst)
    objects = {o.key: o.size for o in list_chunk_objects(src)}
    assert (info.chunks_copied, info.bytes_copied) == (len(objects), sum(objects.values()))
    for step, tree in enumerate(trees):
        assert casstore.restore(dst, step)["w"].tobytes() == tree["w"].tobytes()
    casstore.save(src, 3, {"w": base + 1}, chunk_size_bytes=65_536, delta=False)
    lost = casstore.read_manifest(src, 3).leaves[0].chunks[0]
    src.delete(lost.key)
    other = object_store(server)
    with pytest.raises(casstore.CorruptChunkError, match="source chunk unusable") as e:
        casstore.copy(src, other)
    assert (e.value.step, e.value.chunk_id) == (3, lost.id)
    assert casstore.list_steps(other) == [0, 1, 2]


def test_a_copy_from_no_repository_or_into_itself_is_refused_writing_nothing(tmp_path):
    """Copying from a path without a repository made an empty one at the destination, and a
    repository copied into a path inside itself (exploratory session's repros)."""
    with pytest.raises(casstore.StepNotFoundError, match="no casstore repository here"):
        casstore.copy(tmp_path / "nothing", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
    casstore.save(tmp_path / "repo", 0, {"w": np.arange(3)})
    before = sorted(p for p in (tmp_path / "repo").rglob("*"))
    for dst in ("repo", "repo/nested", "."):
        with pytest.raises(ValueError, match="one repository, or one inside the other"):
            casstore.copy(tmp_path / "repo", tmp_path / dst)
    assert sorted(p for p in (tmp_path / "repo").rglob("*")) == before


def test_one_url_on_two_services_is_two_repositories_to_copy_between():
    """s3://ckpt/run on one S3 service and on another (a migration from an on-premises
    service to a cloud) were refused as one repository: locations name no endpoint (review).
    No request is made: the refusal came first."""
    from casstore.store import nested

    def s3(endpoint):
        return FsspecStore.from_url("s3://ckpt/run", endpoint_url=endpoint, anon=True,
                                    skip_instance_cache=True)

    assert not nested(s3("http://127.0.0.1:9"), s3("http://127.0.0.2:9"))
    assert nested(s3("http://127.0.0.1:9"), s3("http://127.0.0.1:9"))
    assert nested(s3("http://127.0.0.1:9"), FsspecStore.from_url(
        "s3://ckpt/run/inner", client_kwargs={"endpoint_url": "http://127.0.0.1:9"}, anon=True))
    # one service however spelled, and where one names none (the provider's own, or the
    # environment's: it may be the other), one repository: as both tiers retention would
    # delete the persisted steps (review)
    assert nested(s3("http://127.0.0.1:9"), s3("HTTP://127.0.0.1:9/"))
    assert nested(s3("http://host"), s3("http://host:80"))
    assert nested(s3("http://127.0.0.1:9"), FsspecStore.from_url("s3://ckpt/run", anon=True))
