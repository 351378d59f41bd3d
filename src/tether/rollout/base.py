"""The rollout interface: sampling parameters, the batch of sampled responses, and `Engine`.

An engine turns tokenized prompts into a `RolloutBatch`. The trainer only talks to the
`Engine` protocol, so an engine that runs generation elsewhere (e.g. vLLM in its own
process) can be plugged in without touching the trainer: it implements `generate` and,
because its weights are a copy, `sync_weights` to receive the updated policy after each
optimizer step.

Layout conventions of `RolloutBatch` (B = number of prompts x n):

* rows of one prompt are contiguous: rows ``[g*n, (g+1)*n)`` belong to prompt ``g`` of the
  call and have ``group == g``;
* prompts are left-padded and responses right-padded, so ``cat([prompt_ids, response_ids], 1)``
  with mask ``cat([prompt_mask, response_mask], 1)`` is a valid (left/right padded) input
  whose response tokens sit at columns ``P .. P+T-1`` for every row;
* ``response_mask`` is True on every generated token, including a final EOS; everything
  after EOS, after a stop string, or beyond the row's length is padding (mask False).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import torch


@dataclass
class SamplingParams:
    """How to sample responses: group size, sampling distribution, length and stop conditions."""

    n: int = 4  # samples per prompt (group size G)
    temperature: float = 1.0  # softmax temperature; 0 means greedy
    top_p: float = 1.0  # nucleus sampling mass; 1.0 = disabled
    top_k: int = 0  # keep the k most likely tokens; 0 = disabled
    max_new_tokens: int = 256  # response length cap; responses that reach it finish with "length"
    stop: list[str] = field(default_factory=list)  # stop strings; the response is cut right after the stop string's last token
    seed: int | None = None  # seed for this call's sampling (same call + seed -> same output); None = global RNG
    greedy: bool = False  # argmax decoding (same as temperature 0); n copies are then identical

    @property
    def is_greedy(self) -> bool:
        """True if decoding is argmax (``greedy`` set or ``temperature == 0``)."""
        return self.greedy or self.temperature == 0

    def validate(self) -> None:
        """Raise ValueError for out-of-range values."""
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")


def _trim(ids: torch.Tensor, mask: torch.Tensor, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop padding columns that are masked out in every row (leading if `left`, else trailing)."""
    if mask.shape[0] == 0:
        return ids[:, :0], mask[:, :0]
    used = mask.any(dim=0).nonzero().flatten()
    if used.numel() == 0:
        return ids[:, :0], mask[:, :0]
    if left:
        start = int(used[0])
        return ids[:, start:], mask[:, start:]
    end = int(used[-1]) + 1
    return ids[:, :end], mask[:, :end]


def _pad_to(t: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    """Pad a [B, W] tensor to [B, width] with `value` on the left or right."""
    extra = width - t.shape[1]
    if extra <= 0:
        return t
    pad = torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=1) if left else torch.cat([t, pad], dim=1)


