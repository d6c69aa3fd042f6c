"""The ``casstore`` command line: look into, check, clean, copy, export and import repositories.

Every command takes a repository URL (a path, ``s3://``, ``gs://`` or any fsspec URL) and
``-o KEY=VALUE`` storage options for fsspec; s3fs and gcsfs also read their usual credential and
endpoint environment variables. Read commands print rich tables, or JSON with ``--json``.
Progress bars appear only when stdout is a terminal. Exit codes: 0 ok, 1 a check failed
(``verify`` found problems), 2 a usage or input error, printed as one line (``--debug`` shows the
traceback). restic's command line is the model.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import json
import pathlib
import re
import threading
from collections.abc import Callable
from typing import Any

import click
import msgpack
from rich.console import Console
from rich.filesize import decimal as human
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

import casstore

from . import _inspect, _tensorfile
from ._keypath import flatten, matches
from ._layout import RUNS_PREFIX
from ._manifest import encode_manifest
from ._repository import check_config, list_chunk_objects
from .store import CountingStore, Store

EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
JSON_SCHEMA_VERSION = 1  # of every --json output; raised when a field changes meaning
console = Console(highlight=False, markup=False, soft_wrap=True)  # key paths hold "[0]"


class _Group(click.Group):
    """Turns any error into one line on stderr and exit code 2, unless ``--debug``."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as e:
            if ctx.params.get("debug"):
                raise
            where = ctx.meta.get("casstore.where", "")
            message = " ".join(str(e).split()) or type(e).__name__
            if not isinstance(e, casstore.CasstoreError):
                message = f"{type(e).__name__}: {message}"
            if where and getattr(e, "url", None) is None:  # casstore errors name their place
                message += f" ({where})"
            click.echo(f"casstore: error: {message}", err=True)
            damaged = (casstore.ManifestError, casstore.CorruptChunkError,
                       casstore.MissingChunkError)
            ctx.exit(EXIT_CHECK_FAILED if isinstance(e, damaged) else EXIT_USAGE)


def _parse_options(ctx, param, values: tuple[str, ...]) -> dict:
    options = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", ctx, param)
        try:  # true, 3, null, {"a": 1} ... as JSON; anything else is a string
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _storage_options(f):
    return click.option("-o", "--storage-option", "options", multiple=True, metavar="KEY=VALUE",
                        callback=_parse_options,
                        help="fsspec storage option for the URL (repeatable), e.g. "
                        "endpoint_url=http://127.0.0.1:9000 or anon=true.")(f)


def _json_flag(f):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(f)


def _run_option(f):
    return click.option("--run", default="default", show_default=True, help="Run name.")(f)


def _open(url: str, options: dict, *, create: bool = False) -> Store:
    """Opens ``url`` with fsspec storage ``options`` and records it for error lines.

    Raises:
      click.UsageError: not a repository (unless ``create``).
      ValueError: storage options given for a local path.
    """
    ctx = click.get_current_context()
    ctx.meta.setdefault("casstore.where", f"url {url!r}")
    store = casstore.open_store(url, **options)
    if not create and not check_config(store):
        raise click.UsageError(f"no casstore repository at {url!r}", ctx)
    return store


def _check_run(store: Store, url: str, run: str | None) -> None:
    """UsageError if ``run`` is given and has no committed step (a typo must not pass)."""
    if run is not None and run not in casstore.list_runs(store):
        raise click.UsageError(f"run {run!r} has no steps in {url!r}")


def _where(url: str, run: str, step: int | None = None) -> None:
    """Names URL, run and step in any error line of this command."""
    where = f"url {url!r}, run {run!r}" + ("" if step is None else f", step {step}")
    click.get_current_context().meta["casstore.where"] = where


def _emit_json(obj: Any, *, versioned: bool = True) -> None:
    """Prints ``obj`` as JSON; a dict gets ``schema_version`` first (JSON_SCHEMA_VERSION)."""
    if versioned and isinstance(obj, dict):
        obj = {"schema_version": JSON_SCHEMA_VERSION, **obj}

    def default(x: Any) -> Any:
        if isinstance(x, bytes):
            return {"base64": base64.b64encode(x).decode()}
        raise TypeError(f"cannot print {type(x).__name__} as JSON")

    click.echo(json.dumps(obj, indent=2, default=default))


