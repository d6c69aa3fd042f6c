"""The manifest: value objects, msgpack encoding and validation (format.md §4).

:func:`encode_manifest` writes the map in the field order of format.md §4.1; :func:`decode_manifest`
treats the bytes as hostile: it checks every type, range and limit of format.md §4.4 before it
builds anything, and raises :class:`~casstore.ManifestError` naming the step and key path.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from typing import Any, NoReturn

import msgpack
import xxhash

from ._chunking import INLINE_LIMIT_BYTES, dtype_from_name
from ._codec import MAX_RAW_LENGTH, is_chunk_id
from ._errors import ManifestError
from ._format import check_features, check_min_reader, min_reader, unsupported_version
from ._keypath import MAX_DEPTH, escape_name, is_valid_path
from ._layout import chunk_key, object_key
from ._manifest_checks import metadata_problem, sharding_problem, tiling_problem

FORMAT = "casstore.manifest"
VERSION = 1  # manifests without delta chunks; older readers read them
DELTA_VERSION = 2  # manifests with at least one delta chunk ref (format.md §4.1)
MAX_MANIFEST_BYTES = 256 * 2**20
MAX_LEAVES = 1_000_000
MAX_CHUNK_REFS = 10_000_000
MAX_NDIM = 64
MAX_ARRAY_BYTES = 2**48
MAX_CREATED = 253402300800  # seconds: 10000-01-01, past what datetime can show
MAX_SCALAR_BYTES = 2**20
SCALAR_TYPES = ("bool", "int", "float", "complex", "str", "bytes")
DIGEST_BYTES = 16  # the manifest's xxh3-128 digest, its last field (format.md §4.1)
DIGEST_HEADER = b"\xc4\x10"  # msgpack bin 8 of 16 bytes


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkRef:
    """One block of a leaf stored in a chunk (format.md §4.3).

    Attributes:
      id: chunk id, 32 lowercase hex digits.
      start, stop: the block's index into the global array, per dimension (stop exclusive).
      offset: byte offset of the block in the chunk's raw bytes (non-zero only in packs).
      raw_bytes: raw length of the whole chunk, bytes.
      stored_bytes: encoded length of the chunk object, bytes (of the delta object alone for
        a delta chunk).
      base: for a chunk stored as a delta (format.md §3.5), the chunk id of its base, a chunk
        stored whole; None for a chunk stored whole.
    """

    id: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    offset: int
    raw_bytes: int
    stored_bytes: int
    base: str | None = None

    @property
    def key(self) -> str:
        """The key of the object that holds the chunk (a delta object for a delta chunk)."""
        return object_key(self.id, self.base)

    @property
    def shape(self) -> tuple[int, ...]:
        """The block's shape."""
        return tuple(b - a for a, b in zip(self.start, self.stop))


