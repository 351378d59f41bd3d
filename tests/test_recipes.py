"""Named recipes and config validation: every recipe is complete; bad combinations are clear errors."""

import pytest

from tether.algo import RegionConfig
from tether.config.anchor import EMAAnchorConfig, FixedAnchorConfig
from tether.config.kl import kl_config
from tether.config.overrides import apply_keys
from tether.config.recipes import RECIPES, AlgoConfig, recipe, validate
from tether.errors import ConfigError
from tether.resolve import load_config

SPEC = {  # ALGORITHMS.md section 6
    "grpo": ("grpo", "ratio", "k3", "fixed"),
    "dapo": ("grpo", "ratio", "none", "none"),
    "dr_grpo": ("dr_grpo", "ratio", "none", "none"),
    "ema_pg": ("grpo", "ratio", "topk_rev", "ema"),
    "atr_grpo": ("grpo", "kl3", "k3", "fixed"),
    "reinforce_pp": ("reinforce_pp", "ratio", "k3", "fixed"),
    "cispo": ("grpo", "cispo", "none", "none"),
    "gspo": ("grpo", "gspo", "none", "none"),
    **{f"rpg_{v}": ("group_mean", "dual", f"rpg_{v}", "iterative") for v in ("fkl", "rkl", "ufkl", "urkl")},
    **{f"rpg_reinforce_{v}": ("group_mean", "rpg_clip", f"rpg_{v}", "iterative")
       for v in ("fkl", "rkl", "ufkl", "urkl")},
}


def test_all_named_recipes_exist_and_match_spec():
    assert set(RECIPES) == set(SPEC)
    for name, (adv, region, est, anchor) in SPEC.items():
        c = recipe(name)
        assert (c.advantage, c.region.kind, c.kl.estimator, c.anchor.kind) == (adv, region, est, anchor), name
        assert c.name == name


def test_recipe_details():
    assert recipe("dapo").region.eps_high == 0.28
    e = recipe("ema_pg")
    assert (e.kl.topk, e.kl.beta, e.anchor.every) == (32, 1e-3, 10) and 0.9 <= e.anchor.eta <= 0.95
    r = recipe("rpg_reinforce_urkl")
    assert (r.surrogate, r.kl.placement, r.region.clip_c, r.kl.beta) == ("reinforce", "advantage", 3.0, 1e-4)
    assert recipe("rpg_reinforce_fkl").kl.placement == "loss"
    assert recipe("dr_grpo").aggregation == "seq-mean-token-sum-norm"


def test_recipes_are_fresh_copies():
    a = recipe("grpo")
    a.kl.beta = 5.0
    assert recipe("grpo").kl.beta == 1e-3


def test_unknown_recipe_lists_choices():
    with pytest.raises(ConfigError, match="Did you mean 'grpo'.*Valid choices: .*ema_pg"):
        recipe("grpoo")


@pytest.mark.parametrize("keys,msg", [
    ({"anchor": "none"}, "needs an anchor; choose anchor.kind from"),
    ({"kl.estimator": "topk_ref"}, "Did you mean 'topk_rev'"),
    ({"kl.beta": 0.0}, "needs kl.beta > 0"),
    ({"advantage": "gae"}, "unknown advantage 'gae'"),
    ({"kl.placement": "advantage"}, "needs kl.estimator rpg_rkl or rpg_urkl"),
    ({"kl.estimator": "topk_rev_centered", "kl.truncated": True}, "use 'topk_rev'"),
    ({"kl.truncated": True, "kl.s_max": 2.0}, "which kl.truncated=true drops"),
    ({"advantage": "rloo", "adv_eps": 1e-3}, "adv_eps has no effect"),
])
def test_bad_combinations_are_errors(keys, msg):
    """Refused as the keys are set (a rule within the section, e.g. adv_eps's) or by validate (one across its
    sections)."""
    with pytest.raises(ConfigError, match=msg):
        validate(apply_keys(recipe("ema_pg"), keys, "test"))


