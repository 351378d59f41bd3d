"""Check that a refactor changed no training number: every recipe x 3 steps on the tiny random model,
a multi-turn calculator run and an asynchronous K = 1 run.

    .venv/bin/python scripts/same_metrics.py --save before.json       # on the old code
    .venv/bin/python scripts/same_metrics.py --compare before.json    # on the new code: exit 1 on a difference
    .venv/bin/python scripts/same_metrics.py --runs OLD_RUN NEW_RUN    # two run directories' metrics.jsonl

Each recipe trains 3 steps (2 prompts x 4 samples, 8 new tokens, seed 0, one thread) on a tiny
random Llama (`tether.testing.make_tiny_model_dir`) with a synthetic digit reward; the rows of
``metrics.jsonl`` without their timing keys are kept. Two more cases: ``multi_turn_calculator`` (ema_pg,
rollout.agent=multi_turn with the calculator environment on the arithmetic task) and ``async_k1`` (ema_pg,
train.async.max_staleness=1 with a local rollout worker and the default asynchronous correction). ``--compare``
reports every value that differs by more than ``--rtol`` (default 1e-6, relative) and every key present on one
side only. ``--runs`` holds two run directories' ``metrics.jsonl`` against each other by the same rule (timing keys
dropped), e.g. an evidence run on the code that ran it and on today's (docs/evidence.md, "The regime").

Record the old side on the machine that compares: the numbers are exact on one CPU, not across CPUs (float
rounding differs). ``scripts/same_metrics_before.json`` is the record of d125a8e (before the config redesign) made
on the machine of 2026-12-01 with this script's cases (its EXTRA cases in the flat keys d125a8e reads); a record of
the same commit made on an earlier machine differed from it in 161 of 1437 values. To make one for your machine:

    git worktree add /tmp/old d125a8e && git show 373241b:scripts/same_metrics.py > /tmp/sm.py
    PYTHONPATH=/tmp/old/src .venv/bin/python /tmp/sm.py --save /tmp/before.json   # from this checkout
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

TIMING = ("time", "tokens_per_s", "peak_", "_s")
REWARD = "def digits(completion, example):\n    return sum(c.isdigit() for c in completion) / max(len(completion), 1)\n"


# The cases beyond the named recipes: (recipe, overrides on top of the common ones).
EXTRA = {
    "multi_turn_calculator": ("ema_pg", {"data.task": "arithmetic", "data.reward": "auto",
                                         "rollout.agent": "multi_turn", "rollout.agent.env.name": "calculator",
                                         "rollout.max_new_tokens": 12, "rollout.agent.env.max_context": 1024}),
    "async_k1": ("ema_pg", {"train.async.max_staleness": 1}),
}


def run_all(recipes: list[str], extra: list[str]) -> dict:
    from tether.resolve import load_config
    from tether.testing import make_tiny_model_dir
    from tether.train import train

    torch.set_num_threads(1)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        model = make_tiny_model_dir(d / "model")
        (d / "rew.py").write_text(REWARD)
        with open(d / "prompts.jsonl", "w") as f:
            for i in range(40):
                f.write(json.dumps({"question": f"Say some numbers {i}", "answer": str(i)}) + "\n")
        common = {
            "model.name": str(model), "data.task": str(d / "prompts.jsonl"),
            "data.reward": f"{d / 'rew.py'}:digits", "train.steps": 3, "train.lr": 1e-2,
            "rollout.max_new_tokens": 8, "rollout.prompts_per_step": 2, "rollout.n": 4,
            "run.progress": False, "run.plot": False, "run.exact_kl_samples": 0, "run.save_every": 0,
            "eval.before": False, "eval.after": False}
        cases = [(n, n, {}) for n in recipes] + [(n, *EXTRA[n]) for n in extra]
        for name, recipe_name, over in cases:
            cfg = load_config(None, {**common, **over}, recipe_name=recipe_name)
            run = train(cfg, d / f"run-{name}", log=lambda *a, **k: None)
            rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
            out[name] = [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]
            print(f"{name}: {len(rows)} rows", file=sys.stderr)
    return out


def run_metrics(run_dir: str) -> list[dict]:
    """The rows of ``RUN/metrics.jsonl`` without their timing keys."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"same_metrics: {path} does not exist (is {run_dir} a run directory?)")
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def compare(old: dict, new: dict, rtol: float) -> list[str]:
    problems = []
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            problems.append(f"{name}: only in {'old' if name in old else 'new'}")
            continue
        for i, (a, b) in enumerate(zip(old[name], new[name])):
            for k in sorted(set(a) | set(b)):
                if k not in a or k not in b:
                    problems.append(f"{name} row {i}: key {k} only in {'old' if k in a else 'new'}")
                    continue
                x, y = a[k], b[k]
                if isinstance(x, (int, float)) and isinstance(y, (int, float)):
                    if math.isnan(x) and math.isnan(y):
                        continue
                    if abs(x - y) > rtol * max(abs(x), abs(y), 1e-12):
                        problems.append(f"{name} row {i}: {k} {x!r} -> {y!r}")
                elif x != y:
                    problems.append(f"{name} row {i}: {k} {x!r} -> {y!r}")
        if len(old[name]) != len(new[name]):
            problems.append(f"{name}: {len(old[name])} rows -> {len(new[name])}")
    return problems


def main() -> int:
    from tether.config.recipes import RECIPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", help="write the metrics of every recipe to this JSON file")
    ap.add_argument("--compare", help="compare with a file written by --save")
    ap.add_argument("--rtol", type=float, default=1e-6, help="relative tolerance (default 1e-6)")
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES), help="default: every named recipe")
    ap.add_argument("--extra", nargs="*", default=list(EXTRA), help=f"default: {', '.join(EXTRA)}")
    ap.add_argument("--runs", nargs=2, metavar=("OLD_RUN", "NEW_RUN"),
                    help="compare two run directories' metrics.jsonl instead of running the recipes")
    args = ap.parse_args()
    if args.runs:
        old, new = ({"run": run_metrics(r)} for r in args.runs)
        problems = compare(old, new, args.rtol)
        for p in problems:
            print(p)
        n = sum(len(r) for r in new["run"])
        print(f"{len(new['run'])} rows, {n} values: {len(problems)} difference(s) beyond rtol {args.rtol:g}")
        return 1 if problems else 0
    got = run_all(args.recipes, args.extra)
    if args.save:
        Path(args.save).write_text(json.dumps(got, indent=1))
        print(f"saved {sum(len(v) for v in got.values())} rows of {len(got)} recipes to {args.save}")
    if args.compare:
        problems = compare(json.loads(Path(args.compare).read_text()), got, args.rtol)
        for p in problems:
            print(p)
        n = sum(len(r) for rows in got.values() for r in rows)
        print(f"{len(got)} recipes, {n} values: {len(problems)} difference(s) beyond rtol {args.rtol:g}")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
