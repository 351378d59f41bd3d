"""Data-parallel training with FSDP2 under ``torchrun``: all the distributed plumbing, in one place.

Every helper here is a no-op (or the identity) in a single process, so the trainer calls them
unconditionally and the single-process path reads as before.

Layout of one trainer step on W ranks (see docs/scaling.md):

* **Rollouts.** The step's ``rollout.prompts_per_step`` prompts are taken from the (identical)
  prompt stream on every rank; rank r generates whole groups for prompts
  ``[r P/W, (r+1) P/W)`` (:func:`rank_slice`). Its rows are rows ``[offset_r, offset_r + B_r)``
  of the *global batch*, the concatenation of the ranks' rows in rank order, which is exactly
  the batch one process would hold for the same prompts.
* **Batch statistics.** Advantages are computed on the gathered rewards of the global batch
  (:func:`all_gather_cat`), so batch-level normalizations (REINFORCE++, batch_mean) see the
  whole batch; logged metrics are sums / maxima over ranks.
* **Mini-batches.** The global mini-batch ``j`` is the same slice of the same permutation of the
  global rows as in one process; each rank trains on the rows of it that it holds. The loss
  denominators (tokens, sequences) are the global mini-batch's, and gradients are *summed* over
  ranks (FSDP's divide factor is 1), so the update is the single-process update of the whole
  batch. Ranks run the same number of forward/backward calls per mini-batch (the shorter ones
  add zero-loss calls) because each backward reduce-scatters.
* **Weights.** The policy is sharded with ``fully_shard`` (every decoder layer, then the root).
  The anchor keeps per-rank shards (:func:`local`); it is applied by copying into the local
  shards in place, never by swapping ``p.data`` (FSDP2 ignores that). After any edit of the
  shards every FSDP module is resharded (:func:`reshard`), else a module that still holds
  gathered weights (the root does after a forward) would compute with the old ones.
* **The update in lockstep.** :func:`rank_share` gives a rank its rows of a global mini-batch and
  the global loss-token count; :func:`lockstep` pads its micro-batches with zero-loss backward
  calls up to the busiest rank's count. :func:`check_supported` says what a config must satisfy.
* **Generation and no-grad passes** run inside :func:`gathered`: every FSDP module is unsharded
  once and does not reshard after forward, so the ranks may run different numbers of forward
  calls (different response lengths, pruned rows) without a collective in between.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from .errors import ConfigError

__all__ = [
    "init", "teardown", "enabled", "rank", "world_size", "is_main", "barrier",
    "all_reduce", "all_gather_cat", "mean_over_ranks", "all_gather_objects", "on_main", "rank_slice", "rank_seed",
    "check_supported", "rank_share", "lockstep",
    "shard_model", "is_sharded", "fsdp_modules", "reshard", "gathered",
    "local", "full_tensor", "full_like", "shard_like", "as_param_layout", "clip_grad_norm_",
]


# ---------------------------------------------------------------- process group


def _dist():
    import torch.distributed as dist
    return dist


def init() -> bool:
    """Join the process group that ``torchrun`` describes (WORLD_SIZE > 1); returns whether distributed.

    Idempotent. Backend: nccl when CUDA is available (each rank on ``cuda:LOCAL_RANK``), gloo on
    CPU. Without torchrun's environment (or with WORLD_SIZE=1) nothing happens.
    """
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=int(os.environ.get("TETHER_DIST_TIMEOUT_S", "1800")))
    dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=timeout)
    return True


def teardown() -> None:
    """Leave the process group (if this process joined one)."""
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def enabled() -> bool:
    """True inside a process group of more than one rank."""
    dist = _dist()
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return _dist().get_rank() if enabled() else 0


def world_size() -> int:
    return _dist().get_world_size() if enabled() else 1


def is_main() -> bool:
    """Rank 0 (or the only process): the one that logs, shows progress and writes files."""
    return rank() == 0


def barrier() -> None:
    if enabled():
        _dist().barrier()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if _dist().get_backend() == "nccl" else torch.device("cpu")


def all_reduce(x, op: str = "sum"):
    """Sum / max / min of a tensor (or a Python number) over ranks; the input itself at world size 1.

    Tensors come back on their own device and dtype, numbers as floats.
    """
    if not enabled():
        return x
    dist = _dist()
    t = torch.as_tensor(x, dtype=torch.float64) if not torch.is_tensor(x) else x
    buf = t.detach().to(_comm_device(), copy=True)
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dist.all_reduce(buf, op=ops[op])
    out = buf.to(t.device)
    return out if torch.is_tensor(x) else float(out)


def all_gather_objects(obj) -> list:
    """One picklable object from every rank, in rank order ([obj] at world size 1)."""
    if not enabled():
        return [obj]
    out = [None] * world_size()
    _dist().all_gather_object(out, obj)
    return out


def on_main(fn: Callable[[], object]):
    """``fn()`` run on rank 0 only, its result (picklable) returned on every rank; ``fn()`` itself at world
    size 1. An exception ``fn`` raises is raised on every rank (the same class with the same message where
    it takes one; RuntimeError otherwise), so no rank waits on a collective that rank 0 will never reach."""
    if not enabled():
        return fn()
    box: list = [None]
    if is_main():
        try:
            box[0] = ("ok", fn())
        except Exception as e:
            _dist().broadcast_object_list([("error", type(e), str(e))], src=0, device=_comm_device())
            raise
    _dist().broadcast_object_list(box, src=0, device=_comm_device())
    kind, *body = box[0]
    if kind == "ok":
        return body[0]
    cls, msg = body
    try:
        err = cls(msg)
    except Exception:
        err = RuntimeError(f"rank 0 failed: {cls.__name__}: {msg}")
    raise err


def mean_over_ranks(d: dict) -> dict:
    """Numeric values averaged over ranks (the dict itself at world size 1); keys must agree."""
    if not enabled():
        return d
    return {k: all_reduce(float(v)) / world_size() for k, v in d.items()}


def all_gather_cat(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Concatenate every rank's 1-D tensor along dim 0 (rank order); returns (global, this rank's offset).

    Sizes may differ between ranks; values keep their dtype exactly (e.g. float32 rewards).
    """
    if not enabled():
        return x, 0
    parts = all_gather_objects(x.detach().cpu())
    offset = sum(len(p) for p in parts[:rank()])
    return torch.cat(parts).to(x.device), offset


