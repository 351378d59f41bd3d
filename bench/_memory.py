"""Where a training step's memory goes: the sizes of what it holds, and the peak of each phase.

The benchmarks' instrumentation (bench/, not part of the tether package; `tether.memory` keeps only
`malloc_trim`, which a run may call between its phases).

Sizes come from the tensors themselves (`storage_bytes` counts each storage once, so tied weights
and views are not counted twice):

* weights: the policy's parameters and buffers (`module_bytes`);
* the anchor: its master tensors and its forward copies (`anchor_bytes`);
* optimizer state: every tensor in ``optimizer.state`` (AdamW: two moments per parameter, and a
  one-element ``step`` tensor per parameter), `optimizer_state_bytes`;
* gradients: ``p.grad`` of the trainable parameters, read just before the optimizer step, when all
  of them exist (`grad_bytes`);
* activations: the tensors autograd keeps for the backward pass (`SavedActivations`, through
  ``torch.autograd.graph.saved_tensors_hooks``), live bytes and their peak, parameters excluded;
* the rollout's KV cache: the buffers of `tether.rollout.kvcache.GrowingLayer` (HFEngine's default
  cache), live bytes and their peak (`track_kv_cache`).

Peaks per phase (`PhaseMemory`): the resident set's high-water mark (VmHWM), reset at the start of
each phase through ``/proc/self/clear_refs`` (Linux; elsewhere only the running peak is known), and
on CUDA ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` after
``reset_peak_memory_stats``. The highest VmHWM seen before any reset is kept, so the process's own
peak is never lost. `StepMemory` puts these on a `tether.train.Trainer` for one step and writes the
breakdown (`breakdown_rows`); ``bench/vs_trl.py`` prints it for its shared job (through
``_benchutil.memory_breakdown``).

What the sizes do not show is the allocator's overhead: memory freed by tensors but kept by the C
allocator (glibc's arenas on CPU, PyTorch's caching allocator on CUDA), fragmentation, and
everything that is not a tensor (the interpreter, the libraries, the tokenizer). The breakdown's
last line is that rest: the phase's peak resident memory minus the resident memory before the model
was loaded minus the tensors live at the peak. `tether.memory.malloc_trim` hands glibc's free pages back to the OS.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Iterable, Iterator, Optional

import torch

MB = 2**20


# ------------------------------------------------------------------ sizes of tensors


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr())


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]], seen: Optional[set] = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None skipped; a view counts its whole storage).

    ``seen`` (storage keys) is updated and its storages are not counted again, so several calls can
    share one set (e.g. weights, then gradients, without counting a tied tensor twice).
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def module_bytes(model: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each storage once)."""
    return storage_bytes([*model.parameters(), *model.buffers()])


def grad_bytes(params: Iterable[torch.nn.Parameter]) -> int:
    """Bytes of the gradients held now (``p.grad``; None counts 0)."""
    return storage_bytes(p.grad for p in params)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``)."""
    return storage_bytes(v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))


def anchor_bytes(anchor) -> int:
    """Bytes the anchor holds (`tether.anchor.Anchor`: master tensors and forward copies; None counts 0)."""
    if anchor is None:
        return 0
    return storage_bytes([*anchor.master, *anchor._compute])


# ------------------------------------------------------------------ live bytes with a peak


class LiveBytes:
    """Bytes of tracked storages that are still alive, and their peak since creation (or `reset_peak`).

    `add` counts a tensor's storage once however many tensors share it, and stops counting it when
    the last tracked tensor object of that storage is garbage-collected (``weakref.finalize``).
    """

    def __init__(self):
        self._refs: dict[tuple, list] = {}  # storage key -> [tracked objects alive, bytes]
        self.live = 0
        self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [0, t.untyped_storage().nbytes()]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key: tuple) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] <= 0:
            self.live -= entry[1]
            del self._refs[key]

    def reset_peak(self) -> None:
        self.peak = self.live


class SavedActivations(LiveBytes):
    """Within the block, the tensors autograd saves for backward are tracked (live bytes, peak).

    ``exclude``: tensors whose storages are not activations (the parameters: a linear layer saves
    its weight). The hooks return the tensor unchanged, so nothing is copied or kept longer.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._exclude = {_storage_key(t) for t in exclude}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and t.device.type != "meta" and _storage_key(t) not in self._exclude:
            self.add(t)
        return t

    @contextlib.contextmanager
    def tracking(self) -> Iterator["SavedActivations"]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self


