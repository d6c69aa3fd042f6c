"""The ``casstore`` command group: exit codes, one-line errors, shared options, opening a
repository. Commands live in ``_read``, ``_check`` and ``_files``; they call casstore's public
API only, imported on first use so ``casstore --help`` does not import jax."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Any

import click

import casstore

from . import _output
from ._output import error_line

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_NO_REPOSITORY = 10
EXIT_UNREACHABLE = 11
EXIT_ACCESS_DENIED = 12
EXIT_BUSY = 13
EXIT_NEWER = 14
EXIT_STORE_FAILED = 15
EXIT_CODES = f"""\b
Exit codes:
  {EXIT_OK}   ok
  {EXIT_PROBLEMS}   the repository is damaged: verify found problems, or a command met a
      damaged manifest or chunk (the rest was shown; see docs/recovery.md)
  {EXIT_USAGE}   usage or input error (a bad argument, option, step or run)
  {EXIT_NO_REPOSITORY}  no casstore repository at the URL
  {EXIT_UNREACHABLE}  the store is unreachable or did not answer in time
  {EXIT_ACCESS_DENIED}  the store refused access (credentials, read-only)
  {EXIT_BUSY}  gc waited --lock-timeout for saves in flight and did nothing
  {EXIT_NEWER}  a newer casstore wrote what was met (a format feature, codec or version
      this one does not read): upgrade casstore; nothing is damaged
  {EXIT_STORE_FAILED}  the disk failed a read or write: it is full (or over quota), or
      reported an I/O error
  130 interrupted (Ctrl-C: stops at once, releasing the save lock; a second one quits
      without waiting for that)
  141 the output's reader went away (`| head`)"""
# -o options that casstore itself takes (open_store), beside the filesystem's own
CASSTORE_OPTIONS = {"read_only", "request_timeout_s", "operation_timeout_s"}
_where: dict[str, str] = {"at": ""}
_sigints: list[bool] = []  # [True] once a first Ctrl-C came


class NoRepository(click.ClickException):
    """No casstore repository at the URL (exit 10)."""

    exit_code = EXIT_NO_REPOSITORY


_NO_ARGS = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError",  # botocore's
                   "DefaultCredentialsError", "RefreshError")  # google-auth's (gcsfs)


def exit_code_of(e: BaseException) -> int:
    """The exit code that an error means (the table in ``EXIT_CODES``)."""
    if isinstance(e, click.ClickException):
        return e.exit_code
    if isinstance(e, (casstore.StoreTimeoutError, casstore.StoreUnreachableError)):
        return EXIT_UNREACHABLE
    if isinstance(e, casstore.GcBusyError):
        return EXIT_BUSY
    if isinstance(e, casstore.UnsupportedFormatError):
        return EXIT_NEWER
    if (isinstance(e, PermissionError) or type(e).__name__ in _NO_CREDENTIALS
            or getattr(e, "errno", None) == errno.EROFS):  # a read-only filesystem too
        return EXIT_ACCESS_DENIED  # AccessDeniedError, ReadOnlyStoreError, no credentials
    if isinstance(e, (casstore.ManifestError, casstore.CorruptChunkError,
                      casstore.MissingChunkError)):
        return EXIT_PROBLEMS
    if getattr(e, "errno", None) in _FULL + _DISK_ERRORS:
        return EXIT_STORE_FAILED
    return EXIT_USAGE


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_DISK_ERRORS = (errno.EIO, getattr(errno, "EUCLEAN", errno.EIO),  # EUCLEAN: Linux's
                errno.ENOLINK)  # LocalStore's for a link to a disk not mounted


def _os_fix(e: BaseException) -> str | None:
    """The advice for an operating system's error of a local file (casstore's own errors
    name theirs), or None."""
    if not isinstance(e, OSError) or isinstance(e, casstore.CasstoreError):
        return None
    if e.errno in _FULL:
        return ("free some space; gc writes a small lock object before it deletes anything, so "
                "on a full disk free a few kilobytes elsewhere first, then run 'casstore gc "
                "URL --grace-period 0' when no save runs (docs/recovery.md)")
    if e.errno in _DISK_ERRORS and e.filename:  # a local file's (s3fs's EIO names none)
        return "the disk reported an error: check it (dmesg, fsck), then run 'casstore verify'"
    if isinstance(e, PermissionError) and e.filename:
        return f"check the permissions of {e.filename}"
    return None


