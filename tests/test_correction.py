"""Rollout correction (truncated importance sampling, tether.algo.correction) by exact enumeration.

The bandit: every sequence y = (y1, y2) over V = 3 tokens, a policy pi_theta with
pi_theta = pi_old at the current parameters (the trainer's own forward at the rollout
weights), and a different sampler pi_vllm that actually drew the responses. With the
per-sequence advantage A(y) and the sequence-sum aggregation, the loss of one response is
sum_t pg_t(y) w_t(y); its exact expectation under pi_vllm is sum_y pi_vllm(y) loss(y).
"""

import itertools
import math
import re

import pytest
import torch

from tether.algo import LossInputs, RegionConfig, compute_loss, loss_needs
from tether.algo.correction import correction_weights
from tether.config.kl import kl_config
from tether.config.recipes import RECIPES, recipe, validate
from tether.errors import ConfigError
from tether.resolve import load_config

pytestmark = pytest.mark.usefixtures("float64")
V = 3


def seqs(L):
    return torch.tensor(list(itertools.product(range(V), repeat=L)))  # [V^L, L]


def token_logp(params, L):
    """[V^L, L] log pi(y_t | y_<t) of every sequence: params[t] are logits indexed by the previous token."""
    S = seqs(L)
    out = [params[0].log_softmax(-1)[S[:, 0]]]
    for t in range(1, L):
        out.append(params[t].log_softmax(-1)[S[:, t - 1], S[:, t]])
    return torch.stack(out, 1)


def make(seed, L, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(V, generator=g) * scale] + [torch.randn(V, V, generator=g) * scale for _ in range(L - 1)]


def grads(scalar, theta):
    return torch.cat([g.flatten() for g in torch.autograd.grad(scalar, theta)])


def cfg_for(cap, mode="token", base="dapo"):
    cfg = recipe(base)
    cfg.region = RegionConfig("none")
    cfg.aggregation = "seq-mean-token-sum"
    cfg.tis_cap, cfg.tis_mode = cap, mode
    return validate(cfg)


def expected_loss(cfg, lp, lv, adv):
    """sum_y pi_vllm(y) compute_loss(cfg, response y): pi_old = sg(pi_theta), sampler_logp = log pi_vllm."""
    total = 0.0
    one = torch.ones(1, lp.shape[1], dtype=torch.bool)
    for y in range(lp.shape[0]):
        out = compute_loss(cfg, LossInputs(logp=lp[y:y + 1], mask=one, adv=adv[y].view(1),
                                           old_logp=lp[y:y + 1].detach(), sampler_logp=lv[y:y + 1]))
        total = total + lv[y].sum().exp() * out.loss
    return total


def setting(L, seed=0):
    theta = [t.requires_grad_(True) for t in make(seed, L)]
    lv = token_logp(make(seed + 1, L, 1.3), L).detach()  # the sampler pi_vllm
    adv = torch.randn(V ** L, generator=torch.Generator().manual_seed(seed + 2))
    return theta, lv, adv


def exact_objective(theta, adv, L):
    """-E_{y ~ pi_theta}[A(y)]: its gradient at theta is the policy gradient under pi_old."""
    return -(token_logp(theta, L).sum(-1).exp() * adv).sum()


def test_sequence_mode_is_exact_importance_sampling():
    """E_{pi_vllm}[grad loss] with w = prod_t r_t (C large) == the policy gradient under pi_old, for L = 2."""
    L = 2
    theta, lv, adv = setting(L)
    g = grads(expected_loss(cfg_for(1e12, "sequence"), token_logp(theta, L), lv, adv), theta)
    g_exact = grads(exact_objective(theta, adv, L), theta)
    assert torch.allclose(g, g_exact, atol=1e-12), (g, g_exact)
    # without correction the samples estimate the gradient under pi_vllm instead: visibly different
    g_raw = grads(expected_loss(cfg_for(0), token_logp(theta, L), lv, adv), theta)
    assert (g_raw - g_exact).abs().max() > 1e-2


