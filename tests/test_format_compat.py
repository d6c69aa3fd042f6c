"""An older reader against a newer format (format.md §10): every unknown feature, codec or
version is refused with UnsupportedFormatError naming it and the casstore that reads it,
before any chunk is read, and verify reports it as unsupported, never as damage."""

import re

import msgpack
import numpy as np
import pytest

import casstore
from casstore import _format
from casstore._codec import HEADER
from casstore._layout import CHUNKS_PREFIX, manifest_key
from casstore._manifest import features_of
from casstore.store import CountingStore, MemoryStore

from conftest import repack

TREE = {"w": np.arange(64 * 1024, dtype=np.float32) / 3, "b": np.ones(100, np.float32),
        "c": np.zeros(100, np.float32), "n": 3}


@pytest.fixture
def store() -> MemoryStore:
    store = MemoryStore()
    casstore.save(store, 1, TREE, chunk_size_bytes=64 * 1024)
    return store


def rewrite(store: MemoryStore, key: str, **fields) -> None:
    """Replaces fields of the msgpack map at ``key``, as a newer writer would have written."""
    doc = msgpack.unpackb(store.get(key), raw=False, strict_map_key=False)
    doc.update(fields)
    store.delete(key)
    store.put(key, repack(doc))


def test_a_new_save_records_its_features_and_min_reader(store):
    config = msgpack.unpackb(store.get("config"))
    assert config["features"] == sorted(_format.FEATURES)
    assert config["min_reader"] == _format.READER_VERSION
    doc = msgpack.unpackb(store.get(manifest_key("default", 1)))
    assert list(doc)[:4] == ["format", "version", "features", "min_reader"]  # §4.1 order
    assert doc["features"] == ["codec-5", "pack"]  # b and c are packed; no delta yet
    assert features_of(casstore.read_manifest(store, 1)) == doc["features"]
    casstore.save(store, 2, {"n": 4})
    assert msgpack.unpackb(store.get(manifest_key("default", 2)))["features"] == []


@pytest.mark.parametrize(("fields", "named"), [
    ({"features": ["codec-5", "codec-9"], "min_reader": "9.1.0"},
     r"feature 'codec-9'.*casstore >= 9\.1\.0 reads it"),
    ({"min_reader": "9.1"}, r"min_reader 9\.1.*casstore >= 9\.1 reads it"),
    ({"version": 3, "min_reader": "9.2"}, r"version 3.*casstore >= 9\.2 reads it"),
])
def test_a_manifest_of_a_newer_format_is_refused_before_any_chunk_is_read(store, fields, named):
    rewrite(store, manifest_key("default", 1), **fields)
    counting = CountingStore(store)
    with pytest.raises(casstore.UnsupportedFormatError, match=named) as e:
        casstore.restore(counting, 1)
    assert e.value.step == 1
    assert e.value.run == "default"
    assert e.value.reader == _format.READER_VERSION
    assert not [k for k in counting.keys_read if k.startswith(CHUNKS_PREFIX)]
    assert isinstance(e.value, casstore.ManifestError)  # as unknown versions always were
    report = casstore.verify(store)
    assert not report.ok
    assert report.unsupported == report.problems
    assert report.problems[0].step == 1
    assert "unsupported format" in report.problems[0].message


@pytest.mark.parametrize(("fields", "named"), [
    ({"features": ["codec-5", "sha256-ids"], "min_reader": "2.0.0"}, "feature 'sha256-ids'"),
    ({"min_reader": "2.0.0"}, "min_reader 2.0.0"),
    ({"version": 2, "min_reader": "2.0.0"}, "repository version 2"),
    ({"hash": "blake3", "min_reader": "2.0.0"}, "hash 'blake3'"),
])
def test_a_repository_of_a_newer_format_is_refused_by_every_entry_point(store, fields, named):
    rewrite(store, "config", **fields)
    for call in (lambda: casstore.list_steps(store), lambda: casstore.restore(store, 1),
                 lambda: casstore.save(store, 2, TREE)):
        with pytest.raises(casstore.UnsupportedFormatError, match=named):
            call()
    report = casstore.verify(store)
    assert [p.kind for p in report.problems] == ["unsupported"]
    assert named in report.problems[0].message


def test_an_older_reader_refuses_a_repository_using_a_feature_it_predates(monkeypatch):
    """A reader from before delta chunks meets a repository a newer writer made with them."""
    store = MemoryStore()
    w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    casstore.save(store, 1, {"w": w}, chunk_size_bytes=64 * 1024)
    w[::32] += np.float32(1e-6)
    casstore.save(store, 2, {"w": w}, chunk_size_bytes=64 * 1024)
    assert "delta" in msgpack.unpackb(store.get(manifest_key("default", 2)))["features"]
    # The older reader: it knows no "delta" and reads the format of an earlier release.
    monkeypatch.setattr(_format, "FEATURES", {"codec-5": "0.0.9", "pack": "0.0.9"})
    monkeypatch.setattr(_format, "READER_VERSION", "0.0.9")
    with pytest.raises(casstore.UnsupportedFormatError,
                       match=r"feature 'delta'.*reads the format of casstore 0\.0\.9.*"
                             r"casstore >= 0\.1\.0 reads it"):
        casstore.restore(store, 2)
    assert casstore.verify(store).unsupported  # reported as such, never as corruption


