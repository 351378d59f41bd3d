"""A small verifiers ToolEnv for tether's tests (tests/test_verifiers.py) and the SmolLM2 measurement of
docs/ecosystem.md: an ``add`` tool, sums as questions, a rubric that gives 1 when the final message holds the answer.
Loaded as ``verifiers:tether_vf_add`` (with this directory on PYTHONPATH)."""

import random
import re

import verifiers as vf
from datasets import Dataset


def _sums(n: int, digits: int, seed: int) -> list[dict]:
    """``n`` questions: ``i + (i + 1)`` for i < n (``digits=0``), else two random ``digits``-digit numbers."""
    rng = random.Random(seed)
    pairs = [(i, i + 1) for i in range(n)] if not digits else \
        [(rng.randrange(10 ** (digits - 1), 10 ** digits), rng.randrange(10 ** (digits - 1), 10 ** digits))
         for _ in range(n)]
    return [{"question": f"What is {a} + {b}? Use the add tool, then answer.", "answer": str(a + b)} for a, b in pairs]


def load_environment(n: int = 8, max_turns: int = 3, fail_on: int = -1, digits: int = 0, n_eval: int = 4):
    """``n`` training rows; the eval rows are the first ``n_eval`` of them (``digits=0``) or ``n_eval`` other random
    sums (seed 1; the training rows are seed 0). A call of ``add`` with ``a == fail_on`` raises a stop error (the
    episode is marked with state["error"])."""
    rows = _sums(n, digits, 0)
    eval_rows = rows[:n_eval] if not digits else _sums(n_eval, digits, 1)

    class Refused(Exception):
        pass

    def add_checked(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        if a == fail_on:
            raise Refused(f"add refuses {a}")
        return a + b

    add_checked.__name__ = "add"

    async def correct(completion, answer, **kwargs) -> float:
        last = completion[-1] if completion else None
        numbers = re.findall(r"-?\d+", str(getattr(last, "content", None) or ""))
        return 1.0 if numbers and numbers[-1] == answer else 0.0  # the final message's last number

    return vf.ToolEnv(dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(eval_rows), tools=[add_checked],
                      rubric=vf.Rubric(funcs=[correct]), max_turns=max_turns, system_prompt="You can add.",
                      stop_errors=[Refused])
