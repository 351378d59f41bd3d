"""Settings a recipe or a task brings along, applied after the recipe's algorithm and before the
YAML file and the overrides (see ``tether.config.load_config``)."""

from __future__ import annotations

from typing import Any

# Trainer settings a recipe brings along (the algorithm alone does not define them).
RECIPE_TRAINER_DEFAULTS: dict[str, dict[str, Any]] = {
    "dapo": {"rollout.dynamic_sampling": True, "rollout.overlong_buffer_frac": 0.25},
    # RPG ties pi to the sampler pi_old: the KL only acts when the update is off-policy.
    **{f"rpg_{r}{v}": {"train.mini_batches": 2} for r in ("", "reinforce_") for v in ("fkl", "rkl", "ufkl", "urkl")},
}


# `tether train --task NAME`: settings a task brings (after the recipe, before YAML and overrides).
TASK_PRESETS: dict[str, dict[str, Any]] = {
    "math": {},  # the default: single-turn math with the arithmetic / GSM8K / MATH data
    # Search-R1's setting: multi-turn search agent on the closed-pool multi-hop set, exact match only
    "search": {"rollout.agent": "search", "data.task": "multihop", "data.format_weight": 0.0,
               "rollout.n": 5, "rollout.max_new_tokens": 128},
}