def _table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    if title:
        console.print(title, soft_wrap=True)
    table = Table()
    for name in columns:
        table.add_column(name, justify="left" if name in ("run", "key path", "status", "dtype",
                                                         "time", "sharding", "shape") else "right",
                         overflow="fold", no_wrap=name == "time",
                         min_width=24 if name == "key path" else None)
    for row in rows:
        table.add_row(*(str(v) for v in row))
    # a terminal folds the table to its width; a pipe or file gets whole lines
    if not console.is_terminal:
        console.width = max(80, console.measure(
            table, options=console.options.update_width(100_000)).maximum)
    console.print(table)


def _ratio(logical: int, stored: int) -> str:
    return f"{logical / stored:.1f}x" if stored else "-"


class _Meter:
    """Progress of a library call that reports it: ``meter(done, total)`` (bytes)."""

    def __init__(self) -> None:
        self.done, self.total = 0, None

    def __call__(self, done: int, total: int | None) -> None:
        self.done, self.total = done, total

    def state(self) -> tuple[int, int | None]:
        return self.done, self.total


class _StoreMeter:
    """Progress as the bytes a CountingStore read or wrote, out of a known total."""

    def __init__(self, count: Callable[[], int], total: int | None) -> None:
        self.count, self.start, self.total = count, count(), total

    def state(self) -> tuple[int, int | None]:
        return self.count() - self.start, self.total


def _progress(label: str, work: Callable[[], Any], meter: Any = None) -> Any:
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


def _counted(store: Store) -> Store:
    """The store wrapped for progress counting, on a terminal only."""
    return CountingStore(store) if console.is_terminal else store


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show the traceback of an error.")
@click.version_option(casstore.__version__, prog_name="casstore")
def main(debug: bool) -> None:
    """Content-addressed checkpoints: inspect, check and move casstore repositories."""


@main.command("ls")
@click.argument("url")
@click.option("--run", default=None, help="Only this run (default: all runs).")
@_storage_options
@_json_flag
def ls_command(url: str, run: str | None, options: dict, as_json: bool) -> None:
    """Lists the steps of every run, with the bytes each step added and shared.

    ADDED is stored bytes of chunks no earlier step references (in the order steps were
    written, across runs); SHARED is the stored bytes of its chunks that earlier steps hold.
    """
    store = _open(url, options)
    _check_run(store, url, run)
    scan = casstore.scan_manifests(store)
    rows = [u for u in _inspect.step_usage(list(scan.manifests)) if run is None or u.run == run]
    damaged = [p for p in scan.damaged if run is None or p.run == run]
    if as_json:
        _emit_json({"url": url, "steps": [dataclasses.asdict(u) for u in rows],
                    "problems": [_problem_json(p) for p in damaged]})
    else:
        _table(f"{url}: {len({u.run for u in rows} | {p.run for p in damaged})} run(s), "
               f"{len(rows) + len(damaged)} step(s)" + (
                   f", {len(damaged)} damaged" if damaged else ""),
               ["run", "step", "time", "leaves", "logical", "added", "shared"],
               [[u.run, u.step, _time(u.created), u.leaves, human(u.logical_bytes),
                 human(u.added_bytes), human(u.shared_bytes)] for u in rows]
               + [[p.run, p.step, "damaged", "-", "-", "-", "-"] for p in damaged])
    _report_damage(damaged, as_json)


def _problem_json(p: casstore.Problem) -> dict:
    return {**dataclasses.asdict(p), "text": str(p)}


def _report_damage(problems: list[casstore.Problem], as_json: bool) -> None:
    """Names each damaged object on stderr (not in --json mode) and exits 1 if any."""
    if not problems:
        return
    if not as_json:
        for p in problems:
            click.echo(f"casstore: damaged: {p}", err=True)
        click.echo(f"casstore: {len(problems)} damaged object(s); the rest is shown. "
                   "See docs/recovery.md", err=True)
    click.get_current_context().exit(EXIT_CHECK_FAILED)


def _time(created: float) -> str:
    return datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S")


