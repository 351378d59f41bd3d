"""``train.async``: asynchronous RL (docs/async.md), one optional section: None (the default) is the
synchronous loop; ``train.async=K`` is short for ``train.async.max_staleness=K``. Rollouts are generated while
the trainer updates: by local worker processes (`tether.asynchronous.workers`), or, with
``rollout.engine.kind=vllm_server``, by vLLM servers on this node or others (`tether.asynchronous.served`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..sections import Section, only_with

STALE_BATCHES = ("drop", "keep")


class AsyncConfig(Section):
    """``train.async``: rollouts generated in worker processes while the trainer updates, each batch by weights
    at most ``max_staleness`` trainer updates older than the policy it trains. No rollout.dynamic_sampling;
    under torchrun the workers belong to rank 0 and every rank trains on its share of each batch; the workers
    (rollout.engine hf or vllm) report the engine's log-probs, so algo.tis_cap can correct the lag."""

    max_staleness: int = Field(1, ge=1)
    """K >= 1: the most trainer updates a batch's weights may lag behind the policy it trains"""
    correction: bool = True
    """with every rollout-correction key left off (algo.tis_cap, algo.mask_*, algo.kl_sampler at their defaults)
    and an engine whose workers pass log-probs on (hf, vllm): correct the lag as docs/evidence.md recommends,
    TIS capped at 2 with IcePop's token mask [0.5, 5] (algo.tis_cap=2 algo.mask_token_low=0.5
    algo.mask_token_high=5, written into the resolved config); false = train stale batches uncorrected.
    Correction keys set by hand are used as given"""
    workers: int = Field(1, ge=1)
    """rollout worker processes, each with its own copy of the model; up to max(max_staleness + 1, workers)
    batches are in flight, so more than max_staleness + 1 workers make batches older than K possible
    (stale_batches)"""
    stale_batches: Literal[STALE_BATCHES] = "drop"
    """workers > max_staleness + 1 (the only setting where a batch can be older than K): drop (discard it, its
    prompts skipped, counted in async/dropped; the default, as K stays a hard bound on what trains) | keep
    (train on it: the staleness is then bounded by workers - 1, and algo.tis_cap corrects it)"""
    _stale = only_with("stale_batches", holds=lambda a: a.get("workers", 2) > a.get("max_staleness", 0) + 1,
                       text=lambda a: f"has no effect: with train.async.workers={a.get('workers')} <= "
                                      f"train.async.max_staleness + 1 no batch can be more than "
                                      f"{a.get('max_staleness')} versions old")
    verify_sync: bool = False
    """checksum every pushed weights version on both sides (the trainer: what it pushed; a worker: its model's
    weights read back after loading) and stop with an error on a mismatch (one hash pass over the weights per
    version and side; tests turn it on). rollout.engine=vllm: the worker's vLLM engine also reports its
    log-probs of a fixed probe text, compared with the trainer's (verify_logp_tol)"""
    verify_logp_tol: float = Field(0.02, gt=0)
    """verify_sync with rollout.engine=vllm: the largest mean absolute log-prob difference per probe token
    between a worker's vLLM engine and the trainer at the same version (float32 engines agree to ~1e-5; raise it
    for bfloat16 if version 0 already fails); above it the run stops: vLLM kept older weights"""
    partial_rollout_tokens: int = Field(0, ge=0)
    """rollout.agent=single_turn: 0 = a worker samples a whole batch with one weights version; S > 0 = partial
    rollouts: it samples in segments of S tokens and takes a newer pushed version between segments (the rest of
    a response re-encoded with it), recording each token's version; a batch's staleness is its oldest token's
    (async/token_staleness_mean: the mean over tokens)"""
    worker_restarts: int = Field(2, ge=0)
    """how many times in a run a rollout worker that dies (killed, out of memory, its connection lost) is
    restarted; the jobs it held are resubmitted and it loads the newest version. Beyond that (0 =
    never), or a worker that raises, the run stops with an error after a checkpoint of its last step"""


def async_shorthand(value: Any) -> Any:
    """``train.async=K`` -> ``{max_staleness: K}``; ``train.async=none`` / ``0`` / ``false`` -> None (off)."""
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("none", "null", "off", "")):
        return None
    if isinstance(value, bool):
        return {}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None if value == 0 else {"max_staleness": value}
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return None if int(value) == 0 else {"max_staleness": int(value)}
    return value
