"""Commands that look: ``ls``, ``show``, ``du``, ``diff``, ``cat``. They read manifests only,
and on a damaged repository show the healthy rest and exit 1."""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import click

import casstore

from ._app import (
    STEP,
    check_options,
    check_run,
    command,
    json_flag,
    no_repository,
    open_repo,
    parse_options,
    report_damage,
    run_option,
    step_of,
    storage_options,
    where,
)
from ._output import emit_json, human, ratio, rows_of, say, table


def problem_json(p: Any) -> dict:
    return {**dataclasses.asdict(p), "text": str(p)}


def _time(created: float) -> str:
    """``created`` in local time; in UTC where local time would pass the year 9999 (a reader
    takes any time below 10000-01-01 UTC, format.md §4.1)."""
    try:
        return datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, ValueError, OSError):
        return datetime.datetime.fromtimestamp(created, datetime.UTC).strftime(
            "%Y-%m-%d %H:%M:%S UTC")


def _persistent_option(f: Any) -> Any:
    f = click.option("-p", "--persistent-option", "persistent_options", multiple=True,
                     metavar="KEY=VALUE", callback=parse_options,
                     help="Storage option of the --persistent tier (repeatable), as -o.")(f)
    return click.option("--persistent", "persistent", default=None, metavar="URL",
                        help="A persistent tier (CheckpointManager(persistent=...)): also list "
                        "its steps and say where each step lives (local, persistent, both).")(f)


def _tiers(url: str, options: dict, persistent: str | None, persistent_options: dict
           ) -> tuple[list, list, dict]:
    """(manifests in repository order, damaged problems, (run, step) -> where) over ``url``
    and, given, the ``persistent`` tier (either but not both may be no repository yet: a
    replaced node's empty local tier, a tier nothing was persisted to)."""
    local_store = open_repo(url, options, create=persistent is not None)
    local = casstore.scan_manifests(local_store)
    if persistent is None:
        return list(local.manifests), list(local.damaged), {}
    check_options(persistent, persistent_options)
    remote_store = casstore.open_store(persistent, **persistent_options)
    if not casstore.is_repository(remote_store):
        if not casstore.is_repository(local_store):
            raise no_repository(f"{url} + {persistent}")
        click.echo(f"casstore: note: no casstore repository at {persistent!r} yet (nothing "
                   "persisted there, or a mistyped URL): its tier is listed as empty", err=True)
    remote = casstore.scan_manifests(remote_store)
    where_: dict = {}  # the tiers holding an intact copy; a damaged one only elsewhere
    for tier, scan in (("local", local), ("persistent", remote)):
        for x in scan.manifests:
            key = (x.run, x.step)
            where_[key] = "both" if where_.get(key, tier) != tier else tier
    for tier, scan in (("local", local), ("persistent", remote)):
        for x in scan.damaged:
            where_.setdefault((x.run, x.step), tier)
    mine = {(m.run, m.step) for m in local.manifests}
    manifests = sorted([*local.manifests, *(m for m in remote.manifests
                                            if (m.run, m.step) not in mine)],
                       key=lambda m: (m.created, m.run, m.step))
    damaged = {(p.run, p.step): p for p in [*remote.damaged, *local.damaged]}  # once a step
    return manifests, list(damaged.values()), where_


