"""Tests for tether.rollout: RolloutBatch invariants and the HF generate engine (tiny offline model)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tether.models import ModelConfig, load_model
from tether.rollout import Engine, HFEngine, RolloutBatch, SamplingParams

PROMPT_TEXTS = [
    "Hello world",
    "What is 2 + 2? The answer",
    "x",
    "Let x be a number such that 3x + 5 = 20. Then",
    "Question: how many apples are left?",
]


@pytest.fixture
def tiny(tiny_model_dir):
    """(model, tokenizer) freshly loaded from the tiny model dir, in train mode."""
    return load_model(ModelConfig(name=str(tiny_model_dir)))


def _prompts(tok, texts=PROMPT_TEXTS):
    return [tok(t)["input_ids"] for t in texts]


def _fix_distribution(model, eos_id: int, p_eos: float) -> None:
    """Make every next-token distribution uniform over non-EOS tokens, with P(EOS) = p_eos."""
    vocab = model.config.vocab_size
    head = torch.nn.Linear(model.config.hidden_size, vocab, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        if p_eos <= 0:
            head.bias[eos_id] = -1e4
        elif p_eos >= 1:
            head.bias[eos_id] = 1e4
        else:
            head.bias[eos_id] = math.log(p_eos * (vocab - 1) / (1 - p_eos))
    model.lm_head = head


def _rows(batch: RolloutBatch) -> list[list[int]]:
    """Unpadded response token lists."""
    return [batch.response_ids[i][batch.response_mask[i]].tolist() for i in range(len(batch))]


def _reference_greedy(model, prompt: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
    """Unbatched, unpadded greedy generation, cut after the first EOS."""
    model.eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
        )
    toks = out[0, len(prompt) :].tolist()
    return toks[: toks.index(eos_id) + 1] if eos_id in toks else toks


def _check_invariants(batch: RolloutBatch, prompts: list[list[int]], params: SamplingParams, eos_ids, pad_id):
    """Layout invariants that every RolloutBatch from HFEngine must satisfy."""
    n = params.n
    B = len(prompts) * n
    assert len(batch) == B
    assert batch.prompt_ids.dtype == torch.long and batch.response_ids.dtype == torch.long
    assert batch.prompt_mask.dtype == torch.bool and batch.response_mask.dtype == torch.bool
    assert batch.group.tolist() == [g for g in range(len(prompts)) for _ in range(n)]
    assert len(batch.texts) == B and len(batch.finish_reason) == B
    assert batch.gen_tokens == int(batch.response_mask.sum()) == batch.num_response_tokens
    assert batch.gen_time_s > 0
    P, T = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    assert P == max(len(p) for p in prompts)
    assert T == int(batch.response_lengths.max())
    for i in range(B):
        p = prompts[batch.group[i]]
        pm = batch.prompt_mask[i]
        # left padding: mask is a contiguous suffix holding exactly the prompt
        assert pm.tolist() == [False] * (P - len(p)) + [True] * len(p)
        assert batch.prompt_ids[i, P - len(p) :].tolist() == p
        assert (batch.prompt_ids[i, : P - len(p)] == pad_id).all()
        # right padding: mask is a contiguous prefix
        L = int(batch.response_mask[i].sum())
        assert 1 <= L <= params.max_new_tokens
        assert batch.response_mask[i].tolist() == [True] * L + [False] * (T - L)
        assert (batch.response_ids[i, L:] == pad_id).all()
        toks = batch.response_ids[i, :L].tolist()
        # EOS only as the last token, and then the row finished with "stop"
        assert not any(t in eos_ids for t in toks[:-1])
        if toks[-1] in eos_ids:
            assert batch.finish_reason[i] == "stop"
        if batch.finish_reason[i] == "length":
            assert L == params.max_new_tokens
        assert batch.finish_reason[i] in ("stop", "length")


# --------------------------------------------------------------------------- engine basics


def test_engine_protocol_and_sync(tiny):
    model, tok = tiny
    eng = HFEngine(model, tok)
    assert isinstance(eng, Engine)
    eng.sync_weights(model)  # shared model: no-op
    assert eng.model is model
    assert eng.pad_token_id == tok.pad_token_id and tok.eos_token_id in eng.eos_token_ids


def test_shapes_masks_padding(tiny):
    model, tok = tiny
    prompts = _prompts(tok)
    params = SamplingParams(n=3, max_new_tokens=10, seed=0)
    eng = HFEngine(model, tok, batch_size=4)  # 15 rows -> 4 sub-batches
    batch = eng.generate(prompts, params)
    _check_invariants(batch, prompts, params, eng.eos_token_ids, eng.pad_token_id)
    assert model.training  # train mode restored
    full, mask = batch.input_ids()
    assert full.shape == (15, batch.prompt_ids.shape[1] + batch.response_ids.shape[1])
    assert mask.sum() == batch.prompt_mask.sum() + batch.response_mask.sum()


def test_eval_mode_and_no_grad_during_generation(tiny):
    model, tok = tiny
    seen = []
    handle = model.register_forward_pre_hook(lambda mod, args: seen.append((mod.training, torch.is_grad_enabled())))
    try:
        HFEngine(model, tok).generate(_prompts(tok)[:2], SamplingParams(n=2, max_new_tokens=4, seed=0))
    finally:
        handle.remove()
    assert seen and all(not training and not grad for training, grad in seen)
    assert model.training
    # an eval-mode model stays in eval mode
    model.eval()
    HFEngine(model, tok).generate(_prompts(tok)[:1], SamplingParams(n=1, max_new_tokens=2, seed=0))
    assert not model.training


def test_sampled_groups_differ(tiny):
    model, tok = tiny
    batch = HFEngine(model, tok).generate(_prompts(tok)[:2], SamplingParams(n=4, max_new_tokens=8, seed=3))
    rows = _rows(batch)
    for g in range(2):
        assert len({tuple(r) for r in rows[4 * g : 4 * g + 4]}) > 1  # n samples are independent draws


def test_validation_errors(tiny):
    model, tok = tiny
    eng = HFEngine(model, tok)
    with pytest.raises(ValueError):
        eng.generate([[]], SamplingParams(n=1, max_new_tokens=2))
    for bad in (dict(n=0), dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(stop=[""])):
        with pytest.raises(ValueError):
            eng.generate(_prompts(tok)[:1], SamplingParams(**bad))
    with pytest.raises(ValueError):
        HFEngine(model, tok, batch_size=0)


# --------------------------------------------------------------------------- EOS and finish reasons


def test_eos_always(tiny):
    model, tok = tiny
    _fix_distribution(model, tok.eos_token_id, 1.0)
    batch = HFEngine(model, tok).generate(_prompts(tok)[:2], SamplingParams(n=3, max_new_tokens=5, seed=0))
    assert batch.response_ids.shape == (6, 1)
    assert batch.response_ids[:, 0].tolist() == [tok.eos_token_id] * 6
    assert batch.response_mask.all()
    assert batch.finish_reason == ["stop"] * 6 and batch.texts == [""] * 6
    assert batch.gen_tokens == 6


def test_eos_never_gives_length(tiny):
    model, tok = tiny
    _fix_distribution(model, tok.eos_token_id, 0.0)
    params = SamplingParams(n=2, max_new_tokens=7, seed=0)
    batch = HFEngine(model, tok).generate(_prompts(tok)[:3], params)
    assert batch.finish_reason == ["length"] * 6
    assert batch.response_mask.all() and batch.response_ids.shape == (6, 7)
    assert tok.eos_token_id not in batch.response_ids.tolist()


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_eos_mixed_lengths(tiny, pad_is_eos):
    """EOS at random positions: EOS kept with mask True, nothing after it; pad==eos handled too."""
    model, tok = tiny
    if pad_is_eos:
        tok = copy.deepcopy(tok)
        tok.pad_token = tok.eos_token
    _fix_distribution(model, tok.eos_token_id, 0.2)
    prompts = _prompts(tok)
    params = SamplingParams(n=8, max_new_tokens=6, seed=0)
    eng = HFEngine(model, tok, batch_size=16)
    assert (eng.pad_token_id == tok.eos_token_id) == pad_is_eos
    batch = eng.generate(prompts, params)
    _check_invariants(batch, prompts, params, eng.eos_token_ids, eng.pad_token_id)
    reasons = set(batch.finish_reason)
    assert reasons == {"stop", "length"}
    lengths = batch.response_lengths.tolist()
    assert len(set(lengths)) > 2
    for i, r in enumerate(batch.finish_reason):
        last = int(batch.response_ids[i, lengths[i] - 1])
        assert (last == tok.eos_token_id) == (r == "stop")


def test_eos_list_from_generation_config(tiny):
    """A second EOS id listed in generation_config also ends responses."""
    model, tok = tiny
    other = tok.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config.eos_token_id = [tok.eos_token_id, other]
    _fix_distribution(model, other, 1.0)
    eng = HFEngine(model, tok)
    assert set(eng.eos_token_ids) == {tok.eos_token_id, other}
    batch = eng.generate(_prompts(tok)[:2], SamplingParams(n=2, max_new_tokens=5, seed=0))
    assert batch.response_ids.tolist() == [[other]] * 4 and batch.finish_reason == ["stop"] * 4


# --------------------------------------------------------------------------- greedy and padding


def test_greedy_matches_unpadded_reference(tiny):
    """Left-padded, length-sorted, sub-batched greedy == one-prompt-at-a-time greedy."""
    model, tok = tiny
    prompts = _prompts(tok)
    reference = [_reference_greedy(model, p, 12, tok.eos_token_id) for p in prompts]
    model.train()
    for bs in (2, 16):
        params = SamplingParams(n=1, max_new_tokens=12, greedy=True)
        batch = HFEngine(model, tok, batch_size=bs).generate(prompts, params)
        assert _rows(batch) == reference
    # temperature 0 is greedy too; n copies are identical
    batch = HFEngine(model, tok).generate(prompts, SamplingParams(n=2, max_new_tokens=12, temperature=0.0))
    assert _rows(batch) == [r for r in reference for _ in range(2)]


def test_shared_prompt_prefill_same_samples_less_work(tiny):
    """Pre-filling each distinct prompt once (KV expanded to its n rows) draws the same samples."""
    model, tok = tiny
    prompts = _prompts(tok)
    params = SamplingParams(n=3, max_new_tokens=6, seed=11)
    embed = model.get_input_embeddings()
    runs = {}
    for share in (True, False):
        seen = []
        hook = embed.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
        batch = HFEngine(model, tok, batch_size=8, share_prompt=share).generate(prompts, params)
        hook.remove()
        runs[share] = (batch, seen)
    (a, seen_a), (b, seen_b) = runs[True], runs[False]
    assert torch.equal(a.response_ids, b.response_ids) and a.texts == b.texts
    # sub-batches of 8 rows over 5 prompts x 3: the first forward of each is the distinct-prompt pre-fill
    prefills_a = [s for s in seen_a if s[1] > 1]
    prefills_b = [s for s in seen_b if s[1] > 1]
    assert sum(r for r, _ in prefills_b) == 15  # every row pre-filled
    assert sum(r for r, _ in prefills_a) < 15  # each distinct prompt of a sub-batch once
    assert sum(r * w for r, w in prefills_a) < sum(r * w for r, w in prefills_b)


def test_top_k_1_and_tiny_top_p_are_greedy(tiny):
    model, tok = tiny
    prompts = _prompts(tok)[:3]
    eng = HFEngine(model, tok)
    greedy = _rows(eng.generate(prompts, SamplingParams(n=1, max_new_tokens=8, greedy=True)))
    assert _rows(eng.generate(prompts, SamplingParams(n=1, max_new_tokens=8, top_k=1, seed=5))) == greedy
    assert _rows(eng.generate(prompts, SamplingParams(n=1, max_new_tokens=8, top_p=1e-6, seed=5))) == greedy
    assert _rows(eng.generate(prompts, SamplingParams(n=1, max_new_tokens=8, temperature=1e-4, seed=5))) == greedy


def test_generation_config_knobs_are_neutralized(tiny):
    """repetition_penalty / no_repeat_ngram_size from the model's generation_config are not applied."""
    model, tok = tiny
    prompts = _prompts(tok)[:3]
    reference = [_reference_greedy(model, p, 16, tok.eos_token_id) for p in prompts]
    model.generation_config.repetition_penalty = 50.0
    model.generation_config.no_repeat_ngram_size = 1
    # sanity: transformers does apply them when generate() is called plainly
    assert [_reference_greedy(model, p, 16, tok.eos_token_id) for p in prompts] != reference
    batch = HFEngine(model, tok).generate(prompts, SamplingParams(n=1, max_new_tokens=16, greedy=True))
    assert _rows(batch) == reference


