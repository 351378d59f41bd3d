"""Rollout workers of asynchronous training (``train.async.max_staleness`` K >= 1; docs/async.md).

    trainer                                     worker i (its own process and model copy)
      submit(Job: examples, seed) --jobs-->       load the newest weights version v (SharedWeights)
      next_batch() <--results (bounded)--         agent.rollout(examples) -> RolloutBatch + mu's log-probs
      push(model, version) --shared memory-->     (read at the start of the next job)

The trainer owns the data stream: a `Job` is one trainer step's examples and its sampling seed.
Workers take jobs in order, load the newest pushed weights before each job (never during one: a
batch, multi-turn episodes included, is sampled by one version; except with partial rollouts,
``train.async.partial_rollout_tokens``, `tether.asynchronous.partial`: between segments too, each token's
version recorded) and send back a `Rollout` tagged with that version (the oldest). `next_batch`
returns rollouts in job order. How far ahead the trainer submits (``lookahead``) bounds how old a
batch can be: a job submitted at version v is sampled with weights >= v, and the trainer consumes at
most ``lookahead - 1`` other jobs before it, so its staleness (trainer version at consumption -
sampling version) is at most ``lookahead - 1``.

Weights (`tether.asynchronous.weights`): the trainer pushes its *effective* weights (`effective_weights`: LoRA
merged, every name of a tied tensor) into one shared-memory copy with a version counter (`SharedWeights`);
the workers' models are plain copies. With ``verify`` each version is checksummed on both sides (the
worker's read back from its model), and for ``rollout.engine=vllm``, whose engine keeps its own copy
(reloaded after each load, ``VLLMEngine.sync_weights``), the worker's `Sampler` also reports the engine's
log-probs of a fixed probe text; `next_batch` compares both with the trainer's at that version and raises
`WeightSyncError` when they differ (``train.async.verify_logp_tol``), so stale or corrupted weights are an
error, not a silent off-policy bias.

Transports: `WorkerPool` holds what does not depend on where the workers run (jobs in flight, job order,
versions, checksums, the checks); `RolloutWorkers` is the local transport below (spawned processes,
queues, shared memory), `tether.asynchronous.remote.RemoteWorkers` the network one (``tether worker``
processes on other nodes, over TCP).

Local workers ignore SIGINT / SIGTERM (the trainer's graceful stop needs them to finish the step in
progress; ``tether.rundir.stop``) and are killed by `close`, which the trainer calls however it ends;
a worker also exits when its parent is gone. A worker that raises (or dies) becomes a
`WorkerError` naming it and its exception at the trainer's next `next_batch`.
"""

from __future__ import annotations

import collections
import math
import os
import queue
import signal
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .. import models  # models.load_model: an attribute read at call time (tests patch it)
from ..agents.build import build_rollout
from ..errors import GenerationError
from ..rollout.base import RolloutBatch, SamplingParams
from .partial import Segmented
from .weights import (
    SharedWeights,
    WeightSyncError,
    checksum,
    effective_weights,
    engine_probe_logp,
    model_probe_logp,
    model_weights,
    probe_ids,
)


class WorkerError(GenerationError):
    """A rollout worker raised or died; the message names the worker and its exception."""


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
    probe_logp: Optional[list] = None  # verify, rollout.engine=vllm: the engine's log-probs of the probe (PROBE_TEXT)
    # partial rollouts (train.async.partial_rollout_tokens): each response token's version [B, T] (-1 on padding; the
    # oldest is ``version``), the newer versions taken between segments and their (checksum, probe_logp) (verify)
    token_version: Optional[torch.Tensor] = None
    later: dict = field(default_factory=dict)


# ------------------------------------------------------------------ the worker's side

