"""Micro-batches by a token budget (``train.micro_batch_tokens``), packed micro-batches (``train.packing``) and
the padding metric (``pad_frac``): how rows are cut, that the gradient and metrics equal the count-based
split's, that packed log-probs and gradients equal the padded ones, and the options' validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import DIGITS, tiny_config
from tether.errors import ConfigError
from tether.logprobs import response_stats
from tether.metrics import UpdateStats
from tether.passes import check_packing, forwarded_positions, micro_batches
from tether.rollout import RolloutBatch


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("mbtok", DIGITS)


def hand_batch(plens, rlens, groups=None, P=None, T=None) -> RolloutBatch:
    """A RolloutBatch with the given real prompt / response lengths (left / right padded), ids 5 + position."""
    B = len(plens)
    P, T = P or max(plens), T or max(max(rlens), 1)
    pm = torch.arange(P)[None] >= (P - torch.tensor(plens))[:, None]
    rm = torch.arange(T)[None] < torch.tensor(rlens)[:, None]
    g = torch.Generator().manual_seed(0)
    return RolloutBatch(prompt_ids=torch.where(pm, torch.randint(5, 300, (B, P), generator=g), 0), prompt_mask=pm,
                        response_ids=torch.where(rm, torch.randint(5, 300, (B, T), generator=g), 0),
                        response_mask=rm, finish_reason=["stop"] * B,
                        group=torch.tensor(groups if groups is not None else list(range(B))),
                        texts=[""] * B, gen_time_s=0.0, gen_tokens=int(sum(rlens)))


def padded_cost(rb, mb):
    return len(mb) * (max(int(rb.prompt_mask[i].sum()) for i in mb) + max(int(rb.response_mask[i].sum()) for i in mb))


# ---------------------------------------------------------------- cutting


def test_token_budget_cuts_sorted_rows_within_the_budget_and_a_long_row_alone():
    plens, rlens = [3, 5, 2, 4, 6, 3, 2, 5], [4, 30, 1, 6, 2, 3, 0, 8]
    rb = hand_batch(plens, rlens)
    idx = [7, 1, 0, 3, 5, 2, 4, 6]
    for budget in (1, 10, 16, 24, 40, 1000):
        mbs = micro_batches(rb, idx, 8, tokens=budget)
        assert sorted(i for mb in mbs for i in mb) == sorted(idx), budget  # every row once
        flat = [i for mb in mbs for i in mb]
        tot = [plens[i] + rlens[i] for i in flat]
        assert tot == sorted(tot), budget  # length-sorted, as the count-based split
        for mb in mbs:
            assert len(mb) == 1 or padded_cost(rb, mb) <= budget, (budget, mb)
        for a, b in zip(mbs, mbs[1:]):  # greedy: the next row would not have fitted
            assert padded_cost(rb, a + b[:1]) > budget, (budget, a, b)
    assert micro_batches(rb, idx, 8, tokens=1000) == [sorted(idx, key=lambda i: plens[i] + rlens[i])]
    assert [1] in micro_batches(rb, idx, 8, tokens=20)  # 35 tokens: over the budget, alone
    # off: the count-based split, unchanged
    assert micro_batches(rb, idx, 3, tokens=0) == micro_batches(rb, idx, 3)


def test_packed_budget_counts_real_tokens():
    plens, rlens = [3, 5, 2, 4], [4, 30, 1, 6]
    rb = hand_batch(plens, rlens)
    mbs = micro_batches(rb, [0, 1, 2, 3], 8, tokens=20, packed=True)
    assert mbs == [[2, 0, 3], [1]]  # 3 + 7 + 10 = 20 real tokens; padded it would be 3 x 10 = 30
    assert micro_batches(rb, [0, 1, 2, 3], 8, tokens=20) == [[2, 0], [3], [1]]


def test_token_budget_keeps_a_group_together_for_the_shared_prompt_forward():
    # 3 groups of 3 rows sharing a prompt; the budget fits one group, not two
    plens, rlens, groups = [4] * 9, [2, 5, 3, 1, 4, 2, 6, 1, 2], [0, 0, 0, 1, 1, 1, 2, 2, 2]
    rb = hand_batch(plens, rlens, groups)
    mbs = micro_batches(rb, list(range(9)), 8, by_group=True, tokens=3 * (4 + 6))
    assert [sorted(groups[i] for i in mb) for mb in mbs] == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    # row by row the first micro-batch would have taken a row of the next group
    plain = micro_batches(rb, list(range(9)), 8, by_group=False, tokens=3 * (4 + 6))
    assert any(len({groups[i] for i in mb}) > 1 for mb in plain)
    # a group alone over the budget is cut row by row
    mbs = micro_batches(rb, list(range(9)), 8, by_group=True, tokens=2 * (4 + 5))
    assert sorted(i for mb in mbs for i in mb) == list(range(9))
    assert all(len(mb) == 1 or padded_cost(rb, mb) <= 18 for mb in mbs)


# ---------------------------------------------------------------- the padding metric


def test_pad_frac_on_a_hand_made_batch():
    rb = hand_batch([3, 5, 2], [4, 1, 6], P=6, T=7)
    # padded: 3 rows x (5 + 6) = 33 positions, 21 real tokens; packed: no padding
    assert int(forwarded_positions(rb, [0, 1, 2])) == 33
    assert int(forwarded_positions(rb, [0, 1, 2], packed=True)) == 21
    assert int(forwarded_positions(rb, [0])) == 7  # select([0]) lays out 3 + 4 columns
    st = UpdateStats()
    one = {"n_tokens": torch.tensor(1.0)}
    for idx in ([0, 1, 2], [2]):  # 33 + 8 positions, 21 + 8 real tokens
        real = rb.prompt_mask[idx].sum() + rb.response_mask[idx].sum()
        st.add(one, torch.tensor(0.0), torch.tensor(1), real, forwarded_positions(rb, idx))
    st.end_mini_batch()
    row = st.result()
    assert row["train_tokens"] == 29 and row["pad_frac"] == pytest.approx(12 / 41, abs=1e-12)
    assert UpdateStats().result()["pad_frac"] == 0.0  # nothing forwarded
    st = UpdateStats()
    st.add(one, torch.tensor(0.0), torch.tensor(1), torch.tensor(5))  # no positions: no padding
    assert st.result()["pad_frac"] == 0.0


# ---------------------------------------------------------------- packed forward == padded forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_log_probs_and_gradients_equal_the_padded_ones(tiny_model_dir, dtype, impl, one_thread):
    if impl == "eager" and dtype == torch.float64:
        pytest.skip("the padded forward itself gives NaN log-probs under eager attention in float64 (seen with a "
                    "1-token prompt among left-padded rows); not a property of packing")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=impl, dtype=dtype)
    rb = hand_batch([7, 3, 5, 1, 6], [9, 2, 0, 5, 7], P=8, T=10)
    ids = torch.randint(5, 300, (5, 10, 3), generator=torch.Generator().manual_seed(1))
    out = {}
    for packed in (False, True):
        model.zero_grad()
        st = response_stats(model, rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask, topk=2,
                            gather_ids=ids, entropy=True, share_prompt=False, packed=packed, chunk_size=7)
        (st.logp.sum() + st.entropy.sum() + st.ids_logp.sum()).backward()
        out[packed] = (st, [p.grad.clone() for p in model.parameters()])
    (a, ga), (b, gb) = out[False], out[True]
    for f in ("logp", "entropy", "ids_logp", "topk_logp"):
        assert torch.allclose(getattr(a, f), getattr(b, f), rtol=0, atol=1e-5), f
    assert torch.equal(a.topk_ids[rb.response_mask], b.topk_ids[rb.response_mask])
    scale = max(float(g.abs().max()) for g in ga)
    assert max(float((x - y).abs().max()) for x, y in zip(ga, gb)) <= 1e-5 * max(scale, 1.0)


def test_check_packing_refuses_an_attention_that_mixes_packed_sequences(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    import tether.passes as passes

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rb = hand_batch([4, 3, 5], [3, 4, 2])
    assert check_packing(model, rb, temperature=1.0, chunk_size=64) < 1e-4
    real = passes.response_stats

    def mixing(*a, packed=False, **k):  # what an implementation ignoring the position ids would give
        st = real(*a, packed=packed, **k)
        return dataclasses.replace(st, logp=st.logp + 0.1) if packed else st

    monkeypatch.setattr(passes, "response_stats", mixing)
    with pytest.raises(ConfigError, match="train.packing"):
        check_packing(model, rb, temperature=1.0, chunk_size=64)


# ---------------------------------------------------------------- the update: same gradient, same metrics


def fixed_batch_update(trainer, batch, **train):
    """The trainer's update of a copy of ``batch`` (its no-grad passes included) with ``train`` options set:
    each mini-batch's accumulated gradients, the metrics row and the update's micro-batches. The weights are
    not stepped."""
    import tether.train as train_module
    from tether.passes import Passes

    t = trainer.cfg.train
    for k, v in train.items():
        setattr(t, k, v)
    trainer._share_grad = t.share_prompt
    trainer.passes = Passes(trainer.model, trainer.anchor, trainer.needs, on_policy=trainer.passes.on_policy,
                            temperature=trainer.cfg.rollout.temperature, micro_batch_size=t.micro_batch_size,
                            chunk_size=t.logprob_chunk, share_prompt=t.share_prompt,
                            micro_batch_tokens=t.micro_batch_tokens, packed=t.packing)
    b = dataclasses.replace(batch)
    trainer.passes.sampler(b)
    trainer.passes.anchor_pass(b)
    grads = []

    def record(loss, stats):
        grads.append([p.grad.detach().clone() for p in trainer.params])
        trainer.optimizer.zero_grad(set_to_none=True)
        stats.optimizer_step(0.0)

    cuts = []

    def recording(*a, **k):
        cuts.append(micro_batches(*a, **k))
        return cuts[-1]

    trainer._optimizer_step = record
    real, train_module.micro_batches = train_module.micro_batches, recording
    try:
        row = trainer._update(b)
    finally:
        train_module.micro_batches = real
    return b, grads, row, cuts


@pytest.mark.parametrize("recipe", ["dapo", "grpo", "dr_grpo", "ema_pg"])  # token-mean, seq-mean-token-mean,
def test_token_budget_and_packing_give_the_count_based_gradient(recipe, workdir, tiny_model_dir, tmp_path,
                                                                one_thread):  # seq-mean-token-sum-norm, top-k KL
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tether.train import build_trainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = tiny_config(workdir, tiny_model_dir, recipe, 1, **{"train.mini_batches": 2, "train.micro_batch_size": 3,
                                                              "rollout.temperature": 1.0})
    trainer = build_trainer(cfg, tmp_path / "run", model=model, tokenizer=tok, log=lambda *a: None)
    batch, _ = trainer._rollout()
    assert len(set((batch.rb.prompt_mask.sum(-1) + batch.rb.response_mask.sum(-1)).tolist())) > 1  # lengths vary
    longest = int((batch.rb.prompt_mask.sum(-1) + batch.rb.response_mask.sum(-1)).max())
    ref_b, ref_g, ref_row, ref_cuts = fixed_batch_update(trainer, batch)
    assert len(ref_g) == 2 and ref_row["pad_frac"] > 0
    assert min(max(float(g.abs().max()) for g in gm) for gm in ref_g) > 1e-3  # a gradient to compare
    modes = [dict(micro_batch_size=8, micro_batch_tokens=2 * longest),  # a group's rows shared, by the budget
             dict(micro_batch_tokens=3 * longest, share_prompt=False),
             dict(micro_batch_tokens=3 * longest, share_prompt=False, packing=True),
             dict(micro_batch_tokens=0, micro_batch_size=3, share_prompt=False, packing=True)]
    for mode in modes:
        b, g, row, cuts = fixed_batch_update(trainer, batch, **mode)
        if mode["micro_batch_tokens"]:
            assert cuts != ref_cuts and max(len(c) for c in cuts) > 1  # another split, several micro-batches
        for f in ("old_logp", "ref_logp", "head_ref_logp"):
            x, y = getattr(ref_b, f), getattr(b, f)
            assert (x is None) == (y is None), (mode, f)
            if x is not None:
                assert torch.allclose(x, y, rtol=0, atol=1e-6), (mode, f)
        for gm_ref, gm in zip(ref_g, g, strict=True):
            for x, y in zip(gm_ref, gm, strict=True):
                assert torch.allclose(x, y, rtol=1e-6, atol=1e-6), (mode, recipe)
        assert set(row) == set(ref_row)
        for k, v in ref_row.items():
            if k != "pad_frac":
                assert row[k] == pytest.approx(v, rel=1e-6, abs=1e-9), (mode, k)
        if mode.get("packing"):
            assert row["pad_frac"] == 0.0
        else:
            assert 0 <= row["pad_frac"] < 1


def test_runs_log_pad_frac_every_step(workdir, tiny_model_dir, tmp_path, one_thread):
    """Count-based, by the token budget, and packed (checked against the padded forward at its first step)."""
    from helpers import rows
    from tether.train import train

    seen = {}
    for name, over in [("count", {}), ("tokens", {"train.micro_batch_tokens": 64}),
                       ("packed", {"train.micro_batch_tokens": 64, "train.packing": True,
                                   "train.share_prompt": False})]:
        cfg = tiny_config(workdir, tiny_model_dir, "grpo", 2, **over)
        seen[name] = [r["pad_frac"] for r in rows(train(cfg, tmp_path / name, log=lambda *a: None))]
    assert len(seen["count"]) == len(seen["tokens"]) == 2
    assert all(0 <= f < 1 for f in seen["count"] + seen["tokens"]) and seen["packed"] == [0.0, 0.0]


# ---------------------------------------------------------------- validation


def test_options_are_validated(workdir, tiny_model_dir):
    ok = tiny_config(workdir, tiny_model_dir, "grpo", 1, **{"train.micro_batch_tokens": 512,
                                                            "train.packing": True, "train.share_prompt": False})
    assert ok.train.micro_batch_tokens == 512 and ok.train.packing
    for over, msg in [({"train.micro_batch_tokens": -1}, "micro_batch_tokens must be >= 0"),
                      ({"train.micro_batch_tokens": 256, "train.micro_batch_size": 4},
                       "micro_batch_size has no effect with train.micro_batch_tokens"),
                      ({"train.packing": True}, "set train.share_prompt=false with train.packing=true")]:
        with pytest.raises(ConfigError, match=msg):
            tiny_config(workdir, tiny_model_dir, "grpo", 1, **over)
