"""Save-decision policies for CheckpointManager, with orbax's names, and what every policy
sees of a step.

A save-decision policy answers "save this step?" (``should_save(step, previous_steps, *,
context) -> bool``), given :class:`PolicyCheckpointInfo` objects, whose ``metrics`` and
``time`` are read from the step's manifest only when a policy asks for them; preservation
policies (``_preservation``) take them too. Policies compose with :class:`AnySavePolicy`, or
with ``|``. Any object with the method works as a policy.
"""

from __future__ import annotations

import dataclasses
import datetime
import numbers
import signal
from collections.abc import Callable, Container, Sequence
from typing import Any

import numpy as np

from ._coordinator import processes


class PolicyCheckpointInfo:
    """One step as policies see it.

    Attributes:
      step: the step number.
      metrics: the metrics saved with it (None without), read on first use.
      time: when it was saved (``datetime`` in UTC), read on first use.

    Args:
      step: the step number.
      metrics, time: the values, or leave them out and give ``details``.
      details: ``step -> (metrics, time)``, called on the first access of either.
    """

    def __init__(self, step: int, metrics: Any = None, time: datetime.datetime | None = None,
                 *, details: Callable[[int], tuple[Any, datetime.datetime]] | None = None):
        self.step = step
        self._details = details
        self._values = None if details is not None else (metrics, time or utc_now())

    def _get(self) -> tuple[Any, datetime.datetime]:
        if self._values is None:
            self._values = self._details(self.step)
        return self._values

    @property
    def metrics(self) -> Any:
        return self._get()[0]

    @property
    def time(self) -> datetime.datetime:
        return self._get()[1]

    def __repr__(self) -> str:
        return f"PolicyCheckpointInfo(step={self.step})"


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(tz=datetime.UTC)


MANAGER_METADATA = frozenset({"metrics", "user"})  # the keys of a manager's manifest metadata


def split_metadata(metadata: Any) -> tuple[Any, Any]:
    """(metrics, user metadata) of a manifest's metadata: a manager saves
    ``{"metrics": ..., "user": ...}``; anything else (``casstore.save(metadata=...)``,
    ``import_orbax``) is user metadata without metrics."""
    if isinstance(metadata, dict) and metadata.keys() == MANAGER_METADATA:
        return metadata["metrics"], metadata["user"]
    return None, metadata


def manifest_details(manifest: Any) -> tuple[Any, datetime.datetime]:
    """(metrics, save time in UTC) of a step, from its ``Manifest``: the metrics a manager
    saved in its metadata (None without, see :func:`split_metadata`), and its ``created``
    time."""
    return (split_metadata(manifest.metadata)[0],
            datetime.datetime.fromtimestamp(manifest.created, datetime.UTC))


@dataclasses.dataclass(kw_only=True)
class DecisionContext:
    """What a save decision may depend on besides the steps.

    Attributes:
      is_saving_in_progress: a background save is still running.
      reached_preemption: the job was told it will be stopped (see
        :meth:`CheckpointManager.reached_preemption`) and has not saved since.
    """

    is_saving_in_progress: bool = False
    reached_preemption: bool = False


@dataclasses.dataclass(kw_only=True)
class PreservationContext:
    """Context of a preservation decision (empty; orbax's shape)."""


class SaveDecisionPolicy:
    """Base of the save-decision policies: ``a | b`` saves when either says so."""

    def should_save(self, step: PolicyCheckpointInfo,
                    previous_steps: Sequence[PolicyCheckpointInfo], *,
                    context: DecisionContext) -> bool:
        """True to save ``step`` (its ``time`` is now).

        Args:
          step: the step asked about.
          previous_steps: the run's committed steps, ascending.
          context: what else the decision may depend on.
        """
        raise NotImplementedError

    def __or__(self, other: SaveDecisionPolicy) -> AnySavePolicy:
        return AnySavePolicy([self, other])


@dataclasses.dataclass
class FixedIntervalPolicy(SaveDecisionPolicy):
    """Saves every step divisible by ``interval`` (a positive int)."""

    interval: int

    def __post_init__(self):
        check_positive("interval", self.interval)

    def should_save(self, step, previous_steps, *, context) -> bool:
        return step.step % self.interval == 0


