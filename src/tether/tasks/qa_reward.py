"""Exact-match / F1 reward for QA with a search agent (Search-R1 style), scored on the response only.

It lives in ``tether.tasks`` (it needs nothing but ``tether.tasks.base``) so that the reward registry
(``tether.tasks.rewards.REWARDS``: ``search``, ``search_f1``) imports it plainly; ``tether.search.reward``
re-exports it.

Scoring one response against the golden answers (a list: aliases all count):

1. Every observation block ``<information>...</information>`` is removed first (an unclosed
   trailing ``<information>`` is removed to the end), so text the *environment* inserted,
   retrieved passages included, can never be taken as the model's answer.
2. The predicted answer is the content of the **last** ``<answer>...</answer>`` left. No such
   pair: ``answered=False``, EM = F1 = 0.
3. Answers are SQuAD-normalized (:func:`normalize_answer`: lower-case, punctuation removed,
   the articles a/an/the removed, whitespace collapsed). ``em`` is 1 when the prediction
   equals any normalized golden answer; ``f1`` is the best token-level F1 over the golden
   answers (SQuAD's rule: the bag-of-tokens overlap; yes/no/noanswer must match exactly).
4. ``reward`` is the chosen metric (``"em"``, the default and Search-R1's, or ``"f1"``). The
   optional format reward ``format_weight`` (default 0) is a floor, never a bonus on top of a
   correct answer: a response whose metric is 0 but which ends in a well-formed final answer
   (a non-empty last ``<answer>...</answer>`` with only whitespace after it) gets
   ``format_weight``; this is Search-R1's ``format_score`` behaviour, so a correct answer
   always scores exactly the metric.

Deliberate difference from Search-R1's code: Search-R1 (``verl/utils/reward_score/qa_em.py``,
``extract_solution``) searches the decoded prompt **and** response together for
``<answer>...</answer>``, returns nothing when it finds fewer than two matches (the first one is
assumed to be the instruction's example ``<answer> Beijing </answer>``) and otherwise takes the
last one. That ties the score to the prompt's text: with a prompt holding no example, a
response's single real answer is never scored; with a prompt holding two examples (or a
retrieved passage or an observation containing ``<answer>``), a rollout that never answers is
scored from text the model did not write. tether scores only the response (the ``completion``
argument: the generated turns and the observations between them, never the prompt), ignores
``<information>`` blocks, and one ``<answer>`` in the response is enough.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from .base import Example, RewardResult

__all__ = [
    "normalize_answer",
    "exact_match",
    "token_f1",
    "strip_observations",
    "extract_answer",
    "has_final_answer",
    "SearchRewardResult",
    "score_response",
    "SearchReward",
    "search_reward",
    "golden_answers",
]

_INFO_RE = re.compile(r"<information>.*?(?:</information>|\Z)", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lower-case, drop punctuation, drop articles, collapse whitespace."""
    s = str(s).lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES_RE.sub(" ", s)
    return " ".join(s.split())


def exact_match(prediction: str, golden: Iterable[str]) -> bool:
    """True when the normalized prediction equals any normalized golden answer."""
    p = normalize_answer(prediction)
    return any(p == normalize_answer(g) for g in golden)


def _f1(prediction: str, truth: str) -> float:
    p, t = normalize_answer(prediction), normalize_answer(truth)
    special = ("yes", "no", "noanswer")
    if (p in special or t in special) and p != t:
        return 0.0
    pt, tt = p.split(), t.split()
    common = Counter(pt) & Counter(tt)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pt), same / len(tt)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, golden: Iterable[str]) -> float:
    """Best SQuAD token F1 of the prediction over the golden answers (0.0 for none)."""
    return max((_f1(prediction, g) for g in golden), default=0.0)


def strip_observations(text: str) -> str:
    """``text`` with every ``<information>...</information>`` block (and an unclosed trailing
    one) removed."""
    return _INFO_RE.sub("", text)


def extract_answer(response: str) -> Optional[str]:
    """Content (stripped) of the last ``<answer>...</answer>`` outside observation blocks, or
    None when there is none."""
    found = _ANSWER_RE.findall(strip_observations(response))
    return found[-1].strip() if found else None


def has_final_answer(response: str) -> bool:
    """The format check: the response (observations removed) ends with a non-empty
    ``<answer>...</answer>`` followed by nothing but whitespace."""
    text = strip_observations(response).rstrip()
    last = None
    for last in _ANSWER_RE.finditer(text):
        pass
    return last is not None and last.end() == len(text) and bool(last.group(1).strip())


@dataclass
class SearchRewardResult(RewardResult):
    """A :class:`~tether.tasks.base.RewardResult` (``reward``, ``correct`` = EM, ``pred``)
    plus ``em`` (0/1), ``f1`` and ``answered`` (an ``<answer>`` was found)."""

    em: float = 0.0
    f1: float = 0.0
    answered: bool = False


def score_response(
    response: str, golden: Sequence[str], *, metric: str = "em", format_weight: float = 0.0
) -> SearchRewardResult:
    """Score one response against the golden answers (see the module docstring)."""
    if metric not in ("em", "f1"):
        raise ValueError(f"metric must be 'em' or 'f1', got {metric!r}")
    golden = [str(g) for g in golden]
    pred = extract_answer(response)
    if pred is None:
        return SearchRewardResult(0.0, False, None, em=0.0, f1=0.0, answered=False)
    em = 1.0 if exact_match(pred, golden) else 0.0
    f1 = token_f1(pred, golden)
    value = em if metric == "em" else f1
    if value <= 0.0 and format_weight and has_final_answer(response):
        value = float(format_weight)
    return SearchRewardResult(float(value), bool(em), pred, em=em, f1=f1, answered=True)


def golden_answers(example: Example) -> list[str]:
    """The golden answers of an example: ``meta["golden_answers"]`` when present (the search
    datasets put the full alias list there), else ``example.answer`` plus ``meta["answers"]``."""
    meta = example.meta if isinstance(example.meta, dict) else {}
    g = meta.get("golden_answers")
    if isinstance(g, (list, tuple)) and g:
        return [str(a) for a in g]
    out = [example.answer]
    extra = meta.get("answers")
    if isinstance(extra, (list, tuple)):
        out.extend(str(a) for a in extra if str(a) not in out)
    return out


class SearchReward:
    """A tether reward function ``fn(completion, example) -> SearchRewardResult``.

    Args:
        metric: ``"em"`` (default) or ``"f1"``: what ``reward`` is.
        format_weight: Reward floor for a wrong but well-formed final answer (default 0).
    """

    def __init__(self, metric: str = "em", format_weight: float = 0.0):
        if metric not in ("em", "f1"):
            raise ValueError(f"metric must be 'em' or 'f1', got {metric!r}")
        self.metric = metric
        self.format_weight = float(format_weight)

    def __call__(self, completion: str, example: Example) -> SearchRewardResult:
        return score_response(completion, golden_answers(example), metric=self.metric,
                              format_weight=self.format_weight)

    def __repr__(self) -> str:
        return f"SearchReward(metric={self.metric!r}, format_weight={self.format_weight})"


#: The default search reward: exact match, no format reward.
search_reward = SearchReward()