def test_ineffective_options_without_kl():
    with pytest.raises(ConfigError, match="test: kl.beta is set but algo.kl.estimator is 'none'; pick an estimator"):
        apply_keys(recipe("dapo"), {"kl.beta": 0.1}, "test")
    c = recipe("dapo")
    c.anchor = EMAAnchorConfig()
    with pytest.raises(ConfigError, match="has no effect without a KL term"):
        validate(c)


@pytest.mark.parametrize("recipe_name,keys,msg", [
    ("grpo", {"algo.kl.topk": 8}, "algo.kl.topk is a key of algo.kl.estimator=topk_rev or "),
    ("grpo", {"algo.kl.truncated": True}, "algo.kl.truncated is a key of algo.kl.estimator=topk_rev or "),
    ("rpg_fkl", {"algo.kl.s_max": 2.0}, "algo.kl.s_max is a key of algo.kl.estimator=k1 or "),
    ("dapo", {"algo.kl.placement": "reward"}, "algo.kl.placement is a key of algo.kl.estimator=k1 or "),
])
def test_a_key_the_estimator_does_not_read_is_refused(recipe_name, keys, msg):
    """algo.kl is a section per family of estimators: a key another family reads cannot be set (no "has no effect"
    table), and the error names the estimators that read it."""
    with pytest.raises(ConfigError, match=f"override: {msg}"):
        load_config(None, keys, recipe_name=recipe_name)


def test_changing_the_estimator_keeps_the_keys_it_reads():
    """algo.kl.estimator switches the family and keeps beta and placement (a recipe's k3 at beta 1e-3 becomes a
    top-k term at the same beta); the keys the new family reads but the old did not start at their defaults; an
    earlier release's config, with every key, loads (the unread keys at their old defaults dropped)."""
    c = load_config(None, {"algo.kl.estimator": "topk_fwd"}, recipe_name="reinforce_pp")
    assert c.algo.kl.model_dump() == {"estimator": "topk_fwd", "beta": 1e-3, "placement": "reward", "topk": 32,
                                      "truncated": False, "s_min": 0.0, "s_max": 0.0}
    c = load_config(None, {"algo.kl": {"estimator": "exact_fwd", "beta": 0.1}}, recipe_name="ema_pg")
    assert c.algo.kl.model_dump() == {"estimator": "exact_fwd", "beta": 0.1, "placement": "loss"}
    old = {"algo.kl.estimator": "k3", "algo.kl.beta": 0.01, "algo.kl.placement": "loss", "algo.kl.topk": 32,
           "algo.kl.truncated": False, "algo.kl.s_min": 0.0, "algo.kl.s_max": 0.0}  # a saved run's, flattened
    assert load_config(None, old, recipe_name="grpo").algo.kl == kl_config("k3", beta=0.01)
    with pytest.raises(ConfigError, match="algo.kl.topk is a key of"):  # not at its old default: it meant something
        load_config(None, {**old, "algo.kl.topk": 8}, recipe_name="grpo")


def test_every_estimator_has_one_family():
    from tether.algo import KL_ESTIMATORS
    from tether.config.kl import KL_SECTIONS
    assert set(KL_SECTIONS) == {"none", *KL_ESTIMATORS.names()}


def test_region_surrogate_compatibility():
    c = AlgoConfig(surrogate="ratio", region=RegionConfig("cispo"))
    with pytest.raises(ConfigError, match="defined for surrogate 'reinforce'"):
        validate(c)
    # a bound the kind needs is refused where the region is declared: as the section is built, and in a config
    with pytest.raises(ValueError, match="needs region.clip_c > 1"):
        AlgoConfig(region=RegionConfig("dual"))
    with pytest.raises(ValueError, match="needs region.delta > 0"):
        AlgoConfig(region=RegionConfig("kl3"))
    with pytest.raises(ConfigError, match=r"override: algo.region: trust region 'rpg_clip' needs region.clip_c > 1"):
        load_config(None, {"algo.region": "rpg_clip"}, recipe_name="grpo")
    with pytest.raises(ConfigError, match=r"override: algo.anchor: anchor 'kl_reset' needs anchor.kappa > 0"):
        load_config(None, {"algo.anchor": "kl_reset"}, recipe_name="grpo")
    assert load_config(None, {"algo.anchor": "kl_reset", "algo.anchor.kappa": 0.1},
                       recipe_name="grpo").algo.anchor.kappa == 0.1


