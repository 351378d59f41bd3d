"""The nested, typed configuration (tether.sections, tether.config.engine, tether.config.agent,
tether.config.train_async, tether.config.migration): sections chosen by their kind (rollout.engine,
rollout.agent), an optional section (train.async) with its
shorthands, each cross-field rule of those sections, the errors for keys of the earlier flat layout, and a run
directory saved in that layout read in the new one."""

from __future__ import annotations

import pytest
import yaml

from tether.config import (
    AsyncConfig,
    Config,
    ConfigError,
    HFEngineConfig,
    MultiTurnAgentConfig,
    SingleTurnAgentConfig,
    VLLMEngineConfig,
    to_dict,
)
from tether.config.agent import OtherEnvConfig, OtherRetrieverConfig
from tether.config.migration import MOVED, migrate_saved, moved_key
from tether.resolve import load_config, save_config
from tether.sections import Section, default, doc, keys_of, replace


def test_engine_shorthand_and_kind_choose_the_section():
    assert isinstance(Config().rollout.engine, HFEngineConfig)
    cfg = Config()
    cfg.rollout.engine = "vllm"  # the shorthand, validated on assignment
    assert isinstance(cfg.rollout.engine, VLLMEngineConfig) and cfg.rollout.engine.dtype == "auto"
    cfg.rollout.engine = {"kind": "vllm", "dtype": "bfloat16", "max_model_len": 512}
    assert (cfg.rollout.engine.dtype, cfg.rollout.engine.max_model_len) == ("bfloat16", 512)
    cfg.rollout.engine = {"prune_every": 0}  # a mapping without a kind is the default (hf) engine's
    assert isinstance(cfg.rollout.engine, HFEngineConfig) and cfg.rollout.engine.prune_every == 0
    cfg.rollout.engine = "scripted"  # another registered engine: no keys of its own (validated by check)
    assert cfg.rollout.engine.kind == "scripted"


def test_engine_keys_belong_to_their_kind():
    with pytest.raises(ConfigError, match="rollout.engine.dtype is a key of rollout.engine.kind=vllm or vllm_server, "
                                          "and rollout.engine.kind is 'hf': set rollout.engine.kind=vllm first"):
        load_config(None, {"rollout.engine.dtype": "bfloat16"})
    with pytest.raises(ConfigError, match="rollout.engine.share_prompt is a key of rollout.engine.kind=hf"):
        load_config(None, {"rollout.engine.kind": "vllm", "rollout.engine.share_prompt": False})
    # the kind first, whatever the order the keys come in (a YAML mapping, CLI overrides)
    with pytest.raises(ConfigError, match="unknown rollout.engine.dtype 'fp8'. Valid choices: auto, float32, bfloat16, "
                                          "float16"):
        load_config(None, {"rollout.engine.dtype": "fp8", "rollout.engine.kind": "vllm"})


@pytest.mark.parametrize("key,value,msg", [
    ("rollout.engine.prune_every", -1, "must be >= 0, got -1"),
    ("train.async.max_staleness", 0, "must be >= 1, got 0"),
    ("train.async.workers", 0, "must be >= 1, got 0"),
    ("train.async.worker_restarts", -1, "must be >= 0, got -1"),
    ("train.async.verify_logp_tol", 0, "must be > 0, got 0.0"),
    ("train.async.partial_rollout_tokens", -2, "must be >= 0, got -2"),
    ("train.lr", -1, "must be a finite number >= 0, got -1.0"),
    ("train.lr_scale_floor", 1, "must be in [0, 1), got 1.0"),
    ("rollout.top_p", 0, "must be in (0, 1], got 0.0"),
    ("eval.every", -1, "must be >= 0, got -1"),
    ("model.lora_dropout", 1.5, "must be in [0, 1), got 1.5"),
    ("eval.benchmarks", [], "must hold at least 1 item(s), got []"),
    ("model.lora_target_modules", [], "must name at least one module (or 'all-linear'), got []"),
])
def test_ranges_are_declared_with_the_key(key, value, msg):
    """A value out of the range declared with its key is refused as it is set, in one phrasing for every key."""
    with pytest.raises(ConfigError) as e:
        load_config(None, {key: value})
    assert str(e.value) == f"override: {key} {msg}"