def rank_slice(n: int, what: str = "rollout.prompts_per_step") -> slice:
    """This rank's contiguous share of ``n`` items (``n`` must divide evenly over the ranks)."""
    w = world_size()
    if n % w:
        raise ValueError(f"{what}={n} does not divide over {w} ranks (torchrun --nproc_per_node x --nnodes); "
                         f"set {what} to a multiple of {w}")
    k = n // w
    return slice(rank() * k, (rank() + 1) * k)


def rank_seed(seed: int) -> int:
    """A per-rank sampling seed: ``seed`` itself on rank 0 (so one process samples as before)."""
    return (seed + 7_919_993 * rank()) % (2**31)


def check_supported(prompts_per_step: int, dynamic_sampling: bool) -> None:
    """What the ranks need of a config, as a `ConfigError`: the step's prompts divide evenly over them,
    and no dynamic sampling (not supported across ranks yet). Nothing to check in one process."""
    if not enabled():
        return
    try:
        rank_slice(prompts_per_step)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if dynamic_sampling:
        raise ConfigError("rollout.dynamic_sampling is not supported with more than one process yet "
                          f"({world_size()} ranks); set rollout.dynamic_sampling=false")


# ---------------------------------------------------------------- the update in lockstep


def rank_share(global_rows: Sequence[int], offset: int, loss_mask: torch.Tensor) -> tuple[list[int], float]:
    """This rank's part of a global mini-batch ``global_rows`` (row ids of the global batch, in which this
    rank holds rows ``[offset, offset + len(loss_mask))``): the rows it holds, as its local ids, and the
    global mini-batch's loss-token count (the sum of ``loss_mask`` over every rank's rows of it), so that
    every rank divides by the same denominator. One process: ``global_rows`` and its own count."""
    mine = range(offset, offset + loss_mask.shape[0])
    rows = [i - offset for i in global_rows if i in mine]
    return rows, all_reduce(float(loss_mask[rows].sum()))


