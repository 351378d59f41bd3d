"""Per-token log-probabilities of a Hugging Face causal LM at its response tokens.

:func:`response_stats` runs a Hugging Face causal LM (optionally wrapped by peft) on
``[prompt | response]``, takes the final (post-norm) hidden states without the
model's full logits (running each distinct prompt once when rows share it),
checks that the lm_head reproduces the model's own logits, and calls the chunked
engine on the response positions only.

The engine -- :func:`token_stats` and :class:`TokenStats`, which never hold more
than one [chunk, V] block of logits, with the memory argument and the gradient
equations in its docstring -- lives in :mod:`tether.logprobs_chunked`; this
module re-exports it, so ``from tether.logprobs import ...`` gives every name.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from .errors import ConfigError
from .logprobs_chunked import TokenStats, compute_dtype, token_stats, token_stats_capped

__all__ = ["TokenStats", "token_stats", "response_stats", "sequence_logp"]


def _selective_hidden_states_supported() -> bool:
    """Whether transformers can return only selected hidden states (``output_hidden_states=[-1]``)."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return False
    return hasattr(output_capturing, "selected_hidden_states")


_HIDDEN_REQUEST: Any = [-1] if _selective_hidden_states_supported() else True


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword a model's ``forward`` / ``generate`` take a KV cache by: ``cache`` from transformers
    5.24 on (which deprecates ``past_key_values`` with a FutureWarning), ``past_key_values`` before.
    Read once per model class (it is asked at every generate segment and shared-prompt forward)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return _cache_kwarg_of(type(base))


@functools.lru_cache(maxsize=None)
def _cache_kwarg_of(cls: type) -> str:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _final_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final post-norm hidden states [B, S, H] and the model's own logits [B, V] at position S-1.

    ``logits_to_keep=1`` makes the model apply its head to the last position
    only; recent transformers also keep just the last hidden state when asked
    for ``output_hidden_states=[-1]`` (older ones return all, which is also
    correct, and the fallback below handles a model that returns none).
    """
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=1,
        use_cache=False,
        return_dict=True,
    )
    out = model(output_hidden_states=_HIDDEN_REQUEST, **kwargs)
    hs = getattr(out, "hidden_states", None)
    if hs is None or hs[-1] is None:
        out = model(output_hidden_states=True, **kwargs)
        hs = out.hidden_states
    hidden = hs[-1]  # [B, S, H]
    return hidden, out.logits[:, -1]


def _gradient_checkpointing_on(model: torch.nn.Module) -> bool:
    """Whether the (peft-unwrapped) model recomputes activations in training (it then refuses a KV cache)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not base.training:
        return False
    # transformers >= 5 names it is_activation_checkpointing; reading the old is_gradient_checkpointing
    # there raises a FutureWarning. Before 5 both properties scan the modules' flags, as the fallback does.
    if isinstance(getattr(type(base), "is_activation_checkpointing", None), property):
        return bool(base.is_activation_checkpointing)
    return any(getattr(m, "gradient_checkpointing", False) is True for m in base.modules())


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with identical (ids, mask) prompts: ``(first [U], inverse [B])`` with ``rows = first[inverse]``."""
    key = torch.cat([prompt_ids, prompt_mask.long()], dim=1)  # [B, 2P]
    _, inverse = torch.unique(key, dim=0, return_inverse=True)  # [B] in 0..U-1
    rows = torch.arange(key.shape[0], device=key.device)
    first = torch.full((int(inverse.max()) + 1,), key.shape[0], dtype=torch.long, device=key.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")  # [U] first row of each prompt
    return first, inverse


def _shared_prompt_hidden(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    first: torch.Tensor,
    inverse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Hidden states predicting each response token, running every distinct prompt once.

    Pass 1 runs the U distinct prompts [U, P] with a KV cache; its last position predicts
    response token 0. The cache is expanded to the B rows (``index_select``, differentiable,
    so each row's gradient flows back into its prompt's shared activations and the sums
    equal the unshared gradient) and pass 2 runs the responses [B, T] against it. Compute
    and activation memory on prompts drop from B x P tokens to U x P.

    Returns ``(h [B, T, H], last hidden [B, H], model logits at it [B, V])``, or None when the
    model gave no cache (the caller then runs the plain path).
    """
    n_prompt, n_resp = prompt_ids.shape[1], response_ids.shape[1]
    p_mask = prompt_mask[first].long()  # [U, P]
    out = model(
        input_ids=prompt_ids[first],
        attention_mask=p_mask,
        position_ids=(p_mask.cumsum(-1) - 1).clamp(min=0),
        logits_to_keep=1,
        use_cache=True,
        output_hidden_states=_HIDDEN_REQUEST,
        return_dict=True,
    )
    cache = getattr(out, cache_kwarg(model), None)  # the output names the cache as forward takes it
    hs = getattr(out, "hidden_states", None)
    if cache is None or not hasattr(cache, "reorder_cache") or hs is None or hs[-1] is None:
        return None
    h_first = hs[-1][:, -1]  # [U, H]: the last prompt position (left padding: always real)
    del out, hs
    cache.reorder_cache(inverse)  # [U, ...] -> [B, ...]
    full_mask = torch.cat([prompt_mask, response_mask], dim=1).long()  # [B, P+T]
    out = model(
        input_ids=response_ids,
        attention_mask=full_mask,
        position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)[:, n_prompt:],
        **{cache_kwarg(model): cache},
        logits_to_keep=1,
        use_cache=True,
        output_hidden_states=_HIDDEN_REQUEST,
        return_dict=True,
    )
    hs = getattr(out, "hidden_states", None)
    if hs is None or hs[-1] is None:
        return None
    h_resp = hs[-1]  # [B, T, H]: position t predicts response token t+1
    h = torch.cat([h_first[inverse, None], h_resp[:, : n_resp - 1]], dim=1)  # [B, T, H]
    return h, h_resp[:, -1], out.logits[:, -1]


