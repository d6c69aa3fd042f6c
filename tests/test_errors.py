"""Errors: missing and existing steps, corrupt chunks and manifests, mismatched targets."""

import os
import re
import shutil
import time
import types

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest

import casstore
from casstore._layout import chunk_key, manifest_key
from casstore.store import LocalStore, MemoryStore

from conftest import BACKENDS, repack


@pytest.fixture
def saved(repo_store):
    tree = {"params": {"w": np.arange(20000, dtype=np.float32).reshape(100, 200),
                       "b": np.ones(7, np.float32)},
            "opt": {"mu": np.zeros((100, 200), np.float32)}, "step": 3}
    casstore.save(repo_store, 5, tree, chunk_size_bytes=8000)
    return repo_store, tree


def first_chunk(store, path="params/w"):
    leaf = next(x for x in casstore.read_manifest(store, 5).leaves if x.path == path)
    return leaf.chunks[0].id


def test_missing_step_and_empty_repository(saved, tmp_path):
    store, _ = saved
    with pytest.raises(casstore.StepNotFoundError) as info:
        casstore.restore(store, 6)
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.step == 6
    assert "step 6" in str(info.value)
    assert store.url in str(info.value)
    with pytest.raises(casstore.StepNotFoundError, match=r"no committed step.*run 'other'"):
        casstore.restore(store, run="other")
    empty = LocalStore(tmp_path / "empty")
    with pytest.raises(casstore.StepNotFoundError,
                       match=rf"no casstore repository here \(url '{re.escape(empty.url)}'"):
        casstore.restore(empty)
    assert casstore.list_steps(empty) == []
    assert casstore.latest_step(empty) is None
    with pytest.raises(casstore.StepNotFoundError, match=r"no such step.*step 4\)"):
        casstore.delete(store, 4)


@pytest.mark.parametrize("repo_store", BACKENDS, indirect=True)  # moto too: the
# create-only write finds the key present (conftest.STORE_BACKENDS)
def test_existing_step_is_refused_and_unchanged(saved):
    store, tree = saved
    before = {i.key: store.get(i.key) for i in store.list()}
    other = {"params": {"w": np.full((100, 200), 9, np.float32)}}
    with pytest.raises(casstore.StepAlreadyExistsError) as info:
        casstore.save(store, 5, other)
    assert isinstance(info.value, FileExistsError)
    assert isinstance(info.value, ValueError)  # what orbax raises: code for orbax catches it
    assert info.value.step == 5
    assert {i.key: store.get(i.key) for i in store.list()} == before
    np.testing.assert_array_equal(casstore.restore(store, 5)["params"]["w"],
                                  tree["params"]["w"])


@pytest.mark.parametrize("repo_store", BACKENDS, indirect=True)  # moto too: the
# create-only write finds the key present (conftest.STORE_BACKENDS)
def test_concurrent_commit_loser_gets_step_already_exists(saved):
    store, _ = saved
    # The step check passes, then another writer commits first: the create-only put decides.
    data = store.get(manifest_key("default", 5))
    store.delete(manifest_key("default", 5))
    original_put = store.put_if_absent

    def racing_put(key, value):
        if key.endswith(".manifest"):
            original_put(key, data)  # the other writer wins the race
        original_put(key, value)

    store.put_if_absent = racing_put
    with pytest.raises(casstore.StepAlreadyExistsError,
                       match=r"committed by a concurrent save.*step 5\)"):
        casstore.save(store, 5, {"x": np.ones(3)})
    del store.put_if_absent
    assert store.get(manifest_key("default", 5)) == data


