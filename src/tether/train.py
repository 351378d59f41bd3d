"""The training loop, and nothing else. One trainer step:

    examples --agent.rollout--> responses                          (tether.tasks.stream; tether.agents, tether.rollout)
             --reward--> scores (+ DAPO overlong shaping)           (tether.tasks.rewards, tether.algo)
             --advantage--> A                                       (tether.algo.advantages)
             --passes (no grad)--> old / anchor log-probs, KL heads (tether.passes: what runs is algo.loss_needs)
             --update--> epochs x mini-batches x micro-batches      (_update: compute_loss, tether.schedule's LR)
             --anchor update--> EMA / reset / kl_reset              (tether.anchor)
             --push--> the new weights version to the rollout workers (train.async.max_staleness >= 1)
             --log--> metrics.jsonl, samples.jsonl, checkpoint      (tether.report, tether.metrics, tether.rundir)

`Trainer` calls a run's pieces in this order; it moves tensors between them and decides nothing they
own (docs/architecture.md names each arrow's owner). It builds none of them: ``tether.assemble.build_parts``
makes them from the config, and `build_trainer` is both in one call. The
mathematics lives in ``tether.algo`` and ``tether.anchor``. Under ``torchrun`` the policy is
sharded with FSDP2 and rollouts are data-parallel: the loop calls ``tether.distributed``'s helpers
(``rank_share``, ``lockstep``, ``gathered``, ``all_reduce``...), no-ops in a single process.
With ``train.async`` (max_staleness K >= 1) the rollout arrow runs ahead in worker processes
(``tether.asynchronous``: ``feed``, the trainer's side; ``workers``, local processes; ``served``, vLLM servers
driven as jobs with ``rollout.engine.kind=vllm_server``; docs/async.md):
the trainer submits each step's examples as a job, takes the batch of the oldest job (sampled by weights at most K
updates old) and scores it, and pushes its weights after each step; K = 0 is the synchronous loop, unchanged.
`train` / `resume` run a Trainer inside its locked run directory (``tether.rundir.guard``).
"""

from __future__ import annotations

import contextlib
import math
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import torch

from . import distributed as dist
from .agents import env_correct, reward_parts
from .algo import LossInputs, compute_advantages, compute_loss, overlong_penalty, zero_variance_groups
from .algo.correction import lr_scale
from .assemble import RunParts, build_parts
from .asynchronous.feed import rank_groups
from .asynchronous.partial import token_metrics
from .asynchronous.weights import WeightSyncError
from .asynchronous.workers import WorkerError
from .config import Config
from .config.recipes import describe
from .errors import ConfigError, GenerationError
from .logprobs import response_stats
from .loop import run_guarded, run_steps
from .memory import malloc_trim
from .metrics import UpdateStats, peak_memory_mb
from .optim import optimizer_step, skipped_update_line
from .passes import StepBatch, exact_kl_sample, forwarded_positions, head_inputs, idle_backward, micro_batches
from .report import rollout_metrics, sample_rows
from .resolve.saved import resume_config
from .rollout import RolloutBatch, SamplingParams
from .rollout.servers import ServerError
from .rundir.checkpoint import checkpoints, load_checkpoint, save_checkpoint
from .rundir.guard import RunDirectory
from .rundir.stop import resume_hint
from .tasks import Example


class StepProbes:
    """The trainer's public hook for observing a step: ``Trainer.probes``. ``phase(name)`` is a context manager
    around each phase of `Trainer.train_step` (rollout, sampler pass, anchor pass, update), ``optimizer_step()`` one
    around each optimizer step. This one observes nothing; `StepMemory` (bench/_memory.py) puts its own on the trainer
    for one step (the memory of each phase, the gradients before the step and the optimizer state after it)."""

    def phase(self, name: str):
        return contextlib.nullcontext()

    def optimizer_step(self):
        return contextlib.nullcontext()


