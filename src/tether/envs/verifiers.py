"""Prime Intellect's verifiers environments of the classic API (``verifiers`` 0.3.x; deprecated by verifiers, and
gone from its 0.4) as a tether environment: ``rollout.agent.env.name=verifiers:<env_id>`` when verifiers 0.3 is the
installed release (docs/ecosystem.md). With verifiers 0.4 installed (the optional extra ``tether[verifiers]``), the
same name runs its task API instead: `tether.envs.verifiers_v1` (`verifiers_env` picks by the installed release).

A verifiers environment drives its own episode: ``env.rollout(input, client, model, sampling_args)`` asks a
``vf.Client`` for each assistant turn and answers it (a ``ToolEnv`` calls the tools the turn named), then its
``Rubric`` scores the finished state. So it is not a `tether.envs.base.TextEnv` (tether does not drive its
turns): :class:`VerifiersEnv` loads it (``vf.load_environment(env_id, **args)``: the module of that name and its
``load_environment``), gives its dataset to the task (``verifiers``, picked by the environment's name) and its
eval dataset to the held-out evaluation, and `tether.agents.verifiers.VerifiersAgent` runs its rollouts with an
in-process client backed by tether's engine, token-exact.

``rollout.agent.env.options``: ``args`` (the keyword arguments of its ``load_environment``) and ``tool_format``
(how the policy writes tool calls: ``auto`` | ``hermes`` | ``llama3_json``, `tether.agents.verifiers`).
"""

from __future__ import annotations

import importlib
import inspect
import json
from importlib.util import find_spec
from typing import Any, Optional

from ..config.agent import VerifiersEnvConfig
from ..errors import ConfigError, optional_import
from ..tasks.base import DataError, Example
from ..tasks.benchmarks import Benchmark
from ..tasks.registry import TASKS
from ..tasks.rewards import load_reward
from ..userio import slug

__all__ = ["PREFIX", "OPTIONS", "TOOL_FORMATS", "VerifiersEnv", "eval_benchmark", "message_text", "verifiers_library"]

#: ``rollout.agent.env.name`` prefix of a verifiers environment (its section's, tether.config.agent)
PREFIX = VerifiersEnvConfig.choice_prefix
#: the keys of ``rollout.agent.env.options`` a verifiers environment reads
OPTIONS = ("args", "tool_format")
#: how the policy writes a tool call (`tether.agents.verifiers.parse_tool_calls`)
TOOL_FORMATS = ("auto", "hermes", "llama3_json")
#: the release line whose classic API this adapter drives (0.4 moved to verifiers.v1, a program per rollout)
SUPPORTED = "0.3"

_LOADED: dict[tuple[str, str], Any] = {}  # (env_id, its args as JSON) -> the loaded environment (one per process)
_LAST: dict[str, Any] = {}  # env_id -> the environment loaded last for it (its args: the run's)


def installed_version() -> Optional[str]:
    """The release line of the ``verifiers`` that imports here (``verifiers.__version__``): ``"0.4"`` (the task API,
    `tether.envs.verifiers_v1`), ``"0.3"`` (the classic API, this module), another, or None when there is none."""
    try:
        import verifiers  # deferred: an optional extra
    except ImportError:
        return None
    return ".".join(str(getattr(verifiers, "__version__", "0")).split(".")[:2])


def is_task_api() -> bool:
    """Whether ``verifiers:<id>`` runs verifiers 0.4's task API (it is installed) rather than the classic API."""
    v = installed_version()
    return v is not None and v != SUPPORTED and tuple(int(x) for x in v.split(".") if x.isdigit()) >= (0, 4)


def verifiers_env(env_id: str, **kwargs):
    """The environment of ``verifiers:<env_id>`` for the installed release: `tether.envs.verifiers_v1.VerifiersV1Env`
    for verifiers 0.4 (the task API), :class:`VerifiersEnv` for 0.3 (the classic API, deprecated)."""
    if is_task_api():
        from .verifiers_v1 import VerifiersV1Env  # deferred: imports verifiers.v1

        return VerifiersV1Env(env_id, **kwargs)
    return VerifiersEnv(env_id, **kwargs)


