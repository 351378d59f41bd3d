"""Post-processing shared by the engines: cut each sampled row at EOS or a stop string, and pad
the rows into a `RolloutBatch`.

The rule (the one `HFEngine` and `VLLMEngine` share, so their outputs agree token for token):
a row ends after its first EOS (kept, finish reason ``stop``) or right after the token that
completes a stop string (the shortest token prefix whose decoded text, special tokens skipped,
contains a stop string; the text is cut right after the stop string); a row that reached
``max_new_tokens`` otherwise finishes with ``length``. Subclasses set ``tokenizer``,
``eos_token_ids`` and ``pad_token_id``, resolved by `eos_and_pad` for every engine.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .base import RolloutBatch, SamplingParams


def as_id_list(x) -> list[int]:
    """Normalize an int / list of ints / None to a list of ints."""
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return [int(i) for i in x]
    if isinstance(x, torch.Tensor):
        return [int(i) for i in x.flatten().tolist()]
    return [int(x)]


def eos_and_pad(gen_cfg, tokenizer) -> tuple[list[int], int]:
    """Every engine's stop and pad ids: the EOS ids of the model's generation_config and the tokenizer (ordered,
    unique; ValueError when neither has one), and the tokenizer's pad id, else the generation_config's, else the
    first EOS."""
    eos = list(dict.fromkeys(as_id_list(getattr(gen_cfg, "eos_token_id", None)) + as_id_list(tokenizer.eos_token_id)))
    if not eos:
        raise ValueError("Neither the model's generation_config nor the tokenizer defines an EOS token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else getattr(gen_cfg, "pad_token_id", None)
    return eos, int(pad) if pad is not None else eos[0]


class RowPostprocess:
    """Mixin: ``finish_row``, ``stop_prefix`` and ``assemble`` (see the module doc); public, as the engines and
    `tether.asynchronous.partial` use them."""

    tokenizer: Any
    eos_token_ids: list[int]
    pad_token_id: int

    def finish_row(self, tokens: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
        """Cut one generated row at EOS / stop string; return ``(tokens, finish_reason, text)``."""
        eos = set(self.eos_token_ids)
        cut = next((k + 1 for k, t in enumerate(tokens) if t in eos), None)
        candidate = tokens[:cut] if cut is not None else tokens
        if params.stop:
            k = self.stop_prefix(candidate, params.stop)
            if k is not None and (cut is None or k < cut):
                kept = candidate[:k]
                text = self.tokenizer.decode(kept, skip_special_tokens=True)
                end = min(text.find(s) + len(s) for s in params.stop if s in text)
                return kept, "stop", text[:end]
        text = self.tokenizer.decode(candidate, skip_special_tokens=True)
        if cut is not None:
            return candidate, "stop", text
        if len(tokens) < params.max_new_tokens:
            # Only possible if generate stopped a row for a reason we do not model
            # (e.g. a stopping criterion from the model's generation config).
            return candidate, "stop", text
        return candidate, "length", text

    def stop_prefix(self, tokens: list[int], stops: list[str]) -> int | None:
        """Length of the shortest prefix of `tokens` whose decoded text contains a stop string."""

        def hit(k: int) -> bool:
            text = self.tokenizer.decode(tokens[:k], skip_special_tokens=True)
            return any(s in text for s in stops)

        if not tokens or not hit(len(tokens)):
            return None
        lo, hi = 1, len(tokens)  # invariant: hit(hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if hit(mid):
                hi = mid
            else:
                lo = mid + 1
        if hi > 1 and hit(hi - 1):  # containment not monotone (partial UTF-8 bytes): scan linearly
            hi = next(k for k in range(1, len(tokens) + 1) if hit(k))
        return hi

    def assemble(self, prompts: list[list[int]], row_group: list[int], results: list[Any],
                 logps: Optional[list[list[float]]] = None,
                 versions: Optional[list[list[int]]] = None) -> RolloutBatch:
        """Pad per-row results into a `RolloutBatch` (rows in prompt order); ``logps`` (one list
        per row, as long as its kept tokens) fill ``sampler_logp``, ``versions`` (likewise) ``token_version``."""
        num_rows = len(row_group)
        p_width = max((len(prompts[g]) for g in row_group), default=0)
        r_width = max((len(r[0]) for r in results), default=0)
        prompt_ids = torch.full((num_rows, p_width), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((num_rows, p_width), dtype=torch.bool)
        response_ids = torch.full((num_rows, r_width), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((num_rows, r_width), dtype=torch.bool)
        for i, g in enumerate(row_group):
            p = prompts[g]
            prompt_ids[i, p_width - len(p) :] = torch.tensor(p, dtype=torch.long)
            prompt_mask[i, p_width - len(p) :] = True
            toks = results[i][0]
            if toks:
                response_ids[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
                response_mask[i, : len(toks)] = True
        sampler_logp = None
        if logps is not None:
            sampler_logp = torch.zeros((num_rows, r_width), dtype=torch.float32)
            for i, lp in enumerate(logps):
                if lp:
                    sampler_logp[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        token_version = None
        if versions is not None:
            token_version = torch.full((num_rows, r_width), -1, dtype=torch.long)
            for i, v in enumerate(versions):
                if v:
                    token_version[i, : len(v)] = torch.tensor(v, dtype=torch.long)
        return RolloutBatch(
            token_version=token_version,
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            finish_reason=[r[1] for r in results],
            group=torch.tensor(row_group, dtype=torch.long),
            texts=[r[2] for r in results],
            gen_time_s=0.0,
            gen_tokens=int(response_mask.sum()),
            pad_token_id=self.pad_token_id,
            sampler_logp=sampler_logp,
        )
