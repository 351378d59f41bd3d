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
import os
import re
from dataclasses import replace
from itertools import combinations
from pathlib import Path
from typing import Optional

from ..errors import ConfigError, OutputError
from ..userio import MARK_KEY, claim_output_file, image_metadata, loads_json, mark_line, write_output_text
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


def pair_stats(per_arm: dict, arms: list[str], *, reps: int, seed: int, baseline: Optional[str],
               sets: Optional[dict] = None) -> list[dict]:
    """Probability of improvement and paired differences of every pair of arms (each against ``baseline``
    when given): P(A > B), d = A - B of the final values, and of the AUCs (``paired_auc``: the speed of the lift);
    with ``sets`` (name -> seeds), each paired difference within each seed set and its replication verdict
    (`replication`; ``sets_auc``, ``replication_auc`` for the AUC)."""
    pairs = [(a, baseline) for a in arms if a != baseline] if baseline else list(combinations(arms, 2))
    out = []
    for a, b in pairs:
        x, y = per_arm[a]["per_seed"], per_arm[b]["per_seed"]
        xs, ys = [x[s] for s in sorted(x)], [y[s] for s in sorted(y)]
        xa, ya = per_arm[a]["auc_per_seed"], per_arm[b]["auc_per_seed"]
        pair = {"a": a, "b": b, "poi": stats.probability_of_improvement(xs, ys, reps, seed),
                "paired": stats.paired_difference(x, y), "paired_auc": stats.paired_difference(xa, ya)}
        if sets:
            for key, (u, v), pooled in (("", (x, y), "paired"), ("_auc", (xa, ya), "paired_auc")):
                pair["sets" + key] = {name: stats.paired_difference({s: w for s, w in u.items() if s in seeds},
                                                                    {s: w for s, w in v.items() if s in seeds})
                                      for name, seeds in sets.items()}
                pair["replication" + key] = replication(pair["sets" + key], pair[pooled])
        out.append(pair)
    return out


def replication(per_set: dict, pooled: dict) -> str:
    """The verdict on a paired difference measured on several disjoint seed sets (docs/evidence.md's rule): it
    **replicates** when the pooled 95 % interval excludes 0 and every set's mean points the same way; the sets
    **disagree** when their means point opposite ways; otherwise it is **not shown** (the pooled interval holds 0,
    or a set has fewer than two pairs)."""
    means = [d["mean"] for d in per_set.values() if d["n"] >= 2]
    if len(means) < len(per_set):
        return "not shown (a set has < 2 paired seeds)"
    if any(m > 0 for m in means) and any(m < 0 for m in means):
        return "sets disagree"
    ci = pooled.get("ci")
    if ci is not None and (ci[0] > 0 or ci[1] < 0):
        return "replicates"
    return "not shown (pooled interval holds 0)"


def compute(col: Collected, metric: str, *, last_n: int = 10, reps: int = 2000, seed: int = 0,
            collapse_drop: float = 0.0, baseline: Optional[str] = None, sets: Optional[dict] = None) -> dict:
    """Every number of the report for ``metric``: per arm, per pair, and the curve bands."""
    per_arm = {a: arm_stats(col, a, metric, last_n=last_n, reps=reps, seed=seed, collapse_drop=collapse_drop)
               for a in col.arms}
    bands = {a: stats.band([curve(r, metric) for r in col.of(a)]) for a in col.arms}
    return {"metric": metric, "last_n": None if is_eval(metric) else last_n, "arms": per_arm,
            "pairs": pair_stats(per_arm, col.arms, reps=reps, seed=seed, baseline=baseline, sets=sets), "bands": bands,
            "sets": {k: sorted(v) for k, v in (sets or {}).items()}}


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


