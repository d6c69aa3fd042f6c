"""An adaptive limit on the requests in flight to one store: slows down when it throttles.

Additive increase, multiplicative decrease (AIMD), as TCP's congestion window (RFC 5681 §3.1):
a throttled or timed-out request halves the limit, each success raises it by ``1 / limit``, so
a throttling store sees fewer requests at once instead of failing a save. The limit is halved at
most once per "epoch" (requests started before the last halving do not halve it again), as TCP
reduces its window once per round trip.
"""

from __future__ import annotations

import threading
import time


class AdaptiveLimit:
    """At most ``int(limit)`` holders at once; ``1 <= limit <= maximum``. Thread-safe.

    Args:
      maximum: the limit while the store answers everything (the store's ``max_workers``).
    """

    def __init__(self, maximum: int):
        self.maximum = max(1, maximum)
        self.limit = float(self.maximum)
        self.in_flight = 0
        self.epoch = 0
        self._cond = threading.Condition()

    def acquire(self, deadline: float) -> int | None:
        """Waits for a free slot until ``deadline`` (``time.monotonic()`` seconds).

        Returns:
          The epoch to pass to :meth:`release`, or None if no slot came before the deadline.
        """
        with self._cond:
            while self.in_flight >= int(self.limit):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            self.in_flight += 1
            return self.epoch

    def release(self, epoch: int, *, congested: bool) -> None:
        """Frees a slot; ``congested`` says the request was throttled or timed out."""
        with self._cond:
            self.in_flight -= 1
            if not congested:
                self.limit = min(float(self.maximum), self.limit + 1.0 / self.limit)
            elif epoch == self.epoch:
                self.limit = max(1.0, self.limit / 2)
                self.epoch += 1
            self._cond.notify_all()
