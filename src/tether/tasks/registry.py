"""The task registry: where a run's training prompts come from, by name.

A task is a builder that returns the examples of a finite dataset (a list of
:class:`~tether.tasks.base.Example`) or, for a generated task, ``generate(i) -> Example``;
``tether.tasks.stream.prompt_stream`` turns either into the trainer's ``PromptStream``. A task is given
the sections it reads, not the whole config: its builder and its functions below name them as parameters
(`call_task`): ``data`` (the run's data section), ``seed`` (train.seed), ``env`` (rollout.agent.env; None
for a single-turn agent): ``def countdown(data)``, ``def generated(data, seed)``. Each is registered in
:data:`TASKS` with what it needs:

``reward``     the reward that fits it (``data.reward=auto``): a name or spec, or ``reward(data)``;
               None: ``math``
``prefix``     ``data.task`` values starting with it pick this task (``reasoning_gym:``), before a user's
               ``module:function``
``env``        the environment whose episodes read it (then ``rollout.agent.env.name`` picks it, and
               ``data.task`` names its dataset), or a prefix ending in ``:`` of its names (``verifiers:``);
               None: it is picked by ``data.task``
``ignores``    the ``data.*`` keys of its section it has no use for (setting one is a config error; which keys
               each kind of ``data.task`` has is its section's, `tether.config.data`: an environment's task
               and a user's registered one name here those it does not read) and ``about``, how such an
               error names it (default: "only applies to data.task=...")
``check``      ``check(data) -> list[str]``: problems of its own settings
``held_out``   ``{data.task: benchmark}`` or ``held_out(data) -> benchmark``: the held-out set
               ``eval.benchmarks=auto`` evaluates on
``test_set``   ``test_set(data, limit) -> (examples, reward)`` (with ``seed`` or ``env`` if it reads them): the
               benchmark named like the task
``preset``     the settings ``tether train --task NAME`` brings (None: no such option)

``data.task`` picks the task: a user's ``module:function`` / ``path/to/file.py:function`` (the
function is the builder; metadata are its attributes of the same names), else the task registered
for the environment ``rollout.agent.env.name``, else a registered task of that name, else ``math``
(files, named datasets and hub ids).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Optional

from ..algo.registry import Registry, is_spec
from ..config.agent import env_name, env_of
from ..config.data import ArithmeticDataConfig, OrganismDataConfig
from ..sections import default
from . import reasoning_gym
from .arithmetic import ArithmeticTask
from .base import DataError
from .data import default_reward_name, load_examples
from .organism import OrganismTask
from .organism_problems import RL_DIFFICULTY, response_tokens
from .rewards import load_reward

TASKS: Registry[Callable[..., Any]] = Registry("task", error=DataError, defaults={
    "reward": None, "prefix": None, "env": None, "ignores": (), "about": None, "check": None,
    "held_out": {}, "test_set": None, "preset": None})


def call_task(fn: Callable[..., Any], cfg, **extra: Any) -> Any:
    """``fn``, a task's builder or one of its functions (``reward``, ``check``, ``held_out``, ``test_set``), called
    with the parts of ``cfg`` its parameters name: ``data`` (the data section), ``seed`` (train.seed), ``env``
    (rollout.agent.env, None for a single-turn agent), and ``extra`` (test_set's ``limit``); a ``**kwargs`` gets
    them all. An earlier release's form, ``task(cfg)`` / ``test_set(cfg, limit)`` (whatever it calls the config: a
    first parameter, and none naming a section), is called ``fn(cfg, *extra)``, with a FutureWarning; in the new
    form, a parameter that names none of them (and has no default) is a DataError naming the function."""
    given = {"data": cfg.data, "seed": cfg.train.seed, "env": env_of(cfg), **extra}
    code = getattr(fn, "__code__", None)
    where = getattr(fn, "__qualname__", repr(fn)) + (f" ({code.co_filename}:{code.co_firstlineno})" if code else "")
    params = inspect.signature(fn).parameters
    first = next((p for p in params.values() if p.kind is not p.KEYWORD_ONLY), None)  # the config, in that form
    if first is not None and first.name not in given and not set(params) & {"data", "seed", "env"} and \
            all(p.kind is not p.VAR_KEYWORD for p in params.values()):
        warnings.warn(f"task function {where}: a task given the whole config is deprecated; name the "
                      f"sections it reads as its parameters instead (data, seed, env; docs/extending.md)",
                      FutureWarning, stacklevel=2)
        return fn(cfg, *extra.values())
    kw, unknown = {}, []
    for p in params.values():
        if p.kind is p.VAR_KEYWORD:
            kw = given | kw
        elif p.name in given and p.kind is not p.POSITIONAL_ONLY:
            kw[p.name] = given[p.name]
        elif p.default is p.empty and p.kind is not p.VAR_POSITIONAL:
            unknown.append(p.name)
    if unknown:
        raise DataError(f"task function {where}: parameter {', '.join(map(repr, unknown))} names nothing a task is "
                        f"given; it may name: {', '.join(given)} (docs/extending.md)")
    return fn(**kw)


def _difficulty(data, section: type) -> int:
    """``data.difficulty`` when the run trains on ``section``'s task, else that key's default: the held-out set of a
    generated task evaluated beside another task (``eval.benchmarks=[arithmetic]`` while training on a file)."""
    return data.difficulty if isinstance(data, section) else default(section, "difficulty")


def _arithmetic_test_set(data, seed: int, limit: int):
    """The synthetic task's test split (never trained on), with its reward."""
    task = ArithmeticTask(seed=seed, difficulty=_difficulty(data, ArithmeticDataConfig), split="test")
    return task.examples(limit), load_reward("arithmetic")


