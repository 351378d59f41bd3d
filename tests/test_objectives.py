"""RPG objectives on an exactly enumerable bandit, and the composed loss.

The bandit: all sequences y = (y1, y2) over V = 3 tokens (9 arms), an autoregressive
policy pi(y) = pi(y1) pi(y2|y1) with logits theta, a fixed anchor and a different fixed
sampler pi_old. For each RPG variant D in {FKL, RKL, UFKL, URKL}:

    sum_y pi_old(y) loss_y(theta)   has gradient   -grad (E_pi[R] - beta D(pi, pi_a))

for both the fully differentiable and the REINFORCE (stop-gradient) loss forms.
"""

import itertools
import math

import pytest
import torch

from tether.algo import LossInputs, RegionConfig, compute_loss, loss_needs
from tether.algo.aggregation import aggregate
from tether.algo.kl import KL_ESTIMATORS, KLInputs, KLOptions, rpg_score_coef
from tether.config.anchor import FixedAnchorConfig
from tether.config.kl import kl_config
from tether.config.recipes import AlgoConfig, recipe

pytestmark = pytest.mark.usefixtures("float64")
V, L = 3, 2
SEQS = torch.tensor(list(itertools.product(range(V), repeat=L)))  # [9, 2]
BETA = 0.37


def seq_logp(first, second):
    """log pi(y) for every sequence: first [V] logits, second [V, V] logits (row = y1)."""
    lp1 = first.log_softmax(-1)[SEQS[:, 0]]
    lp2 = second.log_softmax(-1)[SEQS[:, 0], SEQS[:, 1]]
    return lp1 + lp2  # [9]


