"""A step's memory: each line of the breakdown of bench/_memory.py (the benchmarks' instrumentation) against
bytes computed by hand on the tiny model, and the changes that trim a step's memory: nothing of the rollout
kept after it (KV cache, generation buffers), a bf16 fixed anchor for an fp32 policy (the KL and its gradient
within the stated tolerance), tether.memory.malloc_trim after the rollout and the update, gradients freed after
every optimizer step."""

from __future__ import annotations

import gc

import pytest
import torch

from helpers import DIGITS, tiny_config
from tether.anchor import Anchor
from tether.config.anchor import FixedAnchorConfig
from tether.config.recipes import AlgoConfig, validate
from tether.errors import ConfigError
from tether.logprobs import response_stats
from tether.memory import malloc_trim
from tether.train import build_trainer

F32 = 4  # bytes per float32


@pytest.fixture(scope="module")
def bm(bench_script):
    """bench/_memory.py: the step instrumentation (sizes of tensors, live bytes, per-phase peaks)."""
    return bench_script("_memory")


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("memory", DIGITS)


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ sizes and live bytes


def test_storage_bytes_counts_each_storage_once(bm):
    a = torch.zeros(10, 4)
    assert bm.storage_bytes([a, a[2:], a.t(), None]) == 40 * F32  # views share a's storage
    seen: set = set()
    assert bm.storage_bytes([a], seen) == 160 and bm.storage_bytes([a, torch.zeros(3)], seen) == 3 * F32


def test_live_bytes_follow_the_tensors_lifetime(bm):
    live = bm.LiveBytes()
    a, b = torch.zeros(100), torch.zeros(50)
    live.add(a)
    view = a[10:]
    live.add(view)  # the same storage: counted once, until both objects are gone
    live.add(b)
    assert (live.live, live.peak) == (600, 600)
    del a
    gc.collect()
    assert live.live == 600  # the view keeps the storage
    live.reset_peak()
    del b
    gc.collect()
    assert (live.live, live.peak) == (400, 600)


def test_saved_activations_are_what_autograd_keeps_without_the_parameters(bm):
    w = torch.nn.Parameter(torch.randn(1000))
    x = torch.randn(1000, requires_grad=True)
    acts = bm.SavedActivations(exclude=[w])
    with acts.tracking():
        y = torch.tanh(x)  # saves its output y
        z = (y * w).sum()  # saves y (the same storage) and w (a parameter: excluded)
    assert acts.live == acts.peak == 1000 * F32
    z.backward()
    del y, z
    gc.collect()
    assert acts.live == 0 and acts.peak == 1000 * F32


# ------------------------------------------------------------------ a step's breakdown, by hand


def _memory_trainer(workdir, tiny_model_dir, tmp_path, **over):
    """The tiny grpo run (fixed anchor, k3), responses of exactly 8 tokens, one generate call per step."""
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 3, **{"rollout.min_new_tokens": 8,
                                                             "rollout.engine.share_prompt": False,
                                                             "rollout.engine.prune_every": 0, **over})
    return build_trainer(cfg, tmp_path / "run", log=lambda *a: None)


