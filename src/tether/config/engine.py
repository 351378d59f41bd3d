"""``rollout.engine``: the sampling engine, a section chosen by its ``kind``, each kind with its own keys
(`tether.rollout.ENGINES` builds it). ``rollout.engine=vllm`` is short for ``rollout.engine.kind=vllm``."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag

from ..sections import Section

VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")


class HFEngineConfig(Section):
    """``rollout.engine.kind=hf``: transformers ``generate`` on the training model (the default)."""

    kind: Literal["hf"] = "hf"
    """hf"""
    share_prompt: bool = True
    """pre-fill each distinct prompt once per generate call and copy its KV cache to its n samples"""
    prune_every: int = Field(64, ge=0)
    """decode in segments of N tokens and drop finished rows between them (0 = never; generate alone decodes
    finished rows until the longest ends)"""


class VLLMEngineConfig(Section):
    """``rollout.engine.kind=vllm``: an in-process vLLM engine (its own venv: ``scripts/setup.sh --vllm``); it
    reports its log-probs, which ``algo.tis_cap`` uses. The GPU-only and CPU-only keys are checked when the
    engine starts, where vLLM's platform is known."""

    kind: Literal["vllm"] = "vllm"
    """vllm"""
    dtype: Literal[VLLM_DTYPES] = "auto"
    """the engine's weights dtype: auto (the training model's) | float32 | bfloat16 | float16"""
    max_model_len: int = Field(0, ge=0)
    """longest prompt + response the engine serves (0 = the model's max_position_embeddings)"""
    enforce_eager: bool = False
    """run the model eagerly (no torch.compile / CUDA graphs: faster start, slower decode)"""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """GPU only: fraction of GPU memory vLLM takes for its weights and KV cache (the rest is the trainer's; an
    error on CPU)"""
    kv_cache_gb: int = Field(0, ge=0)
    """CPU only: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE; 0 = vLLM's default; an error on GPU, where
    gpu_memory_utilization sizes it)"""
    sleep: bool = False
    """GPU only: sleep mode between generations (weights offloaded to CPU, KV cache freed, woken for the next
    rollout; an error on CPU)"""
    sync_bucket_mb: int = Field(256, ge=1)
    """weights are sent to the engine after each trainer step in buckets of at most this many MB"""


