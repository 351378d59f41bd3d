"""The keys of the earlier flat layout and their places in the nested one: a config written for the old keys
gets one clear error per key naming its new place (`moved_key`), and a run directory saved before the change
is read in the new layout (`migrate_saved`: ``--resume``, ``tether eval --model RUN``, ``tether export``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..sections import chosen, variant_for

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
    **{f"env.{k}": f"rollout.agent.env.{k}" for k in ("name", "max_turns", "max_obs_tokens", "max_context",
                                                      "observation_format", "observation_role")},
    "search.retriever": "rollout.agent.env.retriever.kind",
    **{f"search.{k}": f"rollout.agent.env.retriever.{k}" for k in ("corpus", "data_dir", "url", "dense_model",
                                                                   "topk", "timeout", "retries")},
    "search.observation_format": "rollout.agent.env.retriever.passage_format",
    "search.max_searches": "rollout.agent.env.max_turns",
    "search.max_obs_tokens": "rollout.agent.env.max_obs_tokens",
    "search.max_context": "rollout.agent.env.max_context",
}

_NOTES = {
    "rollout.engine.": " (with rollout.engine.kind={kind}: rollout.engine: {{kind: {kind}, {key}: ...}})",
    "train.async.max_staleness": " (train.async=K is short for it; train.async=none is the synchronous loop)",
    "rollout.agent.env.max_turns": "{searches}",
    "rollout.agent.env.retriever.": " (the search environment: rollout.agent.kind=multi_turn, "
                                    "rollout.agent.env.name=search)",
    "rollout.agent.env.": " (with rollout.agent.kind=multi_turn)",
}


#: keys of a retired feature -> what replaced it (an old config gets one line saying so)
RETIRED_PREFIXES = ("train.async.transport", "train.worker_address", "train.worker_timeout_s")
RETIRED_NOTE = ("the remote transport (`tether worker` processes over tether's own TCP protocol) was retired: serve "
                "rollouts on other nodes with vLLM's server instead, rollout.engine.kind=vllm_server with "
                "rollout.engine.urls=[http://HOST:PORT, ...] (weights through vLLM's weight-transfer protocol; "
                "docs/async.md, 'Served rollouts'); local rollout workers need no key")


def retired_key(key: str) -> str | None:
    """The error for a key of a retired feature, naming what replaced it; None for any other key."""
    if any(key == p or key.startswith(p + ".") for p in RETIRED_PREFIXES):
        return f"config key {key!r}: {RETIRED_NOTE}"
    return None


def moved_key(key: str) -> str | None:
    """The error for a key of the earlier flat layout, naming its new place (or what replaced a retired feature);
    None for any other key."""
    retired = retired_key(key)
    if retired:
        return retired
    new = MOVED.get(key)
    if new is None:
        return None
    note = ""
    for start, text in _NOTES.items():
        if new.startswith(start):
            kind = "vllm" if key.startswith("rollout.vllm_") else "hf"
            searches = (" as max_searches + 1: the turn budget counts the final turn (the search environment: "
                        "rollout.agent.kind=multi_turn, rollout.agent.env.name=search)" if key.startswith("search.")
                        else " (with rollout.agent.kind=multi_turn)")
            note = text.format(kind=kind, key=new.rpartition(".")[2], searches=searches)
            break
    return f"config key {key!r} moved to {new!r}{note}; see docs/config.md, 'Keys of the earlier flat layout'"


def migrate_saved(flat: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys (a saved run's flattened config, or a sweep's recorded overrides) in the nested layout: the
    old keys renamed, their sections chosen. An old ``rollout.engine: vllm`` with its ``vllm_*`` keys becomes
    ``rollout.engine: {kind: vllm, ...}`` (the other kind's keys, at their defaults in a saved run, are
    dropped); ``train.max_staleness: 0`` drops the async keys and is ``train.async: none``; the retired
    transport's keys go when they chose the local workers (the default, the only workers left), and a saved run
    that used the remote transport is a ConfigError saying what replaced it. The old agents: ``multi_turn`` keeps
    its ``env.*`` keys under ``rollout.agent.env``; ``search`` becomes ``multi_turn`` with ``env.name=search``, its
    ``search.*`` keys in that env and its retriever section (``max_searches`` M as ``max_turns`` M + 1); the
    sections an old agent did not read (at their defaults in a saved run) are dropped. Keys of the new layout pass
    unchanged."""
    flat = _without_local_transport(flat)
    if not any(k in MOVED for k in flat) and flat.get("rollout.agent") != "search":
        return dict(flat)
    out: dict[str, Any] = {}
    engine = flat.get("rollout.engine")
    staleness = flat.get("train.max_staleness")
    agent = flat.get("rollout.agent")
    for k, v in flat.items():
        if k == "rollout.engine" and isinstance(v, str):
            out["rollout.engine.kind"] = v
            continue
        if k == "rollout.agent" and isinstance(v, str):
            out["rollout.agent.kind"] = "multi_turn" if v == "search" else v
            continue
        new = MOVED.get(k)
        if new is None:
            out[k] = v
        elif new.startswith("rollout.engine."):
            if not isinstance(engine, str) or (engine == "vllm") == k.startswith("rollout.vllm_"):
                out[new] = v
        elif new.startswith("rollout.agent."):
            if agent is None or agent == ("search" if k.startswith("search.") else "multi_turn"):
                out[new] = v + 1 if k == "search.max_searches" else v
        elif staleness is None or staleness >= 1:
            out[new] = v
    if agent == "search":
        out["rollout.agent.env.name"] = "search"
    if staleness is not None and staleness < 1:
        out["train.async"] = None
    return out


