"""A saved run's config resolved here (``tether eval --model RUN``, ``tether export RUN``): a run saved in
the earlier flat layout is read in the nested one (`tether.config.migration.migrate_saved`)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..models import ModelConfig
from ..runs import RunDir
from .load import load_config
from .migration import migrate_saved
from .overrides import flatten
from .sft import load_sft_config


def saved_config(run: RunDir) -> tuple[Any, Any]:
    """``(Config or SFTConfig or raw dict, ModelConfig)`` of run ``run``: the validated config, or, when the saved
    config no longer validates here, the raw YAML and the ``model`` section's known keys."""
    raw = run.raw_config()
    try:
        if run.kind == "sft":
            cfg = load_sft_config(str(run.path / "config.yaml"))
        else:  # a run saved in the earlier flat layout is read in the nested one
            vals = migrate_saved(flatten(raw))
            cfg = load_config(None, vals, recipe_name=vals.pop("recipe", None))
        return cfg, cfg.model
    except ConfigError:
        pass
    return raw, ModelConfig(**{k: v for k, v in (raw.get("model") or {}).items() if k in ModelConfig.model_fields})
