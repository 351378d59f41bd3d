"""The statistics of ``tether sweep report``: across-seed summaries, bootstrap intervals, paired differences,
probability of improvement, area under the curve, and learning-curve bands.

The unit of every statistic here is a *run* (one arm at one seed): the spread is the spread across runs,
which is what a rerun with new seeds would see. Notation: an arm's final values x_1..x_n over its n seeds.

* mean  x̄ = (1/n) Σ x_i;  sd = sqrt(Σ (x_i - x̄)² / (n - 1));  s.e. = sd / sqrt(n)  (sd, s.e.: n >= 2).
* 95 % CI of the mean: rliable's stratified bootstrap (`rliable.library.get_interval_estimates`, percentile
  method): resample the n runs with replacement ``reps`` times, take the 2.5 and 97.5 percentiles of the
  resampled means. With one task, stratifying is plain resampling of runs.
* IQM: `rliable.metrics.aggregate_iqm`, the mean of the middle 50 % of the runs (scipy's
  ``trim_mean(x, 0.25)``: floor(n/4) runs cut at each end, so with n < 4 it equals the mean); its CI is the
  same bootstrap of the IQM.
* probability of improvement P(X > Y): `rliable.metrics.probability_of_improvement`, the Mann-Whitney U
  statistic over all n·m pairs of runs, U / (n m) = (1/(n m)) Σ_i Σ_j [1(x_i > y_j) + ½·1(x_i = y_j)]
  (0.5 when the two arrays are equal); its CI is rliable's independent stratified bootstrap of both arms.
* paired difference (runs of two arms with the same seed share prompts, their order and initial weights):
  d_s = x_s - y_s over the k seeds both arms finished; mean d̄, s.e. = sd(d) / sqrt(k), and the 95 % CI
  d̄ ± t_{0.975, k-1} · s.e. (Student's t with k - 1 degrees of freedom).
* AUC of one run's curve (steps s_0 < ... < s_K, values y_0..y_K): the trapezoidal area divided by the
  span, (1 / (s_K - s_0)) Σ_k (s_{k+1} - s_k)(y_k + y_{k+1}) / 2: the curve's mean height over training, in
  the metric's units (y_0 when the curve has one point). Equal to the mean of the points when they are
  evenly spaced, except that the two end points weigh half.
* curve band at each step: mean ± 1.96 · s.e. across the seeds that have a value at that step (no band
  where fewer than 2 do).

Bootstraps are reproducible: each call draws from its own ``numpy.random.RandomState(seed)`` and, for the
two-sample bootstrap of the probability of improvement (rliable's ``StratifiedIndependentBootstrap`` draws
from numpy's global generator, ignoring ``random_state``), from the global generator seeded with ``seed``
for the call (its previous state restored after).
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence

import numpy as np


def summary(values: Sequence[float]) -> dict:
    """``n``, ``mean``, ``sd`` and ``se`` (None where undefined: sd and se need n >= 2)."""
    x = np.asarray(values, dtype=float)
    n = len(x)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "se": None}
    sd = float(np.std(x, ddof=1)) if n >= 2 else None
    return {"n": n, "mean": float(np.mean(x)), "sd": sd, "se": sd / math.sqrt(n) if sd is not None else None}


def _interval(scores, func, reps: int, seed: int) -> tuple[float, float, float]:
    """(point, low, high): ``func`` on ``scores`` and rliable's 95 % percentile bootstrap interval."""
    from rliable import library as rly

    state = np.random.get_state()
    np.random.seed(seed)  # rliable's two-sample bootstrap draws from numpy's global generator (not random_state)
    try:
        with warnings.catch_warnings():  # arch: "random_state is deprecated" (rliable passes a RandomState)
            warnings.simplefilter("ignore", FutureWarning)
            point, ci = rly.get_interval_estimates({"x": scores}, func, reps=reps,
                                                   random_state=np.random.RandomState(seed))
    finally:
        np.random.set_state(state)
    return float(np.ravel(point["x"])[0]), float(ci["x"][0][0]), float(ci["x"][1][0])


def _runs(values: Sequence[float]) -> np.ndarray:
    """Values as rliable's score matrix: (runs x tasks) with one task."""
    return np.asarray(values, dtype=float).reshape(-1, 1)


