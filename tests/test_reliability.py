"""Reliability: random faults, corrupt and hostile input, secrets, read-only access."""

import collections
import contextlib
import functools
import random
import time
import tracemalloc

import jax
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import casstore
from casstore._codec import (
    CODEC_PLANES,
    CODEC_SHUFFLE_ZSTD,
    HEADER,
    KNOWN_CODECS,
    MAGIC,
    _encode,
    chunk_id,
    decode_chunk,
    encode_chunk,
)
from casstore._layout import manifest_key
from casstore._manifest import decode_manifest
from casstore.store import CountingStore, MemoryStore
from casstore.testing import FaultyStore

from conftest import object_store, repack

FAULT_SEEDS = range(40)


def report(capsys, line: str) -> None:
    """Prints a campaign's figures to the terminal, past pytest's capture."""
    with capsys.disabled():
        print(f"\n[campaign] {line}", flush=True)


def tree_for(step: int) -> dict:
    """A deterministic tree per step: a shared base, a per-step head, small leaves."""
    base = np.arange(30_000, dtype=np.float32)
    return {"base": base, "head": np.full(5000, step, np.float32),
            "bias": np.full(10, step % 3, np.float32), "step": step}


def assert_restores(store, step: int) -> None:
    restored = casstore.restore(store, step)
    expected = tree_for(step)
    for key in ("base", "head", "bias"):
        assert restored[key].tobytes() == expected[key].tobytes(), (step, key)
    assert restored["step"] == step


def fault_campaign(seed: int, operations: int) -> FaultyStore:
    """Runs ``operations`` random saves, restores, GCs, deletes and copies through a
    ``FaultyStore`` seeded with ``seed``; returns it (its ``calls`` and ``injected``).

    Every operation either succeeds (and its step restores) or raises; after each one, a save
    that returned is visible, every visible step restores bit-exact, and step 0 survives.
    """
    inner = MemoryStore()
    casstore.save(inner, 0, tree_for(0), chunk_size_bytes=8192)
    rng = random.Random(seed)
    # GC assumes complete listings (format.md §8): no list_misses_recent while it runs.
    faulty = FaultyStore(inner, seed=seed, rate=0.1, delay_s=0.001,
                         kinds=("error", "timeout", "stored_then_error", "slow"))
    saved, deleting = {0}, set()
    for step in range(1, operations + 1):
        op = rng.choice(["save", "save", "restore", "gc", "delete", "copy"])
        try:
            if op == "save":
                casstore.save(faulty, step, tree_for(step), chunk_size_bytes=8192)
                saved.add(step)
            elif op == "restore" and saved:
                assert_restores(faulty, max(saved))
            elif op == "gc":  # a lock left behind by a failed delete makes GC give up
                casstore.gc(faulty, grace_period_s=0, lock_timeout_s=0.3)
            elif op == "delete" and len(saved) > 1:
                victim = min(saved - {0})
                deleting.add(victim)
                casstore.delete(faulty, victim)
                saved.discard(victim)
            elif op == "copy":
                casstore.copy(faulty, MemoryStore())
        except (OSError, casstore.CasstoreError):
            pass  # the operation failed; the invariants below must hold anyway
        visible = set(casstore.list_steps(inner))
        assert saved - deleting <= visible, (seed, step)  # a save that returned is committed
        for step_seen in visible:  # and whatever is visible restores, failed calls or not
            assert_restores(inner, step_seen)
        assert 0 in visible
    assert casstore.verify(inner).ok
    return faulty


@pytest.mark.parametrize("seed", FAULT_SEEDS)
def test_save_restore_gc_copy_under_random_faults(seed):
    assert fault_campaign(seed, 7).injected  # the run did meet faults


@pytest.mark.slow
def test_fault_campaign_full_count(capsys):
    """The campaign of docs/reliability.md: 500 seeds x 20 operations."""
    t0, operations, calls, kinds = time.perf_counter(), 0, 0, collections.Counter()
    for seed in range(1000, 1500):
        faulty = fault_campaign(seed, 20)
        operations += 20
        calls += sum(faulty.calls.values())
        kinds.update(kind for _, kind, _ in faulty.injected)
    assert operations >= 10_000
    assert kinds["error"]
    assert kinds["stored_then_error"]
    report(capsys, f"faults: {operations} operations, {calls} store calls, "
           f"{sum(kinds.values())} faults {dict(kinds)}, {time.perf_counter() - t0:.0f} s")


