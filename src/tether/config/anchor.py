"""``algo.anchor``: which policy the KL term ties to and how it moves, a section chosen by its ``kind``, each kind
with the keys it reads (tether.anchor builds it; tether.algo.anchors registers the kinds). A key another kind reads
is refused by construction (``algo.anchor.kappa`` with ``kind: ema``); ``algo.anchor=ema`` is short for
``algo.anchor.kind=ema``. A section saved by an earlier release (every kind's keys) is read back by
`ANCHOR.mapping` / `ANCHOR.drop_unread`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, model_validator

from ..sections import Section, alone
from .migration import Choice

#: algo.anchor.dtype (kind fixed)
ANCHOR_DTYPES = ("policy", "bfloat16")


class _Kind(Section):
    kind: str
    """the anchor (tether.anchor)"""


class _Every(Section):
    every: int = Field(10, ge=1)
    """update every N trainer steps (one rollout + its update; not optimizer steps; EMA-PG: 10), >= 1"""


class NoAnchorConfig(_Kind):
    """``algo.anchor.kind=none``: no anchor, and no KL term."""

    kind: Literal["none"] = "none"
    """none"""


class FixedAnchorConfig(_Kind):
    """``algo.anchor.kind=fixed``: the initial policy, frozen (GRPO's reference)."""

    kind: Literal["fixed"] = "fixed"
    """fixed"""
    dtype: Literal[ANCHOR_DTYPES] = "policy"
    """the stored anchor's dtype: policy (the policy's) | bfloat16 (an fp32 policy's anchor held at half the bytes,
    upcast for its forward pass only; the anchor is then the bf16-rounded initial policy: tests/test_memory.py bounds
    the change of the KL and its gradient)"""


class EMAAnchorConfig(_Every, _Kind):
    """``algo.anchor.kind=ema``: an exponential moving average of the policy (EMA-PG)."""

    kind: Literal["ema"] = "ema"
    """ema"""
    eta: float = Field(0.95, ge=0, lt=1)
    """theta_a <- eta*theta_a + (1-eta)*theta, 0 <= eta < 1 (EMA-PG: 0.9-0.95)"""


class IterativeAnchorConfig(_Kind):
    """``algo.anchor.kind=iterative``: the sampler pi_old itself (RPG); no copy of its own."""

    kind: Literal["iterative"] = "iterative"
    """iterative"""


class ResetAnchorConfig(_Every, _Kind):
    """``algo.anchor.kind=reset``: a copy of the policy, renewed every N steps."""

    kind: Literal["reset"] = "reset"
    """reset"""


class KLResetAnchorConfig(_Kind):
    """``algo.anchor.kind=kl_reset``: a copy of the policy, renewed when the moving average of the token KL exceeds
    kappa."""

    kind: Literal["kl_reset"] = "kl_reset"
    """kl_reset"""
    kappa: float = Field(0.0, ge=0)
    """reset when the moving average of the token KL exceeds kappa (> 0: the kind needs it set)"""
    kl_smoothing: float = Field(0.9, ge=0, lt=1)
    """the moving average's factor m in kl_ma <- m*kl_ma + (1-m)*kl"""

    @model_validator(mode="after")
    def _kappa_set(self, info: ValidationInfo):
        if not alone(info) and self.kind == "kl_reset" and not self.kappa > 0:
            raise ValueError("anchor 'kl_reset' needs anchor.kappa > 0")
        return self


class OtherAnchorConfig(KLResetAnchorConfig, EMAAnchorConfig, FixedAnchorConfig):
    """An anchor kind registered in tether.algo.anchors.ANCHOR_KINDS by a user: every key, for it to read."""

    kind: str
    """its registered name"""


#: kind -> its section (the kinds tether ships)
ANCHOR_SECTIONS: dict[str, type[Section]] = {
    c.model_fields["kind"].default: c for c in (NoAnchorConfig, FixedAnchorConfig, EMAAnchorConfig,
                                                IterativeAnchorConfig, ResetAnchorConfig, KLResetAnchorConfig)}

#: the keys every anchor carried before each kind had its own section, and their defaults then
_OLD_DEFAULTS = {"eta": 0.95, "every": 10, "kappa": 0.0, "kl_smoothing": 0.9, "dtype": "policy"}


#: algo.anchor, chosen by its kind
ANCHOR = Choice("algo.anchor", ANCHOR_SECTIONS, OtherAnchorConfig, "none", _OLD_DEFAULTS)
AnchorConfig = ANCHOR.type
