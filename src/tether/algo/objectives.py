"""The policy loss: policy-gradient term (surrogate x trust region) + beta x KL term.

Per token, with A the (baselined) advantage and rho = pi/pi_old:

    ratio form      pg = -A * rho                          (PPO/GRPO; fully differentiable)
    reinforce form  pg = -sg(A * weight) * log pi          (same gradient; RPG, CISPO)

Tokens the trust region rejects keep their value but lose their gradient (``rho`` or
``log pi`` is detached there), which gives exactly the gradient of
``min(rho A, clip_C(rho) A)``. The KL enters in one of three places (``KLConfig.placement``):

    loss       loss += beta * KL_term                        (GRPO, EMA-PG)
    reward     A_t  -= beta * sum_{s >= t} sg(KL_s)          (per-token penalty-to-go; REINFORCE++)
    advantage  A_t  -= beta * sg(C_KL_t)                     (RPG-Style Clip: the regularized advantage A')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .aggregation import aggregate
from .kl import KL_ESTIMATORS, RPG_ESTIMATORS, KLInputs, KLOptions, rpg_advantage_penalty, rpg_score_coef
from .trust_region import REGIONS, RegionOut


def policy_term(logp: Tensor, adv: Tensor, region: RegionOut, surrogate: str) -> Tensor:
    """Per-token policy-gradient loss [B, T]: -A rho (ratio) or -sg(A w) log pi (reinforce), masked by the region."""
    if surrogate == "ratio":
        return -adv * torch.where(region.keep, region.ratio, region.ratio.detach())
    if surrogate == "reinforce":
        return -(adv * region.weight).detach() * torch.where(region.keep, logp, logp.detach())
    raise ValueError(f"unknown surrogate {surrogate!r}. Valid choices: ratio, reinforce")


def penalty_to_go(kl: Tensor, mask: Tensor) -> Tensor:
    """sum_{s >= t} kl_s over each response's own tokens [B, T] (reverse cumulative sum)."""
    k = kl * mask.to(kl.dtype)
    return k.flip(-1).cumsum(-1).flip(-1)


@dataclass
class LossOut:
    """A scalar loss to backpropagate and detached per-batch metrics."""

    loss: Tensor  # scalar, differentiable
    metrics: dict = field(default_factory=dict)  # name -> float, token-means over this batch's mask


def compute_loss(cfg, *, logp: Tensor, mask: Tensor, adv: Tensor, old_logp: Optional[Tensor] = None,
                 ref_logp: Optional[Tensor] = None, head_logp: Optional[Tensor] = None,
                 head_ref_logp: Optional[Tensor] = None, in_head: Optional[Tensor] = None,
                 full_logp: Optional[Tensor] = None, full_ref_logp: Optional[Tensor] = None,
                 num_tokens: Optional[float] = None, num_seqs: Optional[float] = None,
                 max_len: int = 0) -> LossOut:
    """The loss of algorithm ``cfg`` (an :class:`~tether.algo.recipes.AlgoConfig`) on one (micro-)batch.

    logp/old_logp/ref_logp/mask [B, T]; adv [B] (per sequence) or [B, T] (per token);
    head_* [B, T, k] for top-k KL; full_* [B, T, V] only for the exact estimators.
    ``old_logp=None`` means exactly on-policy (pi_old = sg(pi)). ``num_tokens``/``num_seqs``
    are the whole mini-batch's counts when accumulating gradients over micro-batches.
    """
    mask = mask.bool()
    old = logp.detach() if old_logp is None else old_logp
    adv = adv.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logp)
    kl_cfg = cfg.kl
    use_kl = kl_cfg.estimator != "none" and kl_cfg.beta > 0
    kl_tok = kl_val = None
    if use_kl:
        if ref_logp is None:
            raise ValueError(f"KL estimator {kl_cfg.estimator!r} needs the anchor's log-probs (ref_logp)")
        inp = KLInputs(logp=logp, ref_logp=ref_logp, old_logp=old, head_logp=head_logp,
                       head_ref_logp=head_ref_logp, in_head=in_head, full_logp=full_logp,
                       full_ref_logp=full_ref_logp)
        opt = KLOptions(s_min=kl_cfg.s_min, s_max=kl_cfg.s_max if kl_cfg.s_max > 0 else math.inf,
                        truncated=kl_cfg.truncated)
        kl_full = KL_ESTIMATORS[kl_cfg.estimator](inp, opt)  # [B, T] value + exact-form gradient
        kl_val = kl_full.detach()
        if kl_cfg.placement == "loss":
            if cfg.surrogate == "reinforce" and kl_cfg.estimator in RPG_ESTIMATORS:
                kl_tok = rpg_score_coef(kl_cfg.estimator, inp) * logp  # same gradient as kl_full
            else:
                kl_tok = kl_full
        elif kl_cfg.placement == "reward":
            adv = adv - kl_cfg.beta * penalty_to_go(kl_val, mask)
        elif kl_cfg.placement == "advantage":
            adv = adv - kl_cfg.beta * rpg_advantage_penalty(kl_cfg.estimator, inp)
        else:
            raise ValueError(f"unknown KL placement {kl_cfg.placement!r}. Valid choices: loss, reward, advantage")

    region = REGIONS[cfg.region.kind](logp, old, adv, mask, cfg.region)
    pg = policy_term(logp, adv, region, cfg.surrogate)  # [B, T]
    tok = pg if kl_tok is None else pg + kl_cfg.beta * kl_tok
    agg = dict(max_len=max_len or cfg.agg_max_len, num_tokens=num_tokens, num_seqs=num_seqs)
    loss = aggregate(tok, mask, cfg.aggregation, **agg)

    with torch.no_grad():
        m = mask.to(logp.dtype)
        n = m.sum().clamp_min(1.0)

        def tmean(x: Tensor) -> float:
            return float((x.to(m.dtype) * m).sum() / n)

        r = region.ratio.detach()
        metrics = {
            "pg_loss": float(aggregate(pg.detach(), mask, cfg.aggregation, **agg)),
            "clip_frac_low": tmean(region.low),
            "clip_frac_high": tmean(region.high),
            "clip_frac_dual": tmean(region.dual),
            "clip_frac": tmean(~region.keep | region.high),
            "ratio_mean": tmean(r),
            "ratio_max": float(torch.where(mask, r, torch.full_like(r, -math.inf)).max()) if mask.any() else 1.0,
            "ratio_min": float(torch.where(mask, r, torch.full_like(r, math.inf)).min()) if mask.any() else 1.0,
            "n_tokens": float(m.sum()),
        }
        if kl_val is not None:
            metrics["kl"] = tmean(kl_val)
            if kl_tok is not None:
                metrics["kl_loss"] = float(aggregate(kl_cfg.beta * kl_val, mask, cfg.aggregation, **agg))
    return LossOut(loss, metrics)
