"""Reward functions, loading them by name or ``module:function``, and calling them safely.

A reward function has the signature ``fn(completion: str, example: Example)`` and returns a
:class:`~tether.tasks.base.RewardResult`, a float or a bool. The trainer never calls it
directly but through :func:`score_responses` / :func:`call_reward`, which normalize the return
value and turn an exception, or a value that is not a finite number (a string, None, NaN, a
tuple, ...), into reward 0 plus an error, so one bad completion cannot stop training. A user
reward that may hang runs in a worker process with a time limit per call
(:mod:`tether.tasks.reward_worker`).

A reward spec that cannot be loaded (an unknown name, a module that is not found, raises or
has a syntax error on import, a missing function) is a :class:`~tether.errors.RewardError`
naming the spec and the cause (:func:`tether.algo.registry.load_object` loads a user's reward).

Built-in rewards (registered in :data:`REWARDS`; see :func:`load_reward`):

``"math"``
    :func:`~tether.tasks.math.extract_answer` on the completion, then
    :func:`~tether.tasks.math.is_equivalent` against the reference (math-verify). When the
    example carries several equivalent reference forms in ``meta["answers"]`` any of them
    counts.
``"gsm8k"``
    The extracted answer is compared numerically with the number after ``####`` in the
    reference (:func:`~tether.tasks.math.gsm8k_reference`).
``"arithmetic"``
    The extracted answer must be exactly the reference integer (``"12.0"`` and ``"1,234"``
    are accepted spellings of 12 and 1234; ``"12.5"`` never equals 12).
``"search"``, ``"search_f1"``
    The search agent's exact match / token F1 of the last ``<answer>`` (:mod:`tether.tasks.qa_reward`).
``"none"``
    0 and never correct: no text reward, an environment's step rewards are the whole reward (the skyrl-gym
    environments', `tether.envs.skyrl_gym`).
``"reasoning_gym"``
    A reasoning-gym dataset's own verifier on the last ``<answer>`` (:mod:`tether.tasks.reasoning_gym`): its
    score in [0, 1], correct when 1.

For ``gsm8k`` and ``arithmetic`` an extracted answer that is not a number by itself
(``The final answer is 8 + 4 = 12 pencils.`` gives ``8 + 4 = 12 pencils``) is reduced to its
last number (``12``).

Format bonus: with ``format_weight = w`` (default 0) every built-in reward becomes::

    reward = float(correct) + w * float(has_answer_format(completion))

where :func:`~tether.tasks.math.has_answer_format` is true when the completion states exactly one
final answer: a complete ``\\boxed{...}``, or ``####`` followed by a number on the same line, or a
line starting with ``Answer:`` / ``Final answer:`` (a list of ``####`` lines is not the format).
``correct`` (the accuracy metric) is not affected by the bonus.
"""

from __future__ import annotations

import math
import numbers
import reprlib
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..algo.registry import Registry, load_object
from ..errors import RewardError
from .base import Example, RewardFn, RewardResult
from .math import extract_answer, gsm8k_reference, has_answer_format, is_equivalent, last_number, parse_number
from .qa_reward import SearchReward, search_reward
from .reasoning_gym import reasoning_gym_reward

__all__ = [
    "math_reward",
    "gsm8k_reward",
    "arithmetic_reward",
    "BUILTIN_REWARDS",
    "REWARDS",
    "FormatBonusReward",
    "load_reward",
    "is_builtin_reward",
    "call_reward",
    "RewardFailure",
    "score_one",
    "score_responses",
    "normalize_reward_output",
    "reference_answers",
]


def reference_answers(example: Example) -> list[str]:
    """All accepted reference forms of ``example``: ``example.answer`` followed by any extra
    equivalent forms in ``example.meta["answers"]`` (duplicates removed, order kept)."""
    refs = [example.answer]
    extra = example.meta.get("answers") if isinstance(example.meta, dict) else None
    if isinstance(extra, (list, tuple)):
        refs.extend(str(a) for a in extra)
    seen: set[str] = set()
    out = []
    for r in refs:
        r = str(r).strip()
        if r and r not in seen:
            seen.add(r)
            out.append(r)
    return out


