"""Benchmark metrics from scored samples: avg@n, pass@k, maj@n (pure Python, no model code).

For a benchmark of ``N`` problems, ``n`` responses are sampled per problem and each is
scored by a reward function (``RewardResult.correct`` is the verdict, ``RewardResult.pred``
the extracted answer). With ``c_i`` the number of correct responses to problem ``i``:

* ``avg@n   = (1/N) sum_i c_i / n`` -- the mean accuracy over all ``N n`` samples (the
  expected accuracy of one sample; ``avg@1`` with greedy decoding is the usual "accuracy");
* ``pass@k  = (1/N) sum_i [1 - C(n - c_i, k) / C(n, k)]`` -- the unbiased estimate of the
  probability that at least one of ``k`` samples is correct (:func:`pass_at_k`, Chen et al.
  2021), for ``k <= n``;
* ``maj@n   = (1/N) sum_i 1[majority answer of problem i is correct]`` -- self-consistency:
  the most frequent extracted answer among the ``n`` samples, equivalent answers pooled
  (:func:`majority_vote`).

:func:`summarize` turns per-problem rows into these numbers plus the mean response length,
the truncation rate and the fraction of responses without an extractable answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from ..errors import EvalError
from ..tasks.math import is_equivalent, norm_str, parse_number

__all__ = ["MajorityVote", "default_ks", "majority_vote", "normalize_answer", "pass_at_k", "summarize"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from ``n`` samples of which ``c`` are correct.

    ``pass@k = 1 - C(n - c, k) / C(n, k)``: the probability that a uniformly random subset
    of ``k`` of the ``n`` samples contains at least one correct sample. Computed in the
    numerically stable product form ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (Chen et al.,
    2021), which never forms the (huge) binomials; it is exactly 1 when ``n - c < k``.

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    n, c, k = int(n), int(c), int(k)
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def default_ks(n: int) -> list[int]:
    """The ``k`` values reported by default for ``n`` samples: the powers of two ``<= n``,
    plus ``n`` itself (``n=4 -> [1, 2, 4]``, ``n=6 -> [1, 2, 4, 6]``, ``n=1 -> [1]``)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks


def check_ks(ks: Optional[Iterable[int]], n: int) -> list[int]:
    if ks is None:
        return default_ks(n)
    out = sorted({int(k) for k in ks})
    if not out:
        raise EvalError("ks must name at least one k")
    bad = [k for k in out if not 1 <= k <= n]
    if bad:
        raise EvalError(f"pass@k needs 1 <= k <= n = {n}; got k = {bad[0]}")
    return out


def normalize_answer(pred: Optional[str]) -> Optional[str]:
    """A canonical string for an extracted answer, used to pool identical answers cheaply
    before the (slower) equivalence check: a plain number becomes its canonical float repr
    (``"1,000"``, ``"1000.0"``, ``"$1000"`` -> ``"1000.0"``); anything else is stripped of
    whitespace, ``$``, ``\\left``/``\\right``, ``\\text{}`` and ``\\dfrac`` spelling (as in
    :func:`tether.tasks.math.is_equivalent`). ``None`` or an empty answer gives ``None``."""
    if pred is None:
        return None
    s = str(pred).strip()
    if not s:
        return None
    v = parse_number(s)
    if v is not None and math.isfinite(v):
        return repr(float(v))
    return norm_str(s) or None


@dataclass
class MajorityVote:
    """The outcome of a majority vote over ``n`` extracted answers.

    Attributes:
        answer: The winning answer (the first occurrence of its cluster); ``None`` only
            when no sample has an answer.
        correct: Whether the winning answer is correct.
        count: Size of the winning cluster (samples whose answers are equivalent to it).
        index: Index of the sample whose answer represents the winner (its first occurrence).
        clusters: Number of distinct (non-equivalent) answers among the samples.
    """

    answer: Optional[str]
    correct: bool
    count: int
    index: int
    clusters: int


