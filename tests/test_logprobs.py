"""Tests for tether.logprobs: the chunked engine against the naive full-logits path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tether.logprobs import TokenStats, response_stats, token_stats

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

TOL = {torch.float64: 1e-9, torch.float32: 1e-5}


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def naive_from_logits(logits, targets, *, temperature=1.0, softcap=None, topk=0, gather_ids=None):
    """Reference statistics from full logits [..., V] (materialized)."""
    z = logits
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logq = torch.log_softmax(z, dim=-1)  # [..., V]
    logp = logq.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(logq.exp() * logq).sum(-1)
    topk_ids = topk_logp = ids_logp = None
    if topk:
        topk_logp, topk_ids = logq.topk(topk, dim=-1)
    if gather_ids is not None:
        ids_logp = logq.gather(-1, gather_ids)
    return TokenStats(logp=logp, entropy=ent, topk_ids=topk_ids, topk_logp=topk_logp, ids_logp=ids_logp)


def scalar_loss(st: TokenStats, coefs) -> torch.Tensor:
    """Random linear combination of every differentiable statistic."""
    loss = (coefs["logp"] * st.logp).sum() + (coefs["ent"] * st.entropy).sum()
    if st.topk_logp is not None:
        loss = loss + (coefs["topk"] * st.topk_logp).sum()
    if st.ids_logp is not None:
        loss = loss + (coefs["ids"] * st.ids_logp).sum()
    return loss


def make_coefs(lead_shape, k_top, k_ids, dtype, seed=123):
    g = torch.Generator().manual_seed(seed)
    return {
        "logp": torch.randn(lead_shape, generator=g, dtype=dtype),
        "ent": torch.randn(lead_shape, generator=g, dtype=dtype),
        "topk": torch.randn(*lead_shape, max(k_top, 1), generator=g, dtype=dtype)[..., :k_top],
        "ids": torch.randn(*lead_shape, max(k_ids, 1), generator=g, dtype=dtype)[..., :k_ids],
    }


def assert_close(a, b, tol, what=""):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"{what}: max abs diff {err:.3g} > {tol}"


def assert_stats_close(a: TokenStats, b: TokenStats, tol):
    assert_close(a.logp, b.logp, tol, "logp")
    assert_close(a.entropy, b.entropy, tol, "entropy")
    if b.topk_logp is not None:
        assert torch.equal(a.topk_ids, b.topk_ids)
        assert_close(a.topk_logp, b.topk_logp, tol, "topk_logp")
    if b.ids_logp is not None:
        assert_close(a.ids_logp, b.ids_logp, tol, "ids_logp")


def tiny_llama(vocab=97, tie=False, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        pad_token_id=0,
    )
    # Default (sdpa) attention: HF's eager attention yields NaN at fully padded rows in float64.
    model = LlamaForCausalLM(cfg).to(dtype)
    # Larger logits than the default init so the distributions are far from uniform.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def make_batch(vocab, prompt_lens, resp_lens, seed=0, k_ids=3):
    """Left-padded prompts and right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    B, P, T = len(prompt_lens), max(prompt_lens), max(resp_lens)
    prompt_ids = torch.zeros(B, P, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.bool)
    response_ids = torch.zeros(B, T, dtype=torch.long)
    response_mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (p, t) in enumerate(zip(prompt_lens, resp_lens)):
        prompt_ids[b, P - p :] = torch.randint(1, vocab, (p,), generator=g)
        prompt_mask[b, P - p :] = True
        response_ids[b, :t] = torch.randint(1, vocab, (t,), generator=g)
        response_mask[b, :t] = True
    gather_ids = torch.randint(0, vocab, (B, T, k_ids), generator=g)
    return prompt_ids, prompt_mask, response_ids, response_mask, gather_ids