def test_step_breakdown_matches_hand_computed_bytes(bm, workdir, tiny_model_dir, tmp_path, one_thread):
    t = _memory_trainer(workdir, tiny_model_dir, tmp_path)
    t.train_step()  # the optimizer's state exists from the first step on
    m, mem = bm.StepMemory(t, baseline_rss=bm.rss_bytes()).step()
    s, model, n = mem["sizes"], t.model, _n_params(t.model)
    c = model.config
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # the rotary inv_freq
    assert s["weights"] == n * F32 + buffers == bm.module_bytes(model)
    assert s["anchor"] == n * F32  # the fixed anchor: one fp32 copy, no forward copy
    assert s["optimizer"] == 2 * n * F32 + F32 * len(t.params)  # AdamW: exp_avg, exp_avg_sq, a float32 step each
    assert s["gradients"] == n * F32  # one fp32 gradient per parameter at the optimizer step
    rb = t._last_batch.rb
    rows, width = rb.prompt_ids.shape[0], rb.prompt_ids.shape[1]  # one sub-batch of 16 rows, left-padded prompts
    head_dim = c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_hidden_layers * rows * c.num_key_value_heads * head_dim * (width + 8) * F32  # K and V, reserve
    assert s["kv_cache"] == kv
    assert s["activations"] > 0
    assert list(mem["phases"]) == ["rollout", "sampler pass", "anchor pass", "update"]
    for r in mem["phases"].values():
        assert r["peak_rss"] >= r["rss_end"] > 0
    rows_ = {name: mb for name, mb, _ in bm.breakdown_rows(mem)}
    assert rows_["optimizer state"] == pytest.approx(s["optimizer"] / 2**20)
    assert rows_["allocator overhead and untracked"] is not None and rows_["peak RSS"] > 0
    assert m["train_tokens"] > 0 and "kl" in m
    # the wrappers are gone: the next step runs the trainer's own methods
    assert "_rollout" not in t.__dict__ and "sampler" not in t.passes.__dict__


def test_gradients_are_freed_after_every_optimizer_step(bm, workdir, tiny_model_dir, tmp_path, one_thread):
    """train.mini_batches=2: each optimizer step sees one mini-batch's gradient (not two accumulated into a
    second buffer) and none survives the step (zero_grad(set_to_none=True)): no gradient is resident during
    the next rollout."""
    t = _memory_trainer(workdir, tiny_model_dir, tmp_path, **{"train.mini_batches": 2})
    seen, step = [], t._optimizer_step

    def record(*a, **k):
        seen.append(bm.grad_bytes(t.params))
        step(*a, **k)
        seen.append(bm.grad_bytes(t.params))

    t._optimizer_step = record
    t.train_step()
    n = _n_params(t.model)
    assert seen == [n * F32, 0, n * F32, 0]
    assert all(p.grad is None for p in t.model.parameters())


# ------------------------------------------------------------------ (a) the rollout keeps nothing


def _tensor_bytes_outside(bm, model, keep=()) -> int:
    gc.collect()
    skip = {id(p) for p in [*model.parameters(), *model.buffers(), *keep]}
    return bm.storage_bytes(o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and id(o) not in skip)


def test_rollout_frees_its_kv_cache_and_generation_buffers(bm, tiny_model_dir, one_thread):
    """HFEngine.generate keeps nothing once it returns: its KV buffers are freed (tracked live bytes back to
    0) and no other tensor outlives the call but the batch it returns. The trainer's rollout therefore holds
    no KV cache into the update; multi-turn session caches are released by the agent at each episode's end
    and all of them by sync_weights."""
    from tether.models import ModelConfig, load_model
    from tether.rollout import SamplingParams
    from tether.rollout.hf import HFEngine

    model, tok = load_model(ModelConfig(name=str(tiny_model_dir), dtype="float32", device="cpu"))
    eng = HFEngine(model, tok, batch_size=8)
    prompts = [tok.encode("What is 2 + 2?"), tok.encode("Hello world! Hello there.")]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, min_new_tokens=12, seed=0)
    eng.generate(prompts, params)  # first-call allocations (rotary caches and the like) out of the way
    before = _tensor_bytes_outside(bm, model)
    with bm.track_kv_cache() as kv:
        rb = eng.generate(prompts, params)
        gc.collect()
        assert kv.peak > 0 and kv.live == 0
    held = [v for v in vars(rb).values() if isinstance(v, torch.Tensor)]
    assert _tensor_bytes_outside(bm, model, keep=held) - bm.storage_bytes(held) <= before
    assert len(eng.session_store) == 0


# ------------------------------------------------------------------ (b) a bf16 fixed anchor


