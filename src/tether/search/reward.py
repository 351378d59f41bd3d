"""The search agent's exact-match / F1 reward: defined in :mod:`tether.tasks.qa_reward` (beside the
other rewards, which register it as ``search`` and ``search_f1``), re-exported here."""

from ..tasks import qa_reward as _qa
from ..tasks.qa_reward import *  # noqa: F403  (the names of _qa.__all__)

__all__ = list(_qa.__all__)
