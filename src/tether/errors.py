"""Errors shared across layers (imports nothing from tether).

The CLI turns every error below, and ``DataError`` (``tether.tasks``) and ``ExportError``
(``tether.export``), into one line on stderr and exit code 2: they are the user's to fix (an
option, a file, a row, a path), not tether's bugs.

`EvalError` is raised by ``tether.tasks.benchmarks`` (a benchmark whose reward cannot be
loaded) and by ``tether.eval`` (bad evaluation settings, a run without checkpoint or
anchor), so it lives below both.

`optional_import` imports an optional extra's module, or raises the user error that says how to
install it (the one wording for every extra).
"""

from __future__ import annotations

import importlib
from types import ModuleType


class ConfigError(ValueError):
    """A configuration that cannot run as written: an unknown key or choice, an invalid combination, or an
    option that would have no effect under the other settings (``tether.config``)."""


class EvalError(ValueError):
    """An evaluation cannot run as asked (bad settings, a run without checkpoint or anchor, ...)."""


class RunError(RuntimeError):
    """A run directory cannot be used as asked: it is not empty, locked by another trainer, not
    writable, has no loadable checkpoint, or its checkpoint does not fit the model."""


class OutputError(RuntimeError):
    """An output path cannot be used as asked: it is a file or a symlink, not writable, or not empty
    and not something tether wrote (``--overwrite`` deletes only what tether wrote: `tether.rundir.owned`)."""


class ModelLoadError(RuntimeError):
    """A model or tokenizer cannot be loaded (a missing path, an unknown hub id offline, a bad file)."""


class RewardError(ValueError):
    """A reward spec cannot be loaded (an unknown name, a module that fails to import, no such function)."""


class EnvError(ValueError):
    """A user's environment broke its contract (``tether.envs.base``): one of its methods raised, or returned
    what an agent cannot use (not a ``StepResult``, an observation that is not text, a non-finite reward, fewer
    results than actions, an episode kept going past its turn budget). The message names the environment's
    class, the method and the example."""


class GenerationError(RuntimeError):
    """Generation cannot go on: non-finite logits, or a prompt longer than the model's context."""


def optional_import(module: str, needed_by: str, extra: str, error: type[Exception] = ConfigError) -> ModuleType:
    """``module`` (of the optional extra ``tether[<extra>]``) imported; where it does not import, ``error`` (a user
    error: the caller's layer picks it) reading "<needed_by> need the optional extra: pip install 'tether[<extra>]'
    (<the ImportError>)"."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise error(f"{needed_by} need the optional extra: pip install 'tether[{extra}]' ({e})") from None


USER_ERRORS = (EvalError, RunError, OutputError, ModelLoadError, RewardError, GenerationError, EnvError)

__all__ = ["ConfigError", "EnvError", "EvalError", "GenerationError", "ModelLoadError", "OutputError", "RewardError",
           "RunError", "USER_ERRORS", "optional_import"]
