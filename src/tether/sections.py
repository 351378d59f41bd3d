"""The base of every configuration section: a pydantic v2 model whose keys are documented where they
are declared (the docstring under each field, which ``tether config --reference`` and docs/config.md
print), that refuses unknown keys and re-validates each assignment.

A section may hold other sections (``Config.rollout``), a section chosen among several by its ``kind``
(``rollout.engine``: ``hf`` or ``vllm``, each with its own keys), or an optional section (``train.async``:
``None`` is off). The helpers below walk them by name, so the override parser, the reference and the
validators never need to know which section they hold. Imports only pydantic (every layer may use it).
"""

from __future__ import annotations

import contextvars
import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError


class Section(BaseModel):
    """A configuration section: every key typed and documented by the docstring under its declaration."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              validate_by_name=True, validate_by_alias=True, serialize_by_alias=True,
                              arbitrary_types_allowed=True, revalidate_instances="never")

    def __init__(self, *args: Any, **kw: Any):
        """Keys by name, or the first ones by position in declaration order (``KLConfig("k3", beta=1e-3)``)."""
        names = list(type(self).model_fields)
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes at most {len(names)} positional keys, got {len(args)}")
        for name, value in zip(names, args):
            if name in kw:
                raise TypeError(f"{type(self).__name__}: key {name!r} given by position and by name")
            kw[name] = value
        super().__init__(**kw)

    @field_validator("*", mode="before")
    @classmethod
    def _as_written(cls, value: Any, info: ValidationInfo) -> Any:
        return user_value(value, cls.model_fields[info.field_name].annotation)


def user_value(value: Any, tp: Any) -> Any:
    """A value as a user writes it (YAML, ``key=value``) for a field of type ``tp``, before pydantic validates it:
    ``none`` / ``null`` is None for an optional key; a comma-separated string is a list for a list key
    (``eval.benchmarks=gsm8k,math500``), each item read as its type's value is; a number is its text for a string
    key; ``1e3`` is 1000 for an integer key; and a bool is never taken for a number (YAML reads ``steps: yes`` as true,
    and ``int(True)`` is 1)."""
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    union = typing.get_origin(tp) is typing.Union or isinstance(tp, types.UnionType)
    args = typing.get_args(tp) if union else (tp,)
    if type(None) in args and isinstance(value, str) and value.lower() in ("none", "null"):
        return None
    plain = [a for a in args if a is not type(None)]
    if len(plain) != 1:  # a union of plain types: pydantic keeps a value that has one of them
        return value
    t = plain[0]
    if isinstance(value, bool) and t in (int, float):
        raise PydanticCustomError(f"{t.__name__}_type", "a bool for a number")
    if t is float and isinstance(value, (int, str)) and not isinstance(value, bool):  # YAML reads 1e-5 as text
        try:
            return float(value)
        except ValueError:
            return value
    if t is int and isinstance(value, str) and "e" in value.lower():
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else value
    if t is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if (typing.get_origin(t) or t) is list:
        if isinstance(value, str) and not value.strip().startswith("["):
            value = [v for v in value.split(",") if v]
        elif isinstance(value, tuple):
            value = list(value)
        item = next(iter(typing.get_args(t)), None)  # list[float]: each item read as a float key's value is
        return [user_value(v, item) for v in value] if item is not None and isinstance(value, list) else value
    return value


def validate_field(cls: type, name: str, value: Any) -> Any:
    """``value`` validated as field ``name`` of section class ``cls`` alone (its type, range and validators, not the
    rules that join it to other keys: `alone`); raises pydantic's ValidationError."""
    token = _ALONE.set(True)
    try:
        return getattr(cls.__pydantic_validator__.validate_assignment(cls.model_construct(), name, value), name)
    finally:
        _ALONE.reset(token)


#: set while `validate_field` runs (a context variable, not pydantic's validation context: a section's own
#: ``__init__``, which pydantic calls for a nested section, does not pass that context on)
_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("tether_validate_alone", default=False)


def alone(info: ValidationInfo) -> bool:
    """Whether a field is being validated alone (`validate_field`: a flag's value, a section's shorthand), so a rule
    joining it to the section's other keys does not apply."""
    return _ALONE.get()


