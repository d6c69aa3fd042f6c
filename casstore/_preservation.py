"""Preservation policies for CheckpointManager, with orbax's names, and the manager's two
policies made from orbax's keyword arguments.

A preservation policy answers "keep which of the committed steps?" (``should_preserve(
checkpoints, *, context) -> list[bool]``, one flag per step, ascending), given
:class:`~casstore._policies.PolicyCheckpointInfo` objects. Policies compose with
:class:`AnyPreservationPolicy`, or with ``|``. Any object with the method works as a policy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Container, Sequence
from typing import Any

from ._policies import (
    AnySavePolicy,
    FixedIntervalPolicy,
    InitialSavePolicy,
    PolicyCheckpointInfo,
    PreemptionCheckpointingPolicy,
    PreservationContext,
    SaveDecisionPolicy,
    check_policies,
    check_policy,
    check_positive,
    check_steps,
)


class PreservationPolicy:
    """Base of the preservation policies: ``a | b`` keeps what either keeps."""

    def should_preserve(self, checkpoints: Sequence[PolicyCheckpointInfo], *,
                        context: PreservationContext) -> list[bool]:
        """One flag per step of ``checkpoints`` (the run's committed steps, ascending,
        the one just saved included): True keeps it, False lets the manager delete it."""
        raise NotImplementedError

    def __or__(self, other: PreservationPolicy) -> AnyPreservationPolicy:
        return AnyPreservationPolicy([self, other])


class PreserveAll(PreservationPolicy):
    """Keeps every step."""

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        return [True] * len(checkpoints)

    def __repr__(self) -> str:
        return "PreserveAll()"


@dataclasses.dataclass
class LatestN(PreservationPolicy):
    """Keeps the ``n`` latest steps (None: all)."""

    n: int | None = None

    def __post_init__(self):
        check_positive("n", self.n, none_ok=True)

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        first = 0 if self.n is None else max(0, len(checkpoints) - self.n)
        return [i >= first for i in range(len(checkpoints))]


@dataclasses.dataclass
class EveryNSteps(PreservationPolicy):
    """Keeps the steps divisible by ``interval_steps`` (``exact_interval``) or, without it,
    each step at least ``interval_steps`` after the previous kept one (the first is kept);
    of those, the ``max_to_keep`` latest (None: all)."""

    interval_steps: int
    exact_interval: bool = True
    max_to_keep: int | None = None

    def __post_init__(self):
        check_positive("interval_steps", self.interval_steps)
        check_positive("max_to_keep", self.max_to_keep, none_ok=True)

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        keep, last = [], None
        for c in checkpoints:
            if self.exact_interval:
                keep.append(c.step % self.interval_steps == 0)
            else:
                keep.append(last is None or c.step - last >= self.interval_steps)
                last = c.step if keep[-1] else last
        kept = [i for i, k in enumerate(keep) if k]
        if self.max_to_keep is not None:
            for i in kept[:-self.max_to_keep]:
                keep[i] = False
        return keep


@dataclasses.dataclass(kw_only=True)
class BestN(PreservationPolicy):
    """Keeps the ``n`` steps (None: all) whose metrics rank best by ``get_metric_fn``.

    ``get_metric_fn(metrics) -> float``; the highest values are best, the lowest with
    ``reverse=True`` (orbax's semantics; of equal values the latest step ranks best, as in
    orbax). A NaN value ranks below every other, so it is never kept in place of a number, and
    so does a value that is no number (a string, None: a step whose stored metrics another
    writer made so). An error ``get_metric_fn`` raises names the step.
    Steps saved without metrics are kept with ``keep_checkpoints_without_metrics``, dropped
    without once there are more than ``n`` steps (with ``n`` or fewer every step is kept, and
    with ``n=0`` none, as in orbax).
    """

    get_metric_fn: Callable[[Any], float]
    reverse: bool = False
    n: int | None = None
    keep_checkpoints_without_metrics: bool = True

    def __post_init__(self):
        if not callable(self.get_metric_fn):
            raise TypeError(f"get_metric_fn must be callable, not {self.get_metric_fn!r}")
        if self.n != 0:  # 0 keeps none, as in orbax
            check_positive("n", self.n, none_ok=True)

    def ranked(self, checkpoints) -> list:
        """The checkpoints that have metrics, worst first, best last."""
        scored = [(c, _score(self.get_metric_fn, c)) for c in checkpoints
                  if c.metrics is not None]
        for _ in range(2):  # values that do not compare (a tuple, a number): the numbers only
            nan = [c for c, value in scored if _nan(value)]
            values = [(c, value) for c, value in scored if not _nan(value)]
            try:  # sorted() is stable with reverse too: of equal values the later step stays
                return nan + [c for c, _ in sorted(values, key=lambda cv: cv[1],  # later
                                                   reverse=self.reverse)]
            except (TypeError, ValueError):  # (arrays of several compare to no truth value)
                scored = [(c, v if isinstance(v, float) else math.nan) for c, v in scored]
        raise AssertionError("floats compare")

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        if self.n is None or len(checkpoints) <= self.n:  # orbax: room for all, metrics or not
            return [True] * len(checkpoints)
        if self.n == 0:  # orbax: none, those without metrics too
            return [False] * len(checkpoints)
        keep = {c.step for c in self.ranked(checkpoints)[-self.n:]}
        return [c.step in keep or (c.metrics is None and self.keep_checkpoints_without_metrics)
                for c in checkpoints]


def best_of(policy: PreservationPolicy, checkpoints: list) -> int | None:
    """The step of ``checkpoints`` (ascending) that ranks best by ``policy``'s :class:`BestN`
    (the latest without one); None if none has metrics, or none is given."""
    best = find(policy, BestN)
    if best is None:
        return checkpoints[-1].step if checkpoints else None
    ranked = best.ranked(checkpoints)
    return ranked[-1].step if ranked else None


def _nan(value: Any) -> bool:
    return isinstance(value, float) and value != value


def _score(get_metric_fn: Callable[[Any], float], checkpoint) -> Any:
    """``get_metric_fn(checkpoint.metrics)``: a number (a numpy or jax scalar too) as a float,
    NaN for a str, bytes or None, which then ranks as a NaN does; another value (a tuple)
    as it is, ranked by Python's comparison where the values compare."""
    try:
        value = get_metric_fn(checkpoint.metrics)
    except Exception as e:
        e.add_note(f"casstore: get_metric_fn of the metrics of step {checkpoint.step}: "
                   f"{checkpoint.metrics!r}"[:500])
        raise
    if value is None or isinstance(value, str | bytes):
        return float("nan")
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


