"""Device staging for asynchronous saves: a copy of the arrays on their own devices.

An asynchronous save must hold the values of the call: the caller may donate its jax arrays
the moment ``save`` returns. Copying each block to host memory before returning does that,
but costs the caller the device-to-host copies' dispatch (a slice per block, a pinned host
allocation the first time: 13.8 s for GPT-2-XL's 18.7 GB state on an H200). A copy on the
same device costs one ``jax.device_put(..., may_alias=False)`` dispatch instead (0.08-0.7 s
for the same state there; the copy itself runs at device memory speed) and is the saver's own:
no caller can donate or delete it, so its host copies are made by the background save, block
by block, and each part of it is freed once its host copy is made.

A copy is made only where the devices have room for it: for every device, the copy's bytes on
it fit under the allocator's limit less the process's peak use so far (``memory_stats()``'s
``bytes_limit`` and ``peak_bytes_in_use``) less a margin of 5% of the limit. The peak holds
the training step's own temporaries once a step ran before the save, so the copy does not
take memory the next step needs. A peak that a save's own copy set (none higher since) is
replaced by the peak before that copy, so one save's copy does not keep the next from making
one. A copy the allocator refuses anyway (fragmentation, memory that another process or
library holds) is not made. Devices that report no memory statistics (the CPU) get no copy,
nor do arrays that span several processes, arrays another process writes, inline-sized
arrays, and arrays whose chunk ids a save or restore remembered (:mod:`casstore.
_known_chunks`: their chunks are mostly stored already). Everything else is staged as before
(``_staging``). Only asynchronous saves copy, and they store no leaf in another dtype.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import jax

from ._chunking import INLINE_LIMIT_BYTES, on_host
from ._coordinator import processes
from ._known_chunks import remembered, stand_in

log = logging.getLogger("casstore")

MARGIN = 0.05  # of each device's limit, left free
# device -> (its peak right after a save's copy, the peak that save counted without it)
_after_copy: dict[Any, tuple[int, int]] = {}


def copy_on_device(arrays: dict[int, Any]) -> tuple[dict[int, Any], set[int]]:
    """``arrays`` with a device copy in place of each array that gets one (module doc).

    Args:
      arrays: the save's arrays by leaf index (numpy arrays, jax arrays, CastViews).

    Returns:
      ``(arrays, copied)``: the arrays, copies in place of the originals where made (the
      copies stand in for them in :mod:`casstore._known_chunks`, so the chunk ids the save
      hashes are remembered for the caller's arrays), and the indices of the copies. The
      copies are dispatched, not waited for.
    """
    if processes()[1] != 0:  # it writes only arrays that span processes: not copied
        return arrays, set()
    unique = {id(a): a for a in arrays.values() if _wanted(a)}  # a leaf twice: one copy
    need: dict[Any, int] = collections.Counter()
    for a in unique.values():
        for shard in a.addressable_shards:
            need[shard.device] += shard.data.nbytes
    used = {device: _used(device) for device in need}
    if not unique or any(used[d] is None or n > _room(d, used[d]) for d, n in need.items()):
        return arrays, set()
    try:
        copies = dict(zip(unique, jax.device_put(list(unique.values()), may_alias=False)))
    except (TypeError, RuntimeError) as e:  # refused (out of memory), or no may_alias
        log.debug("casstore: no device copy for this save, staged on the host: %s", e)
        return arrays, set()
    for device in need:
        _after_copy[device] = (_stats(device).get("peak_bytes_in_use", 0), used[device])
    for key, copy in copies.items():
        stand_in(copy, unique[key])
    copied = {i for i, a in arrays.items() if id(a) in copies}
    return {i: copies[id(a)] if i in copied else a for i, a in arrays.items()}, copied


def _wanted(a: Any) -> bool:
    """True for an accelerator array of this process alone, larger than an inline leaf, whose
    chunks are not remembered."""
    return (isinstance(a, jax.Array) and a.is_fully_addressable and not on_host(a)
            and a.nbytes > INLINE_LIMIT_BYTES and not remembered(a))


def _stats(device: Any) -> dict:
    """``device.memory_stats()``, or {} where the backend has none."""
    try:
        return device.memory_stats() or {}
    except (RuntimeError, NotImplementedError):
        return {}


def _used(device: Any) -> int | None:
    """The process's peak use of ``device`` so far, bytes, less a save's own copy where that
    copy set the peak (module doc); None where the device reports no limit."""
    stats = _stats(device)
    if "bytes_limit" not in stats:
        return None
    peak = stats.get("peak_bytes_in_use", 0)
    seen = _after_copy.get(device)
    if seen is not None and peak == seen[0]:
        peak = seen[1]
    return max(peak, stats.get("bytes_in_use", 0))


def _room(device: Any, used: int) -> int:
    """Bytes a copy may take on ``device`` where the process used ``used`` bytes at its peak."""
    limit = _stats(device)["bytes_limit"]
    return int(limit - used - MARGIN * limit)
