"""``train.async``: asynchronous RL (docs/async.md), one optional section: None (the default) is the
synchronous loop; ``train.async=K`` is short for ``train.async.max_staleness=K``. Rollouts are generated in
worker processes (`tether.asynchronous`) while the trainer updates; the workers are local processes or
remote ``tether worker`` processes reached over TCP, the ``transport`` chosen by its ``kind``."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator

from ..sections import Section

STALE_BATCHES = ("drop", "keep")


class LocalTransport(Section):
    """``train.async.transport.kind=local``: the rollout workers are processes of this machine (the default)."""

    kind: Literal["local"] = "local"
    """local"""


class RemoteTransport(Section):
    """``train.async.transport.kind=remote``: the trainer listens at ``address`` for ``train.async.workers``
    remote ``tether worker HOST:PORT`` processes (other nodes; jobs, weights per version and batches over TCP,
    authenticated with a shared secret read from an environment variable on both sides)."""

    kind: Literal["remote"] = "remote"
    """remote"""
    address: str = ""
    """HOST:PORT the trainer listens on (e.g. 10.0.0.5:29600, the cluster's private interface, not 0.0.0.0);
    required"""
    timeout_s: float = Field(600.0, gt=0)
    """how long the trainer waits for its remote workers to connect, and how long a connected worker may stay
    silent (they send a heartbeat every few seconds, also while generating) before the run stops with an error
    naming it; a closed connection is an error at once"""
    key_env: str = "TETHER_WORKER_KEY"
    """the environment variable that holds the shared secret (at least 32 characters; the secret itself is never
    written into a config or a run directory); each `tether worker` reads the same variable (--key-env)"""

    @field_validator("address")
    @classmethod
    def _host_port(cls, v: str) -> str:
        if not v:
            return v  # unset: check_train names it (the kind is set before the address)
        host, _, port = v.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"must be HOST:PORT (e.g. 10.0.0.5:29600, the cluster's private interface, not "
                             f"0.0.0.0), got {v!r}")
        return v


Transport = Annotated[Union[Annotated[LocalTransport, Tag("local")], Annotated[RemoteTransport, Tag("remote")]],
                      Discriminator(lambda v: (v.get("kind", "local") if isinstance(v, dict)
                                               else getattr(v, "kind", "local")))]


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
    replaced: a local one restarted, a remote one by the next `tether worker` that connects within the
    transport's timeout_s; the jobs it held are resubmitted and it loads the newest version. Beyond that (0 =
    never), or a worker that raises, the run stops with an error after a checkpoint of its last step"""
    transport: Transport = Field(default_factory=LocalTransport)
    """how the trainer reaches its workers: local (processes of this machine) | remote (tether worker processes
    on other nodes, over authenticated TCP); `train.async.transport=local` is short for its kind"""

    @field_validator("transport", mode="before")
    @classmethod
    def _transport_shorthand(cls, v: Any) -> Any:
        return {"kind": v} if isinstance(v, str) else v


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
