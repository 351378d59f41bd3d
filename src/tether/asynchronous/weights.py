"""The weights rollout workers sample with (asynchronous training; docs/async.md, `tether.asynchronous.workers`):
what the trainer pushes, how it travels, and how a version is verified.

Weights travel as one shared-memory copy of the trainer's *effective* weights (`effective_weights`:
LoRA merged into the base, every name of a tied tensor), written with a version
counter (`SharedWeights`, a seqlock; tied tensors stored once, `unique_weights` / `copy_weights`, which the network
transport `tether.asynchronous.remote` uses too); the workers' models are plain (un-wrapped) copies loaded
with ``tether.models.load_model``. With ``verify`` each version is checksummed on both sides
(`checksum`): the trainer of what it pushed, the worker of its own model's weights read back after
loading, and the worker pool raises `WeightSyncError` when they differ, so stale or corrupted weights
are an error, not a silent off-policy bias.

A vLLM engine keeps its own copy of the weights, so the model's checksum says nothing about what vLLM
samples with: with ``verify`` a vLLM worker also reports the engine's log-probs of a fixed probe text
(`PROBE_TEXT`, `engine_probe_logp`), compared with the trainer's own (`model_probe_logp`).
"""

from __future__ import annotations

import ctypes
import hashlib
import time

import torch

from ..errors import GenerationError
from ..rollout.probe import PROBE_TEXT, model_probe_logp, probe_ids  # noqa: F401 (re-exported: the workers' probe)


class WeightSyncError(GenerationError):
    """A rollout worker sampled with weights that are not the version it claims (checksum mismatch)."""


# ------------------------------------------------------------------ the weights and their checksum


def _lora_layers(model) -> dict:
    """module name -> peft LoRA layer (a module with ``base_layer`` and ``get_delta_weight``)."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "get_delta_weight")}


@torch.no_grad()
def effective_weights(model) -> dict[str, torch.Tensor]:
    """name -> weight of the plain model that samples as ``model`` does: for a peft model the base
    model's names with every active LoRA adapter merged (W + scale * B A, the trainer's weights left
    untouched), and every name of a tied tensor (``lm_head.weight`` and ``model.embed_tokens.weight``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lora = _lora_layers(base)
    out = {}
    for name, p in base.named_parameters(remove_duplicate=False):
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer") and owner[:-len(".base_layer")] in lora:
            owner = owner[:-len(".base_layer")]
            layer, name = lora[owner], f"{owner}.{leaf}"
            if leaf == "weight" and not layer.merged and not getattr(layer, "disable_adapters", False):
                for a in layer.active_adapters:
                    if a in layer.lora_A:
                        p = p + layer.get_delta_weight(a).to(p.dtype)
        out[name] = p.detach()
    return out


def checksum(weights: dict[str, torch.Tensor]) -> str:
    """blake2b of the names and exact bytes of ``weights`` in name order (one pass over the weights)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        t = weights[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        # the bytes read in place, not through .numpy(): that marks the storage not resizable, and FSDP2 frees
        # a gathered parameter by resizing its storage to 0 (a checksum of the gathered weights under torchrun)
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()


def model_weights(model) -> dict[str, torch.Tensor]:
    """A plain model's weights by every name (tied tensors under each of their names)."""
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


class SharedWeights:
    """One shared-memory copy of the effective weights (tied tensors stored once) and its version.

    The trainer `write`s, workers `read_into` their model (a seqlock: a torn read is retried).
    """

    def __init__(self, weights: dict[str, torch.Tensor], ctx):
        stored, self.alias = unique_weights(weights)  # tied: one buffer, every name
        self.tensors = {name: torch.empty(weights[name].shape, dtype=weights[name].dtype).share_memory_()
                        for name in stored}
        self.version = ctx.Value("q", -1, lock=False)
        self.seq = ctx.Value("q", 0, lock=False)  # odd while the trainer writes (a seqlock: readers hold no lock)

    def names(self) -> set:
        return set(self.tensors) | set(self.alias)

    @torch.no_grad()
    def write(self, weights: dict[str, torch.Tensor], version: int) -> None:
        if set(weights) != self.names():
            raise WeightSyncError(f"the weights to push do not match the workers' buffer (names differ: "
                                  f"{sorted(set(weights) ^ self.names())[:4]})")
        self.seq.value += 1  # odd: a write in progress
        for name, buf in self.tensors.items():
            buf.copy_(weights[name])
        self.version.value = version
        self.seq.value += 1

    def read_into(self, model) -> int:
        """Copy the newest weights into ``model`` (a plain model with the same names); returns their version.

        Lock-free for the reader (a seqlock): a copy that overlapped a write is repeated, so a worker killed
        while it reads (``kill -9``) leaves no lock held that would block the trainer's next push."""
        while True:
            seq = self.seq.value
            if seq % 2 == 0:
                copy_weights(model, self.tensors, self.alias)
                version = int(self.version.value)
                if self.seq.value == seq:
                    return version
            time.sleep(0.001)


def copy_weights(model, tensors: dict, alias: dict) -> None:
    """Copy unique ``tensors`` (tied names in ``alias``: name -> stored name) into a plain ``model``."""
    params = dict(model.named_parameters(remove_duplicate=False))
    names = set(tensors) | set(alias)
    if set(params) != names:
        raise WeightSyncError(f"the worker's model does not match the pushed weights (names differ: "
                              f"{sorted(set(params) ^ names)[:4]})")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[alias.get(name, name)])


def unique_weights(weights: dict[str, torch.Tensor]) -> tuple[list[str], dict[str, str]]:
    """(names stored, alias: tied name -> the stored name of its tensor) for ``weights`` in name order."""
    stored, alias, seen = [], {}, {}
    for name in sorted(weights):
        t = weights[name]
        key = (t.data_ptr(), tuple(t.shape), t.dtype, t.device)
        if key in seen:
            alias[name] = seen[key]
        else:
            seen[key] = name
            stored.append(name)
    return stored, alias


# ------------------------------------------------------------------ the probe of a vLLM engine

def engine_probe_logp(engine, ids: list[int]) -> list[float]:
    """The same log-probs as the vLLM engine computes them with the weights it holds (``prompt_logprobs``):
    the weights vLLM samples with, read back through its own forward."""
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    (out,) = engine.llm.generate([TokensPrompt(prompt_token_ids=list(ids))],
                                 VSP(max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0), use_tqdm=False)
    return [float(d[t].logprob) for d, t in zip(out.prompt_logprobs[1:], ids[1:])]