def naive_response_stats(model, prompt_ids, prompt_mask, response_ids, response_mask, **kw):
    """Full-logits reference for response_stats, laid out [B, T] with zeros at padding."""
    P, T = prompt_ids.shape[1], response_ids.shape[1]
    ids = torch.cat([prompt_ids, response_ids], 1)
    am = torch.cat([prompt_mask, response_mask], 1).long()
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
    logits = logits[:, P - 1 : P + T - 1]  # [B, T, V]
    st = naive_from_logits(logits, response_ids, **kw)
    m = response_mask

    def z(x):
        if x is None:
            return None
        mm = m.reshape(m.shape + (1,) * (x.dim() - 2))
        return torch.where(mm, x, torch.zeros((), dtype=x.dtype))

    return TokenStats(z(st.logp), z(st.entropy), z(st.topk_ids), z(st.topk_logp), z(st.ids_logp))


# --------------------------------------------------------------------------- #
# token_stats
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_size", [3, 7, 1024])
@pytest.mark.parametrize("with_bias", [False, True])
def test_token_stats_matches_naive(dtype, chunk_size, with_bias):
    g = torch.Generator().manual_seed(0)
    N, H, V, k_top, k_ids = 23, 16, 61, 4, 3
    hidden = torch.randn(N, H, generator=g, dtype=dtype, requires_grad=True)
    weight = (2 * torch.randn(V, H, generator=g, dtype=dtype)).requires_grad_()
    bias = torch.randn(V, generator=g, dtype=dtype).requires_grad_() if with_bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    gather_ids = torch.randint(0, V, (N, k_ids), generator=g)
    coefs = make_coefs((N,), k_top, k_ids, dtype)
    tol = TOL[dtype]

    st = token_stats(hidden, weight, targets, bias=bias, topk=k_top, gather_ids=gather_ids, chunk_size=chunk_size)
    params = [hidden, weight] + ([bias] if with_bias else [])
    grads = torch.autograd.grad(scalar_loss(st, coefs), params)

    logits = F.linear(hidden, weight, bias)
    ref = naive_from_logits(logits, targets, topk=k_top, gather_ids=gather_ids)
    ref_grads = torch.autograd.grad(scalar_loss(ref, coefs), params)

    assert st.logp.dtype == dtype and st.topk_ids.dtype == torch.long
    assert_stats_close(st, ref, tol)
    for a, b, name in zip(grads, ref_grads, ["hidden", "weight", "bias"]):
        assert_close(a, b, tol * 10, f"grad {name}")


