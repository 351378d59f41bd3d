"""Checkpoints in safetensors, written atomically: a crash never leaves a half checkpoint.

Layout of ``RUN/checkpoints/step-000010/``:

    policy.safetensors      trainable parameters (all of them, or the LoRA adapters)
    anchor.safetensors      the anchor's tensors (EMA in fp32, fp64 for an fp64 policy), when the anchor keeps any
    optimizer.safetensors   AdamW moments, keyed ``state.<param index>.<name>``
    rng.safetensors         torch CPU (and CUDA) generator states
    state.json              step, data position, scheduler, optimizer groups, anchor counters, python RNG
    manifest.json           size and sha256 of each file above, read back from disk after it was written

A checkpoint is written into ``step-N.tmp-<pid>``, flushed to disk, renamed to ``step-N``
and only then named in ``RUN/checkpoints/latest``; an interrupted write leaves the
previous checkpoint as the latest loadable one. A write that fails (disk full) removes its
temporary directory; one that is killed leaves it, and a later save of any trainer removes
it once its pid is no longer running (never another live trainer's).

:func:`latest_checkpoint` checks the newest checkpoint against its manifest (a truncated,
flipped or missing file, bad JSON) and falls back to the previous one with a warning; a
checkpoint written before manifests existed loads unverified.

Under FSDP2 (``torchrun``, ``tether.distributed``) the sharded tensors (policy, anchor, AdamW
moments) are all-gathered into whole tensors and rank 0 writes the same files as one process
would; on load every rank reads them and keeps its own shard. So a checkpoint does not depend
on the number of ranks: a run resumes at any world size (it is resharded on load), and
``tether export`` reads it as it reads a single-process one. Every rank must call
``save_checkpoint`` / ``load_checkpoint``; the run directory must be on a filesystem that all
nodes see. The RNG states saved are rank 0's (sampling seeds are derived per rank and step).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .. import distributed as dist
from ..anchor import Anchor
from ..errors import RunError
from ..metrics import warn, with_path
from ..metrics import write_text_atomic as _write_text_atomic  # a module name: tests inject failures here
from ..userio import loads_json

MANIFEST = "manifest.json"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _LazyTensors(Mapping):
    """name -> tensor of a safetensors file, each read when accessed (never all at once in memory)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._f = safe_open(str(path), framework="pt")
        self._keys = list(self._f.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._f.get_tensor(key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _read_tensors(path: Path) -> Mapping[str, torch.Tensor]:
    """A safetensors file: read whole in one process; under FSDP tensor by tensor, so that a rank that
    keeps one shard of each never holds the whole checkpoint (8 ranks of a node would hold it 8 times)."""
    return _LazyTensors(path) if dist.enabled() else load_file(str(path))


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    except SafetensorError as e:  # safetensors reports I/O failures (disk full, ...) as "... (os error N) ..."
        m = re.search(r"os error (\d+)", str(e))
        if m is None:
            raise
        raise with_path(OSError(int(m.group(1)), os.strerror(int(m.group(1)))), path) from e
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _digest(path: Path, chunk: int = 1 << 22) -> dict:
    """Size and sha256 of a file, read in chunks (a checkpoint is never held in memory twice)."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return {"size": size, "sha256": h.hexdigest()}


def verify_checkpoint(ckpt: Path) -> tuple[bool, str]:
    """``(ok, note)``: whether checkpoint ``ckpt`` matches its manifest, and what failed if not.

    A checkpoint without manifest (saved before manifests existed) is ``(True, note)``: it loads
    unverified. Sizes are compared first (cheap), then every file is hashed.
    """
    ckpt = Path(ckpt)
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        if not (ckpt / "state.json").is_file():
            return False, "no state.json and no manifest.json"
        return True, "has no manifest.json (saved by an older tether): loaded without verification"
    try:
        files = loads_json(mpath.read_text())["files"]
        entries = [(name, int(f["size"]), str(f["sha256"])) for name, f in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return False, f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for name, size, _ in entries:
        if not (ckpt / name).is_file():
            return False, f"{name} is missing"
        have = (ckpt / name).stat().st_size
        if have != size:
            return False, f"{name} has {have} bytes, the manifest says {size} (truncated or rewritten)"
    for name, _, sha in entries:
        if _digest(ckpt / name)["sha256"] != sha:
            return False, f"{name} does not match its sha256 in the manifest (corrupted)"
    return True, ""


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> tensor of the parameters that train (the policy's checkpointed weights)."""
    dist.reshard(model)  # sharded model: name the shards, not gathered copies
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def optimizer_tensors(opt: torch.optim.Optimizer, keep: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict into safetensors-able tensors and JSON-able metadata.

    Sharded moments (FSDP) are gathered whole, one at a time (every rank must call); ``keep=False``
    drops them after the gather (the ranks that do not write), else they are kept on the CPU.
    """
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                whole = dist.full_tensor(v)  # AdamW moments of a sharded parameter
                if keep:
                    tensors[f"state.{idx}.{k}"] = whole.detach().cpu() if dist.enabled() else whole
            else:
                scalars[f"{idx}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = v
    for key, v in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, anchor: Optional[Anchor],
                    optimizer: torch.optim.Optimizer, scheduler, trainer_state: dict, keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically and prune to the newest ``keep``; returns its directory."""
    # Whole tensors first. Gathering a sharded one is collective (every rank takes part), one tensor at
    # a time; only rank 0 keeps them, on the CPU, so no rank ever holds all of them on its device.
    main = dist.is_main()
    host = (lambda t: t.detach().cpu()) if dist.enabled() else (lambda t: t)  # noqa: E731
    policy = {n: host(t) for n, t in ((n, dist.full_tensor(t)) for n, t in trainable_state(model).items()) if main}
    anchor_t = None
    if anchor is not None and anchor.master:
        anchor_t = {n: host(t) for n, t in anchor.iter_tensors() if main}
    opt_t, opt_meta = optimizer_tensors(optimizer, keep=main)
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:06d}"
    if not main:
        dist.barrier()  # rank 0 writes
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"step-{step:06d}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda.{i}"] = s
    state = {
        "step": step,
        "trainer": trainer_state,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "optimizer": opt_meta,
        "anchor": None if anchor is None else {"kind": anchor.kind, "num_updates": anchor.num_updates,
                                               "kl_ma": anchor.kl_ma},
        "python_rng": _jsonable_rng(random.getstate()),
    }
    try:
        tensor_files = {"policy": policy, "anchor": anchor_t, "optimizer": opt_t, "rng": rng}
        written = []
        for name, tensors in tensor_files.items():
            if tensors is not None:
                _save_tensors(tensors, tmp / f"{name}.safetensors")
                written.append(f"{name}.safetensors")
        _write_text_atomic(tmp / "state.json", json.dumps(state, indent=1, default=_json_default))
        written.append("state.json")
        # the bytes on disk, read back after the fsync: a later truncation or bit flip shows on resume
        manifest = {"format": 1, "files": {n: _digest(tmp / n) for n in written}}
        _write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
    except Exception:  # e.g. disk full: drop the partial checkpoint (and free its space); a kill leaves it to _prune
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    _write_text_atomic(root / "latest", final.name + "\n")
    _prune(root, keep)
    dist.barrier()
    return final


def _json_default(o):
    if torch.is_tensor(o):
        return o.item() if o.numel() == 1 else o.tolist()
    raise TypeError(f"cannot serialize {type(o).__name__}")


def _jsonable_rng(state) -> list:
    return [state[0], list(state[1]), state[2]]


def _prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints; remove leftovers of interrupted writes whose writer is gone.

    A temporary directory ``step-N.tmp-<pid>`` of a process that still runs is another trainer's
    checkpoint in progress (the run lock should prevent that, but a lock can be removed by hand):
    it is left alone.
    """
    for p in checkpoints(root.parent)[keep:] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob("step-*.tmp-*"):
        pid = p.name.rpartition(".tmp-")[2]
        if p.is_dir() and pid.isdigit() and (int(pid) == os.getpid() or not pid_alive(int(pid))):
            shutil.rmtree(p, ignore_errors=True)


def step_of(p: Path) -> Optional[int]:
    m = re.fullmatch(r"step-(\d+)", p.name)
    return int(m.group(1)) if m else None


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoint directories ``checkpoints/step-N`` (renamed into place whole), newest first."""
    root = Path(run_dir) / "checkpoints"
    found = [p for p in root.glob("step-*") if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of, reverse=True)


def latest_checkpoint(run_dir: Path, warn=warn) -> Optional[Path]:
    """The newest checkpoint of a run that passes :func:`verify_checkpoint` (None if the run has none).

    A damaged checkpoint is skipped with a warning naming it and what failed, and the previous one
    is tried. Raises `RunError` when there are checkpoints but none is valid.
    """
    problems = []
    for p in checkpoints(run_dir):
        ok, note = verify_checkpoint(p)
        if ok:
            if note:
                warn(f"checkpoint {p} {note}")
            return p
        warn(f"checkpoint {p} is damaged: {note}; trying the previous one")
        problems.append(f"{p.name}: {note}")
    if problems:
        raise RunError(f"run {run_dir} has no valid checkpoint ({'; '.join(problems)})")
    return None


def copy_named_tensors(tensors: dict[str, torch.Tensor], model: torch.nn.Module, source: str) -> None:
    """Copy name -> tensor into the model's parameters of the same names (shapes must match)."""
    dist.reshard(model)  # sharded model: name the shards, not gathered copies
    named = dict(model.named_parameters())
    for n, t in tensors.items():
        if n not in named:
            raise ValueError(f"{source}: tensor {n!r} is not a parameter of the model")
        if named[n].shape != t.shape:
            raise ValueError(f"{source}: tensor {n!r} has shape {tuple(t.shape)}, the model's {tuple(named[n].shape)}")
    with torch.no_grad():
        for n, t in tensors.items():
            dist.local(named[n]).copy_(dist.shard_like(t, named[n]))  # sharded: this rank's part, in place
    dist.reshard(model)  # no FSDP module may keep weights gathered before the copy


def load_policy_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """Load a checkpoint's policy tensors into ``model`` (which must have the same trainable parameters)."""
    copy_named_tensors(_read_tensors(Path(ckpt) / "policy.safetensors"), model, str(ckpt))


def load_anchor_tensors(ckpt: Path) -> Mapping[str, torch.Tensor]:
    """A checkpoint's anchor tensors (raises if the run's anchor keeps none, e.g. iterative)."""
    path = Path(ckpt) / "anchor.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt} holds no anchor (the run had no anchor, or an iterative one)")
    return _read_tensors(path)