@dataclasses.dataclass
class SpecificStepsPolicy(SaveDecisionPolicy):
    """Saves the steps in ``steps``."""

    steps: Container[int]

    def __post_init__(self):
        check_steps(self.steps)

    def should_save(self, step, previous_steps, *, context) -> bool:
        return step.step in self.steps


@dataclasses.dataclass(kw_only=True)
class ContinuousCheckpointingPolicy(SaveDecisionPolicy):
    """Saves whenever no save is in progress and ``minimum_interval_secs`` (seconds, None for
    none) passed since the latest step was saved, or that step is dated in this clock's future
    (a writer whose clock ran ahead: else nothing was saved until this clock caught up). With
    several processes, process 0 decides and the others follow (a collective; every process
    asks at every step)."""

    minimum_interval_secs: float | None = None

    def __post_init__(self):
        value = self.minimum_interval_secs
        if value is not None and (isinstance(value, bool | np.bool_)
                                  or not isinstance(value, numbers.Real) or not value >= 0):
            raise ValueError(f"minimum_interval_secs must be a number >= 0 (seconds) or None, "
                             f"not {value!r}")

    def should_save(self, step, previous_steps, *, context) -> bool:
        since = previous_steps and (step.time - previous_steps[-1].time).total_seconds()
        due = not context.is_saving_in_progress and (
            not previous_steps or self.minimum_interval_secs is None
            or not 0 <= since < self.minimum_interval_secs)
        if processes()[0] > 1:
            from jax.experimental import multihost_utils
            due = bool(multihost_utils.broadcast_one_to_all(np.int32(due)))
        return due


@dataclasses.dataclass
class PreemptionCheckpointingPolicy(SaveDecisionPolicy):
    """Saves the first step after a preemption notice that the loop had not asked about yet.

    The notice is jax's preemption sync point
    (``jax.experimental.multihost_utils.reached_preemption_sync_point``, which agrees across
    processes; jax turns SIGTERM into it when ``jax.distributed`` runs the preemption
    service) and, in a single-process job, any of ``signals``: the manager then installs a
    handler that records the signal (and calls the handler it replaced, if that was a Python
    function) until it is closed. The default ``(SIGTERM,)`` keeps the process alive after
    SIGTERM so that the loop can save and stop: ask :meth:`CheckpointManager.reached_preemption`.
    ``signals=()`` listens to jax only.
    """

    signals: tuple[int, ...] = (signal.SIGTERM,)

    def should_save(self, step, previous_steps, *, context) -> bool:
        return context.reached_preemption


class InitialSavePolicy(SaveDecisionPolicy):
    """Saves when the run has no step yet."""

    def should_save(self, step, previous_steps, *, context) -> bool:
        return not previous_steps

    def __repr__(self) -> str:
        return "InitialSavePolicy()"


@dataclasses.dataclass
class AnySavePolicy(SaveDecisionPolicy):
    """Saves when any of ``policies`` says so (each is asked, in order, until one does)."""

    policies: Sequence[SaveDecisionPolicy]

    def __post_init__(self):
        check_policies(self.policies, "should_save")

    def should_save(self, step, previous_steps, *, context) -> bool:
        return any(p.should_save(step, previous_steps, context=context) for p in self.policies)


def check_steps(steps: Any) -> None:
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Container):
        raise TypeError(f"steps must be a container of ints (a set, a list, a range), not "
                        f"{steps!r}")


def check_policy(name: str, policy: Any, method: str) -> None:
    """Raises TypeError unless ``policy`` (the argument ``name``) has ``method``: any object
    with it works as a policy."""
    if not callable(getattr(policy, method, None)):
        raise TypeError(f"{name} must be a policy, an object with a {method}() method, not "
                        f"{policy!r}")


def check_policies(policies: Any, method: str) -> None:
    if not isinstance(policies, Sequence) or isinstance(policies, str):
        raise TypeError(f"policies must be a sequence of policies, not {policies!r}")
    for i, policy in enumerate(policies):
        check_policy(f"policies[{i}]", policy, method)


def check_positive(name: str, value: Any, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool | np.bool_) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if none_ok else ''}, "
                         f"not {value!r}")
