"""Checkpoints as flat tensor files (.safetensors, .npz) named by key path, and back.

Tensor names are key-path strings (format.md §5, e.g. ``params/layers/[0]/kernel``), so a file
holds one tensor per array leaf and tools that do not know casstore can read it. Files follow
the safetensors format (github.com/huggingface/safetensors, its README's format section) and
numpy's ``.npz`` (``numpy.savez``'s archive: a ``<name>.npy`` member per tensor, written and read
by exact member name here, never with pickles).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import struct
import tempfile
import zipfile
from typing import Any

import numpy as np

from ._chunking import dtype_from_name, dtype_name
from ._errors import TensorFileError, UnsupportedLeafError
from ._keypath import escape_name, is_valid_path

# safetensors' dtype codes for the format.md §4.5 names it can hold.
SAFETENSORS_DTYPES = {
    "bool": "BOOL", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
    "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "float16": "F16",
    "bfloat16": "BF16", "float32": "F32", "float64": "F64", "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0",
}
NPZ_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
              "float16", "float32", "float64", "complex64", "complex128")  # numpy's own


def file_format(path: str | pathlib.Path) -> str:
    """``"safetensors"`` or ``"npz"`` from the file name; ValueError for anything else."""
    suffix = pathlib.Path(path).suffix.lower()
    if suffix not in (".safetensors", ".npz"):
        raise ValueError(f"{str(path)!r}: use a .safetensors or .npz file")
    return suffix[1:]


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.numpy
    except ImportError as e:
        raise ImportError(".safetensors files need safetensors: "
                          "pip install 'casstore[safetensors]'") from e
    return safetensors


def file_array(path: str, value: Any, fmt: str) -> np.ndarray:
    """A restored leaf as a C-contiguous array a ``fmt`` file can hold.

    Python numbers become 0-d arrays (int64, float64, bool, complex128); typed PRNG keys their
    uint32 key data.

    Raises:
      UnsupportedLeafError: a str or bytes leaf, or a dtype the format cannot hold; names the
        key path.
    """
    if isinstance(value, (str, bytes)):
        raise UnsupportedLeafError(f"a {type(value).__name__} leaf does not fit a {fmt} file: "
                                   "select array leaves with --paths", key_path=path)
    if fmt == "safetensors" and path == "__metadata__":  # the header's own key
        raise UnsupportedLeafError("a .safetensors file keeps its metadata under this name: "
                                   "leave the leaf out (--exclude) or use .npz", key_path=path)
    if str(getattr(value, "dtype", "")).startswith("key<"):
        import jax

        value = jax.random.key_data(value)
    array = np.asarray(value)
    array = array if array.flags.c_contiguous else array.copy(order="C")
    allowed = SAFETENSORS_DTYPES if fmt == "safetensors" else NPZ_DTYPES
    if array.dtype.name not in allowed:
        other = ".safetensors" if fmt == "npz" else ".npz"
        fixes = ["cast it (--dtype float32)"] if "float" in array.dtype.name else []
        fixes.append("leave it out (--exclude)")  # --dtype casts floating-point leaves only
        if array.dtype.name in (NPZ_DTYPES if fmt == "safetensors" else SAFETENSORS_DTYPES):
            fixes.append(f"use {other}")  # only where the other format holds it
        advice = " or ".join([", ".join(fixes[:-1]), fixes[-1]] if len(fixes) > 1 else fixes)
        raise UnsupportedLeafError(f"{fmt} files cannot hold dtype {array.dtype.name}: {advice}",
                                   key_path=path)
    return array


def write_tensors(out: str, arrays: dict[str, np.ndarray], fmt: str, metadata: dict) -> None:
    """Writes ``arrays`` by name; ``metadata`` goes to the safetensors header as JSON. The file
    is written under a temporary name in ``out``'s directory (``.casstore-export-*``), fsynced
    and renamed into place: an export cut short (killed, disk full) leaves ``out`` as it was,
    absent or the file it was to replace, never a partial file under its name. It gets the
    mode any new file gets (``0o666`` less the umask)."""
    fd, tmp = tempfile.mkstemp(prefix=".casstore-export-", suffix=pathlib.Path(out).suffix,
                               dir=os.path.dirname(os.path.abspath(out)))
    os.close(fd)
    try:
        if fmt == "safetensors":
            _safetensors().numpy.save_file(arrays, tmp,
                                           metadata={"casstore": json.dumps(metadata)})
        else:
            _write_npz(tmp, arrays)
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _write_npz(out: str, arrays: dict[str, np.ndarray]) -> None:
    """``numpy.savez``'s archive (a stored zip of one ``<name>.npy`` per array), written here:
    ``savez`` takes the names ``file`` and ``allow_pickle`` for its own arguments, so a leaf of
    either name was lost or failed."""
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, array, allow_pickle=False)


def _umask() -> int:
    """The process's umask: from ``/proc/self/status`` (Linux), else set and put back."""
    with contextlib.suppress(OSError, StopIteration, ValueError), open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_tensors(path: str) -> dict[str, np.ndarray]:
    """The tensors of a .safetensors or .npz file by name (numpy or ml_dtypes arrays).

    Raises:
      ValueError: not a .safetensors or .npz name.
      TensorFileError: the file does not parse, or holds a tensor of a dtype casstore does
        not store, or a bool tensor of bytes other than 0 and 1 (names the file and the
        tensor).
    """
    fmt = file_format(path)
    try:
        tensors = _read_npz(path) if fmt == "npz" else _read_safetensors(path)
        for name, a in tensors.items():  # numpy, jax and safetensors' readers differ on them
            if a.dtype == bool and a.size and a.view(np.uint8).max() > 1:
                raise TensorFileError(f"tensor {name!r} of dtype bool holds bytes other than "
                                      "0 and 1", url=str(path))
        return tensors
    except (TensorFileError, OSError):
        raise
    except Exception as e:  # numpy's and safetensors' own errors: name the file, say what
        raise TensorFileError(f"not a valid .{fmt} file ({type(e).__name__}: "
                              f"{' '.join(str(e).split()[:12])})", url=str(path)) from e