@dataclasses.dataclass(frozen=True, slots=True)
class LeafEntry:
    """One leaf of a checkpoint (format.md §4.3).

    Attributes:
      path: the key path string (format.md §5).
      kind: ``"array"`` or ``"scalar"``.
      shape, dtype: global shape and dtype name of an array (key data for PRNG keys).
      jax: the leaf was a jax.Array.
      key_impl: PRNG implementation name for typed key arrays, else None.
      sharding: the NamedSharding used at save as ``{"mesh": {axis: size}, "spec": [...]}``
        (format.md §6.1), or None.
      inline: raw bytes of a tiny array stored in the manifest, else None.
      chunks: the chunk refs that tile the array.
      scalar_type, value: a Python scalar's type name and value.
    """

    path: str
    kind: str
    shape: tuple[int, ...] = ()
    dtype: str = ""
    jax: bool = False
    key_impl: str | None = None
    sharding: Any = None
    inline: bytes | None = None
    chunks: tuple[ChunkRef, ...] = ()
    scalar_type: str = ""
    value: Any = None

    @property
    def nbytes(self) -> int:
        """Raw bytes of an array leaf (0 for other kinds)."""
        if self.kind != "array":
            return 0
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    """A parsed, validated manifest (format.md §4).

    Attributes:
      run: run name. step: the step. created: seconds since the epoch (UTC).
      metadata: the user metadata given at save.
      tree: the tree structure node (format.md §4.2).
      leaves: the leaf entries in tree order.
      source_hash: the xxh3-128 of the stored bytes it was decoded from (None for one made in
        memory): whether the object at its key is still this manifest, not another one saved
        under the same step since (:func:`~casstore._repository.still_committed`).
    """

    run: str
    step: int
    created: float
    metadata: Any
    tree: dict
    leaves: tuple[LeafEntry, ...]
    source_hash: bytes | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def logical_bytes(self) -> int:
        """Raw bytes of all array leaves."""
        return sum(leaf.nbytes for leaf in self.leaves)

    def chunk_ids(self) -> set[str]:
        """Every chunk id the manifest references (bases of delta chunks not included)."""
        return {ref.id for leaf in self.leaves for ref in leaf.chunks}

    def encoded(self) -> bool:
        """Whether most raw bytes of the step's distinct chunks are stored encoded: as deltas,
        or in objects smaller than their raw bytes (byte planes, zstd). A restore of such a
        step decodes on the CPU what it reads (:meth:`~casstore.store.Store.read_threads`)."""
        refs = {ref.key: ref for leaf in self.leaves for ref in leaf.chunks}.values()
        encoded = sum(r.raw_bytes for r in refs if r.base is not None
                      or r.stored_bytes < r.raw_bytes)
        return 2 * encoded > sum(r.raw_bytes for r in refs)

    def object_keys(self) -> set[str]:
        """The key of every object a restore of this step reads: each chunk's object, and the
        chunk object of each delta chunk's base (format.md §3.5). GC keeps exactly these."""
        refs = [ref for leaf in self.leaves for ref in leaf.chunks]
        return {r.key for r in refs} | {chunk_key(r.base) for r in refs if r.base is not None}


def needed_objects(manifest: Manifest) -> dict[str, tuple[str, str | None, int, str]]:
    """Object key -> ``(chunk id, base or None, raw bytes, key path)`` for every object a
    restore of ``manifest`` reads (:meth:`Manifest.object_keys`, with what checks each):
    chunk objects, delta objects and their bases (format.md §3.5)."""
    needed = {}
    for leaf in manifest.leaves:
        for r in leaf.chunks:
            needed[r.key] = (r.id, r.base, r.raw_bytes, leaf.path)
            if r.base is not None:
                needed.setdefault(chunk_key(r.base), (r.base, None, r.raw_bytes, leaf.path))
    return needed


def features_of(m: Manifest) -> list[str]:
    """The format features ``m`` uses (format.md §4.1), sorted: ``codec-5`` if it has chunks
    (this writer may store any chunk in codec 5), ``pack`` if a chunk holds more than one
    block (§3.4), ``delta`` if a chunk ref has a base (§3.5)."""
    refs = [(leaf, ref) for leaf in m.leaves for ref in leaf.chunks]
    packed = any(ref.offset or ref.raw_bytes != math.prod(ref.shape) * dtype_from_name(
        leaf.dtype).itemsize for leaf, ref in refs)
    used = {"codec-5": bool(refs), "pack": packed,
            "delta": any(ref.base is not None for _, ref in refs)}
    return sorted(name for name, on in used.items() if on)


def encode_manifest(m: Manifest) -> bytes:
    """msgpack bytes of ``m`` in format.md §4.1 field order, with the features it uses, ending
    in its ``digest``: the xxh3-128 of every byte before it."""
    features = features_of(m)
    return pack_with_digest({
        "format": FORMAT, "version": DELTA_VERSION if "delta" in features else VERSION,
        "features": features, "min_reader": min_reader(features), "run": m.run,
        "step": m.step, "created": m.created, "metadata": m.metadata, "tree": m.tree,
        "leaves": [_encode_leaf(leaf) for leaf in m.leaves]})


def pack_with_digest(fields: dict) -> bytes:
    """msgpack bytes of ``fields`` (without a ``digest``) followed by the field ``digest``:
    the xxh3-128 of every byte before its value (format.md §4.1)."""
    data = msgpack.packb({**fields, "digest": bytes(DIGEST_BYTES)},
                         use_bin_type=True)[:-DIGEST_BYTES]
    return data + xxhash.xxh3_128_digest(data)


