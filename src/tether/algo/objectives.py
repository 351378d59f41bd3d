"""The policy loss: policy-gradient term (surrogate x trust region) + beta x KL term.

Per token, with A the (baselined) advantage and rho = pi/pi_old:

    ratio form      pg = -A * rho                          (PPO/GRPO; fully differentiable)
    reinforce form  pg = -sg(A * weight) * log pi          (same gradient; RPG, CISPO)

Tokens the trust region rejects keep their value but lose their gradient (``rho`` or
``log pi`` is detached there), which gives exactly the gradient of
``min(rho A, clip_C(rho) A)``. The KL enters in one of three places (``algo.kl.placement``):

    loss       loss += beta * KL_term                        (GRPO, EMA-PG)
    reward     A_t  -= beta * sum_{s >= t} sg(KL_s)          (per-token penalty-to-go; REINFORCE++)
    advantage  A_t  -= beta * sg(C_KL_t)                     (RPG-Style Clip: the regularized advantage A')

Three policies (``tether.algo.correction``): mu, the behaviour policy that drew the tokens
(the engine's ``sampler_logp``), pi_old, the proximal policy the trainer recomputes, and pi.
Rollout correction (``AlgoConfig.tis_cap`` / ``mask_*``) multiplies pg_t by the constant weight
w_t = W_t M_t (an IS weight of r_t = pi_old / mu, truncated, times masks); the KL term is not
re-weighted by w. Given mu's log-probs, the ``rollout_corr/*`` metrics (the mismatch, its ESS) are
reported with the correction off too. With ``tis_mode: token`` and ``tis_cap: inf`` this is **decoupled PPO**
(AReaL, Hilton et al.'s proximal-policy form), with no code of its own:

    loss_t = -(pi_old / mu) * min(rho_t A, clip(rho_t, 1 - eps_lo, 1 + eps_hi) A),   rho_t = pi / pi_old

the trust region around pi_old, the behaviour weight pi_old / mu (AReaL's ``behav_imp_weight_cap``
is ``mask_token_high``; a finite ``tis_cap`` truncates instead). Its gradient at pi = pi_old is
the policy gradient under pi_old, exactly for one-token responses (``tests/test_three_policies.py``).

``AlgoConfig.kl_sampler: mu`` makes the KL term's sampling weights (s, rho, c of
``tether.algo.kl``: the ratios that turn an expectation over the sampler into one over pi or
pi_a) ratios against mu, which really drew the tokens; the anchor and the trust region stay
pi_old's. RPG's KL terms then have the gradient of the KL-regularized objective they claim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from .aggregation import aggregate
from .correction import Masks, correction_weights
from .kl import KL_ESTIMATORS, RPG_ESTIMATORS, KLInputs, KLOptions, rpg_advantage_penalty, rpg_score_coef
from .registry import Registry
from .trust_region import REGIONS, RegionOut

# A surrogate maps (logp, adv, region) -> per-token policy loss [B, T]; both forms read rho = pi/pi_old
# through the region, so off-policy they need the sampler's log-probs.
SurrogateFn = Callable[[Tensor, Tensor, RegionOut], Tensor]
SURROGATES: Registry[SurrogateFn] = Registry("surrogate", required=("needs_old_logp",))


@SURROGATES.register("ratio", needs_old_logp=True)
def surrogate_ratio(logp: Tensor, adv: Tensor, region: RegionOut) -> Tensor:
    """-A rho, rho detached where the region rejects the token (PPO/GRPO; fully differentiable)."""
    return -adv * torch.where(region.keep, region.ratio, region.ratio.detach())


@SURROGATES.register("reinforce", needs_old_logp=True)
def surrogate_reinforce(logp: Tensor, adv: Tensor, region: RegionOut) -> Tensor:
    """-sg(A w) log pi, log pi detached where the region rejects the token (RPG, CISPO); same gradient."""
    return -(adv * region.weight).detach() * torch.where(region.keep, logp, logp.detach())


def policy_term(logp: Tensor, adv: Tensor, region: RegionOut, surrogate: str) -> Tensor:
    """Per-token policy-gradient loss [B, T]: -A rho (ratio) or -sg(A w) log pi (reinforce), masked by the region."""
    return SURROGATES[surrogate](logp, adv, region)


def penalty_to_go(kl: Tensor, mask: Tensor) -> Tensor:
    """sum_{s >= t} kl_s over each response's own tokens [B, T] (reverse cumulative sum)."""
    k = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    return k.flip(-1).cumsum(-1).flip(-1)


