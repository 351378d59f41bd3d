"""The rollout interface: sampling parameters, the batch of sampled responses, and `Engine`.

An engine turns tokenized prompts into a `RolloutBatch`. Agents (``tether.agents``) drive
engines; nothing else talks to one, and ``tether.rollout.make_engine`` is the one place an
engine is built, so an engine that runs generation elsewhere (e.g. vLLM) plugs in without
touching the trainer: it implements `generate` and, because its weights are a copy,
`sync_weights` to receive the updated policy once per trainer step.

Multi-turn sessions (optional). An engine with ``supports_sessions = True`` also takes
``generate(prompts, params, sessions=keys)``, one hashable key per output row (an episode id),
and ``release(sessions=None)``: it may keep each row's KV cache under its key, so that the next
call whose prompt for that key extends the row's prompt + response encodes only the new tokens,
until the key is released (None: all keys) or the weights change. The sampling distribution is
the same as without ``sessions``; only the work differs. Agents check ``getattr(engine, "supports_sessions", False)``
before passing ``sessions``, so an engine without them (the `Engine` protocol below) still works.
`HFEngine` keeps the caches itself (``tether.rollout.sessions``); `VLLMEngine` accepts and ignores
the keys, as vLLM's prefix caching finds the shared prefixes on its own.

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

from dataclasses import dataclass, field, fields
from typing import Optional, Protocol, Sequence, runtime_checkable

import torch

from .. import distributed as dist

#: The ``GenerationError`` message of an engine that met NaN or infinite logits (the trainer adds its step).
NONFINITE_LOGITS = ("the model's logits are NaN or infinite: its weights have diverged or are broken. In training, "
                    "lower train.lr; otherwise check the checkpoint or model that was loaded")


@dataclass
class SamplingParams:
    """How to sample responses: group size, sampling distribution, length and stop conditions."""

    n: int = 4  # samples per prompt (group size G)
    temperature: float = 1.0  # softmax temperature; 0 means greedy
    top_p: float = 1.0  # nucleus sampling mass; 1.0 = disabled
    top_k: int = 0  # keep the k most likely tokens; 0 = disabled
    max_new_tokens: int = 256  # response length cap; responses that reach it finish with "length"
    stop: list[str] = field(default_factory=list)  # stop strings; the response is cut right after
    # the stop string's last token
    seed: int | None = None  # seed for this call's sampling (same call + seed -> same output); None = global RNG
    greedy: bool = False  # argmax decoding (same as temperature 0); n copies are then identical
    min_new_tokens: int = 0  # EOS is banned before this many new tokens (vLLM's min_tokens); 0 = no floor

    @classmethod
    def for_step(cls, rollout, seed: int, step: int, round_: int = 0) -> "SamplingParams":
        """How trainer step ``step`` samples (an asynchronous job: its id), refill round ``round_`` (dynamic
        sampling): the ``rollout`` section's settings with the run's seed schedule (``seed``: ``train.seed``; each
        rank its own, `tether.distributed.rank_seed`)."""
        r = rollout
        return cls(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                   min_new_tokens=r.min_new_tokens, stop=list(r.stop),
                   seed=dist.rank_seed((seed * 1_000_003 + step * 1009 + round_) % (2**31)))

    @property
    def is_greedy(self) -> bool:
        """True if decoding is argmax (``greedy`` set or ``temperature == 0``)."""
        return self.greedy or self.temperature == 0

    def validate(self) -> None:
        """Raise ValueError for out-of-range values."""
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
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


def _laid_out(kind: str):
    """A required RolloutBatch field with its layout (see the layouts below)."""
    return field(metadata={"layout": kind})


def _optional(kind: str):
    """An optional RolloutBatch field (default None) with its layout."""
    return field(default=None, metadata={"layout": kind})


# Field layouts, which select / concat / to follow so that no method lists the fields by hand:
#   prompt    [B, P] tensor, left-padded        response  [B, T] tensor, right-padded
#   row       [B] tensor                         list      python list with one entry per row
#   total     a number for the whole batch: summed by concat, kept by select
#   const     the same for every batch (taken from the first)
_PAD = {"prompt_ids": "pad", "response_ids": "pad"}  # id tensors pad with pad_token_id; masks False; floats 0


@dataclass
class RolloutBatch:
    """Sampled responses for a batch of prompts, padded into rectangular tensors (see module doc)."""

    prompt_ids: torch.Tensor = _laid_out("prompt")  # [B, P] long, left-padded with pad id; rows of a prompt contiguous
    prompt_mask: torch.Tensor = _laid_out("prompt")  # [B, P] bool, True on real prompt tokens
    response_ids: torch.Tensor = _laid_out("response")  # [B, T] long, right-padded with pad id
    response_mask: torch.Tensor = _laid_out("response")  # [B, T] bool, True on every response token
    # (EOS and tool observations included)
    finish_reason: list = _laid_out("list")  # per row: "stop" (EOS or stop string) | "length" (hit max_new_tokens)
    group: torch.Tensor = _laid_out("row")  # [B] long, index of the prompt (example) in the call
    # (after concat: made distinct per batch)
    texts: list = _laid_out("list")  # decoded responses (special tokens skipped,
    # ending right after the stop string if one was hit)
    gen_time_s: float = _laid_out("total")  # wall-clock seconds spent generating (summed over concat; kept by select)
    gen_tokens: int = _laid_out("total")  # generated (response) tokens (summed over concat;
    # kept by select, see num_response_tokens)
    pad_token_id: int = field(default=0, metadata={"layout": "const"})  # id used for the padding positions
    # [B, T] bool: the response tokens the policy produced, the only ones the loss sees. Tool
    # observations and other inserted text are False. None (the default) = response_mask.
    loss_mask: Optional[torch.Tensor] = _optional("response")
    # [B, T] float: log-probs the engine reports for the sampled tokens (vLLM); None = not reported.
    sampler_logp: Optional[torch.Tensor] = _optional("response")
    # [B, T] long: the weights version that sampled each response token, when the engine reports it (a served
    # engine whose weights may change while a request is in flight: vLLM's weight_versions); -1 on padding and on
    # tokens no policy sampled. None = the engine does not report versions.
    token_version: Optional[torch.Tensor] = _optional("response")
    # per row: the agent's record of the episode (a dict, e.g. the search agent's searches and the ids
    # of the passages it was shown); None = the agent keeps none.
    info: Optional[list] = _optional("list")

    def __post_init__(self) -> None:
        """Default ``loss_mask`` to ``response_mask``; check that the row counts and shapes agree."""
        if self.loss_mask is None:
            self.loss_mask = self.response_mask.clone()
        b = self.prompt_ids.shape[0]
        for f in fields(self):
            v, kind = getattr(self, f.name), f.metadata["layout"]
            if v is None:
                continue
            if kind in ("prompt", "response"):
                ref = self.prompt_ids if kind == "prompt" else self.response_ids
                if v.shape != ref.shape:
                    raise ValueError(f"{f.name} has shape {tuple(v.shape)}, expected {tuple(ref.shape)}")
            elif kind in ("row", "list") and len(v) != b:
                raise ValueError(f"{f.name} has {len(v)} rows, expected {b} (the batch size)")
        if (self.loss_mask & ~self.response_mask).any():
            raise ValueError("loss_mask is True outside response_mask")

    def _fields(self, *kinds: str) -> list[str]:
        return [f.name for f in fields(self) if f.metadata["layout"] in kinds]

    def __len__(self) -> int:
        """Number of rows (sequences) B."""
        return self.prompt_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        """[B] long: number of response tokens per row (including EOS)."""
        return self.response_mask.sum(dim=1)

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
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device) if isinstance(v, torch.Tensor) else list(v) if isinstance(v, list) else v
        return RolloutBatch(**kw)

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
        # columns still used by a selected row: leading prompt padding and trailing response padding go
        p_cols = _used_columns(self.prompt_mask[index.to(self.prompt_mask.device)], left=True)
        r_cols = _used_columns(self.response_mask[index.to(self.response_mask.device)], left=False)
        kw = {}
        for f in fields(self):
            v, kind = getattr(self, f.name), f.metadata["layout"]
            if v is None or kind in ("total", "const"):
                kw[f.name] = v
            elif kind == "list":
                kw[f.name] = [v[i] for i in rows]
            else:
                sel = v[index.to(v.device)]
                kw[f.name] = sel[:, p_cols] if kind == "prompt" else sel[:, r_cols] if kind == "response" else sel
        return RolloutBatch(**kw)

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"], offset_groups: bool = True) -> "RolloutBatch":
        """Stack batches row-wise (prompts re-left-padded, responses re-right-padded to a common width).

        Args:
            batches: one or more batches (on the same device).
            offset_groups: shift each batch's `group` values past the previous batches' maximum,
                so rows of different calls never share a group (group-wise advantages stay
                per prompt). With False the values are kept as they are.

        `gen_time_s` and `gen_tokens` are summed. An optional field (``sampler_logp``) is kept
        only if every batch has it.
        """
        batches = list(batches)
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        width = {"prompt": max(b.prompt_ids.shape[1] for b in batches),
                 "response": max(b.response_ids.shape[1] for b in batches)}
        kw = {}
        for f in fields(first):
            vals, kind = [getattr(b, f.name) for b in batches], f.metadata["layout"]
            if kind == "const":
                kw[f.name] = vals[0]
            elif any(v is None for v in vals):
                kw[f.name] = None
            elif kind == "total":
                kw[f.name] = type(vals[0])(sum(vals))
            elif kind == "list":
                kw[f.name] = [x for v in vals for x in v]
            elif kind == "row":
                kw[f.name] = torch.cat(vals)
            else:
                pad = (first.pad_token_id if f.name in _PAD else -1 if f.name == "token_version"
                       else False if vals[0].dtype == torch.bool else 0)
                kw[f.name] = torch.cat([_pad_to(v, width[kind], pad, left=kind == "prompt") for v in vals])
        if offset_groups:
            groups, offset = [], 0
            for b in batches:
                groups.append(b.group + offset)
                if len(b) > 0:
                    offset = int(groups[-1].max()) + 1
            kw["group"] = torch.cat(groups)
        return RolloutBatch(**kw)


def _used_columns(mask: torch.Tensor, left: bool) -> slice:
    """The column range still used by some row: drops leading (left) or trailing padding columns."""
    if mask.shape[0] == 0:
        return slice(0, 0)
    used = mask.any(dim=0).nonzero().flatten()
    if used.numel() == 0:
        return slice(0, 0)
    return slice(int(used[0]), None) if left else slice(0, int(used[-1]) + 1)


def _pad_to(t: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    """Pad a [B, W] tensor to [B, width] with `value` on the left or right."""
    extra = width - t.shape[1]
    if extra <= 0:
        return t
    pad = torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=1) if left else torch.cat([t, pad], dim=1)


@runtime_checkable
class Engine(Protocol):
    """A rollout engine: samples responses for tokenized prompts with the current policy.

    Optional (see the module doc), for engines that keep multi-turn episodes' KV caches:
    ``supports_sessions: bool`` (class attribute, True), ``generate(prompts, params, sessions=None)``
    with one hashable key per output row (``len(prompts) * params.n``, a prompt's rows contiguous),
    and ``release(sessions=None)``, which frees the caches of those keys (unknown keys ignored;
    None frees all).
    """

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        """Sample ``params.n`` responses per prompt (token-id lists, no padding) into a `RolloutBatch`."""
        ...

    def sync_weights(self, model) -> None:
        """Make the engine sample from `model`'s current weights.

        Called by the trainer once per trainer step (after the step's optimizer steps and the
        anchor update) and after a checkpoint is restored; a no-op for engines that share the
        training model (such as `HFEngine`).
        """
        ...