def _cls(section: Any) -> type:
    return section if isinstance(section, type) else type(section)


def keys_of(section: Any) -> list[str]:
    """The key names of a section (an instance or its class), in declaration order."""
    return list(_cls(section).model_fields)


def key_name(section: Any, name: str) -> str:
    """The key a user writes for field ``name`` (its alias where it has one: ``async`` for ``async_``)."""
    return _cls(section).model_fields[name].alias or name


def field_for_key(section: Any, key: str) -> str | None:
    """The field a user's ``key`` names in ``section`` (by its name or its alias), or None."""
    return next((name for name in keys_of(section) if key in (name, key_name(section, name))), None)


def annotation(section: Any, name: str) -> Any:
    """The declared type of field ``name``."""
    return _cls(section).model_fields[name].annotation


def default(section: Any, name: str) -> Any:
    """Field ``name``'s default value (a fresh one for a default factory)."""
    return _cls(section).model_fields[name].get_default(call_default_factory=True)


def doc(section: Any, name: str) -> str | None:
    """The docstring under field ``name``'s declaration, on one line."""
    d = _cls(section).model_fields[name].description
    return " ".join(d.split()) if d else None


def variants(tp: Any) -> list[type]:
    """The section classes a field of type ``tp`` may hold: one, several (a section chosen by its ``kind``),
    or none (a plain value). ``Optional[S]`` gives ``[S]``."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    if typing.get_origin(tp) is typing.Annotated:
        return variants(typing.get_args(tp)[0])
    if typing.get_origin(tp) is typing.Union or isinstance(tp, types.UnionType):
        return [v for a in typing.get_args(tp) for v in variants(a)]
    return []


def optional(tp: Any) -> bool:
    """Whether a field of type ``tp`` may be None (an optional section: None is off)."""
    if typing.get_origin(tp) is typing.Annotated:
        return optional(typing.get_args(tp)[0])
    return (typing.get_origin(tp) is typing.Union or isinstance(tp, types.UnionType)) and \
        type(None) in typing.get_args(tp)


def choice_key(cls: type) -> str:
    """The key that chooses a chosen section's variant: ``kind``, or the one its class names (``algo.kl``:
    ``estimator``, a class variable ``choice_key``)."""
    return getattr(cls, "choice_key", "kind")


def kinds_of(cls: type) -> tuple:
    """The values of a chosen section's choice key (the literals its ``kind`` takes; ``algo.kl``'s families:
    several estimators; a family of names by prefix, a class variable ``choice_prefix``: ``("skyrl_gym:<name>",)``),
    () for a section without one or the variant of any other kind."""
    prefix = getattr(cls, "choice_prefix", None)
    if prefix:
        return (f"{prefix}<name>",)
    if getattr(cls, "choice_label", None):
        return (cls.choice_label,)
    if isinstance(cls, type) and issubclass(cls, BaseModel) and choice_key(cls) in cls.model_fields:
        tp = cls.model_fields[choice_key(cls)].annotation
        if typing.get_origin(tp) is typing.Literal:
            return typing.get_args(tp)
    return ()


def kind_of(cls: type) -> str | None:
    """A chosen section's ``kind`` (the first literal its choice key takes; its tag in the union), None for a section
    without one."""
    return next(iter(kinds_of(cls)), None)


def variant_for(kinds: dict[str, type], kind: Any) -> type | None:
    """The section class of ``kind`` in ``kinds`` (kind -> class; a key ending in ``:`` holds every name it
    starts: ``skyrl_gym:`` for ``skyrl_gym:gsm8k``; then a class whose ``choice_test(kind)`` holds: ``data``'s
    datasets), None for any other kind."""
    if not isinstance(kind, str):
        return None
    if kind in kinds:
        return kinds[kind]
    return next((c for p, c in kinds.items() if p.endswith(":") and kind.startswith(p)), None) or next(
        (c for c in kinds.values() if getattr(c, "choice_test", None) and c.choice_test(kind)), None)


def matches(cls: type, kind: Any) -> bool:
    """Whether ``kind`` may choose the variant ``cls`` (one of its literals, a name with its prefix, or one its
    ``choice_test`` accepts: try the others first, as `variant_for` does)."""
    prefix = getattr(cls, "choice_prefix", None)
    if prefix:
        return isinstance(kind, str) and kind.startswith(prefix)
    return cls.choice_test(kind) if getattr(cls, "choice_test", None) else kind in kinds_of(cls)


def chosen(kinds: dict[str, type], other: type, default_kind: str) -> Any:
    """The type of a section chosen by its ``kind`` (or the class's `choice_key`): a discriminated union of one
    variant per section class of ``kinds`` (kind -> section class, each with ``kind: Literal[...]``; several kinds may
    share a class; a key ending in ``:`` is a prefix, `variant_for`) and ``other`` for any other kind (a user's
    registered name); a mapping without the key is ``default_kind``'s."""
    key = choice_key(other)

    def tag(value: Any) -> str:
        kind = value.get(key, default_kind) if isinstance(value, dict) else getattr(value, key, default_kind)
        cls = variant_for(kinds, kind)
        return kind_of(cls) if cls is not None else "other"

    classes = list(dict.fromkeys(kinds.values()))
    _TAGS.update([*kinds, *map(kind_of, classes)])  # an error's location names the key, not the variant's tag
    return typing.Annotated[typing.Union[tuple(typing.Annotated[c, Tag(kind_of(c))] for c in classes)
                                         + (typing.Annotated[other, Tag("other")],)], Discriminator(tag)]


def only_with(*names: str, holds: typing.Callable[[dict], bool], text: str | typing.Callable[[dict], str]) -> Any:
    """A validator of the fields ``names``, for a rule across keys of one section: a field set away from its default
    needs ``holds(earlier)`` (``earlier``: the section's fields declared above it, validated), else it is refused
    with ``text`` (or ``text(earlier)``), said after the key (``rollout.max_refill_rounds only applies with
    rollout.dynamic_sampling=true``). Declare it beside the keys it joins."""

    def check(cls, v: Any, info: ValidationInfo) -> Any:
        if not alone(info) and v != default(cls, info.field_name) and not holds(info.data):
            raise ValueError(text(info.data) if callable(text) else text)
        return v

    return field_validator(*names)(classmethod(check))


def as_dict(section: Any) -> dict:
    """A plain dict of a section at every depth, with the keys users write (for YAML and logs)."""
    return section.model_dump(mode="python", by_alias=True)


def replace(section: Any, **changes: Any) -> Any:
    """A copy of ``section`` with ``changes`` (validated)."""
    return type(section)(**({name: getattr(section, name) for name in type(section).model_fields} | changes))


def validation_problems(e: ValidationError, key: str, name: str, section: Any = None) -> list[str]:
    """One line per problem of a pydantic ``ValidationError`` raised by assigning field ``name`` of ``section``, each
    naming the dotted key at fault (``key`` is the key the user wrote for ``name``). A value out of its declared range
    or not among its choices is said in one phrasing for every key: ``train.lr must be a finite number >= 0, got -1``,
    ``unknown rollout.prompt_overflow 'truncat'. Did you mean 'truncate'? Valid choices: error, truncate``."""
    out = []
    for err in e.errors():
        loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and (p in _TAGS or p.startswith("function-")))]
        if loc and loc[0] == name:
            loc = loc[1:]
        mapping_key = loc[-1:] == ["[key]"]  # a mapping's key (data.options={1: 2}; pydantic's loc: options.1.[key])
        if mapping_key:
            loc = loc[:-2]
        where = ".".join([key, *loc] if key else loc)
        if mapping_key:
            out.append(f"{where}: its keys are names (text), got the key {err.get('input')!r}")
            continue
        ctx, value = err.get("ctx") or {}, err.get("input")
        info = _field_at(section, err["loc"]) if section is not None else None
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):  # pydantic names its discriminator callable
            tag = ctx.get("tag")
            out.append(f"{where}: " + (f"unknown kind {tag!r}; " if tag is not None else "no kind given; ")
                       + f"expected one of: {ctx.get('expected_tags')}")
        elif err["type"] in _RANGE_ERRORS and info is not None and isinstance(value, (int, float)):
            out.append(f"{where} must be {range_text(info)}, got {value!r}")
        elif err["type"] == "literal_error" and info is not None and choices(info.annotation):
            out.append(unknown_value(where, value, choices(info.annotation)))
        elif err["type"] in _TYPE_ERRORS:
            out.append(f"{where}: expected {_TYPE_ERRORS[err['type']]}, got {value!r}")
        elif err["type"] == "too_short":
            out.append(f"{where} must hold at least {ctx.get('min_length')} item(s), got {value!r}")
        elif err["type"] == "value_error":  # a field validator's own sentence ("must be two numbers in [0, 1)"),
            msg = err["msg"].removeprefix("Value error, ")  # or a section's rule joining its keys: after a colon,
            if not isinstance(value, dict):  # or alone when it names its own key (train.warmup_steps=...)
                out.append(f"{where} {msg}")
            else:
                out.append(msg if msg.startswith(f"{where.rpartition('.')[2]}.") else f"{where}: {msg}")
        else:
            shown = repr(value)
            got = f" (got {shown})" if not isinstance(value, (dict, type(None))) and shown not in err["msg"] else ""
            out.append(f"{where}: {err['msg']}{got}")
    return out