def _check_digest(raw: dict, data: bytes, check: _Check) -> None:
    """Checks the ``digest`` of a manifest that has one (written since 2026-11-28, format.md
    §4.1): the last field, 16 bytes, equal to the xxh3-128 of the bytes before them. Inline
    arrays and scalars live in the manifest, where no chunk id covers them: a flipped bit there
    would otherwise restore as another value. A last field of 16 bytes under another name is
    a digest whose name is damaged (the word ``digest`` has no check of its own; no older
    manifest ends so)."""
    if "digest" not in raw:
        last = raw[next(reversed(raw))] if raw else None
        check(not (isinstance(last, bytes) and len(last) == DIGEST_BYTES),
              "bad digest field (its name is damaged)")
        return
    digest = raw["digest"]
    check(next(reversed(raw)) == "digest" and isinstance(digest, bytes)
          and len(digest) == DIGEST_BYTES
          and bytes(memoryview(data)[-DIGEST_BYTES - 2:]) == DIGEST_HEADER + digest,
          "bad digest field")
    check(xxhash.xxh3_128_digest(memoryview(data)[:-DIGEST_BYTES]) == digest,
          "its bytes do not match its digest (damaged)")


def _encode_leaf(leaf: LeafEntry) -> dict:
    if leaf.kind == "scalar":
        return {"path": leaf.path, "kind": "scalar", "type": leaf.scalar_type,
                "value": leaf.value}
    return {"path": leaf.path, "kind": "array", "shape": list(leaf.shape), "dtype": leaf.dtype,
            "jax": leaf.jax, "key_impl": leaf.key_impl, "sharding": leaf.sharding,
            "inline": leaf.inline,
            "chunks": [_encode_ref(c) for c in leaf.chunks]}


def _encode_ref(c: ChunkRef) -> dict:
    ref = {"id": c.id, "start": list(c.start), "stop": list(c.stop), "offset": c.offset,
           "raw_bytes": c.raw_bytes, "stored_bytes": c.stored_bytes}
    if c.base is not None:
        ref["base"] = c.base
    return ref


class _Check:
    """Raises ManifestError with the manifest's step, run and URL, and the key path at fault."""

    def __init__(self, *, run: str, step: int, url: str):
        self.run, self.step, self.url, self.path = run, step, url, None
        self.version = VERSION

    def __call__(self, ok: bool, message: str) -> None:
        if not ok:
            self.fail(message)

    def fail(self, message: str) -> NoReturn:
        """Raises the error; where a check runs per chunk ref, the caller builds the message
        only when the check fails."""
        raise ManifestError(f"invalid manifest: {message}", run=self.run, step=self.step,
                            url=self.url, key_path=self.path)


def _is_int(x: Any, lo: int = 0, hi: int = 2**63) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x < hi


def decode_manifest(data: bytes, *, run: str, step: int, url: str) -> Manifest:
    """Parses and validates manifest bytes read from storage (format.md §4, limits §4.4).

    Args:
      data: the object's bytes.
      run, step: the run and step its key names (the manifest must agree).
      url: the store URL, for messages.

    Returns:
      The validated Manifest.

    Raises:
      UnsupportedFormatError: a version above 2, a feature this casstore does not know or a
        ``min_reader`` above its own (format.md §10), checked before the leaves.
      ManifestError: the bytes are not a valid version-1 or version-2 manifest for this run
        and step.
    """
    check = _Check(run=run, step=step, url=url)
    check(len(data) <= MAX_MANIFEST_BYTES, f"{len(data)} bytes exceeds the size limit")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True,
                              max_bin_len=MAX_MANIFEST_BYTES, max_str_len=MAX_MANIFEST_BYTES)
    except Exception as e:  # msgpack raises many types on garbage; all mean "not a manifest"
        raise ManifestError(f"invalid manifest: not msgpack: {e}", run=run, step=step,
                            url=url) from e
    check(isinstance(raw, dict), "top level is not a map")
    _check_digest(raw, data, check)  # first: damage is named as such, not as a newer format
    check(raw.get("format") == FORMAT, f"format is {raw.get('format')!r}, not {FORMAT!r}")
    where = {"run": run, "step": step, "url": url}
    check_features(raw, **where)  # before any leaf: a newer format is named, not misread
    unsupported_version("version", raw.get("version"), max(VERSION, DELTA_VERSION),
                        raw.get("min_reader"), **where)
    check_min_reader(raw, **where)
    check.version = raw["version"]
    check(raw.get("run") == run and raw.get("step") == step,
          f"names run {raw.get('run')!r} step {raw.get('step')!r}, but its key says otherwise")
    created = raw.get("created")
    check(isinstance(created, int | float) and not isinstance(created, bool)
          and 0 <= created < MAX_CREATED, "created is not a time since the epoch")
    problem = metadata_problem(raw.get("metadata"))
    check(problem is None, f"bad metadata: {problem}")
    leaves_raw = raw.get("leaves")
    check(isinstance(leaves_raw, list) and len(leaves_raw) <= MAX_LEAVES, "bad leaves list")
    n_refs = sum(len(x["chunks"]) for x in leaves_raw
                 if isinstance(x, dict) and isinstance(x.get("chunks"), list))
    check(n_refs <= MAX_CHUNK_REFS, f"{n_refs} chunk refs exceed the limit")
    leaves = tuple(_decode_leaf(x, check) for x in leaves_raw)
    check.path = None
    check(len({leaf.path for leaf in leaves}) == len(leaves), "duplicate key paths")
    tree = raw.get("tree")
    _check_tree(tree, [leaf.path for leaf in leaves], check)
    return Manifest(run, step, float(raw["created"]), raw.get("metadata"), tree, leaves,
                    xxhash.xxh3_128_digest(data))


