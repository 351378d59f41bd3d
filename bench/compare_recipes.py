"""The results report: grpo, dapo, ema_pg, rpg_reinforce_urkl and atr_grpo on the same budget.

The entry script of the package ``bench/recipes_compare`` (``--help`` tells what it measures and
how to run it; docs/results.md and docs/benchmarks.md show it in use)::

    .venv/bin/python bench/compare_recipes.py --quick --out /tmp/w/results.md

The package's modules: ``args`` (the command line, budgets, --variant), ``running`` (the driver:
training runs, the "before" measurements, --resume merging), ``measure`` (held-out evaluation, the
exact KL to the initial model through ``tether.passes.exact_kl_sample``, entropy), ``results`` (the
JSON's paths and keys), ``report`` (markdown) and ``plot`` (PNG). The names below are re-exported
for tests/test_compare_recipes.py, which loads this file by path.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes_compare import running
from recipes_compare.args import parse_args  # noqa: F401
from recipes_compare.measure import token_kl_entropy  # noqa: F401
from recipes_compare.report import (  # noqa: F401
    PLACEHOLDER,
    anchor_updates_cell,
    clustered_se,
    recipe_trainer_text,
)

main = running.main

if __name__ == "__main__":
    sys.exit(main())