# --------------------------------------------------------------------------- seeding


def test_seeded_determinism(tiny):
    model, tok = tiny
    prompts = _prompts(tok)
    eng = HFEngine(model, tok, batch_size=4)
    params = SamplingParams(n=3, max_new_tokens=8, seed=123)
    state = torch.get_rng_state()
    a = eng.generate(prompts, params)
    assert torch.equal(torch.get_rng_state(), state)  # global RNG untouched by a seeded call
    b = eng.generate(prompts, params)
    assert torch.equal(a.response_ids, b.response_ids) and a.texts == b.texts
    c = eng.generate(prompts, SamplingParams(n=3, max_new_tokens=8, seed=124))
    assert not torch.equal(a.response_ids[:, :8], c.response_ids[:, :8]) or a.texts != c.texts


def test_unseeded_uses_global_rng(tiny):
    model, tok = tiny
    eng = HFEngine(model, tok)
    prompts = _prompts(tok)[:2]
    torch.manual_seed(7)
    a = eng.generate(prompts, SamplingParams(n=2, max_new_tokens=6))
    torch.manual_seed(7)
    b = eng.generate(prompts, SamplingParams(n=2, max_new_tokens=6))
    assert _rows(a) == _rows(b)


# --------------------------------------------------------------------------- stop strings


