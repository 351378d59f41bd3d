"""``data`` is a section chosen by ``data.task`` (tether.config.data): each kind of task has the keys it reads, a key
of another kind is refused as it is set, changing the task keeps the keys the new one reads, a config saved with
every data key loads, and a task registered with a name prefix reads every key."""

from __future__ import annotations

import pytest

from tether.config import data_config, to_dict
from tether.config.data import (
    ArithmeticDataConfig,
    DatasetDataConfig,
    OrganismDataConfig,
    OtherDataConfig,
    ReasoningGymDataConfig,
)
from tether.errors import ConfigError
from tether.resolve import load_config
from tether.tasks.base import Example
from tether.tasks.organism_problems import MAX_DIFFICULTY
from tether.tasks.registry import TASKS
from tether.tasks.stream import prompt_stream


@pytest.mark.parametrize("task, cls", [
    ("arithmetic", ArithmeticDataConfig), ("organism", OrganismDataConfig),
    ("reasoning_gym:basic_arithmetic", ReasoningGymDataConfig), ("gsm8k", DatasetDataConfig),
    ("rows.jsonl", DatasetDataConfig), ("org/name", DatasetDataConfig), ("org/name:main", DatasetDataConfig),
    ("multihop", DatasetDataConfig), ("my_ext:countdown", OtherDataConfig), ("tasks.py:countdown", OtherDataConfig),
])
def test_the_task_chooses_the_section(task, cls):
    assert type(data_config(task)) is cls
    if cls in (ArithmeticDataConfig, OrganismDataConfig, DatasetDataConfig):  # the others load a module here
        assert type(load_config(None, {"data": task}).data) is cls  # data=NAME is short for data.task=NAME


@pytest.mark.parametrize("over, msg", [
    ({"data.task": "gsm8k", "data.difficulty": 2},
     "data.difficulty is a key of data.task=arithmetic or organism, and data.task is 'gsm8k'"),
    ({"data.split": "test"}, "data.split is a key of data.task=<a named dataset, file or hub id>, and data.task is "
                             "'arithmetic': set data.task to one first"),
    ({"data.task": "gsm8k", "data.options": {"size": 3}},
     "data.options is a key of data.task=reasoning_gym:<name>, and data.task is 'gsm8k'"),
    ({"data.difficulty": 5}, r"data.difficulty must be in \[1, 4\], got 5"),
    ({"data.task": "organism", "data.difficulty": 7}, rf"data.difficulty must be in \[1, {MAX_DIFFICULTY}\], got 7"),
    ({"data.task": "gsm8k", "data.limit": -1}, "data.limit must be >= 0, got -1"),
    # what a generated stream cannot use is its registered metadata (limit and shuffle are any finite task's)
    ({"data.limit": 5}, "data.limit has no effect with the synthetic arithmetic task"),
])
def test_a_key_the_task_does_not_read_is_refused(over, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, over)


def test_changing_the_task_keeps_the_keys_the_new_one_reads(tmp_path):
    """A YAML file's data keys, then an override of the task: the keys both read stay, the generated task's difficulty
    goes (the file set it for the arithmetic task it named)."""
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  task: arithmetic\n  difficulty: 3\n  system_prompt: Be brief.\n  format_weight: 0.1\n")
    cfg = load_config(str(f), {"data.task": "gsm8k", "data.limit": 7})
    assert to_dict(cfg)["data"] == {"task": "gsm8k", "limit": 7, "shuffle": True, "reward": "auto",
                                    "reward_timeout": 10.0, "format_weight": 0.1, "system_prompt": "Be brief.",
                                    "split": "train", "prompt_key": None, "answer_key": None, "data_dir": None}
    assert load_config(str(f)).data.difficulty == 3


def test_a_config_saved_with_every_data_key_loads():
    """The previous release wrote every data key whatever the task read: each unread one at its old default is
    dropped; one at another value is refused, naming the tasks that read it."""
    old = {"data.split": "train", "data.prompt_key": None, "data.answer_key": None, "data.data_dir": None,
           "data.limit": 0, "data.shuffle": True, "data.difficulty": 1, "data.options": {}}
    assert type(load_config(None, {**old, "data.task": "gsm8k"}).data) is DatasetDataConfig
    organism = load_config(None, {**old, "data.task": "organism", "data.difficulty": 3})
    assert type(organism.data) is OrganismDataConfig and organism.data.difficulty == 3
    with pytest.raises(ConfigError, match="data.difficulty is a key of data.task=arithmetic or organism"):
        load_config(None, {**old, "data.task": "gsm8k", "data.difficulty": 3})


def test_a_task_registered_with_a_prefix_reads_every_key():
    """``countdown:<n>`` (a task registered with ``prefix``) has every data key: its builder reads difficulty and
    options, and a plain registered name has the dataset's keys only."""
    seen = {}

    def countdown(data):
        seen.update(difficulty=data.difficulty, options=data.options, task=data.task)
        return [Example(id=f"c{i}", prompt=f"count down from {i}", answer="0") for i in range(3)]

    TASKS.register("countdown_t", prefix="countdown:", reward="arithmetic")(countdown)
    try:
        cfg = load_config(None, {"data.task": "countdown:easy", "data.difficulty": 4, "data.options": {"start": 9}})
        assert type(cfg.data) is OtherDataConfig
        assert len(prompt_stream(cfg).examples) == 3
        assert seen == {"difficulty": 4, "options": {"start": 9}, "task": "countdown:easy"}
    finally:
        del TASKS["countdown_t"]