@pytest.mark.parametrize("repo_store", BACKENDS, indirect=True)  # 5 damages x 6 backends,
# as docs/reliability.md counts them
@pytest.mark.parametrize("damage", ["flip", "truncate", "swap", "delete", "garbage_header"])
def test_corrupt_chunks_raise_naming_step_path_and_chunk(saved, damage):
    store, _ = saved
    cid = first_chunk(store)
    key = chunk_key(cid)
    data = bytearray(store.get(key))
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 10]
    elif damage == "swap":
        data = bytearray(store.get(chunk_key(first_chunk(store, "opt/mu"))))
    elif damage == "garbage_header":
        data[:4] = b"XXXX"
    store.delete(key)
    if damage != "delete":
        store.put(key, bytes(data))
    expected = casstore.MissingChunkError if damage == "delete" else casstore.CorruptChunkError
    message = "missing" if damage == "delete" else "unusable chunk"
    with pytest.raises(expected, match=message) as info:
        casstore.restore(store, 5)
    err = info.value
    assert (err.step, err.key_path, err.chunk_id) == (5, "params/w", cid)
    # missing is a FileNotFoundError and never corruption; damaged bytes are a ValueError
    assert isinstance(err, FileNotFoundError if damage == "delete" else ValueError)
    assert isinstance(err, casstore.CorruptChunkError) == (damage != "delete")
    for part in ("step 5", "'params/w'", cid):
        assert part in str(err)
    # Leaves in other chunks still restore.
    assert casstore.restore(store, 5, paths=["opt"])["opt"]["mu"].shape == (100, 200)


@pytest.fixture
def raw_chunks(tmp_path, monkeypatch):
    """A repository of one uint8 leaf of random bytes in 4 raw chunks (codec 0: random bytes
    do not compress), its leaf, a copy of the repository, and the count of chunks a restore
    read straight into their destination (``LocalStore.get_split``)."""
    store = LocalStore(tmp_path / "repo")
    w = np.random.default_rng(0).integers(0, 256, 4 * 32_768, dtype=np.uint8)
    casstore.save(store, 5, {"w": w}, chunk_size_bytes=32_768)
    shutil.copytree(tmp_path / "repo", tmp_path / "copy")
    in_place = []
    split = LocalStore.get_split

    def spy(self, key, head, body):
        done = split(self, key, head, body)
        in_place.append(key) if done else None
        return done

    monkeypatch.setattr(LocalStore, "get_split", spy)
    return store, w, LocalStore(tmp_path / "copy"), in_place


def test_raw_chunks_are_read_straight_into_the_restored_array(raw_chunks):
    store, w, _, in_place = raw_chunks
    refs = casstore.read_manifest(store, 5).leaves[0].chunks
    assert all(store.get(r.key)[5] == 0 for r in refs)  # the header's codec byte: raw
    np.testing.assert_array_equal(casstore.restore(store, 5)["w"], w)
    assert sorted(in_place) == sorted(r.key for r in refs)


@pytest.mark.parametrize(("damage", "message"), [
    ("flip", "do not match their chunk id"), ("header", "bad chunk header"),
    ("codec", "zstd frame does not decode")])
def test_a_damaged_raw_chunk_read_in_place_raises_naming_it(raw_chunks, damage, message):
    store, w, copy, in_place = raw_chunks
    ref = casstore.read_manifest(store, 5).leaves[0].chunks[2]
    data = bytearray(store.get(ref.key))
    if damage == "flip":
        data[-100] ^= 0x10
    elif damage == "header":
        data[:4] = b"XXXX"
    else:  # a zstd chunk's header on raw bytes: read whole and decoded as zstd
        data[5] = 1
    store.delete(ref.key)
    store.put(ref.key, bytes(data))
    with pytest.raises(casstore.CorruptChunkError, match=message) as info:
        casstore.restore(store, 5)
    assert (info.value.step, info.value.key_path, info.value.chunk_id) == (5, "w", ref.id)
    tiered = casstore.FallbackStore(store, [copy])
    np.testing.assert_array_equal(casstore.restore(tiered, 5)["w"], w)
    assert tiered.objects_recovered == 1
    assert ref.key in in_place  # each damage found on the in-place read


