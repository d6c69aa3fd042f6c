"""The codec a save writes, chosen by what the store can take (docs/tuning.md)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import casstore
from casstore import _compression
from casstore._codec import CODEC_EXPONENT_PLANES, CODEC_RAW, HEADER
from casstore._compression import PLANES, RAW, choose, chunk_settings, save_seconds
from casstore.store import LocalStore, MemoryStore

LOCAL = (LocalStore.write_bytes_per_s, LocalStore.read_bytes_per_s)
OBJECT = (MemoryStore.write_bytes_per_s, MemoryStore.read_bytes_per_s)


@pytest.mark.parametrize(("throughputs", "cores", "auto", "speed"), [
    (LOCAL, 1, RAW, RAW), (LOCAL, 2, RAW, RAW), (LOCAL, 3, RAW, RAW),
    (LOCAL, 4, PLANES, RAW), (LOCAL, 5, PLANES, PLANES), (LOCAL, 16, PLANES, PLANES),
    (OBJECT, 1, PLANES, PLANES), (OBJECT, 2, PLANES, PLANES), (OBJECT, 16, PLANES, PLANES),
])
def test_the_rule_picks_as_the_tuning_page_tables_say(throughputs, cores, auto, speed):
    assert choose("auto", *throughputs, cores) is auto
    assert choose("speed", *throughputs, cores) is speed
    assert choose("bytes", *throughputs, cores) is PLANES


def test_auto_is_never_slower_than_raw_and_speed_never_slower_than_raw_save_and_restore():
    rates = [50e6, 100e6, 500e6, 1e9, 2.5e9, 10e9]
    for write, read, cores in itertools.product(rates, rates, range(1, 33)):
        auto = choose("auto", write, read, cores)
        assert save_seconds(auto, 1.0, cores, write) <= save_seconds(RAW, 1.0, cores, write)
        assert save_seconds(auto, 1.0, cores, write) == min(
            save_seconds(e, 1.0, cores, write) for e in (PLANES, RAW))


def test_unknown_compression_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="compression must be one of"):
        choose("smallest", *LOCAL)
    with pytest.raises(ValueError, match="'zstd'"):
        casstore.save(tmp_path / "r", 1, {"x": np.zeros(4)}, compression="zstd")


def test_an_explicit_shuffle_or_a_store_set_to_no_shuffle_wins(monkeypatch):
    monkeypatch.setattr(_compression, "usable_cores", lambda: 2)
    local = LocalStore("unused")
    assert chunk_settings(local, None, None, 4) == (True, False)  # raw on 2 cores
    assert chunk_settings(local, None, "bytes", 4) == (True, True)
    assert chunk_settings(local, True, None, 4) == (True, True)
    assert chunk_settings(local, False, None, 4) == (False, True)
    local.shuffle = False
    assert chunk_settings(local, None, None, 4) == (False, True)
    local.shuffle, local.compression = True, "bytes"
    assert chunk_settings(local, None, None, 4) == (True, True)
    assert chunk_settings(MemoryStore(), None, None, 4) == (True, True)  # 100 MB/s: planes


def _codecs(store) -> set[int]:
    return {HEADER.unpack_from(store.get(info.key))[2] for info in store.list("chunks")}


@pytest.mark.parametrize(("compression", "cores", "codecs"), [
    (None, 2, {CODEC_RAW}), ("auto", 2, {CODEC_RAW}), ("speed", 2, {CODEC_RAW}),
    ("bytes", 2, {CODEC_EXPONENT_PLANES}), ("auto", 8, {CODEC_EXPONENT_PLANES}),
    ("speed", 8, {CODEC_EXPONENT_PLANES}),
])
def test_every_choice_writes_its_codec_restores_bit_exact_and_dedups_with_the_others(
        tmp_path, monkeypatch, compression, cores, codecs):
    monkeypatch.setattr(_compression, "usable_cores", lambda: cores)
    rng = np.random.default_rng(cores)
    state = {"w": (rng.standard_normal((512, 600)) * 0.02).astype(np.float32),
             "b": rng.standard_normal((300, 700)).astype(np.float16)}
    store = LocalStore(tmp_path / "repo")
    info = casstore.save(store, 1, state, compression=compression, max_workers=2 * cores,
                         chunk_size_bytes=2**19)
    assert _codecs(store) == codecs
    if codecs == {CODEC_RAW}:
        assert info.written_bytes > sum(a.nbytes for a in state.values())
    restored = casstore.restore(store, 1)
    for key, value in state.items():
        assert restored[key].dtype == value.dtype
        assert restored[key].tobytes() == value.tobytes()
    other = "bytes" if codecs == {CODEC_RAW} else "speed"
    monkeypatch.setattr(_compression, "usable_cores", lambda: 2)
    assert casstore.save(store, 2, state, compression=other, delta=False,
                         chunk_size_bytes=2**19).new_chunks == 0


def test_with_raw_whole_chunks_deltas_are_judged_against_the_raw_size(tmp_path, monkeypatch):
    monkeypatch.setattr(_compression, "usable_cores", lambda: 2)  # local disk: raw chunks
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((1024, 512)) * 0.02).astype(np.float32)
    tuned = (w + rng.standard_normal(w.shape).astype(np.float32) * 1e-6).astype(np.float32)
    store = LocalStore(tmp_path / "repo")
    first = casstore.save(store, 1, {"w": w}, chunk_size_bytes=2**19)
    assert _codecs(store) == {CODEC_RAW}
    assert first.written_bytes > w.nbytes
    second = casstore.save(store, 2, {"w": tuned}, chunk_size_bytes=2**19)
    assert second.delta_chunks >= 1  # as many as the restore budget lets in
    # Saved bytes count against the chunk stored raw, so written + saved is the raw size (a
    # byte-plane estimate of the whole would put it near 0.96 of it with one delta of four).
    assert 0.97 * tuned.nbytes <= (second.written_bytes - second.manifest_bytes
                                   + second.delta_saved_bytes) <= 1.03 * tuned.nbytes
    assert casstore.restore(store, 2)["w"].tobytes() == tuned.tobytes()
