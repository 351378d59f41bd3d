"""The PNG of the report: the per-step training curves, one row of panels per task."""

from __future__ import annotations

from pathlib import Path

from .results import num as _num
from .results import runs_of

# the per-step curves of the plot: (metrics key, title, log scale)
CURVES = (("reward_mean", "training reward (mean over the step's samples)", False),
          ("accuracy", "training accuracy (fraction of samples correct)", False),
          ("kl", "token KL to the anchor (the recipe's estimator)", True),
          ("entropy", "token entropy of the policy on its samples", False),
          ("clip_frac", "clip fraction (tokens the trust region masks)", False),
          ("response_len", "mean response length (tokens)", False))


def make_plot(res: dict, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    st = res["settings"]
    tasks = st["tasks"]
    cols = 3
    rows_per_task = -(-len(CURVES) // cols)
    fig, axes = plt.subplots(rows_per_task * len(tasks), cols, figsize=(5.5 * cols, 3.6 * rows_per_task * len(tasks)),
                             squeeze=False)
    cmap = plt.get_cmap("tab10")
    for j, task in enumerate(tasks):
        for c, (key, label, log) in enumerate(CURVES):
            ax = axes[j * rows_per_task + c // cols][c % cols]
            for i, recipe in enumerate(st["recipes"]):
                col = cmap(i % 10)
                curves = []
                for r in runs_of(res, task, recipe):
                    if r.get("status") != "ok":
                        continue
                    pts = [(s["step"], s[key]) for s in r.get("steps", [])
                           if s.get("step", 0) > 0 and _num(s.get(key)) is not None]
                    if pts:
                        xs, ys = zip(*pts)
                        ax.plot(xs, ys, color=col, lw=0.8, alpha=0.35)
                        curves.append(dict(pts))
                if not curves:
                    continue
                steps = sorted(set().union(*curves))
                ys = [[cv[s] for cv in curves if s in cv] for s in steps]
                mean = [sum(v) / len(v) for v in ys]
                ax.fill_between(steps, [min(v) for v in ys], [max(v) for v in ys], color=col, alpha=0.12, lw=0)
                seeds = f"{len(curves)} seed" + ("s" if len(curves) != 1 else "")
                ax.plot(steps, mean, color=col, lw=2, marker="o", ms=3, label=f"{recipe} ({seeds})")
            if log and ax.has_data():
                ax.set_yscale("symlog", linthresh=1e-4)
            ax.set_title(f"{task}: {label}", fontsize=10)
            ax.set_xlabel("trainer step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if c == 0 and ax.has_data():
                ax.legend(fontsize=8)
    fig.suptitle("Thick: mean over seeds; band: min-max over seeds; thin: each seed", fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png