# pydantic's errors for a value of another type, and what the key expected
_TYPE_ERRORS = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
                "float_type": "a number", "float_parsing": "a number", "string_type": "a string (quote it in YAML)",
                "bool_type": "true/false", "bool_parsing": "true/false", "list_type": "a list"}
_RANGE_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number")


def range_text(info: Any) -> str:
    """A field's declared range in words (``a finite number >= 0``, ``in (0, 1]``), from its ``Field`` constraints
    (``info``: its pydantic FieldInfo); "" for a field without one."""
    bounds = {type(m).__name__.lower(): getattr(m, type(m).__name__.lower()) for m in info.metadata
              if type(m).__name__ in ("Ge", "Gt", "Le", "Lt")}
    finite = any(getattr(m, "allow_inf_nan", True) is False for m in info.metadata)
    low = next(((op, bounds[op]) for op in ("ge", "gt") if op in bounds), None)
    high = next(((op, bounds[op]) for op in ("le", "lt") if op in bounds), None)
    if low and high:
        text = f"in {'[' if low[0] == 'ge' else '('}{low[1]}, {high[1]}{']' if high[0] == 'le' else ')'}"
    elif low or high:
        op, bound = low or high
        text = f"{dict(ge='>=', gt='>', le='<=', lt='<')[op]} {bound}"
    else:
        text = ""
    return ("a finite number" + (" " + text if text else "")) if finite else text