@main.command("show")
@click.argument("url")
@click.argument("step", type=int)
@_run_option
@_storage_options
@_json_flag
def show_command(url: str, step: int, run: str, options: dict, as_json: bool) -> None:
    """Shows the leaves of STEP: shape, dtype, sharding, chunks, bytes, sharing.

    SHARED says whether the leaf's chunks are the same as in the run's previous step
    (yes, part, no; - for the first step).
    """
    store = _open(url, options)
    _where(url, run, step)
    manifest = casstore.read_manifest(store, step, run=run)
    earlier = [s for s in casstore.list_steps(store, run=run) if s < step]
    shared = {}
    previous = _read_or_none(store, earlier[-1], run) if earlier else None
    if previous is not None:
        shared = {d.path: "no" if d.status == "added" else "yes" if d.status == "unchanged"
                  else "part" if d.changed_bytes < d.bytes_b else "no"
                  for d in _inspect.diff_manifests(previous, manifest)}
    rows = [{"path": leaf.path, "kind": leaf.kind, "shape": list(leaf.shape),
             "dtype": leaf.dtype or leaf.scalar_type, "sharding": leaf.sharding,
             "chunks": len({r.id for r in leaf.chunks}), "logical_bytes": leaf.nbytes,
             "stored_bytes": _inspect.leaf_stored_bytes(leaf),
             "inline": leaf.inline is not None, "shared_with_previous": shared.get(leaf.path)}
            for leaf in manifest.leaves]
    if as_json:
        _emit_json({"run": run, "step": step, "created": manifest.created,
                    "previous_step": earlier[-1] if earlier else None, "leaves": rows})
        return
    _table(f"{url} run {run!r} step {step}: {len(rows)} leaves, "
           f"{human(manifest.logical_bytes)} logical",
           ["key path", "shape", "dtype", "sharding", "chunks", "logical", "stored", "shared"],
           [[r["path"], "scalar" if r["kind"] == "scalar" else tuple(r["shape"]), r["dtype"],
             _sharding_str(r["sharding"]), "inline" if r["inline"] else r["chunks"],
             human(r["logical_bytes"]), human(r["stored_bytes"]),
             r["shared_with_previous"] or "-"] for r in rows])


def _read_or_none(store: Store, step: int, run: str) -> casstore.Manifest | None:
    """The manifest, or None (and a warning naming it) if it is damaged."""
    try:
        return casstore.read_manifest(store, step, run=run)
    except casstore.ManifestError as e:
        click.echo(f"casstore: damaged: {e}", err=True)
        return None


def _sharding_str(sharding: Any) -> str:
    if not isinstance(sharding, dict):
        return "-"
    mesh = ",".join(f"{k}={v}" for k, v in sharding.get("mesh", {}).items())
    return f"{mesh} {sharding.get('spec')}"


@main.command("du")
@click.argument("url")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Draw bytes added vs reused per step, one series per run (.png or .svg).")
@_storage_options
@_json_flag
def du_command(url: str, plot_path: str | None, options: dict, as_json: bool) -> None:
    """Logical versus stored bytes: the repository, each run, each step.

    STORED for the repository is every object under chunks/ and runs/ as listed; UNIQUE is
    what only that run (or step) references: what deleting it would free after gc.
    """
    store = _open(url, options)
    scan = casstore.scan_manifests(store)
    manifests = list(scan.manifests)
    steps, runs = _inspect.step_usage(manifests), _inspect.run_usage(manifests)
    listed = {"chunks": 0, "manifests": 0, "unreferenced": 0}
    referenced = _inspect.object_sizes(manifests)
    for info in list_chunk_objects(store):
        listed["chunks"] += info.size
        listed["unreferenced"] += info.size if info.key not in referenced else 0
    listed["manifests"] = sum(info.size for info in store.list(RUNS_PREFIX))
    logical = sum(m.logical_bytes for m in manifests)
    stored = listed["chunks"] + listed["manifests"]
    if plot_path:
        plot_usage(steps, plot_path, title=url)
    report = {"url": store.url, "logical_bytes": logical, "stored_bytes": stored,
              "chunk_bytes": listed["chunks"], "manifest_bytes": listed["manifests"],
              "unreferenced_bytes": listed["unreferenced"],
              "dedup_ratio": logical / stored if stored else None,
              "runs": [dataclasses.asdict(r) for r in runs],
              "steps": [dataclasses.asdict(u) for u in steps],
              "problems": [_problem_json(p) for p in scan.damaged]}
    if as_json:
        _emit_json(report)
        _report_damage(list(scan.damaged), as_json)
        return
    console.print(f"{url}: {human(logical)} logical in {human(stored)} stored "
                  f"({_ratio(logical, stored)}); chunks {human(listed['chunks'])}, manifests "
                  f"{human(listed['manifests'])}, unreferenced {human(listed['unreferenced'])}")
    _table(None, ["run", "steps", "logical", "stored", "dedup", "unique"],
           [[r.run, r.steps, human(r.logical_bytes), human(r.stored_bytes),
             _ratio(r.logical_bytes, r.stored_bytes), human(r.unique_bytes)] for r in runs])
    _table(None, ["run", "step", "logical", "added", "shared", "unique"],
           [[u.run, u.step, human(u.logical_bytes), human(u.added_bytes),
             human(u.shared_bytes), human(u.unique_bytes)] for u in steps])
    if plot_path:
        console.print(f"wrote {plot_path}")
    _report_damage(list(scan.damaged), as_json)


