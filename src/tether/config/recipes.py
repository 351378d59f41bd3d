"""The algorithm section (``algo.*``) as one typed config, and the named recipes of the three papers and
baselines. The mathematics each field selects is in ``tether.algo``.

    algorithm = advantage x trust region x surrogate form x KL estimator x anchor x aggregation

Every field is documented where it is declared. ``validate`` turns combinations that
cannot work, or options that would have no effect, into errors that list valid choices.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Literal

from pydantic import Field, field_validator

from ..algo.advantages import ADVANTAGES
from ..algo.aggregation import AGGREGATIONS
from ..algo.anchors import ANCHOR_KINDS
from ..algo.correction import KL_REJECT, TIS_MODES
from ..algo.kl import EXACT_ESTIMATORS, KL_ESTIMATORS, RPG_ESTIMATORS, TOPK_ESTIMATORS
from ..algo.objectives import SURROGATES
from ..algo.registry import unknown_choice
from ..algo.trust_region import REGIONS, REINFORCE_ONLY_REGIONS, kl3_bounds
from ..errors import ConfigError
from ..sections import Section, only_with
from .anchor import (
    ANCHOR,
    AnchorConfig,
    EMAAnchorConfig,
    FixedAnchorConfig,
    IterativeAnchorConfig,
    NoAnchorConfig,
)
from .kl import KL, KLConfig, NoKLConfig, kl_config
from .region import (
    REGION,
    CISPORegionConfig,
    DualRegionConfig,
    GSPORegionConfig,
    KL3RegionConfig,
    RatioRegionConfig,
    RegionConfig,
    RPGClipRegionConfig,
)

ANCHORS = ("none", *ANCHOR_KINDS.names())  # "none": no anchor and no KL term; the kinds: tether.algo.anchors
KL_SAMPLERS = ("pi_old", "mu")  # AlgoConfig.kl_sampler
STD_ADVANTAGES = ("grpo", "reinforce_pp", "reinforce_pp_baseline")  # the advantages that divide by a std (adv_eps)


class AlgoConfig(Section):
    """One point in the design space. Named recipes are instances; every field can be overridden."""

    name: str = "custom"
    """recipe name, for logs"""
    advantage: str = "grpo"
    """grpo | dr_grpo | group_mean | batch_mean | rloo | reinforce_pp | reinforce_pp_baseline"""
    adv_eps: float = 1e-6
    """grpo, reinforce_pp*: epsilon added to the std"""
    _std = only_with("adv_eps", holds=lambda a: a.get("advantage", "grpo") in STD_ADVANTAGES,
                     text=lambda a: f"has no effect with algo.advantage {a.get('advantage')!r} (no std normalization)")
    surrogate: str = "ratio"
    """ratio: -A*rho (PPO) | reinforce: -sg(A*rho)*log pi (RPG, CISPO); same gradient"""
    region: RegionConfig = Field(default_factory=RatioRegionConfig)
    """the trust region (tether.config.region: a section per kind, with the bounds it reads)"""
    kl: KLConfig = Field(default_factory=NoKLConfig)
    """the KL term that ties the policy to the anchor (tether.config.kl: a section per family of estimators, with
    the keys it reads)"""
    anchor: AnchorConfig = Field(default_factory=NoAnchorConfig)
    """which policy the KL term ties to, and how it moves (tether.config.anchor: a section per kind)"""
    aggregation: Literal[AGGREGATIONS] = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm"""
    agg_max_len: int = Field(0, ge=0)
    """seq-mean-token-sum-norm: the fixed length L (0 = the rollout's max_new_tokens)"""
    _fixed_len = only_with("agg_max_len", holds=lambda a: a.get("aggregation") in (None, "seq-mean-token-sum-norm"),
                           text="only applies to algo.aggregation seq-mean-token-sum-norm")
    tis_cap: float = 0.0
    """rollout correction (tether.algo.correction) for an engine that reports its log-probs (vLLM, async workers):
    tokens drawn by mu, r_t = pi_old/mu, pi_old recomputed by the trainer; the pg term is weighted by w_t = W_t
    * M_t. W: the IS weight, truncated at C (TIS); inf = untruncated (tis_mode token + a ratio region = AReaL's
    decoupled PPO); 0 = no IS weight; else >= 1. M: the mask_* below (each 0/none = off)"""

    @field_validator("tis_cap")
    @classmethod
    def _off_or_at_least_one(cls, v: float) -> float:
        if v != 0 and not v >= 1:
            raise ValueError(f"must be 0 (off) or >= 1 (a cap below 1 down-weights every on-policy token), got {v}")
        return v

    tis_mode: Literal[TIS_MODES] = "token"
    """tis_cap > 0: token (W_t = min(r_t, C)) | sequence (W = min(prod_t r_t, C) on the whole response; exact IS as
    C -> inf) | mask (token, and responses whose geometric-mean ratio exceeds C are masked)"""
    _weighted = only_with("tis_mode", holds=lambda a: a.get("tis_cap", 1) != 0,
                          text="has no effect while algo.tis_cap is 0 (no IS weight)")
    mask_token_low: float = Field(0.0, ge=0, lt=1)
    """mask tokens with r_t < a, 0 < a < 1 (IcePop's alpha: 0.5)"""
    mask_token_high: float = 0.0
    """mask tokens with r_t > b > 1 (token MIS's cap, with tis_cap inf; IcePop's beta: 5)"""
    mask_seq_high: float = 0.0
    """mask responses with prod_t r_t > C > 1 (sequence MIS, with tis_mode sequence)"""
    mask_geo: float = 0.0
    """mask responses whose geometric-mean ratio exp(mean_t log r_t) is outside [1/C, C], C > 1"""

    @field_validator("mask_token_high", "mask_seq_high", "mask_geo")
    @classmethod
    def _off_or_above_one(cls, v: float) -> float:
        if v != 0 and not v > 1:
            raise ValueError(f"must be 0 (off) or > 1 (a bound <= 1 masks on-policy samples), got {v}")
        return v

    mask_kl: Literal[("none", *KL_REJECT)] = "none"
    """none | k1 | k2 | k3: mask responses whose mean_t k_t, an estimate of KL(mu, pi_old) = E_mu[log mu/pi_old],
    exceeds mask_kl_max (k1 = -log r, k2 = (log r)^2/2, k3 = r - 1 - log r)"""
    mask_kl_max: float = Field(0.0, ge=0)
    """mask_kl: the threshold (> 0)"""
    _kl_masked = only_with("mask_kl_max", holds=lambda a: a.get("mask_kl", "k1") != "none",
                           text="has no effect while algo.mask_kl is 'none'")
    mask_opsm: float = Field(0.0, ge=0)
    """OPSM (DeepSeek-V3.2): delta > 0; mask the A < 0 tokens of responses whose mean_t log(mu/pi) > delta, pi the
    current policy (detached)"""
    kl_sampler: Literal[KL_SAMPLERS] = "pi_old"
    """pi_old | mu: the distribution the KL term's sampling weights (s, rho, c of tether.algo.kl) divide by; mu
    (the engine's log-probs) keeps RPG's KL gradients exact when mu != pi_old"""

    @field_validator("region", mode="before")
    @classmethod
    def _region_shorthand(cls, v: Any) -> Any:
        return REGION.mapping(v)

    @field_validator("anchor", mode="before")
    @classmethod
    def _anchor_shorthand(cls, v: Any) -> Any:
        return ANCHOR.mapping(v)

    @field_validator("kl", mode="before")
    @classmethod
    def _kl_shorthand(cls, v: Any) -> Any:
        return KL.mapping(v)

    def copy(self) -> "AlgoConfig":
        return copy.deepcopy(self)


