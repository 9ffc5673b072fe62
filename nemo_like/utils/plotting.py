"""Reward/accuracy curves as a PNG (CLI) or a matplotlib figure (notebooks)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

DEFAULT_CURVES = ("train/reward_mean", "val/accuracy")


def plot_metrics(history: Sequence[dict], keys: Sequence[str] = DEFAULT_CURVES):
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg",) and not _in_notebook():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = [(h["step"], h[key]) for h in history if key in h and h[key] is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, linewidth=1.5)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def save_training_curves(history: Sequence[dict], path: str | Path, keys: Sequence[str] = DEFAULT_CURVES) -> Path:
    import matplotlib.pyplot as plt

    fig = plot_metrics(history, keys)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None and "IPKernelApp" in get_ipython().config
    except Exception:
        return False
