"""The trainer's side of asynchronous rollouts (``train.async.max_staleness`` K >= 1; docs/async.md).

`RolloutFeed` hands the rollout workers (`tether.asynchronous.workers`, or `tether.asynchronous.remote` on other nodes)
each step's examples as a job, takes back the batch of the oldest job, drops or keeps one older than K
versions (``train.async.stale_batches``), and keeps what a checkpoint needs: the jobs consumed, the data position
after the last consumed job, the dropped batches, the staleness histogram.

Under torchrun the workers belong to rank 0: it reads the data stream, submits the jobs and takes each batch,
which every rank then receives (`tether.distributed.on_main`: a worker's failure is raised on every rank, so
all of them checkpoint and stop together). Each rank trains on its share of the batch's prompts (`rank_groups`:
the rows of its `rank_slice` of the groups, as in the synchronous loop, where a rank generates exactly those).
The weights are pushed from rank 0 inside `tether.distributed.gathered` (the full FSDP2 weights, gathered
on every rank; the vLLM probe's forward is then local).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from .. import distributed as dist
from ..rollout.base import RolloutBatch, SamplingParams
from ..tasks import Example
from .served import ServedPool
from .workers import Job, Rollout, RolloutWorkers


def rank_groups(rb: RolloutBatch, examples: list[Example], prompts: int) -> tuple[RolloutBatch, list[Example]]:
    """This rank's rows of a whole step's batch ``rb`` (groups 0..``prompts``-1, one per example): the groups
    of its `tether.distributed.rank_slice`, renumbered from 0, with their examples. The batch itself at world
    size 1."""
    if not dist.enabled():
        return rb, examples
    sl = dist.rank_slice(prompts)
    idx = [i for i, g in enumerate(rb.group.tolist()) if sl.start <= g < sl.stop]
    mine = rb.select(idx)
    mine.group = mine.group - sl.start
    return mine, examples[sl]


class RolloutFeed:
    """Jobs out, batches back, staleness checked (see the module doc); one per trainer, on every rank.

    Args:
        cfg: the run's `tether.config.Config`.
        model: the trainer's policy, pushed now as ``version``.
        take: the trainer's data stream's ``take(n)`` (`tether.tasks.stream.PromptStream`); ``position()``: its
            position after the last take.
        sampling: job id -> its `SamplingParams` (the seed of the synchronous step of that index).
    """

    def __init__(self, cfg, model, take: Callable[[int], list[Example]], position: Callable[[], int],
                 sampling: Callable[[int], SamplingParams], version: int, log: Callable, tokenizer,
                 served: Optional[tuple] = None):
        a = cfg.train.async_
        self.cfg, self.take, self.where, self.sampling = cfg, take, position, sampling
        self.submitted = self.consumed = 0  # job ids; no drops: job i trains step i + 1
        self.position = position()  # the data position after the last consumed job
        self.dropped = self.restarts = 0
        lookahead = max(a.max_staleness + 1, a.workers)
        self.staleness_counts = [0] * lookahead  # index: staleness
        self.pool = None  # rank 0's workers
        #: the served engine the jobs drive (rollout.engine.kind=vllm_server): pushes update its servers, on every
        #: rank (its weight transfer gathers FSDP2 shards collectively); None: local worker processes
        self.served = served[0] if served is not None else None
        if self.served is not None:
            engine, make_agent = served
            dist.on_main(lambda: setattr(self, "pool", ServedPool(engine, [make_agent() for _ in range(lookahead)],
                                                                  lookahead=lookahead, log=log)))
            return

        def start():  # local processes, weights through shared memory
            self.pool = RolloutWorkers(cfg, model, n=a.workers, lookahead=lookahead, verify=a.verify_sync,
                                       version=version, log=log, tokenizer=tokenizer)

        with dist.gathered(model):
            dist.on_main(start)

    def next(self, step: int) -> tuple[Rollout, int, dict]:
        """Top the jobs up, take the oldest job's batch; one more than K versions older than ``step`` is dropped
        (its prompts skipped) and the next taken, or kept (``train.async.stale_batches``). Returns the rollout, its
        staleness and the ``async/*`` metrics."""
        got, staleness, wait, self.submitted, self.consumed, self.position, self.dropped, self.restarts = \
            dist.on_main(lambda: self._take(step))
        self.staleness_counts[staleness] += 1
        stats = {"async/staleness": staleness, "async/version": got.version, "async/worker": got.worker,
                 "async/dropped": self.dropped, "async/wait_s": wait, "async/worker_gen_s": got.gen_s,
                 "async/worker_load_s": got.load_s, "async/restarts": self.restarts,
                 **{f"async/staleness_{k}": c for k, c in enumerate(self.staleness_counts)}}
        return got, staleness, stats

    def _take(self, step: int) -> tuple:
        a, wait = self.cfg.train.async_, 0.0
        while True:
            while self.pool.wants_job():  # one step's examples and seed per job
                examples = self.take(self.cfg.rollout.prompts_per_step)
                self.pool.submit(Job(self.submitted, examples, self.sampling(self.submitted), self.where()))
                self.submitted += 1
            w0 = time.perf_counter()
            got = self.pool.next_batch()
            wait += time.perf_counter() - w0
            self.consumed, self.position = got.job.id + 1, got.job.position
            staleness = step - got.version
            if staleness <= a.max_staleness or a.stale_batches == "keep":
                break
            self.dropped += 1  # (counted at once: a failure at the next batch checkpoints the job count with it)
        return (got, staleness, wait, self.submitted, self.consumed, self.position, self.dropped,
                self.pool.restarts)

    def push(self, model, version: int) -> None:
        """Publish the policy's weights as ``version`` (every rank calls it: the full weights are gathered)."""
        if self.served is not None:  # the servers, updated in flight (every rank takes part in the transfer)
            self.served.sync_weights(model, version=version)
            return
        with dist.gathered(model):
            dist.on_main(lambda: self.pool.push(model, version))

    def state(self) -> dict:
        """What a checkpoint keeps (the jobs in flight are not saved: a resume regenerates them)."""
        return {"jobs": self.consumed, "dropped": self.dropped, "staleness": self.staleness_counts}

    def restore(self, st: dict, step: int, position: int) -> None:
        """Continue from a checkpoint's `state` (restored before the first job: nothing is in flight)."""
        self.submitted = self.consumed = st.get("jobs", step)
        self.position, self.dropped = position, st.get("dropped", 0)
        for k, c in enumerate(st.get("staleness", [])[:len(self.staleness_counts)]):
            self.staleness_counts[k] = c

    def close(self) -> None:
        """Stop the workers (rank 0's); the trainer calls it however the run ends."""
        if self.pool is not None:
            self.pool.close()
