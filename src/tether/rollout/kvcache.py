"""A KV cache for decoding that grows in place instead of re-copying itself at every token.

transformers' ``DynamicLayer.update`` is ``keys = torch.cat([keys, new], dim=-2)``: every decode
step copies the whole cache of every layer. On CPU that is memory traffic proportional to
``rows x cache length`` per token, which at a few hundred cached positions costs more than the
attention itself (``bench/decode_speed.py`` measures both paths; docs/benchmarks.md has the figures).

`GrowingLayer` keeps each layer's keys and values in a buffer with spare capacity along the
sequence axis, writes new positions into it, and hands attention a view of the filled part.
Attention kernels read the strided view as fast as a contiguous tensor. When the buffer is full it
is reallocated once to ``reserve`` positions (the caller's known final length) or, without one, to twice its size, so
copying is amortized O(1) per token.

Every other operation of ``DynamicLayer`` (batch selection when rows are dropped, reordering
when a shared prompt is expanded, cropping, offloading) reads ``keys`` / ``values`` and assigns
a new tensor; both go through properties here, so they keep working unchanged and the next
update re-grows the buffer.

`shared_prefill` fills an empty cache once per distinct prompt of a sub-batch and expands it to
the prompt's rows (``HFEngine(share_prompt=True)``).

Only for decoding under ``torch.no_grad``: the update writes into the buffer in place, which
autograd would reject for a cache that takes part in a backward pass.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from ..logprobs import cache_kwarg, prompt_groups


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values live in a buffer with spare sequence capacity.

    Args:
        reserve: capacity to allocate at the first growth (the total sequence length the caller
            expects, prompt plus new tokens). Growth past it doubles. 0 = double from the start.
    """

    def __init__(self, reserve: int = 0, **kwargs):
        self.reserve = int(reserve)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._len = 0
        super().__init__(**kwargs)

    # ``keys`` / ``values``: the filled part of the buffers. Assigning replaces the buffers.
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._kbuf is None else self._kbuf[..., : self._len, :]

    @keys.setter
    def keys(self, t: torch.Tensor | None) -> None:
        self._kbuf = t
        self._len = 0 if t is None or t.dim() < 2 else t.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._vbuf is None else self._vbuf[..., : self._len, :]

    @values.setter
    def values(self, t: torch.Tensor | None) -> None:
        self._vbuf = t  # length follows the keys (they are always assigned together)

    @property
    def capacity(self) -> int:
        """Positions the buffers hold before the next reallocation."""
        return 0 if self._kbuf is None or self._kbuf.dim() < 2 else self._kbuf.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._kbuf = self._vbuf = None
        self._len = 0
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    def _grow(self, needed: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        cap = self.reserve if self.reserve >= needed else max(needed, 2 * self.capacity)
        k = like_k.new_empty((*like_k.shape[:-2], cap, like_k.shape[-1]))
        v = like_v.new_empty((*like_v.shape[:-2], cap, like_v.shape[-1]))
        if self._len:
            k[..., : self._len, :] = self._kbuf[..., : self._len, :]
            v[..., : self._len, :] = self._vbuf[..., : self._len, :]
        self._kbuf, self._vbuf = k, v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._len, self._len + key_states.shape[-2]
        if self._kbuf is None or end > self.capacity or self._kbuf.shape[:-2] != key_states.shape[:-2]:
            self._grow(end, key_states, value_states)
        self._kbuf[..., start:end, :] = key_states
        self._vbuf[..., start:end, :] = value_states
        self._len = end
        return self.keys, self.values


def growing_cache(model, reserve: int = 0) -> DynamicCache:
    """A ``DynamicCache`` for `model` whose plain full-attention layers are `GrowingLayer`.

    Other layer kinds the model's config asks for (sliding-window, linear attention, ...) are
    kept as transformers builds them.
    """
    config = getattr(model, "config", None)
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    if cache.layers:
        cache.layers = [GrowingLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    else:
        cache.layer_class_to_replicate = lambda: GrowingLayer(reserve)
    return cache


def shared_prefill(model, ids: torch.Tensor, mask: torch.Tensor, cache) -> None:
    """Fill the empty `cache` with the KV of ``ids[:, :-1]``, computed once per distinct prompt and
    expanded to all rows.

    ``generate`` then feeds only the last prompt column (positions come from ``mask`` as usual) and
    decodes from there. Nothing is done when every row's prompt is distinct (nothing to share);
    ``generate`` then pre-fills every row itself.
    """
    first, inverse = prompt_groups(ids, mask)  # [U], [rows]
    if len(first) == ids.shape[0]:
        return
    pre_mask = mask[first, :-1]  # [U, W-1]
    model(input_ids=ids[first, :-1], attention_mask=pre_mask,
          position_ids=(pre_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True, logits_to_keep=1,
          **{cache_kwarg(model): cache})
    cache.reorder_cache(inverse)
