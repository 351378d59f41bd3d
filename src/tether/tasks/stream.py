"""Where a run's examples come from: the training prompt stream and the held-out evaluation sets.

* `PromptStream` -- what the trainer reads: ``take(n)`` gives the next ``n`` examples of a
  deterministic stream, ``position`` (an int) is checkpointed, ``reward_name`` is the reward that
  fits the task (``data.reward=auto``), and ``examples`` holds a finite dataset's rows (None for a
  generated task) so that they can be checked before the first step.
* `prompt_stream(cfg)` / `held_out_sets(cfg, names)` -- build them from a config (a task is given its
  sections: `tether.tasks.registry.call_task`), and
  `training_reward(cfg.data, stream)` scores the stream's responses. They look the task up in the task
  registry (`tether.tasks.registry.TASKS`: the synthetic ``arithmetic`` task, datasets, the search
  agent's QA data, or a user's ``module:function``); nothing here or in the trainer branches on a name.

The stream is name-agnostic: a generated task gives it ``generate(i) -> Example``, a dataset its
rows (wrapped around, reshuffled each pass with a seed of ``train.seed`` and the pass).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..userio import slug
from .base import Example
from .benchmarks import load_benchmark
from .registry import TASKS, call_task, held_out_benchmark, resolve_task, task_name
from .reward_worker import reward_scorer


class PromptStream:
    """A deterministic stream of training examples; ``position`` (an int) is checkpointed.

    Exactly one of ``examples`` (a dataset's rows, taken in order or reshuffled each pass) and
    ``generate`` (example ``i`` of a generated task) is given.
    """

    def __init__(self, *, reward_name: str, seed: int, shuffle: bool = True,
                 examples: Optional[list[Example]] = None, generate: Optional[Callable[[int], Example]] = None):
        if (examples is None) == (generate is None):
            raise ValueError("PromptStream takes exactly one of examples= and generate=")
        self.examples, self.generate = examples, generate
        self.reward_name, self.seed, self.shuffle = reward_name, seed, shuffle
        self.position = 0

    def _index(self, pos: int) -> int:
        n = len(self.examples)
        epoch, i = divmod(pos, n)
        if not self.shuffle:
            return i
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return int(torch.randperm(n, generator=g)[i])

    def take(self, n: int) -> list[Example]:
        """The next ``n`` examples (datasets wrap around, reshuffled each pass)."""
        if self.examples is None:
            out = [self.generate(self.position + i) for i in range(n)]
        else:
            out = [self.examples[self._index(self.position + i)] for i in range(n)]
        self.position += n
        return out


def prompt_stream(cfg) -> PromptStream:
    """The training stream of the task ``cfg`` picks (`tether.tasks.registry`; ``cfg`` is a
    `tether.config.Config`); every row is validated here, before the (slow) model load."""
    build, meta = resolve_task(cfg)
    rows = call_task(build, cfg)  # given the sections it names (data, seed, env), not the whole config
    reward = meta["reward"]
    reward = (call_task(reward, cfg) if callable(reward) else reward) or "math"
    seed, shuffle = cfg.train.seed, cfg.data.shuffle
    if callable(rows):
        return PromptStream(generate=rows, reward_name=reward, seed=seed, shuffle=shuffle)
    return PromptStream(examples=list(rows), reward_name=reward, seed=seed, shuffle=shuffle)


def training_reward(data, stream: PromptStream, default: Optional[str] = None):
    """The scorer of the training responses (`tether.tasks.reward_worker.reward_scorer`) from the ``data``
    section: ``data.reward``; with ``data.reward=auto``, ``default`` (an environment's own reward) or else the
    stream's task reward. A user reward runs in a worker process with ``data.reward_timeout`` per call; a bad
    spec is a RewardError here, before the model load."""
    spec = (default or stream.reward_name) if data.reward == "auto" else data.reward
    return reward_scorer(spec, format_weight=data.format_weight, timeout=data.reward_timeout)


def held_out_sets(cfg, names: list[str]) -> dict:
    """The held-out benchmarks ``names`` (``tether.resolve.eval_benchmarks(cfg)``) for evaluation during
    training: name -> (examples, reward function). A task registered with a ``test_set`` (``arithmetic``:
    the synthetic task's test split, never trained on) gives its own; any other name is a
    `tether.tasks.benchmarks` benchmark."""
    e, d = cfg.eval, cfg.data
    own = task_name(cfg)  # the training task's own test set, for its name (reasoning_gym:<name>)
    out = {}
    for src in names:
        test_set = TASKS.meta(src)["test_set"] if src in TASKS else None
        if test_set is None and own is not None and src in (d.task, held_out_benchmark(cfg)):
            test_set = TASKS.meta(own)["test_set"]  # e.g. verifiers:<env_id>: the environment's eval dataset
        if test_set is not None:
            # reasoning_gym:<name> -> reasoning_gym_<name>, as tether eval names it
            out[slug(src)] = call_task(test_set, cfg, limit=e.limit)
        else:
            b = load_benchmark(src, limit=e.limit, data_dir=getattr(d, "data_dir", None))  # a dataset task's dir
            out[b.name] = (b.examples, b.reward_fn)
    return out
