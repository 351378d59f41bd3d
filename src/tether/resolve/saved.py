"""A saved run's config resolved here (``tether eval --model RUN``, ``tether export RUN``; `resume_config`: ``tether
train --resume``): a run saved in the earlier flat layout is read in the nested one
(`tether.config.migration.migrate_saved`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..config.migration import migrate_saved
from ..config.model import ModelConfig
from ..config.overrides import flatten
from ..config.schema import DEFAULT_RECIPE
from ..errors import ConfigError
from ..rundir.guard import resumed_values
from ..rundir.reader import RunDir
from .load import load_config
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


def resume_config(run_dir: Path, overrides: Optional[dict] = None):
    """The saved config of run ``run_dir`` with ``overrides`` applied (nothing is written).

    Raises `RunError` (no directory, no or unreadable config.yaml, an SFT run, no checkpoint at all:
    the run stopped before its first save; `tether.rundir.guard.resumed_values`) before any model is loaded,
    `ConfigError` for a bad override. The directory is read by `tether.rundir.reader.RunDir`, as ``tether eval``
    and ``tether export`` read it.
    """
    saved, overrides = resumed_values(run_dir, overrides, "run")
    name = saved.pop("recipe", DEFAULT_RECIPE)
    if "recipe" in overrides and str(overrides["recipe"]) != str(name):
        raise ConfigError(f"recipe={overrides['recipe']} cannot apply to --resume {run_dir}: the run continues "
                          f"with its own recipe ({name}) and its checkpointed state; start a new run for another "
                          f"recipe (tether train --recipe {overrides['recipe']} ...), or change single algo.* keys")
    vals = migrate_saved(flatten(saved))  # a run saved in the earlier flat layout resumes in the nested one
    vals.pop("run.overwrite", None)
    vals.update(overrides)
    return load_config(None, vals, recipe_name=name)
