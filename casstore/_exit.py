"""Work that background threads finish before the interpreter exits: an asynchronous save in
flight, a persist backlog."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("casstore")
_owners: dict[Callable[[Any], None], weakref.WeakSet] = {}
_lock = threading.Lock()


def finish_at_exit(owner: Any, finish: Callable[[Any], None]) -> None:
    """Calls ``finish(owner)`` at interpreter exit, if ``owner`` is alive then and was not
    :func:`forgotten <forget_at_exit>`, before concurrent.futures refuses new thread pools
    (threading's exit hooks run in reverse order of registration, and casstore imports
    concurrent.futures before it registers one). One hook per ``finish`` however many owners
    come and go: a hook per owner stayed registered after the owner was closed."""
    with _lock:
        if (owners := _owners.get(finish)) is None:
            owners = _owners[finish] = weakref.WeakSet()
            register = getattr(threading, "_register_atexit", atexit.register)
            register(lambda: _finish_all(finish, owners))
        owners.add(owner)


def forget_at_exit(owner: Any, finish: Callable[[Any], None]) -> None:
    """Undoes :func:`finish_at_exit` (``owner`` was closed: nothing is left to finish)."""
    with _lock:
        if (owners := _owners.get(finish)) is not None:
            owners.discard(owner)


def _finish_all(finish: Callable[[Any], None], owners: weakref.WeakSet) -> None:
    for owner in list(owners):
        try:
            finish(owner)
        except Exception:  # the next owner's work still finishes
            log.exception("casstore: finishing %r at interpreter exit failed", owner)