@contextlib.contextmanager
def track_kv_cache() -> Iterator[LiveBytes]:
    """Within the block, every KV buffer a `GrowingLayer` allocates or is given is tracked (live, peak).

    Covers HFEngine's default cache (``kv_cache="growing"``); transformers' ``DynamicCache`` and vLLM's
    cache are not seen. The class is patched for the block's duration and restored after it. It is
    taken from the loaded modules (this module imports nothing of tether): in
    a process that never imported ``tether.rollout.kvcache`` no such cache exists, and nothing is tracked.
    """
    live = LiveBytes()
    kvcache = sys.modules.get("tether.rollout.kvcache")
    if kvcache is None:
        yield live
        return
    GrowingLayer = kvcache.GrowingLayer
    grow, prop_k, prop_v = GrowingLayer._grow, GrowingLayer.keys, GrowingLayer.values

    def _grow(self, *a, **k):
        grow(self, *a, **k)
        for t in (self._kbuf, self._vbuf):
            if t is not None:
                live.add(t)

    def _setter(prop):
        def setter(self, t):
            prop.fset(self, t)
            if isinstance(t, torch.Tensor):
                live.add(t)
        return property(prop.fget, setter)

    GrowingLayer._grow = _grow
    GrowingLayer.keys, GrowingLayer.values = _setter(prop_k), _setter(prop_v)
    try:
        yield live
    finally:
        GrowingLayer._grow, GrowingLayer.keys, GrowingLayer.values = grow, prop_k, prop_v


# ------------------------------------------------------------------ the process: resident memory, allocator


def _status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> Optional[int]:
    """Resident memory now (VmRSS), None off Linux."""
    kb = _status_kb("VmRSS")
    return None if kb is None else kb * 1024


def peak_rss_bytes() -> Optional[int]:
    """The resident high-water mark (VmHWM) since the process started or the last `reset_peak_rss`."""
    kb = _status_kb("VmHWM")
    return None if kb is None else kb * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current resident size (``/proc/self/clear_refs``, Linux >= 4.0); False if it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------ phases of a step


class PhaseMemory:
    """Peaks of named phases: ``with pm.phase("update"): ...`` records, per phase, the resident memory at
    its start and end, its peak (VmHWM reset at the start), and on CUDA the peak allocated and reserved
    bytes. ``process_peak`` keeps the highest VmHWM seen, resets included."""

    def __init__(self):
        self.phases: dict[str, dict] = {}
        self.resettable = True
        self.process_peak = peak_rss_bytes() or 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[dict]:
        rec: dict = {"rss_start": rss_bytes()}
        self.process_peak = max(self.process_peak, peak_rss_bytes() or 0)
        self.resettable = self.resettable and reset_peak_rss()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        try:
            yield rec
        finally:
            if cuda:
                torch.cuda.synchronize()
                rec.update(cuda_peak_allocated=torch.cuda.max_memory_allocated(),
                           cuda_peak_reserved=torch.cuda.max_memory_reserved(),
                           cuda_allocated_end=torch.cuda.memory_allocated())
            hwm = peak_rss_bytes() or 0
            self.process_peak = max(self.process_peak, hwm)
            rec.update(rss_end=rss_bytes(), peak_rss=hwm if self.resettable else None)
            self.phases[name] = rec


