"""Aggregation of a per-token loss ``[B, T]`` into a scalar.

For gradient accumulation pass the *whole mini-batch's* counts (``num_tokens`` for
token-mean, ``num_seqs`` for the sequence modes): micro-batch losses then add up to the
mini-batch loss exactly.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .registry import unknown_choice

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(loss: Tensor, mask: Tensor, mode: str, *, max_len: int = 0,
              num_tokens: Optional[float] = None, num_seqs: Optional[float] = None) -> Tensor:
    """Scalar loss from ``loss [B, T]`` over ``mask [B, T]``.

    token-mean:              sum_{i,t} l / sum_{i,t} m (every token of the batch counts equally; DAPO)
    seq-mean-token-mean:     1/B sum_i (sum_t l / |y_i|) (GRPO as published)
    seq-mean-token-sum:      1/B sum_i sum_t l
    seq-mean-token-sum-norm: 1/B sum_i sum_t l / max_len (Dr.GRPO; max_len a fixed constant)
    """
    mask = mask.bool()
    m = mask.to(loss.dtype)
    # inf/NaN at masked positions never leak
    lm = torch.where(mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    if mode == "token-mean":
        n = m.sum() if num_tokens is None else num_tokens
        return lm.sum() / max(float(n), 1.0)
    b = float(loss.shape[0]) if num_seqs is None else float(num_seqs)
    if mode == "seq-mean-token-mean":
        return (lm.sum(-1) / m.sum(-1).clamp_min(1.0)).sum() / max(b, 1.0)
    if mode == "seq-mean-token-sum":
        return lm.sum() / max(b, 1.0)
    if mode == "seq-mean-token-sum-norm":
        if max_len <= 0:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs max_len > 0 "
                             "(a fixed length, e.g. max_new_tokens)")
        return lm.sum() / (max(b, 1.0) * max_len)
    raise ValueError(unknown_choice("aggregation", mode, AGGREGATIONS))
