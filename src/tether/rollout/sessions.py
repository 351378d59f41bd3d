"""Per-episode KV caches kept between `HFEngine.generate` calls, and per-token sampler log-probs.

A multi-turn agent calls the engine once per turn with each episode's whole context so far
(prompt, every earlier turn's response, the observations in between). With ``sessions`` (one
hashable key per output row) `HFEngine` keeps, under the row's key, the KV of the row's prompt
plus response when the call ends (a `SessionEntry`), and the next call whose prompt for that key
extends those tokens encodes only the tokens after them. Everything here is a pure function
of the cache, the attention mask and the token lists; the engine decides when to call it.

What is stored. For each row: the tokens the cache covers (prompt + response ids, all but
possibly the last sampled token, whose KV ``generate`` never computes) and, per layer, K and V
of shape ``[kv_heads, L, head_dim]``, gathered from the batched cache at the columns where the
attention mask is 1 (the layout has left padding and, when a row itself continued from a stored
cache, a hole between its cached and its new tokens), the first ``L`` of them: a row that ended
before the rest of its sub-batch is decoded on with padding tokens that the mask does not hide,
so only its real length counts. A finishing row is taken before `HFEngine` prunes it from the
batch (``prune_every``).

Continuing. A sub-batch whose rows have stored prefixes of lengths ``c_r`` (0 for a row without
one) is laid out per row as ``[pad..][c_r cached tokens][pad..][new tokens]`` (`layout`), mask 0
on the pads, with ``W = max c_r`` cached columns. The cache is pre-filled with the stored KV,
right-aligned in those ``W`` columns (`prefill`), and ``model.generate`` feeds only the columns
from ``W`` on: it slices ``input_ids`` to the columns the cache does not hold (the
``input_ids.shape[1] - cache length`` last ones), and takes position ids from
``attention_mask.cumsum(-1) - 1``, so a token keeps the position it had when it was first
encoded, holes or not. The cached K are stored after the rotary embedding, which is therefore
still right. A key's usable prefix is the longest common prefix of its stored tokens and the new
prompt, capped one short of the prompt (``generate`` needs at least one token to feed); 0 (no
entry, or a first token that differs) is a full encode. Keys are expected to be distinct
within a call (the last row of a key wins).

Where it does not apply. Only caches whose layers are all plain full-attention layers
(``DynamicLayer`` or `kvcache.GrowingLayer`) are stored: a sliding-window layer keeps only its
window and a linear-attention layer a running state, neither of which can be cut to a row's
first ``L`` positions; for such models ``sessions`` are accepted and nothing is stored.

Memory. An entry holds ``layers x 2 x kv_heads x head_dim x dtype bytes`` per token on the
model's device (Qwen2.5-0.5B in bfloat16: 24 x 2 x 2 x 64 x 2 = 12 KiB per token, so a
thousand-token episode is 12 MiB; a 7B model with 28 layers and 4 KV heads of 128: 56 KiB per
token). Entries live until the agent releases them (``engine.release(keys)``, at the end of an
episode), a later call replaces them, or ``sync_weights`` drops them all (KV computed with older
weights is stale). `SessionStore.nbytes` reports the total.

Per-token log-probs (`StepLogp`). A logits processor that sees each decode step's scores
before the sampler, keeps their log-softmax under the sampling warpers (temperature, top-k,
top-p: the distribution the token is drawn from; greedy: none) and, at the next step or at the
segment's end, gathers the value at the token that was actually drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Optional, Sequence

import torch
from transformers import LogitsProcessor
from transformers.cache_utils import DynamicLayer

from .kvcache import GrowingLayer

_PLAIN_LAYERS = (DynamicLayer, GrowingLayer)


@dataclass
class SessionEntry:
    """One row's stored cache: ``tokens`` (what the KV covers), per layer ``(K, V)`` ``[kv_heads, len, head_dim]``."""

    tokens: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        """Bytes held by the KV tensors."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])


class SessionStore:
    """The stored caches of one engine, by session key (see the module doc)."""

    def __init__(self):
        self.entries: dict[Hashable, SessionEntry] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.entries

    def usable(self, key: Hashable, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` the entry under ``key`` can supply (0: encode them all)."""
        e = self.entries.get(key)
        return 0 if e is None else min(common_prefix(e.tokens, prompt), len(prompt) - 1)

    def take(self, key: Hashable, prompt: Sequence[int]) -> tuple[Optional[SessionEntry], int]:
        """Remove the entry under ``key`` and return it with its usable length for ``prompt`` (`usable`).

        The entry is removed whatever it is worth: the call that takes it stores the row's new cache under
        the key, and the old one's memory is released as soon as its sub-batch is pre-filled.
        """
        c = self.usable(key, prompt)
        e = self.entries.pop(key, None)
        return (e if c else None), c

    def put(self, key: Hashable, entry: Optional[SessionEntry]) -> None:
        """Store ``entry`` under ``key`` (None: store nothing, dropping what was there)."""
        if entry is None:
            self.entries.pop(key, None)
        else:
            self.entries[key] = entry

    def release(self, keys: Optional[Iterable[Hashable]] = None) -> None:
        """Free the entries of ``keys`` (unknown keys ignored); None frees them all."""
        if keys is None:
            self.entries.clear()
            return
        for k in keys:
            self.entries.pop(k, None)

    @property
    def nbytes(self) -> int:
        """Bytes held by all stored KV tensors."""
        return sum(e.nbytes for e in self.entries.values())


