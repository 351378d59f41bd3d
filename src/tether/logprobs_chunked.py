"""Chunked per-token log-probabilities, entropies and top-k statistics: the engine.

RL on language models needs, for every response token, a few numbers about the
model's next-token distribution: log pi(target), the entropy, the log-probs of
the model's own top-k tokens, and the log-probs at ids chosen by the caller
(e.g. the sampler's top-k). The naive path materializes ``logits = h @ W.T`` of
shape [N, V] for N tokens and a vocabulary V of 50k-150k, then ``log_softmax``,
``softmax`` for the entropy, and in the backward pass the same number of
[N, V] gradient buffers. At N = 16k tokens and V = 152k that is ~10 GB per fp32
buffer, and autograd keeps several of them alive between forward and backward.

This module never holds more than one chunk of logits. Tokens are processed in
chunks of ``chunk_size`` rows:

* forward: for each chunk, ``z = h_c @ W.T`` ([chunk, V], upcast to fp32 for
  half-precision models), then the per-token statistics are reduced out of it
  (``lse``, ``log p = z - lse`` in place, ``log p[target]``, ``-sum p log p``,
  top-k) and the chunk's buffers are overwritten by the next chunk;
* backward: a custom :class:`torch.autograd.Function` saves only the inputs
  (``hidden`` [N, H], ``weight`` [V, H]) and O(N * k) statistics. It recomputes
  each chunk's logits and applies the closed-form gradient of the statistics
  with respect to the logits (below), then multiplies back through the matmul:
  ``dh_c = dz_c @ W`` and ``dW += dz_c.T @ h_c``.

So the peak extra memory is O(chunk_size * V) in both passes -- two
[chunk_size, V] buffers in the compute dtype (three with soft-capping, plus one
in the weight dtype for bf16/fp16 weights) and one [V, H] accumulator for
``dW`` -- instead of the several [N, V] buffers of the naive path. The cost is
one extra ``h_c @ W.T`` per chunk in backward: the same trade as wrapping each
chunk in ``torch.utils.checkpoint``, but without keeping or replaying autograd
over the log-softmax (its backward would hold several [chunk, V] buffers).
Under ``torch.no_grad()`` (old-policy / anchor passes) no autograd function
is involved at all.

Gradients with respect to the logits z of one row, with p = softmax(z),
log p = z - lse and H = -sum p log p:

* d log p_i / dz       = onehot(i) - p        (targets, top-k ids, gather ids)
* d H / dz             = -p * (log p + H)

Temperature and soft-capping are applied to the logits before the softmax,
``z = cap * tanh(raw / cap) / temperature``, so ``dz/draw = (1 - tanh^2) / temperature``.

Precision: the matmul runs in the model's dtype (as in the model's own
``lm_head``); the [chunk, V] logits are upcast to float32 for bf16/fp16
weights and the soft-max statistics are computed there; float32 and float64
inputs are kept as they are. Statistics are returned in that compute dtype.

:func:`token_stats` works on final hidden states and the lm_head weight;
:func:`tether.logprobs.response_stats` runs a Hugging Face causal LM and calls
its soft-capping core ``token_stats_capped`` on the response positions. Import both
from :mod:`tether.logprobs`, which re-exports this module's public names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TokenStats", "token_stats"]


@dataclass
class TokenStats:
    """Per-token statistics of a model's next-token distribution.

    ``logp``, ``entropy``, ``topk_logp`` and ``ids_logp`` are differentiable
    when the inputs require grad; ``topk_ids`` never is. Fields that were not
    requested are ``None``. Leading dims are [N] from :func:`token_stats` and
    [B, T] from :func:`tether.logprobs.response_stats`.
    """

    logp: torch.Tensor  # [..] log pi(target)
    entropy: torch.Tensor | None  # [..] -sum_v pi(v) log pi(v)
    topk_ids: torch.Tensor | None  # [.., k] long, this model's k most likely ids
    topk_logp: torch.Tensor | None  # [.., k] log pi at topk_ids
    ids_logp: torch.Tensor | None  # [.., k] log pi at caller-given gather_ids


# --------------------------------------------------------------------------- #
# Chunk kernels (plain tensor code, no autograd graph is built in them)
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class _Opts:
    temperature: float
    softcap: float | None
    topk: int
    entropy: bool
    chunk_size: int
    compute_dtype: torch.dtype


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs, the input dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _Workspace:
    """Reusable [chunk, V] buffers, allocated once per call and sliced per chunk.

    Reusing them (all chunk ops write in place or with ``out=``) keeps the
    number of live [chunk, V] buffers at two (three with soft-capping, plus a
    half-precision matmul buffer for bf16/fp16 weights) and, on CPU, avoids
    re-faulting fresh pages for every chunk.
    """

    def __init__(self, rows: int, vocab: int, device: torch.device):
        self.rows, self.vocab, self.device = rows, vocab, device
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        key = (name, dtype)
        if key not in self._bufs:
            self._bufs[key] = torch.empty(self.rows, self.vocab, dtype=dtype, device=self.device)
        return self._bufs[key][:n]  # [n, V], contiguous


def _chunk_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    opts: _Opts,
    ws: _Workspace,
    *,
    keep_tanh: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits of one chunk in the compute dtype, written into workspace buffers.

    Returns ``(z, th)``: ``z = cap * tanh(raw / cap) / temperature`` ([n, V],
    buffer "z") and, when soft-capping with ``keep_tanh``, ``th = tanh(raw / cap)``
    ([n, V], buffer "th"), which the backward pass needs for the chain rule.
    """
    n, cd = h.shape[0], opts.compute_dtype
    z = ws.get("z", n, cd)  # [n, V]
    raw = z if weight.dtype == cd else ws.get("raw", n, weight.dtype)  # [n, V]
    if bias is None:
        torch.mm(h, weight.T, out=raw)
    else:
        torch.addmm(bias, h, weight.T, out=raw)
    if raw is not z:
        z.copy_(raw)  # upcast half-precision logits
    if opts.softcap is None:
        if opts.temperature != 1.0:
            z.div_(opts.temperature)
        return z, None
    z.div_(opts.softcap).tanh_()
    th = None
    if keep_tanh:
        th = ws.get("th", n, cd)
        th.copy_(z)
    z.mul_(opts.softcap / opts.temperature)
    return z, th