def math_reward(completion: str, example: Example) -> RewardResult:
    """1.0 if the answer extracted from ``completion`` is mathematically equivalent
    (math-verify) to any reference form of ``example``, else 0.0."""
    pred = extract_answer(completion)
    correct = pred is not None and any(is_equivalent(pred, ref) for ref in reference_answers(example))
    return RewardResult(reward=float(correct), correct=bool(correct), pred=pred)


def gsm8k_reward(completion: str, example: Example) -> RewardResult:
    """1.0 if the answer extracted from ``completion`` equals (numerically, relative
    tolerance 1e-6) the number after ``####`` in ``example.answer`` (or the answer itself when
    it has no ``####``), else 0.0."""
    pred = _numeric_pred(extract_answer(completion))
    ref = gsm8k_reference(example.answer)
    correct = False
    if pred is not None:
        a, b = parse_number(pred), parse_number(ref)
        if a is not None and b is not None:
            correct = math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
        else:
            correct = is_equivalent(pred, ref)
    return RewardResult(reward=float(correct), correct=bool(correct), pred=pred)


def _numeric_pred(pred: str | None) -> str | None:
    """For numeric rewards: an extracted answer that is not itself a number (``"8 + 4 = 12
    pencils"``) is replaced by its last number (``"12"``)."""
    if pred is None or parse_number(pred) is not None:
        return pred
    return last_number(pred) or pred


def _as_int(s: str | None) -> int | None:
    if s is None:
        return None
    v = parse_number(s)
    if v is None or not math.isfinite(v) or not float(v).is_integer():
        return None
    # parse_number goes through float; re-parse plain integers exactly to avoid rounding
    t = s.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return int(t)
    except ValueError:
        return int(v)


def arithmetic_reward(completion: str, example: Example) -> RewardResult:
    """1.0 if the answer extracted from ``completion`` is exactly the integer
    ``example.answer``, else 0.0."""
    pred = _numeric_pred(extract_answer(completion))
    ref = _as_int(example.answer)
    got = _as_int(pred)
    correct = ref is not None and got is not None and got == ref
    return RewardResult(reward=float(correct), correct=bool(correct), pred=pred)


@dataclass
class FormatBonusReward:
    """A reward function plus a format bonus (picklable when ``fn`` is importable).

    ``reward = base.reward + format_weight * has_answer_format(completion)``; ``correct`` and
    ``pred`` come from the base reward unchanged.
    """

    fn: RewardFn
    format_weight: float = 0.0
    name: str = ""

    def __call__(self, completion: str, example: Example) -> RewardResult:
        """Score ``completion``: the base reward plus the weighted format bonus."""
        return self.add_bonus(normalize_reward_output(self.fn(completion, example)), completion)

    def add_bonus(self, base: RewardResult, completion: str) -> RewardResult:
        """``base`` (the normalized result of ``fn``) plus the weighted format bonus."""
        bonus = self.format_weight * float(has_answer_format(completion)) if self.format_weight else 0.0
        return RewardResult(reward=base.reward + bonus, correct=base.correct, pred=base.pred)


#: Every built-in reward by name (``data.reward``, ``tether eval --reward``). A reward registered with
#: ``weighted`` builds its own scorer for a ``format_weight`` (the search rewards: exact match or token
#: F1 of the last ``<answer>``, ``format_weight`` being a floor for a wrong but well-formed final answer,
#: :mod:`tether.tasks.qa_reward`); the others get :class:`FormatBonusReward`'s bonus.
REWARDS: Registry[RewardFn] = Registry("reward", defaults={"weighted": None}, error=RewardError)
REWARDS.register("arithmetic")(arithmetic_reward)
REWARDS.register("gsm8k")(gsm8k_reward)
REWARDS.register("math")(math_reward)
REWARDS.register("search", weighted=lambda w: SearchReward("em", format_weight=w))(search_reward)
REWARDS.register("search_f1", weighted=lambda w: SearchReward("f1", format_weight=w))(SearchReward("f1"))
REWARDS.register("reasoning_gym")(reasoning_gym_reward)
REWARDS.register("none")(lambda completion, example: RewardResult(reward=0.0, correct=False))
BUILTIN_REWARDS = REWARDS  # its former name