def verifiers_library():
    """``verifiers.legacy`` (the classic API), or a ConfigError naming the extra to install or the release to pin."""
    verifiers = optional_import("verifiers", "verifiers environments", "verifiers")  # used only by these environments
    version = getattr(verifiers, "__version__", "0")
    if not version.startswith(SUPPORTED + "."):
        raise ConfigError(f"verifiers {version} is installed; tether drives the classic API of verifiers "
                          f"{SUPPORTED}.x and the task API of 0.4 (pip install 'tether[verifiers]' installs 0.4; "
                          f"docs/ecosystem.md)")
    import verifiers.legacy as vf  # noqa: PLC0415  (the same optional extra)

    return vf


def load_env(env_id: str, args: Optional[dict] = None):
    """The verifiers environment ``env_id`` built by its module's ``load_environment(**args)``, once per process.
    A module that is not installed, one without ``load_environment``, arguments it refuses, or a load that raises
    is a ConfigError naming the environment."""
    vf = verifiers_library()
    args = dict(args or {})
    key = (env_id, json.dumps(args, sort_keys=True, default=str))
    if key in _LOADED:
        return _LOADED[key]
    module = env_id.replace("-", "_").split("/")[-1]  # verifiers' own rule (env_utils.env_module_name)
    try:
        found = find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"unknown verifiers environment {env_id!r}: no module {module!r} is installed (install "
                          f"the environment's package, e.g. `prime env install {env_id}` or pip install; its module "
                          f"must define load_environment)")
    try:
        inspect.signature(importlib.import_module(module).load_environment).bind(**args)
    except TypeError as e:
        raise ConfigError(f"verifiers environment {env_id!r}: load_environment refused rollout.agent.env.options."
                          f"args {args}: {e}") from None
    except Exception:  # noqa: BLE001  (an import that fails, no load_environment: load_environment says it below)
        pass
    try:
        from datasets.utils.logging import disable_progress_bar  # noqa: PLC0415  (verifiers' own dependency)

        disable_progress_bar()  # a bar per dataset.map of the environment's rows: noise in a training log
    except ImportError:
        pass
    try:
        env = vf.load_environment(env_id, **args)
    except Exception as e:  # the environment's own code: name it
        raise ConfigError(f"verifiers environment {env_id!r}: load_environment raised {type(e).__name__}: {e}") \
            from e
    if not isinstance(env, vf.MultiTurnEnv):
        raise ConfigError(f"verifiers environment {env_id!r}: load_environment returned a {type(env).__name__}, not "
                          f"a verifiers MultiTurnEnv (SingleTurnEnv, ToolEnv, ... of the classic API)")
    _LOADED[key] = _LAST[env_id] = env
    return env