@pytest.mark.parametrize("seed, N, H, V, w_scale, temperature, softcap, k_top, k_ids", [
    pytest.param(1, 11, 8, 40, 1.0, 0.7, None, 3, 2, id="temperature-0.7"),
    pytest.param(1, 11, 8, 40, 1.0, 1.3, None, 3, 2, id="temperature-1.3"),
    # the private soft-capping path (used for Gemma-2 configs)
    pytest.param(2, 9, 8, 30, 3.0, 0.8, 5.0, 2, 0, id="softcap"),
])
def test_token_stats_temperature_and_softcap(seed, N, H, V, w_scale, temperature, softcap, k_top, k_ids):
    """Values and gradients against the naive formula, with a temperature and (private path) soft-capping."""
    from tether.logprobs import token_stats_capped

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (w_scale * torch.randn(V, H, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    gather_ids = torch.randint(0, V, (N, k_ids), generator=g) if k_ids else None
    coefs = make_coefs((N,), k_top, k_ids, torch.float64)

    if softcap is None:
        st = token_stats(hidden, weight, targets, temperature=temperature, topk=k_top, gather_ids=gather_ids,
                         chunk_size=4)
    else:
        st = token_stats_capped(hidden, weight, targets, bias=None, temperature=temperature, softcap=softcap,
                                topk=k_top, gather_ids=gather_ids, entropy=True, chunk_size=4)
    ref = naive_from_logits(hidden @ weight.T, targets, temperature=temperature, softcap=softcap, topk=k_top,
                            gather_ids=gather_ids)
    assert_stats_close(st, ref, 1e-9)
    grads = torch.autograd.grad(scalar_loss(st, coefs), [hidden, weight])
    ref_grads = torch.autograd.grad(scalar_loss(ref, coefs), [hidden, weight])
    for a, b in zip(grads, ref_grads):
        assert_close(a, b, 1e-9, "grad")


def test_token_stats_partial_outputs_and_partial_grads():
    """Only some statistics in the loss; only hidden requires grad; entropy off."""
    g = torch.Generator().manual_seed(3)
    N, H, V = 10, 8, 33
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (N,), generator=g)
    st = token_stats(hidden, weight, targets, entropy=False, topk=2, chunk_size=3)
    assert st.entropy is None and st.ids_logp is None
    (gh,) = torch.autograd.grad(st.topk_logp[:, 0].sum(), [hidden])
    ref = naive_from_logits(hidden @ weight.T, targets, topk=2)
    (rh,) = torch.autograd.grad(ref.topk_logp[:, 0].sum(), [hidden])
    assert_close(gh, rh, 1e-9, "grad hidden")


def test_token_stats_no_grad_and_empty():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, 8, generator=g, requires_grad=True)
    weight = torch.randn(20, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 20, (5,), generator=g)
    with torch.no_grad():
        st = token_stats(hidden, weight, targets, topk=2, gather_ids=targets[:, None], chunk_size=2)
    for t in (st.logp, st.entropy, st.topk_logp, st.ids_logp):
        assert not t.requires_grad
    assert_close(st.ids_logp[:, 0], st.logp, 0.0, "ids vs targets")

    empty = token_stats(hidden[:0], weight, targets[:0], topk=2)
    assert empty.logp.shape == (0,) and empty.topk_ids.shape == (0, 2)


def test_token_stats_bf16_upcasts():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(12, 16, generator=g).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(50, 16, generator=g).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (12,), generator=g)
    st = token_stats(hidden, weight, targets, topk=3, chunk_size=5)
    assert st.logp.dtype == torch.float32
    ref = naive_from_logits((hidden @ weight.T).float(), targets, topk=3)
    assert_close(st.logp, ref.logp, 1e-4, "logp")
    assert_close(st.entropy, ref.entropy, 1e-4, "entropy")
    (st.logp.sum() + st.entropy.sum()).backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    h2 = hidden.detach().clone().requires_grad_()
    w2 = weight.detach().clone().requires_grad_()
    ref = naive_from_logits((h2 @ w2.T).float(), targets)
    (ref.logp.sum() + ref.entropy.sum()).backward()
    assert_close(hidden.grad.float(), h2.grad.float(), 0.05 * h2.grad.abs().max().item(), "grad hidden")
    assert_close(weight.grad.float(), w2.grad.float(), 0.05 * w2.grad.abs().max().item(), "grad weight")


def test_chunk_memory_is_not_retained():
    """The autograd graph keeps no [chunk, V] buffers: saved tensors are inputs and O(N) stats."""
    N, H, V = 64, 8, 5000
    hidden = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        st = token_stats(hidden, weight, targets, topk=4, chunk_size=8)
    assert max(saved) <= V * H  # the largest saved tensor is the weight itself
    assert sum(saved) <= V * H + N * H + 10 * N
    st.logp.sum().backward()


# --------------------------------------------------------------------------- #
# response_stats on tiny HF models
# --------------------------------------------------------------------------- #