@pytest.mark.parametrize("seed", range(10))
def test_saves_survive_listings_that_miss_recent_objects(seed):
    inner = MemoryStore()
    faulty = FaultyStore(inner, seed=seed, rate=0.5, kinds=("list_misses_recent",))
    for step in range(4):
        casstore.save(faulty, step, tree_for(step), chunk_size_bytes=8192)
    for step in range(4):
        assert_restores(inner, step)
    assert faulty.injected


# -- hostile manifests -----------------------------------------------------------------------

@functools.cache
def _valid_manifest_bytes() -> bytes:
    store = MemoryStore()
    casstore.save(store, 1, {"a": {"w": np.arange(4096, dtype=np.float32)}, "b": [1, "x"]},
                  chunk_size_bytes=4096)
    return store.get("runs/default/steps/0000000000000001.manifest")


def valid_manifest() -> dict:
    """A fresh copy of a real manifest document, to mutate."""
    return msgpack.unpackb(_valid_manifest_bytes(), strict_map_key=False)


HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
    st.text(max_size=30), st.binary(max_size=30),
    st.sampled_from(["../../etc/passwd", "/abs", "a\x00b", "object", "O", "float128", "V8",
                     "<U3", "f" * 32, "G" * 32, 2**62, -1, [2**40, 2**40], [[0] * 65],
                     {"t": "leaf", "i": 10**9}, [0, -1], [10**15] * 5]),
    st.lists(st.integers(-2, 2**40), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(-2**63, 2**63 - 1), max_size=3),
)


def mutate(doc, path_choices: list, value):
    """Sets the field at a random path in the manifest document to ``value``."""
    node, path = doc, path_choices
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


def field_paths(doc, prefix=()) -> list:
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((*prefix, k))
            out += field_paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append((*prefix, i))
            out += field_paths(v, (*prefix, i))
    return out


PATHS = field_paths(valid_manifest())


FUZZED: collections.Counter[str] = collections.Counter()  # inputs checked, by kind


