"""Telling "no server there" from "a slow server": a refused connection or an unknown host
fails within seconds, naming the store; a server that accepts and stalls keeps its deadline
(docs/reliability.md, "Deadlines")."""

from __future__ import annotations

import math
import socket
import time

from .._errors import StoreTimeoutError, StoreUnreachableError

UNREACHABLE_S = 3.0  # how long a refused connection or an unknown host is retried


def is_unreachable(exc: BaseException) -> bool:
    """True if ``exc`` or an error it wraps is a refused connection or an unknown host."""
    chain = [exc]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
        chain.append(nxt)
    return any(isinstance(x, (ConnectionRefusedError, socket.gaierror)) for x in chain)


def retry_deadline(exc: BaseException) -> float:
    """The latest monotonic time worth retrying after ``exc``: soon for an unreachable store,
    else no limit of its own (the operation's deadline holds)."""
    return time.monotonic() + UNREACHABLE_S if is_unreachable(exc) else math.inf


def no_answer(budget: float, last: BaseException,
              **where) -> StoreTimeoutError | StoreUnreachableError:
    """The error for an operation that got no answer: StoreUnreachableError (a
    ConnectionError, within seconds) if nobody is there, else a StoreTimeoutError."""
    detail = ": ".join(x for x in (type(last).__name__, str(last)) if x)
    if is_unreachable(last):
        where.pop("key", None)
        return StoreUnreachableError("cannot connect (connection refused or unknown host): "
                                     f"{detail}", **where)
    return StoreTimeoutError(f"no answer within the {budget:g} s deadline (last error: "
                             f"{detail})", **where)
