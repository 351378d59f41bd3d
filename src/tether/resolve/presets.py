"""Settings a recipe or a task brings along, applied after the recipe's algorithm and before the
YAML file and the overrides (see ``tether.resolve.load_config``)."""

from __future__ import annotations

from typing import Any

from ..tasks.registry import task_presets

# Trainer settings a recipe brings along (the algorithm alone does not define them).
RECIPE_TRAINER_DEFAULTS: dict[str, dict[str, Any]] = {
    "dapo": {"rollout.dynamic_sampling": True, "rollout.overlong_buffer_frac": 0.25},
    # RPG ties pi to the sampler pi_old: the KL only acts when the update is off-policy.
    **{f"rpg_{r}{v}": {"train.mini_batches": 2} for r in ("", "reinforce_") for v in ("fkl", "rkl", "ufkl", "urkl")},
}


# `tether train --task NAME`: settings a task brings (after the recipe, before YAML and overrides): the
# ``preset`` of each task registered in tether.tasks.registry.TASKS that has one (math: the default,
# single-turn math with the arithmetic / GSM8K / MATH data; search: Search-R1's setting)
TASK_PRESETS: dict[str, dict[str, Any]] = task_presets()