def load_checkpoint(ckpt: Path, model: torch.nn.Module, anchor: Optional[Anchor],
                    optimizer: torch.optim.Optimizer, scheduler) -> dict:
    """Restore everything saved by ``save_checkpoint``; returns the trainer state (step, data position...)."""
    ckpt = Path(ckpt)
    try:
        state = loads_json((ckpt / "state.json").read_text())
    except (OSError, ValueError) as e:
        raise RunError(f"cannot restore checkpoint {ckpt}: {ckpt / 'state.json'} is unreadable ({e})") from None
    try:
        return _load_checkpoint(ckpt, state, model, anchor, optimizer, scheduler)
    except (OSError, ValueError, KeyError, TypeError, IndexError, SafetensorError) as e:
        what = f"{type(e).__name__}: {e}" if isinstance(e, (KeyError, TypeError, IndexError)) else str(e)
        raise RunError(f"cannot restore checkpoint {ckpt}: {what} (was the model or algorithm changed by an "
                       f"override? a resume must keep the shapes the checkpoint was saved with)") from None


def _load_checkpoint(ckpt: Path, state: dict, model, anchor, optimizer, scheduler) -> dict:
    load_policy_weights(ckpt, model)
    if anchor is not None and anchor.master:
        anchor.load_state_dict({"kind": state["anchor"]["kind"], "num_updates": state["anchor"]["num_updates"],
                                "kl_ma": state["anchor"]["kl_ma"], "tensors": load_anchor_tensors(ckpt)}, model)
    elif anchor is not None:
        anchor.num_updates = state["anchor"]["num_updates"]
        anchor.kl_ma = state["anchor"]["kl_ma"]
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def as_param(key: str, v: torch.Tensor) -> torch.Tensor:  # moments of sharded parameters: sharded again
        idx = int(key.split(".")[1])
        return dist.as_param_layout(v, params[idx]) if idx < len(params) else v

    opt_t = {k: as_param(k, v) for k, v in _read_tensors(ckpt / "optimizer.safetensors").items()}
    optimizer.load_state_dict(_optimizer_state(opt_t, state["optimizer"]))
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    rng = load_file(str(ckpt / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    py = state["python_rng"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    return {"step": state["step"], **state["trainer"]}
