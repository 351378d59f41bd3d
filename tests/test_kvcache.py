"""Tests for tether.rollout.kvcache: the in-place growing KV cache used for decoding."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from tether.models import ModelConfig, load_model
from tether.rollout.kvcache import GrowingLayer, growing_cache


def _decode(model, cache, ids, mask, steps: int, select_at: int | None = None, keep=None):
    """Greedy decode `steps` tokens by hand through `cache`; returns the logits of every step.

    With `select_at`, the rows `keep` are kept (cache.batch_select_indices) before that step.
    """
    logits = []
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                past_key_values=cache, use_cache=True)
    for t in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        logits.append(out.logits[:, -1])
        if select_at is not None and t == select_at:
            cache.batch_select_indices(keep)
            nxt, mask = nxt[keep], mask[keep]
            logits[-1] = logits[-1][keep]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        out = model(input_ids=nxt, attention_mask=mask, position_ids=(mask.sum(-1, keepdim=True) - 1),
                    past_key_values=cache, use_cache=True)
    return logits


def _batch(model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (4, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[3, :5] = 0
    return ids, mask


@torch.no_grad()
def test_growing_cache_gives_the_same_logits_as_dynamic_cache(tiny_model_dir):
    model, _ = load_model(ModelConfig(name=str(tiny_model_dir)))
    model.eval()
    ids, mask = _batch(model)
    ref = _decode(model, DynamicCache(config=model.config), ids, mask, 12, select_at=5, keep=torch.tensor([0, 3]))
    for reserve in (0, 7 + 12, 9):  # doubling only; exact final length; too small, then doubling
        cache = growing_cache(model, reserve=reserve)
        got = _decode(model, cache, ids, mask, 12, select_at=5, keep=torch.tensor([0, 3]))
        assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
        for a, b in zip(ref, got):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert cache.get_seq_length() == 7 + 12
        assert cache.layers[0].keys.shape == (2, model.config.num_key_value_heads, 19, cache.layers[0].keys.shape[-1])


@torch.no_grad()
def test_growing_layer_writes_in_place_and_grows_geometrically():
    """No copy per token: the buffer is reallocated O(log n) times (doubling) or once (reserve)."""
    for reserve, expected_caps in ((0, {4, 8, 16, 32, 64}), (50, {50, 100})):
        layer = GrowingLayer(reserve)
        k0 = torch.randn(2, 3, 4, 8)
        k, v = layer.update(k0, -k0)
        caps, ptrs = {layer.capacity}, {layer._kbuf.data_ptr()}
        steps = []
        for _ in range(60):
            new = torch.randn(2, 3, 1, 8)
            steps.append(new)
            k, v = layer.update(new, -new)
            caps.add(layer.capacity)
            ptrs.add(layer._kbuf.data_ptr())
        full = torch.cat([k0, *steps], dim=-2)
        assert torch.equal(k, full) and torch.equal(v, -full)  # the view holds exactly what was written
        assert layer.get_seq_length() == 64 and caps == expected_caps and len(ptrs) == len(caps)


@torch.no_grad()
def test_growing_layer_reorder_and_crop_go_through_the_buffers():
    layer = GrowingLayer(16)
    k0 = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    layer.update(k0, k0 + 100)
    layer.reorder_cache(torch.tensor([1, 1, 0]))  # expand a shared prompt to 3 rows
    assert torch.equal(layer.keys, k0[[1, 1, 0]]) and torch.equal(layer.values, k0[[1, 1, 0]] + 100)
    new = torch.full((3, 1, 1, 2), -1.0)
    k, _ = layer.update(new, new)
    assert k.shape == (3, 1, 4, 2) and torch.equal(k[:, :, 3], new[:, :, 0]) and layer.capacity == 16
    layer.crop(-2)
    assert layer.get_seq_length() == 2 and torch.equal(layer.keys, k0[[1, 1, 0]][:, :, :2])
