"""verifiers 0.4's task API (``verifiers.v1``) as a tether environment: ``rollout.agent.env.name=verifiers:<id>`` with
verifiers 0.4 installed (docs/ecosystem.md; the classic API of 0.3.x is `tether.envs.verifiers`).

A verifiers 0.4 environment is an ``Env`` (``SingleAgentEnv`` unless the taskset brings its own) running the tasks of
a ``Taskset`` with an agent: a ``Harness`` (the program the model runs in; the null chat harness by default here)
in a runtime. The harness talks to verifiers' own interception server, which renders every turn to token ids
(``renderers``) and asks the model through a ``TrainClient``; `tether.agents.verifiers_v1` points that client at
tether's engine (`tether.rollout.endpoint`), so every trace comes back token-exact with the sampler's log-probs.

``rollout.agent.env.options`` (each optional; unknown keys are refused):

``taskset``
    the taskset's own config keys (its ``id`` is the environment's name), e.g. ``{size: 200}``.
``eval_taskset``
    keys merged over ``taskset`` for the held-out set (default: the training taskset itself).
``harness``
    the harness config (default ``{id: null}``: verifiers' chat program with the taskset's MCP tools; ``bash`` also
    runs without a container). A harness that needs a container is refused with one line naming it.
``runtime``
    the runtime config; only ``{type: subprocess}`` (the default) runs here: docker, podman, apptainer, prime, modal
    and e2b need a container or a hosted sandbox, and are refused with one line naming the runtime.
``agent``
    other keys of verifiers' ``AgentConfig`` (``max_input_tokens``, ``timeout``, ...); ``max_turns`` is
    ``rollout.agent.env.max_turns``, and ``client``, ``model``, ``sampling`` are tether's (refused).
``renderer``
    the ``renderers`` config that turns messages into token ids (default ``{name: default, tool_parser: qwen3}``:
    the tokenizer's own chat template, tool calls parsed in the Hermes ``<tool_call>`` format).
``pass_threshold``
    the reward at which an episode counts as correct (default 0.5).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigError, optional_import
from ..tasks.base import DataError, Example

#: the keys of ``rollout.agent.env.options`` a verifiers 0.4 environment reads
OPTIONS = ("taskset", "eval_taskset", "harness", "runtime", "agent", "renderer", "pass_threshold")
#: runtimes that run on this host without a container
LOCAL_RUNTIMES = ("subprocess",)

_LOADED: dict[tuple, Any] = {}
LAST: dict[str, "VerifiersV1Env"] = {}  # env id -> the environment built last for it (``tether eval --benchmarks``)


def library():
    """``verifiers.v1`` (an optional extra), or a ConfigError naming what to install."""
    return optional_import("verifiers.v1", "verifiers 0.4 environments", "verifiers")


def _mapping(value, key: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"rollout.agent.env.options.{key} must be a mapping, got {value!r}")
    return dict(value)


def env_config(env_id: str, options: dict, max_turns: Optional[int], split: str = "train"):
    """verifiers' resolved ``EnvConfig`` of the options (module doc); every problem one ConfigError."""
    vf = library()
    bad = sorted(set(options) - set(OPTIONS))
    if bad:
        raise ConfigError(f"rollout.agent.env.options of verifiers:{env_id}: unknown key(s) {bad} (known: "
                          f"{', '.join(OPTIONS)})")
    taskset = {**_mapping(options.get("taskset"), "taskset"),
               **(_mapping(options.get("eval_taskset"), "eval_taskset") if split == "eval" else {}), "id": env_id}
    agent = _mapping(options.get("agent"), "agent")
    mine = sorted(set(agent) & {"client", "model", "sampling", "max_turns"})
    if mine:
        raise ConfigError(f"rollout.agent.env.options.agent.{mine[0]} is tether's to set (the client points at "
                          f"tether's engine; max_turns is rollout.agent.env.max_turns; sampling is rollout.*)")
    runtime = _mapping(options.get("runtime"), "runtime") or {"type": "subprocess"}
    kind = runtime.get("type", "subprocess")
    if kind not in LOCAL_RUNTIMES:
        raise ConfigError(f"verifiers:{env_id}: the {kind!r} runtime needs a container or a hosted sandbox; tether "
                          f"runs verifiers' subprocess runtime only (rollout.agent.env.options.runtime: {{type: "
                          f"subprocess}})")
    agent.update(harness=_mapping(options.get("harness"), "harness") or {"id": "null"}, runtime=runtime)
    if max_turns:
        agent["max_turns"] = int(max_turns)
    try:
        cfg = vf.resolve_env_config({"taskset": taskset, "agent": agent})
    except ModuleNotFoundError as e:
        raise ConfigError(f"unknown verifiers environment {env_id!r}: {e}") from None
    except Exception as e:  # pydantic's ValidationError, a taskset's own check: name the environment
        raise ConfigError(f"verifiers:{env_id}: its options do not make an environment: "
                          f"{' '.join(str(e).split())[:600]}") from None
    _check_containers(env_id, cfg)
    return cfg


