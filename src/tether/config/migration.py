"""The keys of the earlier flat layout and their places in the nested one: a config written for the old keys
gets one clear error per key naming its new place (`moved_key`), and a run directory saved before the change
is read in the new layout (`migrate_saved`: ``--resume``, ``tether eval --run``, ``tether export``)."""

from __future__ import annotations

from typing import Any

#: old dotted key -> its new dotted key
MOVED: dict[str, str] = {
    "rollout.share_prompt": "rollout.engine.share_prompt",
    "rollout.prune_every": "rollout.engine.prune_every",
    **{f"rollout.vllm_{k}": f"rollout.engine.{k}" for k in ("dtype", "max_model_len", "enforce_eager",
                                                           "gpu_memory_utilization", "kv_cache_gb", "sleep",
                                                           "sync_bucket_mb")},
    "train.max_staleness": "train.async.max_staleness",
    "train.async_correction": "train.async.correction",
    "train.rollout_workers": "train.async.workers",
    "train.stale_batches": "train.async.stale_batches",
    "train.verify_sync": "train.async.verify_sync",
    "train.verify_logp_tol": "train.async.verify_logp_tol",
    "train.partial_rollout_tokens": "train.async.partial_rollout_tokens",
    "train.worker_restarts": "train.async.worker_restarts",
    "train.worker_address": "train.async.transport.address",
    "train.worker_timeout_s": "train.async.transport.timeout_s",
}

_NOTES = {
    "rollout.engine.": " (with rollout.engine.kind={kind}: rollout.engine: {{kind: {kind}, {key}: ...}})",
    "train.async.max_staleness": " (train.async=K is short for it; train.async=none is the synchronous loop)",
    "train.async.transport.": " (with train.async.transport.kind=remote)",
}


def moved_key(key: str) -> str | None:
    """The error for a key of the earlier flat layout, naming its new place; None for any other key."""
    new = MOVED.get(key)
    if new is None:
        return None
    note = ""
    for start, text in _NOTES.items():
        if new.startswith(start):
            kind = "vllm" if key.startswith("rollout.vllm_") else "hf"
            note = text.format(kind=kind, key=new.rpartition(".")[2])
            break
    return f"config key {key!r} moved to {new!r}{note}; see docs/config.md, 'Keys of the earlier flat layout'"


def migrate_saved(flat: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys (a saved run's flattened config, or a sweep's recorded overrides) in the nested layout: the
    old keys renamed, their sections chosen. An old ``rollout.engine: vllm`` with its ``vllm_*`` keys becomes
    ``rollout.engine: {kind: vllm, ...}`` (the other kind's keys, at their defaults in a saved run, are
    dropped); ``train.max_staleness: 0`` drops the async keys and is ``train.async: none``; a non-empty
    ``train.worker_address`` chooses the remote transport. Keys of the new layout pass unchanged."""
    if not any(k in MOVED for k in flat):
        return dict(flat)
    out: dict[str, Any] = {}
    engine = flat.get("rollout.engine")
    staleness = flat.get("train.max_staleness")
    remote = bool(flat.get("train.worker_address"))
    for k, v in flat.items():
        if k == "rollout.engine" and isinstance(v, str):
            out["rollout.engine.kind"] = v
            continue
        new = MOVED.get(k)
        if new is None:
            out[k] = v
        elif new.startswith("rollout.engine."):
            if not isinstance(engine, str) or (engine == "vllm") == k.startswith("rollout.vllm_"):
                out[new] = v
        elif staleness is None or staleness >= 1:
            if remote or not new.startswith("train.async.transport."):
                out[new] = v
    if remote and (staleness is None or staleness >= 1):
        out["train.async.transport.kind"] = "remote"
    if staleness is not None and staleness < 1:
        out["train.async"] = None
    return out
