"""The model organism's problems: chains of two-digit additions and subtractions, written compactly.

A problem of difficulty ``d`` is a start value and ``d`` operations; the prompt is the expression,
prefixed by a mode letter, and a worked solution does one operation a line::

    Q:47+38-12          (prompt; "C:" instead of "Q:" in the calculator environment's episodes)
    47+38=85            (solution: one line per operation, then the answer after '####')
    85-12=73
    #### 73

Values: the start value is 10..99, each operand 1..99, and every intermediate value stays in
0..199 (a draw that leaves that range is redrawn), so each line is one two- or three-digit sum a
model of under a million parameters can learn. The answer is the last value; the ``arithmetic`` reward
reads it after ``####``.

``draw(split, seed, difficulty, i)`` is a pure function of its arguments (``tether.tasks.organism`` makes
examples of it). The held-out split is by content, as in :mod:`tether.tasks.arithmetic`: the (start, operations) of a
problem hashed into 100 buckets, buckets below :data:`TEST_BUCKETS` being ``test``, so no test
problem is ever trained on, whatever the seed or difficulty.

The organism model (:mod:`tether.organism.build`) is supervised on difficulties 1-3, and reinforced on
difficulty :data:`RL_DIFFICULTY`, where its greedy decoding mostly answers directly and is rarely right.
"""

from __future__ import annotations

import hashlib
import random
from typing import Sequence

from ..config.data import ORGANISM_MAX_DIFFICULTY

__all__ = ["TEST_BUCKETS", "RL_DIFFICULTY", "MAX_DIFFICULTY", "MAX_VALUE", "QUESTION", "CALC", "content_split",
           "solve", "expression", "solution_text", "response_tokens", "draw"]

#: Buckets (of 100) of problem content held out for ``split="test"``.
TEST_BUCKETS = 10
#: The difficulty RL trains and evaluates on by default (``data.difficulty`` for ``data.task=organism``).
RL_DIFFICULTY = 3
#: The largest difficulty (operations per problem; the range of ``data.difficulty`` with ``data.task=organism`` is
#: declared with the key).
MAX_DIFFICULTY = ORGANISM_MAX_DIFFICULTY
#: Prompt prefix of a plain problem, and of one posed in the calculator environment.
QUESTION, CALC = "Q:", "C:"
#: Largest intermediate value (and the smallest is 0).
MAX_VALUE = 199


def _hash_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def content_split(start: int, ops: Sequence[tuple[str, int]]) -> str:
    """``"test"`` or ``"train"``: the split that owns a problem of this content."""
    key = f"{start}|" + ";".join(f"{op}{n}" for op, n in ops)
    return "test" if _hash_int(key) % 100 < TEST_BUCKETS else "train"


def solve(start: int, ops: Sequence[tuple[str, int]]) -> list[int]:
    """The values after each operation (``v_k = v_{k-1} ± n_k``)."""
    values, v = [], start
    for op, n in ops:
        v = v + n if op == "+" else v - n
        values.append(v)
    return values


def expression(start: int, ops: Sequence[tuple[str, int]]) -> str:
    """``47+38-12``."""
    return str(start) + "".join(f"{op}{n}" for op, n in ops)


def solution_text(start: int, ops: Sequence[tuple[str, int]]) -> str:
    """The worked solution: one ``a+b=c`` line per operation, then ``#### answer``."""
    lines, v = [], start
    for (op, n), nv in zip(ops, solve(start, ops)):
        lines.append(f"{v}{op}{n}={nv}")
        v = nv
    return "\n".join(lines) + f"\n#### {v}"


def response_tokens(difficulty: int) -> int:
    """The response cap an organism problem of ``difficulty`` is answered within: its longest worked solution
    (``199-99=100`` and a newline a line, then ``#### 199``: 11 d + 8 characters, one token a character) and the end
    token, rounded up to a multiple of 16: 48 at :data:`RL_DIFFICULTY` (the regime's rollout length), 80 at the
    largest difficulty."""
    return -(-(11 * int(difficulty) + 9) // 16) * 16


def draw(split: str, seed: int, difficulty: int, i: int) -> tuple[int, list[tuple[str, int]]]:
    """The ``i``-th problem's (start, ops) of a stream: redrawn until its values stay in 0..MAX_VALUE
    and its content belongs to ``split``."""
    rng = random.Random(f"organism|{split}|{seed}|{difficulty}|{i}")
    while True:
        start = rng.randint(10, 99)
        ops = [(rng.choice("+-"), rng.randint(1, 99)) for _ in range(difficulty)]
        if all(0 <= v <= MAX_VALUE for v in solve(start, ops)) and content_split(start, ops) == split:
            return start, ops