def validate(cfg: AlgoConfig) -> AlgoConfig:
    """Raise ConfigError listing every invalid combination or ineffective option; return cfg.

    The problems are listed in this order: the top-level choices (advantage, surrogate,
    aggregation, rollout correction), the trust region, the KL term and its anchor. (What one section needs of its
    own keys, a dual region's clip_c or kl_reset's kappa, is refused where the section is declared.)
    """
    errs = _top_level_errors(cfg) + _region_errors(cfg) + _kl_errors(cfg)
    if errs:
        raise ConfigError("invalid algorithm config:\n  - " + "\n  - ".join(errs))
    return cfg


def _top_level_errors(cfg: AlgoConfig) -> list[str]:
    """Unknown advantage / surrogate (registered names a user can extend; the aggregations are a fixed choice, typed
    with the key), and the rollout correction's settings (the keys they make ineffective are refused beside their
    declarations: adv_eps, agg_max_len, tis_mode, mask_kl_max)."""
    errs: list[str] = []
    if cfg.advantage not in ADVANTAGES:
        errs.append(unknown_choice("advantage", cfg.advantage, ADVANTAGES.names()))
    if cfg.surrogate not in SURROGATES:
        errs.append(unknown_choice("surrogate", cfg.surrogate, SURROGATES))
    return errs + _correction_errors(cfg)


