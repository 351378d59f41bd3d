"""The configuration of a supervised fine-tuning run (``tether sft``, docs/sft.md): one section per part, each
key documented by the docstring under its declaration; resolved and checked by `tether.resolve.sft.load_sft_config`.

The ``model`` section is the training run's (`tether.config.model.ModelConfig`), so dtype, device and LoRA mean the
same in both; the optimizer keys are ``tether train``'s (`tether.config.schema.OptimizerConfig`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, model_validator

from ..sections import Section, alone
from .model import ModelConfig
from .schema import OptimizerConfig, OutputsConfig, Schedule

OVERFLOW = ("error", "truncate")
BATCHING = ("padded", "length_grouped", "packed")


class SFTDataConfig(Section):
    """The conversations: JSONL rows of ``{"messages": [...]}`` or ``{"prompt": ..., "completion": ...}``
    (docs/sft.md: the formats, and which tokens the loss reads)."""

    path: str = ""
    """the training rows, a JSONL file (CLI: --data); required"""
    val_path: str = ""
    """validation rows, a JSONL file in the same formats ("" = none; see data.val_fraction)"""
    val_fraction: float = Field(0.0, ge=0, lt=1)
    """hold out this fraction of the training rows for validation, chosen with train.seed (0 = none; not with
    data.val_path)"""
    max_length: int = Field(0, ge=0)
    """tokens per conversation, everything from the first system / user token to the last assistant turn's end (0 =
    the model's context, max_position_embeddings)"""
    overflow: Literal[OVERFLOW] = "error"
    """a conversation longer than data.max_length: error (names the file and line; raised before the first step) |
    truncate (keep its first data.max_length tokens; it must still hold a trained token)"""

    @model_validator(mode="after")
    def _one_validation_source(self, info: ValidationInfo):
        if not alone(info) and self.val_fraction > 0 and self.val_path:
            raise ValueError("data.val_fraction and data.val_path both choose the validation rows: set one")
        return self


class SFTTrainConfig(OptimizerConfig):
    """Optimization: AdamW on the mean negative log-likelihood of the trained tokens of each batch (the optimizer's
    keys are ``tether train``'s, `OptimizerConfig`, first; its schedule is cosine)."""

    epochs: int = Field(1, ge=1)
    """passes over the training rows (with train.steps = 0); raised on --resume it extends the run"""
    steps: int = Field(0, ge=0)
    """optimizer steps (0 = train.epochs passes); > 0 trains exactly this many, reshuffling at each pass over the
    rows (not with train.epochs); raised on --resume it extends the run"""
    batch_size: int = Field(16, ge=1)
    """conversations per optimizer step (the last batch of a pass may be smaller)"""
    micro_batch_size: int = Field(4, ge=1)
    """conversations per forward / backward (gradient accumulation); the loss is divided by the trained tokens of
    the whole batch, so the gradient does not depend on it"""

    @model_validator(mode="after")
    def _length_and_batches(self, info: ValidationInfo):
        if alone(info):
            return self
        if self.steps > 0 and self.epochs != 1:
            raise ValueError(f"train.steps={self.steps} and train.epochs={self.epochs} both set the length of the "
                             "run: set one")
        if self.micro_batch_size > self.batch_size:
            raise ValueError(f"train.micro_batch_size={self.micro_batch_size} exceeds train.batch_size="
                             f"{self.batch_size}")
        problem = self.warmup_problem(self.steps, "train.steps")
        if problem and self.steps > 0:  # (with train.epochs the length is known once the rows are read: the loop's)
            raise ValueError(problem)
        return self
    batching: Literal[BATCHING] = "padded"
    """which conversations share a batch and how they are laid out: padded (random batches, each micro-batch padded
    to its longest) | length_grouped (batches of similar lengths: less padding, but a batch's contents correlate
    with length) | packed (random batches, each micro-batch concatenated without padding, positions restarting
    per conversation; checked against the padded forward at the start)"""
    schedule: Schedule = "cosine"
    """constant | cosine | linear (after warm-up, to 0 at the last step); as for tether train, the LR never jumps
    when --resume extends the run"""
    val_every: int = Field(0, ge=0)
    """also compute the validation loss every N steps (0 = before the first step and after the last only; needs
    data.val_path or data.val_fraction)"""
    logprob_chunk: int = Field(1024, ge=1)
    """tokens per chunk of the loss's log-softmax (peak memory ~ chunk x vocab)"""
    seed: int = 0
    """seeds the validation split, the order of the rows and initialization"""


class SFTRunConfig(OutputsConfig):
    """Outputs: run directory, checkpoints, logs (``tether train``'s ``run`` keys, `OutputsConfig`, with a
    checkpoint every 100 steps)."""

    save_every: int = Field(100, ge=0)
    """checkpoint every N steps (0 = only at the end); the last step always writes one"""


class SFTConfig(Section):
    """Everything an SFT run needs."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = Field(default_factory=SFTTrainConfig)
    run: SFTRunConfig = Field(default_factory=SFTRunConfig)


#: Keys a ``tether sft --resume`` may not change: they decide which rows form each batch (or the model),
#: so the resumed run would not be the one its checkpoint continues.
FROZEN_ON_RESUME = ("model.", "data.", "train.batch_size", "train.batching", "train.seed")
