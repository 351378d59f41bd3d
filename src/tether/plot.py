"""Training curves of one or more runs, overlaid: reward, accuracy, KL, entropy, clip fraction, length."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .errors import RunError
from .metrics import read_metrics

PANELS = [  # (title, metric keys tried in order)
    ("reward", ["reward_mean"]),
    ("accuracy", ["accuracy"]),
    ("KL to anchor (estimator)", ["kl", "exact_kl_sample"]),
    ("entropy", ["entropy"]),
    ("clip fraction", ["clip_frac"]),
    ("response length", ["response_len"]),
]


def _metrics(run_dir: Path) -> list[dict]:
    """The run's metrics rows; RunError naming the directory or file when they cannot be read."""
    if not run_dir.is_dir():
        raise RunError(f"run directory {run_dir} does not exist")
    try:
        return read_metrics(run_dir)
    except FileNotFoundError:
        raise RunError(f"{run_dir} has no metrics.jsonl (is it a tether run directory?)") from None
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise RunError(f"{run_dir / 'metrics.jsonl'}: cannot read the metrics: {e}") from None


def plot_runs(run_dirs: Sequence[Path], out: Path, smooth: int = 1) -> Path:
    """Write a PNG with one panel per curve and one line per run (``smooth`` = moving-average window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(d), _metrics(Path(d))) for d in run_dirs]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for d, rows in runs:
            key = next((k for k in keys if any(k in r for r in rows)), None)
            if key is None:
                continue
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if not pts:
                continue
            xs, ys = zip(*pts)
            if smooth > 1:
                ys = [sum(ys[max(0, i - smooth + 1):i + 1]) / len(ys[max(0, i - smooth + 1):i + 1]) for i in range(len(ys))]
            ax.plot(xs, ys, label=d.name if key == keys[0] else f"{d.name} ({key})")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