@dataclass
class LossInputs:
    """Everything ``compute_loss`` reads for one (micro-)batch: tensors [B, T] unless noted.

    Values at positions where ``mask`` is False are never read: they may hold anything,
    inf and NaN included (e.g. padding, or a truncated response excluded from the loss).
    """

    logp: Tensor  # log pi at the sampled tokens (differentiable)
    mask: Tensor  # bool: the tokens that enter the loss (the policy's own response tokens)
    adv: Tensor  # [B] per sequence or [B, T] per token
    old_logp: Optional[Tensor] = None  # log pi_old of the sampler; None = exactly on-policy (pi_old = sg(pi))
    sampler_logp: Optional[Tensor] = None  # log mu, the behaviour policy: what the rollout engine reported
    # (rollout correction, AlgoConfig.tis_cap / mask_*; kl_sampler mu)
    ref_logp: Optional[Tensor] = None  # log pi_a of the anchor (needed when the KL term is on)
    head_logp: Optional[Tensor] = None  # [B, T, k] log pi at the top-k head ids (top-k estimators)
    head_ref_logp: Optional[Tensor] = None  # [B, T, k] log pi_a at the head ids
    in_head: Optional[Tensor] = None  # bool: the sampled token is one of the head ids
    full_logp: Optional[Tensor] = None  # [B, T, V] exact estimators only
    full_ref_logp: Optional[Tensor] = None  # [B, T, V] exact estimators only
    num_tokens: Optional[float] = None  # token-mean: the whole mini-batch's token count (gradient accumulation)
    num_seqs: Optional[float] = None  # sequence modes: the whole mini-batch's sequence count
    max_len: int = 0  # seq-mean-token-sum-norm: fallback length L when AlgoConfig.agg_max_len is 0


@dataclass(frozen=True)
class LossNeeds:
    """Which inputs an algorithm's loss needs, read from the registries' metadata (no name parsing)."""

    head: Optional[str]  # None | "sampler" (sampler's top-k ids) | "anchor" (anchor's top-k ids)
    # | "all" (full vocabulary)
    k: int  # head size (the vocabulary size for "all"; 0 without a head)
    ref_logp: bool  # the anchor's log-probs at the sampled tokens
    old_logp: bool  # the sampler's log-probs (read only when the update is off-policy)
    sampler_logp: bool = False  # rollout correction / kl_sampler mu: the engine's log-probs, and pi_old
    # recomputed even on-policy


_HEADS = {"sampled": None, "sampler_topk": "sampler", "anchor_topk": "anchor", "full_vocab": "all"}


def loss_needs(cfg, vocab_size: int) -> LossNeeds:
    """What ``compute_loss(cfg, ...)`` needs for a model with ``vocab_size`` tokens."""
    kl = cfg.kl
    use_kl = kl.estimator != "none" and kl.beta > 0
    head = _HEADS[KL_ESTIMATORS.meta(kl.estimator)["inputs"]] if use_kl else None
    k = vocab_size if head == "all" else min(kl.topk, vocab_size) if head else 0
    old = REGIONS.meta(cfg.region.kind)["needs_old_logp"] or SURROGATES.meta(cfg.surrogate)["needs_old_logp"]
    return LossNeeds(head=head, k=k, ref_logp=use_kl, old_logp=bool(old), sampler_logp=uses_sampler_logp(cfg))


def correction_masks(cfg) -> Masks:
    """The masks of ``AlgoConfig.mask_*`` (``tether.algo.correction.Masks``)."""
    return Masks(token_low=cfg.mask_token_low, token_high=cfg.mask_token_high, seq_high=cfg.mask_seq_high,
                 geo=cfg.mask_geo, kl=cfg.mask_kl, kl_max=cfg.mask_kl_max, opsm=cfg.mask_opsm)


def correction_on(cfg) -> bool:
    """Whether the policy-gradient term is corrected (an IS weight or a mask)."""
    return cfg.tis_cap > 0 or correction_masks(cfg).any()


def uses_sampler_logp(cfg) -> bool:
    """Whether the loss reads the engine's log-probs (mu): the correction, or the KL weighted against mu."""
    return correction_on(cfg) or cfg.kl_sampler == "mu"


@dataclass
class LossOut:
    """A scalar loss to backpropagate and detached per-batch metrics."""

    loss: Tensor  # scalar, differentiable
    metrics: dict = field(default_factory=dict)  # name -> detached 0-d tensor, token-means over this batch's mask