@pytest.mark.parametrize("key,value,valid", [
    ("train.async.stale_batches", "maybe", "drop, keep"),
    ("train.schedule", "cosin", "constant, cosine, linear"),
    ("train.lr_scale", "es", "none, ess, seq_ess"),
    ("rollout.prompt_overflow", "truncat", "error, truncate"),
    ("model.dtype", "float8", "float32, fp32, bfloat16, bf16, float16, fp16"),
])
def test_choices_are_declared_with_the_key(key, value, valid):
    """A value not among the choices declared with its key (a Literal) is refused as it is set, with a did-you-mean
    when one is close."""
    with pytest.raises(ConfigError, match=f"override: unknown {key} {value!r}.* Valid choices: {valid}$"):
        load_config(None, {key: value})


def test_the_reference_shows_each_declared_range():
    from tether.resolve.reference import reference

    rows = {ln.split("`")[1]: ln for ln in reference().splitlines() if ln.startswith("| `")}
    assert rows["rollout.top_p"].endswith("Range: in (0, 1] |")
    assert rows["train.lr"].endswith("Range: a finite number >= 0 |")
    assert "Range" not in rows["train.seed"]


def test_async_shorthand_and_off():
    assert Config().train.async_ is None and Config().train.max_staleness == 0
    cfg = load_config(None, {"train.async": 2})
    assert cfg.train.async_ == AsyncConfig(max_staleness=2) and cfg.train.max_staleness == 2
    assert cfg.algo.tis_cap == 2.0  # the default correction (train.async.correction)
    for off in (None, "none", 0, False):
        assert load_config(None, {"train.async": off}).train.async_ is None
    # a key of the section turns it on with its defaults
    cfg = load_config(None, {"train.async.workers": 3})
    assert (cfg.train.max_staleness, cfg.train.async_.workers) == (1, 3)
    # the YAML form
    cfg = load_config(None, {"train.async": {"max_staleness": 4, "workers": 2}})
    assert (cfg.train.async_.max_staleness, cfg.train.async_.workers) == (4, 2)


def test_the_retired_remote_transport_is_one_line_naming_what_replaced_it():
    """train.async.transport (the pickled TCP channel of `tether worker`) was retired for served rollouts: each of its
    keys, new or flat, in an override or a saved run, is one error naming rollout.engine.kind=vllm_server; a saved run
    that used local workers (transport kind local) still loads."""
    for over in ({"train.async.transport.kind": "remote"}, {"train.async.transport": "local"},
                 {"train.worker_address": "10.0.0.5:29600"}):
        with pytest.raises(ConfigError, match="the remote transport .* was retired: .*rollout.engine.kind=vllm_server"):
            load_config(None, {"train.async": 1, **over})
    assert migrate_saved({"train.async.max_staleness": 1, "train.async.transport.kind": "local",
                          "train.async.transport.key_env": "TETHER_WORKER_KEY"}) == {"train.async.max_staleness": 1}
    with pytest.raises(ConfigError, match="this run used the remote transport"):
        migrate_saved({"train.async.transport.kind": "remote", "train.async.transport.address": "h:1"})


def test_the_served_engine_section_rules():
    """rollout.engine.kind=vllm_server: exactly one of launch and urls; URLs of the http form; the launch-only keys
    refused with urls; its own keys of the wrong engine refused."""
    from tether.config.engine import VLLMServerEngineConfig

    assert VLLMServerEngineConfig(launch=2).problems() == []
    assert "exactly one of rollout.engine.launch" in VLLMServerEngineConfig().problems()[0]
    assert "exactly one" in VLLMServerEngineConfig(launch=1, urls=["http://h:1"]).problems()[0]
    assert "each is a base URL" in VLLMServerEngineConfig(urls=["h:1"]).problems()[0]
    assert "rollout.engine.dtype configures servers tether launches" in VLLMServerEngineConfig(
        urls=["http://h:1"], dtype="float32").problems()[0]
    with pytest.raises(ConfigError, match="rollout.engine.launch is a key of rollout.engine.kind=vllm_server"):
        load_config(None, {"rollout.engine.launch": 1})
    with pytest.raises(ConfigError, match="train.async.verify_sync applies to local rollout workers"):
        load_config(None, {"rollout.engine": {"kind": "vllm_server", "launch": 1}, "train.async": 1,
                           "train.async.verify_sync": True})


