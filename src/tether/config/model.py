"""``model``: what model to load and how to prepare it for training (`tether.models.load_model` reads it; the
section of both ``tether train`` and ``tether sft``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ..sections import Section, only_with

#: Name under which the embedded model is selected in `ModelConfig.name`.
EMBEDDED_MODEL_NAME = "smollm2"
#: The dtype names `ModelConfig.dtype` accepts (case-insensitive).
DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


class ModelConfig(Section):
    """What model to load and how to prepare it for training."""

    name: str = EMBEDDED_MODEL_NAME
    """"smollm2" (embedded default) | "organism" (built on first use, docs/organism.md) | hub id | local dir | path
    to .gguf | a tether run directory (tether sft / tether train: the policy of its newest checkpoint) or
    RUN/checkpoints/step-N"""
    dtype: Literal[DTYPES] = "float32"
    """parameter dtype: float32 | bfloat16 | float16 (or fp32, bf16, fp16; any case)"""

    @field_validator("dtype", mode="before")
    @classmethod
    def _any_case(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v

    device: str = "cpu"
    """cpu | cuda | cuda:N | auto (cuda if available, else cpu)"""
    gradient_checkpointing: bool = False
    """recompute activations in backward (saves memory, costs ~30% time)"""
    lora_r: int = Field(0, ge=0)
    """0 = full fine-tuning; >0 = LoRA via peft with this rank. For RL use at least 10x full fine-tuning's learning
    rate: on the organism ranks 1-64 at 10x end where full fine-tuning ends; on SmolLM2-135M rank 1 at 10x ended
    21 points below it after 16 steps (docs/evidence.md "LoRA against full weights")"""
    lora_alpha: int = Field(16, gt=0)
    """LoRA scaling numerator (scale = alpha / r)"""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """dropout on the LoRA branch input"""
    lora_target_modules: list[str] | str = "all-linear"
    """peft target_modules ("all-linear" = every linear but lm_head)"""

    @field_validator("lora_target_modules")
    @classmethod
    def _names_a_module(cls, v: list[str] | str) -> list[str] | str:
        names = [v] if isinstance(v, str) else list(v)
        if not names or not all(x.strip() for x in names):
            raise ValueError(f"must name at least one module (or 'all-linear'), got {v!r}")
        return v

    _lora = only_with("lora_alpha", "lora_dropout", "lora_target_modules", holds=lambda m: m.get("lora_r", 1) > 0,
                      text="only applies with model.lora_r > 0 (LoRA)")

    def without_lora(self, **changes: Any) -> "ModelConfig":
        """This section without LoRA (lora_r 0, the lora_* keys at their defaults) and with ``changes``: the plain
        model a LoRA run's adapters are merged into."""
        keep = {k: getattr(self, k) for k in type(self).model_fields if not k.startswith("lora_")}
        return type(self)(**(keep | changes))
    cache_dir: str | None = None
    """cache for dequantized GGUF models; default $TETHER_CACHE or ~/.cache/tether"""
    trust_remote_code: bool = False
    """allow custom modeling code from hub repos / local dirs"""
