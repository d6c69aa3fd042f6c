"""A module imported on first attribute access, so that commands that read manifests only
(``casstore ls``, ``du``, ``verify``) and ``import casstore`` do not import jax (issue 30)."""

from __future__ import annotations

import importlib
import types
from typing import Any


class LazyModule:
    """Stands for module ``name``; the first attribute access imports it.

    ``jax = LazyModule("jax")`` then ``jax.Array`` behaves as with ``import jax``.
    """

    def __init__(self, name: str):
        self._name = name
        self._module: types.ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)