def _read_npz(path: str) -> dict[str, np.ndarray]:
    """Each member ``<name>.npy`` by its exact name: ``np.load``'s lookup of ``x.npy`` finds
    the member ``x.npy`` (the tensor ``x``) before ``x.npy.npy``, so of two tensors named
    ``x`` and ``x.npy`` it returned ``x``'s values twice."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise TensorFileError("not an .npz archive (no zip file)", url=str(path)) from e
    out = {}
    with archive:
        for member in archive.namelist():
            if not member.endswith(".npy"):
                raise TensorFileError(f"member {member!r} is not a .npy array", url=str(path))
            name = member[:-len(".npy")]
            with archive.open(member) as f:
                out[name] = np.lib.format.read_array(f, allow_pickle=False)
            if dtype_name(out[name].dtype) is None:  # (np.str_, datetime64, structured, ...)
                raise TensorFileError(f"tensor {name!r} has dtype {out[name].dtype}, which "
                                      "casstore does not store", url=str(path))
    return out


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Each tensor read from the file into an array of its own, one at a time: the file's bytes
    are never held whole beside the tensors (``safetensors.deserialize`` takes them whole and
    copies every tensor out: 2x the file at the peak). safetensors' ``safe_open`` checks the
    header first (the dtypes, shapes and data offsets, which must tile the data exactly)."""
    with _safetensors().safe_open(path, framework="numpy"):
        pass  # raises SafetensorError for a header it does not accept
    codes = {code: name for name, code in SAFETENSORS_DTYPES.items()}
    out = {}
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name, t in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
            if t["dtype"] not in codes:
                raise TensorFileError(f"tensor {name!r} has dtype {t['dtype']}, which "
                                      "casstore does not store", url=str(path))
            start, stop = t["data_offsets"]
            out[name] = np.empty(t["shape"], dtype_from_name(codes[t["dtype"]]))
            f.seek(8 + size + start)
            if f.readinto(out[name].reshape(-1).view(np.uint8)) != stop - start:
                raise TensorFileError(f"tensor {name!r} is cut short", url=str(path))
    return out