def test_async_cross_field_rules():
    with pytest.raises(ConfigError, match="train.async.stale_batches has no effect: with train.async.workers=2 <="):
        load_config(None, {"train.async.stale_batches": "keep", "train.async.workers": 2})
    load_config(None, {"train.async.stale_batches": "keep", "train.async.workers": 3})  # a batch can be 2 old
    with pytest.raises(ConfigError, match="train.async does not support rollout.dynamic_sampling"):
        load_config(None, {"train.async": 1}, recipe_name="dapo")
    with pytest.raises(ConfigError, match="verify_logp_tol only applies with train.async.verify_sync=true and "
                                          "rollout.engine.kind=vllm"):
        load_config(None, {"train.async.verify_sync": True, "train.async.verify_logp_tol": 0.1})
    with pytest.raises(ConfigError, match="train.async.correction=false has no effect"):
        load_config(None, {"train.async.correction": False, "algo.tis_cap": 3.0})
    with pytest.raises(ConfigError, match="partial_rollout_tokens .partial rollouts. supports rollout.agent.kind="
                                          "single_turn only"):
        load_config(None, {"train.async.partial_rollout_tokens": 8, "rollout.agent": "multi_turn",
                           "rollout.max_new_tokens": 64})


def test_every_old_key_is_one_error_naming_its_new_place(tmp_path):
    """A config file written for the flat layout: one line per old key, each naming where it went."""
    old = {"rollout": {"engine": "vllm", "vllm_dtype": "bfloat16", "share_prompt": False},
           "train": {"max_staleness": 1, "rollout_workers": 2, "stale_batches": "keep"}}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    text = str(e.value)
    assert f"{path}: 5 keys of the earlier flat layout" in text
    for key in ("rollout.vllm_dtype", "rollout.share_prompt", "train.max_staleness", "train.rollout_workers",
                "train.stale_batches"):
        assert f"config key {key!r} moved to {MOVED[key]!r}" in text
    assert moved_key("train.steps") is None


def test_every_moved_key_has_a_place_in_the_new_layout():
    """MOVED's targets are real keys of the nested config (a typo there would send users nowhere)."""
    for old, new in MOVED.items():
        section, _, leaf = new.rpartition(".")
        cls = {"rollout.engine": VLLMEngineConfig if old.startswith("rollout.vllm_") else HFEngineConfig,
               "train.async": AsyncConfig, "rollout.agent.env": OtherEnvConfig,
               "rollout.agent.env.retriever": OtherRetrieverConfig}[section]
        assert leaf in keys_of(cls), (old, new)


def test_a_run_saved_in_the_flat_layout_is_read_in_the_new_one(tmp_path):
    """migrate_saved: the old keys renamed, their sections chosen; a config without them is unchanged."""
    old_sync = {"rollout.engine": "hf", "rollout.share_prompt": True, "rollout.prune_every": 32,
                "rollout.vllm_dtype": "auto", "train.max_staleness": 0, "train.rollout_workers": 1,
                "train.worker_address": "", "train.steps": 3}
    new = migrate_saved(old_sync)
    assert new == {"rollout.engine.kind": "hf", "rollout.engine.share_prompt": True,
                   "rollout.engine.prune_every": 32, "train.steps": 3, "train.async": None}
    cfg = load_config(None, new)
    assert cfg.rollout.engine.prune_every == 32 and cfg.train.async_ is None
    old_async = {"rollout.engine": "vllm", "rollout.share_prompt": True, "rollout.vllm_dtype": "bfloat16",
                 "train.max_staleness": 2, "train.rollout_workers": 3, "train.worker_address": "",
                 "train.worker_timeout_s": 60.0, "train.async_correction": False}
    assert migrate_saved(old_async) == {
        "rollout.engine.kind": "vllm", "rollout.engine.dtype": "bfloat16", "train.async.max_staleness": 2,
        "train.async.workers": 3, "train.async.correction": False}
    cur = {"train.async": None, "rollout.engine.kind": "hf"}
    assert migrate_saved(cur) == cur