def fuzzing(n: int):
    """Hypothesis settings for ``n`` examples (no database: campaigns are not replayed)."""
    return settings(max_examples=n, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def check_mutated_manifest(where, value) -> None:
    """A mutated manifest gets ManifestError, or is consistent and restores or fails cleanly."""
    FUZZED["mutated manifests"] += 1
    doc = mutate(valid_manifest(), list(where), value)
    data = repack(doc)
    try:
        manifest = decode_manifest(data, run="default", step=1, url="mem")
    except casstore.ManifestError:
        return
    # Accepted: it must be internally consistent, so restoring can only fail cleanly.
    store = MemoryStore()
    store.put("config", msgpack.packb({"format": "casstore", "version": 1, "hash": "xxh3-128",
                                       "created": 0.0}))
    store.put("runs/default/steps/0000000000000001.manifest", data)
    assert manifest.step == 1
    with contextlib.suppress(casstore.CasstoreError):
        casstore.restore(store, 1)


def check_random_bytes(data: bytes) -> None:
    FUZZED["random manifests"] += 1
    with pytest.raises(casstore.ManifestError, match=r"^(not msgpack|invalid|unsupported format)"):
        decode_manifest(data, run="default", step=1, url="mem")


def mutated_manifests(n: int):
    return fuzzing(n)(given(where=st.sampled_from(PATHS), value=HOSTILE)(
        check_mutated_manifest))


def random_manifests(n: int):
    return fuzzing(n)(given(data=st.binary(max_size=2000))(check_random_bytes))


def test_every_single_bit_flip_of_a_manifest_is_refused_or_changes_nothing():
    """Inline arrays and scalar leaves live in the manifest, where no chunk id covers them: its
    digest (format.md §4.1) refuses every flip that would decode into another manifest, and
    none is taken for a newer format. The only flips accepted are in the word ``digest``."""
    store = MemoryStore()
    casstore.save(store, 0, {"inline": np.arange(8, dtype=np.float32), "s": "hello", "n": 7,
                             "big": np.ones(1000)}, metadata={"loss": 0.5})
    data = store.get(manifest_key("default", 0))
    good = decode_manifest(data, run="default", step=0, url="mem")
    accepted = []
    for i in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            try:
                manifest = decode_manifest(bytes(flipped), run="default", step=0, url="mem")
            except casstore.UnsupportedFormatError as e:
                raise AssertionError(f"byte {i} bit {bit}: damage taken for a newer format") from e
            except casstore.ManifestError:
                continue
            assert manifest == good, f"byte {i} bit {bit} decodes into another manifest"
            accepted.append(i)
    start = data.rindex(b"digest")
    assert set(accepted) <= set(range(start, start + len("digest")))


test_mutated_manifests_are_rejected_or_safe = mutated_manifests(400)
test_random_bytes_are_never_a_manifest = random_manifests(300)


# -- hostile chunk objects -------------------------------------------------------------------

def _chunk_samples() -> list[tuple[bytes, bytes]]:
    """``(object, raw)`` for a raw, a zstd, a shuffle + zstd and two byte-plane chunks."""
    rng = np.random.default_rng(0)
    raws = [rng.integers(0, 256, 3000, np.uint8).tobytes(), b"the quick brown fox " * 150,
            (rng.standard_normal(1000) * 0.02).astype(np.float32).tobytes()]
    samples = [(bytes(encode_chunk(memoryview(r), element_size=4)), r) for r in raws]
    shuffled = _encode(raws[2], CODEC_SHUFFLE_ZSTD, 1, 4)  # earlier writers' codec
    samples.append((shuffled, raws[2]))
    samples.append((bytes(_encode(raws[2], CODEC_PLANES, 1, 4)), raws[2]))  # earlier writers'
    assert sorted(HEADER.unpack_from(d)[2] for d, _ in samples) == [0, 1, 2, 4, 5]  # every codec
    return samples


CHUNK_SAMPLES = _chunk_samples()
HEADER_FIELDS = [  # magic, version, codec, element size, raw length (format.md §3.2)
    st.binary(min_size=4, max_size=4) | st.just(MAGIC),
    st.integers(0, 255), st.integers(0, 255) | st.sampled_from([0, 1, 2, 4]),
    st.integers(0, 2**16 - 1) | st.sampled_from([0, 1, 2, 3, 4, 8, 16, 17]),
    st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2**31, 2**63, 3000, 2999, 4000, 4001]),
]


@st.composite
def hostile_chunks(draw) -> tuple[bytes, bytes, int]:
    """A valid chunk object with header fields replaced, payload bytes flipped and the object
    cut short at random; returns ``(object, raw bytes, raw length the manifest claims)``."""
    data, raw = draw(st.sampled_from(CHUNK_SAMPLES))
    fields = list(HEADER.unpack_from(data))
    for i in draw(st.sets(st.integers(0, len(fields) - 1), max_size=len(fields))):
        fields[i] = draw(HEADER_FIELDS[i])
    body = bytearray(data[HEADER.size:])
    for _ in range(draw(st.integers(0, 3))):
        body[draw(st.integers(0, len(body) - 1))] ^= draw(st.integers(1, 255))
    obj = (HEADER.pack(*fields) + bytes(body))[:draw(st.none() | st.integers(0, len(data)))]
    # The manifest is hostile too: it may claim the header's length.
    claimed = draw(st.sampled_from([len(raw), min(fields[4], 2**31)]))
    return obj, raw, claimed


def check_hostile_chunk(case: tuple[bytes, bytes, int]) -> None:
    """A damaged chunk object gets CorruptChunkError (UnsupportedFormatError where its magic
    holds and its version or codec is unknown, format.md §10), or decodes to exactly its raw
    bytes."""
    FUZZED["chunk objects"] += 1
    obj, raw, claimed = case
    try:
        decoded = decode_chunk(obj, chunk_id(raw), claimed)
    except casstore.UnsupportedFormatError:
        magic, version, codec, _, _ = HEADER.unpack_from(obj)
        assert magic == MAGIC
        assert (version != 1 or codec not in KNOWN_CODECS)
        return
    except casstore.CorruptChunkError:
        return
    assert bytes(decoded) == raw


def hostile_chunk_objects(n: int):
    return fuzzing(n)(given(case=hostile_chunks())(check_hostile_chunk))


