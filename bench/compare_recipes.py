"""The results report: grpo, dapo, ema_pg, rpg_reinforce_urkl and atr_grpo on the same budget.

Every run trains a fresh copy of the same initial model with one recipe and one seed on one
task, with identical budgets (trainer steps, prompts per step, samples per prompt, max new
tokens, learning rate, temperature, and the data order of the seed); only the recipe --
``load_config(..., recipe_name=...)``, including the trainer settings the recipe brings along
(``tether.config.RECIPE_TRAINER_DEFAULTS``: DAPO's dynamic sampling and overlong shaping, RPG's
two mini-batches) -- and the seed change. DAPO's dynamic sampling generates extra groups when a
group's rewards are all equal, so the generated tokens of every run are reported.

Tasks:

* ``arithmetic``: the synthetic task (``tether.tasks.arithmetic``), trained on its train
  split and evaluated on its held-out split (problem contents in the test buckets, never
  trained on under any seed);
* ``gsm8k``: trained on GSM8K **train** questions, evaluated on the first N GSM8K **test**
  problems (never trained on).

For each task the initial model is evaluated once ("before"); each run's final policy is
evaluated in memory right after training ("after"), with the same greedy settings, through
``tether.eval.evaluate``. Then, on the first ``--kl-prompts`` held-out prompts, the final
policy samples one response per prompt at temperature 1, and the chunked log-prob engine
(``tether.logprobs.response_stats``) gives, at every response token, the full-vocabulary
log-probs of the final policy and of the initial model (a frozen copy kept in memory): the
report lists the token-mean exact KL(pi_final || pi_initial) = sum_v p log(p / q) and the
token-mean entropy of pi_final on those samples (and the initial model's entropy on its own
samples, for reference).

Outputs: the markdown report ``--out`` (e.g. docs/results.md), ``<out>_rewards.png`` (training
reward and accuracy per step, one colour per recipe, one column per task), and ``<out>.json``
with every measured number, rewritten after every run (a crash or kill keeps what finished;
``--resume`` continues from it, ``--report-only`` re-renders the markdown and plot). A comparison
can run in parts: each ``--resume`` command may name other recipes or seeds, and the report covers
every run made so far. ``--variant LABEL RECIPE KEY=VALUE...`` adds a recipe with some settings
changed (an ablation) under its own label. Each training run writes its normal run directory
under ``--work-dir``.

Usage (from the repository root)::

    .venv/bin/python bench/compare_recipes.py --out docs/results.md              # the full comparison
    .venv/bin/python bench/compare_recipes.py --quick --out /tmp/w/results.md    # CI-size smoke run
    .venv/bin/python bench/compare_recipes.py --quick --model /path/to/tiny --out /tmp/w/r.md  # plumbing
    .venv/bin/python bench/compare_recipes.py --tasks arithmetic --recipes grpo grpo_tm \
        --variant grpo_tm grpo algo.aggregation=token-mean --out /tmp/w/r.md   # an ablation beside its recipe
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

RECIPES = ("grpo", "dapo", "ema_pg", "rpg_reinforce_urkl", "atr_grpo")
TASKS = ("arithmetic", "gsm8k")
SCRIPT = "bench/compare_recipes.py"
PLACEHOLDER = ("_Placeholder, written by hand after the run: what the tables and the plot show, including "
               "where EMA-PG or RPG do not beat GRPO at this scale. The script writes only measured numbers "
               "and no conclusions._")

# full-mode and --quick defaults of the budget flags (a flag given on the command line wins)
FULL = dict(steps={"arithmetic": 16, "gsm8k": 8}, prompts_per_step=6, samples=8, max_new_tokens={"arithmetic": 64, "gsm8k": 256},
            eval_limit_synthetic=500, eval_limit_gsm8k=200,
            eval_max_new_tokens={"arithmetic": 96, "gsm8k": 256}, kl_prompts=32)
QUICK = dict(steps={"arithmetic": 2, "gsm8k": 2}, prompts_per_step=2, samples=2, max_new_tokens={"arithmetic": 16, "gsm8k": 16},
             eval_limit_synthetic=8, eval_limit_gsm8k=8,
             eval_max_new_tokens={"arithmetic": 16, "gsm8k": 32}, kl_prompts=4)
# settings that must match for --resume to reuse earlier runs
BUDGET_KEYS = ("model", "steps", "prompts_per_step", "samples", "max_new_tokens", "lr", "temperature",
               "format_weight", "mini_batches", "anchor_every",
               "difficulty", "eval_limit_synthetic", "eval_limit_gsm8k", "eval_max_new_tokens", "eval_batch_size",
               "eval_seed", "kl_prompts", "kl_max_new_tokens", "rollout_batch_size", "micro_batch_size")


# =========================================================================== arguments


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


def _as_per_task(v) -> dict:
    """A per-task budget (older JSON files hold one number for every task)."""
    return dict(v) if isinstance(v, dict) else {t: v for t in TASKS}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    f, q = FULL, QUICK
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
                        "arithmetic task correctly about a quarter as often as greedily, so most groups carry no signal)")
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
    a = p.parse_args(argv)
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
    from tether.algo.recipes import RECIPES as ALL
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
    from tether.config import TrainConfig
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
    return a


def parse_variants(items: list[list[str]], error) -> dict:
    """``[["grpo_tm", "grpo", "algo.aggregation=token-mean"]]`` -> ``{"grpo_tm": {"recipe": "grpo",
    "overrides": {"algo.aggregation": "token-mean"}}}``; each variant's config is validated here, before any run."""
    from tether.algo.recipes import RECIPES as ALL
    from tether.config import ConfigError, load_config, parse_overrides
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
        "recipes": list(a.recipes), "variants": dict(a.variants), "seeds": list(a.seeds), "tasks": list(a.tasks), "data_dir": str(a.data_dir),
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