@TASKS.register("arithmetic", reward="arithmetic", about="the synthetic arithmetic task (an endless seeded stream)",
                ignores=("limit", "shuffle"), held_out={"arithmetic": "arithmetic"}, test_set=_arithmetic_test_set)
def arithmetic_task(data, seed: int) -> Callable[[int], Any]:
    """The seeded synthetic arithmetic task (``data.difficulty`` steps per problem): an endless stream."""
    return ArithmeticTask(seed=seed, difficulty=data.difficulty, split="train").example


#: ``tether train --task organism``: the organism's RL regime (docs/organism.md): difficulty 3, 200 steps of 6 prompts
#: x 8 samples at lr 3e-5 (on an earlier build, 1e-4 made it worse: 10 -> 1.5 % in 100 steps, seed 0); held-out greedy
#: accuracy on 200 test problems every 25 steps
ORGANISM_PRESET = {"model.name": "organism", "data.task": "organism", "data.difficulty": RL_DIFFICULTY,
                   "train.steps": 200, "train.lr": 3e-5, "rollout.max_new_tokens": response_tokens(RL_DIFFICULTY),
                   "rollout.temperature": 1.0, "eval.limit": 200, "eval.every": 25,
                   "eval.max_new_tokens": response_tokens(RL_DIFFICULTY),
                   "run.save_every": 50}


def _organism_test_set(data, limit: int):
    """The organism task's test split (never trained on) at ``data.difficulty``, with its reward."""
    return (OrganismTask(seed=0, difficulty=_difficulty(data, OrganismDataConfig), split="test").examples(limit),
            load_reward("arithmetic"))


@TASKS.register("organism", reward="arithmetic", about="the model organism's task (docs/organism.md)",
                ignores=("limit", "shuffle"), held_out={"organism": "organism"}, test_set=_organism_test_set,
                preset=ORGANISM_PRESET)
def organism_task(data, seed: int) -> Callable[[int], Any]:
    """The model organism's problems (``data.difficulty`` operations each; use 3, where it starts weak):
    an endless seeded stream."""
    return OrganismTask(seed=seed, difficulty=data.difficulty, split="train").example


def _dataset_reward(data) -> str:
    return default_reward_name(data.task)


@TASKS.register("math", reward=_dataset_reward, held_out={"gsm8k": "gsm8k"}, preset={})
def dataset_task(data) -> list:
    """Single-turn math: ``data.task`` is a named dataset (GSM8K, MATH-500, ...), a .jsonl/.json/.parquet
    file or a hub id (``tether.tasks.data.load_examples``); every row is validated here."""
    return load_examples(data.task, split=data.split, prompt_key=data.prompt_key, answer_key=data.answer_key,
                         data_dir=data.data_dir, limit=data.limit or None)


def _reasoning_gym_test_set(data, seed: int, limit: int):
    """A reasoning-gym task's held-out problems: its dataset at train.seed + TEST_SEED_OFFSET, ``limit`` of them."""
    seed, _, opts = reasoning_gym.split_options(data.options, seed, reasoning_gym.DEFAULT_SIZE)
    name = reasoning_gym.dataset_name(data.task)
    return (reasoning_gym.make_examples(name, seed=seed + reasoning_gym.TEST_SEED_OFFSET, size=limit, options=opts,
                                        split="test"), load_reward("reasoning_gym"))


@TASKS.register("reasoning_gym", reward="reasoning_gym", prefix=reasoning_gym.PREFIX,
                held_out=lambda data: data.task, test_set=_reasoning_gym_test_set)
def reasoning_gym_task(data, seed: int) -> list:
    """A reasoning-gym dataset (``data.task=reasoning_gym:<name>``): ``data.options`` are its size (default
    1000), seed (default train.seed) and its own difficulty options (`tether.tasks.reasoning_gym`)."""
    seed, size, opts = reasoning_gym.split_options(data.options, seed, reasoning_gym.DEFAULT_SIZE)
    examples = reasoning_gym.make_examples(reasoning_gym.dataset_name(data.task), seed=seed, size=size, options=opts)
    return examples[:data.limit] if data.limit else examples


def task_name(cfg) -> Optional[str]:
    """The registered task ``cfg`` trains on (None: ``data.task`` is a user's ``module:function``)."""
    task = cfg.data.task
    for name in TASKS:
        prefix = TASKS.meta(name)["prefix"]
        if prefix and task.startswith(prefix):
            return name
    if is_spec(task):
        return None
    env = env_name(cfg)
    for name in TASKS if env is not None else ():
        want = TASKS.meta(name)["env"]  # an environment's name, or a prefix of its names (``verifiers:``)
        if want is not None and (env == want or (want.endswith(":") and env.startswith(want))):
            return name
    if task in TASKS and TASKS.meta(task)["env"] is None:
        return task
    return "math"


def resolve_task(cfg) -> tuple[Callable[..., Any], dict[str, Any]]:
    """``(builder, metadata)`` of the task ``cfg`` trains on (a user's task is imported here)."""
    name = task_name(cfg)
    return TASKS.resolve(cfg.data.task if name is None else name)


def held_out_benchmark(cfg) -> Optional[str]:
    """The held-out benchmark of the training task (``eval.benchmarks=auto``), None if it has none."""
    name = task_name(cfg)
    if name is None:
        return None
    held_out = TASKS.meta(name)["held_out"]
    return call_task(held_out, cfg) if callable(held_out) else held_out.get(cfg.data.task)


def task_presets() -> dict[str, dict[str, Any]]:
    """``tether train --task NAME``: the settings each task with a preset brings."""
    return {n: dict(TASKS.meta(n)["preset"]) for n in TASKS if TASKS.meta(n)["preset"] is not None}
