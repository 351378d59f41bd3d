"""Rollout correction: re-weight and mask samples drawn by a behaviour policy mu != pi_old.

Three policies meet in an update (asynchronous or engine-sampled RL):

    mu       the behaviour policy that drew the tokens (the engine's log-probs, ``sampler_logp``;
             another kernel / precision, or a stale copy of the weights)
    pi_old   the proximal policy: the trainer's own forward at the rollout's weights (``old_logp``)
    pi       the policy being optimized (``logp``); the trust region is around pi_old

The loss is built around pi_old (rho = pi / pi_old, the trust region, the KL), so the samples
are moved from mu to pi_old. Per response token, r_t = pi_old(y_t | y_<t) / mu(y_t | y_<t), and
the policy-gradient term pg_t is multiplied by the constant (detached) weight

    w_t = W_t * M_t

**The IS weight W** (``AlgoConfig.tis_cap`` = C, ``tis_mode``; C = 0: W = 1, no weight; C = inf:
untruncated):

    token     W_t = min(r_t, C)                          (Yao et al.'s token-level TIS)
    sequence  W_t = min(prod_s r_s, C)  for every t of y  (sequence-level TIS)
    mask      W_t = min(r_t, C) * 1[g(y) <= C],  g(y) = exp(mean_s log r_s)   (kept as it was)

**The masks M** (``AlgoConfig.mask_*``, each 0 / none = off; M_t = the product of those on):

    mask_token_low  a, mask_token_high b   M_t = 1[a <= r_t <= b]         token MIS (b = C), IcePop ([a, b])
    mask_seq_high   C                      M = 1[prod_t r_t <= C]         sequence MIS
    mask_geo        C                      M = 1[1/C <= g(y) <= C]        geometric-mean mask (two-sided)
    mask_kl k, mask_kl_max t               M = 1[mean_t k_t(y) <= t]      rejection by k1 / k2 / k3 of
                                           KL(mu || pi_old): k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r
    mask_opsm       delta                  M_t = 0 if A_t < 0 and mean_s log(mu / sg(pi))(y) > delta   (OPSM)

A masked token contributes exactly nothing to the policy-gradient term (weight 0, value and
gradient). Masked IS is IS with a mask at the same threshold: min(r, C) 1[r <= C] = r 1[r <= C],
so token MIS is ``tis_cap: inf`` (or any cap >= C) with ``mask_token_high: C``; AReaL's decoupled
PPO with its ``behav_imp_weight_cap`` is that too (``tether.algo.objectives``).

OPSM (DeepSeek-V3.2) measures the divergence against the *current* policy pi, detached, as
DeepSeek does: the samples it protects against are those the policy being updated has moved
away from (on the first mini-batch pi = pi_old, where it is the k1 rejection restricted to
negative advantages; over later mini-batches and epochs it also sees the drift of pi). A is
the advantage the policy-gradient term uses (after the KL placement).

What each estimates, with g_t = A(y) grad log pi(y_t | y_<t) at pi = pi_old (proofs by exact
enumeration: ``tests/test_correction.py``, ``tests/test_correction_masks.py``):

* ``sequence`` with C = inf is exact importance sampling of whole sequences:
  E_{y ~ mu}[prod_s r_s * sum_t g_t] = E_{y ~ pi_old}[sum_t g_t], the policy gradient
  under pi_old. A finite C trades that exactness for bounded variance. With sequence masks
  (mask_seq_high, mask_geo, mask_kl, mask_opsm with a per-sequence A) it is exactly
  E_{pi_old}[1[y kept] sum_t g_t]: the policy gradient restricted to the kept sequences.
* ``token`` corrects each token's own sampling distribution only: its context (the prefix,
  and the suffix the advantage depends on) stays mu's. It is exact for one-token
  responses (a bandit; with a token mask: the gradient under pi_old restricted to the kept
  tokens); for longer ones it is the low-variance, slightly biased estimator used in
  practice, whose bias vanishes as mu -> pi_old.
* ``mask`` is ``token`` that, in addition, drops sequences whose mismatch is large on
  average; with C = inf it equals ``token``.

**Effective sample size** (`ess_frac`: the metrics ``rollout_corr/ess_frac``, ``seq_ess_frac``, and
``train.lr_scale``). Kish's effective sample size of N weights w_i >= 0, as a fraction of N:

    ESS / N = (sum_i w_i)^2 / (N sum_i w_i^2) = m1^2 / m2,        m_k = (1/N) sum_i w_i^k

It lies in [1/N, 1] (Cauchy-Schwarz; (sum w)^2 >= sum w^2 for w >= 0): exactly 1 when the weights are
all equal (mu = pi_old: every w = 1), 1/N when one weight carries all the mass; over draws from mu it
estimates E_mu[w]^2 / E_mu[w^2] = 1 / (1 + chi^2(pi_old || mu)). The weights are the raw ratios
r = pi_old / mu, before the cap and the masks (how far apart mu and pi_old are, not what the
correction left of it), at two levels:

    token     w_t = r_t over the loss tokens                         (N = their count)
    sequence  w_y = prod_t r_t over each response's loss tokens      (N = responses with a loss token)

The sequence weight is the product, not the geometric mean exp(mean_t log r_t): the product is the
importance weight of the whole response (E_mu[prod_t r_t] = 1; ``tis_mode: sequence`` exactly), so
its ESS is what a sequence-level IS estimate is worth (VCPO's rho_ess); the geometric mean is a
length-normalized statistic (``mask_geo``), not a weight of any estimator (E_mu[g] != 1). The price
is that the sequence ESS falls with the length (log prod_t r_t has about T times a token's variance):
that is the variance of sequence-level IS. log w is clamped at `ESS_LOG_MAX` before exp (float64), so
the sums stay finite; a weight that large dominates any batch either way. A step's value is m1^2 / m2
of the step's means (`mismatch_metrics`), never an average of its micro-batches' ESS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

TIS_MODES = ("token", "sequence", "mask")
ESS_LOG_MAX = 300.0  # log w is clamped here before exp in the ESS moments: N e^600 stays a finite float64
LR_SCALES = ("none", "ess", "seq_ess")  # train.lr_scale: off, or the token / sequence ESS fraction (lr_scale)

# Per-token estimates of KL(mu || pi_old) from log r = log pi_old/mu on tokens drawn from mu
# (Schulman's k1 / k2 / k3): E_mu[k1] = E_mu[k3] = KL(mu || pi_old); k2 is biased, >= 0.
KL_REJECT: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda log_r: -log_r,
    "k2": lambda log_r: 0.5 * log_r ** 2,
    "k3": lambda log_r: torch.expm1(log_r) - log_r,
}


@dataclass(frozen=True)
class Masks:
    """The masks of the correction (module doc); 0 / ``none`` turns each off."""

    token_low: float = 0.0  # a: mask tokens with r_t < a (IcePop's alpha)
    token_high: float = 0.0  # b: mask tokens with r_t > b (token MIS's C; IcePop's beta)
    seq_high: float = 0.0  # C: mask sequences with prod_t r_t > C (sequence MIS)
    geo: float = 0.0  # C: mask sequences whose geometric-mean ratio is outside [1/C, C]
    kl: str = "none"  # k1 | k2 | k3: mask sequences whose mean_t k_t exceeds kl_max
    kl_max: float = 0.0
    opsm: float = 0.0  # delta: mask A < 0 tokens of sequences with mean_t log(mu/sg(pi)) > delta (OPSM)

    def any(self) -> bool:
        return bool(self.token_low or self.token_high or self.seq_high or self.geo or self.kl != "none"
                    or self.opsm)


NO_MASKS = Masks()


def _seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """[B, 1] mean_t x_t over each row's own tokens (0 for a row without any)."""
    n = mask.sum(-1, keepdim=True).clamp_min(1).to(x.dtype)
    return torch.where(mask, x, torch.zeros_like(x)).sum(-1, keepdim=True) / n


