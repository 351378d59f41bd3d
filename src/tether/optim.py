"""The optimizer of a run (``tether train`` and ``tether sft``): AdamW, and one guarded update.

`make_adamw` builds it from a ``train`` section (``lr``, ``betas``, ``weight_decay``);
`optimizer_step` clips the gradient, steps the optimizer (at the scheduled LR, times an optional
per-step multiplier: ``train.lr_scale``) and the LR scheduler, and skips the update (weights
unchanged, gradients dropped) when the loss or the gradient norm is not finite.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import distributed as dist


def make_adamw(params: list[torch.nn.Parameter], train) -> torch.optim.AdamW:
    """AdamW over ``params`` with ``train.lr``, ``train.betas`` and ``train.weight_decay``."""
    # Not fused=True: torch's fused CPU AdamW assumes contiguous tensors and silently mis-updates
    # the column-major weights that models.column_major_linear_weights gives CPU models.
    return torch.optim.AdamW(params, lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay)


def optimizer_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, scheduler,
                   loss: torch.Tensor, grad_clip: float, lr_scale: Optional[torch.Tensor] = None) -> Optional[float]:
    """Clip the gradient norm to ``grad_clip`` (0 = off), then step the optimizer and ``scheduler``.

    ``lr_scale`` (a 0-d tensor, the same on every rank; None = 1): this step's LR is the scheduled one
    times it. It is set on the optimizer's groups for this ``optimizer.step()`` only: ``scheduler.step()``
    then lays the next LR from its base LR and multiplier as always, so the multiplier never compounds,
    and never reaches the scheduler's or the optimizer's checkpointed state (a skipped update never sets it).

    Returns the gradient norm before clipping, or None when the loss (summed over ranks) or the
    norm is not finite on any rank: the update is then skipped on every rank, the weights stay as
    they were and the gradients are dropped. One device-to-host read per call.
    """
    loss = dist.all_reduce(loss)
    gn = dist.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    read = [loss.float(), gn.float()] + ([] if lr_scale is None else [lr_scale.to(gn.device)])
    loss_v, gn_v, *scale = torch.stack([x.double() for x in read]).tolist()
    if not (math.isfinite(loss_v) and math.isfinite(gn_v)):
        optimizer.zero_grad(set_to_none=True)
        return None
    if scale and scale[0] != 1.0:
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * scale[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return gn_v


def skipped_update_line(step: int, skipped: int) -> str:
    """The log line of an update `optimizer_step` skipped at ``step`` (``skipped`` so far)."""
    return (f"[tether] step {step}: non-finite loss or gradient; update skipped (weights unchanged, {skipped} "
            f"skipped so far)")