def _correction_errors(cfg: AlgoConfig) -> list[str]:
    """The rollout correction's settings that contradict each other or the KL term (each key's own range, and the
    keys that need another key of the section set, are declared with it)."""
    errs = []
    if cfg.mask_kl != "none" and not cfg.mask_kl_max > 0:
        errs.append(f"mask_kl {cfg.mask_kl!r} needs mask_kl_max > 0")
    for f, mode in (("mask_token_high", "token"), ("mask_seq_high", "sequence")):
        b = getattr(cfg, f)
        if b and cfg.tis_mode == mode and math.isfinite(cfg.tis_cap) and 0 < b <= cfg.tis_cap:
            errs.append(f"tis_cap {cfg.tis_cap:g} truncates nothing that {f} {b:g} does not mask; "
                        "set tis_cap=inf for masked IS")
    if cfg.kl_sampler == "mu" and not _kl_has_sampling_weight(cfg):
        trunc = ", truncated" if getattr(cfg.kl, "truncated", False) else ""
        errs.append(f"kl_sampler 'mu' has no effect: the KL term ({cfg.kl.estimator!r}, placement "
                    f"{getattr(cfg.kl, 'placement', 'loss')!r}{trunc}) has no sampling weight")
    return errs


def _kl_has_sampling_weight(cfg: AlgoConfig) -> bool:
    """Whether the KL term reads the sampler's log-probs (a weight s, rho or c; tether.algo.kl)."""
    k = cfg.kl
    if k.estimator == "none" or k.estimator in EXACT_ESTIMATORS or k.estimator == "grpo_k3":
        return False
    if getattr(k, "truncated", False):  # the head alone: exact, no weight
        return False
    return not (k.placement == "advantage" and cfg.surrogate == "reinforce")  # RPG's C_KL = log(pi/pi_a)


def _region_errors(cfg: AlgoConfig) -> list[str]:
    """An unknown trust region, or a region for the other surrogate (a bound the kind does not read cannot be set,
    and a bound the kind needs, with each bound's range, is declared with it: tether.config.region)."""
    errs: list[str] = []
    r = cfg.region
    if r.kind not in REGIONS:
        return [unknown_choice("trust region", r.kind, REGIONS.names())]
    if r.kind in REINFORCE_ONLY_REGIONS and cfg.surrogate != "reinforce":
        errs.append(f"trust region {r.kind!r} is defined for surrogate 'reinforce', got {cfg.surrogate!r}")
    return errs


def _kl_errors(cfg: AlgoConfig) -> list[str]:
    """An unknown KL estimator or anchor, an anchor exactly when there is an estimator, and a placement the surrogate
    supports (a key the estimator does not read cannot be set; each key's range, beta > 0, the advantage placement's
    estimators and truncated's companions are declared with the keys: tether.config.kl)."""
    errs: list[str] = []
    k, a = cfg.kl, cfg.anchor
    if k.estimator != "none" and k.estimator not in KL_ESTIMATORS:
        errs.append(unknown_choice("KL estimator", k.estimator, ["none", *KL_ESTIMATORS.names()]))
    if a.kind not in ANCHORS:
        errs.append(unknown_choice("anchor", a.kind, ANCHORS))
    if k.estimator == "none":
        if a.kind != "none":
            errs.append(f"anchor {a.kind!r} has no effect without a KL term (kl.estimator is 'none'); "
                        "set anchor.kind=none")
        return errs
    if a.kind == "none":
        errs.append(f"kl.estimator {k.estimator!r} needs an anchor; choose anchor.kind from: "
                    + ", ".join(x for x in ANCHORS if x != "none"))
    if k.placement == "reward" and k.estimator in RPG_ESTIMATORS and cfg.surrogate == "reinforce":
        errs.append("kl.placement 'reward' uses the estimator's value; the RPG REINFORCE form has none")
    return errs