@command("ls")
@click.argument("url")
@click.option("--run", default=None, help="Only this run (default: all runs).")
@_persistent_option
@storage_options
@json_flag
def ls_command(url: str, run: str | None, persistent: str | None, persistent_options: dict,
               options: dict, as_json: bool) -> None:
    """Lists the steps of every run, with the bytes each step added and shared.

    ADDED is stored bytes of chunks no earlier step references (in the order steps were
    written, across runs); SHARED is the stored bytes of its chunks that earlier steps hold.
    A damaged manifest is a row marked "damaged" (exit 1), one of a newer format "newer
    format" (exit 14 if nothing is damaged). With --persistent URL the steps of
    both tiers are listed (ADDED and SHARED over both), and WHERE says where each lives: local,
    persistent or both; a persistent URL with no repository yet is listed as empty, with a
    note on stderr.

    \b
    Examples:
      casstore ls ./ckpt --run default
      casstore ls s3://bucket/ckpt -o endpoint_url=http://127.0.0.1:9000 --json
      casstore ls ./ckpt --persistent s3://bucket/ckpt -p endpoint_url=http://127.0.0.1:9000
    """
    manifests, damaged, tier = _tiers(url, options, persistent, persistent_options)
    if run is not None and run not in {m.run for m in manifests}:
        check_run(open_repo(url, options), url, run)
    sizes = casstore.object_sizes(manifests, open_repo(url, options, create=True))  # as listed
    rows = [u for u in casstore.step_usage(manifests, sizes) if run in (None, u.run)]
    damaged = [p for p in damaged if run in (None, p.run)]
    if as_json:
        steps = rows_of(rows)
        if persistent is not None:
            for row in steps:
                row["where"] = tier[row["run"], row["step"]]
        emit_json({"url": url, **({"persistent": persistent} if persistent else {}),
                   "steps": steps, "problems": [problem_json(p) for p in damaged]})
    else:
        runs = {u.run for u in rows} | {p.run for p in damaged}
        extra = ["where"] if persistent is not None else []
        newer = sum(p.kind == "unsupported" for p in damaged)  # not damage: upgrade
        intact = {(u.run, u.step) for u in rows}  # a step damaged on one tier only: one row
        only = [p for p in damaged if (p.run, p.step) not in intact]
        table(f"{url}{f' + {persistent}' if persistent else ''}: {len(runs)} run(s), "
              f"{len(rows) + len(only)} step(s)" + (
                  f", {len(damaged) - newer} damaged" if len(damaged) > newer else "") + (
                  f", {newer} of a newer format" if newer else ""),
              ["run", "step", "time", "leaves", "logical", "added", "shared", *extra],
              [[u.run, u.step, _time(u.created), u.leaves, human(u.logical_bytes),
                human(u.added_bytes), human(u.shared_bytes)]
               + [tier[u.run, u.step] for _ in extra] for u in rows]
              + [[p.run, p.step, "newer format" if p.kind == "unsupported" else "damaged",
                  "-", "-", "-", "-"]
                 + [tier.get((p.run, p.step), "-") for _ in extra] for p in only])
    report_damage(damaged, as_json)


@command("show")
@click.argument("url")
@click.argument("step", type=STEP)
@run_option
@storage_options
@json_flag
def show_command(url: str, step: int | str, run: str, options: dict, as_json: bool) -> None:
    """Shows the leaves of STEP: shape, dtype, sharding, chunks, bytes, sharing.

    SHARED says whether the leaf's chunks are the same as in the run's previous step
    (yes, part, no; - for the first step, or if that step's manifest is damaged).

    \b
    Examples:
      casstore show ./ckpt 100
      casstore show ./ckpt latest --run eval --json
    """
    store = open_repo(url, options)
    check_run(store, url, run)
    step = step_of(store, url, run, step)
    where(url, run, step)
    info = casstore.inspect_step(store, step, run=run)
    for p in info.problems:  # the previous step's manifest
        label = "newer format" if p.kind == "unsupported" else "damaged"
        click.echo(f"casstore: {label}: {p} (sharing unknown)", err=True)
    if as_json:
        emit_json({"run": run, "step": step, "created": info.created,
                   "previous_step": info.previous_step, "leaves": rows_of(info.leaves)})
        return
    table(f"{url} run {run!r} step {step}: {len(info.leaves)} leaves, "
          f"{human(info.logical_bytes)} logical",
          ["key path", "shape", "dtype", "sharding", "chunks", "logical", "stored", "shared"],
          [[x.path, "scalar" if x.kind == "scalar" else tuple(x.shape), x.dtype,
            _sharding_str(x.sharding), "inline" if x.inline else x.chunks,
            human(x.logical_bytes), human(x.stored_bytes), x.shared_with_previous or "-"]
           for x in info.leaves])


def _sharding_str(sharding: Any) -> str:
    if sharding is None:
        return "-"
    mesh = sharding["mesh"]  # checked when the manifest was read (format.md §6.1)
    return f"{','.join(f'{k}={v}' for k, v in mesh.items())} {sharding['spec']}"


