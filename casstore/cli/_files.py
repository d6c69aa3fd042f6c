"""Commands that move a step to and from a tensor file: ``export`` and ``import``."""

from __future__ import annotations

import click

import casstore

from ._app import (
    STEP,
    STEP_NUMBER,
    check_run,
    command,
    counted,
    json_flag,
    open_repo,
    run_option,
    step_of,
    storage_options,
    where,
)
from ._output import StoreMeter, emit_json, human, progress, say


@command("export")
@click.argument("url")
@click.argument("step", type=STEP)
@click.argument("out", type=click.Path(dir_okay=False))
@run_option
@click.option("--paths", multiple=True, help="Key-path prefix to export (repeatable).")
@click.option("--exclude", multiple=True, help="Key-path prefix to leave out (repeatable).")
@click.option("--dtype", default=None,
              help="Cast floating-point leaves to this dtype, e.g. float32 (bfloat16 leaves "
              "into an .npz file).")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@storage_options
@json_flag
def export_command(url: str, step: int | str, out: str, run: str, paths: tuple[str, ...],
                   exclude: tuple[str, ...], dtype: str | None, force: bool, options: dict,
                   as_json: bool) -> None:
    """Writes STEP to a .safetensors or .npz file, one tensor per key path.

    Tensor names are the key paths (format.md §5, e.g. params/layers/[0]/kernel); Python
    number leaves become 0-d arrays; str and bytes leaves are skipped and listed. OUT is
    checked before anything is read. Memory: the selected leaves are held at once.

    \b
    Examples:
      casstore export ./ckpt 100 params.safetensors --paths params
      casstore export ./ckpt latest all.npz --dtype float32 --exclude opt_state
    """
    try:
        casstore.check_export_path(out, force=force)
    except (ValueError, OSError) as e:
        raise click.UsageError(str(e)) from None
    store = counted(open_repo(url, options))
    check_run(store, url, run)
    step = step_of(store, url, run, step)
    where(url, run, step)
    meter = StoreMeter(lambda: store.bytes_read) if hasattr(store, "bytes_read") else None
    info = progress("reading", lambda: casstore.export_tensors(
        store, step, out, run=run, paths=list(paths) or None, exclude=list(exclude) or None,
        dtype=dtype, force=force), meter)
    if as_json:
        emit_json({"path": info.path, "tensors": info.tensors, "nbytes": info.nbytes,
                   "skipped": [{"path": p, "reason": r} for p, r in info.skipped]})
        return
    for path, reason in info.skipped:
        click.echo(f"casstore: skipped {path!r}: {reason}", err=True)
    say(f"wrote {info.tensors} tensors ({human(info.nbytes)}) to {out}" + (
        f"; skipped {len(info.skipped)} leaves" if info.skipped else ""))


@command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.argument("url")
@click.argument("step", type=STEP_NUMBER)
@run_option
@storage_options
@json_flag
def import_command(file: str, url: str, step: int, run: str, options: dict,
                   as_json: bool) -> None:
    """Saves the tensors of a .safetensors or .npz FILE as STEP of a run.

    Names with "/" nest (key paths, format.md §5); others are keys of one flat dict.

    \b
    Examples:
      casstore import model.safetensors ./ckpt 0 --run imported
    """
    store = counted(open_repo(url, options, create=True))
    where(url, run, step)
    meter = StoreMeter(lambda: store.bytes_written) if hasattr(store, "bytes_written") else None
    info = progress("saving", lambda: casstore.import_tensors(file, store, step, run=run),
                    meter)
    if as_json:
        emit_json({"run": run, "step": step, "tensors": info.tensors,
                   "logical_bytes": info.logical_bytes, "written_bytes": info.written_bytes})
        return
    say(f"saved {info.tensors} tensors ({human(info.logical_bytes)}) as run {run!r} "
                  f"step {step}: {human(info.written_bytes)} written")
