"""A sweep's spec: the YAML grid of ``tether sweep SPEC.yaml``, read, checked, and laid out as runs.

A spec (docs/sweeps.md; configs/sweeps/example.yaml) has these top-level keys and no others:

``base`` (mapping, optional)
    What every run starts from, as ``tether train`` takes it: ``config`` (a YAML config file, =
    ``--config``; a relative path is relative to the directory ``tether sweep`` runs in, as for
    ``tether train``), ``recipe`` (= ``--recipe``), ``task`` (= ``--task``) and ``overrides`` (a
    mapping of config keys, dotted (``train.lr: 1e-5``) or nested (``train: {lr: 1e-5}``)).
``axes`` (mapping, optional)
    Each axis is a name and its variants; the arms are the cartesian product of the axes (one
    variant of each). A variant is a mapping of overrides (``recipe`` may be one of its keys).
    Two shorthands: an axis named ``recipe`` may list recipe names (``recipe: [grpo, ema_pg]``),
    and an axis named by a dotted config key may list its values (``train.lr: [1e-6, 1e-5]``: the
    variants are named ``lr=1.0e-06`` and ``lr=1.0e-05``). An arm's name joins its variants' names with
    ``+`` in the axes order (``grpo+lr=1.0e-06``). Two axes may not set the same key.
``arms`` (mapping, optional)
    Extra arms, each a name and its overrides on top of ``base`` (not crossed with the axes).
    Without axes and arms there is one arm, ``base``.
``seeds`` (required)
    A count ``n`` (seeds 0 .. n-1) or a list of distinct integers >= 0. Each seed sets
    ``train.seed`` (data order, sampling, initialization), so the runs of two arms with the same
    seed see the same prompts in the same order from the same initial weights.
``metric`` (string, optional)
    The metric ``tether sweep report`` compares by default, e.g. ``eval/arithmetic/avg@1``
    (default: the first ``eval/<benchmark>/avg@<n>`` the runs logged, else ``reward_mean``).
``name`` (string, optional)
    A title for the report.

The sweep sets ``train.seed``, ``run.output_dir`` and ``run.overwrite`` itself, and a spec that sets one is
refused; it also sets ``run.progress=false`` last (the sweep shows its own progress). Every arm's config
is resolved with `tether.resolve.load_config` (the function ``tether train`` and ``tether config`` use)
before any run starts, and every problem of every arm is reported at once, naming the spec key it came
from.
"""

from __future__ import annotations

import difflib
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from ..errors import ConfigError
from ..userio import loads_yaml

#: the spec's top-level keys and ``base``'s keys: each is described in this module's docstring (docs/sweeps.md)
TOP_KEYS = ("base", "axes", "arms", "seeds", "metric", "name")
BASE_KEYS = ("config", "recipe", "task", "overrides")
#: keys the sweep sets for every run (seed and run directory); a spec may not set them
OWNED_KEYS = ("train.seed", "run.output_dir", "run.overwrite")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=@-]*$")


@dataclass
class Arm:
    """One arm: its name, its overrides (on top of ``base``; ``recipe`` may be among them) and, for each
    override key, the spec key that set it (``axes.lr.small``, ``arms.mine``, ``base.overrides``)."""

    name: str
    overrides: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)


@dataclass
class Spec:
    """A checked spec: ``base`` (config / recipe / task / overrides), the arms in order, the seeds."""

    path: str
    base_config: Optional[str]
    base_recipe: Optional[str]
    base_task: Optional[str]
    base_overrides: dict[str, Any]
    arms: list[Arm]
    seeds: list[int]
    metric: Optional[str] = None
    name: Optional[str] = None

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)

    def overrides(self, arm: Arm, seed: int) -> dict[str, Any]:
        """The overrides of run (``arm``, ``seed``): base, then the arm's, then ``train.seed``."""
        out = {**self.base_overrides, **arm.overrides, "train.seed": seed}
        if self.base_recipe and "recipe" not in arm.overrides:
            out.setdefault("recipe", self.base_recipe)
        return out

    def train_args(self, arm: Arm, seed: int) -> list[str]:
        """The ``tether train`` arguments of run (``arm``, ``seed``), without its run directory."""
        args = (["--config", self.base_config] if self.base_config else []) + (
            ["--task", self.base_task] if self.base_task else [])
        return args + [f"{k}={override_text(v)}" for k, v in self.overrides(arm, seed).items()]

    def runs(self) -> list[tuple[str, int]]:
        """Every (arm, seed), sorted: the order shards deal from."""
        return sorted((a.name, s) for a in self.arms for s in self.seeds)

    def fingerprint(self) -> dict:
        """What makes each arm's runs what they are (compared when a sweep goes on in an existing DIR)."""
        return {"base": {"config": self.base_config, "recipe": self.base_recipe, "task": self.base_task,
                         "overrides": self.base_overrides},
                "arms": {a.name: a.overrides for a in self.arms}}


