"""Which codec a save writes, chosen by what the store can take (docs/tuning.md).

Two encodings compete: byte planes (codec 5 wherever it saves 1/8, format.md §3.2: the fewest
bytes, at about 0.69 GB/s per core) and raw chunks (codec 0: the chunk id's hash and one copy
per chunk). A save runs its encoders on one pool of threads while another writes, so its time
is about the larger of its CPU work over the cores and its stored bytes over the store's write
throughput; a restore's is the larger of its decoding over the cores and its stored bytes
over the store's read throughput. :func:`choose` compares the encodings on those estimates:

* ``"auto"`` (the default): the encoding whose save is fastest; so never slower than storing
  raw, and byte planes wherever the store is slower than the cores' encoding.
* ``"speed"``: the encoding whose save plus one restore is fastest.
* ``"bytes"``: byte planes on every store (for users who pay for the bytes stored).

Ties go to the fewer bytes. The throughputs are the store's ``write_bytes_per_s`` and
``read_bytes_per_s`` and the figures of :data:`ENCODINGS`, measured on the 2-core machine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._pool import usable_cores

COMPRESSIONS = ("auto", "speed", "bytes")


@dataclasses.dataclass(frozen=True, slots=True)
class Encoding:
    """How a save encodes whole chunks, with its measured cost.

    Attributes:
      name: ``"planes"`` (codec 5 where it saves 1/8, else zstd or raw) or ``"raw"``
        (codec 0 for every whole chunk).
      compress: whether chunks are compressed at all.
      ratio: stored bytes / raw bytes on a trained float32 state (GPT-2-small weights and
        adam moments).
      encode_per_core, decode_per_core: raw bytes per second one core encodes (hash
        included) and decodes (with the chunk-id check).
    """

    name: str
    compress: bool
    ratio: float
    encode_per_core: float
    decode_per_core: float


# Measured on the 2-core machine (issue 33; ../shared/CODECS.md): codec 5 keeps 1.23 GB of the
# 1.49 GB GPT-2-small train state, encodes 0.69 GB/s and decodes with the hash check 0.83 GB/s
# per core; a raw chunk costs an xxh3-128 (about 25 GB/s) and one copy (about 13 GB/s).
PLANES = Encoding("planes", True, 0.82, 0.69e9, 0.83e9)
RAW = Encoding("raw", False, 1.0, 8e9, 8e9)
ENCODINGS = (PLANES, RAW)


def save_seconds(encoding: Encoding, raw_bytes: float, cores: int, write_bytes_per_s: float
                 ) -> float:
    """Estimated seconds to save ``raw_bytes``: encoding on ``cores`` overlaps the writes."""
    return max(raw_bytes / (encoding.encode_per_core * cores),
               encoding.ratio * raw_bytes / write_bytes_per_s)


def restore_seconds(encoding: Encoding, raw_bytes: float, cores: int, read_bytes_per_s: float
                    ) -> float:
    """Estimated seconds to restore ``raw_bytes``: decoding on ``cores`` overlaps the reads."""
    return max(raw_bytes / (encoding.decode_per_core * cores),
               encoding.ratio * raw_bytes / read_bytes_per_s)


def choose(compression: str, write_bytes_per_s: float, read_bytes_per_s: float,
           cores: int | None = None) -> Encoding:
    """The encoding a save uses under ``compression`` (see the module docstring).

    Args:
      compression: ``"auto"``, ``"speed"`` or ``"bytes"``.
      write_bytes_per_s, read_bytes_per_s: the store's throughputs, bytes per second.
      cores: the cores that encode (default :func:`~casstore._pool.usable_cores`).

    Returns:
      :data:`PLANES` or :data:`RAW`.

    Raises:
      ValueError: ``compression`` is not one of ``COMPRESSIONS``.
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
    if compression == "bytes":
        return PLANES
    cores = cores or usable_cores()

    def cost(e: Encoding) -> tuple[float, float]:
        seconds = save_seconds(e, 1.0, cores, write_bytes_per_s)
        if compression == "speed":
            seconds += restore_seconds(e, 1.0, cores, read_bytes_per_s)
        return seconds, e.ratio

    return min(ENCODINGS, key=cost)


def chunk_settings(store: Any, shuffle: bool | None, compression: str | None,
                   workers: int) -> tuple[bool, bool]:
    """``(shuffle, compress)`` for a save's :class:`~casstore._save_encode.ChunkWriter`.

    An explicit ``shuffle`` (True: byte planes wherever they save 1/8; False: only where they
    save 1/4) wins, and so does a store whose ``shuffle`` is set False; otherwise
    :func:`choose` decides, with ``compression`` (default the store's ``compression``), the
    store's throughputs and ``min(workers, usable cores)`` encoding cores.

    Raises:
      ValueError: an unknown ``compression``.
    """
    if shuffle is None and not store.shuffle:
        shuffle = False
    chosen = choose(compression or store.compression, store.write_bytes_per_s,
                    store.read_bytes_per_s, max(1, min(workers, usable_cores())))
    if shuffle is not None:
        return shuffle, True
    return True, chosen.compress
