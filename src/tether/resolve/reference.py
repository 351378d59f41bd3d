"""The reference of every config key (docs/config.md, ``tether config --reference``), generated from
the sections themselves: ``Config`` is walked field by field at every depth (each kind of a chosen section,
``rollout.engine``, and each optional section, ``train.async``, in a table of its own), and each key is
documented by the docstring under its declaration (a key without one is an error). The trust region
(``algo.region``, a dataclass of `tether.algo`, which imports only torch) is documented by the comments at its
fields' declarations."""

from __future__ import annotations

import inspect
import re

from pydantic_core import PydanticUndefined

from ..agents import AGENTS
from ..algo.anchors import ANCHOR_KINDS
from ..config.flags import flag_table
from ..config.migration import MOVED
from ..config.schema import Config
from ..envs import ENVS
from ..rollout import ENGINES
from ..search.retrievers import RETRIEVERS
from ..sections import annotation, doc, key_name, keys_of, kind_of, variants
from ..sections import default as field_default  # this module has its own default / optional
from ..sections import optional as is_optional
from ..tasks.registry import TASKS
from ..tasks.rewards import REWARDS

# `name: type = default  # meaning` at a dataclass field's declaration; the meaning may go on over the
# comment-only lines right below it (`    # more meaning`), so no line need pass 120 characters
_DECLARATION = re.compile(r"^\s+(\w+):\s*[^#]*#\s*(.+)$")
_CONTINUATION = re.compile(r"^\s+#\s*(.+)$")


def declaration_comments(section: type) -> dict[str, str]:
    """field name -> the comment at its declaration in dataclass ``section``'s source (continuation lines
    joined)."""
    out: dict[str, str] = {}
    last = None
    for line in inspect.getsource(section).splitlines():
        m = _DECLARATION.match(line)
        if m:
            last = m.group(1)
            out[last] = m.group(2).strip()
            continue
        c = _CONTINUATION.match(line)
        if c and last is not None:
            out[last] += " " + c.group(1).strip()
        else:
            last = None
    return out


def sections(cls: type = Config, prefix: str = "") -> list[tuple[str, type]]:
    """``(prefix, section class)`` of ``cls`` and of every section under it, depth first in declaration order
    (a chosen section once per kind); ``prefix`` is the dotted path with its trailing dot (``""`` at the top)."""
    out = [(prefix, cls)]
    for name in keys_of(cls):
        for sub in variants(annotation(cls, name)):
            out += sections(sub, f"{prefix}{key_name(cls, name)}.")
    return out


def _default(section: type, name: str) -> object:
    if hasattr(section, "model_fields") and section.model_fields[name].is_required():
        return PydanticUndefined
    value = field_default(section, name)
    return value.model_dump(by_alias=True) if hasattr(value, "model_dump") else value


def section_keys(prefix: str, section: type) -> list[tuple[str, object, str]]:
    """``(dotted key, default, meaning)`` of the keys of ``section`` itself (not of the sections under it)."""
    comments = None if hasattr(section, "model_fields") else declaration_comments(section)
    out = []
    for name in keys_of(section):
        tp = annotation(section, name)
        if variants(tp) and not (kind_of(section) and name == "kind"):
            if not _is_choice_or_optional(tp):
                continue  # a plain nested section: its own table
        text = doc(section, name) if comments is None else comments.get(name)
        key = prefix + key_name(section, name)
        if not text:
            raise AssertionError(f"config key {key} has no docstring at its declaration")
        out.append((key, _default(section, name), text))
    return out


def _is_choice_or_optional(tp) -> bool:
    return len(variants(tp)) > 1 or is_optional(tp)


def keys(cls: type = Config) -> list[tuple[str, object, str]]:
    """``(dotted key, field default, docstring)`` of every key of ``cls`` at any depth (a chosen section's keys
    once per kind). The defaults are each section's own field defaults (``algo.*``: AlgoConfig's, which the
    recipes override). Raises AssertionError naming a key declared without a docstring."""
    out, seen = [], set()
    for prefix, section in sections(cls):
        for row in section_keys(prefix, section):
            if row[0] not in seen:
                seen.add(row[0])
                out.append(row)
    return out


