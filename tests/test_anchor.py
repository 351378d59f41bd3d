"""Anchors: EMA closed form, fp32 accumulation under bf16, reset/kl_reset/iterative semantics, swapping, state."""

import pytest
import torch
from torch import nn

from tether.anchor import Anchor, make_anchor
from tether.config.anchor import (
    EMAAnchorConfig,
    FixedAnchorConfig,
    IterativeAnchorConfig,
    KLResetAnchorConfig,
    NoAnchorConfig,
    ResetAnchorConfig,
)


def net(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def set_params(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))


def flat(tensors):
    return torch.cat([t.flatten().double() for t in tensors])


def test_ema_closed_form_after_n_updates():
    model = net()
    theta0 = flat(model.parameters())
    eta, every = 0.9, 3
    anchor = Anchor(EMAAnchorConfig(eta=eta, every=every), model)
    want = theta0.clone()  # the EMA run step by step: theta_a <- eta*theta_a + (1-eta)*theta at every move
    assert torch.allclose(flat(anchor.master), want, atol=1e-6)
    thetas = []
    for step in range(1, 13):
        set_params(model, step)
        moved = anchor.update(model, step)
        assert moved == (step % every == 0)
        if moved:
            thetas.append(flat(model.parameters()))
            want = eta * want + (1 - eta) * thetas[-1]
        assert torch.allclose(flat(anchor.master), want, atol=1e-6), step  # unmoved between updates
    n = len(thetas)
    closed = eta**n * theta0 + sum((1 - eta) * eta ** (n - 1 - i) * t for i, t in enumerate(thetas))
    assert anchor.num_updates == n == 4
    assert torch.allclose(flat(anchor.master), closed, atol=1e-6)


def test_ema_accumulates_in_fp32_for_a_bf16_policy():
    """Updates far below bf16 resolution add up in tether's fp32 master, and the bf16 forward copy
    follows the master: it reaches the policy's value once the master crosses the rounding midpoint."""
    model = net(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    anchor = Anchor(EMAAnchorConfig(eta=0.99, every=1), model)
    assert all(m.dtype == torch.float32 for m in anchor.master)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0078125)  # 1 + 2^-7: each EMA step moves 1e-2 * 2^-7 ~ 7.8e-5, far below bf16's 2^-7 spacing at 1

    def forward_weight():
        with anchor.applied(model):
            assert model[0].weight.dtype == torch.bfloat16
            return model[0].weight.detach().clone()

    for step in range(1, 51):
        anchor.update(model, step)
    want = 1.0 + 2**-7 * (1 - 0.99**50)  # 1.0031: below the midpoint 1 + 2^-8
    assert anchor.num_updates == 50
    assert torch.allclose(anchor.master[0], torch.full_like(anchor.master[0], want), atol=1e-6)
    assert torch.equal(forward_weight(), anchor.master[0].to(torch.bfloat16))
    assert (forward_weight() == 1.0).all()
    for step in range(51, 101):
        anchor.update(model, step)
    want = 1.0 + 2**-7 * (1 - 0.99**100)  # 1.0049: past the midpoint, so bf16 rounds it to 1 + 2^-7
    assert torch.allclose(anchor.master[0], torch.full_like(anchor.master[0], want), atol=1e-6)
    assert (forward_weight() == 1.0078125).all()


def test_applied_swaps_without_copy_and_restores():
    model = net()
    anchor = Anchor(FixedAnchorConfig(), model)
    x = torch.randn(5, 4)
    y0 = model(x).detach()
    set_params(model, 7)
    y_policy = model(x).detach()
    ptr = model[0].weight.data_ptr()
    with anchor.applied(model):
        assert torch.allclose(model(x), y0)
        assert model[0].weight.data_ptr() == anchor.master[0].data_ptr()
    assert torch.allclose(model(x), y_policy) and model[0].weight.data_ptr() == ptr
    # the swap never disturbs training: a gradient step after the anchor pass uses the policy weights
    loss = model(x).sum()
    loss.backward()
    assert model[0].weight.grad is not None


def test_fixed_never_moves_and_reset_copies_every_n():
    model = net()
    theta0 = flat(model.parameters())
    fixed = Anchor(FixedAnchorConfig(), model)
    reset = Anchor(ResetAnchorConfig(every=2), model)
    set_params(model, 1)
    assert not fixed.update(model, 1) and not reset.update(model, 1)
    assert torch.equal(flat(reset.master), theta0)
    assert reset.update(model, 2)
    assert torch.equal(flat(reset.master), flat(model.parameters()))
    assert torch.equal(flat(fixed.master), theta0)


