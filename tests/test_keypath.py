"""Key path strings (format.md §5) and tree structure (§4.2)."""

import collections

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import casstore
from casstore._keypath import (
    escape_name,
    flatten,
    is_valid_path,
    matches,
    path_str,
    prefix_matcher,
    unflatten_plain,
    unmatched,
)

tu = jax.tree_util


@pytest.mark.parametrize(("keys", "expected"), [
    ((tu.DictKey("params"), tu.DictKey("dense"), tu.DictKey("kernel")), "params/dense/kernel"),
    ((tu.DictKey("opt_state"), tu.SequenceKey(0), tu.GetAttrKey("mu")), "opt_state/[0]/mu"),
    ((tu.DictKey(0),), "[=0]"),
    ((tu.SequenceKey(0),), "[0]"),
    ((tu.DictKey("0"),), "0"),
    ((tu.DictKey(-3),), "[=-3]"),
    ((tu.DictKey("a/b"),), "a~1b"),
    ((tu.DictKey("~x"),), "~0x"),
    ((tu.DictKey("[0]"),), "~20]"),
    ((tu.DictKey(""),), "~3"),
    ((), ""),
])
def test_documented_examples(keys, expected):
    assert path_str(keys) == expected
    assert is_valid_path(expected)


def test_list_index_and_int_dict_key_and_str_key_differ():
    """The ambiguity of keystr(simple=True) that the storage form avoids."""
    forms = {path_str((tu.SequenceKey(0),)), path_str((tu.DictKey(0),)),
             path_str((tu.DictKey("0"),))}
    assert len(forms) == 3


@given(st.lists(st.text(st.characters(exclude_characters="\0", exclude_categories=["Cs"]),
                        max_size=8), min_size=1, max_size=4, unique=True))
def test_escaping_is_injective(names):
    escaped = [escape_name(n) for n in names]
    assert len(set(escaped)) == len(names)
    assert all("/" not in e and is_valid_path(e) for e in escaped)


@pytest.mark.parametrize("bad", ["a//b", "a/~9", "[x]", "a\0b", "x" * 5000, 3, None, "~",
                                 "a/[\u0663]", "[=\u0663]"])  # Arabic-Indic 3: not an index
def test_invalid_paths_are_rejected(bad):
    assert not is_valid_path(bad)


def test_flatten_records_structure_and_rebuilds_plain_containers():
    Pair = collections.namedtuple("Pair", "a b")
    tree = {"x": [np.ones(1), (2, None)], "p": Pair(np.zeros(2), "s"), "e": {}}
    node, leaves = flatten(tree)
    assert [p for p, _ in leaves] == ["p/a", "p/b", "x/[0]", "x/[1]/[0]"]
    plain = unflatten_plain(node, {i: v for i, (_, v) in enumerate(leaves)})
    assert plain["p"] == {"a": leaves[0][1], "b": "s"}
    assert plain["e"] == {}
    assert isinstance(plain["x"], list)
    assert plain["x"][1] == (2, None)
    assert node["c"][1]["type"].endswith("Pair")


def test_nul_in_a_key_is_refused(tmp_path):
    with pytest.raises(casstore.UnsupportedLeafError, match="contains NUL"):
        casstore.save(tmp_path, 0, {"a\0b": np.ones(1)})


@pytest.mark.parametrize(("tree", "message"), [
    ({"vocab": {2**63: np.ones(3)}}, r"dict key 9223372036854775808 does not fit in a signed "
                                     r"64-bit int \(key path 'vocab'\)"),
    ({"meta": {"name": "run-\ud800"}}, r"str is not valid Unicode.*\(key path 'meta/name'\)")])
def test_a_key_or_str_msgpack_cannot_store_is_refused_naming_its_key_path(tmp_path, tree,
                                                                           message):
    """Both raised msgpack's OverflowError / UnicodeEncodeError, naming no key path, and from
    a manager's background save, after save() had returned True (exploratory session); a key
    from 2**63 to 2**64 - 1 was saved in a manifest that no reader takes (format.md §4.2)."""
    with pytest.raises(casstore.UnsupportedLeafError, match=message):
        casstore.save(tmp_path, 0, tree)
    with casstore.CheckpointManager(tmp_path / "m") as mngr, pytest.raises(
            casstore.UnsupportedLeafError, match=message):
        mngr.save(0, tree)
    assert casstore.list_steps(tmp_path) == []
    casstore.save(tmp_path, 0, {"vocab": {-2**63: np.ones(3), 2**63 - 1: np.ones(3)},
                                "name": "run-\u00e9"})
    assert list(casstore.restore(tmp_path, 0)["vocab"]) == [-2**63, 2**63 - 1]


def test_saved_paths_match_jax_key_paths(tmp_path):
    tree = {"a": [np.ones(2), {"b": np.zeros(3)}], "z": (np.ones(1),), "i": {3: np.ones(1)}}
    casstore.save(tmp_path, 0, tree)
    saved = [leaf.path for leaf in casstore.read_manifest(tmp_path, 0).leaves]
    assert saved == [path_str(k) for k, _ in tu.tree_flatten_with_path(tree)[0]]


PATHS = st.lists(st.sampled_from(["a", "ab", "b", "[0]", "[=1]", "~1"]), min_size=1,
                 max_size=4).map("/".join)


@given(st.lists(PATHS, max_size=12), st.lists(PATHS | st.just(""), max_size=6))
def test_the_prefix_matcher_selects_what_matches_selects(paths, prefixes):
    """prefix_matcher and unmatched (a restore or export of thousands of leaves by name: one
    set lookup per path element, where calling matches per pair was quadratic, 22 s for 4,000
    leaves) answer as matches does, prefix by prefix."""
    match = prefix_matcher(prefixes)
    assert [match(p) for p in paths] == [matches(p, prefixes) for p in paths]
    assert prefix_matcher(None)("a/b")
    assert unmatched(prefixes, paths) == [q for q in prefixes
                                          if not any(matches(p, [q]) for p in paths)]
