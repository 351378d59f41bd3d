"""Three policies in the objective: mu (behaviour: drew the tokens), pi_old (proximal: the trust region's
centre, recomputed by the trainer), pi_theta (current), by exact enumeration.

1. Decoupled PPO (AReaL) is tether's token IS weight with tis_cap = inf on a ratio trust region:
   loss_t = -(pi_old/mu) min(rho A, clip(rho) A), rho = pi/pi_old. Checked against that formula written
   out here, in expectation (the on-policy gradient under pi_old), and for where the clip is centred.
2. RPG's off-policy-correct KL terms weight by ratios against the *sampling* distribution. With
   mu != pi_old, ``kl_sampler: mu`` makes those ratios (s, rho, c) ratios against mu, and the pg term's
   weight pi_old/mu x rho = pi/mu; then every RPG variant, in both forms, has the gradient of
   E_pi[R] - beta D(pi, pi_a) exactly. The anchor (iterative: pi_a = pi_old) and the region stay pi_old's.
"""

import math

import pytest
import torch

from test_objectives import divergence  # the exact divergences (one copy)
from tether.algo import LossInputs, RegionConfig, compute_loss
from tether.config.recipes import recipe, validate

pytestmark = pytest.mark.usefixtures("float64")
V = 5
BETA = 0.37


def dist(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g) * scale).log_softmax(-1)


def grads(scalar, theta):
    return torch.autograd.grad(scalar, theta)[0]


def expected(cfg, lp, lo, lmu, adv, la=None):
    """sum_y mu(y) compute_loss(cfg, one-token response y): the exact expectation under the behaviour policy."""
    one = torch.ones(1, 1, dtype=torch.bool)
    total = 0.0
    for y in range(V):
        out = compute_loss(cfg, LossInputs(
            logp=lp[y].view(1, 1), mask=one, adv=adv[y].view(1), old_logp=lo[y].view(1, 1),
            sampler_logp=lmu[y].view(1, 1), ref_logp=None if la is None else la[y].view(1, 1)))
        total = total + lmu[y].exp() * out.loss
    return total


def decoupled(base="dapo", **over):
    cfg = recipe(base)
    cfg.tis_cap, cfg.tis_mode = math.inf, "token"
    for k, v in over.items():
        setattr(cfg, k, v)
    return validate(cfg)


# ---------------------------------------------------------------- 1. decoupled PPO


def areal_loss(logp, old, samp, adv, mask, eps_lo, eps_hi, cap=None):
    """AReaL's decoupled PPO loss as published, token-mean: -(pi_old/mu) min(rho A, clip(rho) A);
    ``cap``: its behav_imp_weight_cap (weights above it are set to 0)."""
    rho = torch.exp(logp - old)
    behav = torch.exp(old - samp)
    if cap is not None:
        behav = torch.where(behav <= cap, behav, torch.zeros(()))
    tok = -behav * torch.min(rho * adv, rho.clamp(1 - eps_lo, 1 + eps_hi) * adv)
    return torch.where(mask, tok, torch.zeros(())).sum() / mask.sum()


@pytest.mark.parametrize("cap", [None, 1.5])
def test_decoupled_ppo_is_areals_loss(cap):
    """Same gradient as AReaL's loss on every token (clipped or not), and the same value where nothing is clipped."""
    g = torch.Generator().manual_seed(0)
    B, T = 4, 6
    old = -torch.rand(B, T, generator=g) * 2 - 0.1
    samp = old + 0.5 * torch.randn(B, T, generator=g)
    logp = (old + 0.3 * torch.randn(B, T, generator=g)).requires_grad_(True)
    adv = torch.randn(B, generator=g)[:, None].expand(B, T)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 4:] = False
    cfg = decoupled(**({} if cap is None else {"mask_token_high": cap}))
    eps_lo, eps_hi = cfg.region.eps_low, cfg.region.eps_high
    rho = (logp - old).exp().detach()
    assert bool(((rho > 1 + eps_hi) & (adv > 0) & mask).any() and ((rho < 1 - eps_lo) & (adv < 0) & mask).any())
    out = compute_loss(cfg, LossInputs(logp=logp, mask=mask, adv=adv[:, 0], old_logp=old, sampler_logp=samp))
    ref = areal_loss(logp, old, samp, adv, mask, eps_lo, eps_hi, cap)
    assert torch.allclose(grads(out.loss, logp), grads(ref, logp), atol=1e-14, rtol=0)
    at_old = old.clone().requires_grad_(True)  # rho = 1: nothing clipped, the values agree
    out = compute_loss(cfg, LossInputs(logp=at_old, mask=mask, adv=adv[:, 0], old_logp=old, sampler_logp=samp))
    assert float(out.loss.detach()) == pytest.approx(float(areal_loss(old, old, samp, adv, mask, eps_lo, eps_hi, cap)))


