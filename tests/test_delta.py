"""Delta chunks (format.md §3.5): written, read, verified, copied and collected correctly."""

import functools
import math
import struct
from unittest import mock

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import casstore
from casstore import _manifest, _save_encode
from casstore._codec import HEADER, SAMPLE_BYTES, decode_chunk
from casstore._delta import CODEC_DELTA, MAX_RESTORE_OVERHEAD, RestoreBudget, decode_delta
from casstore._layout import DELTAS_PREFIX, chunk_key, manifest_key
from casstore.store import CountingStore, LocalStore, MemoryStore

from conftest import object_store, repack

CHUNK = 64 * 1024
WEIGHTS = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32) * 0.02


def trained(step: int, seed: int = 0) -> np.ndarray:
    """Weights after ``step`` small sparse updates: at step s, s elements in 32 (spread over
    every block) differ from step 0 in their low mantissa bits, so a delta against step 0 is
    small and fits the restore budget (``RestoreBudget``)."""
    noise = np.random.default_rng(seed + 1).standard_normal(WEIGHTS.shape).astype(np.float32)
    touched = np.arange(WEIGHTS.size).reshape(WEIGHTS.shape) % 32 < step
    return np.where(touched, WEIGHTS + np.float32(1e-4) * step * noise * 0.02, WEIGHTS)