def _without_local_transport(flat: dict[str, Any]) -> dict[str, Any]:
    """A saved config's ``train.async.transport`` keys (and the old flat ``train.worker_*``) dropped when they chose
    the local workers, what every run without the retired remote transport did; a run that used the remote transport
    is a ConfigError naming what replaced it."""
    from ..errors import ConfigError

    retired = [k for k in flat if retired_key(k)]
    if (flat.get("train.async.transport.kind") == "remote" or flat.get("train.async.transport") == "remote"
            or flat.get("train.worker_address")):
        raise ConfigError(f"this run used the remote transport: {RETIRED_NOTE}")
    return {k: v for k, v in flat.items() if k not in retired}


def kind_mapping(value: Any, kinds: dict[str, Any], old_defaults: dict[str, Any], default_kind: str,
                 key: str = "kind") -> Any:
    """A chosen section given as its kind (``"ema"``), a dataclass, or an earlier release's mapping that held every
    kind's keys: the mapping of its kind's section (``kinds``: kind -> section class; ``key``: the key that chooses
    it), a key the kind does not read dropped when it holds its old default (any other value stays, and is refused
    as an unknown key of the kind)."""
    if isinstance(value, str):
        return {key: value}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if not isinstance(value, dict):
        return value
    value = {key: default_kind, **value}
    cls = variant_for(kinds, value[key])
    if cls is None:
        return value
    return {k: v for k, v in value.items()
            if k in cls.model_fields or k not in old_defaults or v != old_defaults[k]}


def drop_unread_keys(vals: dict[str, Any], prefix: str, kinds: dict[str, Any], other: Any,
                     old_defaults: dict[str, Any], kind: str, key: str = "kind") -> dict[str, Any]:
    """Dotted keys ``vals`` without the ``<prefix>.<key>`` keys that the section's kind (``vals``' own
    ``<prefix>.kind``, or its ``key``, when it sets one, else ``kind``) does not read and that hold their old
    default: an earlier release wrote every kind's keys into each config.yaml, and setting one at that default never
    had an effect."""
    given = vals.get(f"{prefix}.{key}", vals.get(prefix))
    kind = given if isinstance(given, str) else given.get(key, kind) if isinstance(given, dict) else kind
    fields = (variant_for(kinds, kind) or other).model_fields
    n = len(prefix) + 1
    return {k: v for k, v in vals.items()
            if not (k.startswith(prefix + ".") and k[n:] in old_defaults and k[n:] not in fields
                    and v == old_defaults[k[n:]])}


@dataclasses.dataclass(frozen=True)
class Choice:
    """A section chosen by its ``key`` (``kind``; ``algo.kl``: ``estimator``; ``data``: ``task``), declared once:
    where it sits (``at``), its variants (``kinds``: kind -> section class; a key ending in ``:`` holds every name
    it starts), the variant of any other kind (``other``: a user's plugin, every key), the kind a mapping without the
    key gets, and the keys every kind carried before each had its own section with their defaults then
    (``old_defaults``: what an earlier release saved). ``type`` is the field's annotation (`tether.sections.chosen`)."""

    at: str
    kinds: dict[str, Any]
    other: Any
    default_kind: str
    old_defaults: dict[str, Any]
    key: str = "kind"
    type: Any = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", chosen(self.kinds, self.other, self.default_kind))

    def section(self, kind: str | None = None, **keys: Any) -> Any:
        """The section of ``kind`` (default: the default kind; or given by its key, ``estimator="k3"``) with ``keys``
        (``KL.section("k3", beta=1e-3)``)."""
        kind = keys.pop(self.key, self.default_kind if kind is None else kind)
        return (variant_for(self.kinds, kind) or self.other)(**{self.key: kind}, **keys)

    def mapping(self, value: Any) -> Any:
        """The section given as its kind, a dataclass or an earlier release's mapping of every kind's keys: its
        kind's mapping (`kind_mapping`); the field's before-validator."""
        return kind_mapping(value, self.kinds, self.old_defaults, self.default_kind, key=self.key)

    def drop_unread(self, vals: dict[str, Any], kind: Any) -> dict[str, Any]:
        """Dotted keys ``vals`` without this section's keys that ``kind`` (or the kind ``vals`` set) does not read at
        their old default (`drop_unread_keys`)."""
        return drop_unread_keys(vals, self.at, self.kinds, self.other, self.old_defaults, kind, key=self.key)