def sets_table(res: dict) -> list[str]:
    """The paired differences within each seed set and pooled, with the replication verdict (`replication`)."""
    pairs = [p for p in res["pairs"] if "sets" in p]
    if not pairs:
        return []
    names = list(res["sets"])
    head = " | ".join(f"{n} (seeds {_seed_text(res['sets'][n])}): mean [95 % CI]" for n in names)
    L = [f"### Replication of `{res['metric']}` over seed sets", "",
         "The paired difference A − B of the final values, and of the AUCs (the curve's mean height: the speed of the "
         "lift), within each disjoint set of seeds and over all of them (pooled). A difference **replicates** when "
         "the pooled t-interval excludes 0 and every set points the same way; the sets **disagree** when their means "
         "have opposite signs.", "",
         f"| A | B | of | {head} | pooled: n, mean [95 % CI] | verdict |",
         "|---|---|---|" + "---|" * len(names) + "---|---|"]
    for p in pairs:
        for of, key, pooled in (("final", "", "paired"), ("AUC", "_auc", "paired_auc")):
            cells = [f"{_f(d['mean'])} {_ci(d['ci'])} (n={d['n']})" for d in (p["sets" + key][n] for n in names)]
            d = p[pooled]
            L.append(f"| {p['a']} | {p['b']} | {of} | {' | '.join(cells)} | {d['n']}, {_f(d['mean'])} "
                     f"{_ci(d['ci'])} | {p['replication' + key]} |")
    return L + [""]


def _seed_text(seeds: list[int]) -> str:
    return f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))


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


def markdown(col: Collected, results: list[dict], png: Optional[Path], settings: dict,
             forest_png: Optional[Path] = None) -> str:
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
    if forest_png is not None:
        L += ["## Against the baseline", "", f"![paired differences]({forest_png.name})", "",
              f"Each arm minus the baseline on the same seed (`{results[0]['metric']}`): the mean and its 95 % "
              "t-interval (rliable's interval-estimate plot), pooled over every seed"
              + (" and within each seed set" if results[0].get("sets") else "") + "; the dashed line is no difference.",
              ""]
    L += ["## Results", ""]
    for res in results:
        L += arm_table(res) + pair_table(res) + sets_table(res)
    L += _noise(results[0]) + _problems(col, results[0])
    return "\n".join(L) + "\n"


#: at most this many curves on one axis: more arms are split over several panels of the same metric
CURVES_PER_AXIS = 6