def mean_ci(values: Sequence[float], reps: int = 2000, seed: int = 0) -> Optional[tuple[float, float, float]]:
    """(mean, low, high): the mean and its 95 % stratified-bootstrap CI (rliable); None without values."""
    if len(values) == 0:
        return None
    return _interval(_runs(values), lambda s: np.array([np.mean(s)]), reps, seed)


def iqm_ci(values: Sequence[float], reps: int = 2000, seed: int = 0) -> Optional[tuple[float, float, float]]:
    """(IQM, low, high): rliable's interquartile mean and its 95 % stratified-bootstrap CI."""
    from rliable import metrics

    if len(values) == 0:
        return None
    return _interval(_runs(values), lambda s: np.array([metrics.aggregate_iqm(s)]), reps, seed)


def probability_of_improvement(x: Sequence[float], y: Sequence[float], reps: int = 2000,
                               seed: int = 0) -> Optional[tuple[float, float, float]]:
    """(P(X > Y), low, high): rliable's probability of improvement of arm X over arm Y and its 95 % CI."""
    from rliable import metrics

    if len(x) == 0 or len(y) == 0:
        return None
    return _interval((_runs(x), _runs(y)), lambda a, b: np.array([metrics.probability_of_improvement(a, b)]),
                     reps, seed)


def paired_difference(x: dict, y: dict) -> dict:
    """Paired differences d_s = x[s] - y[s] over the seeds s in both (dicts seed -> value): ``n``, ``mean``,
    ``se``, ``ci`` (t-based 95 %; None with fewer than 2 pairs) and ``diffs`` (seed -> d_s)."""
    from scipy import stats

    seeds = sorted(set(x) & set(y))
    d = {s: float(x[s]) - float(y[s]) for s in seeds}
    out = summary(list(d.values()))
    ci = None
    if out["n"] >= 2:
        half = float(stats.t.ppf(0.975, out["n"] - 1)) * out["se"]
        ci = (out["mean"] - half, out["mean"] + half)
    return {"n": out["n"], "mean": out["mean"], "se": out["se"], "ci": ci, "diffs": d}


def auc(steps: Sequence[float], values: Sequence[float]) -> Optional[float]:
    """The curve's trapezoidal area over its steps divided by the span of the steps (module docstring)."""
    s, y = np.asarray(steps, dtype=float), np.asarray(values, dtype=float)
    if len(s) == 0:
        return None
    if len(s) == 1 or s[-1] == s[0]:
        return float(y[0])
    return float(np.sum(np.diff(s) * (y[1:] + y[:-1]) / 2) / (s[-1] - s[0]))


def band(curves: Sequence[tuple[Sequence[float], Sequence[float]]]) -> dict:
    """Mean curve and 95 % band (mean ± 1.96 s.e. across runs) of ``curves`` ((steps, values) per run), at
    every step any run has: ``steps``, ``mean``, ``low``, ``high`` (low = high = mean where n < 2), ``n``."""
    at: dict[float, list[float]] = {}
    for steps, values in curves:
        for s, v in zip(steps, values):
            at.setdefault(float(s), []).append(float(v))
    out = {"steps": [], "mean": [], "low": [], "high": [], "n": []}
    for s in sorted(at):
        st = summary(at[s])
        half = 1.96 * st["se"] if st["se"] is not None else 0.0
        for k, v in (("steps", s), ("mean", st["mean"]), ("low", st["mean"] - half), ("high", st["mean"] + half),
                     ("n", st["n"])):
            out[k].append(v)
    return out


def collapsed(failed: bool, nonfinite: bool, first: Optional[float], final: Optional[float],
              drop: float = 0.0) -> Optional[str]:
    """Why a run counts as collapsed, or None. A run collapsed when it failed (no final value), logged a
    non-finite loss or gradient norm, or ended below its own first point by more than ``drop``
    (final < first - drop; the first point is the step-0 evaluation when the run evaluated before training)."""
    if failed:
        return "failed"
    if nonfinite:
        return "non-finite loss or gradient"
    if first is not None and final is not None and final < first - drop:
        return f"final {final:.4g} below its start {first:.4g}"
    return None