# =========================================================================== data


def check_data_dir(a) -> None:
    """Fail early, before any model is loaded, if GSM8K is asked for and its files are missing."""
    if "gsm8k" not in a.tasks:
        return
    d = Path(a.data_dir)
    missing = [n for n in ("gsm8k_train.jsonl", "gsm8k_test.jsonl") if not (d / n).is_file()]
    if missing:
        raise SystemExit(f"[compare] the data directory {d} lacks {', '.join(missing)}: the gsm8k task trains on "
                         f"GSM8K train and evaluates on GSM8K test. Pass --data-dir DIR (or set $TETHER_DATA_DIR) "
                         f"to a directory holding both files, or leave gsm8k out with --tasks arithmetic")


def eval_set(a, task: str):
    """(examples, reward function, description) of a task's held-out set; the same for every run."""
    from tether.tasks.arithmetic import ArithmeticTask
    from tether.tasks.benchmarks import load_benchmark
    from tether.tasks.rewards import load_reward
    if task == "arithmetic":
        ex = ArithmeticTask(seed=0, difficulty=a.difficulty, split="test").examples(a.eval_limit_synthetic)
        distinct = len({content_of(task, e) for e in ex})
        desc = (f"synthetic arithmetic, held-out split (content buckets never trained on), difficulty "
                f"{a.difficulty}, the first {len(ex)} problems of the seed-0 test stream ({distinct} distinct "
                f"start/operation contents)")
        return ex, load_reward("arithmetic"), desc
    b = load_benchmark("gsm8k", limit=a.eval_limit_gsm8k, data_dir=a.data_dir)
    if b.split != "test":
        raise RuntimeError(f"GSM8K evaluation must use the test split, got {b.split!r}")
    return b.examples, b.reward_fn, f"GSM8K test, the first {len(b.examples)} problems (training uses GSM8K train)"


# =========================================================================== measurements


def run_eval(model, tok, examples, reward_fn, a, task: str) -> dict:
    """Greedy avg@1 and friends on the held-out set (the library's evaluate())."""
    from tether.eval import evaluate
    res = evaluate(model, tok, examples, reward_fn, n=1, greedy=True, temperature=0.0,
                   max_new_tokens=a.eval_max_new_tokens[task], batch_size=a.eval_batch_size, seed=0,
                   show_progress=a.progress, desc=f"eval {task}")
    keep = ("avg@1", "mean_response_tokens", "truncation_rate", "no_answer_rate", "n_problems", "gen_tokens",
            "wall_time_s", "reward_errors")
    out = {k: float(res.metrics[k]) for k in keep if k in res.metrics}
    out["correct"] = [int(p["n_correct"]) for p in res.per_problem]  # per problem, for clustered errors
    return out


def content_of(task: str, example) -> str:
    """What makes two held-out problems the same problem: the arithmetic content (start value and
    operations; the wording differs) or, for GSM8K, the problem itself."""
    if task == "arithmetic":
        return json.dumps([example.meta["start"], example.meta["ops"]])
    return str(example.id)


def clustered_se(before: list[int], after: list[int] | None, clusters: list[str]) -> float | None:
    """Cluster-robust standard error of mean(after - before) (or of mean(before) when ``after`` is None)
    with problems grouped by content: sqrt(C/(C-1) * sum_c (sum_{i in c} (d_i - mean d))^2) / n. Problems that
    share a content are not independent draws, so this is the honest error bar (the binomial one assumes
    they are)."""
    d = [float(x) for x in before] if after is None else [float(y - x) for x, y in zip(before, after)]
    n = len(d)
    if n == 0 or len(clusters) != n:
        return None
    mean = sum(d) / n
    sums: dict[str, float] = {}
    for x, c in zip(d, clusters):
        sums[c] = sums.get(c, 0.0) + (x - mean)
    C = len(sums)
    if C < 2:
        return None
    return math.sqrt(C / (C - 1) * sum(v * v for v in sums.values())) / n


