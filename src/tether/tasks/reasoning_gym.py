"""reasoning-gym's procedurally generated, verifiable tasks as tether tasks (the optional extra
``tether[reasoning-gym]``; docs/ecosystem.md).

``data.task=reasoning_gym:<name>`` trains on ``reasoning_gym.create_dataset(name, seed=..., size=..., **options)``
(``data.options``: its size, seed and the dataset's own difficulty options); each question gets an instruction to
put the final answer in ``<answer></answer>`` tags, and the dataset's own verifier scores it (the ``reasoning_gym``
reward: ``score_answer(extracted answer, entry)``, in [0, 1]; correct when it is 1). reasoning-gym has no test
split: the held-out problems (``eval.benchmarks=auto``, ``tether eval --benchmarks reasoning_gym:<name>``) are the
same dataset drawn with seed + :data:`TEST_SEED_OFFSET` (for a task with few distinct problems some may coincide
with training ones).
"""

from __future__ import annotations

from typing import Any, Optional

from ..algo.registry import unknown_choice
from ..errors import optional_import
from .base import DataError, Example, RewardResult

#: ``data.task`` / benchmark prefix of a reasoning-gym dataset
PREFIX = "reasoning_gym:"
#: added to each question (reasoning-gym's verifiers read the text between the last answer tags)
INSTRUCTION = ("\n\nThink step by step, then give only the final answer between answer tags, "
               "like this: <answer>your answer</answer>")
#: the held-out problems are the dataset drawn at seed + this
TEST_SEED_OFFSET = 1_000_000
#: problems per dataset when ``data.options`` gives no ``size``
DEFAULT_SIZE = 1000


def library():
    """The ``reasoning_gym`` module (an optional extra, imported only by the tasks that use it), or a DataError
    saying how to install it."""
    return optional_import("reasoning_gym", "reasoning-gym tasks", "reasoning-gym", DataError)


def dataset_name(source: str) -> str:
    """``reasoning_gym:<name>`` -> ``<name>`` (a DataError if the name is missing)."""
    name = source[len(PREFIX):] if source.startswith(PREFIX) else ""
    if not name:
        raise DataError(f"{source!r}: name a reasoning-gym dataset, e.g. reasoning_gym:basic_arithmetic")
    return name


def make_examples(name: str, *, seed: int, size: int, options: Optional[dict[str, Any]] = None,
                  split: str = "train") -> list[Example]:
    """``size`` problems of reasoning-gym dataset ``name`` at ``seed`` with its ``options`` (its difficulty
    settings), as Examples whose ``meta["entry"]`` is the dataset's entry (what its verifier reads). An unknown
    name or an option the dataset refuses is a DataError naming it."""
    rg = library()
    known = sorted(rg.factory.DATASETS)
    if name not in known:
        raise DataError(unknown_choice("reasoning-gym dataset", name, known))
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise DataError(f"reasoning_gym:{name}: size must be an integer >= 1, got {size!r}")
    try:
        data = rg.create_dataset(name, seed=seed, size=size, **(options or {}))
    except (TypeError, ValueError, AssertionError, KeyError) as e:
        raise DataError(f"reasoning_gym:{name}: the dataset refused its options {options or {}} (data.options): "
                        f"{type(e).__name__}: {e}") from None
    return [Example(prompt=str(entry["question"]) + INSTRUCTION, answer=str(entry["answer"]),
                    id=f"rg:{name}:{split}:s{seed}:{i}", meta={"entry": entry}) for i, entry in enumerate(data)]


def split_options(options: dict[str, Any], seed: int, size: int) -> tuple[int, int, dict[str, Any]]:
    """``data.options`` as (seed, size, the dataset's own options): ``seed`` and ``size`` there override the
    defaults given."""
    opts = dict(options)
    return int(opts.pop("seed", seed)), opts.pop("size", size), opts


def reasoning_gym_reward(completion: str, example: Example) -> RewardResult:
    """The dataset's own verifier on the answer between the completion's last ``<answer>`` tags: its score in
    [0, 1] is the reward; correct when it is 1 (no answer tags: 0)."""
    rg = library()
    entry = example.meta.get("entry")
    if not isinstance(entry, dict):
        raise ValueError(f"example {example.id!r} is not a reasoning-gym problem (no meta['entry'])")
    pred = rg.utils.extract_answer(completion)
    if pred is None:
        return RewardResult(reward=0.0, correct=False, pred=None)
    score = float(rg.get_score_answer_fn(entry["metadata"]["source_dataset"])(pred, entry))
    return RewardResult(reward=score, correct=score >= 1.0, pred=pred)
