"""tether.config itself: the key reference in docs/config.md, round trips of YAML files and
dotted overrides, value coercion, the resolution of the recipe's name, the package's
re-exports (every name callers import from ``tether.config`` is still there), and the checks
``load_config`` makes of keys and values (and of the shipped configs/*.yaml)."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Optional, Union

import pytest

import tether.config
import tether.resolve
from helpers import DIGITS, tiny_config
from tether.config import Config, ConfigError, flatten, parse_overrides, to_dict
from tether.resolve import load_config, reference, save_config
from tether.sections import Section, user_value

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "config.md"


def _fields(obj) -> list[tuple[str, str]]:
    """(attribute, key a user writes) of a section's fields: pydantic's model_fields (with aliases) or a
    dataclass's fields (``algo.region``)."""
    cls = obj if isinstance(obj, type) else type(obj)
    if hasattr(cls, "model_fields"):
        return [(n, f.alias or n) for n, f in cls.model_fields.items()]
    return [(f.name, f.name) for f in dataclasses.fields(cls)]


def _is_section(value) -> bool:
    return hasattr(type(value), "model_fields") or (dataclasses.is_dataclass(value) and not isinstance(value, type))


def leaf_keys(obj=None, prefix: str = "") -> list[str]:
    """Every key of a config instance at any depth (default: ``Config()``), walked from its fields
    (independently of ``tether.resolve.reference``); an optional section that is off is one leaf."""
    obj = Config() if obj is None else obj
    out = []
    for name, key in _fields(obj):
        value = getattr(obj, name)
        out += leaf_keys(value, f"{prefix}{key}.") if _is_section(value) else [prefix + key]
    return out


def every_key() -> set[str]:
    """Every key any config can have: the default's, each engine and agent kind's, the search environment's
    retriever, train.async's."""
    from tether.config import (
        AsyncConfig,
        MultiTurnAgentConfig,
        VLLMEngineConfig,
        VLLMServerEngineConfig,
        retriever_config,
    )
    from tether.config.agent import OtherEnvConfig, SearchEnvConfig, SkyRLGymEnvConfig, VerifiersEnvConfig
    from tether.config.anchor import OtherAnchorConfig
    from tether.config.data import OtherDataConfig
    from tether.config.kl import OtherKLConfig
    from tether.config.region import OtherRegionConfig

    keys = set(leaf_keys())
    keys |= {"rollout.engine", "rollout.agent", "train.async", "algo.region", "algo.anchor", "algo.kl", "data"}
    keys |= set(leaf_keys(OtherDataConfig(task="my_ext:task"), "data."))
    keys |= set(leaf_keys(OtherRegionConfig(kind="my.module:Region"), "algo.region."))
    keys |= set(leaf_keys(OtherAnchorConfig(kind="my_anchor"), "algo.anchor."))
    keys |= set(leaf_keys(OtherKLConfig(estimator="my_kl", beta=0.1), "algo.kl."))
    for env in (*(SearchEnvConfig(retriever=retriever_config(k, url="http://x")) for k in ("http", "my_ext:R")),
                SkyRLGymEnvConfig(name="skyrl_gym:x"), VerifiersEnvConfig(name="verifiers:x"),
                OtherEnvConfig(name="my_env:Env")):
        keys |= set(leaf_keys(MultiTurnAgentConfig(env=env), "rollout.agent."))
    keys |= {"rollout.agent.env.retriever", "rollout.agent.env"}
    keys |= set(leaf_keys(VLLMEngineConfig(), "rollout.engine."))
    keys |= set(leaf_keys(AsyncConfig(), "train.async."))
    keys |= set(leaf_keys(VLLMServerEngineConfig(launch=1), "rollout.engine."))
    return keys


# ---------------------------------------------------------------- docs/config.md


