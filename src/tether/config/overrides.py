"""One parse of a config: the dotted keys of its layers (presets, the flattened YAML file, ``key=value``
overrides) set into one nested mapping, checked by name as they are set (``set_key``: an unknown key is an error with
a did-you-mean), and validated once by the sections' own types (``parse``; a value as users write it is read by
`tether.sections.user_value`)."""

from __future__ import annotations

import copy
import difflib
from typing import Any, Callable, Optional, Sequence

from ..errors import ConfigError
from ..sections import (
    ValidationError,
    annotation,
    as_dict,
    choice_key,
    default,
    field_for_key,
    key_name,
    keys_of,
    kinds_of,
    matches,
    optional,
    validate_field,
    validation_problems,
    variants,
)
from ..userio import loads_yaml
from .migration import moved_key


def parse(cls: type, base: Any, layers: Sequence[tuple[str, dict[str, Any]]],
          prepare: Optional[Callable[[dict[str, Any], dict], dict[str, Any]]] = None) -> Any:
    """One parse: the dotted keys of each layer (``(source, {key: value})``: a preset, the config file, the
    overrides; later layers win) set into one nested mapping over ``base`` (a section of type ``cls``, or its
    mapping), then ``cls.model_validate`` once. Every key is checked by name as it is set (an unknown key is an
    error with a did-you-mean; a key of the earlier flat layout names its new place; a key of another kind names
    the kinds that read it), every value by its declared type when the whole is validated; each problem names the
    source its key came from, and all of them come at once. ``prepare(vals, tree)``, if given, rewrites a layer's
    keys against the mapping built so far (`tether.resolve.load_config` drops an earlier release's unread keys)."""
    tree = as_dict(base) if not isinstance(base, dict) else copy.deepcopy(base)
    origin: dict[str, str] = {}
    problems: list[tuple[str, str]] = []  # (source, problem)
    for source, vals in layers:
        vals = prepare(vals, tree) if prepare else vals
        moved = [moved_key(k) for k in vals if moved_key(k)]
        if moved:
            many = f"{len(moved)} keys of the earlier flat layout:\n  - " + "\n  - ".join(moved)
            raise ConfigError(f"{source}: " + (moved[0] if len(moved) == 1 else many))
        # a section's choice first, the outer before the inner: its kind, or the section given whole
        # (rollout.engine=vllm before its dtype; rollout.agent.kind before rollout.agent.env.name before its retriever)
        first = {k for k in vals if chooses(cls, k) or any(o.startswith(k + ".") for o in vals)}
        for k, v in sorted(vals.items(), key=lambda kv: (kv[0] not in first, kv[0].count(".") * (kv[0] in first))):
            try:
                set_key(tree, cls, k, v)
                origin[k] = source
            except ConfigError as e:  # a key refused by name is left out; the others are still validated
                problems.append((source, str(e)))
    try:
        parsed = cls.model_validate(tree)
    except ValidationError as e:
        problems += [(_source(p, origin), p) for p in validation_problems(e, "", "", cls)]
    if problems:  # every problem at once, each naming its key and where the key came from
        raise ConfigError(_listed(problems))
    return parsed


def chooses(cls: type, dotted: str) -> bool:
    """Whether the dotted key ``dotted`` of a section of type ``cls`` is the key that chooses a chosen section's
    variant (its `tether.sections.choice_key`: ``rollout.engine.kind``, ``algo.kl.estimator``,
    ``rollout.agent.env.name``), set before the keys under that section."""
    *path, last = dotted.split(".")
    choices = [cls]
    for part in path:
        choices = [v for c in choices if (f := field_for_key(c, part)) is not None for v in variants(annotation(c, f))]
    return len(choices) > 1 and last == choice_key(choices[-1])


def apply_keys(cfg: Any, vals: dict[str, Any], source: str) -> Any:
    """``cfg`` (a section) with the dotted keys ``vals`` set (``source`` names them in errors), parsed once: a new
    section; ``cfg`` is not changed."""
    return parse(type(cfg), cfg, [(source, vals)])


