"""Reading one or more sweep directories into runs for the report (`collect`), and a run's curve and final
value of a metric.

Several DIRs (shards run into separate directories, or sweeps that added arms) merge into one set of runs
keyed by (arm, seed). The same arm must have the same overrides in every DIR, and one (arm, seed) may be
done in one DIR only (else ConfigError / OutputError naming both). A run with a ``done`` record is counted;
one with a ``failed`` record counts in the collapse rate and is listed with its error; a run of the spec
without a record (never started, or stopped) is listed as incomplete and counts nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..errors import ConfigError, OutputError
from . import layout

INCOMPLETE = "incomplete"


@dataclass
class Run:
    """One (arm, seed) of the merged sweep: its state, record and metrics rows (done runs)."""

    arm: str
    seed: int
    state: str  # done | failed | incomplete
    path: Path  # its run directory
    record: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)


@dataclass
class Collected:
    """The merged runs of ``sources`` (the sweep directories), arms in the order the sweeps list them."""

    sources: list[Path]
    arms: list[str]
    runs: dict  # (arm, seed) -> Run
    metric: Optional[str]  # the first sweep.json's spec metric
    name: Optional[str]

    def of(self, arm: str, state: str = layout.DONE) -> list[Run]:
        return sorted((r for r in self.runs.values() if r.arm == arm and r.state == state), key=lambda r: r.seed)


def _number(v) -> Optional[float]:
    """A finite float from a metrics value (non-finite values are logged as strings: None)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def _read_run(out: Path, arm: str, seed: int) -> Run:
    from ..metrics import read_jsonl  # deferred: pulls in torch

    rec = layout.read_record(out, arm, seed)
    path = layout.run_dir(out, arm, seed)
    if rec is None:
        return Run(arm, seed, INCOMPLETE, path)
    rows = []
    if rec["state"] == layout.DONE:
        mpath = path / "metrics.jsonl"
        if not mpath.is_file():
            raise OutputError(f"{path}: recorded done but has no metrics.jsonl")
        rows = read_jsonl(mpath, warn=lambda _m: None)[0]
    return Run(arm, seed, rec["state"], path, rec, rows)


def _runs_of(out: Path, sweep: dict) -> list[tuple[str, int]]:
    """The (arm, seed) of sweep.json's arms x seeds, plus any other recorded run under DIR/runs."""
    found = {(a, s) for a in sweep["arms"] for s in sweep.get("seeds", [])}
    for rec in (Path(out) / "runs").glob("*/seed-*.json"):
        try:
            found.add((rec.parent.name, int(rec.stem[len("seed-"):])))
        except ValueError:
            continue
    return sorted(found)


def collect(dirs: list) -> Collected:
    """Merge the sweep directories ``dirs`` (module docstring)."""
    sources = [Path(d) for d in dirs]
    arms: dict[str, tuple[dict, Path]] = {}
    runs: dict = {}
    metric = name = None
    for out in sources:
        sweep = layout.migrated(layout.read_sweep(out))  # a sweep run with the earlier flat keys: the nested ones
        metric, name = metric or sweep.get("metric"), name or sweep.get("name")
        for arm, over in sweep["arms"].items():
            if arm in arms and not layout.same_overrides(arms[arm][0], over):
                raise ConfigError(f"arm {arm!r} has overrides {arms[arm][0]} in {arms[arm][1]} and {over} in {out}: "
                                  f"not the same arm; report them separately")
            arms.setdefault(arm, (over, out))
        for arm, seed in _runs_of(out, sweep):
            run = _read_run(out, arm, seed)
            old = runs.get((arm, seed))
            if old is not None and old.state == layout.DONE and run.state == layout.DONE:
                raise OutputError(f"arm {arm!r} seed {seed} is done in two directories, {old.path} and {run.path}; "
                                  f"report one of them")
            rank = {layout.DONE: 2, layout.FAILED: 1, INCOMPLETE: 0}
            if old is None or rank[run.state] > rank[old.state]:
                runs[(arm, seed)] = run
    return Collected(sources, list(arms), runs, metric, name)


def default_metric(col: Collected) -> str:
    """The first ``eval/<benchmark>/avg@<n>`` a done run logged, else ``reward_mean`` (training reward)."""
    for run in sorted(col.runs.values(), key=lambda r: (r.arm, r.seed)):
        for row in run.rows:
            for k in row:
                if k.startswith("eval/") and k.count("/") == 2 and k.rsplit("/", 1)[1].startswith("avg@"):
                    return k
    return "reward_mean"


def is_eval(metric: str) -> bool:
    return metric.startswith("eval/") or metric.startswith("eval_anchor/")


def curve(run: Run, metric: str) -> tuple[list[float], list[float]]:
    """(steps, values) of ``metric`` in the run's rows, finite values only, by step (the last row of a step)."""
    at: dict[int, float] = {}
    for row in run.rows:
        v = _number(row.get(metric))
        if v is not None and isinstance(row.get("step"), int):
            at[row["step"]] = v
    steps = sorted(at)
    return [float(s) for s in steps], [at[s] for s in steps]


def final_value(run: Run, metric: str, last_n: int) -> Optional[float]:
    """The run's final value of ``metric``: an evaluation metric's value at its last evaluation; a training
    metric's mean over its last ``last_n`` logged steps (steps >= 1)."""
    steps, values = curve(run, metric)
    if not values:
        return None
    if is_eval(metric):
        return values[-1]
    tail = [v for s, v in zip(steps, values) if s >= 1][-last_n:]
    return sum(tail) / len(tail) if tail else None


def nonfinite(run: Run) -> bool:
    """Whether the run logged a non-finite loss (any ``*loss`` key) or gradient norm."""
    for row in run.rows:
        for k, v in row.items():
            if (k.endswith("loss") or k == "grad_norm") and (isinstance(v, str) or
                                                             (isinstance(v, float) and not math.isfinite(v))):
                return True
    return False


def eval_noise(run: Run, metric: str) -> Optional[float]:
    """Binomial standard error sqrt(p (1 - p) / N) of the run's final evaluation, p its value and N the
    benchmark's ``n_problems``: the noise of re-drawing the problems with the policy held fixed. None for a
    metric that is not an ``eval/<b>/avg@n`` fraction."""
    if not (is_eval(metric) and "/avg@" in metric):
        return None
    steps, values = curve(run, metric)
    n_key = metric.rsplit("/", 1)[0] + "/n_problems"
    n = next((_number(r.get(n_key)) for r in reversed(run.rows) if _number(r.get(n_key))), None)
    if not values or not n:
        return None
    p = values[-1]
    return math.sqrt(max(p * (1 - p), 0.0) / n)