def message_text(content) -> str:
    """A verifiers message's content as text (a list of content parts: their text parts joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(getattr(p, "text", "")) for p in content)
    return "" if content is None else str(content)


def dataset_examples(env_id: str, env, split: str, limit: Optional[int] = None) -> list[Example]:
    """The rows of ``env``'s ``train`` (``get_dataset``) or ``eval`` (``get_eval_dataset``) dataset as Examples:
    ``meta["vf_input"]`` holds the row as the rollout takes it (prompt messages, answer, info, example_id, task);
    ``prompt`` is its last user message (for logs and samples)."""
    ds = env.get_dataset() if split == "train" else env.get_eval_dataset()
    if ds is None or len(ds) == 0:
        raise DataError(f"verifiers environment {env_id!r} has no {split} dataset rows")
    n = len(ds) if not limit else min(limit, len(ds))
    out = []
    for i in range(n):
        row = dict(ds[i])
        prompt = row.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            raise DataError(f"verifiers environment {env_id!r}: {split} row {i} has no prompt messages")
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        vf_input = {k: row[k] for k in ("prompt", "answer", "info", "example_id", "task") if k in row}
        vf_input.setdefault("example_id", i)
        last = users[-1] if users else prompt[-1]
        out.append(Example(prompt=message_text(last.get("content")),
                           answer=str(row.get("answer", "")), id=f"vf:{env_id}:{split}:{row.get('example_id', i)}",
                           meta={"vf_input": vf_input}))
    return out


class VerifiersEnv:
    """A loaded verifiers environment and what tether needs of it (module docstring).

    Args:
        env_id: the environment's id (its module's name; ``-`` reads as ``_``).
        args: the keyword arguments of its ``load_environment``.
        tool_format: how the policy writes tool calls (:data:`TOOL_FORMATS`).
        max_turns: tether's turn budget, when set (the environment's own ``max_turns`` otherwise).
    """

    reward = "none"  # the rubric's score is the episode's reward (info["env_reward"]); data.reward adds one if set

    def __init__(self, env_id: str, *, args: Optional[dict] = None, tool_format: str = "auto",
                 max_turns: Optional[int] = None):
        if tool_format not in TOOL_FORMATS:
            raise ConfigError(f"rollout.agent.env.options.tool_format: unknown {tool_format!r} (known: "
                              f"{', '.join(TOOL_FORMATS)})")
        if args is not None and not isinstance(args, dict):
            raise ConfigError(f"rollout.agent.env.options.args must be a mapping of load_environment's arguments, "
                              f"got {args!r}")
        self.env_id, self.args, self.tool_format = env_id, dict(args or {}), tool_format
        self.name = "verifiers"
        self.vf = verifiers_library()
        self.env = load_env(env_id, self.args)
        self.max_turns = max_turns
        if max_turns:
            self.env.max_turns = max_turns

    @property
    def pass_threshold(self) -> float:
        """The rubric score at which an episode counts as correct (verifiers' ``Environment.pass_threshold``)."""
        return float(getattr(self.env, "pass_threshold", 0.5))

    def reset(self, example):  # pragma: no cover - the verifiers agent drives it; a TextEnv agent cannot
        raise ConfigError("a verifiers environment drives its own episode: rollout.agent.kind=multi_turn runs it "
                          "with tether.agents.verifiers.VerifiersAgent")

    step = reset


# ---------------------------------------------------------------- its task and its held-out set


def _env_section(env):
    return env.name[len(PREFIX):], dict(env.options.get("args") or {})


def _v1(env):
    return verifiers_env(env.name[len(PREFIX):], max_turns=env.max_turns or None, **env.options)


def _test_set(env, limit: int):
    """The environment's eval dataset (its train dataset when it has none), scored by its rubric (verifiers 0.4:
    its eval taskset, scored by its rewards)."""
    if is_task_api():
        return _v1(env).examples("eval", limit), load_reward("none")
    env_id, args = _env_section(env)
    return dataset_examples(env_id, load_env(env_id, args), "eval", limit), load_reward("none")


@TASKS.register("verifiers", reward="none", env=PREFIX, ignores=("task", "prompt_key", "answer_key", "data_dir",
                                                                  "split", "difficulty"),
                about="rollout.agent.env.name=verifiers:<env_id> (its rows are the environment's dataset)",
                held_out=lambda env: env.name, test_set=_test_set)
def verifiers_task(data, env) -> list:
    """The training rows of the verifiers environment ``rollout.agent.env.name`` (its ``get_dataset()``; verifiers
    0.4: its taskset's tasks; ``data.limit`` keeps the first rows)."""
    if is_task_api():
        return _v1(env).examples("train", data.limit or None)
    env_id, args = _env_section(env)
    return dataset_examples(env_id, load_env(env_id, args), "train", data.limit or None)


def eval_benchmark(source: str, limit: Optional[int], reward: Optional[str]) -> Benchmark:
    """``tether eval --benchmarks verifiers:<env_id>`` (its entry in `tether.tasks.benchmarks.BENCHMARK_PREFIXES`):
    its eval dataset, from the environment this process loaded for the run (with the run's load_environment
    arguments), else loaded with its defaults."""
    env_id = source[len(PREFIX):]
    spec = reward or "none"
    if is_task_api():  # its eval taskset, from the environment this process built for the run (with its options)
        from .verifiers_v1 import LAST, VerifiersV1Env  # deferred: imports verifiers.v1

        env = LAST.get(env_id) or VerifiersV1Env(env_id)
        return Benchmark(name=slug(source), source=source, split="eval", examples=env.examples("eval", limit),
                         reward=spec, reward_fn=load_reward(spec))
    env = _LAST.get(env_id) or load_env(env_id)
    examples = dataset_examples(env_id, env, "eval", limit)
    return Benchmark(name=slug(source), source=source, split="eval", examples=examples, reward=spec,
                     reward_fn=load_reward(spec))