def tree_of(tensors: dict[str, np.ndarray]) -> dict | np.ndarray:
    """Nests tensors by their names' key paths: ``a/b`` -> ``{"a": {"b": ...}}``.

    A name that is not a valid key path (format.md §5) is one dict key. A node whose elements
    are all sequence indices ``[i]`` becomes a list, None where an index has no tensor (an
    element of the exported tree that held none: ``None``, an optax ``EmptyState``), so the
    key paths stay those of the exported tree; ``[=k]``, and ``[k]`` beside names or past
    2**16 missing positions, are the int dict key k.

    A file whose one tensor is named ``""`` (an export of a tree that is one array, whose key
    path is empty) is that array, not a dict.

    Raises:
      ValueError: a name lies below or on another tensor's key path, or the elements of one
        node mix int keys with names or give one int key twice (``[1]`` and ``[=1]``).
    """
    if list(tensors) == [""]:
        return tensors[""]
    root: dict = {}
    for name, value in tensors.items():
        elements = name.split("/") if is_valid_path(name) and name else [escape_name(name)]
        node = root
        for element in elements[:-1]:
            node = node.setdefault(element, {})
            if not isinstance(node, dict):
                raise ValueError(f"tensor {name!r} lies below another tensor")
        if elements[-1] in node:
            raise ValueError(f"tensor {name!r} clashes with another tensor's key path")
        node[elements[-1]] = value
    return _containers(root, [MAX_GAPS])


MAX_GAPS = 2**16  # list positions without a tensor that one file may make (its names' indices
# are untrusted: 40 names "a{i}/[65536]" of a 2.5 kB file made a manifest of 21 MB)


def _containers(node: Any, gaps: list[int]) -> Any:
    """``node``'s nested dicts, those keyed ``[0]``, ``[1]``, ... as lists while the file's
    budget of missing positions (``gaps[0]``, spent here) lasts; past it, dicts of int keys."""
    if not isinstance(node, dict):
        return node
    keys = list(node)
    if keys and all(re.fullmatch(r"\[(0|[1-9][0-9]*)\]", k) for k in keys) and (
            length := 1 + max(int(k[1:-1]) for k in keys)) <= len(keys) + gaps[0]:
        # sequence indices (format.md §5): a missing one held no tensor (None, an optax
        # EmptyState), so it is None, and the list keeps the positions of the saved tree
        gaps[0] -= length - len(keys)
        return [_containers(node[f"[{i}]"], gaps) if f"[{i}]" in node else None
                for i in range(length)]
    out = {_unescape(k): _containers(v, gaps) for k, v in node.items()}
    if len(out) < len(keys) or len({type(k) for k in out}) > 1:
        raise ValueError(f"tensor name elements {sorted(keys)[:6]} at one level name the same "
                         "int key twice or mix int keys ([k], [=k]) with names: a pytree "
                         "dict's keys are all of one type")
    return out


def _unescape(element: str) -> Any:
    """The dict key of a key-path element (format.md §5).

    Raises:
      ValueError: an int key outside 64 bits (a key path holds no other).
    """
    if m := re.fullmatch(r"\[=?(-?[0-9]+)\]", element):
        if not -2**63 <= (key := int(m.group(1))) < 2**63:
            raise ValueError(f"the int key of {element!r} does not fit in 64 bits")
        return key
    if element == "~3":
        return ""
    return element.replace("~2", "[").replace("~1", "/").replace("~0", "~")