def kind_at(tree: dict, dotted: str, key: str = "kind") -> Any:
    """The kind of the chosen section at ``dotted`` in a mapping being built (its ``kind`` or other choice ``key``,
    or its shorthand)."""
    value: Any = tree
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value.get(key) if isinstance(value, dict) else value


def _source(problem: str, origin: dict[str, str]) -> str:
    """Where the key a validation problem names was set (the longest key set that is the key, a section above it,
    or a key under it; for a rule of a section that names its keys from the section, ``kl.estimator 'k3' needs
    kl.beta > 0``, a key set in that section), else "config"."""
    key = problem.removeprefix("unknown ").split(" ")[0].partition("=")[0].rstrip(":")  # (train.warmup_steps=4 ...)
    hits = [k for k in origin if key == k or key.startswith(k + ".") or k.startswith(key + ".")]
    section = key.rpartition(".")[0]
    if not hits and section:  # a short key: the section's keys, wherever the section sits (algo.kl.beta)
        hits = [k for k in origin if f".{section}." in f".{k}."]
    return origin[max(hits, key=len)] if hits else "config"


def _listed(lines: list[tuple[str, str]]) -> str:
    """``(source, problem)`` lines as one message: under the source when they share one."""
    sources = {s for s, _ in lines}
    if len(lines) == 1:
        return f"{lines[0][0]}: {lines[0][1]}"
    if len(sources) == 1:
        return f"{lines[0][0]}: {len(lines)} problems:\n  - " + "\n  - ".join(p for _, p in lines)
    return f"{len(lines)} problems:\n  - " + "\n  - ".join(f"{s}: {p}" for s, p in lines)


def set_key(tree: dict, cls: type, dotted: str, value: Any, prefix: str = "") -> None:
    """Set the dotted key ``dotted`` in ``tree``, the mapping of a section of type ``cls`` (its value is checked
    when the whole is validated). A key of a section chosen by its kind (``rollout.engine.dtype``) needs that kind;
    ``kind`` itself replaces the section by a fresh one of the new kind (``algo.kl.estimator``, the choice key of a
    family of estimators, keeps the keys the new one reads); a key of an optional section that is off
    (``train.async.workers`` while ``train.async`` is none) turns it on with its defaults; a section's shorthand
    (``rollout.engine=vllm``) is expanded before a key is set under it. An unknown key is a ConfigError with a
    did-you-mean, naming the key's new place if it is a key of the earlier flat layout."""
    head, _, rest = dotted.partition(".")
    full = prefix + head
    name = field_for_key(cls, head)
    if name is None:
        raise ConfigError(unknown_key(cls, full, prefix))
    key = key_name(cls, name)
    tp = annotation(cls, name)
    choices = variants(tp)
    if not choices:  # a plain value
        if rest:
            raise ConfigError(f"{full!r} is not a section (cannot set {prefix + dotted!r})")
        tree[key] = value
        return
    cur = tree.get(key)
    tk = choice_key(choices[-1])  # kind, or the key that chooses the variant (algo.kl: estimator)
    if not rest:
        if isinstance(value, dict) and isinstance(cur, dict) and not (
                tk == "kind" and tk in value and len(choices) > 1 and value[tk] != cur.get(tk)):
            for k, v in sorted(value.items(), key=lambda kv: str(kv[0]) != tk):  # its kind / estimator first
                set_key(tree, cls, f"{head}.{k}", v, prefix)
            return
        if value is None or isinstance(value, (dict, str, int, float)) and (len(choices) > 1 or optional(tp)):
            tree[key] = value  # a whole section: the shorthand or the mapping, expanded by the field's validators
            return
        raise ConfigError(f"{full!r} is a section; set its keys ({full}.<key>=...) or give a mapping")
    if not isinstance(cur, dict):  # off (an optional section: on, with its defaults), or a shorthand to expand
        cur = tree[key] = _expanded(cls, name, cur, full)
    sub = rest.partition(".")[0]
    if sub == tk and len(choices) > 1 and "." not in rest:
        if value != cur.get(tk):
            kept = {k: v for k, v in cur.items() if field_for_key(_variant(choices, {tk: value}), k)} if tk != "kind" \
                else {}
            tree[key] = kept | {tk: value}
        return
    variant = _variant(choices, cur)
    if field_for_key(variant, sub) is None and len(choices) > 1:
        owners = [k for c in choices if field_for_key(c, sub) is not None for k in kinds_of(c)]
        if owners:
            listed = " or ".join(map(str, owners[:6])) + (f" (or {len(owners) - 6} more)" if len(owners) > 6 else "")
            first = f"{tk} to one" if str(owners[0]).startswith("<") else f"{tk}={owners[0]}"
            raise ConfigError(f"{full}.{sub} is a key of {full}.{tk}={listed}, and {full}.{tk} "
                              f"is {cur.get(tk)!r}: set {full}.{first} first (or give {full} as a "
                              f"mapping with its {tk})")
    set_key(cur, variant, rest, value, full + ".")