# ---------------------------------------------------------------- named recipes

# ATR-GRPO: the KL3 radius whose Lambert-W interval is closest to DAPO's [0.8, 1.28]:
# kl3_delta_for(0.2, 0.28) = 0.0295, rounded to 0.03 ([l, u] = [0.775, 1.265]).
ATR_DELTA = 0.03


def _grpo() -> AlgoConfig:
    return AlgoConfig(name="grpo", advantage="grpo", region=RatioRegionConfig(eps_low=0.2, eps_high=0.2),
                      kl=kl_config("k3", beta=1e-3), anchor=FixedAnchorConfig(),
                      aggregation="seq-mean-token-mean")


def _rpg(variant: str, reinforce: bool) -> AlgoConfig:
    region = (RPGClipRegionConfig if reinforce else DualRegionConfig)(eps_low=0.2, eps_high=0.28, clip_c=3.0)
    placement = "advantage" if reinforce and variant in ("rkl", "urkl") else "loss"
    return AlgoConfig(name=f"rpg_{'reinforce_' if reinforce else ''}{variant}", advantage="group_mean",
                      surrogate="reinforce" if reinforce else "ratio", region=region,
                      kl=kl_config(f"rpg_{variant}", beta=1e-4, placement=placement),
                      anchor=IterativeAnchorConfig(), aggregation="token-mean")


RECIPES = {
    # GRPO (DeepSeekMath): group-normalized advantage, symmetric ratio clip, k3 in the loss, frozen reference.
    "grpo": _grpo,
    # DAPO: clip-higher 0.2/0.28, token-mean, no KL (dynamic sampling and overlong shaping live in the trainer).
    "dapo": lambda: AlgoConfig(name="dapo", region=RatioRegionConfig(eps_low=0.2, eps_high=0.28),
                               aggregation="token-mean"),
    # Dr.GRPO: no std normalization, no length normalization (fixed-L sum), no KL.
    "dr_grpo": lambda: AlgoConfig(name="dr_grpo", advantage="dr_grpo",
                                  region=RatioRegionConfig(eps_low=0.2, eps_high=0.2),
                                  aggregation="seq-mean-token-sum-norm"),
    # EMA-PG (arXiv 2602.04417): EMA anchor, unbiased top-k reverse KL with k = 32, clip-higher.
    "ema_pg": lambda: AlgoConfig(name="ema_pg", region=RatioRegionConfig(eps_low=0.2, eps_high=0.28),
                                 kl=kl_config("topk_rev", beta=1e-3, topk=32),
                                 anchor=EMAAnchorConfig(eta=0.95, every=10), aggregation="token-mean"),
    # ATR-GRPO (arXiv 2602.05494): the KL3 trust region instead of the ratio clip; otherwise GRPO.
    "atr_grpo": lambda: AlgoConfig(name="atr_grpo", advantage="grpo", region=KL3RegionConfig(delta=ATR_DELTA),
                                   kl=kl_config("k3", beta=1e-3), anchor=FixedAnchorConfig(),
                                   aggregation="seq-mean-token-mean"),
    # REINFORCE++: batch-normalized advantage, PPO clip, k3 KL as a per-token reward penalty.
    "reinforce_pp": lambda: AlgoConfig(name="reinforce_pp", advantage="reinforce_pp",
                                       region=RatioRegionConfig(eps_low=0.2, eps_high=0.2),
                                       kl=kl_config("k3", beta=1e-3, placement="reward"),
                                       anchor=FixedAnchorConfig(), aggregation="token-mean"),
    # CISPO (MiniMax-M1): no mask; REINFORCE with the truncated IS weight sg(min(rho, 1 + eps_high)).
    "cispo": lambda: AlgoConfig(name="cispo", surrogate="reinforce",
                                region=CISPORegionConfig(eps_high=0.28), aggregation="token-mean"),
    # GSPO (Qwen): sequence-level geometric-mean ratio with a tight clip.
    "gspo": lambda: AlgoConfig(name="gspo", region=GSPORegionConfig(eps_low=3e-4, eps_high=4e-4),
                               aggregation="seq-mean-token-mean"),
}
for _v in ("fkl", "rkl", "ufkl", "urkl"):
    # RPG (arXiv 2505.17508): off-policy-correct KL to the sampler (iterative anchor), dual clip 0.2/0.28, c = 3.
    RECIPES[f"rpg_{_v}"] = (lambda v: lambda: _rpg(v, reinforce=False))(_v)
    # RPG-REINFORCE: the stop-gradient form with RPG-Style Clip; rkl/urkl fold the KL into A'.
    RECIPES[f"rpg_reinforce_{_v}"] = (lambda v: lambda: _rpg(v, reinforce=True))(_v)