def lockstep(micro: list, idle: Callable[[], None]) -> Iterator:
    """Yield this rank's ``micro``-batches, then call ``idle()`` until it has made as many forward /
    backward calls as the busiest rank: under FSDP every backward reduce-scatters, so all ranks must make
    the same number. ``idle`` makes one that adds exactly zero to the gradients. One process: ``micro``.

    The busiest rank's count is agreed (an all-reduce) before the first batch is yielded.
    """
    busiest = int(all_reduce(float(len(micro)), "max"))
    yield from micro
    for _ in range(busiest - len(micro)):
        idle()


# ---------------------------------------------------------------- sharding


def _layer_classes(model: nn.Module) -> set[str]:
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return set(getattr(base, "_no_split_modules", None) or [])


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2-managed modules of ``model`` (empty when it is not sharded)."""
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    return bool(fsdp_modules(model))


def shard_model(model: nn.Module) -> nn.Module:
    """Shard ``model`` with FSDP2 over all ranks (every decoder layer, then the root); identity at world size 1.

    Parameters must be contiguous for ``fully_shard``: the column-major layout that
    ``models.column_major_linear_weights`` gives CPU models is undone here. Gradients are summed
    over ranks (divide factor 1): the trainer normalizes the loss by global token/sequence counts.
    """
    if not enabled():
        return model
    from torch.distributed.fsdp import fully_shard
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_contiguous():
                p.data = p.data.contiguous()
    classes = _layer_classes(model)
    for m in model.modules():
        if type(m).__name__ in classes:
            fully_shard(m, reshard_after_forward=True)
    fully_shard(model)
    for m in fsdp_modules(model):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    return model


def reshard(model: nn.Module) -> None:
    """Free every gathered weight of every FSDP module (call after editing the local shards)."""
    for m in fsdp_modules(model):
        m.reshard()


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block every FSDP module holds its full weights and no forward communicates.

    For generation and no-grad passes, where ranks run different numbers of forward calls.
    Costs the full weights on every rank for the block's duration. Resharded on exit.
    """
    mods = fsdp_modules(model)
    if not mods:
        yield model
        return
    reshard(model)  # gathered copies may be stale (shards edited since the last forward)
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
    for m in mods:
        m.unshard()
    try:
        yield model
    finally:
        for m in mods[1:] if mods[0] is model else mods:  # the root keeps its default (no reshard)
            m.set_reshard_after_forward(True, recurse=False)
        reshard(model)


# ---------------------------------------------------------------- tensors


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a sharded tensor (a view: in-place edits reach the parameter); ``t`` otherwise."""
    return t.to_local() if _is_dtensor(t) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (all-gathered when sharded: every rank must call); ``t`` otherwise."""
    return t.full_tensor() if _is_dtensor(t) else t


def full_like(shard: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Gather a local shard laid out like parameter ``like`` (e.g. an anchor tensor) into the whole tensor."""
    if not _is_dtensor(like):
        return shard
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(shard, like.device_mesh, like.placements, shape=like.shape,
                              stride=like.stride(), run_check=False).full_tensor()


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of the whole tensor ``full`` in the layout of ``like`` (no communication)."""
    if not _is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor
    shard = distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()
    return shard.clone()  # a view would keep the whole tensor's storage alive


@torch.no_grad()
def clip_grad_norm_(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole (sharded) gradient; returns the global norm."""
    if not enabled():
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [local(p.grad) for p in params if p.grad is not None]
    dev = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=dev)
    for g in grads:
        sq += g.double().pow(2).sum()
    total = all_reduce(sq).sqrt().float()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def as_param_layout(full: torch.Tensor, like: Optional[torch.Tensor]) -> torch.Tensor:
    """``full`` distributed like the sharded parameter ``like`` (a DTensor, e.g. an AdamW moment being
    restored), when ``like`` is sharded and of the same shape; ``full`` otherwise. No communication."""
    if like is None or not _is_dtensor(like) or tuple(full.shape) != tuple(like.shape):
        return full
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(shard_like(full, like), like.device_mesh, like.placements, shape=like.shape,
                              stride=like.stride(), run_check=False)
