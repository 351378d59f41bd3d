"""Graceful stop of a training run on SIGINT (Ctrl-C) or SIGTERM (what a cluster scheduler sends).

The first signal only sets a flag. ``Trainer.run`` (and ``tether.sft``'s loop) polls it once per step: the step in
progress finishes, a checkpoint is written, the loggers close and ``run()`` returns; the CLI
then exits with 128 + the signal number (130 for SIGINT, 143 for SIGTERM) and says how to
resume. A second signal raises `Aborted` (a ``KeyboardInterrupt``) at once: the step or
checkpoint write in progress is dropped, and since checkpoints are written atomically the
previous one stays the latest (the run resumes from it). A signal within `REPEAT_S` of the
first one is the same stop delivered twice, not a second one: a Ctrl-C under ``torchrun``
reaches every worker from the terminal and again, a moment later, forwarded by torchrun's agent.

The handlers are installed only while ``run()`` runs, only in the main thread (Python allows no
other), and never over a signal the process ignores (SIG_IGN: e.g. SIGINT in a background job
started by a shell script, or under ``nohup``); the previous handlers are restored after, so the
Python API does not keep the caller's signals.

Under ``torchrun`` every rank calls `GracefulStop.requested` once per step; it all-reduces the
signal number (max), so all ranks stop after the same step and take part in the same
(collective) checkpoint write, also when the scheduler signalled only some of them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from .. import distributed as dist
from .checkpoint import checkpoints
from .owned import RUN_KINDS, run_kind

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_S = 1.0  # seconds after the first signal during which another one is the same stop, delivered twice

_last_stop: Optional[str] = None


def exit_code(signal_name: str) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (SIGINT 130, SIGTERM 143)."""
    return 128 + int(signal.Signals[signal_name])


def last_stop() -> Optional[str]:
    """The signal name that stopped the latest ``Trainer.run`` of this process early (None: it ran to
    the end). The CLI maps it to its exit code; ``train()`` / ``resume()`` return normally."""
    return _last_stop


def resume_hint(run_dir: Path) -> str:
    """The command that resumes ``run_dir``: ``tether train --resume`` or, for an SFT run (its marker
    says so: `tether.rundir.owned.run_kind`), ``tether sft --resume``."""
    return f"{RUN_KINDS[run_kind(run_dir)]} --resume {Path(run_dir).absolute()}"


class Interrupted(KeyboardInterrupt):
    """Work ended at once by a stop signal; the CLI prints the message as one line and exits 128 + signal."""

    def __init__(self, signal_name: str, message: str, announce: bool = True):
        super().__init__(message)
        self.signal_name = signal_name
        self.announce = announce  # rank 0 (or the only process) reports it


class Aborted(Interrupted):
    """A second stop signal: the run ended at once, without writing a checkpoint for the step in progress."""

    def __init__(self, signal_name: str, run_dir: Path, announce: bool = True):
        self.run_dir = Path(run_dir)
        # the newest checkpoint directory, not verified: an abort must not read gigabytes back to hash them
        ckpt = next(iter(checkpoints(self.run_dir)), None)
        where = (f"the latest checkpoint is {ckpt}; resume with: {resume_hint(self.run_dir)}" if ckpt is not None
                 else f"{self.run_dir} has no checkpoint yet, so the run cannot be resumed")
        super().__init__(signal_name, f"aborted by a second stop signal ({signal_name}) without a new checkpoint; "
                         f"{where}", announce)


class GracefulStop:
    """Context manager that turns SIGINT / SIGTERM into a stop request polled by the training loop."""

    def __init__(self, run_dir: Path, announce: bool = True,
                 doing: str = "stopping after the step in progress and writing a checkpoint",
                 abort: Optional[Callable[[str], KeyboardInterrupt]] = None):
        self.run_dir = Path(run_dir)
        self.announce = announce  # rank 0 says what it does; the other ranks stay quiet
        self.doing = doing  # what the first signal does, as announced (tether eval: "saving the finished problems")
        self._abort = abort or (lambda name: Aborted(name, self.run_dir, self.announce))  # the second signal's
        self.signum = 0  # the first signal received by this process (0: none)
        self._first_at = 0.0  # when it came (time.monotonic)
        self._previous: dict = {}

    def __enter__(self) -> "GracefulStop":
        global _last_stop
        _last_stop = None
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                prev = signal.getsignal(s)
                if prev is not signal.SIG_IGN:
                    self._previous[s] = prev
                    signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, signal.SIG_DFL if prev is None else prev)  # None: a handler not set from Python
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum:
            if time.monotonic() - self._first_at < REPEAT_S:
                return  # the first stop, delivered twice
            raise self._abort(name)
        self.signum, self._first_at = signum, time.monotonic()
        if self.announce:  # os.write, not print: the signal may have interrupted a print to the same stream
            os.write(2, f"\n[tether] {name} received: {self.doing} (send it again to abort at "
                        f"once)\n".encode())

    def requested(self) -> Optional[str]:
        """The stop signal's name if any rank received one, else None. Collective under torchrun:
        every rank calls it once per trainer step."""
        signum = int(dist.all_reduce(float(self.signum), "max"))
        return signal.Signals(signum).name if signum else None

    def poll(self, step: int, total: int, save: Callable[[], Path], saved: Optional[Path],
             log: Callable[[str], None]) -> Optional[str]:
        """Once per step (collective, as `requested`): the stop signal's name when the run stops after step
        ``step`` of ``total``, else None. Stopping writes a checkpoint of the step (``save()``, unless
        ``saved`` is already one), records the stop (`stopped`) and logs how to resume. After the last
        step the run ends anyway: no poll."""
        name = self.requested() if step < total else None
        if name:
            saved = saved or save()
            self.stopped(name)
            log(f"[tether] stopped by {name} after step {step} of {total}; checkpoint {saved}. Resume with: "
                f"{resume_hint(self.run_dir)}")
        return name

    def stopped(self, signal_name: str) -> None:
        """Record that the run stopped early on ``signal_name`` (see `last_stop`)."""
        global _last_stop
        _last_stop = signal_name