class StepMemory:
    """One `Trainer.train_step` with its memory recorded: ``StepMemory(trainer).step()`` -> (metrics, breakdown).

    The trainer's phases (rollout, sampler pass, anchor pass, update) are observed through its public
    hook, ``Trainer.probes`` (`tether.train.StepProbes`), set for the one step and restored after it.
    During the update the saved activations are tracked, and the gradients are measured just before
    the (last) optimizer step, the optimizer state just after it; during the rollout the KV buffers
    are tracked. Run it after at least one ordinary step, so that
    the optimizer's state exists, as in every later step.

    ``baseline_rss``: resident bytes before the model was loaded (the interpreter and libraries); the
    rest line of `breakdown_rows` is measured above it.
    """

    PHASES = ("rollout", "sampler pass", "anchor pass", "update")

    def __init__(self, trainer, baseline_rss: Optional[int] = None):
        self.trainer = trainer
        self.baseline_rss = baseline_rss

    def step(self) -> tuple[dict, dict]:
        tr = self.trainer
        pm = PhaseMemory()
        acts = SavedActivations(exclude=[*tr.model.parameters(), *tr.model.buffers()])
        found: dict = {"grads": 0, "optimizer": 0, "kv_peak": None}
        engine_kv = getattr(tr.engine, "kv_cache", None) == "growing"
        wraps = {"rollout": track_kv_cache if engine_kv else None, "update": acts.tracking}

        class Probes:  # tether.train.StepProbes: the trainer's hook around each phase and optimizer step
            @contextlib.contextmanager
            def phase(self, name: str):
                wrap = wraps.get(name)
                with pm.phase(name), (wrap() if wrap else contextlib.nullcontext()) as w:
                    yield
                if name == "rollout" and w is not None:
                    found["kv_peak"] = w.peak

            @contextlib.contextmanager
            def optimizer_step(self):
                found["grads"] = grad_bytes(tr.params)
                yield
                found["optimizer"] = optimizer_state_bytes(tr.optimizer)

        before, tr.probes = tr.probes, Probes()
        try:
            metrics = tr.train_step()
        finally:
            tr.probes = before
        sizes = {
            "weights": module_bytes(tr.model),
            "anchor": anchor_bytes(tr.anchor),
            "optimizer": found["optimizer"] or optimizer_state_bytes(tr.optimizer),
            "gradients": found["grads"],
            "activations": acts.peak,
            "kv_cache": found["kv_peak"],
        }
        return metrics, {"sizes": sizes, "phases": pm.phases, "process_peak_rss": pm.process_peak,
                         "baseline_rss": self.baseline_rss}


def breakdown_rows(mem: dict) -> list[tuple[str, Optional[float], str]]:
    """``(line, MiB or None, what it is)`` rows of a `StepMemory` record, in the issue's order.

    The peak phase is the phase with the highest resident peak (on CUDA: the highest peak allocated);
    the tensors live at it are the weights, the anchor, the optimizer state, plus the gradients and the
    activations when it is the update, the KV cache when it is the rollout. The rest line is the
    peak minus the baseline minus those tensors (on CUDA: peak reserved minus peak allocated).
    """
    s, ph = mem["sizes"], mem["phases"]
    mb = lambda b: None if b is None else b / MB  # noqa: E731
    cuda = any("cuda_peak_allocated" in r for r in ph.values())
    key = "cuda_peak_allocated" if cuda else "peak_rss"
    ranked = [(r.get(key) or 0, n) for n, r in ph.items() if r.get(key) is not None]
    peak_phase = max(ranked)[1] if ranked else None
    live = s["weights"] + s["anchor"] + s["optimizer"]
    if peak_phase == "update":
        live += s["gradients"] + s["activations"]
    elif peak_phase == "rollout":
        live += s["kv_cache"] or 0
    rows = [
        ("weights", mb(s["weights"]), "parameters and buffers of the policy"),
        ("anchor / reference", mb(s["anchor"]), "the anchor's tensors (master and forward copies)"),
        ("optimizer state", mb(s["optimizer"]), "every tensor in optimizer.state"),
        ("gradients", mb(s["gradients"]), "p.grad at the optimizer step"),
        ("activations at the peak", mb(s["activations"]), "peak of the bytes saved for backward in the update"),
        ("rollout KV cache", mb(s["kv_cache"]), "peak of the GrowingLayer buffers in the rollout"
         if s["kv_cache"] is not None else "not tracked (engine without the growing cache)"),
    ]
    if cuda:
        r = ph[peak_phase]
        rows.append(("allocator overhead", mb(r["cuda_peak_reserved"] - r["cuda_peak_allocated"]),
                     f"CUDA peak reserved minus peak allocated in the {peak_phase}"))
        rows.append(("peak allocated (CUDA)", mb(r["cuda_peak_allocated"]), f"in the {peak_phase}"))
    else:
        peak = ph[peak_phase]["peak_rss"] if peak_phase else None
        base = mem.get("baseline_rss")
        if base is not None:
            rows.append(("runtime before the model", mb(base), "resident memory before the model load"))
        rest = None if peak is None else peak - (base or 0) - live
        rows.append(("allocator overhead and untracked", mb(rest),
                     f"peak RSS of the {peak_phase} minus the runtime minus the tensors live at it"))
        rows.append(("peak RSS", mb(peak), f"in the {peak_phase} (process peak {mb(mem['process_peak_rss']):.0f} MiB)"
                     if peak is not None else "VmHWM could not be reset per phase"))
    return rows