def test_decoupled_ppo_at_pi_old_is_the_on_policy_gradient_under_pi_old():
    """E_mu[grad loss] at theta = pi_old equals grad -E_{pi_theta}[A] (exact IS), and not without the weight."""
    theta = dist(1).clone().requires_grad_(True)  # logits: pi_theta = softmax(theta)
    lmu, adv = dist(2, 1.5), torch.randn(V, generator=torch.Generator().manual_seed(3))
    lp = theta.log_softmax(-1)
    g = grads(expected(decoupled(), lp, lp.detach(), lmu, adv), theta)
    g_exact = grads(-(theta.log_softmax(-1).exp() * adv).sum(), theta)
    assert torch.allclose(g, g_exact, atol=1e-13), (g, g_exact)
    lp = theta.log_softmax(-1)
    g_raw = grads(expected(recipe("dapo"), lp, lp.detach(), lmu, adv), theta)
    assert (g_raw - g_exact).abs().max() > 1e-2


def test_decoupled_ppo_clips_around_pi_old_not_mu():
    """Token 1: pi/pi_old = 1.1 (inside [0.8, 1.28]) but pi/mu = 5.5: its gradient passes, -(pi_old/mu) A rho = -5.5.
    Token 2: pi/pi_old = 1.5 (outside) but pi/mu = 1: no gradient. A clip centred on mu would do the opposite."""
    old = torch.tensor([[math.log(0.5), math.log(0.2)]])
    samp = torch.tensor([[math.log(0.1), math.log(0.3)]])
    logp = torch.tensor([[math.log(0.55), math.log(0.3)]], requires_grad=True)
    cfg = decoupled(aggregation="seq-mean-token-sum")
    out = compute_loss(cfg, LossInputs(logp=logp, mask=torch.ones(1, 2, dtype=torch.bool), adv=torch.ones(1),
                                       old_logp=old, sampler_logp=samp))
    g = grads(out.loss, logp)
    assert g[0, 0].item() == pytest.approx(-5.5) and g[0, 1].item() == 0.0
    assert float(out.metrics["clip_frac_high"]) == 0.5  # the trust region's ratio is pi/pi_old


# ---------------------------------------------------------------- 2. RPG's weights against mu


def rpg_cfg(variant, form, kl_sampler):
    cfg = recipe(variant if form == "ratio" else variant.replace("rpg_", "rpg_reinforce_"))
    cfg.kl.beta = BETA
    cfg.region = RegionConfig("none")  # pi_theta is far from pi_old here; the clip is not the point
    cfg.tis_cap = math.inf  # the pg term's weight pi_old/mu (exact for one token)
    cfg.kl_sampler = kl_sampler
    return validate(cfg)


@pytest.fixture(params=["fixed", "iterative"])
def three(request):
    """theta (current), pi_old (proximal), mu (behaviour), pi_a (anchor; = pi_old when iterative), R."""
    theta = dist(10).clone().requires_grad_(True)
    lo, lmu = dist(11), dist(12, 1.5)
    la = lo if request.param == "iterative" else dist(13)
    R = torch.randn(V, generator=torch.Generator().manual_seed(14))
    return theta, lo, lmu, la, R


