"""The configuration of a supervised fine-tuning run (``tether sft``, docs/sft.md): one dataclass per
section, each key documented by the comment where it is declared, resolved as field defaults -> the
YAML file (``--config``) -> ``key=value`` overrides and checked all at once (`load_sft_config`).

The ``model`` section is the training run's (`tether.models.ModelConfig`), so dtype, device and
LoRA mean the same in both; the optimizer keys mean what ``train.*`` means for ``tether train``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from pydantic import Field

from ..algo.registry import unknown_choice
from ..models import ModelConfig
from ..sections import Section
from .overrides import apply_keys, flatten
from .reference import keys, section_tables
from .schema import OptimizerConfig, OutputsConfig
from .validate import check_checkpoints, check_model, check_optimizer, check_outputs, raise_problems
from .yaml_io import read_yaml_mapping

OVERFLOW = ("error", "truncate")
BATCHING = ("padded", "length_grouped", "packed")


class SFTDataConfig(Section):
    """The conversations: JSONL rows of ``{"messages": [...]}`` or ``{"prompt": ..., "completion": ...}``
    (docs/sft.md: the formats, and which tokens the loss reads)."""

    path: str = ""
    """the training rows, a JSONL file (CLI: --data); required"""
    val_path: str = ""
    """validation rows, a JSONL file in the same formats ("" = none; see data.val_fraction)"""
    val_fraction: float = 0.0
    """hold out this fraction of the training rows for validation, chosen with train.seed (0 = none; not with
    data.val_path)"""
    max_length: int = 0
    """tokens per conversation, everything from the first system / user token to the last assistant turn's end (0 =
    the model's context, max_position_embeddings)"""
    overflow: str = "error"
    """a conversation longer than data.max_length: error (names the file and line; raised before the first step) |
    truncate (keep its first data.max_length tokens; it must still hold a trained token)"""


class SFTTrainConfig(OptimizerConfig):
    """Optimization: AdamW on the mean negative log-likelihood of the trained tokens of each batch (the optimizer's
    keys are ``tether train``'s, `OptimizerConfig`, first; its schedule is cosine)."""

    epochs: int = 1
    """passes over the training rows (with train.steps = 0); raised on --resume it extends the run"""
    steps: int = 0
    """optimizer steps (0 = train.epochs passes); > 0 trains exactly this many, reshuffling at each pass over the
    rows (not with train.epochs); raised on --resume it extends the run"""
    batch_size: int = 16
    """conversations per optimizer step (the last batch of a pass may be smaller)"""
    micro_batch_size: int = 4
    """conversations per forward / backward (gradient accumulation); the loss is divided by the trained tokens of
    the whole batch, so the gradient does not depend on it"""
    batching: str = "padded"
    """which conversations share a batch and how they are laid out: padded (random batches, each micro-batch padded
    to its longest) | length_grouped (batches of similar lengths: less padding, but a batch's contents correlate
    with length) | packed (random batches, each micro-batch concatenated without padding, positions restarting
    per conversation; checked against the padded forward at the start)"""
    schedule: str = "cosine"
    """constant | cosine | linear (after warm-up, to 0 at the last step); as for tether train, the LR never jumps
    when --resume extends the run"""
    val_every: int = 0
    """also compute the validation loss every N steps (0 = before the first step and after the last only; needs
    data.val_path or data.val_fraction)"""
    logprob_chunk: int = 1024
    """tokens per chunk of the loss's log-softmax (peak memory ~ chunk x vocab)"""
    seed: int = 0
    """seeds the validation split, the order of the rows and initialization"""


class SFTRunConfig(OutputsConfig):
    """Outputs: run directory, checkpoints, logs (``tether train``'s ``run`` keys, `OutputsConfig`, with a
    checkpoint every 100 steps)."""

    save_every: int = 100
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


def load_sft_config(path: Optional[str] = None, overrides: Optional[dict[str, Any]] = None) -> SFTConfig:
    """Resolve an SFTConfig: field defaults -> YAML file -> overrides, then check it (`check_sft`)."""
    cfg = SFTConfig()
    file_vals = flatten(read_yaml_mapping(path)) if path else {}
    for source, vals in ((path or "config file", file_vals), ("override", dict(overrides or {}))):
        apply_keys(cfg, vals, source)
    return check_sft(cfg)


def check_sft(cfg: SFTConfig) -> SFTConfig:
    """Every problem of a resolved SFT config at once (a key without effect is one, too)."""
    raise_problems(_check_data(cfg.data) + _check_train(cfg) + check_model(cfg.model) + check_outputs(cfg.run)
                   + check_checkpoints(cfg.run))
    return cfg


def _check_data(d: SFTDataConfig) -> list[str]:
    errs = []
    if not d.path:
        errs.append("data.path is required: the training conversations, a JSONL file (tether sft --data FILE)")
    for key in ("path", "val_path"):
        p = getattr(d, key)
        if p and not Path(p).expanduser().is_file():
            errs.append(f"data.{key}: {p} {'is not a file' if Path(p).expanduser().exists() else 'does not exist'}")
    if not (math.isfinite(d.val_fraction) and 0 <= d.val_fraction < 1):
        errs.append(f"data.val_fraction must be in [0, 1), got {d.val_fraction!r}")
    elif d.val_fraction > 0 and d.val_path:
        errs.append("data.val_fraction and data.val_path both choose the validation rows: set one")
    if d.max_length < 0:
        errs.append(f"data.max_length must be >= 0 (0 = the model's context), got {d.max_length}")
    if d.overflow not in OVERFLOW:
        errs.append(unknown_choice("data.overflow", d.overflow, OVERFLOW))
    return errs


def _check_train(cfg: SFTConfig) -> list[str]:
    t, errs = cfg.train, []
    for k in ("epochs", "batch_size", "micro_batch_size", "logprob_chunk"):
        if getattr(t, k) < 1:
            errs.append(f"train.{k} must be >= 1, got {getattr(t, k)}")
    if t.steps < 0:
        errs.append(f"train.steps must be >= 0 (0 = train.epochs passes over the rows), got {t.steps}")
    elif t.steps > 0 and t.epochs != 1:
        errs.append(f"train.steps={t.steps} and train.epochs={t.epochs} both set the length of the run: set one")
    if t.micro_batch_size > t.batch_size >= 1:
        errs.append(f"train.micro_batch_size={t.micro_batch_size} exceeds train.batch_size={t.batch_size}")
    if t.batching not in BATCHING:
        errs.append(unknown_choice("train.batching", t.batching, BATCHING))
    if t.val_every < 0:
        errs.append(f"train.val_every must be >= 0, got {t.val_every}")
    elif t.val_every > 0 and not (cfg.data.val_path or cfg.data.val_fraction > 0):
        errs.append("train.val_every has no effect without validation rows (data.val_path or data.val_fraction)")
    return errs + check_optimizer(t, t.steps, "train.steps")


def sft_reference() -> str:
    """The tables of every ``tether sft`` key (docs/sft.md, "Options": one ``###`` heading a section), from the
    declaration comments."""
    text = section_tables(SFTConfig, keys(SFTConfig), {})
    return "\n".join("#" + ln if ln.startswith("## ") else ln for ln in text.splitlines())