def choices(tp: Any) -> tuple | None:
    """The values of a ``Literal`` type (a key's choices), None for another type."""
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None


def unknown_value(key: str, value: Any, valid: Any) -> str:
    """The error for a value not among ``valid``: a did-you-mean, and every valid choice."""
    valid = [str(v) for v in valid]
    close = difflib.get_close_matches(str(value), valid, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown {key} {value!r}.{hint} Valid choices: {', '.join(valid)}"


def _field_at(section: Any, loc: tuple) -> Any:
    """The FieldInfo of the field at pydantic location ``loc`` under ``section`` (a variant's tag in ``loc`` picks
    the kind; a list index stays on its field), or None."""
    cls = section if isinstance(section, type) else type(section)
    info, options = None, [cls]
    for part in loc:
        if isinstance(part, int) or part.startswith("function-"):  # a list's item, a validator's wrapper
            continue
        if len(options) > 1:  # a chosen section: this part is the variant's tag
            options = [c for c in options if kind_of(c) == part] or [c for c in options if kind_of(c) is None]
            continue
        if not options or not (isinstance(options[0], type) and issubclass(options[0], BaseModel)):
            return None
        field = field_for_key(options[0], part)
        if field is None:
            return None
        info = options[0].model_fields[field]
        options = variants(info.annotation)
    return info


# the tags pydantic adds to an error's location inside a chosen section (rollout.engine.vllm.dtype)
_TAGS = {"hf", "vllm", "vllm_server", "single_turn", "multi_turn", "other", "local", "remote"}

__all__ = ["Section", "ValidationError", "annotation", "as_dict", "choice_key", "chosen", "default", "doc",
           "field_for_key", "key_name", "keys_of", "kind_of", "kinds_of", "matches", "optional",
           "range_text", "choices", "replace", "unknown_value", "validate_field", "validation_problems", "variant_for",
           "variants"]