@pytest.mark.parametrize("variant", ["rpg_fkl", "rpg_rkl", "rpg_ufkl", "rpg_urkl"])
@pytest.mark.parametrize("form", ["ratio", "reinforce"])
def test_rpg_with_mu_weights_has_the_exact_gradient(three, variant, form):
    """E_mu[grad loss] = -grad(E_pi[R] - beta D(pi, pi_a)) at a theta that is neither pi_old nor mu."""
    theta, lo, lmu, la, R = three
    adv_placement = form == "reinforce" and variant in ("rpg_rkl", "rpg_urkl")  # RPG's A' = A - beta C_KL
    # with A' the KL rides on the pg term, whose weight is already against mu: kl_sampler mu has no effect there
    cfg = rpg_cfg(variant, form, "pi_old" if adv_placement else "mu")
    g = grads(expected(cfg, theta.log_softmax(-1), lo, lmu, R, la), theta)
    g_exact = grads(-((theta.log_softmax(-1).exp() * R).sum() - BETA * divergence(variant, theta.log_softmax(-1), la)),
                    theta)
    assert torch.allclose(g, g_exact, atol=1e-13), (g, g_exact)
    if not adv_placement:  # the KL weighted against pi_old, while mu drew the tokens, is wrong
        g_old = grads(expected(rpg_cfg(variant, form, "pi_old"), theta.log_softmax(-1), lo, lmu, R, la), theta)
        assert (g_old - g_exact).abs().max() > 1e-3


@pytest.mark.parametrize("est,value_div,grad_div", [
    ("k1", "rkl", None), ("k3", "rkl", "fkl"), ("k4", "rkl", "rkl"), ("k5", "fkl", "fkl")])
def test_sampled_kl_estimators_weighted_against_mu_keep_their_claims(est, value_div, grad_div):
    """s = sg(pi/mu): E_mu[s f] = E_pi[f] for value and gradient (tether.algo.kl's table), off-policy w.r.t. mu."""
    theta = dist(20).clone().requires_grad_(True)
    lo, lmu, la = dist(21), dist(22, 1.5), dist(23)
    cfg = recipe("grpo")
    cfg.kl.estimator, cfg.kl.beta, cfg.kl_sampler = est, BETA, "mu"
    validate(cfg)
    zero = torch.zeros(V)  # A = 0: only the KL term
    lp = theta.log_softmax(-1)
    one = torch.ones(1, 1, dtype=torch.bool)
    value = sum(lmu[y].exp() * compute_loss(cfg, LossInputs(
        logp=lp[y].view(1, 1).detach(), mask=one, adv=zero[y].view(1), old_logp=lo[y].view(1, 1),
        sampler_logp=lmu[y].view(1, 1), ref_logp=la[y].view(1, 1))).metrics["kl"] for y in range(V))
    kl = {"rkl": lambda lp: (lp.exp() * (lp - la)).sum(), "fkl": lambda lp: (la.exp() * (la - lp)).sum()}
    assert float(value) == pytest.approx(float(kl[value_div](lp.detach())), abs=1e-12)
    g = grads(expected(cfg, lp, lo, lmu, zero, la), theta)
    want = torch.zeros(V) if grad_div is None else BETA * grads(kl[grad_div](theta.log_softmax(-1)), theta)
    assert torch.allclose(g, want, atol=1e-13), (g, want)
    cfg.kl_sampler = "pi_old"  # s = pi/pi_old under draws from mu: the value is off
    value_old = sum(lmu[y].exp() * compute_loss(cfg, LossInputs(
        logp=lp[y].view(1, 1).detach(), mask=one, adv=zero[y].view(1), old_logp=lo[y].view(1, 1),
        sampler_logp=lmu[y].view(1, 1), ref_logp=la[y].view(1, 1))).metrics["kl"] for y in range(V))
    assert abs(float(value_old) - float(kl[value_div](lp.detach()))) > 1e-3