def test_agent_shorthand_and_kind_choose_the_section():
    cfg = Config()
    assert isinstance(cfg.rollout.agent, SingleTurnAgentConfig) and not hasattr(cfg.rollout.agent, "env")
    cfg.rollout.agent = "multi_turn"
    assert isinstance(cfg.rollout.agent, MultiTurnAgentConfig) and cfg.rollout.agent.env.name == "calculator"
    cfg.rollout.agent = {"env": {"name": "search"}}  # a mapping with an env is multi_turn's
    assert cfg.rollout.agent.kind == "multi_turn" and cfg.rollout.agent.env.retriever.kind == "bm25"
    assert cfg.rollout.agent.env.search_turns() == 5 and cfg.rollout.agent.env.retriever.topk == 3
    with pytest.raises(ConfigError, match="rollout.agent=search is now the search environment: "
                                          "rollout.agent.kind=multi_turn with rollout.agent.env.name=search"):
        load_config(None, {"rollout.agent": "search"})
    with pytest.raises(ConfigError, match="rollout.agent.env is a key of rollout.agent.kind=multi_turn"):
        load_config(None, {"rollout.agent.env.max_turns": 3})
    # the kind first, whatever the order the keys come in; a retriever key turns the retriever section on
    cfg = load_config(None, {"rollout.agent.env.retriever.topk": 5, "rollout.agent.env.name": "search",
                             "rollout.agent.kind": "multi_turn", "data.task": "multihop"})
    assert cfg.rollout.agent.env.retriever.topk == 5 and cfg.rollout.agent.env.retriever.kind == "bm25"


@pytest.mark.parametrize("over, msg", [
    # the retriever belongs to the search environment
    ({"rollout.agent.env.retriever.topk": 5}, "rollout.agent.env.retriever is a key of rollout.agent.env.name=search, "
                                              "and rollout.agent.env.name is 'calculator'"),
    # Search-R1's protocol is one growing assistant turn: the search environment has no observation_format
    ({"rollout.agent.env.name": "search", "rollout.agent.env.observation_format": "chat"},
     "rollout.agent.env.observation_format is a key of rollout.agent.env.name=calculator or skyrl_gym:<name> or "
     "verifiers:<name>, and rollout.agent.env.name is 'search'"),
    # SkyRL and verifiers environments run in chat turns only
    ({"rollout.agent.env.name": "skyrl_gym:gsm8k", "rollout.agent.env.observation_format": "raw"},
     r"unknown rollout.agent.env.observation_format 'raw'. Valid choices: chat"),
    ({"rollout.agent.env.name": "verifiers:x", "rollout.agent.env.observation_role": "user"},
     "rollout.agent.env.observation_role is a key of rollout.agent.env.name=calculator or skyrl_gym:<name>, and "
     "rollout.agent.env.name is 'verifiers:x'"),
    # the role of an observation turn exists only in the chat format
    ({"rollout.agent.env.observation_role": "user"}, "rollout.agent.env.observation_role only applies with "
                                                     "observation_format=chat"),
    # a retriever's keys belong to the retrievers that read them (a section per kind)
    ({"rollout.agent.env.name": "search", "rollout.agent.env.retriever.timeout": 5.0},
     "rollout.agent.env.retriever.timeout is a key of rollout.agent.env.retriever.kind=http, and "
     "rollout.agent.env.retriever.kind is 'bm25'"),
    ({"rollout.agent.env.name": "search", "rollout.agent.env.retriever.kind": "http"},
     "rollout.agent.env.retriever.url must be set: the retrieval server's base URL"),
    ({"rollout.agent.env.name": "nope_env"}, "unknown rollout.agent.env.name 'nope_env'"),
    # a verifiers environment names its env_id (refused where the section declares its name)
    ({"rollout.agent.env.name": "verifiers:"}, r"rollout.agent.env.name names no environment \(verifiers:<env_id>"),
    ({"rollout.agent.env.max_context": 0}, "rollout.agent.env.max_context must be >= 1, got 0"),
])
def test_agent_cross_field_rules(over, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, {"rollout.agent.kind": "multi_turn", "data.task": "multihop", **over})


