"""Core types shared by every task: examples, reward results and data errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

__all__ = ["Example", "RewardResult", "RewardFn", "RewardReturn", "DataError"]


@dataclass
class Example:
    """One prompt with its verifiable reference answer.

    Attributes:
        prompt: The user question text. The chat template is applied later by the trainer,
            so this is plain text (for the synthetic task it already ends with the answer
            format instruction).
        answer: The reference answer as a string. Numbers are canonical strings
            (``142.0`` -> ``"142"``, ``"1,234"`` -> ``"1234"``).
        id: A stable identifier, e.g. ``"gsm8k_test:17"`` (0-based row) or
            ``"arith:train:d1:seed3:42"``.
        meta: Everything else from the source row (for GSM8K the full worked solution is in
            ``meta["solution"]``; for rows whose answer was a list of equivalent forms, all of
            them are in ``meta["answers"]``).
    """

    prompt: str
    answer: str
    id: str
    meta: dict = field(default_factory=dict)


@dataclass
class RewardResult:
    """What a reward function reports for one completion.

    Attributes:
        reward: Scalar reward used for training.
        correct: Whether the final answer is correct (the accuracy metric); independent of
            any format bonus folded into ``reward``.
        pred: The extracted answer, for logs (``None`` when nothing could be extracted).
    """

    reward: float
    correct: bool
    pred: str | None = None


#: What a reward function may return; :func:`tether.tasks.rewards.call_reward` normalizes it.
RewardReturn = Union[RewardResult, float, int, bool]

#: Signature of a reward function: ``fn(completion, example) -> RewardResult | float | bool``.
RewardFn = Callable[[str, Example], Any]


class DataError(ValueError):
    """A dataset could not be loaded or a row is invalid.

    The message names the file (or dataset), the 1-based row number (the line number for
    JSONL) and the offending field, so the problem can be fixed before any training starts.
    """
