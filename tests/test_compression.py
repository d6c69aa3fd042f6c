"""The codec a save writes, chosen by what the store can take (docs/tuning.md)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

import casstore
from casstore import _compression, _save_encode
from casstore._codec import CODEC_EXPONENT_PLANES, CODEC_RAW, HEADER
from casstore._compression import (
    MIN_MEASURED_BYTES,
    PLANES,
    RAW,
    choose,
    chunk_settings,
    encodings,
    measured_encode,
    measured_write,
    save_seconds,
    write_bytes_per_s,
)
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


class SlowDisk(LocalStore):
    """A local directory whose every put takes as long as a 40 MB/s stream would."""

    def put(self, key, data):
        time.sleep(memoryview(data).nbytes / 40e6)
        super().put(key, data)


def test_a_save_measures_its_disk_and_the_next_save_to_that_disk_picks_the_codec_from_it(
        tmp_path, monkeypatch):
    monkeypatch.setattr(_compression, "usable_cores", lambda: 2)
    rng = np.random.default_rng(2)
    state = {"w": (rng.standard_normal((5, 4 << 20)) * 0.02).astype(np.float32)}  # 80 MiB
    slow = SlowDisk(tmp_path / "slow")
    assert write_bytes_per_s(slow) == LocalStore.write_bytes_per_s  # nothing measured yet
    casstore.save(slow, 1, state, max_workers=4, chunk_size_bytes=4 << 20)
    assert _codecs(slow) == {CODEC_RAW}  # 2.5 GB/s assumed: raw on 2 cores
    # 4 upload threads of 40 MB/s each, less what the real writes add to each put
    assert 10e6 < write_bytes_per_s(slow) <= 160e6
    other = LocalStore(tmp_path / "other")  # another directory of the same filesystem
    assert write_bytes_per_s(other) == write_bytes_per_s(slow)
    casstore.save(other, 1, {"v": state["w"][:1]}, chunk_size_bytes=4 << 20)
    assert _codecs(other) == {CODEC_EXPONENT_PLANES}  # byte planes: the disk bounds the save
    assert casstore.restore(other, 1)["v"].tobytes() == state["w"][:1].tobytes()
    other.write_bytes_per_s = 10e9  # a figure set on the store object wins
    assert write_bytes_per_s(other) == 10e9
    assert chunk_settings(other, None, None, 4) == (True, False)


def test_a_save_of_few_bytes_measures_nothing_and_each_memory_store_is_its_own_medium():
    first, second = MemoryStore(), MemoryStore()
    measured_write(first, MIN_MEASURED_BYTES - 1, 1e-6, 4)
    assert write_bytes_per_s(first) == MemoryStore.write_bytes_per_s
    measured_write(first, MIN_MEASURED_BYTES, 0.5, 4)
    assert write_bytes_per_s(first) == MIN_MEASURED_BYTES / 0.5 * 4
    assert write_bytes_per_s(second) == MemoryStore.write_bytes_per_s
    assert chunk_settings(second, None, None, 4)[1]  # 100 MB/s: byte planes


def test_an_encoder_slowed_by_a_busy_cpu_is_measured_and_auto_then_stores_raw(monkeypatch):
    monkeypatch.setattr(_compression, "usable_cores", lambda: 2)
    encode = _save_encode.encode_chunk

    def busy(raw, **kwargs):  # byte planes at 20 MB/s a thread, as on a crowded machine
        time.sleep(len(raw) / 20e6)
        return encode(raw, **kwargs)

    monkeypatch.setattr(_save_encode, "encode_chunk", busy)
    rng = np.random.default_rng(3)
    state = {"w": (rng.standard_normal((5, 4 << 20)) * 0.02).astype(np.float32)}  # 80 MiB
    store = MemoryStore()
    store.write_bytes_per_s = 100e6  # set on the object: the write figure stays this
    assert chunk_settings(store, None, None, 2) == (True, True)  # byte planes, as measured
    casstore.save(store, 1, state, max_workers=2, chunk_size_bytes=4 << 20)
    assert _codecs(store) == {CODEC_EXPONENT_PLANES}
    planes = encodings()[0]
    assert planes.name == "planes"
    assert 5e6 < planes.encode_per_core <= 20e6  # 2 threads on 2 cores, each under 20 MB/s
    # 2 cores at under 20 MB/s: 25 ns a byte or more, where raw chunks take 10 at 100 MB/s
    assert chunk_settings(store, None, None, 2) == (True, False)
    assert choose("bytes", 100e6, 100e6, 2) == planes  # "bytes" still writes byte planes
    casstore.save(store, 2, {"v": state["w"][:1] + 1}, max_workers=2, chunk_size_bytes=4 << 20)
    assert CODEC_RAW in _codecs(store)
    measured_encode(None, MIN_MEASURED_BYTES, 0.001, 2)  # another zstd level: not remembered
    measured_encode("planes", MIN_MEASURED_BYTES - 1, 0.001, 2)  # too few bytes to tell
    assert encodings()[0] == planes
