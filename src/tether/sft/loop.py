"""The SFT loop: one step takes the next batch of conversations (`tether.sft.batches.BatchPlan`), runs its
micro-batches forward and backward on the mean negative log-likelihood of the batch's trained tokens,
and updates the weights (`tether.optim`, the LR of `tether.schedule`).

    loss = - sum_{trained tokens t of the batch} log pi(x_t | x_<t)  /  (trained tokens of the batch)

Each micro-batch's part is divided by the whole batch's count, so the sum of the micro-batch
gradients is the batch's gradient whatever ``train.micro_batch_size`` is.

What it shares with ``tether train``: the model (`tether.models.load_model`: dtype, LoRA, a run
directory as the model), the run directory and its lock (`tether.rundir.guard.RunDirectory`, marker kind
``sft``), checkpoints with exact resume (`tether.rundir.checkpoint`: weights, AdamW, RNG; the data
position is the step, since each step takes one batch of a seeded order), the graceful stop
(`tether.rundir.stop`), metrics.jsonl (`tether.metrics`), the progress bar (`tether.metrics.Progress`) and
curves.png (`tether.plot`). `sft` / `resume_sft` run an `SFTTrainer` inside its locked directory.
"""

from __future__ import annotations

import math
import random
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import torch

from .. import models  # models.load_model: an attribute read at call time (tests patch it)
from ..config import flatten, to_dict
from ..config.sft import FROZEN_ON_RESUME, SFTConfig
from ..errors import ConfigError, RunError
from ..loop import run_guarded, run_steps
from ..metrics import peak_memory_mb
from ..optim import make_adamw, optimizer_step, skipped_update_line
from ..resolve.sft import load_sft_config
from ..rundir.checkpoint import load_checkpoint, save_checkpoint
from ..rundir.guard import RunDirectory, resumed_values
from ..schedule import LRSchedule
from .batches import BatchPlan, batch_logp, check_packing, collate, micro_batches
from .data import ChatEncoder, encode_all, read_conversations, resolve_max_length, split_validation


def _postfix(m: dict) -> dict:
    post = {"loss": f"{m['loss']:.4f}"}
    if "val_loss" in m:
        post["val"] = f"{m['val_loss']:.4f}"
    post["s/step"] = f"{m['time_step_s']:.1f}"
    return post