def test_zstd_bomb_is_rejected_before_decompressing():
    import zstandard

    from casstore._codec import HEADER, MAGIC, decode_chunk
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 * 2**20))  # 64 MiB of zeros
    data = HEADER.pack(MAGIC, 1, 1, 0, 4096) + bomb
    with pytest.raises(casstore.CorruptChunkError, match="declares"):
        decode_chunk(data, "0" * 32, 4096)
    data = HEADER.pack(MAGIC, 1, 1, 0, 100) + bomb  # larger than any encoding of 100 bytes
    with pytest.raises(casstore.CorruptChunkError, match="larger than the 180 bytes"):
        decode_chunk(data, "0" * 32, 100)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "not_a_map", "version",
                                    "wrong_step", "bad_dtype", "gap", "overlap", "escape"])
def test_bad_manifests_raise_manifest_error(saved, damage):
    store, _ = saved
    key = manifest_key("default", 5)
    data = store.get(key)
    doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    w = next(x for x in doc["leaves"] if x["path"] == "params/w")
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = os.urandom(300)
    elif damage == "empty":
        data = b""
    else:
        if damage == "not_a_map":
            doc = [1, 2, 3]
        elif damage == "version":
            doc["version"] = 99
        elif damage == "wrong_step":
            doc["step"] = 6
        elif damage == "bad_dtype":
            w["dtype"] = "object"
        elif damage == "gap":
            w["chunks"].pop()
        elif damage == "overlap":
            w["chunks"][1]["start"] = [0, 0]
            w["chunks"][1]["stop"] = w["chunks"][0]["stop"]
        elif damage == "escape":
            w["chunks"][0]["id"] = "../../etc/passwd"
        data = repack(doc)
    store.delete(key)
    store.put(key, data)
    with pytest.raises(casstore.ManifestError) as info:
        casstore.restore(store, 5)
    assert info.value.step == 5
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("start", "stop"), [([1], [1000]), ([0], [999]), ([0], [1001])])
def test_a_single_chunk_that_does_not_cover_its_array_is_refused(repo_store, start, stop):
    casstore.save(repo_store, 1, {"x": np.arange(1000, dtype=np.float32)})
    key = manifest_key("default", 1)
    doc = msgpack.unpackb(repo_store.get(key), raw=False, strict_map_key=False)
    (ref,) = next(x for x in doc["leaves"] if x["path"] == "x")["chunks"]
    ref["start"], ref["stop"] = start, stop
    repo_store.delete(key)
    repo_store.put(key, repack(doc))
    with pytest.raises(casstore.ManifestError, match=r"gaps|out of bounds|past its raw bytes"):
        casstore.restore(repo_store, 1)


def test_unknown_repository_version_is_refused(saved):
    store, _ = saved
    config = msgpack.unpackb(store.get("config"))
    config["version"] = 2
    store.delete("config")
    store.put("config", msgpack.packb(config))
    with pytest.raises(casstore.ManifestError, match="version"):
        casstore.list_steps(store)
    with pytest.raises(casstore.ManifestError,
                       match=rf"repository version 2.*url '{re.escape(store.url)}'"):
        casstore.save(store, 9, {"x": np.ones(2)})


def test_mismatched_targets(saved):
    store, tree = saved
    target = jax.eval_shape(lambda: jax.tree.map(jnp.asarray, tree))
    wrong_shape = dict(target, params=dict(target["params"], w=jax.ShapeDtypeStruct((3,),
                                                                                    jnp.float32)))
    with pytest.raises(casstore.TargetMismatchError) as info:
        casstore.restore(store, 5, target=wrong_shape)
    assert info.value.key_path == "params/w"
    assert "(3,)" in str(info.value)
    missing = dict(target, extra=jax.ShapeDtypeStruct((2,), jnp.float32))
    with pytest.raises(casstore.TargetMismatchError, match="not in the checkpoint"):
        casstore.restore(store, 5, target=missing)
    subtree = {"params": target["params"]}
    with pytest.raises(casstore.TargetMismatchError, match="partial=True"):
        casstore.restore(store, 5, target=subtree)
    restored = casstore.restore(store, 5, target=subtree, partial=True)
    np.testing.assert_array_equal(restored["params"]["w"], tree["params"]["w"])
    with pytest.raises(casstore.TargetMismatchError,
                       match=r"no leaf matches the requested path.*key path 'nope'"):
        casstore.restore(store, 5, paths=["nope"])


