"""The rollout correction's masks (tether.algo.correction) by exact enumeration, and their metrics.

A sampler mu draws every response y over V = 3 tokens (length 1 or 2); pi_theta = pi_old at the
current parameters (the trainer's forward at the rollout weights). With the per-sequence advantage
A(y) and the sequence-sum aggregation, the exact expected loss is sum_y mu(y) loss(y). Each mask's
claim is checked against autograd of an exact objective whose kept set is computed here, in python
floats, from the definitions (not from the code under test).
"""

import math
import re

import pytest
import torch

from test_correction import V, grads, make, token_logp  # the enumeration helpers (one copy)
from tether.algo import LossInputs, RegionConfig, compute_loss
from tether.algo.correction import Masks, correction_weights
from tether.config.kl import kl_config
from tether.config.recipes import describe, recipe, validate
from tether.errors import ConfigError
from tether.resolve import load_config

pytestmark = pytest.mark.usefixtures("float64")


def setting(L, seed=0, scale=1.3):
    theta = [t.requires_grad_(True) for t in make(seed, L)]
    lv = token_logp(make(seed + 1, L, scale), L).detach()  # the behaviour policy mu
    adv = torch.randn(V ** L, generator=torch.Generator().manual_seed(seed + 2))
    return theta, lv, adv


def cfg_for(**over):
    cfg = recipe("dapo")
    cfg.region = RegionConfig("none")
    cfg.aggregation = "seq-mean-token-sum"
    for k, v in over.items():
        setattr(cfg, k, v)
    return validate(cfg)


def expected_loss(cfg, lp, lv, adv):
    """sum_y mu(y) compute_loss(cfg, response y), pi_old = sg(pi_theta), sampler_logp = log mu."""
    total = 0.0
    one = torch.ones(1, lp.shape[1], dtype=torch.bool)
    for y in range(lp.shape[0]):
        out = compute_loss(cfg, LossInputs(logp=lp[y:y + 1], mask=one, adv=adv[y].view(1),
                                           old_logp=lp[y:y + 1].detach(), sampler_logp=lv[y:y + 1]))
        total = total + lv[y].sum().exp() * out.loss
    return total


def log_ratios(theta, lv, L):
    """Python floats log r_t = log pi_old/mu per sequence and token."""
    lo = token_logp(theta, L).detach()
    return [[float(lo[y, t]) - float(lv[y, t]) for t in range(L)] for y in range(lo.shape[0])]


def kept_objective(theta, adv, L, kept):
    """-sum_{y kept} pi_theta(y) A(y): its gradient at theta is the policy gradient under pi_old
    restricted to the kept sequences."""
    lp = token_logp(theta, L).sum(-1)
    k = torch.tensor([float(x) for x in kept])
    return -(k * lp.exp() * adv).sum()


def check_nontrivial(kept):
    assert 0 < sum(kept) < len(kept), kept  # the mask drops some sequences and keeps others


# ---------------------------------------------------------------- token masks (exact for one-token responses)


@pytest.mark.parametrize("low,high", [(0.0, 12.0), (0.4, 12.0), (0.5, 0.0)])
def test_token_mis_and_icepop_are_the_pg_under_pi_old_on_the_kept_tokens(low, high):
    """One-token responses: E_mu[r 1[a <= r <= b] A grad log pi] = sum_{y: a <= r(y) <= b} pi_old(y) A grad log pi."""
    L = 1
    theta, lv, adv = setting(L, seed=5, scale=2.0)
    lr = log_ratios(theta, lv, L)
    kept = [(not low or math.exp(x[0]) >= low) and (not high or math.exp(x[0]) <= high) for x in lr]
    check_nontrivial(kept)
    cfg = cfg_for(tis_cap=math.inf, mask_token_low=low, mask_token_high=high)
    g = grads(expected_loss(cfg, token_logp(theta, L), lv, adv), theta)
    g_exact = grads(kept_objective(theta, adv, L, kept), theta)
    assert torch.allclose(g, g_exact, atol=1e-12), (g, g_exact)


