"""``tether export``: a run's policy or anchor as a standard Hugging Face model directory.

A tether checkpoint (``RUN/checkpoints/step-N/policy.safetensors``) holds only the trainable
tensors under tether's names; nothing outside tether can load it. `export_run` rebuilds the
run's model at a checkpoint (the run's base model from ``RUN/config.yaml``, the checkpoint's
policy tensors, and for ``anchor=True`` its anchor tensors in their place) and writes a
directory that plain transformers (``AutoModelForCausalLM`` / ``AutoTokenizer``), vLLM,
lm-eval or a Hub upload take as is:

    config.json                   model config (dtype, tie_word_embeddings as the base model)
    model.safetensors             weights; above --max-shard-size: model-0000k-of-0000n.safetensors
                                  + model.safetensors.index.json (transformers' own sharding)
    generation_config.json        eos / pad / bos ids (and the base model's sampling defaults)
    tokenizer files               tokenizer.json, tokenizer_config.json, chat template, ...
    README.md                     model card (`tether.export_card`): base model, recipe, steps, metrics, versions

With LoRA the adapters are merged into the base weights (the default), or, with
``lora="adapter"``, written as a standard PEFT adapter directory (``adapter_config.json``,
``adapter_model.safetensors``; no ``config.json``) for ``PeftModel.from_pretrained``.

Nothing of tether's internal layout leaks into the files: CPU linear weights that
`tether.models.column_major_linear_weights` stores column-major are written contiguous
(row-major), names are the plain transformers names, and tied embeddings stay one tensor.

The directory is written into a temporary sibling ``.OUT.tmp-export-<pid>-<random>`` and
renamed into place at the end, so a failed or killed export never leaves a half directory
under the target name. A non-empty target is refused; ``overwrite=True`` replaces it only if it
is an earlier export that tether wrote and nothing else was put into (`tether.rundir.owned`: the
``.tether.json`` marker, which lists the export's files, is written into every export).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from .errors import OutputError
from .eval.run import RunCheckpoint, check_anchor, checkpoint_at, load_run_model
from .export_card import render_card
from .models import EMBEDDED_MODEL_NAME
from .rundir.checkpoint import pid_alive
from .rundir.guard import WRITE_ERRNOS
from .rundir.owned import check_replaceable, write_marker
from .rundir.reader import RunDir
from .userio import loads_json

#: ``--dtype`` names -> torch dtypes (long forms accepted too).
EXPORT_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
#: Default shard size: the Hub's usual limit per file.
DEFAULT_MAX_SHARD_SIZE = "5GB"
_TMP_TAG = ".tmp-export-"
_OLD_TAG = ".old-export-"  # a replaced export (--overwrite), deleted once the new one is in place


class ExportError(ValueError):
    """A bad export request (missing run / checkpoint / step, no anchor, no LoRA, target in the way)."""


# --------------------------------------------------------------------------- which checkpoint, the model


def resolve_run_checkpoint(run_dir: str | os.PathLike, step: Optional[int] = None) -> RunCheckpoint:
    """The run's checkpoint at ``step`` (default: the newest valid one) and its config, read by
    `tether.rundir.reader.RunDir` (as ``tether eval`` and ``tether train --resume`` read a run).

    Raises:
        ExportError: no run directory / ``config.yaml``, no (valid) checkpoint, no checkpoint at ``step``
            (the message lists the available steps), or a damaged checkpoint at ``step``.
    """
    return checkpoint_at(RunDir(run_dir, verb="export", error=ExportError), step)


def plain_contiguous(model: torch.nn.Module) -> int:
    """Make every parameter and buffer of ``model`` a contiguous (row-major) tensor; returns how many moved.

    Undoes `tether.models.column_major_linear_weights` (and any other strided storage) in place;
    values, names and sharing (tied embeddings: one Parameter) are unchanged.
    """
    moved, seen = 0, set()
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            if not t.data.is_contiguous():
                t.data = t.data.contiguous()
                moved += 1
    return moved


# --------------------------------------------------------------------------- the model card


def _is_hub_id(name: str) -> bool:
    return (name != EMBEDDED_MODEL_NAME and not Path(name).expanduser().exists()
            and re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", name) is not None)


def model_card(rc: RunCheckpoint, *, anchor: bool, fmt: str, dtype: str, base_ref: str) -> str:
    """The export's ``README.md``: what was exported, from which run and recipe, metrics, versions
    (written by `tether.export_card.render_card`)."""
    return render_card(rc, anchor=anchor, fmt=fmt, dtype=dtype, base_ref=base_ref,
                       base_on_hub=_is_hub_id(str(rc.model_config.name)))


# --------------------------------------------------------------------------- atomic output


def _clean_stale_temps(out: Path, tag: str = _TMP_TAG) -> None:
    """Remove the hidden dirs (``tag``: temp, or moved-aside old export) that earlier exports to
    ``out`` left when they were killed (their process is gone)."""
    prefix = f".{out.name}{tag}"
    for p in out.parent.glob(f"{prefix}*"):
        m = re.match(r"(\d+)(-|$)", p.name[len(prefix):])
        if p.is_dir() and m and not pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def check_target(out_dir: str | os.PathLike, overwrite: bool = False, run_dir: Optional[Path] = None) -> Path:
    """Validate the target directory before anything is loaded; returns it as a Path.

    The target must be absent or empty; with ``overwrite`` it may also be an earlier export, and
    only one that tether wrote and nothing was added to (`tether.rundir.owned.check_replaceable`: a
    directory of yours is never deleted). Its parent must be writable: a temporary directory is
    made and removed there now, so a read-only or missing place fails before the model loads.

    Raises:
        ExportError: it is a file or a symlink, a non-empty directory and not ``overwrite``, not an
            export tether wrote, it is (or contains) the run directory, or its parent cannot be written.
    """
    out = Path(out_dir).expanduser()
    if run_dir is not None:
        o, r = out.resolve(), Path(run_dir).resolve()
        if o == r or o in r.parents:
            raise ExportError(f"output directory {out} is or contains the run directory {run_dir}; pick another")
    if out.is_symlink():
        raise ExportError(f"output path {out} is a symbolic link (to {os.path.realpath(out)}); an export is "
                          f"renamed into place and would replace the link: name the real directory")
    if out.exists():
        if not out.is_dir():
            raise ExportError(f"output path {out} exists and is not a directory")
        if any(out.iterdir()):
            if not overwrite:
                raise ExportError(f"output directory {out} exists and is not empty; pass --overwrite to replace "
                                  f"an earlier export")
            try:
                check_replaceable(out, "export")
            except OutputError as e:
                raise ExportError(str(e)) from None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}{_TMP_TAG}{os.getpid()}-", dir=out.parent))
    except OSError as e:
        raise ExportError(f"cannot write the export to {out}: {e.strerror or e} ({e.filename or out.parent}); "
                          f"choose a writable place") from None
    return out


def _fsync_tree(d: Path) -> None:
    for p in d.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    try:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` (checked by `check_target`) is replaced."""
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700, and transformers writes shards 0600: make the export readable
    for f in tmp.iterdir():
        if f.is_file():
            os.chmod(f, 0o644)
    old = None
    if out.is_dir() and not out.is_symlink():
        if any(out.iterdir()):
            old = out.with_name(f".{out.name}{_OLD_TAG}{os.getpid()}")
            if old.exists():
                shutil.rmtree(old)
            os.rename(out, old)
        else:
            out.rmdir()
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None and not out.exists():
            os.rename(old, out)  # put the previous export back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- writing