@dataclasses.dataclass
class CustomSteps(PreservationPolicy):
    """Keeps the steps in ``steps``."""

    steps: Container[int]

    def __post_init__(self):
        check_steps(self.steps)

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        return [c.step in self.steps for c in checkpoints]


@dataclasses.dataclass
class AnyPreservationPolicy(PreservationPolicy):
    """Keeps a step if any of ``policies`` keeps it."""

    policies: Sequence[PreservationPolicy]

    def __post_init__(self):
        check_policies(self.policies, "should_preserve")

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        votes = [p.should_preserve(checkpoints, context=context) for p in self.policies]
        return [any(v) for v in zip(*votes, strict=True)] if votes else [False] * len(
            checkpoints)


def manager_policies(save_decision_policy: SaveDecisionPolicy | None,
                     preservation_policy: PreservationPolicy | None, *,
                     save_interval_steps: int | None, max_to_keep: int | None,
                     keep_period: int | None, best_fn: Callable[[Any], float] | None,
                     best_mode: str, keep_checkpoints_without_metrics: bool,
                     ) -> tuple[SaveDecisionPolicy, PreservationPolicy]:
    """CheckpointManager's two policies: those given, or those of orbax's keyword arguments.

    ``save_interval_steps=s`` is ``FixedIntervalPolicy(s)`` (1 if None) with jax's preemption
    sync point (no signal handler) and ``InitialSavePolicy()``: orbax 0.12's default, which
    saves a run's first step whatever its number. ``max_to_keep=n`` is ``LatestN(n)``, or
    with ``best_fn`` ``BestN(get_metric_fn=best_fn, reverse=best_mode == "min", n=n,
    keep_checkpoints_without_metrics=...)``; ``keep_period=k`` adds ``EveryNSteps(k)``.

    Raises:
      ValueError: a policy is given with a keyword argument it replaces (set to other than its
        default), ``best_mode`` is not ``"max"`` / ``"min"``, or a count is not positive.
    """
    if best_mode not in ("max", "min"):
        raise ValueError(f"best_mode must be 'max' or 'min', not {best_mode!r}")
    if best_fn is not None and not callable(best_fn):
        raise TypeError(f"best_fn must be callable, not {best_fn!r}")
    for name, policy, method in (("save_decision_policy", save_decision_policy, "should_save"),
                                 ("preservation_policy", preservation_policy,
                                  "should_preserve")):
        if policy is not None:
            check_policy(name, policy, method)
    for name, value in (("save_interval_steps", save_interval_steps),
                        ("max_to_keep", max_to_keep), ("keep_period", keep_period)):
        check_positive(name, value, none_ok=True)  # named as the caller wrote it
    replaced = {"save_decision_policy": {"save_interval_steps": save_interval_steps},
                "preservation_policy": {
                    "max_to_keep": max_to_keep, "keep_period": keep_period, "best_fn": best_fn,
                    "best_mode": None if best_mode == "max" else best_mode,
                    "keep_checkpoints_without_metrics":
                        None if keep_checkpoints_without_metrics else False}}
    for name, policy in (("save_decision_policy", save_decision_policy),
                         ("preservation_policy", preservation_policy)):
        given = [key for key, value in replaced[name].items() if value is not None]
        if policy is not None and given:
            raise ValueError(f"{name}= replaces {', '.join(k + '=' for k in given)}: pass one "
                             "or the other (as orbax's CheckpointManagerOptions)")
    if save_decision_policy is None:
        interval = FixedIntervalPolicy(1 if save_interval_steps is None else save_interval_steps)
        save_decision_policy = AnySavePolicy([interval, PreemptionCheckpointingPolicy(
            signals=()), InitialSavePolicy()])
    if preservation_policy is None:
        preservation_policy = _preservation_of(max_to_keep, keep_period, best_fn, best_mode,
                                               keep_checkpoints_without_metrics)
    return save_decision_policy, preservation_policy


