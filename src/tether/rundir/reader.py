"""Reading a run directory: its ``config.yaml`` and one of its checkpoints, for ``tether train
--resume`` (`tether.rundir.guard.resume_config`), ``tether eval`` and ``tether export``.

* `RunDir` -- one run directory ``RUN``: checked (:meth:`RunDir.open`: it exists and has a
  ``config.yaml``), its saved config as written (:meth:`~RunDir.raw_config`; resolved:
  `tether.resolve.saved.saved_config`), its checkpoints (:meth:`~RunDir.steps`) and the one to use
  (:meth:`~RunDir.checkpoint`): the newest that passes its manifest (`tether.rundir.checkpoint.latest_checkpoint`),
  or a named step or checkpoint directory, verified against its manifest (`tether.rundir.checkpoint.verify_checkpoint`).
* The run at one checkpoint, with its config and its model: `tether.eval.run`.

Every problem is raised as the caller's error class (``error``: `RunError` for a resume,
`EvalError` for eval, ``ExportError`` for export), in words that name the directory and what the
caller was doing (``verb``), so the three commands report the same problem the same way.

Nothing here imports torch or the config: ``tether eval`` classifies its ``--model`` argument with
`is_run_dir` / `is_checkpoint_dir` while the parser is built.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError, RunError
from ..userio import loads_json, read_yaml_mapping
from .owned import RUN_KINDS, is_checkpoint_dir, is_run_dir, run_kind  # noqa: F401  (is_*: re-exported for tether eval)


class RunDir:
    """Reads run directory ``path`` for a caller that is about to ``verb`` it ("resume", "evaluate",
    "export"); every problem is raised as ``error`` (except `ConfigError` for bad overrides, raised by
    the resume itself). Nothing is written."""

    def __init__(self, path: str | Path, *, verb: str = "use", error: type[Exception] = RunError):
        self.path = Path(path).expanduser()
        self.verb, self.error = verb, error

    @classmethod
    def of_checkpoint(cls, ckpt: Path, **kw) -> RunDir:
        """The run that holds checkpoint directory ``ckpt`` (``RUN/checkpoints/step-N``), checked."""
        ckpt = Path(ckpt)
        run = cls(ckpt.parent.parent, **kw)
        if ckpt.parent.name != "checkpoints" or not (run.path / "config.yaml").is_file():
            raise run.error(f"checkpoint {ckpt} is not inside a run directory (RUN/checkpoints/step-N with "
                            f"RUN/config.yaml), so its base model is unknown")
        return run

    @property
    def kind(self) -> str:
        """``"run"`` or ``"sft"`` (`tether.rundir.owned.run_kind`)."""
        return run_kind(self.path)

    def open(self) -> RunDir:
        """Check that the directory exists and has a ``config.yaml``; returns self."""
        if not self.path.is_dir():
            what = "a file, not a run directory" if self.path.exists() else "no such directory"
            raise self.error(f"cannot {self.verb} {self.path}: {what}")
        if not (self.path / "config.yaml").is_file():
            raise self.error(f"cannot {self.verb} {self.path}: it has no config.yaml (not a tether run directory, "
                             f"or its run never started)")
        return self

    # ------------------------------------------------------------------ the saved config

    def raw_config(self) -> dict:
        """``config.yaml`` as a mapping (unreadable, not UTF-8, not YAML, not a mapping: ``error`` with the line)."""
        try:
            return read_yaml_mapping(self.path / "config.yaml")
        except ConfigError as e:
            raise self.error(f"cannot {self.verb} {self.path}: {e}") from None

    # ------------------------------------------------------------------ which checkpoint

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (``checkpoints/step-N`` with ``state.json``), ascending."""
        from .checkpoint import checkpoints, step_of  # deferred: pulls in torch

        return sorted(step_of(p) for p in checkpoints(self.path) if (p / "state.json").is_file())

    def available(self) -> str:
        """The checkpoints one may name instead, for an error message: the steps whose checkpoints verify
        (``"2, 4"``), then any damaged ones as such (``"2, 4; damaged: 3"``). It reads every checkpoint's
        files: only an error path calls it."""
        from .checkpoint import checkpoints, step_of, verify_checkpoint  # deferred: pulls in torch

        good, bad = [], []
        for p in sorted((p for p in checkpoints(self.path) if (p / "state.json").is_file()), key=step_of):
            (good if verify_checkpoint(p)[0] else bad).append(str(step_of(p)))
        return (", ".join(good) or "none") + (f"; damaged: {', '.join(bad)}" if bad else "")

    def has_checkpoint(self) -> bool:
        """Whether the run saved any checkpoint (valid or not)."""
        from .checkpoint import checkpoints  # deferred: pulls in torch

        return bool(checkpoints(self.path))

    def no_checkpoint(self) -> str:
        """The message for a run that saved no checkpoint."""
        msg = (f"cannot {self.verb} {self.path}: it has no checkpoint ({self.path / 'checkpoints'}/step-N); the run "
               f"stopped (or is still running) before its first save (run.save_every)")
        if self.verb == "resume":
            msg += f". Start it again: {RUN_KINDS[self.kind]} --output-dir {self.path} --overwrite ..."
        return msg

    def checkpoint(self, which: int | Path | None = None) -> Path:
        """The checkpoint to use: ``None`` the newest that passes its manifest (a damaged one is skipped
        with a warning); a step number, or a checkpoint directory of this run, that one, verified."""
        from ..metrics import warn  # deferred: pulls in torch
        from .checkpoint import latest_checkpoint, step_of, verify_checkpoint  # deferred: pulls in torch

        if which is None:
            try:
                ckpt = latest_checkpoint(self.path)
            except RunError as e:  # checkpoints, but none valid
                raise self.error(str(e)) from None
            if ckpt is None:
                raise self.error(self.no_checkpoint())
            return ckpt
        if isinstance(which, int):
            found = [p for p in (self.path / "checkpoints").glob("step-*")
                     if step_of(p) == which and (p / "state.json").is_file()]
            if not found:
                raise self.error(f"cannot {self.verb} {self.path}: it has no checkpoint at step {which}; available "
                                 f"steps: {self.available()}")
            ckpt = found[0]
        else:
            ckpt = Path(which)
        ok, note = verify_checkpoint(ckpt)  # the newest is verified by latest_checkpoint; a named one here
        if not ok:
            raise self.error(f"checkpoint {ckpt} is damaged: {note}; {self.verb} another step (available: "
                             f"{self.available()}), or the run directory without a step (its newest valid checkpoint)")
        if note:
            warn(f"checkpoint {ckpt} {note}")
        return ckpt

def checkpoint_step(ckpt: Path) -> int:
    """The step a checkpoint was saved at: its ``state.json``'s, else its name's (``step-N``), else -1."""
    from .checkpoint import step_of  # deferred: pulls in torch

    try:
        return int(loads_json((Path(ckpt) / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        n = step_of(Path(ckpt))
        return -1 if n is None else n


