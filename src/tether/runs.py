"""Reading a run directory: its ``config.yaml`` and one of its checkpoints, for ``tether train
--resume`` (`tether.rundir.resume_config`), ``tether eval`` and ``tether export``.

* `RunDir` -- one run directory ``RUN``: checked (:meth:`RunDir.open`: it exists and has a
  ``config.yaml``), its saved config (:meth:`~RunDir.raw_config`, :meth:`~RunDir.config`), its
  checkpoints (:meth:`~RunDir.steps`) and the one to use (:meth:`~RunDir.checkpoint`): the
  newest that passes its manifest (`tether.checkpoint.latest_checkpoint`), or a named step or
  checkpoint directory, verified against its manifest (`tether.checkpoint.verify_checkpoint`).
* `RunCheckpoint` -- a run at one checkpoint, resolved without loading weights (:meth:`RunDir.at`).
* `check_anchor`, `load_run_model` -- the run's model at that checkpoint, policy or anchor.

Every problem is raised as the caller's error class (``error``: `RunError` for a resume,
`EvalError` for eval, ``ExportError`` for export), in words that name the directory and what the
caller was doing (``verb``), so the three commands report the same problem the same way.

Nothing here imports torch or the config at import time: ``tether eval`` classifies its
``--model`` argument with `is_run_dir` / `is_checkpoint_dir` while the parser is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, RunError, loads_json
from .owned import RUN_KINDS, is_checkpoint_dir, is_run_dir, run_kind  # noqa: F401  (is_*: re-exported for tether eval)


@dataclass
class RunCheckpoint:
    """A run directory at one of its checkpoints, resolved without loading weights (`RunDir.at`).

    Attributes:
        run_dir: the run directory.
        checkpoint: the checkpoint directory ``RUN/checkpoints/step-N``.
        step: its step (from its ``state.json``; else from its name; -1 if neither says).
        config: the run's `tether.config.Config`, or the raw YAML mapping when the saved config
            no longer validates here (e.g. it asked for wandb, which this environment lacks).
        model_config: the run's `tether.models.ModelConfig` (base model, dtype, LoRA).
        kind: ``"run"`` (``tether train``) or ``"sft"`` (``tether sft``: its config is a
            `tether.config.sft.SFTConfig`, it has no recipe and no anchor).
    """

    run_dir: Path
    checkpoint: Path
    step: int
    config: Any
    model_config: Any
    kind: str = "run"

    def _raw(self, section: str) -> dict:
        return self.config.get(section) or {}

    @property
    def lora(self) -> bool:
        return int(getattr(self.model_config, "lora_r", 0) or 0) > 0

    @property
    def anchor_kind(self) -> str:
        if self.kind == "sft":
            return "none"
        if isinstance(self.config, dict):
            return str((self._raw("algo").get("anchor") or {}).get("kind", "none"))
        return self.config.algo.anchor.kind

    @property
    def recipe(self) -> str:
        if self.kind == "sft":
            return "sft"
        return str(self.config.get("recipe", "?")) if isinstance(self.config, dict) else self.config.recipe

    @property
    def system_prompt(self) -> str:
        if self.kind == "sft":  # each conversation carries its own system message, if any
            return ""
        if isinstance(self.config, dict):
            return str(self._raw("data").get("system_prompt") or "")
        return self.config.data.system_prompt


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
        """``"run"`` or ``"sft"`` (`tether.owned.run_kind`)."""
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
        from .config import read_yaml_mapping  # deferred: pulls in torch

        try:
            return read_yaml_mapping(self.path / "config.yaml")
        except ConfigError as e:
            raise self.error(f"cannot {self.verb} {self.path}: {e}") from None

    def config(self) -> tuple[Any, Any]:
        """``(Config or SFTConfig or raw dict, ModelConfig)``: the validated config, or, when the saved
        config no longer validates here, the raw YAML and the ``model`` section's known keys."""
        from .config import load_config  # deferred: pulls in torch
        from .config.sft import load_sft_config  # deferred: pulls in torch
        from .models import ModelConfig  # deferred: pulls in torch

        try:
            cfg = (load_sft_config if self.kind == "sft" else load_config)(str(self.path / "config.yaml"))
            return cfg, cfg.model
        except ConfigError:
            pass
        raw = self.raw_config()
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        return raw, ModelConfig(**{k: v for k, v in (raw.get("model") or {}).items() if k in known})

    # ------------------------------------------------------------------ which checkpoint

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (``checkpoints/step-N`` with ``state.json``), ascending."""
        from .checkpoint import step_of, checkpoints  # deferred: pulls in torch

        return sorted(step_of(p) for p in checkpoints(self.path) if (p / "state.json").is_file())

    def available(self) -> str:
        """The checkpoints one may name instead, for an error message: the steps whose checkpoints verify
        (``"2, 4"``), then any damaged ones as such (``"2, 4; damaged: 3"``). It reads every checkpoint's
        files: only an error path calls it."""
        from .checkpoint import step_of, checkpoints, verify_checkpoint  # deferred: pulls in torch

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
        from .checkpoint import step_of, latest_checkpoint, verify_checkpoint  # deferred: pulls in torch
        from .metrics import warn  # deferred: pulls in torch

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

    def at(self, which: int | Path | None = None) -> RunCheckpoint:
        """The run at checkpoint ``which`` (see :meth:`checkpoint`) with its config; checks the directory first."""
        self.open()
        ckpt = self.checkpoint(which)
        cfg, mc = self.config()
        return RunCheckpoint(run_dir=self.path, checkpoint=ckpt, step=checkpoint_step(ckpt), config=cfg,
                             model_config=mc, kind=self.kind)


def checkpoint_step(ckpt: Path) -> int:
    """The step a checkpoint was saved at: its ``state.json``'s, else its name's (``step-N``), else -1."""
    from .checkpoint import step_of  # deferred: pulls in torch

    try:
        return int(loads_json((Path(ckpt) / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        n = step_of(Path(ckpt))
        return -1 if n is None else n


# ---------------------------------------------------------------------------- the model at a checkpoint


def check_anchor(rc: RunCheckpoint, *, verb: str = "use", error: type[Exception] = RunError) -> None:
    """Raise ``error`` unless the checkpoint holds anchor tensors (EMA / fixed / reset / kl_reset)."""
    kind = rc.anchor_kind
    if rc.kind == "sft":
        raise error(f"run {rc.run_dir} is a supervised fine-tuning run (tether sft): it has no anchor to {verb}")
    if kind in ("none", "iterative"):
        why = ("it has no KL term (algo.anchor.kind = none)" if kind == "none" else
               "its anchor is iterative (the sampler itself), so it keeps no anchor weights")
        raise error(f"run {rc.run_dir} ({rc.recipe}) has no anchor to {verb}: {why}")
    if not (rc.checkpoint / "anchor.safetensors").is_file():
        raise error(f"checkpoint {rc.checkpoint} holds no anchor tensors (anchor.safetensors); "
                    f"the run's anchor kind is {kind!r}")


def load_run_model(rc: RunCheckpoint, *, anchor: bool = False, dtype: str = "float32", device: str = "cpu",
                   merge_lora: bool = True, verb: str = "use",
                   error: type[Exception] = RunError) -> tuple[Any, Any, str]:
    """The run's model at ``rc``: ``(model, tokenizer, description)``, in eval mode with gradients off.

    The base model is built from the run's ``model`` section (LoRA included; gradient
    checkpointing off; ``dtype`` / ``device`` from the arguments), then the checkpoint's policy
    tensors are loaded (`tether.checkpoint.load_policy_weights`). With ``anchor=True`` the
    checkpoint's anchor tensors theta_a (the EMA / fixed / reset anchor, fp32 on disk) are then
    copied into the same named parameters, so the model computes pi_a: with LoRA the policy
    tensors are loaded first for the structure and the anchor replaces the adapters. With LoRA and
    ``merge_lora`` the adapters are merged into the base weights afterwards (parameter names then
    lose the peft prefixes).

    Raises ``error``: ``anchor=True`` for a run without anchor tensors (`check_anchor`), a base
    model that cannot be loaded, tensors that do not match the model.
    """
    from .checkpoint import copy_named_tensors, load_anchor_tensors, load_policy_weights  # deferred: pulls in torch
    from .models import ModelLoadError, load_model  # deferred: pulls in torch

    if anchor:
        check_anchor(rc, verb=verb, error=error)
    mc = dataclasses.replace(rc.model_config, dtype=dtype, device=device, gradient_checkpointing=False)
    try:
        model, tok = load_model(mc)
    except ModelLoadError as e:
        raise error(f"run {rc.run_dir}: cannot load its base model {mc.name!r} "
                    f"(from {rc.run_dir / 'config.yaml'}): {e}") from None
    try:
        load_policy_weights(rc.checkpoint, model)
    except ValueError as e:
        raise error(f"{e} (base model {mc.name!r}, lora_r={mc.lora_r})") from None
    what = "policy"
    if anchor:
        try:
            copy_named_tensors(load_anchor_tensors(rc.checkpoint), model, f"{rc.checkpoint} anchor")
        except ValueError as e:
            raise error(str(e)) from None
        what = f"anchor ({rc.anchor_kind})"
    lora = f", LoRA r={mc.lora_r}" if mc.lora_r else ""
    desc = f"run {rc.run_dir} [{rc.recipe}] step {rc.step} {what}; base {mc.name}{lora}"
    if merge_lora and callable(getattr(model, "merge_and_unload", None)):
        model = model.merge_and_unload()
    model.requires_grad_(False)
    model.eval()
    return model, tok, desc
