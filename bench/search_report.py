"""The closed-pool search-agent results: curves of the training runs and dev EM before/after.

Reads run directories (``metrics.jsonl``) and ``tether eval --agent search`` output directories
(``results.json``), writes one PNG with four panels per metric (exact match, answered rate,
invalid-action rate, searches per response; one line per run) and prints Markdown tables:
the per-step curves and the dev metrics of each evaluation.

Usage::

    python bench/search_report.py --runs grpo=RUN_A ema_pg=RUN_B \\
        --evals initial=EVAL_0 grpo=EVAL_A ema_pg=EVAL_B --out docs/results_search.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CURVES = [("accuracy", "exact match (train samples)"), ("search/answered_rate", "answered rate"),
          ("search/invalid_action_rate", "invalid-action rate (per turn)"),
          ("search/searches", "searches per response")]
DEV = [("search/em", "EM"), ("search/f1", "F1"), ("search/answered_rate", "answered"), ("search/searches", "searches"),
       ("search/gold_recall", "gold recall")]


def _pairs(items: list[str], flag: str) -> dict[str, Path]:
    out = {}
    for it in items:
        name, sep, path = it.partition("=")
        if not sep:
            raise SystemExit(f"{flag} takes NAME=PATH, got {it!r}")
        out[name] = Path(path)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="NAME=RUN_DIR of each training run")
    p.add_argument("--evals", nargs="*", default=[], help="NAME=EVAL_OUT of each tether eval --agent search")
    p.add_argument("--out", required=True, help="PNG of the curves")
    a = p.parse_args(argv)
    runs = {k: [json.loads(x) for x in (v / "metrics.jsonl").read_text().splitlines() if x.strip()]
            for k, v in _pairs(a.runs, "--runs").items()}

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.2))
    for ax, (key, title) in zip(axes, CURVES):
        for name, rows in runs.items():
            ax.plot([r["step"] for r in rows], [r.get(key, float("nan")) for r in rows], marker="o", ms=3, label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"curves: {a.out}\n")

    for name, rows in runs.items():
        print(f"### {name}: {len(rows)} steps, {sum(r['time_step_s'] for r in rows) / 60:.1f} min of steps\n")
        print("| step | reward | EM | answered | invalid/turn | searches | turns | obs tokens | s/step |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['step']} | {r['reward_mean']:.3f} | {r['accuracy']:.3f} | {r['search/answered_rate']:.2f} | "
                  f"{r['search/invalid_action_rate']:.2f} | {r['search/searches']:.2f} | {r['search/turns']:.2f} | "
                  f"{r['search/obs_tokens']:.0f} | {r['time_step_s']:.0f} |")
        print()
    if a.evals:
        print("| model | problems | " + " | ".join(t for _, t in DEV) + " |")
        print("| --- | --- | " + " | ".join("---" for _ in DEV) + " |")
        for name, d in _pairs(a.evals, "--evals").items():
            res = json.loads((d / "results.json").read_text())
            for bench, b in res["benchmarks"].items():
                m = b["metrics"]
                cells = [f"{100 * m[k]:.1f}" if k != "search/searches" else f"{m[k]:.2f}" for k, _ in DEV]
                print(f"| {name} ({bench}) | {int(m['n_problems'])} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
