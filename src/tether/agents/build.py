"""The one rollout builder: a config's engine, agent and environment, for every caller that samples.

    plan = RolloutPlan(cfg)                            # the agent resolved, its tools built (cheap; before the model)
    parts = plan.assemble(model, tokenizer)            # parts.engine, parts.agent, parts.tools
    batch = parts.agent.rollout(examples, params)

``build_rollout(cfg, model, tokenizer)`` is both halves in one call; `build_env` makes the environment alone, for
``tether demos``. The trainer (``tether.train``), an asynchronous rollout worker (``tether.asynchronous.workers``)
and ``tether eval`` (whose flags are the same ``rollout`` / ``rollout.agent.env`` keys, `tether.eval.agents`) all
build their sampler here, so they cannot drift apart. The plan is made first because its tools are what can fail
early: the environment, with a retriever that loads and checks its corpus, or a verifiers environment that holds
its own data set; the trainer and ``tether eval`` plan before the slow model load and assemble after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import ConfigError
from ..rollout import Engine, make_engine
from . import AGENTS, Agent


@dataclass
class RolloutParts:
    """What samples a batch: the engine, the agent that drives it, and the agent's tools (e.g. ``env``)."""

    engine: Engine
    agent: Agent
    tools: dict[str, Any]


class RolloutPlan:
    """The agent ``cfg.rollout.agent`` names, resolved once in `tether.agents.AGENTS`, and its tools.

    Args:
        cfg: a ``tether.config.Config``. The agent's options (``system_prompt``, the env section's budgets...) are
            read from it when the agent is made, so a caller may still set ``cfg.data.system_prompt`` in between
            (``tether eval``).
        tools: the agent's tools if already built; None builds them here (e.g. the environment and its retriever:
            a bad corpus or environment fails now).
    """

    def __init__(self, cfg, tools: Optional[dict[str, Any]] = None):
        self.cfg = cfg
        self._make, self._meta = AGENTS.resolve(cfg.rollout.agent.kind)
        self.tools: dict[str, Any] = self._meta["tools"](cfg) if tools is None else tools

    @property
    def env_reward(self) -> Optional[str]:
        """The reward spec of the environment among the tools (None: no environment, or it keeps the task's
        reward); the trainer's reward when ``data.reward=auto``."""
        return getattr(self.tools.get("env"), "reward", None)

    def agent(self, engine, tokenizer) -> Agent:
        """The agent, driving ``engine``, with its options from the config and the plan's tools."""
        return self._make(engine, tokenizer, **self._meta["options"](self.cfg), **self.tools)

    def assemble(self, model, tokenizer, *, engine_cfg=None, record_logp: bool = False,
                 wrap: Optional[Callable[[Engine], Engine]] = None,
                 engine_options: Optional[dict[str, Any]] = None) -> RolloutParts:
        """The engine ``rollout.engine`` names on ``model``, and the agent driving it.

        Args:
            engine_cfg: the ``rollout`` section the engine is built from (default ``cfg.rollout``; the trainer of an
                asynchronous run that samples nothing itself passes one with the hf engine).
            record_logp: ask the engine to record the sampled tokens' log-probs (a rollout worker's mu): passed
                to every engine but vLLM, which reports them anyway and takes no such option.
            wrap: an engine wrapper the agent drives instead of the engine itself (``wrap(engine)``).
            engine_options: single engine options the config does not hold (``tether eval``: ``show_progress``).
        """
        rollout = self.cfg.rollout if engine_cfg is None else engine_cfg
        extra = {"record_logp": True} if record_logp and rollout.engine.kind not in ("vllm", "vllm_server") else {}
        extra.update(engine_options or {})
        engine = make_engine(rollout, model, tokenizer, **extra)
        return RolloutParts(engine=engine, agent=self.agent(wrap(engine) if wrap else engine, tokenizer),
                            tools=self.tools)


def build_rollout(cfg, model, tokenizer, **assemble: Any) -> RolloutParts:
    """``RolloutPlan(cfg).assemble(model, tokenizer, **assemble)``: the sampler in one call (a rollout worker)."""
    return RolloutPlan(cfg).assemble(model, tokenizer, **assemble)


def build_env(cfg):
    """The environment the agent ``rollout.agent`` runs (``rollout.agent.env``), without a model or an engine
    (``tether demos``: its teacher's turns are answered by exactly the environment training uses). Raises
    ConfigError for an agent that runs no environment."""
    tools = RolloutPlan(cfg).tools
    if "env" not in tools:
        raise ConfigError(f"rollout.agent.kind={cfg.rollout.agent.kind} runs no environment (multi_turn does)")
    return tools["env"]
