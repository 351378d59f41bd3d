"""HFEngine sessions (issue #26): a multi-turn episode's context is encoded once.

Every test runs the same multi-turn simulation (no agent: turn 0 generates from the prompts, each later
turn appends "observation" ids to each row's prompt + response and generates again under the same
session keys) with ``reuse_kv=True`` and ``reuse_kv=False``, and compares: the ids must be identical,
the sampler log-probs equal to 1e-5, and the reusing engine must feed the model only the new tokens.
"""

from __future__ import annotations

import pytest
import torch

from tether.logprobs import cache_kwarg
from tether.models import ModelConfig, load_model
from tether.rollout import HFEngine, SamplingParams
from tether.rollout.sessions import SessionStore, common_prefix, layout

TEXTS = ["Hello world", "What is 2 + 2? The answer", "x", "Let x be a number such that 3x + 5 = 20. Then",
         "Question: how many apples are left?"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """(model, tokenizer) with the EOS logit raised, so that some rows end at EOS."""
    model, tok = load_model(ModelConfig(name=str(tiny_model_dir)))
    bias = torch.zeros(model.config.vocab_size)
    bias[tok.eos_token_id] = 3.0
    model.lm_head.register_forward_hook(lambda mod, args, out: out + bias)
    return model, tok


class FedTokens:
    """Counts the real (attention mask 1) tokens fed to the model's forward, and all fed columns."""

    def __init__(self, model):
        self.real = self.cols = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")  # generate drops a mask of all ones
        self.cols += ids.numel()
        self.real += ids.numel() if mask is None else int(mask[:, -ids.shape[1]:].sum())

    def take(self) -> tuple[int, int]:
        out, self.real, self.cols = (self.real, self.cols), 0, 0
        return out


def _resp(rb, i) -> list[int]:
    return rb.response_ids[i][rb.response_mask[i]].tolist()


def _episodes(engine, tok, params, turns=3, counter=None, odd=False):
    """Run ``turns`` turns; returns per turn (batch, prompts, usable cached lengths before, (real, cols) fed).

    ``odd``: at turn 2, row 1's prompt does not extend its context (a new first token), row 2's drops its
    context's last 3 tokens before the observation (a stored prefix longer than the usable one), and
    row 3's is its context itself, no observation (all stored tokens are the prompt).
    """
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    keys = [("ep", i) for i in range(len(prompts) * params.n)]
    ctx, out = None, []
    for t in range(turns):
        if t == 0:
            call_prompts, p = prompts, params
        else:
            call_prompts = [c + tok(f" obs {t}" + " y" * (i % 3))["input_ids"] for i, c in enumerate(ctx)]
            if t == 2 and odd:
                call_prompts[1] = [tok.bos_token_id] + call_prompts[1][3:]
                call_prompts[2] = ctx[2][:-3] + call_prompts[2][len(ctx[2]):]
                call_prompts[3] = ctx[3]
            p = SamplingParams(**{**params.__dict__, "n": 1})
            if p.seed is not None:
                p.seed += t
        usable = [engine.session_store.usable(k, call_prompts[i // p.n]) for i, k in enumerate(keys)]
        rb = engine.generate(call_prompts, p, sessions=keys)
        out.append((rb, call_prompts, usable, counter.take() if counter else None))
        ctx = [call_prompts[i // p.n] + _resp(rb, i) for i in range(len(keys))]
    return out, keys


def _same(a, b, logp=True):
    for (x, _, _, _), (y, _, _, _) in zip(a, b):
        assert torch.equal(x.response_ids, y.response_ids) and torch.equal(x.response_mask, y.response_mask)
        assert x.finish_reason == y.finish_reason and x.texts == y.texts
        if logp:
            torch.testing.assert_close(x.sampler_logp[x.response_mask], y.sampler_logp[y.response_mask],
                                       rtol=0, atol=1e-5)


def _engines(model, tok, **kw):
    opts = dict(batch_size=3, prune_every=3, record_logp=True) | kw
    return HFEngine(model, tok, reuse_kv=True, **opts), HFEngine(model, tok, reuse_kv=False, **opts)


def test_greedy_turns_match_without_reuse(tiny):
    model, tok = tiny
    params = SamplingParams(n=2, greedy=True, max_new_tokens=10, stop=["q"])
    reuse, plain = _engines(model, tok)
    a, keys = _episodes(reuse, tok, params)
    b, _ = _episodes(plain, tok, params)
    _same(a, b)
    assert len(reuse.session_store) == len(keys) and len(plain.session_store) == 0
    assert sum(u for _, _, usable, _ in a[1:] for u in usable) > 0  # turns 1 and 2 did reuse


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kw", [{}, {"kv_cache": "dynamic", "sampler": "multinomial", "prune_every": 0}],
                         ids=["growing-inverse_cdf", "dynamic-multinomial"])
def test_sampled_turns_match_without_reuse(tiny, seed, kw):
    """n > 1, several sub-batches, pruning, rows of different lengths ending at EOS, a stop string or the cap."""
    model, tok = tiny
    params = SamplingParams(n=2, temperature=0.9, top_p=0.95, max_new_tokens=12, stop=["e"], seed=seed)
    reuse, plain = _engines(model, tok, **kw)
    a, _ = _episodes(reuse, tok, params)
    b, _ = _episodes(plain, tok, params)
    _same(a, b)
    reasons = [r for rb, _, _, _ in a for r in rb.finish_reason]
    assert "stop" in reasons and "length" in reasons


def test_only_new_tokens_are_fed(tiny):
    """With reuse, each turn feeds exactly the tokens after each row's usable cached prefix; a row whose
    prompt does not extend its context falls back to a full encode and still matches."""
    model, tok = tiny
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=4)
    reuse, plain = _engines(model, tok, share_prompt=False)
    counter = FedTokens(model)
    try:
        a, keys = _episodes(reuse, tok, params, counter=counter, odd=True)
        b, _ = _episodes(plain, tok, params, counter=counter, odd=True)
    finally:
        counter.handle.remove()
    _same(a, b)
    ctx = [p + _resp(a[1][0], i) for i, p in enumerate(a[1][1])]  # what was stored after turn 1 (or one less)
    assert a[2][2][1] == 0  # the diverging row: nothing usable
    assert 0 < a[2][2][2] < len(ctx[2]) - 2 and a[2][2][3] == len(ctx[3]) - 1  # cut to the common prefix
    for t in (1, 2):
        (real_a, cols_a), (real_b, cols_b) = a[t][3], b[t][3]
        assert all(u > 0 for i, u in enumerate(a[t][2]) if not (t == 2 and i == 1))
        assert real_b - real_a == sum(a[t][2])  # exactly the reused positions were not fed again
        assert cols_a < cols_b
    assert a[0][3] == b[0][3]  # turn 0: nothing to reuse


def test_stored_entries_hold_the_rows_kv(tiny):
    """Each key stores its row's prompt + response (all but possibly the last token), and the KV equals a
    fresh unpadded forward of those tokens."""
    model, tok = tiny
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=9, stop=["e"], seed=1)
    reuse, _ = _engines(model, tok)
    a, keys = _episodes(reuse, tok, params, turns=2)
    rb, prompts, _, _ = a[-1]
    for i, k in enumerate(keys):
        e = reuse.session_store.entries[k]
        full = prompts[i] + _resp(rb, i)
        assert len(e.tokens) in (len(full) - 1, len(full)) and e.tokens == full[: len(e.tokens)]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([e.tokens]), use_cache=True)
        fresh = getattr(out, cache_kwarg(model)).layers
        assert len(fresh) == len(e.kv)
        for layer, (k, v) in zip(fresh, e.kv):
            torch.testing.assert_close(k, layer.keys[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(v, layer.values[0], rtol=1e-4, atol=1e-5)
    assert reuse.session_store.nbytes > 0


def test_release_and_no_sessions(tiny):
    model, tok = tiny
    params = SamplingParams(n=2, greedy=True, max_new_tokens=4)
    prompts = [tok(t)["input_ids"] for t in TEXTS[:2]]
    eng = HFEngine(model, tok, batch_size=3)
    assert HFEngine.supports_sessions
    eng.generate(prompts, params)
    assert len(eng.session_store) == 0  # sessions=None stores nothing
    eng.generate(prompts, params, sessions=["a", "b", "c", "d"])
    assert sorted(eng.session_store.entries) == ["a", "b", "c", "d"]
    eng.release(["a", "c", "unknown"])
    assert sorted(eng.session_store.entries) == ["b", "d"]
    eng.release()
    assert len(eng.session_store) == 0
    eng.generate(prompts, params, sessions=["a", "b", "c", "d"])
    eng.sync_weights(model)  # the weights may have changed in place: stored KV is stale
    assert len(eng.session_store) == 0
    with pytest.raises(ValueError, match="sessions has 3 keys for 4 rows"):
        eng.generate(prompts, params, sessions=["a", "b", "c"])


def test_record_logp_is_the_sampling_distribution(tiny):
    """sampler_logp is log softmax(logits / temperature) at the drawn token (greedy: of the logits); None by default."""
    model, tok = tiny
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    for params in (SamplingParams(n=2, temperature=0.7, max_new_tokens=6, seed=3),
                   SamplingParams(n=1, greedy=True, max_new_tokens=6)):
        rb = HFEngine(model, tok, batch_size=4, prune_every=2, record_logp=True).generate(prompts, params)
        assert HFEngine(model, tok).generate(prompts[:1], params).sampler_logp is None
        ids, mask = rb.input_ids()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask.long(),
                           position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0)).logits
        p = rb.prompt_ids.shape[1]
        scale = 1.0 if params.is_greedy else params.temperature
        ref = torch.log_softmax(logits[:, p - 1 : -1].float() / scale, -1).gather(2, rb.response_ids[..., None])[..., 0]
        torch.testing.assert_close(rb.sampler_logp[rb.response_mask], ref[rb.response_mask], rtol=0, atol=1e-4)


def test_layout_and_common_prefix():
    ids, mask, w = layout([[5, 6, 7, 8], [9, 10, 11], [11, 12, 13]], [2, 0, 1], pad_id=0)
    assert w == 2
    assert ids.tolist() == [[5, 6, 0, 7, 8], [0, 0, 9, 10, 11], [0, 11, 0, 12, 13]]  # [pad][cached][pad][new]
    assert mask.tolist() == [[1, 1, 0, 1, 1], [0, 0, 1, 1, 1], [0, 1, 0, 1, 1]]
    plain, plain_mask, w = layout([[5, 6, 7], [9]], [0, 0], pad_id=0)  # nothing cached: left padding
    assert w == 0 and plain.tolist() == [[5, 6, 7], [0, 0, 9]] and plain_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([1, 2], [1, 2, 3]) == 2
    store = SessionStore()
    assert store.usable("k", [1, 2]) == 0 and store.take("k", [1, 2]) == (None, 0)
