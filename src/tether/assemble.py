"""A run's parts, built from its config: the one place the trainer's pieces are made. `tether.train.Trainer` runs
them; it reads its config's sections each step but builds nothing from it.

    parts = build_parts(cfg, run_dir)      # checked and loaded in this order:
        the agent's plan and tools         (tether.agents.build: an environment's corpus is checked here)
        the prompt stream and the reward   (tether.tasks.stream: every row checked)
        the held-out sets                  (tether.eval.held_out)
        the run directory                  (tether.rundir.guard: created and locked once the cheap checks pass)
        the model (FSDP2 under torchrun)   (tether.models, tether.distributed)
        the engine and the agent on it     (tether.rollout, tether.agents)
        the anchor, optimizer, LR schedule (tether.anchor, tether.optim, tether.schedule)
        the passes                         (tether.passes: what runs is algo.loss_needs)
        the rollout feed (train.async)     (tether.asynchronous.feed: its workers start last)
    trainer = Trainer(cfg, parts)

``tether.train.build_trainer(cfg, run_dir)`` is both in one call, for `train`, `resume`, tests and benchmarks; a
caller with a policy already loaded passes it (``model``, ``tokenizer``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from . import distributed as dist
from . import models  # models.load_model: an attribute read at call time (tests patch it)
from .agents import Agent
from .agents.build import RolloutPlan
from .algo import LossNeeds, loss_needs
from .anchor import Anchor, make_anchor
from .asynchronous.feed import RolloutFeed
from .config import Config
from .eval.held_out import HeldOut
from .optim import make_adamw
from .passes import Passes
from .report import RewardErrorLog
from .resolve import apply_async_correction, evaluating
from .rollout import Engine, SamplingParams
from .rundir.guard import RunDirectory
from .schedule import LRSchedule
from .sections import replace
from .tasks.stream import PromptStream, prompt_stream, training_reward


@dataclass
class RunParts:
    """What a `tether.train.Trainer` runs, built by `build_parts`."""

    run_dir: Path
    guard: Optional[RunDirectory]  # the run directory's lock and checks (train / resume; None: only created)
    data: PromptStream  # the training prompts, in the run's order (its position is checkpointed)
    score_rewards: Callable  # (texts, examples) -> (rewards, correct, errors): data.reward, or the environment's
    held_out: HeldOut  # eval.*'s sets (none if the run does not evaluate)
    model: torch.nn.Module  # the policy (FSDP2-sharded under torchrun)
    tokenizer: Any
    params: list  # the policy's trained parameters (requires_grad: all, or LoRA's)
    engine: Engine  # the trainer's own engine (with train.async K >= 1 it only serves the held-out evaluation)
    agent: Agent  # the agent driving it
    anchor: Optional[Anchor]  # algo.anchor's policy (None: no anchor term)
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    reward_errors: RewardErrorLog  # reward exceptions, counted; the first of each kind logged
    needs: LossNeeds  # which log-probabilities and KL heads the loss reads
    passes: Passes  # the no-grad passes that compute them
    feed: Optional[RolloutFeed]  # train.async (K >= 1): jobs to the rollout workers, batches back (None: K = 0)


def trainer_engine_config(cfg: Config):
    """rollout.* for the trainer's own engine. With K >= 1 the workers sample; the trainer's engine only serves
    the held-out evaluation (and its agent encodes prompts), so a run that does not evaluate gives the trainer
    the hf engine on its own model, not a second vLLM copy of the weights reloaded every step."""
    r = cfg.rollout
    if cfg.train.max_staleness > 0 and r.engine.kind not in ("hf", "vllm_server") and not evaluating(cfg):
        return replace(r, engine="hf")  # (a served engine is the one the jobs drive: the trainer holds it)
    return r


def build_parts(cfg: Config, run_dir: Path, model=None, tokenizer=None, log=print,
                run_guard: Optional[RunDirectory] = None) -> RunParts:
    """Every part of a run, the cheap checks first: a bad config, row, reward or corpus fails before a run directory
    is made and before the (slow) model load. ``run_guard`` (`tether.rundir.guard.RunDirectory`, passed by `train` /
    `resume`) creates, locks and checks the run directory; without it (tests, benchmarks) the directory is only
    created. ``model`` / ``tokenizer``: a policy already loaded (else ``cfg.model``'s). Under torchrun it joins the
    process group first; a Config built in Python gets load_config's asynchronous default here (in place)."""
    dist.init()
    apply_async_correction(cfg)
    t, run_dir = cfg.train, Path(run_dir)
    engine_cfg = trainer_engine_config(cfg)
    served = engine_cfg.engine.kind == "vllm_server"  # the servers' logs in RUN/servers/, their seed the run's
    random.seed(t.seed)
    torch.manual_seed(t.seed)
    plan = RolloutPlan(cfg)  # the agent and its tools, e.g. the search environment's retriever: corpus checked
    data = prompt_stream(cfg)  # tether.tasks.stream; validates every row
    score_rewards = training_reward(cfg.data, data, plan.env_reward)  # a bad reward spec fails here, too
    held_out = HeldOut.of(cfg, log)  # tether.eval.held_out: eval.*'s sets, loaded (none if it does not evaluate)
    dist.check_supported(cfg.rollout.prompts_per_step, cfg.rollout.dynamic_sampling)
    if run_guard is not None:
        run_guard.open(cfg)  # after the cheap checks (a bad config leaves no directory), before the model load
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
    if model is None:
        log(f"[tether] loading model {models.describe_model(cfg.model.name)}")
        model, tokenizer = models.load_model(cfg.model)
    model = dist.shard_model(model)  # FSDP2 under torchrun (before the engine, the optimizer and the anchor see it)
    rollout = plan.assemble(model, tokenizer, engine_cfg=engine_cfg,  # the engine, and the agent on it
                            engine_options=dict(log_dir=run_dir / "servers", seed=t.seed) if served else None)
    engine = rollout.engine
    prompts = getattr(rollout.agent, "prompts", None)  # the agent's PromptEncoder (tether.tasks.prompts)
    if prompts is not None and data.examples is not None:  # an overlong row fails now, not at its step
        prompts.check(data.examples, cfg.rollout.max_new_tokens)
    params = [p for p in model.parameters() if p.requires_grad]
    anchor = make_anchor(cfg.algo.anchor, model)
    reward_errors = RewardErrorLog(run_dir, log)  # counted; the first of each kind logged (a file once one fails)
    optimizer = make_adamw(params, t)
    # a resume that extends the run re-lays it (continue_from)
    schedule = LRSchedule(optimizer, t.schedule, t.warmup_steps, t.steps, t.lr, per_step=t.epochs * t.mini_batches)
    needs = loss_needs(cfg.algo, model.get_output_embeddings().weight.shape[0])
    passes = Passes(model, anchor, needs, on_policy=t.epochs == 1 and t.mini_batches == 1,
                    temperature=cfg.rollout.temperature, micro_batch_size=t.micro_batch_size,
                    chunk_size=t.logprob_chunk, share_prompt=t.share_prompt, micro_batch_tokens=t.micro_batch_tokens,
                    packed=t.packing)
    feed = None
    if t.max_staleness > 0:  # last: nothing after the workers start can fail
        feed = RolloutFeed(cfg, model, data.take, lambda: data.position,
                           lambda job: SamplingParams.for_step(cfg.rollout, t.seed, job), 0, log, tokenizer,
                           served=(engine, lambda: plan.agent(engine, tokenizer)) if served else None)
    return RunParts(run_dir=run_dir, guard=run_guard, data=data, score_rewards=score_rewards, held_out=held_out,
                    model=model, tokenizer=tokenizer, params=params, engine=engine, agent=rollout.agent,
                    anchor=anchor, optimizer=optimizer, schedule=schedule, reward_errors=reward_errors,
                    needs=needs, passes=passes, feed=feed)
