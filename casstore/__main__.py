"""``python -m casstore``: the command line (see :mod:`casstore.cli`)."""

from .cli import main

main(prog_name="casstore")