test_hostile_chunk_objects_are_rejected_or_exact = hostile_chunk_objects(300)


@pytest.mark.slow
def test_fuzz_campaign_full_count(capsys):
    """The campaign of docs/reliability.md: 100,000 hostile manifests and chunk objects."""
    t0 = time.perf_counter()
    FUZZED.clear()
    mutated_manifests(40_000)()
    random_manifests(20_000)()
    hostile_chunk_objects(40_000)()
    assert sum(FUZZED.values()) >= 100_000, FUZZED
    report(capsys, f"fuzzing: {sum(FUZZED.values())} inputs {dict(FUZZED)}, "
           f"{time.perf_counter() - t0:.0f} s")


@pytest.mark.parametrize("hostile", [
    {"shape": [2**40, 2**40]},                      # huge allocation
    {"shape": [0, 2**52, 2**52], "chunks": []},     # zero-size, but numpy refuses the extent
    {"shape": [-4]},                                # negative
    {"dtype": "object"}, {"dtype": "V16"}, {"dtype": "<U8"},  # not plain numeric
    {"raw_bytes": 3 * 2**30},                       # a chunk past format.md 3.2's 2**31 bytes
])
def test_hostile_leaf_fields_fail_before_any_allocation(hostile):
    doc = valid_manifest()
    leaf = next(x for x in doc["leaves"] if x["path"] == "a/w")
    if "raw_bytes" in hostile:  # a small zstd frame may claim that much (a zip bomb)
        leaf["chunks"][0]["raw_bytes"] = hostile.pop("raw_bytes")
    leaf.update(hostile)
    with pytest.raises(casstore.ManifestError, match=r"exceeds the limit|bad shape|not an "
                       r"allowed array dtype|bad chunk sizes") as info:
        decode_manifest(repack(doc), run="default", step=1, url="m")
    assert info.value.key_path == "a/w"


def test_deeply_nested_tree_and_oversized_strings_are_rejected():
    doc = valid_manifest()
    node = {"t": "none"}
    for _ in range(300):
        node = {"t": "list", "c": [node], "type": "x"}
    doc["tree"] = node
    with pytest.raises(casstore.ManifestError, match="bad tree node or too deep"):
        decode_manifest(repack(doc), run="default", step=1, url="m")
    doc = valid_manifest()
    doc["leaves"][0]["path"] = "p" * 5000
    with pytest.raises(casstore.ManifestError, match="bad key path"):
        decode_manifest(repack(doc), run="default", step=1, url="m")