def test_every_registered_estimator_validates_with_an_anchor():
    from tether.algo import KL_ESTIMATORS
    for est in KL_ESTIMATORS:
        validate(AlgoConfig(kl=kl_config(est, beta=0.01), anchor=FixedAnchorConfig()))


def test_algo_layer_imports_only_torch():
    """tether.algo (and the anchor) must be usable inside another trainer without transformers."""
    import subprocess
    import sys

    code = ("import sys, tether.algo, tether.anchor; "
            "bad = [m for m in ('transformers', 'peft', 'safetensors', 'yaml') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_anchor_kinds_of_the_config_are_the_registered_ones():
    """The anchor kinds are one registry, tether.algo.anchors.ANCHOR_KINDS (with their rules); the config's
    choices ("none" plus the kinds) and tether.anchor read it."""
    from tether.anchor import ANCHOR_KINDS
    from tether.config.recipes import ANCHORS

    assert ANCHORS == ("none", *ANCHOR_KINDS)
    import tether.algo.anchors
    assert ANCHOR_KINDS is tether.algo.anchors.ANCHOR_KINDS
    assert ANCHOR_KINDS.where(needs_forward=False) == ("iterative",)


# ---------------------------------------------------------------- algo.region: a section per kind


def test_each_region_kind_holds_only_the_bounds_it_reads():
    """Written out from tether.algo.trust_region's functions: the keys each kind's section declares."""
    from tether.config.region import REGION_KINDS, OtherRegionConfig

    reads = {"none": set(), "ratio": {"eps_low", "eps_high", "clip_c"}, "dual": {"eps_low", "eps_high", "clip_c"},
             "rpg_clip": {"eps_low", "eps_high", "clip_c"}, "gspo": {"eps_low", "eps_high", "clip_c"},
             "kl3": {"delta", "clip_c"}, "tv": {"delta", "clip_c"}, "binary_kl": {"delta", "clip_c"},
             "cispo": {"eps_high"}}
    from tether.algo.trust_region import REGIONS

    assert set(REGION_KINDS) == set(reads) == set(REGIONS.names())
    for kind, cls in REGION_KINDS.items():
        assert set(cls.model_fields) - {"kind"} == reads[kind], kind
    assert set(OtherRegionConfig.model_fields) == {"kind", "eps_low", "eps_high", "clip_c", "delta"}


def test_a_region_switched_by_kind_starts_from_its_own_defaults():
    from tether.resolve import load_config

    c = load_config(None, {"algo.region.kind": "kl3", "algo.region.delta": 0.05}, recipe_name="ema_pg")
    assert c.algo.region.model_dump() == {"kind": "kl3", "delta": 0.05, "clip_c": 0.0}
    assert load_config(None, {"algo.region": "tv", "algo.region.delta": 0.1}).algo.region.kind == "tv"
    c = load_config(None, {"algo.region": {"kind": "cispo", "eps_high": 0.3}, "algo.surrogate": "reinforce"})
    assert c.algo.region.model_dump() == {"kind": "cispo", "eps_high": 0.3}


def test_an_earlier_release_s_region_with_all_four_bounds_still_loads(tmp_path):
    """config.yaml of the previous release held eps_low, eps_high, clip_c and delta whatever the kind: the bounds
    the kind does not read, at their old defaults, are dropped; a non-default one is still refused."""
    from tether.resolve import load_config

    old = tmp_path / "config.yaml"
    old.write_text("recipe: atr_grpo\nalgo:\n  region: {kind: kl3, eps_low: 0.2, eps_high: 0.2, clip_c: 0.0, "
                   "delta: 0.03}\n")
    assert load_config(str(old)).algo.region.model_dump() == {"kind": "kl3", "delta": 0.03, "clip_c": 0.0}
    flat = {"algo.region.kind": "cispo", "algo.region.eps_low": 0.2, "algo.region.eps_high": 0.28,
            "algo.region.clip_c": 0.0, "algo.region.delta": 0.0, "algo.surrogate": "reinforce"}
    assert load_config(None, flat).algo.region.model_dump() == {"kind": "cispo", "eps_high": 0.28}
    with pytest.raises(ConfigError, match="algo.region.eps_low is a key of algo.region.kind=ratio"):
        load_config(None, {**flat, "algo.region.eps_low": 0.1})
    # the algorithms' own dataclass (tether.algo.RegionConfig) is read the same way
    assert AlgoConfig(region=RegionConfig("kl3", delta=0.03)).region.model_dump() == \
        {"kind": "kl3", "delta": 0.03, "clip_c": 0.0}


def test_a_user_region_keeps_every_bound_and_must_be_registered():
    c = AlgoConfig(region={"kind": "my_module:MyRegion", "delta": 0.2})
    assert type(c.region).__name__ == "OtherRegionConfig" and c.region.delta == 0.2 and c.region.eps_low == 0.2
    with pytest.raises(ConfigError, match="unknown trust region 'my_module:MyRegion'"):
        validate(c)


# ---------------------------------------------------------------- algo.anchor: a section per kind


def test_each_anchor_kind_holds_only_the_keys_it_reads():
    """Written out from tether.anchor: ema reads eta and every, reset every, kl_reset kappa and kl_smoothing, fixed
    its stored dtype; none and iterative nothing."""
    from tether.algo.anchors import ANCHOR_KINDS
    from tether.config.anchor import ANCHOR_SECTIONS

    reads = {"none": set(), "fixed": {"dtype"}, "ema": {"eta", "every"}, "iterative": set(), "reset": {"every"},
             "kl_reset": {"kappa", "kl_smoothing"}}
    assert set(ANCHOR_SECTIONS) == set(reads) == {"none", *ANCHOR_KINDS.names()}
    for kind, cls in ANCHOR_SECTIONS.items():
        assert set(cls.model_fields) - {"kind"} == reads[kind], kind


def test_an_earlier_release_s_anchor_with_every_key_still_loads(tmp_path):
    from tether.resolve import load_config

    old = tmp_path / "config.yaml"
    old.write_text("recipe: grpo\nalgo:\n  anchor: {kind: fixed, eta: 0.95, every: 10, kappa: 0.0, kl_smoothing: 0.9, "
                   "dtype: policy}\n")
    assert load_config(str(old)).algo.anchor.model_dump() == {"kind": "fixed", "dtype": "policy"}
    flat = {"algo.anchor.kind": "ema", "algo.anchor.eta": 0.9, "algo.anchor.every": 10, "algo.anchor.kappa": 0.0,
            "algo.anchor.kl_smoothing": 0.9, "algo.anchor.dtype": "policy"}
    assert load_config(None, flat, recipe_name="ema_pg").algo.anchor.model_dump() == \
        {"kind": "ema", "every": 10, "eta": 0.9}
    with pytest.raises(ConfigError, match="algo.anchor.kappa is a key of algo.anchor.kind=kl_reset"):
        load_config(None, {**flat, "algo.anchor.kappa": 0.3}, recipe_name="ema_pg")
    c = load_config(None, {"algo.anchor": "reset", "algo.anchor.every": 3}, recipe_name="grpo")
    assert c.algo.anchor.model_dump() == {"kind": "reset", "every": 3}


def test_an_old_default_bound_is_dropped_against_the_kind_an_earlier_source_chose(tmp_path):
    """The YAML file picks the kind by the shorthand (algo.region: kl3); an override then carries an earlier
    release's default bound the kind does not read: dropped, as within one source."""
    from tether.resolve import load_config

    f = tmp_path / "c.yaml"
    f.write_text("recipe: ema_pg\nalgo: {region: kl3, anchor: reset}\n")
    c = load_config(str(f), {"algo.region.delta": 0.03, "algo.region.eps_low": 0.2, "algo.anchor.eta": 0.95})
    assert c.algo.region.model_dump() == {"kind": "kl3", "delta": 0.03, "clip_c": 0.0}
    assert c.algo.anchor.model_dump() == {"kind": "reset", "every": 10}


@pytest.mark.parametrize("key,value,msg", [
    ("algo.anchor.eta", 1.0, "algo.anchor.eta must be in [0, 1), got 1.0"),
    ("algo.anchor.every", 0, "algo.anchor.every must be >= 1, got 0"),
    ("algo.region.eps_low", 1.0, "algo.region.eps_low must be in [0, 1), got 1.0"),
    ("algo.region.eps_high", -0.1, "algo.region.eps_high must be >= 0, got -0.1"),
    ("algo.region.clip_c", 0.5, "algo.region.clip_c must be > 1 or 0 (off), got 0.5"),
    ("algo.kl.topk", -1, "algo.kl.topk must be >= 0, got -1"),
    ("algo.kl.beta", -1e-3, "algo.kl.beta must be a finite number >= 0, got -0.001"),
    ("algo.kl.placement", "los", "unknown algo.kl.placement 'los'. Did you mean 'loss'? Valid choices: loss, reward, "
                                 "advantage"),
])
def test_algo_keys_are_typed(key, value, msg):
    """The algorithm's ranges and fixed choices are declared with its keys (the anchor's, the region's and the KL
    term's sections): a value outside them is refused as it is set, naming the key."""
    with pytest.raises(ConfigError) as e:
        load_config(None, {key: value}, recipe_name="ema_pg")
    assert str(e.value) == f"override: {msg}"


def test_anchor_dtype_is_a_choice():
    with pytest.raises(ConfigError, match=r"unknown algo.anchor.dtype 'fp16'.* Valid choices: policy, bfloat16$"):
        load_config(None, {"algo.anchor.dtype": "fp16"}, recipe_name="grpo")


@pytest.mark.parametrize("kl,msg", [
    (dict(estimator="k3", beta=0.1, placement="advantage"), "needs kl.estimator rpg_rkl or rpg_urkl"),
    (dict(estimator="topk_fwd_centered", beta=0.1, truncated=True), "use 'topk_fwd'"),
    (dict(estimator="topk_rev", beta=0.1, truncated=True, s_min=0.5), "which kl.truncated=true drops"),
    (dict(estimator="topk_rev", beta=0.0), "needs kl.beta > 0"),
])
def test_the_kl_terms_own_rules_are_its_sections(kl, msg, tmp_path):
    """A rule joining keys of algo.kl is the section's validator: refused as the section is built in Python, and in
    a config, once, under the source that set the section's keys (an override; a file: named)."""
    with pytest.raises(ValueError, match=msg):
        kl_config(**kl)
    with pytest.raises(ConfigError, match=f"^override: kl.*{msg}"):
        load_config(None, {f"algo.kl.{k}": v for k, v in kl.items()}, recipe_name="ema_pg")
    f = tmp_path / "c.yaml"
    f.write_text("algo:\n  kl:\n" + "".join(f"    {k}: {v}\n" for k, v in kl.items()))
    with pytest.raises(ConfigError, match=f"^{f}: kl.*{msg}"):
        load_config(f, {}, recipe_name="ema_pg")
    assert validate(AlgoConfig(kl=kl_config("rpg_urkl", beta=0.1, placement="advantage"), anchor=FixedAnchorConfig(),
                               surrogate="reinforce"))
