"""`MultiTurnAgent`: runs any text environment (``tether.envs``) with the policy, token-exact.

One rollout runs ``params.n`` episodes per example as one batch::

    starts = [env.reset(ex) for ex in examples for _ in range(n)]   # prompts (text or chat messages)
    while env.active():                                              # every active episode decodes together
        turn = engine.generate(contexts, stop=env.stop_strings())    # policy ids, kept exactly as sampled
        results = env.step(turn texts)                               # one batched call of the tools
        append each observation's tokens (loss_mask False), or end the episode

Token bookkeeping. The policy's sampled ids are appended as they came from the engine (never
decoded and re-tokenized); an observation is tokenized and appended with ``loss_mask`` False.
Observations take one of two forms (``observation_format``): ``raw``, text inside the one
assistant turn (Search-R1's format), or ``chat``, a turn of the chat template
(:mod:`tether.agents.chat_turns`, token-exact as well).

The environment is a user's code: what its ``reset``, ``step`` and ``finish`` return is checked
(``tether.envs.base``: a ``Start`` with a text or chat prompt, one ``StepResult`` per action with a text
observation and a finite reward part), and anything it raises or returns amiss is an ``EnvError`` naming
its class, the method and the example. No loop waits on it behaving: an episode still active after the
environment's ``max_turns`` turns is an ``EnvError``, and one whose context is full ends even if the
environment ignores ``cut``.

Budgets: ``params.max_new_tokens`` new tokens per policy turn; ``max_obs_tokens`` per observation
(raw format: cut keeping the environment's ``observation_tail`` and the final-turn note; chat format:
the observation's text is cut and the template closes its turn); ``max_context`` tokens of prompt +
response in all, at most the model's context and the engine's (``engine.max_model_len`` when it has
one, e.g. ``rollout.engine.max_model_len``); a larger one is lowered to it, with a warning. A turn that
fills the context is the episode's last (``env.cut``: no tool runs on it); an observation that
fills it ends the episode. Either way the finish reason is ``"length"``. An episode the
environment ends on its own terms (an answer) finishes ``"stop"``; one whose turn budget ran out
finishes with its last turn's reason.

Each token is encoded once. With an engine that keeps sessions (``engine.supports_sessions``: the
transformers engine keeps each episode's KV cache between turns, vLLM its prefix cache), every
episode is a session: turn t encodes only the tokens added since turn t-1, and an episode's
cache is released when it ends.

Metrics (per episode, since the last call, under the environment's name): ``turns``,
``tool_calls``, ``invalid_action_rate`` (invalid turns / turns), ``obs_tokens``, ``env_s``
(seconds in ``env.step``), plus the environment's own ``metrics()``. ``RolloutBatch.info`` holds
each episode's record (its counters, its reward parts ``env_reward``, ``env.finish``'s record and,
under ``start``, what ``reset`` said of it), and ``samples.jsonl`` the whole trajectory. In the chat
format a turn the environment answers with no observation leaves the assistant message open: the
next turn's text joins it.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..envs.base import call_env, check_count, check_result, check_start, env_error
from ..rollout.base import RolloutBatch, SamplingParams
from ..tasks.base import Example
from ..tasks.prompts import agent_prompt_encoder, chat_messages
from .chat_turns import OBSERVATION_FORMATS, ChatTurns

__all__ = ["MultiTurnAgent", "turn_of"]

_SESSIONS = itertools.count()


@dataclass
class _Episode:
    """One trajectory: the ids after the prompt, which of them the policy sampled, and its counters."""

    index: int
    prompt: list[int]
    example: Optional[Example] = None  # what it runs on (errors of the environment name its id)
    messages: Optional[list] = None  # the conversation so far (chat observation format)
    start_info: dict = field(default_factory=dict)  # what the environment's reset said of the episode
    pending: tuple = ("", ())  # chat format: the text and ids of turns not yet closed by an observation
    ids: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    done: bool = False
    finish: str = "stop"
    turns: int = 0
    tool_calls: int = 0
    invalid: int = 0
    obs_tokens: int = 0
    reward: float = 0.0

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.ids)

    def add(self, ids: list[int], policy: bool, logp: Optional[list[float]] = None) -> None:
        self.ids += ids
        self.policy += [policy] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)


class _EnvPrompts:
    """The agent's prompts (``Agent.prompts``) as the environment opens its episodes (its ``start``, without
    opening one; an environment without ``start``: the example's prompt): their ids (``encode``, for
    ``tether eval``'s length order) and the check of every dataset row against the context (``check``:
    text prompts; chat-message prompts are checked when drawn)."""

    def __init__(self, agent: "MultiTurnAgent"):
        self.agent, self.context = agent, agent.encoder.context

    def _prompt(self, ex: Example):
        env = self.agent.env
        start = getattr(env, "start", None)
        return check_start(env, "start", ex, call_env(env, "start", ex, start, ex)).prompt if callable(start) \
            else ex.prompt

    def encode(self, examples: Sequence[Example], max_new_tokens: int) -> list[list[int]]:
        return [self.agent._encode(self._prompt(ex), ex, max_new_tokens)[0] for ex in examples]

    def check(self, examples: Sequence[Example], max_new_tokens: int) -> None:
        texts = [Example(p, ex.answer, ex.id, ex.meta) for ex in examples if isinstance(p := self._prompt(ex), str)]
        self.agent.encoder.check(texts, max_new_tokens)


def turn_of(rb: RolloutBatch, j: int, cap: int, tokenizer) -> tuple[list[int], Optional[list[float]], str, str]:
    """Row ``j`` of an engine's batch as one policy turn, cut to ``cap`` ids (then finished ``"length"``): its ids,
    the engine's log-probs of them (None when it reports none), its text and its finish reason."""
    m = rb.response_mask[j]
    ids = rb.response_ids[j][m].tolist()
    logp = rb.sampler_logp[j][m].tolist() if rb.sampler_logp is not None else None
    reason = rb.finish_reason[j]
    if len(ids) > cap:
        ids, logp, reason = ids[:cap], (logp[:cap] if logp is not None else None), "length"
    text = rb.texts[j] if len(ids) == int(m.sum()) else tokenizer.decode(ids, skip_special_tokens=True)
    return ids, logp, text, reason