def test_token_masks_on_two_token_responses_equal_the_hand_computed_form():
    """L = 2: sum_y mu(y) sum_t r_t 1[a <= r_t <= b] (-A(y)) log pi(y_t | y_<t), w in python floats."""
    L, a, b = 2, 0.7, 1.6
    theta, lv, adv = setting(L, seed=3)
    lr = log_ratios(theta, lv, L)
    assert any(math.exp(x) < a for r in lr for x in r) and any(math.exp(x) > b for r in lr for x in r)
    lp = token_logp(theta, L)
    hand = 0.0
    for y, r in enumerate(lr):
        w = [math.exp(x) if a <= math.exp(x) <= b else 0.0 for x in r]
        hand = hand + math.exp(float(lv[y].sum())) * sum(-w[t] * adv[y] * lp[y, t] for t in range(L))
    cfg = cfg_for(tis_cap=math.inf, mask_token_low=a, mask_token_high=b)
    g = grads(expected_loss(cfg, token_logp(theta, L), lv, adv), theta)
    assert torch.allclose(g, grads(hand, theta), atol=1e-12)


# ---------------------------------------------------------------- sequence masks (exact with the sequence weight)


def _kl_mean(kind, r):
    f = {"k1": lambda x: -x, "k2": lambda x: x * x / 2, "k3": lambda x: math.exp(x) - 1 - x}[kind]
    return sum(f(x) for x in r) / len(r)


SEQ_MASKS = {  # name -> (config overrides, python predicate kept(log r per token, A))
    "seq_mis": ({"mask_seq_high": 1.5}, lambda r, A: math.exp(sum(r)) <= 1.5),
    "geo": ({"mask_geo": 2.0}, lambda r, A: 1 / 2 <= math.exp(sum(r) / len(r)) <= 2),
    "k1": ({"mask_kl": "k1", "mask_kl_max": 0.05}, lambda r, A: _kl_mean("k1", r) <= 0.05),
    "k2": ({"mask_kl": "k2", "mask_kl_max": 0.5}, lambda r, A: _kl_mean("k2", r) <= 0.5),
    "k3": ({"mask_kl": "k3", "mask_kl_max": 0.5}, lambda r, A: _kl_mean("k3", r) <= 0.5),
    # at theta = pi_old, log(mu/pi) = -log r: OPSM drops A < 0 sequences with mean(-log r) > delta
    "opsm": ({"mask_opsm": 0.02}, lambda r, A: not (A < 0 and -sum(r) / len(r) > 0.02)),
}


@pytest.mark.parametrize("name", sorted(SEQ_MASKS))
def test_sequence_masks_are_the_exact_pg_over_the_kept_sequences(name):
    """Sequence IS weight (C = inf) x mask: E_mu[prod r 1[y kept] sum_t g_t] = E_pi_old[1[y kept] sum_t g_t]."""
    L = 2
    theta, lv, adv = setting(L, seed=7)
    over, pred = SEQ_MASKS[name]
    kept = [pred(r, float(adv[y])) for y, r in enumerate(log_ratios(theta, lv, L))]
    check_nontrivial(kept)
    cfg = cfg_for(tis_cap=math.inf, tis_mode="sequence", **over)
    g = grads(expected_loss(cfg, token_logp(theta, L), lv, adv), theta)
    g_exact = grads(kept_objective(theta, adv, L, kept), theta)
    assert torch.allclose(g, g_exact, atol=1e-12), (g, g_exact)
    g_all = grads(kept_objective(theta, adv, L, [True] * len(kept)), theta)
    assert (g_exact - g_all).abs().max() > 1e-3  # the mask changes the gradient


def test_geometric_mask_is_two_sided():
    """mask_geo drops responses with g(y) < 1/C as well as g(y) > C (tis_mode mask only the latter)."""
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    samp = old - torch.tensor([[math.log(2.0), 0.0], [-math.log(2.0), 0.0], [0.1, -0.1]])  # g = 1.414, 0.707, 1
    mask = torch.ones(3, 2, dtype=torch.bool)
    w, m = correction_weights(old, samp, mask, 0.0, masks=Masks(geo=1.4))
    assert w.tolist() == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]  # no IS weight: w = M
    w, _ = correction_weights(old, samp, mask, 0.0, masks=Masks(geo=1.42))
    assert w.tolist() == [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]  # sqrt(2) = 1.4142 <= 1.42
    w, _ = correction_weights(old, samp, mask, 1.4, "mask")  # the legacy one-sided veto keeps row 1
    assert w[0].tolist() == [0.0, 0.0] and w[1].tolist() == pytest.approx([0.5, 1.0])
    assert float(m["rollout_corr/masked_seq_frac"]) == pytest.approx(2 / 3)