def _masked(x: Optional[Tensor], mask: Tensor, fill: float = 0.0) -> Optional[Tensor]:
    """x where mask is True, else a constant: nothing at a masked position reaches a value or a gradient."""
    if x is None:
        return None
    m = mask if x.dim() == mask.dim() else mask[..., None]
    return torch.where(m, x, torch.full_like(x, fill))


def compute_loss(cfg, inputs: LossInputs) -> LossOut:
    """The loss of algorithm ``cfg`` (an :class:`~tether.config.recipes.AlgoConfig`) on one (micro-)batch.

    ``inputs.old_logp=None`` means exactly on-policy (pi_old = sg(pi)). ``num_tokens`` /
    ``num_seqs`` are the whole mini-batch's counts when accumulating gradients over
    micro-batches. Masked positions are replaced by constants before any arithmetic
    (``torch.where``), so an inf or NaN there never reaches the loss or its gradient.
    Metrics are detached 0-d tensors (read them once per optimizer step, not per micro-batch).
    """
    inp = inputs
    mask = inp.mask.bool()
    logp = _masked(inp.logp, mask)
    old = logp.detach() if inp.old_logp is None else _masked(inp.old_logp, mask)
    adv = inp.adv.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logp)
    adv = _masked(adv, mask)
    kl_cfg = cfg.kl
    adv, kl_tok, kl_val = _kl_terms(cfg, inp, logp, old, adv, mask)

    region = REGIONS[cfg.region.kind](logp, old, adv, mask, cfg.region)
    pg = policy_term(logp, adv, region, cfg.surrogate)  # [B, T]
    pg, corr_metrics = _rollout_correction(cfg, inp, pg, old, mask, logp, adv)
    tok = pg if kl_tok is None else pg + kl_cfg.beta * kl_tok
    # The configured L wins; the caller's max_len (the rollout's max_new_tokens) is the fallback.
    agg = dict(max_len=cfg.agg_max_len or inp.max_len, num_tokens=inp.num_tokens, num_seqs=inp.num_seqs)
    loss = aggregate(tok, mask, cfg.aggregation, **agg)

    with torch.no_grad():
        metrics = _loss_metrics(cfg, logp, mask, region, pg, agg)
        metrics.update(corr_metrics)
        if kl_val is not None:
            metrics["kl"] = _token_mean(kl_val, mask, logp)
            if kl_tok is not None:
                metrics["kl_loss"] = aggregate(kl_cfg.beta * kl_val, mask, cfg.aggregation, **agg)
    return LossOut(loss, metrics)


def _kl_terms(cfg, inp: LossInputs, logp: Tensor, old: Tensor, adv: Tensor,
              mask: Tensor) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """The KL term in its ``algo.kl.placement``: returns ``(adv, kl_tok, kl_val)``.

        loss       kl_tok = KL_t (value + exact-form gradient; the RPG REINFORCE form: its score
                   coefficient x log pi, same gradient), added to the loss as beta * kl_tok
        reward     A_t -= beta * sum_{s >= t} sg(KL_s)      (per-token penalty-to-go; REINFORCE++)
        advantage  A_t -= beta * sg(C_KL_t)                 (RPG-Style Clip: the regularized advantage A')

    ``kl_val`` = sg(KL_t) [B, T] for the metrics; ``kl_tok`` is None outside ``loss``, and both are
    None when the KL term is off (estimator ``none`` or beta = 0), where ``adv`` is returned as is.
    """
    kl_cfg = cfg.kl
    use_kl = kl_cfg.estimator != "none" and kl_cfg.beta > 0
    kl_tok = kl_val = None
    if use_kl:
        if inp.ref_logp is None:
            raise ValueError(f"KL estimator {kl_cfg.estimator!r} needs the anchor's log-probs (ref_logp)")
        sampler = old  # the distribution the sampling weights divide by: pi_old, or mu (kl_sampler)
        if cfg.kl_sampler == "mu":
            if inp.sampler_logp is None:
                raise ValueError("algo.kl_sampler 'mu' needs the engine's log-probs (sampler_logp)")
            sampler = _masked(inp.sampler_logp.to(logp.dtype), mask)
        kin = KLInputs(logp=logp, ref_logp=_masked(inp.ref_logp, mask), old_logp=sampler,
                       head_logp=_masked(inp.head_logp, mask), head_ref_logp=_masked(inp.head_ref_logp, mask),
                       in_head=inp.in_head, full_logp=_masked(inp.full_logp, mask),
                       full_ref_logp=_masked(inp.full_ref_logp, mask))
        opt = KLOptions(s_min=kl_cfg.s_min, s_max=kl_cfg.s_max if kl_cfg.s_max > 0 else math.inf,
                        truncated=kl_cfg.truncated)  # a family without a weight or a head states 0 / False
        kl_full = KL_ESTIMATORS[kl_cfg.estimator](kin, opt)  # [B, T] value + exact-form gradient
        kl_val = kl_full.detach()
        if kl_cfg.placement == "loss":
            if cfg.surrogate == "reinforce" and kl_cfg.estimator in RPG_ESTIMATORS:
                kl_tok = rpg_score_coef(kl_cfg.estimator, kin) * logp  # same gradient as kl_full
            else:
                kl_tok = kl_full
        elif kl_cfg.placement == "reward":
            adv = adv - kl_cfg.beta * penalty_to_go(kl_val, mask)
        elif kl_cfg.placement == "advantage":
            adv = adv - kl_cfg.beta * rpg_advantage_penalty(kl_cfg.estimator, kin)
        else:
            raise ValueError(f"unknown KL placement {kl_cfg.placement!r}. Valid choices: loss, reward, advantage")
    return adv, kl_tok, kl_val