def _stop_candidate(tok, tokens: list[int], min_pos: int = 1) -> tuple[str, int] | None:
    """A printable single-token string at position >= min_pos, and the expected cut (brute force)."""
    for j in range(min_pos, len(tokens)):
        s = tok.decode([tokens[j]], skip_special_tokens=True)
        if s.strip() and s.isascii() and s.isprintable():
            cut = next(k for k in range(1, len(tokens) + 1) if s in tok.decode(tokens[:k], skip_special_tokens=True))
            return s, cut
    return None


def test_stop_string_cuts_tokens_and_text(tiny):
    model, tok = tiny
    prompts = _prompts(tok)
    eng = HFEngine(model, tok, batch_size=2)
    free = eng.generate(prompts, SamplingParams(n=1, max_new_tokens=20, greedy=True))
    checked = 0
    for i, toks in enumerate(_rows(free)):
        cand = _stop_candidate(tok, toks, min_pos=2)
        if cand is None:
            continue
        stop, cut = cand
        out = eng.generate([prompts[i]], SamplingParams(n=2, max_new_tokens=20, greedy=True, stop=["@@never@@", stop]))
        for r in range(2):
            assert _rows(out)[r] == toks[:cut]  # minimal token prefix containing the stop string
            assert out.finish_reason[r] == "stop"
            assert out.texts[r].endswith(stop) and out.texts[r].count(stop) == 1
            assert free.texts[i].startswith(out.texts[r])
        checked += 1
    assert checked >= 2