def _check_tree(tree: Any, paths: list[str], check: _Check) -> None:
    """Checks the tree nodes (format.md §4.2): kinds, keys (unique in a dict), depth, each leaf
    index once, at the key path its leaf entry gives (``paths``, by index): a restore without
    a target rebuilds the tree, so a tree that disagrees would put values at other paths."""
    seen: set[int] = set()
    # (node, depth, its path as a cons cell (parent's cell, element) or None): one cell per
    # node, where a tuple of the whole path per node took memory of nodes x depth
    stack: list[tuple[Any, int, Any]] = [(tree, 0, None)]
    while stack:
        node, depth, cell = stack.pop()
        check(isinstance(node, dict) and depth <= MAX_DEPTH
              and isinstance(node.get("type", ""), str), "bad tree node or too deep")
        t = node.get("t")
        if t == "leaf":
            i = node.get("i")
            check(_is_int(i, 0, len(paths)) and i not in seen, "bad leaf index in tree")
            path = _joined(cell)
            check(paths[i] == path, f"the tree puts leaf {paths[i]!r} at {path!r}")
            seen.add(i)
        elif t in ("dict", "list", "tuple"):
            children = node.get("c")
            check(isinstance(children, list), "tree node without children list")
            if t == "dict":
                keys = node.get("k")
                check(isinstance(keys, list) and len(keys) == len(children) and all(
                    isinstance(k, str) or _is_int(k, -2**63) for k in keys)
                    and len({(type(k), k) for k in keys}) == len(keys), "bad dict keys")
                elements = [_element(k) for k in keys]
            else:
                elements = [f"[{j}]" for j in range(len(children))]
            stack.extend((c, depth + 1, (cell, e)) for c, e in zip(children, elements))
        else:
            check(t == "none", f"unknown tree node kind {t!r}")
    check(len(seen) == len(paths), "tree does not reference every leaf")


def _joined(cell: Any) -> str:
    """The key path of a cons cell of :func:`_check_tree`."""
    elements = []
    while cell is not None:
        cell, element = cell
        elements.append(element)
    return "/".join(reversed(elements))


def _element(key: str | int) -> str:
    """A dict key's key-path element (format.md §5); ``"\0"`` (never in a path) if it has none."""
    try:
        return f"[={key}]" if isinstance(key, int) else escape_name(key)
    except TypeError:  # a NUL or a lone surrogate
        return "\0"