def registered() -> dict[str, str]:
    """Config key -> the names its registry holds (appended to the key's meaning in the reference)."""
    def names(extra, registry, where, user=True):
        spec = ", or module:function / path.py:function" if user else ""
        return f"Registered: {', '.join([*extra, *registry])} (`{where}`){spec}."

    return {"data.task": names((), TASKS, "tether.tasks.registry.TASKS") + " A registered name picks its task; "
            "any other value is a dataset of task `math`.",
            "data.reward": names(("auto",), REWARDS, "tether.tasks.rewards.REWARDS"),
            "rollout.engine": names((), ENGINES, "tether.rollout.ENGINES", user=False),
            "rollout.agent": names((), AGENTS, "tether.agents.AGENTS"),
            "rollout.agent.env.name": names((), ENVS, "tether.envs.ENVS", user=False)
            + " Or module:Class / path.py:Class.",
            "rollout.agent.env.retriever.kind": names((), RETRIEVERS, "tether.search.retrievers.RETRIEVERS"),
            "algo.anchor.kind": names(("none",), ANCHOR_KINDS, "tether.algo.anchors.ANCHOR_KINDS", user=False)}


def reference() -> str:
    """Markdown reference of every config key, generated from the comments at their declarations."""
    out = ["# Configuration keys", "",
           "Generated by `tether config --reference` from the config's sections: every key at any depth,",
           "with the docstring under its declaration (`tether.config.schema`, `tether.models`, `tether.algo`).",
           "Set keys in a YAML file (`--config`) or as `key=value` overrides; `recipe` picks the `algo.*` defaults",
           "(the `algo.*` defaults below are the bare field defaults: each recipe, the default `ema_pg` included,",
           "overrides some of them; `tether config --recipe NAME` prints a recipe's resolved values).", ""]
    out.append(section_tables(Config, None, registered()))
    out.append(flag_table())
    out.append(moved_table())
    return "\n".join(out)


def section_tables(cls: type, rows: list[tuple[str, object, str]] | None, reg: dict[str, str]) -> str:
    """One markdown table per section of ``cls`` (one per kind of a chosen section): the section's first docstring
    paragraph, then ``| key | default | meaning |``, ``reg`` appended to the keys it names."""
    out, titled = [], set()
    for prefix, section in sections(cls):
        own = section_keys(prefix, section)
        if not own:
            continue
        kind = kind_of(section)
        title = (f"`{prefix[:-1]}`" if prefix else "Top level") + (
            f" (kind = `{kind}`)" if kind else " (any other kind)" if prefix in titled else "")
        titled.add(prefix)
        summary = " ".join(inspect.cleandoc(section.__doc__ or "").split("\n\n")[0].split())  # its first paragraph
        out += [f"## {title}", "", summary, "",
                "| key | default | meaning |", "| --- | --- | --- |"]
        out += [f"| `{key}` | {_shown(value)} | {_meaning(key, comment, reg)} |" for key, value, comment in own]
        out.append("")
    return "\n".join(out)


def moved_table() -> str:
    """The keys of the earlier flat layout and their new places (`tether.config.migration.MOVED`)."""
    out = ["## Keys of the earlier flat layout", "",
           "A config that sets one of these keys is refused with an error naming its new place; a run directory "
           "saved before the change is read in the new layout (`--resume`, `tether eval --run`, `tether export`).",
           "", "| earlier key | its place now |", "| --- | --- |"]
    out += [f"| `{old}` | `{new}` |" for old, new in MOVED.items()]
    return "\n".join(out + [""])


def _shown(value: object) -> str:
    return "required" if value is PydanticUndefined else f"`{value!r}`"


def _meaning(key: str, comment: str, reg: dict[str, str]) -> str:
    text = f"{comment}. {reg[key]}" if key in reg else comment
    return text.replace("|", "/")
