"""tether.memory: each line of a step's memory breakdown against bytes computed by hand on the tiny model,
and the changes that trim a step's memory: nothing of the rollout kept after it (KV cache, generation
buffers), a bf16 fixed anchor for an fp32 policy (the KL and its gradient within the stated tolerance),
malloc_trim after the rollout and the update, gradients freed after every optimizer step."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import DIGITS, tiny_config

from tether.memory import (LiveBytes, SavedActivations, StepMemory, breakdown_rows, grad_bytes, malloc_trim,
                           module_bytes, optimizer_state_bytes, rss_bytes, storage_bytes, track_kv_cache)
from tether.train import Trainer

F32 = 4  # bytes per float32


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("memory", DIGITS)


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ sizes and live bytes


def test_storage_bytes_counts_each_storage_once():
    a = torch.zeros(10, 4)
    assert storage_bytes([a, a[2:], a.t(), None]) == 40 * F32  # views share a's storage
    seen: set = set()
    assert storage_bytes([a], seen) == 160 and storage_bytes([a, torch.zeros(3)], seen) == 3 * F32


def test_live_bytes_follow_the_tensors_lifetime():
    live = LiveBytes()
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


def test_saved_activations_are_what_autograd_keeps_without_the_parameters():
    w = torch.nn.Parameter(torch.randn(1000))
    x = torch.randn(1000, requires_grad=True)
    acts = SavedActivations(exclude=[w])
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
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 3, **{"rollout.min_new_tokens": 8, "rollout.share_prompt": False,
                                                             "rollout.prune_every": 0, **over})
    return Trainer(cfg, tmp_path / "run", log=lambda *a: None)


def test_step_breakdown_matches_hand_computed_bytes(workdir, tiny_model_dir, tmp_path, one_thread):
    t = _memory_trainer(workdir, tiny_model_dir, tmp_path)
    t.train_step()  # the optimizer's state exists from the first step on
    m, mem = StepMemory(t, baseline_rss=rss_bytes()).step()
    s, model, n = mem["sizes"], t.model, _n_params(t.model)
    c = model.config
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # the rotary inv_freq
    assert s["weights"] == n * F32 + buffers == module_bytes(model)
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
    rows_ = {name: mb for name, mb, _ in breakdown_rows(mem)}
    assert rows_["optimizer state"] == pytest.approx(s["optimizer"] / 2**20)
    assert rows_["allocator overhead and untracked"] is not None and rows_["peak RSS"] > 0
    assert m["train_tokens"] > 0 and "kl" in m
    # the wrappers are gone: the next step runs the trainer's own methods
    assert "_rollout" not in t.__dict__ and "sampler" not in t.passes.__dict__


def test_gradients_are_freed_after_every_optimizer_step(workdir, tiny_model_dir, tmp_path, one_thread):
    """train.mini_batches=2: each optimizer step sees one mini-batch's gradient (not two accumulated into a
    second buffer) and none survives the step (zero_grad(set_to_none=True)): no gradient is resident during
    the next rollout."""
    t = _memory_trainer(workdir, tiny_model_dir, tmp_path, **{"train.mini_batches": 2})
    seen, step = [], t._optimizer_step

    def record(*a, **k):
        seen.append(grad_bytes(t.params))
        step(*a, **k)
        seen.append(grad_bytes(t.params))

    t._optimizer_step = record
    t.train_step()
    n = _n_params(t.model)
    assert seen == [n * F32, 0, n * F32, 0]
    assert all(p.grad is None for p in t.model.parameters())


# ------------------------------------------------------------------ (a) the rollout keeps nothing


def _tensor_bytes_outside(model, keep=()) -> int:
    gc.collect()
    skip = {id(p) for p in [*model.parameters(), *model.buffers(), *keep]}
    return storage_bytes(o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and id(o) not in skip)


def test_rollout_frees_its_kv_cache_and_generation_buffers(tiny_model_dir, one_thread):
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
    before = _tensor_bytes_outside(model)
    with track_kv_cache() as kv:
        rb = eng.generate(prompts, params)
        gc.collect()
        assert kv.peak > 0 and kv.live == 0
    held = [v for v in vars(rb).values() if isinstance(v, torch.Tensor)]
    assert _tensor_bytes_outside(model, keep=held) - storage_bytes(held) <= before
    assert len(eng.session_store) == 0


# ------------------------------------------------------------------ (c) malloc_trim


def test_malloc_trim_returns_free_heap_pages(one_thread):
    if not malloc_trim():
        pytest.skip("no glibc malloc_trim here")
    keep = []
    small = [torch.ones(8192) for _ in range(4000)]  # 32 KiB each, below glibc's mmap threshold: on the heap
    keep.append(torch.ones(8192))  # the heap's top stays in use: only trimming frees the pages below it
    del small
    gc.collect()
    before = rss_bytes()
    assert malloc_trim()
    assert rss_bytes() < before - 64 * 2**20


def test_optimizer_state_bytes_of_adamw_by_hand():
    p = [torch.nn.Parameter(torch.randn(10, 3)), torch.nn.Parameter(torch.randn(7))]
    opt = torch.optim.AdamW(p, lr=1e-3)
    assert optimizer_state_bytes(opt) == 0  # created lazily at the first step
    sum(x.sum() for x in p).backward()
    opt.step()
    assert optimizer_state_bytes(opt) == 2 * 37 * F32 + 2 * F32