def test_a_deep_tree_of_many_nodes_is_checked_in_memory_of_its_nodes_not_times_its_depth():
    """A tree 250 lists deep ending in 50,000 'none' nodes: the check kept each node's whole
    path, memory of nodes x depth (a 1.5 MiB manifest grew the process by 469 MB; exploratory
    session's repro); now a cell per node."""
    from casstore._manifest import _Check, _check_tree

    node = {"t": "list", "c": [{"t": "none"}] * 50_000, "type": "list"}
    for _ in range(249):
        node = {"t": "list", "c": [node], "type": "list"}
    tracemalloc.start()
    try:
        _check_tree(node, [], _Check(run="default", step=1, url="m"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 30e6, peak  # 100 MB before: 50,000 tuples of 250 elements


def test_chunk_ids_cannot_name_objects_outside_chunks():
    doc = valid_manifest()
    leaf = next(x for x in doc["leaves"] if x["path"] == "a/w")
    for bad in ("../config0000000000000000000000000", "runs/default/steps/000000000000000"):
        leaf["chunks"][0]["id"] = bad
        with pytest.raises(casstore.ManifestError, match="bad chunk id"):
            decode_manifest(repack(doc), run="default", step=1, url="m")


def test_chunk_refs_that_each_cover_the_grid_are_refused_in_bounded_time():
    """The tiling check (format.md §4.3) bounds its work by the refs and the grid cells, not
    their product: 2,000 refs that each cover a 2000 x 2000 grid (a 0.4 MB manifest) took
    ~10 s to be refused, and the 256 MiB limit allowed hours, for every read of the step."""
    d, cid = 2000, "ab" * 16

    def ref(start: list[int], stop: list[int]) -> dict:
        return {"id": cid, "start": start, "stop": stop, "offset": 0, "raw_bytes": d * d,
                "stored_bytes": 20}

    doc = valid_manifest()
    leaf = next(x for x in doc["leaves"] if x["path"] == "a/w")
    leaf.update(shape=[d, d], dtype="uint8", inline=None, chunks=[
        ref([i, i], [i + 1, i + 1]) for i in range(d)] + [ref([0, 0], [d, d])] * 2000)
    data = repack(doc)
    t0 = time.perf_counter()
    with pytest.raises(casstore.ManifestError, match="overlap or leave gaps") as info:
        decode_manifest(data, run="default", step=1, url="m")
    assert time.perf_counter() - t0 < 2
    assert info.value.key_path == "a/w"
    # blocks whose volumes sum to the element count, one overlap making up for one gap
    leaf.update(shape=[4], chunks=[ref([0], [2]), ref([1], [3])])
    with pytest.raises(casstore.ManifestError, match="overlap or leave gaps"):
        decode_manifest(repack(doc), run="default", step=1, url="m")
    # bricks: blocks of several grid cells that tile the array are read
    leaf.update(shape=[2, 4], chunks=[ref([0, 0], [1, 1]), ref([0, 1], [1, 4]),
                                      ref([1, 0], [2, 3]), ref([1, 3], [2, 4])])
    decode_manifest(repack(doc), run="default", step=1, url="m")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("metadata", {"when": msgpack.Timestamp(1, 0)}, r"metadata\['when'\] is of type Timestamp"),
    ("metadata", {"ok": [1, {2: msgpack.Timestamp(1, 0)}]},
     r"metadata\['ok'\]\[1\]\[2\] is of type Timestamp"),
    ("metadata", msgpack.ExtType(5, b"x"), r"metadata is of type ExtType"),
    ("metadata", functools.reduce(lambda x, _: [x], range(300), 0), "nested over 256 deep"),
    ("metadata", ["x" * 2**19] * 3, "over 1 MiB encoded"),
    ("sharding", msgpack.Timestamp(1, 0), r"bad saved sharding \(not a map"),
    ("sharding", {"mesh": {"x": 0}, "spec": []}, r"bad saved sharding \(mesh axes\)"),
    ("sharding", {"mesh": {"x": 2}, "spec": ["y"]}, r"bad saved sharding \(partition spec\)"),
])
def test_metadata_and_sharding_that_format_md_does_not_allow_are_damage(field, value, message):
    """``metadata`` (format.md §4.1: msgpack's nil, bool, int, float, str, bin, list and map,
    no extension type; at most 1 MiB) and a leaf's ``sharding`` (§6.1) are checked at decode
    like every other field: a Timestamp there passed, and ``casstore cat`` then failed as a
    usage error (exit 2)."""
    doc = valid_manifest()
    where = doc if field == "metadata" else next(x for x in doc["leaves"] if x["path"] == "a/w")
    where[field] = value
    with pytest.raises(casstore.ManifestError, match=message) as info:
        decode_manifest(repack(doc), run="default", step=1, url="m")
    assert info.value.step == 1
    assert info.value.key_path == (None if field == "metadata" else "a/w")


@pytest.mark.parametrize(("metadata", "message"), [
    ({"when": msgpack.Timestamp(1, 0)}, r"metadata\['when'\] is of type Timestamp"),
    ({"x": msgpack.ExtType(5, b"x")}, r"metadata\['x'\] is of type ExtType"),
    (functools.reduce(lambda x, _: [x], range(300), 0), "nested over 256 deep"),
])
def test_save_refuses_metadata_a_reader_would_refuse(metadata, message):
    """Never write what a reader refuses: such metadata fails the save before any write.
    What saves have always written (bytes, map keys other than str) stays readable."""
    store = CountingStore(MemoryStore())
    with pytest.raises(ValueError, match=message):
        casstore.save(store, 0, {"x": np.ones(3)}, metadata=metadata)
    assert store.keys_written == []
    kept = {"t": [1, 2.5, None, True, "s"], "blob": b"\0\1", "by_epoch": {1: "a", 2.5: b"b"}}
    casstore.save(store, 0, {"x": np.ones(3)}, metadata={**kept, "t": tuple(kept["t"])})
    assert casstore.read_manifest(store, 0).metadata == kept