def _tiny_policy(tiny_model_dir):
    from tether.models import ModelConfig, load_model

    model, _ = load_model(ModelConfig(name=str(tiny_model_dir), dtype="float32", device="cpu"))
    return model


def test_bf16_anchor_halves_its_bytes_and_keeps_no_fp32_copy(bm, tiny_model_dir):
    model = _tiny_policy(tiny_model_dir)
    n = _n_params(model)
    a32, a16 = Anchor(FixedAnchorConfig(), model), Anchor(FixedAnchorConfig(dtype="bfloat16"), model)
    assert bm.storage_bytes(a32.master) == n * F32 and bm.storage_bytes(a16.master) == n * 2 and not a16._compute
    before = [p.detach().clone() for p in model.parameters()]
    with a16.applied(model):
        assert all(p.dtype == torch.float32 for p in model.parameters())  # upcast for the block only
        assert all(torch.equal(p, m.float()) for p, m in zip(model.parameters(), a16.master))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and not a16._compute
    assert bm.module_bytes(model) == n * F32 + sum(b.numel() * b.element_size() for b in model.buffers())


def test_bf16_anchor_kl_and_gradient_within_the_stated_tolerance(tiny_model_dir, one_thread):
    """The bf16 anchor is the bf16-rounded initial policy (relative rounding <= 2^-9 per weight). Stated
    tolerance on the tiny model, at distance 0 from the anchor and at a k3 KL of ~3e-3 (measured in brackets):
    the anchor's log-probs move by at most 0.05 per token (0.038), the KL by at most 1e-4 + 10% of it (at
    distance 0 the fp32 anchor gives KL = 0 exactly and the bf16 one a floor of 5.2e-5; at 2.75e-3 it
    gives 2.58e-3), and the KL's gradient by at most 25% relative at a KL >= 1e-3 (13%). Below ~10x the
    floor the rounding dominates the KL gradient: on SmolLM2-135M the floor is 9.6e-5 and at a KL of
    1.3e-4 the gradient differs by 83% (docs/benchmarks.md, "Memory: what each change should remove")."""
    model = _tiny_policy(tiny_model_dir)
    a32, a16 = Anchor(FixedAnchorConfig(), model), Anchor(FixedAnchorConfig(dtype="bfloat16"), model)
    g = torch.Generator().manual_seed(0)
    B, P, T = 4, 12, 16
    pid, rid = torch.randint(4, 384, (B, P), generator=g), torch.randint(4, 384, (B, T), generator=g)
    pm, rm = torch.ones(B, P, dtype=torch.long), torch.ones(B, T, dtype=torch.bool)

    def ref(a):
        with torch.no_grad(), a.applied(model):
            return response_stats(model, pid, pm, rid, rm, entropy=False).logp

    def kl_and_grad(ref_logp):
        model.zero_grad(set_to_none=True)
        d = ref_logp - response_stats(model, pid, pm, rid, rm, entropy=False).logp
        kl = (d.exp() - 1 - d).mean()  # k3, token mean
        kl.backward()
        return kl.item(), torch.cat([p.grad.flatten() for p in model.parameters()])

    for scale in (0.0, 0.01):  # the policy moved away from the anchor: not at all, then to a KL of ~3e-3
        with torch.no_grad():
            for p, m in zip(model.parameters(), a32.master):
                p.copy_(m + scale * p.abs().mean() * torch.randn(p.shape, generator=g))
        r32, r16 = ref(a32), ref(a16)
        assert (r32 - r16).abs().max() <= 0.05
        (k32, g32), (k16, g16) = kl_and_grad(r32), kl_and_grad(r16)
        assert abs(k16 - k32) <= 1e-4 + 0.1 * k32
        if scale == 0:
            assert k32 == 0.0 and k16 > 0
        else:
            assert k32 >= 1e-3 and (g16 - g32).norm() <= 0.25 * g32.norm()


