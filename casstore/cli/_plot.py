"""``casstore du --plot``: bytes each step added and reused, one series per run."""

from __future__ import annotations

import pathlib
from typing import Any

import click


def plot_usage(steps: list, path: str, *, title: str = "") -> Any:
    """Draws per step (x) the stored bytes it added (top) and reused (bottom), one line per run.

    Args:
      steps: :class:`casstore.StepUsage` rows (``casstore.usage(url).steps``).
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
        if steps:  # an empty repository has no run to name
            axes[0].legend(title="run")
        fig.suptitle(title, fontsize=10)
        fig.savefig(path, dpi=100, metadata={"Date": None} if suffix == ".svg" else None)
    plt.close(fig)
    return fig
