"""Setting config keys by dotted name: ``key=value`` overrides, and the flattened YAML file.

A value is converted to the declared type of its field (``coerce_value``); an unknown key is an error
with a did-you-mean (``set_key``).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

import yaml

from ..errors import ConfigError


def section_fields(obj) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(obj)}


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
    head, _, rest = dotted.partition(".")
    fields = section_fields(obj)
    full = prefix + head
    if head not in fields:
        close = difflib.get_close_matches(head, list(fields), n=1)
        hint = f" Did you mean {prefix + close[0]!r}?" if close else ""
        valid = ", ".join(prefix + f for f in fields)
        raise ConfigError(f"unknown config key {full!r}.{hint} Valid keys here: {valid}")
    cur = getattr(obj, head)
    hints = typing.get_type_hints(type(obj))
    if dataclasses.is_dataclass(cur):
        if rest:
            set_key(cur, rest, value, full + ".")
            return
        if not isinstance(value, dict):
            raise ConfigError(f"{full!r} is a section; set its keys ({full}.<key>=...) or give a mapping")
        for k, v in value.items():
            set_key(cur, str(k), v, full + ".")
        return
    if rest:
        raise ConfigError(f"{full!r} is not a section (cannot set {prefix + dotted!r})")
    setattr(obj, head, coerce_value(value, hints[head], full))


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("stop",):
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
    """An override's value parsed as YAML; text that is not YAML (``[`` alone) or is nested too deeply for the
    parser is a ConfigError naming the key, not a traceback."""
    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{key}: the value is nested too deeply for the YAML parser") from None
    except yaml.YAMLError as e:
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"{key}={text[:60]}: not a valid YAML value: {what}") from None