def majority_vote(
    preds: Sequence[Optional[str]],
    refs: Optional[Sequence[str] | str] = None,
    *,
    correct: Optional[Sequence[bool]] = None,
    equivalent: Optional[Callable[[str, str], bool]] = None,
) -> MajorityVote:
    """maj@n for one problem: the most frequent answer among ``preds``, and whether it is right.

    Answers are pooled into clusters of equivalent answers: first by
    :func:`normalize_answer` (identical strings / equal plain numbers), then each distinct
    answer joins the first earlier cluster whose representative it is ``equivalent`` to
    (default :func:`tether.tasks.math.is_equivalent`, the check the ``math`` reward uses, so
    ``"0.5"`` and ``"\\frac{1}{2}"`` pool). The winner is the largest cluster; ties go to the
    cluster that occurs first. ``None`` answers (nothing extracted) form no cluster and never
    win, unless every answer is ``None``.

    The winner is scored, in order of preference:

    * against ``refs`` (a reference answer or a list of equivalent forms): correct iff
      ``equivalent(winner, ref)`` for some ref;
    * else with ``correct`` (the per-sample verdicts of the reward): the verdict of the
      sample that represents the winner -- the reward itself is the judge, which is what
      :func:`tether.eval.runner.evaluate` uses, so e.g. the ``gsm8k`` reward's numeric
      comparison applies;
    * else it is not correct.

    When every answer is ``None`` the winner is ``None`` (sample 0), scored by
    ``correct[0]`` when given (a reward that extracts no answers gives no vote to take),
    else incorrect.
    """
    if equivalent is None:
        equivalent = is_equivalent
    if isinstance(refs, str):
        refs = [refs]
    n = len(preds)
    if correct is not None and len(correct) != n:
        raise ValueError(f"majority_vote: {len(correct)} correctness flags for {n} answers")
    if n == 0:
        return MajorityVote(None, False, 0, -1, 0)
    # clusters: [representative answer, representative index, count]
    clusters: list[list[Any]] = []
    by_key: dict[str, int] = {}
    for i, p in enumerate(preds):
        key = normalize_answer(p)
        if key is None:
            continue
        j = by_key.get(key)
        if j is None:
            p = str(p).strip()
            j = next((c for c, cl in enumerate(clusters) if _safe_eq(equivalent, p, cl[0])), None)
            if j is None:
                clusters.append([p, i, 0])
                j = len(clusters) - 1
            by_key[key] = j
        clusters[j][2] += 1
    if not clusters:
        ok = bool(correct[0]) if correct is not None else False
        return MajorityVote(None, ok, n, 0, 0)
    best = max(range(len(clusters)), key=lambda c: (clusters[c][2], -clusters[c][1]))
    answer, index, count = clusters[best]
    if refs:
        ok = any(_safe_eq(equivalent, answer, str(r)) for r in refs)
    elif correct is not None:
        ok = bool(correct[index])
    else:
        ok = False
    return MajorityVote(answer, bool(ok), int(count), int(index), len(clusters))


def _safe_eq(eq: Callable[[str, str], bool], a: str, b: str) -> bool:
    try:
        return bool(eq(a, b))
    except Exception:
        return False


def summarize(per_problem: Sequence[Mapping], n: int, ks: Optional[Iterable[int]] = None) -> dict[str, float]:
    """Benchmark metrics from per-problem rows (``correct``, ``lengths``, ``finish_reasons``,
    ``preds``, ``rewards``, ``maj_correct``), each with ``n`` samples:

    ``avg@n = mean over all samples of correct``; ``pass@k = mean_i pass_at_k(n, c_i, k)``;
    ``maj@n = mean_i maj_correct_i``; ``mean_response_tokens = mean length``;
    ``truncation_rate = fraction of finish_reason == "length"``; ``no_answer_rate =
    fraction of preds that are None``; ``reward_mean = mean reward``.
    """
    ks = check_ks(ks, n)
    rows = list(per_problem)
    N = len(rows)
    flat = [bool(x) for r in rows for x in r["correct"]]
    lengths = [int(x) for r in rows for x in r["lengths"]]
    reasons = [x for r in rows for x in r["finish_reasons"]]
    preds = [x for r in rows for x in r["preds"]]
    rewards = [float(x) for r in rows for x in r.get("rewards", r["correct"])]
    mean = lambda xs: float(sum(xs) / len(xs)) if xs else float("nan")  # noqa: E731
    m: dict[str, float] = {f"avg@{n}": mean([float(x) for x in flat])}
    for k in ks:
        m[f"pass@{k}"] = mean([pass_at_k(n, sum(bool(x) for x in r["correct"]), k) for r in rows])
    m[f"maj@{n}"] = mean([float(bool(r["maj_correct"])) for r in rows])
    m["mean_response_tokens"] = mean([float(x) for x in lengths])
    m["truncation_rate"] = mean([float(x == "length") for x in reasons])
    m["no_answer_rate"] = mean([float(p is None) for p in preds])
    m["reward_mean"] = mean(rewards)
    m["n_problems"] = N
    m["n_samples"] = n
    m["n_responses"] = len(flat)
    return m

