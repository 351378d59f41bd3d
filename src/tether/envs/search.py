"""The ``search`` environment: Search-R1's protocol over a retriever (``rollout.agent.env.name=search``).

One episode is one growing assistant turn (the raw observation format)::

    <think> ... </think> <search> q1 </search>        the policy's turn
    <information>Doc 1(Title: ...) ...</information>   the observation (render_observation)
    <think> ... </think> <answer> x </answer>          the policy's last turn

A turn's action is its first complete ``<search>`` or ``<answer>`` pair
(``tether.search.protocol.parse_action``). An answer ends the episode; a search is answered with
the passages (every search of a turn goes to the retriever as one batch); a turn with neither gets
:data:`~tether.search.protocol.INVALID_ACTION_MESSAGE`. The turn budget is ``max_searches + 1``:
after ``max_searches`` search turns one final turn runs that stops only at ``</answer>``, and a
search there is not executed. A retrieval that fails (server down, timeout) becomes an observation
saying so (``render_search_error``) and is counted.

The steps' reward parts are 0: the task's reward (``search_em``) scores the episode's text.
:meth:`SearchEnv.episode_info` records each episode's searches, answer and the ids of the passages
it was shown (``tether eval`` measures gold recall from them), and scores EM and F1 for
:meth:`SearchEnv.metrics`.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from ..search.protocol import (
    INVALID_ACTION_MESSAGE,
    OBSERVATION_FORMATS,
    STOP_STRINGS,
    parse_action,
    render_observation,
    render_search_error,
)
from ..search.retrievers import RetrievalError
from ..search.reward import golden_answers, score_response
from ..tasks.base import Example
from .base import Episode, FinalTurn, Start, StepResult, TextEnv

__all__ = ["SearchEnv", "FINAL_TURN"]

#: The last turn: it stops only at ``</answer>`` (a search there would not run); no note.
FINAL_TURN = FinalTurn(stop=("</answer>",))


class SearchEnv(TextEnv):
    """Search-R1's environment (module docstring).

    Args:
        retriever: a ``tether.search.retrievers.Retriever`` (``search(queries, k)``, batched).
        topk: passages per search.
        max_searches: searches per episode; then one final turn without search (the turn budget
            is ``max_searches + 1``).
        observation_format: how passages are rendered, one of
            ``tether.search.protocol.OBSERVATION_FORMATS`` (``"search_r1"``: Search-R1's exact bytes).
        reward: the reward spec scoring the episode's text (default None: the task's, ``search_em``).
    """

    name = "search"
    stop = tuple(STOP_STRINGS)
    final_turn = FINAL_TURN
    observation_tail = "</information>\n\n"

    def __init__(self, retriever, *, topk: int = 3, max_searches: int = 4, observation_format: str = "search_r1",
                 reward: Optional[str] = None):
        if topk < 1:
            raise ValueError(f"search environment: topk must be >= 1, got {topk}")
        if max_searches < 0:
            raise ValueError(f"search environment: max_searches must be >= 0, got {max_searches}")
        if observation_format not in OBSERVATION_FORMATS:
            raise ValueError(f"search environment: unknown observation_format {observation_format!r} "
                             f"(known: {', '.join(OBSERVATION_FORMATS)})")
        super().__init__(max_turns=max_searches + 1, reward=reward)
        self.retriever, self.topk, self.max_searches = retriever, topk, max_searches
        self.observation_format = observation_format
        self._counters: dict[str, float] = {}

    def start(self, example: Example) -> Start:
        """The example's prompt as it is (the search task builds it with the protocol's instruction)."""
        return Start(prompt=example.prompt, info={"id": example.id})

    def act_batch(self, episodes: Sequence[Episode], actions: Sequence[str]) -> list[StepResult]:
        """Answers end an episode; the turn's searches go to the retriever as one batch."""
        results: list[StepResult] = []
        queries: list[tuple[int, Episode, str]] = []
        for e, text in zip(episodes, actions):
            kind, content = parse_action(text)
            if kind == "answer":
                e.state["answered"] = True
                results.append(StepResult(done=True, info={"action": "answer", "answer": content}))
            elif e.final:  # no search runs on the last turn: the base class ends the episode
                results.append(StepResult(info={"action": kind}))
            elif kind == "search":
                queries.append((len(results), e, content))
                results.append(StepResult())
            else:
                results.append(StepResult(observation=INVALID_ACTION_MESSAGE, info={"action": None, "invalid": True}))
        if queries:
            for (i, e, q), (text, ids) in zip(queries, self._search([q for _, _, q in queries])):
                e.state["searches"] = e.state.get("searches", 0) + 1
                e.state.setdefault("retrieved", []).extend(ids)
                results[i] = StepResult(observation=text, info={"action": "search", "query": q, "tool_calls": 1})
        return results

    def _search(self, queries: list[str]) -> list[tuple[str, list[str]]]:
        """(observation, passage ids) per query, from one batched retrieval (a failure: an error observation)."""
        c, t0 = self._counters, time.perf_counter()
        try:
            found = self.retriever.search(queries, self.topk)
            if len(found) != len(queries):
                raise RetrievalError(f"the retriever answered {len(found)} of {len(queries)} queries", attempts=1)
            out = [(render_observation(r, self.observation_format), [p.id for p in r]) for r in found]
        except RetrievalError as err:
            out = [(render_search_error(str(err).splitlines()[0][:200]), [])] * len(queries)
            c["failures"] = c.get("failures", 0) + len(queries)
        c["retrieval_s"] = c.get("retrieval_s", 0.0) + time.perf_counter() - t0
        return out

    def episode_info(self, episode: Episode, text: str) -> dict:
        """Its searches, whether it answered, the passage ids it was shown; EM and F1 are counted."""
        c, st = self._counters, episode.state
        score = score_response(text, golden_answers(episode.example))
        for k, v in (("episodes", 1), ("em", score.em), ("f1", score.f1), ("searches", st.get("searches", 0)),
                     ("answered", bool(st.get("answered")))):
            c[k] = c.get(k, 0) + v
        return {"searches": st.get("searches", 0), "answered": bool(st.get("answered")),
                "retrieved": list(st.get("retrieved", []))}

    def metrics(self) -> dict[str, float]:
        """Per-episode means since the last call (then reset): exact match and F1 of the last answer (the
        search reward's rules), searches, answered rate; failed searches and retrieval seconds in all."""
        c, self._counters = self._counters, {}
        if not c.get("episodes"):
            return {}
        n = c["episodes"]
        return {"search/em": c["em"] / n, "search/f1": c["f1"] / n, "search/searches": c["searches"] / n,
                "search/answered_rate": c["answered"] / n, "search/failures": c.get("failures", 0),
                "search/retrieval_s": c.get("retrieval_s", 0.0)}
