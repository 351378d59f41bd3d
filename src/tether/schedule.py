"""The learning-rate schedule of a run, and how a resume goes on with it.

Per optimizer step the LR is ``train.lr`` times a multiplier (`multiplier`): a linear warm-up over
``train.warmup_steps``, then constant, or a cosine / linear decay to 0 at the last optimizer step
(``train.steps x train.epochs x train.mini_batches``; skipped updates do not count).

With ``train.lr_scale`` (``ess`` / ``seq_ess``) each optimizer step applies that LR times the ESS
multiplier of its mini-batch, ``clip((ESS/N)^p, floor, 1)`` (`tether.algo.correction.lr_scale`):
`tether.optim.optimizer_step` sets it on the optimizer for that one ``optimizer.step()``, and the
scheduler's next step lays the LR from its base LR and multiplier again. The multiplier is no part of
the schedule's state (``last_epoch``, base LRs, ``plan``), so checkpoints and resumes are unchanged.

`LRSchedule` owns the optimizer's ``LambdaLR`` (``.scheduler``, checkpointed beside the optimizer)
and the ``plan`` that lays out its multiplier (a dict, saved in the trainer state). On resume,
``continue_from(saved_plan, ...)`` goes on exactly when the plan is unchanged, and re-lays the decay
when the resume changed it (``train.steps`` raised to extend the run, or the schedule's settings),
so that the LR never jumps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

from torch.optim.lr_scheduler import LambdaLR

from .errors import ConfigError


def multiplier(kind: str, warmup: int, total: int, start: Optional[int] = None, mult: float = 1.0,
               **_) -> Callable[[int], float]:
    """LR multiplier per optimizer step: linear warm-up, then constant, or a cosine / linear decay from
    ``mult`` at optimizer step ``start`` (default: the end of warm-up, at 1) to 0 at ``total``.

    A fresh run decays from 1 after warm-up; a resume that extends it starts a new decay from the
    multiplier reached (`LRSchedule.continue_from`). Other keys (the saved ``steps``...) are ignored.
    """
    start = warmup if start is None else start

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        frac = min(1.0, (step - start) / max(1, total - start))
        return mult * (0.5 * (1 + math.cos(math.pi * frac)) if kind == "cosine" else 1.0 - frac)

    return f


class _RelayableLambdaLR(LambdaLR):
    """A ``LambdaLR`` whose multiplier and base LR can be replaced from the optimizer step it has reached.

    It adds no state: its ``state_dict`` is the ``LambdaLR``'s.
    """

    def relay(self, f: Callable[[int], float], lr: float) -> None:
        """Multiplier ``f`` and base LR ``lr`` from now on; the optimizer's LR becomes ``lr * f(last_epoch)``."""
        groups = self.optimizer.param_groups
        self.lr_lambdas = [f] * len(groups)
        self.base_lrs = [lr] * len(groups)
        for g in groups:
            g["initial_lr"], g["lr"] = lr, lr * f(self.last_epoch)
        self._last_lr = [g["lr"] for g in groups]


class LRSchedule:
    """The LR schedule of ``optimizer``: ``kind`` (constant | cosine | linear) after ``warmup`` optimizer steps of
    linear warm-up, over ``steps`` trainer steps of ``per_step`` optimizer steps each, at peak ``lr``
    (`tether.train.Trainer`: train.steps x (train.epochs x train.mini_batches); SFT: one optimizer step a step).

    ``scheduler`` is the ``LambdaLR`` to step after each optimizer step and to checkpoint; ``plan``
    is what lays out its multiplier (the keyword arguments of `multiplier`, plus the ``steps`` and
    ``per_step`` it was laid for), to save beside it and hand back to `continue_from` on resume.
    """

    def __init__(self, optimizer, kind: str, warmup: int, steps: int, lr: float, per_step: int = 1):
        self.kind, self.warmup, self.steps, self.lr = kind, warmup, steps, lr
        self.plan = dict(kind=kind, warmup=warmup, total=steps * per_step, start=warmup, mult=1.0, steps=steps,
                         per_step=per_step)
        self.scheduler = _RelayableLambdaLR(optimizer, multiplier(**self.plan))

    def continue_from(self, saved: dict, step: int, run_dir: Path) -> None:
        """Go on with a checkpoint's schedule (``saved``: its ``plan``), restored at trainer step ``step``
        with the scheduler's state already loaded.

        When the resume changed the schedule (``train.steps`` raised to extend the run, or the schedule's
        settings), the decay is re-laid so that the LR never jumps: from the multiplier reached, to 0 at
        the new last optimizer step. Warm-up already done stays done. ``train.lr`` given on resume
        applies. A run whose decay had already reached 0 cannot be extended (it would train at lr 0): a
        ConfigError says what to do (``run_dir`` names the run in it).
        """
        done = self.scheduler.last_epoch  # optimizer steps taken (skipped updates do not count)
        if all(saved[k] == self.plan[k] for k in ("kind", "warmup", "steps", "per_step")):
            self.plan = saved  # the same run: the same schedule, so the resume is exact
        else:
            remaining = (self.steps - step) * self.plan["per_step"]
            if self.kind != "constant" and done > self.warmup:  # the decay runs: go on from where it was
                mult = multiplier(**saved)(done)
                if mult <= 0 and remaining > 0:
                    raise ConfigError(
                        f"train.steps={self.steps}: the run's {saved['kind']} LR schedule had already decayed to 0 at "
                        f"step {step} (optimizer step {done}), so extending it would train at lr 0. Resume with "
                        f"train.schedule=constant to train on at train.lr ({self.lr}), or start a new run from the "
                        f"exported model (tether export {run_dir} OUT_DIR, then tether train model.name=OUT_DIR)")
                self.plan = dict(self.plan, start=done, mult=mult, total=done + remaining)
            else:  # constant, or warm-up not finished: the decay (if any) starts after warm-up
                self.plan = dict(self.plan, total=done + remaining)
        self.scheduler.relay(multiplier(**self.plan), self.lr)
