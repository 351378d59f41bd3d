"""`VerifiersAgent`: runs a verifiers environment (`tether.envs.verifiers`) with the policy, token-exact.

A verifiers environment drives its episodes itself: it calls a ``vf.Client`` for every assistant turn. Here that
client is in-process and backed by tether's engine::

    for each example, n times (concurrently, in one asyncio loop):
        state = await env.rollout(row, client, ...)       # each turn: await client.get_response(messages, tools)
    await env.rubric.score_group(the example's n states)  # the episode's reward (info["env_reward"])

Every rollout's turn requests wait in one queue; when every unfinished rollout waits on the model, the queue goes to
``engine.generate`` as one batch (the environments' own code, e.g. tool calls, runs in between). When some rollouts
wait on something else (a slow tool), the waiting turns go after `BATCH_WAIT_S` at the latest. The state of one
``rollout`` call (its episodes' tokens, the queue) lives in a `_Call`, created per call: the agent keeps none of it.

Token bookkeeping, as `tether.agents.multi_turn` keeps it in the chat format. Turn 1's ids are the chat template's
rendering of the environment's prompt messages, with the tool definitions (``tools=``; a template that renders none,
SmolLM2's, gets them described in the system message in the Hermes format). A later turn's messages must be the
earlier ones, the assistant's turn, then new messages (tool results, a user's reply); its ids are the earlier prompt
ids, the ids the policy sampled (verbatim, never re-tokenized) and the ids of only the new messages
(`tether.agents.chat_turns.ChatTurns.continuation_ids`: the difference of two renderings), marked False in
``loss_mask``. A template that rewrites earlier turns, or an environment that rewrites earlier messages, is an error
naming it. The engine's log-probs of the sampled ids are kept beside them (``sampler_logp``), and returned to the
environment in the response's ``tokens`` (``prompt_ids``, ``completion_ids``, ``completion_logprobs``), as
verifiers stores them in ``state["trajectory"]``.

Tool calls are parsed from the turn's text in the format of the model family (``tool_format``): ``hermes``
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: Qwen 2.5 / 3, SmolLM, Hermes; also every template
that renders no tools) or ``llama3_json`` (Llama 3.1+: a JSON object ``{"name": ..., "parameters": {...}}``);
``auto`` reads it from the template. A template that renders tools in another format is a ConfigError. A tool call
whose JSON does not parse goes to the environment as a call to ``invalid`` with the text as its arguments (a
``ToolEnv`` answers it with the error, as it answers any failed call).

An episode the environment marks with ``state["error"]`` (a ``vf.Error``: a tool that raised a stop error, ...)
is kept with its ``loss_mask`` all False and counted (``verifiers/errors``); anything else the environment's code
raises is an `EnvError` naming it and the example.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ..envs.verifiers import VerifiersEnv, message_text
from ..errors import ConfigError, EnvError
from ..rollout.base import RolloutBatch, SamplingParams
from ..tasks.base import Example
from ..tasks.prompts import agent_prompt_encoder
from ..userio import json_copy
from .chat_turns import ChatTemplateError, ChatTurns
from .multi_turn import turn_of
from .tool_calls import parse_tool_calls, template_tool_format, tools_system_text
from .verifiers_client import MODEL_NAME, Native, client_class, dump_messages, tool_dict

__all__ = ["VerifiersAgent"]

BATCH_WAIT_S = 0.2  # the longest a waiting turn waits for the episodes that wait on something else than the model


@dataclass
class _Trace:
    """One episode's tokens: the opening prompt's ids, then every id after it (the policy's, and the messages')."""

    example: Example
    prompt: list[int] = field(default_factory=list)
    seen: list[dict] = field(default_factory=list)  # the messages as the environment sent them last
    rendered: list[dict] = field(default_factory=list)  # the conversation as tether renders it (tools described)
    turn_text: str = ""
    turn_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    finish: str = "stop"
    turns: int = 0
    tool_calls: int = 0
    obs_tokens: int = 0

    def add(self, ids: list[int], policy: bool, logp: Optional[list[float]] = None) -> None:
        self.ids += ids
        self.policy += [policy] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)


@dataclass
class _Call:
    """The state of one `VerifiersAgent.rollout` call: its episodes (row ``r`` plays ``examples[r]``), their traces,
    and the turns that wait on the model."""

    key: int  # the call's session namespace in the engine
    params: SamplingParams
    examples: list[Example]
    traces: dict[int, _Trace] = field(default_factory=dict)
    pending: list = field(default_factory=list)  # (context ids, max new tokens, future, row) of each waiting turn
    calls: int = 0  # engine.generate calls so far (each one's seed differs)
    gen_time: float = 0.0
    fatal: Optional[BaseException] = None  # the first error that ends the call
    changed: Optional[asyncio.Event] = None  # set when a turn starts waiting or an episode ends (made in the loop)


#: the episode the running task plays: its call and row (each episode's task sets it; the client reads it)
_EPISODE: contextvars.ContextVar[tuple[_Call, int]] = contextvars.ContextVar("tether_verifiers_episode")


class _Prompts:
    """The opening prompts' ids (``tether eval``'s length order) and the check of every row against the context."""

    def __init__(self, agent: "VerifiersAgent"):
        self.agent = agent

    def encode(self, examples: Sequence[Example], max_new_tokens: int) -> list[list[int]]:
        a = self.agent
        return [a._open(a._input(ex)["prompt"], a._template_tools(a.env.env.tool_defs), ex, max_new_tokens)[0]
                for ex in examples]

    def check(self, examples: Sequence[Example], max_new_tokens: int) -> None:
        self.encode(examples, max_new_tokens)


class VerifiersAgent:
    """Runs the verifiers environment ``env`` with the policy (module docstring).

    Args:
        engine: a ``tether.rollout.Engine`` (every waiting turn decodes in one call).
        tokenizer: the policy's tokenizer (it must have a chat template).
        env: a `tether.envs.verifiers.VerifiersEnv`.
        system_prompt: refused (the environment's rows carry their own system prompt).
        max_obs_tokens: tokens per new message's text (longer ones are cut; the template closes the message).
        max_context: prompt + response tokens per episode (at most the model's context).
        prompt_overflow: an opening prompt that leaves no room: ``"error"`` or ``"truncate"``.
        observation_format: must be ``"chat"`` (the environment's messages are chat turns).
        observation_role: unused (each message carries its role); accepted for the multi_turn options.
        reuse_kv: keep each episode's cache in the engine between turns when it can (``supports_sessions``: the
            transformers engine's KV, vLLM's prefix cache), so a turn encodes only the tokens added since the last.
    """

    def __init__(self, engine, tokenizer, env: VerifiersEnv, *, system_prompt: str = "", max_obs_tokens: int = 512,
                 max_context: int = 4096, prompt_overflow: str = "error", observation_format: str = "chat",
                 observation_role: str = "tool", reuse_kv: bool = True):
        if system_prompt:
            raise ConfigError("data.system_prompt has no effect with a verifiers environment (its rows carry their "
                              "own system prompt)")
        if observation_format != "chat":
            raise ConfigError("a verifiers environment's messages are chat turns: set "
                              "rollout.agent.env.observation_format=chat")
        self.engine, self.tokenizer, self.env, self.vf = engine, tokenizer, env, env.vf
        served = getattr(engine, "max_model_len", None)
        cap = max_context if not served else min(max_context, int(served))
        self.encoder = agent_prompt_encoder(engine, tokenizer, "", prompt_overflow, max_context=cap, reserve=1)
        self.max_context, self.max_obs_tokens = self.encoder.context, max_obs_tokens
        self.chat = ChatTurns(tokenizer, "tool", getattr(engine, "eos_token_ids", None))
        self.tool_format, self.renders_tools = template_tool_format(tokenizer, env.tool_format)
        self.prompts = _Prompts(self)
        self.client = client_class(self.vf)(self)
        self.sessions = bool(reuse_kv and getattr(engine, "supports_sessions", False))
        self._key = 0  # the last rollout call's session namespace (one per call)
        sa = getattr(env.env, "sampling_args", None) or {}
        stop = sa.get("stop")
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        self._ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
        self._counters: dict[str, float] = {}

    # ------------------------------------------------------------ the rollout

    def rollout(self, examples: Sequence[Example], params: SamplingParams) -> RolloutBatch:
        """``params.n`` episodes per example (rows of example ``i`` contiguous, ``group == i``)."""
        rows = [(i, ex) for i, ex in enumerate(examples) for _ in range(params.n)]
        self._key += 1
        call = _Call(key=self._key, params=params, examples=[ex for _, ex in rows])
        t0 = time.perf_counter()
        try:
            states = _run(self._episodes(call, rows, params.n))
        finally:
            if self.sessions:
                self.engine.release([(("verifiers", call.key), r) for r in range(len(rows))])
        if call.fatal is not None:
            raise call.fatal
        rb = self._batch(call, rows, states, params.n)
        self._count(call, states, time.perf_counter() - t0 - call.gen_time)
        return rb

    async def _episodes(self, call: _Call, rows: list[tuple[int, Example]], n: int) -> list:
        env = self.env.env
        sampling = dict(getattr(env, "sampling_args", None) or {})
        call.changed = asyncio.Event()

        async def one(r: int, ex: Example):
            _EPISODE.set((call, r))
            try:
                return await env.rollout(self._input(ex), self.client, MODEL_NAME, sampling)
            except Exception as e:  # the environment's own code (a vf.Error it did not catch, or any other)
                if call.fatal is None:
                    call.fatal = EnvError(f"verifiers environment {self.env.env_id!r}: rollout on example "
                                          f"{ex.id!r} raised {type(e).__name__}: {e}")
                raise

        tasks = [asyncio.ensure_future(one(r, ex)) for r, (_, ex) in enumerate(rows)]
        for t in tasks:
            t.add_done_callback(lambda _: call.changed.set())
        await self._drive(call, tasks)
        states = await asyncio.gather(*tasks, return_exceptions=True)
        if call.fatal is not None:
            return states
        for g in range(0, len(states), n):  # the rubric scores each example's group together
            group = states[g:g + n]
            try:
                await env.rubric.score_group(group)
                for s in group:
                    await env.rubric.cleanup(s)
            except Exception as e:  # noqa: BLE001
                call.fatal = EnvError(f"verifiers environment {self.env.env_id!r}: its rubric raised "
                                       f"{type(e).__name__}: {e} scoring example {rows[g][1].id!r}")
                return states
        return states

    async def _drive(self, call: _Call, tasks: list) -> None:
        """Send the waiting turns to the engine as one batch whenever every unfinished episode waits on the model,
        or, when some wait on something else, `BATCH_WAIT_S` after the first turn of the batch began to wait.

        ``call.changed`` is set whenever a turn starts waiting (`_turn`) or an episode ends (its task's done
        callback); this loop clears it and sleeps on it in between, so it runs only when something changed."""
        loop = asyncio.get_running_loop()
        while not all(t.done() for t in tasks):
            deadline = None
            while len(call.pending) < sum(not t.done() for t in tasks):
                if call.pending and deadline is None:
                    deadline = loop.time() + BATCH_WAIT_S
                timeout = None if deadline is None else deadline - loop.time()
                if timeout is not None and timeout <= 0:
                    break
                call.changed.clear()
                try:
                    await asyncio.wait_for(call.changed.wait(), timeout)
                except asyncio.TimeoutError:
                    break
            if call.pending:
                self._flush(call)

    def _flush(self, call: _Call) -> None:
        batch, call.pending = call.pending, []
        p = call.params
        sp = SamplingParams(n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, greedy=p.greedy,
                            max_new_tokens=max(m for _, m, _, _ in batch), stop=list(self.stop),
                            seed=None if p.seed is None else (p.seed + 7919 * call.calls) % (2**31))
        call.calls += 1
        t0 = time.perf_counter()
        try:
            kw = {"sessions": [(("verifiers", call.key), row) for _, _, _, row in batch]} if self.sessions else {}
            rb = self.engine.generate([ids for ids, _, _, _ in batch], sp, **kw)
        except Exception as e:  # noqa: BLE001  (the engine's failure ends the rollout, as it does elsewhere)
            call.fatal = call.fatal or e
            for _, _, fut, _ in batch:
                fut.set_exception(e)
            return
        call.gen_time += time.perf_counter() - t0
        for j, (_, cap, fut, _) in enumerate(batch):
            ids, logp, text, reason = turn_of(rb, j, cap, self.tokenizer)
            fut.set_result((ids, [0.0] * len(ids) if logp is None else logp, text, reason))

    # ------------------------------------------------------------ one turn (the client's request)

    def _input(self, ex: Example) -> dict:
        row = ex.meta.get("vf_input") if isinstance(ex.meta, dict) else None
        if row is None:  # a row of another task: its prompt as one user message
            row = {"prompt": [{"role": "user", "content": ex.prompt}], "answer": ex.answer, "example_id": 0}
        return json_copy(row, default=str)  # a copy the environment may keep

    def _template_tools(self, tools) -> list[dict]:
        return [t if isinstance(t, dict) else tool_dict(t) for t in (tools or [])]

    def _prepare(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        """The opening messages as rendered: with the tools described in the system message when the template
        renders none."""
        msgs = [dict(m, content=message_text(m.get("content"))) for m in messages]
        if tools and not self.renders_tools:
            desc = tools_system_text([t["function"] for t in tools])
            if msgs and msgs[0].get("role") == "system":
                msgs[0] = dict(msgs[0], content=msgs[0]["content"] + "\n\n" + desc)
            else:
                msgs.insert(0, {"role": "system", "content": desc})
        return msgs

    def _render_tools(self, tools: list[dict]) -> Optional[list[dict]]:
        return tools if tools and self.renders_tools else None

    def _open(self, messages, tools, ex: Example, max_new_tokens: int) -> tuple[list[int], list[dict]]:
        rendered = self._prepare(dump_messages(messages), tools)
        text = self.chat.render(rendered, generation_prompt=True, tools=self._render_tools(tools))
        return self.encoder.fit(self._ids(text), ex, max_new_tokens), rendered

    async def _turn(self, messages: list[dict], tools: Optional[list[dict]]) -> Native:
        call, row = _EPISODE.get()
        tools = list(tools or [])
        tr = call.traces.get(row)
        try:
            if tr is None:
                ex = call.examples[row]
                tr = call.traces[row] = _Trace(example=ex)
                tr.prompt, tr.rendered = self._open(messages, tools, ex, call.params.max_new_tokens)
            else:
                self._extend(tr, messages, tools)
        except (ChatTemplateError, ConfigError, EnvError) as e:
            call.fatal = call.fatal or _named(e, self.env.env_id)
            raise
        tr.seen = list(messages)
        room = self.max_context - len(tr.prompt) - len(tr.ids)
        if room <= 0:
            tr.finish = "length"
            raise self.vf.OverlongPromptError("the episode filled its context (rollout.agent.env.max_context)")
        fut = asyncio.get_running_loop().create_future()
        context = tr.prompt + tr.ids
        call.pending.append((context, max(1, min(call.params.max_new_tokens, room)), fut, row))
        call.changed.set()
        ids, logp, text, reason = await fut
        tr.add(ids, True, logp)
        tr.turn_text, tr.turn_ids, tr.turns, tr.finish = text, ids, tr.turns + 1, reason
        if len(tr.prompt) + len(tr.ids) >= self.max_context:
            tr.finish = "length"
        content, calls = parse_tool_calls(text, self.tool_format, tr.turns) if tools else (text, [])
        tr.tool_calls += len(calls)
        return Native(context, ids, logp, text, reason, content, calls)

    def _extend(self, tr: _Trace, messages: list[dict], tools: list[dict]) -> None:
        """Append the ids of the messages after the policy's last turn (masked), checking the conversation only
        grew."""
        k = len(tr.seen)
        if len(messages) <= k or messages[:k] != tr.seen or messages[k].get("role") != "assistant":
            raise EnvError(f"verifiers environment {self.env.env_id!r} rewrote the conversation of example "
                           f"{tr.example.id!r} (its turn {tr.turns + 1} messages do not extend turn {tr.turns}'s "
                           f"messages and the assistant's reply): tether trains on the ids as sampled, so each turn "
                           f"must extend the last")
        new = []
        for m in messages[k + 1:]:
            text = message_text(m.get("content"))
            ids = self._ids(text)
            if len(ids) > self.max_obs_tokens:
                text = self.tokenizer.decode(ids[:self.max_obs_tokens])
            new.append({**{kk: v for kk, v in m.items() if kk in ("role", "name", "tool_call_id")}, "content": text})
        obs = self.chat.continuation_ids(tr.rendered, tr.turn_text, tr.turn_ids, new, tools=self._render_tools(tools))
        tr.rendered = tr.rendered + [{"role": "assistant", "content": tr.turn_text}, *new]
        room = self.max_context - len(tr.prompt) - len(tr.ids)
        if len(obs) >= room:
            obs = obs[:max(room, 0)]
        tr.add(obs, False)
        tr.obs_tokens += len(obs)

    # ------------------------------------------------------------ batch and metrics

    def _batch(self, call: _Call, rows: list[tuple[int, Example]], states: list, n: int) -> RolloutBatch:
        pad = getattr(self.engine, "pad_token_id", 0)
        traces = []
        for r, (_, ex) in enumerate(rows):
            tr = call.traces.get(r)
            if tr is None:  # the environment ended the episode before the model's first turn
                tr = _Trace(example=ex)
                tr.prompt = self._open(self._input(ex)["prompt"], self._template_tools(self.env.env.tool_defs), ex,
                                       call.params.max_new_tokens)[0]
            traces.append(tr)
        B, P = len(traces), max(max(len(t.prompt) for t in traces), 1)
        T = max(max(len(t.ids) for t in traces), 1)
        prompt_ids = torch.full((B, P), pad, dtype=torch.long)
        prompt_mask = torch.zeros(B, P, dtype=torch.bool)
        ids = torch.full((B, T), pad, dtype=torch.long)
        resp_mask, loss_mask = torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.bool)
        logp = torch.zeros(B, T)
        info = []
        for i, (tr, st) in enumerate(zip(traces, states)):
            if tr.prompt:
                prompt_ids[i, P - len(tr.prompt):] = torch.tensor(tr.prompt)
                prompt_mask[i, P - len(tr.prompt):] = True
            L = len(tr.ids)
            err = st.get("error") if isinstance(st, dict) else None
            if L:
                ids[i, :L], resp_mask[i, :L], logp[i, :L] = torch.tensor(tr.ids), True, torch.tensor(tr.logp)
                if err is None:
                    loss_mask[i, :L] = torch.tensor(tr.policy)
            reward = float(st.get("reward") or 0.0) if err is None else 0.0
            if st.get("prompt_too_long"):
                tr.finish = "length"
            rec = {"turns": tr.turns, "tool_calls": tr.tool_calls, "obs_tokens": tr.obs_tokens, "env_reward": reward,
                   "env_correct": err is None and reward >= self.env.pass_threshold,
                   "stop_condition": st.get("stop_condition"),
                   "metrics": {k: float(v) for k, v in (st.get("metrics") or {}).items()
                               if isinstance(v, (int, float))}}
            if err is not None:
                rec["error"] = f"{type(err).__name__}: {err}"
            info.append(rec)
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=ids, response_mask=resp_mask,
            finish_reason=[t.finish for t in traces], group=torch.arange(B) // n,
            texts=[self.tokenizer.decode(t.ids, skip_special_tokens=True) for t in traces],
            gen_time_s=call.gen_time, gen_tokens=int(sum(sum(t.policy) for t in traces)), pad_token_id=pad,
            loss_mask=loss_mask, sampler_logp=logp, info=info)

    def _count(self, call: _Call, states: list, env_s: float) -> None:
        c = self._counters
        c["episodes"] = c.get("episodes", 0) + len(states)
        c["env_s"] = c.get("env_s", 0.0) + max(env_s, 0.0)
        for tr in call.traces.values():
            c["turns"] = c.get("turns", 0) + tr.turns
            c["tool_calls"] = c.get("tool_calls", 0) + tr.tool_calls
            c["obs_tokens"] = c.get("obs_tokens", 0) + tr.obs_tokens
        for st in states:
            c["errors"] = c.get("errors", 0) + int(st.get("error") is not None)
            c["reward"] = c.get("reward", 0.0) + float(st.get("reward") or 0.0)
            for k, v in (st.get("metrics") or {}).items():
                if isinstance(v, (int, float)):
                    c[f"m:{k}"] = c.get(f"m:{k}", 0.0) + float(v)

    def metrics(self) -> dict[str, float]:
        """Per-episode means since the last call (then reset), under ``verifiers/``: turns, tool calls, the new
        messages' tokens, errors (the rate of episodes the environment marked with ``state["error"]``), the rubric's
        reward and each rubric metric; and seconds in the environment's own code in all."""
        c, self._counters = self._counters, {}
        if not c:
            return {}
        n = max(c["episodes"], 1)
        out = {f"verifiers/{k}": c.get(k, 0) / n for k in ("turns", "tool_calls", "obs_tokens", "errors", "reward")}
        out["verifiers/env_s"] = c["env_s"]
        out.update({f"verifiers/{k[2:]}": v / n for k, v in c.items() if k.startswith("m:")})
        return out


def _named(e: Exception, env_id: str) -> Exception:
    if isinstance(e, ChatTemplateError):
        return ChatTemplateError(f"verifiers environment {env_id!r}: the chat template rewrites earlier turns when a "
                                 f"turn is added, so the environment's messages cannot be appended to the ids the "
                                 f"policy sampled; run a model whose template only appends")
    return e


def _run(coro):
    """Run ``coro`` to its end: in this thread, or in a new one when an event loop already runs here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    out: dict[str, Any] = {}

    def target():
        try:
            out["v"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            out["e"] = e

    th = threading.Thread(target=target)
    th.start()
    th.join()
    if "e" in out:
        raise out["e"]
    return out["v"]
