"""``algo.kl``: the KL term that ties the policy to the anchor, a section chosen by its ``estimator`` (tether.algo.kl
has every estimator's equation), each family of estimators with the keys it reads. A key another family reads is
refused by construction (``algo.kl.topk`` with ``estimator: k3``); changing the estimator keeps the keys the new one
reads too (beta, placement). A section saved by an earlier release (every key, whatever the estimator read) is read
back by `KL.mapping` / `KL.drop_unread`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ..algo.kl import EXACT_ESTIMATORS, KL_ESTIMATORS, RPG_ESTIMATORS, TOPK_ESTIMATORS
from ..sections import Section, alone
from .migration import Choice

#: algo.kl.placement
PLACEMENTS = ("loss", "reward", "advantage")
#: the sampled estimators whose sampling weight s = sg(pi/pi_old) algo.kl.s_min / s_max clip
WEIGHTED = ("k1", "k2", "k3", "k3pp", "k4", "k5")
#: the estimators without a clipped sampling weight or a head: exact, GRPO's k3 forms and RPG's
UNWEIGHTED = (*EXACT_ESTIMATORS, "grpo_k3", "grpo_k3_corrected", *RPG_ESTIMATORS)


class _Estimator(Section):
    choice_key: ClassVar[str] = "estimator"
    estimator: str
    """the estimator (tether.algo.kl.KL_ESTIMATORS)"""
    beta: float = Field(0.0, ge=0, allow_inf_nan=False)
    """KL coefficient, > 0 (an estimator needs it set)"""

    @model_validator(mode="after")
    def _beta_set(self, info: ValidationInfo):
        if not alone(info) and self.estimator != "none" and not self.beta > 0:
            raise ValueError(f"kl.estimator {self.estimator!r} needs kl.beta > 0")
        return self


class _Placed(Section):
    placement: Literal[PLACEMENTS] = "loss"
    """loss: + beta*KL in the loss | reward: per-token penalty-to-go in the advantage | advantage: RPG's A' = A -
    beta*C_KL (rpg_rkl/rpg_urkl)"""

    @model_validator(mode="after")
    def _advantage_form(self, info: ValidationInfo):
        if not alone(info) and self.placement == "advantage" and self.estimator not in ("rpg_rkl", "rpg_urkl"):
            raise ValueError("kl.placement 'advantage' (RPG-Style Clip's A') needs kl.estimator rpg_rkl or rpg_urkl")
        return self


class _Head(Section):
    topk: int = Field(32, ge=0)
    """head size k (EMA-PG: 32); 0 = pure sampled tail; >= |V| = exact"""
    truncated: bool = False
    """drop the tail, KL over the head only (a biased, distillation-style KL); not with a *_centered estimator, nor
    with s_min / s_max (which clip the tail's weight)"""

    @model_validator(mode="after")
    def _head_alone(self, info: ValidationInfo):
        if alone(info) or not self.truncated:
            return self
        if self.estimator.endswith("_centered"):
            raise ValueError(f"kl.truncated drops the tail, and {self.estimator!r}'s baseline is unbiased only with "
                             "it (the head alone would not have the truncated KL's gradient); use "
                             f"{self.estimator[:-9]!r}")
        if getattr(self, "s_min", 0) or getattr(self, "s_max", 0):
            raise ValueError("kl.s_min/s_max clip the sampling weight of the top-k estimators' sampled tail, which "
                             "kl.truncated=true drops")
        return self


class _Weight(Section):
    s_min: float = Field(0.0, ge=0)
    """lower clip of the sampling weight s = sg(pi/pi_old) (top-k: of its sampled tail; not with truncated; 0 =
    none; a documented bias)"""
    s_max: float = Field(0.0, ge=0)
    """upper clip of s (top-k: of its sampled tail; not with truncated; 0 = none; a documented bias)"""


class NoKLConfig(_Estimator):
    """``algo.kl.estimator=none``: no KL term (and no anchor)."""

    estimator: Literal["none"] = "none"
    """none"""

    @field_validator("beta")
    @classmethod
    def _no_term(cls, v: float) -> float:
        if v:
            raise ValueError("is set but algo.kl.estimator is 'none'; pick an estimator: "
                             + ", ".join(KL_ESTIMATORS.names()))
        return v


class SampledKLConfig(_Weight, _Placed, _Estimator):
    """``algo.kl.estimator`` k1 | k2 | k3 | k3pp | k4 | k5: the sampled estimators, weighted by s = sg(pi/pi_old)."""

    estimator: Literal[WEIGHTED] = "k3"
    """k1 | k2 | k3 | k3pp | k4 | k5"""
    #: no head to truncate (not a key)
    truncated: ClassVar[bool] = False


class TopKKLConfig(_Weight, _Head, _Placed, _Estimator):
    """``algo.kl.estimator`` topk_rev | topk_fwd | topk_*_centered (per-sample gradient 0 at the anchor) |
    topk_*_legacy: the exact KL over a head of k tokens plus a sampled tail (EMA-PG)."""

    estimator: Literal[TOPK_ESTIMATORS] = "topk_rev"
    """topk_rev | topk_fwd | topk_rev_centered | topk_fwd_centered | topk_rev_legacy | topk_fwd_legacy"""


class UnweightedKLConfig(_Placed, _Estimator):
    """``algo.kl.estimator`` exact_rev | exact_fwd (the full vocabulary) | grpo_k3 | grpo_k3_corrected | rpg_fkl |
    rpg_rkl | rpg_ufkl | rpg_urkl: the estimators without a head or a clipped weight."""

    estimator: Literal[UNWEIGHTED] = "exact_rev"
    """exact_rev | exact_fwd | grpo_k3 | grpo_k3_corrected | rpg_fkl | rpg_rkl | rpg_ufkl | rpg_urkl"""
    #: no sampling weight to clip and no head to truncate (not keys)
    s_min: ClassVar[float] = 0.0
    s_max: ClassVar[float] = 0.0
    truncated: ClassVar[bool] = False


class OtherKLConfig(_Weight, _Head, _Placed, _Estimator):
    """An estimator registered in tether.algo.kl.KL_ESTIMATORS by a user (docs/extending.md): every key, for it to
    read."""


#: estimator -> its section (the estimators tether ships)
KL_SECTIONS: dict[str, type[Section]] = {e: c for c in (NoKLConfig, SampledKLConfig, TopKKLConfig, UnweightedKLConfig)
                                         for e in c.model_fields["estimator"].annotation.__args__}

#: the keys every KL term carried before each family had its own section, and their defaults then
_OLD_DEFAULTS = {"placement": "loss", "topk": 32, "truncated": False, "s_min": 0.0, "s_max": 0.0}


#: algo.kl, chosen by its estimator
KL = Choice("algo.kl", KL_SECTIONS, OtherKLConfig, "none", _OLD_DEFAULTS, key="estimator")
KLConfig = KL.type
kl_config = KL.section
