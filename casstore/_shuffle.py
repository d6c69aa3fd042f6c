"""Byte shuffle and codec 5's sign move: numpy transforms of byte planes (format.md §3.2).

Pure functions on uint8 arrays, without headers or compression: :mod:`casstore._codec` and
:mod:`casstore._delta` build chunk and delta objects from them. numpy's copies release the GIL,
so they run in parallel in a thread pool.
"""

from __future__ import annotations

import numpy as np

# Elements per block of the plane scatter: 4 blocks for a 16 MiB float32 chunk. Each numpy
# call releases and retakes the GIL, and with many decoding threads retaking it is what a
# restore waited on: with 64 Ki-element blocks (~1300 calls per chunk) a warm restore of
# GPT-2-XL on 16 cores took 15.9 s for 53 s of CPU time, with whole planes 4.8 s. With these
# blocks (~60 calls per chunk) it took 5.06-5.26 s for 54-57 s of CPU on an H200's 16 cores,
# whole planes 4.81-5.16 s for 58-62 s, and its peak RSS was 150 MB lower: codec 5's sign is
# moved back in temporaries of a block, not of a plane. On 2 cores two threads decoded a chunk
# in 8.1-8.7 ms, with whole planes in 11.0-11.1 ms.
_UNPLANE_BLOCK = 1024 * 1024
# Bytes per block of codec 5's sign move, for the same reason: its temporaries are a few
# blocks, not a few planes (an encode takes 14.1 ms per chunk with 256 KiB blocks or whole
# planes alike).
_SIGN_BLOCK = 1024 * 1024


def shuffle(raw: memoryview | bytes | np.ndarray, element_size: int,
            out: np.ndarray | None = None) -> np.ndarray:
    """Byte shuffle (HDF5's shuffle filter): byte ``j`` of element ``i`` goes to ``j * n + i``.

    Args:
      raw: ``n * element_size`` bytes.
      element_size: bytes per element.
      out: a ``(element_size, n)`` uint8 array to write into, e.g. the planes region of
        :func:`plane_buffer`; None allocates one.

    Returns:
      ``out``, or a new uint8 array: all first bytes of the elements, then all second bytes,
      and so on. The exponent bytes of floats end up together, which zstd compresses.
    """
    transposed = np.frombuffer(raw, np.uint8).reshape(-1, element_size).T
    if out is None:
        return transposed.copy()
    out[...] = transposed
    return out


def unshuffle(shuffled: bytes | memoryview, element_size: int) -> np.ndarray:
    """The inverse of :func:`shuffle`; returns a new uint8 array (one strided copy per byte)."""
    planes = np.frombuffer(shuffled, np.uint8).reshape(element_size, -1)
    out = np.empty((planes.shape[1], element_size), np.uint8)
    for j in range(element_size):  # row-by-row copies run ~3x faster than planes.T.copy()
        out[:, j] = planes[j]
    return out.reshape(-1)


def move_sign(planes: np.ndarray) -> np.ndarray:
    """Codec 5's bit move (format.md §3.2), in place on the ``(k, n)`` byte planes ``planes``
    (k >= 2) of little-endian elements, and returns them.

    In the element's two most significant bytes, the top bit (a float's sign) moves down to bit
    7 of the lower one and the 15 bits below it move up by one: the top plane of a float32 or
    bfloat16 then holds the whole 8-bit exponent, whose distribution zstd's Huffman coder sees
    whole instead of split over two planes (the lower of which is stored as is). On N(0, 0.02)
    float32 the top plane takes 0.326 of its size instead of 0.340; on adam's nu (one sign) the
    plane below it, 7 random bits a byte, then compresses to 0.875.
    """
    top, below = planes[-1], planes[-2]
    for start in range(0, len(top), _SIGN_BLOCK):  # temporaries of one block stay in cache
        hi = _words(top[start:start + _SIGN_BLOCK])
        lo = _words(below[start:start + _SIGN_BLOCK])
        m80, m7f, m01 = (_bytes_mask(b, hi.dtype) for b in (0x80, 0x7F, 0x01))
        sign = hi & m80
        np.left_shift(hi, hi.dtype.type(1), out=hi)
        hi &= ~m01
        hi |= (lo >> hi.dtype.type(7)) & m01
        lo &= m7f
        lo |= sign
    return planes


def _words(a: np.ndarray) -> np.ndarray:
    """A 1-D uint8 array as 8-byte words where its length allows: numpy's shifts and masks
    run about 1.5x faster on them (each byte keeps its own bits through :func:`_bytes_mask`)."""
    return a.view(np.uint64) if a.size % 8 == 0 else a


def _bytes_mask(byte: int, dtype: np.dtype) -> np.integer:
    """``byte`` repeated in every byte of a ``dtype`` (uint8 or uint64) scalar."""
    return dtype.type(int.from_bytes(bytes([byte]) * dtype.itemsize, "little"))


def unmove_sign(hi: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of :func:`move_sign` on its top plane ``hi`` and the one below, ``lo``
    (read-only views of a payload, left as they are): new ``(hi, lo)`` arrays."""
    hi, lo = _words(hi), _words(lo)
    m80, m7f = _bytes_mask(0x80, hi.dtype), _bytes_mask(0x7F, hi.dtype)
    old_hi = lo & m80
    old_hi |= (hi >> hi.dtype.type(1)) & m7f
    old_lo = (hi << hi.dtype.type(7)) & m80
    old_lo |= lo & m7f
    return old_hi.view(np.uint8), old_lo.view(np.uint8)


def interleave(planes: list[np.ndarray], xor: list[np.ndarray] | None = None,
               out: np.ndarray | None = None, moved: bool = False) -> np.ndarray:
    """The raw bytes whose byte planes are ``planes`` (each XORed with ``xor``'s if given),
    written into ``out`` (a contiguous uint8 array of all the bytes) or a new array.

    Written in blocks of rows, so the rows stay in cache across all planes. With ``moved``
    (codec 5's planes as stored, ``xor`` None), :func:`unmove_sign` is applied block by block
    on the way, so no plane-sized array is allocated for it.
    """
    n, k = len(planes[0]), len(planes)
    out = np.empty((n, k), np.uint8) if out is None else out.reshape(n, k)
    for start in range(0, n, _UNPLANE_BLOCK):
        stop = start + _UNPLANE_BLOCK
        blocks = [plane[start:stop] for plane in planes]
        if moved:
            hi, lo = unmove_sign(blocks[-1], blocks[-2])
            blocks[-2:] = lo, hi
        elif xor is not None:
            blocks = [block ^ x[start:stop] for block, x in zip(blocks, xor)]
        rows = out[start:stop]
        for j, block in enumerate(blocks):
            rows[:, j] = block
    return out.reshape(-1)
