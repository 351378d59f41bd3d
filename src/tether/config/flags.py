"""Entry points' flags generated from the sections: ``tether eval`` and ``tether demos`` name the config keys they
take (:data:`EVAL_FLAGS`, :data:`DEMOS_FLAGS`), and each flag's type, choices and help come from the key's
declaration (the docstring under its field), its stated default from the section or from the entry point's
documented preset (:data:`EVAL_PRESET`, :data:`DEMOS_PRESET`). docs/config.md's "Entry points' flags" lists the
same tables (`flag_table`), so `tether eval --help`, `tether demos --help` and the reference read one declaration.

A flag's parser default is None ("not given"): the flags given become overrides of the one config the entry point
parses, and one not given keeps the preset's value, else the section's.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from ..sections import (
    ValidationError,
    annotation,
    default,
    doc,
    field_for_key,
    validate_field,
    validation_problems,
    variants,
)

#: ``tether eval``'s preset (`EVAL_PRESET`): its defaults that differ from the in-run evaluation's and the rollout
#: section's, and why (docs/config.md prints this)
EVAL_PRESET_WHY = ("A standalone evaluation reports avg@n, pass@k and maj@n, which need several samples per problem "
                   "(4, sampled at eval.temperature), and can afford 512-token responses on every problem (limit: "
                   "none); the evaluation inside a training run is greedy, one sample, 256 tokens, 100 problems, to "
                   "stay cheap beside training. Held-out evaluation calls take 64 sequences (training's "
                   "rollout.batch_size is 32). Without --max-new-tokens, a benchmark with its own response cap is "
                   "answered within it (organism-dN: its longest worked solution; the organism's context is 256 "
                   "tokens).")
EVAL_PRESET: dict[str, Any] = {"eval.n": 4, "eval.greedy": False, "eval.max_new_tokens": 512, "eval.limit": None,
                               "rollout.batch_size": 64}

#: ``tether demos``' preset (`DEMOS_PRESET`) and why
DEMOS_PRESET_WHY = ("the calculator's turn budget the demonstrations fit is stated (4 policy turns: up to 3 "
                    "calls) rather than 0 (the environment's own), since the demonstrations are written for it.")
DEMOS_PRESET: dict[str, Any] = {"rollout.agent.env.max_turns": 4}


@dataclass(frozen=True)
class Flag:
    """One command-line flag of an entry point: the config ``key`` it sets; ``flag`` its name (default: the key's
    last part with dashes); ``note`` what the entry point adds after the key's own docstring (what not giving it
    means); ``where`` which of the entry point's modes reads it (the help's first word)."""

    key: str
    flag: str = ""
    note: str = ""
    where: str = ""

    @property
    def name(self) -> str:
        return self.flag or "--" + self.key.rsplit(".", 1)[-1].replace("_", "-")

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


_ENV, _RET = "rollout.agent.env.", "rollout.agent.env.retriever."

#: ``tether eval``'s flags that are config keys, by option group: sampling, the multi-turn agent, the search
#: environment (its retriever and budgets)
EVAL_FLAGS: dict[str, list[Flag]] = {
    "sampling": [Flag("eval.n", note="1 with --greedy"), Flag("eval.temperature"),
                 Flag("eval.max_new_tokens", note="not given: a benchmark's own cap where it has one (organism-dN: "
                      "its longest worked solution)"),
                 Flag("eval.limit", note="the first N problems of each benchmark; none: all"), Flag("eval.greedy"),
                 Flag("eval.top_p"), Flag("rollout.batch_size"),
                 Flag("train.seed", note="here: the sampling seed")],
    "multi_turn": [Flag(_ENV + "max_turns", where="multi_turn", note="not given: the run's, when --model is a "
                        "multi-turn run")],
    "budgets": [Flag(_ENV + "max_obs_tokens", where="search, multi_turn", note="multi_turn, not given: the run's, "
                     "when --model is a multi-turn run"),
                Flag(_ENV + "max_context", where="search, multi_turn", note="multi_turn, not given: the run's, "
                     "when --model is a multi-turn run")],
    "search": [Flag(_RET + "kind", "--retriever", where="search"), Flag(_RET + "url", where="search"),
               Flag(_RET + "corpus", where="search"), Flag(_RET + "timeout", where="search"),
               Flag(_RET + "retries", where="search"), Flag(_RET + "passage_format", "--observation-format",
                                                             where="search"),
               Flag(_RET + "data_dir", "--search-data-dir", where="search"), Flag(_RET + "topk", where="search")],
}

#: ``tether demos``' flags that are config keys
DEMOS_FLAGS: list[Flag] = [
    Flag(_ENV + "max_turns", where="calculator", note="the turn budget the demonstrations fit, as in training"),
    Flag(_RET + "corpus", where="search"), Flag(_RET + "topk", where="search"),
    Flag(_RET + "passage_format", "--observation-format", where="search"),
    Flag("data.system_prompt", note="written into each demonstration, as in training"),
]


def field_at(key: str, root: Optional[type] = None) -> tuple[type, str]:
    """The section class and field name a dotted ``key`` names, from ``root`` (default: the run's `Config`);
    a chosen or optional section is searched in each of its variants. KeyError names an unknown key."""
    if root is None:
        from .schema import Config

        root = Config
    classes, *path, last = [root], *key.split(".")
    for part in path:
        classes = [v for c in classes if (f := field_for_key(c, part)) for v in variants(annotation(c, f))]
    for c in classes:
        if (f := field_for_key(c, last)) is not None:
            return c, f
    raise KeyError(f"{key} is not a config key")


def stated_default(key: str, preset: Mapping[str, Any]) -> Any:
    """The default a flag of ``key`` states: the preset's, else the key's own."""
    return preset[key] if key in preset else default(*field_at(key))


def _kind(tp: Any) -> tuple[Any, Optional[list]]:
    """(argparse type, choices) of a field of type ``tp`` (Optional unwrapped, a Literal's values as choices)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Literal:
        return type(args[0]), list(args)
    if args and typing.get_origin(tp) is not typing.Annotated:  # Optional[X]
        return _kind(args[0])
    return tp, None


def add_flags(group, flags: Sequence[Flag], preset: Mapping[str, Any], *,
              choices: Optional[Mapping[str, Sequence[str]]] = None) -> None:
    """Add each of ``flags`` to ``group`` (an argparse parser or group): type and choices from the key's
    declaration (``choices`` overrides them by key, for a registry's names), help = note + the key's docstring +
    the key + the default it states; parser default None (not given)."""
    for f in flags:
        section, name = field_at(f.key)
        tp, options = _kind(annotation(section, name))
        options = list((choices or {}).get(f.key, options) or []) or None
        meaning = doc(section, name) or ""
        shown = stated_default(f.key, preset)
        text = (f"{f.where}: " if f.where else "") + meaning + (f"; {f.note}" if f.note else "") + \
            f" ({f.key}; default {_shown(shown)})"
        text = text.replace("%", "%%")
        if tp is bool:
            group.add_argument(f.name, dest=f.dest, action="store_true", default=None, help=text)
        else:
            group.add_argument(f.name, dest=f.dest, type=tp if tp in (int, float, str) else str, default=None,
                               choices=options, help=text)


def _shown(v: Any) -> str:
    return "none" if v is None else repr(v)


def given(args: argparse.Namespace, flags: Sequence[Flag]) -> dict[str, Any]:
    """The config keys of the ``flags`` given on the command line (their parser default is None)."""
    return {f.key: getattr(args, f.dest) for f in flags if getattr(args, f.dest, None) is not None}


def flag_problems(args: argparse.Namespace, flags: Sequence[Flag]) -> list[str]:
    """The flags given whose value is outside the type, range or choices declared with their key, one line each
    naming the flag as the key would be named (``--n must be >= 1, got 0``)."""
    out = []
    for f in flags:
        v = getattr(args, f.dest, None)
        if v is None:
            continue
        section, name = field_at(f.key)
        try:
            validate_field(section, name, v)
        except ValidationError as e:
            out += validation_problems(e, f.name, name, section)
    return out


def value(args: argparse.Namespace, f: Flag, preset: Mapping[str, Any]) -> Any:
    """A flag's value: given, else the default it states."""
    v = getattr(args, f.dest, None)
    return stated_default(f.key, preset) if v is None else v


def flag_table() -> str:
    """docs/config.md's table of the entry points' flags: flag, key, the default it states (a preset's marked)."""
    out = ["## Entry points' flags", "",
           "`tether eval` and `tether demos` take these keys as flags, generated from the declarations above (type, "
           "choices, meaning); their defaults are the keys' own except where the entry point's documented preset "
           "says otherwise (`tether.config.flags.EVAL_PRESET`, `DEMOS_PRESET`: marked *preset*). `tether eval`'s "
           "preset: " + EVAL_PRESET_WHY + " `tether demos`' preset: " + DEMOS_PRESET_WHY, "",
           "| command | flag | key | default |", "| --- | --- | --- | --- |"]
    rows = [("eval", f, EVAL_PRESET) for group in EVAL_FLAGS.values() for f in group]
    rows += [("demos", f, DEMOS_PRESET) for f in DEMOS_FLAGS]
    for cmd, f, preset in rows:
        mark = " *preset*" if f.key in preset else ""
        out.append(f"| `tether {cmd}` | `{f.name}` | `{f.key}` | `{_shown(stated_default(f.key, preset))}`{mark} |")
    return "\n".join(out + [""])


__all__ = ["DEMOS_FLAGS", "DEMOS_PRESET", "DEMOS_PRESET_WHY", "EVAL_FLAGS", "EVAL_PRESET", "EVAL_PRESET_WHY", "Flag",
           "add_flags", "field_at", "flag_problems", "flag_table", "given", "stated_default", "value"]