class Sampler:
    """A worker's model, engine and agent, built from the run's config as the trainer builds its own.

    The model is a plain copy (``lora_r=0``: LoRA arrives merged); ``rollout.engine=hf`` samples with it
    (recording its log-probs), ``rollout.engine=vllm`` builds a vLLM engine from it and reloads the engine
    from it after each weights load (``VLLMEngine.sync_weights``). ``run`` answers a job: ``pull()`` (the
    transport's: load the newest pushed version if it is newer, through `load`) before it, and, with partial
    rollouts (``train.async.partial_rollout_tokens``, `tether.asynchronous.partial`), between its segments.
    """

    def __init__(self, cfg, rank: int, verify: bool, probe: list[int]):

        self.rank, self.verify, self.probe = rank, verify, probe
        self.model, tokenizer = models.load_model(cfg.model.without_lora(gradient_checkpointing=False))
        self.model.requires_grad_(False)
        self.vllm = cfg.rollout.engine.kind == "vllm"
        S = cfg.train.async_.partial_rollout_tokens
        self.segmented: Optional[Segmented] = None

        def segment(engine):  # partial rollouts: the agent drives the engine through Segmented
            self.segmented = Segmented(engine, S, self._refresh)
            return self.segmented

        parts = build_rollout(cfg, self.model, tokenizer, record_logp=True, wrap=segment if S else None)
        self.engine, self.agent = parts.engine, parts.agent  # record_logp: mu's log-probs
        self.version: Optional[int] = None
        self.checks: dict[int, tuple] = {}  # version -> (checksum, probe log-probs) of the loads of this job
        self._pull: Callable = lambda: None

    def load(self, copy_into: Callable) -> None:
        """``copy_into(model)`` copies a version's weights into the model and returns the version; the engine
        then takes them (a vLLM reload), and with ``verify`` they are read back: the model's checksum, and
        the vLLM engine's log-probs of the probe."""
        self.version = copy_into(self.model)
        self.engine.sync_weights(self.model)  # vLLM: a reload; HF: drops KV caches computed with older weights
        sum_ = checksum(model_weights(self.model)) if self.verify else None
        probe = engine_probe_logp(self.engine, self.probe) if self.verify and self.vllm else None
        self.checks[self.version] = (sum_, probe)

    def _refresh(self) -> int:
        self._pull()
        return self.version

    def run(self, job: Job, pull: Callable) -> Rollout:
        t0 = time.perf_counter()
        self._pull = pull
        pull()  # the newest version, before the job
        first = self.version
        self.checks = {first: self.checks[first]}  # + the versions taken between segments (partial rollouts)
        t1 = time.perf_counter()
        rb = self.agent.rollout(job.examples, job.params).to("cpu")
        self._pull = lambda: None
        sum_, probe = self.checks[first]
        return Rollout(job=job, rb=rb, version=first, worker=self.rank, checksum=sum_,
                       agent_metrics=self.agent.metrics(), gen_s=time.perf_counter() - t1, load_s=t1 - t0,
                       probe_logp=probe, token_version=self.segmented.token_version if self.segmented else None,
                       later={v: c for v, c in self.checks.items() if v != first})


def error_text(e: BaseException) -> str:
    """``Type: message (at file:line)`` of an exception, for the trainer's error line."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def _worker_main(rank: int, cfg, shared: "SharedWeights", jobs, results, verify: bool, parent: int,
                 probe: list) -> None:
    """A local worker: load the model and agent as the trainer does, then answer jobs until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer stops gracefully and then kills its workers
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _thread_lock_for_progress_bars()
    try:
        s = Sampler(cfg, rank, verify, probe)

        def pull() -> None:  # before a job (and between its segments with partial rollouts): the newest version
            if shared.version.value != s.version:
                s.load(shared.read_into)

        while (job := _next_job(jobs, parent)) is not None:
            results.put(("batch", rank, s.run(job, pull)))
    except BaseException as e:  # noqa: BLE001  every failure goes to the trainer, named
        results.put(("error", rank, error_text(e)))
        _linger(jobs, parent)