def token_kl_entropy(policy, initial, rb, *, micro: int = 2, chunk_size: int = 1024) -> dict:
    """Exact per-token KL(policy || initial) over the full vocabulary and the policy's entropy, at
    every response token of the rollout batch ``rb``; returns token means (and sums, counts).

    Both models go through ``tether.logprobs.response_stats`` with every vocabulary id as
    ``gather_ids`` (an expanded view, as in the trainer's ``_exact_kl_sample``), ``micro``
    responses at a time, so only [micro, T, V] log-probs exist at once:
    ``KL_t = sum_v p_t(v) (log p_t(v) - log q_t(v))``, ``H_t = -sum_v p_t(v) log p_t(v)``.
    """
    import torch

    from tether.logprobs import response_stats

    vocab = policy.get_output_embeddings().weight.shape[0]
    kl_sum, ent_sum, n_tok, kl_max = 0.0, 0.0, 0, 0.0
    modes = (policy.training, initial.training)
    policy.eval()
    initial.eval()
    try:
        with torch.no_grad():
            for s in range(0, len(rb), micro):
                mb = rb.select(list(range(s, min(s + micro, len(rb)))))
                if int(mb.response_mask.sum()) == 0:
                    continue
                every_id = torch.arange(vocab, device=mb.response_ids.device).expand(*mb.response_ids.shape, vocab)

                def stats(model, entropy):
                    return response_stats(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
                                          temperature=1.0, gather_ids=every_id, entropy=entropy,
                                          chunk_size=chunk_size)

                sp, s0 = stats(policy, True), stats(initial, False)
                lp, l0 = sp.ids_logp.double(), s0.ids_logp.double()  # [b, T, V] log-probs at every id
                kl = (lp.exp() * (lp - l0)).sum(-1)  # [b, T]
                m = mb.response_mask
                kl_sum += float(kl[m].sum())
                ent_sum += float(sp.entropy.double()[m].sum())
                n_tok += int(m.sum())
                kl_max = max(kl_max, float(kl[m].max()))
                del sp, s0, lp, l0, kl
    finally:
        policy.train(modes[0])
        initial.train(modes[1])
    return {"kl_to_initial": kl_sum / max(n_tok, 1), "entropy": ent_sum / max(n_tok, 1), "kl_token_max": kl_max,
            "kl_tokens": n_tok}


def kl_and_entropy(policy, initial, tok, examples, *, max_new_tokens: int, seed: int) -> dict:
    """:func:`token_kl_entropy` on one response per example sampled from ``policy`` at temperature 1
    (so the token mean estimates the expected per-token KL under the policy's own distribution)."""
    from tether.agents import make_agent
    from tether.config import RolloutConfig
    from tether.rollout import SamplingParams, make_engine

    t0 = time.perf_counter()
    agent = make_agent("single_turn", make_engine(RolloutConfig(batch_size=32), policy, tok), tok)
    rb = agent.rollout(examples, SamplingParams(n=1, temperature=1.0, max_new_tokens=max_new_tokens, seed=seed))
    out = token_kl_entropy(policy, initial, rb)
    out.update(kl_responses=len(rb), kl_mean_response_tokens=out["kl_tokens"] / max(len(rb), 1),
               kl_wall_s=time.perf_counter() - t0)
    return out


# =========================================================================== one run


def overrides_for(a, task: str, seed: int, run_dir: Path) -> dict:
    ov = {
        "model.name": a.model, "model.dtype": "float32", "model.device": "cpu",
        "data.task": task,
        "rollout.prompts_per_step": a.prompts_per_step, "rollout.n": a.samples,
        "rollout.max_new_tokens": a.max_new_tokens[task], "rollout.temperature": a.temperature,
        "data.format_weight": a.format_weight, "train.mini_batches": a.mini_batches,
        "train.steps": a.steps[task], "train.lr": a.lr, "train.seed": seed,
        "run.output_dir": str(run_dir), "run.save_every": 0, "run.exact_kl_samples": 0,
        "run.progress": bool(a.progress), "run.plot": False,
        "eval.before": False, "eval.after": False,  # evaluated here, before and after, on the same set for all
    }
    if task == "arithmetic":
        ov["data.difficulty"] = a.difficulty
    else:
        ov.update({"data.split": "train", "data.data_dir": str(a.data_dir)})
    return ov


_RUN_FILES = {"config.yaml", "metrics.jsonl", "samples.jsonl", "checkpoints", "curves.png", "reward_errors.log"}


def fresh_run_dir(path: Path) -> None:
    """Empty a run directory of an earlier run (only if it holds nothing but run files)."""
    if path.exists():
        extra = {p.name for p in path.iterdir()} - _RUN_FILES
        if extra:
            raise RuntimeError(f"{path} exists and holds files that are not a tether run's ({sorted(extra)}); "
                               f"refusing to delete it. Choose another --work-dir")
        shutil.rmtree(path)
    path.mkdir(parents=True)



