"""``tether sweep report DIR [DIR...]``: markdown tables, a PNG of the learning curves, and every number in
a JSON file beside them.

What is computed for each arm from its done runs (statistics and their formulas: `tether.sweep.stats`;
runs and metrics: `tether.sweep.results`; definitions for readers: docs/sweeps.md):

* the final value of the metric per seed (an evaluation metric at its last evaluation; a training metric
  averaged over its last ``last_n`` steps), its mean, s.e., sd, the bootstrap 95 % CI of the mean, and the
  IQM with its CI (rliable);
* AUC: each run's curve's mean height over training (trapezoids / span), averaged over seeds, with its s.e.;
* the collapse rate: collapsed runs / (done + failed runs), a run collapsing when it failed, logged a
  non-finite loss or gradient norm, or ended below its own first point by more than ``collapse_drop``;
* for each pair of arms: rliable's probability of improvement with its CI, and the paired difference over
  the seeds both finished (mean, s.e., t-based 95 % CI).

The uncertainty in the tables is the spread across runs. The evaluation's own noise (the binomial s.e. of
one evaluation over its problems) is shown apart, labelled "evaluation noise (policy held fixed)".
"""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from . import layout, stats
from .results import INCOMPLETE, Collected, collect, curve, default_metric, eval_noise, final_value, is_eval, nonfinite


TRAIN_REWARD = "reward_mean"  # the training reward of each step (tether.report.rollout_metrics)


def arm_stats(col: Collected, arm: str, metric: str, *, last_n: int, reps: int, seed: int,
              collapse_drop: float) -> dict:
    """The per-arm numbers of one metric (module docstring)."""
    done = col.of(arm)
    finals = {r.seed: final_value(r, metric, last_n) for r in done}
    finals = {s: v for s, v in finals.items() if v is not None}
    vals = [finals[s] for s in sorted(finals)]
    aucs = {}
    why = {}
    for r in done:
        steps, values = curve(r, metric)
        if values:
            aucs[r.seed] = stats.auc(steps, values)
        reason = stats.collapsed(False, nonfinite(r), values[0] if values else None, finals.get(r.seed),
                                 collapse_drop)
        if reason:
            why[r.seed] = reason
    for r in col.of(arm, layout.FAILED):
        why[r.seed] = stats.collapsed(True, False, None, None)
    counted = len(done) + len(col.of(arm, layout.FAILED))
    noise = [x for x in (eval_noise(r, metric) for r in done) if x is not None]
    return {**stats.summary(vals), "ci": stats.mean_ci(vals, reps, seed), "iqm": stats.iqm_ci(vals, reps, seed),
            "auc": stats.summary(list(aucs.values())), "auc_per_seed": aucs, "per_seed": finals,
            "collapsed": why, "collapse_rate": len(why) / counted if counted else None, "runs_counted": counted,
            "failed": [r.seed for r in col.of(arm, layout.FAILED)],
            "incomplete": [r.seed for r in col.of(arm, INCOMPLETE)],
            "eval_noise": sum(noise) / len(noise) if noise else None}


def pair_stats(per_arm: dict, arms: list[str], *, reps: int, seed: int, baseline: Optional[str]) -> list[dict]:
    """Probability of improvement and paired differences of every pair of arms (each against ``baseline``
    when given): P(A > B), d = A - B."""
    pairs = [(a, baseline) for a in arms if a != baseline] if baseline else list(combinations(arms, 2))
    out = []
    for a, b in pairs:
        x, y = per_arm[a]["per_seed"], per_arm[b]["per_seed"]
        xs, ys = [x[s] for s in sorted(x)], [y[s] for s in sorted(y)]
        out.append({"a": a, "b": b, "poi": stats.probability_of_improvement(xs, ys, reps, seed),
                    "paired": stats.paired_difference(x, y)})
    return out


def compute(col: Collected, metric: str, *, last_n: int = 10, reps: int = 2000, seed: int = 0,
            collapse_drop: float = 0.0, baseline: Optional[str] = None) -> dict:
    """Every number of the report for ``metric``: per arm, per pair, and the curve bands."""
    per_arm = {a: arm_stats(col, a, metric, last_n=last_n, reps=reps, seed=seed, collapse_drop=collapse_drop)
               for a in col.arms}
    bands = {a: stats.band([curve(r, metric) for r in col.of(a)]) for a in col.arms}
    return {"metric": metric, "last_n": None if is_eval(metric) else last_n, "arms": per_arm,
            "pairs": pair_stats(per_arm, col.arms, reps=reps, seed=seed, baseline=baseline), "bands": bands}


