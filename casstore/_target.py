"""Matching a restore target to a checkpoint's leaves (format.md §5), before any chunk is read.

A target is a pytree whose leaves say what to return for each key path: a
``jax.ShapeDtypeStruct`` or jax.Array (a jax array of that dtype and sharding), a numpy array
(numpy of its dtype), the class ``np.ndarray`` (numpy of the saved shape and dtype, orbax's
``restore_type=np.ndarray``), a Python scalar, or :data:`PLACEHOLDER` (leave the leaf, or the
subtree saved under its key path, out and read none of its chunks). :func:`match_target` pairs
each target leaf with its saved leaf, or raises one :class:`TargetMismatchError` listing every
key path at fault. :func:`abstract_tree` builds a target from a live pytree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from ._chunking import dtype_from_name, dtype_name
from ._errors import TargetMismatchError
from ._keypath import SCALAR_TYPES, path_str, prefix_matcher, unmatched
from ._manifest import LeafEntry, Manifest
from .store import Store

PLACEHOLDER = ...
"""A target leaf that skips its key path: returned as ``...``, no chunk read (orbax's
``ocp.PLACEHOLDER``, which is also ``...``)."""


def abstract_tree(tree: Any) -> Any:
    """An abstract restore target with the structure, shapes, dtypes and shardings of ``tree``.

    orbax's ``ocp.utils.to_shape_dtype_struct`` mapped over a tree. Unlike
    ``jax.eval_shape(lambda: tree)``, each jax.Array keeps its sharding, so a restore into the
    result places every leaf as the live one is placed.

    Args:
      tree: a pytree of jax.Arrays (any sharding; typed PRNG key arrays too), numpy arrays,
        ``jax.ShapeDtypeStruct`` s, Python scalars and strings, e.g. a live train state.

    Returns:
      The same structure with each jax.Array as a ``jax.ShapeDtypeStruct(shape, dtype,
      sharding=its sharding, weak_type=its weak_type)``, each numpy array as one without a
      sharding (restored as a jax array on the default device, as orbax does), and every
      other leaf (Python scalars, strings, ``ShapeDtypeStruct`` s) unchanged. Allocates
      nothing and reads no array.
    """
    def abstract(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                        weak_type=getattr(x, "weak_type", False))
        if isinstance(x, np.ndarray | np.generic):  # in native byte order, as jax holds it
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype.newbyteorder("="))
        return x

    return jax.tree.map(abstract, tree)


def is_numpy_class(t: Any) -> bool:
    """True for the target leaf ``np.ndarray`` (the class): numpy of the saved shape and dtype
    (a saved str or bytes leaf stays that str or bytes)."""
    return t is np.ndarray


def target_shape(t: Any) -> tuple[int, ...] | None:
    """The shape a target leaf asks for; None for scalars, classes (``np.ndarray``; a class's
    ``shape`` is a descriptor) and placeholders."""
    if isinstance(t, type) or not (hasattr(t, "shape") and hasattr(t, "dtype")):
        return None
    return tuple(t.shape)


def is_concrete(t: Any) -> bool:
    """True for target leaves that hold values: jax or numpy arrays and Python scalars."""
    return isinstance(t, (jax.Array, np.ndarray, np.generic, *SCALAR_TYPES))


def returns_numpy(entry: LeafEntry, t: Any) -> bool:
    """True if a jax target leaf ``t`` is restored as numpy of its dtype instead.

    That is the case for a ``jax.ShapeDtypeStruct`` without a sharding whose dtype jax cannot
    hold with ``jax_enable_x64`` off (a 64-bit type) while the saved values need it: jax would
    narrow them (int64 to a wrapped int32, 1e300 to inf). orbax returns numpy there too.
    """
    return (isinstance(t, jax.ShapeDtypeStruct) and t.sharding is None
            and _narrowed(entry, t.dtype) is not None)


def match_target(manifest: Manifest, flat: list, store: Store, *, paths, partial: bool,
                 strict: bool, transforms, fill_missing: bool) -> list[tuple[Any, int | None]]:
    """Pairs each target leaf with its saved leaf index (None: return the target leaf as is).

    Args:
      flat: the target's ``jax.tree_util.tree_flatten_with_path`` leaves.
      paths, partial, strict, transforms, fill_missing: as :func:`casstore.restore` takes them.

    Returns:
      One ``(target leaf, saved leaf index or None)`` per target leaf, in order.

    Raises:
      TargetMismatchError: every missing, extra and mismatched key path in one error; no chunk
        is read before the whole target matches.
    """
    # a typo would return the target as it is, abstract leaves and all
    for p in unmatched(paths, (path_str(keys) for keys, _ in flat))[:1]:
        raise mismatch("no leaf of the target matches the requested path", manifest, store, p)
    selects = prefix_matcher(paths)
    by_path = _saved_by_target_path(manifest, transforms, store)
    plan: list[tuple[Any, int | None]] = []
    missing: list[tuple[str, str]] = []
    mismatched: list[tuple[str, str]] = []
    skipped: list[str] = []
    for keys, t in flat:
        path = path_str(keys)
        i = by_path.get(path)
        if t is PLACEHOLDER:
            plan.append((t, None))
            skipped.append(path)
        elif not selects(path) or (i is None and fill_missing and is_concrete(t)):
            plan.append((t, None))
        elif i is None:
            missing.append((path, "not in the checkpoint" if not fill_missing else
                            f"not in the checkpoint, and the target leaf ({type(t).__name__}) "
                            f"is {'abstract' if hasattr(t, 'dtype') else 'no array or scalar'}"
                            ": fill_missing needs a concrete array or scalar"))
        elif (problem := _compatibility_problem(manifest.leaves[i], t := _struct_of(t), strict)
              or (t := on_concrete_mesh(t))[1]) is not None:
            mismatched.append((path, problem))
        else:
            plan.append((t[0], i))
    used = {i for _, i in plan if i is not None} | {by_path[p] for p, _ in mismatched}
    skips = prefix_matcher(skipped)
    extra = [] if partial else [(manifest.leaves[i].path, p) for p, i in by_path.items()
                                if i not in used and selects(p) and not skips(p)]
    if missing or extra or mismatched:
        raise _mismatch_report(manifest, store, missing, extra, mismatched, fill_missing)
    return plan


def _struct_of(t: Any) -> Any:
    """A ``jax.core.ShapedArray`` target leaf (what ``jax.typeof(x)`` gives) as the
    ``jax.ShapeDtypeStruct`` of its fields, without its sharding where that names no mesh axes
    (its mesh is empty); any other leaf as it is."""
    if not isinstance(t, jax.core.ShapedArray):
        return t
    sharding = getattr(t, "sharding", None)
    if sharding is not None and getattr(getattr(sharding, "mesh", None), "empty", True):
        sharding = None
    return jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type, sharding=sharding)


def on_concrete_mesh(t: Any) -> tuple[Any, str | None]:
    """``(t, None)``, or ``(t, the problem)`` for a sharding that does not split the target's
    shape; for a target whose sharding is on an AbstractMesh (``nnx.eval_shape``
    or ``jax.eval_shape`` under ``jax.set_mesh`` gives such targets: it names no devices),
    ``t`` on the mesh ``jax.set_mesh`` made active, or ``(t, the problem)`` without one of
    those axes; one whose sharding is a ``PartitionSpec`` (jax takes it on that mesh) with the
    ``NamedSharding`` it names there."""
    sharding = getattr(t, "sharding", None)
    if isinstance(getattr(t, "_sharding", None), jax.sharding.PartitionSpec):
        # a spec on jax.set_mesh's mesh, which jax reads per thread: fixed here, on the
        # caller's, for the read threads, which have no mesh
        t = t.update(sharding=sharding)
    if isinstance(sharding, jax.sharding.Sharding) and isinstance(t, jax.ShapeDtypeStruct):
        try:
            sharding.shard_shape(t.shape)
        except ValueError as e:  # jax's IndivisibleError, raised later with no key path
            why = str(e).split("implies that ", 1)[-1].split(" (full shape", 1)[0]
            return t, f"its sharding does not split shape {t.shape}: {why}"
    if not (isinstance(sharding, jax.sharding.NamedSharding)
            and isinstance(sharding.mesh, jax.sharding.AbstractMesh)):
        return t, None
    mesh, want = jax.sharding.get_mesh(), sharding.mesh
    if mesh.empty:
        return t, (f"its sharding is on an AbstractMesh {want.shape_tuple}, which names no "
                   "devices: restore under `with jax.set_mesh(mesh):` with a mesh of those "
                   "axes, or give the target NamedSharding(mesh, spec)")
    # names, sizes and axis types decide; a hand-made AbstractMesh has no device kind
    if (mesh.abstract_mesh.shape_tuple, mesh.abstract_mesh.axis_types) != (
            want.shape_tuple, want.axis_types):
        return t, (f"its sharding is on an AbstractMesh {want.shape_tuple} with axis types "
                   f"{want.axis_types}, and the active mesh (jax.set_mesh) is "
                   f"{mesh.abstract_mesh.shape_tuple} with {mesh.abstract_mesh.axis_types}: "
                   "restore under a mesh of the target's axes, or give the target "
                   "NamedSharding(mesh, spec)")
    return jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type, sharding=(
        jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind))), None


def mismatch(message: str, manifest: Manifest, store: Store, path: str | None = None):
    """A TargetMismatchError located at the manifest's step and ``path``."""
    return TargetMismatchError(message, url=store.url, run=manifest.run, step=manifest.step,
                               key_path=path)


