"""Repository-level reads and the config object (format.md §2 and §2.1).

Listing steps and runs reads only manifest keys; a step exists exactly when its manifest does
(format.md §7).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import xxhash

from ._errors import (
    ManifestError,
    StepNotFoundError,
    UnsupportedFormatError,
    unreadable,
    warn_read_again,
)
from ._format import (
    FEATURES,
    check_features,
    check_min_reader,
    min_reader,
    unknown_to_reader,
    unsupported_version,
)
from ._layout import (
    CHUNKS_PREFIX,
    CONFIG_KEY,
    DELTAS_PREFIX,
    RUNS_PREFIX,
    check_run,
    check_step,
    is_object_key,
    manifest_key,
    parse_manifest_key,
    steps_prefix,
)
from ._manifest import MAX_MANIFEST_BYTES, Manifest, decode_manifest
from .store import ObjectInfo, Store, open_store

CONFIG_FORMAT = "casstore"
CONFIG_VERSION = 1
HASH = "xxh3-128"

Url = str | os.PathLike | Store
MAX_CONFIG_BYTES = 2**20  # format.md §2.1: a reader reads no more of a config object
_REPAIR_HINT = ("; `casstore verify` reports it and `casstore repair GOOD_COPY URL` puts another "
                "copy's config object in its place (docs/recovery.md)")


def parse_config(data: bytes, url: str) -> dict:
    """Validates the config object (format.md §2.1).

    Raises:
      UnsupportedFormatError: a version, hash or feature of a newer format (format.md §10).
      ManifestError: the object is damaged, not a casstore config, or larger than
        ``MAX_CONFIG_BYTES`` (``data`` may be its first ``MAX_CONFIG_BYTES + 1`` bytes).
    """
    if len(data) > MAX_CONFIG_BYTES:
        raise ManifestError(f"config object larger than {MAX_CONFIG_BYTES} bytes, the size "
                            f"limit (not read further){_REPAIR_HINT}", url=url)
    try:
        config = msgpack.unpackb(data, raw=False, max_str_len=4096, max_bin_len=0)
    except Exception as e:  # any msgpack failure means a damaged config
        raise ManifestError(f"config object is not msgpack: {e}{_REPAIR_HINT}", url=url) from e
    if not isinstance(config, dict) or config.get("format") != CONFIG_FORMAT:
        raise ManifestError(f"not a casstore repository (bad config object){_REPAIR_HINT}",
                            url=url)
    check_features(config, url=url)
    unsupported_version("repository version", config.get("version"), CONFIG_VERSION,
                        config.get("min_reader"), url=url)
    if config.get("hash") != HASH:
        if not isinstance(config.get("hash"), str):
            raise ManifestError(f"invalid config: bad hash {config.get('hash')!r}{_REPAIR_HINT}",
                                url=url)
        unknown_to_reader(f"hash {config['hash']!r}", config.get("min_reader"), url=url)
    check_min_reader(config, url=url)
    return config


def _read_again(read: Callable[[], bytes], parse: Callable[[bytes], Any], what: str,
                url: str) -> tuple[bytes, Any]:
    """``(bytes, parse(bytes))`` of the object ``read`` reads; one that does not parse is
    read once more, and parsed if its bytes changed (a body cut short on its way, a response
    without Content-Length), with a warning naming ``what``.

    Raises:
      ManifestError: it does not parse (the second read's error, or the first's if the same
        bytes came back); UnsupportedFormatError at once. FileNotFoundError: it is gone.
    """
    data = read()
    try:
        return data, parse(data)
    except UnsupportedFormatError:
        raise
    except ManifestError:  # damaged in storage only if it fails again
        if (again := read()) == data:
            raise
    parsed = parse(again)
    warn_read_again(what, url)
    return again, parsed


def read_config_bytes(store: Store) -> bytes:
    """The config object's bytes, or its first ``MAX_CONFIG_BYTES + 1`` if it is larger (one
    request: a damaged object of many GB is not held; :func:`parse_config` refuses it)."""
    return store.head(CONFIG_KEY, MAX_CONFIG_BYTES + 1)


def _read_config(store: Store) -> None:
    """Reads and validates the config object (:func:`_read_again`).

    Raises:
      FileNotFoundError: there is none. ManifestError: as :func:`parse_config`.
    """
    _read_again(lambda: read_config_bytes(store), lambda data: parse_config(data, store.url),
                "the config object", store.url)


def ensure_config(store: Store) -> None:
    """Validates the config object, creating it (create-only) if the repository is new; a new
    one lists the features this writer may use and the oldest casstore that reads them."""
    try:
        return _read_config(store)
    except FileNotFoundError:
        pass
    features = sorted(FEATURES)  # what this writer may write into any step
    data = msgpack.packb({"format": CONFIG_FORMAT, "version": CONFIG_VERSION, "hash": HASH,
                          "created": time.time(), "features": features,
                          "min_reader": min_reader(features)})
    try:
        store.put_if_absent(CONFIG_KEY, data)
    except FileExistsError:  # a concurrent first save won; validate what it wrote
        _read_config(store)


def check_config(store: Store) -> bool:
    """Validates the config object if present; returns whether the repository exists.

    Raises:
      ManifestError: the config object is damaged or of an unknown version
        (:func:`parse_config`), or missing while a manifest exists (every reader refuses such
        a repository until its config object is put back: ``repair``).
    """
    try:
        _read_config(store)
    except FileNotFoundError:
        if any(parse_manifest_key(info.key) for info in store.list(RUNS_PREFIX)):
            raise ManifestError(f"config object missing, but steps exist{_REPAIR_HINT}",
                                url=store.url) from None
        return False
    return True


def list_chunk_objects(store: Store) -> Iterator[ObjectInfo]:
    """Every chunk object of the repository: the chunks under ``chunks/`` and the delta
    objects under ``deltas/`` (format.md §2); other keys there are skipped."""
    for prefix in (CHUNKS_PREFIX, DELTAS_PREFIX):
        yield from (info for info in store.list(prefix) if is_object_key(info.key))


def list_steps(url: Url, *, run: str = "default") -> list[int]:
    """The committed steps of a run, ascending.

    Reads one listing of ``runs/<run>/steps/``; keys that are not manifest names are ignored.

    Args:
      url: a path, an fsspec URL or a Store.
      run: the run name.

    Returns:
      Step numbers, ascending; empty if the run or the repository does not exist.

    Raises:
      ValueError: ``run`` is not a valid run name.
      ManifestError: the repository's config object is damaged or of an unknown version.
    """
    store = open_store(url)
    prefix = steps_prefix(run)
    if not check_config(store):
        return []
    return sorted(p[1] for info in store.list(prefix)
                  if (p := parse_manifest_key(info.key)) is not None and p[0] == run)


def latest_step(url: Url, *, run: str = "default") -> int | None:
    """The largest committed step of a run, or None if it has none (see :func:`list_steps`)."""
    steps = list_steps(url, run=run)
    return steps[-1] if steps else None


def list_runs(url: Url) -> list[str]:
    """The names of the runs that have at least one committed step, sorted.

    Raises:
      ManifestError: the repository's config object is damaged or of an unknown version.
    """
    store = open_store(url)
    return run_names(store) if check_config(store) else []


def run_names(store: Store) -> list[str]:
    """:func:`list_runs` without the config object's check (for verify's report)."""
    return sorted({p[0] for info in store.list(RUNS_PREFIX)
                   if (p := parse_manifest_key(info.key)) is not None})


def resolve_step(store: Store, step: int | None, run: str) -> int:
    """``step`` (:func:`~casstore._layout.check_step`), or the latest step for None. Raises
    StepNotFoundError if there is none, ValueError for an invalid step."""
    if step is not None:
        return check_step(step)
    latest = latest_step(store, run=run)
    if latest is None:
        raise StepNotFoundError("no committed step", url=store.url, run=run)
    return latest


def read_manifest_bytes(store: Store, run: str, step: int, size: int | None = None) -> bytes:
    """The bytes of a step's manifest object, at most ``MAX_MANIFEST_BYTES`` (format.md
    §4.4). One over the limit is refused without being read where its size is known (``size``,
    from a listing, or a stat on a store with cheap stats: local disk); elsewhere no more than
    one byte past the limit is read (:meth:`~casstore.store.Store.head`: a ranged GET on
    object stores).

    Raises:
      ManifestError: the object is over the size limit.
      FileNotFoundError: it does not exist.
      OSError: it is there but unreadable (a bad block, a permission), with a note naming
        the step.
    """
    key = manifest_key(run, step)
    try:
        if size is None and store.cheap_stat:
            size = store.stat(key).size
        if size is not None and size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{size} bytes exceeds the size limit of {MAX_MANIFEST_BYTES} "
                                "(not read)", run=run, step=step, url=store.url)
        data = store.head(key, MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        if unreadable(e):  # a bad block, a permission: the step named
            e.add_note(f"casstore: reading the manifest of run {run!r}, step {step} from "
                       f"{store.url}")
        raise
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"over {MAX_MANIFEST_BYTES} bytes: exceeds the size limit (read "
                            "no further)", run=run, step=step, url=store.url)
    return data


def read_decoded(store: Store, run: str, step: int, size: int | None = None
                 ) -> tuple[bytes, Manifest]:
    """A step's manifest object, read (:func:`read_manifest_bytes`) and decoded: its bytes
    and the :class:`Manifest`. One that does not decode is read once more, and decoded if
    its bytes changed (a body cut short on its way, a response without Content-Length).

    Raises:
      ManifestError: it does not decode (the second read's error, or the first's if the same
        bytes came back), or is over the size limit.
      FileNotFoundError: it does not exist.
    """
    return _read_again(lambda: read_manifest_bytes(store, run, step, size),
                       lambda data: decode_manifest(data, run=run, step=step, url=store.url),
                       f"manifest {manifest_key(run, step)}", store.url)


def read_manifest(url: Url, step: int | None = None, *, run: str = "default") -> Manifest:
    """Reads and validates the manifest of one step (format.md §4).

    Args:
      url: a path, an fsspec URL or a Store.
      step: the step; None means the latest.
      run: the run name.

    Returns:
      The parsed :class:`Manifest`.

    Raises:
      StepNotFoundError: the step (or, for None, any step) does not exist.
      ManifestError: the manifest or the config object is malformed or of an unknown version.
    """
    store = open_store(url)
    check_run(run)
    if not check_config(store):
        raise StepNotFoundError("no casstore repository here", url=store.url, run=run,
                                step=step)
    step = resolve_step(store, step, run)
    try:
        return read_decoded(store, run, step)[1]
    except FileNotFoundError:
        raise no_such_step(store, run, step) from None


def still_committed(store: Store, manifest: Manifest) -> bool:
    """Whether ``manifest`` (one read from ``store``) is still the manifest at its key: False
    if its step was deleted, or deleted and saved again by another writer (whose collection
    in between may have deleted this manifest's chunks: format.md §7 lets a save reuse only the
    chunks of a manifest it read during that save), or for a manifest made in memory. One GET
    of the manifest object, compared by its xxh3-128 (no decode)."""
    if manifest.source_hash is None:
        return False
    try:
        data = read_manifest_bytes(store, manifest.run, manifest.step)
    except (FileNotFoundError, ManifestError):
        return False
    except OSError as e:
        if unreadable(e):
            return False
        raise
    return xxhash.xxh3_128_digest(data) == manifest.source_hash


def delete(url: Url, step: int, *, run: str = "default") -> None:
    """Deletes a step by deleting its manifest (format.md §8).

    Its chunks stay until garbage collection reclaims the ones no manifest references.

    Raises:
      StepNotFoundError: the step does not exist.
      ReadOnlyStoreError: the store is read-only.
    """
    store, step = open_store(url), check_step(step)
    key = manifest_key(run, step)
    if not store.exists(key):
        raise no_such_step(store, run, step)
    store.delete(key)


def no_such_step(store: Store, run: str, step: int) -> StepNotFoundError:
    """The error for a step the run lacks, naming the steps it has (the first and last three
    of more than eight), where a listing answers; for a step the listing has, that its
    manifest did not read as an object."""
    try:
        steps = list_steps(store, run=run)
    except (ManifestError, OSError):
        return StepNotFoundError("no such step", url=store.url, run=run, step=step)
    if step in steps:  # listed, yet no object was read: not a regular file, or came meanwhile
        return StepNotFoundError("its manifest is listed but is no object that reads (not a "
                                 "regular file?)", url=store.url, run=run, step=step)
    shown = ", ".join(map(str, steps)) if len(steps) <= 8 else (
        f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))} "
        f"({len(steps)} steps)")
    has = f"the run's steps are {shown}" if steps else "the run has no committed step"
    return StepNotFoundError(f"no such step; {has}", url=store.url, run=run, step=step)


def deleted(store: Store, step: int, run: str) -> bool:
    """:func:`delete`, returning False where the step does not exist."""
    try:
        delete(store, step, run=run)
    except StepNotFoundError:
        return False
    return True
