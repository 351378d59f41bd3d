"""What ``tether eval --model`` names, and loading it.

* :func:`resolve_eval_spec` / :class:`EvalModelSpec` -- classify a ``--model`` argument (a hub id / local dir /
  GGUF / ``"smollm2"``, a training run directory, or one checkpoint);
* :func:`load_eval_model` -- load it (a run's checkpoint's policy, or with ``anchor=True`` its anchor).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .. import models  # models.load_model: an attribute read at call time (tests patch it)
from ..errors import EvalError
from ..models import ModelConfig, ModelLoadError
from ..rundir.reader import RunDir, is_checkpoint_dir, is_run_dir
from ..userio import slug
from .run import RunCheckpoint, check_anchor, checkpoint_at, load_run_model

__all__ = ["EvalModelSpec", "check_run_anchor", "load_eval_model", "resolve_eval_spec"]


@dataclass
class EvalModelSpec:
    """What a ``--model`` argument names (see :func:`resolve_eval_spec`).

    Attributes:
        spec: The argument as given.
        run: For a training run directory or one of its checkpoint directories: the run at the
            checkpoint used (the newest valid one unless a checkpoint directory was given), a
            `tether.eval.run.RunCheckpoint`; None for a model (hub id / local dir / GGUF / smollm2).

    ``kind`` (``"run"`` or ``"model"``) and, for runs, ``run_dir``, ``checkpoint``, ``step``,
    ``model_config``, ``anchor_kind``, ``recipe`` and ``system_prompt`` read through to ``run``.
    """

    spec: str
    run: Optional[RunCheckpoint] = None

    kind = property(lambda self: "model" if self.run is None else "run")
    run_dir = property(lambda self: self.run and self.run.run_dir)
    checkpoint = property(lambda self: self.run and self.run.checkpoint)
    step = property(lambda self: self.run and self.run.step)
    model_config = property(lambda self: self.run and self.run.model_config)
    anchor_kind = property(lambda self: self.run and self.run.anchor_kind)
    recipe = property(lambda self: self.run and self.run.recipe)
    system_prompt = property(lambda self: self.run.system_prompt if self.run else "")

    @property
    def name(self) -> str:
        """A short name for output directories: the run's directory name (with the step), or
        the model's last path component."""
        if self.run is not None:
            return slug(f"{self.run.run_dir.resolve().name}-step{self.run.step}")
        s = str(self.spec).rstrip("/\\")
        base = Path(s).name or s
        for suf in (".gguf", ".GGUF"):
            if base.endswith(suf):
                base = base[: -len(suf)]
        return slug(base)


def resolve_eval_spec(spec: str | os.PathLike) -> EvalModelSpec:
    """Classify a ``--model`` argument without loading any weights.

    * a checkpoint directory (``RUN/checkpoints/step-000010``: ``state.json`` and
      ``policy.safetensors``) -> that checkpoint of its run, verified against its manifest;
    * a run directory (``config.yaml`` and no ``config.json``) -> its newest valid checkpoint;
    * anything else -> a model for :func:`tether.models.load_model` (hub id, local HF
      directory, ``.gguf`` file, ``smollm2``).

    Runs are read by `tether.rundir.reader.RunDir` (as ``tether train --resume`` and ``tether export`` read them).

    Raises:
        EvalError: a run directory without (valid) checkpoint, a damaged checkpoint directory, or a
            checkpoint outside a run.
    """
    s = os.fspath(spec)
    p = Path(s).expanduser()
    if is_checkpoint_dir(p):
        run = checkpoint_at(RunDir.of_checkpoint(p, verb="evaluate", error=EvalError), p)
    elif is_run_dir(p):
        run = checkpoint_at(RunDir(p, verb="evaluate", error=EvalError))
    else:
        return EvalModelSpec(spec=s)
    return EvalModelSpec(spec=s, run=run)


def check_run_anchor(info: EvalModelSpec) -> None:
    if info.run is None:
        raise EvalError(f"--anchor needs a training run directory (or one of its checkpoints); "
                        f"{info.spec!r} is a plain model")
    check_anchor(info.run, verb="evaluate", error=EvalError)


def load_eval_model(
    spec: str | os.PathLike | EvalModelSpec,
    *,
    anchor: bool = False,
    dtype: str = "float32",
    device: str = "cpu",
    merge_lora: bool = True,
) -> tuple[Any, Any, str]:
    """Load a model to evaluate; returns ``(model, tokenizer, description)``.

    * A model spec (hub id, local directory, ``.gguf`` file, ``"smollm2"``) is loaded by
      :func:`tether.models.load_model` in ``dtype`` on ``device``.
    * A run directory (``config.yaml`` + ``checkpoints/``) or a checkpoint directory: the run's
      policy at the checkpoint, or with ``anchor=True`` its anchor, by
      :func:`tether.eval.run.load_run_model` (the loader ``tether export`` uses too), in ``dtype`` on
      ``device``; with LoRA and ``merge_lora`` the adapters are merged into the base weights
      (faster generation; parameter names then lose the peft prefixes).

    The model is returned in eval mode with gradients off.

    Raises:
        EvalError: a run without a checkpoint, ``anchor=True`` for a plain model or for a run
            without anchor tensors (no KL term, or the iterative anchor), anchor tensors that
            do not match the model, or a base model that cannot be loaded.
    """

    info = spec if isinstance(spec, EvalModelSpec) else resolve_eval_spec(spec)
    if anchor:
        check_run_anchor(info)
    if info.run is not None:
        return load_run_model(info.run, anchor=anchor, dtype=dtype, device=device, merge_lora=merge_lora,
                              verb="evaluate", error=EvalError)
    try:
        model, tok = models.load_model(ModelConfig(name=info.spec, dtype=dtype, device=device))
    except ModelLoadError as e:
        raise EvalError(str(e)) from None
    model.requires_grad_(False)
    model.eval()
    return model, tok, f"model {info.spec}"
