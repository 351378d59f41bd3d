"""Agents: how an episode runs, from examples to a `RolloutBatch`.

An agent owns the conversation: it encodes prompts, drives an engine (``tether.rollout``)
and, for a multi-turn agent, interleaves tool observations, marking them False in
``RolloutBatch.loss_mask``. The trainer and ``tether eval`` call only ``Agent.rollout``.

* ``single_turn`` (:class:`SingleTurnAgent`): prompt -> one response (the math tasks).
* ``search`` (:class:`~tether.agents.search.SearchAgent`): Search-R1's multi-turn protocol
  with a retriever (``tether.search``).

``make_agent(name, engine, tokenizer, **options)`` builds one by name;
``agent_from_config(cfg, engine, tokenizer)`` builds the one ``rollout.agent`` names, with its
options from the config. ``agent_tools(cfg)`` builds its tools (e.g. the retriever, which loads
and checks its corpus) on their own, so a trainer can do it before the slow model load.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

from ..algo.registry import Registry
from ..rollout.base import RolloutBatch, SamplingParams
from ..tasks.base import Example
from .single_turn import SingleTurnAgent


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


def _search_tools(cfg) -> dict[str, Any]:
    """The retriever of ``cfg.search`` (bm25 / dense load and check the corpus here)."""
    from ..search.data import corpus_path
    from ..search.retrievers import make_retriever

    s = cfg.search
    if s.retriever == "http":
        return {"retriever": make_retriever("http", url=s.url, timeout=s.timeout, retries=s.retries)}
    corpus = s.corpus or corpus_path(s.data_dir or None)
    opts = {"model": s.dense_model} if s.retriever == "dense" else {}
    return {"retriever": make_retriever(s.retriever, corpus=corpus, **opts)}


def _search(engine, tokenizer, **options) -> Agent:
    from .search import SearchAgent

    return SearchAgent(engine, tokenizer, **options)


#: agent name -> builder(engine, tokenizer, **options)
AGENTS: Registry[Callable[..., Agent]] = Registry("agent")
AGENTS.register("single_turn")(SingleTurnAgent)
AGENTS.register("search")(_search)

#: agent name -> (options(cfg) -> dict, tools(cfg) -> dict): how a tether Config configures it
AGENT_CONFIG: dict[str, tuple[Callable[[Any], dict], Callable[[Any], dict]]] = {
    "single_turn": (lambda cfg: {"system_prompt": cfg.data.system_prompt,
                                 "prompt_overflow": cfg.rollout.prompt_overflow}, lambda cfg: {}),
    "search": (lambda cfg: {"system_prompt": cfg.data.system_prompt, "prompt_overflow": cfg.rollout.prompt_overflow,
                            "topk": cfg.search.topk,
                            "max_searches": cfg.search.max_searches, "max_obs_tokens": cfg.search.max_obs_tokens,
                            "max_context": cfg.search.max_context}, _search_tools),
}


def make_agent(name: str, engine, tokenizer, **options: Any) -> Agent:
    """The agent registered as ``name``, driving ``engine`` (``options`` go to its constructor)."""
    return AGENTS[name](engine, tokenizer, **options)


def agent_tools(cfg) -> dict[str, Any]:
    """The tools the agent ``cfg.rollout.agent`` needs, e.g. a retriever (build once, before the model)."""
    return AGENT_CONFIG[cfg.rollout.agent][1](cfg)


def agent_from_config(cfg, engine, tokenizer, tools: Optional[dict[str, Any]] = None) -> Agent:
    """The agent ``cfg.rollout.agent`` names, configured from a ``tether.config.Config``."""
    options, make_tools = AGENT_CONFIG[cfg.rollout.agent]
    return make_agent(cfg.rollout.agent, engine, tokenizer, **options(cfg),
                      **(make_tools(cfg) if tools is None else tools))


__all__ = ["AGENTS", "AGENT_CONFIG", "Agent", "SingleTurnAgent", "agent_from_config", "agent_tools", "make_agent"]
