"""Rollout workers of asynchronous training (``train.max_staleness`` K >= 1; docs/async.md).

    trainer                                     worker i (its own process and model copy)
      submit(Job: examples, seed) --jobs-->       load the newest weights version v (SharedWeights)
      next_batch() <--results (bounded)--         agent.rollout(examples) -> RolloutBatch + mu's log-probs
      push(model, version) --shared memory-->     (read at the start of the next job)

The trainer owns the data stream: a `Job` is one trainer step's examples and its sampling seed.
Workers take jobs in order, load the newest pushed weights before each job (never during one: a
batch, multi-turn episodes included, is sampled by one version) and send back a `Rollout` tagged
with that version. `next_batch` returns rollouts in job order. How far ahead the trainer submits
(``lookahead``) bounds how old a batch can be: a job submitted at version v is sampled with
weights >= v, and the trainer consumes at most ``lookahead - 1`` other jobs before it, so its
staleness (trainer version at consumption - sampling version) is at most ``lookahead - 1``.

Weights travel as one shared-memory copy of the trainer's *effective* weights (`effective_weights`:
LoRA merged into the base, every name of a tied tensor), written under a lock with a version
counter; the workers' models are plain (un-wrapped) copies loaded with ``tether.models.load_model``.
With ``verify`` each version is checksummed on both sides (`checksum`): the trainer of what it
pushed, the worker of its own model's weights read back after loading, and `next_batch` raises
`WeightSyncError` when they differ, so stale or corrupted weights are an error, not a silent
off-policy bias.

Workers ignore SIGINT / SIGTERM (the trainer's graceful stop needs them to finish the step in
progress; ``tether.stop``) and are killed by `close`, which the trainer calls however it ends;
a worker also exits when its parent is gone. A worker that raises (or dies) becomes a
`WorkerError` naming it and its exception at the trainer's next `next_batch`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import queue
import signal
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..errors import GenerationError
from .base import RolloutBatch, SamplingParams


class WorkerError(GenerationError):
    """A rollout worker raised or died; the message names the worker and its exception."""


class WeightSyncError(GenerationError):
    """A rollout worker sampled with weights that are not the version it claims (checksum mismatch)."""


@dataclass
class Job:
    """One trainer step's prompts, sent to a worker."""

    id: int  # the job's index in the run: the trainer consumes jobs in this order
    examples: list  # the step's examples (tether.tasks.Example)
    params: SamplingParams  # with the job's seed
    position: int  # the data stream's position after these examples (checkpointed once the job is consumed)


@dataclass
class Rollout:
    """A worker's answer to a `Job`."""

    job: Job
    rb: RolloutBatch  # on the CPU; sampler_logp = mu's log-probs of the sampled tokens
    version: int  # the policy version (trainer updates) of the weights that sampled it
    worker: int
    checksum: Optional[str]  # of the weights the worker sampled with, read back from its model (verify only)
    agent_metrics: dict = field(default_factory=dict)  # the worker agent's metrics() for this batch
    gen_s: float = 0.0  # seconds the worker spent generating the batch
    load_s: float = 0.0  # seconds it spent loading (and checksumming) new weights before it


# ------------------------------------------------------------------ weights


