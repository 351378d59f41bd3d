"""Tasks: datasets of prompts with verifiable answers, and the rewards that check them.

* :mod:`tether.tasks.base` -- :class:`Example`, :class:`RewardResult`, :class:`DataError`.
* :mod:`tether.tasks.arithmetic` -- :class:`ArithmeticTask`, the seeded synthetic default task.
* :mod:`tether.tasks.data` -- :func:`load_examples` for files, named datasets and hub ids.
* :mod:`tether.tasks.math` -- :func:`extract_answer`, :func:`is_equivalent` (math-verify).
* :mod:`tether.tasks.rewards` -- :func:`load_reward`, :func:`call_reward`, the reward registry ``REWARDS``.
* :mod:`tether.tasks.registry` -- :data:`TASKS`, the task registry (arithmetic, math datasets, the search
  agent's QA data, a user's ``module:function``) that ``tether.tasks.stream.prompt_stream`` looks up.
* :mod:`tether.tasks.qa_reward` -- the search agent's exact-match / F1 reward (``search``, ``search_f1``).
* :mod:`tether.tasks.benchmarks` -- :func:`load_benchmark`: a benchmark's examples and reward.
* :mod:`tether.tasks.prompts` -- :func:`encode_prompts` through the chat template.

Nothing here touches the network unless a hub dataset is requested explicitly (and the
optional ``datasets`` package is installed).
"""

from .arithmetic import DEFAULT_DIFFICULTY, DEFAULT_INSTRUCTION, LEVELS, ArithmeticTask, apply_ops
from .base import DataError, Example, RewardFn, RewardResult
from .data import (
    DATA_DIR_ENV,
    NAMED_DATASETS,
    NamedDataset,
    default_reward_name,
    load_examples,
    resolve_dataset_name,
)
from .math import extract_answer, extract_boxed, gsm8k_reference, has_answer_format, is_equivalent
from .registry import TASKS
from .rewards import (
    BUILTIN_REWARDS,
    REWARDS,
    arithmetic_reward,
    call_reward,
    gsm8k_reward,
    load_reward,
    math_reward,
    normalize_reward_output,
)

__all__ = [
    "ArithmeticTask",
    "BUILTIN_REWARDS",
    "DATA_DIR_ENV",
    "DEFAULT_DIFFICULTY",
    "DEFAULT_INSTRUCTION",
    "DataError",
    "Example",
    "LEVELS",
    "NAMED_DATASETS",
    "NamedDataset",
    "REWARDS",
    "RewardFn",
    "RewardResult",
    "TASKS",
    "apply_ops",
    "arithmetic_reward",
    "call_reward",
    "default_reward_name",
    "extract_answer",
    "extract_boxed",
    "gsm8k_reference",
    "gsm8k_reward",
    "has_answer_format",
    "is_equivalent",
    "load_examples",
    "load_reward",
    "math_reward",
    "normalize_reward_output",
    "resolve_dataset_name",
]
