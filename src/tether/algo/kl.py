"""Token-level KL estimators between the policy ``pi`` and the anchor ``pi_a``.

Every estimator returns a per-token tensor ``[B, T]`` whose *value* estimates a divergence
and whose *autograd gradient* estimates a divergence gradient, both in expectation over
tokens drawn from the sampler ``pi_old``. Notation (ALGORITHMS.md):

    d   = logp - ref                 log pi/pi_a at the sampled token
    w   = exp(ref - logp)            pi_a/pi
    r   = exp(logp - sg(logp))       value 1, gradient grad logp (turns a value into REINFORCE)
    s   = sg(pi/pi_old), clipped     importance weight for the sampler; 1 on-policy
    rho = exp(logp - old)            the differentiable importance ratio
    c   = exp(ref - old)             pi_a/pi_old (a constant; 1 when the anchor is the sampler)

Sampled estimators (``k1``..``k5``) are the classic on-policy estimators multiplied by ``s``,
so ``E_old[s f] = E_pi[f]`` and ``E_old[s grad f] = E_pi[grad f]``: each keeps, off-policy,
exactly the value and gradient claims it has on-policy (table below). The ``rpg_*`` and
``grpo_k3*`` entries are the off-policy objectives of RPG (arXiv 2505.17508) and GRPO.

| name | value estimates | gradient estimates |
| --- | --- | --- |
| k1 | KL(pi||pi_a) | 0 |
| k2 | E[d^2/2] (biased) | grad KL(pi||pi_a) |
| k3 | KL(pi||pi_a) | grad KL(pi_a||pi) |
| k3pp, k4 | KL(pi||pi_a) | grad KL(pi||pi_a) |
| k5 | KL(pi_a||pi) | grad KL(pi_a||pi) |
| exact_rev / exact_fwd | exact, full vocabulary | exact |
| topk_rev / topk_fwd | exact head + unbiased tail | unbiased at every k |
| topk_*_centered | exact head + unbiased tail | unbiased at every k; zero per sample at pi = pi_a |
| topk_*_legacy | unbiased | biased by grad pi(q) for 0<k<|V| (public code; kept to show it) |
| grpo_k3 | E_old[k3], no IS weight (GRPO as published) | not the gradient of any KL |
| grpo_k3_corrected | UKL(pi||pi_a) | grad UKL(pi||pi_a) |
| rpg_fkl / rpg_ufkl | KL / UKL(pi_a||pi) | exact gradient |
| rpg_rkl / rpg_urkl | KL / UKL(pi||pi_a) | exact gradient |
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from .registry import Registry


@dataclass
class KLInputs:
    """What a chunked log-prob engine produces for one batch of response tokens.

    Only ``exact_*`` needs the full ``[B, T, V]`` log-probs; top-k needs ``k`` per token.
    """

    logp: Tensor  # [B, T] log pi(y_t|h_t) of the policy being trained (differentiable)
    ref_logp: Tensor  # [B, T] log pi_a(y_t|h_t) of the anchor (no grad)
    old_logp: Optional[Tensor] = None  # [B, T] log pi_old(y_t|h_t) of the sampler; None = on-policy
    head_logp: Optional[Tensor] = None  # [B, T, k] log pi at the head ids q (differentiable)
    head_ref_logp: Optional[Tensor] = None  # [B, T, k] log pi_a at the head ids q
    in_head: Optional[Tensor] = None  # [B, T] bool, y_t is one of the head ids q
    full_logp: Optional[Tensor] = None  # [B, T, V] exact estimators only (differentiable)
    full_ref_logp: Optional[Tensor] = None  # [B, T, V] exact estimators only

    def old(self) -> Tensor:
        """Sampler log-probs; on-policy (None) means pi_old = sg(pi)."""
        return self.logp.detach() if self.old_logp is None else self.old_logp


@dataclass
class KLOptions:
    """Estimator options. Defaults give the unbiased estimators of ALGORITHMS.md."""

    s_min: float = 0.0  # lower clip of the sampling weight s = sg(pi/pi_old) (a documented bias if > 0)
    s_max: float = math.inf  # upper clip of s (a documented bias if finite)
    truncated: bool = False  # top-k only: drop the tail term (KL over the head q only)


# An estimator maps (inputs, options) -> per-token loss term [B, T]. Each registers the inputs it
# needs beyond the sampled token's log-probs (one of these names), so the trainer knows which
# passes to run:
#   sampled       logp / ref_logp (/ old_logp) at the sampled token only
#   sampler_topk  + a head q = the sampler's top-k ids at each position, with pi and pi_a there
#   anchor_topk   + a head q = the anchor's top-k ids at each position, with pi and pi_a there
#   full_vocab    + pi and pi_a over the whole vocabulary (full_logp, full_ref_logp)
KLFn = Callable[[KLInputs, KLOptions], Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator", required=("inputs",))

# Which divergence each estimator's value estimates ("reverse" = KL(pi||pi_a)), used by
# tests and docs; "none" means no divergence (k2's value, grpo_k3 off-policy).
KL_DIRECTION = {
    "k1": "reverse", "k2": "reverse", "k3": "reverse", "k3pp": "reverse", "k4": "reverse",
    "k5": "forward", "exact_rev": "reverse", "exact_fwd": "forward",
    "topk_rev": "reverse", "topk_fwd": "forward",
    "topk_rev_legacy": "reverse", "topk_fwd_legacy": "forward",
    "topk_rev_centered": "reverse", "topk_fwd_centered": "forward",
    "grpo_k3": "reverse", "grpo_k3_corrected": "reverse",
    "rpg_fkl": "forward", "rpg_ufkl": "forward", "rpg_rkl": "reverse", "rpg_urkl": "reverse",
}
RPG_ESTIMATORS = ("rpg_fkl", "rpg_rkl", "rpg_ufkl", "rpg_urkl")  # have a REINFORCE form (rpg_score_coef)


def score(logp: Tensor) -> Tensor:
    """r = exp(logp - sg(logp)): value 1, gradient grad logp."""
    return torch.exp(logp - logp.detach())


def sampling_weight(inp: KLInputs, opt: KLOptions) -> Tensor:
    """s = clip(sg(pi/pi_old), s_min, s_max): corrects E_old to E_pi for a per-token term."""
    s = torch.exp(inp.logp.detach() - inp.old())
    if opt.s_min > 0 or math.isfinite(opt.s_max):
        s = s.clamp(min=opt.s_min, max=opt.s_max)
    return s


# ---------------------------------------------------------------- sampled estimators


def _k3(log_w: Tensor) -> Tensor:
    """k3(w) = w - 1 - log w >= 0 (differentiable in log w)."""
    return torch.exp(log_w) - 1.0 - log_w


@KL_ESTIMATORS.register("k1", inputs="sampled")
def k1(inp: KLInputs, opt: KLOptions) -> Tensor:
    """s * d. Value: KL(pi||pi_a). Gradient: 0 in expectation (useless as a loss)."""
    return sampling_weight(inp, opt) * (inp.logp - inp.ref_logp)


@KL_ESTIMATORS.register("k2", inputs="sampled")
def k2(inp: KLInputs, opt: KLOptions) -> Tensor:
    """s * d^2/2. Value: biased. Gradient: grad KL(pi||pi_a)."""
    return sampling_weight(inp, opt) * 0.5 * (inp.logp - inp.ref_logp) ** 2


@KL_ESTIMATORS.register("k3", inputs="sampled")
def k3(inp: KLInputs, opt: KLOptions) -> Tensor:
    """s * (w - 1 - log w), w = pi_a/pi (GRPO's low_var_kl). Value: KL(pi||pi_a). Gradient: grad KL(pi_a||pi)."""
    return sampling_weight(inp, opt) * _k3(inp.ref_logp - inp.logp)


@KL_ESTIMATORS.register("k3pp", inputs="sampled")
def k3pp(inp: KLInputs, opt: KLOptions) -> Tensor:
    """s * r * (w - 1 - log w). Value: KL(pi||pi_a). Gradient: grad KL(pi||pi_a) (k3 made reverse)."""
    return sampling_weight(inp, opt) * score(inp.logp) * _k3(inp.ref_logp - inp.logp)


@KL_ESTIMATORS.register("k4", inputs="sampled")
def k4(inp: KLInputs, opt: KLOptions) -> Tensor:
    """s * r * sg(d). Value: KL(pi||pi_a). Gradient: grad KL(pi||pi_a)."""
    return sampling_weight(inp, opt) * _tail_k4(inp.logp, inp.ref_logp)


@KL_ESTIMATORS.register("k5", inputs="sampled")
def k5(inp: KLInputs, opt: KLOptions) -> Tensor:
    """s * (sg(w) log w + log r). Value: KL(pi_a||pi). Gradient: grad KL(pi_a||pi)."""
    return sampling_weight(inp, opt) * _tail_k5(inp.logp, inp.ref_logp)


# ---------------------------------------------------------------- exact estimators


def _require_full(inp: KLInputs, name: str) -> None:
    if inp.full_logp is None or inp.full_ref_logp is None:
        raise ValueError(f"KL estimator {name!r} needs full-vocabulary log-probs (full_logp, full_ref_logp)")


@KL_ESTIMATORS.register("exact_rev", inputs="full_vocab")
def exact_rev(inp: KLInputs, opt: KLOptions) -> Tensor:
    """sum_v pi(v) [log pi(v) - log pi_a(v)]: the exact KL(pi||pi_a) at each state."""
    _require_full(inp, "exact_rev")
    return (inp.full_logp.exp() * (inp.full_logp - inp.full_ref_logp)).sum(-1)


@KL_ESTIMATORS.register("exact_fwd", inputs="full_vocab")
def exact_fwd(inp: KLInputs, opt: KLOptions) -> Tensor:
    """sum_v pi_a(v) [log pi_a(v) - log pi(v)]: the exact KL(pi_a||pi) at each state."""
    _require_full(inp, "exact_fwd")
    return (inp.full_ref_logp.exp() * (inp.full_ref_logp - inp.full_logp)).sum(-1)


# ---------------------------------------------------------------- top-k estimators (EMA-PG)


def _tail_k4(logp: Tensor, ref: Tensor) -> Tensor:
    """r * sg(d): value d, gradient d grad logp (the public code's reverse tail)."""
    return score(logp) * (logp - ref).detach()


def _tail_k5(logp: Tensor, ref: Tensor) -> Tensor:
    """sg(w) log w + log r: value w log w, gradient (1 - w) grad logp (the public code's forward tail)."""
    log_w = ref - logp
    return torch.exp(log_w.detach()) * log_w + (logp - logp.detach())


def _tail_rev(logp: Tensor, ref: Tensor) -> Tensor:
    """r * sg(d) + (r - 1): value d, gradient (d + 1) grad logp.

    The +1 restores grad pi(v) for v outside the head, which k4 drops; with it the tail's
    expectation has the gradient of sum_{v not in q} pi(v) d(v) exactly.
    """
    r = score(logp)
    return r * (logp - ref).detach() + (r - 1.0)


def _tail_fwd(logp: Tensor, ref: Tensor) -> Tensor:
    """sg(w) log w + log r - (r - 1): value w log w, gradient -w grad logp."""
    return _tail_k5(logp, ref) - (score(logp) - 1.0)


def _topk(inp: KLInputs, opt: KLOptions, name: str, reverse: bool, tail: Callable, centered: bool = False) -> Tensor:
    if inp.head_logp is None or inp.head_ref_logp is None or inp.in_head is None:
        raise ValueError(f"KL estimator {name!r} needs head_logp, head_ref_logp and in_head")
    lp, la = inp.head_logp, inp.head_ref_logp  # [B, T, k]
    if reverse:  # head: sum_{j in q} pi(j) [log pi(j) - log pi_a(j)], differentiated through pi(j)
        # centered: through pi(j) only, gradient sum_q grad pi(j) d(j) (the +1 of d(pi d) = (d + 1) d pi dropped)
        head = (lp.exp() * ((lp - la).detach() if centered else (lp - la))).sum(-1)
    else:  # head: sum_{j in q} pi_a(j) [log pi_a(j) - log pi(j)]
        head = (la.exp() * (la - lp)).sum(-1)
        if centered:  # + sum_q (pi - sg(pi)): value 0, gradient + sum_q grad pi(j) (the baseline's head part)
            pi = lp.exp()
            head = head + (pi - pi.detach()).sum(-1)
    if opt.truncated:
        return head
    out = (~inp.in_head).to(lp.dtype)  # [B, T] 1 when y_t is in the tail
    return head + sampling_weight(inp, opt) * out * tail(inp.logp, inp.ref_logp)


@KL_ESTIMATORS.register("topk_rev", inputs="sampler_topk")
def topk_rev(inp: KLInputs, opt: KLOptions) -> Tensor:
    """sum_{q} pi (log pi - log pi_a) + s 1[y not in q] (r sg(d) + r - 1); q = sampler's top-k.
    Unbiased KL(pi||pi_a), value and gradient."""
    return _topk(inp, opt, "topk_rev", True, _tail_rev)


@KL_ESTIMATORS.register("topk_fwd", inputs="anchor_topk")
def topk_fwd(inp: KLInputs, opt: KLOptions) -> Tensor:
    """sum_{q} pi_a (log pi_a - log pi) + s 1[y not in q] (sg(w) log w + log r - r + 1); q = anchor's top-k.
    Unbiased KL(pi_a||pi)."""
    return _topk(inp, opt, "topk_fwd", False, _tail_fwd)


@KL_ESTIMATORS.register("topk_rev_centered", inputs="sampler_topk")
def topk_rev_centered(inp: KLInputs, opt: KLOptions) -> Tensor:
    """sum_{q} pi sg(log pi - log pi_a) + s 1[y not in q] r sg(d): topk_rev with the baseline -1.

    The gradient of KL(pi||pi_a) is sum_v grad pi(v) (d(v) + 1) = sum_v grad pi(v) d(v), since
    sum_v grad pi(v) = 0. topk_rev estimates the first form (the head's (d + 1) grad pi, the tail's
    (d + 1) grad log pi), whose +1 parts cancel only in expectation: at pi = pi_a each sample still
    carries grad pi(q) + 1[y not in q] grad log pi(y). This one estimates the second (head d grad pi,
    tail d grad log pi: the k4 tail), so it is unbiased at every k as well, and its gradient is zero
    for every sample where the policy is its anchor (a step with no reward signal then stays put).
    """
    return _topk(inp, opt, "topk_rev_centered", True, _tail_k4, centered=True)


@KL_ESTIMATORS.register("topk_fwd_centered", inputs="anchor_topk")
def topk_fwd_centered(inp: KLInputs, opt: KLOptions) -> Tensor:
    """sum_{q} [pi_a (log pi_a - log pi) + pi - sg(pi)] + s 1[y not in q] (sg(w) log w + log r): baseline 1.

    The gradient of KL(pi_a||pi) is -sum_v w(v) grad pi(v) = -sum_v (w(v) - 1) grad pi(v): head
    -(w - 1) grad pi over q, tail (1 - w) grad log pi (the k5 tail). Unbiased at every k, zero per
    sample at pi = pi_a (w = 1).
    """
    return _topk(inp, opt, "topk_fwd_centered", False, _tail_k5, centered=True)


@KL_ESTIMATORS.register("topk_rev_legacy", inputs="sampler_topk")
def topk_rev_legacy(inp: KLInputs, opt: KLOptions) -> Tensor:
    """Public EMA-PG code: reverse top-k with a k4 tail. Value unbiased; gradient biased by grad pi(q) for 0<k<|V|."""
    return _topk(inp, opt, "topk_rev_legacy", True, _tail_k4)


@KL_ESTIMATORS.register("topk_fwd_legacy", inputs="anchor_topk")
def topk_fwd_legacy(inp: KLInputs, opt: KLOptions) -> Tensor:
    """Public EMA-PG code: forward top-k with a k5 tail. Value unbiased; gradient biased for 0<k<|V|."""
    return _topk(inp, opt, "topk_fwd_legacy", False, _tail_k5)


# ---------------------------------------------------------------- GRPO and RPG (off-policy objectives)


def ratio(inp: KLInputs) -> Tensor:
    """rho = pi/pi_old, differentiable (1 in value on-policy)."""
    return torch.exp(inp.logp - inp.old())


def anchor_weight(inp: KLInputs) -> Tensor:
    """c = pi_a/pi_old: reweights sampler draws to anchor draws (a constant; 1 for the iterative anchor)."""
    return torch.exp(inp.ref_logp - inp.old())


@KL_ESTIMATORS.register("grpo_k3", inputs="sampled")
def grpo_k3(inp: KLInputs, opt: KLOptions) -> Tensor:
    """k3(pi_a/pi) with no importance weight (GRPO as published). Off-policy its gradient is no KL's gradient."""
    return _k3(inp.ref_logp - inp.logp)


@KL_ESTIMATORS.register("grpo_k3_corrected", inputs="sampled")
def grpo_k3_corrected(inp: KLInputs, opt: KLOptions) -> Tensor:
    """rho * k3(pi_a/pi), rho differentiable. E_old = UKL(pi||pi_a); gradient = grad UKL(pi||pi_a) exactly."""
    return ratio(inp) * _k3(inp.ref_logp - inp.logp)


@KL_ESTIMATORS.register("rpg_fkl", inputs="sampled")
def rpg_fkl(inp: KLInputs, opt: KLOptions) -> Tensor:
    """c * (log pi_a - log pi). E_old = KL(pi_a||pi), exact gradient (RPG FKL; -log pi when pi_a = pi_old)."""
    return anchor_weight(inp) * (inp.ref_logp - inp.logp)


@KL_ESTIMATORS.register("rpg_rkl", inputs="sampled")
def rpg_rkl(inp: KLInputs, opt: KLOptions) -> Tensor:
    """rho * log(pi/pi_a). E_old = KL(pi||pi_a), exact gradient (RPG RKL: w log w)."""
    return ratio(inp) * (inp.logp - inp.ref_logp)


@KL_ESTIMATORS.register("rpg_ufkl", inputs="sampled")
def rpg_ufkl(inp: KLInputs, opt: KLOptions) -> Tensor:
    """c * k3(pi/pi_a). E_old = UKL(pi_a||pi), exact gradient (RPG UFKL: w - log w - 1)."""
    return anchor_weight(inp) * _k3(inp.logp - inp.ref_logp)


@KL_ESTIMATORS.register("rpg_urkl", inputs="sampled")
def rpg_urkl(inp: KLInputs, opt: KLOptions) -> Tensor:
    """rho (log(pi/pi_a) - 1) + c. E_old = UKL(pi||pi_a), exact gradient (RPG URKL: w log w - w)."""
    return ratio(inp) * (inp.logp - inp.ref_logp - 1.0) + anchor_weight(inp)


def rpg_score_coef(name: str, inp: KLInputs) -> Tensor:
    """g with grad(KL term) = g * grad log pi, for the REINFORCE form ``sg(g) * log pi`` (no grad).

    fkl: -c;  rkl: rho (d + 1);  ufkl: rho - c;  urkl: rho d.
    """
    with torch.no_grad():
        rho = torch.exp(inp.logp - inp.old())
        d = inp.logp - inp.ref_logp
        if name == "rpg_fkl":
            return -anchor_weight(inp)
        if name == "rpg_rkl":
            return rho * (d + 1.0)
        if name == "rpg_ufkl":
            return rho - anchor_weight(inp)
        if name == "rpg_urkl":
            return rho * d
    raise ValueError(f"{name!r} has no REINFORCE form; choose one of {', '.join(RPG_ESTIMATORS)}")


def rpg_advantage_penalty(name: str, inp: KLInputs) -> Tensor:
    """C_KL of RPG-Style Clip (the KL folded into the advantage): urkl: log(pi/pi_a); rkl: log(pi/pi_a) + 1."""
    d = (inp.logp - inp.ref_logp).detach()
    if name == "rpg_urkl":
        return d
    if name == "rpg_rkl":
        return d + 1.0
    raise ValueError(
        f"KL placement 'advantage' (RPG-Style Clip) needs estimator rpg_urkl or rpg_rkl, got {name!r}; "
        "for rpg_fkl/rpg_ufkl keep the KL as a loss term (placement 'loss')"
    )


# Derived from the registrations, for validation and docs.
TOPK_ESTIMATORS = KL_ESTIMATORS.where(inputs="sampler_topk") + KL_ESTIMATORS.where(inputs="anchor_topk")
EXACT_ESTIMATORS = KL_ESTIMATORS.where(inputs="full_vocab")