def is_weight(log_r: Tensor, mask: Tensor, cap: float, mode: str) -> tuple[Tensor, Tensor, Tensor]:
    """The IS weight W [B, T] (module doc), with ``cut`` (tokens whose weight the cap changed) and
    ``veto`` (tokens ``mode='mask'`` zeroes). cap 0: W = 1 (no IS weight)."""
    zero = torch.zeros((), dtype=log_r.dtype, device=log_r.device)
    no = torch.zeros_like(mask)
    r = log_r.exp()
    if cap == 0:
        return torch.ones_like(r), no, no
    log_cap = math.log(cap) if math.isfinite(cap) else math.inf
    if mode == "token":
        return r.clamp(max=cap), mask & (log_r > log_cap), no
    if mode == "sequence":
        seq = log_r.sum(-1, keepdim=True)  # log prod_s r_s
        return seq.clamp(max=log_cap).exp().expand_as(r), mask & (seq > log_cap), no
    n = mask.sum(-1, keepdim=True).clamp_min(1).to(log_r.dtype)
    veto = (log_r.sum(-1, keepdim=True) / n) > log_cap  # geometric mean > C
    return torch.where(veto, zero, r.clamp(max=cap)), mask & (veto | (log_r > log_cap)), mask & veto


def keep_mask(log_r: Tensor, mask: Tensor, masks: Masks, log_mu_over_pi: Optional[Tensor] = None,
              adv: Optional[Tensor] = None) -> Tensor:
    """M [B, T] bool: the tokens every mask that is on keeps (module doc); bounds are inclusive."""
    keep = mask.clone()
    if masks.token_low:
        keep &= log_r >= math.log(masks.token_low)
    if masks.token_high:
        keep &= log_r <= math.log(masks.token_high)
    if masks.seq_high:
        keep &= torch.where(mask, log_r, torch.zeros_like(log_r)).sum(-1, keepdim=True) <= math.log(masks.seq_high)
    if masks.geo:
        keep &= _seq_mean(log_r, mask).abs() <= math.log(masks.geo)
    if masks.kl != "none":
        keep &= _seq_mean(KL_REJECT[masks.kl](log_r), mask) <= masks.kl_max
    if masks.opsm:
        if log_mu_over_pi is None or adv is None:
            raise ValueError("mask_opsm needs the current log-probs and the advantages")
        keep &= ~((adv < 0) & (_seq_mean(log_mu_over_pi, mask) > masks.opsm))
    return keep