def override_text(value: Any) -> str:
    """``value`` as the text after ``key=`` on a ``tether train`` command line: YAML in flow style, which
    `tether.config.parse_overrides` reads back to the same value (checked)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, allow_unicode=True)
    text = text[: -len("\n...\n")] if text.endswith("\n...\n") else text.rstrip("\n")
    if loads_yaml(text, "value") != value:  # pragma: no cover (safe_dump round-trips what safe_load gave)
        raise ConfigError(f"cannot pass {value!r} on a command line")
    return text


def _unknown(where: str, key: str, valid) -> str:
    close = difflib.get_close_matches(str(key), list(valid), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{where}: unknown key {key!r}.{hint} Valid keys: {', '.join(valid)}"


def _mapping(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
    return value


def _overrides(value, where: str) -> dict[str, Any]:
    """A mapping of config keys (dotted or nested) as flat dotted keys; ``recipe`` stays a key."""
    from ..config.overrides import flatten  # deferred: pulls in torch

    flat = flatten({str(k): v for k, v in _mapping(value, where).items()})
    owned = [k for k in flat if k in OWNED_KEYS]
    if owned:
        raise ConfigError(f"{where}: {owned[0]} is set by the sweep for every run (train.seed from `seeds`, the "
                          f"run directory under --out); remove it")
    return flat


def _name(name, where: str) -> str:
    name = str(name)
    if not _NAME.match(name):
        raise ConfigError(f"{where}: {name!r} cannot name an arm's directory: use letters, digits and _ . = @ - "
                          f"(no '+', '/' or spaces)")
    return name


def _axis(name: str, value) -> list[Arm]:
    """The variants of axis ``name`` as one-axis arms (name, overrides, sources)."""
    where = f"axes.{name}"
    if isinstance(value, list):  # the shorthands
        if not value:
            raise ConfigError(f"{where}: an empty list (an axis needs at least one variant)")
        if name == "recipe":
            return [Arm(_name(v, where), {"recipe": v}, {"recipe": where}) for v in value]
        if "." not in name:
            raise ConfigError(f"{where}: a list of values needs a dotted config key as the axis name (e.g. "
                              f"train.lr: [1e-6, 1e-5]) or `recipe`; else give named variants (a mapping)")
        _overrides({name: None}, where)  # refuses an owned key
        label = name.rsplit(".", 1)[1]
        return [Arm(_name(f"{label}={override_text(v)}", where), {name: v}, {name: where}) for v in value]
    variants = _mapping(value, where)
    if not variants:
        raise ConfigError(f"{where}: no variants")
    out = []
    for vname, over in variants.items():
        w = f"{where}.{vname}"
        flat = _overrides(over, w)
        out.append(Arm(_name(vname, w), flat, {k: w for k in flat}))
    return out


def _product(axes: dict) -> list[Arm]:
    per_axis = [_axis(str(n), v) for n, v in axes.items()]
    arms = []
    for combo in itertools.product(*per_axis):
        over: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for part in combo:
            for k, v in part.overrides.items():
                if k in over:
                    raise ConfigError(f"{sources[k]} and {part.sources[k]} both set {k}: two axes may not set the "
                                      f"same key (make them one axis, or an explicit arm under `arms`)")
                over[k], sources[k] = v, part.sources[k]
        arms.append(Arm("+".join(p.name for p in combo), over, sources))
    return arms


def _seeds(value) -> list[int]:
    if value is None:
        raise ConfigError("seeds: required: a count (seeds: 3 runs seeds 0, 1, 2) or a list (seeds: [0, 7])")
    if isinstance(value, bool):
        raise ConfigError(f"seeds: expected a count >= 1 or a non-empty list of integers >= 0, got "
                          f"{str(value).lower()} (a boolean)")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"seeds: a count must be >= 1, got {value}")
        return list(range(value))
    if isinstance(value, list) and value and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                 for s in value):
        if len(set(value)) != len(value):
            raise ConfigError(f"seeds: {value} lists a seed twice")
        return list(value)
    raise ConfigError(f"seeds: expected a count >= 1 or a non-empty list of integers >= 0, got {value!r}")


def parse_spec(raw: dict, path: str = "spec") -> Spec:
    """A `Spec` from the spec's top-level mapping; raises ConfigError naming the key at fault."""
    for k in raw:
        if k not in TOP_KEYS:
            raise ConfigError(_unknown(path, k, TOP_KEYS))
    base = _mapping(raw.get("base"), "base")
    for k in base:
        if k not in BASE_KEYS:
            raise ConfigError(_unknown("base", k, BASE_KEYS))
    config = base.get("config")
    if config is not None and not Path(str(config)).is_file():
        raise ConfigError(f"base.config: {config} is not a file")
    arms = _product(_mapping(raw.get("axes"), "axes")) if raw.get("axes") else []
    for name, over in _mapping(raw.get("arms"), "arms").items():
        w = f"arms.{name}"
        flat = _overrides(over, w)
        if any(a.name == str(name) for a in arms):
            raise ConfigError(f"{w}: an arm of the axes already has the name {name!r}")
        arms.append(Arm(_name(name, w), flat, {k: w for k in flat}))
    if not arms:
        arms = [Arm("base", {})]
    for key in ("metric", "name"):
        if raw.get(key) is not None and not isinstance(raw[key], str):
            raise ConfigError(f"{key}: expected a string, got {raw[key]!r}")
    return Spec(path=path, base_config=str(config) if config is not None else None,
                base_recipe=base.get("recipe"), base_task=base.get("task"),
                base_overrides=_overrides(base.get("overrides"), "base.overrides"), arms=arms,
                seeds=_seeds(raw.get("seeds")), metric=raw.get("metric"), name=raw.get("name"))


