"""The run loop every trainer shares: `tether.train.Trainer` (RL) and `tether.sft.loop.SFTTrainer` (SFT).

    run_guarded:  build the trainer inside its locked run directory, run it, release the lock
    run_steps:    resume -> (evaluate the start) -> for step: train_step -> evaluate -> log -> progress -> save
                  -> graceful stop; then the curves

Written once here: the resume from the newest valid checkpoint, metrics.jsonl (and TensorBoard / W&B), the
progress bar, the checkpoints every ``run.save_every`` steps and at the end, SIGINT / SIGTERM finishing the step
in progress with a checkpoint (`tether.rundir.stop`), curves.png. A trainer brings its own step and its own
evaluations through the small interface `run_steps` documents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from .config import to_dict
from .metrics import MetricsLogger, Progress, rl_postfix
from .plot import plot_runs
from .rundir.guard import RunDirectory, restore_latest
from .rundir.stop import GracefulStop

__all__ = ["run_guarded", "run_steps"]


def run_steps(t, total: int, resume: bool, *, title: str, main: bool = True, final_checkpoint: bool = True,
              samples: bool = True, postfix: Callable[[dict], dict] = rl_postfix) -> Optional[str]:
    """Train ``t`` from its step to ``total``; returns the name of the signal that stopped it early, or None.

    ``t`` has ``cfg`` (its ``run`` section: save_every, progress, plot, the loggers), ``run_dir``, ``guard``
    (its `tether.rundir.guard.RunDirectory` or None), ``log``, ``step`` and the methods ``train_step() -> dict``,
    ``save() -> Path``, ``restore(ckpt)``, ``evaluate_start(resume) -> dict`` (the row logged at step 0 before
    training, {} for none), ``evaluate_step() -> dict`` (metrics added to the step's row, {} for none) and, with
    ``samples``, ``sample_rows() -> list`` (rows for samples.jsonl).

    ``main``: this process logs, shows progress and plots (rank 0 under torchrun; every rank saves and polls the
    stop, so all ranks stop at the same step). ``final_checkpoint``: save after the last step too.
    """
    run = t.cfg.run
    with GracefulStop(t.run_dir, announce=main) as stop:
        if resume:
            ckpt = restore_latest(t.run_dir, t.restore, t.guard, t.cfg)
            t.log(f"[tether] resumed from {ckpt} (step {t.step} of {total})")
        logger = MetricsLogger(t.run_dir, resume_step=t.step if resume else None, tensorboard=run.tensorboard,
                               wandb=run.wandb, wandb_project=run.wandb_project, config=to_dict(t.cfg),
                               samples=samples) if main else None
        bar = Progress(total, t.step, title, enabled=run.progress and main, postfix=postfix)
        stopped = None
        try:
            first = t.evaluate_start(resume)
            if first and logger is not None:
                logger.log(0, first)
            while t.step < total:
                m = t.train_step()
                m.update(t.evaluate_step())
                if logger is not None:
                    logger.log(t.step, m)
                    if samples:
                        logger.log_samples(t.step, t.sample_rows())
                bar.update(m)
                saved = None
                if (run.save_every and t.step % run.save_every == 0) or (t.step == total and final_checkpoint):
                    saved = t.save()
                # once per step on every rank (an all-reduce under torchrun): all ranks stop at the same step
                stopped = stop.poll(t.step, total, t.save, saved, t.log)
                if stopped:
                    break
        finally:
            bar.close()
            if logger is not None:
                logger.close()
    if run.plot and main:
        plot_runs([t.run_dir], t.run_dir / "curves.png")
    return stopped


def run_guarded(guard: RunDirectory, make_trainer, resume: bool) -> Path:
    """Build the trainer (its ``__init__`` opens the guard) and run it; the lock is released however it
    ends, a fresh run whose trainer cannot be built leaves no directory, and a disk-full or read-only
    write while training is a `RunError` naming the path."""
    try:
        trainer = make_trainer()
    except BaseException:
        guard.abandon()
        raise
    guard.commit()  # an --overwrite's previous run is deleted only now that the new trainer is built
    try:
        with guard.write_errors():
            return trainer.run(resume=resume)
    finally:
        guard.release()
