"""Commands that check or change a repository: ``verify``, ``gc``, ``rm``, ``copy``. Each
checks all its inputs before it changes anything."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import click

import casstore

from ._app import (
    EXIT_NEWER,
    EXIT_PROBLEMS,
    STEP,
    STEP_NUMBER,
    check_run,
    command,
    counted,
    json_flag,
    no_repository,
    open_repo,
    pair_options,
    parse_options,
    problems_exit,
    run_option,
    step_number,
    step_of,
    storage_options,
    where,
)
from ._output import Meter, StoreMeter, emit_json, human, progress, rows_of, say
from ._read import problem_json


@command("verify")
@click.argument("url")
@click.argument("step", type=STEP, required=False)
@click.option("--run", default=None,
              help="Only this run (default: all runs; with STEP, run 'default').")
@click.option("--read-data/--no-read-data", default=True, show_default=True,
              help="Read and check every chunk, or only that it exists.")
@storage_options
@json_flag
def verify_command(url: str, step: int | str | None, run: str | None, read_data: bool,
                   options: dict, as_json: bool) -> None:
    """Checks that checkpoints restore: manifests valid, chunks present and intact.

    Each damaged manifest or object is one problem, with the steps that need it: "missing"
    (the object is gone), "corrupt" (its bytes fail their checks), "manifest" (it does not
    read); "config" if the repository's config object is damaged, or missing where steps
    exist (every reader refuses the repository; its steps are checked all the same). Exits 1
    if a problem is found; docs/recovery.md says what to do.

    \b
    Examples:
      casstore verify ./ckpt
      casstore verify ./ckpt 100 --no-read-data
      casstore verify ./ckpt latest --run eval
    """
    store = open_repo(url, options, damaged=True)
    run = "default" if step is not None and run is None else run
    try:  # a damaged or missing config object: the report says so
        sound = casstore.is_repository(store)
    except casstore.ManifestError:
        sound = False
    if sound:
        check_run(store, url, run)
    if step is not None:
        step = step_of(store, url, run, step)
    where(url, run, step)
    meter = Meter()
    report = progress("verifying", lambda: casstore.verify(
        store, step, run=run, read_data=read_data, progress=meter), meter)
    kinds = {p.kind for p in report.problems}
    if "not found" in kinds and "config" not in kinds and not sound:
        raise no_repository(url)  # no config object and no step: no repository (exit 10)
    if step is not None and "config" not in kinds and "not found" in kinds:
        steps = casstore.list_steps(store, run=run)  # a typo is no damage: exit 2, not 1
        raise click.UsageError(f"step {step} of run {run!r} does not exist in {url!r} (steps: "
                               f"{', '.join(map(str, steps[-10:])) or 'none'})")
    if as_json:
        emit_json({"ok": report.ok, **dict(rows_of([report])[0].items()),
                   "problems": [problem_json(p) for p in report.problems]})
    else:
        for p in report.problems:
            say(f"problem: {p.kind}: {p}", style="red")
        say(f"{'ok' if report.ok else f'{len(report.problems)} problem(s)'}: "
                      f"{len(report.steps_checked)} step(s), {report.chunks_checked} chunks "
                      f"({report.chunks_ok} ok, {report.chunks_missing} missing, "
                      f"{report.chunks_corrupt} corrupt, {report.chunks_unsupported} unsupported, "
                      f"{report.chunks_unchecked} unchecked), "
                      f"{report.manifests_damaged} damaged manifest(s), "
                      f"{report.manifests_unsupported} of a newer format; "
                      f"{human(report.bytes_read)} read in {report.seconds:.1f} s")
    if not report.ok:
        click.get_current_context().exit(problems_exit(report.problems))


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)")


def parse_duration(ctx: Any, param: Any, value: str) -> float:
    m = _DURATION.fullmatch(value.strip())
    if not m:
        raise click.BadParameter(f"{value!r} is not a duration like 90s, 30m, 1h or 2d", ctx,
                                 param)
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


@command("gc")
@click.argument("url")
@click.option("--dry-run", is_flag=True, help="Report what would be deleted; delete nothing.")
@click.option("--grace-period", default="1h", show_default=True, callback=parse_duration,
              help="Spare unreferenced chunks younger than this (s, m, h, d).")
@click.option("--lock-timeout", default="10m", show_default=True, callback=parse_duration,
              help="Wait this long for saves in flight (their locks) before giving up.")
@storage_options
@json_flag
def gc_command(url: str, dry_run: bool, grace_period: float, lock_timeout: float,
               options: dict, as_json: bool) -> None:
    """Deletes chunks no step of any run references (after the grace period).

    gc covers every run (it takes no --run). With a damaged manifest it refuses to delete
    anything (exit 1); --dry-run still reports. A chunk referenced but missing exits 1 too.

    \b
    Examples:
      casstore gc ./ckpt --dry-run --grace-period 0
    """
    store = open_repo(url, options)
    info = progress("collecting garbage", lambda: casstore.gc(
        store, grace_period_s=grace_period, dry_run=dry_run, lock_timeout_s=lock_timeout))
    if as_json:
        emit_json(rows_of([info])[0])
    else:
        verb = "would delete" if dry_run else "deleted"
        say(f"{verb} {info.deleted_chunks} chunks ({human(info.deleted_bytes)}); "
                      f"of {info.chunks} chunks listed, {info.referenced_chunks} referenced by "
                      f"{info.manifests} manifests, {info.young_unreferenced_chunks} "
                      "unreferenced within the grace period; "
                      f"{info.missing_chunks} referenced but missing")
    if info.damaged_manifests and not as_json:
        click.echo(f"casstore: {info.damaged_manifests} manifest(s) unreadable (damaged, or "
                   "of a newer format); chunks only they reference count as garbage above, "
                   "and gc without --dry-run refuses to run (see verify)", err=True)
    if info.missing_chunks and not as_json:
        click.echo(f"casstore: damaged: {info.missing_chunks} chunk object(s) referenced but "
                   "missing (see verify, docs/recovery.md)", err=True)
    if info.damaged_manifests > info.newer_manifests or info.missing_chunks:
        click.get_current_context().exit(EXIT_PROBLEMS)
    if info.newer_manifests:
        click.get_current_context().exit(EXIT_NEWER)


def list_option(given: tuple[str, ...], kind: Callable[[str], Any], name: str) -> list | None:
    """The items of a comma-separated option given any number of times, or None; a
    UsageError names a bad or empty one."""
    if not given:
        return None
    text = ",".join(given)
    try:
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.UsageError(f"{name} {text!r} is not a comma-separated list of "
                               f"{'steps' if kind is step_number else 'names'}") from None
    if not items:
        raise click.UsageError(f"{name} {text!r} names nothing")
    return items


def check_selection(store: Any, url: str, runs: list[str] | None,
                    steps: list[int] | None) -> None:
    """UsageError naming every run and step asked for that ``url`` does not hold."""
    have = casstore.list_runs(store)
    unknown = [r for r in runs or [] if r not in have]
    if unknown:
        raise click.UsageError(f"run(s) {', '.join(map(repr, unknown))} have no steps in "
                               f"{url!r} (runs: {', '.join(map(repr, have)) or 'none'})")
    held = {s for r in runs or have for s in casstore.list_steps(store, run=r)}
    absent = [s for s in steps or [] if s not in held]
    if absent:
        raise click.UsageError(f"step(s) {', '.join(map(str, absent))} are in no selected run "
                               f"of {url!r}")


@command("copy")
@click.argument("src")
@click.argument("dst")
@click.option("--steps", multiple=True,
              help="Comma-separated steps to copy (default: all); may be repeated.")
@click.option("--runs", multiple=True,
              help="Comma-separated runs to copy (default: all); may be repeated.")
@click.option("--verify", is_flag=True,
              help="Decode every object and check its chunk id before writing it (reads each "
                   "object here, also between two paths of one S3 or GCS service).")
@storage_options
@click.option("-O", "--dst-storage-option", "dst_options", multiple=True, metavar="KEY=VALUE",
              callback=parse_options,
              help="Storage option for DST only (default: -o's). Local paths take none.")
@json_flag
def copy_command(src: str, dst: str, steps: tuple[str, ...], runs: tuple[str, ...], verify: bool,
                 options: dict, dst_options: dict, as_json: bool) -> None:
    """Copies steps from SRC to DST, sending only the chunks DST lacks.

    Runs and steps are checked in SRC before DST is touched. A step of SRC whose manifest
    is damaged is not copied; name the steps to copy around it. Between two paths of one S3
    or GCS service the service copies the objects itself, unless --verify.

    \b
    Examples:
      casstore copy ./ckpt s3://bucket/ckpt --runs default --steps 100,200
    """
    src_options, dst_options = pair_options(src, dst, options, dst_options)
    source = open_repo(src, src_options)
    step_list = list_option(steps, step_number, "--steps")
    run_list = list_option(runs, str, "--runs")
    check_selection(source, src, run_list, step_list)
    target = counted(open_repo(dst, dst_options, create=True))
    where(f"{src} -> {dst}", None)
    meter = StoreMeter(lambda: target.bytes_written) if hasattr(target, "bytes_written") else None
    try:
        info = progress("copying", lambda: casstore.copy(source, target, steps=step_list,
                                                         runs=run_list, verify=verify), meter)
    except casstore.StepAlreadyExistsError as e:
        e.cli_fix = "to copy the other steps, name them with --steps"
        raise
    if as_json:
        emit_json(rows_of([info])[0])
        return
    say(f"copied {len(info.steps_copied)} step(s), {info.chunks_copied} chunks "
                  f"({human(info.bytes_copied)}); {len(info.steps_skipped)} step(s) and "
                  f"{info.chunks_skipped} chunks were already there; {info.seconds:.1f} s")


@command("rm")
@click.argument("url")
@click.argument("steps", type=STEP_NUMBER, nargs=-1, required=True)
@run_option
@click.option("--dry-run", is_flag=True,
              help="Name the steps that would be deleted; delete nothing.")
@storage_options
@json_flag
def rm_command(url: str, steps: tuple[int, ...], run: str, dry_run: bool, options: dict,
               as_json: bool) -> None:
    """Deletes STEPS of a run (their manifests); gc reclaims chunks no step uses.

    Every step is checked first: if one is missing, nothing is deleted.

    \b
    Examples:
      casstore rm ./ckpt 100 200 --dry-run
    """
    store = open_repo(url, options)
    where(url, run)
    wanted = list(dict.fromkeys(steps))
    have = set(casstore.list_steps(store, run=run))
    absent = [s for s in wanted if s not in have]
    if absent:
        raise click.UsageError(f"step(s) {', '.join(map(str, absent))} not in run {run!r} of "
                               f"{url!r}; nothing deleted")
    for step in wanted:
        if not dry_run:
            where(url, run, step)
            casstore.delete(store, step, run=run)
        if not as_json:
            say(f"{'would delete' if dry_run else 'deleted'} run {run!r} step {step}")
    if as_json:
        emit_json({"run": run, "steps": wanted, "dry_run": dry_run})


@command("repair")
@click.argument("good")
@click.argument("damaged")
@click.option("--dry-run", is_flag=True, help="Show what would be mended; change nothing.")
@click.option("--read-data/--no-read-data", default=True, show_default=True,
              help="Verify DAMAGED by reading every chunk, or only that it exists.")
@storage_options
@click.option("-O", "--dst-storage-option", "dst_options", multiple=True, metavar="KEY=VALUE",
              callback=parse_options, help="Storage option for DAMAGED only (default: -o's).")
@json_flag
def repair_command(good: str, damaged: str, dry_run: bool, read_data: bool, options: dict,
                   dst_options: dict, as_json: bool) -> None:
    """Repairs DAMAGED from GOOD, another copy of the same repository.

    Runs verify on DAMAGED; a damaged or missing config object is replaced by GOOD's; for
    each step that needs a missing or corrupt object, or whose manifest is damaged, GOOD's
    copies of those objects (checked first) and of a damaged manifest are written there. No
    step is deleted; steps GOOD lacks, holds damaged or holds as another step are left alone
    and reported. Exits 1 unless DAMAGED verifies clean afterwards (docs/recovery.md).

    \b
    Examples:
      casstore repair s3://backup/ckpt ./ckpt --dry-run
      casstore repair s3://backup/ckpt ./ckpt
    """
    good_options, damaged_options = pair_options(good, damaged, options, dst_options)
    source = open_repo(good, good_options)
    target = open_repo(damaged, damaged_options, damaged=True)
    where(f"{good} -> {damaged}", None)
    info = progress("repairing", lambda: casstore.repair(source, target, dry_run=dry_run,
                                                         read_data=read_data))
    if {p.kind for p in info.problems} == {"not found"}:  # nothing there: not a repository
        raise no_repository(damaged)
    if as_json:
        emit_json({**rows_of([info])[0], "problems": [problem_json(p) for p in info.problems],
                   "unrepairable": [problem_json(p) for p in info.unrepairable],
                   "why": [{"run": r, "step": s, "why": w}
                           for (r, s), w in sorted(info.why.items())]})
    else:
        verb = "would copy back" if dry_run else "copied back"
        newer = len({p.key for p in info.problems if p.kind == "unsupported"}
                    & set(info.deleted_objects))  # or a damaged header: GOOD's has the data
        say(f"{len(info.problems)} problem(s); {verb} {len(info.steps)} step(s) ("
            + ", ".join(f"{r}@{s}" for r, s in info.steps) + f"), replacing "
            f"{len(info.deleted_objects) - newer} corrupt object(s)"
            + (f" and {newer} this casstore cannot read (GOOD's copy, checked, holds the same "
               "data)" if newer else "") + "; "
            + ("config object from GOOD; " if info.config_restored else "")
            + f"{len(info.unrepairable)} unrepairable; {'ok' if info.ok else 'not ok'}")
        for p in info.unrepairable:
            click.echo(f"casstore: unrepairable: {p.kind}: {p}", err=True)
        for (run, step), why in sorted(info.why.items()):
            click.echo(f"casstore: unrepairable: {run}@{step}: {why}", err=True)
    if not info.ok:  # 14 where all that is left is of a newer format
        click.get_current_context().exit(problems_exit(info.unrepairable or info.problems))
