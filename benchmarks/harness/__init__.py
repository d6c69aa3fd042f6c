# ruff: noqa: F401, F403  (this package re-exports its modules' names)
"""What every benchmark shares; each script holds only its scenario and imports this package by
path (``benchmarks/`` is scripts, not a package): ``import harness as h``. benchmarks/README.md
says what each module holds."""

from . import limit, peers
from .report import *
from .states import *
from .storage import *
from .timing import *
