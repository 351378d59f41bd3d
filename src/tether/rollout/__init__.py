"""Rollout engines: sample groups of responses from the policy.

`SamplingParams`, `RolloutBatch` and the `Engine` protocol live in `tether.rollout.base`
(torch only); `HFEngine` (transformers ``generate`` on the training model) in
`tether.rollout.hf`, imported lazily so that importing this package does not load
transformers; `VLLMEngine` (an in-process ``vllm.LLM``) in `tether.rollout.vllm`, imported
only when ``rollout.engine=vllm`` builds it. `make_engine` is the one place an engine is built
(``rollout.engine``).
"""

from __future__ import annotations

from typing import Any, Callable

from ..algo.registry import Registry
from .base import Engine, RolloutBatch, SamplingParams

__all__ = ["ENGINES", "Engine", "HFEngine", "RolloutBatch", "SamplingParams", "engine_reports_logp", "make_engine"]


def _hf(cfg, model, tokenizer, **overrides: Any) -> Engine:
    """transformers ``generate`` on the training model itself (shares its weights: nothing to sync)."""
    from .hf import HFEngine  # deferred: pulls in transformers

    opts = dict(batch_size=cfg.batch_size, share_prompt=cfg.engine.share_prompt, prune_every=cfg.engine.prune_every,
                reuse_kv=cfg.reuse_kv)  # rollout.reuse_kv: keep multi-turn episodes' KV
    opts.update(overrides)
    return HFEngine(model, tokenizer, **opts)


def _vllm(cfg, model, tokenizer, **overrides: Any) -> Engine:
    """An in-process vLLM engine with its own copy of the weights, synced after each trainer step
    (needs the .venv-vllm environment: ``bash scripts/setup.sh --vllm``)."""
    from .vllm import VLLMEngine  # deferred: read at call time (tests patch tether.rollout.vllm.VLLMEngine)

    e = cfg.engine  # rollout.engine (kind vllm); an option left at its default is "not set" (GPU-only options
    # are errors on CPU)
    gmu = e.gpu_memory_utilization
    opts = dict(dtype=e.dtype, max_model_len=e.max_model_len, enforce_eager=e.enforce_eager,
                gpu_memory_utilization=None if gmu == type(e).model_fields["gpu_memory_utilization"].default else gmu,
                kv_cache_gb=e.kv_cache_gb, sleep=e.sleep, sync_bucket_mb=e.sync_bucket_mb, prefix_caching=cfg.reuse_kv)
    opts.update(overrides)
    return VLLMEngine(model, tokenizer, **opts)


def _vllm_server(cfg, model, tokenizer, **overrides: Any) -> Engine:
    """vLLM servers (launched by tether, or the user's), weights through vLLM's weight-transfer protocol (needs the
    .venv-vllm environment for the trainer too: it drives vLLM's trainer engine)."""
    from .served import ServedEngine  # deferred: the weight transfer imports vLLM

    opts = dict(seed=overrides.pop("seed", 0), log_dir=overrides.pop("log_dir", None))
    if overrides:
        raise TypeError(f"rollout.engine=vllm_server takes no option {sorted(overrides)[0]!r}")
    return ServedEngine(model, tokenizer, cfg.engine, **opts)


#: engine name -> builder(cfg, model, tokenizer, **overrides); metadata ``reports_logp``: whether the
#: engine fills ``RolloutBatch.sampler_logp`` (rollout correction, ``algo.tis_cap``)
ENGINES: Registry[Callable[..., Engine]] = Registry("rollout.engine", required=("reports_logp",))
ENGINES.register("hf", reports_logp=False)(_hf)
ENGINES.register("vllm", reports_logp=True)(_vllm)
ENGINES.register("vllm_server", reports_logp=True)(_vllm_server)


def engine_reports_logp(name: str) -> bool:
    """Whether engine ``name`` reports the sampled tokens' log-probs (``RolloutBatch.sampler_logp``)."""
    return bool(ENGINES.meta(name)["reports_logp"])


def worker_records_logp(name: str) -> bool:
    """Whether a rollout worker (``train.async``) running engine ``name`` passes the sampled tokens'
    log-probs on: the hf engine records them when asked (the workers ask), an engine that reports them anyway
    does; another registered engine may not."""
    return name == "hf" or (name in ENGINES and engine_reports_logp(name))


def make_engine(cfg, model, tokenizer, **overrides: Any) -> Engine:
    """The engine ``cfg.engine.kind`` names, for ``model``.

    ``cfg`` is a ``tether.config.RolloutConfig`` (its ``engine`` section holds the engine's own keys);
    ``overrides`` replace single engine options (e.g. ``show_progress=True``). An unknown name is a
    ValueError with a did-you-mean.
    """
    return ENGINES[cfg.engine.kind](cfg, model, tokenizer, **overrides)


def __getattr__(name):
    """Lazily import `HFEngine` (pulls in transformers)."""
    if name == "HFEngine":
        from .hf import HFEngine  # deferred: the lazy attribute itself (pulls in transformers)

        return HFEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
