"""The search agent's exact-match / F1 reward: defined in :mod:`tether.tasks.qa_reward` (beside the
other rewards, which register it as ``search`` and ``search_f1``), re-exported here."""

from ..tasks.qa_reward import (
    SearchReward,
    SearchRewardResult,
    exact_match,
    extract_answer,
    golden_answers,
    has_final_answer,
    normalize_answer,
    score_response,
    search_reward,
    strip_observations,
    token_f1,
)

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