@pytest.mark.parametrize("mode", ["token", "mask"])
def test_token_modes_are_exact_for_one_token_responses(mode):
    L = 1
    theta, lv, adv = setting(L, seed=5)
    g = grads(expected_loss(cfg_for(1e12, mode), token_logp(theta, L), lv, adv), theta)
    assert torch.allclose(g, grads(exact_objective(theta, adv, L), theta), atol=1e-12)


def by_hand(theta, lv, adv, L, cap, mode):
    """sum_y pi_vllm(y) sum_t w_t(y) (-A(y)) log pi(y_t | y_<t), w computed with python floats."""
    lp = token_logp(theta, L)
    total = 0.0
    for y in range(lp.shape[0]):
        r = [math.exp(float(lp[y, t].detach()) - float(lv[y, t])) for t in range(L)]
        if mode == "token":
            w = [min(x, cap) for x in r]
        elif mode == "sequence":
            w = [min(math.prod(r), cap)] * L
        else:
            geo = math.exp(sum(math.log(x) for x in r) / L)
            w = [0.0] * L if geo > cap else [min(x, cap) for x in r]
        total = total + math.exp(float(lv[y].sum())) * sum(-w[t] * adv[y] * lp[y, t] for t in range(L))
    return total


@pytest.mark.parametrize("mode", ["token", "sequence", "mask"])
@pytest.mark.parametrize("cap", [1.0, 1.5, 4.0, 1e12])
def test_truncated_forms_equal_the_hand_computed_ones(mode, cap):
    L = 2
    theta, lv, adv = setting(L, seed=3)
    g = grads(expected_loss(cfg_for(cap, mode), token_logp(theta, L), lv, adv), theta)
    g_hand = grads(by_hand(theta, lv, adv, L, cap, mode), theta)
    assert torch.allclose(g, g_hand, atol=1e-12), (g, g_hand)


def test_token_mode_is_biased_for_longer_responses_and_the_cap_matters():
    """Documented in correction.py: per-token weights do not correct the context of a token (L = 2)."""
    L = 2
    theta, lv, adv = setting(L)
    g_exact = grads(exact_objective(theta, adv, L), theta)
    g_tok = grads(expected_loss(cfg_for(1e12, "token"), token_logp(theta, L), lv, adv), theta)
    assert (g_tok - g_exact).abs().max() > 1e-3
    r = (token_logp(theta, L).detach() - lv).exp()
    assert r.max() > 1.5  # so cap 1.5 truncates something
    g_cap = grads(expected_loss(cfg_for(1.5, "token"), token_logp(theta, L), lv, adv), theta)
    assert (g_cap - g_tok).abs().max() > 1e-3


