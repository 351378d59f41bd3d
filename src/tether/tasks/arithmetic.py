"""Synthetic multi-step integer word problems: the default training task (no data files).

``ArithmeticTask(seed, difficulty).example(i)`` is a pure function of ``(split, seed,
difficulty, i)``, so a position in the training stream can be checkpointed as an integer.

A problem is a start value followed by ``steps`` operations, told as a short story with one
of several templates::

    Tom has 7 apples. He buys 5 more. Then he gives away 3. How many apples does Tom have now?
    Give the final answer as a number after '####'.

The answer is the integer result. Every intermediate value is a non-negative integer
(subtractions never go below zero, divisions are exact).

Held-out split: the *mathematical content* of a problem (start value and operation
sequence) is hashed into 100 buckets; buckets ``< TEST_BUCKETS`` belong to ``split="test"``,
the rest to ``split="train"``. Each split draws from its own seed stream and rejects
candidates from the other split's buckets, so no test problem appears in training under
any wording, seed or difficulty.

Difficulty levels (see :data:`LEVELS`):

====  =====  ===========  ============  ==================
 d    steps  start value  operands      operations
====  =====  ===========  ============  ==================
 1    1      2..20        2..10         + -
 2    2      3..30        2..20         + - (x2, x3)
 3    3      5..60        2..30         + - x(2..4)
 4    4      10..100      2..50         + - x(2..5) /(2..5)
====  =====  ===========  ============  ==================
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Iterator, Sequence

from .base import Example

__all__ = [
    "ArithmeticTask",
    "Level",
    "LEVELS",
    "DEFAULT_DIFFICULTY",
    "DEFAULT_INSTRUCTION",
    "TEST_BUCKETS",
    "apply_ops",
    "content_split",
]

#: Instruction appended to every problem (the ``arithmetic`` reward also accepts a bare last
#: number, so a model that ignores the format still gets credit for the right number).
DEFAULT_INSTRUCTION = "Give the final answer as a number after '####'."

#: Default difficulty, calibrated on SmolLM2-135M-Instruct with bench/calibrate_arithmetic.py
#: (32 held-out problems per level, 96 new tokens; accuracy sampled at T=1.0 / greedy):
#: d1 0.06 / 0.22, d2 0.00 / 0.03, d3 0.03 / 0.00, d4 0.00 / 0.03.
DEFAULT_DIFFICULTY = 1

#: Buckets (out of 100) of problem content reserved for the test split.
TEST_BUCKETS = 10


@dataclass(frozen=True)
class Level:
    """Parameters of one difficulty level."""

    steps: int
    start: tuple[int, int]
    operand: tuple[int, int]
    ops: tuple[str, ...]
    mul: tuple[int, int] = (2, 3)
    div: tuple[int, int] = (2, 5)


#: Difficulty -> generator parameters.
LEVELS: dict[int, Level] = {
    1: Level(steps=1, start=(2, 20), operand=(2, 10), ops=("+", "-")),
    2: Level(steps=2, start=(3, 30), operand=(2, 20), ops=("+", "-", "+", "-", "*"), mul=(2, 3)),
    3: Level(steps=3, start=(5, 60), operand=(2, 30), ops=("+", "-", "*"), mul=(2, 4)),
    4: Level(steps=4, start=(10, 100), operand=(2, 50), ops=("+", "-", "*", "/"), mul=(2, 5), div=(2, 5)),
}

_PEOPLE = [
    ("Tom", "he", "his", "him"),
    ("Anna", "she", "her", "her"),
    ("Liam", "he", "his", "him"),
    ("Mia", "she", "her", "her"),
    ("Omar", "he", "his", "him"),
    ("Sara", "she", "her", "her"),
    ("Ben", "he", "his", "him"),
    ("Lucy", "she", "her", "her"),
    ("Raj", "he", "his", "him"),
    ("Emma", "she", "her", "her"),
    ("Carlos", "he", "his", "him"),
    ("Nina", "she", "her", "her"),
]

_ITEMS = [
    "apples", "marbles", "stickers", "pencils", "cookies", "coins",
    "books", "stamps", "cards", "balloons", "shells", "toy cars",
]

# Person frame: "{name} has {a} {items}." then steps told with a pronoun.
_PERSON_START = [
    "{Name} has {a} {items}.",
    "{Name} starts with {a} {items}.",
    "{Name} has a bag with {a} {items}.",
]
_PERSON_OPS = {
    "+": ["{s} buys {n} more.", "{s} finds {n} more.", "a friend gives {o} {n} more.", "{s} gets {n} more."],
    "-": ["{s} gives away {n}.", "{s} loses {n}.", "{s} gives {n} to a friend.", "{s} sells {n}."],
    "*": ["{s} ends up with {k} times as many {items} as before.",
          "the number of {items} {s} has becomes {k} times as large."],
    "/": ["{s} splits {p} {items} equally into {k} groups and keeps only one group."],
}
_PERSON_Q = [
    "How many {items} does {Name} have now?",
    "How many {items} does {Name} have at the end?",
]

# Container frame: "A box holds {a} {items}." then steps done by a named person.
_BOX_START = [
    "A box holds {a} {items}.",
    "There are {a} {items} in a box.",
]
_BOX_OPS = {
    "+": ["{Name} puts {n} more into the box.", "{Name} adds {n} more {items} to the box."],
    "-": ["{Name} takes {n} out of the box.", "{Name} removes {n} {items} from the box."],
    "*": ["the number of {items} in the box becomes {k} times as large."],
    "/": ["the {items} are shared equally among {k} boxes, and only one box is kept."],
}
_BOX_Q = [
    "How many {items} are in the box now?",
    "How many {items} are in the box at the end?",
]

_CONNECTORS = ["", "Then ", "After that, ", "Next, "]


def apply_ops(start: int, ops: Sequence[Sequence]) -> int:
    """Result of applying ``ops`` (pairs ``(op, n)`` with op in ``+ - * /``) to ``start``.

    Division must be exact (raises ValueError otherwise)."""
    v = int(start)
    for op, n in ops:
        n = int(n)
        if op == "+":
            v += n
        elif op == "-":
            v -= n
        elif op == "*":
            v *= n
        elif op == "/":
            if n == 0 or v % n:
                raise ValueError(f"inexact division {v} / {n}")
            v //= n
        else:
            raise ValueError(f"unknown op {op!r}")
    return v


def _hash_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def content_split(start: int, ops: Sequence[Sequence]) -> str:
    """``"test"`` or ``"train"``: which split owns a problem with this start value and
    operation sequence (independent of wording, seed and difficulty)."""
    key = f"{int(start)}|" + ";".join(f"{op}{int(n)}" for op, n in ops)
    return "test" if _hash_int(key) % 100 < TEST_BUCKETS else "train"


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:] if s else s


class ArithmeticTask:
    """Seeded generator of integer word problems with exact answers.

    Args:
        seed: Stream seed; ``example(i)`` is deterministic in ``(split, seed, difficulty, i)``.
        difficulty: 1..4, see :data:`LEVELS` (number of steps = difficulty).
        split: ``"train"`` or ``"test"``; the two never share a problem (see module docs).
        instruction: Text appended (on a new line) to every problem; ``""`` for none.

    Each example's ``meta`` holds ``start``, ``ops`` (list of ``[op, n]``), ``difficulty``,
    ``split``, ``seed`` and ``index`` so the answer can be recomputed with :func:`apply_ops`.
    """

    reward_name = "arithmetic"

    def __init__(
        self,
        seed: int = 0,
        difficulty: int = DEFAULT_DIFFICULTY,
        split: str = "train",
        instruction: str = DEFAULT_INSTRUCTION,
    ):
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if difficulty not in LEVELS:
            raise ValueError(f"difficulty must be one of {sorted(LEVELS)}, got {difficulty!r}")
        self.seed = int(seed)
        self.difficulty = int(difficulty)
        self.split = split
        self.instruction = instruction
        self.level = LEVELS[self.difficulty]

    def __repr__(self) -> str:
        return f"ArithmeticTask(seed={self.seed}, difficulty={self.difficulty}, split={self.split!r})"

    def with_split(self, split: str) -> "ArithmeticTask":
        """The same task (seed, difficulty, instruction) on another split."""
        return ArithmeticTask(self.seed, self.difficulty, split, self.instruction)

    # ------------------------------------------------------------------ generation

    def _draw_ops(self, rng: random.Random) -> tuple[int, list[list]]:
        lv = self.level
        start = rng.randint(*lv.start)
        v = start
        ops: list[list] = []
        for _ in range(lv.steps):
            op = rng.choice(lv.ops)
            if op == "/":
                divisors = [k for k in range(lv.div[0], lv.div[1] + 1) if v % k == 0 and v // k >= 1]
                if not divisors:
                    op = rng.choice(["+", "-"])
            if op == "-" and v <= 1:
                op = "+"
            if op == "*" and v > 200:
                op = "-"
            if op == "+":
                n = rng.randint(*lv.operand)
                v += n
            elif op == "-":
                n = rng.randint(min(lv.operand[0], v - 1), min(lv.operand[1], v - 1))
                v -= n
            elif op == "*":
                n = rng.randint(*lv.mul)
                v *= n
            else:
                n = rng.choice(divisors)
                v //= n
            ops.append([op, n])
        return start, ops

    def _render(self, rng: random.Random, start: int, ops: list[list]) -> str:
        name, subj, poss, obj = rng.choice(_PEOPLE)
        items = rng.choice(_ITEMS)
        person_frame = rng.random() < 0.6
        if person_frame:
            first = rng.choice(_PERSON_START)
            table, question = _PERSON_OPS, rng.choice(_PERSON_Q)
        else:
            first = rng.choice(_BOX_START)
            table, question = _BOX_OPS, rng.choice(_BOX_Q)
        fmt = dict(Name=name, s=subj, p=poss, o=obj, items=items)
        sentences = [_cap(first.format(a=start, **fmt))]
        for j, (op, n) in enumerate(ops):
            body = rng.choice(table[op]).format(n=n, k=n, **fmt)
            conn = rng.choice(_CONNECTORS) if j > 0 else ""
            if op in "*/" and not conn:
                conn = "Then "
            sentences.append(_cap(conn + body))
        sentences.append(question.format(**fmt))
        return " ".join(sentences)

    def example(self, i: int) -> Example:
        """The ``i``-th problem of this task's stream (deterministic, any ``i >= 0``)."""
        i = int(i)
        if i < 0:
            raise ValueError(f"index must be >= 0, got {i}")
        rng = random.Random(_hash_int(f"arith|{self.split}|{self.seed}|{self.difficulty}|{i}"))
        for _ in range(10_000):
            start, ops = self._draw_ops(rng)
            if content_split(start, ops) == self.split:
                break
        else:  # pragma: no cover - probability ~0
            raise RuntimeError("could not draw a problem for this split")
        answer = apply_ops(start, ops)
        text = self._render(rng, start, ops)
        prompt = f"{text}\n{self.instruction}" if self.instruction else text
        meta = {
            "task": "arithmetic",
            "start": start,
            "ops": ops,
            "difficulty": self.difficulty,
            "split": self.split,
            "seed": self.seed,
            "index": i,
        }
        return Example(
            prompt=prompt,
            answer=str(answer),
            id=f"arith:{self.split}:d{self.difficulty}:seed{self.seed}:{i}",
            meta=meta,
        )

    def __getitem__(self, i: int) -> Example:
        """Same as :meth:`example`."""
        return self.example(i)

    def examples(self, n: int, start: int = 0) -> list[Example]:
        """``[example(start), ..., example(start + n - 1)]``."""
        return [self.example(j) for j in range(start, start + int(n))]

    def stream(self, start: int = 0) -> Iterator[Example]:
        """Endless iterator over ``example(start), example(start + 1), ...``."""
        j = int(start)
        while True:
            yield self.example(j)
            j += 1