def _thread_lock_for_progress_bars() -> None:
    """A worker's progress bars (tqdm: the model load's) lock with a thread lock. tqdm's default one is also a
    multiprocessing RLock, a named semaphore that a worker killed with ``kill -9`` never unlinks, so the resource
    tracker warned of a "leaked semaphore" when the trainer exited; a worker has no child processes to share it with."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _next_job(jobs, parent: int, until: float = math.inf) -> Optional[Job]:
    """The trainer's next job; None once it says stop (its ``None`` job), is gone (killed: a worker does not
    outlive it) or ``until`` (``time.monotonic``) has passed."""
    while time.monotonic() < until:
        try:
            return jobs.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None
    return None


def _linger(jobs, parent: int, limit_s: float = 600.0) -> None:
    """After an error: stay until the trainer says stop (its ``None`` job, sent once it has read the error) or
    is gone. The batches this worker sent before the error hold their tensors as file descriptors that the
    trainer fetches from this very process when it reads them; had it exited at once, the trainer would find
    its last good batch unreadable and take a worker that raised for one that died. Jobs sent meanwhile are
    dropped (the trainer stops at the error)."""
    until = time.monotonic() + limit_s
    try:
        while _next_job(jobs, parent, until) is not None:
            pass
    except (OSError, EOFError, ValueError):  # the trainer closed the queue
        pass


# ------------------------------------------------------------------ the trainer's side


class WorkerPool:
    """What every transport shares (`RolloutWorkers`: local processes; `tether.asynchronous.remote.RemoteWorkers`:
    ``tether worker`` processes over TCP): jobs in flight, rollouts in job order, the versions pushed and
    their checksums (and, for vLLM workers, the trainer's log-probs of the probe), and the checks of
    `next_batch`, and the restart of a dead worker (`_lost`: ``train.async.worker_restarts``). A transport implements
    ``_send(job, rank=None) -> rank``, ``_receive(timeout) -> message or None``, ``_check_alive()`` (calls
    `_lost` for a dead worker), ``_restart(rank)``, ``_publish(weights, version)``, ``close()`` and
    ``describe(rank)``.
    """

    def __init__(self, cfg, n: int, lookahead: int, verify: bool, tokenizer, log: Callable = print):
        self.n, self.lookahead, self.verify, self.log = n, lookahead, verify, log
        self.max_restarts, self.restarts = cfg.train.async_.worker_restarts, 0  # restarts of dead workers (the run's)
        self._held: dict[int, tuple[int, Job]] = {}  # job id -> (rank, job): sent to a worker, its batch not arrived
        self.vllm = cfg.rollout.engine.kind == "vllm"
        self.logp_tol = cfg.train.async_.verify_logp_tol
        self.probe = probe_ids(tokenizer) if verify and self.vllm else []
        self.checksums: dict[int, str] = {}  # version -> checksum of what was pushed (verify)
        self.probes: dict[int, list] = {}  # version -> the trainer's log-probs of the probe (verify, vLLM)
        self.submitted, self.consumed = 0, 0
        self._ready: dict[int, Rollout] = {}  # job id -> rollout that arrived before its turn
        self._order: collections.deque = collections.deque()  # ids of the jobs in flight, in submission order

    def wants_job(self) -> bool:
        """Whether fewer than ``lookahead`` jobs are submitted and not yet consumed."""
        return self.submitted - self.consumed < self.lookahead

    def submit(self, job: Job) -> None:
        """Queue ``job``; `next_batch` returns the rollouts in submission order."""
        if not self.wants_job():
            raise RuntimeError(f"{self.lookahead} jobs already in flight")
        self._held[job.id] = (self._send(job), job)
        self._order.append(job.id)
        self.submitted += 1

    def next_batch(self) -> Rollout:
        """The rollout of the oldest unconsumed job (waits for it); raises `WorkerError` if a worker
        failed, `WeightSyncError` if verified weights differ from those pushed for its version."""
        if self.consumed >= self.submitted:
            raise RuntimeError("next_batch() with no job in flight: submit() first")
        want = self._order[0]
        while want not in self._ready:
            msg = self._receive(0.5)
            if msg is None:
                self._check_alive()
                continue
            self._take(msg)
        r = self._ready.pop(self._order.popleft())
        self.consumed += 1
        self._verify(r)
        return r

    def _verify(self, r: Rollout) -> None:
        for version, (sum_, probe) in [(r.version, (r.checksum, r.probe_logp)), *r.later.items()]:
            self._verify_version(r, version, sum_, probe)

    def _verify_version(self, r: Rollout, version: int, sum_: Optional[str], probe: Optional[list]) -> None:
        who = f"rollout worker {r.worker}"
        if version not in self.checksums:
            raise WeightSyncError(f"{who} tagged job {r.job.id} with version {version}, "
                                  f"which was never pushed (pushed: {sorted(self.checksums)[-3:]})")
        if not self.verify:
            return
        if sum_ != self.checksums[version]:
            raise WeightSyncError(f"{who} sampled job {r.job.id} with weights that are not "
                                  f"version {version}'s: checksum {sum_} read back from its model, "
                                  f"{self.checksums[version]} pushed")
        if self.vllm:
            ours = self.probes[version]
            if probe is None or len(probe) != len(ours):
                raise WeightSyncError(f"{who} sent no vLLM probe log-probs for version {version}")
            d = sum(abs(a - b) for a, b in zip(ours, probe)) / max(len(ours), 1)
            if not d <= self.logp_tol:  # NaN too
                raise WeightSyncError(
                    f"{who}'s vLLM engine does not sample with version {version}'s weights: its log-probs of "
                    f"the probe text differ from the trainer's by {d:.3g} per token on average (> "
                    f"train.async.verify_logp_tol={self.logp_tol:g}) though the weights it was given match (job "
                    f"{r.job.id}). At version 0 this is the engine's numerics (raise train.async.verify_logp_tol, "
                    f"e.g. for bfloat16); later, the engine kept older weights")

    def _take(self, msg) -> None:
        kind, rank, body = msg
        if kind == "error":
            raise WorkerError(f"{self.describe(rank)} failed: {body}")
        self._held.pop(body.job.id, None)
        self._ready[body.job.id] = body

    def _least_busy(self) -> int:
        held = [r for r, _ in self._held.values()]
        return min(range(self.n), key=held.count)

    def _lost(self, rank: int, what: str) -> None:
        """Worker ``rank`` died (or went silent): restart it, the jobs it held resubmitted to it in order
        (``train.async.worker_restarts`` left), else raise `WorkerError`. Resubmitted jobs keep their id, examples
        and seed; the new worker loads the newest pushed version before each, so the staleness bound holds."""
        who = f"{self.describe(rank)} {what}"
        if self.restarts >= self.max_restarts:
            used = f" (train.async.worker_restarts={self.max_restarts} restart(s) used)" if self.max_restarts else ""
            raise WorkerError(who + used)
        self.restarts += 1
        jobs = sorted((j for r, j in self._held.values() if r == rank), key=lambda j: j.id)
        self.log(f"[tether] {who}; restarting it (restart {self.restarts} of train.async.worker_restarts="
                 f"{self.max_restarts}), its job(s) {[j.id for j in jobs]} resubmitted")
        try:
            self._restart(rank)
        except WorkerError as e:  # e.g. no remote replacement connected in time
            raise WorkerError(f"{who}; its replacement failed: {e}") from e
        for job in jobs:
            self._held[job.id] = (self._send(job, rank), job)

    def push(self, model, version: int) -> None:
        """Publish ``model``'s effective weights as ``version`` (and, with ``verify``, their checksum and the
        trainer's log-probs of the probe for vLLM workers)."""
        w = effective_weights(model)
        self.checksums[version] = checksum(w) if self.verify else ""  # "": pushed, not checksummed
        if self.probe:
            self.probes[version] = model_probe_logp(model, self.probe)
        self._publish(w, version)
        for v in [v for v in self.checksums if v < version - self.lookahead - 1]:
            del self.checksums[v]
            self.probes.pop(v, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _kill(procs: list, jobs: list, grace_s: float = 2.0) -> None:
    """End the workers: an idle one exits on its ``None`` job within ``grace_s``; the others are killed."""
    for q in jobs:
        try:
            q.put_nowait(None)
        except (queue.Full, ValueError, OSError):
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def _discard(*queues) -> None:
    for q in queues:
        q.cancel_join_thread()
        q.close()


class RolloutWorkers(WorkerPool):
    """``n`` local rollout worker processes (spawned) for the trainer: `submit`, `next_batch`, `push`, `close`.

    Each worker has its own job queue and result queue, so the trainer knows which jobs a worker holds and a
    worker killed mid-write (``kill -9``) corrupts no other worker's pipe: a dead worker is restarted with
    new queues and its jobs resubmitted (``train.async.worker_restarts``), or the run stops with a `WorkerError`.

    Args:
        cfg: the run's `tether.config.Config` (the workers build model, engine and agent from it).
        model: the trainer's policy; its effective weights are pushed now as version ``version``.
        n: worker processes.
        lookahead: at most this many jobs submitted and not yet consumed (`wants_job`).
        verify: checksum every version on both sides (`next_batch` raises `WeightSyncError` on a mismatch);
            vLLM workers also report their engine's log-probs of a probe text.
        tokenizer: the run's tokenizer (the probe's ids).
    """

    def __init__(self, cfg, model, n: int, lookahead: int, verify: bool, version: int = 0,
                 log: Callable = print, tokenizer=None):
        import torch.multiprocessing as mp

        super().__init__(cfg, n, lookahead, verify, tokenizer, log)
        self.cfg, self.ctx = cfg, mp.get_context("spawn")
        self.shared = SharedWeights(effective_weights(model), self.ctx)
        self.push(model, version)
        self.procs, self.jobs, self.results = [None] * n, [None] * n, [None] * n  # per worker
        for i in range(n):
            self._start(i)
        self._finalizer = weakref.finalize(self, _kill, self.procs, self.jobs)  # the lists, as restarts update them

    def _start(self, i: int) -> None:
        self.jobs[i], self.results[i] = self.ctx.Queue(), self.ctx.Queue()  # <= lookahead jobs / batches each
        p = self.ctx.Process(target=_worker_main, name=f"tether-rollout-{i}", daemon=True,
                             args=(i, self.cfg, self.shared, self.jobs[i], self.results[i], self.verify, os.getpid(),
                                   self.probe))
        p.start()
        self.procs[i] = p
        self.log(f"[tether] rollout worker {i} started (pid {p.pid})")

    def describe(self, rank: int) -> str:
        return f"rollout worker {rank} (pid {self.procs[rank].pid})"

    def _send(self, job: Job, rank: Optional[int] = None) -> int:
        rank = self._least_busy() if rank is None else rank
        self.jobs[rank].put(job)
        return rank

    def _receive(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            for i, q in enumerate(self.results):
                try:
                    return q.get_nowait()
                except queue.Empty:
                    pass
                except (OSError, EOFError) as e:  # a batch's tensors travel by fd from its worker: it died meanwhile
                    self.procs[i].join(timeout=5)
                    if self.procs[i].is_alive():
                        raise
                    self._lost(i, f"died with exit code {self.procs[i].exitcode} (its batch unreadable: "
                                  f"{type(e).__name__}; killed, e.g. out of memory?)")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)

    def _check_alive(self) -> None:
        """A worker that raised exits 0 after its error message (complete: a queue is flushed at exit), which
        is raised here; one that died otherwise (a signal, e.g. killed or out of memory) goes to `_lost`
        without its queue being read (a message it was writing may be cut)."""
        for i, p in enumerate(self.procs):
            if p.is_alive():
                continue
            if p.exitcode is not None and p.exitcode >= 0:
                while True:
                    try:
                        self._take(self.results[i].get(timeout=2.0))
                    except queue.Empty:
                        break
            self._lost(i, f"died with exit code {p.exitcode} and no error message (killed, e.g. out of memory?)")

    def _restart(self, i: int) -> None:
        self.procs[i].join(timeout=5)
        _discard(self.jobs[i], self.results[i])  # what the dead worker held or sent is resubmitted
        self._start(i)

    def _publish(self, weights: dict, version: int) -> None:
        self.shared.write(weights, version)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        """End the workers: idle ones on a ``None`` job, busy ones killed (they hold nothing worth saving: the
        jobs in flight are regenerated on resume)."""
        self._finalizer()
        _discard(*self.jobs, *self.results)