def test_a_chunk_of_an_unknown_codec_is_unsupported_not_corrupt(store):
    """A newer writer's chunk can sit under an older manifest (dedup): named at decode."""
    ref = next(leaf for leaf in casstore.read_manifest(store, 1).leaves if leaf.path == "w"
               ).chunks[0]
    data = bytearray(store.get(ref.key))
    magic, version, _, k, length = HEADER.unpack_from(data)
    HEADER.pack_into(data, 0, magic, version, 9, k, length)
    store.delete(ref.key)
    store.put(ref.key, bytes(data))
    with pytest.raises(casstore.UnsupportedFormatError, match="chunk codec 9") as e:
        casstore.restore(store, 1)
    assert e.value.chunk_id == ref.id
    report = casstore.verify(store)
    assert [(p.kind, p.key_path, p.chunk_id) for p in report.problems] == [
        ("unsupported", "w", ref.id)]
    dst = MemoryStore()  # a copy's framing check says the same, and commits nothing
    with pytest.raises(casstore.UnsupportedFormatError, match="chunk codec 9"):
        casstore.copy(store, dst)
    assert casstore.list_steps(dst) == []


def test_a_delta_object_of_a_newer_header_version_is_unsupported_not_corrupt():
    store = MemoryStore()
    w = np.arange(64 * 1024, dtype=np.float32) / 3
    casstore.save(store, 0, {"w": w}, chunk_size_bytes=64 * 1024)
    w[::1000] += 1
    casstore.save(store, 1, {"w": w}, chunk_size_bytes=64 * 1024)
    ref = casstore.read_manifest(store, 1).leaves[0].chunks[0]
    assert ref.base is not None
    data = bytearray(store.get(ref.key))
    magic, _, codec, k, length = HEADER.unpack_from(data)
    HEADER.pack_into(data, 0, magic, 2, codec, k, length)
    store.delete(ref.key)
    store.put(ref.key, bytes(data))
    with pytest.raises(casstore.UnsupportedFormatError, match="chunk header version 2"):
        casstore.restore(store, 1)
    assert [p.kind for p in casstore.verify(store).problems] == ["unsupported"]
    with pytest.raises(casstore.UnsupportedFormatError, match="chunk header version 2"):
        casstore.copy(store, MemoryStore())


@pytest.mark.parametrize(("fields", "message"), [
    ({"features": "codec-5"}, "bad features list"), ({"features": [5]}, "bad features list"),
    ({"min_reader": "latest"}, "bad min_reader"), ({"min_reader": 2}, "bad min_reader"),
    ({"version": 0}, "bad version 0"), ({"version": "2"}, "bad version '2'"),
])
def test_damaged_format_fields_are_damage_not_a_newer_format(store, fields, message):
    rewrite(store, manifest_key("default", 1), **fields)
    with pytest.raises(casstore.ManifestError, match=message) as e:
        casstore.read_manifest(store, 1)
    assert not isinstance(e.value, casstore.UnsupportedFormatError)
    assert [p.kind for p in casstore.verify(store).problems] == ["manifest"]


def test_the_feature_table_is_read_by_this_release():
    """Every feature a writer may list is readable by READER_VERSION (bump both together)."""
    assert all(_format.version_tuple(v) <= _format.version_tuple(_format.READER_VERSION)
               for v in _format.FEATURES.values())
    assert _format.min_reader(sorted(_format.FEATURES)) == _format.READER_VERSION
    assert _format.version_tuple("0.10.0") > _format.version_tuple("0.9.1")


@pytest.mark.parametrize(("key", "fields", "named"), [
    ("config", {"version": 2}, "repository version 2"),
    ("config", {"hash": "xxh3-12("}, "hash 'xxh3-12('"),
    ("config", {"features": ["pAck"]}, "feature 'pAck'"),
    ("manifest", {"version": 3}, "version 3"),
])
def test_an_unknown_version_hash_or_feature_without_a_newer_min_reader_is_damage(
        store, key, fields, named):
    """What a flipped bit makes of the config object (which has no digest) or an older
    manifest: a newer writer would have named a newer min_reader, so it is damage (verify's
    "damaged", exit 1, mended by repair), not "upgrade casstore"."""
    rewrite(store, "config" if key == "config" else manifest_key("default", 1), **fields)
    with pytest.raises(casstore.ManifestError, match=rf"unknown {re.escape(named)}.*damaged"
                       ) as e:
        casstore.restore(store, 1)
    assert not isinstance(e.value, casstore.UnsupportedFormatError)
    assert not casstore.verify(store).unsupported