def _write_weights(model, tmp: Path, max_shard_size: str | int) -> None:
    """``save_pretrained`` of the model (full: config.json + safetensors shards; PEFT: the adapter)."""
    if _is_peft(model):
        model.save_pretrained(str(tmp))
    else:
        model.save_pretrained(str(tmp), max_shard_size=max_shard_size)


def _is_peft(model) -> bool:
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def resolve_export_dtype(dtype: Optional[str], rc: RunCheckpoint) -> tuple[str, torch.dtype]:
    """(name, torch dtype) for ``--dtype``; None means the run's training dtype (``model.dtype``)."""
    name = str(dtype if dtype is not None else getattr(rc.model_config, "dtype", "float32")).lower()
    if name not in EXPORT_DTYPES:
        raise ExportError(f"unknown dtype {name!r}; expected bf16, fp16 or fp32")
    td = EXPORT_DTYPES[name]
    return str(td).removeprefix("torch."), td


def _check_request(rc: RunCheckpoint, *, lora: Optional[str], anchor: bool, max_shard_size: str | int) -> str | int:
    """The checks that need the run: ``lora`` ("merge" / "adapter") only on a LoRA run, an anchor
    to export for ``anchor``, a valid shard size. Returns ``max_shard_size``, a digit string as bytes."""
    if lora == "merge" and not rc.lora:
        raise ExportError(f"--merge-lora needs a LoRA run; run {rc.run_dir} fine-tuned all weights "
                          "(its export is a full model already: drop --merge-lora)")
    if lora == "adapter" and not rc.lora:
        raise ExportError(f"--adapter-only needs a LoRA run; run {rc.run_dir} fine-tuned all weights "
                          f"(model.lora_r = 0)")
    if anchor:
        check_anchor(rc, verb="export", error=ExportError)
    if isinstance(max_shard_size, str) and max_shard_size.strip().isdigit():
        max_shard_size = int(max_shard_size)  # bytes
    _check_shard_size(max_shard_size)
    return max_shard_size


