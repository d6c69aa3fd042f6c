"""The ``casstore`` command line: look into, check, clean, copy, export and import repositories.

restic's command line is the model. The package holds the group and its error handling
(``_app``), what it prints (``_output``), and the commands by group: ``_read`` (ls, show, du,
diff, cat), ``_check`` (verify, gc, rm, copy) and ``_files`` (export, import). Commands call
casstore's public API only, so a script can do what each command does.
"""

from . import _check, _files, _read  # noqa: F401  (registers the commands)
from ._app import EXIT_ACCESS_DENIED as EXIT_ACCESS_DENIED
from ._app import EXIT_BUSY as EXIT_BUSY
from ._app import EXIT_NO_REPOSITORY as EXIT_NO_REPOSITORY
from ._app import EXIT_OK as EXIT_OK
from ._app import EXIT_PROBLEMS as EXIT_PROBLEMS
from ._app import EXIT_STORE_FAILED as EXIT_STORE_FAILED
from ._app import EXIT_UNREACHABLE as EXIT_UNREACHABLE
from ._app import EXIT_USAGE as EXIT_USAGE
from ._app import main as main
from ._app import parse_options as parse_options
from ._output import JSON_SCHEMA_VERSION as JSON_SCHEMA_VERSION
from ._plot import plot_usage as plot_usage

if __name__ == "__main__":  # pragma: no cover
    main(prog_name="casstore")
