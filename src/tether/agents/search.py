"""The search agent (``rollout.agent=search``): the ``search`` environment run by `MultiTurnAgent`.

Search-R1's protocol (``tether.envs.search``) in its raw observation format: one growing assistant
turn after the prompt, the policy's ids kept as sampled (loss_mask True), observations tokenized
and appended (loss_mask False). See :mod:`tether.agents.multi_turn` for the episode loop and its
budgets, and docs/search_agents.md.
"""

from __future__ import annotations

from ..envs.search import SearchEnv
from .multi_turn import MultiTurnAgent


def SearchAgent(engine, tokenizer, retriever, *, system_prompt: str = "", topk: int = 3, max_searches: int = 4,
                max_obs_tokens: int = 512, max_context: int = 4096, prompt_overflow: str = "error",
                observation_format: str = "search_r1", reuse_kv: bool = True) -> MultiTurnAgent:
    """A `MultiTurnAgent` running `SearchEnv` (Search-R1: think, ``<search>``, read ``<information>``, ``<answer>``).

    Args:
        engine: a ``tether.rollout.Engine`` (decodes every active trajectory in one call per turn).
        tokenizer: the policy's tokenizer (observations are tokenized with it).
        retriever: a ``tether.search.retrievers.Retriever`` (``search(queries, k)``, batched).
        system_prompt: a system message before every prompt ("" = none).
        topk: passages per search.
        max_searches: searches per episode; then one final turn without search.
        max_obs_tokens: tokens per observation (longer ones are cut, keeping ``</information>``).
        max_context: prompt + response tokens per episode; reaching it ends the episode (at most
            the model's context).
        prompt_overflow: a first prompt that leaves no room under the cap: ``"error"`` or
            ``"truncate"`` (``tether.tasks.prompts.PromptEncoder``).
        observation_format: how search results are rendered, one of
            ``tether.search.protocol.OBSERVATION_FORMATS``: ``"search_r1"`` (Search-R1's exact bytes, the
            default) or ``"clean"`` (tether's earlier layout); ``search.observation_format``.
        reuse_kv: keep each episode's KV cache in the engine between turns (``rollout.reuse_kv``).
    """
    env = SearchEnv(retriever, topk=topk, max_searches=max_searches, observation_format=observation_format)
    return MultiTurnAgent(engine, tokenizer, env, system_prompt=system_prompt, max_obs_tokens=max_obs_tokens,
                          max_context=max_context, prompt_overflow=prompt_overflow, observation_format="raw",
                          reuse_kv=reuse_kv)
