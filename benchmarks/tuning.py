"""casstore's settings side by side: chunk size, codec and zstd level, workers (docs/tuning.md).

README.md's ``tuning.py`` section describes every figure."""

import functools
import os
import pathlib
import sys

import casstore

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness as h

VARIANTS = {  # name -> casstore.save / restore keyword arguments
    "default": {}, "chunk 4 MiB": {"chunk_size_bytes": 4 << 20},
    "chunk 64 MiB": {"chunk_size_bytes": 64 << 20}, "compression bytes": {"compression": "bytes"},
    "bytes, zstd 3": {"compression": "bytes", "zstd_level": 3},
    "bytes, zstd 9": {"compression": "bytes", "zstd_level": 9},
    "1 worker": {"max_workers": 1}, "4 workers": {"max_workers": 4},
    "16 workers": {"max_workers": 16},
}
COLUMNS = [  # (key, header, unit) of the variants' table
    ("save_s", "save (s)", "s"), ("save_cpu_s", "save CPU (s)", "s"),
    ("save_rss_extra_bytes", "save peak extra RSS", "B"), ("stored_bytes", "stored", "B"),
    ("objects", "chunk objects", "n"), ("changed_save_s", "changed save (s)", "s"),
    ("changed_written_bytes", "changed save writes", "B"), ("restore_s", "restore (s)", "s"),
    ("restore_cpu_s", "restore CPU (s)", "s"),
    ("restore_rss_extra_bytes", "restore peak extra RSS", "B"),
]
LIMITED = [("save_s", "save"), ("changed_save_s", "changed save"), ("restore_s", "restore")]


def bench(name: str, root: pathlib.Path, states: list, drop: bool, warm: int) -> dict:
    """One variant's save, changed save, restore (checked bit-exact) and the default's exports."""
    options, out, repo = VARIANTS[name], {}, str(root / "repo")
    phase = functools.partial(h.phase, out, warm=warm, drop=drop)
    phase("save_s", lambda: casstore.save(repo, 1, states[0], **options),
          rss="save_rss_extra_bytes")
    out["objects"], out["stored_bytes"] = h.du(root / "repo" / "chunks")
    info = phase("changed_save_s", lambda: casstore.save(repo, 2, states[1], **options))
    out["changed_written_bytes"] = info.written_bytes
    workers = {k: v for k, v in options.items() if k == "max_workers"}
    restored = phase("restore_s", lambda: casstore.restore(repo, 2, **workers),
                     rss="restore_rss_extra_bytes")
    h.verify_equal(states[1], restored, name)
    del restored
    for kind in ("safetensors", "npz") if name == "default" else ():
        path = root / f"step2.{kind}"
        phase(f"export_{kind}_s", lambda p=path: casstore.export_tensors(repo, 2, p),
              rss=f"export_{kind}_rss_extra_bytes")
        out[f"export_{kind}_file_bytes"] = os.path.getsize(path)
    return out


def run(args) -> dict:
    """Every variant ``args.repeat`` times (rotating), the limit once per repeat."""
    states, result = h.two_states("tiny" if args.tiny else "gpt2")
    logical = result["logical_bytes"]
    warm = 0 if args.no_warm else 3 * logical

    runs, res, lim = h.limit.interleaved(args, logical, tuple(VARIANTS), lambda name, root: bench(
        name, root, states, args.drop_caches, warm))
    dropped, d = all(r["dropped_caches"] for rs in runs.values() for r in rs), res["default"]
    limits = {  # every variant judged by what the default stores
        "save_s": h.limit.save_s(lim, logical, d["stored_bytes"]),
        "changed_save_s": h.limit.save_s(lim, result["changed_raw_bytes"],
                                         d["changed_written_bytes"]),
        "restore_s": h.limit.restore_s(lim, logical, d["stored_bytes"],
                                       cold=dropped and lim["read_cold"])}
    return {**result, "repeat": args.repeat, "variants": VARIANTS, "results": res, "runs": runs,
            "dropped_caches": dropped, "limit": lim, "limits": limits, "fractions": {
                name: {k: h.ratio(v, r[k]) for k, v in limits.items()} for name, r in res.items()}}


def table(result: dict) -> list[str]:
    """The medians: a row per variant with its fractions of the limit, the limit, then the
    default's exports."""
    res, d, frac = result["results"], result["results"]["default"], result["fractions"]
    return [*h.md_table(["variant", *(c for _, c, _ in COLUMNS),
                         *(f"limit / {label}" for _, label in LIMITED)], [
        [name, *(h.fmt(res[name][k], unit) for k, _, unit in COLUMNS),
         *(h.fmt(frac[name][k], "x") for k, _ in LIMITED)] for name in res]), "",
        "- machine's limit (s), every variant judged by what the default stores: " + ", ".join(
            f"{label} {h.fmt(result['limits'][k], 's')}" for k, label in LIMITED),
        *h.limit_lines(result["limit"]), "",
        *h.md_table(["export of step 2 (default variant)", "s", "peak extra RSS", "file"], [
            [kind, *(h.fmt(d[f"export_{kind}_{k}"], unit) for k, unit in (
                ("s", "s"), ("rss_extra_bytes", "B"), ("file_bytes", "B")))]
            for kind in ("safetensors", "npz")]), "",
        f"- state: {result['logical_bytes'] / 1e6:.1f} MB in {result['leaves']} leaves "
        f"({result['size']}, numpy); median of {result['repeat']} run(s); restores verified "
        f"bit-exact; page cache dropped before each phase: {h.yes(result['dropped_caches'])}"]


main = h.command(__doc__, run, table, "dir", "repeat", "tiny", "drop-caches", "no-warm")

if __name__ == "__main__":
    main()
