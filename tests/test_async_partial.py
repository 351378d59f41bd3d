"""Partial rollouts (train.async.partial_rollout_tokens, tether.asynchronous.partial): a worker samples in segments and
takes
newer weights between them, recording each token's version.

With one version throughout, segmenting changes nothing (greedy ids, finish reasons, texts equal the unsegmented
call; a stop string split across segments ends the row where it would have); with a new version between segments,
each token's log-prob is that version's; a trainer with partial rollouts trains with staleness (the oldest
token's) <= K and verified checksums of every version used.
"""

import math

import pytest
import torch

from helpers import DIGITS, tiny_config
from tether.asynchronous.partial import Segmented
from tether.errors import ConfigError
from tether.logprobs import response_stats
from tether.models import ModelConfig, load_model
from tether.rollout import HFEngine, SamplingParams
from tether.train import build_trainer

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["Hello world", "What is 2 + 2? The answer", "x y z"]


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("async_partial", DIGITS)


@pytest.fixture
def policy(tiny_model_dir):
    model, tok = load_model(ModelConfig(name=str(tiny_model_dir)))
    model.requires_grad_(False)
    return model, tok, [tok(p)["input_ids"] for p in PROMPTS]


def test_segments_of_one_version_change_nothing(policy):
    model, tok, prompts = policy
    eng = HFEngine(model, tok, record_logp=True)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=11)
    whole = eng.generate(prompts, greedy)
    seg = Segmented(eng, 3, lambda: 7)
    part = seg.generate(prompts, greedy)
    assert part.response_ids.tolist() == whole.response_ids.tolist()
    assert part.finish_reason == whole.finish_reason and part.texts == whole.texts
    m = whole.response_mask
    assert torch.allclose(part.sampler_logp[m], whole.sampler_logp[m], atol=1e-5)
    assert torch.all(seg.token_version[m] == 7) and torch.all(seg.token_version[~m] == -1) and seg.swaps == 0
    # a stop string that a segment boundary splits: the row ends right after it, as unsegmented
    text = next(t for t in whole.texts if len(t) > 6)
    row = whole.texts.index(text)
    ids = whole.response_ids[row][m[row]].tolist()
    k = next(k for k in range(4, len(ids)) if len(tok.decode(ids[:k], skip_special_tokens=True)) > 3 and k % 3 == 1)
    stop = tok.decode(ids[:k], skip_special_tokens=True)[-2:]  # its end: token k - 1, the first of a segment
    stopped = SamplingParams(n=1, temperature=0.0, max_new_tokens=11, stop=[stop])
    a, b = eng.generate(prompts, stopped), seg.generate(prompts, stopped)
    assert b.response_ids.tolist() == a.response_ids.tolist() and b.texts == a.texts
    assert b.finish_reason == a.finish_reason and a.finish_reason[row] == "stop"


def test_each_token_is_sampled_and_scored_by_its_segments_version(policy):
    """A new version (the weights moved) between every two segments: token_version counts up segment by segment,
    and each token's sampler log-prob equals the trainer-side log-prob under the weights of its version."""
    model, tok, prompts = policy
    eng = HFEngine(model, tok, record_logp=True)
    snapshots = [[p.detach().clone() for p in model.parameters()]]
    state = {"v": 0}

    def refresh():  # called before the first segment (no change) and between segments (a new version)
        if getattr(refresh, "started", False):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            snapshots.append([p.detach().clone() for p in model.parameters()])
            state["v"] += 1
        refresh.started = True
        return state["v"]

    seg = Segmented(eng, 4, refresh)
    rb = seg.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3))
    tv, m = seg.token_version, rb.response_mask
    assert m.sum() > 4 * len(rb) + 8  # (a row may end with EOS early)
    position = torch.arange(tv.shape[1]).expand_as(tv)
    assert torch.equal(tv[m], (position // 4)[m]) and seg.swaps == int(tv.max()) == 2
    for v, snap in enumerate(snapshots):
        with torch.no_grad():
            for p, s in zip(model.parameters(), snap):
                p.copy_(s)
            lp = response_stats(model, rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask,
                                temperature=1.0, entropy=False).logp.float()
        here = tv == v
        assert torch.allclose(rb.sampler_logp[here], lp[here], atol=1e-5)
        assert not torch.allclose(rb.sampler_logp[m & ~here], lp[m & ~here], atol=1e-3)  # the others' differ


@pytest.mark.parametrize("over,msg", [
    ({"train.async.partial_rollout_tokens": -1}, "train.async.partial_rollout_tokens must be >= 0, got -1"),
    ({"train.async.max_staleness": 1, "train.async.partial_rollout_tokens": 8},
     "has no effect: a response has at most"),
    ({"train.async.max_staleness": 1, "train.async.partial_rollout_tokens": 4, "rollout.agent": "multi_turn"},
     "supports rollout.agent.kind=single_turn only"),
])
def test_partial_rollout_options(over, msg, workdir, tiny_model_dir):
    with pytest.raises(ConfigError, match=msg):
        tiny_config(workdir, tiny_model_dir, "grpo", 2, **over)


def test_a_trainer_with_partial_rollouts(workdir, tiny_model_dir, tmp_path):
    """Real workers, segments of 3 tokens: staleness (the oldest token's) <= K, each token's version between the
    batch's version and the trainer's, verified checksums of every version used (mid-job ones included)."""
    steps = 5
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", steps, **{
        "train.async.max_staleness": 1, "train.async.verify_sync": True, "train.async.partial_rollout_tokens": 3,
        "algo.tis_cap": 2.0})
    t = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    try:
        ms = [t.train_step() for _ in range(steps)]
    finally:
        t.close()
    for step, m in enumerate(ms):
        assert 0 <= m["async/staleness"] <= 1 and m["async/version"] == step - m["async/staleness"]
        assert m["async/version"] <= m["async/newest_version"] <= step
        assert step - m["async/newest_version"] <= m["async/token_staleness_mean"] <= m["async/staleness"]
        assert m["async/swaps"] <= m["async/newest_version"] - m["async/version"]
        assert math.isfinite(m["pg_loss"]) and math.isfinite(m["rollout_corr/ratio_mean"])