def _lora_layers(model) -> dict:
    """module name -> peft LoRA layer (a module with ``base_layer`` and ``get_delta_weight``)."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "get_delta_weight")}


@torch.no_grad()
def effective_weights(model) -> dict[str, torch.Tensor]:
    """name -> weight of the plain model that samples as ``model`` does: for a peft model the base
    model's names with every active LoRA adapter merged (W + scale * B A, the trainer's weights left
    untouched), and every name of a tied tensor (``lm_head.weight`` and ``model.embed_tokens.weight``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lora = _lora_layers(base)
    out = {}
    for name, p in base.named_parameters(remove_duplicate=False):
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer") and owner[:-len(".base_layer")] in lora:
            owner = owner[:-len(".base_layer")]
            layer, name = lora[owner], f"{owner}.{leaf}"
            if leaf == "weight" and not layer.merged and not getattr(layer, "disable_adapters", False):
                for a in layer.active_adapters:
                    if a in layer.lora_A:
                        p = p + layer.get_delta_weight(a).to(p.dtype)
        out[name] = p.detach()
    return out


def checksum(weights: dict[str, torch.Tensor]) -> str:
    """blake2b of the names and exact bytes of ``weights`` in name order (one pass over the weights)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        t = weights[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_weights(model) -> dict[str, torch.Tensor]:
    """A plain model's weights by every name (tied tensors under each of their names)."""
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


class SharedWeights:
    """One shared-memory copy of the effective weights (tied tensors stored once) and its version.

    The trainer `write`s, workers `read_into` their model; both under one lock.
    """

    def __init__(self, weights: dict[str, torch.Tensor], ctx):
        self.alias, self.tensors, seen = {}, {}, {}
        for name in sorted(weights):
            t = weights[name]
            key = (t.data_ptr(), tuple(t.shape), t.dtype, t.device)
            if key in seen:  # tied: one buffer, every name
                self.alias[name] = seen[key]
                continue
            seen[key] = name
            self.tensors[name] = torch.empty(t.shape, dtype=t.dtype).share_memory_()
        self.version = ctx.Value("q", -1, lock=False)
        self.lock = ctx.Lock()

    def names(self) -> set:
        return set(self.tensors) | set(self.alias)

    @torch.no_grad()
    def write(self, weights: dict[str, torch.Tensor], version: int) -> None:
        if set(weights) != self.names():
            raise WeightSyncError(f"the weights to push do not match the workers' buffer (names differ: "
                                  f"{sorted(set(weights) ^ self.names())[:4]})")
        with self.lock:
            for name, buf in self.tensors.items():
                buf.copy_(weights[name])
            self.version.value = version

    @torch.no_grad()
    def read_into(self, model) -> int:
        """Copy the newest weights into ``model`` (a plain model with the same names); returns their version."""
        params = dict(model.named_parameters(remove_duplicate=False))
        if set(params) != self.names():
            raise WeightSyncError(f"the worker's model does not match the pushed weights (names differ: "
                                  f"{sorted(set(params) ^ self.names())[:4]})")
        with self.lock:
            for name, p in params.items():
                p.copy_(self.tensors[self.alias.get(name, name)])
            return int(self.version.value)


# ------------------------------------------------------------------ the worker process


def _worker_main(rank: int, cfg, shared: SharedWeights, jobs, results, verify: bool, parent: int) -> None:
    """A worker: load the model and agent as the trainer does, then answer jobs until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer stops gracefully and then kills its workers
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from ..agents import agent_from_config, agent_tools
        from ..models import load_model
        from . import make_engine

        # the trainer's loading code; LoRA is merged into the pushed weights, so the worker's model is plain
        model, tokenizer = load_model(dataclasses.replace(cfg.model, lora_r=0, gradient_checkpointing=False))
        model.requires_grad_(False)
        engine = make_engine(cfg.rollout, model, tokenizer, record_logp=True)  # mu's log-probs for the trainer
        agent = agent_from_config(cfg, engine, tokenizer, agent_tools(cfg))
        loaded, sum_ = None, None
        while True:
            try:
                job = jobs.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:  # the trainer is gone (killed): do not outlive it
                    return
                continue
            if job is None:
                return
            t0 = time.perf_counter()
            if shared.version.value != loaded:
                loaded = shared.read_into(model)
                engine.sync_weights(model)  # drops KV caches computed with the previous weights
                sum_ = checksum(model_weights(model)) if verify else None
            t1 = time.perf_counter()
            rb = agent.rollout(job.examples, job.params).to("cpu")
            results.put(("batch", rank, Rollout(job=job, rb=rb, version=loaded, worker=rank, checksum=sum_,
                                                agent_metrics=agent.metrics(), gen_s=time.perf_counter() - t1,
                                                load_s=t1 - t0)))
    except BaseException as e:  # noqa: BLE001  every failure goes to the trainer, named
        tb = traceback.extract_tb(e.__traceback__)
        where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
        results.put(("error", rank, f"{type(e).__name__}: {e}{where}"))


# ------------------------------------------------------------------ the trainer's side


def _kill(procs: list, jobs=None, grace_s: float = 2.0) -> None:
    """End the workers: an idle one exits on its ``None`` job within ``grace_s``; the others are killed."""
    if jobs is not None:
        for _ in procs:
            try:
                jobs.put_nowait(None)
            except (queue.Full, ValueError, OSError):
                break
        deadline = time.monotonic() + grace_s
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


class RolloutWorkers:
    """``n`` rollout worker processes (spawned) for the trainer: `submit`, `next_batch`, `push`, `close`.

    Args:
        cfg: the run's `tether.config.Config` (the workers build model, engine and agent from it).
        model: the trainer's policy; its effective weights are pushed now as version ``version``.
        n: worker processes.
        lookahead: at most this many jobs submitted and not yet consumed (`wants_job`).
        verify: checksum every version on both sides (`next_batch` raises `WeightSyncError` on a mismatch).
    """

    def __init__(self, cfg, model, n: int, lookahead: int, verify: bool, version: int = 0,
                 log: Callable = print):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.n, self.lookahead, self.verify = n, lookahead, verify
        self.shared = SharedWeights(effective_weights(model), ctx)
        self.checksums: dict[int, str] = {}  # version -> checksum of what was pushed (verify)
        self.jobs = ctx.Queue(maxsize=lookahead)
        self.results = ctx.Queue(maxsize=lookahead + 2 * n)  # batches (<= lookahead) and the workers' errors
        self.submitted, self.consumed = 0, 0
        self._ready: dict[int, Rollout] = {}  # job id -> rollout that arrived before its turn
        self._order: collections.deque = collections.deque()  # ids of the jobs in flight, in submission order
        self.push(model, version)
        self.procs = []
        for i in range(n):
            p = ctx.Process(target=_worker_main, name=f"tether-rollout-{i}", daemon=True,
                            args=(i, cfg, self.shared, self.jobs, self.results, verify, os.getpid()))
            p.start()
            self.procs.append(p)
            log(f"[tether] rollout worker {i} started (pid {p.pid})")
        self._finalizer = weakref.finalize(self, _kill, list(self.procs), self.jobs)

    def wants_job(self) -> bool:
        """Whether fewer than ``lookahead`` jobs are submitted and not yet consumed."""
        return self.submitted - self.consumed < self.lookahead

    def submit(self, job: Job) -> None:
        """Queue ``job``; `next_batch` returns the rollouts in submission order."""
        if not self.wants_job():
            raise RuntimeError(f"{self.lookahead} jobs already in flight")
        self.jobs.put(job)
        self._order.append(job.id)
        self.submitted += 1

    def next_batch(self) -> Rollout:
        """The rollout of the oldest unconsumed job (waits for it); raises `WorkerError` if a worker
        failed, `WeightSyncError` if verified weights differ from those pushed for its version."""
        if self.consumed >= self.submitted:
            raise RuntimeError("next_batch() with no job in flight: submit() first")
        want = self._order[0]
        while want not in self._ready:
            try:
                msg = self.results.get(timeout=0.5)
            except queue.Empty:
                self._check_alive()
                continue
            self._take(msg)
        r = self._ready.pop(self._order.popleft())
        self.consumed += 1
        if r.version not in self.checksums:
            raise WeightSyncError(f"rollout worker {r.worker} tagged job {r.job.id} with version {r.version}, "
                                  f"which was never pushed (pushed: {sorted(self.checksums)[-3:]})")
        if self.verify and r.checksum != self.checksums[r.version]:
            raise WeightSyncError(f"rollout worker {r.worker} sampled job {r.job.id} with weights that are not "
                                  f"version {r.version}'s: checksum {r.checksum} read back from its model, "
                                  f"{self.checksums[r.version]} pushed")
        return r

    def _take(self, msg) -> None:
        kind, rank, body = msg
        if kind == "error":
            raise WorkerError(f"rollout worker {rank} (pid {self.procs[rank].pid}) failed: {body}")
        self._ready[body.job.id] = body

    def _check_alive(self) -> None:
        """A dead worker is an error; its own error message, if it sent one, is the one raised."""
        dead = [(i, p) for i, p in enumerate(self.procs) if not p.is_alive()]
        if not dead:
            return
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:  # the error it put before exiting may still be in the pipe
            try:
                self._take(self.results.get(timeout=0.2))
            except queue.Empty:
                break
        i, p = dead[0]
        raise WorkerError(f"rollout worker {i} (pid {p.pid}) died with exit code {p.exitcode} and no error "
                          f"message (killed, e.g. out of memory?)")

    def push(self, model, version: int) -> None:
        """Write ``model``'s effective weights as ``version`` (and their checksum, with ``verify``)."""
        w = effective_weights(model)
        self.checksums[version] = checksum(w) if self.verify else ""  # "": pushed, not checksummed
        self.shared.write(w, version)
        for v in [v for v in self.checksums if v < version - self.lookahead - 1]:
            del self.checksums[v]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        """End the workers: idle ones on a ``None`` job, busy ones killed (they hold nothing worth saving: the
        jobs in flight are regenerated on resume)."""
        self._finalizer()
        for q in (self.jobs, self.results):
            q.cancel_join_thread()
            q.close()

    def __enter__(self) -> "RolloutWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
