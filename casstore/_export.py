"""A step to a flat tensor file and back (``casstore export`` / ``casstore import``).

Tensor names are key paths (format.md §5); file formats are in ``_tensorfile``. Export checks
its output path before it reads anything, and skips (and lists) the leaves a tensor file
cannot hold rather than failing on them.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._chunking import DTYPE_NAMES, dtype_from_name, overflowed
from ._errors import TensorFileError, UnsupportedLeafError
from ._repository import Url, read_manifest
from .store import open_store


@dataclasses.dataclass(frozen=True, slots=True)
class ExportInfo:
    """The result of :func:`export_tensors`.

    Attributes:
      path: the file written.
      tensors: tensors written. nbytes: their bytes (after any ``dtype`` cast).
      skipped: ``(key path, reason)`` of each selected leaf left out (a str or bytes leaf).
    """

    path: str
    tensors: int
    nbytes: int
    skipped: tuple[tuple[str, str], ...]


def check_export_path(out: str | os.PathLike, *, force: bool = False) -> str:
    """Checks that ``out`` can be written: a .safetensors or .npz name in an existing
    directory, absent unless ``force``. Returns its format (``"safetensors"`` or ``"npz"``).

    Raises:
      ValueError: another suffix. FileNotFoundError: its directory does not exist.
      FileExistsError: ``out`` exists and ``force`` is False.
    """
    from ._tensorfile import file_format

    fmt = file_format(out)
    path = pathlib.Path(out).expanduser()
    if not path.parent.is_dir():
        raise FileNotFoundError(f"the directory of {str(out)!r} does not exist; create it first")
    if path.exists() and not force:
        raise FileExistsError(f"{str(out)!r} exists; pass force=True (--force) to overwrite it")
    return fmt


def export_tensors(url: Url, step: int | None, out: str | os.PathLike, *, run: str = "default",
                   paths: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
                   dtype: str | None = None, force: bool = False,
                   max_workers: int | None = None) -> ExportInfo:
    """Writes a step's array leaves to a .safetensors or .npz file, one tensor per key path.

    The output path is checked before anything is read. Python number leaves become 0-d
    arrays; str and bytes leaves are skipped and listed. Memory: the selected leaves are held
    in host memory at once (their logical bytes, plus the cast ones with ``dtype``).

    Args:
      url: a path, an fsspec URL or a Store.
      step: the step; None for the latest.
      out: the file, ``.safetensors`` or ``.npz``.
      run: the run.
      paths: key-path prefixes to export (None: all).
      exclude: key-path prefixes to leave out.
      dtype: cast every floating-point leaf to this dtype (e.g. ``"float32"``, so bfloat16
        leaves fit an .npz file).
      force: overwrite ``out`` if it exists.
      max_workers: concurrent chunk reads.

    Returns:
      An :class:`ExportInfo`.

    Raises:
      ValueError: a bad suffix, no leaf selected, or ``dtype`` not a floating-point dtype's
        name (checked before reading); its subclass TargetMismatchError: a prefix of ``paths``
        or ``exclude`` selects no leaf (names it). FileNotFoundError, FileExistsError: see
        :func:`check_export_path`. StepNotFoundError, ManifestError, CorruptChunkError,
        MissingChunkError: as :func:`~casstore.restore`. UnsupportedLeafError: a leaf of a
        dtype the format cannot hold (names it and suggests ``dtype``), or whose values
        overflow ``dtype``. TypeError: ``paths`` or ``exclude`` is one string, not a list.
    """
    from ._keypath import prefix_matcher, unmatched
    from ._restore import restore
    from ._target import mismatch
    from ._tensorfile import file_array, write_tensors

    out = os.path.expanduser(out)  # what check_export_path checks is what is written
    fmt = check_export_path(out, force=force)
    as_dtype = _float_dtype(dtype)
    store = open_store(url)
    manifest = read_manifest(store, step, run=run)
    chosen_by, excluded_by = prefix_matcher(paths or None), prefix_matcher(exclude or [])
    for p in unmatched([*(paths or ()), *(exclude or ())], (x.path for x in manifest.leaves)):
        raise mismatch("no leaf matches the requested path (paths or exclude)", manifest, store,
                       p)  # a typo: the file would hold what was asked out, or lack what in
    chosen = [leaf for leaf in manifest.leaves
              if chosen_by(leaf.path) and not (exclude and excluded_by(leaf.path))]
    skipped = tuple((leaf.path, f"a {leaf.scalar_type} leaf") for leaf in chosen
                    if leaf.kind == "scalar" and leaf.scalar_type in ("str", "bytes"))
    not_arrays = {path for path, _ in skipped}
    wanted = [leaf.path for leaf in chosen if leaf.path not in not_arrays]
    if not wanted:
        raise ValueError(f"no array leaf of step {manifest.step} is selected (paths "
                         f"{list(paths or [])}, exclude {list(exclude or [])})")
    for leaf in chosen:  # a dtype the file cannot hold is refused before any chunk is read
        if leaf.path not in not_arrays and leaf.kind in ("array", "scalar"):  # (a set: a
            # test against the list of wanted paths took 46 s for 40,000 leaves)
            probe = (np.empty(0, dtype_from_name(leaf.dtype)) if leaf.kind == "array"
                     else leaf.value)
            file_array(leaf.path, _cast(leaf.path, probe, as_dtype), fmt)
    values = _leaves(restore(store, manifest.step, run=run, paths=wanted,
                             max_workers=max_workers))
    arrays = {p: file_array(p, _cast(p, values[p], as_dtype), fmt) for p in wanted}
    write_tensors(str(out), arrays, fmt, {"run": run, "step": manifest.step,
                                          "skipped": [p for p, _ in skipped]})
    return ExportInfo(str(out), len(arrays), sum(a.nbytes for a in arrays.values()), skipped)


def _leaves(tree: Any) -> dict[str, Any]:
    from ._keypath import flatten

    return dict(flatten(tree)[1])


def _float_dtype(dtype: str | None) -> np.dtype | None:
    """The floating-point dtype named ``dtype`` (format.md §4.5), None for None.

    Raises:
      ValueError: not the name of a floating-point dtype (before anything is read).
    """
    if dtype is None:
        return None
    found = dtype_from_name(dtype)
    if found is None or "float" not in found.name:  # bfloat16 and float8 names too
        floats = ", ".join(n for n in DTYPE_NAMES if "float" in n)
        raise ValueError(f"dtype {dtype!r} is not a floating-point dtype; one of {floats}")
    return found


def _cast(path: str, value: Any, dtype: np.dtype | None) -> Any:
    """``value`` cast to ``dtype`` if both are floating point (bfloat16 and float8 included).

    Raises:
      UnsupportedLeafError: a value would overflow ``dtype``, or is a NaN or infinity that
        ``dtype`` has no such value for; names the key path.
    """
    value = np.asarray(value) if isinstance(value, float) else value  # a 0-d float64 array
    name = str(getattr(value, "dtype", ""))
    if dtype is None or not name.startswith(("float", "bfloat")):
        return value
    value = np.asarray(value)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused just below
        out = value.astype(dtype)
    if overflowed(value, out):
        raise UnsupportedLeafError(f"its {value.dtype} values overflow {dtype.name} or hold "
                                   "NaN or infinities it has no such value for; export it in "
                                   "a wider dtype", key_path=path)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class ImportInfo:
    """The result of :func:`import_tensors`: tensors read, and the save's
    ``logical_bytes`` and ``written_bytes`` (see :class:`~casstore.SaveInfo`)."""

    tensors: int
    logical_bytes: int
    written_bytes: int


def import_tensors(file: str | os.PathLike, url: Url, step: int, *,
                   run: str = "default") -> ImportInfo:
    """Saves the tensors of a .safetensors or .npz file as a step.

    Names with "/" nest (key paths, format.md §5); others are keys of one flat dict; a file whose
    one tensor is named "" (an exported tree that is one array) is that array. Host memory:
    the file's tensors, read one by one (1.0x the file), plus the save's in-flight window.

    Raises:
      TensorFileError: the file is not a valid .safetensors / .npz file, holds a tensor of a
        dtype casstore does not store, or its tensor names do not nest into one pytree
        (:func:`~casstore._tensorfile.tree_of`); names the file.
      StepAlreadyExistsError: the step exists.
    """
    from ._save import save
    from ._tensorfile import read_tensors, tree_of

    tensors = read_tensors(file)
    try:
        tree = tree_of(tensors)
    except (ValueError, TypeError) as e:  # TypeError: a name holding NUL (escape_name)
        raise TensorFileError(f"its tensor names do not make a pytree: {e}", url=str(file)
                              ) from e
    info = save(url, step, tree, run=run)
    return ImportInfo(len(tensors), info.logical_bytes, info.written_bytes)

