"""`VerifiersV1Agent`: a verifiers 0.4 environment (`tether.envs.verifiers_v1`) run with the policy, token-exact.

    for each example, n times (concurrently, in one asyncio loop, inside ``env.serving()``):
        episode = await env.run_slot(slot, ModelContext(model, TrainClient -> tether's endpoint, sampling))
    each trace's branches -> rows of a RolloutBatch

verifiers runs each rollout itself: its harness program (the null chat harness by default) talks to verifiers'
interception server, which renders the conversation to token ids with ``renderers`` and asks the model through a
``TrainClient``. Here that client calls `tether.rollout.endpoint.GenerateEndpoint`, a loopback endpoint over the
run's engine (the served engine's vLLM servers, or the hf engine), so the policy's tokens are the engine's sampled
ids verbatim with the sampler's log-probs, and verifiers records them in the trace's message graph.

Rows. A trace's message graph has one branch per training sample (verifiers' ``Trace.branches``): the tokens
of a root-to-leaf path, ``sampled_mask`` True exactly on the tokens the policy sampled, and their log-probs. A row
is one branch: its prompt is every token before the first sampled one, its response every token after, with
``loss_mask`` = the sampled mask (what the harness, the tools or the user inserted is masked) and
``sampler_logp`` = the branch's log-probs. A trace whose later turn does not extend the earlier tokens (a template
that rewrites history) has forked into several branches in verifiers' own graph, and becomes several samples, each
token-exact (the trace's data allows it, so nothing is dropped or re-tokenized). Each row's ``info`` holds the
trace's reward (``env_reward``) and verdict (``env_correct``: reward >= ``pass_threshold``).

Failures. An error of the task's own code (``TaskError``: its reward or setup raised) is an `EnvError` naming the
environment and the example. A model call the engine failed (non-finite logits, a server gone) is raised as the
engine's own error (the trainer checkpoints). A trace that errored otherwise (its harness program or a tool) is
kept as a row with an empty loss mask and counted (``verifiers/errors``); a batch in which every trace errored is
an `EnvError` with the first error. A trace with no token ids (its client was not a training client) is an
`EnvError`.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections import Counter
from typing import Any, Sequence

import torch

from ..envs.verifiers_v1 import VerifiersV1Env, library
from ..errors import EnvError
from ..rollout.base import RolloutBatch, SamplingParams
from ..rollout.endpoint import GenerateEndpoint
from ..tasks.base import Example

__all__ = ["VerifiersV1Agent"]

MODEL_NAME = "tether"  # what verifiers' client calls the model (the endpoint's /v1/models)


class VerifiersV1Agent:
    """The agent of a verifiers 0.4 environment (module doc). ``max_concurrency``: episodes in flight at once."""

    def __init__(self, engine, tokenizer, env: VerifiersV1Env, *, system_prompt: str = "", max_concurrency: int = 64,
                 **_options: Any):
        self.engine, self.tokenizer, self.env, self.max_concurrency = engine, tokenizer, env, max_concurrency
        if hasattr(engine, "record_logp"):
            engine.record_logp = True  # the hf engine keeps the sampler's log-probs of what it samples
        config = getattr(getattr(engine, "model", None), "config", None)  # the hf engine's model: its context
        self.endpoint = GenerateEndpoint(engine, model=MODEL_NAME,
                                         max_len=int(getattr(config, "max_position_embeddings", 0) or 0))
        self._key_var = f"TETHER_VF_ENDPOINT_{id(self)}"  # the client reads its key from this variable
        os.environ[self._key_var] = self.endpoint.token
        self._tok_dir = tempfile.TemporaryDirectory(prefix="tether-vf-tokenizer-")
        tokenizer.save_pretrained(self._tok_dir.name)  # renderers loads the tokenizer by path: the run's own
        self._metrics: dict[str, float] = {}

    def _context(self, params: SamplingParams):
        vf = library()
        client = vf.TrainClientConfig(base_url=self.endpoint.url + "/v1", api_key_var=self._key_var,
                                      renderer=self.env.renderer, renderer_model_name=self._tok_dir.name)
        greedy = params.is_greedy
        extra = {} if greedy or not params.top_k else {"top_k": params.top_k}
        if params.min_new_tokens:
            extra["min_tokens"] = params.min_new_tokens
        if params.stop:
            extra["stop"] = list(params.stop)
        sampling = vf.SamplingConfig(temperature=0.0 if greedy else params.temperature,
                                     top_p=1.0 if greedy else params.top_p, max_tokens=params.max_new_tokens, **extra)
        return vf.ModelContext(model=MODEL_NAME, client=client, sampling=sampling)

    def rollout(self, examples: Sequence[Example], params: SamplingParams) -> RolloutBatch:
        """``params.n`` episodes of each example; a row per branch of each trace (module doc)."""
        params.validate()
        env = self.env.env
        tasks = [self.env.tasks(e.meta["vf_split"])[e.meta["vf_task"]] for e in examples]
        ctx = self._context(params)
        self.endpoint.seed = params.seed
        self.endpoint.failure = None
        busy = self.endpoint.busy_s

        async def run():
            sem = asyncio.Semaphore(self.max_concurrency)
            async with env.serving():
                slots = [(g, s) for g, task in enumerate(tasks) for s in env.slots(task, params.n)]
                episodes = await asyncio.gather(*(env.run_slot(s, ctx, sem) for _, s in slots))
            return [(g, ep) for (g, _), ep in zip(slots, episodes)]

        results = asyncio.run(run())
        if self.endpoint.failure is not None:  # the engine itself failed a request: its error, as any rollout's
            raise self.endpoint.failure
        batch = self._batch(examples, results)
        batch.gen_time_s = self.endpoint.busy_s - busy  # the time the engine was generating for these episodes
        return batch

    # ------------------------------------------------------------ traces -> rows

    def _batch(self, examples: Sequence[Example], results: list) -> RolloutBatch:
        rows, errors, stops, calls, first_error = [], 0, Counter(), [], None
        for g, ep in results:
            traces = list(ep.traces)
            if not traces:
                errors += 1
                first_error = first_error or "; ".join(e.message for e in ep.errors)[:500] or "no trace"
                rows.append(self._empty(g, {"env_reward": 0.0, "env_correct": False, "vf_error": "no trace"}))
                continue
            for tr in traces:
                stops[tr.stop_condition or "none"] += 1
                calls.append(len(tr.calls))
                task_errors = [e for e in tr.errors if e.type in ("TaskError",)]
                if task_errors:
                    raise EnvError(f"verifiers:{self.env.env_id}: the taskset raised on example "
                                   f"{examples[g].id!r} ({task_errors[0].type}): {task_errors[0].message[:500]}")
                branches = [b for b in tr.branches if b.trainable and any(b.sampled_mask)]
                info = {"env_reward": float(tr.reward or 0.0), "env_correct": float(tr.reward or 0.0) >=
                        self.env.pass_threshold, "vf_stop": tr.stop_condition, "vf_turns": len(tr.calls)}
                if tr.errors or not branches:
                    if not tr.errors and tr.calls:
                        raise EnvError(f"verifiers:{self.env.env_id}: the trace of example {examples[g].id!r} has "
                                       f"model calls but no token ids: its client was not a training client (tether "
                                       f"sets it: drop rollout.agent.env.options.agent.client)")
                    errors += 1
                    first_error = first_error or (f"{tr.errors[0].type}: {tr.errors[0].message[:500]}" if tr.errors
                                                  else "the episode made no model call")
                    rows.append(self._empty(g, {**info, "env_reward": 0.0, "env_correct": False,
                                                "vf_error": first_error}))
                    continue
                reason = "length" if tr.calls and tr.calls[-1].finish_reason == "length" else "stop"
                for b in branches:
                    rows.append(self._row(g, b, reason, info))
        if rows and errors == len(rows):
            raise EnvError(f"verifiers:{self.env.env_id}: every episode of the batch failed; the first: {first_error}")
        self._metrics = {"verifiers/errors": float(errors), "verifiers/samples_per_trace":
                         len(rows) / max(1, sum(len(list(ep.traces)) for _, ep in results)),
                         "verifiers/model_calls": sum(calls) / max(1, len(calls)),
                         **{f"verifiers/stop/{k}": float(v) for k, v in stops.items()}}
        return self._assemble(rows)

    def _row(self, g: int, b, reason: str, info: dict) -> dict:
        ids, mask = [int(t) for t in b.token_ids], [bool(m) for m in b.sampled_mask]
        logps = [float(x) for x in (b.logprobs if b.logprobs is not None else [0.0] * len(ids))]
        start = mask.index(True)
        resp = ids[start:]
        return {"group": g, "prompt": ids[:start], "response": resp, "mask": mask[start:], "logp": logps[start:],
                "reason": reason, "text": self.tokenizer.decode([t for t, m in zip(resp, mask[start:]) if m],
                                                                skip_special_tokens=True), "info": info}

    def _empty(self, g: int, info: dict) -> dict:
        """A row for an episode that produced no sample: one padding token, nothing to train on."""
        pad = self._pad()
        return {"group": g, "prompt": [pad], "response": [pad], "mask": [False], "logp": [0.0], "reason": "stop",
                "text": "", "info": info}

    def _pad(self) -> int:
        t = self.tokenizer
        return int(t.pad_token_id if t.pad_token_id is not None else t.eos_token_id)

    def _assemble(self, rows: list[dict]) -> RolloutBatch:
        pad, B = self._pad(), len(rows)
        P = max(len(r["prompt"]) for r in rows)
        T = max(len(r["response"]) for r in rows)
        prompt_ids = torch.full((B, P), pad, dtype=torch.long)
        prompt_mask = torch.zeros((B, P), dtype=torch.bool)
        response_ids = torch.full((B, T), pad, dtype=torch.long)
        response_mask = torch.zeros((B, T), dtype=torch.bool)
        loss_mask = torch.zeros((B, T), dtype=torch.bool)
        logp = torch.zeros((B, T), dtype=torch.float32)
        for i, r in enumerate(rows):
            p, n = r["prompt"], len(r["response"])
            prompt_ids[i, P - len(p):] = torch.tensor(p)
            prompt_mask[i, P - len(p):] = True
            response_ids[i, :n] = torch.tensor(r["response"])
            response_mask[i, :n] = True
            loss_mask[i, :n] = torch.tensor(r["mask"])
            logp[i, :n] = torch.tensor(r["logp"])
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                            response_mask=response_mask, finish_reason=[r["reason"] for r in rows],
                            group=torch.tensor([r["group"] for r in rows], dtype=torch.long),
                            texts=[r["text"] for r in rows], gen_time_s=0.0,  # set by rollout
                            gen_tokens=int(loss_mask.sum()), pad_token_id=pad, loss_mask=loss_mask,
                            sampler_logp=logp, info=[r["info"] for r in rows])

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def close(self) -> None:
        self.endpoint.close()
        os.environ.pop(self._key_var, None)

