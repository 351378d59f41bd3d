"""The run configuration: nested typed sections (pydantic), YAML files, recipes and dotted CLI overrides.

Resolution order (later wins): field defaults -> the recipe's algorithm (``--recipe`` or the
YAML's ``recipe:``) and its trainer defaults -> the YAML file -> ``key=value`` overrides.
Unknown keys, and keys that have no effect under the resolved settings, are errors with a
did-you-mean. The resolved config is written to the run directory as ``config.yaml``.

One module per concern; every name is importable from ``tether.config``:

    recipes.py     the algo section (AlgoConfig), its validation, and the named recipes (RECIPES, recipe)
    schema.py      the sections (pydantic models) and the held-out sets of eval.benchmarks=auto
    agent.py       rollout.agent (single_turn | multi_turn with its env section; search is env.name=search)
    engine.py      rollout.engine (hf | vllm)
    train_async.py train.async (none | max_staleness, workers, ...)
    presets.py     trainer settings a recipe brings (RECIPE_TRAINER_DEFAULTS), task presets (--task)
    yaml_io.py     reading a YAML config (trees only: no duplicate key, no recursive alias); save_config
    overrides.py   dotted keys: key=value parsing, type coercion, setting, flattening
    validate.py    check: every problem of a resolved config at once, section by section
    validate_train.py  its train.* section: sizes, micro-batches, asynchronous training (and its default
                   rollout correction, apply_async_correction)
    load.py        load_config: recipe -> task preset -> YAML -> overrides -> async correction -> check
    reference.py   docs/config.md from the fields' declaration comments
"""

# First: importing tether.search registers its task in tether.tasks.TASKS, which presets.py (TASK_PRESETS) and
# schema.py (HELD_OUT) read while this package initialises.
from .. import search as _search  # noqa: F401, I001

from .recipes import RECIPES, AlgoConfig, AnchorConfig, KLConfig, describe, recipe
from ..errors import ConfigError
from ..models import ModelConfig
from .load import load_config
from .overrides import apply_keys, coerce_value, flatten, parse_overrides, set_key
from .presets import RECIPE_TRAINER_DEFAULTS, TASK_PRESETS
from .reference import reference
from .schema import (DEFAULT_RECIPE, HELD_OUT, Config, DataConfig, EvalConfig, RolloutConfig, RunConfig,
                     TrainConfig, eval_benchmarks, evaluating, to_dict)
from .agent import (AgentConfig, EnvConfig, MultiTurnAgentConfig, OtherAgentConfig, RetrieverConfig,
                    SingleTurnAgentConfig, env_name, env_of)
from .engine import (VLLM_DTYPES, EngineConfig, HFEngineConfig, OtherEngineConfig, VLLMEngineConfig,
                     VLLMServerEngineConfig)
from .train_async import AsyncConfig
from .validate import check, check_device
from .validate_train import apply_async_correction
from .yaml_io import read_yaml_mapping, save_config

__all__ = [
    "DEFAULT_RECIPE", "HELD_OUT", "AsyncConfig", "EngineConfig", "HFEngineConfig",
    "OtherEngineConfig", "VLLMEngineConfig", "VLLMServerEngineConfig", "RECIPES", "RECIPE_TRAINER_DEFAULTS",
    "TASK_PRESETS",
    "VLLM_DTYPES", "AlgoConfig",
    "AnchorConfig", "Config", "KLConfig", "describe", "recipe",
    "ConfigError", "DataConfig", "EvalConfig", "ModelConfig", "RolloutConfig", "RunConfig", "AgentConfig",
    "EnvConfig", "MultiTurnAgentConfig", "OtherAgentConfig", "RetrieverConfig", "SingleTurnAgentConfig", "env_name",
    "env_of", "TrainConfig", "apply_async_correction", "check", "check_device", "eval_benchmarks", "evaluating",
    "load_config", "apply_keys", "coerce_value", "flatten", "parse_overrides", "set_key", "read_yaml_mapping",
    "reference", "save_config", "to_dict",
]
