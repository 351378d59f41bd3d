"""Which conversations form each SFT batch, and how a micro-batch is laid out for the forward pass.

* `BatchPlan` -- the batches of every pass over the training rows, a function of (seed, pass), so
  that the data position of a checkpoint is just the number of batches taken. ``padded`` and
  ``packed`` batches are random; ``length_grouped`` ones are cut from length-sorted runs of 50
  batches' worth of rows, then shuffled (as transformers' ``group_by_length``).
* `micro_batches` -- a batch's rows by length (longest first), ``size`` at a time: the gradient is
  a sum over the batch, so the split changes nothing but padding.
* `collate` -- a micro-batch as tensors: ``padded`` rows (right padding, positions 0..L-1, an
  attention mask), or one ``packed`` row (the conversations one after another, no padding,
  positions restarting at 0 for each, no attention mask: transformers keeps each conversation's
  attention to itself from the positions).
* `check_packing` -- that this model's attention does so: the packed forward against the padded one.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..logprobs import packing_difference, sequence_logp
from .data import Encoded

GROUP_BATCHES = 50  # length_grouped: rows sorted by length within runs of this many batches


class BatchPlan:
    """The batches of pass ``epoch`` over ``len(lengths)`` rows (`batches`), and the batch at any global
    position (`batch`: position p is batch ``p % steps_per_epoch`` of pass ``p // steps_per_epoch``)."""

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int, grouped: bool):
        self.lengths, self.batch_size, self.seed, self.grouped = list(lengths), batch_size, seed, grouped
        self.steps_per_epoch = math.ceil(len(self.lengths) / batch_size)
        self._cached: tuple[int, list[list[int]]] = (-1, [])

    def batches(self, epoch: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + epoch)
        perm = list(range(len(self.lengths)))
        rng.shuffle(perm)
        size = self.batch_size
        if self.grouped:
            run = GROUP_BATCHES * size
            perm = [i for k in range(0, len(perm), run)
                    for i in sorted(perm[k:k + run], key=lambda i: -self.lengths[i])]
        out = [perm[k:k + size] for k in range(0, len(perm), size)]
        if self.grouped:
            rng.shuffle(out)  # the long batches are not all at the start of a run
        return out

    def batch(self, position: int) -> list[int]:
        epoch, index = divmod(position, self.steps_per_epoch)
        if self._cached[0] != epoch:
            self._cached = (epoch, self.batches(epoch))
        return self._cached[1][index]


def micro_batches(rows: Sequence[int], lengths: Sequence[int], size: int) -> list[list[int]]:
    """``rows`` sorted by length (longest first), ``size`` at a time."""
    ordered = sorted(rows, key=lambda i: -lengths[i])
    return [ordered[k:k + size] for k in range(0, len(ordered), size)]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, S] long
    attention_mask: Optional[torch.Tensor]  # [B, S] bool (padded), None (packed)
    position_ids: torch.Tensor  # [B, S] long
    targets: torch.Tensor  # [B, S] bool: the tokens the loss reads
    tokens: int  # real (not padding) tokens


def collate(encs: Sequence[Encoded], packed: bool, pad_id: int, device) -> MicroBatch:
    """``encs`` as one packed row or as right-padded rows (module docstring)."""
    if packed:
        ids = [i for e in encs for i in e.ids]
        pos = [p for e in encs for p in range(len(e.ids))]
        tgt = [t and k > 0 for e in encs for k, t in enumerate(e.train)]
        row = lambda x, dt: torch.tensor([x], dtype=dt, device=device)  # noqa: E731
        return MicroBatch(row(ids, torch.long), None, row(pos, torch.long), row(tgt, torch.bool), len(ids))
    width = max(len(e.ids) for e in encs)
    ids = torch.full((len(encs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encs), width), dtype=torch.bool)
    tgt = torch.zeros((len(encs), width), dtype=torch.bool)
    for b, e in enumerate(encs):
        n = len(e.ids)
        ids[b, :n] = torch.tensor(e.ids)
        mask[b, :n] = True
        tgt[b, 1:n] = torch.tensor(e.train[1:], dtype=torch.bool)
    pos = torch.arange(width).repeat(len(encs), 1)
    return MicroBatch(ids.to(device), mask.to(device), pos.to(device), tgt.to(device), int(mask.sum()))


def batch_logp(model, mb: MicroBatch, chunk_size: int) -> torch.Tensor:
    """log-probs [N] of the micro-batch's targets (`tether.logprobs.sequence_logp`)."""
    return sequence_logp(model, mb.input_ids, mb.attention_mask, mb.position_ids, mb.targets, chunk_size=chunk_size)


def check_packing(model, encs: Sequence[Encoded], pad_id: int, device, chunk_size: int, width: int = 48) -> float:
    """Raise ConfigError unless packed rows give the padded rows' log-probs on this model.

    The first tokens (``width``) of up to four conversations ``encs`` are run both ways, in eval mode
    without gradients, every position after the first a target; returns the largest difference.
    """
    probe = [Encoded(e.where, e.ids[:width], [False] + [True] * (min(width, len(e.ids)) - 1)) for e in encs[:4]]
    probe = [e for e in probe if len(e.ids) > 1]
    if len(probe) < 2:
        return 0.0  # nothing to compare: a single conversation never shares a packed row
    return packing_difference(model, lambda packed: batch_logp(model, collate(probe, packed, pad_id, device),
                                                               chunk_size),
                              key="train.batching=packed", fix="use train.batching=padded or length_grouped")
