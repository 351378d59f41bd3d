"""``data``: where prompts come from and how responses are scored, a section chosen by its ``task``, each kind of task
with the keys it reads: the generated tasks (arithmetic, organism: ``difficulty``), a dataset (a named set, a file or
a hub id: its split, fields and directory), ``reasoning_gym:<name>`` (its ``options``) and a user's task
``module:function`` / ``path.py:function`` or prefixed name (every key, for it to read). A key another kind reads is
refused by construction (``data.difficulty`` with ``task: gsm8k``); changing the task keeps the keys the new one reads.

Which keys an *environment's* task reads (the search environment's QA sets, a verifiers environment's rows: the
environment picks the task, `tether.tasks.registry`) is its registered ``ignores``, checked by `tether.resolve`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import Field

from ..algo.registry import is_spec
from ..sections import Section, only_with
from .migration import Choice

#: The largest difficulty of the organism's problems (operations per problem; `tether.tasks.organism_problems`)
ORGANISM_MAX_DIFFICULTY = 6


class _Task(Section):
    choice_key: ClassVar[str] = "task"
    task: str
    """arithmetic (synthetic, no files) | organism (docs/organism.md) | reasoning_gym:<name> (a reasoning-gym dataset,
    extra tether[reasoning-gym], its options in data.options) | gsm8k | math500 | aime24 | amc | minerva |
    olympiadbench | a .jsonl/.json/.parquet file | a hub dataset id | a user's task module:function / path.py:function
    (docs/extending.md); with rollout.agent.env.name=search, a QA set of the search data dir"""
    limit: int = Field(0, ge=0)
    """use only the first N examples (0 = all; a dataset's, not a generated task's)"""
    shuffle: bool = True
    """visit a dataset's examples in a seeded random order (train.seed; not a generated task's)"""
    reward: str = "auto"
    """auto (the task's own) | a registered reward | a user's module:function / path.py:function
    (docs/extending.md)"""
    reward_timeout: float = Field(10.0, ge=0, allow_inf_nan=False)
    """user rewards (module:function, path.py:function) run in a worker process, at most this many seconds per
    call: a call that runs longer is stopped, scores 0 and counts in reward_errors (0 = no limit, the reward
    runs in the trainer process, as the built-in rewards always do)"""
    _user_reward = only_with("reward_timeout", holds=lambda d: is_spec(d.get("reward", "m:f")),
                             text="only applies to a user reward (data.reward=module:function or path.py:function); "
                                  "the built-in rewards run in the trainer process")
    format_weight: float = Field(0.0, allow_inf_nan=False)
    """reward += format_weight when the answer is in the requested format (0 = correctness only, the default: a 0.2
    bonus was gamed by responses of repeated "####" lines that collect it without a correct answer, see
    docs/results.md)"""
    system_prompt: str = ""
    """system message prepended through the model's chat template ("" = none)"""


class _Files(Section):
    split: str = "train"
    """dataset split (named and hub datasets; env.name=search: hub ids only)"""
    prompt_key: Optional[str] = None
    """files/hub: the prompt field (default: first of prompt, question, problem)"""
    answer_key: Optional[str] = None
    """files/hub: the answer field (default: answer)"""
    data_dir: Optional[str] = None
    """named datasets: local directory tried before $TETHER_DATA_DIR and the hub (the search environment's QA
    sets: rollout.agent.env.retriever.data_dir)"""


class _Options(Section):
    options: dict[str, Any] = Field(default_factory=dict)
    """the task's own options; data.task=reasoning_gym:<name>: keyword arguments of reasoning_gym.create_dataset:
    size (default 1000), seed (default train.seed) and the dataset's difficulty options, e.g. {size: 500,
    min_terms: 2, max_terms: 4} (docs/ecosystem.md)"""


class ArithmeticDataConfig(_Task):
    """``data.task=arithmetic``: the synthetic arithmetic task, an endless seeded stream."""

    task: Literal["arithmetic"] = "arithmetic"
    """arithmetic"""
    difficulty: int = Field(1, ge=1, le=4)
    """number of steps per problem"""


class OrganismDataConfig(_Task):
    """``data.task=organism``: the model organism's problems, an endless seeded stream (docs/organism.md)."""

    task: Literal["organism"] = "organism"
    """organism"""
    difficulty: int = Field(1, ge=1, le=ORGANISM_MAX_DIFFICULTY)
    """operations per problem (tether train --task organism: 3, where it starts weak)"""


class ReasoningGymDataConfig(_Options, _Task):
    """``data.task=reasoning_gym:<name>``: a reasoning-gym dataset (extra tether[reasoning-gym], docs/ecosystem.md),
    its options in data.options."""

    choice_prefix: ClassVar[str] = "reasoning_gym:"
    task: str = Field(pattern=r"^reasoning_gym:")
    """reasoning_gym:<name>, a reasoning-gym dataset's name"""


class DatasetDataConfig(_Files, _Task):
    """A dataset: a named one (gsm8k, math500, ...), a .jsonl/.json/.parquet file or a hub id; with
    rollout.agent.env.name=search, a QA set of the search data dir. Any name that is none of the others' (and not a
    user's module:function) is one."""

    choice_label: ClassVar[str] = "<a named dataset, file or hub id>"
    task: str = "gsm8k"
    """gsm8k | math500 | aime24 | amc | minerva | olympiadbench | a .jsonl/.json/.parquet file | a hub dataset id
    (org/name, org/name:config); with rollout.agent.env.name=search, a QA set of the search data dir"""

    @classmethod
    def choice_test(cls, task: Any) -> bool:
        """Whether ``task`` names a dataset: a name of no other kind and not a user's ``module:function``."""
        return isinstance(task, str) and not is_spec(task)


class OtherDataConfig(_Options, _Files, _Task):
    """A user's task ``module:function`` / ``path.py:function`` or a task registered with a name prefix
    (docs/extending.md): every key, for it to read."""

    difficulty: int = Field(1, ge=1)
    """a user's task's own difficulty, if it reads one"""


#: data.task -> its section (a key ending in ":" holds every name it starts; the dataset's section holds every name
#: its ``choice_test`` accepts)
DATA_SECTIONS: dict[str, type[Section]] = {"arithmetic": ArithmeticDataConfig, "organism": OrganismDataConfig,
                                           "reasoning_gym:": ReasoningGymDataConfig, "<dataset>": DatasetDataConfig}

#: the keys every data section carried before each kind of task had its own, and their defaults then
_OLD_DEFAULTS = {"split": "train", "prompt_key": None, "answer_key": None, "data_dir": None, "difficulty": 1,
                 "options": {}}


#: data, chosen by its task
DATA = Choice("data", DATA_SECTIONS, OtherDataConfig, "arithmetic", _OLD_DEFAULTS, key="task")
DataConfig = DATA.type
data_config = DATA.section
