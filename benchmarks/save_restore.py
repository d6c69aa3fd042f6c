"""casstore vs orbax-checkpoint vs safetensors: save and restore a GPT-2-small train state.

The state is GPT-2-small-shaped (124M float32 parameters, plus adam mu and nu and a step count:
about 1.49 GB), random values, no download. Every system writes to local disk with fsync, in
the same run, and each figure is reported in seconds or bytes and as a ratio to orbax:

1. first save;
2. a second save in which the embeddings and the first 10 blocks (params and their adam
   moments) are unchanged, and the last 2 blocks, ``ln_f`` and the count changed;
3. a save of the unchanged state;
4. a restore (checked bit-exact against the saved state, outside the timed region);

plus the peak extra host memory (RSS) of casstore's first save and of its restore.

    python benchmarks/save_restore.py [--dir DIR] [--repeat N] [--tiny] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc as pygc
import json
import os
import pathlib
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import psutil
import zstandard

import casstore

SIZES = {"gpt2": dict(vocab=50257, ctx=1024, width=768, blocks=12),
         "tiny": dict(vocab=1000, ctx=64, width=32, blocks=12)}
FROZEN_BLOCKS = 10


def gpt2_params(rng: np.random.Generator, vocab: int, ctx: int, width: int,
                blocks: int) -> dict:
    """GPT-2 parameter shapes (Radford et al. 2019; HF ``GPT2LMHeadModel`` naming)."""

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    def block() -> dict:
        return {"ln_1": {"g": np.ones(width, np.float32), "b": normal(width)},
                "attn": {"c_attn": {"w": normal(width, 3 * width), "b": normal(3 * width)},
                         "c_proj": {"w": normal(width, width), "b": normal(width)}},
                "ln_2": {"g": np.ones(width, np.float32), "b": normal(width)},
                "mlp": {"c_fc": {"w": normal(width, 4 * width), "b": normal(4 * width)},
                        "c_proj": {"w": normal(4 * width, width), "b": normal(width)}}}

    return {"wte": normal(vocab, width), "wpe": normal(ctx, width),
            "h": [block() for _ in range(blocks)],
            "ln_f": {"g": np.ones(width, np.float32), "b": normal(width)}}


def train_state(size: str, seed: int) -> dict:
    """params plus adam mu and nu (random, like a state mid-training) and the step count."""
    rng = np.random.default_rng(seed)
    shape = SIZES[size]
    return {"params": gpt2_params(rng, **shape), "mu": gpt2_params(rng, **shape),
            "nu": jax.tree.map(np.abs, gpt2_params(rng, **shape)), "count": np.int32(1000)}


def changed_state(state: dict, seed: int) -> dict:
    """``state`` with the last blocks, ln_f (params, mu, nu) and the count replaced."""
    rng = np.random.default_rng(seed)
    out = {"count": np.int32(state["count"] + 1)}
    for part in ("params", "mu", "nu"):
        tree = dict(state[part])
        tree["h"] = list(tree["h"])
        for i in range(FROZEN_BLOCKS, len(tree["h"])):
            tree["h"][i] = jax.tree.map(lambda x: x + rng.standard_normal(
                x.shape, dtype=np.float32) * np.float32(1e-3), tree["h"][i])
        tree["ln_f"] = jax.tree.map(lambda x: x + np.float32(1e-3), tree["ln_f"])
        out[part] = tree
    return out


def changed_compressed_bytes(old: dict, new: dict) -> int:
    """zstd (level 1) size of the leaves that differ between two states."""
    level1 = zstandard.ZstdCompressor(level=1)
    total = 0
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
        if np.asarray(a).tobytes() != np.asarray(b).tobytes():
            total += len(level1.compress(np.ascontiguousarray(b).tobytes()))
    return total


class PeakRss:
    """Samples this process's RSS every 5 ms; ``extra`` is peak minus the starting RSS."""

    def __enter__(self) -> PeakRss:
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.extra = self.peak - self.base


def du(path: pathlib.Path) -> int:
    """Bytes of all files under ``path``."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_caches() -> bool:
    """Drops the OS page cache so restores read from disk (needs root); returns whether it did."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_path(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def as_jax(tree: dict) -> dict:
    return jax.tree.map(jax.device_put, tree)


def assert_equal(expected: dict, got: Any, system: str) -> None:
    e, g = jax.tree.leaves(expected), jax.tree.leaves(got)
    assert len(e) == len(g), system
    for a, b in zip(e, g):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"{system} restore differs"


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


# -- the three systems: each returns {figure: value} -----------------------------------------

def bench_casstore(root: pathlib.Path, states: list[dict], abstract: Any, drop: bool) -> dict:
    repo = root / "casstore"
    out: dict[str, float] = {}
    with PeakRss() as rss:
        out["first_save_s"], info = timed(lambda: casstore.save(repo, 1, states[0]))
    out["first_save_bytes"], out["save_rss_extra_bytes"] = info.written_bytes, rss.extra
    out["changed_save_s"], info = timed(lambda: casstore.save(repo, 2, states[1]))
    out["changed_save_bytes"] = info.written_bytes
    out["unchanged_save_s"], info = timed(lambda: casstore.save(repo, 3, states[1]))
    out["unchanged_save_bytes"] = info.written_bytes
    out["repo_bytes"] = du(repo)
    drop and drop_caches()
    with PeakRss() as rss:
        out["restore_s"], restored = timed(lambda: jax.block_until_ready(
            casstore.restore(repo, 3, target=abstract)))
    out["restore_rss_extra_bytes"] = rss.extra
    assert_equal(states[1], restored, "casstore")
    return out