def test_dtype_cast_on_restore(saved):
    store, tree = saved
    target = {"params": {"w": jax.ShapeDtypeStruct((100, 200), jnp.bfloat16),
                         "b": np.zeros(7, np.float16)},
              "opt": {"mu": jax.ShapeDtypeStruct((100, 200), jnp.float32)}, "step": 0}
    r = casstore.restore(store, 5, target=target)
    assert r["params"]["w"].dtype == jnp.bfloat16
    assert isinstance(r["params"]["w"], jax.Array)
    np.testing.assert_array_equal(np.asarray(r["params"]["w"]),
                                  tree["params"]["w"].astype(jnp.bfloat16))
    assert r["params"]["b"].dtype == np.float16
    assert isinstance(r["params"]["b"], np.ndarray)
    assert r["step"] == 3
    assert type(r["step"]) is int


def test_partial_restore_params_without_optimizer_state(saved):
    store, tree = saved
    params = casstore.restore(store, 5, paths=["params"])
    assert set(params) == {"params"}
    np.testing.assert_array_equal(params["params"]["b"], tree["params"]["b"])


def test_a_path_no_target_leaf_matches_is_an_error_as_without_a_target(saved):
    """With a target, a typo in paths returned the target as it was: abstract leaves where
    the weights should be, and no error."""
    store, tree = saved
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)
    for wrong in ("parms", "params/w/x"):
        for kwargs in ({}, {"target": target}):
            with pytest.raises(casstore.TargetMismatchError,
                               match=rf"no leaf .*matches the requested path.*'{wrong}'"):
                casstore.restore(store, 5, paths=[wrong], **kwargs)


def test_integer_numpy_and_jax_scalars_are_steps(tmp_path):
    """A train state's step is often a jax scalar: every call taking a step reads an integer
    numpy or jax scalar (0-d) as its int, and refuses bools, floats and 1-element arrays."""
    import jax.numpy as jnp

    url = str(tmp_path / "repo")
    info = casstore.save(url, np.int64(7), {"x": np.arange(3.0)})
    assert info.step == 7
    assert type(info.step) is int
    assert casstore.list_steps(url) == [7]
    assert casstore.read_manifest(url, jnp.int32(7)).step == 7
    assert casstore.restore(url, np.uint8(7))["x"].tolist() == [0.0, 1.0, 2.0]
    with casstore.CheckpointManager(url, max_to_keep=None) as mngr:
        assert mngr.should_save(jnp.int32(8))
        assert mngr.save(jnp.int32(8), {"x": np.ones(3)})
        mngr.wait_until_finished()
        assert mngr.all_steps() == [7, 8]
        assert not mngr.reached_preemption(jnp.int32(8))
        mngr.delete(np.int64(8))
        assert mngr.all_steps() == [7]
    casstore.delete(url, jnp.int32(7))
    assert casstore.list_steps(url) == []
    for step in (np.bool_(True), jnp.bool_(True), np.float32(7), np.array([7]), jnp.array([7]),
                 np.int64(-1)):
        with pytest.raises(ValueError, match="invalid step"):
            casstore.save(url, step, {"x": np.ones(1)})
    assert casstore.list_steps(url) == []