def test_weights_and_metrics():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 9.0]])
    samp = torch.tensor([[-1.0, -2.0 - math.log(3), -0.5], [-0.1 - math.log(0.5), -3.0, -1.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])  # (1, 2) is padding: never read
    w, m = correction_weights(old, samp, mask, 2.0, "token")
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 1.0], [0.5, 1.0, 0.0]]))
    assert float(m["rollout_corr/ratio_max"]) == pytest.approx(3.0)
    assert float(m["rollout_corr/ratio_mean"]) == pytest.approx((1 + 3 + 1 + 0.5 + 1) / 5)
    assert float(m["rollout_corr/trunc_frac"]) == pytest.approx(1 / 5)
    w, m = correction_weights(old, samp, mask, 2.0, "sequence")  # row 0: prod 3 -> 2; row 1: 0.5
    assert torch.allclose(w, torch.tensor([[2.0, 2.0, 2.0], [0.5, 0.5, 0.0]]))
    assert float(m["rollout_corr/trunc_frac"]) == pytest.approx(3 / 5)
    w, m = correction_weights(old, samp, mask, 1.4, "mask")  # row 0: geo-mean 3^(1/3) = 1.44 > 1.4 -> masked
    assert torch.allclose(w, torch.tensor([[0.0, 0.0, 0.0], [0.5, 1.0, 0.0]]))
    assert float(m["rollout_corr/trunc_frac"]) == pytest.approx(3 / 5)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_composes_with_every_recipe(name):
    """With the sampler's log-probs equal to pi_old's the correction is the identity (loss and gradient);
    with a mismatch only the policy-gradient term changes, and the metrics are reported."""
    g = torch.Generator().manual_seed(0)
    B, T = 4, 5
    old = -torch.rand(B, T, generator=g) * 2 - 0.05
    logp = (old + 0.1 * torch.randn(B, T, generator=g)).clamp(max=-1e-3).requires_grad_(True)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 3:] = False
    kw = dict(logp=logp, mask=mask, adv=torch.randn(B, generator=g), old_logp=old, max_len=T,
              ref_logp=(old + 0.2 * torch.randn(B, T, generator=g)).clamp(max=-1e-3))
    base = recipe(name)
    if base.kl.estimator.startswith("topk"):
        base.kl = kl_config("k3", beta=base.kl.beta)  # head inputs are not the point here
    on = base.copy()
    on.tis_cap = 2.0
    validate(on)
    assert loss_needs(on, 10).sampler_logp and not loss_needs(base, 10).sampler_logp
    out0 = compute_loss(base, LossInputs(**kw))
    out1 = compute_loss(on, LossInputs(**kw, sampler_logp=old.clone()))
    assert torch.allclose(out0.loss, out1.loss, atol=1e-12)
    assert torch.allclose(grads(out0.loss, [logp]), grads(out1.loss, [logp]), atol=1e-12)
    assert float(out1.metrics["rollout_corr/ratio_mean"]) == pytest.approx(1.0)
    assert float(out1.metrics["rollout_corr/trunc_frac"]) == 0.0
    out2 = compute_loss(on, LossInputs(**kw, sampler_logp=old - 1.0))  # r = e > C = 2 everywhere
    assert float(out2.metrics["rollout_corr/trunc_frac"]) == 1.0
    assert float(out2.metrics["rollout_corr/ratio_max"]) == pytest.approx(math.e)
    with pytest.raises(ValueError, match="sampler_logp"):
        compute_loss(on, LossInputs(**kw))


@pytest.mark.parametrize("over,msg", [
    ({"tis_cap": 0.5}, "override: algo.tis_cap must be 0 (off) or >= 1"),
    ({"tis_cap": -1.0}, "override: algo.tis_cap must be 0 (off) or >= 1"),
    ({"tis_cap": 2.0, "tis_mode": "seq"}, "override: unknown algo.tis_mode 'seq'"),
])
def test_each_key_is_typed(over, msg):
    """A value outside its key's declared range or choices is refused as it is set."""
    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_config(None, {f"algo.{k}": v for k, v in over.items()}, recipe_name="dapo")


def test_validation():
    with pytest.raises(ConfigError, match="algo.tis_mode has no effect while algo.tis_cap is 0"):
        load_config(None, {"algo.tis_mode": "sequence"}, recipe_name="dapo")


def test_update_stats_reduces_each_extreme_by_its_own_op():
    """Across data-parallel ranks a *_ratio_max (the rollout correction's ``rollout_corr/ratio_max`` too) is
    reduced with max and a *_ratio_min with min: a rank-local extreme must never be replaced by the others'."""
    from tether.metrics import UpdateStats

    st = UpdateStats()
    one = torch.tensor(1.0)
    st.add({"n_tokens": one, "ratio_max": torch.tensor(1.5), "rollout_corr/ratio_max": torch.tensor(2.0),
            "ratio_min": torch.tensor(0.5)}, one, one, one)
    st.end_mini_batch()
    mine = {1.5: "ratio_max", 2.0: "rollout_corr/ratio_max", 0.5: "ratio_min"}  # this rank's extremes, by value
    other = {"ratio_max": 3.0, "rollout_corr/ratio_max": 7.0, "ratio_min": 0.25}  # the other rank's
    ops = {}

    def reduce(x, op="sum"):  # a two-rank all-reduce of this rank's value with the other rank's
        if op == "sum":
            return x * 2
        name = mine[float(x)]
        ops[name] = op
        return (torch.maximum if op == "max" else torch.minimum)(x, torch.tensor(other[name]))

    row = st.result(reduce=reduce)
    assert ops == {"ratio_max": "max", "rollout_corr/ratio_max": "max", "ratio_min": "min"}
    assert row["rollout_corr/ratio_max"] == pytest.approx(7.0) and row["ratio_max"] == pytest.approx(3.0)
    assert row["ratio_min"] == pytest.approx(0.25)