def layout(prompts: list[list[int]], cached: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(ids, mask, W)``: each row as ``[pad..][its cached prefix][pad..][the rest]`` (module doc).

    ``cached[r]`` leading tokens of ``prompts[r]`` are right-aligned in the first ``W = max(cached)``
    columns, the remaining tokens in the columns after them; with no cached token this is plain left
    padding.
    """
    w = max(cached, default=0)
    n = max((len(p) - c for p, c in zip(prompts, cached)), default=0)
    ids = torch.full((len(prompts), w + n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), w + n), dtype=torch.long)
    for r, (p, c) in enumerate(zip(prompts, cached)):
        if c:
            ids[r, w - c : w] = torch.tensor(p[:c], dtype=torch.long)
            mask[r, w - c : w] = 1
        m = len(p) - c
        ids[r, w + n - m :] = torch.tensor(p[c:], dtype=torch.long)
        mask[r, w + n - m :] = 1
    return ids, mask, w


def prefill(cache, past: list[tuple[Optional[SessionEntry], int]], width: int) -> None:
    """Write each row's first ``c`` stored positions, right-aligned in ``width`` columns, into the empty ``cache``.

    ``past[r] = (entry, c)`` (entry None when ``c == 0``); the other columns hold zeros that the
    attention mask hides.
    """
    ref = next(e for e, c in past if c)
    for layer, (k0, v0) in enumerate(ref.kv):
        k = k0.new_zeros((len(past), k0.shape[0], width, k0.shape[-1]))
        v = v0.new_zeros((len(past), v0.shape[0], width, v0.shape[-1]))
        for r, (e, c) in enumerate(past):
            if c:
                k[r, :, width - c :] = e.kv[layer][0][:, :c]
                v[r, :, width - c :] = e.kv[layer][1][:, :c]
        cache.update(k, v, layer)


def storable(cache) -> bool:
    """Whether every layer of ``cache`` is a plain full-attention layer holding positions (module doc)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in _PLAIN_LAYERS and layer.keys is not None
                                and layer.keys.dim() == 4 for layer in layers)


def take_rows(cache, mask: torch.Tensor, idx: list[int], tokens: list[list[int]]) -> list[Optional[SessionEntry]]:
    """The entries of rows ``idx`` of the batched ``cache``: the KV of each row's real columns.

    ``mask`` [rows, >= cache length] marks the real columns of each row (its first ``cache length``
    columns are the cache's positions); ``tokens[j]`` are row ``idx[j]``'s prompt + response ids.
    A row gets its first ``min(len(tokens[j]), real columns)`` positions. None for every row when
    the cache cannot be stored (`storable`).
    """
    if not storable(cache):
        return [None] * len(idx)
    length = cache.get_seq_length()
    out: list[Optional[SessionEntry]] = []
    for i, toks in zip(idx, tokens):
        cols = mask[i, :length].nonzero().flatten()[: len(toks)]
        kv = [(layer.keys[i][:, cols], layer.values[i][:, cols]) for layer in cache.layers]
        out.append(SessionEntry(list(toks[: cols.numel()]), kv))
    return out


class StepLogp(LogitsProcessor):
    """Records the log-prob of each drawn token under the distribution it was drawn from (module doc).

    Args:
        warpers: the sampling warpers, applied to the scores this processor sees (it must run before
            any processor that replaces them, e.g. `hf._InverseCDFSampler`); empty for greedy.
    """

    def __init__(self, warpers: Sequence = ()):
        self.warpers = list(warpers)
        self.pending: Optional[torch.Tensor] = None  # [rows, vocab] log-probs of the last step
        self.steps: list[torch.Tensor] = []  # [rows] per drawn token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.pending is not None:  # the previous step's draw is the last column now
            self.steps.append(self.pending.gather(1, input_ids[:, -1:]).squeeze(1))
        s = scores
        for w in self.warpers:
            s = w(input_ids, s)
        self.pending = torch.log_softmax(s.float(), dim=-1)
        return scores

    def finish(self, last: torch.Tensor) -> torch.Tensor:
        """``[rows, steps]`` log-probs of the segment, given its last drawn tokens ``last`` [rows]; resets."""
        if self.pending is not None:
            self.steps.append(self.pending.gather(1, last.view(-1, 1).to(self.pending.device)).squeeze(1))
        out = torch.stack(self.steps, dim=1) if self.steps else torch.zeros(len(last), 0)
        self.pending, self.steps = None, []
        return out