def test_kl_triggered_reset():
    model = net()
    a = Anchor(KLResetAnchorConfig(kappa=0.05, kl_smoothing=0.5), model)
    set_params(model, 3)
    assert not a.update(model, 1, token_kl=0.04)  # ma 0.02
    assert not a.update(model, 2, token_kl=0.06)  # ma 0.04
    assert a.update(model, 3, token_kl=0.1)  # ma 0.07 > 0.05 -> reset
    assert a.kl_ma == 0.0 and torch.equal(flat(a.master), flat(model.parameters()))
    with pytest.raises(ValueError, match="token KL"):
        a.update(model, 4)


def test_iterative_anchor_keeps_nothing():
    model = net()
    a = make_anchor(IterativeAnchorConfig(), model)
    assert not a.needs_forward and a.master == [] and not a.update(model, 1)
    with pytest.raises(ValueError, match="sampler"):
        with a.applied(model):
            pass
    assert make_anchor(NoAnchorConfig(), model) is None


def saved(a: Anchor) -> dict:
    """What ``tether.rundir.checkpoint`` saves of an anchor and hands back to ``load_state_dict`` on resume."""
    return {"kind": a.kind, "num_updates": a.num_updates, "kl_ma": a.kl_ma, "tensors": a.tensors()}


def test_state_round_trip():
    model = net()
    a = Anchor(EMAAnchorConfig(eta=0.5, every=1), model)
    set_params(model, 2)
    a.update(model, 1)
    state = saved(a)
    b = Anchor(EMAAnchorConfig(eta=0.5, every=1), net(seed=5))
    b.load_state_dict(state, model)
    assert b.num_updates == 1 and torch.equal(flat(b.master), flat(a.master))
    with pytest.raises(ValueError, match="'ema' anchor"):
        Anchor(FixedAnchorConfig(), model).load_state_dict(state)


def test_load_state_dict_without_model_refreshes_the_bf16_forward_copy():
    """A bf16 policy's EMA anchor forwards through a bf16 copy of its fp32 master; restoring a state
    without passing the model must refresh that copy too, or ``applied`` forwards stale weights."""
    model = net(torch.bfloat16)
    cfg = EMAAnchorConfig(eta=0.5, every=1)
    a = Anchor(cfg, model)
    set_params(model, 4)
    assert a.update(model, 1)
    state = saved(a)
    b = Anchor(cfg, model)  # fresh: its master and forward copy are the current policy
    b.load_state_dict(state)
    assert b.num_updates == 1 and torch.equal(flat(b.master), flat(a.master))
    x = torch.randn(5, 4).to(torch.bfloat16)
    with torch.no_grad():
        with a.applied(model):
            want = model(x)
        with b.applied(model):
            got = model(x)
        assert not torch.equal(want, model(x))  # the anchor differs from the policy: the check has teeth
    assert torch.equal(got, want)


def test_ema_master_is_fp64_for_an_fp64_policy():
    """The master is at least as precise as the policy: promote(float32, dtype). fp64 stays fp64 and
    an update is the exact fp64 formula theta_a <- eta theta_a + (1 - eta) theta."""
    model = net(torch.float64)
    eta = 0.9
    a = Anchor(EMAAnchorConfig(eta=eta, every=1), model)
    assert all(m.dtype == torch.float64 for m in a.master)
    theta0 = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-9 * torch.randn_like(p))  # far below fp32 resolution near weights of size ~0.1-1
    a.update(model, 1)
    for m, t0, p in zip(a.master, theta0, model.parameters()):
        want = eta * t0 + (1 - eta) * p.detach()
        assert (m - want).abs().max() <= 1e-12
        assert not torch.equal(m, t0)  # the 1e-10-sized move was kept
    with a.applied(model):  # no separate forward copy: the fp64 master is the forward weight
        assert model[0].weight.data_ptr() == a.master[0].data_ptr()


def test_lora_tracks_only_adapters():
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = peft.get_peft_model(LlamaForCausalLM(cfg), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    a = Anchor(EMAAnchorConfig(eta=0.9, every=1), model)
    assert a.names and all("lora_" in n for n in a.names)
    n_adapter = sum(t.numel() for t in a.master)
    assert n_adapter < 0.1 * sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.1)
        y_pol = model(ids).logits
        with a.applied(model):
            y_anchor = model(ids).logits
    assert not torch.allclose(y_pol, y_anchor)
    with model.disable_adapter(), torch.no_grad():
        y_base = model(ids).logits
    assert torch.allclose(y_anchor, y_base, atol=1e-6)  # the initial adapters (B = 0) = the base model