# -- read-only access and secrets -----------------------------------------------------------

def test_read_only_operations_never_write():
    inner = MemoryStore()
    casstore.save(inner, 1, tree_for(1))
    counting = CountingStore(inner)
    casstore.restore(counting, 1)
    casstore.list_steps(counting)
    casstore.read_manifest(counting, 1)
    assert casstore.verify(counting).ok
    casstore.gc(counting, dry_run=True)
    assert counting.counts["put"] == counting.counts["put_if_absent"] == 0
    assert counting.counts["delete"] == 0


def test_secrets_never_appear_in_manifests_reprs_logs_or_errors(object_servers, caplog, capfd):
    import logging

    from casstore.store import FsspecStore
    secret = "SECRETabc123XYZ-do-not-leak"
    server = object_servers["moto"]
    options = dict(server.storage_options, key="AKIDEXAMPLE", secret=secret)
    url = server.url()
    caplog.set_level(logging.DEBUG)
    store = casstore.open_store(url, **options)
    seen = [repr(store), str(store.url)]
    casstore.save(store, 1, tree_for(1), metadata={"note": "hello"})
    seen.append(repr(casstore.read_manifest(store, 1)))
    for failing, error, message in (
            (lambda: casstore.restore(store, 99), casstore.StepNotFoundError, "no such step"),
            (lambda: casstore.save(store, 1, tree_for(1)), casstore.StepAlreadyExistsError,
             "step already exists"),
            (lambda: casstore.restore(casstore.open_store(
                "s3://no-such-bucket-casstore/x", **options), 1), casstore.StepNotFoundError,
             "no casstore repository here")):
        with pytest.raises(error, match=message) as info:
            failing()
        seen += [str(info.value), repr(info.value), *getattr(info.value, "__notes__", [])]
    raw = FsspecStore.from_url(url, **options)
    seen += [raw.get(i.key).decode("latin-1") for i in raw.list("runs/")]
    out, err = capfd.readouterr()
    seen += [out, err, caplog.text]
    assert not [s for s in seen if secret in s]


def test_an_unknown_prng_implementation_is_a_manifest_error_naming_the_key_path():
    store = MemoryStore()
    casstore.save(store, 0, {"k": jax.random.key(0)})
    key = "runs/default/steps/0000000000000000.manifest"
    doc = msgpack.unpackb(store.get(key))
    doc["leaves"][0]["key_impl"] = "nonexistent"  # an identifier: the validator lets it pass
    store.delete(key)
    store.put(key, repack(doc))
    for target in (None, {"k": jax.random.key(1)}):
        with pytest.raises(casstore.ManifestError, match=r"'nonexistent'.*key path 'k'"):
            casstore.restore(store, 0, target=target)


@pytest.mark.parametrize("tamper", ["swap_keys", "duplicate_key", "swap_leaves"])
def test_a_tree_that_disagrees_with_the_leaf_paths_is_refused(tamper):
    """A restore without a target rebuilds the tree: one whose keys disagree with the leaves'
    paths put values at other key paths (count and w swapped) or dropped one, silently."""
    store = MemoryStore()
    casstore.save(store, 0, {"count": np.int32(7), "w": np.arange(4.0)})
    key = "runs/default/steps/0000000000000000.manifest"
    doc = msgpack.unpackb(store.get(key))
    node = doc["tree"]
    if tamper == "swap_keys":
        node["k"] = node["k"][::-1]
    elif tamper == "duplicate_key":
        node["k"] = [node["k"][0]] * 2
    else:
        node["c"] = node["c"][::-1]
    store.delete(key)
    store.put(key, repack(doc))
    with pytest.raises(casstore.ManifestError, match=r"the tree puts leaf|bad dict keys"):
        casstore.restore(store, 0)