class SFTTrainer:
    """Owns the model, optimizer and data of one SFT run; ``run()`` trains to the last step.

    The rows are read and checked before the run directory is opened (``run_guard``, as
    `tether.train.Trainer` takes it) and the model loaded; they are encoded once the tokenizer is
    there (a row over ``data.max_length`` fails then, before the first step).
    """

    stopped_by: Optional[str] = None  # "SIGINT" / "SIGTERM" after run() stopped early on that signal

    def __init__(self, cfg: SFTConfig, run_dir: Path, model=None, tokenizer=None, log=print,
                 run_guard: Optional[RunDirectory] = None):
        self.cfg, self.run_dir, self.log, self.guard = cfg, Path(run_dir), log, run_guard
        d, t = cfg.data, cfg.train
        random.seed(t.seed)
        torch.manual_seed(t.seed)
        train_rows, self.data_sha256 = read_conversations(d.path)
        val_rows = read_conversations(d.val_path)[0] if d.val_path else []
        if d.val_fraction > 0:
            train_rows, val_rows = split_validation(train_rows, d.val_fraction, t.seed, d.path)
        if run_guard is not None:
            run_guard.open(cfg)  # after the rows are checked (a bad row leaves no directory), before the model
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if model is None:
            self.log(f"[tether] loading model {models.describe_model(cfg.model.name)}")
            model, tokenizer = models.load_model(cfg.model)
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        enc = ChatEncoder(tokenizer, resolve_max_length(d.max_length, model, tokenizer), d.overflow)
        self.train_set = encode_all(train_rows, enc, cfg.run.progress, "encoding the training rows")
        self.val_set = encode_all(val_rows, enc, cfg.run.progress, "encoding the validation rows")
        self.plan = BatchPlan([len(e.ids) for e in self.train_set], t.batch_size, t.seed,
                              grouped=t.batching == "length_grouped")
        self.total = t.steps or t.epochs * self.plan.steps_per_epoch
        if problem := t.warmup_problem(self.total):  # the length, now that the rows give it (tether.config.schema)
            raise ConfigError(problem)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_adamw(self.params, t)
        # the schedule of tether train, over this run's optimizer steps (one per step)
        self.schedule = LRSchedule(self.optimizer, t.schedule, t.warmup_steps, self.total, t.lr)
        self.scheduler = self.schedule.scheduler
        self.step, self.skipped_updates = 0, 0
        self.packed = t.batching == "packed"
        if self.packed:
            check_packing(model, self.train_set, self.pad_id, self.device, t.logprob_chunk)
        self.log(self._summary())

    def _summary(self) -> str:
        tokens = sum(len(e.ids) for e in self.train_set)
        trained = sum(e.n_targets for e in self.train_set)
        t = self.cfg.train
        val = f", {len(self.val_set)} validation conversations" if self.val_set else ", no validation rows"
        return (f"[tether] sft: {len(self.train_set)} training conversations ({tokens} tokens, {trained} trained)"
                f"{val}; {self.total} steps of {t.batch_size} ({self.total / self.plan.steps_per_epoch:.3g} "
                f"passes over the rows), batching {t.batching}")

    # ------------------------------------------------------------ one step, validation

    def train_step(self) -> dict:
        """One optimizer step on the next batch; returns its metrics row."""
        t0 = time.perf_counter()
        rows = self.plan.batch(self.step)
        lr = self.scheduler.get_last_lr()[0]  # the LR of this update
        loss, n_targets, tokens = self.backward(rows)
        gn = optimizer_step(self.params, self.optimizer, self.scheduler, loss, self.cfg.train.grad_clip)
        self.step += 1
        if gn is None:
            self.skipped_updates += 1
            self.log(skipped_update_line(self.step, self.skipped_updates))
        dt = time.perf_counter() - t0
        return {"loss": float(loss), "lr": lr, "grad_norm": math.nan if gn is None else gn, "train_tokens": n_targets,
                "tokens": tokens, "sequences": len(rows), "epoch": self.step / self.plan.steps_per_epoch,
                "skipped_updates": self.skipped_updates, "time_step_s": dt, "tokens_per_s": tokens / max(dt, 1e-9),
                **peak_memory_mb()}

    def backward(self, rows: list[int]) -> tuple[torch.Tensor, int, int]:
        """Accumulate the gradient of the batch ``rows``' loss, micro-batch by micro-batch; returns
        ``(loss, trained tokens, tokens forwarded)``."""
        t = self.cfg.train
        n_targets = max(1, sum(self.train_set[i].n_targets for i in rows))
        losses, tokens = [], 0
        for idx in micro_batches(rows, self.plan.lengths, t.micro_batch_size):
            mb = collate([self.train_set[i] for i in idx], self.packed, self.pad_id, self.device)
            loss = -batch_logp(self.model, mb, t.logprob_chunk).sum() / n_targets  # this part of the batch mean
            loss.backward()
            losses.append(loss.detach())
            tokens += mb.tokens
        return torch.stack(losses).sum(), n_targets, tokens

    def validate(self) -> dict:
        """The mean negative log-likelihood of the validation rows' trained tokens (eval mode, no gradients)."""
        t0 = time.perf_counter()
        order = micro_batches(range(len(self.val_set)), [len(e.ids) for e in self.val_set],
                              self.cfg.train.micro_batch_size)
        nll, n = torch.zeros((), dtype=torch.float64, device=self.device), 0
        self.model.eval()
        try:
            with torch.no_grad():
                for idx in order:
                    mb = collate([self.val_set[i] for i in idx], self.packed, self.pad_id, self.device)
                    logp = batch_logp(self.model, mb, self.cfg.train.logprob_chunk)
                    nll, n = nll - logp.double().sum(), n + logp.numel()
        finally:
            self.model.train()
        return {"val_loss": float(nll) / max(n, 1), "val_tokens": n, "time_val_s": time.perf_counter() - t0}

    # ------------------------------------------------------------ checkpoints, the run

    def state(self) -> dict:
        return {"skipped_updates": self.skipped_updates, "schedule": self.schedule.plan,
                "data_sha256": self.data_sha256, "train_rows": len(self.train_set)}

    def save(self) -> Path:
        return save_checkpoint(self.run_dir, self.step, self.model, None, self.optimizer, self.scheduler,
                               self.state(), keep=self.cfg.run.keep_checkpoints)

    def restore(self, ckpt: Path) -> None:
        st = load_checkpoint(ckpt, self.model, None, self.optimizer, self.scheduler)
        if st["data_sha256"] != self.data_sha256:
            raise RunError(f"cannot resume {self.run_dir}: data.path {self.cfg.data.path} changed since checkpoint "
                           f"{ckpt.name} was written (its sha256 differs), so the resumed run would not continue "
                           f"the same batches; put the original file back, or start a new run from this one "
                           f"(tether sft model.name={self.run_dir} ...)")
        self.step, self.skipped_updates = st["step"], st["skipped_updates"]
        try:
            self.schedule.continue_from(st["schedule"], self.step, self.run_dir)
        except ConfigError:  # its one refusal: extending a run whose LR decay has reached 0
            t = self.cfg.train
            raise ConfigError(f"extending {self.run_dir} to {self.total} steps: its {t.schedule} LR schedule had "
                              f"already decayed to 0 at step {self.step}, so it would train at lr 0. Resume with "
                              f"train.schedule=constant to train on at train.lr ({t.lr}), or start a new SFT stage "
                              f"from it: tether sft model.name={self.run_dir} --data ...") from None

    def run(self, resume: bool = False) -> Path:
        """Train to the last step (`tether.loop.run_steps`, as tether train does); checkpoints every
        ``run.save_every`` steps and after the last one.

        SIGINT / SIGTERM stop the run gracefully (`tether.rundir.stop`): the step in progress finishes, a
        checkpoint is written, ``run()`` returns with ``self.stopped_by`` set.
        """
        self.stopped_by = None
        # the last step is always saved: it is what tether train model.name=RUN starts from
        self.stopped_by = run_steps(self, self.total, resume, title="tether sft", samples=False, postfix=_postfix)
        return self.run_dir

    # the evaluations of the run loop (tether.loop.run_steps)

    def evaluate_start(self, resume: bool) -> dict:
        """The starting model's validation loss, logged at step 0 (a fresh run with validation rows), else {}."""
        return self.validate() if self.val_set and not resume else {}

    def evaluate_step(self) -> dict:
        """The validation loss after this step when due (train.val_every, and the last step), else {}."""
        every = self.cfg.train.val_every
        due = bool(self.val_set) and (self.step == self.total or (every > 0 and self.step % every == 0))
        return self.validate() if due else {}


