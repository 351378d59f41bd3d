"""A run directory at one of its checkpoints, with its config and its model, for ``tether eval`` and
``tether export`` (the directory itself is read by `tether.rundir.reader.RunDir`; its config resolved by
`tether.resolve.saved.saved_config`).

* `RunCheckpoint` -- a run at one checkpoint, resolved without loading weights (`checkpoint_at`).
* `check_anchor`, `load_run_model` -- the run's model at that checkpoint, policy or anchor.

Every problem is raised as the caller's error class (``error``: `EvalError` for eval, ``ExportError``
for export), in words that name the directory and what the caller was doing (``verb``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import models  # models.load_model read at call time (tests patch it)
from ..errors import RunError
from ..models import ModelLoadError
from ..resolve.saved import saved_config
from ..rundir.checkpoint import copy_named_tensors, load_anchor_tensors, load_policy_weights
from ..rundir.reader import RunDir, checkpoint_step
from ..sections import replace


@dataclass
class RunCheckpoint:
    """A run directory at one of its checkpoints, resolved without loading weights (`checkpoint_at`).

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



def checkpoint_at(run: RunDir, which: int | Path | None = None) -> RunCheckpoint:
    """Run ``run`` at checkpoint ``which`` (see `RunDir.checkpoint`) with its config; checks the directory
    first."""
    run.open()
    ckpt = run.checkpoint(which)
    cfg, mc = saved_config(run)
    return RunCheckpoint(run_dir=run.path, checkpoint=ckpt, step=checkpoint_step(ckpt), config=cfg,
                         model_config=mc, kind=run.kind)


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
    tensors are loaded (`tether.rundir.checkpoint.load_policy_weights`). With ``anchor=True`` the
    checkpoint's anchor tensors theta_a (the EMA / fixed / reset anchor, fp32 on disk) are then
    copied into the same named parameters, so the model computes pi_a: with LoRA the policy
    tensors are loaded first for the structure and the anchor replaces the adapters. With LoRA and
    ``merge_lora`` the adapters are merged into the base weights afterwards (parameter names then
    lose the peft prefixes).

    Raises ``error``: ``anchor=True`` for a run without anchor tensors (`check_anchor`), a base
    model that cannot be loaded, tensors that do not match the model.
    """
    if anchor:
        check_anchor(rc, verb=verb, error=error)
    mc = replace(rc.model_config, dtype=dtype, device=device, gradient_checkpointing=False)
    try:
        model, tok = models.load_model(mc)
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