def correction_weights(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float, mode: str = "token",
                       masks: Masks = NO_MASKS, logp: Optional[Tensor] = None,
                       adv: Optional[Tensor] = None) -> tuple[Tensor, dict]:
    """Per-token weights w = W * M [B, T] (detached) and the mismatch metrics of one batch.

    Args:
        old_logp: [B, T] log pi_old at the sampled tokens (the trainer's own forward).
        sampler_logp: [B, T] log mu at the sampled tokens (what the engine reported).
        mask: [B, T] bool, the tokens that enter the loss; other positions are never read.
        cap: C of the IS weight: 0 = no IS weight (W = 1), else >= 1; ``float('inf')`` = untruncated.
        mode: ``token`` | ``sequence`` | ``mask`` (see the module doc).
        masks: the masks M that are on (module doc).
        logp: [B, T] log pi, the current policy (read, detached, by ``masks.opsm`` only).
        adv: [B, T] the advantage of the policy-gradient term (read by ``masks.opsm`` only).

    Returns:
        ``(w, metrics)``: ``w`` is 0 at masked positions; ``metrics`` holds detached 0-d
        tensors under ``rollout_corr/``: ``ratio_mean`` (token mean of r_t), ``ratio_max``,
        ``trunc_frac`` (fraction of tokens whose weight the cap changed: r_t > C for ``token``;
        tokens of sequences whose ratio exceeds C for ``sequence`` and ``mask``; ``mask`` counts
        tokens with r_t > C too), ``kl_k1`` / ``kl_k3`` (token means of k1 = -log r and
        k3 = r - 1 - log r: KL(mu || pi_old) per token), ``ppl_ratio`` (ppl under pi_old / ppl
        under mu = exp(mean_t(log mu - log pi_old)) over the batch's tokens),
        ``masked_token_frac`` (tokens with w = 0: the masks, and ``mode='mask'``'s veto) and
        ``masked_seq_frac`` (responses with tokens, every one of them masked), with ``n_seqs``
        (the responses with tokens: ``masked_seq_frac``'s denominator), ``ess_frac`` and
        ``seq_ess_frac`` (ESS / N of the token and response weights r_t, prod_t r_t: module doc), with
        their moments ``ess_m1``, ``ess_m2``, ``seq_ess_m1``, ``seq_ess_m2``. See `mismatch_metrics`
        for how a training step combines its micro-batches' values.
    """
    if mode not in TIS_MODES:
        raise ValueError(f"unknown rollout-correction mode {mode!r}. Valid choices: {', '.join(TIS_MODES)}")
    mask = mask.bool()
    zero = torch.zeros((), dtype=old_logp.dtype, device=old_logp.device)
    with torch.no_grad():
        samp = sampler_logp.detach().to(old_logp.dtype)
        log_r = torch.where(mask, old_logp.detach() - samp, zero)  # [B, T] log pi_old/mu
        w, cut, veto = is_weight(log_r, mask, cap, mode)
        dropped = veto
        if masks.any():
            log_mu_pi = None if logp is None else torch.where(mask, samp - logp.detach().to(samp.dtype), zero)
            keep = keep_mask(log_r, mask, masks, log_mu_pi, None if adv is None else adv.detach())
            w = torch.where(keep, w, zero)
            dropped = dropped | (mask & ~keep)
        w = torch.where(mask, w, zero)
        metrics = mismatch_metrics(log_r, mask, cut, dropped)
    return w, metrics


