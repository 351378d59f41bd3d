"""The anchor pi_a: the policy the KL term ties the trained policy to (EMA-PG, RPG, GRPO).

An anchor is a set of tensors, one per *tracked* parameter of the policy module: the
parameters with ``requires_grad`` (all of them in full fine-tuning, only the adapters with
LoRA). The anchor model is the policy module with those tensors swapped in (``applied``):
no second model object is kept, and with LoRA the anchor costs only the adapters.

The kinds and their update rules (fixed, ema, iterative, reset, kl_reset) are the registry
`tether.algo.anchors.ANCHOR_KINDS`, with the table of their equations. A trainer step is one
rollout and its update; with ``train.epochs`` x ``train.mini_batches`` > 1 it holds several
optimizer steps, and the anchor still moves at most once per trainer step (EMA-PG counts
trainer steps).

The EMA accumulates in promote(fp32, policy dtype): fp32 for a bf16/fp16 policy (a bf16
accumulator loses every update smaller than 2^-8 of a weight), fp64 for an fp64 one, with
one fused in-place ``torch._foreach_lerp_`` when the dtypes match. When the policy's dtype
differs from the master's a compute-dtype copy is kept for the forward pass and refreshed
after each update and each ``load_state_dict``.

Under FSDP2 (``tether.distributed``) the policy's parameters are sharded: the anchor keeps the
local shards only (the EMA master per rank, in the same precision), ``applied`` copies them
into the policy's local shards in place (swapping ``p.data`` of a sharded parameter does
nothing) and reshards every FSDP module on entry and exit, so no module computes with weights
gathered before the copy. ``tensors`` and ``load_state_dict`` speak whole tensors (gathered /
re-sharded), so checkpoints do not depend on the number of ranks.

``anchor.dtype=bfloat16`` (the fixed anchor of an fp32 policy): the master is stored in bf16, half
the bytes of the policy's weights, and no forward copy is kept between passes: ``applied`` upcasts
the master to the policy's dtype on entry and drops the copy on exit, so the fp32 copy exists only
during the anchor's own forward passes, never during the update (where the step's memory peaks).
The anchor is then the bf16-rounded initial policy; tests/test_memory.py bounds what that changes
in the KL and its gradient.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from . import distributed as dist
from .algo.anchors import ANCHOR_KINDS

# ``cfg`` below is the ``algo.anchor`` section (``tether.config.anchor``: a section per kind, each with the keys
# its rule reads: ema eta and every, reset every, kl_reset kappa and kl_smoothing, fixed dtype)
AnchorSection = Any


def tracked_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters an anchor follows: those that train (all, or only LoRA adapters)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters; an anchor would equal the policy")
    return params


class Anchor:
    """An anchor over a module's tracked parameters. ``needs_forward`` is False for the iterative anchor."""

    def __init__(self, cfg: AnchorSection, model: Optional[nn.Module] = None):
        self.needs_forward = ANCHOR_KINDS.meta(cfg.kind)["needs_forward"]  # an unknown kind: the did-you-mean error
        self.cfg = cfg
        self.kind = cfg.kind
        self.num_updates = 0  # EMA updates or resets applied so far
        self.kl_ma = 0.0  # kl_reset: moving average of the token KL
        self.names: list[str] = []
        self.master: list[torch.Tensor] = []  # anchor values (ema: promote(fp32, policy dtype))
        self._compute: list[torch.Tensor] = []  # forward copies in the policy's dtype (empty when = master)
        self._layout: list[torch.Tensor] = []  # the tracked parameters (sharded: their layout for gather/scatter)
        self.sharded = False
        self.stored_dtype = None if getattr(cfg, "dtype", "policy") == "policy" else getattr(torch, cfg.dtype)
        if self.needs_forward:
            if model is None:
                raise ValueError(f"anchor {cfg.kind!r} needs the policy model to copy")
            params = tracked_parameters(model)
            self.names = [n for n, _ in params]
            self._layout = [p for _, p in params]
            self.sharded = any(dist.local(p) is not p for p in self._layout)
            ema = cfg.kind == "ema"  # accumulates in promote(fp32, dtype): never less precise than the policy
            local = [dist.local(p.detach()) for _, p in params]
            if self.stored_dtype is not None and any(p.dtype.itemsize <= self.stored_dtype.itemsize for p in local):
                raise ValueError(f"algo.anchor.dtype={cfg.dtype} stores the anchor of an fp32 (or fp64) policy in "
                                 f"fewer bytes; this policy is {local[0].dtype}, so it would change nothing")
            self.master = [p.to(dtype=self.stored_dtype or (torch.promote_types(torch.float32, p.dtype) if ema
                                                            else p.dtype), copy=True) for p in local]
            self._sync_compute(local)

    # ------------------------------------------------------------ updates

    def _params(self, model: nn.Module) -> list[nn.Parameter]:
        dist.reshard(model)  # a gathered FSDP module lists its unsharded (temporary) tensors, not the shards
        named = dict(model.named_parameters())
        try:
            return [named[n] for n in self.names]
        except KeyError as e:
            raise ValueError(f"anchor tracks parameter {e.args[0]!r}, which the model does not have") from None

    def _sync_compute(self, ps: Optional[list[torch.Tensor]] = None) -> None:
        """Refresh the forward copies when the policy's dtype differs from the anchor's.

        ``ps`` (the policy's tracked parameters) sets the forward dtype; without it the existing
        copies, made in the policy's dtype at construction, are refreshed in place.
        """
        if self.stored_dtype is not None or (ps is not None and all(m.dtype == p.dtype
                                                                    for m, p in zip(self.master, ps))):
            self._compute = []  # a bf16-stored anchor is upcast in `applied` only
            return
        with torch.no_grad():
            if self._compute and (ps is None or all(c.dtype == p.dtype for c, p in zip(self._compute, ps))):
                for c, m in zip(self._compute, self.master):
                    c.copy_(m)
            elif ps is not None:
                self._compute = [m.to(p.dtype) for m, p in zip(self.master, ps)]

    @torch.no_grad()
    def update(self, model: nn.Module, step: int, token_kl: Optional[float] = None) -> bool:
        """Apply the anchor rule after trainer step ``step`` (1-based; not optimizer steps).
        Returns True if the anchor moved."""
        if not ANCHOR_KINDS.meta(self.kind)["moves"]:
            return False
        params = [dist.local(p) for p in self._params(model)]
        if not ANCHOR_KINDS[self.kind](self, params, step, token_kl):
            return False
        self._sync_compute(params)
        self.num_updates += 1
        return True

    # ------------------------------------------------------------ using the anchor as a model

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[nn.Module]:
        """Within the block, ``model`` computes pi_a: the anchor tensors are swapped in (no copy)."""
        if not self.needs_forward:
            raise ValueError("the iterative anchor is the sampler itself; use the sampler's log-probs")
        params = self._params(model)
        values = self._compute or self.master
        if self.stored_dtype is not None and not self.sharded:  # upcast for this block only (sharded: copy_ casts)
            values = [m.to(dist.local(p).dtype) for m, p in zip(self.master, params)]
        if self.sharded:
            with self._copied_in(model, params, values):
                yield model
            return
        saved = [p.data for p in params]
        try:
            for p, v in zip(params, values):
                p.data = v
            yield model
        finally:
            for p, s in zip(params, saved):
                p.data = s

    @contextlib.contextmanager
    def _copied_in(self, model: nn.Module, params: list, values: list) -> Iterator[None]:
        """Sharded policy: the anchor's shards copied into the local shards in place (then restored)."""
        shards = [dist.local(p) for p in params]
        with torch.no_grad():
            saved = [s.clone() for s in shards]
            dist.reshard(model)
            for s, v in zip(shards, values):
                s.copy_(v)
        try:
            yield
        finally:
            with torch.no_grad():
                for s, v in zip(shards, saved):
                    s.copy_(v)
                dist.reshard(model)

    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> anchor value (ema: promote(fp32, policy dtype)), for checkpoints and exporting the anchor as a model.

        Whole tensors: under FSDP the shards are all-gathered (every rank must call).
        """
        return dict(self.iter_tensors())

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole anchor tensor), gathered one at a time under FSDP (every rank must iterate)."""
        for n, m, p in zip(self.names, self.master, self._layout or [None] * len(self.names)):
            yield n, dist.full_like(m, p) if self.sharded else m

    # ------------------------------------------------------------ checkpoints

    def load_state_dict(self, state: dict, model: Optional[nn.Module] = None) -> None:
        """Restore from ``{"kind", "num_updates", "kl_ma", "tensors"}`` (as ``tether.rundir.checkpoint`` saves
        them: the counters and ``tensors()``); ``model`` (the policy) sets the forward dtype, else the
        copies made at construction are refreshed (they are never left stale)."""
        if state["kind"] != self.kind:
            raise ValueError(f"checkpoint holds a {state['kind']!r} anchor, the config asks for {self.kind!r}")
        self.num_updates = int(state["num_updates"])
        self.kl_ma = float(state["kl_ma"])
        tensors = state["tensors"]
        if set(tensors) != set(self.names):
            missing = sorted(set(self.names) - set(tensors))[:3]
            raise ValueError("checkpoint anchor does not match the model's trainable parameters "
                             f"(missing e.g. {missing})")
        with torch.no_grad():
            for m, n, p in zip(self.master, self.names, self._layout):
                m.copy_(dist.shard_like(tensors[n], p) if self.sharded else tensors[n])
        self._sync_compute(None if model is None else [dist.local(p) for p in self._params(model)])


def make_anchor(cfg: AnchorSection, model: nn.Module) -> Optional[Anchor]:
    """The anchor for ``cfg`` (None when there is no KL term)."""
    return None if cfg.kind == "none" else Anchor(cfg, model)
