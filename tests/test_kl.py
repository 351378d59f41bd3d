"""KL estimators, proven by exact enumeration over a 6-token vocabulary (float64, no sampling).

At one state, the "batch" holds every possible sampled token y as its own position, so
    E_{y ~ pi_old}[f(y)] = sum_y pi_old(y) f(y)
is an exact finite sum, and autograd of that sum is the exact expected gradient.
"""

import math

import pytest
import torch

from tether.algo.kl import KL_DIRECTION, KL_ESTIMATORS, TOPK_ESTIMATORS, KLInputs, KLOptions

pytestmark = [pytest.mark.usefixtures("float64"),
              pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")]
V = 6
ATOL = 1e-12


def logits(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * scale


@pytest.fixture(params=["on_policy", "off_policy"])
def setting(request):
    theta = logits(0).requires_grad_(True)
    anchor = logits(1)
    sampler = theta.detach().clone() if request.param == "on_policy" else logits(2, 1.5)
    return request.param, theta, anchor, sampler


def exact_kl(theta, anchor, direction):
    lp, la = theta.log_softmax(-1), anchor.log_softmax(-1)
    if direction == "reverse":
        return (lp.exp() * (lp - la)).sum()
    return (la.exp() * (la - lp)).sum()


def expected(name, theta, anchor, sampler, k=None, opt=None):
    """sum_y pi_old(y) f(y): exact expectation of estimator ``name`` (a differentiable scalar)."""
    lp_full = theta.log_softmax(-1)  # [V]
    la_full = anchor.log_softmax(-1)
    lo_full = sampler.log_softmax(-1)
    y = torch.arange(V)
    inp = KLInputs(logp=lp_full[y][None], ref_logp=la_full[y][None], old_logp=lo_full[y][None],
                   full_logp=lp_full.expand(V, V)[None], full_ref_logp=la_full.expand(V, V)[None])
    if k is not None:
        # reverse: q = top-k of the sampler; forward: q = top-k of the anchor
        src = sampler if "rev" in name else anchor
        q = torch.topk(src, k).indices if k > 0 else torch.zeros(0, dtype=torch.long)
        inp.head_logp = lp_full[q].expand(V, k)[None]
        inp.head_ref_logp = la_full[q].expand(V, k)[None]
        inp.in_head = torch.isin(y, q)[None]
    f = KL_ESTIMATORS[name](inp, opt or KLOptions())  # [1, V]
    return (lo_full.exp() * f[0]).sum()


def grad(fn, theta):
    (g,) = torch.autograd.grad(fn(), theta)
    return g


# name -> (what the value estimates, what the gradient estimates); None = no claim
CLAIMS = {
    "k1": ("reverse", "zero"),
    "k2": (None, "reverse"),
    "k3": ("reverse", "forward"),
    "k3pp": ("reverse", "reverse"),
    "k4": ("reverse", "reverse"),
    "k5": ("forward", "forward"),
    "exact_rev": ("reverse", "reverse"),
    "exact_fwd": ("forward", "forward"),
    "grpo_k3_corrected": ("reverse", "reverse"),
    "rpg_fkl": ("forward", "forward"),
    "rpg_ufkl": ("forward", "forward"),
    "rpg_rkl": ("reverse", "reverse"),
    "rpg_urkl": ("reverse", "reverse"),
}


def test_every_estimator_has_a_claim_or_topk_test():
    assert set(KL_ESTIMATORS.names()) == set(CLAIMS) | set(TOPK_ESTIMATORS) | {"grpo_k3"}
    assert set(KL_DIRECTION) == set(KL_ESTIMATORS.names())


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_estimator_value_and_gradient_claims(name, setting):
    _, theta, anchor, sampler = setting
    value_claim, grad_claim = CLAIMS[name]

    def est():
        return expected(name, theta, anchor, sampler)

    if value_claim:
        assert float(est().detach()) == pytest.approx(float(exact_kl(theta, anchor, value_claim)), abs=ATOL)
    g = grad(est, theta)
    if grad_claim == "zero":
        assert torch.allclose(g, torch.zeros(V), atol=ATOL)
    else:
        g_true = grad(lambda: exact_kl(theta, anchor, grad_claim), theta)
        assert torch.allclose(g, g_true, atol=ATOL), (g, g_true)
        assert g_true.abs().max() > 1e-3  # the check is not vacuous


def test_k2_value_is_half_second_moment(setting):
    _, theta, anchor, sampler = setting
    lp, la = theta.log_softmax(-1), anchor.log_softmax(-1)
    want = (lp.exp() * 0.5 * (lp - la) ** 2).sum()
    assert float(expected("k2", theta, anchor, sampler)) == pytest.approx(float(want), abs=ATOL)


@pytest.mark.parametrize("variant", ["", "_centered"])
@pytest.mark.parametrize("direction", ["rev", "fwd"])
@pytest.mark.parametrize("k", list(range(V + 1)))
def test_topk_unbiased_in_value_and_gradient_at_every_k(direction, k, variant, setting):
    _, theta, anchor, sampler = setting
    name = f"topk_{direction}{variant}"
    full = "reverse" if direction == "rev" else "forward"

    def est():
        return expected(name, theta, anchor, sampler, k=k)

    assert float(est().detach()) == pytest.approx(float(exact_kl(theta, anchor, full)), abs=ATOL)
    g, g_true = grad(est, theta), grad(lambda: exact_kl(theta, anchor, full), theta)
    assert torch.allclose(g, g_true, atol=ATOL), (k, g - g_true)


@pytest.mark.parametrize("direction", ["rev", "fwd"])
def test_legacy_topk_value_unbiased_gradient_biased(direction, setting):
    """The public code's k4/k5 tails: exact value, but grad pi(q) missing for 0 < k < |V|."""
    _, theta, anchor, sampler = setting
    name = f"topk_{direction}_legacy"
    full = "reverse" if direction == "rev" else "forward"
    g_true = grad(lambda: exact_kl(theta, anchor, full), theta)
    for k in range(V + 1):

        def est():
            return expected(name, theta, anchor, sampler, k=k)

        assert float(est().detach()) == pytest.approx(float(exact_kl(theta, anchor, full)), abs=ATOL)
        err = (grad(est, theta) - g_true).abs().max()
        if 0 < k < V:
            assert err > 1e-3, f"legacy {direction} tail should be biased at k={k}"
        else:
            assert err < ATOL  # k=0: the (unbiased) sampled k4/k5; k=|V|: no tail


def test_legacy_reverse_bias_is_grad_of_head_mass(setting):
    """ALGORITHMS.md: the reverse legacy bias is exactly -grad pi(q) (the tail's missing sum of grad pi)."""
    _, theta, anchor, sampler = setting
    for k in range(1, V):
        q = torch.topk(sampler, k).indices
        g_leg = grad(lambda: expected("topk_rev_legacy", theta, anchor, sampler, k=k), theta)
        g_true = grad(lambda: exact_kl(theta, anchor, "reverse"), theta)
        g_head = grad(lambda: theta.softmax(-1)[q].sum(), theta)
        assert torch.allclose(g_leg - g_true, g_head, atol=ATOL)


def per_sample_grads(name, theta, anchor, sampler, k):
    """[V, V]: row y = the gradient of the estimator's term at sampled token y (times its weight pi_old(y))."""
    lp_full, la_full, lo_full = theta.log_softmax(-1), anchor.log_softmax(-1), sampler.log_softmax(-1)
    y = torch.arange(V)
    src = sampler if "rev" in name else anchor
    q = torch.topk(src, k).indices
    inp = KLInputs(logp=lp_full[y][None], ref_logp=la_full[y][None], old_logp=lo_full[y][None],
                   head_logp=lp_full[q].expand(V, k)[None], head_ref_logp=la_full[q].expand(V, k)[None],
                   in_head=torch.isin(y, q)[None])
    f = KL_ESTIMATORS[name](inp, KLOptions())[0]
    return torch.stack([torch.autograd.grad(lo_full.exp()[i].detach() * f[i], theta, retain_graph=True)[0]
                        for i in range(V)])


@pytest.mark.parametrize("direction", ["rev", "fwd"])
def test_centered_topk_is_zero_per_sample_at_the_anchor(direction):
    """At pi = pi_a the centered estimators' gradient is 0 for every sampled token, not only on average;
    the default ones' per-sample gradients are not (they cancel in expectation only): the step without
    reward signal of docs/results_search.md ("The chosen settings, second seed")."""
    theta = logits(0).requires_grad_(True)
    anchor, sampler = theta.detach().clone(), logits(2, 1.5)
    for k in range(1, V):
        g_c = per_sample_grads(f"topk_{direction}_centered", theta, anchor, sampler, k)
        g_d = per_sample_grads(f"topk_{direction}", theta, anchor, sampler, k)
        assert g_c.abs().max() < ATOL
        assert g_d.abs().max() > 1e-3 and g_d.sum(0).abs().max() < ATOL  # noisy per sample, 0 on average


@pytest.mark.parametrize("direction", ["rev", "fwd"])
def test_centered_topk_has_less_gradient_noise_near_the_anchor(direction):
    """E_old ||g(y) - E g||^2 over the sampled token, exactly, with the policy a small step from its anchor."""
    anchor = logits(1)
    theta = (anchor + 0.05 * logits(3)).requires_grad_(True)
    sampler = theta.detach().clone()
    lo = sampler.log_softmax(-1).exp()
    for k in range(1, V):
        noise = {}
        for name in (f"topk_{direction}", f"topk_{direction}_centered"):
            g = per_sample_grads(name, theta, anchor, sampler, k) / lo[:, None]  # the per-sample gradients
            mean = (lo[:, None] * g).sum(0)
            noise[name] = float((lo[:, None] * (g - mean) ** 2).sum())
        assert noise[f"topk_{direction}_centered"] < 0.1 * noise[f"topk_{direction}"], (k, noise)


def test_topk_truncated_is_head_only(setting):
    _, theta, anchor, sampler = setting
    k = 3
    q = torch.topk(sampler, k).indices
    lp, la = theta.log_softmax(-1), anchor.log_softmax(-1)
    want = (lp.exp()[q] * (lp[q] - la[q])).sum()
    got = expected("topk_rev", theta, anchor, sampler, k=k, opt=KLOptions(truncated=True))
    assert float(got.detach()) == pytest.approx(float(want), abs=ATOL)


def test_sampling_weight_clip_is_applied():
    theta, anchor, sampler = logits(0).requires_grad_(True), logits(1), logits(2, 3.0)
    lp, lo = theta.log_softmax(-1).detach(), sampler.log_softmax(-1)
    s = (lp - lo).exp()
    assert s.max() > 2 and s.min() < 0.5  # clipping matters here
    unclipped = expected("k3", theta, anchor, sampler)
    clipped = expected("k3", theta, anchor, sampler, opt=KLOptions(s_min=0.5, s_max=2.0))
    la = anchor.log_softmax(-1)
    w = (la - lp).exp()
    want = (lo.exp() * s.clamp(0.5, 2.0) * (w - 1 - (la - lp))).sum()
    assert float(clipped) == pytest.approx(float(want), abs=ATOL)
    assert abs(float(clipped) - float(unclipped)) > 1e-4


def ukl(la, lb):
    """UKL(a||b) = sum a log(a/b) + b - a, from log-masses (either may have total mass != 1)."""
    return (la.exp() * (la - lb)).sum() + (lb.exp() - la.exp()).sum()


# (policy mass, anchor mass, sampler): on-policy pi_old = pi, so only a normalized pi can be on-policy
@pytest.mark.parametrize("p_mass,a_mass,sampler", [(1.0, 1.0, "on_policy"), (1.0, 0.6, "on_policy"),
                                                   (1.0, 0.6, "off_policy"), (1.7, 1.0, "off_policy")])
def test_k3_equals_unnormalized_kl_in_expectation(p_mass, a_mass, sampler):
    """tether's k3 (KL_ESTIMATORS["k3"]), enumerated exactly over the vocabulary:
    E_{y ~ pi_old}[k3] = UKL(pi||pi_a) and its gradient is grad UKL(pi_a||pi), also for unnormalized pi or pi_a."""
    theta = logits(0).requires_grad_(True)
    la = logits(1).log_softmax(-1) + math.log(a_mass)
    lo = (theta.detach() if sampler == "on_policy" else logits(2, 1.5)).log_softmax(-1)

    def log_pi():
        return theta.log_softmax(-1) + math.log(p_mass)

    def expected_k3():  # position y of the one-row batch is the sampled token y
        inp = KLInputs(logp=log_pi()[None], ref_logp=la[None], old_logp=None if sampler == "on_policy" else lo[None])
        return (lo.exp() * KL_ESTIMATORS["k3"](inp, KLOptions())[0]).sum()

    want = ukl(log_pi(), la)
    assert float(expected_k3()) == pytest.approx(float(want), abs=ATOL)
    if (p_mass, a_mass) != (1.0, 1.0):  # the unnormalized terms matter: UKL != the normalized KL
        assert abs(float(want) - float(exact_kl(theta, logits(1), "reverse"))) > 1e-2
    g, g_true = grad(expected_k3, theta), grad(lambda: ukl(la, log_pi()), theta)
    assert torch.allclose(g, g_true, atol=ATOL) and g_true.abs().max() > 1e-3


def test_grpo_k3_uncorrected_off_policy_gradient_is_wrong_corrected_is_ukl():
    theta, anchor, sampler = logits(0).requires_grad_(True), logits(1), logits(2, 1.5)
    la = anchor.log_softmax(-1)

    def ukl_rev():  # UKL(pi||pi_a) with pi normalized
        lp = theta.log_softmax(-1)
        return (lp.exp() * (lp - la)).sum() + (la.exp() - lp.exp()).sum()

    g_ukl = grad(ukl_rev, theta)
    g_unc = grad(lambda: expected("grpo_k3", theta, anchor, sampler), theta)
    g_cor = grad(lambda: expected("grpo_k3_corrected", theta, anchor, sampler), theta)
    assert (g_unc - g_ukl).abs().max() > 1e-3
    assert torch.allclose(g_cor, g_ukl, atol=ATOL)
    # on-policy the uncorrected term is plain k3 (value = reverse KL)
    on = theta.detach().clone()
    assert float(expected("grpo_k3", theta, anchor, on)) == pytest.approx(float(exact_kl(theta, anchor, "reverse")),
                                                                          abs=ATOL)


def test_estimators_work_on_batched_shapes():
    """[B, T] inputs with a top-k head [B, T, k]: outputs keep the shape and are finite."""
    g = torch.Generator().manual_seed(0)
    B, T, k = 3, 5, 4
    lp = torch.randn(B, T, 50, generator=g).log_softmax(-1)
    la = torch.randn(B, T, 50, generator=g).log_softmax(-1)
    y = torch.randint(0, 50, (B, T), generator=g)
    q = lp.topk(k, -1).indices
    inp = KLInputs(logp=lp.gather(-1, y[..., None])[..., 0], ref_logp=la.gather(-1, y[..., None])[..., 0],
                   head_logp=lp.gather(-1, q), head_ref_logp=la.gather(-1, q),
                   in_head=(q == y[..., None]).any(-1), full_logp=lp, full_ref_logp=la)
    for name in KL_ESTIMATORS:
        out = KL_ESTIMATORS[name](inp, KLOptions())
        assert out.shape == (B, T) and torch.isfinite(out).all(), name


def test_missing_inputs_are_clear_errors():
    inp = KLInputs(logp=torch.zeros(1, 2), ref_logp=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="head_logp"):
        KL_ESTIMATORS["topk_rev"](inp, KLOptions())
    with pytest.raises(ValueError, match="full-vocabulary"):
        KL_ESTIMATORS["exact_fwd"](inp, KLOptions())
    with pytest.raises(ValueError, match="Valid choices"):
        KL_ESTIMATORS["k7"]