def _saved_by_target_path(manifest: Manifest, transforms, store: Store) -> dict[str, int]:
    """Target key path -> saved leaf index, after the ``transforms`` renames (None drops).

    Raises:
      ValueError: a key of ``transforms`` is no regular expression, or a template no str.
    """
    rules = []
    if not isinstance(transforms, Mapping | None):
        raise ValueError(f"transforms must be a dict of saved key path regular expression -> "
                         f"target key path template (or None), not {transforms!r}")
    for k, v in (transforms or {}).items():
        if not isinstance(k, str) or not isinstance(v, str | None):
            raise ValueError("transforms maps str regular expressions to str templates (e.g. "
                             f"r'params/\\1') or None (drop), not {k!r} to {v!r}")
        try:
            rules.append((re.compile(k), v))
        except re.error as e:
            raise ValueError(f"transforms: {k!r} is no regular expression: {e}") from None
    out: dict[str, int] = {}
    for i, leaf in enumerate(manifest.leaves):
        path = leaf.path
        for regex, template in rules:
            if (m := regex.fullmatch(path)) is not None:
                try:
                    path = None if template is None else m.expand(template)
                except (re.error, IndexError) as e:  # a group the expression does not have
                    raise ValueError(f"transforms: template {template!r} of {regex.pattern!r}"
                                     f" does not expand: {e}") from None
                break
        if path is None:
            continue
        if path in out:
            raise mismatch(f"transforms rename saved leaves {manifest.leaves[out[path]].path!r}"
                           f" and {leaf.path!r} to the same key path", manifest, store, path)
        out[path] = i
    return out


