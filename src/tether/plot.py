"""Training curves of one or more runs, overlaid: reward, accuracy, KL, entropy, clip fraction, length; for
SFT runs (``tether sft``: no reward in their metrics) loss, validation loss, LR, grad norm, tokens."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence, Union

from .errors import OutputError, RunError
from .metrics import read_metrics
from .userio import claim_output_file, image_metadata, slug

PANELS = [  # (title, metric keys tried in order)
    ("reward", ["reward_mean"]),
    ("accuracy", ["accuracy"]),
    ("KL to anchor (estimator)", ["kl", "exact_kl_sample"]),
    ("entropy", ["entropy"]),
    ("clip fraction", ["clip_frac"]),
    ("response length", ["response_len"]),
]
SFT_PANELS = [  # runs of tether sft
    ("training loss (NLL per trained token)", ["loss"]),
    ("validation loss", ["val_loss"]),
    ("learning rate", ["lr"]),
    ("grad norm", ["grad_norm"]),
    ("trained tokens per step", ["train_tokens"]),
    ("tokens per second", ["tokens_per_s"]),
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


def plot_path(out: Union[str, Path], formats) -> Path:
    """The file ``tether plot --out OUT`` writes: ``OUT/curves.png`` when OUT is an existing directory
    (or is written with a trailing slash: a directory to create); OUT itself when its suffix is an
    image format matplotlib writes (``formats``: .png, .pdf, .svg, ...); otherwise OUT with ``.png``
    appended (``cmp`` -> ``cmp.png``, as matplotlib would name it, and ``run.v2`` -> ``run.v2.png``)."""
    text = os.fspath(out)
    p = Path(text)
    if p.is_dir() or text.endswith(("/", os.sep)):
        return p / "curves.png"
    if p.suffix[1:].lower() in formats:
        return p
    return p.with_name(p.name + ".png")


def default_plot_out(runs: Sequence[Union[str, Path]]) -> Path:
    """Where ``tether plot`` writes without ``--out``: one run's own ``RUN/curves.png``; an overlay of several runs
    goes to ``curves_<A>_vs_<B>....png`` in the current directory (the runs' directory names, `tether.userio.slug`,
    cut to 120 characters), never into a run, whose curves.png shows that run alone."""
    if len(runs) == 1:
        return Path(runs[0]) / "curves.png"
    names = "_vs_".join(slug(Path(r).resolve().name) for r in runs)
    return Path(f"curves_{names[:120]}.png")


PLOT_KIND = "plot"  # the mark of an image `tether plot` wrote (`tether.userio.image_metadata`)


def _legacy(p: Path) -> bool:
    """An image written before plots carried tether's mark (2026-12-05): a run directory's own curves.png."""
    return p.name == "curves.png" and (p.parent / "config.yaml").is_file() and (p.parent / "metrics.jsonl").is_file()


def claim_plot_path(path: Path) -> Path:
    """``path`` checked before anything is drawn (`tether.userio.claim_output_file`): absent, or an image tether
    plotted there; its directory writable."""
    return claim_output_file(path, PLOT_KIND, legacy=_legacy)


def _save(fig, path: Path) -> None:
    """Write the figure to ``path`` through a temporary file and a rename (never half an image), marked as
    tether's; an OSError (a full or read-only filesystem) is an `OutputError` naming ``path``."""
    fmt = path.suffix[1:].lower()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=100, format=fmt, metadata=image_metadata(fmt, PLOT_KIND) or None)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        why = (e.strerror or str(e)) if e.errno else str(e)
        raise OutputError(f"cannot write the plot to {path}: {why}") from None


def plot_runs(run_dirs: Sequence[Path], out: Union[str, Path], smooth: int = 1) -> Path:
    """Write an image with one panel per curve and one line per run (``smooth`` = moving-average
    window); returns the path written, which `plot_path` derives from ``out``.

    Raises:
        RunError: a run directory or its metrics.jsonl cannot be read.
        OutputError: the image cannot be written there (the path is named).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    out = plot_path(out, FigureCanvasAgg.get_supported_filetypes())
    runs = [(Path(d), _metrics(Path(d))) for d in run_dirs]  # first: a missing run is named, not created
    try:
        claim_plot_path(out)
    except OutputError as e:
        raise OutputError(f"cannot write the plot to {out}: {e}") from None
    rl = any("reward_mean" in r for _, rows in runs for r in rows)  # else all are SFT runs (or have no rows)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, keys) in zip(axes.flat, PANELS if rl else SFT_PANELS):
        for d, rows in runs:
            key = next((k for k in keys if any(k in r for r in rows)), None)
            if key is None:
                continue
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if not pts:
                continue
            xs, ys = zip(*pts)
            if smooth > 1:
                ys = [sum(ys[max(0, i - smooth + 1):i + 1]) / len(ys[max(0, i - smooth + 1):i + 1])
                      for i in range(len(ys))]
            ax.plot(xs, ys, label=d.name if key == keys[0] else f"{d.name} ({key})")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    try:
        _save(fig, out)
    finally:
        plt.close(fig)
    return out
