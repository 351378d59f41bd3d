"""The command line of the comparison: its flags, their full and --quick defaults, --variant parsing,
and the settings (and command) recorded in the results JSON."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import _benchutil as bu

from . import __doc__ as _DOC

RECIPES = ("grpo", "dapo", "ema_pg", "rpg_reinforce_urkl", "atr_grpo")
TASKS = ("arithmetic", "gsm8k")
SCRIPT = "bench/compare_recipes.py"
# full-mode and --quick defaults of the budget flags (a flag given on the command line wins)
FULL = dict(steps={"arithmetic": 16, "gsm8k": 8}, prompts_per_step=6, samples=8,
            max_new_tokens={"arithmetic": 64, "gsm8k": 256},
            eval_limit_synthetic=500, eval_limit_gsm8k=200,
            eval_max_new_tokens={"arithmetic": 96, "gsm8k": 256}, kl_prompts=32)
QUICK = dict(steps={"arithmetic": 2, "gsm8k": 2}, prompts_per_step=2, samples=2,
             max_new_tokens={"arithmetic": 16, "gsm8k": 16},
             eval_limit_synthetic=8, eval_limit_gsm8k=8,
             eval_max_new_tokens={"arithmetic": 16, "gsm8k": 32}, kl_prompts=4)
# settings that must match for --resume to reuse earlier runs
BUDGET_KEYS = ("model", "steps", "prompts_per_step", "samples", "max_new_tokens", "lr", "temperature",
               "format_weight", "mini_batches", "anchor_every",
               "difficulty", "eval_limit_synthetic", "eval_limit_gsm8k", "eval_max_new_tokens", "eval_batch_size",
               "eval_seed", "kl_prompts", "kl_max_new_tokens", "rollout_batch_size", "micro_batch_size")



def _per_task(values: list[str] | None, default: dict, flag: str) -> dict:
    """``["64"]`` -> 64 for every task; ``["arithmetic=48", "gsm8k=128"]`` -> per task (others keep defaults)."""
    out = dict(default)
    for v in values or []:
        if "=" in v:
            k, _, x = v.partition("=")
            if k not in TASKS:
                raise SystemExit(f"{flag}: unknown task {k!r} in {v!r}; tasks are {', '.join(TASKS)}")
            out[k] = int(x)
        else:
            out = {t: int(v) for t in TASKS}
    if any(x < 1 for x in out.values()):
        raise SystemExit(f"{flag} must be >= 1")
    return out


def as_per_task(v) -> dict:
    """A per-task budget (older JSON files hold one number for every task)."""
    return dict(v) if isinstance(v, dict) else {t: v for t in TASKS}

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=_DOC.split("\n\n")[0], epilog=_DOC.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_comparison_flags(p)
    _add_budget_flags(p, FULL, QUICK)
    _add_measure_flags(p, FULL, QUICK)
    _add_io_flags(p)
    return p


def _add_comparison_flags(p) -> None:
    """What is compared: the model, the recipes (and variants), the seeds and the tasks."""
    p.add_argument("--model", default="smollm2",
                   help="model to train and evaluate: 'smollm2' (the embedded SmolLM2-135M-Instruct, default), "
                        "a local HF directory or a hub id; loaded once in fp32 on the CPU")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), metavar="RECIPE",
                   help=f"recipes to compare (default: {' '.join(RECIPES)})")
    p.add_argument("--variant", nargs="+", action="append", default=[], metavar=("LABEL RECIPE", "KEY=VALUE"),
                   help="a recipe with some settings changed, compared under its own label: 'LABEL RECIPE "
                        "KEY=VALUE [KEY=VALUE ...]', e.g. '--variant grpo_token_mean grpo "
                        "algo.aggregation=token-mean', then name LABEL in --recipes (repeat the flag for more "
                        "variants). The overrides are tether config keys, applied after the comparison's own "
                        "settings; they are recorded with each run, and --resume refuses a run made with others")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], metavar="SEED",
                   help="training seeds; every recipe runs every seed (default: 0 1). Seeds are fixed in advance, "
                        "never chosen after looking at results")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS,
                   help="arithmetic: the synthetic task (held-out split for evaluation); gsm8k: GSM8K train "
                        "questions (first --eval-limit-gsm8k test problems for evaluation). Default: both")


def _add_budget_flags(p, f: dict, q: dict) -> None:
    """The training budget, identical for every recipe (``f``, ``q``: the full and --quick defaults)."""
    p.add_argument("--steps", nargs="+", default=None, metavar="N|TASK=N",
                   help="trainer steps per run: one number for every task, or per task like 'arithmetic=8 "
                        "gsm8k=4' (default 8; --quick 2)")
    p.add_argument("--prompts-per-step", type=int, default=None,
                   help=f"prompts per trainer step (default {f['prompts_per_step']}; --quick {q['prompts_per_step']})")
    p.add_argument("--samples", type=int, default=None,
                   help=f"samples per prompt, the group size G (default {f['samples']}; --quick {q['samples']})")
    p.add_argument("--max-new-tokens", nargs="+", default=None, metavar="N|TASK=N",
                   help="training response cap: one number for every task, or per task like 'arithmetic=48 "
                        "gsm8k=128' (default arithmetic=48 gsm8k=128; --quick 16 for both)")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate, the same for every recipe (default 1e-05)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature of the training rollouts (default 0.7: at 1.0 SmolLM2 answers the "
                        "arithmetic task correctly about a quarter as often as greedily, so most groups carry "
                        "no signal)")
    p.add_argument("--format-weight", type=float, default=0.0,
                   help="data.format_weight, the reward bonus for an answer in the requested '####' format "
                        "(default 0: correctness only; a 0.2 bonus was gamed by lists of '####' lines)")
    p.add_argument("--mini-batches", type=int, default=2,
                   help="train.mini_batches, optimizer steps per rollout batch, the same for every recipe (default 2: "
                        "the second step is off-policy, so ratios leave 1 and trust regions can bind)")
    p.add_argument("--anchor-every", type=int, default=4,
                   help="algo.anchor.every for the recipes whose anchor moves on a period (ema, reset); the fixed and "
                        "iterative anchors have none (default 4: 4 EMA updates in 16 steps)")
    p.add_argument("--difficulty", type=int, default=None,
                   help="arithmetic difficulty 1-4 for training and the held-out set (default: the task's default)")


def _add_measure_flags(p, f: dict, q: dict) -> None:
    """The held-out evaluation and the KL / entropy measurement."""
    p.add_argument("--eval-limit-synthetic", type=int, default=None,
                   help=f"held-out synthetic problems evaluated before/after (default {f['eval_limit_synthetic']}; "
                        f"--quick {q['eval_limit_synthetic']})")
    p.add_argument("--eval-limit-gsm8k", type=int, default=None,
                   help=f"first N GSM8K test problems evaluated before/after (default {f['eval_limit_gsm8k']}; "
                        f"--quick {q['eval_limit_gsm8k']})")
    p.add_argument("--eval-max-new-tokens", nargs="+", default=None, metavar="N|TASK=N",
                   help="greedy evaluation response cap, one number or per task (default arithmetic=96 gsm8k=256; "
                        "--quick arithmetic=16 gsm8k=32)")
    p.add_argument("--eval-batch-size", type=int, default=64,
                   help="sequences per generate call during evaluation (default 64)")
    p.add_argument("--kl-prompts", type=int, default=None,
                   help="held-out prompts on which the final policy samples one response each (temperature 1) for "
                        f"the KL to the initial model and the entropy (default {f['kl_prompts']}; "
                        f"--quick {q['kl_prompts']})")
    p.add_argument("--kl-max-new-tokens", nargs="+", default=None, metavar="N|TASK=N",
                   help="response cap of those samples, one number or per task (default: the training "
                        "--max-new-tokens of the task)")


def _add_io_flags(p) -> None:
    """Where things go, and what this command does (run, resume, re-render)."""
    p.add_argument("--data-dir", default=None,
                   help="directory with gsm8k_train.jsonl and gsm8k_test.jsonl (default: $TETHER_DATA_DIR, else "
                        "shared/data/math next to or above the repository, i.e. ../shared/data/math)")
    p.add_argument("--work-dir", default=None,
                   help="where the run directories go, as WORK/<task>/<recipe>-seed<seed> (default: "
                        f"{Path(tempfile.gettempdir()) / 'tether-compare-recipes'}; outside the repository)")
    p.add_argument("--out", default=None,
                   help="markdown report to write (e.g. docs/results.md); the plot goes next to it as "
                        "<stem>_rewards.png and all numbers as <stem>.json (default: WORK/results.md)")
    p.add_argument("--quick", action="store_true",
                   help="CI-size smoke run: 2 steps of 2 prompts x 2 samples, 16 new tokens, 8 evaluation problems, "
                        "4 KL prompts (each budget flag given explicitly still wins); works with a tiny --model")
    p.add_argument("--resume", action="store_true",
                   help="reuse the finished runs (and 'before' evaluations) of an existing <stem>.json made with "
                        "the same budgets; only missing or failed runs are run")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: re-render the markdown and the plot from the existing <stem>.json")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="also write each run's final checkpoint (policy, anchor, optimizer: ~2 GB for SmolLM2) "
                        "into its run directory; by default none is written, the final policy is evaluated in memory")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no per-step progress bars (the per-run progress lines are always printed)")


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    _resolve(a, p)
    return a


def _resolve(a, p) -> None:
    """Fill the defaults that depend on --quick or on other flags, and refuse inconsistent values."""
    base = QUICK if a.quick else FULL
    for k in ("prompts_per_step", "samples", "eval_limit_synthetic", "eval_limit_gsm8k", "kl_prompts"):
        if getattr(a, k) is None:
            setattr(a, k, base[k])
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if a.samples < 2:
        p.error("--samples must be >= 2 (group-relative advantages need at least two samples per prompt)")
    a.steps = _per_task(a.steps, base["steps"], "--steps")
    a.max_new_tokens = _per_task(a.max_new_tokens, base["max_new_tokens"], "--max-new-tokens")
    a.eval_max_new_tokens = _per_task(a.eval_max_new_tokens, base["eval_max_new_tokens"], "--eval-max-new-tokens")
    a.kl_max_new_tokens = _per_task(a.kl_max_new_tokens, a.max_new_tokens, "--kl-max-new-tokens")
    if a.eval_batch_size < 1:
        p.error("--eval-batch-size must be >= 1")
    from tether.config.recipes import RECIPES as ALL
    a.variants = parse_variants(a.variant, p.error)
    bad = [r for r in a.recipes if r not in ALL and r not in a.variants]
    if bad:
        p.error(f"unknown recipe(s) {bad}; tether has {', '.join(sorted(ALL))}"
                + (f"; --variant defines {', '.join(a.variants)}" if a.variants else ""))
    unused = [v for v in a.variants if v not in a.recipes]
    if unused:
        p.error(f"--variant {unused[0]} is defined but not named in --recipes; add it there or drop the flag")
    if len(set(a.recipes)) != len(a.recipes) or len(set(a.seeds)) != len(a.seeds) or len(set(a.tasks)) != len(a.tasks):
        p.error("--recipes, --seeds and --tasks must not repeat a value")
    from tether.tasks.arithmetic import DEFAULT_DIFFICULTY
    a.lr = 1e-5 if a.lr is None else a.lr
    if a.temperature <= 0 or a.mini_batches < 1 or a.anchor_every < 1:
        p.error("--temperature must be > 0, --mini-batches and --anchor-every >= 1")
    if a.lr < 0:
        p.error("--lr must be >= 0")
    a.difficulty = DEFAULT_DIFFICULTY if a.difficulty is None else a.difficulty
    if not 1 <= a.difficulty <= 4:
        p.error("--difficulty must be 1-4")
    a.work_dir = Path(a.work_dir) if a.work_dir else Path(tempfile.gettempdir()) / "tether-compare-recipes"
    a.out = Path(a.out) if a.out else a.work_dir / "results.md"
    a.data_dir = a.data_dir or bu.default_data_dir() or str(bu.ROOT.parent / "shared" / "data" / "math")



def parse_variants(items: list[list[str]], error) -> dict:
    """``[["grpo_tm", "grpo", "algo.aggregation=token-mean"]]`` -> ``{"grpo_tm": {"recipe": "grpo",
    "overrides": {"algo.aggregation": "token-mean"}}}``; each variant's config is validated here, before any run."""
    from tether.config import ConfigError, parse_overrides
    from tether.config.recipes import RECIPES as ALL
    from tether.resolve import load_config
    out = {}
    for item in items:
        if len(item) < 3:
            error(f"--variant {' '.join(item)}: give LABEL RECIPE KEY=VALUE [KEY=VALUE ...]")
        label, base, kvs = item[0], item[1], item[2:]
        if label in ALL or label in out:
            error(f"--variant label {label!r} is already a recipe or another variant's label; choose a new one")
        if not re.fullmatch(r"[A-Za-z0-9_.+-]+", label):
            error(f"--variant label {label!r}: use letters, digits and _ . + - only (it names a run directory)")
        if base not in ALL:
            error(f"--variant {label}: unknown recipe {base!r}; tether has {', '.join(sorted(ALL))}")
        try:
            ov = parse_overrides(kvs)
            load_config(None, ov, recipe_name=base)
        except ConfigError as e:
            error(f"--variant {label} ({base} {' '.join(kvs)}): {e}")
        out[label] = {"recipe": base, "overrides": ov}
    return out


