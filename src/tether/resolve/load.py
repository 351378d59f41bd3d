"""Resolving a run's config: recipe -> task preset -> YAML file -> dotted overrides -> the asynchronous default
correction (``train.async.correction``) -> ``check``."""

from __future__ import annotations

from typing import Any, Optional

from ..algo.registry import unknown_choice
from ..config.agent import drop_unread_env_keys, drop_unread_retriever_keys
from ..config.anchor import drop_unread_anchor_keys
from ..config.data import drop_unread_data_keys
from ..config.kl import drop_unread_kl_keys
from ..config.overrides import flatten, kind_at, parse
from ..config.recipes import RECIPES, recipe
from ..config.region import drop_unread_bounds
from ..config.schema import DEFAULT_RECIPE, Config
from ..errors import ConfigError
from ..sections import replace
from .presets import RECIPE_TRAINER_DEFAULTS, TASK_PRESETS
from .validate import check
from .validate_train import apply_async_correction
from .yaml_io import read_yaml_mapping


def load_config(path: Optional[str] = None, overrides: Optional[dict[str, Any]] = None,
                recipe_name: Optional[str] = None, task: Optional[str] = None) -> Config:
    """Resolve a Config: recipe -> task preset (``TASK_PRESETS``) -> YAML file -> overrides, then validate it."""
    file_vals: dict[str, Any] = {}
    if path:
        file_vals = flatten(read_yaml_mapping(path))
    overrides = dict(overrides or {})
    name = recipe_name or overrides.pop("recipe", None) or file_vals.pop("recipe", None) or DEFAULT_RECIPE
    file_vals.pop("recipe", None)
    overrides.pop("recipe", None)
    if name not in RECIPES:
        raise ConfigError(unknown_choice("recipe", name, RECIPES))
    if task is not None and task not in TASK_PRESETS:
        raise ConfigError(unknown_choice("task", task, TASK_PRESETS))

    def unread_dropped(vals: dict[str, Any], tree: dict) -> dict[str, Any]:
        """Region, anchor, KL, environment and data keys their kind, estimator, name or task (the one vals set, else
        the one so far) does not read, at an earlier release's defaults, dropped."""
        vals = drop_unread_bounds(vals, kind_at(tree, "algo.region"))
        vals = drop_unread_anchor_keys(vals, kind_at(tree, "algo.anchor"))
        vals = drop_unread_env_keys(vals, kind_at(tree, "rollout.agent.env", "name"))
        vals = drop_unread_retriever_keys(vals, kind_at(tree, "rollout.agent.env.retriever"))
        vals = drop_unread_data_keys(vals, kind_at(tree, "data", "task"))
        return drop_unread_kl_keys(vals, kind_at(tree, "algo.kl", "estimator"))

    layers = [(f"recipe {name}'s trainer defaults", RECIPE_TRAINER_DEFAULTS.get(name, {})),
              (f"task {task}'s preset", TASK_PRESETS[task] if task is not None else {}),
              (path or "config file", file_vals), ("override", overrides)]
    cfg = parse(Config, Config(recipe=name, algo=recipe(name)), layers, unread_dropped)
    # algo.name names the recipe, +custom when an algo.* key changed it (algo.name itself set by hand does not count,
    # nor the correction train.async.correction brings: a saved config, which holds it, resolves to the same name)
    cfg = apply_async_correction(cfg)
    base = apply_async_correction(Config(recipe=name, algo=recipe(name), rollout=cfg.rollout, train=cfg.train)).algo
    customized = replace(cfg.algo, name=base.name) != base
    cfg.algo.name = f"{name}+custom" if customized else name
    return check(cfg)