def _save(fig, png: Path) -> None:
    """``fig`` to ``png`` (tether's mark in its metadata) through a temporary file; OutputError where it cannot."""
    import matplotlib.pyplot as plt

    tmp = png.with_name(f".{png.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=120, format="png", metadata=image_metadata("png", REPORT_KIND), bbox_inches="tight")
        os.replace(tmp, png)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {png}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def _family(arm: str) -> str:
    """An arm's name without its learning-rate part (``r8_lr=1.0e-04`` -> ``r8``; ``grpo+lr=3.0e-05`` ->
    ``grpo``): the arms of one learning-rate grid share a family."""
    return re.sub(r"[_+]?lr=[^_+]*", "", arm) or arm


def _lr_of(arm: str) -> float:
    """The learning rate an arm's name states (``lr=1.0e-04``), or 0 where it states none."""
    m = re.search(r"lr=([0-9.eE+-]+?)(?:[_+]|$)", arm)
    try:
        return float(m.group(1)) if m else 0.0
    except ValueError:
        return 0.0


def curve_groups(arms: list[str]) -> list[list[str]]:
    """``arms`` (in order) split into the curves of each axis: a family (`_family`: one learning-rate grid)
    stays on one axis in the order of its learning rates, families packed in order while at most
    `CURVES_PER_AXIS` curves share it (a family larger than that is split)."""
    groups: list[list[str]] = []
    families: dict[str, list[str]] = {}
    for a in arms:
        families.setdefault(_family(a), []).append(a)
    for fam in families.values():
        fam.sort(key=_lr_of)  # a grid in the order of its learning rates (stable: others keep theirs)
        for i in range(0, len(fam), CURVES_PER_AXIS):
            part = fam[i:i + CURVES_PER_AXIS]
            if groups and len(groups[-1]) + len(part) <= CURVES_PER_AXIS:
                groups[-1].extend(part)
            else:
                groups.append(list(part))
    return groups or [[]]


def plot(panels: list[tuple[str, dict]], png: Path, title: str) -> None:
    """One row per (metric, bands), a line per arm (its mean across seeds) and its 95 % band, at most
    `CURVES_PER_AXIS` arms on one axis (more go to the next panel of the row, same y scale; a learning-rate
    grid's arms share one, `curve_groups`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def chunks(bands: dict) -> list[list[str]]:
        return curve_groups([a for a, b in bands.items() if b["steps"]] or list(bands))

    cols = max(len(chunks(b)) for _, b in panels)
    fig, axes = plt.subplots(len(panels), cols, figsize=(6.5 * cols, 4.2 * len(panels)), squeeze=False)
    for row, (metric, bands) in zip(axes, panels):
        groups = chunks(bands)
        for j, ax in enumerate(row):
            if j >= len(groups):
                ax.axis("off")
                continue
            for i, arm in enumerate(groups[j]):
                b = bands[arm]
                if not b["steps"]:
                    continue
                (line,) = ax.plot(b["steps"], b["mean"], marker="o" if len(b["steps"]) < 30 else None, ms=3,
                                  color=f"C{i}", label=f"{arm} (n={max(b['n'])})")
                ax.fill_between(b["steps"], b["low"], b["high"], color=line.get_color(), alpha=0.2, lw=0)
            ax.set_xlabel("trainer step")
            ax.set_ylabel(metric)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            if j:
                ax.sharey(row[0])
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, png)


def forest(res: dict, png: Path, title: str) -> bool:
    """The paired differences against the baseline (``res`` from `compute` with a baseline), one row per arm, as
    rliable's interval-estimate plot: the pooled mean and its 95 % t-interval, and with seed sets one panel per set
    beside it (an empty row where the arm has fewer than two paired seeds in a set). False (nothing written) when
    no pair has an interval."""
    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    from rliable import plot_utils

    pairs = [p for p in res["pairs"] if p["paired"].get("ci") is not None]
    if not pairs:
        return False
    nan = {"mean": float("nan"), "ci": (float("nan"), float("nan")), "n": 0}
    names = ["pooled" if res.get("sets") else "all seeds", *(res.get("sets") or {})]

    def cell(p: dict, i: int) -> dict:
        d = p["paired"] if i == 0 else (p.get("sets") or {}).get(names[i]) or nan
        return d if d.get("ci") is not None else nan  # a set where the arm has < 2 paired seeds: an empty row

    rows = {p["a"]: [cell(p, i) for i in range(len(names))] for p in pairs}
    points = {k: np.array([d["mean"] for d in v]) for k, v in rows.items()}
    intervals = {k: np.array([[d["ci"][0] for d in v], [d["ci"][1] for d in v]]) for k, v in rows.items()}

    def label(i: int) -> str:
        ns = sorted({r[i]["n"] for r in rows.values() if r[i]["n"]})
        return f"{names[i]} (n={ns[0]})" if len(ns) == 1 else f"{names[i]} (n={ns[0]}-{ns[-1]})" if ns else names[i]

    labels = [label(i) for i in range(len(names))]
    fig, axes = plot_utils.plot_interval_estimates(points, intervals, labels, algorithms=list(rows),
                                                   subfigure_width=4.5, row_height=max(0.6, 3.2 / len(rows)),
                                                   xlabel_y_coordinate=-0.25 if len(rows) <= 5 else -0.1,
                                                   xlabel=f"arm − {pairs[0]['b']}: paired difference in "
                                                   f"{res['metric']} (95 % CI)")
    ends = np.concatenate([v.ravel() for v in intervals.values()] + [np.zeros(1)])
    lo, hi = np.nanmin(ends), np.nanmax(ends)
    pad = 0.05 * (hi - lo or 1.0)
    for ax in np.atleast_1d(axes):  # one x scale for every panel, so the sets compare at a glance
        ax.set_xlim(lo - pad, hi + pad)
        ax.axvline(0.0, color="k", lw=0.8, ls="--")
    fig.suptitle(title, fontsize=12, y=1.12)
    _save(fig, png)
    return True


#: the mark of a report's files (`tether.userio`): `tether sweep report` replaces only files that carry it
REPORT_KIND = "sweep report"


def _legacy(p: Path) -> bool:
    """A file of a report written before reports carried tether's mark (2026-12-05): replaced as tether's."""
    try:
        if p.suffix == ".md":
            head = p.read_text(encoding="utf-8", errors="replace").splitlines()[:4]
            return bool(head) and head[0].startswith("# Sweep report") and any(
                ln.startswith("Written by `tether sweep report`") for ln in head)
        if p.suffix == ".json":
            obj = loads_json(p.read_text(encoding="utf-8"))
            return isinstance(obj, dict) and set(obj) == {"sources", "settings", "results"}
        if p.suffix == ".png":
            md = p.with_suffix(".md")
            return p.read_bytes()[:4] == b"\x89PNG" and md.is_file() and _legacy(md)
    except (OSError, ValueError):
        return False
    return False


def forest_path(md: Path) -> Path:
    """The forest plot's path beside the report: ``<stem>-forest.png``."""
    return md.with_name(f"{md.stem}-forest.png")


def claim_report_paths(md: Path, with_forest: bool = False) -> tuple[Path, ...]:
    """The report's markdown, PNG and JSON paths (and with a baseline the forest plot's), each checked before
    anything is computed (`tether.userio.claim_output_file`): absent, or a file an earlier report wrote; the
    directory writable."""
    paths = (md, md.with_suffix(".png"), md.with_suffix(".json")) + ((forest_path(md),) if with_forest else ())
    return tuple(claim_output_file(p, REPORT_KIND, flag="--out", legacy=_legacy) for p in paths)


def write_report(dirs: list, out: Optional[str] = None, *, metric: Optional[str] = None,
                 extra_metrics: tuple = (), last_n: int = 10, reps: int = 2000, seed: int = 0,
                 collapse_drop: float = 0.0, baseline: Optional[str] = None, sets: Optional[dict] = None,
                 arms: Optional[list] = None) -> Path:
    """Write the report of sweep directories ``dirs`` to ``out`` (default DIR/report.md of the first) with
    ``<stem>.png`` and ``<stem>.json`` beside it (only ``arms`` when given); returns the markdown's path."""
    if collapse_drop < 0:
        raise ConfigError(f"--collapse-drop must be >= 0 (a drop below the run's first point), got {collapse_drop}")
    col = collect(dirs)  # first: DIR must be a sweep directory before its report.md is claimed
    if arms is not None:
        unknown = [a for a in arms if a not in col.arms]
        if unknown or not arms:
            raise ConfigError(f"--arms: no such arm {', '.join(unknown) or '(none given)'} "
                              f"(arms: {', '.join(col.arms)})")
        keep = [a for a in col.arms if a in arms]
        col = replace(col, arms=keep, runs={k: r for k, r in col.runs.items() if r.arm in keep})
    if baseline is not None and baseline not in col.arms:
        raise ConfigError(f"--baseline {baseline}: no such arm (arms: {', '.join(col.arms)})")
    md, png, js, *fp = claim_report_paths(Path(out) if out else col.sources[0] / "report.md",
                                          with_forest=baseline is not None)
    main = metric or col.metric or default_metric(col)
    kw = dict(last_n=last_n, reps=reps, seed=seed, collapse_drop=collapse_drop, baseline=baseline, sets=sets)
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
    title = col.name or ", ".join(str(s) for s in col.sources)
    forest_png = None
    if has_done:
        plot(panels, png, title)
        if fp and forest(results[0], fp[0], f"{title}: against {baseline}"):
            forest_png = fp[0]
    settings = {"reps": reps, "seed": seed, "json": js.name}
    write_output_text(md, mark_line(REPORT_KIND) + "\n" + markdown(col, results, png if has_done else None, settings,
                                                                   forest_png))
    write_output_text(js, json.dumps({MARK_KEY: REPORT_KIND, "sources": [str(s) for s in col.sources],
                                      "settings": settings, "results": results}, indent=1, default=str) + "\n")
    return md
