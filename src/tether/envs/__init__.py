"""Environments at the level of text: what a multi-turn episode talks to.

An environment opens an episode on an example (``reset(example) -> Start``: the first prompt, as
text or chat messages) and answers each turn of the policy (``step(actions) -> list[StepResult]``,
batched: the turn's texts of every active episode go out together; each result holds the
observation to append, a reward part, whether the episode is done, and info). Each environment
has its stop strings (``stop``), its turn budget (``max_turns``), its final-turn rule
(``final_turn``: what happens at the last turn) and its reward (``reward``; None keeps the task's).
:mod:`tether.envs.base` defines the interface and :class:`TextEnv`, the base class that keeps the
bookkeeping; docs/environments.md writes one.

* ``calculator`` (:class:`~tether.envs.calculator.CalculatorEnv`): ``<calc>`` calls evaluated by a
  safe exact arithmetic evaluator, a ``####`` final answer (the arithmetic task, GSM8K).
* ``organism_calc`` (:class:`~tether.envs.organism_calc.OrganismCalcEnv`): the calculator with the model
  organism's compact prompt (``data.task=organism``, docs/organism.md).

Environments register in :data:`ENVS`; a user's environment loads from a ``module:Class`` (or
``path/to/file.py:Class``) spec, and :func:`make_env` builds one by name or spec.
"""

from __future__ import annotations

from typing import Any, Callable

from ..algo.registry import Registry
from ..errors import ConfigError
from .base import Env, Episode, FinalTurn, Prompt, Start, StepResult, TextEnv
from .calculator import CalculatorEnv
from .organism_calc import OrganismCalcEnv
from .search import SearchEnv

__all__ = ["ENVS", "make_env", "Env", "TextEnv", "Episode", "FinalTurn", "Prompt", "Start", "StepResult",
           "CalculatorEnv", "SearchEnv", "OrganismCalcEnv"]

#: environment name -> its class (or any builder ``(**options) -> Env``); a user's ``module:Class``
#: spec resolves through it too (``ENVS.resolve``).
ENVS: Registry[Callable[..., Env]] = Registry("environment", error=ConfigError)
ENVS.register("calculator")(CalculatorEnv)
ENVS.register("search")(SearchEnv)
ENVS.register("organism_calc")(OrganismCalcEnv)


def make_env(spec: str, **options: Any) -> Env:
    """The environment ``spec`` names (a registered name, ``module:Class`` or ``path/to/file.py:Class``),
    built with ``options``. An unknown name, a spec that does not load, options it does not take, or
    an object without ``reset`` and ``step`` is a :class:`~tether.errors.ConfigError`."""
    builder, _ = ENVS.resolve(spec)
    try:
        env = builder(**options)
    except TypeError as e:
        raise ConfigError(f"environment {spec!r}: {e}") from None
    if not all(callable(getattr(env, m, None)) for m in ("reset", "step")):
        raise ConfigError(f"environment {spec!r}: {type(env).__name__} has no reset(example) and step(actions)")
    return env
