"""``algo.region``: the trust region, a section chosen by its ``kind``, each kind with the keys it reads
(tether.algo.trust_region computes each; ``REGIONS`` registers them). A key another kind reads is refused by
construction (``algo.region.delta`` with ``kind: ratio``), and ``algo.region.kind=kl3`` starts the new kind from its
own defaults. ``algo.region=ratio`` is short for ``algo.region.kind=ratio``.

A region saved by an earlier release (config.yaml held all four bounds, whatever the kind read) is read back by
`REGION.mapping`: a bound the kind does not read, at its old default, is dropped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ..sections import Section, alone
from .migration import Choice


class _Kind(Section):
    kind: str
    """the trust region (tether.algo.trust_region; its table: docs/algorithms.md)"""


class _Interval(Section):
    eps_low: float = Field(0.2, ge=0, lt=1)
    """the ratio interval's lower bound is 1 - eps_low, 0 <= eps_low < 1"""
    eps_high: float = Field(0.2, ge=0)
    """the ratio interval's upper bound is 1 + eps_high, >= 0 (DAPO's clip-higher: 0.28)"""


class _DualCap(Section):
    clip_c: float = 0.0
    """for A < 0, no gradient once rho > clip_c (the dual clip; > 1, RPG uses 3; 0 = off)"""

    @field_validator("clip_c")
    @classmethod
    def _off_or_above_one(cls, v: float) -> float:
        if v != 0 and not v > 1:
            raise ValueError(f"must be > 1 or 0 (off), got {v}")
        return v


class _Radius(Section):
    delta: float = Field(0.0, ge=0)
    """the divergence radius, > 0 (the kinds that read it need it set)"""


def _needs(key: str, above: float, why: str = ""):
    """A kind that needs bound ``key`` set above ``above`` (a rule joining the kind to the key)."""

    def check(self, info: ValidationInfo):
        if not alone(info) and not getattr(self, key) > above:
            raise ValueError(f"trust region {self.kind!r} needs region.{key} > {above:g}{why}")
        return self

    return model_validator(mode="after")(check)


class _CapNeeded(Section):
    """A kind that is the dual cap: clip_c > 1 is required, not optional."""

    _cap = _needs("clip_c", 1, " (RPG uses 3)")


class _RadiusNeeded(Section):
    """A kind bounded by a divergence: delta > 0 is required (0 would clip every token that moves)."""

    _radius = _needs("delta", 0)


class NoRegionConfig(_Kind):
    """``algo.region.kind=none``: every token's gradient passes (no trust region)."""

    kind: Literal["none"] = "none"
    """none"""


class RatioRegionConfig(_DualCap, _Interval, _Kind):
    """``algo.region.kind=ratio``: PPO / GRPO's clip, 1 - eps_low <= rho <= 1 + eps_high (DAPO: clip-higher)."""

    kind: Literal["ratio"] = "ratio"
    """ratio"""


class DualRegionConfig(_CapNeeded, _DualCap, _Interval, _Kind):
    """``algo.region.kind=dual``: the ratio clip plus the dual cap at clip_c for A < 0 (needs clip_c > 1)."""

    kind: Literal["dual"] = "dual"
    """dual"""


class RPGClipRegionConfig(_CapNeeded, _DualCap, _Interval, _Kind):
    """``algo.region.kind=rpg_clip``: RPG-Style Clip, the dual clip in REINFORCE form (surrogate reinforce; needs
    clip_c > 1)."""

    kind: Literal["rpg_clip"] = "rpg_clip"
    """rpg_clip"""


class GSPORegionConfig(_DualCap, _Interval, _Kind):
    """``algo.region.kind=gspo``: the sequence ratio (pi(y)/pi_old(y))^(1/|y|) inside the ratio interval (GSPO:
    3e-4 / 4e-4)."""

    kind: Literal["gspo"] = "gspo"
    """gspo"""


class KL3RegionConfig(_RadiusNeeded, _DualCap, _Radius, _Kind):
    """``algo.region.kind=kl3``: k3(rho) = rho - 1 - log rho <= delta, i.e. Lambert-W bounds on rho (ATR-GRPO)."""

    kind: Literal["kl3"] = "kl3"
    """kl3"""


class TVRegionConfig(_RadiusNeeded, _DualCap, _Radius, _Kind):
    """``algo.region.kind=tv``: abs(pi(y) - pi_old(y)) <= delta (binary total variation, DPPO)."""

    kind: Literal["tv"] = "tv"
    """tv"""


class BinaryKLRegionConfig(_RadiusNeeded, _DualCap, _Radius, _Kind):
    """``algo.region.kind=binary_kl``: KL(Bern(pi_old(y)) || Bern(pi(y))) <= delta (binary KL, DPPO)."""

    kind: Literal["binary_kl"] = "binary_kl"
    """binary_kl"""


class CISPORegionConfig(_Kind):
    """``algo.region.kind=cispo``: no mask; the REINFORCE weight sg(min(rho, 1 + eps_high)) (surrogate
    reinforce)."""

    kind: Literal["cispo"] = "cispo"
    """cispo"""
    eps_high: float = Field(0.2, ge=0)
    """the weight's cap is 1 + eps_high, >= 0 (MiniMax-M1: 0.28)"""


class OtherRegionConfig(_Radius, _DualCap, _Interval, _Kind):
    """A trust region registered in tether.algo.trust_region.REGIONS by a user (docs/extending.md): every bound,
    for it to read."""


#: kind -> its section (the kinds tether ships)
REGION_KINDS: dict[str, type[Section]] = {
    c.model_fields["kind"].default: c for c in (NoRegionConfig, RatioRegionConfig, DualRegionConfig,
                                                RPGClipRegionConfig, GSPORegionConfig, KL3RegionConfig, TVRegionConfig,
                                                BinaryKLRegionConfig, CISPORegionConfig)}

#: the bounds every region carried before each kind had its own section, and their defaults then
_OLD_DEFAULTS = {"eps_low": 0.2, "eps_high": 0.2, "clip_c": 0.0, "delta": 0.0}


#: algo.region, chosen by its kind
REGION = Choice("algo.region", REGION_KINDS, OtherRegionConfig, "ratio", _OLD_DEFAULTS)
RegionConfig = REGION.type