def plot_usage(steps: list[_inspect.StepUsage], path: str, *, title: str = "") -> Any:
    """Draws per step (x) the stored bytes it added (top) and reused (bottom), one line per run.

    Args:
      steps: the usage rows (:func:`casstore._inspect.step_usage`).
      path: a ``.png`` or ``.svg`` file to write; each run's lines have the SVG id
        ``added-<run>`` / ``shared-<run>``.
      title: the figure title.

    Returns:
      The matplotlib Figure.

    Raises:
      click.UsageError: matplotlib is not installed, or ``path`` is not .png or .svg.
    """
    suffix = pathlib.Path(path).suffix.lower()
    if suffix not in (".png", ".svg"):
        raise click.UsageError(f"--plot writes .png or .svg files, not {path!r}")
    try:
        import matplotlib
    except ImportError:
        raise click.UsageError("--plot needs matplotlib: pip install 'casstore[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "casstore"}):
        fig, axes = plt.subplots(2, 1, sharex=True, figsize=(7, 5), layout="constrained")
        for i, run in enumerate(sorted({u.run for u in steps})):
            mine = sorted((u.step, u.added_bytes / 1e6, u.shared_bytes / 1e6)
                          for u in steps if u.run == run)
            style = {"marker": "os^Dv"[i % 5], "linestyle": ["-", "--", ":", "-."][i % 4],
                     "fillstyle": "full" if i % 2 == 0 else "none", "label": run}
            x = [s for s, _, _ in mine]
            axes[0].plot(x, [a for _, a, _ in mine], gid=f"added-{run}", **style)
            axes[1].plot(x, [s for _, _, s in mine], gid=f"shared-{run}", **style)
        axes[0].set_ylabel("MB added")
        axes[0].set_title("stored bytes each step added (new chunks)", fontsize=10)
        axes[1].set_ylabel("MB reused")
        axes[1].set_title("stored bytes each step reused from earlier steps", fontsize=10)
        axes[1].set_xlabel("step")
        for ax in axes:
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[0].legend(title="run")
        fig.suptitle(title, fontsize=10)
        fig.savefig(path, dpi=100, metadata={"Date": None} if suffix == ".svg" else None)
    plt.close(fig)
    return fig


@main.command("diff")
@click.argument("url")
@click.argument("step_a", type=int)
@click.argument("step_b", type=int)
@_run_option
@click.option("--run-b", default=None, help="Run of STEP_B (default: --run).")
@click.option("--all", "show_all", is_flag=True, help="List unchanged key paths too.")
@_storage_options
@_json_flag
def diff_command(url: str, step_a: int, step_b: int, run: str, run_b: str | None, show_all: bool,
                 options: dict, as_json: bool) -> None:
    """Key paths changed, added and removed from STEP_A to STEP_B, by chunk ids.

    No chunk data is read. CHANGED is the logical bytes of B's blocks stored in chunks A does
    not hold there (largest first). Small leaves packed together (marked "pack") change
    together.
    """
    store = _open(url, options)
    run_b = run_b or run
    _where(url, run, step_a)
    a = casstore.read_manifest(store, step_a, run=run)
    _where(url, run_b, step_b)
    b = casstore.read_manifest(store, step_b, run=run_b)
    diffs = _inspect.diff_manifests(a, b)
    counts = {s: sum(d.status == s for d in diffs)
              for s in ("changed", "added", "removed", "unchanged")}
    changed_bytes = sum(d.changed_bytes for d in diffs)
    shown = [d for d in diffs if show_all or d.status != "unchanged"]
    if as_json:
        _emit_json({"a": {"run": run, "step": step_a}, "b": {"run": run_b, "step": step_b},
                    "counts": counts, "changed_bytes": changed_bytes,
                    "leaves": [dataclasses.asdict(d) for d in shown]})
        return
    _table(f"{run}@{step_a} -> {run_b}@{step_b}: " + ", ".join(
        f"{n} {s}" for s, n in counts.items()) + f"; {human(changed_bytes)} differ",
           ["key path", "status", "A", "B", "changed"],
           [[d.path, d.status + (" (pack)" if d.packed and d.status == "changed" else ""),
             human(d.bytes_a), human(d.bytes_b), human(d.changed_bytes)]
            for d in sorted(shown, key=lambda d: -d.changed_bytes)])


@main.command("cat")
@click.argument("url")
@click.argument("step", type=int)
@_run_option
@_storage_options
def cat_command(url: str, step: int, run: str, options: dict) -> None:
    """Prints the decoded manifest of STEP as JSON (format.md §4; bytes as base64)."""
    store = _open(url, options)
    _where(url, run, step)
    manifest = casstore.read_manifest(store, step, run=run)
    _emit_json(msgpack.unpackb(encode_manifest(manifest), raw=False, strict_map_key=False),
               versioned=False)  # the manifest itself, format.md §4


@main.command("verify")
@click.argument("url")
@click.argument("step", type=int, required=False)
@click.option("--run", default=None, help="Only this run (default: all runs).")
@click.option("--read-data/--no-read-data", default=True, show_default=True,
              help="Read and check every chunk, or only that it exists.")
@_storage_options
@_json_flag
def verify_command(url: str, step: int | None, run: str | None, read_data: bool, options: dict,
                   as_json: bool) -> None:
    """Checks that checkpoints restore: manifests valid, chunks present and intact.

    Exits 1 if a problem is found.
    """
    store = _open(url, options)
    _check_run(store, url, run)
    meter = _Meter()
    report = _progress("verifying", lambda: casstore.verify(
        store, step, run=run, read_data=read_data, progress=meter), meter)
    if as_json:
        _emit_json({"ok": report.ok, **dataclasses.asdict(report),
                    "problems": [_problem_json(p) for p in report.problems]})
    else:
        for p in report.problems:
            console.print(f"problem: {p.kind}: {p}", style="red")
        console.print(f"{'ok' if report.ok else f'{len(report.problems)} problem(s)'}: "
                      f"{len(report.steps_checked)} step(s), {report.chunks_checked} chunks "
                      f"({report.chunks_ok} ok, {report.chunks_missing} missing, "
                      f"{report.chunks_corrupt} corrupt, {report.chunks_unchecked} unchecked), "
                      f"{report.manifests_damaged} damaged manifest(s); "
                      f"{human(report.bytes_read)} read in {report.seconds:.1f} s")
    if not report.ok:
        click.get_current_context().exit(EXIT_CHECK_FAILED)


def _bytes_read(store: Store, total: int | None = None) -> _StoreMeter | None:
    return _StoreMeter(lambda: store.bytes_read, total) if isinstance(
        store, CountingStore) else None


def _bytes_written(store: Store, total: int | None = None) -> _StoreMeter | None:
    return _StoreMeter(lambda: store.bytes_written, total) if isinstance(
        store, CountingStore) else None


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)")


