"""Resolving and checking a ``tether sft`` config (`tether.config.sft`: its sections): field defaults -> the YAML
file (``--config``) -> ``key=value`` overrides, every problem at once (`load_sft_config`); and docs/sft.md's key
tables (`sft_reference`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..config.overrides import flatten, parse
from ..config.sft import SFTConfig, SFTDataConfig
from ..userio import read_yaml_mapping
from .reference import keys, section_tables
from .validate import check_model, check_outputs, raise_problems


def load_sft_config(path: Optional[str] = None, overrides: Optional[dict[str, Any]] = None) -> SFTConfig:
    """Resolve an SFTConfig: field defaults -> YAML file -> overrides, then check it (`check_sft`)."""
    file_vals = flatten(read_yaml_mapping(path)) if path else {}
    return check_sft(parse(SFTConfig, SFTConfig(), [(path or "config file", file_vals),
                                                    ("override", dict(overrides or {}))]))


def check_sft(cfg: SFTConfig) -> SFTConfig:
    """Every problem of a resolved SFT config at once (a key without effect is one, too)."""
    raise_problems(_check_data(cfg.data) + _check_train(cfg) + check_model(cfg.model) + check_outputs(cfg.run))
    return cfg


def _check_data(d: SFTDataConfig) -> list[str]:
    errs = []
    if not d.path:
        errs.append("data.path is required: the training conversations, a JSONL file (tether sft --data FILE)")
    for key in ("path", "val_path"):
        p = getattr(d, key)
        if p and not Path(p).expanduser().is_file():
            errs.append(f"data.{key}: {p} {'is not a file' if Path(p).expanduser().exists() else 'does not exist'}")
    return errs


def _check_train(cfg: SFTConfig) -> list[str]:
    """The train section against the data section (the train section's own rules are declared with its keys,
    `tether.config.sft.SFTTrainConfig`)."""
    if cfg.train.val_every > 0 and not (cfg.data.val_path or cfg.data.val_fraction > 0):
        return ["train.val_every has no effect without validation rows (data.val_path or data.val_fraction)"]
    return []


def sft_reference() -> str:
    """The tables of every ``tether sft`` key (docs/sft.md, "Options": one ``###`` heading a section), from the
    declaration comments."""
    text = section_tables(SFTConfig, keys(SFTConfig), {})
    return "\n".join("#" + ln if ln.startswith("## ") else ln for ln in text.splitlines())