def mismatch_metrics(log_r: Tensor, mask: Tensor, cut: Tensor, dropped: Tensor) -> dict:
    """The ``rollout_corr/*`` metrics (``correction_weights``) from log r [B, T] (0 off the mask).

    Each is defined on the batch it is given; in training, on the whole step (every micro-batch and
    mini-batch of the update, each epoch's pass counted; summed over data-parallel ranks), which
    `tether.metrics.UpdateStats` assembles from the micro-batches' values as follows:

        ratio_mean, trunc_frac, kl_k1, kl_k3, masked_token_frac
                          token means / token fractions: the step's sum over its loss tokens divided
                          by its loss-token count (each micro-batch weighted by its ``n_tokens``)
        ratio_max         the largest r_t of the step
        ppl_ratio         exp(the step's kl_k1) = ppl under pi_old / ppl under mu over the step's tokens
                          (not a mean of the micro-batches' ratios: exp is not linear)
        masked_seq_frac   the step's fully masked responses / its responses with a loss token (each
                          micro-batch weighted by its ``n_seqs``, not by its tokens)
        ess_frac          token ESS / N (module doc) = m1^2 / m2 of the step's token means ``ess_m1``,
                          ``ess_m2`` of r_t and r_t^2 (each micro-batch weighted by its tokens): the
                          step's (sum w)^2 / (N sum w^2), whatever the split
        seq_ess_frac      the same of the responses' weights prod_t r_t, from the step's response means
                          ``seq_ess_m1``, ``seq_ess_m2`` (each micro-batch weighted by its ``n_seqs``)
        n_seqs            responses with a loss token: ``masked_seq_frac``'s denominator (a weight,
                          not logged); the four moments are not logged either
    """
    zero = torch.zeros((), dtype=log_r.dtype, device=log_r.device)
    r = log_r.exp()
    count = mask.sum().clamp_min(1).to(r.dtype)
    tok_mean = lambda x: torch.where(mask, x, zero).sum() / count  # noqa: E731
    rows = mask.any(-1)  # [B] responses with a loss token
    k1 = tok_mean(-log_r)
    m1, m2 = ess_moments(log_r, mask)
    s1, s2 = ess_moments(torch.where(mask, log_r, zero).sum(-1), rows)  # w_y = prod_t r_t of each response
    return {
        "rollout_corr/ratio_mean": tok_mean(r),
        "rollout_corr/ratio_max": torch.where(mask.any(), torch.where(mask, r, zero - math.inf).max(), zero + 1),
        "rollout_corr/trunc_frac": cut.sum().to(r.dtype) / count,
        "rollout_corr/kl_k1": k1,
        "rollout_corr/kl_k3": tok_mean(torch.expm1(log_r) - log_r),
        "rollout_corr/ppl_ratio": k1.exp(),
        "rollout_corr/masked_token_frac": (mask & dropped).sum().to(r.dtype) / count,
        "rollout_corr/masked_seq_frac": (rows & ~(mask & ~dropped).any(-1)).sum().to(r.dtype)
        / rows.sum().clamp_min(1).to(r.dtype),
        "rollout_corr/n_seqs": rows.sum().to(r.dtype),
        "rollout_corr/ess_frac": ess_frac(m1, m2),
        "rollout_corr/seq_ess_frac": ess_frac(s1, s2),
        "rollout_corr/ess_m1": m1, "rollout_corr/ess_m2": m2,
        "rollout_corr/seq_ess_m1": s1, "rollout_corr/seq_ess_m2": s2,
    }