def test_invalid_arguments(saved):
    store, _ = saved
    for step in (-1, 1.5, True, 10**16):
        with pytest.raises(ValueError, match=re.escape(f"invalid step {step!r}")):
            casstore.save(store, step, {"x": np.ones(1)})
    for run in ("", "../x", "a/b", ".hidden"):
        with pytest.raises(ValueError, match=re.escape(f"invalid run name {run!r}")):
            casstore.save(store, 0, {"x": np.ones(1)}, run=run)
    with pytest.raises(ValueError, match="metadata"):
        casstore.save(store, 0, {"x": np.ones(1)}, metadata={"f": object()})
    with pytest.raises(ValueError, match="metadata cannot be saved: a dict key that is a tuple"):
        casstore.save(store, 0, {"x": np.ones(1)}, metadata={(1, 2): "x"})  # was msgpack's
    for size in (0, -16, 2**32, 1.5):  # ZeroDivisionError, or a ManifestError at the commit
        with pytest.raises(ValueError, match=re.escape(f"chunk_size_bytes must be an int in "
                                                       f"[1, 2**31], not {size!r}")):
            casstore.save(store, 0, {"x": np.ones(100, np.float32)}, chunk_size_bytes=size)
        with pytest.raises(ValueError, match="chunk_size_bytes must be"):
            casstore.CheckpointManager(store, chunk_size_bytes=size)
    with pytest.raises(ValueError, match=re.escape(
            "chunk_size_bytes=3 is smaller than one element of key path 'x' (float32, 4 bytes)")):
        casstore.save(store, 0, {"x": np.ones(100, np.float32)}, chunk_size_bytes=3)
    for inflight in (0, -1, 2**23, 1.5):  # a window of no chunk was taken as the default
        with pytest.raises(ValueError, match=re.escape(
                f"max_inflight_bytes={inflight!r} is less than one chunk")):
            casstore.save(store, 0, {"x": np.ones(100, np.float32)},
                          chunk_size_bytes=2**24, max_inflight_bytes=inflight)
    assert casstore.list_steps(store) == [5]


def test_read_only_store_restores_and_refuses_to_save(tmp_path):
    casstore.save(tmp_path / "r", 1, {"x": np.arange(5)})
    ro = LocalStore(tmp_path / "r", read_only=True)
    np.testing.assert_array_equal(casstore.restore(ro, 1)["x"], np.arange(5))
    with pytest.raises(casstore.ReadOnlyStoreError,
                       match=rf"store is read-only; nothing was saved \(url '{re.escape(ro.url)}'"
                       r", run 'default', step 2\)"):
        casstore.save(ro, 2, {"x": np.arange(5)})
    with pytest.raises(casstore.ReadOnlyStoreError,
                       match=rf"read-only; cannot write '{re.escape(manifest_key('default', 1))}'"):
        casstore.delete(ro, 1)
    assert casstore.list_steps(ro) == [1]


def test_delete_removes_only_the_manifest():
    store = MemoryStore()
    casstore.save(store, 1, {"x": np.arange(100_000)})
    chunks = [i.key for i in store.list("chunks/")]
    casstore.delete(store, 1)
    assert casstore.list_steps(store) == []
    assert [i.key for i in store.list("chunks/")] == chunks


