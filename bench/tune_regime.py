"""Tune a training regime on a validation slice, never on the test split.

Trains one run with ``tether train``'s settings plus the overrides given, and every ``--every``
trainer steps (and before the first) evaluates the policy greedily on a *validation slice*: the
first ``--val`` problems of the synthetic arithmetic **train** split drawn with seed 10000, a
stream that no training seed (0, 1, 2, ...) reads in that order, over the same training
calculations (so it measures fit to the training distribution), with the trainer's own agent and
engine (``rollout.engine``), as training samples. The held-out test split
(``eval.benchmarks=arithmetic``, what ``bench/compare_recipes.py`` and the default run report)
is never touched, so a setting chosen here is not fitted to the numbers reported.

Each row (one per trainer step, with the validation accuracy where evaluated) is printed as
JSON and appended to ``OUT/tune.jsonl``; training stops after ``--minutes`` of training time
(evaluation excluded) or ``train.steps``, whichever comes first.

Usage (from the repository root), the pilot that chose the default regime::

    .venv/bin/python bench/tune_regime.py /tmp/tune/p1 --recipe ema_pg data.format_weight=0 \\
        rollout.temperature=0.7 rollout.max_new_tokens=64 rollout.n=8 rollout.prompts_per_step=6 \\
        train.lr=1e-5 train.steps=300 run.save_every=0 --every 10 --val 100 --eval-tokens 96 --minutes 30
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

VAL_SEED = 10_000  # the validation stream's seed; training seeds are small integers
KEEP = ("reward_mean", "accuracy", "response_len", "truncation_rate", "kl", "entropy", "clip_frac", "clip_frac_low",
        "clip_frac_high", "groups_zero_variance_frac", "anchor_updates", "time_step_s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="run directory (must be new or empty); tune.jsonl is written into it")
    p.add_argument("overrides", nargs="*", help="config overrides KEY=VALUE, as for tether train")
    p.add_argument("--recipe", default="ema_pg", help="recipe (default ema_pg)")
    p.add_argument("--every", type=int, default=10, help="evaluate the validation slice every N steps (default 10)")
    p.add_argument("--val", type=int, default=100, help="validation problems (default 100)")
    p.add_argument("--eval-tokens", type=int, default=96, help="greedy response cap on the validation slice (96)")
    p.add_argument("--minutes", type=float, default=60.0, help="stop after this much training time (default 60)")
    a = p.parse_intermixed_args(argv)
    if a.every < 1 or a.val < 1 or a.eval_tokens < 1 or a.minutes <= 0:
        p.error("--every, --val, --eval-tokens must be >= 1 and --minutes > 0")

    from tether.config import parse_overrides
    from tether.eval.runner import evaluate_during_training
    from tether.resolve import load_config
    from tether.tasks.arithmetic import ArithmeticTask
    from tether.tasks.rewards import load_reward
    from tether.train import build_trainer

    over = parse_overrides(a.overrides)
    over.update({"run.progress": False, "run.plot": False, "run.output_dir": a.out,
                 "eval.before": False, "eval.after": False})  # the test split stays untouched
    cfg = load_config(None, over, recipe_name=a.recipe)
    if cfg.data.task != "arithmetic":
        p.error("the validation slice is the synthetic arithmetic task's: data.task must be arithmetic")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = build_trainer(cfg, out, log=lambda *x: None)
    val = ArithmeticTask(seed=VAL_SEED, difficulty=cfg.data.difficulty, split="train").examples(a.val)
    reward = load_reward("arithmetic")
    settings = dict(n=1, greedy=True, temperature=0.0, max_new_tokens=a.eval_tokens, batch_size=100, seed=0)

    def validate() -> dict:
        res = evaluate_during_training(trainer.agent, {"val": val}, {"val": reward}, settings)  # as training samples
        return {"val_" + k.split("/")[-1]: v for k, v in res.items()
                if k.split("/")[-1] in ("avg@1", "mean_response_tokens", "truncation_rate")}

    with open(out / "tune.jsonl", "a") as f:
        def emit(row: dict) -> None:
            line = json.dumps(row)
            print(line, flush=True)
            f.write(line + "\n")
            f.flush()

        emit({"step": 0, "train_s": 0.0, **validate()})
        train_s = 0.0
        while trainer.step < cfg.train.steps and train_s < a.minutes * 60:
            t0 = time.perf_counter()
            m = trainer.train_step()
            train_s += time.perf_counter() - t0
            row = {"step": trainer.step, "train_s": round(train_s, 1), **{k: m[k] for k in KEEP if k in m}}
            if trainer.step % a.every == 0:
                row.update(validate())
            emit(row)
        if trainer.step % a.every:
            emit({"step": trainer.step, "train_s": round(train_s, 1), **validate()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