def test_a_manifest_over_the_size_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """A manifest object over MAX_MANIFEST_BYTES (format.md §4.4) is refused where its size is
    known before reading (a stat on local disk, or the listing a scan makes): a 256 MiB file
    at a manifest's key is never read into memory."""
    import os

    from casstore._manifest import MAX_MANIFEST_BYTES
    from casstore.store import LocalStore

    url = str(tmp_path / "repo")
    for step in (0, 1):
        casstore.save(url, step, {"x": np.arange(10.0) + step})
    path = tmp_path / "repo" / "runs" / "default" / "steps" / f"{1:016d}.manifest"
    os.truncate(path, MAX_MANIFEST_BYTES + 1)  # a sparse file: nothing is written
    read: list[str] = []
    get = LocalStore.get
    head = LocalStore.head
    monkeypatch.setattr(LocalStore, "get", lambda self, key: read.append(key) or get(self, key))
    monkeypatch.setattr(LocalStore, "head",
                        lambda self, key, n: read.append(key) or head(self, key, n))
    for call in (lambda: casstore.read_manifest(url, 1), lambda: casstore.restore(url, 1),
                 lambda: casstore.copy(url, str(tmp_path / "dst"), steps=[1])):
        with pytest.raises(casstore.ManifestError, match="exceeds the size limit"):
            call()
    report = casstore.verify(url)
    assert [(p.kind, p.step) for p in report.problems] == [("manifest", 1)]
    assert "exceeds the size limit" in report.problems[0].message
    assert casstore.restore(url, 0)["x"].tolist() == list(np.arange(10.0))
    assert path.name not in " ".join(read)


@pytest.mark.parametrize("server", ["seaweedfs", "fake-gcs"])
def test_an_object_store_reads_no_more_of_a_manifest_than_the_size_limit(
        object_servers, server, monkeypatch):
    """Where a manifest's size is not known beforehand (an object store, a step named by the
    caller), read_manifest, restore and copy read at most one byte past MAX_MANIFEST_BYTES
    (a ranged GET; on S3 a GET whose body is read no further) and refuse the manifest: a huge
    object there cannot exhaust memory."""
    import casstore._repository as repository

    store = object_store(object_servers[server])
    casstore.save(store, 3, {"x": np.arange(1000.0)})
    assert store.stat("runs/default/steps/0000000000000003.manifest").size > 200
    monkeypatch.setattr(repository, "MAX_MANIFEST_BYTES", 200)
    returned: list[int] = []
    cat = store.fs._cat_file  # the coroutine FsspecStore runs on fsspec's event loop

    async def counted(*args, **kwargs):
        data = await cat(*args, **kwargs)
        returned.append(len(data))
        return data

    store.fs._cat_file = counted
    s3_head = casstore.store._clients.s3_head  # S3's reads bounded by a size (FsspecStore.head)

    async def counted_heads(*args, **kwargs):
        data = await s3_head(*args, **kwargs)
        returned.append(len(data))
        return data

    monkeypatch.setattr(casstore.store._clients, "s3_head", counted_heads)
    for call in (lambda: casstore.read_manifest(store, 3), lambda: casstore.restore(store, 3),
                 lambda: casstore.copy(store, casstore.store.MemoryStore(), steps=[3])):
        with pytest.raises(casstore.ManifestError, match="over 200 bytes: exceeds the size"):
            call()
    assert max(returned) == 201  # the first 200 + 1 bytes, on each call


