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
policy samples one response per prompt at temperature 1, and tether's own exact-KL diagnostic
(``tether.passes.exact_kl_sample``: full-vocabulary log-probs of the final policy and of the
initial model through ``tether.logprobs.response_stats``) gives the token-mean exact
KL(pi_final || pi_initial) = sum_v p log(p / q); the report lists it with the token-mean entropy
of pi_final on those samples (and the initial model's entropy on its own samples, for reference).

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

import sys
from pathlib import Path

_BENCH = str(Path(__file__).resolve().parents[1])  # bench/, for the shared _benchutil
if _BENCH not in sys.path:
    sys.path.insert(0, _BENCH)