def _variant(choices: list[type], mapping: dict) -> type:
    """The section class of a chosen section's ``mapping``: the variant of its kind, else the one for any other kind
    (a user's registered kind), else the only one."""
    if len(choices) == 1:
        return choices[0]
    kind = mapping.get(choice_key(choices[-1]))
    return next((c for c in choices if matches(c, kind)), None) or next(
        (c for c in choices if not kinds_of(c)), choices[0])


def _expanded(cls: type, name: str, value: Any, full: str) -> dict:
    """The mapping of field ``name``'s section given as ``value`` (None: an optional section off, now on with its
    defaults; a shorthand such as ``vllm`` or ``1``: what the field's validators make of it)."""
    if value is None:
        if optional(annotation(cls, name)):
            return {}
        value = default(cls, name)  # a section not set yet (rollout.agent.env of a new multi_turn): its default
    try:
        section = validate_field(cls, name, value)
    except ValidationError as e:
        raise ConfigError("; ".join(validation_problems(e, full, name, cls))) from None
    tk = choice_key(type(section))
    return section.model_dump(by_alias=True, exclude_unset=True) | (
        {tk: getattr(section, tk)} if tk in type(section).model_fields else {})


def unknown_key(obj, full: str, prefix: str) -> str:
    """The message for an unknown key ``full`` of section ``obj``: its new place if the earlier flat layout had
    it (`tether.config.migration`), else a did-you-mean and the valid keys there."""
    moved = moved_key(full)
    if moved:
        return moved
    head = full[len(prefix):]
    names = [key_name(obj, n) for n in keys_of(obj)]
    close = difflib.get_close_matches(head, names, n=1)
    hint = f" Did you mean {prefix + close[0]!r}?" if close else ""
    return f"unknown config key {full!r}.{hint} Valid keys here: {', '.join(prefix + n for n in names)}"


#: keys whose value is a mapping kept whole (data.options, rollout.agent.env.options), not a section
VALUE_MAPPINGS = ("options",)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys (the mappings of :data:`VALUE_MAPPINGS` kept as values)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in VALUE_MAPPINGS:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out



def parse_overrides(items: list[str]) -> dict[str, Any]:
    """['a.b=1', 'c=x'] -> {'a.b': 1, 'c': 'x'} (values parsed as YAML scalars). A key given twice takes its last
    value, so that a script can append overrides to a base list (scripts/coldstart_lib.sh does)."""
    out = {}
    for it in items:
        if "=" not in it:
            raise ConfigError(f"override {it!r} is not of the form key=value (e.g. train.lr=1e-5)")
        k, v = it.split("=", 1)
        out[k.strip()] = yaml_value(k.strip(), v) if v.strip() else ""
    return out


def yaml_value(key: str, text: str) -> Any:
    """An override's value parsed as YAML (`tether.userio.loads_yaml`): text that is not YAML (``[`` alone), nested
    too deeply for the parser, or with a key written twice in one mapping (``{size: 1, size: 2}``) is a ConfigError
    naming the key, not a traceback or a silently dropped value."""
    return loads_yaml(text, key, ConfigError)