@pytest.mark.parametrize("min_reader", [_format.READER_VERSION, None])
def test_an_unknown_feature_this_release_is_said_to_read_is_damage_not_a_newer_format(
        min_reader):
    """A newer writer's feature always comes with a newer min_reader: a feature name this
    release does not know, under a min_reader it meets, is a damaged name ('coDec-5'),
    reported as damage (exit 1), never as "upgrade casstore" (exit 14)."""
    fields = {"features": ["coDec-5"], **({"min_reader": min_reader} if min_reader else {})}
    with pytest.raises(casstore.ManifestError, match=r"unknown feature 'coDec-5'.*damaged") as e:
        _format.check_features(fields, url="u", run="default", step=1)
    assert not isinstance(e.value, casstore.UnsupportedFormatError)
    with pytest.raises(casstore.UnsupportedFormatError, match="feature 'coDec-5'"):
        _format.check_features({**fields, "min_reader": "9.0.0"}, url="u", run="default", step=1)


def test_gc_refuses_a_repository_with_a_step_of_a_newer_format(store):
    """GC cannot know what a newer step references, so it deletes nothing (format.md §8)."""
    casstore.save(store, 2, {"w": np.ones(10_000, np.float32)})
    rewrite(store, manifest_key("default", 2), features=["codec-9"], min_reader="9.0.0")
    keys = sorted(info.key for info in store.list(""))
    casstore.delete(store, 1)  # its chunks are garbage to a GC that could read step 2
    with pytest.raises(casstore.ManifestError,
                       match=r"gc refused.*needs a newer casstore.*feature 'codec-9'"):
        casstore.gc(store, grace_period_s=0)
    assert sorted(info.key for info in store.list("")) == [
        k for k in keys if k != manifest_key("default", 1)]


def test_a_newer_manifest_is_counted_and_exits_as_newer_never_as_damage(tmp_path):
    """verify counts it under manifests_unsupported (not manifests_damaged); gc refuses with
    UnsupportedFormatError; the CLI's verify, ls and gc exit 14 (upgrade), not 1 (damaged),
    and ls marks the row "newer format". The CLI runs through click's CliRunner, as in
    test_cli.py, whose one ``python -m casstore`` run checks that entry point."""
    from click.testing import CliRunner

    from casstore import cli as casstore_cli

    store = casstore.LocalStore(tmp_path / "repo")
    casstore.save(store, 1, TREE)
    casstore.save(store, 2, {"n": 1})
    rewrite(store, manifest_key("default", 2), features=["zstd-dict"], min_reader="9.0.0")
    report = casstore.verify(store)
    assert (report.manifests_damaged, report.manifests_unsupported) == (0, 1)
    assert len(report.problems) == report.manifests_unsupported
    with pytest.raises(casstore.UnsupportedFormatError, match=r"1 manifest\(s\) \(default@2\)"):
        casstore.gc(store)

    def cli(*args):
        return CliRunner().invoke(casstore_cli.main, [*args, str(tmp_path / "repo")])

    for command in (["verify"], ["ls"], ["gc"], ["gc", "--dry-run"]):
        out = cli(*command)
        assert out.exit_code == 14, (command, out.stdout, out.stderr, out.exception)
        assert not re.search(r"[1-9]\d* damaged|(?<!not )damaged:|\bdamaged\b\s*│",
                             out.stdout + out.stderr), (command, out.stdout, out.stderr)
    assert "newer format" in cli("ls").stdout
    casstore.save(store, 3, {"n": 3})
    (tmp_path / "repo" / "runs" / "default" / "steps" / f"{3:016d}.manifest").write_bytes(b"x")
    assert cli("verify").exit_code == 1  # damage as well: 1 wins


def test_a_damaged_name_of_the_digest_never_turns_its_check_off(store):
    """A flipped bit in the word ``digest`` made the manifest read as one written before the
    digest existed: a second flipped bit, in an inline value, then restored as another value
    with no error, and verify called it sound (exploratory session's repro)."""
    casstore.save(store, 7, {"small": np.arange(4, dtype=np.float32)})
    key = manifest_key("default", 7)
    data = store.get(key)
    name = data.rindex(b"digest")
    value = data.index(np.arange(4, dtype=np.float32).tobytes())
    for bit in range(6 * 8):
        damaged = bytearray(data)
        damaged[name + bit // 8] ^= 1 << bit % 8
        damaged[value + 5] ^= 0x04  # 1.0 -> 1.0019531
        store.delete(key)
        store.put(key, bytes(damaged))
        with pytest.raises(casstore.ManifestError, match=r"invalid manifest: (not msgpack|bad d)"):
            casstore.restore(store, 7)
        assert not casstore.verify(store).ok
