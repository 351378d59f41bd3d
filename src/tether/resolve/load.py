"""Resolving a run's config: recipe -> task preset -> YAML file -> dotted overrides -> the asynchronous default
correction (``train.async.correction``) -> ``check``."""

from __future__ import annotations

from typing import Any, Optional

from ..algo.registry import unknown_choice
from ..config.agent import ENV, RETRIEVER
from ..config.anchor import ANCHOR
from ..config.data import DATA
from ..config.kl import KL
from ..config.overrides import flatten, kind_at, parse
from ..config.recipes import RECIPES, recipe
from ..config.region import REGION
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
        for c in (REGION, ANCHOR, ENV, RETRIEVER, DATA, KL):
            vals = c.drop_unread(vals, kind_at(tree, c.at, c.key))
        return vals

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
