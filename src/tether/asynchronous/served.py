"""Asynchronous rollouts over served engines (``train.async`` with ``rollout.engine.kind=vllm_server``;
docs/async.md).

    trainer (rank 0)                                    vLLM servers (their own processes, on any node)
      submit(Job) -> a thread: agent.rollout(examples) --HTTP generate requests-->  generating while the trainer trains
      next_batch() <- the oldest job's batch, each token tagged with the weights version that sampled it
      push(model, version) --/pause?mode=keep, vLLM's weight transfer, probe, /resume-->  requests go on, new weights

No worker process holds a model: a job is a thread of the trainer that drives the run's agent on the shared
`tether.rollout.served.ServedEngine`, and the generation happens in the servers. Up to ``lookahead`` =
``max(max_staleness + 1, workers)`` jobs are in flight, so requests of the next steps are being answered while
the trainer updates. A push updates the servers in flight: the requests in progress are frozen (vLLM's pause
mode ``keep``), the weights replaced and verified, and the requests resume with the new weights; vLLM reports
which version sampled each token (``weight_versions``, `RolloutBatch.token_version`), so a batch's tokens may be
of several versions (partial rollouts, as `tether.asynchronous.partial` makes them on local workers), each with
the sampler's log-prob under the version that drew it.

The staleness bound holds unchanged: a job submitted at version v sends its first request after v was pushed,
so every token is sampled by a version >= v; the batch's version is its oldest token's (v when the agent keeps no
token versions, e.g. a multi-turn episode: a lower bound), and the trainer consumes at most ``lookahead - 1``
other jobs before it, so its staleness is at most ``lookahead - 1`` = K with the default ``workers``.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from ..rollout.servers import ServerError
from .workers import Job, Rollout, WorkerError


class ServedPool:
    """The `RolloutWorkers` interface (``wants_job``, ``submit``, ``next_batch``, ``push``, ``close``, ``restarts``)
    over a served engine (module doc). ``agents``: ``lookahead`` agents driving ``engine`` (one per job thread:
    an agent keeps per-batch metrics)."""

    def __init__(self, engine, agents: list, *, lookahead: int, log: Callable[[str], None] = print):
        if len(agents) < lookahead:
            raise ValueError(f"need {lookahead} agents, got {len(agents)}")
        self.engine, self.lookahead, self.log = engine, lookahead, log
        self.restarts = 0  # a server is not restarted by tether: a failure stops the run (after a checkpoint)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for a in agents[:lookahead]:
            self._free.put(a)
        self._jobs: list[tuple[Job, Future]] = []  # in submission order
        self._threads = ThreadPoolExecutor(max_workers=lookahead, thread_name_prefix="tether-job")

    def wants_job(self) -> bool:
        return len(self._jobs) < self.lookahead

    def submit(self, job: Job) -> None:
        version = self.engine.version  # pushed before this job: every token of it is sampled by this or newer
        self._jobs.append((job, self._threads.submit(self._run, job, version)))

    def _run(self, job: Job, version: int) -> Rollout:
        agent = self._free.get()
        try:
            t0 = time.perf_counter()
            rb = agent.rollout(job.examples, job.params)
            metrics = agent.metrics()
            gen_s = time.perf_counter() - t0
        finally:
            self._free.put(agent)
        rb = rb.to("cpu")
        tv = rb.token_version
        later: dict = {}
        oldest = version
        if tv is not None:
            seen = tv[rb.loss_mask & (tv >= 0)]
            if seen.numel():
                oldest = int(seen.min())
                later = {int(v): None for v in seen.unique().tolist() if int(v) > oldest}
        return Rollout(job=job, rb=rb, version=oldest, worker=0, checksum=None, agent_metrics=metrics, gen_s=gen_s,
                       token_version=tv, later=later)

    def next_batch(self) -> Rollout:
        """The oldest job's batch (waiting for it); a server's failure is a `WorkerError` naming the server."""
        job, fut = self._jobs.pop(0)
        try:
            return fut.result()
        except ServerError as e:
            raise WorkerError(f"job {job.id}: {e}") from e

    def push(self, model, version: int) -> None:
        """Update every server to ``version`` with the requests in flight (`ServedEngine.sync_weights`)."""
        self.engine.sync_weights(model, version=version)

    def close(self) -> None:
        """Stop waiting for the jobs in flight (their requests end with the servers; the engine is the trainer's
        to close)."""
        self._threads.shutdown(wait=False, cancel_futures=True)
