"""Trust regions: sign-gated masks, exact gradients, and the KL3 <-> Lambert-W equivalence."""

import math

import pytest
import torch

from tether.algo.objectives import policy_term
from tether.algo.trust_region import REGIONS, RegionConfig, binary_kl, kl3_bounds, kl3_delta_for, lambert_w

pytestmark = pytest.mark.usefixtures("float64")


def grid():
    """Ratios from 0.3 to 4 crossed with advantages of both signs: [2, N]."""
    rho = torch.linspace(0.3, 4.0, 371)
    rho = torch.cat([rho, rho])
    adv = torch.cat([torch.ones(371), -torch.ones(371)])
    old = torch.log(torch.full_like(rho, 0.2))  # pi_old(y) = 0.2
    logp = (old + rho.log()).requires_grad_(True)
    mask = torch.ones_like(rho, dtype=torch.bool)
    return logp[None], old[None], adv[None], mask[None]


def pg_grad(kind, cfg, surrogate="ratio"):
    logp, old, adv, mask = grid()
    out = REGIONS[kind](logp, old, adv, mask, cfg)
    (g,) = torch.autograd.grad(policy_term(logp, adv, out, surrogate).sum(), logp)
    return g[0], out, torch.exp(logp.detach() - old)[0], adv[0]


@pytest.mark.parametrize("delta,lo,hi", [(0.005, 0.903, 1.103), (0.01, 0.865, 1.148), (0.0231, 0.800, 1.231),
                                         (0.05, 0.716, 1.350), (0.1, 0.617, 1.516)])
def test_kl3_bounds_match_table(delta, lo, hi):
    low, up = kl3_bounds(delta)
    assert round(low, 3) == lo and round(up, 3) == hi
    for t in (low, up):  # both are roots of t - log t = 1 + delta
        assert t - math.log(t) == pytest.approx(1 + delta, abs=1e-12)
    assert low < 1 < up and (up - 1) > (1 - low)  # asymmetric toward clip-higher


def test_kl3_bounds_near_one_expansion():
    d = 1e-4
    low, up = kl3_bounds(d)
    assert low == pytest.approx(1 - math.sqrt(2 * d) + 2 * d / 3, abs=1e-5)
    assert up == pytest.approx(1 + math.sqrt(2 * d) + 2 * d / 3, abs=1e-5)


@pytest.mark.parametrize("z", [-1 / math.e + 1e-12, -0.3, -0.1, -1e-3, -1e-8])
def test_lambert_w_both_branches(z):
    for b in (0, -1):
        w = lambert_w(z, b)
        assert w * math.exp(w) == pytest.approx(z, rel=1e-10, abs=1e-14)
        assert (w >= -1) if b == 0 else (w <= -1)
    for z in (0.5, 1.0, 10.0):
        w = lambert_w(z, 0)
        assert w * math.exp(w) == pytest.approx(z, rel=1e-12)


def test_kl3_mask_equals_ratio_mask_with_lambert_bounds():
    delta = 0.05
    low, up = kl3_bounds(delta)
    g3, o3, rho, adv = pg_grad("kl3", RegionConfig("kl3", delta=delta))
    gr, orr, _, _ = pg_grad("ratio", RegionConfig("ratio", eps_low=1 - low, eps_high=up - 1))
    assert torch.equal(o3.keep, orr.keep) and torch.equal(g3, gr)
    # and it is the k3 test itself: k3(rho) <= delta  <=>  low <= rho <= up
    k3 = rho - 1 - rho.log()
    outside = k3 > delta
    assert torch.equal(~o3.keep[0], outside & (((adv > 0) & (rho > 1)) | ((adv < 0) & (rho < 1))))


def test_atr_default_delta_is_closest_to_clip_higher(monkeypatch):
    d = kl3_delta_for(0.2, 0.28)
    low, up = kl3_bounds(d)
    assert abs(low - 0.8) < 0.03 and abs(up - 1.28) < 0.03
    # The constant the recipe uses is that fit, rounded as documented (docs/algorithms.md:
    # delta = 0.03, kl3_delta_for(0.2, 0.28) = 0.0295) ...
    from tether.config import recipes
    from tether.config.recipes import recipe

    assert recipes.ATR_DELTA == round(d, 2) == 0.03
    # ... and atr_grpo's region is the KL3 region with that constant, read when the recipe is built.
    r = recipe("atr_grpo").region
    assert r.kind == "kl3" and r.delta == recipes.ATR_DELTA
    monkeypatch.setattr(recipes, "ATR_DELTA", 0.05)
    assert recipe("atr_grpo").region.delta == 0.05


@pytest.mark.parametrize("surrogate", ["ratio", "reinforce"])
def test_ratio_region_gradient_is_ppo_clip_gradient(surrogate):
    """Gradient of -A*rho with the sign-gated mask == gradient of -min(rho A, clip(rho) A)."""
    cfg = RegionConfig("ratio", eps_low=0.2, eps_high=0.28)
    g, out, rho, adv = pg_grad("ratio", cfg, surrogate)
    logp, old, adv2, _ = grid()
    r = torch.exp(logp - old)
    ppo = -torch.minimum(r * adv2, r.clamp(0.8, 1.28) * adv2)
    (g_ppo,) = torch.autograd.grad(ppo.sum(), logp)
    assert torch.allclose(g, g_ppo[0])
    # dropped exactly where the table says
    want_drop = ((adv > 0) & (rho > 1.28)) | ((adv < 0) & (rho < 0.8))
    assert torch.equal(g == 0, want_drop)
    assert torch.equal(out.high[0], (adv > 0) & (rho > 1.28)) and torch.equal(out.low[0], (adv < 0) & (rho < 0.8))