def base_recipe(a, label: str) -> tuple[str, dict]:
    """The tether recipe behind a --recipes label and the overrides its --variant adds (none for a recipe)."""
    v = a.variants.get(label)
    return (v["recipe"], dict(v["overrides"])) if v else (label, {})


def settings_of(a) -> dict:
    """The settings that define the comparison (identical for every recipe and seed)."""
    from tether.config import RolloutConfig, TrainConfig
    return {
        "model": a.model, "steps": a.steps, "prompts_per_step": a.prompts_per_step, "samples": a.samples,
        "max_new_tokens": {t: a.max_new_tokens[t] for t in a.tasks}, "lr": a.lr, "temperature": a.temperature,
        "format_weight": a.format_weight, "mini_batches": a.mini_batches, "anchor_every": a.anchor_every,
        "difficulty": a.difficulty, "eval_limit_synthetic": a.eval_limit_synthetic,
        "eval_limit_gsm8k": a.eval_limit_gsm8k,
        "eval_max_new_tokens": {t: a.eval_max_new_tokens[t] for t in a.tasks}, "eval_batch_size": a.eval_batch_size,
        "eval_seed": 0, "kl_prompts": a.kl_prompts, "kl_max_new_tokens": {t: a.kl_max_new_tokens[t] for t in a.tasks},
        "rollout_batch_size": RolloutConfig().batch_size, "micro_batch_size": TrainConfig().micro_batch_size,
        "recipes": list(a.recipes), "variants": dict(a.variants), "seeds": list(a.seeds), "tasks": list(a.tasks),
        "data_dir": str(a.data_dir),
        "quick": bool(a.quick),
    }


def command_of(argv: list[str]) -> str:
    exe = sys.executable
    try:
        if Path(exe).absolute().is_relative_to(bu.ROOT):
            exe = os.path.relpath(exe, bu.ROOT)
    except ValueError:
        pass
    return " ".join(shlex.quote(x) for x in [exe, SCRIPT, *argv])


def git_commit() -> str | None:
    """Short hash of the checked-out commit (with '+dirty' if tracked files changed), or None outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=bu.ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=bu.ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")



def variant_text(label: str, variant: dict | None) -> str:
    if not variant:
        return f"recipe {label!r} as it is"
    return f"{label!r} = {variant['recipe']} with " + " ".join(f"{k}={v}" for k, v in variant["overrides"].items())