def _write_export(out: Path, model, base, tokenizer, card: str, *, fmt: str, max_shard_size: str | int) -> None:
    """Write the export into a temporary sibling of ``out`` and rename it into place (see the module
    docstring); on any failure the temporary directory is removed and ``out`` is left as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_temps(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{_TMP_TAG}{os.getpid()}-", dir=out.parent))
    try:
        _write_weights(model, tmp, max_shard_size)
        if fmt == "full":
            _add_legacy_config_keys(tmp / "config.json")
        else:
            base.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "README.md").write_text(card)
        write_marker(tmp, "export", [p.name for p in tmp.iterdir()])  # what --overwrite may replace later
        _fsync_tree(tmp)
        _publish(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _is_write_failure(e):  # disk full, quota, read-only, file too large: the user's to fix
            raise ExportError(f"cannot write the export to {out}: {_write_failure_text(e)}; nothing was written "
                              f"under {out.name} (free space or choose another place)") from None
        raise
    _clean_stale_temps(out, _OLD_TAG)  # an --overwrite killed between its two renames


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: Optional[int] = None,
               anchor: bool = False, lora: Optional[str] = None, dtype: Optional[str] = None,
               max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE, overwrite: bool = False,
               log=None) -> Path:
    """Export a run's policy (or anchor) at a checkpoint as a Hugging Face model directory.

    Args:
        run_dir: the training run (``config.yaml`` + ``checkpoints/``).
        out_dir: the directory to create; must be absent or empty unless ``overwrite``.
        step: checkpoint step (default: the latest complete checkpoint).
        anchor: export the anchor (EMA / fixed / reset) instead of the policy.
        lora: for LoRA runs, ``"merge"`` (default: adapters merged into the base weights, a
            full model) or ``"adapter"`` (a PEFT adapter directory); must be None / "merge"
            for runs without LoRA.
        dtype: ``bf16`` | ``fp16`` | ``fp32`` (default: the run's ``model.dtype``).
        max_shard_size: weights above this are split into shards with an index file
            (transformers' ``save_pretrained``), e.g. ``"5GB"``, ``"500MB"`` or bytes.
        overwrite: replace a non-empty ``out_dir``.
        log: callable for progress lines (default: none).

    Returns:
        ``out_dir``.

    Raises:
        ExportError: see `resolve_run_checkpoint`, `tether.eval.run.check_anchor`, `check_target`; ``lora="adapter"``
            without LoRA; an unknown ``lora`` or dtype.
    """
    log = log or (lambda *a: None)
    if lora not in (None, "merge", "adapter"):
        raise ExportError(f"lora must be 'merge' or 'adapter', got {lora!r}")
    rc = resolve_run_checkpoint(run_dir, step)
    out = check_target(out_dir, overwrite, rc.run_dir)
    max_shard_size = _check_request(rc, lora=lora, anchor=anchor, max_shard_size=max_shard_size)
    fmt = "adapter" if lora == "adapter" else "full"
    dtype_name, torch_dtype = resolve_export_dtype(dtype, rc)

    log(f"[tether] rebuilding {rc.run_dir} step {rc.step} {'anchor' if anchor else 'policy'} "
        f"(base {rc.model_config.name})")
    # fp32 on the CPU keeps the EMA anchor's fp32 master exact; the export casts afterwards
    model, _, _ = load_run_model(rc, anchor=anchor, dtype="float32", device="cpu", merge_lora=fmt == "full",
                                 verb="export", error=ExportError)
    base = model.get_base_model() if _is_peft(model) else model
    plain_contiguous(model)
    model.to(torch_dtype)
    plain_contiguous(model)  # .to() keeps strides; make sure nothing strided is left

    from transformers import AutoTokenizer

    base_path = base.name_or_path  # the resolved local directory of the base model
    tokenizer = AutoTokenizer.from_pretrained(base_path, trust_remote_code=bool(rc.model_config.trust_remote_code))
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # what tether trained with (config.pad_token_id agrees)
    base_ref = str(rc.model_config.name) if _is_hub_id(str(rc.model_config.name)) else str(base_path)
    if fmt == "adapter":
        for pc in model.peft_config.values():
            pc.base_model_name_or_path = base_ref
    card = model_card(rc, anchor=anchor, fmt=fmt, dtype=dtype_name, base_ref=base_ref)

    _write_export(out, model, base, tokenizer, card, fmt=fmt, max_shard_size=max_shard_size)
    log(f"[tether] exported to {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
    return out


def _is_write_failure(e: BaseException) -> bool:
    """A write that failed for lack of space or rights (OSError, or safetensors' own error for the same)."""
    if isinstance(e, OSError):
        return e.errno in WRITE_ERRNOS
    return type(e).__name__ == "SafetensorError"


def _write_failure_text(e: BaseException) -> str:
    if isinstance(e, OSError):
        return f"{e.strerror or os.strerror(e.errno)} ({e.filename})" if e.filename else (e.strerror or str(e))
    return f"{type(e).__name__}: {e}"


def _add_legacy_config_keys(config_json: Path) -> None:
    """Also write the pre-5.0 spellings of ``config.json`` keys transformers 5 renamed, for older readers.

    transformers < 4.56 (and the vLLM versions built on it) read only ``torch_dtype`` (else fp32), and
    transformers < 5 reads ``rope_theta`` / ``rope_scaling`` instead of ``rope_parameters`` (a missing
    ``rope_theta`` silently means the class default, e.g. 10000 for Llama where SmolLM2 uses 100000).
    transformers 5 reads ``rope_parameters`` first, so the extra keys change nothing for it.
    """
    cfg = loads_json(config_json.read_text())
    changed = False
    if "dtype" in cfg and "torch_dtype" not in cfg:
        cfg["torch_dtype"] = cfg["dtype"]
        changed = True
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_type" in rope:  # one global dict (not nested per layer type)
        if "rope_theta" in rope and "rope_theta" not in cfg:
            cfg["rope_theta"] = rope["rope_theta"]
            changed = True
        if rope.get("rope_type") != "default" and cfg.get("rope_scaling") is None:
            cfg["rope_scaling"] = dict(rope)
            changed = True
    if changed:
        config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _check_shard_size(max_shard_size: str | int) -> None:
    try:
        from transformers.utils.hub import convert_file_size_to_int
    except ImportError:  # moved in some transformers version: let save_pretrained judge
        return
    try:
        ok = convert_file_size_to_int(max_shard_size) > 0
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise ExportError(f"--max-shard-size {max_shard_size!r} is not a size such as 500MB or 5GB")


# --------------------------------------------------------------------------- the command line


def add_export_parser(sub) -> None:
    """Register the ``export`` subcommand on an ``argparse`` subparsers object."""
    e = sub.add_parser(
        "export", help="write a run's policy or anchor as a Hugging Face model directory (transformers, vLLM, hub)",
        description="Rebuild a run's model at a checkpoint and write OUT_DIR: config.json, model.safetensors "
        "(sharded above --max-shard-size), generation_config.json, tokenizer files with the chat template, and "
        "a README.md model card. Loads with AutoModelForCausalLM.from_pretrained(OUT_DIR) without tether. "
        "See docs/export.md.")
    e.add_argument("run_dir", metavar="RUN_DIR", help="training run directory (config.yaml + checkpoints/)")
    e.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (must be absent or empty unless --overwrite)")
    e.add_argument("--step", type=int, default=None, help="export checkpoints/step-N (default: the latest checkpoint)")
    e.add_argument("--anchor", action="store_true",
                   help="export the anchor (EMA / fixed / reset) instead of the policy")
    g = e.add_mutually_exclusive_group()
    g.add_argument("--merge-lora", dest="lora", action="store_const", const="merge",
                   help="LoRA runs: merge the adapters into the base weights, a full model (the default)")
    g.add_argument("--adapter-only", dest="lora", action="store_const", const="adapter",
                   help="LoRA runs: write a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) "
                   "for PeftModel.from_pretrained on the base model")
    e.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                   help="dtype of the written weights (default: the run's model.dtype)")
    e.add_argument("--max-shard-size", dest="max_shard_size", default=DEFAULT_MAX_SHARD_SIZE,
                   help=f"split the weights into shards of at most this size, with an index file "
                   f"(e.g. 500MB, 2GB; default {DEFAULT_MAX_SHARD_SIZE})")
    e.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    e.set_defaults(fn=run_export_cli, lora=None)


def run_export_cli(args) -> int:
    """``tether export``: errors in the request raise `ExportError` (exit code 2 via ``tether.cli``)."""
    out = export_run(args.run_dir, args.out_dir, step=args.step, anchor=args.anchor, lora=args.lora,
                     dtype=args.dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                     log=lambda m: print(m, file=sys.stderr))
    print(out)
    return 0