def test_hidden_states_last_is_post_norm():
    model = tiny_llama(tie=False)
    ids = torch.randint(0, 97, (2, 9))
    am = torch.ones_like(ids)
    out = model(input_ids=ids, attention_mask=am, output_hidden_states=True, logits_to_keep=1)
    full = model(input_ids=ids, attention_mask=am).logits
    assert_close(out.hidden_states[-1] @ model.lm_head.weight.T, full, 1e-12, "post-norm hidden")
    assert out.logits.shape[1] == 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_response_stats_matches_naive(dtype, tie, chunk_size):
    vocab = 97 if tie else 211
    model = tiny_llama(vocab=vocab, tie=tie, dtype=dtype)
    prompt_ids, prompt_mask, response_ids, response_mask, gather_ids = make_batch(vocab, [5, 2, 4], [6, 3, 1])
    k_top, tol = 4, TOL[dtype]
    coefs = make_coefs(response_ids.shape, k_top, gather_ids.shape[-1], dtype)
    params = [p for p in model.parameters() if p.requires_grad]

    st = response_stats(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature=0.9,
                        topk=k_top, gather_ids=gather_ids, chunk_size=chunk_size)
    grads = torch.autograd.grad(scalar_loss(st, coefs), params)
    ref = naive_response_stats(model, prompt_ids, prompt_mask, response_ids, response_mask,
                               temperature=0.9, topk=k_top, gather_ids=gather_ids)
    ref_grads = torch.autograd.grad(scalar_loss(ref, coefs), params, allow_unused=True)

    assert st.logp.shape == response_ids.shape and st.topk_ids.shape == (*response_ids.shape, k_top)
    assert st.logp.dtype == dtype
    assert_stats_close(st, ref, tol)
    pad = ~response_mask
    for t in (st.logp, st.entropy, st.topk_ids, st.topk_logp, st.ids_logp):
        assert (t[pad] == 0).all()
    scale = max(g.abs().max().item() for g in ref_grads if g is not None)
    for a, b in zip(grads, ref_grads):
        b = torch.zeros_like(a) if b is None else b
        assert_close(a, b, tol * max(1.0, scale), "param grad")


def test_response_stats_padding_matches_unpadded_rows():
    model = tiny_llama(vocab=150)
    prompt_lens, resp_lens = [6, 1, 3], [2, 5, 4]
    prompt_ids, prompt_mask, response_ids, response_mask, gather_ids = make_batch(150, prompt_lens, resp_lens, seed=7)
    with torch.no_grad():
        st = response_stats(model, prompt_ids, prompt_mask, response_ids, response_mask, topk=3,
                            gather_ids=gather_ids, chunk_size=7)
        for b, (p, t) in enumerate(zip(prompt_lens, resp_lens)):
            pi = prompt_ids[b : b + 1, prompt_ids.shape[1] - p :]
            ri = response_ids[b : b + 1, :t]
            row = response_stats(model, pi, torch.ones_like(pi, dtype=torch.bool), ri,
                                 torch.ones_like(ri, dtype=torch.bool), topk=3, gather_ids=gather_ids[b : b + 1, :t])
            ids = torch.cat([pi, ri], 1)
            logits = model(input_ids=ids).logits[:, p - 1 : p + t - 1]
            ref = naive_from_logits(logits, ri, topk=3, gather_ids=gather_ids[b : b + 1, :t])
            assert_stats_close(row, ref, 1e-9)
            sliced = TokenStats(st.logp[b : b + 1, :t], st.entropy[b : b + 1, :t], st.topk_ids[b : b + 1, :t],
                                st.topk_logp[b : b + 1, :t], st.ids_logp[b : b + 1, :t])
            assert_stats_close(sliced, ref, 1e-9)
            assert (st.logp[b, t:] == 0).all() and (st.topk_ids[b, t:] == 0).all()


def test_response_stats_no_grad():
    model = tiny_llama(vocab=80, dtype=torch.float32)
    batch = make_batch(80, [3, 2], [4, 2])
    with torch.no_grad():
        st = response_stats(model, *batch[:4], topk=2, gather_ids=batch[4], chunk_size=3)
    for t in (st.logp, st.entropy, st.topk_logp, st.ids_logp):
        assert not t.requires_grad
    ref = naive_response_stats(model, *batch[:4], topk=2, gather_ids=batch[4])
    assert_stats_close(st, ref, 1e-5)


