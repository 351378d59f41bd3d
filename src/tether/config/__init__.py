"""The run configuration's declarations: nested typed sections (pydantic), at the bottom of the house. They import
only pydantic, the standard library and tether's shared bottom modules (``sections``, ``errors``, ``userio``) and
the algorithms' registries (``tether.algo``, which imports only torch); nothing here imports an agent, an
environment, a task, an engine or the model loader. Resolving a config against those (recipes, task presets, YAML
files, overrides, the registries' names) is `tether.resolve` (``load_config``, ``check``).

One module per concern; every name is importable from ``tether.config``:

    recipes.py     the algo section (AlgoConfig), its validation, and the named recipes (RECIPES, recipe)
    region.py      algo.region (a section per trust-region kind)
    anchor.py      algo.anchor (a section per anchor kind)
    kl.py          algo.kl (a section per family of KL estimators, chosen by algo.kl.estimator)
    data.py        data (a section per kind of task, chosen by data.task)
    schema.py      the sections (pydantic models): rollout, train (with OptimizerConfig), run, eval; Config
    model.py       model (ModelConfig, DTYPES)
    agent.py       rollout.agent (single_turn | multi_turn with its env section; search is env.name=search)
    engine.py      rollout.engine (hf | vllm | vllm_server)
    train_async.py train.async (none | max_staleness, workers, ...)
    sft.py         tether sft's sections (SFTConfig)
    flags.py       entry points' flags generated from the sections (tether eval, tether demos) and their presets
    overrides.py   dotted keys: key=value parsing, setting into one mapping, one parse, flattening
    migration.py   keys of the earlier flat layout: their one-line "moved to" errors, saved runs read anew
"""

from ..errors import ConfigError
from .agent import (
                    AgentConfig,
                    EnvConfig,
                    MultiTurnAgentConfig,
                    OtherAgentConfig,
                    RetrieverConfig,
                    SingleTurnAgentConfig,
                    env_name,
                    env_of,
                    retriever_config,
)
from .anchor import AnchorConfig
from .data import DataConfig, data_config
from .engine import (
                    VLLM_DTYPES,
                    EngineConfig,
                    HFEngineConfig,
                    OtherEngineConfig,
                    VLLMEngineConfig,
                    VLLMServerEngineConfig,
)
from .kl import KLConfig, kl_config
from .model import DTYPES, ModelConfig
from .overrides import apply_keys, flatten, parse, parse_overrides, set_key
from .recipes import RECIPES, AlgoConfig, describe, recipe
from .schema import (
                    DEFAULT_RECIPE,
                    Config,
                    EvalConfig,
                    OptimizerConfig,
                    RolloutConfig,
                    RunConfig,
                    TrainConfig,
                    to_dict,
)
from .train_async import AsyncConfig

__all__ = [
    "DEFAULT_RECIPE", "DTYPES", "AsyncConfig", "EngineConfig", "HFEngineConfig", "OtherEngineConfig",
    "VLLMEngineConfig", "VLLMServerEngineConfig", "RECIPES", "VLLM_DTYPES", "AlgoConfig", "AnchorConfig", "Config",
    "KLConfig", "kl_config", "describe", "recipe", "ConfigError", "DataConfig", "data_config", "EvalConfig",
    "ModelConfig", "OptimizerConfig",
    "RolloutConfig", "RunConfig", "AgentConfig", "EnvConfig", "MultiTurnAgentConfig", "OtherAgentConfig",
    "RetrieverConfig", "retriever_config", "SingleTurnAgentConfig", "env_name", "env_of", "TrainConfig", "apply_keys",
    "parse", "flatten", "parse_overrides", "set_key", "to_dict",
]