def ess_moments(log_w: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    """``(m1, m2)``: the means of w and w^2 over the entries ``keep`` marks (float64; 0, 0 without any),
    with w = exp(min(log_w, ESS_LOG_MAX)) (module doc)."""
    zero = torch.zeros((), dtype=torch.float64, device=log_w.device)
    w = torch.where(keep, log_w.detach().double().clamp(max=ESS_LOG_MAX).exp(), zero)
    n = keep.sum().clamp_min(1).double()
    return w.sum() / n, (w * w).sum() / n


def ess_frac(m1, m2) -> Tensor:
    """ESS / N = m1^2 / m2 = (sum w)^2 / (N sum w^2) from the weights' moments (module doc), float64;
    1 where there is no weight (m2 = 0: no token, or every weight 0), so that an empty batch scales nothing."""
    m1, m2 = torch.as_tensor(m1, dtype=torch.float64), torch.as_tensor(m2, dtype=torch.float64)
    return torch.where(m2 > 0, m1 * m1 / torch.where(m2 > 0, m2, torch.ones_like(m2)), torch.ones_like(m2))


def lr_scale(ess: Tensor, floor: float = 0.0, power: float = 1.0) -> Tensor:
    """The learning-rate multiplier of ``train.lr_scale`` for one optimizer step (VCPO's ESS-guided step
    size, Huang et al. 2026, arXiv 2602.17616):

        lr_step = lr_sched * clip((ESS/N)^p, floor, 1)

    ``ess`` is ESS/N (`ess_frac`) of the tokens (``lr_scale: ess``) or responses (``seq_ess``) of the
    optimizer step's own mini-batch, all its micro-batches and data-parallel ranks; lr_sched is the
    schedule's LR (``tether.schedule``). p = 1 (``train.lr_scale_power``) scales the step like the
    effective batch (the linear rule); p = 1/2 is VCPO's square-root rule for Adam-type optimizers.
    With mu = pi_old every weight is 1, ESS/N = 1 exactly and the step is unchanged, bit for bit.
    """
    return torch.as_tensor(ess, dtype=torch.float64).pow(power).clamp(min=floor, max=1.0)

