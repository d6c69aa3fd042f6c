"""Pytree structure and key paths (format.md §4.2 and §5).

:func:`flatten` walks a pytree with ``jax.tree_util`` one level at a time and returns the
manifest's tree structure plus ``(key path string, leaf)`` pairs; :func:`unflatten_plain`
rebuilds plain dict / list / tuple containers from the structure; :func:`path_str` gives the
storage form of a jax key path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ._errors import UnsupportedLeafError
from ._lazy import LazyModule

jax = LazyModule("jax")  # imported on first use: reading manifests needs no jax
tu = LazyModule("jax.tree_util")
SCALAR_TYPES = (bool, int, float, complex, str, bytes)
MAX_DEPTH = 256
_INDEX = r"\[-?[0-9]+\]|\[=-?[0-9]+\]"
_NAME = r"(?:[^~/\[]|~[0-3])+"
_ELEMENT = re.compile(rf"{_INDEX}|~3|{_NAME}")
_PATH = re.compile(rf"(?:{_ELEMENT.pattern})(?:/(?:{_ELEMENT.pattern}))*")  # one match a path


def _has_surrogate(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False


def escape_name(name: str) -> str:
    """The storage form of a dict key or attribute name (format.md §5).

    Raises:
      TypeError: the name contains a NUL character, which key paths never hold.
    """
    if "\0" in name or _has_surrogate(name):
        raise TypeError(f"key {name!r} contains NUL or is not valid Unicode")
    if name == "":
        return "~3"
    return name.replace("~", "~0").replace("/", "~1").replace("[", "~2")


def element_str(key: Any) -> str:
    """The storage form of one jax key-path entry (DictKey, GetAttrKey, SequenceKey, ...).

    Raises:
      TypeError: a dict key that is neither str nor int, or an int beyond a signed 64-bit one.
    """
    if isinstance(key, tu.DictKey):
        k = key.key
        if isinstance(k, str):
            return escape_name(k)
        if isinstance(k, int) and not isinstance(k, bool) and -2**63 <= k < 2**63:
            return f"[={k}]"
        if isinstance(k, int) and not isinstance(k, bool):  # (format.md §4.2)
            raise TypeError(f"dict key {k} does not fit in a signed 64-bit int")
        raise TypeError(f"dict key {k!r} of type {type(k).__name__} is not str or int")
    if isinstance(key, tu.GetAttrKey):
        return escape_name(key.name)
    if isinstance(key, tu.SequenceKey):
        return f"[{key.idx}]"
    if isinstance(key, tu.FlattenedIndexKey):
        return f"[{key.key}]"
    raise TypeError(f"unsupported key path entry {key!r}")


def path_str(keys: tuple) -> str:
    """The storage form of a jax key path: elements joined by ``/`` (format.md §5)."""
    return "/".join(element_str(k) for k in keys)


def is_valid_path(path: object) -> bool:
    """True if ``path`` is a well-formed key path string (format.md §5)."""
    if not isinstance(path, str) or "\0" in path or _has_surrogate(path) or len(
            path.encode()) > 4096:
        return False
    return path == "" or _PATH.fullmatch(path) is not None


def matches(path: str, prefixes: Sequence[str] | None) -> bool:
    """True if ``path`` equals a prefix or lies below one (``prefix + "/"``); None matches all.

    Raises:
      TypeError: ``prefixes`` is a string (``paths="params"``), which would match by its
        letters (the message says to pass ``["params"]``), or holds something not a string.
    """
    if prefixes is None:
        return True
    _check_prefixes(prefixes)
    return any(p == "" or path == p or path.startswith(p + "/") for p in prefixes)


def _check_prefixes(prefixes: Sequence[str]) -> None:
    """Raises :func:`matches`'s TypeError for ``prefixes`` that are no list of strings."""
    if isinstance(prefixes, str):
        raise TypeError(f"key-path prefixes are a list of strings: pass [{prefixes!r}], not "
                        f"the string {prefixes!r}")
    if not_text := [p for p in prefixes if not isinstance(p, str)]:
        raise TypeError("key-path prefixes are a list of strings ('params/w', "
                        f"'opt_state/[0]/mu'), not {not_text[0]!r} of type "
                        f"{type(not_text[0]).__name__}")


def prefix_matcher(prefixes: Sequence[str] | None) -> Callable[[str], bool]:
    """:func:`matches` for many paths against one list of ``prefixes``: checked and hashed once,
    then each path costs one set lookup per element of it (a restore of every one of 20,000
    leaves by name was quadratic). Raises as :func:`matches`."""
    if prefixes is None:
        return lambda path: True
    _check_prefixes(prefixes)
    if "" in (wanted := frozenset(prefixes)):
        return lambda path: True
    return lambda path: any(path[:i] in wanted for i in _ends(path))


