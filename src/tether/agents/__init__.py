"""Agents: how an episode runs, from examples to a `RolloutBatch`.

An agent owns the conversation: it encodes prompts, drives an engine (``tether.rollout``)
and, for a multi-turn agent, interleaves tool observations, marking them False in
``RolloutBatch.loss_mask``. The trainer and ``tether eval`` call only ``Agent.rollout``.

* ``single_turn`` (:class:`SingleTurnAgent`): prompt -> one response (the math tasks).
* ``multi_turn`` (:class:`~tether.agents.multi_turn.MultiTurnAgent`): any text environment
  (``tether.envs``, ``rollout.agent.env.name``: ``calculator``, ``search`` (Search-R1's protocol over a
  retriever, ``tether.search``), ``skyrl_gym:<name>`` or a user's ``module:Class``), token-exact; a verifiers
  environment (``verifiers:<env_id>``) drives its own turns through
  :class:`~tether.agents.verifiers.VerifiersAgent`, token-exact as well.

Agents register in :data:`AGENTS` with how a config configures them (metadata ``options``,
``tools``); ``rollout.agent`` also takes a user's ``module:name`` / ``file.py:name``.
``make_agent(name, engine, tokenizer, **options)`` builds one by name; the one ``rollout.agent.kind``
names, with its options and tools from a config, is built by `tether.agents.build.RolloutPlan` (its tools, e.g.
the retriever, which loads and checks its corpus, first: a trainer does that before the slow model load).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from ..algo.registry import Registry
from ..config.agent import SearchEnvConfig, SkyRLGymEnvConfig, VerifiersEnvConfig
from ..envs import make_env
from ..envs.search import SearchEnv
from ..envs.skyrl_gym import SkyRLGymEnv
from ..envs.verifiers import VerifiersEnv, verifiers_env
from ..errors import ConfigError
from ..rollout.base import RolloutBatch, SamplingParams
from ..search.retrievers import retriever_from_config
from ..tasks.base import Example
from .multi_turn import MultiTurnAgent
from .single_turn import SingleTurnAgent
from .verifiers import VerifiersAgent


@runtime_checkable
class Agent(Protocol):
    """Runs ``params.n`` episodes per example and returns them as one batch.

    Rows of example ``i`` are contiguous and have ``group == i``; ``response_ids`` hold every
    token after the prompt (the policy's and any tool's), and ``loss_mask`` marks the ones the
    policy sampled. ``metrics()`` returns the agent's counters since the last call (floats),
    which the trainer logs with the step. An agent may have a ``prompts`` attribute, its
    ``tether.tasks.prompts.PromptEncoder``: the trainer then checks every dataset row against
    the model's context before the first step, and ``tether eval`` before generating.
    """

    def rollout(self, examples: Sequence[Example], params: SamplingParams) -> RolloutBatch: ...

    def metrics(self) -> dict[str, float]: ...


def _options(cfg) -> dict[str, Any]:
    """The options every agent takes from a tether Config (an agent's default ``options``)."""
    return {"system_prompt": cfg.data.system_prompt, "prompt_overflow": cfg.rollout.prompt_overflow}


def _no_tools(cfg) -> dict[str, Any]:
    return {}


def _env_options(cfg) -> dict[str, Any]:
    e = cfg.rollout.agent.env  # search's format and role, and verifiers' role, are fixed by their sections
    return {**_options(cfg), "max_obs_tokens": e.max_obs_tokens, "max_context": e.max_context,
            "observation_format": e.observation_format, "observation_role": e.observation_role,
            "reuse_kv": cfg.rollout.reuse_kv}


def env_from_config(e, retriever=None):
    """The environment of the env section ``e`` (``rollout.agent.env``, a section per environment:
    `tether.config.agent`): search over ``retriever`` (default: the one ``e.retriever`` configures; bm25 / dense
    load and check the corpus here); a SkyRL environment (`tether.envs.skyrl_gym`); a verifiers one; any other name
    built with ``e.max_turns`` when set; ``e.options`` are the constructor's keyword arguments."""
    if isinstance(e, SearchEnvConfig):
        r = e.retriever
        return SearchEnv(retriever_from_config(r) if retriever is None else retriever, topk=r.topk,
                         max_searches=e.search_turns() - 1, observation_format=r.passage_format)
    turns = {"max_turns": e.max_turns} if e.max_turns else {}
    options = e.options  # the calculator's: none
    if isinstance(e, (SkyRLGymEnvConfig, VerifiersEnvConfig)):
        name = e.name[len(e.choice_prefix):]
        try:
            if isinstance(e, SkyRLGymEnvConfig):
                return SkyRLGymEnv(name, role=e.observation_role, **turns, **options)
            return verifiers_env(name, **turns, **options)
        except TypeError as err:
            raise ConfigError(f"rollout.agent.env.options of {e.name}: {err}") from None
    return make_env(e.name, **turns, **options)


def _env_tools(cfg) -> dict[str, Any]:
    """The environment ``rollout.agent.env`` (its reward, ``reward``, is the run's when ``data.reward=auto``)."""
    return {"env": env_from_config(cfg.rollout.agent.env)}


#: agent name -> builder(engine, tokenizer, **options), with metadata: ``options(cfg) -> dict`` and
#: ``tools(cfg) -> dict`` (how a tether Config configures it; tools such as the environment and its retriever
#: are built on their own, before the model). A user's agent (``rollout.agent=module:name``) carries either as
#: an attribute; by default it gets ``system_prompt`` and ``prompt_overflow`` and no tools.
AGENTS: Registry[Callable[..., Agent]] = Registry("agent", defaults={"options": _options, "tools": _no_tools},
                                                  error=ConfigError)
AGENTS.register("single_turn")(SingleTurnAgent)


def multi_turn_agent(engine, tokenizer, env, **options: Any) -> Agent:
    """The agent of ``rollout.agent.kind=multi_turn``: :class:`MultiTurnAgent` (tether drives the environment's
    turns), or :class:`~tether.agents.verifiers.VerifiersAgent` for a verifiers environment (it drives its own)."""
    if getattr(env, "version", None) == "0.4":  # verifiers' task API: it drives its episodes in its own programs
        from .verifiers_v1 import VerifiersV1Agent  # deferred: imports verifiers.v1

        return VerifiersV1Agent(engine, tokenizer, env, **options)
    return (VerifiersAgent if isinstance(env, VerifiersEnv) else MultiTurnAgent)(engine, tokenizer, env, **options)


AGENTS.register("multi_turn", options=_env_options, tools=_env_tools)(multi_turn_agent)


def reward_parts(rb: RolloutBatch) -> list[float]:
    """Each row's environment reward parts (``info["env_reward"]``, summed over its steps; 0 without)."""
    return [float((i or {}).get("env_reward", 0.0)) for i in rb.info] if rb.info is not None else [0.0] * len(rb)


def env_correct(rb: RolloutBatch) -> list[bool]:
    """Each row's verdict from its environment (``info["env_correct"]``, e.g. a verifiers rubric's score at least
    its pass threshold; False without): a row is correct when its text reward or its environment says so."""
    return [bool((i or {}).get("env_correct", False)) for i in rb.info] if rb.info is not None else [False] * len(rb)


def make_agent(name: str, engine, tokenizer, **options: Any) -> Agent:
    """The agent registered as ``name`` (or a user's ``module:name``), driving ``engine`` (``options`` go
    to its constructor)."""
    return AGENTS.resolve(name)[0](engine, tokenizer, **options)


__all__ = ["AGENTS", "Agent", "MultiTurnAgent", "SingleTurnAgent", "VerifiersAgent", "env_correct",
           "env_from_config", "make_agent", "multi_turn_agent", "reward_parts"]
