"""Named recipes and config validation: every recipe is complete; bad combinations are clear errors."""

import pytest

from tether.algo import RegionConfig
from tether.config.recipes import RECIPES, AlgoConfig, AnchorConfig, KLConfig, recipe, validate
from tether.errors import ConfigError

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


@pytest.mark.parametrize("mutate,msg", [
    (lambda c: setattr(c.anchor, "kind", "none"), "needs an anchor; choose anchor.kind from"),
    (lambda c: setattr(c.kl, "estimator", "topk_ref"), "Did you mean 'topk_rev'"),
    (lambda c: setattr(c.kl, "beta", 0.0), "needs kl.beta > 0"),
    (lambda c: setattr(c.region, "delta", 0.1), "region.delta has no effect with trust region 'ratio'"),
    (lambda c: setattr(c, "advantage", "gae"), "unknown advantage 'gae'"),
    (lambda c: setattr(c.anchor, "kappa", 0.3), "anchor.kappa has no effect with anchor 'ema'"),
    (lambda c: setattr(c.kl, "placement", "advantage"), "needs kl.estimator rpg_rkl or rpg_urkl"),
    (lambda c: (setattr(c.kl, "estimator", "topk_rev_centered"), setattr(c.kl, "truncated", True)),
     "use 'topk_rev'"),
    (lambda c: (setattr(c.kl, "truncated", True), setattr(c.kl, "s_max", 2.0)), "which kl.truncated=true drops"),
    (lambda c: (setattr(c, "advantage", "rloo"), setattr(c, "adv_eps", 1e-3)), "adv_eps has no effect"),
])
def test_bad_combinations_are_errors(mutate, msg):
    c = recipe("ema_pg")
    mutate(c)
    with pytest.raises(ConfigError, match=msg):
        validate(c)


def test_ineffective_options_without_kl():
    c = recipe("dapo")
    c.kl.beta = 0.1
    with pytest.raises(ConfigError, match="kl.beta is set but kl.estimator is 'none'"):
        validate(c)
    c = recipe("dapo")
    c.anchor = AnchorConfig("ema")
    with pytest.raises(ConfigError, match="has no effect without a KL term"):
        validate(c)
    c = recipe("grpo")
    c.kl.topk = 8
    with pytest.raises(ConfigError, match="only applies to top-k"):
        validate(c)


def test_region_surrogate_compatibility():
    c = AlgoConfig(surrogate="ratio", region=RegionConfig("cispo"))
    with pytest.raises(ConfigError, match="defined for surrogate 'reinforce'"):
        validate(c)
    with pytest.raises(ConfigError, match="needs region.clip_c > 1"):
        validate(AlgoConfig(region=RegionConfig("dual")))
    with pytest.raises(ConfigError, match="needs region.delta > 0"):
        validate(AlgoConfig(region=RegionConfig("kl3")))


def test_every_registered_estimator_validates_with_an_anchor():
    from tether.algo import KL_ESTIMATORS
    for est in KL_ESTIMATORS:
        validate(AlgoConfig(kl=KLConfig(est, beta=0.01), anchor=AnchorConfig("fixed")))


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
