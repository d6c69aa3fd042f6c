"""What the command line prints: JSON with a schema version, rich tables, progress bars,
and one-line errors (plain or JSON)."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import click
import msgpack
from rich.console import Console
from rich.filesize import decimal as human
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

JSON_SCHEMA_VERSION = 1  # of every --json output; raised when a field changes meaning
class _Console(Console):
    def on_broken_pipe(self) -> None:
        """``casstore show URL | head``: the reader went away. Exit as SIGPIPE would (141),
        not with rich's 1, which means a damaged repository here."""
        self.quiet = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(128 + 13)


console = _Console(highlight=False, markup=False, soft_wrap=True)  # key paths hold "[0]"

__all__ = [
    "JSON_SCHEMA_VERSION",
    "console",
    "emit_json",
    "error_line",
    "human",
    "progress",
    "ratio",
    "rows_of",
    "say",
    "table",
]


def rows_of(items: Any) -> list[dict]:
    """Dataclass instances as JSON-ready dicts."""
    return [dataclasses.asdict(x) for x in items]


def emit_json(obj: Any, *, versioned: bool = True) -> None:
    """Prints ``obj`` as JSON (RFC 8259); a dict gets ``schema_version`` first. Bytes print as
    ``{"base64": ...}``, and a float NaN or infinity (a diverged loss) as the string ``"NaN"``,
    ``"Infinity"`` or ``"-Infinity"``, which strict parsers accept. A map with a key other than
    str (user metadata may have int, float, bool, nil and bytes keys), or whose one key is
    ``"base64"`` or ``"map"``, prints as ``{"map": [[key, value], ...]}``, its keys typed as
    values are: JSON keys are str, so ``1`` and ``"1"`` would print as one key twice."""
    if versioned and isinstance(obj, dict):
        obj = {"schema_version": JSON_SCHEMA_VERSION, **obj}

    def default(x: Any) -> Any:
        if isinstance(x, bytes):
            return {"base64": base64.b64encode(x).decode()}
        if isinstance(x, msgpack.Timestamp):  # in a field no reader checks (another writer's)
            try:
                return x.to_datetime().isoformat()
            except (OverflowError, ValueError, OSError):  # past what datetime holds
                return {"timestamp": [x.seconds, x.nanoseconds]}
        raise TypeError(f"cannot print {type(x).__name__} as JSON")

    write_lines(json.dumps(_finite(obj), indent=2, default=default,
                           allow_nan=False).split("\n"))


_TAGS = {"base64", "map"}  # the one key of a JSON object that stands for bytes or a map


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by its JSON5 name, as a string, and every
    map that JSON object keys cannot tell apart as ``{"map": [[key, value], ...]}``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else "Infinity" if obj > 0 else "-Infinity"
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and set(obj) & _TAGS):
            return {k: _finite(v) for k, v in obj.items()}
        return {"map": [[_finite(k), _finite(v)] for k, v in obj.items()]}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def error_line(message: str, code: int, kind: str, *, as_json: bool) -> None:
    """Prints one error on stderr: ``casstore: error: ...`` or, in --json mode, one JSON line
    ``{"schema_version", "error": {"code", "type", "message"}}`` (restic's exit_error)."""
    if as_json:
        click.echo(json.dumps({"schema_version": JSON_SCHEMA_VERSION, "error": {
            "code": code, "type": kind, "message": message}}), err=True)
    else:
        click.echo(f"casstore: error: {message}", err=True)


_LEFT = ("run", "key path", "status", "dtype", "time", "sharding", "shape")
PLAIN_ROWS = 2000  # a longer table prints plainly: rich takes about 2 ms a row (43 s for 20,000)


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    """Prints a table; on a pipe or file each row stays one whole line. No rows: the title
    alone (it gives the counts), not an empty frame. Over ``PLAIN_ROWS`` rows (a step of
    20,000 leaves) the table prints without a frame, its columns aligned, in well under a
    second."""
    if title:
        console.print(title, soft_wrap=True)
    if not rows:
        return
    cells = [[_printable(str(v)) for v in row] for row in rows]
    if len(cells) > PLAIN_ROWS:
        return _plain(columns, cells)
    t = Table()
    for name in columns:
        t.add_column(name, justify="left" if name in _LEFT else "right", overflow="fold",
                     no_wrap=name == "time", min_width=24 if name == "key path" else None)
    for row in cells:
        t.add_row(*row)
    if not console.is_terminal:
        console.width = max(80, console.measure(
            t, options=console.options.update_width(100_000)).maximum)
    console.print(t)


def _plain(columns: list[str], cells: list[list[str]]) -> None:
    widths = [max(map(len, col)) for col in zip(columns, *cells, strict=True)]

    def line(row: list[str]) -> str:
        return "  ".join(v.ljust(w) if name in _LEFT else v.rjust(w)
                         for name, v, w in zip(columns, row, widths, strict=True)).rstrip()

    write_lines([line(columns), "  ".join("-" * w for w in widths), *map(line, cells)])


def write_lines(lines: list[str]) -> None:
    """Prints ``lines`` to stdout, a line a write: one large write that the reader's exit cut
    short raised no error, and the command exited 0 with its output cut. A reader that went
    away (``casstore show URL --json | head``) exits as SIGPIPE would (141)."""
    try:
        for text in lines:
            console.file.write(text + "\n")
        console.file.flush()
    except BrokenPipeError:
        console.on_broken_pipe()


def _printable(text: str) -> str:
    """``text`` with control characters (a key path may hold any but NUL) escaped as Python
    does (``\n``, ``\x1b``): one row a line, and nothing the terminal would act on."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


def ratio(logical: int, stored: int) -> str:
    return f"{logical / stored:.1f}x" if stored else "-"


class Meter:
    """Progress that a library call reports as ``meter(done, total)`` (bytes)."""

    def __init__(self) -> None:
        self.done, self.total = 0, None

    def __call__(self, done: int, total: int | None) -> None:
        self.done, self.total = done, total

    def state(self) -> tuple[int, int | None]:
        return self.done, self.total


class StoreMeter:
    """Progress as the bytes a ``casstore.store.CountingStore`` moved (no total)."""

    def __init__(self, count: Callable[[], int]) -> None:
        self.count, self.start = count, count()

    def state(self) -> tuple[int, int | None]:
        return self.count() - self.start, None


def progress(label: str, work: Callable[[], Any], meter: Any = None) -> Any:
    """Runs ``work()``; on a terminal shows a bar of ``meter.state()`` (done, total bytes)."""
    if not console.is_terminal:
        return work()
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = work()
        except BaseException as e:  # re-raised in the main thread below
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    columns = [SpinnerColumn(), TextColumn(label), BarColumn(),
               TextColumn("{task.fields[done]}"), TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(label, total=None, done="")
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if meter is not None:
                n, total = meter.state()
                of_total = "" if total is None else f" of {human(total)}"
                bar.update(task, total=total, completed=min(n, total or n),
                           done=human(n) + of_total)
    if "error" in result:
        raise result["error"]
    return result["value"]


def say(*objects: Any, **kwargs: Any) -> None:
    """Prints to the console (``console.print``; tests may swap ``console``)."""
    console.print(*objects, **kwargs)