@command("du")
@click.argument("url")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Draw bytes added vs reused per step, one series per run (.png or .svg).")
@storage_options
@json_flag
def du_command(url: str, plot_path: str | None, options: dict, as_json: bool) -> None:
    """Logical versus stored bytes: the repository, each run, each step.

    STORED for the repository is every object under chunks/, deltas/ and runs/ as listed;
    UNIQUE is what only that run (or step) references: what deleting it would free after gc.
    du covers every run (it takes no --run).

    \b
    Examples:
      casstore du ./ckpt --plot usage.svg
    """
    from ._plot import plot_usage

    if plot_path and not os.path.isdir(os.path.dirname(plot_path) or "."):  # before the work
        raise click.UsageError(f"--plot {plot_path!r}: its folder does not exist")
    store = open_repo(url, options)
    u = casstore.usage(store)
    if plot_path:
        plot_usage(list(u.steps), plot_path, title=url)
    if as_json:
        emit_json({"url": u.url, "logical_bytes": u.logical_bytes,
                   "stored_bytes": u.stored_bytes, "chunk_bytes": u.chunk_bytes,
                   "manifest_bytes": u.manifest_bytes, "unreferenced_bytes":
                   u.unreferenced_bytes, "dedup_ratio": u.dedup_ratio,
                   "runs": rows_of(u.runs), "steps": rows_of(u.steps),
                   "problems": [problem_json(p) for p in u.problems]})
    else:
        say(f"{url}: {human(u.logical_bytes)} logical in {human(u.stored_bytes)} "
                      f"stored ({ratio(u.logical_bytes, u.stored_bytes)}); chunks "
                      f"{human(u.chunk_bytes)}, manifests {human(u.manifest_bytes)}, "
                      f"unreferenced {human(u.unreferenced_bytes)}")
        table(None, ["run", "steps", "logical", "stored", "dedup", "unique"],
              [[r.run, r.steps, human(r.logical_bytes), human(r.stored_bytes),
                ratio(r.logical_bytes, r.stored_bytes), human(r.unique_bytes)]
               for r in u.runs])
        table(None, ["run", "step", "logical", "added", "shared", "unique"],
              [[s.run, s.step, human(s.logical_bytes), human(s.added_bytes),
                human(s.shared_bytes), human(s.unique_bytes)] for s in u.steps])
        if plot_path:
            say(f"wrote {plot_path}")
    report_damage(list(u.problems), as_json)


@command("diff")
@click.argument("url")
@click.argument("step_a", type=STEP)
@click.argument("step_b", type=STEP)
@run_option
@click.option("--run-b", default=None, help="Run of STEP_B (default: --run).")
@click.option("--all", "show_all", is_flag=True, help="List unchanged key paths too.")
@storage_options
@json_flag
def diff_command(url: str, step_a: int | str, step_b: int | str, run: str, run_b: str | None,
                 show_all: bool, options: dict, as_json: bool) -> None:
    """Key paths changed, added and removed from STEP_A to STEP_B, by chunk ids.

    No chunk data is read. CHANGED is the logical bytes of B's blocks stored in chunks A does
    not hold there (largest first). Small leaves packed together (marked "pack") change
    together.

    \b
    Examples:
      casstore diff ./ckpt 100 latest
      casstore diff ./ckpt 100 100 --run a --run-b b --json
    """
    store = open_repo(url, options)
    run_b = run_b or run
    check_run(store, url, run)
    check_run(store, url, run_b)
    step_a, step_b = step_of(store, url, run, step_a), step_of(store, url, run_b, step_b)
    where(url, run, step_a)
    diffs = casstore.diff_steps(store, step_a, step_b, run=run, run_b=run_b)
    counts = {s: sum(d.status == s for d in diffs)
              for s in ("changed", "added", "removed", "unchanged")}
    changed_bytes = sum(d.changed_bytes for d in diffs)
    shown = [d for d in diffs if show_all or d.status != "unchanged"]
    if as_json:
        emit_json({"a": {"run": run, "step": step_a}, "b": {"run": run_b, "step": step_b},
                   "counts": counts, "changed_bytes": changed_bytes, "leaves": rows_of(shown)})
        return
    table(f"{run}@{step_a} -> {run_b}@{step_b}: " + ", ".join(
        f"{n} {s}" for s, n in counts.items()) + f"; {human(changed_bytes)} differ",
          ["key path", "status", "A", "B", "changed"],
          [[d.path, d.status + (" (pack)" if d.packed and d.status == "changed" else ""),
            human(d.bytes_a), human(d.bytes_b), human(d.changed_bytes)]
           for d in sorted(shown, key=lambda d: -d.changed_bytes)])


@command("cat")
@click.argument("url")
@click.argument("step", type=STEP)
@run_option
@storage_options
def cat_command(url: str, step: int | str, run: str, options: dict) -> None:
    """Prints the decoded manifest of STEP as JSON (format.md §4; bytes as base64).

    Its output is the manifest itself, so it carries no schema_version (format.md
    versions it). Bytes print as {"base64": TEXT}. A map with a key other than str
    (metadata may have int, float, bool, null and bytes keys), or whose one key is
    "base64" or "map", prints as {"map": [[KEY, VALUE], ...]}, each key typed as a
    value is (1 and "1" stay two entries); other maps print as JSON objects.

    \b
    Examples:
      casstore cat ./ckpt 100 | jq '.leaves[0]'
      casstore cat ./ckpt latest | jq '.leaves | length'
    """
    store = open_repo(url, options)
    check_run(store, url, run)
    step = step_of(store, url, run, step)
    where(url, run, step)
    manifest = casstore.read_manifest(store, step, run=run)
    emit_json(casstore.manifest_as_dict(manifest), versioned=False)