def _parse_duration(ctx, param, value: str) -> float:
    m = _DURATION.fullmatch(value.strip())
    if not m:
        raise click.BadParameter(f"{value!r} is not a duration like 90s, 30m, 1h or 2d", ctx,
                                 param)
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


@main.command("gc")
@click.argument("url")
@click.option("--dry-run", is_flag=True, help="Report what would be deleted; delete nothing.")
@click.option("--grace-period", default="1h", show_default=True, callback=_parse_duration,
              help="Spare unreferenced chunks younger than this (s, m, h, d).")
@_storage_options
@_json_flag
def gc_command(url: str, dry_run: bool, grace_period: float, options: dict,
               as_json: bool) -> None:
    """Deletes chunks no step of any run references (after the grace period)."""
    store = _open(url, options)
    info = _progress("collecting garbage", lambda: casstore.gc(
        store, grace_period_s=grace_period, dry_run=dry_run))
    if as_json:
        _emit_json(dataclasses.asdict(info))
        if info.damaged_manifests:
            click.get_current_context().exit(EXIT_CHECK_FAILED)
        return
    verb = "would delete" if dry_run else "deleted"
    console.print(f"{verb} {info.deleted_chunks} chunks ({human(info.deleted_bytes)}); "
                  f"of {info.chunks} chunks listed, {info.referenced_chunks} referenced by "
                  f"{info.manifests} manifests, {info.young_unreferenced_chunks} unreferenced "
                  f"within the grace period; {info.missing_chunks} referenced but missing")
    if info.damaged_manifests:
        click.echo(f"casstore: damaged: {info.damaged_manifests} manifest(s) unreadable; the "
                   "chunks only they reference count as garbage above, and gc without "
                   "--dry-run refuses to run (see verify, docs/recovery.md)", err=True)
        click.get_current_context().exit(EXIT_CHECK_FAILED)


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _list_option(text: str | None, kind: Callable[[str], Any], name: str) -> list | None:
    """A comma-separated option's items, or None; a UsageError names a bad or empty one."""
    if text is None:
        return None
    try:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.UsageError(f"{name} {text!r} is not a comma-separated list of "
                               f"{'steps (integers)' if kind is int else 'names'}") from None
    if not items:
        raise click.UsageError(f"{name} {text!r} names nothing")
    return items


