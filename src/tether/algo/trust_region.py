"""Trust regions: which tokens' gradients pass, as a sign-gated feasibility test (ATR-GRPO).

The general clipped objective is ``E_old[min(rho A, clip_C(rho) A)]`` (arXiv 2602.05494).
Its gradient is ``A grad rho`` on every token except those that are outside the region C
*and* would move further out: ``A > 0`` with the token above the region, or ``A < 0`` with
it below. So each region is a per-token **mask** of tokens whose gradient is dropped:

    high = (A > 0) & above(C)         low = (A < 0) & below(C)
    dual = (A < 0) & (rho > c)        (dual clip: the loss is capped at -c A)

| region | feasibility test |
| --- | --- |
| none | always feasible |
| ratio (PPO/GRPO; DAPO clip-higher) | 1 - eps_low <= rho <= 1 + eps_high |
| dual / rpg_clip | ratio, plus the dual cap at c for A < 0 (RPG-Style Clip in REINFORCE form) |
| kl3 | k3(rho) = rho - 1 - log rho <= delta, i.e. l <= rho <= u with Lambert-W bounds |
| tv | abs(pi(y) - pi_old(y)) <= delta (binary TV, DPPO) |
| binary_kl | KL(Bern(pi_old(y)) || Bern(pi(y))) <= delta (binary KL, DPPO) |
| cispo | no mask; REINFORCE weight sg(min(rho, 1 + eps_high)) |
| gspo | sequence ratio (pi(y)/pi_old(y))^(1/|y|) inside the ratio interval |
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from .registry import Registry


@dataclass
class RegionConfig:
    """Trust-region settings. Each field is read only by the regions named in its comment."""

    kind: str = "ratio"  # none | ratio | dual | rpg_clip | kl3 | tv | binary_kl | cispo | gspo
    eps_low: float = 0.2  # ratio, dual, rpg_clip, gspo: lower bound 1 - eps_low
    eps_high: float = 0.2  # ratio, dual, rpg_clip, gspo, cispo: upper bound 1 + eps_high (DAPO: 0.28)
    clip_c: float = 0.0  # dual, rpg_clip (required, > 1; RPG: 3); optional for ratio, kl3, tv, binary_kl, gspo:
    # for A < 0 no gradient once rho > c. 0 = off
    delta: float = 0.0  # kl3, tv, binary_kl: the divergence radius (> 0)


@dataclass
class RegionOut:
    """A region's verdict for one batch."""

    ratio: Tensor  # [B, T] the importance ratio the surrogate uses (differentiable)
    keep: Tensor  # [B, T] bool: the token's gradient passes
    weight: Tensor  # [B, T] detached IS weight of the REINFORCE form (sg(ratio), CISPO: truncated)
    low: Tensor  # [B, T] bool: A < 0 and below the region (no gradient)
    high: Tensor  # [B, T] bool: A > 0 and above the region (no gradient; CISPO: weight truncated)
    dual: Tensor  # [B, T] bool: A < 0 and rho > c (no gradient)


RegionFn = Callable[[Tensor, Tensor, Tensor, Tensor, RegionConfig], RegionOut]
# Each region registers whether it reads pi_old (every shipped region does: it clips or weights by
# rho = pi/pi_old); the trainer runs the sampler pass off-policy only when something needs it.
REGIONS: Registry[RegionFn] = Registry("trust region", required=("needs_old_logp",))
REINFORCE_ONLY_REGIONS = ("cispo", "rpg_clip")


# ---------------------------------------------------------------- Lambert W and the KL3 bounds