def default_sft_dir(cfg: SFTConfig) -> Path:
    return Path("runs") / f"sft-{Path(cfg.data.path).stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def sft(cfg: SFTConfig, run_dir: Optional[Path] = None, model=None, tokenizer=None, log=print) -> Path:
    """Fine-tune a fresh run; returns its directory (config.yaml, metrics.jsonl, checkpoints/, curves.png).

    The directory must be new or empty (``run.overwrite`` replaces an earlier SFT run there) and is
    locked while the run trains (`tether.rundir.guard`).
    """
    _single_process()
    run_dir = Path(run_dir or cfg.run.output_dir or default_sft_dir(cfg))
    guard = RunDirectory(run_dir, fresh=True, overwrite=cfg.run.overwrite, log=log, kind="sft")
    return run_guarded(guard, lambda: SFTTrainer(cfg, run_dir, model, tokenizer, log=log, run_guard=guard),
                       resume=False)


def resume_sft(run_dir: Path, overrides: Optional[dict] = None, model=None, tokenizer=None, log=print) -> Path:
    """Continue an SFT run from its newest valid checkpoint (``overrides`` may extend train.steps /
    train.epochs, change the LR or the outputs; not the model, the data or the batches)."""
    _single_process()
    run_dir = Path(run_dir)
    cfg = resume_sft_config(run_dir, overrides)
    guard = RunDirectory(run_dir, fresh=False, log=log, kind="sft")
    return run_guarded(guard, lambda: SFTTrainer(cfg, run_dir, model, tokenizer, log=log, run_guard=guard),
                       resume=True)


def resume_sft_config(run_dir: Path, overrides: Optional[dict] = None) -> SFTConfig:
    """The saved config of SFT run ``run_dir`` with ``overrides`` applied (nothing is written).

    Raises `RunError` as a training run's resume does (`tether.rundir.guard.resumed_values`: no directory or
    config.yaml, a training run, no checkpoint), and `ConfigError` for an override of a key in
    `tether.config.sft.FROZEN_ON_RESUME` to another value: the model, the data and the batches stay
    the checkpoint's.
    """
    saved, overrides = resumed_values(run_dir, overrides, "sft")
    vals = flatten(saved)
    vals.pop("run.overwrite", None)
    before = flatten(to_dict(load_sft_config(None, vals)))
    cfg = load_sft_config(None, {**vals, **overrides})
    after = flatten(to_dict(cfg))
    changed = [k for k in after if k.startswith(FROZEN_ON_RESUME) and after[k] != before[k]]
    if changed:
        raise ConfigError(f"{', '.join(f'{k}={after[k]}' for k in changed)} cannot apply to --resume {run_dir}: "
                          f"the model, the data and the batches stay those of the checkpoint; start a new run "
                          f"from this one instead (tether sft model.name={run_dir} ...)")
    return cfg


def _single_process() -> None:
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("tether sft runs in one process (one device); run it without torchrun")