def _rollout_correction(cfg, inp: LossInputs, pg: Tensor, old: Tensor, mask: Tensor, logp: Tensor,
                        adv: Tensor) -> tuple[Tensor, dict]:
    """pg_t * w_t, w_t = W_t M_t from pi_old / mu (``AlgoConfig.tis_cap`` / ``mask_*``, `tether.algo.correction`),
    and the correction's metrics; ``pg`` unchanged when the correction is off, with the ``rollout_corr/*``
    metrics of mu against pi_old all the same whenever the engine's log-probs are given (``old`` is pi_old:
    the recomputed one, or sg(pi) on-policy), else ``{}``. ``adv`` is the advantage pg uses (OPSM reads its
    sign), ``logp`` the current policy (OPSM, detached)."""
    corr_metrics = {}
    if correction_on(cfg):  # rollout correction: re-weight the samples from the engine's mu to pi_old
        if inp.sampler_logp is None or inp.old_logp is None:
            raise ValueError("algo.tis_cap > 0 / algo.mask_* need the engine's log-probs (sampler_logp) and the "
                             "trainer's recomputed pi_old (old_logp)")
        w, corr_metrics = correction_weights(old, inp.sampler_logp, mask, cfg.tis_cap, cfg.tis_mode,
                                             correction_masks(cfg), logp=logp, adv=adv)
        pg = pg * w.to(pg.dtype)
    elif inp.sampler_logp is not None:  # no correction: the mismatch is measured (ESS, k1...), pg left as it is
        _, corr_metrics = correction_weights(old, inp.sampler_logp, mask, 0.0)
    return pg, corr_metrics


def _token_mean(x: Tensor, mask: Tensor, logp: Tensor) -> Tensor:
    """sum_t mask_t x_t / max(sum_t mask_t, 1), in logp's dtype (no gradient: call under no_grad)."""
    n = mask.sum().clamp_min(1).to(logp.dtype)
    return torch.where(mask, x.to(logp.dtype), torch.zeros((), dtype=logp.dtype, device=logp.device)).sum() / n


def _loss_metrics(cfg, logp: Tensor, mask: Tensor, region: RegionOut, pg: Tensor, agg: dict) -> dict:
    """The policy term's metrics (call under no_grad): pg_loss aggregated like the loss, the
    trust region's clip fractions and the ratio rho = pi/pi_old (mean, max, min over the mask;
    max = min = 1 without a token), and the token count."""
    r = region.ratio.detach()
    inf = torch.tensor(math.inf, dtype=r.dtype, device=r.device)
    one = torch.ones((), dtype=r.dtype, device=r.device)
    any_tok = mask.any()
    return {
        "pg_loss": aggregate(pg.detach(), mask, cfg.aggregation, **agg),
        "clip_frac_low": _token_mean(region.low, mask, logp),
        "clip_frac_high": _token_mean(region.high, mask, logp),
        "clip_frac_dual": _token_mean(region.dual, mask, logp),
        "clip_frac": _token_mean(~region.keep | region.high, mask, logp),
        "ratio_mean": _token_mean(r, mask, logp),
        "ratio_max": torch.where(any_tok, torch.where(mask, r, -inf).max(), one),
        "ratio_min": torch.where(any_tok, torch.where(mask, r, inf).min(), one),
        "n_tokens": mask.sum().to(logp.dtype),
    }
