"""Partial rollouts (``train.async.partial_rollout_tokens`` S; docs/async.md): a rollout worker samples in segments
of S tokens and takes the newest pushed weights between segments, recording the version of every token.

    segment 0: engine.generate(prompts, n, max_new_tokens=S)            version v0 (loaded before the job)
    refresh(): a newer version pushed? load it (weights copied, engine reloaded, checksummed)  -> v1 >= v0
    segment 1: engine.generate(prompt_i + its tokens so far, n=1, S)     for the rows not finished yet
    ...        until every row ended (EOS, a stop string, or max_new_tokens in all)

A continuation re-encodes its prompt and tokens with the weights of its segment (no KV computed with
older weights is reused: the HF engine gets no sessions, vLLM's prefix cache is reset by its reload), so
each token is sampled by exactly the version recorded for it, and its log-prob (``sampler_logp``, mu) is
that version's. Rows are cut with the engine's own rule on the whole response (`RowPostprocess`), so a
stop string split across two segments ends the row where it would have ended unsegmented (tokens
sampled past it are dropped). The oldest token's version is the batch's version: staleness is measured
by it, and the staleness bound of the workers holds unchanged (every token is sampled by a version at
least as new as the one loaded at the job's start).

`Segmented` wraps an engine as an engine, so the single-turn agent runs on it unchanged; the rows of its
last call are the batch's rows, which is why partial rollouts are for ``rollout.agent=single_turn``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

from ..rollout.base import RolloutBatch, SamplingParams


class Segmented:
    """``engine`` generating in segments of ``segment`` tokens, calling ``refresh()`` (returns the version it
    holds after loading any newer one) between segments. After `generate`, ``token_version`` [B, T] long
    holds each response token's version (-1 on padding) and ``swaps`` how many newer versions it took."""

    supports_sessions = False  # continuations re-encode with the segment's weights

    def __init__(self, engine, segment: int, refresh: Callable[[], int]):
        if segment < 1:
            raise ValueError(f"segment must be >= 1, got {segment}")
        self.engine, self.segment, self.refresh = engine, segment, refresh
        self.token_version: Optional[torch.Tensor] = None
        self.swaps = 0

    def __getattr__(self, name):  # max_model_len, tokenizer, eos ids, ...: the wrapped engine's
        return getattr(self.engine, name)

    def sync_weights(self, model) -> None:
        self.engine.sync_weights(model)

    def release(self, sessions=None) -> None:
        pass

    def generate(self, prompts: list[list[int]], params: SamplingParams, sessions=None) -> RolloutBatch:
        params.validate()
        eng, S, t0 = self.engine, self.segment, time.perf_counter()
        prompts = [list(map(int, p)) for p in prompts]
        row_group = [g for g in range(len(prompts)) for _ in range(params.n)]
        toks: list[list[int]] = [[] for _ in row_group]
        logps: list[list[float]] = [[] for _ in row_group]
        vers: list[list[int]] = [[] for _ in row_group]
        open_rows, version, first, k, self.swaps = list(range(len(row_group))), self.refresh(), True, 0, 0
        while open_rows:
            done = len(toks[open_rows[0]])  # every open row has the same length: k full segments
            seg = dataclasses.replace(
                params, n=params.n if first else 1, max_new_tokens=min(S, params.max_new_tokens - done),
                min_new_tokens=min(max(params.min_new_tokens - done, 0), S, params.max_new_tokens - done),
                seed=None if params.seed is None else (params.seed + 1_000_003 * k) % 2**31)
            rb = eng.generate(prompts if first else [prompts[row_group[i]] + toks[i] for i in open_rows], seg)
            if rb.sampler_logp is None:
                raise RuntimeError("partial rollouts need an engine that reports its log-probs")
            still = []
            for j, i in enumerate(open_rows):
                m = rb.response_mask[j]
                new = rb.response_ids[j][m].tolist()
                toks[i] += new
                logps[i] += rb.sampler_logp[j][m].tolist()
                vers[i] += [version] * len(new)
                ended = rb.finish_reason[j] == "stop" or len(toks[i]) >= params.max_new_tokens
                if not ended and params.stop and eng.stop_prefix(toks[i], params.stop) is not None:
                    ended = True  # a stop string split across two segments
                if not ended:
                    still.append(i)
            open_rows, first, k = still, False, k + 1
            if open_rows:
                newer = self.refresh()
                self.swaps += newer != version
                version = newer
        results, cut_logps = [], []
        for i in range(len(row_group)):
            kept, reason, text = eng.finish_row(toks[i], params)
            results.append((kept, reason, text))
            cut_logps.append(logps[i][:len(kept)])
            vers[i] = vers[i][:len(kept)]
        batch = eng.assemble(prompts, row_group, results, cut_logps)
        tv = torch.full(batch.response_ids.shape, -1, dtype=torch.long)
        for i, v in enumerate(vers):
            tv[i, :len(v)] = torch.tensor(v, dtype=torch.long)
        self.token_version = tv
        batch.gen_time_s = time.perf_counter() - t0
        return batch


def token_metrics(got, step: int) -> dict:
    """The trainer's metrics of a partial rollout ``got`` (a `tether.asynchronous.workers.Rollout`) at version ``step``:
    its newest token's version, the versions taken mid-job, the mean staleness over response tokens."""
    tv = got.token_version[got.rb.response_mask]
    return {"async/newest_version": int(tv.max()) if tv.numel() else got.version, "async/swaps": len(got.later),
            "async/token_staleness_mean": float((step - tv).float().mean()) if tv.numel() else 0.0}