def _check_selection(store: Store, url: str, runs: list[str] | None,
                     steps: list[int] | None) -> None:
    """UsageError naming every run and step asked for that ``url`` does not hold."""
    have = casstore.list_runs(store)
    unknown = [r for r in runs or [] if r not in have]
    if unknown:
        raise click.UsageError(f"run(s) {', '.join(map(repr, unknown))} have no steps in "
                               f"{url!r} (it has {', '.join(map(repr, have)) or 'none'})")
    held = {s for r in runs or have for s in casstore.list_steps(store, run=r)}
    absent = [s for s in steps or [] if s not in held]
    if absent:
        raise click.UsageError(f"step(s) {', '.join(map(str, absent))} are in no selected run "
                               f"of {url!r}")


@main.command("copy")
@click.argument("src")
@click.argument("dst")
@click.option("--steps", help="Comma-separated steps to copy (default: all).")
@click.option("--runs", help="Comma-separated runs to copy (default: all).")
@_storage_options
@click.option("-O", "--dst-storage-option", "dst_options", multiple=True, metavar="KEY=VALUE",
              callback=_parse_options,
              help="Storage option for DST only (default: -o's). Local paths take none.")
@_json_flag
def copy_command(src: str, dst: str, steps: str | None, runs: str | None, options: dict,
                 dst_options: dict, as_json: bool) -> None:
    """Copies steps from SRC to DST, sending only the chunks DST lacks."""
    source = _open(src, {} if _is_local(src) else options)
    step_list = _list_option(steps, int, "--steps")
    run_list = _list_option(runs, str, "--runs")
    _check_selection(source, src, run_list, step_list)  # before DST is touched
    dst_options = dst_options or options
    target = _counted(_open(dst, {} if _is_local(dst) else dst_options, create=True))
    click.get_current_context().meta["casstore.where"] = f"from {src!r} to {dst!r}"
    wanted = [m for m in casstore.scan_manifests(source, runs=run_list).manifests
              if step_list is None or m.step in step_list]  # a total from what reads
    present = {i.key for i in list_chunk_objects(target)}
    total = sum(n for k, n in _inspect.object_sizes(wanted).items() if k not in present)
    info = _progress("copying", lambda: casstore.copy(source, target, steps=step_list,
                                                      runs=run_list),
                     _bytes_written(target, total))
    if as_json:
        _emit_json(dataclasses.asdict(info))
        return
    console.print(f"copied {len(info.steps_copied)} step(s), {info.chunks_copied} chunks "
                  f"({human(info.bytes_copied)}); {len(info.steps_skipped)} step(s) and "
                  f"{info.chunks_skipped} chunks were already there; {info.seconds:.1f} s")


@main.command("rm")
@click.argument("url")
@click.argument("steps", type=int, nargs=-1, required=True)
@_run_option
@click.option("--dry-run", is_flag=True, help="Name the steps that would be deleted; delete "
              "nothing.")