def one_run(a, task: str, recipe: str, seed: int, base_model, tok, evals: dict) -> dict:
    """Train one (task, recipe, seed), evaluate its final policy, measure KL and entropy."""
    from tether.algo import describe
    from tether.config import RECIPE_TRAINER_DEFAULTS, load_config, save_config
    from tether.metrics import read_metrics
    from tether.train import Trainer

    run_dir = a.work_dir / task / f"{recipe}-seed{seed}"
    rec = {"task": task, "recipe": recipe, "seed": seed, "run_dir": str(run_dir), "status": "running"}
    base, variant_ov = base_recipe(a, recipe)
    if variant_ov:
        rec["variant"] = {"recipe": base, "overrides": variant_ov}
    ov = {**overrides_for(a, task, seed, run_dir), **variant_ov}  # a variant's own settings win
    cfg = load_config(None, ov, recipe_name=base)
    if cfg.algo.anchor.kind in ("ema", "reset") and "algo.anchor.every" not in variant_ov:
        ov["algo.anchor.every"] = a.anchor_every  # the comparison's anchor period (fixed anchors have none)
        cfg = load_config(None, ov, recipe_name=base)
    rec["algo"] = describe(cfg.algo)
    rec["anchor_kind"] = cfg.algo.anchor.kind  # what Tables 3-4 count as "anchor updates" depends on it
    rec["recipe_trainer_settings"] = dict(RECIPE_TRAINER_DEFAULTS.get(base, {}))
    fresh_run_dir(run_dir)
    save_config(cfg, run_dir / "config.yaml")
    policy = copy.deepcopy(base_model)  # a fresh copy of the initial weights for every run
    trainer = Trainer(cfg, run_dir, model=policy, tokenizer=tok, log=lambda *x: print(*x, flush=True))
    if not a.keep_checkpoints:
        trainer.save = lambda: None  # the final policy is evaluated in memory; skip the ~2 GB write
    t0 = time.perf_counter()
    trainer.run()
    rec["train_wall_s"] = time.perf_counter() - t0
    rows = read_metrics(run_dir)
    # every numeric metric of every step (reward, accuracy, clip fractions, KL to the anchor, entropy, ...)
    rec["steps"] = [{k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                    for r in rows]
    rec["gen_tokens"] = int(sum(r.get("gen_tokens", 0) for r in rows))
    rec["train_tokens"] = int(sum(r.get("train_tokens", 0) for r in rows))
    rec["gen_rounds"] = int(sum(r.get("ds_rounds", 1) for r in rows))
    del trainer
    examples, reward_fn, _ = evals[task]
    t1 = time.perf_counter()
    rec["eval"] = run_eval(policy, tok, examples, reward_fn, a, task)
    rec["eval_wall_s"] = time.perf_counter() - t1
    rec.update(kl_and_entropy(policy, base_model, tok, examples[:a.kl_prompts],
                              max_new_tokens=a.kl_max_new_tokens[task], seed=seed))
    rec["status"] = "ok"
    del policy
    gc.collect()
    return rec


# =========================================================================== results file


def paths_of(out: Path) -> tuple[Path, Path]:
    return out.with_suffix(".json"), out.with_name(out.stem + "_rewards.png")


def run_key(task: str, recipe: str, seed: int) -> str:
    return f"{task}/{recipe}/seed{seed}"


# =========================================================================== report


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(float(x)) else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _sci(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def _f3(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _f1(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _dur(s) -> str:
    s = float(s or 0)
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m{int(s % 60):02d}s" if s >= 3600 else \
        f"{int(s // 60)}m{int(s % 60):02d}s"


def runs_of(res: dict, task: str, recipe: str) -> list[dict]:
    return [res["runs"][run_key(task, recipe, s)] for s in res["settings"]["seeds"]
            if run_key(task, recipe, s) in res["runs"]]


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


def recipe_trainer_text(settings: dict) -> str:
    """The trainer settings the compared recipes bring with them ('none' when none does)."""
    parts = ["{}: {}".format(r, ", ".join(f"`{k}={v}`" for k, v in s.items())) for r, s in settings.items() if s]
    if not parts:
        return "none"
    text = "; ".join(parts)
    if any(s.get("rollout.dynamic_sampling") for s in settings.values()):
        text += ". Dynamic sampling generates more than the other recipes; the generated tokens of every run are in Table 4"
    return text


def render(res: dict, out: Path, png: Path) -> str:
    st, info = res["settings"], res["machine"]
    md = bu.md_table
    L = ["# Results: recipe comparison", "",
         "Written by `bench/compare_recipes.py` from the runs described below; every number in this file was "
         "measured by it (all of them are also in "
         f"[`{paths_of(out)[0].name}`]({paths_of(out)[0].name})).", ""]
    L += ["## How these numbers were made", ""]
    cmds = res.get("commands", [])
    L.append("Command(s), from the repository root" + (" (later ones resumed the earlier)" if len(cmds) > 1 else "")
             + ":")
    L += ["", "```", *[c["command"] for c in cmds], "```", ""]
    for c in cmds:
        L.append(f"- {c['started']}" + (f" (commit `{c['commit']}`)" if c.get("commit") else "")
                 + f": ran {c.get('runs_run', '?')} run(s), wall time {_dur(c.get('wall_s'))}"
                 + (" (interrupted)" if c.get("interrupted") else "") + (f". {c['note']}" if c.get("note") else ""))
    L += [f"- total wall time: {_dur(sum(float(c.get('wall_s') or 0) for c in cmds))}",
          f"- machine: {info['nproc']} CPUs (`nproc`), {info['cpu']}, {info['memory']} RAM; torch threads "
          f"{info.get('torch_threads')}",
          f"- versions: python {info['python']}, torch {info['torch']}, transformers {info['transformers']}",
          f"- model: `{st['model']}`" + (" (SmolLM2-135M-Instruct, embedded GGUF dequantized to fp32)"
                                          if st["model"] == "smollm2" else "") + ", fp32, CPU", ""]
    L += ["## Budgets (identical for every recipe)", "",
          f"- recipes: {', '.join(st['recipes'])}; seeds: {', '.join(map(str, st['seeds']))} (every recipe runs "
          f"every seed; the seeds were fixed before any run); tasks: {', '.join(st['tasks'])}",
          f"- training per run: trainer steps " + ", ".join(f"{t} {n}" for t, n in _as_per_task(st["steps"]).items()
                                                            if t in st["tasks"])
          + f" x {st['prompts_per_step']} prompts x {st['samples']} "
          f"samples at temperature {st.get('temperature', 1.0):g}; max new tokens "
          + ", ".join(f"{t} {n}" for t, n in st["max_new_tokens"].items())
          + f"; AdamW lr {st['lr']:g} (constant), {st.get('mini_batches', 1)} optimizer step(s) per rollout batch "
            f"(train.mini_batches), gradient clip 1.0, micro-batches of {st['micro_batch_size']}; EMA anchors move "
            f"every {st.get('anchor_every', '-')} steps (algo.anchor.every); otherwise "
            "each recipe's own algorithm settings (`tether.algo.recipes`)",
          *([f"- variants (`--variant`): " + "; ".join(_variant_text(k, v) for k, v in st["variants"].items())]
            if st.get("variants") else []),
          "- algorithms (`tether.algo.describe`): " + "; ".join(
              f"`{d}`" for d in dict.fromkeys(r.get("algo") for r in res["runs"].values() if r.get("algo"))),
          "- data order: the seed fixes it (the synthetic stream, or the shuffled GSM8K train order), so every "
          "recipe sees the same prompts in the same order, except that DAPO's dynamic sampling draws extra "
          "prompts when it refills",
          "- recipe-specific trainer settings (part of the recipe, `tether.config.RECIPE_TRAINER_DEFAULTS`): "
          + recipe_trainer_text(res.get("recipe_trainer_settings", {})),
          "- training reward: correctness (1/0)" + (f" + {st.get('format_weight', 0.2):g} if the answer is in the "
                                                    "requested `####` format" if st.get("format_weight", 0.2) else
                                                    " only (no format bonus)") + "; DAPO's "
          "reward also carries its overlong penalty (so its reward curve is not on exactly the same scale; the "
          "accuracy curves are)",
          f"- evaluation (before and after, identical): greedy, one response per problem, max new tokens "
          + ", ".join(f"{t} {n}" for t, n in st["eval_max_new_tokens"].items())
          + ", accuracy = `avg@1` of `tether.eval.evaluate`",
          f"- KL and entropy: on the first {st['kl_prompts']} held-out prompts, one response each sampled from "
          f"the final policy at temperature 1 (max new tokens "
          + ", ".join(f"{t} {n}" for t, n in st["kl_max_new_tokens"].items())
          + "); at every response token the full-vocabulary log-probs of the final policy and of the initial "
          "model (`tether.logprobs.response_stats`): KL = token mean of sum_v p log(p/q), entropy = token mean "
          "of -sum_v p log p of the final policy, in nats", ""]
    for task in st["tasks"]:
        b = res.get("before", {}).get(task)
        if b:
            L.append(f"- {task} held-out set: {b.get('description', '')}")
    L += ["", "## Reward curves", "", f"![training curves per step]({png.name})", "",
          "Per trainer step: training reward and accuracy of the sampled responses, the token KL to the anchor, "
          "the policy's entropy, the clip fraction and the response length. "
          "Thick line: mean over seeds; band: min-max over seeds; thin lines: the individual seeds.", ""]

    # Table 1
    L += ["## Table 1: held-out accuracy before and after training", "",
          "Greedy accuracy in %; 'before' is the initial model (one evaluation per task), 'after' each run's "
          "final policy; mean over the seeds that finished, then each seed. s.e.: binomial standard error of "
          "one accuracy on this many problems at the 'before' accuracy.", ""]
    for task in st["tasks"]:
        b = res.get("before", {}).get(task, {})
        be = b.get("eval", {})
        acc0 = _num(be.get("avg@1"))
        n = int(be.get("n_problems", 0) or 0)
        se = math.sqrt(acc0 * (1 - acc0) / n) if acc0 is not None and n else None
        L += [f"### {task} ({n} problems)", ""]
        rows = []
        for recipe in st["recipes"]:
            rs = runs_of(res, task, recipe)
            ok = [r for r in rs if r.get("status") == "ok"]
            after = [_num(r["eval"].get("avg@1")) for r in ok]
            m = _mean(after)
            per = ", ".join(f"s{r['seed']}: " + (_pct(_num(r["eval"].get("avg@1"))) if r.get("status") == "ok"
                                                 else "failed") for r in rs) or "not run"
            contents, c0 = b.get("contents"), be.get("correct")
            ses = [clustered_se(c0, r["eval"].get("correct"), contents) if contents and c0 and r["eval"].get("correct")
                   else None for r in ok]
            rows.append([recipe, _pct(acc0), _pct(m),
                         "-" if m is None or acc0 is None else f"{100 * (m - acc0):+.1f}", per,
                         ", ".join(_pct(x) for x in ses) or "-",
                         _f1(_mean([_num(r["eval"].get("mean_response_tokens")) for r in ok])),
                         _pct(_mean([_num(r["eval"].get("truncation_rate")) for r in ok]))])
        L += [md(["recipe", "before %", "after % (mean)", "change (points)", "after % per seed",
                  "s.e. of each seed's change (clustered)", "mean response tokens (after)", "truncated % (after)"],
                 rows), ""]
        contents = b.get("contents")
        n_c = len(set(contents)) if contents else None
        cse = clustered_se(be["correct"], None, contents) if contents and be.get("correct") else None
        L.append(f"Before: {_pct(acc0)} % (binomial s.e. {_pct(se)} points"
                 + (f"; clustered by the {n_c} distinct problem contents, {_pct(cse)} points" if cse is not None
                    else "") + f"), mean response {_f1(_num(be.get('mean_response_tokens')))} tokens, "
                 f"truncated {_pct(_num(be.get('truncation_rate')))} %. The clustered standard errors group the "
                 "held-out problems by content (arithmetic: start value and operations, told in different words), "
                 "since problems that share one are not independent; '-' where a run kept no per-problem results.")
        L.append("")

    # Table 2
    L += ["## Table 2: KL to the initial model and entropy at the end", "",
          "Token-mean exact KL(pi_final || pi_initial) over the full vocabulary and token-mean entropy of "
          "pi_final (nats), on the final policy's own temperature-1 samples (see Budgets); mean over seeds, then "
          "each seed. The 'initial model' row is the initial model measured the same way on its own samples "
          "(its KL to itself is a check: it must be 0).", ""]
    for task in st["tasks"]:
        b = res.get("before", {}).get(task, {})
        L += [f"### {task}", ""]
        rows = [["initial model", _sci(_num(b.get("kl_to_initial"))), "-", _f3(_num(b.get("entropy"))), "-",
                 str(b.get("kl_tokens", "-"))]]
        for recipe in st["recipes"]:
            rs = runs_of(res, task, recipe)
            ok = [r for r in rs if r.get("status") == "ok"]
            per_kl = ", ".join(f"s{r['seed']}: " + (_sci(_num(r.get("kl_to_initial"))) if r.get("status") == "ok"
                                                    else "failed") for r in rs) or "not run"
            per_h = ", ".join(f"s{r['seed']}: " + (_f3(_num(r.get("entropy"))) if r.get("status") == "ok"
                                                   else "failed") for r in rs) or "not run"
            rows.append([recipe, _sci(_mean([_num(r.get("kl_to_initial")) for r in ok])), per_kl,
                         _f3(_mean([_num(r.get("entropy")) for r in ok])), per_h,
                         ", ".join(str(r.get("kl_tokens")) for r in ok) or "-"])
        L += [md(["recipe", "KL to initial (mean)", "KL per seed", "entropy (mean)", "entropy per seed",
                  "tokens measured"], rows), ""]

    # Table 3: what the trust regions and anchors did during training
    L += ["## Table 3: trust regions, anchors and dynamics during training", "",
          "Per-step training metrics, mean over the run's steps, then over seeds (each seed's in brackets for the "
          "total). Clip fractions are fractions of response tokens whose gradient the trust region removes "
          "(`clip_frac_low`: ratio below the region with a negative advantage, `clip_frac_high`: above it with a "
          "positive one, `clip_frac`: total, incl. dual-clip), averaged over the optimizer steps of a trainer step; "
          "with one optimizer step per rollout they are 0 by construction. Token KL to the anchor: the recipe's "
          "KL estimator at the first and the last step (its anchor: the initial model for grpo / atr_grpo, the "
          "EMA for ema_pg, the sampler for rpg). Entropy and response length: first step -> last step.", ""]
    for task in st["tasks"]:
        rows = []
        for recipe in st["recipes"]:
            ok = [r for r in runs_of(res, task, recipe) if r.get("status") == "ok" and r.get("steps")]
            if not ok:
                rows.append([recipe] + ["-"] * 8)
                continue

            def run_mean(r, k):
                return _mean([_num(x.get(k)) for x in r["steps"] if x.get("step", 0) > 0])

            def first_last(k, fmt):
                f = _mean([_num(next((x.get(k) for x in r["steps"] if x.get("step", 0) > 0), None)) for r in ok])
                la = _mean([_num(r["steps"][-1].get(k)) for r in ok])
                return f"{fmt(f)} -> {fmt(la)}"

            tot = [run_mean(r, "clip_frac") for r in ok]
            rows.append([recipe, _pct(_mean([run_mean(r, "clip_frac_low") for r in ok])),
                         _pct(_mean([run_mean(r, "clip_frac_high") for r in ok])),
                         _pct(_mean(tot)) + " (" + ", ".join(_pct(x) for x in tot) + ")",
                         first_last("kl", _sci), first_last("entropy", _f3), first_last("response_len", _f1),
                         first_last("truncation_rate", _pct),
                         anchor_updates_cell(ok)])
        L += [f"### {task}", "", md(["recipe", "clip low %", "clip high %", "clip total % (per seed)",
                                     "token KL to anchor, first -> last", "entropy first -> last",
                                     "response tokens first -> last", "truncated % first -> last",
                                     "anchor updates"], rows), ""]

    # Table 4
    L += ["## Table 4: per-run wall time and generated tokens", "",
          "train s: the training loop (rollouts and updates); eval s: the greedy held-out evaluation; KL s: "
          "sampling and the two full-vocabulary passes. generated tokens: all tokens sampled during training "
          "(DAPO's refills included); rounds: generation rounds (steps, plus DAPO's refills); reward: mean "
          "training reward of the first and the last step; anchor updates: EMA updates / resets of the KL "
          "anchor during the run (0 for a fixed anchor, and for an EMA anchor whose period exceeds the steps; "
          "'every step (sampler)' for the iterative anchor, which is the sampler itself and so moves with every "
          "step without an update of its own).", ""]
    rows = []
    for task in st["tasks"]:
        for recipe in st["recipes"]:
            for s in st["seeds"]:
                r = res["runs"].get(run_key(task, recipe, s))
                if r is None:
                    rows.append([task, recipe, str(s), "not run"] + ["-"] * 8)
                    continue
                if r.get("status") != "ok":
                    err = (r.get("error") or "").strip().splitlines()
                    msg = err[-1] if err else "unknown error"
                    rows.append([task, recipe, str(s), f"failed: `{msg[:150].replace('|', '/')}`"] + ["-"] * 8)
                    continue
                stp = r.get("steps", [])
                rew = f"{_f3(_num(stp[0].get('reward_mean')))} -> {_f3(_num(stp[-1].get('reward_mean')))}" if stp \
                    else "-"
                rows.append([task, recipe, str(s), "ok", f"{r['train_wall_s']:.0f}", f"{r['eval_wall_s']:.0f}",
                             f"{r['kl_wall_s']:.0f}", str(r["gen_tokens"]), str(r["gen_rounds"]),
                             str(r["train_tokens"]), rew, anchor_updates_cell([r]) if stp else "-"])
    L += [md(["task", "recipe", "seed", "status", "train s", "eval s", "KL s", "generated tokens", "rounds",
              "train tokens", "reward first -> last", "anchor updates"], rows), ""]
    bt = [f"{t} {_dur(b.get('wall_s'))}" for t, b in res.get("before", {}).items()]
    if bt:
        L += [f"Initial-model measurements (evaluation + KL/entropy), once per task: {', '.join(bt)}.", ""]
    L += ["### Reading these numbers", "", PLACEHOLDER, ""]
    return "\n".join(L)


def _union(first: list, then: list) -> list:
    """The distinct values of ``first`` then ``then``, in order."""
    return list(dict.fromkeys([*first, *then]))


def merged_lists(first: dict, then: dict) -> dict:
    """The recipes, seeds and tasks of ``first`` then ``then`` (distinct, in order; seeds sorted)."""
    return {"recipes": _union(first.get("recipes", []), then.get("recipes", [])),
            "seeds": sorted(set(first.get("seeds", [])) | set(then.get("seeds", []))),
            "tasks": _union(first.get("tasks", []), then.get("tasks", []))}


def _variant_text(label: str, variant: dict | None) -> str:
    if not variant:
        return f"recipe {label!r} as it is"
    return f"{label!r} = {variant['recipe']} with " + " ".join(f"{k}={v}" for k, v in variant["overrides"].items())


def anchor_kind(run: dict) -> str | None:
    """The run's anchor kind (fixed / ema / reset / iterative): stored since session 8; older records only
    keep the algorithm description (`tether.algo.describe`), whose ``anchor=<kind>`` field says the same."""
    if run.get("anchor_kind"):
        return run["anchor_kind"]
    m = re.search(r"\banchor=(\w+)", run.get("algo") or "")
    return m.group(1) if m else None


def anchor_updates_cell(runs: list[dict]) -> str:
    """Tables 3-4's 'anchor updates': the EMA updates / resets of the last step (mean over the runs), or
    'every step (sampler)' for the iterative anchor, which *is* the sampler and has no update count."""
    if runs and all(anchor_kind(r) == "iterative" for r in runs):
        return "every step (sampler)"
    return str(int(_mean([_num(r["steps"][-1].get("anchor_updates")) for r in runs]) or 0))


def reported(res: dict) -> dict:
    """``res`` with the recipes, seeds and tasks of every run it holds in its settings (in the order they ran,
    then the ones named but not run), so a comparison made in parts -- or by older versions of this script,
    which kept only the last command's lists -- reports all its runs."""
    runs = list(res.get("runs", {}).values())
    ran = {"recipes": [r["recipe"] for r in runs], "seeds": [r["seed"] for r in runs],
           "tasks": [r["task"] for r in runs]}  # every run record has all three (one_run, and failures)
    return {**res, "settings": {**res["settings"], **merged_lists(ran, res["settings"])}}


def write_report(res: dict, out: Path) -> None:
    res = reported(res)
    js, png = paths_of(out)
    make_plot(res, png)
    text = render(res, out, png)
    head = "### Reading these numbers"
    if out.exists():  # a hand-written reading survives a re-render (--resume, --report-only) of the tables
        old = out.read_text()
        reading = old.split(head, 1)[1].strip() if head in old else ""
        if reading and reading != PLACEHOLDER:
            text = text.replace(PLACEHOLDER, reading, 1)
            print(f"[compare] {out}: kept its hand-written '{head}'; check it against the new tables", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"[compare] wrote {out}, {png} and {js}", flush=True)


# =========================================================================== driver


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    js, _ = paths_of(a.out)
    if a.report_only:
        if not js.is_file():
            raise SystemExit(f"[compare] --report-only needs {js}")
        write_report(json.loads(js.read_text()), a.out)
        return 0
    check_data_dir(a)
    from tether.metrics import write_json_atomic
    settings = settings_of(a)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t_start = time.perf_counter()
    import torch

    from tether.config import RECIPE_TRAINER_DEFAULTS

    info = bu.machine_info()
    info["torch_threads"] = torch.get_num_threads()
    res = {"settings": settings, "machine": info, "commands": [], "before": {}, "runs": {},
           "recipe_trainer_settings": {r: dict(RECIPE_TRAINER_DEFAULTS.get(base_recipe(a, r)[0], {}))
                                       for r in a.recipes}}
    if a.resume and js.is_file():
        old = json.loads(js.read_text())
        diff = [k for k in BUDGET_KEYS if old.get("settings", {}).get(k) != settings.get(k)]
        if diff:
            raise SystemExit(f"[compare] --resume: {js} was made with other settings ({', '.join(diff)}); "
                             f"rerun without --resume or with the same budgets")
        res["commands"] = old.get("commands", [])
        res["before"] = dict(old.get("before", {}))
        # a comparison run in parts (some recipes or seeds per command) reports everything run so far
        ost = old.get("settings", {})
        settings.update(merged_lists(ost, settings))
        settings["variants"] = {**ost.get("variants", {}), **a.variants}
        res["recipe_trainer_settings"] = {**old.get("recipe_trainer_settings", {}), **res["recipe_trainer_settings"]}
        res["runs"] = {k: r for k, r in old.get("runs", {}).items() if r.get("status") == "ok"}
        for k, r in res["runs"].items():  # a label must mean the same recipe and overrides as before
            if r.get("recipe") in a.recipes and r.get("variant") != a.variants.get(r.get("recipe")):
                raise SystemExit(f"[compare] --resume: run {k} in {js} was made as "
                                 f"{_variant_text(r.get('recipe'), r.get('variant'))}, but this command defines "
                                 f"{_variant_text(r.get('recipe'), a.variants.get(r.get('recipe')))}; use another "
                                 f"label, or the same --variant")
    cmd = {"command": command_of(argv), "started": started, "commit": git_commit(), "wall_s": 0.0, "runs_run": 0,
           "interrupted": True}
    res["commands"].append(cmd)

    def save():
        cmd["wall_s"] = time.perf_counter() - t_start
        write_json_atomic(js, res)

    # seed-major within a task: if the comparison is cut short, every recipe has the same seeds done
    plan = [(t, r, s) for t in a.tasks for s in a.seeds for r in a.recipes]
    todo = [p for p in plan if run_key(*p) not in res["runs"]]
    print(f"[compare] {len(plan)} runs ({len(plan) - len(todo)} reused): recipes {' '.join(a.recipes)}; seeds "
          f"{' '.join(map(str, a.seeds))}; tasks {' '.join(a.tasks)}; {a.steps} steps x {a.prompts_per_step} "
          f"prompts x {a.samples} samples, max new tokens {a.max_new_tokens}, lr {a.lr:g}; eval greedy "
          f"{a.eval_max_new_tokens} tokens; work dir {a.work_dir}; results {js}", flush=True)
    save()

    if not todo and all(t in res["before"] for t in a.tasks):
        cmd["interrupted"] = False
        save()
        write_report(res, a.out)
        print("[compare] nothing left to run", flush=True)
        return 0
    from tether.models import ModelConfig, load_model
    print(f"[compare] loading {a.model!r} (once; every run trains a fresh copy)", flush=True)
    base_model, tok = load_model(ModelConfig(name=a.model, dtype="float32", device="cpu"))
    evals = {t: eval_set(a, t) for t in a.tasks}
    try:
        for task in a.tasks:
            if task in res["before"]:
                continue
            t0 = time.perf_counter()
            examples, reward_fn, desc = evals[task]
            print(f"[compare] before: evaluating the initial model on {task} ({len(examples)} problems) "
                  f"[elapsed {_dur(time.perf_counter() - t_start)}]", flush=True)
            b = {"description": desc, "eval": run_eval(base_model, tok, examples, reward_fn, a, task),
                 "contents": [content_of(task, e) for e in examples]}
            b.update(kl_and_entropy(base_model, base_model, tok, examples[:a.kl_prompts],
                                    max_new_tokens=a.kl_max_new_tokens[task], seed=0))
            b["wall_s"] = time.perf_counter() - t0
            res["before"][task] = b
            print(f"[compare] before {task}: accuracy {_pct(b['eval']['avg@1'])} %, entropy {b['entropy']:.3f}, "
                  f"{_dur(b['wall_s'])}", flush=True)
            save()
        run_times = []
        for i, (task, recipe, seed) in enumerate(todo, 1):
            el = time.perf_counter() - t_start
            eta = f", ~{_dur(sum(run_times) / len(run_times) * (len(todo) - i + 1))} left" if run_times else ""
            print(f"[compare] run {i}/{len(todo)}: task {task}, recipe {recipe}, seed {seed} "
                  f"[elapsed {_dur(el)}{eta}]", flush=True)
            t0 = time.perf_counter()
            try:
                rec = one_run(a, task, recipe, seed, base_model, tok, evals)
                print(f"[compare] run {i}/{len(todo)} done in {_dur(time.perf_counter() - t0)}: accuracy "
                      f"{_pct(res['before'][task]['eval']['avg@1'])} -> {_pct(rec['eval']['avg@1'])} %, KL to "
                      f"initial {rec['kl_to_initial']:.3e}, entropy {rec['entropy']:.3f}, generated "
                      f"{rec['gen_tokens']} tokens", flush=True)
            except Exception as e:  # record, keep going with the other runs
                tb = traceback.format_exc()
                print(f"[compare] run {i}/{len(todo)} ({task} {recipe} seed {seed}) FAILED:\n{tb}", file=sys.stderr,
                      flush=True)
                rec = {"task": task, "recipe": recipe, "seed": seed, "status": "failed",
                       "error": f"{type(e).__name__}: {e}\n{tb}"}
                gc.collect()
            rec["wall_s"] = time.perf_counter() - t0
            run_times.append(rec["wall_s"])
            res["runs"][run_key(task, recipe, seed)] = rec
            cmd["runs_run"] += 1
            save()
        cmd["interrupted"] = False
    finally:
        save()
        write_report(res, a.out)
    failed = [k for k, r in res["runs"].items() if r.get("status") != "ok"]
    print(f"[compare] finished in {_dur(time.perf_counter() - t_start)}; "
          f"{len(plan) - len(failed)}/{len(plan)} runs ok" + (f"; failed: {', '.join(failed)}" if failed else ""),
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