def _text_config(model: torch.nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    return cfg


def _logit_softcap(model: torch.nn.Module) -> float | None:
    """``final_logit_softcapping`` of the model config (Gemma-2), or None."""
    cap = getattr(_text_config(model), "final_logit_softcapping", None)
    return float(cap) if cap else None


def _head_params(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Effective lm_head ``(weight [V, H], bias [V] | None)``, including a plain LoRA on the head."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head)")
    if hasattr(head, "base_layer"):  # a peft tuner layer wraps the head
        base = head.get_base_layer()
        weight, bias = base.weight, getattr(base, "bias", None)
        if getattr(head, "merged", False) or getattr(head, "disable_adapters", False):
            return weight, bias
        if not (hasattr(head, "lora_A") and hasattr(head, "get_delta_weight")):
            raise NotImplementedError(f"unsupported adapter on the lm_head: {type(head).__name__}")
        for name in head.active_adapters:
            if name not in head.lora_A:
                continue
            if getattr(head, "use_dora", {}).get(name, False) or getattr(head, "lora_bias", {}).get(name, False):
                raise NotImplementedError("DoRA / lora_bias on the lm_head is not supported")
            drop = head.lora_dropout[name]
            if head.training and getattr(drop, "p", 0.0) > 0:
                raise NotImplementedError("LoRA dropout on the lm_head is not supported in training mode")
            weight = weight + head.get_delta_weight(name)  # [V, H], differentiable
        return weight, bias
    return head.weight, getattr(head, "bias", None)


def _check_head(
    last_hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float | None,
    model_logits: torch.Tensor,
) -> None:
    """Raise if our head (matmul, bias, soft-cap) does not reproduce the model's logits.

    Costs one [B, V] product. It catches models whose forward changes the
    logits in ways this module does not know about (logit scales, a pre-norm
    ``hidden_states[-1]``, adapters on the head).
    """
    with torch.no_grad():
        ours = F.linear(last_hidden.detach().to(weight.dtype), weight.detach(), None if bias is None else bias.detach())
        ours = ours.to(compute_dtype(weight.dtype))  # [B, V]
        if softcap is not None:
            ours = softcap * torch.tanh(ours / softcap)
        theirs = model_logits.detach().to(ours.dtype)  # [B, V]
        finite = torch.isfinite(theirs)  # padded rows may be NaN in some attention kernels
        if not torch.equal(finite, torch.isfinite(ours)):
            err = float("inf")
        elif not finite.any():
            err = 0.0
        else:
            ours, theirs = ours[finite], theirs[finite]
            scale = theirs.abs().max().clamp_min(1.0)
            err = ((ours - theirs).abs().max() / scale).item()
    tol = {torch.float64: 1e-7, torch.float32: 1e-2}.get(weight.dtype, 5e-2)
    if not err <= tol:
        raise ValueError(
            "the lm_head applied to hidden_states[-1] does not reproduce the model's logits "
            f"(relative error {err:.3g}); this model transforms its logits in a way the chunked "
            "engine does not support"
        )


def _unpack(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scatter packed rows [N, ...] into zeros of shape [B, T, ...] at ``mask`` (differentiable)."""
    out = values.new_zeros(mask.shape + values.shape[1:])  # [B, T, ...]
    return out.index_put((mask,), values)


def _check_response_shapes(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    gather_ids: torch.Tensor | None,
) -> None:
    """Raise ValueError unless the ids, masks and ``gather_ids`` have the shapes :func:`response_stats` takes."""
    if prompt_ids.dim() != 2 or response_ids.dim() != 2 or prompt_ids.shape[0] != response_ids.shape[0]:
        raise ValueError("prompt_ids [B, P] and response_ids [B, T] must share B")
    if prompt_mask.shape != prompt_ids.shape or response_mask.shape != response_ids.shape:
        raise ValueError("masks must have the shapes of their ids")
    if prompt_ids.shape[1] < 1:
        raise ValueError("need at least one prompt position to predict the first response token")
    if gather_ids is not None and (gather_ids.dim() != 3 or gather_ids.shape[:2] != response_ids.shape):
        raise ValueError(f"gather_ids must have shape [B, T, k], got {tuple(gather_ids.shape)}")


def _response_hidden(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    share_prompt: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h [B, T, H] predicting each response token, last hidden [B, H], model logits at it [B, V])``.

    Runs each distinct prompt once (:func:`_shared_prompt_hidden`) when ``share_prompt`` and
    rows repeat a prompt, unless gradient checkpointing is on in training; otherwise, or when
    the model gave no cache, one pass over ``[prompt | response]`` (:func:`_final_hidden`).
    """
    n_prompt, n_resp = prompt_ids.shape[1], response_ids.shape[1]
    shared = None
    if share_prompt and not _gradient_checkpointing_on(model):
        first, inverse = prompt_groups(prompt_ids, prompt_mask)
        if len(first) < prompt_ids.shape[0]:
            shared = _shared_prompt_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, first, inverse)
    if shared is not None:
        return shared  # [B, T, H], [B, H], [B, V]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # [B, S]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()  # [B, S]
    # Left padding: the first real token gets position 0, as in `generate`.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, S]
    hidden, last_logits = _final_hidden(model, input_ids, attention_mask, position_ids)  # [B, S, H], [B, V]
    h_resp = hidden[:, n_prompt - 1 : n_prompt + n_resp - 1]  # [B, T, H]; position P-1+t predicts token t
    return h_resp, hidden[:, -1], last_logits


def _packed_response_hidden(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(h [N, H] predicting each real response token in row-major order, last hidden [1, H], logits [1, V])``
    from one packed row: every row's real prompt then real response tokens one after another, no padding,
    positions restarting at 0 for each, no attention mask (transformers keeps each sequence's attention
    to itself from the positions, as `sequence_logp`'s packed rows). The padded forward gives the same
    values: it masks the padding out and numbers the real tokens from 0 (``(mask.cumsum - 1)``).
    Needs a prompt token in every row, and contiguous masks (left-padded prompts, right-padded responses).
    """
    pm, rm = prompt_mask.bool(), response_mask.bool()
    plen, rlen = pm.sum(-1), rm.sum(-1)  # [B]
    if bool((plen < 1).any()):
        raise ValueError("packed: every row needs a prompt token to predict its first response token")
    keep = torch.cat([pm, rm], dim=1)  # [B, P+T]
    ids = torch.cat([prompt_ids, response_ids], dim=1)[keep][None]  # [1, L]: row by row
    lens = plen + rlen  # [B]
    starts = lens.cumsum(0) - lens  # [B] where each row's sequence starts in the packed row
    dev = ids.device
    position_ids = (torch.arange(ids.shape[1], device=dev) - starts.repeat_interleave(lens))[None]  # [1, L]
    hidden, last_logits = _final_hidden(model, ids, None, position_ids)  # [1, L, H], [1, V]
    rows = torch.arange(len(rlen), device=dev).repeat_interleave(rlen)  # [N] the row of each response token
    k = torch.arange(len(rows), device=dev) - (rlen.cumsum(0) - rlen)[rows]  # [N] its index in its response
    at = starts[rows] + plen[rows] - 1 + k  # [N] the packed position predicting it (the token before)
    return hidden[0, at], hidden[:, -1], last_logits


def _unpack_stats(st: TokenStats, mask: torch.Tensor) -> TokenStats:
    """Packed statistics [N, ...] laid out as [B, T, ...] at ``mask`` (0 and id 0 elsewhere)."""

    def unpack(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else _unpack(x, mask)

    return TokenStats(
        logp=_unpack(st.logp, mask),  # [B, T]
        entropy=unpack(st.entropy),  # [B, T]
        topk_ids=unpack(st.topk_ids),  # [B, T, k]
        topk_logp=unpack(st.topk_logp),  # [B, T, k]
        ids_logp=unpack(st.ids_logp),  # [B, T, k]
    )


def response_stats(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    topk: int = 0,
    gather_ids: torch.Tensor | None = None,
    entropy: bool = True,
    chunk_size: int = 1024,
    share_prompt: bool = True,
    packed: bool = False,
) -> TokenStats:
    """Statistics of a causal LM's next-token distribution at each response token.

    Math: with ``x = [prompt | response]`` and ``z_t = lm_head(h_{P-1+t}) / temperature``
    (soft-capped first if the config sets ``final_logit_softcapping``),
    returns ``log softmax(z_t)[response_t]``, its entropy, top-k and values at
    ``gather_ids``, for every response position t with ``response_mask``.

    Meaning: log pi(y_t | x, y_<t) of the policy (or old policy / anchor under
    ``torch.no_grad()``) for a batch of rollouts; pass the rollout temperature
    to get the sampler's log-probs. Logits are formed only at response
    positions, ``chunk_size`` tokens at a time, so no [B, S, V] tensor exists.

    Args:
        model: a Hugging Face causal LM (optionally wrapped by peft) with
            ``get_output_embeddings``.
        prompt_ids: [B, P] long, left-padded; P >= 1.
        prompt_mask: [B, P] bool, True on real prompt tokens.
        response_ids: [B, T] long, right-padded.
        response_mask: [B, T] bool, True on real response tokens.
        temperature, topk, entropy, chunk_size: as in :func:`token_stats`.
        gather_ids: optional [B, T, k] long ids whose log-probs are returned.
        share_prompt: run each distinct prompt once when rows repeat it (the G samples of a
            group), with its KV cache expanded to the rows (see `_shared_prompt_hidden`). Same
            values and gradients up to float rounding; off, or with gradient checkpointing in
            training (which refuses a cache), every row recomputes its prompt.
        packed: forward the rows as one packed row without padding (`_packed_response_hidden`;
            ``share_prompt`` is then not used). Same values and gradients up to float rounding where
            the model's attention keeps packed sequences apart (transformers' eager / SDPA / flash
            masks do, from the restarting positions; `tether.passes.check_packing` verifies it).

    Returns:
        :class:`TokenStats` laid out as [B, T] (and [B, T, k]); positions where
        ``response_mask`` is False hold 0 (and id 0).
    """
    _check_response_shapes(prompt_ids, prompt_mask, response_ids, response_mask, gather_ids)
    mask = response_mask.bool()  # [B, T]
    if packed:
        h, last_hidden, last_logits = _packed_response_hidden(
            model, prompt_ids, prompt_mask, response_ids, response_mask
        )  # [N, H], [1, H], [1, V]
    else:
        h_resp, last_hidden, last_logits = _response_hidden(
            model, prompt_ids, prompt_mask, response_ids, response_mask, share_prompt
        )  # [B, T, H], [B, H], [B, V]
        h = h_resp[mask]  # [N, H]
        del h_resp
    weight, bias = _head_params(model)
    softcap = _logit_softcap(model)
    _check_head(last_hidden, weight, bias, softcap, last_logits)
    del last_logits

    targets = response_ids[mask]  # [N]
    ids = gather_ids[mask] if gather_ids is not None else None  # [N, k]

    st = token_stats_capped(h, weight, targets, bias=bias, temperature=temperature, softcap=softcap, topk=topk,
                            gather_ids=ids, entropy=entropy, chunk_size=chunk_size)
    return _unpack_stats(st, mask)


def sequence_logp(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    target_mask: torch.Tensor,
    *,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """log pi(x_t | x_<t) at every position t where ``target_mask`` is True, in row-major order [N].

    Meaning: the per-token log-likelihood of a supervised target (``tether sft``), from one pass
    over whole sequences: position t-1's final hidden state predicts token t, logits are formed
    only at the N target positions, ``chunk_size`` at a time (no [B, S, V] tensor).

    Args:
        input_ids: [B, S] long; right-padded rows, or packed rows (several sequences one after
            another, with ``attention_mask=None`` and ``position_ids`` restarting at 0 for each:
            transformers then keeps each sequence's attention to itself).
        attention_mask: [B, S] bool / long (False on padding), or None for packed rows.
        position_ids: [B, S] long.
        target_mask: [B, S] bool; must be False at position 0 (nothing predicts it) and at the
            first token of each packed sequence.
    """
    if target_mask.shape != input_ids.shape or bool(target_mask[:, 0].any()):
        raise ValueError("target_mask must have the shape of input_ids and be False at position 0")
    mask = None if attention_mask is None else attention_mask.long()
    hidden, last_logits = _final_hidden(model, input_ids, mask, position_ids)  # [B, S, H], [B, V]
    weight, bias = _head_params(model)
    softcap = _logit_softcap(model)
    _check_head(hidden[:, -1], weight, bias, softcap, last_logits)
    at = target_mask[:, 1:].bool()  # [B, S-1]: position t (of hidden[:, :-1]) predicts token t+1
    st = token_stats_capped(hidden[:, :-1][at], weight, input_ids[:, 1:][at], bias=bias, temperature=1.0,
                            softcap=softcap, topk=0, gather_ids=None, entropy=False, chunk_size=chunk_size)
    return st.logp  # [N]


def packing_difference(model, logp, mask=None, *, key: str, fix: str) -> float:
    """Raise ConfigError unless the packed forward gives the padded forward's log-probs on this model; returns the
    largest difference.

    ``logp(packed)`` runs the same rows packed (``True``: one row, positions restarting at 0 for each sequence) or
    padded (``False``); it is called in eval mode without gradients and the results are compared where ``mask``
    holds (everywhere when None). An attention implementation that ignores the restarting position ids lets packed
    sequences see each other, which this catches. ``key`` names the option at fault in the error and ``fix`` says
    what to set instead. Tolerance: 1e-3 in float32 / float64, 1e-1 in half precision.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed, padded = logp(True).double(), logp(False).double()
    finally:
        model.train(was_training)
    d = (packed - padded).abs()
    if mask is not None:
        d = d[mask]
    diff = float(d.max()) if d.numel() else 0.0
    tol = 1e-3 if next(model.parameters()).dtype in (torch.float32, torch.float64) else 1e-1
    if not diff <= tol:
        raise ConfigError(f"{key}: this model's attention does not keep packed sequences apart (log-probs differ "
                          f"from the padded forward by up to {diff:.3g}; its attention implementation ignores the "
                          f"restarting position ids); {fix}")
    return diff