def test_bf16_anchor_config_is_for_a_fixed_anchor_of_an_fp32_policy(tiny_model_dir):
    validate(AlgoConfig(anchor=FixedAnchorConfig(dtype="bfloat16"), **_k3()))
    from tether.resolve import load_config

    with pytest.raises(ConfigError, match="algo.anchor.dtype is a key of algo.anchor.kind=fixed"):  # by construction
        load_config(None, {"algo.anchor.dtype": "bfloat16"}, recipe_name="ema_pg")
    with pytest.raises(ConfigError, match="unknown algo.anchor.dtype 'float16'.* Valid choices: policy, bfloat16"):
        load_config(None, {"algo.anchor.kind": "fixed", "algo.anchor.dtype": "float16"}, recipe_name="grpo")
    with pytest.raises(ValueError, match="'policy' or 'bfloat16'"):  # a section built in Python: its own type
        FixedAnchorConfig(dtype="float16")
    with pytest.raises(ValueError, match="would change nothing"):
        Anchor(FixedAnchorConfig(dtype="bfloat16"), _tiny_policy(tiny_model_dir).to(torch.bfloat16))


def _k3():
    from tether.config import kl_config
    return {"kl": kl_config("k3", beta=0.04)}


def test_bf16_anchor_trains_and_checkpoints(bm, workdir, tiny_model_dir, tmp_path, one_thread):
    t = _memory_trainer(workdir, tiny_model_dir, tmp_path, **{"algo.anchor.dtype": "bfloat16"})
    m = t.train_step()
    assert m["kl"] >= 0 and t.anchor.master[0].dtype == torch.bfloat16
    assert bm.storage_bytes(t.anchor.master) == 2 * _n_params(t.model)
    path = t.save()
    t2 = _memory_trainer(workdir, tiny_model_dir, tmp_path / "b", **{"algo.anchor.dtype": "bfloat16"})
    t2.restore(path)
    assert all(torch.equal(a, b) for a, b in zip(t.anchor.master, t2.anchor.master))


# ------------------------------------------------------------------ (c) malloc_trim


def test_malloc_trim_returns_free_heap_pages(bm, one_thread):
    if not malloc_trim():
        pytest.skip("no glibc malloc_trim here")
    keep = []
    small = [torch.ones(8192) for _ in range(4000)]  # 32 KiB each, below glibc's mmap threshold: on the heap
    keep.append(torch.ones(8192))  # the heap's top stays in use: only trimming frees the pages below it
    del small
    gc.collect()
    before = bm.rss_bytes()
    assert malloc_trim()
    assert bm.rss_bytes() < before - 64 * 2**20


def test_train_malloc_trim_trims_after_the_rollout_and_the_update(workdir, tiny_model_dir, tmp_path, monkeypatch,
                                                                  one_thread):
    import tether.train

    calls = []
    monkeypatch.setattr(tether.train, "malloc_trim", lambda: calls.append(1) or True)
    _memory_trainer(workdir, tiny_model_dir, tmp_path, **{"train.malloc_trim": True}).train_step()
    assert len(calls) == 2  # after the rollout and after the update
    calls.clear()
    _memory_trainer(workdir, tiny_model_dir, tmp_path / "off").train_step()
    assert calls == []


def test_optimizer_state_bytes_of_adamw_by_hand(bm):
    p = [torch.nn.Parameter(torch.randn(10, 3)), torch.nn.Parameter(torch.randn(7))]
    opt = torch.optim.AdamW(p, lr=1e-3)
    assert bm.optimizer_state_bytes(opt) == 0  # created lazily at the first step
    sum(x.sum() for x in p).backward()
    opt.step()
    assert bm.optimizer_state_bytes(opt) == 2 * 37 * F32 + 2 * F32


def test_config_error_is_raised_for_a_bad_anchor_dtype(workdir, tiny_model_dir):
    with pytest.raises(ConfigError, match="anchor.dtype"):
        tiny_config(workdir, tiny_model_dir, "ema_pg", 1, **{"algo.anchor.dtype": "bfloat16"})