def recipe(name: str) -> AlgoConfig:
    """A fresh, validated AlgoConfig for a named recipe."""
    if name not in RECIPES:
        raise ConfigError(unknown_choice("recipe", name, RECIPES))
    return validate(RECIPES[name]())


def describe(cfg: AlgoConfig) -> str:
    """One line naming every choice of cfg, for logs."""
    r, k, a = cfg.region, cfg.kl, cfg.anchor
    if r.kind == "kl3":
        reg = "kl3(delta=%g -> [%.3f, %.3f])" % ((r.delta,) + kl3_bounds(r.delta))
    else:
        parts = [f"eps={r.eps_low:g}/{r.eps_high:g}" if hasattr(r, "eps_low") else
                 f"eps_high={r.eps_high:g}" if hasattr(r, "eps_high") else "",
                 f"delta={r.delta:g}" if hasattr(r, "delta") else "",
                 f"c={r.clip_c:g}" if getattr(r, "clip_c", 0) else ""]
        reg = r.kind + (f"({', '.join(p for p in parts if p)})" if any(parts) else "")
    kl = "none" if k.estimator == "none" else f"{k.estimator}(beta={k.beta:g}, {k.placement}" + (
        f", k={k.topk})" if k.estimator in TOPK_ESTIMATORS else ")")
    anc = a.kind + (f"(eta={a.eta:g}, every={a.every})" if a.kind == "ema" else "")
    return (f"{cfg.name}: advantage={cfg.advantage} surrogate={cfg.surrogate} region={reg} kl={kl} "
            f"anchor={anc} aggregation={cfg.aggregation}{_describe_correction(cfg)}")


def _describe_correction(cfg: AlgoConfig) -> str:
    """' tis=token(C=2) mask=[icepop[0.5,5], opsm(0.1)] kl_sampler=mu', or '' with no correction."""
    out = f" tis={cfg.tis_mode}(C={cfg.tis_cap:g})" if cfg.tis_cap > 0 else ""
    lo, hi = cfg.mask_token_low, cfg.mask_token_high
    masks = [f"icepop[{lo:g},{hi or math.inf:g}]" if lo else f"token<={hi:g}" if hi else "",
             f"seq<={cfg.mask_seq_high:g}" if cfg.mask_seq_high else "",
             f"geo[1/{cfg.mask_geo:g},{cfg.mask_geo:g}]" if cfg.mask_geo else "",
             f"{cfg.mask_kl}<={cfg.mask_kl_max:g}" if cfg.mask_kl != "none" else "",
             f"opsm({cfg.mask_opsm:g})" if cfg.mask_opsm else ""]
    masks = [m for m in masks if m]
    out += f" mask=[{', '.join(masks)}]" if masks else ""
    if cfg.tis_mode == "token" and math.isinf(cfg.tis_cap) and cfg.region.kind in ("ratio", "dual"):
        out += " (decoupled PPO)"
    return out + (" kl_sampler=mu" if cfg.kl_sampler == "mu" else "")
