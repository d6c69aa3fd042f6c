"""The main job: the MiniLM fine-tuning example on the real pretrained weights."""

import pathlib
import re
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "finetune_minilm.py"


def run(*args: str) -> str:
    out = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def step_lines(output: str) -> list[tuple[int, float, float]]:
    """(step, logical MB, written MB) of every per-step line."""
    rows = re.findall(r"^\s*(\d+)\s+[\d.]+\s+([\d.]+)\s+([\d.]+)\s+[\d.]+x", output, re.M)
    return [(int(s), float(logical), float(written)) for s, logical, written in rows]


def test_finetune_stores_the_frozen_base_once(tmp_path):
    url = str(tmp_path / "ckpt")
    first = run("--url", url, "--steps", "3")
    rows = step_lines(first)
    assert [r[0] for r in rows] == [0, 1, 2]
    assert rows[0][1] > 100 and rows[0][2] > 80  # the whole 22.7M-parameter state
    for _, _, written in rows[1:]:
        assert written < 0.25 * rows[0][2]  # only the trained layer, its adam state, the head
    assert "restore check: OK" in first
    second = run("--url", url, "--steps", "2", "--run", "other", "--lr", "3e-4")
    assert all(written < 0.25 * rows[0][2] for _, _, written in step_lines(second))
    resumed = run("--url", url, "--steps", "1")
    assert "resumed run 'default' from step 2" in resumed
    assert [r[0] for r in step_lines(resumed)] == [3]
