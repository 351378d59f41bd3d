"""The results JSON: where it and the plot go, the key of a run, the runs of a recipe, and the
recipes, seeds and tasks a comparison made in parts covers."""

from __future__ import annotations

import math
from pathlib import Path


def paths_of(out: Path) -> tuple[Path, Path]:
    return out.with_suffix(".json"), out.with_name(out.stem + "_rewards.png")


def run_key(task: str, recipe: str, seed: int) -> str:
    return f"{task}/{recipe}/seed{seed}"


def runs_of(res: dict, task: str, recipe: str) -> list[dict]:
    return [res["runs"][run_key(task, recipe, s)] for s in res["settings"]["seeds"]
            if run_key(task, recipe, s) in res["runs"]]


def num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(float(x)) else None


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _union(first: list, then: list) -> list:
    """The distinct values of ``first`` then ``then``, in order."""
    return list(dict.fromkeys([*first, *then]))


def merged_lists(first: dict, then: dict) -> dict:
    """The recipes, seeds and tasks of ``first`` then ``then`` (distinct, in order; seeds sorted)."""
    return {"recipes": _union(first.get("recipes", []), then.get("recipes", [])),
            "seeds": sorted(set(first.get("seeds", [])) | set(then.get("seeds", []))),
            "tasks": _union(first.get("tasks", []), then.get("tasks", []))}


def reported(res: dict) -> dict:
    """``res`` with the recipes, seeds and tasks of every run it holds in its settings (in the order they ran,
    then the ones named but not run), so a comparison made in parts -- or by older versions of this script,
    which kept only the last command's lists -- reports all its runs."""
    runs = list(res.get("runs", {}).values())
    ran = {"recipes": [r["recipe"] for r in runs], "seeds": [r["seed"] for r in runs],
           "tasks": [r["task"] for r in runs]}  # every run record has all three (one_run, and failures)
    return {**res, "settings": {**res["settings"], **merged_lists(ran, res["settings"])}}

