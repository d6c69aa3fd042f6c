"""Opening a tiered manager's :class:`~casstore._tiers.Persister` (``docs/tiers.md``).

The two tiers are checked apart, the persistent tier's steps listed, and, with
``PersistPolicy.local_per_host`` in a ``jax.distributed`` job, the processes agree on the
local steps they all hold (:meth:`~casstore._persist_rounds.Rounds.agree`), so that every
process lists the same steps; the persister then resumes what a killed manager left.
"""

from __future__ import annotations

import logging

import xxhash

from ._coordinator import processes
from ._errors import PersistError, located
from ._layout import manifest_key
from ._persist_rounds import Rounds
from ._repository import deleted, list_steps
from ._tiers import Persister, PersistPolicy
from .store import Store, nested, open_store

log = logging.getLogger("casstore")


def start_persister(local: Store, persistent, run: str, local_steps: list[int],
                    policy: PersistPolicy) -> Persister:
    """A :class:`Persister` from ``local`` to ``persistent`` (a URL or Store), which has
    queued the eligible ``local_steps`` a killed manager left unpersisted.

    With several ``jax.distributed`` processes every process sends its share of each step
    (:class:`Rounds`); process 0 decides which steps (the backlog, resuming) and writes their
    manifests. Every process must read the local tier where the others write (one machine, or
    a shared filesystem), unless ``policy.local_per_host``: then the processes first exchange
    their local steps, each deletes from its own local tier the steps not every process holds
    (another host's part is gone: a replaced host), and ``Persister.local_steps`` gives the
    steps left, alike on every process; all take process 0's list of persisted steps.

    Raises:
      ValueError: a policy value is out of range, or the two tiers are one repository, or
        one lies inside the other (local retention would delete persisted steps), or
        ``local_per_host`` with a local tier that is not a local filesystem.
      PersistError: the persistent tier cannot be listed and ``local_steps`` is empty (else
        that error surfaces on the next save; the tier is listed again before a persist).
      CasstoreError: (``local_per_host``) another process did not post its local steps within
        the multi-process timeout.
    """
    persistent = open_store(persistent)
    if policy.local_per_host and not local.cheap_stat:  # a host's own disk
        raise ValueError(f"local_per_host needs a local tier on a local filesystem, not "
                         f"{local.url!r}: a save there checks each chunk of the step before "
                         "(its manifest names other hosts' chunks) with one stat each")
    if nested(local, persistent):
        raise ValueError(f"the persistent tier {persistent.url!r} and the local tier "
                         f"{local.url!r} must be two repositories, neither inside the other")
    cause = None
    try:
        remote: set[int] | BaseException = set(list_steps(persistent, run=run))
    except Exception as e:
        cause, remote = e, located(e, None, persistent.url, run)
    rounds = Rounds(run) if processes()[0] > 1 else None
    held = local_steps
    if policy.local_per_host and rounds is not None:
        # each step's manifest as a digest: a step of one number saved twice (a host's old
        # disk back after its replacement saved the step again) is not the same step
        posts = rounds.agree([_digests(local, run, local_steps),
                              None if isinstance(remote, BaseException) else sorted(remote)])
        held = sorted(set.intersection(*({tuple(d) for d in digests} for digests, _ in posts)))
        held = [step for step, _ in held]
        remote = remote if posts[0][1] is None else set(posts[0][1])  # process 0's
    if isinstance(remote, BaseException) and not held:
        # a replaced node would start over and reuse persisted steps' numbers
        raise PersistError(
            "the persistent tier could not be listed and the local tier has no step: a "
            "manager on an empty local tier (a replaced node) resumes from the persistent "
            f"tier's steps, so it cannot start without them; retry once it answers ({cause})",
            step=None, url=persistent.url, run=run) from cause
    for step in sorted(set(local_steps) - set(held)):
        log.warning("casstore: step %d is on this process's local tier %s but not on every "
                    "process's, or another save of that step is; deleted there (persisted "
                    "steps stay on %s)", step, local.url, persistent.url)
        deleted(local, step, run)
    persister = Persister(local, persistent, run, policy, remote, rounds)
    persister.local_steps = held
    persister.resume(held)  # process 0 queues them, the others note them
    return persister


def _digests(local: Store, run: str, steps: list[int]) -> list[list]:
    """``[step, xxh3-64 of its manifest's bytes]`` of each of ``steps`` on ``local`` (one
    deleted since it was listed is left out)."""
    found = []
    for step in steps:
        try:
            found.append([step, xxhash.xxh3_64_hexdigest(local.get(manifest_key(run, step)))])
        except FileNotFoundError:
            continue
    return found