def _check_containers(env_id: str, cfg) -> None:
    """Refuse, with one line, what needs a container: the harness, the task class, a tool server's runtime."""
    from verifiers.v1.utils.loaders import harness_class, taskset_class

    for role, harness in cfg.agent_harnesses().items():
        if harness_class(harness.id).NEEDS_CONTAINER:
            raise ConfigError(f"verifiers:{env_id}: the {harness.id!r} harness needs a container (docker, prime, ...); "
                              f"tether runs harnesses without one: null or bash")
    ts = taskset_class(cfg.taskset.id)
    task_cls = ts.task_type()
    if getattr(task_cls, "NEEDS_CONTAINER", False):
        raise ConfigError(f"verifiers:{env_id}: its tasks ({task_cls.__name__}) need a container; tether runs "
                          f"verifiers' subprocess runtime only")
    for t in [*task_cls.toolsets(cfg.taskset.task), *ts.toolsets(cfg.taskset)]:
        tc = getattr(t, "config", None)
        rt = getattr(getattr(tc, "runtime", None), "type", "subprocess")
        if getattr(tc, "url", None) is None and rt not in LOCAL_RUNTIMES:
            raise ConfigError(f"verifiers:{env_id}: its tool server {type(t).__name__} needs the {rt!r} runtime; "
                              f"tether runs tool servers as subprocesses only")


def _uv_on_path() -> None:
    """verifiers prepares a harness's program with ``uv``: the one installed beside this interpreter is found first."""
    here = str(Path(sys.executable).parent)
    if (Path(here) / "uv").exists() and here not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


class VerifiersV1Env:
    """A loaded verifiers 0.4 environment (module doc): ``env`` (verifiers' ``Env``), its tasks per split, its
    options for the agent (``renderer``, ``pass_threshold``)."""

    reward = "none"  # the trace's reward is the episode's (info["env_reward"]); data.reward adds one if set
    name = "verifiers"
    version = "0.4"

    def __init__(self, env_id: str, *, max_turns: Optional[int] = None, **options: Any):
        self.env_id, self.options, self.max_turns = env_id, dict(options), max_turns
        self.cfg = env_config(env_id, self.options, max_turns)
        try:
            self.pass_threshold = float(self.options.get("pass_threshold", 0.5))
        except (TypeError, ValueError):
            raise ConfigError(f"rollout.agent.env.options.pass_threshold must be a number, got "
                              f"{self.options.get('pass_threshold')!r}") from None
        self.renderer = _mapping(self.options.get("renderer"), "renderer") or {"name": "default",
                                                                                "tool_parser": "qwen3"}
        _uv_on_path()
        self.env = self._load(self.cfg)
        self._tasks: dict[str, list] = {}
        LAST[env_id] = self

    @staticmethod
    def _load(cfg):
        vf = library()
        key = (cfg.model_dump_json(),)
        if key not in _LOADED:
            try:
                _LOADED[key] = vf.load_environment(cfg)
            except Exception as e:
                raise ConfigError(f"verifiers:{cfg.taskset.id}: loading the environment raised {type(e).__name__}: "
                                  f"{e}") from e
        return _LOADED[key]

    def tasks(self, split: str = "train") -> list:
        """The tasks of ``split`` (``eval``: the taskset with ``eval_taskset`` merged in), each a verifiers Task."""
        if split not in self._tasks:
            env = self.env if split == "train" or not self.options.get("eval_taskset") else self._load(
                env_config(self.env_id, self.options, self.max_turns, "eval"))
            try:
                tasks = list(env.taskset)
            except Exception as e:
                raise DataError(f"verifiers:{self.env_id}: its taskset raised {type(e).__name__} while loading "
                                f"its tasks: {e}") from e
            if not tasks:
                raise DataError(f"verifiers:{self.env_id}: its {split} taskset has no tasks")
            for t in tasks:
                if getattr(t.data, "image", None) is not None:
                    raise ConfigError(f"verifiers:{self.env_id}: task {t.data.idx!r} needs the container image "
                                      f"{t.data.image!r}; tether runs verifiers' subprocess runtime only")
            self._tasks[split] = tasks
        return self._tasks[split]

    def examples(self, split: str = "train", limit: Optional[int] = None) -> list[Example]:
        """The tasks of ``split`` as Examples: ``meta`` names the task (split and index), ``prompt`` is its text."""
        tasks = self.tasks(split)[: limit or None]
        return [Example(id=f"vf:{self.env_id}:{split}:{i}", prompt=_prompt_text(t.data.prompt), answer="",
                        meta={"vf_split": split, "vf_task": i}) for i, t in enumerate(tasks)]

    def reset(self, example):  # pragma: no cover - the verifiers agent drives it
        raise ConfigError("a verifiers environment drives its own episode: rollout.agent.kind=multi_turn runs it "
                          "with tether.agents.verifiers_v1.VerifiersV1Agent")

    step = reset


def _prompt_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m for m in prompt if (m.get("role") if isinstance(m, dict) else getattr(m, "role", "")) == "user"]
        last = (users or prompt)[-1]
        content = last.get("content") if isinstance(last, dict) else getattr(last, "content", "")
        return content if isinstance(content, str) else str(content)
    return "" if prompt is None else str(prompt)
