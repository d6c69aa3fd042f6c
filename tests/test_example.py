"""The main job: the MiniLM fine-tuning example on the real pretrained weights."""

import contextlib
import functools
import importlib.util
import io
import itertools
import pathlib
import re

import jax
import numpy as np

import casstore
from casstore._compression import PLANES, choose
from casstore.store import LocalStore

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "finetune_minilm.py"


@functools.cache
def example():
    """The example's module, imported from its file once per test process. Its ``main`` runs
    here rather than in a fresh interpreter (4 runs in this file: each one started python,
    imported jax and compiled the encoder, about 5 of its 9 s); test_tiers.py runs the script
    as a user does, in its own interpreter."""
    spec = importlib.util.spec_from_file_location("example_finetune_minilm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(*args: str) -> str:
    """The example's output; batches of 8 (its default is 32): what is checked is what each
    step stores, which does not depend on the batch, and a batch of 8 trains 4x faster."""
    if "--batch-size" not in args:
        args = (*args, "--batch-size", "8")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = example().main(list(args))
    assert code == 0, out.getvalue()[-3000:] + err.getvalue()[-3000:]
    return out.getvalue()


def step_rows(output: str) -> list[tuple[int, float, float, float, int]]:
    """(step, logical MB, written MB, MB without deltas, delta chunks) of every per-step line."""
    rows = re.findall(r"^\s*(\d+)\s+[\d.]+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+[\d.]+x",
                      output, re.M)
    return [(int(s), float(logical), float(written), float(whole), int(deltas))
            for s, logical, written, whole, deltas in rows]


def step_lines(output: str) -> list[tuple[int, float, float]]:
    """(step, logical MB, written MB) of every per-step line."""
    return [row[:3] for row in step_rows(output)]


def test_finetune_stores_the_frozen_base_once(tmp_path):
    url = str(tmp_path / "ckpt")
    first = run("--url", url, "--steps", "2")
    rows = step_lines(first)
    assert [r[0] for r in rows] == [0, 1]
    assert rows[0][1] > 100
    assert rows[0][2] > 80
    for _, _, written in rows[1:]:
        assert written < 0.25 * rows[0][2]  # only the trained layer, its adam state, the head
    assert "restore check: OK" in first
    # another run's first step stores the base no more: the default run's chunks hold it
    second = run("--url", url, "--steps", "1", "--run", "other", "--lr", "3e-4")
    assert [(r[0], r[2] < 0.25 * rows[0][2]) for r in step_lines(second)] == [(0, True)]
    resumed = run("--url", url, "--steps", "1")
    assert "resumed run 'default' from step 1" in resumed
    assert [r[0] for r in step_lines(resumed)] == [2]


def test_full_finetune_changes_every_leaf_and_stores_deltas(tmp_path):
    url = str(tmp_path / "ckpt")
    out = run("--url", url, "--steps", "3", "--full", "--lr", "1e-4", "--batch-size", "8")
    rows = step_rows(out)
    assert [r[0] for r in rows] == [0, 1, 2]
    assert "frozen check" not in out  # nothing is frozen
    assert "restore check: OK (step 2 restored bit-exact" in out
    assert re.search(r"MB without deltas\)", out)
    assert rows[0][1] > 250  # params + adam mu and nu, all 22.7M parameters trained
    assert rows[0][4] == 0  # the run's first step has no previous step to take a delta from
    # Whole chunks are byte planes where the cores outpace the local disk (4 cores or more,
    # docs/tuning.md), else raw: the bytes plus chunk framing.
    planes = choose("auto", LocalStore.write_bytes_per_s, LocalStore.read_bytes_per_s) is PLANES
    for _, logical, written, whole, deltas in rows[1:]:
        assert deltas > 0
        assert written < 0.8 * whole
        assert whole < 0.8 * logical if planes else whole <= 1.01 * logical

    # Every float leaf (params, adam mu and nu of every layer and the head) changed each step.
    steps = [jax.tree_util.tree_leaves_with_path(casstore.restore(url, n)) for n in (0, 1, 2)]
    for before, after in itertools.pairwise(steps):
        floats = [(jax.tree_util.keystr(p), a, b) for (p, a), (_, b) in zip(before, after)
                  if a.dtype == np.float32]
        assert len(floats) == 3 * 103  # params, mu and nu of 6 layers, embeddings and head
        assert [k for k, a, b in floats if a.tobytes() == b.tobytes()] == []
    # Step 2's deltas are taken against chunks an earlier step stored whole (a chunk ref's
    # base, format.md §3.5): a delta's base is its previous block's chunk or that one's base.
    whole = {r.id for n in (0, 1) for leaf in casstore.read_manifest(url, n).leaves
             for r in leaf.chunks if r.base is None}
    bases = [r.base for leaf in casstore.read_manifest(url, 2).leaves for r in leaf.chunks
             if r.base is not None]
    assert bases
    assert set(bases) <= whole