def test_every_config_field_at_any_depth_is_in_docs_config_md():
    tables = DOC.read_text().split("## Keys of the earlier flat layout")[0]  # not the old keys' table
    documented = set(re.findall(r"^\| `([\w.]+)` \|", tables, flags=re.MULTILINE))
    keys = every_key()
    assert len(keys) > 100 and "algo.anchor.every" in keys and "recipe" in keys  # the walk went deep
    assert {"rollout.engine.dtype", "train.async.workers", "rollout.engine.urls"} <= keys
    missing = [k for k in keys if k not in documented]
    assert not missing, f"keys missing from docs/config.md (tether config --reference > docs/config.md): {missing}"
    stale = sorted(documented - set(keys))
    assert not stale, f"docs/config.md documents keys Config does not have: {stale}"


def test_every_search_key_is_documented():
    """The hand-listed generator this replaced left out the whole search section; the search environment's keys
    are the env section's and its retriever's."""
    search = [k for k in every_key() if k.startswith("rollout.agent.env.")]
    assert len(search) == 17
    rows = {ln.split("`")[1]: ln for ln in reference().splitlines() if ln.startswith("| `rollout.agent.env.")}
    assert set(rows) == set(search)
    assert "passages per search" in rows["rollout.agent.env.retriever.topk"]  # the comment at its declaration


def test_config_reference_is_complete_and_current():
    """Every key has a comment where it is declared, and docs/config.md is the generated reference."""
    assert DOC.read_text().strip() == reference().strip(), "regenerate with: tether config --reference > docs/config.md"


def test_anchor_every_is_documented_in_trainer_steps():
    """The declaration comment (hence docs/config.md) names the unit the trainer counts in."""
    row = next(ln for ln in reference().splitlines() if ln.startswith("| `algo.anchor.every`"))
    assert "every N trainer steps" in row, row


class _Undocumented(Section):
    """A section with a key declared without a docstring."""

    fine: int = 1
    """documented"""
    bare: int = 2


def test_a_key_declared_without_a_docstring_is_refused():
    from tether.resolve.reference import keys

    with pytest.raises(AssertionError, match="config key bare has no docstring"):
        keys(_Undocumented)


# ---------------------------------------------------------------- round trips

CONFIGS = [
    ({}, None),
    ({"recipe": "dapo", "train.lr": 3e-6, "rollout.stop": ["\n\n", "###"]}, None),
    ({"recipe": "grpo", "algo.kl.beta": 0.02, "eval.benchmarks": ["gsm8k", "arithmetic"], "data.prompt_key": None},
     None),
    ({"recipe": "rpg_fkl", "model.lora_r": 8, "model.lora_target_modules": ["q_proj", "v_proj"]}, None),
    ({}, "search"),
    ({"train.async": {"max_staleness": 2, "workers": 3}, "rollout.engine.prune_every": 0}, None),
]


@pytest.mark.parametrize("overrides,task", CONFIGS)
def test_saved_yaml_loads_back_to_the_same_config(overrides, task, tmp_path):
    cfg = load_config(None, dict(overrides), task=task)
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"))
    assert to_dict(again) == to_dict(cfg)


@pytest.mark.parametrize("overrides,task", CONFIGS)
def test_every_key_as_a_dotted_override_gives_back_the_same_config(overrides, task):
    """Each leaf of a resolved config, written as ``key=value`` (JSON is YAML), parses and loads back."""
    cfg = load_config(None, dict(overrides), task=task)
    flat = flatten(to_dict(cfg))
    assert sorted(flat) == sorted(leaf_keys(cfg))
    items = [f"{k}={json.dumps(v)}" for k, v in flat.items()]
    again = load_config(None, parse_overrides(items))
    assert to_dict(again) == to_dict(cfg)


def test_parse_overrides_reads_yaml_scalars():
    assert parse_overrides(["a.b=1", "c=x", "d=", "e=[1, 2]", "f=null", "g=k=v"]) == {
        "a.b": 1, "c": "x", "d": "", "e": [1, 2], "f": None, "g": "k=v"}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["train.lr"])


