"""Preemption notices: jax's preemption sync point and, in one process, a signal (SIGTERM).

A cluster scheduler tells a job it will be stopped by sending SIGTERM some time before it
kills it. In a ``jax.distributed`` job with jax's preemption service, jax catches the signal
and agrees with every process on a step to save at (its sync point); a single process has no
one to agree with, so :class:`PreemptionNotice` records the signal itself.
"""

from __future__ import annotations

import signal
import threading
import weakref
from collections.abc import Sequence

from ._coordinator import processes


def reached_sync_point(step: int) -> bool:
    """jax's ``reached_preemption_sync_point(step)``; False where jax runs no preemption
    service (no ``jax.distributed``, or the service disabled)."""
    try:
        from jax.experimental import multihost_utils
        return bool(multihost_utils.reached_preemption_sync_point(step))
    except (ImportError, RuntimeError):  # RuntimeError: no preemption sync manager
        return False


class PreemptionNotice:
    """Answers "was this job told it will be stopped?", step by step.

    Args:
      signals: signals that mean a preemption notice in a single-process job; a handler is
        installed for each (from the main thread only) until :meth:`close`. The handler it
        replaces is called too when it is a Python function. Ignored with several processes,
        where only jax's sync point agrees across processes.
      owner: an object (the manager) whose collection closes the notice, so that a manager
        dropped unclosed puts back the handlers it replaced.

    Raises:
      ValueError: ``signals`` given but this is not the main thread (Python installs signal
        handlers there only).
    """

    def __init__(self, signals: Sequence[int] = (), owner: object = None):
        self.signal_received: int | None = None
        self._previous: dict[int, object] = {}
        self._closed = False
        self._step: int | None = None  # the first step reached: the one to save
        self._denied: int | None = None  # the last step answered False
        if not signals or processes()[0] > 1:
            return
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("a preemption policy with signals= needs the manager to be made "
                             "in the main thread (pass signals=() to listen to jax only)")
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        if owner is not None:
            weakref.finalize(owner, self.close)

    def _handle(self, signum: int, frame) -> None:
        previous = _live(self._previous.get(signum), signum)
        if not self._closed:
            self.signal_received = signum
        elif signal.getsignal(signum) == self._handle:  # closed outside the main thread:
            signal.signal(signum, previous)  # what it replaced is put back now, and acts
            if previous == signal.SIG_DFL:  # the default action (SIGTERM: the process ends)
                signal.raise_signal(signum)
        if callable(previous):
            previous(signum, frame)

    def reached(self, step: int) -> bool:
        """True from the first step asked after a notice on (the job is going away), or from
        the next one if this step was already answered False: a loop that asked about a step
        (its save decided not to save it) before the notice came saves the next one, as jax's
        sync point agrees on a step later than those reported. A loop that went back to an
        earlier step (a rollback) is answered from there.

        Every process of a multi-process job must ask at every step (jax's protocol).
        """
        if self._step is None and (self.signal_received is not None
                                   or reached_sync_point(step)):
            self._step = step + 1 if step == self._denied else step
        if self._step is not None and step >= self._step:
            return True
        self._denied = step
        return False

    def close(self) -> None:
        """Puts back the signal handlers it replaced, skipping those of notices closed since
        (closed in another order than made, the last one still puts back the first's
        predecessor). Idempotent. Outside the main thread (a ``close`` from another thread,
        or the owner collected there), where Python sets no handler, each handler puts its
        predecessor back when its signal next comes, and passes the signal on to it."""
        self._closed = True
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self._previous:
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, _live(self._handle, sig))


def _live(handler: object, sig: int) -> object:
    """``handler``, or the first handler before it in a chain of closed notices' handlers."""
    while isinstance(owner := getattr(handler, "__self__", None), PreemptionNotice) and (
            owner._closed):
        handler = owner._previous.get(sig, signal.SIG_DFL)
    return handler