def _valid_choices() -> str:
    return ", ".join(sorted(REWARDS)) + ", or 'module:function' / 'path/to/file.py:function'"


def is_builtin_reward(spec: str) -> bool:
    """Whether ``spec`` names one of tether's own rewards (``auto`` always resolves to one), as
    opposed to a user reward ``module:function`` / ``path/to/file.py:function``."""
    return isinstance(spec, str) and ":" not in spec


def load_reward(spec: str | Callable, format_weight: float = 0.0) -> RewardFn:
    """Resolve a reward specification to a reward function.

    Args:
        spec: ``"math"``, ``"gsm8k"`` or ``"arithmetic"`` (see the module docstring), a user
            reward ``"package.module:function"`` (imported with :mod:`importlib`; dotted
            attributes such as ``module:Class.method`` work) or ``"path/to/file.py:function"``
            (a file path, relative to the working directory), or a callable (returned as is).
        format_weight: Weight of the format bonus (default 0, no bonus). With ``w != 0`` the
            result returns ``reward = base_reward + w * has_answer_format(completion)``; for the
            built-in rewards ``base_reward = float(correct)``.

    Raises:
        RewardError: (a ``ValueError``) unknown name (the message lists the valid choices), or
            a module / file / function that cannot be loaded; the message names the spec and
            the cause (for a syntax error: the file and line; for an exception raised while
            importing: its type, message and where it was raised).
    """
    if callable(spec):
        fn = spec
        name = getattr(spec, "__name__", repr(spec))
    else:
        if not isinstance(spec, str) or not spec.strip():
            raise RewardError(f"reward must be a non-empty string; choose one of: {_valid_choices()}")
        name = spec.strip()
        weighted = REWARDS.meta(name)["weighted"] if name in REWARDS else None
        if weighted is not None:
            return weighted(float(format_weight or 0.0))
        if name in REWARDS:
            fn = REWARDS[name]
        elif ":" in name:
            fn = load_object(name, "reward", RewardError)
        else:
            raise RewardError(f"unknown reward {name!r}; choose one of: {_valid_choices()}")
    w = float(format_weight or 0.0)
    if not math.isfinite(w):
        raise RewardError(f"format_weight must be finite, got {format_weight!r}")
    if w == 0.0:
        return fn
    return FormatBonusReward(fn=fn, format_weight=w, name=name)


def normalize_reward_output(out: Any) -> RewardResult:
    """Convert what a reward function returned into a :class:`RewardResult`.

    * ``RewardResult``: returned with ``reward`` as float, ``correct`` as bool;
    * ``bool``: reward 1.0 / 0.0, ``correct`` = the bool;
    * a real number (Python, NumPy, or a one-element tensor/array via ``.item()``):
      ``reward`` = the number, ``correct = reward > 0``.

    Raises:
        TypeError: for any other type.
        ValueError: when the reward is NaN or infinite.
    """
    if isinstance(out, RewardResult):
        reward = _to_float(out.reward)
        pred = None if out.pred is None else str(out.pred)
        res = RewardResult(reward=reward, correct=bool(out.correct), pred=pred)
    elif isinstance(out, bool) or type(out).__name__ == "bool_":
        res = RewardResult(reward=float(bool(out)), correct=bool(out), pred=None)
    else:
        reward = _to_float(out)
        res = RewardResult(reward=reward, correct=reward > 0, pred=None)
    if not math.isfinite(res.reward):
        raise ValueError(f"reward function returned a non-finite reward: {res.reward!r}")
    return res