def lambert_w(z: float, branch: int = 0) -> float:
    """W_k(z), the solution of W e^W = z on branch 0 (W >= -1) or -1 (W <= -1), for real z.

    Halley's iteration from a branch-point series start; accurate to ~1e-15.
    """
    if branch not in (0, -1):
        raise ValueError("branch must be 0 or -1")
    if z < -1.0 / math.e - 1e-15 or (branch == -1 and z >= 0):
        raise ValueError(f"W_{branch}({z}) is not real")
    z = max(z, -1.0 / math.e)
    p = math.sqrt(max(2.0 * (math.e * z + 1.0), 0.0))  # series in p near the branch point -1/e
    if branch == 0:
        w = -1.0 + p - p * p / 3.0 + 11.0 / 72.0 * p**3 if z < 0.5 else math.log1p(z)
    else:
        w = -1.0 - p - p * p / 3.0 - 11.0 / 72.0 * p**3 if z > -0.25 else math.log(-z) - math.log(-math.log(-z))
    for _ in range(100):
        ew = math.exp(w)
        f = w * ew - z
        if f == 0.0 or w == -1.0:
            break
        step = f / (ew * (w + 1.0) - (w + 2.0) * f / (2.0 * w + 2.0))
        w -= step
        if abs(step) <= 1e-15 * (1.0 + abs(w)):
            break
    return w


def kl3_bounds(delta: float) -> tuple[float, float]:
    """[l, u] = roots of t - log t = 1 + delta: l = -W0(-e^(-1-delta)), u = -W_-1(-e^(-1-delta)).

    The KL3 region k3(rho) <= delta is exactly the ratio interval [l, u]; near 1 it is
    1 -/+ sqrt(2 delta) + 2 delta/3, asymmetric in the direction of clip-higher.
    """
    if not delta > 0:
        raise ValueError(f"kl3 trust region needs delta > 0, got {delta}")
    z = -math.exp(-1.0 - delta)
    return -lambert_w(z, 0), -lambert_w(z, -1)


def kl3_delta_for(eps_low: float, eps_high: float) -> float:
    """The delta whose KL3 interval best matches [1 - eps_low, 1 + eps_high] (least squares on the bounds)."""
    lo, hi = 1e-6, 2.0
    target = (1.0 - eps_low, 1.0 + eps_high)

    def err(d: float) -> float:
        low, up = kl3_bounds(d)
        return (low - target[0]) ** 2 + (up - target[1]) ** 2

    for _ in range(200):  # golden-section search; err is unimodal in delta
        a = hi - (hi - lo) / 1.618033988749895
        b = lo + (hi - lo) / 1.618033988749895
        if err(a) < err(b):
            hi = b
        else:
            lo = a
    return 0.5 * (lo + hi)


# ---------------------------------------------------------------- regions


def _gate(ratio: Tensor, adv: Tensor, below: Tensor, above: Tensor, cfg: RegionConfig,
          weight: Optional[Tensor] = None) -> RegionOut:
    """Sign-gate the out-of-region tests and add the dual cap."""
    low = below & (adv < 0)
    high = above & (adv > 0)
    if cfg.clip_c > 0:
        dual = (adv < 0) & (ratio.detach() > cfg.clip_c) & ~low
    else:
        dual = torch.zeros_like(low)
    keep = ~(low | high | dual)
    return RegionOut(ratio, keep, ratio.detach() if weight is None else weight, low, high, dual)


def _interval(ratio: Tensor, adv: Tensor, lo: float, hi: float, cfg: RegionConfig) -> RegionOut:
    r = ratio.detach()
    return _gate(ratio, adv, r < lo, r > hi, cfg)


@REGIONS.register("none", needs_old_logp=True)
def region_none(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg: RegionConfig) -> RegionOut:
    """No trust region: plain importance-weighted policy gradient."""
    rho = torch.exp(logp - old)
    f = torch.zeros_like(mask, dtype=torch.bool)
    return RegionOut(rho, ~f, rho.detach(), f, f, f)


@REGIONS.register("ratio", needs_old_logp=True)
def region_ratio(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg: RegionConfig) -> RegionOut:
    """1 - eps_low <= rho <= 1 + eps_high (PPO/GRPO; DAPO's clip-higher with eps_high > eps_low)."""
    return _interval(torch.exp(logp - old), adv, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high, cfg)


@REGIONS.register("dual", needs_old_logp=True)
def region_dual(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg: RegionConfig) -> RegionOut:
    """Ratio region plus dual clip: for A < 0 the objective is capped at c A (no gradient once rho > c)."""
    if not cfg.clip_c > 1:
        raise ValueError(f"dual clip needs clip_c > 1, got {cfg.clip_c}")
    return region_ratio(logp, old, adv, mask, cfg)


