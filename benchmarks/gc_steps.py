"""async_gc.py's part 2: casstore GC of a repository of 50 steps, 40 of them deleted, timed
(dry run and real) and checked to delete exactly the chunks only the deleted steps referenced.
README.md's ``async_gc.py`` section."""

import inspect
import os
import pathlib
import time

import harness as h
import numpy as np

import casstore

GC_STEPS, GC_KEEP = 50, 10
GC_SIZES = {"gpt2": (64, 128 * 1024, 256, 16), "tiny": (8, 32 * 1024, 16, 2)}  # matrices,
# float32 elements per matrix, bias elements, matrices changed per step
GC_FIGURES = [("seconds", "seconds"), ("manifests", "manifests read"),
              ("chunks", "chunks listed"), ("referenced_chunks", "chunks referenced"),
              ("deleted_chunks", "chunks deleted (dry run: would be)"),
              ("deleted_bytes", "MB freed (dry run: would be)")]
GC_UNITS = {"seconds": "s", "deleted_bytes": "MB"}  # others: counts


def bench_gc(root: pathlib.Path, size: str, drop: bool) -> dict:
    """50 steps, each with some matrices and biases new; deletes 40, times GC and checks it."""
    matrices, elements, bias, changed = GC_SIZES[size]
    rng = np.random.default_rng(0)
    layers = [None] * matrices
    repo, chunk_dir, states = str(root / "gc-repo"), root / "gc-repo" / "chunks", []
    for step in range(GC_STEPS):
        for i in range((step - 1) * changed, step * changed) if step else range(matrices):
            layers[i % matrices] = {"w": rng.standard_normal(elements, dtype=np.float32),
                                    "b": rng.standard_normal(bias, dtype=np.float32)}
        states.append({"layers": list(layers), "step": np.int64(step)})
    build_s = sum(h.seconds(lambda s=s, t=t: casstore.save(repo, s, t))[0]
                  for s, t in enumerate(states))
    refs = {s: casstore.read_manifest(repo, s).chunk_ids() for s in range(len(states))}
    keep, doomed = list(refs)[-GC_KEEP:], list(refs)[:-GC_KEEP]
    live = set().union(*(refs[s] for s in keep))
    garbage = set().union(*(refs[s] for s in doomed)) - live
    garbage_bytes = sum((chunk_dir / c[:2] / c[2:]).stat().st_size for c in garbage)
    chunks_before, bytes_before = h.du(chunk_dir)
    for step in doomed:
        casstore.delete(repo, step)
    young = casstore.gc(repo, dry_run=True)  # default grace period: nothing is old enough
    h.check(young.deleted_chunks == 0 and young.young_unreferenced_chunks == len(garbage), young)
    age_s = 2 * inspect.signature(casstore.gc).parameters["grace_period_s"].default
    for path in chunk_dir.rglob("*"):
        os.utime(path, (time.time() - age_s,) * 2)
    h.settle(drop=drop)
    dry, real = (casstore.gc(repo, grace_period_s=0, dry_run=d) for d in (True, False))
    for info in (dry, real):
        h.check((info.deleted_chunks, info.deleted_bytes) == (len(garbage), garbage_bytes), info)
        h.check(info.manifests == GC_KEEP and info.chunks == chunks_before, info)
        h.check(info.referenced_chunks == len(live) and info.missing_chunks == 0, info)
    chunks_after, bytes_after = h.du(chunk_dir)
    h.check((chunks_after, bytes_after) == (chunks_before - len(garbage),
                                            bytes_before - garbage_bytes), "GC left too much")
    again, report = casstore.gc(repo, grace_period_s=0), casstore.verify(repo)
    h.check(again.deleted_chunks == 0 and report.ok, (again, report.problems))
    h.check(sorted(s for _, s in report.steps_checked) == keep, report.steps_checked)
    for step in keep:
        h.verify_equal(states[step], casstore.restore(repo, step), "gc")
    return {"steps": len(states), "kept_steps": keep, "deleted_steps": len(doomed),
            "state_bytes": h.state_bytes(states[0]), "build_s": build_s,
            "chunks_before": chunks_before, "bytes_before": bytes_before,
            "chunks_after": chunks_after, "bytes_after": bytes_after,
            "young_dry_run_spared": young.young_unreferenced_chunks,
            **{p: {k: getattr(info, k) for k, _ in GC_FIGURES}
               for p, info in (("dry_run", dry), ("gc", real))},
            "second_gc_deleted": again.deleted_chunks, "verify_ok": report.ok,
            "verify_chunks": report.chunks_checked, "verify_s": report.seconds,
            "verify_bytes_read": report.bytes_read, "restored_steps": len(keep)}


def run_gc(args, size: str) -> tuple[list[dict], dict]:
    """:func:`bench_gc` ``args.repeat`` times: (the runs, their medians)."""
    runs = []
    for _ in range(args.repeat):
        with h.scratch(args.dir, "gc") as root:
            runs.append(bench_gc(root, size, args.drop_caches))
    return runs, {**h.medians(runs), **{p: h.medians([g[p] for g in runs])
                                        for p in ("dry_run", "gc")}}


def gc_table(g: dict) -> list[str]:
    """The GC figures (medians: :func:`harness.medians` of :func:`bench_gc`'s) and notes."""
    return [f"GC of a repository of {g['steps']} steps of {g['state_bytes'] / 1e6:.1f} MB "
            f"({g['deleted_steps']} deleted, {len(g['kept_steps'])} kept; built in "
            f"{g['build_s']:.1f} s):", "",
            *h.md_table(["GC figure", "dry run", "gc"], [
                [label, *(h.fmt(g[p][key], GC_UNITS.get(key, "n")) for p in ("dry_run", "gc"))]
                for key, label in GC_FIGURES]), "",
            f"- chunks: {g['chunks_before']:.0f} ({g['bytes_before'] / 1e6:.1f} MB) before GC, "
            f"{g['chunks_after']:.0f} ({g['bytes_after'] / 1e6:.1f} MB) after; a dry run with "
            f"the default grace period spared {g['young_dry_run_spared']:.0f} young "
            f"unreferenced chunks; a second GC deleted {g['second_gc_deleted']:.0f}; verify "
            f"{'ok' if g['verify_ok'] else 'FAILED'} ({g['verify_chunks']:.0f} chunks, "
            f"{g['verify_bytes_read'] / 1e6:.1f} MB read, {g['verify_s']:.2f} s); "
            f"{g['restored_steps']:.0f} remaining steps restored bit-exact"]