def test_the_keys_of_one_response_apply_to_a_single_turn_agent():
    """rollout.stop / min_new_tokens / overlong_buffer_frac: refused under a multi-turn agent (its messages:
    tests/test_multi_turn_agent.py) beside their declarations, whatever order the keys come in."""
    cfg = load_config(None, {"rollout.stop": ["</answer>"], "rollout.min_new_tokens": 4,
                             "rollout.overlong_buffer_frac": 0.25})
    assert cfg.rollout.stop == ["</answer>"] and cfg.rollout.min_new_tokens == 4
    with pytest.raises(ConfigError, match="rollout.stop with rollout.agent.kind=multi_turn"):  # the agent set after
        load_config(None, {"rollout.stop": ["</answer>"], "rollout.agent": "multi_turn", "data.task": "multihop"})


def test_agent_keys_of_the_earlier_layout():
    """Each old env.* / search.* key names its new place; a saved run of the old search agent reads as the search
    environment (max_searches M as max_turns M + 1), a saved multi-turn run keeps its env, a single-turn run drops
    the sections it never read."""
    assert "'rollout.agent.env.max_turns' as max_searches + 1" in moved_key("search.max_searches")
    assert "moved to 'rollout.agent.env.retriever.passage_format'" in moved_key("search.observation_format")
    assert "moved to 'rollout.agent.env.name' (with rollout.agent.kind=multi_turn)" in moved_key("env.name")
    env = {"env.name": "calculator", "env.max_turns": 0, "env.max_obs_tokens": 512}
    search = {"search.retriever": "bm25", "search.topk": 2, "search.max_searches": 3, "search.max_context": 900,
              "search.observation_format": "clean"}
    new = migrate_saved({"rollout.agent": "search", **env, **search, "data.task": "multihop"})
    assert new == {"rollout.agent.kind": "multi_turn", "rollout.agent.env.name": "search",
                   "rollout.agent.env.retriever.kind": "bm25", "rollout.agent.env.retriever.topk": 2,
                   "rollout.agent.env.max_turns": 4, "rollout.agent.env.max_context": 900,
                   "rollout.agent.env.retriever.passage_format": "clean", "data.task": "multihop"}
    e = load_config(None, new).rollout.agent.env
    assert (e.search_turns(), e.retriever.topk, e.max_context) == (4, 2, 900)
    new = migrate_saved({"rollout.agent": "multi_turn", **{**env, "env.max_turns": 3}, **search})
    assert new == {"rollout.agent.kind": "multi_turn", "rollout.agent.env.name": "calculator",
                   "rollout.agent.env.max_turns": 3, "rollout.agent.env.max_obs_tokens": 512}
    assert migrate_saved({"rollout.agent": "single_turn", **env, **search}) == {"rollout.agent.kind": "single_turn"}


def test_saved_config_round_trips_with_the_nested_sections(tmp_path):
    cfg = load_config(None, {"train.async": {"max_staleness": 2, "workers": 3},
                             "rollout.engine": {"prune_every": 16}})
    save_config(cfg, tmp_path / "c.yaml")
    saved = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert saved["train"]["async"]["max_staleness"] == 2 and "async_" not in saved["train"]
    assert saved["rollout"]["engine"] == {"kind": "hf", "share_prompt": True, "prune_every": 16}
    assert to_dict(load_config(str(tmp_path / "c.yaml"))) == to_dict(cfg)


class _Demo(Section):
    """A section for the base's own behaviour."""

    a: int = 1
    """first"""
    b: str = "x"
    """second"""


def test_section_base():
    assert _Demo(5, b="y") == _Demo(a=5, b="y")  # positional keys, in declaration order
    with pytest.raises(TypeError, match="given by position and by name"):
        _Demo(5, a=6)
    with pytest.raises(Exception, match="Extra inputs are not permitted"):
        _Demo(c=1)
    d = _Demo()
    with pytest.raises(Exception, match="valid integer"):
        d.a = "many"  # assignments are validated
    assert replace(d, a=3).a == 3 and d.a == 1
    assert default(_Demo, "b") == "x" and doc(_Demo, "a") == "first" and keys_of(_Demo) == ["a", "b"]


