"""Setting config keys by dotted name: ``key=value`` overrides, and the flattened YAML file.

A value is converted to the declared type of its field (``coerce_value``); an unknown key is an error
with a did-you-mean (``set_key``).
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from ..errors import ConfigError
from ..sections import (
    ValidationError,
    annotation,
    field_for_key,
    key_name,
    keys_of,
    kind_of,
    optional,
    validation_problems,
    variants,
)
from ..userio import loads_yaml
from .migration import moved_key


def coerce_value(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the field's declared type.

    A bool is never taken for a number or a string (YAML reads ``steps: true`` or ``name: no``
    as booleans, and ``int(True)`` is 1); a bool key takes true/false, yes/no, on/off or 0/1.
    """
    origin = typing.get_origin(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
            return None
        args = [a for a in args if a is not type(None)]
        for a in args:  # a value that already has one of the types stays as it is
            plain = typing.get_origin(a) or a
            # a non-bool value of a plain type, or a bool for a bool (a bool is an int, but never taken for one)
            if ((isinstance(plain, type) and isinstance(value, plain) and not isinstance(value, bool))
                    or (a is bool and isinstance(value, bool))):
                return value
        args = sorted(args, key=lambda a: a is str)  # otherwise convert, trying str last
        for a in args:
            try:
                return coerce_value(value, a, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} is not a valid {tp}")
    if tp in (list, typing.List) or origin in (list, typing.List):
        if isinstance(value, str):
            value = yaml_value(key, value) if value.strip().startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return list(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if isinstance(value, bool) and tp in _TYPE_NAMES:  # bool is an int subclass: int(True) would be 1
        raise ConfigError(f"{key}: expected {_TYPE_NAMES[tp]}, got {value!r}")
    if tp is int:
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            if not isinstance(value, str):
                return int(value)
            return int(float(value)) if "e" in value.lower() else int(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if value is None or isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


# how coerce_value names the expected type when it gets a bool
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string (quote it in YAML)"}


def set_key(obj, dotted: str, value: Any, prefix: str = "") -> None:
    """Set the dotted key ``dotted`` of section ``obj`` to ``value`` (converted to the key's declared type and
    validated). A key of a section chosen by its kind (``rollout.engine.dtype``) needs that kind; ``kind`` itself
    replaces the section by a fresh one of the new kind; a key of an optional section that is off
    (``train.async.workers`` while ``train.async`` is none) turns it on with its defaults. Unknown keys are a
    ConfigError with a did-you-mean, naming the key's new place if it is a key of the earlier flat layout."""
    head, _, rest = dotted.partition(".")
    full = prefix + head
    name = field_for_key(obj, head)
    if name is None:
        raise ConfigError(unknown_key(obj, full, prefix))
    tp = annotation(obj, name)
    choices = variants(tp)
    if not choices:  # a plain value
        if rest:
            raise ConfigError(f"{full!r} is not a section (cannot set {prefix + dotted!r})")
        _assign(obj, name, coerce_value(value, tp, full), full)
        return
    cur = getattr(obj, name)
    if not rest:
        if isinstance(value, dict) and cur is not None and not ("kind" in value and len(choices) > 1):
            for k, v in sorted(value.items(), key=lambda kv: str(kv[0]) != "kind"):
                set_key(cur, str(k), v, full + ".")
            return
        if value is None or isinstance(value, (dict, str, int, float)) and (len(choices) > 1 or optional(tp)):
            _assign(obj, name, value, full)  # a whole section: the shorthand or the mapping, validated
            return
        raise ConfigError(f"{full!r} is a section; set its keys ({full}.<key>=...) or give a mapping")
    if cur is None:  # an optional section that is off: on, with its defaults
        _assign(obj, name, {}, full)
        cur = getattr(obj, name)
    key, _, _ = rest.partition(".")
    if key == "kind" and len(choices) > 1 and "." not in rest:
        if value != getattr(cur, "kind", None):
            _assign(obj, name, {"kind": value}, full)
        return
    if field_for_key(cur, key) is None and len(choices) > 1:
        owners = [k for c in choices if field_for_key(c, key) is not None and (k := kind_of(c))]
        if owners:
            raise ConfigError(f"{full}.{key} is a key of {full}.kind={' or '.join(map(str, owners))}, and {full}.kind "
                              f"is {getattr(cur, 'kind', None)!r}: set {full}.kind={owners[0]} first (or give "
                              f"{full} as a mapping with its kind)")
    set_key(cur, rest, value, full + ".")


def _assign(obj, name: str, value: Any, full: str) -> None:
    """``setattr`` with pydantic's validation, whose errors become a ConfigError naming the key."""
    try:
        setattr(obj, name, value)
    except ValidationError as e:
        raise ConfigError("; ".join(validation_problems(e, full, name, obj))) from None


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


def apply_keys(cfg, vals: dict[str, Any], source: str) -> None:
    """Set every dotted key of ``vals`` on ``cfg`` (``source`` names where they come from in errors: the config
    file, or "override"). The ``kind`` of a chosen section is set before its other keys, whatever their order;
    keys of the earlier flat layout are refused together, one line each naming its new place, and so are the other
    keys at fault."""
    moved = [moved_key(k) for k in vals if moved_key(k)]
    if moved:
        many = f"{len(moved)} keys of the earlier flat layout:\n  - " + "\n  - ".join(moved)
        raise ConfigError(f"{source}: " + (moved[0] if len(moved) == 1 else many))
    # a section's choice first: its kind, or the section given whole (rollout.engine=vllm before rollout.engine.dtype)
    first = {k for k in vals if k.endswith(".kind") or any(o.startswith(k + ".") for o in vals)}
    errs = []
    for k, v in sorted(vals.items(), key=lambda kv: kv[0] not in first):
        try:
            set_key(cfg, k, v)
        except ConfigError as e:
            errs.append(str(e))
    if errs:  # every key at fault at once, each naming itself
        raise ConfigError(f"{source}: " + (errs[0] if len(errs) == 1 else f"{len(errs)} problems:\n  - "
                                           + "\n  - ".join(errs)))


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
