"""The ``organism_calc`` environment: the calculator, posed to the model organism in its own compact form.

The same protocol and evaluator as :class:`~tether.envs.calculator.CalculatorEnv` (``<calc>`` calls
answered by ``<result>`` observations, a ``####`` final answer), but the opening prompt is the
organism's (:data:`tether.tasks.organism_problems.CALC` and the expression, ``C:47+38-12``) instead of the
calculator's prose instruction, which a character-level model of a million parameters could not
read. The organism was shown three ways of answering such a prompt in its supervised build (worked by
hand, directly, and with one call), and greedy decoding mostly answers directly, so RL on this
environment measures whether an algorithm teaches an agent to work it out or use its tool
(docs/organism.md).
"""

from __future__ import annotations

from ..tasks.base import Example
from ..tasks.organism_problems import CALC, QUESTION
from .base import Start
from .calculator import CalculatorEnv

__all__ = ["OrganismCalcEnv"]


class OrganismCalcEnv(CalculatorEnv):
    """:class:`CalculatorEnv` with the organism's prompt: ``C:`` and the problem's expression (an
    organism example's ``Q:`` prefix is replaced; any other prompt gets ``C:`` in front)."""

    name = "organism_calc"

    def start(self, example: Example) -> Start:
        """The prompt ``C:<expression>``; info: the example's id and the calls allowed."""
        text = example.prompt[len(QUESTION):] if example.prompt.startswith(QUESTION) else example.prompt
        return Start(prompt=CALC + text, info={"id": example.id, "calls": self.max_turns - 1})