def _mismatch_report(manifest: Manifest, store: Store, missing: list[tuple[str, str]],
                     extra: list[tuple[str, str]], mismatched: list[tuple[str, str]],
                     fill_missing: bool):
    """One TargetMismatchError listing every problem key path, with the opt-ins that help
    (those not passed already)."""
    lines = [f"target and checkpoint differ: {len(missing)} missing, {len(extra)} extra, "
             f"{len(mismatched)} mismatched key paths"]
    lines += [f"  missing {p!r}: {why}" for p, why in missing]
    lines += [f"  extra {saved!r}: in the checkpoint, not in the target"
              + (f" (renamed to {p!r})" if p != saved else "") for saved, p in extra]
    lines += [f"  mismatched {p!r}: {why}" for p, why in mismatched]
    hints = (["pass partial=True to restore a subtree"] if extra else []) + (
        ["fill_missing=True returns concrete target leaves the checkpoint lacks"]
        if missing and not fill_missing else []) + (
            ["transforms={saved regex: target path} renames saved leaves"]
            if missing or extra else [])
    lines += [f"  hint: {h}" for h in hints] + ["  first difference at"]  # + the location
    first = (missing or extra or mismatched)[0]
    error = mismatch("\n".join(lines), manifest, store, first[0])
    error.missing = tuple(p for p, _ in missing)
    error.extra = tuple(saved for saved, _ in extra)
    error.mismatched = tuple(mismatched)
    return error


