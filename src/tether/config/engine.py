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


class OtherEngineConfig(Section):
    """Another engine registered in `tether.rollout.ENGINES` (e.g. by a test or a plugin): no keys of its own."""

    kind: str
    """its name in tether.rollout.ENGINES"""


def _engine_tag(value: Any) -> str:
    kind = value.get("kind", "hf") if isinstance(value, dict) else getattr(value, "kind", "hf")
    return kind if kind in ("hf", "vllm") else "other"


EngineConfig = Annotated[Union[Annotated[HFEngineConfig, Tag("hf")], Annotated[VLLMEngineConfig, Tag("vllm")],
                               Annotated[OtherEngineConfig, Tag("other")]], Discriminator(_engine_tag)]


def engine_shorthand(value: Any) -> Any:
    """``rollout.engine=NAME`` (a string) is ``{kind: NAME}``; a mapping without ``kind`` is the hf engine's."""
    if isinstance(value, str):
        return {"kind": value}
    if isinstance(value, dict) and "kind" not in value:
        return {"kind": "hf", **value}
    return value