def test_stop_string_stops_generation_early(tiny):
    """Generation itself stops once every row hit a stop string (no wasted decoding steps)."""
    model, tok = tiny
    prompt = _prompts(tok)[1]
    eng = HFEngine(model, tok)
    free = eng.generate([prompt], SamplingParams(n=1, max_new_tokens=30, greedy=True))
    toks = _rows(free)[0]
    stop, cut = _stop_candidate(tok, toks, min_pos=2)
    for share, prefill in ((False, 0), (True, 1)):
        steps = []
        handle = model.register_forward_pre_hook(lambda mod, args: steps.append(1))
        try:
            HFEngine(model, tok, share_prompt=share).generate(
                [prompt], SamplingParams(n=3, max_new_tokens=30, greedy=True, stop=[stop]))
        finally:
            handle.remove()
        # one forward per generated token, none after the stop (plus the shared prompt pre-fill)
        assert len(steps) == cut + prefill


def test_stop_string_not_matched_across_prompt_boundary(tiny):
    """A stop string made of the prompt's last char + the response's first char must not fire."""
    model, tok = tiny
    eng = HFEngine(model, tok)
    found = False
    for text in PROMPT_TEXTS + ["Hello there.", "The answer is", "Goodbye world"]:
        prompt = tok(text)["input_ids"]
        free = eng.generate([prompt], SamplingParams(n=1, max_new_tokens=10, greedy=True))
        first = free.texts[0][:1]
        if not (first.isascii() and first.isprintable() and first.strip()):
            continue
        stop = text[-1] + first
        if stop in free.texts[0]:
            continue
        out = eng.generate([prompt], SamplingParams(n=1, max_new_tokens=10, greedy=True, stop=[stop]))
        assert _rows(out) == _rows(free) and out.finish_reason == free.finish_reason
        found = True
    assert found


def test_eos_before_stop_string(tiny):
    model, tok = tiny
    _fix_distribution(model, tok.eos_token_id, 1.0)
    out = HFEngine(model, tok).generate(_prompts(tok)[:1], SamplingParams(n=2, max_new_tokens=5, stop=["a"], seed=0))
    assert out.response_ids.tolist() == [[tok.eos_token_id]] * 2 and out.finish_reason == ["stop"] * 2