def unmatched(prefixes: Sequence[str] | None, paths: Iterable[str]) -> list[str]:
    """The ``prefixes`` that none of ``paths`` equals or lies below, in their order."""
    above = {path[:i] for path in paths for i in _ends(path)}
    return [p for p in prefixes or () if (not above if p == "" else p not in above)]


def _ends(path: str) -> list[int]:
    """Where each key path above ``path``, and ``path`` itself, ends in it."""
    return [i for i, c in enumerate(path) if c == "/"] + [len(path)]


def is_leaf_value(x: Any) -> bool:
    """True for what casstore stores as a leaf: arrays and plain Python scalars."""
    return isinstance(x, (np.ndarray, np.generic, jax.Array, *SCALAR_TYPES))


def _type_name(x: Any) -> str:
    t = type(x)
    return f"{t.__module__}.{t.__qualname__}"


def flatten(tree: Any) -> tuple[dict, list[tuple[str, Any]]]:
    """Walks ``tree`` into the manifest's structure and its leaves (format.md §4.2).

    Args:
      tree: any pytree whose leaves are arrays, Python scalars, strings, bytes or None.

    Returns:
      ``(node, leaves)``: the root node as the manifest stores it, and ``(key path, value)``
      for every leaf in order. ``None`` is a node of the structure, not a leaf.

    Raises:
      UnsupportedLeafError: a leaf is some other object, a dict key is not str or int, or the
        tree is deeper than 256 levels; the message names the key path.
    """
    leaves: list[tuple[str, Any]] = []
    return _walk(tree, (), leaves), leaves


def _walk(node: Any, path: tuple[str, ...], leaves: list) -> dict:
    if len(path) > MAX_DEPTH:
        raise UnsupportedLeafError(f"tree is nested deeper than {MAX_DEPTH} levels (format.md "
                                   "§4.2)", key_path="/".join(path[:8]) + "/...")
    if node is None:  # a tree node without children, as in jax (format.md §4.2)
        return {"t": "none"}
    if is_leaf_value(node):
        leaves.append(("/".join(path), node))
        return {"t": "leaf", "i": len(leaves) - 1}
    try:
        children, treedef = tu.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    except ValueError as e:  # e.g. dict keys of mixed types, which jax cannot sort
        raise UnsupportedLeafError(f"cannot flatten this node: {e}",
                                   key_path="/".join(path)) from e
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:  # not a pytree node
        raise UnsupportedLeafError(
            f"cannot store a leaf of type {_type_name(node)}: only arrays, Python scalars, "
            "str and bytes are stored (casstore never pickles)", key_path="/".join(path))
    try:
        elements = [element_str(keys[0]) for keys, _ in children]
    except TypeError as e:
        raise UnsupportedLeafError(str(e), key_path="/".join(path)) from e
    nodes = [_walk(child, (*path, el), leaves) for el, (_, child) in zip(elements, children)]
    if isinstance(node, list) or (isinstance(node, tuple) and not hasattr(node, "_fields")):
        return {"t": "list" if isinstance(node, list) else "tuple", "c": nodes,
                "type": _type_name(node)}
    if children and all(isinstance(k[0], (tu.SequenceKey, tu.FlattenedIndexKey))
                        for k, _ in children):
        return {"t": "list", "c": nodes, "type": _type_name(node)}
    if not all(isinstance(k[0], (tu.DictKey, tu.GetAttrKey)) for k, _ in children):
        raise UnsupportedLeafError(
            f"a {_type_name(node)} node's children mix sequence indices and names "
            f"({', '.join(elements[:4])}{', ...' if len(elements) > 4 else ''}), which no "
            "manifest tree node holds (format.md §4.2); save its state instead (flax nnx: "
            "nnx.state(model))", key_path="/".join(path))
    keys = [k[0].key if isinstance(k[0], tu.DictKey) else k[0].name for k, _ in children]
    return {"t": "dict", "k": keys, "c": nodes, "type": _type_name(node)}


def unflatten_plain(node: dict, values: dict[int, Any], keep: set[int] | None = None) -> Any:
    """Rebuilds plain containers from a manifest tree node (format.md §4.2).

    Args:
      node: a validated manifest tree node.
      values: leaf index -> restored value.
      keep: leaf indices to include; dict entries without any kept leaf are dropped, and
        sequence positions without one become None. None keeps everything.

    Returns:
      Nested dict / list / tuple / None with the restored values at the leaves.
    """
    t = node["t"]
    if t == "leaf":
        return values.get(node["i"])
    if t == "none":
        return None
    children = [unflatten_plain(c, values, keep) for c in node["c"]]
    if t == "dict":
        return {k: v for k, v, c in zip(node["k"], children, node["c"])
                if keep is None or _has_kept(c, keep)}
    return list(children) if t == "list" else tuple(children)


def _has_kept(node: dict, keep: set[int]) -> bool:
    if node["t"] == "leaf":
        return node["i"] in keep
    return any(_has_kept(c, keep) for c in node.get("c", ()))
