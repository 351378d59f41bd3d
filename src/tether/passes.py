"""The no-grad passes between the rollout and the update, and the batch they fill.

    StepBatch (rollout, rewards, advantages)
      --sampler pass--> old_logp (pi_old at the sampled tokens), head ids from the sampler's top-k
      --anchor pass-->  ref_logp (pi_a at the sampled tokens), head log-probs of the anchor

Which passes run is decided by ``tether.algo.loss_needs`` (the registries' metadata), never by
estimator names: on-policy with no sampler head the sampler pass is skipped (pi_old = sg(pi)),
unless rollout correction (``algo.tis_cap``) needs pi_old to compare with the engine's log-probs;
with no KL term the anchor pass is skipped; under the iterative anchor the sampler pass *is*
the anchor pass. Micro-batching (length-sorted, groups kept together for the shared-prompt
forward; ``size`` rows or a token budget; padded or packed) is shared with the update in
``micro_batches``, and ``head_inputs`` turns what the passes
filled into the KL head's fields of the update's ``LossInputs``, again as ``loss_needs`` says.
Two more forwards sit here: ``exact_kl_sample`` (a diagnostic) and ``idle_backward`` (the zero-loss
call a rank makes to keep in lockstep with the others under FSDP, `tether.distributed.lockstep`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from . import distributed as dist
from .algo import LossNeeds
from .logprobs import packing_difference, response_stats
from .rollout import RolloutBatch


@dataclass
class StepBatch:
    """One step's rollout with everything the update needs, aligned [B, T] with ``rb``."""

    rb: RolloutBatch
    examples: list  # [B] the example each response answers
    rewards: torch.Tensor  # [B] float
    correct: torch.Tensor  # [B] bool
    adv: torch.Tensor  # [B] float
    loss_mask: torch.Tensor  # [B, T] bool: the policy's response tokens that enter the loss
    old_logp: Optional[torch.Tensor] = None  # [B, T] sampler log-probs (None = exactly on-policy)
    head_ids: Optional[torch.Tensor] = None  # [B, T, k] top-k KL head ids q
    ref_logp: Optional[torch.Tensor] = None  # [B, T] anchor log-probs at the sampled tokens
    head_ref_logp: Optional[torch.Tensor] = None  # [B, T, k] anchor log-probs at q
    row_offset: int = 0  # data-parallel: this rank's rows are rows [row_offset, row_offset + B) of the global batch
    global_rows: Optional[int] = None  # rows of the global batch (all ranks); None = B (one process)
    stale: bool = False  # sampled by weights older than the policy it trains (asynchronous, staleness >= 1): pi_old
    # is then recomputed by the sampler pass even when the update is one optimizer step


def micro_batches(rb: RolloutBatch, idx: list[int], size: int, by_group: bool = False, tokens: int = 0,
                  packed: bool = False) -> list[list[int]]:
    """``idx`` cut into micro-batches, ordered so that they waste little padding.

    Order. Plain: by total sequence length. ``by_group`` (shared prompts): by prompt length, then
    group, then total length, so a group's rows stay adjacent, where its prompt is run once.

    Cut. ``tokens`` = 0: ``size`` rows at a time. ``tokens`` > 0: greedily, in that order, as many
    rows as fit the budget: a micro-batch's forwarded length (`forwarded_positions`: rows x (longest
    prompt + longest response) padded, the sum of its rows' lengths ``packed``) stays <= ``tokens``,
    except that a row longer than the budget goes alone. ``by_group`` adds whole groups (a group that
    does not fit in an empty micro-batch is cut row by row), so a group is split only when it alone
    exceeds the budget.
    """
    plen, rlen = rb.prompt_mask.sum(-1).tolist(), rb.response_mask.sum(-1).tolist()
    tot = [p + r for p, r in zip(plen, rlen)]
    if by_group:
        group = rb.group.tolist()
        order = sorted(idx, key=lambda i: (plen[i], group[i], tot[i]))
    else:
        order = sorted(idx, key=lambda i: tot[i])
    if tokens <= 0:
        return [order[i:i + size] for i in range(0, len(order), size)]
    units: list[list[int]] = []  # whole groups (by_group) or single rows, in order
    for i in order:
        if by_group and units and group[units[-1][-1]] == group[i]:
            units[-1].append(i)
        else:
            units.append([i])

    def cost(n: int, p: int, r: int, s: int) -> int:  # forwarded length of n rows, longest p + r, lengths summing to s
        return s if packed else n * (p + r)

    out: list[list[int]] = []
    cur, p_max, r_max, s_sum = [], 0, 0, 0
    for unit in units:
        up, ur, us = max(plen[i] for i in unit), max(rlen[i] for i in unit), sum(tot[i] for i in unit)
        pieces = [unit] if cost(len(unit), up, ur, us) <= tokens else [[i] for i in unit]
        for piece in pieces:
            pp, pr, ps = max(plen[i] for i in piece), max(rlen[i] for i in piece), sum(tot[i] for i in piece)
            if cur and cost(len(cur) + len(piece), max(p_max, pp), max(r_max, pr), s_sum + ps) > tokens:
                out.append(cur)
                cur, p_max, r_max, s_sum = [], 0, 0, 0
            cur = cur + piece
            p_max, r_max, s_sum = max(p_max, pp), max(r_max, pr), s_sum + ps
    if cur:
        out.append(cur)
    return out


