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
take memory the next step needs. Devices that report no memory statistics (the CPU) get no
copy, nor do arrays that span several processes, arrays seen in a stored dtype (their cast
is checked as the caller's thread stages them, so a cast that overflows fails ``save``), and
arrays whose chunk ids a save or restore remembered (:mod:`casstore._known_chunks`: their
chunks are mostly stored already). Everything else is staged as before (``_staging``).
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp

from ._chunking import on_host
from ._known_chunks import remembered, stand_in

MARGIN = 0.05  # of each device's limit, left free


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
    wanted = {i: a for i, a in arrays.items() if _wanted(a)}
    if not wanted or not _fits(wanted.values()):
        return arrays, set()
    try:
        copies = jax.device_put(list(wanted.values()), may_alias=False)
    except TypeError:  # a jax without may_alias
        copies = [jnp.copy(a) for a in wanted.values()]
    for original, copy in zip(wanted.values(), copies):
        stand_in(copy, original)
    return {**arrays, **dict(zip(wanted, copies))}, set(wanted)


def _wanted(a: Any) -> bool:
    """True for an accelerator array of this process alone whose chunks are not remembered."""
    return (isinstance(a, jax.Array) and a.is_fully_addressable and not on_host(a)
            and a.size > 0 and not remembered(a))


def _fits(arrays: Any) -> bool:
    """True if every device has room for the copies of ``arrays``' shards on it."""
    need: dict[Any, int] = collections.Counter()
    for a in arrays:
        for shard in a.addressable_shards:
            need[shard.device] += shard.data.nbytes
    return all(n <= _room(device) for device, n in need.items())


def _room(device: Any) -> int:
    """Bytes a copy may take on ``device`` (module doc); 0 where it reports no statistics."""
    try:
        stats = device.memory_stats()
    except (RuntimeError, NotImplementedError):  # a backend without statistics
        return 0
    if not stats or "bytes_limit" not in stats:
        return 0
    limit = stats["bytes_limit"]
    used = max(stats.get("peak_bytes_in_use", 0), stats.get("bytes_in_use", 0))
    return int(limit - used - MARGIN * limit)