def test_dual_clip_gradient_is_dual_ppo_gradient():
    cfg = RegionConfig("dual", eps_low=0.2, eps_high=0.28, clip_c=3.0)
    g, out, rho, adv = pg_grad("dual", cfg)
    logp, old, adv2, _ = grid()
    r = torch.exp(logp - old)
    obj = torch.minimum(r * adv2, r.clamp(0.8, 1.28) * adv2)
    obj = torch.where(adv2 < 0, torch.maximum(obj, 3.0 * adv2), obj)
    (g_ref,) = torch.autograd.grad((-obj).sum(), logp)
    assert torch.allclose(g, g_ref[0])
    assert torch.equal(out.dual[0], (adv < 0) & (rho > 3.0))


def test_rpg_clip_reinforce_gradient():
    """RPG-Style Clip: A>=0 passes while rho <= 1+eps_high; A<0 while 1-eps_low <= rho <= c; weight sg(rho)."""
    cfg = RegionConfig("rpg_clip", eps_low=0.2, eps_high=0.28, clip_c=3.0)
    g, out, rho, adv = pg_grad("rpg_clip", cfg, "reinforce")
    keep = torch.where(adv > 0, rho <= 1.28, (rho >= 0.8) & (rho <= 3.0))
    # d/dlogp of -sg(A rho) logp is -A rho where kept
    assert torch.allclose(g, torch.where(keep, -adv * rho, torch.zeros_like(rho)))


def test_tv_and_binary_kl_regions():
    logp, old, adv, mask = grid()
    p, q = logp.detach().exp()[0], old.exp()[0]
    a = adv[0]
    tv = REGIONS["tv"](logp, old, adv, mask, RegionConfig("tv", delta=0.1))
    want = ((a > 0) & (p - q > 0.1)) | ((a < 0) & (q - p > 0.1))
    assert torch.equal(~tv.keep[0], want)
    bk = REGIONS["binary_kl"](logp, old, adv, mask, RegionConfig("binary_kl", delta=0.05))
    kl = q * (q / p).log() + (1 - q) * ((1 - q) / (1 - p).clamp_min(1e-300)).log()
    want = (kl > 0.05) & (((a > 0) & (p > q)) | ((a < 0) & (p < q)))
    assert torch.equal(~bk.keep[0], want)
    assert torch.allclose(binary_kl(q, p.clamp(max=1 - 1e-12)), kl.clamp(max=1e300), equal_nan=True)


def test_cispo_weight_truncation_no_mask():
    g, out, rho, adv = pg_grad("cispo", RegionConfig("cispo", eps_high=0.28), "reinforce")
    assert out.keep.all()
    assert torch.allclose(g, -adv * rho.clamp(max=1.28))
    assert torch.equal(out.high[0], rho > 1.28)


def test_gspo_sequence_ratio_and_gradient():
    torch.manual_seed(0)
    B, T = 4, 6
    old = torch.randn(B, T).log_softmax(-1)
    logp = (old + 0.01 * torch.randn(B, T)).requires_grad_(True)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 4:] = False
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None].expand(B, T)
    cfg = RegionConfig("gspo", eps_low=0.5, eps_high=0.5)  # wide: nothing clipped
    out = REGIONS["gspo"](logp, old, adv, mask, cfg)
    n = mask.sum(-1, keepdim=True)
    s = torch.exp(((logp - old) * mask).sum(-1, keepdim=True) / n)
    assert torch.allclose(out.ratio, s.expand(B, T))
    # gradient of the token-summed ratio loss / |y| == gradient of the sequence ratio
    loss = (-(adv * out.ratio) * mask).sum(-1) / n[:, 0]
    (g1,) = torch.autograd.grad(loss.sum(), logp)
    (g2,) = torch.autograd.grad((-(adv[:, 0] * s[:, 0])).sum(), logp)
    assert torch.allclose(g1, g2)
    tight = REGIONS["gspo"](logp, old, adv, mask, RegionConfig("gspo", eps_low=1e-6, eps_high=1e-6))
    seq_out = ((adv[:, 0] > 0) & (s[:, 0] > 1 + 1e-6)) | ((adv[:, 0] < 0) & (s[:, 0] < 1 - 1e-6))
    assert torch.equal(~tight.keep, seq_out[:, None].expand(B, T))


def test_region_errors():
    logp, old, adv, mask = grid()
    with pytest.raises(ValueError, match="delta > 0"):
        REGIONS["kl3"](logp, old, adv, mask, RegionConfig("kl3"))
    with pytest.raises(ValueError, match="clip_c > 1"):
        REGIONS["dual"](logp, old, adv, mask, RegionConfig("dual"))
    with pytest.raises(ValueError, match="Valid choices"):
        REGIONS["ppo"]
