"""Entry points' flags generated from the config's declarations (`tether.config.flags`): `tether eval --help`,
`tether demos --help` and docs/config.md state the same keys, types, choices and defaults, and a flag not given takes
the default its help states."""

from __future__ import annotations

import argparse
import typing

import pytest

from tether.cli import build_parser
from tether.config import EvalConfig
from tether.config.agent import BM25RetrieverConfig
from tether.config.flags import (
    DEMOS_FLAGS,
    DEMOS_PRESET,
    EVAL_FLAGS,
    EVAL_PRESET,
    Flag,
    field_at,
    flag_table,
    stated_default,
)
from tether.sections import annotation, choice_key, default, doc

EVAL = [f for group in EVAL_FLAGS.values() for f in group]


def _actions(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {opt: a for a in sub.choices[command]._actions for opt in a.option_strings}


@pytest.mark.parametrize("command, flags, preset", [("eval", EVAL, EVAL_PRESET), ("demos", DEMOS_FLAGS, DEMOS_PRESET)])
def test_each_flag_states_its_keys_declaration_and_default(command, flags, preset):
    """Written out independently of the generator: the help holds the key's docstring, the key and the default
    (the preset's where it has one, else the section's); choices are the Literal's values; types are the field's."""
    actions = _actions(command)
    for f in flags:
        a = actions[f.name]
        section, name = field_at(f.key)
        want = preset[f.key] if f.key in preset else default(section, name)
        shown = "none" if want is None else repr(want)
        assert a.help.endswith(f"({f.key}; default {shown})"), (f.name, a.help)
        assert doc(section, name) in a.help
        assert a.default is None  # not given: the stated default comes from the declaration, not the parser
        tp = annotation(section, name)
        if name == choice_key(section):  # a chosen section's kind: the default kind is among the registry's choices
            assert set(typing.get_args(tp)) <= set(a.choices)
        elif typing.get_origin(tp) is typing.Literal:
            assert list(a.choices) == list(typing.get_args(tp))
        elif tp in (int, float):
            assert a.type is tp


def test_the_presets_are_the_only_defaults_that_differ_from_the_declarations():
    """tether eval's defaults are EvalConfig's except its documented preset (n 4, sampled, 512 tokens, every
    problem, 64 sequences a call), which docs/config.md lists with the reason."""
    assert EVAL_PRESET == {"eval.n": 4, "eval.greedy": False, "eval.max_new_tokens": 512, "eval.limit": None,
                           "rollout.batch_size": 64}
    assert (EvalConfig().n, EvalConfig().greedy, EvalConfig().max_new_tokens) == (1, True, 256)
    assert stated_default("eval.temperature", EVAL_PRESET) == EvalConfig().temperature
    assert stated_default("rollout.agent.env.retriever.topk", EVAL_PRESET) == BM25RetrieverConfig().topk
    table = flag_table()
    assert "| `tether eval` | `--n` | `eval.n` | `4` *preset* |" in table
    assert "| `tether eval` | `--temperature` | `eval.temperature` | `1.0` |" in table
    assert "| `tether demos` | `--topk` | `rollout.agent.env.retriever.topk` | `3` |" in table


def test_a_flag_not_given_takes_the_default_its_help_states():
    from tether.eval.cli import _eval_settings

    p = build_parser()
    s = _eval_settings(p.parse_args(["eval", "--model", "m", "--benchmarks", "gsm8k"]))
    assert (s.n, s.temperature, s.top_p, s.max_new_tokens, s.batch_size, s.seed, s.greedy) == \
        (4, 1.0, 1.0, 512, 64, 0, False)
    s = _eval_settings(p.parse_args(["eval", "--model", "m", "--benchmarks", "gsm8k", "--greedy", "--seed", "3",
                                     "--max-new-tokens", "7"]))
    assert (s.n, s.temperature, s.max_new_tokens, s.seed, s.greedy) == (1, 0.0, 7, 3, True)


def test_a_key_that_is_not_declared_is_refused():
    with pytest.raises(KeyError, match="eval.no_such_key is not a config key"):
        field_at("eval.no_such_key")
    assert field_at("rollout.agent.env.retriever.topk") == (BM25RetrieverConfig, "topk")
    assert Flag("rollout.agent.env.retriever.passage_format", "--observation-format").dest == "observation_format"


def test_demos_flags_reach_the_environment_it_builds():
    """A demos flag not given is its key's default (topk 3) or the preset's (max_turns 4); a given one overrides."""
    from tether.sft.demos import _env_keys, flag_values

    p = build_parser()
    args = p.parse_args(["demos", "calculator", "--out", "x.jsonl"])
    flag_values(args)
    assert _env_keys(args)["rollout.agent.env.max_turns"] == 4 and args.system_prompt == ""
    args = p.parse_args(["demos", "search", "--out", "x.jsonl", "--topk", "5", "--corpus", "c.jsonl"])
    flag_values(args)
    keys = _env_keys(args)
    assert keys["rollout.agent.env.retriever.topk"] == 5
    assert keys["rollout.agent.env.retriever.passage_format"] == "search_r1"


@pytest.mark.parametrize("over, needle", [({"eval.top_p": 1.5}, "eval.top_p must be in (0, 1], got 1.5"),
                                          ({"eval.top_p": 0.9}, "eval.top_p has no effect with eval.greedy=true")])
def test_eval_top_p_is_a_checked_key(over, needle):
    from tether.errors import ConfigError
    from tether.resolve import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, over)
    assert needle in str(e.value)
    assert load_config(None, {"eval.top_p": 0.9, "eval.greedy": False}).eval.top_p == 0.9


def test_sft_and_train_share_the_optimizer_section():
    """tether sft's optimizer keys are tether train's declarations (one section, OptimizerConfig); only the
    schedule's default differs (SFT decays, cosine)."""
    from tether.config import TrainConfig
    from tether.config.schema import OptimizerConfig
    from tether.config.sft import SFTTrainConfig

    shared = list(OptimizerConfig.model_fields)
    assert shared == ["lr", "weight_decay", "betas", "warmup_steps", "schedule", "grad_clip"]
    for cls in (TrainConfig, SFTTrainConfig):
        assert issubclass(cls, OptimizerConfig) and list(cls.model_fields)[:len(shared)] == shared
    for k in shared:
        if k != "schedule":
            assert doc(SFTTrainConfig, k) == doc(TrainConfig, k) == doc(OptimizerConfig, k)
            assert default(SFTTrainConfig, k) == default(TrainConfig, k)
    assert (SFTTrainConfig().schedule, TrainConfig().schedule) == ("cosine", "constant")