def _forward_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    gather_ids: torch.Tensor | None,
    opts: _Opts,
) -> tuple[torch.Tensor | None, ...]:
    """All statistics, one chunk of logits at a time.

    Returns ``(logp, entropy, topk_ids, topk_logp, ids_logp, lse)``; unrequested
    entries are ``None``. ``lse`` ([N]) is kept for the backward pass.
    """
    n_tok, vocab = hidden.shape[0], weight.shape[0]
    cd = opts.compute_dtype
    dev = hidden.device
    logp = torch.empty(n_tok, dtype=cd, device=dev)  # [N]
    lse = torch.empty(n_tok, dtype=cd, device=dev)  # [N]
    ent = torch.empty(n_tok, dtype=cd, device=dev) if opts.entropy else None  # [N]
    k = opts.topk
    topk_ids = torch.empty(n_tok, k, dtype=torch.long, device=dev) if k else None  # [N, k]
    topk_logp = torch.empty(n_tok, k, dtype=cd, device=dev) if k else None  # [N, k]
    ids_logp = (
        torch.empty(gather_ids.shape, dtype=cd, device=dev) if gather_ids is not None else None
    )  # [N, k']
    ws = _Workspace(min(opts.chunk_size, n_tok), vocab, dev)

    for s in range(0, n_tok, opts.chunk_size):
        e = min(s + opts.chunk_size, n_tok)
        z, _ = _chunk_logits(hidden[s:e], weight, bias, opts, ws)  # [n, V]
        # log-sum-exp with the exponentials kept: they become the softmax.
        m = z.amax(dim=-1, keepdim=True)  # [n, 1]
        p = torch.sub(z, m, out=ws.get("p", e - s, cd)).exp_()  # [n, V] exp(z - m)
        sum_p = p.sum(dim=-1, keepdim=True)  # [n, 1]
        lse_c = sum_p.log().add_(m)  # [n, 1]
        lse[s:e] = lse_c.squeeze(1)
        logq = z.sub_(lse_c)  # [n, V] log-softmax, in place
        logp[s:e] = logq.gather(1, targets[s:e, None]).squeeze(1)
        if ids_logp is not None:
            ids_logp[s:e] = logq.gather(1, gather_ids[s:e])
        if k:
            topk_logp[s:e], topk_ids[s:e] = logq.topk(k, dim=-1, sorted=True)
        if ent is not None:
            # -sum p log p from log p directly: no cancellation between lse and E[z].
            ent[s:e] = p.div_(sum_p).mul_(logq).sum(-1).neg_()
    return logp, ent, topk_ids, topk_logp, ids_logp, lse