def persistent_preservation(policy: PreservationPolicy | None, max_to_keep: int | None,
                            keep_period: int | None) -> PreservationPolicy | None:
    """The persistent tier's preservation policy: ``policy``, or ``LatestN(max_to_keep)`` with
    ``EveryNSteps(keep_period)`` added, or None (keep every persisted step) without either.

    Raises:
      ValueError: ``policy`` is given with ``max_to_keep`` or ``keep_period``, or a count is
        not a positive int (naming the manager's ``persistent_*`` argument).
    """
    check_positive("persistent_max_to_keep", max_to_keep, none_ok=True)
    check_positive("persistent_keep_period", keep_period, none_ok=True)
    given = [name for name, value in (("persistent_max_to_keep", max_to_keep),
                                      ("persistent_keep_period", keep_period)) if value]
    if policy is not None and given:
        raise ValueError(f"persistent_preservation_policy= replaces {', '.join(given)}: pass "
                         "one or the other")
    if policy is not None or (max_to_keep is None and keep_period is None):
        return policy
    return _preservation_of(max_to_keep, keep_period, None, "max", True)


def _preservation_of(max_to_keep, keep_period, best_fn, best_mode,
                     keep_checkpoints_without_metrics) -> PreservationPolicy:
    if best_fn is None:
        policy: PreservationPolicy = LatestN(max_to_keep)
    else:
        policy = BestN(get_metric_fn=best_fn, reverse=best_mode == "min", n=max_to_keep,
                       keep_checkpoints_without_metrics=keep_checkpoints_without_metrics)
    if keep_period is not None:
        policy = AnyPreservationPolicy([policy, EveryNSteps(keep_period)])
    return policy


def find(policy: Any, kind: type) -> Any:
    """The first policy of class ``kind`` in ``policy`` or its ``Any*`` children, or None."""
    if isinstance(policy, kind):
        return policy
    for child in getattr(policy, "policies", ()):
        found = find(child, kind)
        if found is not None:
            return found
    return None