class CutShort(FaultyStore):
    """Reads of objects under ``prefixes`` return half their bytes (a response without
    Content-Length whose connection ended early: the client cannot tell): each object's first
    read only, or with ``always`` every read."""

    def __init__(self, inner, prefixes=("chunks/", "deltas/", "runs/"), always=False):
        super().__init__(inner, seed=0, rate=0.0)
        self.prefixes, self.always, self.cut = prefixes, always, set()

    def get(self, key):
        data = self.inner.get(key)
        if key.startswith(self.prefixes) and (self.always or key not in self.cut):
            self.cut.add(key)
            return data[:len(data) // 2]
        return data


@pytest.mark.parametrize("backend", ["local", "seaweedfs"])
def test_a_body_cut_short_on_its_way_is_read_again_not_reported_as_damage(backend, tmp_path,
                                                                         request, caplog):
    """A chunk, delta or manifest whose first read came back short passes when read again:
    restore, verify, read_manifest and copy succeed (a warning names the object); an object
    that is short every time stays an error."""
    inner = (casstore.LocalStore(tmp_path / "repo") if backend == "local" else
             object_store(request.getfixturevalue("object_servers")["seaweedfs"]))
    rng = np.random.default_rng(0)
    w = rng.standard_normal(40_000).astype(np.float32)
    casstore.save(inner, 0, {"w": w, "b": np.arange(10.0)}, chunk_size_bytes=16384, delta=True)
    w[::97] += 1  # a few elements per chunk change: chunks stored as deltas on step 0's
    casstore.save(inner, 1, {"w": w, "b": np.arange(10.0)}, chunk_size_bytes=16384, delta=True)
    assert any(r.base for leaf in casstore.read_manifest(inner, 1).leaves for r in leaf.chunks)

    assert casstore.read_manifest(CutShort(inner), 1).step == 1
    np.testing.assert_array_equal(casstore.restore(CutShort(inner), 1)["w"], w)
    report = casstore.verify(CutShort(inner))
    assert report.ok, report.problems
    assert report.chunks_checked > 0
    for verify in (False, True):
        dst = casstore.LocalStore(tmp_path / f"copy-{verify}")
        info = casstore.copy(CutShort(inner), dst, verify=verify)
        assert len(info.steps_copied) == 2
        assert casstore.verify(dst).ok
        np.testing.assert_array_equal(casstore.restore(dst, 1)["w"], w)
    assert "passed when read again" in caplog.text

    with pytest.raises(casstore.ManifestError, match="step 1"):
        casstore.read_manifest(CutShort(inner, ("runs/",), always=True), 1)
    with pytest.raises(casstore.ManifestError, match="config object"):
        casstore.read_manifest(FaultyStore(inner, seed=0, rate=1.0, kinds=("truncated",)), 1)
    damaged = CutShort(inner, ("deltas/",), always=True)
    with pytest.raises(casstore.CorruptChunkError, match="step 1"):
        casstore.restore(damaged, 1)
    report = casstore.verify(damaged)
    assert not report.ok
    assert {p.kind for p in report.problems} == {"corrupt"}
    with pytest.raises(casstore.CorruptChunkError, match="bad chunk object"):
        casstore.copy(damaged, casstore.LocalStore(tmp_path / "copy-damaged"))
    casstore.save(CutShort(inner, ("config",)), 9, {"b": np.arange(3.0)})  # read it again
    assert casstore.list_steps(inner) == [0, 1, 9]


def test_a_verifying_copy_reads_a_deltas_base_again_when_it_came_back_short(tmp_path):
    """copy(verify=True) rebuilt the delta again on the base it held, the same short bytes,
    and left the step out; the base is now read again too."""
    from casstore._layout import chunk_key

    src = casstore.LocalStore(tmp_path / "src")
    a = np.random.default_rng(0).normal(0, 0.02, 1 << 20).astype(np.float32)
    casstore.save(src, 1, {"w": a})
    b = a.copy()
    b[::1000] += 1e-3
    casstore.save(src, 2, {"w": b})
    refs = casstore.read_manifest(src, 2).leaves[0].chunks
    base = chunk_key(next(r.base for r in refs if r.base is not None))
    head, cut = src.head, []

    def first_read_of_the_base_short(key, nbytes):
        data = head(key, nbytes)
        if key == base and not cut:
            cut.append(key)
            return data[:len(data) // 2]
        return data

    src.head = first_read_of_the_base_short
    info = casstore.copy(src, tmp_path / "dst", steps=[2], verify=True)
    assert cut == [base]
    assert info.steps_copied == (("default", 2),)
    np.testing.assert_array_equal(casstore.restore(tmp_path / "dst", 2)["w"], b)


def test_a_second_read_that_times_out_names_the_step_and_key_path():
    """The chunk's first read came back short and its second read stalled: the
    StoreTimeoutError names step, key path and chunk id, as a first read's does."""
    class ShortThenStalled(casstore.MemoryStore):
        reads = 0

        def get(self, key):
            data = super().get(key)
            if key.startswith("chunks/"):
                self.reads += 1
                if self.reads == 1:
                    return data[:len(data) // 2]
                raise casstore.StoreTimeoutError("no answer within 1 s", key=key,
                                                 url=self.url)
            return data

    store = ShortThenStalled()
    casstore.save(store, 3, {"w": np.arange(10_000.0)})
    with pytest.raises(casstore.StoreTimeoutError, match="no answer") as info:
        casstore.restore(store, 3)
    assert (info.value.step, info.value.key_path) == (3, "w")
    assert info.value.chunk_id in casstore.read_manifest(store, 3).chunk_ids()