def test_opsm_uses_the_current_policy_and_the_sign_of_the_advantage():
    """mean_t log(mu/pi) with pi the current policy (not pi_old); only A < 0 tokens are masked."""
    old = torch.zeros(4, 2) - 1.0
    samp = old.clone()  # mu = pi_old: no mismatch, so only the drift of pi decides
    logp = old - torch.tensor([[0.3, 0.1], [0.3, 0.1], [0.05, 0.05], [0.0, 0.0]])  # mean log(mu/pi): .2 .2 .05 0
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0], [-2.0, 0.5]])
    adv[3] = torch.tensor([-2.0, 0.5])
    mask = torch.ones(4, 2, dtype=torch.bool)
    logp[3] = old[3] - torch.tensor([0.5, 0.1])  # mean 0.3 > delta: its A < 0 token is masked, the A > 0 one kept
    w, m = correction_weights(old, samp, mask, 0.0, masks=Masks(opsm=0.1), logp=logp, adv=adv)
    assert w.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.0, 1.0]]
    assert float(m["rollout_corr/masked_token_frac"]) == pytest.approx(3 / 8)
    assert float(m["rollout_corr/masked_seq_frac"]) == pytest.approx(1 / 4)
    # against pi_old (= mu here) nothing would be masked: the mask reads the current policy
    w_old, _ = correction_weights(old, samp, mask, 0.0, masks=Masks(opsm=0.1), logp=old, adv=adv)
    assert bool((w_old == 1).all())


# ---------------------------------------------------------------- masked tokens contribute nothing; limits


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_masked_tokens_contribute_exactly_nothing(agg):
    """Changing a masked token's log-prob, advantage or ratio changes neither the loss nor any gradient,
    and its own gradient is exactly 0."""
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 4, generator=g) - 0.1
    samp = old + torch.tensor([[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, -2.0], [0.0, 0.0, 0.0, 0.0]])  # r = e^-2, e^2
    cfg = cfg_for(tis_cap=math.inf, mask_token_low=0.5, mask_token_high=5.0, aggregation=agg)
    cfg.region = RegionConfig("ratio", 0.2, 0.28)
    validate(cfg)
    mask = torch.ones(3, 4, dtype=torch.bool)
    adv = torch.randn(3, 4, generator=g)

    def run(logp_shift, adv_shift):
        logp = (old + 0.05 * torch.randn(3, 4, generator=torch.Generator().manual_seed(2)))
        logp = (logp + logp_shift).requires_grad_(True)
        out = compute_loss(cfg, LossInputs(logp=logp, mask=mask, adv=adv + adv_shift, old_logp=old, sampler_logp=samp))
        return out.loss, torch.autograd.grad(out.loss, logp)[0]

    bump = torch.zeros(3, 4)
    bump[0, 1], bump[1, 3] = 0.7, -0.4  # the two masked tokens only
    l0, g0 = run(0.0, 0.0)
    l1, g1 = run(bump, 3 * bump)
    assert float(l0.detach()) == float(l1.detach()) and torch.equal(g0, g1)
    assert float(g0[0, 1]) == 0.0 and float(g0[1, 3]) == 0.0 and bool((g0[2] != 0).all())