def forwarded_positions(rb: RolloutBatch, idx: list[int], packed: bool = False) -> torch.Tensor:
    """Positions the forward of micro-batch ``idx`` lays out (a 0-dim tensor): rows x (longest prompt +
    longest response) padded (``rb.select(idx)``'s shape), its real tokens ``packed``. Real tokens over
    this is 1 - the padding fraction (``pad_frac``)."""
    pm, rm = rb.prompt_mask[idx], rb.response_mask[idx]
    if packed:
        return pm.sum() + rm.sum()
    return len(idx) * (pm.sum(-1).max() + rm.sum(-1).max())


def head_inputs(needs: LossNeeds, st, head_ids: Optional[torch.Tensor], head_ref_logp: Optional[torch.Tensor],
                response_ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """The KL head's fields of `tether.algo.LossInputs` for one micro-batch, as ``needs`` asks for them.

    ``st`` is the update's forward (``response_stats`` with ``gather_ids=head_ids`` when ``needs.k``);
    ``head_ids`` / ``head_ref_logp`` [B, T, k] are the micro-batch's slices of what the passes filled.
    No head: nothing. The full vocabulary: ``full_logp`` / ``full_ref_logp``. A top-k head: ``head_logp``,
    ``head_ref_logp`` and ``in_head`` (the sampled token is one of the head ids); an empty head (k = 0)
    puts every sampled token in the tail.
    """
    if needs.head is None:
        return {}
    head_logp = st.ids_logp if needs.k else st.logp.new_zeros(*st.logp.shape, 0)
    head_ref = head_ref_logp if needs.k else head_logp.detach()
    if needs.head == "all":
        return {"full_logp": head_logp, "full_ref_logp": head_ref}
    in_head = (head_ids == response_ids[..., None]).any(-1) if needs.k else torch.zeros_like(mask)
    return {"head_logp": head_logp, "head_ref_logp": head_ref, "in_head": in_head}


def vocab_ids(vocab: int, B: int, T: int, device) -> torch.Tensor:
    """Every vocabulary id at every position [B, T, V] (an expanded view, no copy)."""
    return torch.arange(vocab, device=device).expand(B, T, vocab)


class Passes:
    """Runs the sampler and anchor passes that the loss needs, filling a `StepBatch` in place.

    Args:
        model: the policy (the anchor's weights are swapped in by ``anchor.applied``).
        anchor: a ``tether.anchor.Anchor`` or None.
        needs: ``tether.algo.loss_needs(cfg.algo, vocab)``.
        on_policy: one optimizer step per rollout, so that pi_old = pi exactly for a batch that is not
            ``stale`` (a stale batch's pi_old is always recomputed).
        temperature, chunk_size, share_prompt, packed: as the training forward uses them.
        micro_batch_size, micro_batch_tokens: the update's micro-batch (rows, or a token budget when
            ``micro_batch_tokens`` > 0); a no-grad forward takes twice as much (it keeps no activations).
    """

    def __init__(self, model, anchor, needs: LossNeeds, on_policy: bool, *, temperature: float,
                 micro_batch_size: int, chunk_size: int, share_prompt: bool, micro_batch_tokens: int = 0,
                 packed: bool = False):
        self.model, self.anchor, self.needs, self.on_policy = model, anchor, needs, on_policy
        self.temperature, self.size, self.chunk, self.share = temperature, micro_batch_size, chunk_size, share_prompt
        self.tokens, self.packed = micro_batch_tokens, packed
        self.packing_checked = False
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.iterative = anchor is not None and not anchor.needs_forward  # the anchor is the sampler

    def sampler(self, b: StepBatch) -> None:
        """pi_old's log-probs (and its top-k ids for a sampler head), unless exactly on-policy and not needed.

        The trainer calls it first at every step: under ``packed``, the first call checks on the batch that
        the model keeps packed sequences apart (`check_packing`)."""
        if self.packed and not self.packing_checked:
            with dist.gathered(self.model):
                check_packing(self.model, b.rb, temperature=self.temperature, chunk_size=self.chunk)
            self.packing_checked = True
        n, device = self.needs, b.rb.response_ids.device
        if n.head == "all":
            b.head_ids = vocab_ids(self.vocab, *b.rb.response_ids.shape, device)
        # Rollout correction needs pi_old itself (the trainer's forward at the rollout weights),
        # to re-weight samples the engine drew from its own pi_vllm, even when on-policy.
        off_policy = (self.needs.old_logp and (b.stale or not self.on_policy)) or n.sampler_logp
        need_ids = n.head == "sampler" or (n.head == "anchor" and self.iterative)
        if not (off_policy or need_ids or (self.iterative and n.ref_logp)):
            return  # pi_old = pi: compute_loss uses sg(logp)
        gather = b.head_ids if n.head == "all" and self.iterative else None
        logp, ids, head = self._pass(b, topk=n.k if need_ids else 0, gather=gather)
        b.old_logp = logp if off_policy else None
        if need_ids:
            b.head_ids = ids
        if self.iterative:  # the anchor is the sampler: its log-probs are the anchor's
            b.ref_logp, b.head_ref_logp = logp, head

    def anchor_pass(self, b: StepBatch) -> bool:
        """pi_a's log-probs at the sampled tokens and at the head ids; returns whether it ran."""
        n = self.needs
        if not n.ref_logp or self.anchor is None or self.iterative:
            return False
        topk = n.k if n.head == "anchor" else 0
        gather = b.head_ids if n.head in ("sampler", "all") and n.k else None
        logp, ids, head = self._pass(b, topk=topk, gather=gather, with_anchor=True)
        b.ref_logp = logp
        if n.head == "anchor":
            b.head_ids = ids
        b.head_ref_logp = head
        return True

    def _pass(self, b: StepBatch, *, topk: int = 0, gather: Optional[torch.Tensor] = None,
              with_anchor: bool = False):
        """``response_stats`` over the batch in length-sorted micro-batches, without gradients.

        Returns (logp [B, T], topk_ids [B, T, k] | None, head_logp [B, T, k] | None).
        """
        rb = b.rb
        B, T = rb.response_ids.shape
        dev = rb.response_ids.device
        logp = torch.zeros(B, T, device=dev)
        ids = torch.zeros(B, T, topk, dtype=torch.long, device=dev) if topk else None
        kdim = topk or (gather.shape[-1] if gather is not None else 0)
        head = torch.zeros(B, T, kdim, device=dev) if kdim else None
        ctx = self.anchor.applied(self.model) if with_anchor else contextlib.nullcontext()
        with torch.no_grad(), ctx, dist.gathered(self.model):  # ranks may run different numbers of forwards
            for idx in micro_batches(rb, list(range(B)), 2 * self.size, self.share, 2 * self.tokens, self.packed):
                mb = rb.select(idx)
                t = mb.response_ids.shape[1]
                g = gather[idx, :t] if gather is not None else None
                st = response_stats(self.model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
                                    temperature=self.temperature, topk=topk, gather_ids=g, entropy=False,
                                    chunk_size=self.chunk, share_prompt=self.share, packed=self.packed)
                logp[idx, :t] = st.logp.float()
                if topk:
                    ids[idx, :t] = st.topk_ids
                    head[idx, :t] = st.topk_logp.float()
                elif g is not None:
                    head[idx, :t] = st.ids_logp.float()
        return logp, ids, head


def check_packing(model, rb: RolloutBatch, *, temperature: float, chunk_size: int, rows: int = 4) -> float:
    """Raise ConfigError unless packed rows give the padded rows' response log-probs on this model
    (``train.packing``), on the first ``rows`` rows of ``rb`` (`tether.logprobs.packing_difference`)."""
    mb = rb.select(list(range(min(rows, len(rb)))))
    return packing_difference(
        model, lambda packed: response_stats(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
                                             temperature=temperature, entropy=False, chunk_size=chunk_size,
                                             share_prompt=False, packed=packed).logp,
        mb.response_mask.bool(), key="train.packing", fix="set train.packing=false")


@torch.no_grad()
def exact_kl_sample(model, anchor, rb: RolloutBatch, n: int, *, temperature: float, chunk_size: int,
                    share_prompt: bool) -> Optional[float]:
    """Exact token-mean KL(pi || pi_a) over the full vocabulary on the first ``n`` responses.

    A diagnostic logged beside the estimator's value (``exact_kl_sample``): it forwards both
    models with every vocabulary id gathered, so keep ``n`` small.
    """
    n = min(n, len(rb))
    if n == 0 or anchor is None:
        return None
    mb = rb.select(list(range(n)))
    every_id = vocab_ids(model.get_output_embeddings().weight.shape[0], *mb.response_ids.shape,
                         mb.response_ids.device)

    def logprobs():  # [n, T, V] full log-probs at response positions, through the same engine
        return response_stats(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
                              temperature=temperature, gather_ids=every_id, entropy=False,
                              chunk_size=chunk_size, share_prompt=share_prompt).ids_logp.float()

    with dist.gathered(model):
        lp = logprobs()
    with anchor.applied(model), dist.gathered(model):
        la = logprobs()
    kl = (lp.exp() * (lp - la)).sum(-1)  # [n, T]
    m = mb.response_mask
    return float(torch.where(m, kl, torch.zeros_like(kl)).sum() / m.sum().clamp_min(1))


def idle_backward(model, rb: RolloutBatch, *, temperature: float, chunk_size: int) -> None:
    """A zero-loss forward/backward on the first row of ``rb``: keeps a rank with fewer micro-batches in
    step with the others' gradient reduce-scatters (FSDP); adds exactly zero to the gradients."""
    mb = rb.select([0])
    st = response_stats(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
                        temperature=temperature, entropy=False, chunk_size=chunk_size, share_prompt=False)
    (torch.nan_to_num(st.logp).sum() * 0.0).backward()