@pytest.mark.parametrize("value,tp,want", [
    (None, Optional[str], None), ("none", Optional[str], None), (3, Optional[int], 3), ("3", Optional[int], "3"),
    (True, Optional[bool], True), ("x", Union[int, str], "x"), (3, Union[int, str], 3), ("3", Union[int, str], "3"),
    (2.0, Union[float, str], 2.0), ("q_proj", Union[list, str], "q_proj"), (["a"], Union[list, str], ["a"]),
    ("1e3", int, 1000), ("1.5e0", int, "1.5e0"), (7, str, "7"), ("a,b", list, ["a", "b"]), (("a",), list, ["a"]),
    # a typed list's items are read as that type's values are: numbers as text for list[str], 1e-3 for list[float]
    ([0, 1], list[str], ["0", "1"]), ("0.9,1e-3", list[float], [0.9, 0.001]), ((1,), list[str], ["1"]),
])
def test_a_value_as_written_keeps_a_value_of_a_declared_type(value, tp, want):
    """``sections.user_value`` reads what YAML and ``key=value`` give (none, comma lists, 1e3, a number for a string)
    and leaves the rest to pydantic."""
    got = user_value(value, tp)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("key,value,msg", [("train.steps", True, "train.steps: expected an integer, got True"),
                                           ("train.lr", False, "train.lr: expected a number, got False"),
                                           ("data.system_prompt", True, "data.system_prompt: expected a string"),
                                           ("train.steps", 2.5, "train.steps: expected an integer, got 2.5")])
def test_never_a_bool_for_a_number_or_a_string(key, value, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_config(None, {key: value})


@pytest.mark.parametrize("key,value,msg", [
    ("train.betas", [True, 0.9], "train.betas must be two numbers in [0, 1), got [True, 0.9]"),
    ("train.betas", ["a", 0.9], "train.betas must be two numbers in [0, 1), got ['a', 0.9]"),
    ("rollout.stop", ["</answer>", {"a": 1}], "rollout.stop.1: expected a string"),
    ("eval.benchmarks", [["gsm8k"]], "eval.benchmarks.0: expected a string"),
])
def test_a_list_key_types_its_items(key, value, msg):
    """The list keys are typed to their items (train.betas: list[float], rollout.stop and eval.benchmarks:
    list[str]): an item of another type is refused naming the key (and the item), and items as users write them
    are read as for a single key (a bool is never a number, 1e-1 is a number, a number in a list of text is its
    text)."""
    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_config(None, {key: value})
    cfg = load_config(None, {"train.betas": "0.8,1e-1", "rollout.stop": ["</answer>", 7]})
    assert cfg.train.betas == [0.8, 0.1] and cfg.rollout.stop == ["</answer>", "7"]
    # the options mappings are keyword arguments: their keys are names (dict[str, Any])
    with pytest.raises(ConfigError, match=re.escape("data.options: its keys are names (text), got the key 1")):
        load_config(None, {"data.task": "reasoning_gym:chain_sum", "data.options": {1: 2}})


def test_one_parse_names_the_source_of_each_problem(tmp_path):
    """The layers are parsed once: a problem names the file or the override its key came from."""
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  lr: -1\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(y), {"rollout.top_p": 2})
    lines = str(e.value).splitlines()
    assert lines[0] == "2 problems:" and lines[1:] == [  # in the sections' order
        "  - override: rollout.top_p must be in (0, 1], got 2.0",
        f"  - {y}: train.lr must be a finite number >= 0, got -1.0"]
    with pytest.raises(ConfigError, match=f"^{re.escape(str(y))}: train.lr must be"):
        load_config(str(y), {})
    assert load_config(str(y), {"train.lr": 1e-5}).train.lr == 1e-5  # a later layer wins before anything validates


# ---------------------------------------------------------------- resolution