def state(step: int) -> dict:
    """A train state: trained weights (numpy and sharded jax), a random moment, a counter."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    return {"w": trained(step),
            "w_jax": jax.device_put(trained(step, seed=7), NamedSharding(mesh, P("data", "model"))),
            "mu": np.random.default_rng(100 + step).standard_normal(30_000).astype(np.float32),
            "count": step}


def assert_bit_exact(restored: dict, expected: dict) -> None:
    assert restored.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, int):
            assert restored[key] == value
        else:
            assert np.asarray(restored[key]).tobytes() == np.asarray(value).tobytes(), key


def refs(store, step: int, path: str, run: str = "default"):
    leaf = next(x for x in casstore.read_manifest(store, step, run=run).leaves if x.path == path)
    return leaf.chunks


@pytest.mark.parametrize("backend", ["local", "memory", "seaweedfs", "fake-gcs"])
def test_changed_weights_are_stored_as_deltas_and_restore_bit_exact(backend, tmp_path, request):
    if backend in ("seaweedfs", "fake-gcs"):
        store = object_store(request.getfixturevalue("object_servers")[backend])
    else:
        store = LocalStore(tmp_path / "r") if backend == "local" else MemoryStore()
    whole = MemoryStore()
    infos = [casstore.save(store, s, state(s), chunk_size_bytes=CHUNK) for s in range(4)]
    plain = [casstore.save(whole, s, state(s), chunk_size_bytes=CHUNK, delta=False)
             for s in range(4)]
    assert infos[0].delta_chunks == 0
    assert plain[3].delta_chunks == 0
    for info, without in zip(infos[1:], plain[1:]):
        # w and w_jax: 4 + 8 blocks as deltas; mu is random: whole.
        assert info.delta_chunks == 12, info
        assert info.delta_saved_bytes > 0, info
        assert info.written_bytes < 0.8 * without.written_bytes, (info, without)
    for s in range(4):
        assert_bit_exact(casstore.restore(store, s), state(s))
    assert all(r.base is None for r in refs(store, 0, "w"))
    assert all(r.base is None for r in refs(store, 3, "mu"))
    # Depth 1: every later step's delta is against step 0's whole chunk.
    assert [r.base for r in refs(store, 3, "w")] == [r.id for r in refs(store, 0, "w")]
    assert any(i.key.startswith(DELTAS_PREFIX) for i in store.list(DELTAS_PREFIX))
    assert casstore.verify(store).ok
    target = jax.eval_shape(lambda: state(3))
    assert_bit_exact(casstore.restore(store, 3, target=target), state(3))


def test_manifest_versions_follow_the_use_of_deltas(tmp_path):
    store = MemoryStore()
    casstore.save(store, 0, state(0), chunk_size_bytes=CHUNK)
    casstore.save(store, 1, state(1), chunk_size_bytes=CHUNK, delta=False)
    casstore.save(store, 2, state(2), chunk_size_bytes=CHUNK)
    version = {s: _manifest.msgpack.unpackb(store.get(f"runs/default/steps/{s:016d}.manifest"))[
        "version"] for s in range(3)}
    assert version == {0: 1, 1: 1, 2: 2}
    assert all(r.base is None for r in refs(store, 1, "w"))


def test_an_older_reader_refuses_a_delta_step_and_never_returns_wrong_data(monkeypatch):
    store = MemoryStore()
    casstore.save(store, 0, state(0), chunk_size_bytes=CHUNK)
    casstore.save(store, 1, state(1), chunk_size_bytes=CHUNK)
    ref = refs(store, 1, "w")[0]
    # A version-1 chunk decoder given a delta object: an error, not bytes.
    with pytest.raises(casstore.CorruptChunkError, match="codec 3"):
        decode_chunk(store.get(ref.key), ref.id, ref.raw_bytes)
    # A version-1 manifest reader (it accepts version 1 only) refuses the step by name.
    monkeypatch.setattr(_manifest, "DELTA_VERSION", _manifest.VERSION)
    with pytest.raises(casstore.ManifestError, match="version 2") as e:
        casstore.restore(store, 1)
    assert e.value.step == 1
    assert_bit_exact(casstore.restore(store, 0), state(0))  # steps without deltas still read


def test_a_corrupt_base_is_reported_with_the_dependent_step_and_key_path(tmp_path):
    store = LocalStore(tmp_path / "r")
    for s in range(3):
        casstore.save(store, s, state(s), chunk_size_bytes=CHUNK)
    base = refs(store, 2, "w")[1].base
    path = tmp_path / "r" / chunk_key(base)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(casstore.CorruptChunkError, match=f"base chunk {base} is corrupt") as e:
        casstore.restore(store, 2)
    assert e.value.step == 2
    assert e.value.key_path == "w"
    report = casstore.verify(store)  # the base, once, with every step that needs it
    assert [(p.chunk_id, p.kind, p.key_path) for p in report.problems] == [
        (base, "corrupt", "w")]
    assert report.problems[0].needed_by == (("default", 0), ("default", 1), ("default", 2))
    assert report.chunks_unchecked == 2  # the deltas on it, in steps 1 and 2


def test_a_missing_base_is_found_by_verify_without_reading_data(tmp_path):
    store = MemoryStore()
    casstore.save(store, 0, state(0), chunk_size_bytes=CHUNK)
    casstore.save(store, 1, state(1), chunk_size_bytes=CHUNK)
    base = refs(store, 1, "w")[0].base
    store.delete(chunk_key(base))
    report = casstore.verify(store, read_data=False)
    assert [(p.chunk_id, p.kind, p.needed_by) for p in report.problems] == [
        (base, "missing", (("default", 0), ("default", 1)))], report.problems


def test_a_save_on_local_disk_does_not_reuse_a_delta_chunk_whose_base_was_lost(tmp_path):
    """On local disk a save checks the latest step's chunks (a stat each): an unchanged block
    stored as a delta whose base was lost is not reused; it is stored anew, whole."""
    store = LocalStore(tmp_path / "repo")
    for step in (0, 1):
        casstore.save(store, step, state(step), chunk_size_bytes=CHUNK)
    base = refs(store, 1, "w")[0].base
    assert base is not None
    store.delete(chunk_key(base))
    casstore.save(store, 2, state(1), chunk_size_bytes=CHUNK)  # w unchanged since step 1
    assert casstore.verify(store, 2).ok
    assert all(r.base != base for r in refs(store, 2, "w"))
    assert_bit_exact(casstore.restore(store, 2), state(1))


@pytest.mark.parametrize("dst_kind", ["memory", "seaweedfs"])
def test_copy_of_one_delta_step_brings_its_bases(dst_kind, tmp_path, request):
    src = LocalStore(tmp_path / "src")
    for s in range(3):
        casstore.save(src, s, state(s), chunk_size_bytes=CHUNK)
    dst = (object_store(request.getfixturevalue("object_servers")["seaweedfs"])
           if dst_kind == "seaweedfs" else MemoryStore())
    info = casstore.copy(src, dst, steps=[2])
    assert info.steps_copied == (("default", 2),)
    assert_bit_exact(casstore.restore(dst, 2), state(2))
    assert casstore.verify(dst).ok
    for r in refs(dst, 2, "w"):
        assert dst.exists(chunk_key(r.base))
        assert dst.exists(r.key)
    again = casstore.copy(src, dst, steps=[2])
    assert again.chunks_copied == 0
    assert again.steps_skipped == (("default", 2),)


def test_gc_keeps_the_bases_of_live_deltas_after_their_step_is_deleted(tmp_path):
    store = MemoryStore()
    for s in range(3):
        casstore.save(store, s, state(s), chunk_size_bytes=CHUNK)
    casstore.delete(store, 0)  # step 0 held the bases as whole chunks
    casstore.delete(store, 1)
    info = casstore.gc(store, grace_period_s=0)
    assert info.deleted_chunks > 0  # step 1's deltas and moments went
    assert_bit_exact(casstore.restore(store, 2), state(2))
    assert casstore.verify(store).ok
    # The next step deltas against the same bases, still without step 0.
    info = casstore.save(store, 3, state(3), chunk_size_bytes=CHUNK)
    assert info.delta_chunks == 12
    assert [r.base for r in refs(store, 3, "w")] == [r.base for r in refs(store, 2, "w")]
    casstore.delete(store, 2)
    casstore.gc(store, grace_period_s=0)
    assert_bit_exact(casstore.restore(store, 3), state(3))


def test_verify_counts_the_bases_it_reads_for_deltas_in_bytes_read():
    # Once step 0 is deleted its chunks are read only as bases of step 1's deltas; verify's
    # bytes_read counts them too: every chunk and delta object byte it read, each object once.
    store = CountingStore(MemoryStore())
    for s in range(2):
        casstore.save(store, s, state(s), chunk_size_bytes=CHUNK)
    casstore.delete(store, 0)
    assert any(r.base for r in refs(store, 1, "w"))
    store.reset()
    report = casstore.verify(store)
    assert report.ok
    read = [k for k in store.keys_read if k.startswith(("chunks/", DELTAS_PREFIX))]
    assert len(read) == len(set(read))  # each object once
    assert any(k.startswith(DELTAS_PREFIX) for k in read)
    assert report.bytes_read == sum(len(store.inner.get(k)) for k in read)


def test_a_delta_object_of_another_run_is_never_reused_without_its_base(tmp_path):
    store = MemoryStore()
    for s in range(2):
        casstore.save(store, s, state(s), run="a", chunk_size_bytes=CHUNK)
    info = casstore.save(store, 0, state(1), run="b", chunk_size_bytes=CHUNK)
    assert info.delta_chunks == 0  # run b has no previous step to delta against
    assert all(r.base is None for r in refs(store, 0, "w", run="b"))
    for s in range(2):
        casstore.delete(store, s, run="a")
    casstore.gc(store, grace_period_s=0)
    assert_bit_exact(casstore.restore(store, 0, run="b"), state(1))


def test_async_manager_saves_deltas_from_staged_numpy_leaves(tmp_path):
    """The staged copy is what gets delta-encoded: overwriting the leaf after save() is safe."""
    store = LocalStore(tmp_path / "r")
    expected = {}
    with casstore.CheckpointManager(store, max_to_keep=2, gc_after_retention=True,
                                    grace_period_s=0, chunk_size_bytes=CHUNK) as mngr:
        w = trained(0).copy()
        for s in range(5):
            w[...] = trained(s)
            expected[s] = w.copy()
            mngr.save(s, {"w": w})
            w[...] = -1  # the caller reuses its buffer at once
        mngr.wait_until_finished()
        assert mngr.last_save_info.delta_chunks == 4
    assert casstore.list_steps(store) == [3, 4]
    for s in (3, 4):
        assert casstore.restore(store, s)["w"].tobytes() == expected[s].tobytes()
    assert casstore.verify(store).ok


MESSAGES = {"truncate": "shorter than its header", "codec": r"codec 2 in a delta object",
            "element_size": "element size 3 and", "length": "manifest says",
            "payload": "zstd|rebuilt bytes do not match|plane lengths"}


@pytest.mark.parametrize("mutate", list(MESSAGES))
def test_a_malformed_delta_object_is_a_corrupt_chunk_error(mutate):
    store = MemoryStore()
    casstore.save(store, 0, {"w": trained(0)}, chunk_size_bytes=CHUNK)
    casstore.save(store, 1, {"w": trained(1)}, chunk_size_bytes=CHUNK)
    ref = refs(store, 1, "w")[0]
    data, base = bytearray(store.get(ref.key)), store.get(chunk_key(ref.base))
    magic, version, codec, k, length = HEADER.unpack_from(data)
    assert codec == CODEC_DELTA
    assert k == 4
    if mutate == "truncate":
        data = data[:10]
    elif mutate == "codec":
        HEADER.pack_into(data, 0, magic, version, 2, k, length)
    elif mutate == "element_size":
        HEADER.pack_into(data, 0, magic, version, codec, 3, length)
    elif mutate == "length":
        HEADER.pack_into(data, 0, magic, version, codec, k, length * 2)
    else:
        data[-5] ^= 0xFF
    with pytest.raises(casstore.CorruptChunkError, match=MESSAGES[mutate]):
        decode_delta(bytes(data), base, ref.id, ref.base, ref.raw_bytes)
    store.put(ref.key, bytes(data))
    with pytest.raises(casstore.CorruptChunkError,
                       match="unusable chunk: .*" + MESSAGES[mutate]) as e:
        casstore.restore(store, 1)
    assert e.value.step == 1
    assert e.value.key_path == "w"
    assert e.value.chunk_id == ref.id


@pytest.mark.parametrize(("field", "value", "message"), [
    ("base", "zz", "bad delta base"), ("base", "self", "bad delta base"),
    ("version", 1, "bad delta base"),
    ("version", 3, "unknown version 3, under min_reader 0.1.0 .*: damaged")])
def test_hostile_delta_fields_in_a_manifest_are_refused(field, value, message):
    store = MemoryStore()
    casstore.save(store, 0, {"w": trained(0)}, chunk_size_bytes=CHUNK)
    casstore.save(store, 1, {"w": trained(1)}, chunk_size_bytes=CHUNK)
    key = "runs/default/steps/0000000000000001.manifest"
    raw = _manifest.msgpack.unpackb(store.get(key))
    if field == "base":
        ref = raw["leaves"][0]["chunks"][0]
        ref["base"] = ref["id"] if value == "self" else value
    else:
        raw["version"] = value
    store.delete(key)
    store.put(key, repack(raw))
    with pytest.raises(casstore.ManifestError, match=message):
        casstore.read_manifest(store, 1)


# --- Property test: any sequence of save / delete / gc / copy leaves every step restorable. ---

OPS = st.lists(st.one_of(
    st.tuples(st.just("save"), st.integers(0, 3)),  # which leaves change (bit mask, w and v)
    st.tuples(st.just("delete"), st.integers(0, 50)),  # index into the steps still there
    st.tuples(st.just("gc"), st.just(0)),
    st.tuples(st.just("copy"), st.integers(0, 50))), min_size=1, max_size=14)


@functools.cache  # each version's arrays computed once, not at every restore check (1.2 s)
def _tree(versions: tuple[int, int]) -> dict:
    return {"w": trained(versions[0])[:64], "v": trained(versions[1], seed=3)[:32],
            "frozen": WEIGHTS[:16]}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_save_delete_gc_copy_sequences_keep_every_step_restorable(ops):
    """Against a dict model: each save changes some leaves a little (deltas), deletes and GCs
    (no grace) remove what they may, copies send one step to a second repository; after
    every operation every remaining step of both repositories restores bit-exact.

    The restore budget is lifted here: in a tree of 28 small chunks it refuses the first
    deltas of a step while few whole bytes are booked (``[save 2, save 2, save 1]`` took 12
    of 16), and this test is about chains, not the budget (tested above)."""
    with mock.patch.object(_save_encode, "RestoreBudget",
                           functools.partial(RestoreBudget, math.inf)):
        _run_sequence(ops)


def _run_sequence(ops: list[tuple[str, int]]) -> None:
    store, mirror = MemoryStore(), MemoryStore()
    model: dict[int, tuple[int, int]] = {}
    copied: dict[int, tuple[int, int]] = {}
    versions, step = (0, 0), 0
    for op, arg in ops:
        if op == "save":
            latest = model[max(model)] if model else None
            versions = (versions[0] + (arg & 1), versions[1] + (arg >> 1 & 1))
            info = casstore.save(store, step, _tree(versions), chunk_size_bytes=4096)
            if latest is not None and latest[0] != versions[0]:
                assert info.delta_chunks >= 16  # w's blocks changed: deltas against latest
            model[step] = versions
            step += 1
        elif op == "delete" and model:
            victim = sorted(model)[arg % len(model)]
            casstore.delete(store, victim)
            del model[victim]
        elif op == "gc":
            casstore.gc(store, grace_period_s=0)
            casstore.gc(mirror, grace_period_s=0)
        elif op == "copy" and model:
            chosen = sorted(model)[arg % len(model)]
            casstore.copy(store, mirror, steps=[chosen])
            copied[chosen] = model[chosen]
        for repo, expected in ((store, model), (mirror, copied)):
            assert casstore.list_steps(repo) == sorted(expected)
            for s, v in expected.items():
                restored = casstore.restore(repo, s)
                for key, value in _tree(v).items():
                    assert restored[key].tobytes() == value.tobytes(), (s, key)


@pytest.mark.parametrize("damage", ["corrupt", "missing", "rotted"])
def test_a_damaged_base_makes_the_next_save_store_the_block_whole(damage, tmp_path):
    """Rotted: a payload byte flipped, the framing intact. A delta XORed on those bytes would
    read back only from this rotted copy: never from a backup or a repaired repository."""
    store = LocalStore(tmp_path / "r")
    casstore.save(store, 0, {"w": trained(0)}, chunk_size_bytes=CHUNK)
    base = refs(store, 0, "w")[0].id
    path = tmp_path / "r" / chunk_key(base)
    data = bytearray(path.read_bytes())
    if damage == "missing":
        path.unlink()
    elif damage == "corrupt":
        HEADER.pack_into(data, 0, b"XXXX", 1, 0, 0, len(data) - HEADER.size)
        path.write_bytes(bytes(data))
    else:
        data[-100] ^= 1
        path.write_bytes(bytes(data))
    info = casstore.save(store, 1, {"w": trained(1)}, chunk_size_bytes=CHUNK)
    assert info.delta_chunks == 3  # the other three blocks still delta against their bases
    assert refs(store, 1, "w")[0].base is None
    assert casstore.restore(store, 1)["w"].tobytes() == trained(1).tobytes()
    assert {p.step for p in casstore.verify(store).problems} == {0}
    casstore.copy(store, tmp_path / "backup", steps=[1])
    assert casstore.restore(tmp_path / "backup", 1)["w"].tobytes() == trained(1).tobytes()


def test_a_base_shared_by_deltas_is_read_once_by_restore_verify_and_copy():
    # Two leaves equal at step 0 are one chunk; trained apart, both become deltas on it.
    steps = [{"a": trained(0), "b": trained(0)}, {"a": trained(1), "b": trained(1, seed=5)}]
    src = CountingStore(MemoryStore())
    for s, tree in enumerate(steps):
        casstore.save(src, s, tree, chunk_size_bytes=CHUNK)
    bases = {r.base for path in ("a", "b") for r in refs(src, 1, path)}
    assert len(bases) == 4
    assert None not in bases

    def base_reads() -> int:
        return sum(src.keys_read.count(chunk_key(b)) for b in bases)

    for run in (lambda: casstore.restore(src, 1), lambda: casstore.verify(src, 1),
                lambda: casstore.copy(src, MemoryStore(), steps=[1])):
        src.reset()
        result = run()
        assert base_reads() == len(bases), result
    assert casstore.verify(src).ok
    assert_bit_exact(casstore.restore(src, 1), steps[1])


@pytest.mark.parametrize("backend", ["memory", "seaweedfs"])
def test_a_block_whose_delta_did_not_pay_is_retried_once_in_delta_retry_saves(backend, request):
    # "mu" is random every step (adam's moments: no delta pays); "w" trains slowly.
    def tree(step: int) -> dict:
        rng = np.random.default_rng(300 + step)
        return {"w": trained(step), "mu": rng.standard_normal(16 * CHUNK // 4).astype(np.float32)}

    inner = (MemoryStore() if backend == "memory"
             else object_store(request.getfixturevalue("object_servers")[backend]))
    store = CountingStore(inner)
    reads_of_previous_mu = []
    for s in range(4):
        earlier = refs(store, s - 1, "mu") if s else []
        store.reset()
        info = casstore.save(store, s, tree(s), chunk_size_bytes=CHUNK)
        reads_of_previous_mu.append(sum(store.keys_read.count(chunk_key(r.id)) for r in earlier))
        assert info.delta_chunks == (4 if s else 0)  # w's 4 blocks, every step after the first
        new_mu = refs(store, s, "mu")
        assert len(new_mu) == 16
        assert all(r.base is None for r in new_mu)
        if s >= 2:
            # Stored whole at steps s-1 and s-2 with other bytes: the delta did not pay, so
            # only the blocks whose new chunk id picks them try again (reading their base).
            retried = sum(int(r.id[:8], 16) % _save_encode.DELTA_RETRY == 0 for r in new_mu)
            assert reads_of_previous_mu[s] == retried < 16
    assert reads_of_previous_mu[1] == 16  # no step before step 0: every block tries
    # A save with no changed block reads the previous manifest only, not the one before it.
    store.reset()
    assert casstore.save(store, 4, tree(3), chunk_size_bytes=CHUNK).new_chunks == 0
    assert [k for k in store.keys_read if k.endswith(".manifest")] == [manifest_key("default", 3)]
    assert_bit_exact(casstore.restore(store, 3), tree(3))


def test_deltas_that_save_little_stay_within_the_restore_budget():
    """Dense updates (every weight's low bits move, as in pretraining) give deltas of about 0.7
    of the chunk: a save takes them only while a restore of its step reads at most about 1.25x
    the bytes of the same step stored whole plus MAX_RESTORE_OVERHEAD (RestoreBudget), as
    measured on what restore reads."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((1024, 256)).astype(np.float32) * 0.02

    def tree(step: int) -> dict:
        noise = rng.standard_normal(w.shape).astype(np.float32) * np.float32(2e-5)
        return {"w": w + noise * step}

    stores = {"delta": CountingStore(MemoryStore()), "whole": CountingStore(MemoryStore())}
    states = [tree(0), tree(1)]
    infos = {name: [casstore.save(store, step, state, chunk_size_bytes=CHUNK,
                                  delta=name == "delta") for step, state in enumerate(states)]
             for name, store in stores.items()}
    info = infos["delta"][1]
    assert 0 < info.delta_chunks < 16, info  # w: 16 blocks
    assert info.delta_saved_bytes > 0, info
    read = {}
    for name, store in stores.items():
        store.reset()
        assert_bit_exact(casstore.restore(store, 1), states[1])
        read[name] = store.bytes_read
    bound = 1 + MAX_RESTORE_OVERHEAD
    assert read["delta"] <= bound * 1.03 * read["whole"], read  # 3%: the samples' estimates
    assert read["delta"] > (1 + MAX_RESTORE_OVERHEAD / 2) * read["whole"], read  # budget used


def test_a_delta_whose_samples_missed_the_changes_is_judged_by_its_encoded_size():
    """The choice to encode a delta is made on two samples of the block (its start and
    middle); a block that changed everywhere else (new random values) estimates as a delta of
    almost nothing, but its encoded delta is larger than the block stored whole: it is not
    kept, and the block is stored whole, as a save without deltas stores it."""
    rng = np.random.default_rng(11)
    n = 1 << 18  # one 1 MiB chunk of float32
    old = rng.standard_normal(n).astype(np.float32) * 0.02
    new = rng.standard_normal(n).astype(np.float32) * 0.02
    sampled = SAMPLE_BYTES // 4  # elements in each of the two samples (_delta._samples)
    for start in (0, n // 2):
        new[start:start + sampled] = old[start:start + sampled]
    infos = {}
    for delta in (True, False):
        store = MemoryStore()
        casstore.save(store, 0, {"w": old}, chunk_size_bytes=4 * n, delta=delta)
        infos[delta] = casstore.save(store, 1, {"w": new}, chunk_size_bytes=4 * n, delta=delta)
        assert_bit_exact(casstore.restore(store, 1), {"w": new})
    assert infos[True].delta_chunks == 0, infos[True]
    assert infos[True].delta_saved_bytes == 0, infos[True]
    assert infos[True].written_bytes == infos[False].written_bytes


def test_the_restore_budget_holds_on_encoded_sizes():
    """A delta booked at its estimate is kept at its encoded size only while the bound holds;
    else it is withdrawn with the whole size booked for it."""
    budget = RestoreBudget(0.25)
    budget.add_whole(1000)
    assert budget.take(200, 800)  # 200 <= 0.25 * 1800
    assert budget.settle(200, 800, 400)  # 400 <= 450: kept at 400
    assert (budget.delta_bytes, budget.whole_bytes) == (400, 1800)
    assert budget.take(50, 200)  # 450 <= 500
    assert not budget.settle(50, 200, 150)  # 550 > 500: withdrawn
    assert (budget.delta_bytes, budget.whole_bytes) == (400, 1800)
    assert budget.take(10, 100)
    assert not budget.settle(10, 100, None)
    assert (budget.delta_bytes, budget.whole_bytes) == (400, 1800)


def test_a_delta_base_whose_header_gives_an_element_size_its_codec_refuses_is_corrupt(
        tmp_path):
    """A uint8 leaf's delta (element size 1) on a base whose header was damaged to codec 5
    with element size 1: the base's planes were read unchecked and an IndexError came out of
    restore, verify and export (exploratory session's repro)."""
    rng = np.random.default_rng(1)
    big = rng.integers(0, 256, 200_000, dtype=np.uint8)  # unchanged: keeps the restore budget
    u = rng.integers(0, 256, 100_000, dtype=np.uint8)
    for step in range(2):
        changed = u.copy()
        changed[:10] += step
        casstore.save(tmp_path, step, {"big": big, "u": changed})
    (delta,) = (tmp_path / "deltas").rglob("*.*")
    base_id = delta.name.rsplit(".", 1)[1]
    base = tmp_path / "chunks" / base_id[:2] / base_id[2:]
    data = base.read_bytes()
    n = struct.unpack("<Q", data[8:16])[0]
    header = bytearray(data[:16])
    header[5], header[6:8] = 5, struct.pack("<H", 1)  # codec 5 needs an element size of 2-16
    base.write_bytes(bytes(header) + struct.pack("<I", n) + data[16:16 + n])
    with pytest.raises(casstore.CorruptChunkError,
                       match=r"base chunk .* is corrupt: bad element size 1 for codec 5.*"
                             r"step 1, key path 'u'"):
        casstore.restore(tmp_path, 1)
    report = casstore.verify(tmp_path)
    assert [(p.kind, p.chunk_id) for p in report.problems] == [("corrupt", base_id)]
