"""The organism's task (``data.task=organism``): :mod:`tether.tasks.organism_problems` as tether examples.

``OrganismTask(seed, difficulty, split).example(i)`` is a pure function of its arguments; the
``test`` and ``train`` splits never share a problem (by content, :func:`~tether.tasks.organism_problems.content_split`).
"""

from __future__ import annotations

from typing import Iterator

from .base import Example
from .organism_problems import MAX_DIFFICULTY, QUESTION, RL_DIFFICULTY, draw, expression, solve

__all__ = ["OrganismTask"]


class OrganismTask:
    """Seeded generator of the organism's problems (module docstring).

    Args:
        seed: stream seed; ``example(i)`` is deterministic in ``(split, seed, difficulty, i, prefix)``.
        difficulty: operations per problem, 1..:data:`MAX_DIFFICULTY`.
        split: ``"train"`` or ``"test"`` (disjoint by content).
        prefix: the prompt's mode letter, :data:`QUESTION` or :data:`CALC`.

    ``meta`` holds ``start``, ``ops`` (``[[op, n], ...]``) and ``difficulty``.
    """

    reward_name = "arithmetic"

    def __init__(self, seed: int = 0, difficulty: int = RL_DIFFICULTY, split: str = "train", prefix: str = QUESTION):
        if not 1 <= int(difficulty) <= MAX_DIFFICULTY:
            raise ValueError(f"organism: difficulty must be 1-{MAX_DIFFICULTY}, got {difficulty}")
        if split not in ("train", "test"):
            raise ValueError(f"organism: split must be 'train' or 'test', got {split!r}")
        self.seed, self.difficulty, self.split, self.prefix = int(seed), int(difficulty), split, prefix

    def draw(self, i: int) -> tuple[int, list[tuple[str, int]]]:
        """The ``i``-th problem's (start, ops): redrawn until its values stay in range and its
        content belongs to this split."""
        return draw(self.split, self.seed, self.difficulty, i)

    def example(self, i: int) -> Example:
        """Problem ``i`` of the stream."""
        start, ops = self.draw(i)
        return Example(prompt=self.prefix + expression(start, ops), answer=str(solve(start, ops)[-1]),
                       id=f"organism:{self.split}:d{self.difficulty}:seed{self.seed}:{i}",
                       meta={"start": start, "ops": [list(o) for o in ops], "difficulty": self.difficulty})

    def examples(self, n: int, start: int = 0) -> list[Example]:
        """Problems ``start .. start + n - 1``."""
        return [self.example(i) for i in range(start, start + n)]

    def stream(self, start: int = 0) -> Iterator[Example]:
        """Problems from ``start`` on, endlessly."""
        i = start
        while True:
            yield self.example(i)
            i += 1