def test_infinite_caps_and_wide_bounds_are_plain_importance_sampling():
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(3, 5, generator=g) * 2 - 0.05
    samp = old + torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    r = torch.where(mask, (old - samp).exp(), torch.zeros(()))
    wide = Masks(token_low=1e-12, token_high=1e12, seq_high=1e12, geo=1e12, kl="k3", kl_max=1e12, opsm=1e12)
    w, m = correction_weights(old, samp, mask, math.inf, "token", wide, logp=old, adv=-torch.ones(3, 5))
    assert torch.allclose(w, r, rtol=1e-14, atol=0)
    assert float(m["rollout_corr/masked_token_frac"]) == 0.0 and float(m["rollout_corr/trunc_frac"]) == 0.0
    w, _ = correction_weights(old, samp, mask, math.inf, "sequence", wide, logp=old, adv=-torch.ones(3, 5))
    prod = torch.where(mask, old - samp, torch.zeros(())).sum(-1, keepdim=True).exp()
    assert torch.allclose(w, torch.where(mask, prod.expand(3, 5), torch.zeros(())), rtol=1e-14, atol=0)


def test_metrics_on_a_hand_computed_batch():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 9.0]])
    samp = torch.tensor([[-1.0, -2.0 - math.log(3), -0.5], [-0.1 - math.log(2), -3.0, -1.0]])  # r: 1 3 1 | 2 1 -
    mask = torch.tensor([[True, True, True], [True, True, False]])
    w, m = correction_weights(old, samp, mask, 0.0, masks=Masks(token_high=2.5))
    assert w.tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    k1 = -(math.log(3) + math.log(2)) / 5
    assert float(m["rollout_corr/kl_k1"]) == pytest.approx(k1)
    assert float(m["rollout_corr/kl_k3"]) == pytest.approx((3 - 1 - math.log(3) + 2 - 1 - math.log(2)) / 5)
    ppl_old = math.exp(-(-1 - 2 - 0.5 - 0.1 - 3) / 5)  # perplexities of the 5 loss tokens
    ppl_mu = math.exp(-(-1 - 2 - math.log(3) - 0.5 - 0.1 - math.log(2) - 3) / 5)
    assert float(m["rollout_corr/ppl_ratio"]) == pytest.approx(ppl_old / ppl_mu)
    assert float(m["rollout_corr/masked_token_frac"]) == pytest.approx(1 / 5)
    assert float(m["rollout_corr/masked_seq_frac"]) == 0.0
    _, m = correction_weights(old, samp, mask, 0.0, masks=Masks(kl="k3", kl_max=0.2))  # row 0: (2 - log 3)/3 = .30
    assert float(m["rollout_corr/masked_seq_frac"]) == pytest.approx(1 / 2)  # row 1: (1 - log 2)/2 = .15
    assert float(m["rollout_corr/masked_token_frac"]) == pytest.approx(3 / 5)


def test_compute_loss_reports_the_metrics_and_needs_the_engine_logprobs():
    from tether.algo import loss_needs

    cfg = cfg_for(mask_geo=1.5)
    assert loss_needs(cfg, 10).sampler_logp and cfg.tis_cap == 0
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = compute_loss(cfg, LossInputs(logp=lp, mask=torch.ones(1, 2, dtype=torch.bool), adv=torch.ones(1),
                                       old_logp=lp.detach(), sampler_logp=lp.detach() + 1.0))  # geo = e^-1 < 1/1.5
    assert float(out.metrics["rollout_corr/masked_seq_frac"]) == 1.0 and float(out.loss.detach()) == 0.0
    assert float(out.metrics["rollout_corr/kl_k1"]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="sampler_logp"):
        compute_loss(cfg, LossInputs(logp=lp, mask=torch.ones(1, 2, dtype=torch.bool), adv=torch.ones(1),
                                     old_logp=lp.detach()))


# ---------------------------------------------------------------- config surface


@pytest.mark.parametrize("over,msg", [
    ({"mask_token_low": 1.0}, "algo.mask_token_low must be in [0, 1), got 1.0"),
    ({"mask_token_high": 0.9}, "algo.mask_token_high must be 0 (off) or > 1"),
    ({"mask_seq_high": 1.0}, "algo.mask_seq_high must be 0 (off) or > 1"),
    ({"mask_geo": -2.0}, "algo.mask_geo must be 0 (off) or > 1"),
    ({"mask_kl": "k4"}, "unknown algo.mask_kl 'k4'"),
    ({"mask_opsm": -0.1}, "algo.mask_opsm must be >= 0, got -0.1"),
    ({"kl_sampler": "behaviour"}, "unknown algo.kl_sampler 'behaviour'"),
])
def test_each_key_is_typed(over, msg):
    """A value outside its key's declared range or choices is refused as it is set."""
    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_config(None, {f"algo.{k}": v for k, v in over.items()}, recipe_name="dapo")