_FIXES = {EXIT_UNREACHABLE: "check the endpoint (-o endpoint_url=...), that the server runs, "
                            "and the network; a slow store may need -o operation_timeout_s",
          EXIT_ACCESS_DENIED: "check the credentials (AWS_*/GOOGLE_* variables, -o key=... "
                              "-o secret=..., -o anon=true for public data)",
          EXIT_PROBLEMS: "run 'casstore verify' and see docs/recovery.md",
          EXIT_NEWER: "upgrade casstore (pip install -U casstore)"}


def describe(e: BaseException) -> str:
    """One line: the error, where it happened (URL, run, step) and what to do."""
    if isinstance(e, click.UsageError):
        where = f"; see '{e.ctx.command_path} --help'" if e.ctx is not None else ""
        return " ".join(e.format_message().split()).rstrip(".") + where
    if isinstance(e, click.ClickException):
        return " ".join(e.format_message().split())
    message = " ".join(str(e).split()) or type(e).__name__
    if not isinstance(e, casstore.CasstoreError):
        message = f"{type(e).__name__}: {message}"
    if _where["at"] and getattr(e, "url", None) is None:  # casstore errors name their place
        message += f" ({_where['at']})"
    # a command's own advice (copy's --steps), an OS error's, else the exit code's
    fix = getattr(e, "cli_fix", None) or _os_fix(e) or (
        None if isinstance(e, casstore.UnsupportedFormatError) else _FIXES.get(
            exit_code_of(e)))  # that one says to upgrade
    if isinstance(e, casstore.ReadOnlyStoreError):  # opened so, not refused by the server
        fix = "it was opened read-only (read_only=true): drop that option to write"
    return f"{message}; {fix}" if fix else message


def _interrupted(signum: int, frame: Any) -> None:
    """SIGINT: the first stops the command (KeyboardInterrupt): its chunk requests in flight
    are cancelled (``bounded_map``), it releases its lock, and the process exits without
    waiting for any thread (:meth:`_Group._main`); a second exits at once, even while
    the lock's release waits on a stalled store. Either way no step is half there: a manifest
    is written last (format.md §7); a save lock left behind holds off GC until it turns stale
    (_locks)."""
    if _sigints:
        os.write(2, b"casstore: aborted\n")
        os._exit(130)
    _sigints.append(True)
    os.write(2, b"casstore: stopping; press Ctrl-C again to quit now\n")
    raise KeyboardInterrupt


class _Group(click.Group):
    """Turns any error into one line on stderr (JSON with --json) and its exit code, unless
    ``--debug``."""

    def main(self, args: Any = None, prog_name: str | None = None, **extra: Any) -> Any:
        args = list(sys.argv[1:] if args is None else args)
        _where["at"] = ""
        _sigints.clear()
        main_thread = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGINT, _interrupted) if main_thread else None
        try:
            self._main(args, prog_name, **extra)
        finally:  # (a process stopping on Ctrl-C keeps it: a second one still exits at once)
            if main_thread and not _sigints:
                signal.signal(signal.SIGINT, before)

    def _main(self, args: list[str], prog_name: str | None, **extra: Any) -> None:
        try:
            rv = super().main(args, prog_name=prog_name or "casstore", standalone_mode=False,
                              **extra)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except _NO_ARGS as e:  # bare "casstore": the help, as click prints it
            click.echo(e.format_message())
            sys.exit(EXIT_USAGE)
        except click.Abort:
            click.echo("casstore: aborted", err=True)
            if _sigints:  # Ctrl-C: the command cleaned up; its requests in flight are moot
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(130)
            sys.exit(130)
        except BrokenPipeError:  # `casstore ... --json | head`: the reader went away (SIGPIPE)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
            sys.exit(128 + 13)
        except Exception as e:
            code = exit_code_of(e)
            if "--debug" in args and not isinstance(e, click.UsageError):
                traceback.print_exc()  # then the same exit code as without --debug
            error_line(describe(e), code, type(e).__name__, as_json="--json" in args)
            sys.exit(code)
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=EXIT_CODES)
@click.option("--debug", is_flag=True, help="Show the traceback of an error.")
@click.version_option(casstore.__version__, prog_name="casstore")
def main(debug: bool) -> None:
    """Content-addressed checkpoints: inspect, check and move casstore repositories.

    Every command takes a repository URL (a path, s3://, gs:// or any fsspec URL) and -o
    KEY=VALUE storage options; s3fs and gcsfs also read their usual credential and endpoint
    environment variables. Read commands print tables, or JSON with --json (errors too,
    as one JSON line on stderr). Progress bars appear only on a terminal.

    \b
    Examples:
      casstore ls ./ckpt
      casstore ls s3://bucket/ckpt -o endpoint_url=http://127.0.0.1:9000
      casstore verify ./ckpt --json
    """
    if not debug:  # one line per error: not gcsfs's "could not determine bucket type" warnings
        logging.getLogger("gcsfs").addFilter(_no_bucket_type_warnings)  # added once