@pytest.mark.parametrize("failure", ["timeout", "oserror"])
def test_a_failed_chunk_upload_names_its_key_path_and_commits_nothing(failure):
    """Uploads run on their own threads, after encoding: their errors still name the leaf."""

    class FailingPuts(MemoryStore):
        def put(self, key, data):
            if key.startswith("chunks/") and len(data) > 40_000:  # only the chunks of "big"
                if failure == "timeout":
                    raise casstore.StoreTimeoutError("no answer", key=key, url=self.url)
                raise OSError(28, "No space left on device")
            super().put(key, data)

    store = FailingPuts()
    casstore.save(store, 0, {"small": np.arange(10.0)})
    rng = np.random.default_rng(0)
    tree = {"small": np.arange(10.0), "big": rng.random(100_000, np.float32)}
    with pytest.raises((casstore.StoreTimeoutError, OSError)) as info:
        casstore.save(store, 1, tree, chunk_size_bytes=100_000)
    if failure == "timeout":
        assert info.value.key_path == "big"
        assert "big" in str(info.value)
    else:
        assert "while saving key path 'big'" in info.value.__notes__
    assert casstore.list_steps(store) == [0]
    np.testing.assert_array_equal(casstore.restore(store, 0)["small"], np.arange(10.0))


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9", "http://no-such-host.invalid:9000"])
def test_an_unreachable_store_fails_within_seconds_naming_it(endpoint):
    store = casstore.open_store("s3://bucket/repo", endpoint_url=endpoint, key="k", secret="s",
                                operation_timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(casstore.StoreUnreachableError, match="cannot connect") as info:
        casstore.list_steps(store)
    assert time.monotonic() - t0 < 30  # not the 60 s deadline (a few seconds when idle)
    assert isinstance(info.value, ConnectionError)
    assert info.value.url == "s3://bucket/repo"
    assert endpoint.split("//")[1] in str(info.value)


def test_a_missing_step_is_named_with_the_steps_the_run_has():
    store = MemoryStore()
    for step in (1, 2, 5):
        casstore.save(store, step, {"a": np.ones(3)})
    for call in (lambda: casstore.restore(store, 3), lambda: casstore.read_manifest(store, 3),
                 lambda: casstore.delete(store, 3)):
        with pytest.raises(casstore.StepNotFoundError,
                           match=r"^no such step; the run's steps are 1, 2, 5 \(.*step 3\)$"):
            call()
    for step in range(6, 20):
        casstore.save(store, step, {"a": np.ones(3)})
    with pytest.raises(casstore.StepNotFoundError,
                       match=r"steps are 1, 2, 5, \.\.\., 17, 18, 19 \(17 steps\)"):
        casstore.restore(store, 3)
    with pytest.raises(casstore.StepNotFoundError, match="the run has no committed step"):
        casstore.restore(store, 3, run="other")


class _SameKeyTwice:
    """A pytree node whose flatten gives both children the key ``z``."""

    def __init__(self, a, b):
        self.a, self.b = a, b


jax.tree_util.register_pytree_with_keys(
    _SameKeyTwice,
    lambda n: (((jax.tree_util.GetAttrKey("z"), n.a), (jax.tree_util.GetAttrKey("z"), n.b)),
               None),
    lambda _, children: _SameKeyTwice(*children),
    flatten_func=lambda n: ((n.a, n.b), None))


def test_two_leaves_on_one_key_path_are_refused_before_any_write(tmp_path):
    store = LocalStore(tmp_path / "repo")
    tree = {"n": _SameKeyTwice(np.ones(100_000), np.zeros(300_000))}
    with pytest.raises(casstore.UnsupportedLeafError, match="two leaves have this key path") as e:
        casstore.save(store, 0, tree)
    assert e.value.key_path == "n/z"
    assert [p for p in (tmp_path / "repo").rglob("*") if p.is_file() and "chunks" in p.parts] == []
    assert casstore.list_steps(store) == []


def test_a_key_path_over_4096_bytes_is_refused_before_any_write_naming_the_limit(tmp_path):
    store = LocalStore(tmp_path / "repo")
    with pytest.raises(casstore.UnsupportedLeafError,
                       match=r"a key path of 5000 bytes; format.md §5 allows at most 4096") as e:
        casstore.save(store, 0, {"k" * 5000: np.ones(3)})
    assert e.value.key_path == "k" * 100 + "..."  # named, not printed whole
    assert casstore.list_steps(store) == []
    assert [p for p in (tmp_path / "repo").rglob("*") if p.is_file() and "chunks" in p.parts] == []
    casstore.save(store, 0, {"k" * 4000: np.ones(3)})  # within the limit


def test_a_zero_size_array_of_a_huge_extent_is_refused_as_a_leaf_not_as_damage(tmp_path):
    """Its manifest failed casstore's own check of what a reader accepts: a ManifestError, which
    the CLI reports as a damaged repository (exit 1)."""
    store = LocalStore(tmp_path / "repo")
    with pytest.raises(casstore.UnsupportedLeafError, match=r"spans 4503599627370496 bytes, "
                       r"past casstore's limit of 2\*\*48 \(key path 'z'\)"):
        casstore.save(store, 0, {"z": np.zeros((2**20, 0, 2**30), np.float32)})
    assert casstore.list_steps(store) == []
    casstore.save(store, 0, {"z": np.zeros((2**20, 0, 2**25), np.float32)})  # 2**47 bytes
    assert casstore.restore(store, 0)["z"].shape == (2**20, 0, 2**25)


def test_a_complex_value_without_an_imaginary_part_restores_into_a_python_scalar(tmp_path):
    casstore.save(tmp_path, 0, {"c": 1 + 0j, "zc": np.array(2 + 0j, np.complex64),
                                "i": 3 - 1j})
    got = casstore.restore(tmp_path, target={"c": 0.0, "zc": 0, "i": 0j})
    assert got == {"c": 1.0, "zc": 2, "i": 3 - 1j}
    assert type(got["c"]) is float
    assert type(got["zc"]) is int
    with pytest.raises(casstore.TargetMismatchError, match="imaginary part") as e:
        casstore.restore(tmp_path, target={"i": 0.0}, partial=True)
    assert e.value.key_path == "i"


def test_key_path_prefixes_given_as_one_string_are_refused(tmp_path):
    casstore.save(tmp_path, 0, {"params": {"w": np.ones(3)}, "opt": np.zeros(2)})
    with pytest.raises(TypeError, match=re.escape("pass ['params'], not the string 'params'")):
        casstore.restore(tmp_path, paths="params")
    with pytest.raises(TypeError, match=re.escape("pass ['opt']")):
        casstore.export_tensors(tmp_path, 0, tmp_path / "out.npz", exclude="opt")
    assert list(casstore.restore(tmp_path, paths=["params"])) == ["params"]
    with pytest.raises(TypeError, match=r"a list of strings .*not 1 of type int"):
        casstore.restore(tmp_path, paths=[1])  # was: unsupported operand type(s) for +


def test_a_timeout_placed_at_a_step_and_key_path_names_its_object_once():
    """Each at() added "; object 'chunks/...'" again: a save's error named it three times."""
    e = casstore.StoreTimeoutError("no answer within the 3 s deadline", key="chunks/b1/89",
                                   url="s3://b/r")
    placed = e.at(run="default", step=1).at(key_path="w")
    assert str(placed) == ("no answer within the 3 s deadline; object 'chunks/b1/89' (url "
                           "'s3://b/r', run 'default', step 1, key path 'w')")
    assert placed.key == "chunks/b1/89"
    assert placed.__cause__.__cause__ is e


def test_a_tree_nested_too_deeply_is_refused_naming_its_path_briefly(tmp_path):
    """The error printed the whole key path: 300 levels of 'k' make 600 characters, and long
    keys far more."""
    tree = np.ones(2)
    for _ in range(300):
        tree = {"k" * 50: tree}
    with pytest.raises(casstore.UnsupportedLeafError,
                       match=r"nested deeper than 256 levels \(format.md §4.2\)") as e:
        casstore.save(tmp_path / "r", 0, tree)
    assert e.value.key_path == "/".join(["k" * 50] * 8) + "/..."
    assert len(str(e.value)) < 600


def test_a_tree_a_manifest_cannot_hold_is_refused_before_anything_is_written(tmp_path,
                                                                          monkeypatch):
    """Over a million leaves, or str and bytes leaves past the manifest's size limit, passed
    every check, wrote their chunks, then failed as a damaged manifest (ManifestError) at the
    commit (exploratory session's repro)."""
    blob = b"x" * (1 << 20)  # one object, many leaves: no memory of its own
    with pytest.raises(casstore.UnsupportedLeafError, match="the str and bytes leaves hold "
                                                           "135266304 bytes"):
        casstore.save(tmp_path, 0, {"w": np.ones(1000), **{f"b{i}": blob for i in range(129)}})
    from casstore import _save_leaves

    monkeypatch.setattr(_save_leaves, "MAX_LEAVES", 1000)  # a million leaves take 15 s
    with pytest.raises(casstore.UnsupportedLeafError, match="the tree has 1001 leaves; a "
                                                           "manifest holds at most 1000"):
        casstore.save(tmp_path, 0, list(range(1001)))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("option", "value", "message"), [
    ("zstd_level", 99, "zstd_level must be an int in"),
    ("zstd_level", "3", "zstd_level must be an int in"),
    ("max_workers", 0, "max_workers must be an int in [1, 4096], not 0"),
    ("max_workers", 1.5, "max_workers must be an int in"),
    ("pack_threshold_bytes", None, "pack_threshold_bytes must be a number of bytes in"),
    ("delta", "no", "delta must be a bool, not 'no'"),
    ("shuffle", "yes", "shuffle must be a bool or None"),
    ("dtypes", "w", "dtypes must be a mapping")])