@pytest.mark.parametrize("over,msg", [
    ({"mask_kl": "k3"}, "needs mask_kl_max > 0"),
    ({"tis_cap": 2.0, "mask_token_high": 2.0}, "set tis_cap=inf for masked IS"),
    ({"tis_cap": 3.0, "tis_mode": "sequence", "mask_seq_high": 2.0}, "set tis_cap=inf for masked IS"),
    ({"kl_sampler": "mu"}, "kl_sampler 'mu' has no effect"),
])
def test_validation(over, msg):
    cfg = recipe("dapo")
    for k, v in over.items():
        setattr(cfg, k, v)
    with pytest.raises(ConfigError, match=msg):
        validate(cfg)


@pytest.mark.parametrize("over,msg", [
    ({"mask_kl_max": 0.1}, "algo.mask_kl_max has no effect while algo.mask_kl is 'none'"),
    ({"mask_geo": 2.0, "tis_mode": "sequence"}, "algo.tis_mode has no effect while algo.tis_cap is 0"),
])
def test_a_key_without_the_key_it_needs_is_refused_as_it_is_set(over, msg):
    """A rule within algo.* (declared beside its keys): refused when the keys are parsed, naming the key."""
    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_config(None, {f"algo.{k}": v for k, v in over.items()}, recipe_name="dapo")


def test_kl_sampler_mu_needs_a_sampling_weight():
    validate(_with(recipe("grpo"), kl_sampler="mu"))  # k3 with s = pi/mu
    validate(_with(recipe("rpg_reinforce_fkl"), kl_sampler="mu"))  # c = pi_a/mu
    for name, msg in (("rpg_reinforce_urkl", "placement 'advantage'"), ("dapo", "'none'")):
        with pytest.raises(ConfigError, match=msg):
            validate(_with(recipe(name), kl_sampler="mu"))
    cfg = _with(recipe("grpo"), kl_sampler="mu")
    cfg.kl = kl_config("exact_rev", beta=cfg.kl.beta)
    with pytest.raises(ConfigError, match="'exact_rev'"):
        validate(cfg)


def _with(cfg, **over):
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def test_describe_names_the_correction():
    cfg = _with(recipe("dapo"), tis_cap=math.inf, mask_token_low=0.5, mask_token_high=5.0, mask_opsm=0.1)
    assert describe(validate(cfg)).endswith(" tis=token(C=inf) mask=[icepop[0.5,5], opsm(0.1)] (decoupled PPO)")
    cfg = _with(recipe("grpo"), tis_cap=2.0, tis_mode="sequence", mask_geo=1.5, mask_kl="k3", mask_kl_max=0.1,
                kl_sampler="mu")
    assert describe(validate(cfg)).endswith(" tis=sequence(C=2) mask=[geo[1/1.5,1.5], k3<=0.1] kl_sampler=mu")
    assert describe(validate(_with(recipe("dapo"), mask_token_high=3.0))).endswith(" mask=[token<=3]")
    assert "mask=" not in describe(recipe("dapo")) and "tis=" not in describe(recipe("dapo"))


# ---------------------------------------------------------------- step-level metrics across micro-batches


def _micro_batches():
    """Two micro-batches of one step, of very different token counts, through compute_loss (the trainer's
    path). A: 1 response of 12 tokens, log r = log pi_old - log mu = -1 on each (k1 = 1), every token masked
    by the k1 rejection; B: 3 responses of 1 token, log r = 0 (k1 = 0), none masked."""
    cfg = cfg_for(mask_kl="k1", mask_kl_max=0.5)
    outs = []
    for rows, length, log_r in ((1, 12, -1.0), (3, 1, 0.0)):
        lp = torch.full((rows, length), -2.0, requires_grad=True)
        mask = torch.ones(rows, length, dtype=torch.bool)
        outs.append(compute_loss(cfg, LossInputs(logp=lp, mask=mask, adv=torch.ones(rows), old_logp=lp.detach(),
                                                 sampler_logp=lp.detach() - log_r, num_tokens=15.0, num_seqs=4)))
    return [o.metrics for o in outs]