def test_algo_name_is_the_recipe_plus_custom_only_when_an_algo_key_changed():
    assert load_config(None, {"recipe": "grpo"}).algo.name == "grpo"
    assert load_config(None, {"recipe": "grpo", "algo.name": "mine"}).algo.name == "grpo"  # a name is no change
    assert load_config(None, {"recipe": "grpo", "algo.kl.beta": 0.5}).algo.name == "grpo+custom"


def test_unknown_task_is_a_config_error():
    """It was an UnboundLocalError (a function-local import shadowed unknown_choice) for a valid recipe."""
    with pytest.raises(ConfigError, match="unknown task 'bogus'. Valid choices: organism, math, search"):
        load_config(None, {}, task="bogus")


def test_problems_of_several_sections_are_listed_in_section_order():
    """Every value outside its declared type or range at once (the one parse), then every rule across keys at once,
    section by section."""
    cross = {"data.shuffle": False, "train.mini_batches": 1000}  # rules across sections, after the parse
    ranged = {"rollout.batch_size": 0, "train.lr": -1, "train.steps": 0, "eval.every": -1}  # the sections' order
    with pytest.raises(ConfigError) as e:
        load_config(None, cross | ranged)
    lines = str(e.value).splitlines()
    assert lines[0] == "override: 4 problems:"
    assert [ln.split()[1] for ln in lines[1:]] == list(ranged)
    with pytest.raises(ConfigError) as e:
        load_config(None, cross)
    lines = str(e.value).splitlines()
    assert lines[0] == "invalid config (2 problems):"
    keys = [ln.split()[1].split("=")[0] for ln in lines[1:]]
    assert keys == ["data.shuffle", "train.mini_batches"]


# ---------------------------------------------------------------- the package's names


def _imported_from(package: str) -> set[str]:
    """Names imported from tether.<package> anywhere in src, bench, tests and scripts (also relatively)."""
    names = set()
    for top in ("src", "bench", "tests", "scripts"):
        for f in (ROOT / top).rglob("*.py"):
            in_pkg = f.parent.name == "tether" or f.parent.parent.name == "tether"
            try:
                tree = ast.parse(f.read_text(), str(f))
            except SyntaxError:  # a file being written by someone else; it imports nothing yet
                continue
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom) or package not in (node.module or ""):
                    continue
                absolute = node.level == 0 and node.module == f"tether.{package}"
                relative = in_pkg and node.module == package and node.level == (1 if f.parent.name == "tether" else 2)
                if absolute or relative:
                    names.update(a.name for a in node.names)
    return names


def test_every_name_callers_import_is_re_exported():
    """tether.config (the declarations) and tether.resolve (load_config, check, ...) export every name imported
    from them; the former single module's public names are in one of the two."""
    config, resolve = _imported_from("config"), _imported_from("resolve")
    assert {"parse_overrides", "flatten", "Config"} <= config  # the scan worked
    assert {"load_config", "reference", "check_device"} <= resolve
    old_public = {  # the names of the former single module tether/config.py
        "DEFAULT_RECIPE", "DataConfig", "RolloutConfig", "TrainConfig", "RunConfig", "EvalConfig",
        "HELD_OUT", "eval_benchmarks", "evaluating", "Config", "RECIPE_TRAINER_DEFAULTS", "TASK_PRESETS", "to_dict",
        "parse_overrides", "read_yaml_mapping", "load_config", "check", "check_device", "VLLM_DTYPES",
        "save_config", "reference", "ConfigError", "AlgoConfig", "ModelConfig", "flatten", "set_key"}
    missing = sorted(n for n in config if not hasattr(tether.config, n))
    missing += sorted(n for n in resolve if not hasattr(tether.resolve, n))
    missing += sorted(n for n in old_public if not hasattr(tether.config, n) and not hasattr(tether.resolve, n))
    assert not missing, f"no longer exported: {missing}"
    assert all(hasattr(tether.config, n) for n in tether.config.__all__)
    assert all(hasattr(tether.resolve, n) for n in tether.resolve.__all__)


