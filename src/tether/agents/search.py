"""A multi-turn search agent in the Search-R1 protocol (``rollout.agent=search``).

One episode is one growing assistant turn after the prompt::

    <think> ... </think> <search> q1 </search>        policy tokens       loss_mask True
    <information>Doc 1(Title: ...) ...</information>   observation tokens  loss_mask False
    <think> ... </think> <answer> x </answer>          policy tokens       loss_mask True

Each turn, every active trajectory decodes together (one engine call), stopping at
``</search>`` or ``</answer>``; the turn's queries go to the retriever as one batch; finished
trajectories leave the batch. The ids the policy sampled are kept exactly as sampled (never
decoded and re-tokenized); observations (``render_observation`` in ``observation_format``,
Search-R1's bytes by default) and the invalid-action message are tokenized and appended. After
``max_searches`` turns, one final turn runs with searching disabled (it stops only at
``</answer>``, and a search there is not executed).

Budgets: ``params.max_new_tokens`` (``rollout.max_new_tokens``) new tokens per turn, ``max_obs_tokens``
per observation (cut, keeping the closing tag), ``max_context`` tokens of prompt + response in all; a trajectory that
reaches the context cap ends with finish reason ``"length"``. The cap is never more than the
model's context (``max_position_embeddings``): a larger ``max_context`` is lowered to it, with a
warning, so an episode can never run past what the model can attend to. Since every turn is cut
to the room left under the cap, the first prompt need only leave one token of it; a longer one
is an error or cut to its last tokens (``prompt_overflow``, as for the single-turn agent).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..rollout.base import RolloutBatch, SamplingParams
from ..search.protocol import (INVALID_ACTION_MESSAGE, OBSERVATION_FORMATS, STOP_STRINGS, parse_action,
                               render_observation, render_search_error)
from ..search.retrievers import RetrievalError
from ..search.reward import golden_answers, score_response
from ..tasks.base import Example
from ..tasks.prompts import agent_prompt_encoder

_CLOSE = "</information>\n\n"


@dataclass
class _Episode:
    """One trajectory's state: the ids after the prompt and which of them the policy sampled."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    done: bool = False
    finish: str = "stop"
    searches: int = 0
    invalid: int = 0
    turns: int = 0
    obs_tokens: int = 0
    answered: bool = False
    retrieved: list[str] = field(default_factory=list)  # corpus ids of every passage shown

    def add(self, ids: list[int], policy: bool, logp: Optional[list[float]] = None) -> None:
        self.ids += ids
        self.policy += [policy] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)


