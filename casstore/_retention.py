"""Retention: the steps a preservation policy drops, and the details it ranks them by.

The metrics and save time of each step (:class:`StepDetails`) are kept by a manager for its
local steps and by its persister for the persisted ones (``docs/tiers.md``): remembered from
each save or persist, or read once from the step's manifest (a step an earlier manager wrote).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import Any

from ._errors import ManifestError, StepNotFoundError
from ._manifest import Manifest
from ._policies import (
    PolicyCheckpointInfo,
    PreservationContext,
    manifest_details,
    utc_now,
)
from ._preservation import PreservationPolicy
from ._repository import deleted
from .store import Store

log = logging.getLogger("casstore")


class StepDetails(dict):
    """``{step: (metrics, save time in UTC)}``, filled on demand: calling it with a step it
    lacks reads that step's manifest once (``read(step)``). A step whose manifest is gone
    (:class:`StepNotFoundError`) is passed to ``forget`` (deleted by someone else) and, as
    one whose manifest does not read (:class:`ManifestError`: damaged, or of a newer
    format; a warning names it), ranks as new: ``(None, now)``, not kept. So one damaged
    step does not stop retention, or the saves after which it runs. NOT thread-safe."""

    def __init__(self, read: Callable[[int], Manifest], forget: Callable[[int], None]):
        super().__init__()
        self.read, self.forget, self.warned = read, forget, set()

    def __call__(self, step: int) -> tuple[Any, datetime.datetime]:
        if step not in self:
            try:
                manifest = self.read(step)
            except (StepNotFoundError, ManifestError) as e:
                if isinstance(e, StepNotFoundError):
                    self.forget(step)
                elif step not in self.warned:  # once
                    self.warned.add(step)
                    log.warning("casstore: retention ranks step %d as new, without metrics: "
                                "%s", step, e)
                return None, utc_now()
            self[step] = manifest_details(manifest)
        return self[step]


def dropped(policy: PreservationPolicy, steps: list[int], details: StepDetails,
            pending: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """The steps of ``steps`` (ascending) that ``policy`` does not keep, ranked by
    ``details``, but those in ``pending`` (persisting or queued)."""
    infos = [PolicyCheckpointInfo(step, details=details) for step in steps]
    keep = policy.should_preserve(infos, context=PreservationContext())
    return [s for s, kept in zip(steps, keep, strict=True) if not kept and s not in pending]


def retain(store: Store, run: str, policy: PreservationPolicy, steps: list[int],
           details: StepDetails, pending: set[int], delete: bool,
           forget: Callable[[int], None]) -> list[int]:
    """A manager's local retention after a save: the steps :func:`dropped` gives are deleted
    from ``store`` (their manifests; already gone: the same outcome) where ``delete`` (the
    process that deletes there), and each, once deleted, forgotten from ``details`` and passed
    to ``forget`` (so a delete that fails midway leaves no deleted step listed); returns
    them."""
    doomed = dropped(policy, steps, details, pending)
    for step in doomed:
        if delete:
            deleted(store, step, run)
        details.pop(step, None)
        forget(step)
    return doomed