def _prompt_key(prompt) -> str:
    """A hashable identity of an environment's opening prompt (text, or chat messages)."""
    return prompt if isinstance(prompt, str) else json.dumps(list(prompt), sort_keys=True, default=str)


class MultiTurnAgent:
    """Runs the environment ``env`` with the policy (module docstring).

    Args:
        engine: a ``tether.rollout.Engine`` (every active episode decodes in one call per turn).
        tokenizer: the policy's tokenizer (prompts and observations are tokenized with it).
        env: a ``tether.envs.Env`` (one batch of episodes per rollout).
        system_prompt: a system message before a text prompt ("" = none).
        max_obs_tokens: tokens per observation (longer ones are cut, keeping ``env.observation_tail``).
        max_context: prompt + response tokens per episode (at most the model's context).
        prompt_overflow: a first prompt that leaves no room under the cap: ``"error"`` or ``"truncate"``.
        observation_format: ``"raw"`` (text inside the assistant turn) or ``"chat"`` (a chat-template turn).
        observation_role: the observation turn's role in the chat format: ``"tool"`` or ``"user"``.
        reuse_kv: keep each episode's cache in the engine between turns when it can (``supports_sessions``).
    """

    def __init__(self, engine, tokenizer, env, *, system_prompt: str = "", max_obs_tokens: int = 512,
                 max_context: int = 4096, prompt_overflow: str = "error", observation_format: str = "raw",
                 observation_role: str = "tool", reuse_kv: bool = True):
        for name, v in (("max_obs_tokens", max_obs_tokens), ("max_context", max_context)):
            if v < 1:
                raise ValueError(f"{env.name} agent: {name} must be >= 1, got {v}")
        if observation_format not in OBSERVATION_FORMATS:
            raise ValueError(f"{env.name} agent: unknown observation_format {observation_format!r} "
                             f"(known: {', '.join(OBSERVATION_FORMATS)})")
        self.engine, self.tokenizer, self.env, self.system_prompt = engine, tokenizer, env, system_prompt
        served = getattr(engine, "max_model_len", None)  # an engine that serves less than the model (vLLM's cap)
        cap = max_context if not served else min(max_context, int(served))
        encoder = agent_prompt_encoder(engine, tokenizer, system_prompt, prompt_overflow, max_context=cap, reserve=1)
        if encoder.context < max_context:
            print(f"[tether] warning: {env.name} agent: max_context={max_context} is more than the model's context "
                  f"or the engine's ({encoder.context} tokens); episodes end at {encoder.context} tokens",
                  file=sys.stderr)
        self.encoder = encoder
        self.prompts = _EnvPrompts(self)
        self.max_obs_tokens, self.max_context = max_obs_tokens, encoder.context
        self.chat = ChatTurns(tokenizer, observation_role, getattr(engine, "eos_token_ids", None)) \
            if observation_format == "chat" else None
        self.sessions = bool(reuse_kv and getattr(engine, "supports_sessions", False))
        self._ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
        self._tail = self._ids(env.observation_tail) if getattr(env, "observation_tail", "") else []
        self._counters: dict[str, float] = {}

    # ------------------------------------------------------------ the episode loop

    def rollout(self, examples: Sequence[Example], params: SamplingParams) -> RolloutBatch:
        """``params.n`` episodes per example (rows of example ``i`` contiguous, ``group == i``)."""
        for i in self.env.active():  # a rollout that raised left its episodes open: close them
            self.env.end(i)
        eps, first = self._start(examples, params)
        key, t_gen, t_env = next(_SESSIONS), 0.0, 0.0
        self._got_logp = True
        budget = self._turn_budget()
        try:
            for turn in range(budget + 1):  # bounded whatever the environment does
                active = [e for e in eps if not e.done]
                if not active:
                    break
                if turn == budget:
                    raise env_error(self.env, "step", [e.example for e in active], f"kept {len(active)} episode(s) "
                                    f"going after {budget} turns, its max_turns: an environment ends each episode "
                                    f"within its turn budget (a done StepResult)")
                t0 = time.perf_counter()
                outs = self._decode(active, params, turn, first if turn == 0 else None, key)
                t_gen += time.perf_counter() - t0
                for e, (ids, logp, _, _) in zip(active, outs):
                    e.add(ids, True, logp)
                    e.turns += 1
                    if e.length >= self.max_context:
                        self.env.cut(e.index)  # the context is full: this turn is its last
                t0 = time.perf_counter()
                results = self._step(active, [text for _, _, text, _ in outs])
                t_env += time.perf_counter() - t0
                for e, r, (ids, _, text, reason) in zip(active, results, outs):
                    self._after(e, r, ids, text, reason)
                    if not e.done and e.length >= self.max_context:  # full, and the environment ignored cut
                        e.done, e.finish = True, "length"
                        self.env.end(e.index)
                if self.sessions:
                    self.engine.release([(key, e.index) for e in active if e.done])
        finally:
            if self.sessions:
                self.engine.release([(key, e.index) for e in eps])
        rb = self._batch(eps, params.n, t_gen)
        for e, text in zip(eps, rb.texts):
            record = call_env(self.env, "finish", e.example, self.env.finish, e.index, text)
            if not isinstance(record, dict):
                raise env_error(self.env, "finish", e.example, f"returned a {type(record).__name__}, not a dict")
            rb.info[e.index].update(record, start=e.start_info)
        self._count(eps, t_env)
        return rb

    def _start(self, examples: Sequence[Example], params: SamplingParams):
        """Open ``n`` episodes per example; returns them and, when each example's ``n`` prompts are the
        same, one prompt per example (turn 0 then samples ``n`` per prompt, sharing the prompt)."""
        eps, shared = [], []
        env = self.env
        for ex in examples:
            starts = [check_start(env, "reset", ex, call_env(env, "reset", ex, env.reset, ex)) for _ in range(params.n)]
            keys, seen = [_prompt_key(s.prompt) for s in starts], {}
            for s, key in zip(starts, keys):  # each distinct opening prompt tokenized once (usually all n are one)
                if key not in seen:
                    seen[key] = self._encode(s.prompt, ex, params.max_new_tokens)
            encoded = [seen[key] for key in keys]
            for (ids, messages), s in zip(encoded, starts):
                eps.append(_Episode(index=len(eps), prompt=list(ids), example=ex, start_info=dict(s.info),
                                    messages=None if messages is None else list(messages)))  # grows per episode
            shared.append(encoded[0][0] if all(ids == encoded[0][0] for ids, _ in encoded) else None)
        return eps, (shared if all(p is not None for p in shared) else None)

    def _turn_budget(self) -> int:
        """The most turns an episode may take: the environment's ``max_turns`` (the context's tokens if it has none)."""
        m = getattr(self.env, "max_turns", None)
        return m if isinstance(m, int) and not isinstance(m, bool) and m >= 1 else self.max_context

    def _step(self, active: list[_Episode], texts: list[str]) -> list:
        """The environment's step on the turn's ``texts``: one checked StepResult per active episode."""
        env, examples = self.env, [e.example for e in active]
        results = call_env(env, "step", examples, env.step, texts)
        check_count(env, "step", examples, results)
        return [check_result(env, "step", e.example, r) for e, r in zip(active, results)]

    def _encode(self, prompt, ex: Example, max_new_tokens: int) -> tuple[list[int], Optional[list]]:
        """The opening prompt's ids (fitted in the context) and, in the chat format, its messages."""
        if isinstance(prompt, str):
            ids = self.encoder.encode([Example(prompt, ex.answer, ex.id, ex.meta)], max_new_tokens)[0]
            return ids, (chat_messages(Example(prompt, "", ""), self.system_prompt) if self.chat else None)
        text = self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
        return self.encoder.fit(self._ids(text), ex, max_new_tokens), list(prompt)

    def _decode(self, active: list[_Episode], params: SamplingParams, turn: int,
                first: Optional[list[list[int]]], key: int):
        """One policy turn for every active episode: (ids, logp, text, finish reason) per episode."""
        room = max(self.max_context - e.length for e in active)
        sp = SamplingParams(n=params.n if first is not None else 1, temperature=params.temperature,
                            top_p=params.top_p, top_k=params.top_k, greedy=params.greedy,
                            max_new_tokens=max(1, min(params.max_new_tokens, room)), stop=self.env.stop_strings(),
                            seed=None if params.seed is None else (params.seed + 7919 * turn) % (2**31))
        prompts = first if first is not None else [e.prompt + e.ids for e in active]
        kw = {"sessions": [(key, e.index) for e in active]} if self.sessions else {}
        rb = self.engine.generate(prompts, sp, **kw)
        self._got_logp = self._got_logp and rb.sampler_logp is not None
        return [turn_of(rb, j, self.max_context - e.length, self.tokenizer) for j, e in enumerate(active)]  # own room

    def _after(self, e: _Episode, r, ids: list[int], text: str, reason: str) -> None:
        """Apply one step's result to its episode: counters, the end, or the observation."""
        e.reward += r.reward
        e.tool_calls += int(r.info.get("tool_calls", 0))
        e.invalid += int(bool(r.info.get("invalid", False)))
        if r.done:
            e.done = True
            e.finish = "stop" if not r.truncated else "length" if e.length >= self.max_context else reason
        elif r.observation is not None:
            self._observe(e, r.observation, ids, text)
        elif self.chat is not None:  # the assistant message goes on: the next turn's text joins it
            e.pending = (e.pending[0] + text, (*e.pending[1], *ids))

    def _observe(self, e: _Episode, observation: str, turn_ids: list[int], turn_text: str) -> None:
        """Append an observation's tokens (not the policy's), cut to max_obs_tokens and to the context cap."""
        if self.chat is not None:
            turn_text, turn_ids = e.pending[0] + turn_text, [*e.pending[1], *turn_ids]
            e.pending = ("", ())
            obs = self._ids(observation)
            if len(obs) > self.max_obs_tokens:  # cut the text; the template closes the turn after it
                observation = self.tokenizer.decode(obs[:self.max_obs_tokens])
            ids = self.chat.observation_ids(e.messages, turn_text, turn_ids, observation)
            e.messages += [{"role": "assistant", "content": turn_text},
                           {"role": self.chat.role, "content": observation}]
        else:
            ids = self._ids(observation)
            if len(ids) > self.max_obs_tokens:
                ids = self._cut(observation)
        room = self.max_context - e.length
        if len(ids) >= room:  # no room left for the policy to act on it
            ids = ids[:room]
            e.done, e.finish = True, "length"
            self.env.end(e.index)
        e.add(ids, False)
        e.obs_tokens += len(ids)

    def _cut(self, observation: str) -> list[int]:
        """An observation's ids cut to ``max_obs_tokens``, keeping ``env.observation_tail`` and, when it ends with
        it and both fit, the final-turn rule's note (``TextEnv`` adds it after the tail; a note cut short would
        say nothing, so it is kept whole or dropped)."""
        note = getattr(getattr(self.env, "final_turn", None), "note", "")
        note = note if note and observation.endswith(note) else ""
        body, end = self._ids(observation[:len(observation) - len(note)]), self._ids(note) if note else []
        if len(end) + len(self._tail) > self.max_obs_tokens:
            body, end = self._ids(observation), []
        room = self.max_obs_tokens - len(end)
        if len(body) <= room:
            return body + end
        keep = max(room - len(self._tail), 0)
        return body[:keep] + self._tail[: room - keep] + end

    # ------------------------------------------------------------ batch and metrics

    def _batch(self, eps: list[_Episode], n: int, gen_time: float) -> RolloutBatch:
        pad = getattr(self.engine, "pad_token_id", 0)
        B, P, T = len(eps), max(len(e.prompt) for e in eps), max(max(len(e.ids) for e in eps), 1)
        prompt_ids = torch.full((B, P), pad, dtype=torch.long)
        prompt_mask = torch.zeros(B, P, dtype=torch.bool)
        ids = torch.full((B, T), pad, dtype=torch.long)
        resp_mask, loss_mask = torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.bool)
        logp = torch.zeros(B, T)
        for i, e in enumerate(eps):
            if e.prompt:
                prompt_ids[i, P - len(e.prompt):] = torch.tensor(e.prompt)
                prompt_mask[i, P - len(e.prompt):] = True
            L = len(e.ids)
            if L:
                ids[i, :L], resp_mask[i, :L] = torch.tensor(e.ids), True
                loss_mask[i, :L], logp[i, :L] = torch.tensor(e.policy), torch.tensor(e.logp)
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=ids, response_mask=resp_mask,
            finish_reason=[e.finish for e in eps], group=torch.arange(B) // n,
            texts=[self.tokenizer.decode(e.ids, skip_special_tokens=True) for e in eps],
            gen_time_s=gen_time, gen_tokens=int(sum(sum(e.policy) for e in eps)), pad_token_id=pad,
            loss_mask=loss_mask, sampler_logp=logp if self._got_logp else None,
            info=[{"turns": e.turns, "tool_calls": e.tool_calls, "invalid_actions": e.invalid,
                   "obs_tokens": e.obs_tokens, "env_reward": e.reward} for e in eps])

    def _count(self, eps: list[_Episode], env_s: float) -> None:
        c = self._counters
        for k, v in (("episodes", len(eps)), ("turns", sum(e.turns for e in eps)),
                     ("tool_calls", sum(e.tool_calls for e in eps)), ("invalid", sum(e.invalid for e in eps)),
                     ("obs_tokens", sum(e.obs_tokens for e in eps)), ("env_s", env_s)):
            c[k] = c.get(k, 0) + v

    def metrics(self) -> dict[str, float]:
        """Per-episode means since the last call (then reset), under the environment's name: turns, tool
        calls, invalid actions per turn, observation tokens; seconds in the environment in all; and the
        environment's own metrics."""
        c, self._counters = self._counters, {}
        if not c:
            return {}
        p, n = self.env.name, max(c["episodes"], 1)
        out = {f"{p}/turns": c["turns"] / n, f"{p}/tool_calls": c["tool_calls"] / n,
               f"{p}/invalid_action_rate": c["invalid"] / max(c["turns"], 1), f"{p}/obs_tokens": c["obs_tokens"] / n,
               f"{p}/env_s": c["env_s"]}
        return {**out, **self.env.metrics()}