def test_step_level_rollout_corr_metrics_over_micro_batches_of_different_sizes():
    """``rollout_corr/masked_seq_frac`` is the step's fully masked responses over its responses, and
    ``rollout_corr/ppl_ratio`` exp of the step's token mean of k1 (tether.algo.correction.mismatch_metrics),
    whatever the micro-batch split: not the token-weighted mean of the micro-batches' values
    (0.8 and (12 e + 3) / 15 = 2.37 here), which weighs A's one response as 12 and averages exp."""
    from tether.metrics import UpdateStats

    a, b = _micro_batches()
    assert float(a["rollout_corr/masked_seq_frac"]) == 1.0 and float(b["rollout_corr/masked_seq_frac"]) == 0.0
    st = UpdateStats()
    for m in (a, b):
        st.add(m, torch.tensor(0.0), m["n_tokens"], m["n_tokens"])
    st.end_mini_batch()
    row = st.result()
    assert row["rollout_corr/masked_seq_frac"] == pytest.approx(1 / 4, abs=1e-12)  # 1 of 4 responses
    assert row["rollout_corr/kl_k1"] == pytest.approx(12 / 15, abs=1e-12)  # token mean: 12 x 1 + 3 x 0
    assert row["rollout_corr/ppl_ratio"] == pytest.approx(math.exp(12 / 15), abs=1e-12)
    assert row["rollout_corr/masked_token_frac"] == pytest.approx(12 / 15, abs=1e-12)  # token fractions stay
    assert "rollout_corr/n_seqs" not in row  # a weight, not a metric

    # the whole step in one micro-batch gives the same values (the definition on the step's batch)
    cfg = cfg_for(mask_kl="k1", mask_kl_max=0.5)
    lp = torch.full((4, 12), -2.0, requires_grad=True)
    mask = torch.zeros(4, 12, dtype=torch.bool)
    mask[0], mask[1:, 0] = True, True
    log_r = torch.zeros(4, 12)
    log_r[0] = -1.0
    whole = compute_loss(cfg, LossInputs(logp=lp, mask=mask, adv=torch.ones(4), old_logp=lp.detach(),
                                         sampler_logp=lp.detach() - log_r)).metrics
    for k in ("masked_seq_frac", "kl_k1", "ppl_ratio", "masked_token_frac"):
        assert float(whole[f"rollout_corr/{k}"]) == pytest.approx(row[f"rollout_corr/{k}"], abs=1e-12), k


def test_step_level_rollout_corr_metrics_across_data_parallel_ranks():
    """Under data parallelism each rank holds one micro-batch; the ranks' numerators and denominators are
    summed (``reduce``, the all-reduce) before they are divided: the same step values as on one rank."""
    from tether.metrics import UpdateStats

    a, b = _micro_batches()
    ranks = []
    for m in (a, b):
        st = UpdateStats()
        st.add(m, torch.tensor(0.0), m["n_tokens"], m["n_tokens"])
        st.end_mini_batch()
        ranks.append(st)
    sent = []  # rank 1's values, in the order it reduces them (every rank reduces the same names in order)
    ranks[1].result(reduce=lambda x, op="sum": sent.append((torch.as_tensor(x), op)) or x)

    def all_reduce(x, op="sum"):  # rank 0's view of a two-rank all-reduce
        other, other_op = sent.pop(0)
        assert op == other_op
        return {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op](torch.as_tensor(x), other)

    row = ranks[0].result(reduce=all_reduce)
    assert not sent
    assert row["rollout_corr/masked_seq_frac"] == pytest.approx(1 / 4, abs=1e-12)
    assert row["rollout_corr/ppl_ratio"] == pytest.approx(math.exp(12 / 15), abs=1e-12)
    assert row["rollout_corr/kl_k1"] == pytest.approx(12 / 15, abs=1e-12)