def _f(x, digits: int = 4) -> str:
    return "–" if x is None else f"{x:.{digits}g}"


def _ci(t) -> str:
    return "–" if t is None else f"[{_f(t[-2])}, {_f(t[-1])}]"


def _how_final(res: dict) -> str:
    if res["last_n"] is None:
        return "its value at the run's last evaluation"
    return f"its mean over the run's last {res['last_n']} logged steps"


def arm_table(res: dict) -> list[str]:
    m = res["metric"]
    L = [f"### `{m}` per arm", "", f"Final value of a run: {_how_final(res)}. Mean, s.e., sd and the CIs are "
         "across runs (seeds); the CI of the mean and the IQM's CI are rliable stratified-bootstrap 95 % intervals. "
         "AUC: the curve's mean height over training (mean ± s.e. across seeds). Collapse: failed, non-finite loss "
         "or gradient, or final below the run's own first point.", "",
         "| arm | n | mean | s.e. | sd | 95 % CI of mean | IQM [95 % CI] | AUC ± s.e. | collapse | per-seed values |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, a in res["arms"].items():
        per_seed = ", ".join(f"s{s}: {_f(v)}" for s, v in sorted(a["per_seed"].items(), key=lambda kv: int(kv[0])))
        coll = "–" if a["collapse_rate"] is None else f"{len(a['collapsed'])}/{a['runs_counted']}"
        L.append(f"| {arm} | {a['n']} | {_f(a['mean'])} | {_f(a['se'])} | {_f(a['sd'])} | {_ci(a['ci'])} | "
                 f"{_f(a['iqm'][0]) if a['iqm'] else '–'} {_ci(a['iqm'])} | {_f(a['auc']['mean'])} ± "
                 f"{_f(a['auc']['se'])} | {coll} | {per_seed} |")
    return L + [""]


def pair_table(res: dict) -> list[str]:
    if not res["pairs"]:
        return []
    L = [f"### Pairwise comparisons of `{res['metric']}`", "",
         "P(A > B): rliable's probability of improvement (the Mann-Whitney fraction of run pairs where A beats B, "
         "ties counting half) with its bootstrap 95 % CI. Paired difference A − B: over the seeds both arms "
         "finished (same seed: same prompts and initial weights), mean ± s.e. across seeds, t-based 95 % CI.", "",
         "| A | B | P(A > B) [95 % CI] | seeds paired | mean A − B | s.e. | 95 % CI (t) | A − B per seed |",
         "|---|---|---|---|---|---|---|---|"]
    for p in res["pairs"]:
        d = p["paired"]
        per = ", ".join(f"s{s}: {_f(v)}" for s, v in d["diffs"].items())
        L.append(f"| {p['a']} | {p['b']} | {_f(p['poi'][0], 3) if p['poi'] else '–'} {_ci(p['poi'])} | {d['n']} | "
                 f"{_f(d['mean'])} | {_f(d['se'])} | {_ci(d['ci'])} | {per} |")
    return L + [""]


def _problems(col: Collected, res: dict) -> list[str]:
    L = []
    for arm, a in res["arms"].items():
        for s, why in sorted(a["collapsed"].items()):
            if why != "failed":
                L.append(f"- collapsed: {arm} seed {s}: {why}")
    for run in sorted(col.runs.values(), key=lambda r: (r.arm, r.seed)):
        if run.state == layout.FAILED:
            L += [f"- **failed**: {run.arm} seed {run.seed} ({run.path}): {run.record.get('error')}", "",
                  "  ```", *["  " + ln for ln in (run.record.get("stderr_tail") or "").splitlines()[-12:]], "  ```"]
        elif run.state == INCOMPLETE:
            L.append(f"- incomplete (not counted): {run.arm} seed {run.seed} ({run.path})")
    return (["### Failed, collapsed and incomplete runs", "", *L, ""]) if L else []


def _noise(res: dict) -> list[str]:
    rows = [(arm, a["eval_noise"]) for arm, a in res["arms"].items() if a["eval_noise"] is not None]
    if not rows:
        return []
    return ["### Evaluation noise (policy held fixed)", "",
            "The binomial s.e. sqrt(p(1 − p)/N) of one run's final evaluation over its N problems, averaged over "
            "the arm's runs: how much re-drawing the problems would move one fixed policy's score. It is not a "
            "significance measure and not the across-run spread above.", "",
            "| arm | evaluation noise (policy held fixed) |", "|---|---|",
            *[f"| {arm} | {_f(v)} |" for arm, v in rows], ""]


def markdown(col: Collected, results: list[dict], png: Optional[Path], settings: dict) -> str:
    n = {st: sum(r.state == st for r in col.runs.values()) for st in (layout.DONE, layout.FAILED, INCOMPLETE)}
    L = [f"# Sweep report{': ' + col.name if col.name else ''}", "",
         "Written by `tether sweep report` from " + ", ".join(f"`{s}`" for s in col.sources) + f": {len(col.arms)} "
         f"arm(s); runs: {n[layout.DONE]} done, {n[layout.FAILED]} failed, {n[INCOMPLETE]} incomplete (not counted). "
         f"Bootstrap: {settings['reps']} resamples, seed {settings['seed']}. Every number is also in "
         f"`{settings['json']}`; the definitions are in docs/sweeps.md.", "",
         "The uncertainty in these tables is the spread across runs (seeds): what a rerun with new seeds would "
         "see.", ""]
    if png is not None:
        L += ["## Learning curves", "", f"![learning curves]({png.name})", "",
              f"`{results[0]['metric']}` at each step it was logged"
              + (" (the held-out evaluations during training, eval.every)" if is_eval(results[0]["metric"]) else "")
              + (f", and the training reward `{TRAIN_REWARD}` at each step" if results[0]["metric"] != TRAIN_REWARD
                 else "") + ": the mean across seeds per arm; band: mean ± 1.96 s.e. across seeds (none where fewer "
              "than two seeds have the step).", ""]
    L += ["## Results", ""]
    for res in results:
        L += arm_table(res) + pair_table(res)
    L += _noise(results[0]) + _problems(col, results[0])
    return "\n".join(L) + "\n"


LINESTYLES = ("-", "--", ":", "-.")


def plot(panels: list[tuple[str, dict]], png: Path, title: str) -> None:
    """One panel per (metric, bands): a line per arm (its mean across seeds) and its 95 % band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    for ax, (metric, bands) in zip(axes[0], panels):
        for i, (arm, b) in enumerate(bands.items()):
            if not b["steps"]:
                continue
            # ten colours, then the same ten dashed, dotted, ...: no two of up to 40 arms drawn alike
            (line,) = ax.plot(b["steps"], b["mean"], marker="o" if len(b["steps"]) < 30 else None, ms=3,
                              color=f"C{i % 10}", linestyle=LINESTYLES[(i // 10) % len(LINESTYLES)],
                              label=f"{arm} (n={max(b['n'])})")
            ax.fill_between(b["steps"], b["low"], b["high"], color=line.get_color(), alpha=0.2, lw=0)
        ax.set_xlabel("trainer step")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8 if len(bands) <= 10 else 6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def write_report(dirs: list, out: Optional[str] = None, *, metric: Optional[str] = None,
                 extra_metrics: tuple = (), last_n: int = 10, reps: int = 2000, seed: int = 0,
                 collapse_drop: float = 0.0, baseline: Optional[str] = None) -> Path:
    """Write the report of sweep directories ``dirs`` to ``out`` (default DIR/report.md of the first) with
    ``<stem>.png`` and ``<stem>.json`` beside it; returns the markdown's path."""
    col = collect(dirs)
    if baseline is not None and baseline not in col.arms:
        raise ConfigError(f"--baseline {baseline}: no such arm (arms: {', '.join(col.arms)})")
    md = Path(out) if out else col.sources[0] / "report.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    png, js = md.with_suffix(".png"), md.with_suffix(".json")
    main = metric or col.metric or default_metric(col)
    kw = dict(last_n=last_n, reps=reps, seed=seed, collapse_drop=collapse_drop, baseline=baseline)
    results = [compute(col, m, **kw) for m in dict.fromkeys([main, *extra_metrics])]
    has_done = any(r.state == layout.DONE for r in col.runs.values())
    if has_done and not any(b["steps"] for b in results[0]["bands"].values()):
        raise ConfigError(f"no done run logged {main!r}; name a metric its metrics.jsonl has (--metric)")
    # the curves: the main metric's (held-out evaluations when it is one) and the training reward's
    panels = [(main, results[0]["bands"])]
    if main != TRAIN_REWARD:
        reward = {a: stats.band([curve(r, TRAIN_REWARD) for r in col.of(a)]) for a in col.arms}
        if any(b["steps"] for b in reward.values()):
            panels.append((TRAIN_REWARD, reward))
    if has_done:
        plot(panels, png, col.name or ", ".join(str(s) for s in col.sources))
    settings = {"reps": reps, "seed": seed, "json": js.name}
    md.write_text(markdown(col, results, png if has_done else None, settings))
    js.write_text(json.dumps({"sources": [str(s) for s in col.sources], "settings": settings,
                              "results": results}, indent=1, default=str) + "\n")
    return md