def test_a_save_option_out_of_its_range_is_refused_before_anything_is_written(
        tmp_path, option, value, message):
    """Each was ignored (a zstd level where raw chunks were stored), taken for something else
    (0 workers for the default, "no" for true) or failed midway in the save (a level zstd
    does not have, where it compressed) (exploratory session's repros)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        casstore.save(tmp_path / "r", 0, {"w": np.ones(3)}, **{option: value})
    assert not (tmp_path / "r").exists()
    if option in ("zstd_level", "delta"):
        with pytest.raises(ValueError, match=re.escape(message)):
            casstore.AsyncCheckpointer(tmp_path / "r", **{option: value})
    info = casstore.save(tmp_path / "r", 0, {"w": np.ones(3)}, max_workers=np.int64(2))
    assert info.step == 0  # a numpy int is an int
    casstore.save(tmp_path / "r", 1, {"w": np.ones(3)}, delta=np.int64(1), zstd_level=-5,
                  pack_threshold_bytes=1e6, dtypes=types.MappingProxyType({}))  # (review)


def test_arguments_of_the_wrong_kind_are_named_before_any_work(tmp_path):
    """Each failed with a bare error naming no argument, some after the work: copy committed
    a step before it called progress=5, verify read every chunk first, gc took NaN seconds
    and deleted nothing (exploratory session's repros)."""
    url = tmp_path / "repo"
    casstore.save(url, 0, {"a": np.arange(3.0), "b": np.ones(2)})
    target = {"x": jax.ShapeDtypeStruct((3,), np.float64),
              "b": jax.ShapeDtypeStruct((2,), np.float64)}
    for call, error, message in [
            (lambda: casstore.restore(url, 0, target=target, transforms=[("a", "x")]),
             ValueError, "transforms must be a dict"),
            (lambda: casstore.restore(url, 0, target=target, transforms={"(a)": r"\2"}),
             ValueError, r"template '\\2' of '(a)' does not expand"),
            (lambda: casstore.restore(url, 0, fallback=5), TypeError,
             "url must be a str path or URL, a PathLike or a Store, not 5"),
            (lambda: casstore.verify(url, progress=5), TypeError, "progress must be callable"),
            (lambda: casstore.copy(url, tmp_path / "copy", progress=5), TypeError,
             "progress must be callable"),
            (lambda: casstore.gc(url, grace_period_s=float("nan")), ValueError,
             "grace_period_s must be a number of seconds >= 0, not nan"),
            (lambda: casstore.gc(url, lock_timeout_s="x"), ValueError,
             "lock_timeout_s must be a number of seconds >= 0, not 'x'")]:
        with pytest.raises(error, match=re.escape(message)):
            call()
    assert not (tmp_path / "copy").exists()
    restored = casstore.restore(url, 0, target=target, transforms={"(a)": "x"}, fallback=url)
    assert restored["x"].tolist() == [0.0, 1.0, 2.0]
    # what worked before these checks still does (review): any mapping, any iterable of
    # fallbacks, numpy seconds, an endless lock timeout
    restored = casstore.restore(url, 0, target=target, fallback=(u for u in [url]),
                                transforms=types.MappingProxyType({"(a)": "x"}))
    assert restored["x"].tolist() == [0.0, 1.0, 2.0]
    casstore.gc(url, grace_period_s=np.float32(60), lock_timeout_s=float("inf"))