def load_spec(path: str | Path) -> Spec:
    """Read spec file ``path`` and check its keys (`parse_spec`); `check_arms` then resolves its arms."""
    from ..resolve import read_yaml_mapping  # deferred: pulls in torch

    return parse_spec(read_yaml_mapping(path), str(path))


def check_arms(spec: Spec) -> dict:
    """Resolve every arm's config (at the first seed) with `tether.resolve.load_config`, as ``tether train``
    would; every problem of every arm at once in one ConfigError, each naming the arm and the spec keys that
    set its overrides. Returns arm name -> its resolved `tether.config.Config`."""
    from ..resolve import load_config  # deferred: pulls in torch

    problems, configs = [], {}
    for arm in spec.arms:
        try:
            configs[arm.name] = load_config(spec.base_config, spec.overrides(arm, spec.seeds[0]),
                                            recipe_name=None, task=spec.base_task)
        except ConfigError as e:
            text = " ".join(str(e).split())
            named = sorted({src for k, src in arm.sources.items() if k in text}) or sorted(set(arm.sources.values()))
            problems.append(f"  - arm {arm.name!r} ({', '.join(named) or 'base'}): {text}")
    if problems:
        raise ConfigError(f"{spec.path}: {len(problems)} of {len(spec.arms)} arm(s) do not resolve; no run was "
                          f"started:\n" + "\n".join(problems))
    return configs


def parse_shard(text: Optional[str]) -> tuple[int, int]:
    """``"i/n"`` -> (i, n) with 1 <= i <= n; None -> (1, 1)."""
    if text is None:
        return 1, 1
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ConfigError(f"--shard {text}: expected i/n with 1 <= i <= n (e.g. --shard 2/4)")
    return int(m.group(1)), int(m.group(2))


def shard(runs: list, i: int, n: int) -> list:
    """The ``i``-th (1-based) of ``n`` round-robin shares of ``runs``: runs[i-1], runs[i-1+n], ..."""
    return runs[i - 1::n]


def parse_seed_list(text: str, flag: str = "--seeds", count: bool = True) -> list[int]:
    """``"10-19"``, ``"0,3,7"``, a mix of ranges and values, or (``count``) ``"5"`` for seeds 0..4 -> distinct seeds
    >= 0 (without ``count``, ``"5"`` is seed 5)."""
    text = str(text).strip()
    if count and re.fullmatch(r"\d+", text):
        return _seeds(int(text))
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ConfigError(f"{flag} {text}: expected a count (10), a range (10-19) or a list (0,3,7-9) of seeds "
                              f">= 0")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        out.extend(range(lo, hi + 1))
    if len(set(out)) != len(out):
        raise ConfigError(f"{flag} {text}: lists a seed twice")
    return out


def select(spec: Spec, seeds: Optional[str] = None, arms: Optional[str] = None) -> Spec:
    """``spec`` with its seeds replaced (``--seeds``: a second, disjoint set for a replication) and its arms cut to
    ``arms`` (``--arms``: a comma list of arm names; an unknown name is a ConfigError listing the arms)."""
    if seeds is not None:
        spec.seeds = parse_seed_list(seeds)
    if arms is not None:
        names = [a.strip() for a in str(arms).split(",") if a.strip()]
        known = [a.name for a in spec.arms]
        bad = [n for n in names if n not in known]
        if bad or not names:
            close = difflib.get_close_matches(bad[0], known, n=1) if bad else []
            raise ConfigError(f"--arms: {'no arm named ' + repr(bad[0]) if bad else 'no arm given'}"
                              + (f" (did you mean {close[0]!r}?)" if close else "") + f"; the arms: {', '.join(known)}")
        spec.arms = [a for a in spec.arms if a.name in names]
    return spec