class _ChunkedStatsFn(torch.autograd.Function):
    """Autograd wrapper: forward over chunks, backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, gather_ids, opts):  # type: ignore[override]
        logp, ent, topk_ids, topk_logp, ids_logp, lse = _forward_chunks(
            hidden, weight, bias, targets, gather_ids, opts
        )
        ctx.set_materialize_grads(False)
        ctx.opts = opts
        ctx.save_for_backward(hidden, weight, bias, targets, gather_ids, lse, ent, topk_ids)
        return logp, ent, topk_ids, topk_logp, ids_logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent, _g_topk_ids, g_topk, g_ids):  # type: ignore[override]
        hidden, weight, bias, targets, gather_ids, lse, ent, topk_ids = ctx.saved_tensors
        opts: _Opts = ctx.opts
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not (need_h or need_w or need_b):
            return None, None, None, None, None, None
        n_tok, vocab = hidden.shape[0], weight.shape[0]
        cd = opts.compute_dtype
        dev = hidden.device
        has_ent = g_ent is not None and ent is not None

        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H]
        # dW is accumulated over chunks in the compute dtype (fp32 for half weights).
        grad_w = torch.zeros(weight.shape, dtype=cd, device=dev) if need_w else None  # [V, H]
        grad_b = torch.zeros(vocab, dtype=cd, device=dev) if need_b else None  # [V]
        ws = _Workspace(min(opts.chunk_size, n_tok), vocab, dev)

        for s in range(0, n_tok, opts.chunk_size):
            e = min(s + opts.chunk_size, n_tok)
            n = e - s
            h_c = hidden[s:e]  # [n, H]
            # Every log-prob statistic contributes (onehot - p) * grad: collect the -p part.
            coef = torch.zeros(n, 1, dtype=cd, device=dev)  # [n, 1]
            if g_logp is not None:
                coef += g_logp[s:e, None]
            if g_topk is not None:
                coef += g_topk[s:e].sum(-1, keepdim=True)
            if g_ids is not None:
                coef += g_ids[s:e].sum(-1, keepdim=True)

            z, th = _chunk_logits(h_c, weight, bias, opts, ws, keep_tanh=True)  # [n, V]
            logq = z.sub_(lse[s:e, None])  # [n, V] log p, in place
            dz = torch.exp(logq, out=ws.get("p", n, cd))  # [n, V] p
            if has_ent:
                # dz = -p * (coef + g_ent * (log p + H))
                dz.mul_(logq.add_(ent[s:e, None]).mul_(g_ent[s:e, None]).add_(coef)).neg_()
            else:
                dz.mul_(coef).neg_()
            # + the onehot parts
            if g_logp is not None:
                dz.scatter_add_(1, targets[s:e, None], g_logp[s:e, None])
            if g_topk is not None:
                dz.scatter_add_(1, topk_ids[s:e], g_topk[s:e])
            if g_ids is not None:
                dz.scatter_add_(1, gather_ids[s:e], g_ids[s:e])
            # Back through soft-capping and temperature to the raw logits.
            if th is not None:
                dz.mul_(th.mul_(th).neg_().add_(1.0))
            if opts.temperature != 1.0:
                dz.div_(opts.temperature)

            if need_b:
                grad_b += dz.sum(0)
            if weight.dtype != cd:
                dz = ws.get("raw", n, weight.dtype).copy_(dz)  # [n, V] in the matmul dtype
            if need_h:
                torch.mm(dz, weight, out=grad_h[s:e])
            if need_w:
                if dz.dtype == cd:
                    grad_w.addmm_(dz.T, h_c)
                else:
                    grad_w += (dz.T @ h_c).to(cd)

        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #


def token_stats_capped(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    temperature: float,
    softcap: float | None,
    topk: int,
    gather_ids: torch.Tensor | None,
    entropy: bool,
    chunk_size: int,
) -> TokenStats:
    """:func:`token_stats` plus Gemma-2 style logit soft-capping."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    n_tok, vocab = hidden.shape[0], weight.shape[0]
    if targets.shape != (n_tok,):
        raise ValueError(f"targets must have shape [{n_tok}], got {tuple(targets.shape)}")
    if gather_ids is not None and (gather_ids.dim() != 2 or gather_ids.shape[0] != n_tok):
        raise ValueError(f"gather_ids must have shape [{n_tok}, k], got {tuple(gather_ids.shape)}")
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"bias must have shape [{vocab}], got {tuple(bias.shape)}")
    if not 0 <= topk <= vocab:
        raise ValueError(f"topk must be in [0, {vocab}], got {topk}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")

    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)
    targets = targets.long()
    gather_ids = gather_ids.long() if gather_ids is not None else None
    opts = _Opts(
        temperature=float(temperature),
        softcap=float(softcap) if softcap is not None else None,
        topk=int(topk),
        entropy=bool(entropy),
        chunk_size=int(chunk_size),
        compute_dtype=compute_dtype(weight.dtype),
    )
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    if wants_grad:
        logp, ent, topk_ids, topk_logp, ids_logp = _ChunkedStatsFn.apply(
            hidden, weight, bias, targets, gather_ids, opts
        )
    else:
        with torch.no_grad():
            logp, ent, topk_ids, topk_logp, ids_logp, _ = _forward_chunks(
                hidden, weight, bias, targets, gather_ids, opts
            )
    return TokenStats(logp=logp, entropy=ent, topk_ids=topk_ids, topk_logp=topk_logp, ids_logp=ids_logp)


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    topk: int = 0,
    gather_ids: torch.Tensor | None = None,
    entropy: bool = True,
    chunk_size: int = 1024,
) -> TokenStats:
    """Next-token statistics from final hidden states, never materializing [N, V] logits.

    Math: ``z = (hidden @ weight.T + bias) / temperature``, ``log p = log_softmax(z)``;
    returns ``log p[targets]``, ``H = -sum p log p``, ``topk(log p, k)`` and
    ``log p[gather_ids]``, computed over chunks of ``chunk_size`` rows.

    Meaning: the log-probabilities (and entropy, top-k) of the distribution the
    model samples from at ``temperature``; pass the rollout temperature to get the
    sampler's log-probs. Gradients flow to ``hidden``, ``weight`` and ``bias``
    through a recompute-in-backward autograd function, so the extra memory is
    O(chunk_size * V) with or without grad.

    Args:
        hidden: [N, H] final (post-norm) hidden states.
        weight: [V, H] output embedding (lm_head) weight.
        targets: [N] long, the token whose log-prob is wanted at each row.
        bias: optional [V] lm_head bias.
        temperature: divides the logits; must be > 0.
        topk: k > 0 also returns this model's top-k ids and their log-probs.
        gather_ids: optional [N, k] long; returns the log-probs at these ids.
        entropy: whether to compute the entropy.
        chunk_size: rows of logits materialized at a time.

    Returns:
        :class:`TokenStats` with leading dim N, values in float32 for
        half-precision weights, otherwise in the weight's dtype.
    """
    return token_stats_capped(
        hidden,
        weight,
        targets,
        bias=bias,
        temperature=temperature,
        softcap=None,
        topk=topk,
        gather_ids=gather_ids,
        entropy=entropy,
        chunk_size=chunk_size,
    )