def bench_orbax(root: pathlib.Path, states: list[dict], abstract: Any, drop: bool) -> dict:
    import orbax.checkpoint as ocp
    out: dict[str, float] = {}
    with ocp.StandardCheckpointer() as ckptr:
        def save(step: int, state: dict) -> int:
            path = root / "orbax" / str(step)
            ckptr.save(path, state)
            ckptr.wait_until_finished()
            return du(path)

        out["first_save_s"], out["first_save_bytes"] = timed(lambda: save(1, states[0]))
        out["changed_save_s"], out["changed_save_bytes"] = timed(lambda: save(2, states[1]))
        out["unchanged_save_s"], out["unchanged_save_bytes"] = timed(lambda: save(3, states[1]))
        out["repo_bytes"] = du(root / "orbax")
        drop and drop_caches()
        out["restore_s"], restored = timed(lambda: jax.block_until_ready(
            ckptr.restore(root / "orbax" / "3", abstract)))
    assert_equal(states[1], restored, "orbax")
    return out


def bench_safetensors(root: pathlib.Path, states: list[dict], drop: bool) -> dict:
    from safetensors.numpy import load_file, save_file
    (root / "safetensors").mkdir()
    out: dict[str, float] = {}

    def save(step: int, state: dict) -> int:
        path = root / "safetensors" / f"{step}.safetensors"
        flat = {jax.tree_util.keystr(k): np.asarray(v)
                for k, v in jax.tree_util.tree_leaves_with_path(state)}
        save_file(flat, str(path))
        fsync_path(path)
        fsync_path(path.parent)
        return du(path)

    out["first_save_s"], out["first_save_bytes"] = timed(lambda: save(1, states[0]))
    out["changed_save_s"], out["changed_save_bytes"] = timed(lambda: save(2, states[1]))
    out["unchanged_save_s"], out["unchanged_save_bytes"] = timed(lambda: save(3, states[1]))
    out["repo_bytes"] = du(root / "safetensors")
    drop and drop_caches()
    out["restore_s"], flat = timed(lambda: load_file(str(root / "safetensors" / "3.safetensors")))
    keys = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(states[1])]
    assert_equal(states[1], [flat[k] for k in keys], "safetensors")
    return out


FIGURES = ["first_save_s", "first_save_bytes", "changed_save_s", "changed_save_bytes",
           "unchanged_save_s", "unchanged_save_bytes", "restore_s", "repo_bytes"]


def run(size: str = "gpt2", base_dir: str | None = None, repeat: int = 1,
        drop: bool = False) -> dict:
    """Runs every system ``repeat`` times; returns median figures per system and targets."""
    np_states = [train_state(size, 0)]
    np_states.append(changed_state(np_states[0], 1))
    logical = sum(x.nbytes for x in jax.tree.leaves(np_states[0]))
    changed = changed_compressed_bytes(np_states[0], np_states[1])
    runs: dict[str, list[dict]] = {"casstore": [], "orbax": [], "safetensors": []}
    for _ in range(repeat):
        for system in runs:
            root = pathlib.Path(tempfile.mkdtemp(prefix=f"bench-{system}-", dir=base_dir))
            try:
                pygc.collect()
                if system == "safetensors":
                    runs[system].append(bench_safetensors(root, np_states, drop))
                else:
                    states = jax.block_until_ready([as_jax(s) for s in np_states])
                    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                            states[1])
                    fn = bench_casstore if system == "casstore" else bench_orbax
                    runs[system].append(fn(root, states, abstract, drop))
                    del states
            finally:
                shutil.rmtree(root, ignore_errors=True)
    medians = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for s, rs in runs.items()}
    return {"size": size, "logical_bytes": logical, "changed_compressed_bytes": changed,
            "repeat": repeat, "dropped_caches": drop and drop_caches(),
            "load": os.getloadavg(), "results": medians}


def table(result: dict) -> str:
    """The results as a markdown table, with casstore/orbax ratios."""
    res = result["results"]
    lines = ["| figure | casstore | orbax | safetensors | casstore / orbax |",
             "|---|---:|---:|---:|---:|"]
    for fig in FIGURES:
        unit = "s" if fig.endswith("_s") else "MB"
        scale = 1 if unit == "s" else 1e6
        vals = [res[s][fig] / scale for s in ("casstore", "orbax", "safetensors")]
        ratio = vals[0] / vals[1] if vals[1] else float("nan")
        fmt = "{:.3f}" if unit == "s" else "{:.2f}"
        lines.append(f"| {fig.removesuffix('_s').removesuffix('_bytes')} ({unit}) | "
                     + " | ".join(fmt.format(v) for v in vals) + f" | {ratio:.3f} |")
    c = res["casstore"]
    changed = result["changed_compressed_bytes"]
    lines += ["", f"- logical state: {result['logical_bytes'] / 1e6:.1f} MB; changed leaves "
              f"zstd-compressed: {changed / 1e6:.2f} MB; casstore's changed save wrote "
              f"{c['changed_save_bytes'] / changed:.3f}x that",
              f"- casstore peak extra RSS: save {c['save_rss_extra_bytes'] / 1e6:.1f} MB, restore "
              f"{c['restore_rss_extra_bytes'] / 1e6:.1f} MB (the restored state itself is "
              f"{result['logical_bytes'] / 1e6:.0f} MB)",
              f"- page cache dropped before restores: {result['dropped_caches']}; load average "
              f"{result['load'][0]:.2f}; median of {result['repeat']} run(s)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="a tiny state, for the smoke test")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache (root)")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    result = run("tiny" if args.tiny else "gpt2", args.dir, args.repeat, args.drop_caches)
    print(table(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