class Trainer:
    """Runs a run's parts (`tether.assemble.RunParts`: the model, engine, agent, anchor, optimizer, data stream...);
    ``run()`` trains to ``train.steps``. It reads ``cfg``'s sections each step and builds nothing from it;
    ``build_trainer(cfg, run_dir)`` builds the parts and the trainer in one call.
    """

    stopped_by: Optional[str] = None  # "SIGINT" / "SIGTERM" after run() stopped early on that signal

    def __init__(self, cfg: Config, parts: RunParts, log=print):
        if not isinstance(parts, RunParts):  # the earlier Trainer(cfg, run_dir, ...)
            raise TypeError(f"Trainer(cfg, parts) runs a run's built parts, got {type(parts).__name__} {parts!r}: "
                            f"build_trainer(cfg, run_dir, ...) (tether.train) builds them and the Trainer")
        self.cfg, self.log = cfg, log
        self.run_dir, self.guard = parts.run_dir, parts.guard  # the guard: a resume checks the checkpoint with it
        self.data, self.score_rewards = parts.data, parts.score_rewards
        self.held_out, self.reward_errors = parts.held_out, parts.reward_errors
        self.model, self.tokenizer, self.params = parts.model, parts.tokenizer, parts.params
        self.device = next(self.model.parameters()).device
        self.engine, self.agent = parts.engine, parts.agent
        self.anchor, self.optimizer, self.schedule = parts.anchor, parts.optimizer, parts.schedule
        self.scheduler = self.schedule.scheduler
        self.needs, self.passes = parts.needs, parts.passes
        self.step, self.skipped_updates = 0, 0
        t = cfg.train
        # Under FSDP all ranks must make the same forward calls with gradients: the shared-prompt forward
        # makes two when a micro-batch repeats a prompt (data-dependent), so only no-grad passes share.
        self._share_grad = t.share_prompt and not dist.enabled()
        self._fwd = dict(temperature=cfg.rollout.temperature, chunk_size=t.logprob_chunk)  # as every pass runs
        self._trim = malloc_trim if t.malloc_trim else (lambda: False)  # after the rollout and the update
        self.probes = StepProbes()  # observers of each step's phases (bench/_memory.py's StepMemory)
        self.feed = parts.feed  # train.async: jobs to the rollout workers, batches back
        self._sync_error: Optional[ServerError] = None  # the servers failed to take the weights (raised next step)

    # ------------------------------------------------------------ rollout and rewards

    def _sampling(self, round_: int) -> SamplingParams:
        return SamplingParams.for_step(self.cfg.rollout, self.cfg.train.seed, self.step, round_)

    def _score(self, rb: RolloutBatch, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewards [B] (with DAPO's overlong shaping when on) and correctness [B] of one rollout."""
        r = self.cfg.rollout
        rewards, correct, errors = self.score_rewards(rb.texts, examples)
        self.reward_errors.add(errors, self.step + 1)
        rew = torch.tensor(rewards, dtype=torch.float32) + torch.tensor(reward_parts(rb))  # + an environment's parts
        if r.overlong_buffer_frac > 0:
            rew = rew - overlong_penalty(rb.response_lengths, r.max_new_tokens, r.overlong_buffer_frac,
                                         r.overlong_penalty)
        return rew, torch.tensor([c or e for c, e in zip(correct, env_correct(rb))])  # or the environment's verdict

    def _rollout(self) -> tuple[StepBatch, dict]:
        """Generate one step's groups (refilling with new prompts under dynamic sampling), score them."""
        if self.feed is not None:
            return self._async_rollout()
        r = self.cfg.rollout
        kept, seen, n_groups, rounds = [], [], 0, 0
        while True:
            # every rank reads the same stream and generates whole groups for its share of the prompts
            examples = self.data.take(r.prompts_per_step - n_groups)[dist.rank_slice(r.prompts_per_step - n_groups)]
            with dist.gathered(self.model):
                rb = self.agent.rollout(examples, self._sampling(rounds))
            ex_rows = [examples[int(g)] for g in rb.group]
            rew, cor = self._score(rb, ex_rows)
            seen.append((rb, rew, cor))
            keep = ~zero_variance_groups(rew, rb.group) if r.dynamic_sampling else torch.ones(len(rb), dtype=torch.bool)
            if keep.any():
                idx = keep.nonzero().flatten().tolist()
                kept.append((rb.select(idx), [ex_rows[i] for i in idx], rew[idx], cor[idx]))
                n_groups += len(set(rb.group[idx].tolist()))
            if not r.dynamic_sampling or n_groups >= r.prompts_per_step or rounds >= r.max_refill_rounds:
                break
            rounds += 1
        if not kept:  # dynamic sampling found no informative group: train on the last batch (zero advantages)
            kept = [(rb, ex_rows, rew, cor)]
        batch, stats = self._step_batch(kept, seen, self.agent.metrics())
        if r.dynamic_sampling:
            stats.update(ds_rounds=rounds + 1, ds_groups_kept=n_groups)
        return batch, stats

    def _async_rollout(self) -> tuple[StepBatch, dict]:
        """K >= 1: the oldest job's batch (``tether.asynchronous.feed``; under torchrun rank 0 takes it, every rank
        trains on its share of the prompts), scored."""
        got, staleness, feed_stats = self.feed.next(self.step)
        rb, examples = rank_groups(got.rb, got.job.examples, self.cfg.rollout.prompts_per_step)
        ex_rows = [examples[int(g)] for g in rb.group]
        rew, cor = self._score(rb, ex_rows)
        batch, stats = self._step_batch([(rb, ex_rows, rew, cor)], [(rb, rew, cor)], got.agent_metrics,
                                        stale=staleness > 0)  # a stale batch: pi_old recomputed by the sampler pass
        stats.update(feed_stats)
        if got.token_version is not None:  # partial rollouts: staleness above is the oldest token's
            stats.update(token_metrics(got, self.step))
        return batch, stats

    def _step_batch(self, kept: list, seen: list, agent_metrics: dict, stale: bool = False) -> tuple[StepBatch, dict]:
        """The StepBatch of the kept (rollout, examples, rewards, correct) with its advantages, and the rollout
        metrics over every generation round ``seen``; ``stale``: sampled by older weights (StepBatch.stale)."""
        r = self.cfg.rollout
        rb = RolloutBatch.concat([k[0] for k in kept])
        rewards, correct = torch.cat([k[2] for k in kept]), torch.cat([k[3] for k in kept])
        # on the global batch (all ranks' rows in rank order), so batch-level normalizations see all of it
        all_rewards, offset = dist.all_gather_cat(rewards)
        all_groups, _ = dist.all_gather_cat(rb.group + dist.rank() * (r.prompts_per_step // dist.world_size()))
        adv = compute_advantages(self.cfg.algo.advantage, all_rewards, all_groups,
                                 self.cfg.algo.adv_eps)[offset:offset + len(rewards)]
        loss_mask = rb.loss_mask.clone()
        if r.mask_truncated:
            loss_mask[torch.tensor([f == "length" for f in rb.finish_reason], dtype=torch.bool)] = False
        stats = rollout_metrics(seen, all_rewards, all_groups, agent_metrics)
        batch = StepBatch(rb=rb.to(self.device), examples=[e for k in kept for e in k[1]], rewards=rewards,
                          correct=correct, adv=adv.to(self.device), loss_mask=loss_mask.to(self.device),
                          row_offset=offset, global_rows=len(all_rewards), stale=stale)
        return batch, stats

    # ------------------------------------------------------------ update

    def _loss_inputs(self, b: StepBatch, idx: list[int], num_tokens: float, num_seqs: int):
        """Forward micro-batch ``idx`` with gradients; returns its LossInputs and token entropies [B, T]."""
        mb, n = b.rb.select(idx), self.needs
        T = mb.response_ids.shape[1]
        sl = lambda x: None if x is None else x[idx, :T]  # noqa: E731  rows idx, columns of this micro-batch
        head_ids = sl(b.head_ids)
        st = response_stats(self.model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
                            gather_ids=head_ids if n.k else None, entropy=True, share_prompt=self._share_grad,
                            packed=self.cfg.train.packing, **self._fwd)
        mask = b.loss_mask[idx, :T]
        kw = head_inputs(n, st, head_ids, sl(b.head_ref_logp), mb.response_ids, mask)  # as loss_needs says
        # the engine's log-probs, whenever the batch has them: the correction, and the rollout_corr/* metrics (ESS)
        inputs = LossInputs(logp=st.logp, mask=mask, adv=b.adv[idx], old_logp=sl(b.old_logp), ref_logp=sl(b.ref_logp),
                            sampler_logp=mb.sampler_logp, num_tokens=num_tokens, num_seqs=num_seqs,
                            max_len=self.cfg.rollout.max_new_tokens, **kw)
        return inputs, st.entropy.detach()

    def _update(self, b: StepBatch) -> dict:
        """epochs x mini-batches of optimizer steps, each accumulating micro-batch gradients.

        Mini-batches are slices of a permutation of the *global* batch (``b.global_rows`` rows; this
        rank holds rows ``[b.row_offset, b.row_offset + len(b.rb))``); each rank trains on the rows
        of a mini-batch it holds, with the global mini-batch's token and sequence counts, so the
        summed gradient is the single-process one. Every rank runs as many micro-batches as the
        busiest (``dist.lockstep``: each backward reduce-scatters the gradients under FSDP).
        """
        t, B, stats = self.cfg.train, b.global_rows or len(b.rb), UpdateStats()
        if t.lr_scale != "none" and b.rb.sampler_logp is None:
            raise ConfigError(f"train.lr_scale={t.lr_scale} needs the engine's log-probs of the sampled tokens, and "
                              f"step {self.step + 1}'s batch has none (rollout.agent.kind="
                              f"{self.cfg.rollout.agent.kind} did not pass them on)")
        if self.needs.sampler_logp and b.rb.sampler_logp is None:
            off = " (or train.async.correction=false: the lag uncorrected)" if t.max_staleness else ""
            raise ConfigError(f"the rollout correction (algo.tis_cap / algo.mask_* / algo.kl_sampler=mu) needs the "
                              f"engine's log-probs of the sampled tokens, and step {self.step + 1}'s batch has none: "
                              f"rollout.agent.kind={self.cfg.rollout.agent.kind} did not pass them on{off}")
        g = torch.Generator().manual_seed(t.seed * 31337 + self.step)
        for _ in range(t.epochs):
            perm = torch.randperm(B, generator=g).tolist() if t.mini_batches > 1 else list(range(B))
            size = math.ceil(B / t.mini_batches)
            for gmini in (perm[i:i + size] for i in range(0, B, size)):
                mini, n_tok = dist.rank_share(gmini, b.row_offset, b.loss_mask)  # my rows; global token count
                micro = micro_batches(b.rb, mini, t.micro_batch_size, t.share_prompt, t.micro_batch_tokens, t.packing)
                losses = []
                for idx in dist.lockstep(micro, idle=lambda: idle_backward(self.model, b.rb, **self._fwd)):
                    inputs, entropy = self._loss_inputs(b, idx, max(n_tok, 1.0), len(gmini))
                    out = compute_loss(self.cfg.algo, inputs)
                    out.loss.backward()
                    losses.append(out.loss.detach())
                    stats.add(out.metrics, torch.where(inputs.mask, entropy, 0).sum(), inputs.mask.sum(),
                              b.rb.prompt_mask[idx].sum() + b.rb.response_mask[idx].sum(),
                              forwarded_positions(b.rb, idx, t.packing))
                stats.end_mini_batch()
                loss = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
                self._optimizer_step(loss, stats)
        return {**stats.result(reduce=dist.all_reduce), "lr": self.scheduler.get_last_lr()[0],
                "skipped_updates": self.skipped_updates}

    def _optimizer_step(self, loss: torch.Tensor, stats: UpdateStats) -> None:
        """Clip, then step (skipped, weights unchanged, if the loss or gradient is not finite on any rank); with
        ``train.lr_scale`` at the scheduled LR times the ESS multiplier of the mini-batch just ended
        (`tether.algo.correction.lr_scale`; its sums all-reduced, so every rank applies the same)."""
        t, scale = self.cfg.train, None
        if t.lr_scale != "none":
            ess = stats.mini_batch_ess("token" if t.lr_scale == "ess" else "sequence", reduce=dist.all_reduce)
            scale = lr_scale(ess, t.lr_scale_floor, t.lr_scale_power)
            stats.record_lr_scale(scale)
        with self.probes.optimizer_step():
            gn = optimizer_step(self.params, self.optimizer, self.scheduler, loss, t.grad_clip, lr_scale=scale)
        if gn is None:
            self.skipped_updates += 1
            self.log(skipped_update_line(self.step + 1, self.skipped_updates))
            return
        stats.optimizer_step(gn)

    # ------------------------------------------------------------ one step, the run

    def train_step(self) -> dict:
        """One trainer step; returns its metrics row."""
        self._raise_sync_error()  # the servers failed to take the last step's weights
        t0, probe = time.perf_counter(), self.probes.phase
        try:
            with probe("rollout"):
                b, m = self._rollout()
        except GenerationError as e:  # non-finite logits, an overlong prompt, a rollout worker: say at which step
            raise type(e)(f"trainer step {self.step + 1}: {e}") from e
        self._trim()  # train.malloc_trim: the rollout's KV cache and generation buffers are freed, return their pages
        t1 = time.perf_counter()
        with probe("sampler pass"):
            self.passes.sampler(b)
        t2 = time.perf_counter()
        with probe("anchor pass"):
            anchored = self.passes.anchor_pass(b)
        exact = self._exact_kl(b) if anchored else None
        t3 = time.perf_counter()
        with probe("update"):
            upd = self._update(b)
        self._trim()  # and those of the gradients and activations
        t4 = time.perf_counter()
        self.step += 1
        moved = False
        if self.anchor is not None:
            moved = self.anchor.update(self.model, self.step, token_kl=upd.get("kl"))
        t5 = time.perf_counter()
        self._sync_weights()
        m.update(upd, time_sync_s=time.perf_counter() - t5)
        if exact is not None:
            m["exact_kl_sample"] = exact
        m.update(time_rollout_s=t1 - t0, time_sampler_pass_s=t2 - t1, time_anchor_pass_s=t3 - t2,
                 time_update_s=t4 - t3, time_step_s=time.perf_counter() - t0,
                 train_tokens_per_s=upd["train_tokens"] / max(t4 - t3, 1e-9), reward_errors=self.reward_errors.count,
                 anchor_updates=self.anchor.num_updates if self.anchor is not None else 0, anchor_moved=moved,
                 **peak_memory_mb())
        self._last_batch = b
        return m

    def _sync_weights(self) -> None:
        """The new weights to the engine's copy (vLLM, vLLM servers) and the rollout workers. A served engine that
        fails here is raised at the next step (`_raise_sync_error`): this step's update is done, so its row and
        checkpoint are written first and ``--resume`` continues after it."""
        try:
            if self.feed is None or self.feed.served is None:
                self.engine.sync_weights(self.model)  # a copy's engine gets the new weights here
            if self.feed is not None:
                self.feed.push(self.model, self.step)  # the next jobs sample with this version (served: in flight)
        except ServerError as e:
            self._sync_error = e

    def _raise_sync_error(self) -> None:
        if self._sync_error is not None:
            raise self._sync_error

    def _exact_kl(self, b: StepBatch) -> Optional[float]:
        """The exact-KL diagnostic on the first ``run.exact_kl_samples`` responses (None when off)."""
        kl = exact_kl_sample(self.model, self.anchor, b.rb, self.cfg.run.exact_kl_samples,
                             share_prompt=self.cfg.train.share_prompt, **self._fwd)
        return kl if kl is None else dist.all_reduce(kl) / dist.world_size()  # the mean of the ranks' samples

    def state(self) -> dict:
        st = {"data_position": self.data.position, "skipped_updates": self.skipped_updates,
              "reward_errors": self.reward_errors.count, "schedule": self.schedule.plan}
        if self.feed is not None:  # the jobs in flight are not saved: a resume regenerates them
            st.update(data_position=self.feed.position, async_=self.feed.state())
        return st

    def save(self) -> Path:
        return save_checkpoint(self.run_dir, self.step, self.model, self.anchor, self.optimizer, self.scheduler,
                               self.state(), keep=self.cfg.run.keep_checkpoints)

    def restore(self, ckpt: Path) -> None:
        st = load_checkpoint(ckpt, self.model, self.anchor, self.optimizer, self.scheduler)
        self.step = st["step"]
        self.data.position = st["data_position"]
        self.skipped_updates = st["skipped_updates"]
        self.reward_errors.count = st["reward_errors"]
        if "schedule" in st:  # absent in checkpoints written before it was saved: those keep the config's schedule
            self.schedule.continue_from(st["schedule"], self.step, self.run_dir)
        if self.feed is None or self.feed.served is None:
            self.engine.sync_weights(self.model)
        if self.feed is not None:  # restored before the first job: nothing is in flight
            self.feed.restore(st.get("async_", {}), self.step, self.data.position)
            self.feed.push(self.model, self.step)

    def close(self) -> None:
        """Stop the rollout workers (K >= 1) and the servers tether launched (rollout.engine.kind=vllm_server);
        ``run()`` calls it however it ends."""
        if self.feed is not None:
            self.feed.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def run(self, resume: bool = False) -> Path:
        """Train until ``train.steps`` (`tether.loop.run_steps`); checkpoints every ``run.save_every`` steps and at
        the end.

        SIGINT / SIGTERM stop the run gracefully (``tether.rundir.stop``): the step in progress finishes,
        a checkpoint is written, and ``run()`` returns with ``self.stopped_by`` set to the signal's
        name; a second signal aborts at once (``tether.rundir.stop.Aborted``).
        """
        self.stopped_by = None
        try:
            self.stopped_by = run_steps(self, self.cfg.train.steps, resume, title=f"tether {self.cfg.recipe}",
                                        main=dist.is_main(), final_checkpoint=self.cfg.run.final_checkpoint)
            self._raise_sync_error()  # after the last step: its row and checkpoint are written
        except (WorkerError, WeightSyncError, ServerError) as e:  # the last completed step checkpointed, then the error
            raise self._checkpointed(e) from e
        finally:
            self.close()  # the rollout workers end with the run: normally, on an error or a stop signal
        self.held_out.after(self.run_dir, self.step)  # the before -> after line
        return self.run_dir

    # the evaluations and samples of the run loop (tether.loop.run_steps)

    def evaluate_start(self, resume: bool) -> dict:
        """The initial policy on the held-out sets (eval.before), logged at step 0; {} when not due."""
        due = self.held_out.due_before(self.step)
        return self.held_out.before(self.model, self.agent, self.engine, self.anchor) if due else {}

    def evaluate_step(self) -> dict:
        """The held-out sets after this step when due (eval.every, eval.after), else {}."""
        due = self.held_out.due(self.step) and self._sync_error is None  # (not on servers that missed the weights)
        return self.held_out.evaluate(self.model, self.agent, self.engine, self.anchor) if due else {}

    def sample_rows(self) -> list:
        """The last step's first run.log_samples prompts and responses, for samples.jsonl."""
        return sample_rows(self._last_batch, self.cfg.run.log_samples)

    def _checkpointed(self, e: GenerationError) -> GenerationError:
        """``e`` (a rollout worker that failed, or failed sync) with a checkpoint of the last completed step: its
        weights are unaffected (the failed step never reached its update), so ``--resume`` continues there."""
        if self.step == 0:
            return type(e)(f"{e}; no step completed, nothing to checkpoint")
        latest = next(iter(checkpoints(self.run_dir)), None)  # run.save_every may have written this step's already
        ckpt = latest if latest is not None and latest.name == f"step-{self.step:06d}" else self.save()
        return type(e)(f"{e}; step {self.step}'s checkpoint: {ckpt} (resume with: {resume_hint(self.run_dir)})")


def build_trainer(cfg: Config, run_dir: Path, model=None, tokenizer=None, log=print,
                  run_guard: Optional[RunDirectory] = None) -> Trainer:
    """The run's parts (`tether.assemble.build_parts`: the cheap checks, then the run directory, then the model) and
    the Trainer that runs them. ``run_guard`` (`tether.rundir.guard.RunDirectory`, passed by `train` / `resume`)
    creates, locks and checks the run directory once the data, reward, tools and held-out sets have loaded, before
    the model does; it writes config.yaml (a resume: after the checkpoint is restored). Without it (tests,
    benchmarks) the directory is only created."""
    dist.init()  # (build_parts also applies load_config's asynchronous default to a Config built in Python)
    log = log if dist.is_main() else (lambda *a, **k: None)
    parts = build_parts(cfg, run_dir, model, tokenizer, log=log, run_guard=run_guard)
    return Trainer(cfg, parts, log=log)


def default_run_dir(cfg: Config) -> Path:
    task = Path(cfg.data.task).stem.replace("/", "_")
    return Path("runs") / f"{cfg.recipe}-{task}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def train(cfg: Config, run_dir: Optional[Path] = None, model=None, tokenizer=None, log=print) -> Path:
    """Train a fresh run; returns the run directory (config.yaml, metrics.jsonl, checkpoints/, curves.png).

    The directory must be new or empty (``run.overwrite`` deletes an old run's contents first) and is
    locked while the run trains; see `tether.rundir.guard`.
    """
    dist.init()
    if not (run_dir or cfg.run.output_dir) and dist.enabled():  # one timestamped name for all ranks
        run_dir = Path(dist.all_gather_objects(str(default_run_dir(cfg)))[0])
    run_dir = Path(run_dir or cfg.run.output_dir or default_run_dir(cfg))
    if dist.is_main():
        log(f"[tether] {describe(cfg.algo)}")
    guard = RunDirectory(run_dir, fresh=True, overwrite=cfg.run.overwrite, log=log)
    return run_guarded(guard, lambda: build_trainer(cfg, run_dir, model, tokenizer, log=log, run_guard=guard),
                       resume=False)


def resume(run_dir: Path, overrides: Optional[dict] = None, model=None, tokenizer=None, log=print) -> Path:
    """Continue a run from its newest valid checkpoint (``overrides`` may extend e.g. train.steps).

    Every rank reads the saved config here; rank 0 rewrites it with the overrides only once the
    checkpoint has been restored (a resume that fails leaves config.yaml as it was).
    """
    run_dir = Path(run_dir)
    cfg = resume_config(run_dir, overrides)
    dist.init()
    guard = RunDirectory(run_dir, fresh=False, log=log)
    return run_guarded(guard, lambda: build_trainer(cfg, run_dir, model, tokenizer, log=log, run_guard=guard),
                       resume=True)