def test_the_declarations_import_nothing_above_them():
    """tether.config imports no agent, environment, task, engine, retriever, model loader or run directory: it is
    the bottom of the house (tether.resolve checks names against those registries)."""
    banned = ("agents", "envs", "tasks", "rollout", "models", "search", "rundir", "resolve", "anchor", "eval")
    found = []
    for f in (ROOT / "src" / "tether" / "config").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom):
                mod = (node.module or "").split(".")
                top = mod[1] if node.level == 0 and mod[0] == "tether" and len(mod) > 1 else \
                    mod[0] if node.level == 2 else None
                if top in banned:
                    found.append(f"{f.name}: {'.' * node.level}{node.module}")
    assert not found, found


# ---------------------------------------------------------------- values checked by load_config


@pytest.fixture(scope="module")
def workdir(make_workdir):
    """A tiny run's directory: the reward spec of the configs below names a module that exists."""
    return make_workdir("config", DIGITS)


def test_bad_keys_are_errors_with_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'train.lrr'.*Did you mean 'train.lr'"):
        load_config(None, {"train.lrr": 1e-5})
    with pytest.raises(ConfigError, match="algo.region.delta is a key of algo.region.kind=kl3 or tv or binary_kl, "
                       "and algo.region.kind is 'ratio'"):
        load_config(None, {"algo.region.delta": 0.1}, recipe_name="grpo")
    with pytest.raises(ConfigError, match="data.difficulty is a key of data.task=arithmetic or organism, and data.task "
                                          "is 'gsm8k'"):
        load_config(None, {"data.task": "gsm8k", "data.difficulty": 3})
    with pytest.raises(ConfigError, match=r"data.difficulty must be in \[1, 4\], got 9"):
        load_config(None, {"data.difficulty": 9})
    with pytest.raises(ConfigError, match="identically zero"):
        load_config(None, {"train.mini_batches": 1}, recipe_name="rpg_urkl")
    with pytest.raises(ConfigError, match="data.shuffle has no effect with the synthetic"):
        load_config(None, {"data.shuffle": False})
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config(None, {"train.steps": "many"})
    y = tmp_path / "c.yaml"
    y.write_text("recipe: grpo\ntrain:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"c.yaml.*'train.stepz'.*Did you mean 'train.steps'"):
        load_config(str(y))


def test_reward_timeout_and_prompt_overflow_are_validated(workdir, tiny_model_dir):
    for over, msg in (({"data.reward": "math", "data.reward_timeout": 5}, "data.reward_timeout only applies to a user"),
                      ({"data.reward": "auto", "data.reward_timeout": 5}, "data.reward_timeout only applies to a user"),
                      ({"data.reward_timeout": -1}, "data.reward_timeout must be a finite number >= 0, got -1"),
                      ({"data.reward_timeout": float("nan")},
                       "data.reward_timeout must be a finite number >= 0, got nan"),
                      ({"rollout.prompt_overflow": "truncat"}, "rollout.prompt_overflow 'truncat'.*Did you mean")):
        with pytest.raises(ConfigError, match=msg):
            tiny_config(workdir, tiny_model_dir, "grpo", 1, **over)
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 1,
                      **{"data.reward_timeout": 0, "rollout.prompt_overflow": "truncate"})
    assert cfg.data.reward_timeout == 0 and cfg.rollout.prompt_overflow == "truncate"


def test_rollout_correction_config_errors(workdir, tiny_model_dir):
    with pytest.raises(ConfigError, match="rollout.engine.kind=hf reports none"):
        tiny_config(workdir, tiny_model_dir, "grpo", 1, **{"algo.tis_cap": 2.0})
    with pytest.raises(ConfigError, match="tis_mode has no effect"):
        tiny_config(workdir, tiny_model_dir, "grpo", 1, **{"algo.tis_mode": "sequence"})
    with pytest.raises(ConfigError, match="tis_cap must be 0"):
        tiny_config(workdir, tiny_model_dir, "grpo", 1, **{"algo.tis_cap": 0.5})