def test_stop_strings_with_sampling_invariants(tiny):
    model, tok = tiny
    prompts = _prompts(tok)
    params = SamplingParams(n=4, max_new_tokens=16, stop=["e", "a"], seed=0)
    eng = HFEngine(model, tok, batch_size=8)
    batch = eng.generate(prompts, params)
    _check_invariants(batch, prompts, params, eng.eos_token_ids, eng.pad_token_id)
    for i, toks in enumerate(_rows(batch)):
        text = tok.decode(toks, skip_special_tokens=True)
        prefix = tok.decode(toks[:-1], skip_special_tokens=True)
        if batch.finish_reason[i] == "stop" and toks[-1] != tok.eos_token_id:
            assert ("e" in text or "a" in text) and not ("e" in prefix or "a" in prefix)
            assert batch.texts[i][-1] in "ea" and ("e" not in batch.texts[i][:-1] and "a" not in batch.texts[i][:-1])
        else:
            assert "e" not in text and "a" not in text


# --------------------------------------------------------------------------- training-model interplay


def test_gradient_checkpointing_generation_uses_cache(tiny_model_dir):
    model, tok = load_model(ModelConfig(name=str(tiny_model_dir), gradient_checkpointing=True))
    assert model.config.use_cache is False
    lengths = []

    def hook(mod, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        lengths.append(ids.shape[1])

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    prompts = _prompts(tok)[:2]
    try:
        batch = HFEngine(model, tok).generate(prompts, SamplingParams(n=1, max_new_tokens=6, greedy=True))
    finally:
        handle.remove()
    assert lengths[0] > 1 and all(n == 1 for n in lengths[1:])  # KV cache: one new token per step
    assert model.training and model.config.use_cache is False
    plain, _ = load_model(ModelConfig(name=str(tiny_model_dir)))
    want = HFEngine(plain, tok).generate(prompts, SamplingParams(n=1, max_new_tokens=6, greedy=True))
    assert _rows(batch) == _rows(want)
    # training forward/backward after generation still works with checkpointing
    ids, mask = batch.input_ids()
    model(input_ids=ids, attention_mask=mask.long()).logits.sum().backward()


def test_lora_model_generation(tiny_model_dir):
    pytest.importorskip("peft")
    model, tok = load_model(ModelConfig(name=str(tiny_model_dir), lora_r=4))
    prompts = _prompts(tok)[:3]
    params = SamplingParams(n=2, max_new_tokens=6, seed=0)
    eng = HFEngine(model, tok)
    batch = eng.generate(prompts, params)
    _check_invariants(batch, prompts, params, eng.eos_token_ids, eng.pad_token_id)
    assert model.training
    # freshly initialized LoRA (B = 0) leaves greedy output unchanged
    plain, _ = load_model(ModelConfig(name=str(tiny_model_dir)))
    g = SamplingParams(n=1, max_new_tokens=6, greedy=True)
    assert _rows(eng.generate(prompts, g)) == _rows(HFEngine(plain, tok).generate(prompts, g))


def test_show_progress(tiny, capsys):
    model, tok = tiny
    batch = HFEngine(model, tok, batch_size=2, show_progress=True).generate(
        _prompts(tok)[:3], SamplingParams(n=1, max_new_tokens=2, seed=0)
    )
    assert len(batch) == 3


# --------------------------------------------------------------------------- select / concat


def _fake_batch(prompt_lens, resp_lens, group, pad=0, t=1.0) -> RolloutBatch:
    B = len(prompt_lens)
    P, T = max(prompt_lens), max(resp_lens)
    pid = torch.full((B, P), pad)
    pm = torch.zeros(B, P, dtype=torch.bool)
    rid = torch.full((B, T), pad)
    rm = torch.zeros(B, T, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        pid[i, P - p :] = torch.arange(1, p + 1) + 100 * i
        pm[i, P - p :] = True
        rid[i, :r] = torch.arange(1, r + 1) + 1000 * i
        rm[i, :r] = True
    return RolloutBatch(
        prompt_ids=pid,
        prompt_mask=pm,
        response_ids=rid,
        response_mask=rm,
        finish_reason=["stop" if r < T else "length" for r in resp_lens],
        group=torch.tensor(group),
        texts=[f"row{i}" for i in range(B)],
        gen_time_s=t,
        gen_tokens=sum(resp_lens),
        pad_token_id=pad,
    )


def _unpadded(batch):
    return (
        [batch.prompt_ids[i][batch.prompt_mask[i]].tolist() for i in range(len(batch))],
        _rows(batch),
    )


def test_select_retrims_padding():
    b = _fake_batch([2, 5, 3, 3], [4, 1, 7, 2], [0, 0, 1, 1], pad=9)
    s = b.select([0, 3])
    assert s.prompt_ids.shape == (2, 3) and s.response_ids.shape == (2, 4)
    full_p, full_r = _unpadded(b)
    sp, sr = _unpadded(s)
    assert sp == [full_p[0], full_p[3]] and sr == [full_r[0], full_r[3]]
    assert s.group.tolist() == [0, 1] and s.texts == ["row0", "row3"] and s.finish_reason == ["stop", "stop"]
    assert s.gen_time_s == b.gen_time_s and s.gen_tokens == b.gen_tokens  # cost accounting kept
    assert s.num_response_tokens == 6
    # bool mask and tensor index give the same rows
    m = b.select(torch.tensor([True, False, False, True]))
    assert _unpadded(m) == _unpadded(s)
    assert _unpadded(b.select(torch.tensor([3, 0]))) == (sp[::-1], sr[::-1])
    assert _unpadded(b.select([True, False, False, True])) == _unpadded(s)
    np = pytest.importorskip("numpy")
    assert _unpadded(b.select(np.array([True, False, False, True]))) == _unpadded(s)
    assert _unpadded(b.select(np.array([0, 3]))) == _unpadded(s)
    with pytest.raises(ValueError):
        b.select([True, False])
    e = b.select([])
    assert len(e) == 0 and e.prompt_ids.shape == (0, 0) and e.response_ids.shape == (0, 0)


def test_concat():
    a = _fake_batch([2, 5], [4, 1], [0, 1], t=1.5)
    b = _fake_batch([3, 3, 1], [7, 2, 2], [0, 0, 1], t=2.0)
    c = RolloutBatch.concat([a, b])
    assert c.prompt_ids.shape == (5, 5) and c.response_ids.shape == (5, 7)
    ap, ar = _unpadded(a)
    bp, br = _unpadded(b)
    assert _unpadded(c) == (ap + bp, ar + br)
    assert c.group.tolist() == [0, 1, 2, 2, 3]
    assert RolloutBatch.concat([a, b], offset_groups=False).group.tolist() == [0, 1, 0, 0, 1]
    assert c.gen_time_s == 3.5 and c.gen_tokens == a.gen_tokens + b.gen_tokens
    assert c.texts == a.texts + b.texts and c.finish_reason == a.finish_reason + b.finish_reason
    # padding stays padding
    assert not c.prompt_mask[0, :3].any() and (c.prompt_ids[0, :3] == 0).all()
    # selecting back out of a concatenation
    assert _unpadded(c.select([2, 3, 4])) == _unpadded(b)
    with pytest.raises(ValueError):
        RolloutBatch.concat([])


def test_select_concat_on_engine_output(tiny):
    """Dynamic-sampling pattern: keep some groups of two calls and concatenate them."""
    model, tok = tiny
    eng = HFEngine(model, tok)
    prompts = _prompts(tok)
    b1 = eng.generate(prompts[:3], SamplingParams(n=2, max_new_tokens=6, seed=1))
    b2 = eng.generate(prompts[3:], SamplingParams(n=2, max_new_tokens=6, seed=2))
    keep1 = b1.select(b1.group != 1)
    c = RolloutBatch.concat([keep1, b2])
    assert len(c) == 4 + 4
    assert c.group.tolist() == [0, 0, 2, 2, 3, 3, 4, 4]
    assert _unpadded(c) == tuple(x + y for x, y in zip(_unpadded(keep1), _unpadded(b2)))
    assert c.gen_tokens == b1.gen_tokens + b2.gen_tokens


# --------------------------------------------------------------------------- real model (slow)


@pytest.mark.slow
def test_real_smollm2_generation():
    model, tok = load_model(ModelConfig())
    questions = ["What is 2+2? Answer with a number.", "What is the capital of France? Answer in one word."]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    eng = HFEngine(model, tok, batch_size=8)
    params = SamplingParams(n=2, max_new_tokens=48, greedy=True)
    batch = eng.generate(prompts, params)
    _check_invariants(batch, prompts, params, eng.eos_token_ids, eng.pad_token_id)
    assert eng.pad_token_id == tok.eos_token_id  # SmolLM2: pad == eos == <|im_end|>
    assert "4" in batch.texts[0] and "Paris" in batch.texts[2]
    assert batch.finish_reason[0] == "stop" and batch.response_ids[0, batch.response_lengths[0] - 1] == tok.eos_token_id
    # sampled, with a stop string
    sampled = eng.generate(prompts, SamplingParams(n=4, max_new_tokens=32, temperature=0.7, seed=0, stop=["."]))
    for text, reason in zip(sampled.texts, sampled.finish_reason):
        if reason == "stop" and text.endswith("."):
            assert text.count(".") == 1
    assert model.training
    # the rollout feeds a training forward/backward
    ids, mask = batch.input_ids()
    out = model(input_ids=ids, attention_mask=mask.long())
    out.logits[:, -1].logsumexp(-1).mean().backward()
    assert model.model.embed_tokens.weight.grad is not None


# --------------------------------------------------------------------------- pruning finished rows


@pytest.mark.parametrize("prune_every", [1, 3])
def test_pruning_finished_rows_keeps_greedy_outputs(tiny, prune_every):
    """Decoding in segments and dropping finished rows == one unsegmented generate (greedy)."""
    model, tok = tiny
    prompts = _prompts(tok)
    reference = [_reference_greedy(model, p, 12, tok.eos_token_id) for p in prompts]
    eng = HFEngine(model, tok, batch_size=16, prune_every=prune_every)
    assert _rows(eng.generate(prompts, SamplingParams(n=2, max_new_tokens=12, greedy=True))) == \
        [r for r in reference for _ in range(2)]
    # stop strings across segment boundaries: same cut as without pruning
    free = HFEngine(model, tok, prune_every=0).generate(prompts, SamplingParams(n=1, max_new_tokens=20, greedy=True))
    stop, cut = _stop_candidate(tok, _rows(free)[1], min_pos=4)
    out = eng.generate([prompts[1]], SamplingParams(n=2, max_new_tokens=20, greedy=True, stop=[stop]))
    assert _rows(out) == [_rows(free)[1][:cut]] * 2 and out.finish_reason == ["stop", "stop"]


def test_pruning_drops_finished_rows_and_keeps_the_distribution(tiny):
    """With EOS at random positions, later segments run on fewer rows; lengths follow the geometric law."""
    model, tok = tiny
    _fix_distribution(model, tok.eos_token_id, 0.25)
    batch_rows = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: batch_rows.append(i[0].shape[0]))
    eng = HFEngine(model, tok, batch_size=512, prune_every=2)
    batch = eng.generate(_prompts(tok)[:2], SamplingParams(n=200, max_new_tokens=10, seed=3))
    hook.remove()
    assert batch_rows[0] == 2  # the shared pre-fill of the 2 distinct prompts
    decode = batch_rows[1:]
    assert decode[0] == 400 and decode[-1] < 100 and decode == sorted(decode, reverse=True)
    _check_invariants(batch, _prompts(tok)[:2], SamplingParams(n=200, max_new_tokens=10), eng.eos_token_ids,
                      eng.pad_token_id)
    lengths = batch.response_lengths.float()
    # P(length = L) = 0.75^(L-1) 0.25 for L < 10, the rest is cut at 10: E[L] = (1 - 0.75^10) / 0.25
    expected = (1 - 0.75 ** 10) / 0.25
    assert abs(lengths.mean().item() - expected) < 4 * lengths.std().item() / math.sqrt(len(lengths))
    # full-length callers (min_new_tokens, e.g. the benches) still get every token across segments
    eng.prune_every = 3
    kw = eng._generate_kwargs
    eng._generate_kwargs = lambda p: {**kw(p), "min_new_tokens": p.max_new_tokens}
    full = eng.generate(_prompts(tok)[:1], SamplingParams(n=4, max_new_tokens=8, seed=1))
    assert full.response_lengths.tolist() == [8] * 4


# --------------------------------------------------------------------------- the sampler's law


def _interval_masses(sampler, scores: torch.Tensor, grid: int = 1 << 16) -> torch.Tensor:
    """Fraction of a uniform grid over [0, 1) (plus the largest double below 1) mapped to each token.

    ``draw`` is a deterministic function of the uniform, so this enumerates its law: each
    token's mass must equal its probability up to 1 / grid.
    """
    u = torch.cat([(torch.arange(grid, dtype=torch.float64) + 0.5) / grid,
                   torch.tensor([0.0, 1.0 - 2.0 ** -53], dtype=torch.float64)]).unsqueeze(1)
    toks = sampler.draw(scores.expand(len(u), -1).clone(), uniform=u)
    mass = torch.bincount(toks[:grid], minlength=scores.shape[-1]).double() / grid
    return mass, toks


@pytest.mark.parametrize("block", [1, 4, 7, 1024])
def test_inverse_cdf_sampler_interval_lengths_equal_probabilities(block):
    """Exact law of the draw: interval lengths = softmax probabilities, zero-mass tokens unreachable."""
    from tether.rollout.hf import _InverseCDFSampler

    torch.manual_seed(0)
    scores = torch.randn(1, 11) * 2
    scores[0, 0] = float("-inf")  # zero-probability tokens: the first (reached by u = 0 if the
    scores[0, 3] = float("-inf")  # search were not strict), one inside a block,
    scores[0, 10] = float("-inf")  # and the very last (a zero-mass tail)
    mass, toks = _interval_masses(_InverseCDFSampler(block=block), scores)
    probs = torch.softmax(scores.double(), -1)[0]
    assert torch.allclose(mass, probs, atol=2.0 / (1 << 16))
    assert not torch.isin(toks, torch.tensor([0, 3, 10])).any()  # including u = 0 and u just below 1


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 4, 1.0), (1.3, 0, 0.8), (0.9, 5, 0.6)])
def test_inverse_cdf_sampler_matches_transformers_warpers(temperature, top_k, top_p):
    """Same distribution as generate(do_sample=True): transformers' warpers, then softmax."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from tether.rollout.hf import _InverseCDFSampler

    torch.manual_seed(1)
    scores = torch.randn(1, 13) * 1.5
    ref = scores.clone()
    if temperature != 1.0:
        ref = TemperatureLogitsWarper(temperature)(None, ref)
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    probs = torch.softmax(ref.double(), -1)[0]
    mass, toks = _interval_masses(_InverseCDFSampler(temperature, top_k, top_p, block=4), scores)
    assert torch.allclose(mass, probs, atol=2.0 / (1 << 16))
    assert not torch.isin(toks, (probs == 0).nonzero().flatten()).any()
    if top_k or top_p < 1.0:
        assert (probs == 0).any()  # the cut really removed tokens


def test_inverse_cdf_sampler_random_draws_follow_the_law():
    """Second line: seeded random draws through __call__ (the one-hot scores) match the probabilities."""
    from tether.rollout.hf import _InverseCDFSampler

    torch.manual_seed(2)
    scores = torch.randn(1, 6)
    probs = torch.softmax(scores.double(), -1)[0]
    out = _InverseCDFSampler(block=4)(None, scores.expand(40000, -1).clone())
    assert torch.isfinite(out).sum(-1).eq(1).all()  # one-hot: argmax is the draw
    freq = torch.bincount(out.argmax(-1), minlength=6).double() / 40000
    se = (probs * (1 - probs) / 40000).sqrt()
    assert ((freq - probs).abs() < 5 * se).all()


@pytest.mark.parametrize("sampler,kv_cache", [("multinomial", "dynamic"), ("inverse_cdf", "dynamic"),
                                              ("multinomial", "growing")])
def test_alternative_sampler_and_cache_keep_outputs_and_law(tiny, sampler, kv_cache):
    """The A/B switches (transformers' multinomial, DynamicCache) give the same greedy rows and length law."""
    model, tok = tiny
    prompts = _prompts(tok)
    reference = [_reference_greedy(model, p, 10, tok.eos_token_id) for p in prompts]
    eng = HFEngine(model, tok, batch_size=8, sampler=sampler, kv_cache=kv_cache, prune_every=3)
    assert _rows(eng.generate(prompts, SamplingParams(n=1, max_new_tokens=10, greedy=True))) == reference
    _fix_distribution(model, tok.eos_token_id, 0.25)
    batch = eng.generate(prompts[:2], SamplingParams(n=150, max_new_tokens=10, seed=5))
    lengths = batch.response_lengths.float()
    expected = (1 - 0.75 ** 10) / 0.25
    assert abs(lengths.mean().item() - expected) < 4 * lengths.std().item() / math.sqrt(len(lengths))
    with pytest.raises(ValueError, match="sampler"):
        HFEngine(model, tok, sampler="gumbel")
    with pytest.raises(ValueError, match="kv_cache"):
        HFEngine(model, tok, kv_cache="static")