def _no_bucket_type_warnings(record: logging.LogRecord) -> bool:
    """False for gcsfs's "Could not determine bucket type ..." warning (it falls back anyway)."""
    return not str(record.msg).startswith("Could not determine")


def command(name: str) -> Any:
    """``main.command(name)`` with the exit codes in its help."""
    return main.command(name, epilog=EXIT_CODES)


def parse_options(ctx: Any, param: Any, values: tuple[str, ...]) -> dict:
    """``KEY=VALUE`` items as a dict; values parse as JSON (true, 3, {...}) else strings."""
    options = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", ctx, param)
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
        if key in CASSTORE_OPTIONS:  # casstore's own: typed here, as the API takes them
            options[key] = _typed(key, value, ctx, param)
    return options


def _typed(key: str, value: str, ctx: Any, param: Any) -> bool | float:
    """``read_only`` as a bool (true/false, yes/no, 1/0), a timeout as positive seconds."""
    text = value.strip().lower()
    if key == "read_only":
        if text in ("true", "yes", "1", "false", "no", "0"):
            return text in ("true", "yes", "1")
        raise click.BadParameter(f"read_only={value!r}: true or false", ctx, param)
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise click.BadParameter(f"{key}={value!r}: a number of seconds, above 0", ctx, param)
    return seconds


def storage_options(f: Any) -> Any:
    return click.option("-o", "--storage-option", "options", multiple=True, metavar="KEY=VALUE",
                        callback=parse_options,
                        help="Storage option (repeatable): the filesystem's (e.g. "
                        "endpoint_url=http://127.0.0.1:9000, anon=true) or casstore's "
                        "(read_only, request_timeout_s, operation_timeout_s).")(f)


def json_flag(f: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(f)


def run_option(f: Any) -> Any:
    return click.option("--run", default="default", show_default=True, help="Run name.")(f)


def step_number(text: str) -> int:
    """A step number written in ASCII digits; ValueError for anything else (Python's ``int``
    also takes ``1_0`` for 10 and other scripts' digits, and ``rm`` would delete that step)."""
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{text!r} is not a step number")
    return int(text)


class StepParam(click.ParamType):
    """A STEP argument: a step number, or with ``latest`` also ``latest`` (the run's newest
    committed step, as restic's ``latest`` snapshot; :func:`step_of` resolves it once the
    repository is open)."""

    name = "step"

    def __init__(self, latest: bool = True):
        self.latest = latest

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, int) or (self.latest and value == "latest"):
            return value
        try:
            return step_number(value)
        except ValueError:
            self.fail(f"{value!r} is neither a step number nor 'latest'" if self.latest
                      else f"{value!r} is not a step number", param, ctx)


STEP, STEP_NUMBER = StepParam(), StepParam(latest=False)


def step_of(store: Any, url: str, run: str, step: int | str) -> int:
    """``step``, or the newest committed step of ``run`` for ``latest``.

    Raises:
      click.UsageError: ``latest`` of a run with no committed step.
    """
    if step != "latest":
        return int(step)
    found = casstore.latest_step(store, run=run)
    if found is None:
        raise click.UsageError(f"run {run!r} has no committed step in {url!r}: no 'latest'")
    return found


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def pair_options(src: str, dst: str, options: dict, dst_options: dict) -> tuple[dict, dict]:
    """The storage options of SRC (``-o``) and DST (``-O``, else ``-o``): none for a local path.

    Raises:
      click.UsageError: options that no URL of the two takes (they would be ignored).
    """
    if ((options and is_local(src) and (is_local(dst) or dst_options))
            or (dst_options and is_local(dst))):  # -o for a local SRC with -O: for no URL
        raise click.UsageError(f"storage options (-o/-O) are for fsspec URLs; {src!r} and "
                               f"{dst!r} take none" if is_local(dst) else
                               "-o is for SRC, a local path here, which takes none; give "
                               "DST's options with -O (or -o alone)")
    return ({} if is_local(src) else options), ({} if is_local(dst) else dst_options or options)