def test_vllm_options_are_validated(workdir, tiny_model_dir):
    import importlib.util

    with pytest.raises(ConfigError, match="rollout.engine.sleep is a key of rollout.engine.kind=vllm, and "
                                          "rollout.engine.kind is 'hf'"):
        tiny_config(workdir, tiny_model_dir, "grpo", 1, **{"rollout.engine.sleep": True})
    bad = {"rollout.engine": "vllm", "rollout.engine.dtype": "fp8", "rollout.engine.gpu_memory_utilization": 1.5,
           "rollout.engine.sync_bucket_mb": 0, "rollout.engine.kv_cache_gb": -1, "rollout.engine.prune_every": 8}
    with pytest.raises(ConfigError) as e:
        tiny_config(workdir, tiny_model_dir, "grpo", 1, **bad)
    for msg in ("unknown rollout.engine.dtype 'fp8'. Valid choices: auto, float32, bfloat16, float16",
                "rollout.engine.gpu_memory_utilization must be in (0, 1], got 1.5",
                "rollout.engine.sync_bucket_mb must be >= 1, got 0",
                "rollout.engine.kv_cache_gb must be >= 0, got -1",
                "rollout.engine.prune_every is a key of rollout.engine.kind=hf"):
        assert msg in str(e.value)  # every problem at once, each naming its key
    with pytest.raises(ConfigError, match="rollout.engine.kind=vllm needs vLLM" if importlib.util.find_spec("vllm")
                       is None else "nothing"):
        tiny_config(workdir, tiny_model_dir, "grpo", 1, **{"rollout.engine": "vllm"})
    with pytest.raises(ConfigError, match="model.trust_remote_code=true with rollout.engine.kind=vllm: vLLM samples "
                                          "from a snapshot"):
        tiny_config(workdir, tiny_model_dir, "grpo", 1, **{"rollout.engine": "vllm", "model.trust_remote_code": True})


def test_vllm_factory_maps_reuse_kv_to_prefix_caching(monkeypatch):
    """rollout.reuse_kv is vLLM's prefix cache (on by default; false: every turn encodes its whole context)."""
    import tether.rollout.vllm as tv
    from tether.rollout import make_engine

    built = []
    monkeypatch.setattr(tv, "VLLMEngine", lambda model, tok, **kw: built.append(kw) or "engine")
    model = tok = object()  # the stand-in engine never reads them
    for reuse in (True, False):
        cfg = load_config(None, {"rollout.reuse_kv": reuse})
        cfg.rollout.engine = "vllm"  # built directly: this environment may not have vLLM, which validation checks
        assert make_engine(cfg.rollout, model, tok) == "engine" and built.pop()["prefix_caching"] is reuse


@pytest.mark.parametrize("recipe_name", ["rpg_fkl", "dapo"])
def test_exact_kl_samples_needs_an_anchor_with_weights(recipe_name):
    """The exact-KL diagnostic runs in the anchor pass: with anchor.kind none or iterative (the sampler) there is
    none, so asking for more samples is an error; the default (1) and 0 are not."""
    with pytest.raises(ConfigError, match="run.exact_kl_samples logs the exact KL to the anchor, and anchor.kind="):
        load_config(None, {"run.exact_kl_samples": 4}, recipe_name=recipe_name)
    for n in (0, 1):
        load_config(None, {"run.exact_kl_samples": n}, recipe_name=recipe_name)
    load_config(None, {"run.exact_kl_samples": 4}, recipe_name="grpo")
    with pytest.raises(ConfigError, match="run.exact_kl_samples must be >= 0"):
        load_config(None, {"run.exact_kl_samples": -1})


def test_shipped_configs_are_valid():
    for y in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(str(y))