@dataclass
class RolloutBatch:
    """Sampled responses for a batch of prompts, padded into rectangular tensors (see module doc)."""

    prompt_ids: torch.Tensor  # [B, P] long, left-padded with pad id; B = num_prompts * n, rows of a prompt contiguous
    prompt_mask: torch.Tensor  # [B, P] bool, True on real prompt tokens
    response_ids: torch.Tensor  # [B, T] long, right-padded with pad id
    response_mask: torch.Tensor  # [B, T] bool, True on generated tokens (EOS included when emitted)
    finish_reason: list[str]  # per row: "stop" (EOS or stop string) | "length" (hit max_new_tokens)
    group: torch.Tensor  # [B] long, index of the prompt in the generate call (after concat: made distinct per batch)
    texts: list[str]  # decoded responses (special tokens skipped, ending right after the stop string if one was hit)
    gen_time_s: float  # wall-clock seconds spent generating (summed over concatenated batches; kept by select)
    gen_tokens: int  # number of generated (response) tokens (summed over concat; kept by select, see num_response_tokens)
    pad_token_id: int = 0  # id used for the padding positions

    def __post_init__(self) -> None:
        """Check that the row counts and ids/mask shapes agree."""
        b = self.prompt_ids.shape[0]
        if self.prompt_mask.shape != self.prompt_ids.shape or self.response_mask.shape != self.response_ids.shape:
            raise ValueError("ids and mask shapes differ")
        if self.response_ids.shape[0] != b or self.group.shape[0] != b:
            raise ValueError("inconsistent batch sizes")
        if len(self.finish_reason) != b or len(self.texts) != b:
            raise ValueError("finish_reason/texts length differs from the batch size")

    def __len__(self) -> int:
        """Number of rows (sequences) B."""
        return self.prompt_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] long: number of response tokens per row (including EOS)."""
        return self.response_mask.sum(dim=1)

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """[B] long: number of real prompt tokens per row."""
        return self.prompt_mask.sum(dim=1)

    @property
    def num_response_tokens(self) -> int:
        """Total response tokens in this batch (unlike `gen_tokens`, always recomputed from the mask)."""
        return int(self.response_mask.sum())

    def input_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, mask)`` of the full sequences ``[prompt | response]``, shape [B, P + T].

        Response token ``t`` of every row sits at column ``P + t``.
        """
        ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        mask = torch.cat([self.prompt_mask, self.response_mask], dim=1)
        return ids, mask

    def to(self, device) -> "RolloutBatch":
        """A copy with the tensors moved to `device`."""
        return RolloutBatch(
            prompt_ids=self.prompt_ids.to(device),
            prompt_mask=self.prompt_mask.to(device),
            response_ids=self.response_ids.to(device),
            response_mask=self.response_mask.to(device),
            finish_reason=list(self.finish_reason),
            group=self.group.to(device),
            texts=list(self.texts),
            gen_time_s=self.gen_time_s,
            gen_tokens=self.gen_tokens,
            pad_token_id=self.pad_token_id,
        )

    def select(self, idx) -> "RolloutBatch":
        """The subset of rows `idx`, with padding columns no longer used by any row removed.

        Args:
            idx: row indices (list/sequence of ints or a long tensor, in the order wanted) or a
                [B] bool mask.

        `group` values are kept as they are (they still index the prompts of the generate
        call). `gen_time_s` and `gen_tokens` are kept too: they account for the generation
        that produced the batch, including rows dropped here (use `num_response_tokens` for
        the tokens that remain).
        """
        index = idx if isinstance(idx, torch.Tensor) else torch.as_tensor(idx)  # lists, numpy arrays
        index = index.flatten().cpu()
        if index.numel() == 0:
            index = index.long()
        elif index.dtype == torch.bool:
            if index.numel() != len(self):
                raise ValueError(f"bool mask has {index.numel()} entries for a batch of {len(self)} rows")
            index = index.nonzero().flatten()
        else:
            index = index.long()
        rows = index.tolist()
        dev = self.prompt_ids.device
        pid, pmask = _trim(self.prompt_ids[index.to(dev)], self.prompt_mask[index.to(dev)], left=True)
        rid, rmask = _trim(self.response_ids[index.to(dev)], self.response_mask[index.to(dev)], left=False)
        return RolloutBatch(
            prompt_ids=pid,
            prompt_mask=pmask,
            response_ids=rid,
            response_mask=rmask,
            finish_reason=[self.finish_reason[i] for i in rows],
            group=self.group[index.to(self.group.device)],
            texts=[self.texts[i] for i in rows],
            gen_time_s=self.gen_time_s,
            gen_tokens=self.gen_tokens,
            pad_token_id=self.pad_token_id,
        )

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"], offset_groups: bool = True) -> "RolloutBatch":
        """Stack batches row-wise (prompts re-left-padded, responses re-right-padded to a common width).

        Args:
            batches: one or more batches (on the same device).
            offset_groups: shift each batch's `group` values past the previous batches' maximum,
                so rows of different calls never share a group (group-wise advantages stay
                per prompt). With False the values are kept as they are.

        `gen_time_s` and `gen_tokens` are summed.
        """
        batches = list(batches)
        if not batches:
            raise ValueError("concat needs at least one batch")
        pad = batches[0].pad_token_id
        p_width = max(b.prompt_ids.shape[1] for b in batches)
        r_width = max(b.response_ids.shape[1] for b in batches)
        groups = []
        offset = 0
        for b in batches:
            g = b.group + offset if offset_groups else b.group
            groups.append(g)
            if offset_groups and len(b) > 0:
                offset = int(g.max()) + 1
        return RolloutBatch(
            prompt_ids=torch.cat([_pad_to(b.prompt_ids, p_width, pad, left=True) for b in batches]),
            prompt_mask=torch.cat([_pad_to(b.prompt_mask, p_width, False, left=True) for b in batches]),
            response_ids=torch.cat([_pad_to(b.response_ids, r_width, pad, left=False) for b in batches]),
            response_mask=torch.cat([_pad_to(b.response_mask, r_width, False, left=False) for b in batches]),
            finish_reason=[r for b in batches for r in b.finish_reason],
            group=torch.cat(groups),
            texts=[t for b in batches for t in b.texts],
            gen_time_s=float(sum(b.gen_time_s for b in batches)),
            gen_tokens=int(sum(b.gen_tokens for b in batches)),
            pad_token_id=pad,
        )


@runtime_checkable
class Engine(Protocol):
    """A rollout engine: samples responses for tokenized prompts with the current policy."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` responses per prompt (token-id lists, no padding) into a `RolloutBatch`."""
        ...

    def sync_weights(self, model) -> None:
        """Make the engine sample from `model`'s current weights.

        Called by the trainer after every optimizer step; a no-op for engines that share the
        training model (such as `HFEngine`).
        """
        ...