def test_env_options_are_the_environment_constructors_keyword_arguments(tmp_path):
    """rollout.agent.env.options reach a user's environment's constructor; an argument it does not take is a
    ConfigError naming the environment; the built-in calculator and search take none."""
    from tether.agents import env_from_config
    from tether.envs import TextEnv

    (tmp_path / "opt_env.py").write_text(
        "from tether.envs import TextEnv\n"
        "class Guess(TextEnv):\n"
        "    name = 'guess'\n"
        "    def __init__(self, secret_range=10, **kw):\n"
        "        super().__init__(**kw)\n        self.secret_range = secret_range\n")
    over = {"rollout.agent.kind": "multi_turn", "rollout.agent.env.name": f"{tmp_path / 'opt_env.py'}:Guess"}
    env = env_from_config(load_config(None, {**over, "rollout.agent.env.options": {"secret_range": 100},
                                             "rollout.agent.env.max_turns": 3}).rollout.agent.env)
    assert isinstance(env, TextEnv) and (env.secret_range, env.max_turns) == (100, 3)
    with pytest.raises(ConfigError, match="opt_env.py:Guess.*unexpected keyword argument 'colour'"):
        env_from_config(load_config(None, {**over, "rollout.agent.env.options": {"colour": 1}}).rollout.agent.env)
    for name in ("calculator", "search"):  # their settings are the section's own keys
        with pytest.raises(ConfigError, match=f"rollout.agent.env.options is a key of .*, and rollout.agent.env.name "
                                              f"is '{name}'"):
            load_config(None, {"rollout.agent.kind": "multi_turn", "rollout.agent.env.name": name,
                               "rollout.agent.env.options": {"max_turns": 2}})


R = "rollout.agent.env.retriever"


def test_a_config_saved_before_the_kl_and_env_sections_loads():
    """The previous release saved every KL key and every environment key whatever the estimator or the environment
    read (its config.yaml, flattened as a resume reads it): each unread key at its old default is dropped, and the
    values it held are kept (a SkyRL run keeps the role it trained with)."""
    saved = {"rollout.agent.kind": "multi_turn", "rollout.agent.env.name": "search", "rollout.agent.env.max_turns": 3,
             "rollout.agent.env.max_obs_tokens": 512, "rollout.agent.env.max_context": 4096,
             "rollout.agent.env.observation_format": "raw", "rollout.agent.env.observation_role": "tool",
             "rollout.agent.env.options": {}, "rollout.agent.env.retriever": None, "data.task": "multihop",
             "algo.kl.estimator": "k3", "algo.kl.beta": 0.001, "algo.kl.placement": "loss", "algo.kl.topk": 32,
             "algo.kl.truncated": False, "algo.kl.s_min": 0.0, "algo.kl.s_max": 0.0}
    cfg = load_config(None, saved, recipe_name="grpo")
    assert to_dict(cfg)["rollout"]["agent"]["env"] == {"name": "search", "max_turns": 3, "max_obs_tokens": 512,
                                                       "max_context": 4096, "retriever": {
                                                           "kind": "bm25", "data_dir": "", "topk": 3,
                                                           "passage_format": "search_r1", "corpus": ""}}
    # its retriever saved with every key (an http one): the keys http does not read, at their defaults, dropped
    old_http = {f"{R}.kind": "http", f"{R}.url": "http://127.0.0.1:1", f"{R}.corpus": "", f"{R}.data_dir": "",
                f"{R}.dense_model": "intfloat/e5-base-v2", f"{R}.topk": 3, f"{R}.passage_format": "search_r1",
                f"{R}.timeout": 30.0, f"{R}.retries": 2}
    saved_http = {k: v for k, v in saved.items() if k != R} | old_http
    assert load_config(None, saved_http, recipe_name="grpo").rollout.agent.env.retriever.url == "http://127.0.0.1:1"
    with pytest.raises(ConfigError, match=f"{R}.dense_model is a key of {R}.kind=dense"):
        load_config(None, saved_http | {f"{R}.dense_model": "other-model"}, recipe_name="grpo")
    assert to_dict(cfg)["algo"]["kl"] == {"estimator": "k3", "beta": 0.001, "placement": "loss", "s_min": 0.0,
                                          "s_max": 0.0}
    skyrl = {**saved, "rollout.agent.env.name": "skyrl_gym:gsm8k", "rollout.agent.env.observation_format": "chat",
             "data.task": "gsm8k"}
    assert load_config(None, skyrl, recipe_name="grpo").rollout.agent.env.observation_role == "tool"