def make(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * scale, torch.randn(V, V, generator=g) * scale


def divergence(name, lp, la):
    p, a = lp.exp(), la.exp()
    return {
        "rpg_fkl": (a * (la - lp)).sum(),
        "rpg_rkl": (p * (lp - la)).sum(),
        "rpg_ufkl": (a * (la - lp)).sum() + (p - a).sum(),
        "rpg_urkl": (p * (lp - la)).sum() + (a - p).sum(),
    }[name]


@pytest.fixture
def bandit():
    theta = [t.requires_grad_(True) for t in make(0)]
    anchor, sampler = seq_logp(*make(1)), seq_logp(*make(2, 1.3))
    reward = torch.randn(len(SEQS), generator=torch.Generator().manual_seed(3))
    return theta, anchor.detach(), sampler.detach(), reward


def grads(scalar, theta):
    return torch.cat([g.flatten() for g in torch.autograd.grad(scalar, theta)])


def expected_loss(cfg, lp, lo, la, adv):
    """sum_y pi_old(y) compute_loss(cfg, arm y): the exact expected loss, each arm one (1, 1) batch."""
    one = torch.ones(1, 1, dtype=torch.bool)
    total = 0.0
    for y in range(len(SEQS)):
        out = compute_loss(cfg, LossInputs(logp=lp[y].view(1, 1), mask=one, adv=adv[y].view(1),
                                           old_logp=lo[y].view(1, 1), ref_logp=la[y].view(1, 1)))
        total = total + lo[y].exp() * out.loss
    return total


@pytest.mark.parametrize("variant", ["rpg_fkl", "rpg_rkl", "rpg_ufkl", "rpg_urkl"])
@pytest.mark.parametrize("form", ["ratio", "reinforce"])
@pytest.mark.parametrize("baseline", [0.0, 0.4])
def test_rpg_both_forms_equal_exact_objective_gradient(bandit, variant, form, baseline):
    """compute_loss with the rpg_X / rpg_reinforce_X recipe (placements as published: loss, or RPG's A'
    for rkl/urkl) has, in exact expectation under pi_old, the gradient of -(E_pi[R] - beta D(pi, pi_a))."""
    theta, la, lo, R = bandit
    adv = R - baseline  # a constant baseline leaves the expected gradient unchanged
    name = variant if form == "ratio" else variant.replace("rpg_", "rpg_reinforce_")
    cfg = recipe(name)
    assert cfg.surrogate == form and cfg.kl.estimator == variant
    cfg.kl.beta = BETA  # large enough that the KL gradient matters
    cfg.region = RegionConfig("none")  # pi_old is far from pi; the dual / RPG-style clip is tested in test_trust_region

    def exact():
        lp = seq_logp(*theta)
        return -((lp.exp() * R).sum() - BETA * divergence(variant, lp, la))  # minimize -J

    g_exact = grads(exact(), theta)
    g = grads(expected_loss(cfg, seq_logp(*theta), lo, la, adv), theta)
    assert torch.allclose(g, g_exact, atol=1e-12), (g, g_exact)
    g_kl = grads(BETA * divergence(variant, seq_logp(*theta), la), theta)
    assert g_exact.abs().max() > 1e-2 and g_kl.abs().max() > 1e-2  # the KL part is not negligible


@pytest.mark.parametrize("variant", ["rpg_fkl", "rpg_rkl", "rpg_ufkl", "rpg_urkl"])
def test_rpg_value_is_the_divergence(bandit, variant):
    theta, la, lo, _ = bandit
    lp = seq_logp(*theta)
    inp = KLInputs(logp=lp[None], ref_logp=la[None], old_logp=lo[None])
    val = (lo.exp() * KL_ESTIMATORS[variant](inp, KLOptions())[0]).sum()
    assert float(val.detach()) == pytest.approx(float(divergence(variant, lp, la).detach()), abs=1e-12)


def test_rpg_with_iterative_anchor_matches_paper_formulas(bandit):
    """With pi_a = pi_old the terms are the paper's: FKL -log pi, RKL w log w, UFKL w - log w - 1, URKL w log w - w."""
    theta, _, lo, _ = bandit
    lp = seq_logp(*theta)
    w = torch.exp(lp - lo)
    inp = KLInputs(logp=lp[None], ref_logp=lo[None], old_logp=lo[None])
    paper = {"rpg_fkl": -lp + lo, "rpg_rkl": w * w.log(), "rpg_ufkl": w - w.log() - 1, "rpg_urkl": w * w.log() - w + 1}
    for name, want in paper.items():
        assert torch.allclose(KL_ESTIMATORS[name](inp, KLOptions())[0], want), name
    paper_coef = {"rpg_fkl": -torch.ones_like(w), "rpg_rkl": w * (w.log() + 1), "rpg_ufkl": w - 1,
                  "rpg_urkl": w * w.log()}
    for name, want in paper_coef.items():
        assert torch.allclose(rpg_score_coef(name, inp)[0], want.detach()), name


def random_batch(seed=0, B=4, T=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 2 - 0.05
    logp = (old + 0.3 * torch.randn(B, T, generator=g)).clamp(max=-1e-3).requires_grad_(True)
    ref = old + 0.2 * torch.randn(B, T, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 5:] = False
    mask[3, 2:] = False
    adv = torch.randn(B, generator=g)
    return dict(logp=logp, old_logp=old, ref_logp=ref.clamp(max=-1e-3), mask=mask, adv=adv)


@pytest.mark.parametrize("variant", ["fkl", "rkl", "ufkl", "urkl"])
def test_rpg_recipes_full_and_reinforce_forms_have_equal_gradients(variant):
    """With no trust region, rpg_X (ratio form) and rpg_reinforce_X (REINFORCE form, incl. A' folding) agree per
    token."""
    b = random_batch()
    grads_ = []
    for name in (f"rpg_{variant}", f"rpg_reinforce_{variant}"):
        cfg = recipe(name)
        cfg.region = RegionConfig("none")
        cfg.surrogate = "ratio" if name == f"rpg_{variant}" else "reinforce"
        out = compute_loss(cfg, LossInputs(**b))
        (g,) = torch.autograd.grad(out.loss, b["logp"])
        grads_.append(g)
    assert torch.allclose(grads_[0], grads_[1], atol=1e-12)


def test_compute_loss_equals_manual_composition():
    """loss = aggregate(-A*rho (masked) + beta*KL) with every piece computed by hand."""
    b = random_batch(1)
    cfg = AlgoConfig(region=RegionConfig("ratio", 0.2, 0.28), kl=kl_config("k3", beta=0.1),
                     anchor=FixedAnchorConfig(), aggregation="seq-mean-token-mean")
    out = compute_loss(cfg, LossInputs(**b))
    logp, old, ref, mask, adv = b["logp"], b["old_logp"], b["ref_logp"], b["mask"], b["adv"][:, None]
    rho = torch.exp(logp - old)
    ppo = -torch.minimum(rho * adv, rho.clamp(0.8, 1.28) * adv)
    s = torch.exp(logp.detach() - old)
    k3 = s * (torch.exp(ref - logp) - 1 - (ref - logp))
    tok = ppo + 0.1 * k3
    want = ((tok * mask).sum(-1) / mask.sum(-1)).mean()
    (g1,) = torch.autograd.grad(out.loss, logp)
    (g2,) = torch.autograd.grad(want, logp)
    assert torch.allclose(g1, g2, atol=1e-12)
    assert out.metrics["kl"] == pytest.approx(float((k3.detach() * mask).sum() / mask.sum()))


def test_kl_in_reward_is_penalty_to_go():
    b = random_batch(2)
    cfg = AlgoConfig(region=RegionConfig("none"), kl=kl_config("k1", beta=0.5, placement="reward"),
                     anchor=FixedAnchorConfig(), aggregation="token-mean")
    out = compute_loss(cfg, LossInputs(**b))
    logp, old, ref, mask = b["logp"], b["old_logp"], b["ref_logp"], b["mask"]
    s = torch.exp(logp.detach() - old)
    kl = (s * (logp.detach() - ref)) * mask
    togo = kl.flip(-1).cumsum(-1).flip(-1)
    a = b["adv"][:, None] - 0.5 * togo
    want = aggregate(-a * torch.exp(logp - old), mask, "token-mean")
    (g1,) = torch.autograd.grad(out.loss, logp)
    (g2,) = torch.autograd.grad(want, logp)
    assert torch.allclose(g1, g2, atol=1e-12)


def test_on_policy_none_old_equals_detached_logp():
    b = random_batch(3)
    cfg = recipe("ema_pg")
    cfg.kl = kl_config("k3", beta=1e-3)
    b2 = dict(b, old_logp=None)
    b3 = dict(b, old_logp=b["logp"].detach())
    o2, o3 = compute_loss(cfg, LossInputs(**b2)), compute_loss(cfg, LossInputs(**b3))
    g2 = torch.autograd.grad(o2.loss, b["logp"])[0]
    g3 = torch.autograd.grad(o3.loss, b["logp"])[0]
    assert torch.equal(g2, g3) and o2.metrics["ratio_mean"] == pytest.approx(1.0)


def test_micro_batches_sum_to_the_full_batch_gradient():
    b = random_batch(4, B=6)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        cfg = recipe("grpo")
        cfg.aggregation = agg
        full = compute_loss(cfg, LossInputs(**b, max_len=7)).loss
        (g_full,) = torch.autograd.grad(full, b["logp"])
        n_tok, n_seq = float(b["mask"].sum()), 6.0
        g_acc = torch.zeros_like(g_full)
        for sl in (slice(0, 2), slice(2, 5), slice(5, 6)):
            part = {k: (v[sl] if torch.is_tensor(v) else v) for k, v in b.items()}
            lp = b["logp"].detach()[sl].clone().requires_grad_(True)
            part["logp"] = lp
            loss = compute_loss(cfg, LossInputs(**part, num_tokens=n_tok, num_seqs=n_seq, max_len=7)).loss
            (g,) = torch.autograd.grad(loss, lp)
            g_acc[sl] = g
        assert torch.allclose(g_full, g_acc, atol=1e-12), agg


def test_every_recipe_gives_a_finite_loss_and_gradient():
    from tether.config.recipes import RECIPES
    b = random_batch(5)
    k = 4
    g = torch.Generator().manual_seed(9)
    head = torch.randn(4, 7, k, generator=g).log_softmax(-1) - 1.0
    for name in RECIPES:
        cfg = recipe(name)
        extra = {}
        if cfg.kl.estimator.startswith("topk"):
            extra = dict(head_logp=head.clone().requires_grad_(True), head_ref_logp=head.detach() + 0.1,
                         in_head=torch.zeros(4, 7, dtype=torch.bool))
        args = dict(b)
        if cfg.anchor.kind == "iterative":
            args["ref_logp"] = b["old_logp"]
        out = compute_loss(cfg, LossInputs(**args, **extra, max_len=7))
        (gr,) = torch.autograd.grad(out.loss, b["logp"])
        assert torch.isfinite(out.loss) and torch.isfinite(gr).all(), name
        assert all(v == v for v in out.metrics.values()), name


def test_configured_agg_max_len_wins_over_the_callers_fallback():
    """Defect: the trainer always passed max_len=max_new_tokens and objectives took `max_len or cfg.agg_max_len`."""
    b = random_batch(6)
    cfg = recipe("dr_grpo")
    assert cfg.aggregation == "seq-mean-token-sum-norm"
    base = compute_loss(cfg, LossInputs(**b, max_len=7)).loss
    cfg.agg_max_len = 70
    scaled = compute_loss(cfg, LossInputs(**b, max_len=7)).loss  # the fallback 7 must not win
    assert scaled.item() == pytest.approx(base.item() / 10, rel=1e-12)
    cfg.agg_max_len = 0
    assert compute_loss(cfg, LossInputs(**b, max_len=7)).loss.item() == pytest.approx(base.item(), rel=1e-12)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("name", ["grpo", "ema_pg", "rpg_reinforce_urkl", "reinforce_pp", "gspo", "dr_grpo"])
def test_masked_positions_never_leak_inf_or_nan(name, bad):
    """Defect: masking by multiplication let an inf/NaN at a masked position (e.g. the k3 of a truncated
    response) make the loss NaN. Values and gradients must equal those of the clean batch."""
    k = 4
    clean = random_batch(7)
    g = torch.Generator().manual_seed(3)
    head = torch.randn(4, 7, k, generator=g).log_softmax(-1) - 1.0
    in_head = torch.zeros(4, 7, dtype=torch.bool)

    def run(poison: bool):
        args = {key: (v.detach().clone() if torch.is_tensor(v) else v) for key, v in clean.items()}
        hl = head.clone()
        if poison:
            m = ~args["mask"]
            for key in ("logp", "old_logp", "ref_logp"):
                args[key][m] = bad
            hl[m] = bad
        args["logp"].requires_grad_(True)
        hl.requires_grad_(True)
        cfg = recipe(name)
        if cfg.anchor.kind == "iterative":
            args["ref_logp"] = args["old_logp"]
        extra = (dict(head_logp=hl, head_ref_logp=hl.detach() + 0.1, in_head=in_head)
                 if cfg.kl.estimator.startswith("topk") else {})
        out = compute_loss(cfg, LossInputs(**args, **extra, max_len=7))
        (gr,) = torch.autograd.grad(out.loss, args["logp"])
        return out, gr

    ref_out, ref_g = run(False)
    out, gr = run(True)
    assert torch.isfinite(out.loss) and torch.isfinite(gr).all()
    assert out.loss.item() == pytest.approx(ref_out.loss.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(gr, ref_g, atol=1e-15)
    for key, v in out.metrics.items():
        assert torch.isfinite(v) and v.item() == pytest.approx(ref_out.metrics[key].item(), rel=1e-12, abs=1e-15), key


def test_loss_needs_reads_the_registries():
    """The trainer asks loss_needs which passes to run; it never parses estimator names."""
    from tether.algo.kl import KL_ESTIMATORS
    vocab = 50
    want = {"sampled": None, "sampler_topk": "sampler", "anchor_topk": "anchor", "full_vocab": "all"}
    for est in KL_ESTIMATORS.names():
        cfg = recipe("grpo")
        cfg.kl = kl_config(est, beta=0.1, **({"topk": 8} if "topk" in est else {}))  # only the top-k ones read k
        n = loss_needs(cfg, vocab)
        assert n.head == want[KL_ESTIMATORS.meta(est)["inputs"]], est
        assert n.k == {None: 0, "sampler": 8, "anchor": 8, "all": vocab}[n.head], est
        assert n.ref_logp and n.old_logp
    assert loss_needs(recipe("ema_pg"), vocab).head == "sampler"  # reverse top-k: the sampler's head
    assert loss_needs(recipe("dapo"), vocab) == loss_needs(recipe("dapo"), 7)
    assert not loss_needs(recipe("dapo"), vocab).ref_logp  # no KL term: no anchor pass
    cfg = recipe("grpo")
    cfg.kl = kl_config(estimator="topk_fwd", beta=0.1, topk=500)
    assert loss_needs(cfg, vocab).k == vocab  # k is capped at the vocabulary


def test_registry_metadata_is_required_and_lookup_is_checked():
    from tether.algo.registry import Registry
    reg = Registry("thing", required=("inputs",))
    with pytest.raises(ValueError, match="without inputs"):
        reg.register("a")
    reg.register("b", inputs="x")(lambda: 0)
    assert reg.meta("b") == {"inputs": "x"} and reg.where(inputs="x") == ("b",)
    with pytest.raises(ValueError, match="unknown thing 'c'"):
        reg.meta("c")