class VLLMServerEngineConfig(Section):
    """``rollout.engine.kind=vllm_server``: generation through vLLM servers (``vllm serve``, vLLM's own HTTP server),
    weights through vLLM's own weight-transfer protocol (docs/async.md; `tether.rollout.served`). The servers come
    from one of two places: ``launch: N`` (tether starts N on this node, owns them, and stops them on every exit)
    or ``urls: [...]`` (you started them, on any node, with the command line docs/async.md gives). Needs the vLLM
    environment (``scripts/setup.sh --vllm``) for the trainer too: it drives vLLM's trainer engine."""

    kind: Literal["vllm_server"] = "vllm_server"
    """vllm_server"""
    launch: int = Field(0, ge=0)
    """start this many servers on this node (0: none; then urls names them); their logs go to RUN/servers/"""
    urls: list[str] = Field(default_factory=list)
    """base URLs of servers you started (http://HOST:PORT), started with VLLM_SERVER_DEV_MODE=1 and the flags
    docs/async.md lists; requests are spread over them"""
    api_key_env: str = "VLLM_API_KEY"
    """the environment variable holding the servers' --api-key (never written into a config); with launch and the
    variable unset, tether makes a random key for its servers"""
    weight_transfer: Literal["auto", "gloo", "nccl", "ipc"] = "auto"
    """vLLM weight-transfer backend: nccl (servers on other GPUs), ipc (a launched server on the trainer's GPU),
    gloo (CPU; tether's backend, registered in vLLM through its plugin entry point); auto picks by where the
    trainer and the servers run. With urls, the servers' --weight-transfer-config must name the same backend"""
    host: str = "127.0.0.1"
    """launch: the interface the servers listen on (keep it private: docs/reliability.md, served rollouts)"""
    devices: list[str] = Field(default_factory=list)
    """launch, GPU: CUDA device of each server (CUDA_VISIBLE_DEVICES, cycled); empty = the trainer's own device"""
    dtype: Literal[VLLM_DTYPES] = "auto"
    """launch: the servers' weights dtype (auto: the checkpoint's)"""
    max_model_len: int = Field(0, ge=0)
    """launch: longest prompt + response a server serves (0 = the model's max_position_embeddings)"""
    enforce_eager: bool = False
    """launch: run the model eagerly (no torch.compile / CUDA graphs: faster start, slower decode)"""
    gpu_memory_utilization: float = Field(0.0, ge=0, le=1)
    """launch, GPU: the fraction of its GPU a server takes (0 = vLLM's default, 0.9: set it when a server shares
    the trainer's GPU)"""
    kv_cache_gb: int = Field(0, ge=0)
    """launch, CPU: each server's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE; 0 = vLLM's default)"""
    extra_args: list[str] = Field(default_factory=list)
    """launch: more `vllm serve` flags, appended to tether's (e.g. ["--max-num-seqs", "64"])"""
    start_timeout_s: float = Field(600.0, gt=0)
    """launch: how long a server may take to answer /health (SmolLM2-135M on 2 CPU cores: about 135 s)"""
    request_timeout_s: float = Field(600.0, gt=0)
    """how long a request (a generation, a weight update) may wait for its server before the run stops with an
    error naming it (after a checkpoint of the last step)"""
    max_concurrency: int = Field(64, ge=1)
    """requests in flight at once from this process (each prompt of a batch is one request)"""
    verify_logp_tol: float = Field(0.02, gt=0)
    """after every weight update, the largest mean absolute difference per token between a server's log-probs of
    a fixed probe text and the trainer's (float32 agrees to ~1e-5; bfloat16 needs more); above it the run stops"""

    def problems(self) -> list[str]:
        """The rules that join this section's keys (checked with the whole config: the keys are set one at a time)."""
        errs = []
        if bool(self.launch) == bool(self.urls):
            errs.append("rollout.engine.kind=vllm_server: set exactly one of rollout.engine.launch (servers tether "
                        "starts) and rollout.engine.urls (servers you started)")
        bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        if bad:
            errs.append(f"rollout.engine.urls: each is a base URL http://HOST:PORT, got {bad[0]!r}")
        launch_only = sorted(self.model_fields_set & set(LAUNCH_ONLY))
        if self.urls and launch_only:
            errs.append(f"rollout.engine.{launch_only[0]} configures servers tether launches; with "
                        f"rollout.engine.urls your own servers' flags decide it")
        return errs


#: the keys of a served engine that only servers tether launches read
LAUNCH_ONLY = ("host", "devices", "dtype", "max_model_len", "enforce_eager", "gpu_memory_utilization", "kv_cache_gb",
               "extra_args", "start_timeout_s")


class OtherEngineConfig(Section):
    """Another engine registered in `tether.rollout.ENGINES` (e.g. by a test or a plugin): no keys of its own."""

    kind: str
    """its name in tether.rollout.ENGINES"""


def _engine_tag(value: Any) -> str:
    kind = value.get("kind", "hf") if isinstance(value, dict) else getattr(value, "kind", "hf")
    return kind if kind in ("hf", "vllm", "vllm_server") else "other"


EngineConfig = Annotated[Union[Annotated[HFEngineConfig, Tag("hf")], Annotated[VLLMEngineConfig, Tag("vllm")],
                               Annotated[VLLMServerEngineConfig, Tag("vllm_server")],
                               Annotated[OtherEngineConfig, Tag("other")]], Discriminator(_engine_tag)]


def engine_shorthand(value: Any) -> Any:
    """``rollout.engine=NAME`` (a string) is ``{kind: NAME}``; a mapping without ``kind`` is the hf engine's."""
    if isinstance(value, str):
        return {"kind": value}
    if isinstance(value, dict) and "kind" not in value:
        return {"kind": "hf", **value}
    return value