@REGIONS.register("rpg_clip", needs_old_logp=True)
def region_rpg_clip(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg: RegionConfig) -> RegionOut:
    """RPG-Style Clip: A' >= 0 passes while rho <= 1 + eps_high; A' < 0 while 1 - eps_low <= rho <= c.

    It is the dual region applied to the REINFORCE form -sg(A' rho) log pi.
    """
    return region_dual(logp, old, adv, mask, cfg)


@REGIONS.register("kl3", needs_old_logp=True)
def region_kl3(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg: RegionConfig) -> RegionOut:
    """k3(rho) = rho - 1 - log rho <= delta, evaluated as the ratio interval [l, u] (ATR-GRPO)."""
    lo, hi = kl3_bounds(cfg.delta)
    return _interval(torch.exp(logp - old), adv, lo, hi, cfg)


@REGIONS.register("tv", needs_old_logp=True)
def region_tv(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg: RegionConfig) -> RegionOut:
    """abs(pi(y) - pi_old(y)) <= delta on the sampled token (binary total variation, DPPO)."""
    if not cfg.delta > 0:
        raise ValueError(f"tv trust region needs delta > 0, got {cfg.delta}")
    p, q = logp.detach().exp(), old.exp()
    return _gate(torch.exp(logp - old), adv, q - p > cfg.delta, p - q > cfg.delta, cfg)


def binary_kl(p_old: Tensor, p: Tensor) -> Tensor:
    """KL(Bern(p_old) || Bern(p)) = p_old log(p_old/p) + (1 - p_old) log((1 - p_old)/(1 - p))."""
    eps = torch.finfo(p.dtype).tiny
    a = torch.xlogy(p_old, p_old) - p_old * torch.log(p.clamp_min(eps))
    b = torch.xlogy(1 - p_old, 1 - p_old) - (1 - p_old) * torch.log((1 - p).clamp_min(eps))
    return a + b


@REGIONS.register("binary_kl", needs_old_logp=True)
def region_binary_kl(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg: RegionConfig) -> RegionOut:
    """KL(Bern(pi_old(y)) || Bern(pi(y))) <= delta on the sampled token (binary KL, DPPO)."""
    if not cfg.delta > 0:
        raise ValueError(f"binary_kl trust region needs delta > 0, got {cfg.delta}")
    p, q = logp.detach().exp(), old.exp()
    out = binary_kl(q, p) > cfg.delta
    return _gate(torch.exp(logp - old), adv, out & (p < q), out & (p > q), cfg)


@REGIONS.register("cispo", needs_old_logp=True)
def region_cispo(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg: RegionConfig) -> RegionOut:
    """No mask; the REINFORCE weight is sg(min(rho, 1 + eps_high)) (CISPO). 'high' counts truncated weights."""
    rho = torch.exp(logp - old)
    r = rho.detach()
    f = torch.zeros_like(mask, dtype=torch.bool)
    return RegionOut(rho, ~f, r.clamp(max=1.0 + cfg.eps_high), f, r > 1.0 + cfg.eps_high, f)


@REGIONS.register("gspo", needs_old_logp=True)
def region_gspo(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg: RegionConfig) -> RegionOut:
    """Sequence ratio s = exp(mean_t (logp - old)) clipped to [1 - eps_low, 1 + eps_high] (GSPO).

    Per token the ratio is sg(s) * r_t, so its gradient is s grad log pi(y_t): GSPO-token.
    """
    m = mask.to(logp.dtype)
    n = m.sum(-1, keepdim=True).clamp_min(1.0)
    log_s = ((logp.detach() - old) * m).sum(-1, keepdim=True) / n  # [B, 1]
    s = torch.exp(log_s).expand_as(logp)
    tok_ratio = s * torch.exp(logp - logp.detach())
    return _gate(tok_ratio, adv, s < 1.0 - cfg.eps_low, s > 1.0 + cfg.eps_high, cfg)
