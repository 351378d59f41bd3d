"""tether.algo: the mathematics of KL-regularized policy gradients, as plain functions on tensors.

Imports nothing but torch. Where to look:

- ``kl.py``           KL estimators (k1..k5, exact, top-k, GRPO, RPG), by name in ``KL_ESTIMATORS``
- ``trust_region.py`` trust regions (ratio, dual, KL3 via Lambert W, TV, binary KL, CISPO, GSPO)
- ``objectives.py``   the loss: surrogate x region + beta x KL, and ``compute_loss``
- ``advantages.py``   GRPO, Dr.GRPO, RLOO, REINFORCE++, RPG baselines
- ``aggregation.py``  token-mean and the sequence-mean modes
- ``correction.py``   rollout correction for a behaviour policy mu != pi_old: TIS, MIS, IcePop, geometric, k1-k3, OPSM
The anchor (fixed / EMA / iterative / reset) lives in ``tether.anchor``; the algorithm's configuration
(``AlgoConfig``), its validation and the named recipes in ``tether.config.recipes``.
"""

from .advantages import ADVANTAGES, compute_advantages, overlong_penalty, zero_variance_groups
from .aggregation import AGGREGATIONS, aggregate
from .kl import KL_ESTIMATORS, KLInputs, KLOptions
from .objectives import SURROGATES, LossInputs, LossNeeds, LossOut, compute_loss, loss_needs, policy_term
from .trust_region import REGIONS, RegionConfig, kl3_bounds, lambert_w

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "KL_ESTIMATORS", "REGIONS", "SURROGATES", "KLInputs", "KLOptions", "LossInputs",
    "LossNeeds", "LossOut", "RegionConfig", "aggregate", "compute_advantages", "compute_loss", "kl3_bounds",
    "lambert_w", "loss_needs", "overlong_penalty", "policy_term", "zero_variance_groups",
]