def _decode_leaf(x: Any, check: _Check) -> LeafEntry:
    check.path = None
    check(isinstance(x, dict), "leaf entry is not a map")
    path = x.get("path")
    check(is_valid_path(path), f"bad key path {path!r}")
    check.path = path
    kind = x.get("kind")
    if kind == "scalar":
        return _decode_scalar(path, x, check)
    check(kind == "array", f"unknown leaf kind {kind!r}")
    shape, dtype = x.get("shape"), x.get("dtype")
    check(isinstance(shape, list) and len(shape) <= MAX_NDIM
          and all(_is_int(d, 0, 2**53) for d in shape), f"bad shape {shape!r}")
    np_dtype = dtype_from_name(dtype) if isinstance(dtype, str) else None
    check(np_dtype is not None, f"dtype {dtype!r} is not an allowed array dtype")
    nbytes = math.prod(shape) * np_dtype.itemsize
    extent = math.prod(d for d in shape if d) * np_dtype.itemsize  # numpy refuses a zero-size
    check(nbytes <= MAX_ARRAY_BYTES and extent <= MAX_ARRAY_BYTES,  # array of a huge extent
          f"array of {nbytes} bytes (extent {extent}) exceeds the limit")
    key_impl = x.get("key_impl")
    check(key_impl is None or (isinstance(key_impl, str) and key_impl.isidentifier()),
          "bad key_impl")
    inline = x.get("inline")
    refs_raw = x.get("chunks")
    check(isinstance(refs_raw, list), "chunks is not a list")
    if inline is not None:
        check(isinstance(inline, bytes) and len(inline) == nbytes <= INLINE_LIMIT_BYTES
              and not refs_raw, "bad inline bytes")
    refs = tuple(_decode_ref(r, len(shape), np_dtype.itemsize, check) for r in refs_raw)
    problem = None if inline is not None else tiling_problem(tuple(shape), refs)
    check(problem is None, f"{problem}")
    sharding = x.get("sharding")
    problem = sharding_problem(sharding, len(shape))
    check(problem is None, f"bad saved sharding ({problem}): {reprlib.repr(sharding)}")
    return LeafEntry(path, "array", tuple(shape), dtype, bool(x.get("jax")), key_impl,
                     sharding, inline, refs)


def _decode_scalar(path: str, x: dict, check: _Check) -> LeafEntry:
    t, v = x.get("type"), x.get("value")
    ok = {"bool": lambda: isinstance(v, bool), "int": lambda: _is_int(v, -2**63),
          "float": lambda: isinstance(v, float),
          "complex": lambda: isinstance(v, list) and len(v) == 2
          and all(isinstance(p, float) for p in v),
          "str": lambda: isinstance(v, str) and len(v) <= MAX_SCALAR_BYTES,
          "bytes": lambda: isinstance(v, bytes) and len(v) <= MAX_SCALAR_BYTES}
    check(isinstance(t, str) and t in ok and ok[t](), f"bad scalar of type {t!r}")
    return LeafEntry(path, "scalar", scalar_type=t, value=v)


def _decode_ref(r: Any, ndim: int, itemsize: int, check: _Check) -> ChunkRef:
    if type(r) is not dict:
        check.fail("chunk ref is not a map")
    cid, start, stop = r.get("id"), r.get("start"), r.get("stop")
    offset, raw_bytes, stored = r.get("offset"), r.get("raw_bytes"), r.get("stored_bytes")
    if not is_chunk_id(cid):
        check.fail(f"bad chunk id {cid!r}")
    if not (type(start) is list and type(stop) is list and len(start) == len(stop) == ndim
            and _ints(start + stop, 2**53)):
        check.fail(f"bad chunk index of {cid}")
    if not (_ints([offset, raw_bytes, stored], 2**32) and raw_bytes <= MAX_RAW_LENGTH):
        check.fail(f"bad chunk sizes of {cid}")  # bounds allocations
    base = r.get("base")
    if not (base is None or (check.version == DELTA_VERSION and is_chunk_id(base)
                             and base != cid and offset == 0)):
        check.fail(f"bad delta base {base!r} of chunk {cid}")
    block = [b - a for a, b in zip(start, stop)]
    if block and min(block) <= 0:
        check.fail(f"empty or inverted block in chunk {cid}")
    if offset + math.prod(block) * itemsize > raw_bytes:
        check.fail(f"block of chunk {cid} extends past its raw bytes")
    return ChunkRef(cid, tuple(start), tuple(stop), offset, raw_bytes, stored, base)


def _ints(values: list, hi: int) -> bool:
    """Whether every value is an int (not a bool) in ``[0, hi)``: :func:`_is_int` of each, at
    C speed (a manifest of a large step holds millions of them)."""
    return not values or ({*map(type, values)} == {int} and min(values) >= 0
                          and max(values) < hi)
