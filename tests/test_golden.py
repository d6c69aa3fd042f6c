"""The committed golden repositories must keep loading, bit-exact, in every later version:
v1 (the first format, without the ``features`` fields), v2-features (codec 5, deltas,
packs, two runs, bfloat16, a sharded leaf; format.md §10) and v3-digest (manifests with their
``digest``, format.md §4.1)."""

import collections

import jax
import msgpack
import numpy as np
from golden import GOLDEN, GOLDEN_V2, GOLDEN_V3, V2_STEPS, golden_tree, golden_v2_tree

import casstore
from casstore._codec import HEADER
from casstore.store import LocalStore


def assert_restores_bit_exact(restored, expected) -> None:
    e_leaves = jax.tree_util.tree_leaves_with_path(expected)
    r_leaves = dict(jax.tree_util.tree_leaves_with_path(restored))
    assert len(e_leaves) == len(r_leaves)
    for path, value in e_leaves:
        got = r_leaves[path]
        if isinstance(value, jax.Array):  # the typed PRNG key
            np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(value))
        elif isinstance(value, (np.ndarray, np.generic)):  # restored little-endian
            value = np.asarray(value)
            assert got.dtype == value.dtype.newbyteorder("=")
            assert got.shape == value.shape
            assert value.astype(got.dtype).tobytes() == got.tobytes(), path
        else:
            assert type(got) is type(value)
            assert got == value


def test_golden_v1_repository_restores_bit_exact():
    store = LocalStore(GOLDEN, read_only=True)
    assert casstore.list_runs(store) == ["default"]
    assert casstore.list_steps(store) == [1, 2]
    # Written before format features were recorded: no such fields, and it still reads.
    assert "features" not in msgpack.unpackb((GOLDEN / "config").read_bytes())
    for step in (1, 2):
        restored = casstore.restore(store, step)
        assert_restores_bit_exact(restored, golden_tree(step))
        assert restored["opt"][1] is None
        assert casstore.read_manifest(store, step).metadata == {"note": "golden v1"}


def test_golden_step_2_shares_unchanged_chunks_with_step_1():
    m1, m2 = (casstore.read_manifest(GOLDEN, s) for s in (1, 2))
    assert m1.chunk_ids() & m2.chunk_ids()  # params unchanged between the steps
    assert m1.chunk_ids() != m2.chunk_ids()  # opt/mu changed


def test_golden_v2_repository_restores_bit_exact_and_verifies():
    store = LocalStore(GOLDEN_V2, read_only=True)
    assert casstore.list_runs(store) == sorted(V2_STEPS)
    for run, steps in V2_STEPS.items():
        assert casstore.list_steps(store, run=run) == list(steps)
        for step in steps:
            assert_restores_bit_exact(casstore.restore(store, step, run=run),
                                      golden_v2_tree(run, step))
    report = casstore.verify(store)
    assert report.ok, report.problems
    assert len(report.steps_checked) == 4, report.steps_checked


def test_golden_v2_repository_holds_every_feature_it_claims():
    """The fixture really exercises what it is for: each feature is present in its bytes."""
    config = msgpack.unpackb((GOLDEN_V2 / "config").read_bytes())
    assert config["features"] == ["codec-5", "delta", "pack"]
    assert config["min_reader"]
    codecs = collections.Counter(HEADER.unpack_from(p.read_bytes())[2]
                                 for p in GOLDEN_V2.glob("chunks/*/*"))
    assert codecs[5] > 0, codecs
    for run, steps in V2_STEPS.items():
        first, second = (casstore.read_manifest(GOLDEN_V2, s, run=run) for s in steps)
        leaves = {leaf.path: leaf for leaf in second.leaves}
        assert all(r.base is None for leaf in first.leaves for r in leaf.chunks)
        assert all(r.base in first.chunk_ids() for r in leaves["params/w"].chunks)
        assert any(r.offset for r in leaves["params/layers/[0]/scale"].chunks)  # a pack
        assert leaves["params/emb_bf16"].dtype == "bfloat16"
        assert leaves["params/w_sharded"].sharding == {"mesh": {"data": 4, "model": 2},
                                                       "spec": ["data", "model"]}
        assert len(leaves["params/w_sharded"].chunks) == 8  # one per shard
        raw = msgpack.unpackb((GOLDEN_V2 / "runs" / run / "steps" / f"{steps[1]:016d}.manifest"
                               ).read_bytes())
        assert raw["version"] == 2
        assert raw["features"] == ["codec-5", "delta", "pack"]
    assert list(GOLDEN_V2.glob("deltas/*/*"))


def test_golden_v3_repository_restores_bit_exact_and_its_manifest_digest_checks():
    store = LocalStore(GOLDEN_V3, read_only=True)
    assert casstore.list_steps(store) == [1]
    assert_restores_bit_exact(casstore.restore(store, 1), golden_tree(1))
    data = (GOLDEN_V3 / "runs" / "default" / "steps" / f"{1:016d}.manifest").read_bytes()
    assert list(msgpack.unpackb(data))[-1] == "digest"
    assert casstore.read_manifest(store, 1).metadata == {"note": "golden v3-digest"}
    assert casstore.verify(store).ok
