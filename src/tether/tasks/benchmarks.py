"""Benchmarks: a named benchmark or a data file, loaded and validated, with the reward that scores it.

``tether eval`` and evaluation during training both load their held-out sets here. A named
benchmark (``gsm8k``, ``math500``, ``aime24``, ``amc``, ``minerva``, ``olympiadbench`` or an
alias, see :data:`tether.tasks.data.NAMED_DATASETS`) reads split ``test`` by default; a file
or hub id reads what it is given. The reward defaults to
:func:`tether.tasks.data.default_reward_name` (``gsm8k`` for GSM8K, ``math`` otherwise).
``arithmetic`` / ``arithmetic-dN`` is the synthetic task's test split at difficulty N (1-4;
default 1), seed 0: the problems a run with ``train.seed=0`` holds out, never trained on.

Data layer: imports nothing from eval, train, rollout or models.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import EvalError
from ..userio import slug
from . import reasoning_gym
from .arithmetic import LEVELS, ArithmeticTask
from .data import default_reward_name, load_examples, resolve_dataset_name
from .organism import OrganismTask
from .organism_problems import MAX_DIFFICULTY, RL_DIFFICULTY, response_tokens
from .rewards import load_reward

__all__ = ["BENCHMARK_PREFIXES", "Benchmark", "load_benchmark", "load_benchmarks", "slug"]

#: a source prefix -> ``"module:function"`` of its loader, ``function(source, limit, reward) -> Benchmark`` (named
#: ``slug(source)``), for benchmarks an environment holds; the module is imported when a source has the prefix (the
#: environments sit above this data layer). ``verifiers:<env_id>``: the environment's eval dataset.
BENCHMARK_PREFIXES: dict[str, str] = {
    "verifiers:": "tether.envs.verifiers:eval_benchmark",
}


@dataclass
class Benchmark:
    """A loaded, validated benchmark with the reward that scores it.

    Attributes:
        name: Short name used for output files and table rows (``gsm8k``, or a file's stem).
        source: What was asked for (a named benchmark or a file path / hub id).
        split: The split loaded (``test`` for named benchmarks; None for files).
        examples: The problems.
        reward: The reward spec (``gsm8k``, ``math``, ``file.py:function``, ...).
        reward_fn: The loaded reward function.
        max_new_tokens: The response cap the benchmark is answered within when the caller sets none
            (``organism-dN``: its longest worked solution, `tether.tasks.organism_problems.response_tokens`, the
            organism's context being 256 tokens); None: the caller's.
    """

    name: str
    source: str
    split: Optional[str]
    examples: list
    reward: str
    reward_fn: Any
    max_new_tokens: Optional[int] = None


_ARITHMETIC_RE = re.compile(r"arithmetic(?:-d(\d+))?")
_ORGANISM_RE = re.compile(r"organism(?:-d(\d+))?")


def _benchmark_reward(label: str, spec: str):
    """The reward ``spec`` of benchmark ``label`` (as errors name it); one that does not load is an EvalError."""
    try:
        return load_reward(spec)
    except (ValueError, ImportError) as e:
        raise EvalError(f"benchmark {label}: {e}") from None


def _synthetic_benchmark(kind: str, difficulty: int, limit: Optional[int], reward: Optional[str]) -> Benchmark:
    """A generated task's test split at ``difficulty`` (seed 0; never trained on): ``arithmetic`` (``limit``
    problems, default 100) or ``organism`` (the model organism's, default 200, with its response cap), scored by
    ``reward`` (default the ``arithmetic`` reward)."""
    task, valid, default_limit = {"arithmetic": (ArithmeticTask, sorted(LEVELS), 100),
                                  "organism": (OrganismTask, list(range(1, MAX_DIFFICULTY + 1)), 200)}[kind]
    if difficulty not in valid:
        raise EvalError(f"benchmark '{kind}-d{difficulty}': the difficulty must be one of {valid}")
    spec = reward or "arithmetic"
    fn = _benchmark_reward(f"'{kind}-d{difficulty}'", spec)
    examples = task(seed=0, difficulty=difficulty, split="test").examples(limit or default_limit)
    return Benchmark(name=f"{kind}_d{difficulty}", source=f"{kind}-d{difficulty}", split="test",
                     examples=examples, reward=spec, reward_fn=fn,
                     max_new_tokens=response_tokens(difficulty) if kind == "organism" else None)


def _reasoning_gym_benchmark(source: str, limit: Optional[int], reward: Optional[str]) -> Benchmark:
    """``reasoning_gym:<name>``: the dataset's held-out problems with its default options (seed
    `TEST_SEED_OFFSET`: those a run with ``train.seed=0`` holds out), ``limit`` of them (default 100), scored by
    its own verifier unless ``reward`` says otherwise."""
    spec = reward or "reasoning_gym"
    fn = _benchmark_reward(repr(source), spec)
    name = reasoning_gym.dataset_name(source)
    examples = reasoning_gym.make_examples(name, seed=reasoning_gym.TEST_SEED_OFFSET, size=limit or 100, split="test")
    return Benchmark(name=slug(source), source=source, split="test", examples=examples, reward=spec,
                     reward_fn=fn)


def load_benchmark(
    source: str,
    *,
    limit: Optional[int] = None,
    data_dir: Optional[str | os.PathLike] = None,
    prompt_key: Optional[str] = None,
    answer_key: Optional[str] = None,
    split: Optional[str] = None,
    reward: Optional[str] = None,
) -> Benchmark:
    """Load and validate one benchmark, and resolve its reward.

    ``source`` is ``reasoning_gym:<name>`` (a reasoning-gym dataset's held-out problems, default 100), one of
    :data:`BENCHMARK_PREFIXES` (``verifiers:<env_id>``: the environment's eval dataset), or
    ``arithmetic`` / ``arithmetic-dN`` (the synthetic task's test split at difficulty
    N, seed 0, ``limit`` problems, default 100), ``organism`` / ``organism-dN`` (the model organism's
    test split, difficulty 3 unless N is given, seed 0, default 200 problems), a named benchmark (``gsm8k``,
    ``math500``, ``aime24``, ``amc``, ``minerva``, ``olympiadbench``, or an alias), read from ``data_dir`` /
    ``$TETHER_DATA_DIR`` / the hub by :func:`tether.tasks.load_examples` with split ``test`` unless ``split`` says
    otherwise; or a ``.jsonl``/``.json``/``.parquet`` file (fields chosen by ``prompt_key`` /
    ``answer_key``), or a hub id. The reward is ``reward`` when given, else
    :func:`tether.tasks.default_reward_name` (``gsm8k`` for GSM8K, ``math`` otherwise).

    Raises:
        DataError: unknown source, missing file, or a malformed row (naming file and row).
        EvalError: an unknown or unimportable reward.
    """
    if str(source).startswith(reasoning_gym.PREFIX):
        return _reasoning_gym_benchmark(str(source), limit, reward)
    for prefix, target in BENCHMARK_PREFIXES.items():
        if str(source).startswith(prefix):
            module, _, function = target.partition(":")
            return getattr(importlib.import_module(module), function)(str(source), limit, reward)
    m = _ARITHMETIC_RE.fullmatch(str(source))
    if m and not Path(str(source)).expanduser().exists():
        return _synthetic_benchmark("arithmetic", int(m.group(1) or 1), limit, reward)
    m = _ORGANISM_RE.fullmatch(str(source))
    if m and not Path(str(source)).expanduser().exists():
        return _synthetic_benchmark("organism", int(m.group(1) or RL_DIFFICULTY), limit, reward)

    named = resolve_dataset_name(str(source))
    is_file = Path(str(source)).expanduser().is_file()
    sp = split if split else ("test" if named is not None and not is_file else None)
    examples = load_examples(source, split=sp, prompt_key=prompt_key, answer_key=answer_key,
                             data_dir=data_dir, limit=limit)
    reward_spec = reward or default_reward_name(str(source))
    fn = _benchmark_reward(repr(source), reward_spec)
    if named is not None and not is_file:
        name = named
    else:
        p = Path(str(source))
        name = p.stem if p.suffix.lower() in (".jsonl", ".json", ".parquet") or is_file else str(source)
    return Benchmark(name=slug(name), source=str(source), split=sp, examples=examples, reward=reward_spec,
                     reward_fn=fn)


def load_benchmarks(sources: Sequence[str], **kwargs) -> list[Benchmark]:
    """:func:`load_benchmark` for each source (all loaded and validated before anything else
    runs), with distinct names (``name``, ``name-2``, ... when two sources share one)."""
    out: list[Benchmark] = []
    seen: dict[str, int] = {}
    for src in sources:
        b = load_benchmark(src, **kwargs)
        if b.name in seen:
            seen[b.name] += 1
            b.name = f"{b.name}-{seen[b.name]}"
        else:
            seen[b.name] = 1
        out.append(b)
    return out
