"""Resolving a run's configuration (`tether.config` declares it) against what tether has installed: the recipe's
algorithm and trainer settings, a task's preset, a YAML file, ``key=value`` overrides, the asynchronous default
correction, then every problem at once, names checked against the registries of agents, environments, engines,
retrievers, tasks and rewards (before any model loads). Every entry point resolves through here.

    load.py        load_config: recipe -> task preset -> YAML -> overrides -> async correction -> check
    validate.py    check: every problem of a resolved config at once, section by section (check_device too)
    validate_train.py  its train.* section: sizes, micro-batches, asynchronous training (apply_async_correction)
    presets.py     trainer settings a recipe brings (RECIPE_TRAINER_DEFAULTS), task presets (--task)
    held_out.py    eval.benchmarks=auto: a task's held-out set (eval_benchmarks, evaluating)
    saved.py       a saved run's config (tether eval / export RUN, --resume)
    sft.py         tether sft's config: load_sft_config, check_sft, docs/sft.md's tables
    reference.py   docs/config.md from the declarations, with the registries' names
    yaml_io.py     reading a YAML config (trees only); save_config, the one writer of config.yaml
"""

# First: importing tether.search registers its task in tether.tasks.TASKS, which presets.py (TASK_PRESETS) and
# held_out.py (HELD_OUT) read while this package initialises.
from .. import search as _search  # noqa: F401, I001

from .held_out import HELD_OUT, eval_benchmarks, evaluating
from .load import load_config
from .presets import RECIPE_TRAINER_DEFAULTS, TASK_PRESETS
from .reference import reference
from .validate import check, check_device
from .validate_train import apply_async_correction
from .yaml_io import read_yaml_mapping, save_config

__all__ = ["HELD_OUT", "RECIPE_TRAINER_DEFAULTS", "TASK_PRESETS", "apply_async_correction", "check", "check_device",
           "eval_benchmarks", "evaluating", "load_config", "read_yaml_mapping", "reference", "save_config"]