@_storage_options
@_json_flag
def rm_command(url: str, steps: tuple[int, ...], run: str, dry_run: bool, options: dict,
               as_json: bool) -> None:
    """Deletes STEPS of a run (their manifests); gc reclaims chunks no step uses.

    Every step is checked first: if one is missing, nothing is deleted.
    """
    store = _open(url, options)
    _where(url, run)
    have = set(casstore.list_steps(store, run=run))
    absent = [s for s in dict.fromkeys(steps) if s not in have]
    if absent:
        raise click.UsageError(f"step(s) {', '.join(map(str, absent))} not in run {run!r} of "
                               f"{url!r}; nothing deleted")
    for step in dict.fromkeys(steps):
        if not dry_run:
            _where(url, run, step)
            casstore.delete(store, step, run=run)
        if not as_json:
            console.print(f"{'would delete' if dry_run else 'deleted'} run {run!r} step {step}")
    if as_json:
        _emit_json({"run": run, "steps": list(dict.fromkeys(steps)), "dry_run": dry_run})


@main.command("export")
@click.argument("url")
@click.argument("step", type=int)
@click.argument("out", type=click.Path(dir_okay=False))
@_run_option
@click.option("--paths", multiple=True, help="Key-path prefix to export (repeatable).")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@_storage_options
def export_command(url: str, step: int, out: str, run: str, paths: tuple[str, ...],
                   force: bool, options: dict) -> None:
    """Writes STEP to a .safetensors or .npz file, one tensor per key path.

    Tensor names are the key paths (format.md §5, e.g. params/layers/[0]/kernel); Python
    number leaves become 0-d arrays.
    """
    fmt = _tensorfile.file_format(out)
    _check_output(out, force)
    store = _counted(_open(url, options))
    _where(url, run, step)
    manifest = casstore.read_manifest(store, step, run=run)
    selected = [leaf for leaf in manifest.leaves if matches(leaf.path, list(paths) or None)]
    if not selected:
        raise click.UsageError(f"no key path of step {step} starts with {list(paths)}")
    total = sum(_inspect.leaf_stored_bytes(leaf) for leaf in selected)
    tree = _progress("reading", lambda: casstore.restore(
        store, step, run=run, paths=list(paths) or None), _bytes_read(store, total))
    flat = flatten(tree)[1]
    if [p for p, _ in flat] != [leaf.path for leaf in selected]:
        raise casstore.CasstoreError("restored leaves do not match the manifest's key paths")
    arrays = {p: _tensorfile.file_array(p, v, fmt) for p, v in flat}
    _tensorfile.write_tensors(out, arrays, fmt, {"run": run, "step": step})
    console.print(f"wrote {len(arrays)} tensors ({human(sum(a.nbytes for a in arrays.values()))})"
                  f" to {out}")


def _check_output(out: str, force: bool) -> None:
    """UsageError, before any read, if OUT's directory is missing or OUT exists (no --force)."""
    path = pathlib.Path(out).expanduser()
    if not path.parent.is_dir():
        raise click.UsageError(f"the directory of {out!r} does not exist; create it first")
    if path.exists() and not force:
        raise click.UsageError(f"{out!r} exists; pass --force to overwrite it")


@main.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.argument("url")
@click.argument("step", type=int)
@_run_option
@_storage_options
@_json_flag
def import_command(file: str, url: str, step: int, run: str, options: dict,
                   as_json: bool) -> None:
    """Saves the tensors of a .safetensors or .npz FILE as STEP of a run.

    Names with "/" nest (key paths, format.md §5); others are keys of one flat dict.
    """
    tensors = _tensorfile.read_tensors(file)
    store = _counted(_open(url, options, create=True))
    _where(url, run, step)
    info = _progress("saving", lambda: casstore.save(store, step, _tensorfile.tree_of(tensors),
                                                        run=run),
                     _bytes_written(store))
    if as_json:
        _emit_json({"run": run, "step": step, "tensors": len(tensors),
                    "logical_bytes": info.logical_bytes, "written_bytes": info.written_bytes})
        return
    console.print(f"saved {len(tensors)} tensors ({human(info.logical_bytes)}) as run {run!r} "
                  f"step {step}: {human(info.written_bytes)} written")


if __name__ == "__main__":  # pragma: no cover
    main(prog_name="casstore")