class SearchAgent:
    """Search-R1-style agent: think, ``<search>``, read ``<information>``, ``<answer>``.

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
    """

    def __init__(self, engine, tokenizer, retriever, *, system_prompt: str = "", topk: int = 3,
                 max_searches: int = 4, max_obs_tokens: int = 512,
                 max_context: int = 4096, prompt_overflow: str = "error", observation_format: str = "search_r1"):
        for name, v in (("topk", topk), ("max_obs_tokens", max_obs_tokens),
                        ("max_context", max_context)):
            if v < 1:
                raise ValueError(f"search agent: {name} must be >= 1, got {v}")
        if max_searches < 0:
            raise ValueError(f"search agent: max_searches must be >= 0, got {max_searches}")
        if observation_format not in OBSERVATION_FORMATS:
            raise ValueError(f"search agent: unknown observation_format {observation_format!r} "
                             f"(known: {', '.join(OBSERVATION_FORMATS)})")
        self.observation_format = observation_format
        self.engine, self.tokenizer, self.retriever = engine, tokenizer, retriever
        self.system_prompt, self.topk, self.max_searches = system_prompt, topk, max_searches
        self.prompts = agent_prompt_encoder(engine, tokenizer, system_prompt, prompt_overflow, max_context=max_context,
                                            reserve=1)
        if self.prompts.context < max_context:
            print(f"[tether] warning: search.max_context={max_context} is more than the model's context "
                  f"({self.prompts.context} tokens); episodes end at {self.prompts.context} tokens", file=sys.stderr)
        self.max_obs_tokens, self.max_context = max_obs_tokens, self.prompts.context
        self._ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
        self._invalid_ids = self._ids(INVALID_ACTION_MESSAGE)
        self._close_ids = self._ids(_CLOSE)
        self._counters: dict[str, float] = {}

    # ------------------------------------------------------------ the episode loop

    def rollout(self, examples: Sequence[Example], params: SamplingParams) -> RolloutBatch:
        """``params.n`` episodes per example (rows of example ``i`` contiguous, ``group == i``)."""
        prompts = self.prompts.encode(examples, params.max_new_tokens)
        eps = [_Episode(prompt=list(p)) for p in prompts for _ in range(params.n)]
        t_gen, t_ret, failures = 0.0, 0.0, 0
        self._got_logp = True
        for turn in range(self.max_searches + 1):
            final = turn == self.max_searches
            active = [e for e in eps if not e.done]
            if not active:
                break
            t0 = time.perf_counter()
            outs = self._decode(active, params, turn, final, prompts if turn == 0 else None)
            t_gen += time.perf_counter() - t0
            queries: list[tuple[_Episode, str]] = []
            for e, (ids, logp, text, reason) in zip(active, outs):
                e.add(ids, True, logp)
                e.turns += 1
                kind, content = parse_action(text)
                if kind == "answer":
                    e.done, e.answered, e.finish = True, True, "stop"
                elif len(e.prompt) + len(e.ids) >= self.max_context:
                    e.done, e.finish = True, "length"
                elif final:
                    e.done, e.finish = True, reason
                elif kind == "search":
                    queries.append((e, content))
                else:
                    e.invalid += 1
                    self._observe(e, self._invalid_ids)
            if queries:
                t0 = time.perf_counter()
                failures += self._search(queries)
                t_ret += time.perf_counter() - t0
        rb = self._batch(eps, params.n, t_gen)
        self._count(eps, rb.texts, [examples[i // params.n] for i in range(len(eps))], t_ret, failures)
        return rb

    def _decode(self, active: list[_Episode], params: SamplingParams, turn: int, final: bool,
                first_prompts: Optional[list[list[int]]]):
        """One policy turn for every active episode: (ids, logp, text, finish reason) per episode."""
        room = max(self.max_context - len(e.prompt) - len(e.ids) for e in active)
        sp = SamplingParams(n=params.n if first_prompts is not None else 1, temperature=params.temperature,
                            top_p=params.top_p, top_k=params.top_k, greedy=params.greedy,
                            max_new_tokens=max(1, min(params.max_new_tokens, room)),
                            stop=["</answer>"] if final else list(STOP_STRINGS),
                            seed=None if params.seed is None else (params.seed + 7919 * turn) % (2**31))
        if first_prompts is not None:  # turn 0: each example's prompt once, n samples (prompt shared)
            rb = self.engine.generate(first_prompts, sp)
        else:
            rb = self.engine.generate([e.prompt + e.ids for e in active], sp)
        self._got_logp = self._got_logp and rb.sampler_logp is not None
        out = []
        for j, e in enumerate(active):
            m = rb.response_mask[j]
            ids = rb.response_ids[j][m].tolist()
            logp = rb.sampler_logp[j][m].tolist() if rb.sampler_logp is not None else None
            cap = self.max_context - len(e.prompt) - len(e.ids)  # this episode's own room
            reason = rb.finish_reason[j]
            if len(ids) > cap:
                ids, logp, reason = ids[:cap], (logp[:cap] if logp is not None else None), "length"
            text = rb.texts[j] if len(ids) == int(m.sum()) else self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append((ids, logp, text, reason))
        return out

    def _search(self, queries: list[tuple[_Episode, str]]) -> int:
        """Run a turn's queries as one batch and append each observation; returns failed searches."""
        try:
            results = self.retriever.search([q for _, q in queries], self.topk)
            texts = [render_observation(r, self.observation_format) for r in results]
            failed = 0
        except RetrievalError as err:
            results = [[] for _ in queries]
            texts = [render_search_error(str(err).splitlines()[0][:200])] * len(queries)
            failed = len(queries)
        for (e, _), text, passages in zip(queries, texts, results):
            e.searches += 1
            e.retrieved += [p.id for p in passages]
            self._observe(e, self._ids(text))
        return failed

    def _observe(self, e: _Episode, ids: list[int]) -> None:
        """Append observation tokens (not the policy's), cut to max_obs_tokens and to the context cap."""
        if len(ids) > self.max_obs_tokens:
            keep = max(self.max_obs_tokens - len(self._close_ids), 0)
            ids = ids[:keep] + self._close_ids[: self.max_obs_tokens - keep]
        room = self.max_context - len(e.prompt) - len(e.ids)
        if len(ids) >= room:  # no room left for the policy to act on it
            ids = ids[:room]
            e.done, e.finish = True, "length"
        e.add(ids, False)
        e.obs_tokens += len(ids)

    # ------------------------------------------------------------ batch and metrics

    def _batch(self, eps: list[_Episode], n: int, gen_time: float) -> RolloutBatch:
        pad = getattr(self.engine, "pad_token_id", 0)
        B = len(eps)
        P = max(len(e.prompt) for e in eps)
        T = max(max(len(e.ids) for e in eps), 1)
        prompt_ids = torch.full((B, P), pad, dtype=torch.long)
        prompt_mask = torch.zeros(B, P, dtype=torch.bool)
        ids = torch.full((B, T), pad, dtype=torch.long)
        resp_mask = torch.zeros(B, T, dtype=torch.bool)
        loss_mask = torch.zeros(B, T, dtype=torch.bool)
        logp = torch.zeros(B, T)
        for i, e in enumerate(eps):
            if e.prompt:
                prompt_ids[i, P - len(e.prompt):] = torch.tensor(e.prompt)
                prompt_mask[i, P - len(e.prompt):] = True
            L = len(e.ids)
            if L:
                ids[i, :L] = torch.tensor(e.ids)
                resp_mask[i, :L] = True
                loss_mask[i, :L] = torch.tensor(e.policy)
                logp[i, :L] = torch.tensor(e.logp)
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=ids, response_mask=resp_mask,
            finish_reason=[e.finish for e in eps], group=torch.arange(B) // n,
            texts=[self.tokenizer.decode(e.ids, skip_special_tokens=True) for e in eps],
            gen_time_s=gen_time, gen_tokens=int(sum(sum(e.policy) for e in eps)), pad_token_id=pad,
            loss_mask=loss_mask, sampler_logp=logp if self._got_logp else None,
            info=[{"searches": e.searches, "turns": e.turns, "invalid_actions": e.invalid, "answered": e.answered,
                   "obs_tokens": e.obs_tokens, "retrieved": list(e.retrieved)} for e in eps])

    def _count(self, eps: list[_Episode], texts: list[str], examples: list[Example], retrieval_s: float,
               failures: int) -> None:
        c = self._counters
        turns = sum(e.turns for e in eps)
        scores = [score_response(t, golden_answers(ex)) for t, ex in zip(texts, examples)]
        c["em"] = c.get("em", 0) + sum(r.em for r in scores)
        c["f1"] = c.get("f1", 0) + sum(r.f1 for r in scores)
        for k, v in (("episodes", len(eps)), ("searches", sum(e.searches for e in eps)),
                     ("answered", sum(e.answered for e in eps)), ("invalid", sum(e.invalid for e in eps)),
                     ("turns", turns), ("obs_tokens", sum(e.obs_tokens for e in eps)),
                     ("retrieval_s", retrieval_s), ("search_failures", failures)):
            c[k] = c.get(k, 0) + v

    def metrics(self) -> dict[str, float]:
        """Per-response means since the last call (then reset): exact match and F1 of the last answer
        (the search reward's rules), searches, answered rate, turns, observation tokens, invalid
        actions (per turn), failed searches, retrieval seconds."""
        c, self._counters = self._counters, {}
        n = max(c.get("episodes", 0), 1)
        if not c:
            return {}
        return {"search/em": c["em"] / n, "search/f1": c["f1"] / n, "search/searches": c["searches"] / n,
                "search/answered_rate": c["answered"] / n,
                "search/invalid_action_rate": c["invalid"] / max(c["turns"], 1),
                "search/turns": c["turns"] / n, "search/obs_tokens": c["obs_tokens"] / n,
                "search/failures": c["search_failures"], "search/retrieval_s": c["retrieval_s"]}
