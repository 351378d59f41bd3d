"""The anchor kinds and their update rules: the mathematics of how the anchor pi_a follows the policy.

Each rule is ``rule(anchor, params, step, token_kl) -> bool``: given the policy's tracked parameters
after trainer step ``step`` it updates ``anchor.master`` (the anchor's tensors, one per parameter) in
place and says whether it moved. ``anchor`` is any object with ``cfg`` (its ``algo.anchor`` section),
``master`` and ``kl_ma``: `tether.anchor.Anchor` holds the tensors, applies them and checkpoints them.

| kind | rule (after trainer step ``n``) |
| --- | --- |
| fixed | theta_a = theta_0, never changes (GRPO's reference model) |
| ema | every ``every`` trainer steps: theta_a <- eta theta_a + (1 - eta) theta (EMA-PG) |
| iterative | theta_a = theta_old: the anchor *is* the sampler; no tensors, no forward pass (RPG) |
| reset | every ``every`` trainer steps: theta_a <- theta |
| kl_reset | theta_a <- theta when kl_ma > kappa, kl_ma <- m kl_ma + (1 - m) KL (RPG's suggestion) |

This registry is the one list of anchor kinds: `tether.config.recipes` validates ``algo.anchor.kind``
against it (plus ``none``: no anchor, no KL term), the config reference lists it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .registry import Registry

#: anchor kind -> its rule ``rule(anchor, params, step, token_kl) -> bool`` (whether it moved the anchor's
#: tensors, given the policy's local parameters after trainer step ``step``), with metadata ``needs_forward``
#: (it has its own weights, which a forward pass computes with; the iterative anchor is the sampler) and
#: ``moves`` (it changes after the first step). ``anchor.kind=none`` is no anchor at all.
ANCHOR_KINDS: Registry[Callable[..., bool]] = Registry("anchor", required=("needs_forward", "moves"))


def _never(anchor: Any, params: list, step: int, token_kl: Optional[float]) -> bool:
    return False


ANCHOR_KINDS.register("fixed", needs_forward=True, moves=False)(_never)


@ANCHOR_KINDS.register("ema", needs_forward=True, moves=True)
def _ema(anchor: Any, params: list, step: int, token_kl: Optional[float]) -> bool:
    c = anchor.cfg
    if step % c.every:
        return False
    if all(p.dtype == m.dtype for m, p in zip(anchor.master, params)):
        torch._foreach_lerp_(anchor.master, [p.detach() for p in params], 1.0 - c.eta)
    else:  # per tensor, so only one upcast temporary exists at a time
        for m, p in zip(anchor.master, params):
            m.lerp_(p.detach().to(m.dtype), 1.0 - c.eta)
    return True


ANCHOR_KINDS.register("iterative", needs_forward=False, moves=False)(_never)


@ANCHOR_KINDS.register("reset", needs_forward=True, moves=True)
def _reset(anchor: Any, params: list, step: int, token_kl: Optional[float]) -> bool:
    if step % anchor.cfg.every:
        return False
    torch._foreach_copy_(anchor.master, [p.detach() for p in params])
    return True


@ANCHOR_KINDS.register("kl_reset", needs_forward=True, moves=True)
def _kl_reset(anchor: Any, params: list, step: int, token_kl: Optional[float]) -> bool:
    c = anchor.cfg
    if token_kl is None:
        raise ValueError("anchor 'kl_reset' needs the step's token KL")
    anchor.kl_ma = c.kl_smoothing * anchor.kl_ma + (1.0 - c.kl_smoothing) * float(token_kl)
    if anchor.kl_ma <= c.kappa:
        return False
    torch._foreach_copy_(anchor.master, [p.detach() for p in params])
    anchor.kl_ma = 0.0
    return True
