"""Validation of train.* against the other sections (part of ``tether.resolve.validate.check``): mini-batches
against the batch, an iterative anchor that would be exactly on-policy, the ESS-scaled step (``train.lr_scale``)
against the engine, and asynchronous training (``train.async`` and the options of the rollout workers,
`tether.asynchronous.workers`, against the engine, the agent and the rollout; the served engine's asynchronous
mode). A key that has no effect under the resolved settings is a problem too. The rules within train.* itself
(micro-batches by count or by tokens, packing without a shared prompt, the ESS floor and power, stale batches) are
validators beside their keys (`tether.config.schema.TrainConfig`, `tether.config.train_async.AsyncConfig`).
"""

from __future__ import annotations

from ..config.recipes import AlgoConfig
from ..config.schema import Config
from ..rollout import ENGINES, engine_reports_logp, worker_records_logp
from ..sections import default


def check_train(cfg: Config) -> list[str]:
    """train.*: mini-batches against the batch, an iterative anchor that would be exactly on-policy, and asynchronous
    training (`_check_async`)."""
    r, t, errs = cfg.rollout, cfg.train, []
    if r.prompts_per_step * r.n < t.mini_batches:
        errs.append("train.mini_batches exceeds the number of sequences per step")
    if (cfg.algo.anchor.kind == "iterative" and t.epochs == 1 and t.mini_batches == 1
            and cfg.algo.kl.estimator != "none"):
        errs.append("anchor 'iterative' with train.epochs=1 and train.mini_batches=1 is exactly on-policy: "
                    "pi_a = pi_old = pi, so the KL term is identically zero; use train.mini_batches > 1 "
                    "or train.epochs > 1, or another anchor")
    return errs + _check_lr_scale(cfg) + _check_async(cfg)


def _check_lr_scale(cfg: Config) -> list[str]:
    """train.lr_scale where the sampler is the trainer's own policy (its floor and power without it: their
    section's rule, `TrainConfig`)."""
    t, r, errs = cfg.train, cfg.rollout, []
    if t.lr_scale == "none":
        return []
    if t.max_staleness == 0 and r.engine.kind in ENGINES and not engine_reports_logp(r.engine.kind):
        errs.append(f"train.lr_scale={t.lr_scale} has no effect here: with train.async none and "
                    f"rollout.engine.kind={r.engine.kind} the sampler is the trainer's own policy (mu = pi_old, no "
                    f"engine log-probs), so ESS/N is 1 at every step; use it with train.async (the workers report "
                    f"mu) or rollout.engine=vllm")
    return errs


def _check_async(cfg: Config) -> list[str]:
    """train.async (tether.asynchronous.workers): what its section's own types cannot say, each rule a check of
    its own."""
    r, a, errs = cfg.rollout, cfg.train.async_, []
    if a is None:
        return []
    if r.engine.kind == "vllm_server":  # the servers generate: the local workers' own keys have no effect
        local = [k for k in ("verify_sync", "verify_logp_tol", "partial_rollout_tokens", "worker_restarts")
                 if getattr(a, k) != default(type(a), k)]
        if local:
            errs.append(f"train.async.{local[0]} applies to local rollout workers, and rollout.engine.kind=vllm_server "
                        f"runs none: its servers are verified after every update (rollout.engine.verify_logp_tol), "
                        f"updated in flight (partial rollouts, each token's version recorded), and not restarted")
    if a.verify_logp_tol != default(type(a), "verify_logp_tol") and not (a.verify_sync and r.engine.kind == "vllm"):
        errs.append("train.async.verify_logp_tol only applies with train.async.verify_sync=true and "
                    "rollout.engine.kind=vllm (the vLLM workers' probe)")
    if not a.correction and correction_set(cfg.algo):
        errs.append("train.async.correction=false has no effect: a rollout correction is set by hand (algo.tis_cap / "
                    "algo.mask_* / algo.kl_sampler), and it is used as given")
    if a.partial_rollout_tokens:
        if r.agent.kind != "single_turn":
            errs.append(f"train.async.partial_rollout_tokens (partial rollouts) supports rollout.agent.kind="
                        f"single_turn only, got {r.agent.kind!r}")
        if a.partial_rollout_tokens >= r.max_new_tokens:
            errs.append(f"train.async.partial_rollout_tokens={a.partial_rollout_tokens} has no effect: a response has "
                        f"at most rollout.max_new_tokens={r.max_new_tokens} tokens, one segment")
    if r.dynamic_sampling:
        errs.append("train.async does not support rollout.dynamic_sampling (its refills are decided after scoring, "
                    "in the trainer)")
    return errs


#: the rollout correction train.async.correction applies (docs/evidence.md, staleness): TIS cap 2 + IcePop [0.5, 5]
ASYNC_CORRECTION = {"tis_cap": 2.0, "mask_token_low": 0.5, "mask_token_high": 5.0}
CORRECTION_KEYS = ("tis_cap", "tis_mode", "mask_token_low", "mask_token_high", "mask_seq_high", "mask_geo", "mask_kl",
                   "mask_kl_max", "mask_opsm", "kl_sampler")


def correction_set(algo: AlgoConfig) -> bool:
    """Whether any rollout-correction key of ``algo`` differs from its default."""
    return any(getattr(algo, k) != default(AlgoConfig, k) for k in CORRECTION_KEYS)


def apply_async_correction(cfg: Config) -> Config:
    """train.async.correction: with train.async on, an engine whose workers pass their log-probs on, and no
    correction key set, set ASYNC_CORRECTION in ``cfg.algo`` (in place; idempotent: once set, the keys are no
    longer at their defaults). `load_config` and `tether.assemble.build_parts` (for a Config built in Python) call
    it."""
    a = cfg.train.async_
    if a is not None and a.correction and not correction_set(cfg.algo) and worker_records_logp(cfg.rollout.engine.kind):
        for k, v in ASYNC_CORRECTION.items():
            setattr(cfg.algo, k, v)
    return cfg