def _compatibility_problem(entry: LeafEntry, t: Any, strict: bool) -> str | None:
    """Why target leaf ``t`` cannot take the saved leaf (shape, kind or a dtype jax would
    narrow on a sharding), or None if it can.

    Without ``strict`` an array target may differ from the saved shape in the axes' sizes.
    """
    if is_numpy_class(t):
        return None
    if isinstance(t, type):  # orbax's restore_type=jax.Array is np.ndarray's sibling
        return (f"unsupported target leaf: the class {t.__name__} (the one "
                "class a target leaf may be is np.ndarray; for jax arrays, a "
                "jax.ShapeDtypeStruct or casstore.abstract_tree)")
    shape = target_shape(t)
    saved_text = entry.kind == "scalar" and entry.scalar_type in ("str", "bytes")
    if shape is None:
        if not isinstance(t, SCALAR_TYPES):
            return f"unsupported target leaf of type {type(t).__name__}"
        if entry.kind == "array" and entry.shape != ():
            return f"target is a Python scalar, saved an array of shape {entry.shape}"
        text = type(t).__name__ if isinstance(t, str | bytes) else None
        if (text or saved_text) and text != (entry.scalar_type if saved_text else None):
            saved = entry.scalar_type if entry.kind == "scalar" else f"{entry.dtype} array"
            return f"the target asks for {type(t).__name__}, saved {saved}"
        return None
    if saved_text:
        return f"the target asks for an array, saved {entry.scalar_type}"
    if not jax.dtypes.issubdtype(t.dtype, jax.dtypes.prng_key) and dtype_name(t.dtype) is None:
        return f"target dtype {t.dtype} is not one of the dtypes of format.md §4.5"
    if (key := _key_mismatch(entry, t.dtype)) is not None:  # before shapes: a key's differs
        return key
    saved = entry.shape[:-1] if entry.key_impl else entry.shape
    if entry.kind != "array" and shape != ():
        return f"target has shape {shape}, saved a {entry.kind}"
    if entry.kind == "array" and shape != saved and (strict or len(shape) != len(saved)):
        return f"target has shape {shape}, saved shape is {saved}"
    if (isinstance(t, jax.ShapeDtypeStruct | jax.Array) and not returns_numpy(entry, t)
            and (held := _narrowed(entry, t.dtype)) is not None):
        what = (f"the {entry.scalar_type} {entry.value!r}" if entry.kind == "scalar"
                else str(_saved_dtype(entry)))  # not the dtype a Python int first fits
        return (f"saved {what}, the target asks for a jax array of "
                f"{np.dtype(t.dtype)}, which jax holds as {held} because jax_enable_x64 is "
                f"off: the values would change. Enable x64 "
                f"(jax.config.update('jax_enable_x64', True)), ask for {held} explicitly, or "
                "for numpy (target leaf np.ndarray)")
    return None


def _key_mismatch(entry: LeafEntry, wanted: Any) -> str | None:
    """Why a target dtype ``wanted`` and a saved leaf disagree on PRNG keys (typed keys against
    key data, or another implementation), or None."""
    if jax.dtypes.issubdtype(wanted, jax.dtypes.prng_key) != bool(entry.key_impl):
        return (f"the target asks for typed PRNG keys {wanted}, saved a {entry.dtype} array "
                "(key data, as jax.random.PRNGKey makes): restore it as that array and wrap it "
                "with jax.random.wrap_key_data" if not entry.key_impl else
                f"the target asks for a {np.dtype(wanted)} array, saved typed PRNG keys "
                f"({entry.key_impl}): ask for typed keys (jax.random.key), or take "
                "jax.random.key_data of them after the restore")
    try:
        saved = entry.key_impl and jax.random.key(0, impl=entry.key_impl).dtype
    except (ValueError, TypeError):  # an implementation jax does not know: refused at placing
        return None
    if saved and saved != wanted:
        return f"the target asks for PRNG keys {wanted}, saved {saved} keys ({entry.key_impl})"
    return None


def _narrowed(entry: LeafEntry, wanted: Any) -> np.dtype | None:
    """The dtype jax would hold ``wanted`` in, if that is narrower than ``wanted`` and the
    saved dtype does not fit into it exactly; else None."""
    if entry.key_impl or jax.dtypes.issubdtype(wanted, jax.dtypes.extended):
        return None
    wanted = np.dtype(wanted)
    held = np.dtype(jax.dtypes.canonicalize_dtype(wanted))
    if held == wanted or _fits(entry, held):
        return None
    return held


def _fits(entry: LeafEntry, held: np.dtype) -> bool:
    """Whether a saved leaf's values fit ``held`` exactly: an int scalar by its value (100000
    fits int32, though numpy's smallest type for it is uint32), else by a safe cast."""
    if entry.kind == "scalar" and isinstance(entry.value, int) and held.kind in "iu":
        return np.iinfo(held).min <= entry.value <= np.iinfo(held).max
    return bool(np.can_cast(_saved_dtype(entry), held, "safe"))


def _saved_dtype(entry: LeafEntry) -> np.dtype:
    """The saved dtype of an array leaf, or the smallest dtype that holds a scalar leaf's value
    exactly (a step counter of 5 fits any integer dtype; 2**40 does not fit int32; 0.1 needs
    float64, 0.5 fits float32)."""
    if entry.kind == "array":
        return dtype_from_name(entry.dtype)
    if entry.scalar_type in ("float", "complex"):  # by precision: 0.1 is not a float16
        value = complex(*entry.value) if entry.scalar_type == "complex" else entry.value
        narrow, wide = ((np.complex64, np.complex128) if entry.scalar_type == "complex"
                        else (np.float32, np.float64))
        with np.errstate(over="ignore"):  # bits compared: a NaN's payload, -0.0
            exact = wide(value).tobytes() == wide(narrow(value)).tobytes()
        return np.dtype(narrow if exact else wide)
    return np.min_scalar_type(entry.value)
