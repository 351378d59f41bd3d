"""Errors shared across layers (imports nothing from tether).

The CLI turns every error below, and ``DataError`` (``tether.tasks``) and ``ExportError``
(``tether.export``), into one line on stderr and exit code 2: they are the user's to fix (an
option, a file, a row, a path), not tether's bugs.

`EvalError` is raised by ``tether.tasks.benchmarks`` (a benchmark whose reward cannot be
loaded) and by ``tether.eval`` (bad evaluation settings, a run without checkpoint or
anchor), so it lives below both.
"""

from __future__ import annotations

import json


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


def read_utf8(path, label: str, error: type[Exception]) -> str:
    """The text of file ``path``; an unreadable or non-UTF-8 file raises ``error`` naming ``label``,
    the line and the byte (shared by config files and data files)."""
    try:
        raw = open(path, "rb").read()
    except OSError as e:
        raise error(f"{label}: cannot read it: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise error(f"{label} line {line}: not valid UTF-8 (byte {e.start}: {e.reason})") from None


class JSONTooDeep(json.JSONDecodeError):
    """JSON nested more deeply than the parser can recurse (``"[" * 100000``): a `JSONDecodeError`,
    so every reader that refuses invalid JSON refuses it too, instead of a `RecursionError` traceback."""


def loads_json(text):
    """``json.loads(text)``, except that JSON nested too deeply for the parser raises `JSONTooDeep`
    (a ``ValueError``) rather than ``RecursionError``: every reader of a file a user may hand tether
    (data rows, a corpus, a marker, a checkpoint's manifest) parses through it."""
    try:
        return json.loads(text)
    except RecursionError:
        raise JSONTooDeep("nested too deeply for the parser", text if isinstance(text, str) else "", 0) from None


def json_error(e: json.JSONDecodeError) -> str:
    """What is wrong with invalid JSON, for an error line: the parser's message and column (none when it
    is nested too deeply: the parser gives up at no one column)."""
    return e.msg if isinstance(e, JSONTooDeep) else f"{e.msg} at column {e.colno}"


USER_ERRORS = (EvalError, RunError, OutputError, ModelLoadError, RewardError, GenerationError, EnvError)

__all__ = ["EnvError", "EvalError", "GenerationError", "JSONTooDeep", "ModelLoadError", "OutputError", "RewardError",
           "RunError", "USER_ERRORS", "json_error", "loads_json", "read_utf8"]