def _peft_lora_llama():
    """A LoRA-wrapped tiny Llama, lm_head adapted too; its batch and response_stats options."""
    peft = pytest.importorskip("peft")
    base = tiny_llama(vocab=120, dtype=torch.float64)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"],
                          init_lora_weights=False, lora_dropout=0.0)
    model = peft.get_peft_model(base, cfg)
    assert any("lm_head" in n for n, p in model.named_parameters() if p.requires_grad)
    return model, make_batch(120, [4, 2], [3, 5], seed=3), {}


def _gemma2_softcap():
    """A tiny Gemma-2 with final logit soft-capping; its batch and response_stats options."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=90, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       final_logit_softcapping=3.0, attn_logit_softcapping=None, pad_token_id=0)
    model = Gemma2ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    # Gemma-2 only has eager attention, which gives NaN at fully left-padded rows in float64:
    # equal prompt lengths, right-padded responses. Its forward already soft-caps the logits
    # (the naive reference reads them as they are).
    return model, make_batch(90, [3, 3], [4, 2], seed=5), {"temperature": 1.2}


@pytest.mark.parametrize("build", [_peft_lora_llama, _gemma2_softcap], ids=["peft_lora", "gemma2_softcap"])
def test_response_stats_lora_and_softcapped_models(build):
    model, batch, kw = build()
    coefs = make_coefs(batch[2].shape, 2, batch[4].shape[-1], torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    st = response_stats(model, *batch[:4], topk=2, gather_ids=batch[4], chunk_size=3, **kw)
    grads = torch.autograd.grad(scalar_loss(st, coefs), params)
    ref = naive_response_stats(model, *batch[:4], topk=2, gather_ids=batch[4], **kw)
    ref_grads = torch.autograd.grad(scalar_loss(ref, coefs), params)
    assert_stats_close(st, ref, 1e-9)
    for a, b in zip(grads, ref_grads):
        assert_close(a, b, 1e-9, "param grad")


def test_response_stats_rejects_unknown_logit_transform():
    class Scaled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    torch.manual_seed(0)
    ref = tiny_llama(vocab=64)
    model = Scaled(ref.config).double()
    model.load_state_dict(ref.state_dict())
    batch = make_batch(64, [2], [3])
    with pytest.raises(ValueError, match="does not reproduce"):
        response_stats(model, *batch[:4])


def _repeat_prompts(batch, counts):
    """A batch whose rows repeat each prompt counts[i] times (the G samples of a group)."""
    prompt_ids, prompt_mask, response_ids, response_mask, gather_ids = batch
    rep = torch.tensor([i for i, c in enumerate(counts) for _ in range(c)])
    return prompt_ids[rep], prompt_mask[rep], response_ids, response_mask, gather_ids


@pytest.mark.parametrize("tie", [False, True])
def test_shared_prompt_equals_unshared_values_and_gradients(tie):
    """Running each distinct prompt once (KV expanded to its rows) changes nothing but the work."""
    vocab = 97
    model = tiny_llama(vocab=vocab, tie=tie, dtype=torch.float64)
    # 3 distinct prompts of lengths 5, 2, 4 (left padding), repeated 3, 1, 2 times; ragged responses.
    base = make_batch(vocab, [5, 2, 4, 1, 1, 1], [6, 3, 1, 4, 6, 2], seed=5)
    batch = _repeat_prompts(base, [3, 1, 2])
    coefs = make_coefs(batch[2].shape, 3, batch[4].shape[-1], torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))

    st = response_stats(model, *batch[:4], topk=3, gather_ids=batch[4], chunk_size=4)
    grads = torch.autograd.grad(scalar_loss(st, coefs), params)
    shared_tokens = sum(seen)
    seen.clear()
    plain = response_stats(model, *batch[:4], topk=3, gather_ids=batch[4], chunk_size=4, share_prompt=False)
    plain_grads = torch.autograd.grad(scalar_loss(plain, coefs), params)
    plain_tokens = sum(seen)
    hook.remove()
    ref = naive_response_stats(model, *batch[:4], topk=3, gather_ids=batch[4])

    B, P = batch[0].shape
    T = batch[2].shape[1]
    assert shared_tokens == 3 * P + B * T  # each distinct prompt once, then every response
    assert plain_tokens == B * (P + T)
    assert_stats_close(st, ref, 1e-10)
    assert_stats_close(st, plain, 1e-10)
    # HF's RMSNorm computes in float32 even in a float64 model, so gradients summed in a different
    # order (the shared prompt's rows meet in one index_add) agree to float32 rounding, not float64.
    scale = max(g.abs().max().item() for g in plain_grads)
    for a, b in zip(grads, plain_grads):
        assert_close(a, b, 1e-6 * scale, "shared-prompt grad")


def test_shared_prompt_with_lora_and_off_under_gradient_checkpointing():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(vocab=120, dtype=torch.float64),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                init_lora_weights=False, lora_dropout=0.0))
    batch = _repeat_prompts(make_batch(120, [4, 2, 1, 1], [3, 5, 2, 4], seed=3), [2, 2])
    coefs = make_coefs(batch[2].shape, 2, batch[4].shape[-1], torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    st = response_stats(model, *batch[:4], topk=2, gather_ids=batch[4], chunk_size=3)
    grads = torch.autograd.grad(scalar_loss(st, coefs), params)
    ref = naive_response_stats(model, *batch[:4], topk=2, gather_ids=batch[4])
    ref_grads = torch.autograd.grad(scalar_loss(ref, coefs), params)
    assert_stats_close(st, ref, 1e-9)
    scale = max(g.abs().max().item() for g in ref_grads)
    for a, b in zip(grads, ref_grads):
        assert_close(a, b, 1e-6 * scale, "lora grad")  # float32 RMSNorm: see the test above

    # Gradient checkpointing in training refuses a KV cache: the plain path runs (and is right).
    plain = tiny_llama(vocab=120, dtype=torch.float64)
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plain.train()
    seen = []
    plain.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    st = response_stats(plain, *batch[:4], topk=2, gather_ids=batch[4], chunk_size=3)
    B, P = batch[0].shape
    assert sum(seen) == B * (P + batch[2].shape[1])
    plain.eval()
    assert_stats_close(st, naive_response_stats(plain, *batch[:4], topk=2, gather_ids=batch[4]), 1e-9)


def test_gradient_checkpointing_detection_reads_no_deprecated_attribute(tiny_model_dir):
    """The shared-prompt path asks whether checkpointing is on without transformers' FutureWarning
    (``is_gradient_checkpointing`` is deprecated in 5.x), and the answer is right: on only in training
    with checkpointing enabled, also through a peft (LoRA) wrapper."""
    import warnings

    from tether.logprobs import _gradient_checkpointing_on
    from tether.models import ModelConfig, load_model

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        on, _ = load_model(ModelConfig(name=str(tiny_model_dir), gradient_checkpointing=True))
        off, _ = load_model(ModelConfig(name=str(tiny_model_dir)))
        on.train(), off.train()
        assert _gradient_checkpointing_on(on) is True
        assert _gradient_checkpointing_on(off) is False
        on.eval()
        assert _gradient_checkpointing_on(on) is False  # eval: no backward, the KV cache is allowed
        pytest.importorskip("peft")  # peft 0.21 reads is_gradient_checkpointing itself; load_model mutes that one
        lora, _ = load_model(ModelConfig(name=str(tiny_model_dir), gradient_checkpointing=True, lora_r=2))
        lora_off, _ = load_model(ModelConfig(name=str(tiny_model_dir), lora_r=2))
        assert _gradient_checkpointing_on(lora) is True and _gradient_checkpointing_on(lora_off) is False
