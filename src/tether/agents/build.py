"""The one rollout builder: a config's engine, agent and environment, for every caller that samples.

    parts = build_rollout(cfg, model, tokenizer)      # parts.engine, parts.agent, parts.tools
    batch = parts.agent.rollout(examples, params)

`build_env` makes the environment alone, for ``tether demos``.
The trainer (``tether.train``), an asynchronous rollout worker (``tether.asynchronous.workers``) and
``tether eval`` (whose flags are the same ``rollout`` / ``rollout.agent.env`` keys, `tether.eval.agents`) all
build their sampler here, so they cannot drift apart. The tools (the environment, with a retriever that loads
and checks its corpus) can be built first with ``tether.agents.agent_tools``, before the slow model load, and handed
in; ``wrap`` puts an engine wrapper between the agent and the engine (partial rollouts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import ConfigError
from ..rollout import Engine, make_engine
from . import Agent, agent_from_config, agent_tools


@dataclass
class RolloutParts:
    """What samples a batch: the engine, the agent that drives it, and the agent's tools (e.g. ``env``)."""

    engine: Engine
    agent: Agent
    tools: dict[str, Any]


def build_rollout(cfg, model, tokenizer, *, tools: Optional[dict[str, Any]] = None, engine_cfg=None,
                  record_logp: bool = False, wrap: Optional[Callable[[Engine], Engine]] = None,
                  engine_options: Optional[dict[str, Any]] = None) -> RolloutParts:
    """The engine ``rollout.engine`` names on ``model`` and the agent ``rollout.agent`` names driving it.

    Args:
        cfg: a ``tether.config.Config``.
        tools: the agent's tools if already built (``agent_tools(cfg)``); None builds them here.
        engine_cfg: the ``rollout`` section the engine is built from (default ``cfg.rollout``; the trainer of an
            asynchronous run that samples nothing itself passes one with the hf engine).
        record_logp: ask the engine to record the sampled tokens' log-probs (a rollout worker's mu): passed
            to every engine but vLLM, which reports them anyway and takes no such option.
        wrap: an engine wrapper the agent drives instead of the engine itself (``wrap(engine)``).
        engine_options: single engine options the config does not hold (``tether eval``: ``show_progress``).
    """
    rollout = cfg.rollout if engine_cfg is None else engine_cfg
    extra = {"record_logp": True} if record_logp and rollout.engine.kind != "vllm" else {}
    extra.update(engine_options or {})
    engine = make_engine(rollout, model, tokenizer, **extra)
    tools = agent_tools(cfg) if tools is None else tools
    agent = agent_from_config(cfg, wrap(engine) if wrap else engine, tokenizer, tools)
    return RolloutParts(engine=engine, agent=agent, tools=tools)


def build_env(cfg, tools: Optional[dict[str, Any]] = None):
    """The environment the agent ``rollout.agent`` runs (``rollout.agent.env``), without a model or an engine
    (``tether demos``: its teacher's turns are answered by exactly the environment training uses). ``tools``: the
    agent's tools if already built. Raises ConfigError for an agent that runs no environment."""
    tools = agent_tools(cfg) if tools is None else tools
    if "env" not in tools:
        raise ConfigError(f"rollout.agent.kind={cfg.rollout.agent.kind} runs no environment (multi_turn does)")
    return tools["env"]