def _to_float(x: Any) -> float:
    if isinstance(x, numbers.Real):
        return float(x)
    item = getattr(x, "item", None)
    if callable(item):
        try:
            v = item()
        except Exception:
            v = None
        if isinstance(v, numbers.Real):
            return float(v)
    raise TypeError(
        f"reward function returned {type(x).__name__} ({short_repr(x)}); expected RewardResult, float or bool"
    )


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def short_repr(x: Any) -> str:
    """``repr(x)`` cut to about 80 characters (a repr that raises is reported as such)."""
    try:
        return _REPR.repr(x)
    except Exception as e:
        return f"<{type(x).__name__} whose repr raised {type(e).__name__}>"


@dataclass
class RewardFailure:
    """Why one reward call scored 0: ``kind`` is ``"raised"`` (``detail``: the traceback),
    ``"invalid"`` (the return value was not a finite number; ``detail`` says what it was, its
    repr cut to about 80 characters), ``"timeout"`` (``detail``: the limit) or ``"crashed"``
    (the worker process died during the call; or, once it died during several calls in a row,
    the call was not made: ``tether.tasks.reward_worker.MAX_CRASHES_IN_A_ROW``)."""

    example_id: str
    kind: str
    detail: str

    #: how each kind reads in a log line
    WHAT = {"raised": "the reward function raised", "invalid": "the reward function returned an invalid value",
            "timeout": "the reward function timed out", "crashed": "the reward worker process died"}

    def __str__(self) -> str:
        return f"{self.WHAT.get(self.kind, self.kind)} on example {self.example_id}: {self.detail}"


def score_one(fn: RewardFn, completion: str, example: Example) -> tuple[RewardResult, Optional[RewardFailure]]:
    """Call ``fn(completion, example)``: ``(normalized result, None)``, or ``(reward 0, the
    failure)`` when it raises or returns something that is not a finite number.
    ``KeyboardInterrupt`` and ``SystemExit`` are not caught."""
    base = fn.fn if isinstance(fn, FormatBonusReward) else fn  # the user's function, then the bonus
    try:
        out = base(completion, example)
    except Exception:
        return RewardResult(0.0, False, None), RewardFailure(str(example.id), "raised", traceback.format_exc())
    try:
        res = normalize_reward_output(out)
    except Exception as e:  # TypeError / ValueError, or a value whose float() or bool() raises
        name, got = getattr(base, "__name__", type(base).__name__), short_repr(out)
        detail = f"reward {name}: {e}" + ("" if got in str(e) else f" (got {got})")
        return RewardResult(0.0, False, None), RewardFailure(str(example.id), "invalid", detail)
    return (fn.add_bonus(res, completion) if base is not fn else res), None


def call_reward(fn: RewardFn, completion: str, example: Example) -> tuple[RewardResult, str | None]:
    """Call ``fn(completion, example)`` safely.

    Returns ``(result, error)``. On success ``error`` is None and ``result`` is the normalized
    return value (see :func:`normalize_reward_output`). If ``fn`` raises, returns a bad type,
    or a non-finite reward, ``result`` is ``RewardResult(0.0, False, None)`` and ``error`` is
    the formatted traceback (or a one-line message for a non-finite / bad-type return) so the
    caller can count errors, log the first one, and keep going. ``KeyboardInterrupt`` and
    ``SystemExit`` are not caught.
    """
    res, failure = score_one(fn, completion, example)
    return res, None if failure is None else failure.detail


def score_responses(fn: RewardFn, texts: Sequence[str], examples: Sequence[Example]
                    ) -> tuple[list[float], list[bool], list[RewardFailure]]:
    """Score each response against its example (:func:`score_one`), in this process.

    Returns ``(rewards, correct, failures)``: one reward and correctness per response, and a
    :class:`RewardFailure` (naming the example) for each call that failed; those score 0.
    """
    rewards, correct, failures = [], [], []
    for text, ex in zip(texts, examples):
        res, failure = score_one(fn, text, ex)
        rewards.append(res.reward)
        correct.append(bool(res.correct))
        if failure is not None:
            failures.append(failure)
    return rewards, correct, failures