def check_options(url: str, options: dict) -> None:
    """UsageError for a storage option the URL's filesystem does not take, before any request.

    Known: casstore's own, fsspec's common ones, and every named parameter of the
    filesystem class's ``__init__`` along its class hierarchy.
    """
    if not options or is_local(url):
        return  # open_store refuses options for a local path, by name
    from casstore.store import unknown_storage_options
    try:
        problem = unknown_storage_options(url.split("://")[0], {
            k: v for k, v in options.items() if k not in CASSTORE_OPTIONS})
    except (ValueError, ImportError) as e:
        raise click.UsageError(f"cannot open {url!r}: {e}") from None
    if problem:
        raise click.UsageError(problem)


def open_repo(url: str, options: dict, *, create: bool = False, damaged: bool = False) -> Any:
    """Opens ``url`` with storage ``options`` (checked first) and records it for error lines.

    With ``damaged`` (verify, and repair's damaged copy), a damaged or missing config object
    is left for the command to report.

    Raises:
      NoRepository: not a repository (unless ``create`` or ``damaged``).
      ManifestError: a damaged config object (unless ``create`` or ``damaged``).
      click.UsageError: an unknown storage option.
    """
    _where["at"] = _where["at"] or f"url {url!r}"
    check_options(url, options)
    store = casstore.open_store(url, **options)
    if create:
        return store
    try:
        found = casstore.is_repository(store)
    except casstore.UnsupportedFormatError:
        raise
    except casstore.ManifestError:
        if not damaged:
            raise
        found = True
    if not found and not damaged:
        raise no_repository(url)
    return store


def no_repository(url: str) -> NoRepository:
    """The error for a URL that holds no casstore repository (exit 10)."""
    server = {"s3": "an S3-compatible server", "gs": "a GCS emulator"}.get(url.split("://")[0])
    return NoRepository(f"no casstore repository at {url!r}; check the path" + (
        f" (for {server}, -o endpoint_url=...)" if server else ""))


def where(url: str, run: str | None, step: int | None = None) -> None:
    """Names URL, run and step in any error line of this command."""
    _where["at"] = f"url {url!r}" + ("" if run is None else f", run {run!r}") + (
        "" if step is None else f", step {step}")


def check_run(store: Any, url: str, run: str | None) -> None:
    """UsageError if ``run`` is given and has no committed step (a typo must not pass)."""
    if run is None:
        return
    runs = casstore.list_runs(store)
    if run not in runs:
        raise click.UsageError(f"run {run!r} has no steps in {url!r} (runs: "
                               f"{', '.join(map(repr, runs)) or 'none'})")


def counted(store: Any) -> Any:
    """The store wrapped for progress counting, on a terminal only."""
    from casstore.store import CountingStore

    return CountingStore(store) if _output.console.is_terminal else store


def report_damage(problems: list, as_json: bool) -> None:
    """Names each damaged object on stderr (not in --json mode) and exits 1 if any, else 14
    if any is of a newer format."""
    if not problems:
        return
    if not as_json:
        newer = [p for p in problems if p.kind == "unsupported"]  # not damage: upgrade
        for p in problems:
            click.echo(f"casstore: {'newer format' if p in newer else 'damaged'}: {p}", err=True)
        if len(newer) < len(problems):
            click.echo(f"casstore: {len(problems) - len(newer)} damaged object(s); the rest is "
                       "shown. See 'casstore verify' and docs/recovery.md", err=True)
        if newer:
            click.echo(f"casstore: {len(newer)} object(s) of a newer format, not damaged: "
                       "upgrade casstore to read them; the rest is shown", err=True)
    click.get_current_context().exit(problems_exit(problems))


def problems_exit(problems: list) -> int:
    """1 if any of ``problems`` is damage, 14 if all are of a newer format (upgrade)."""
    return EXIT_NEWER if all(p.kind == "unsupported" for p in problems) else EXIT_PROBLEMS
