"""Edge faults through the real CLI (``python -m tether`` in a subprocess): YAML files that are no
config tree (a recursive alias, a duplicate key), `tether plot --out` paths, a resume whose
metrics.jsonl is a directory, and a reward that kills its worker process on every call.

Each case ends as one ``tether: error:`` line and exit code 2 (tests/test_errors.py), or, for the
reward, as a run that finishes with the failed calls counted in reward_errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from test_errors import assert_clean_error, run_module

pytestmark = pytest.mark.faults


# ---------------------------------------------------------------- YAML files that are no config tree


def test_recursive_alias_in_a_config_file_is_one_error_line(tmp_path):
    """`train: &t {steps: 2, more: *t}` was a RecursionError traceback (config._flatten)."""
    f = tmp_path / "rec.yaml"
    f.write_text("model:\n  dtype: float32\ntrain: &t {steps: 2, more: *t}\n")
    run = tmp_path / "run"
    for argv in (["train", "--config", f, "--model", tmp_path / "nope", "--output-dir", run],
                 ["config", "--config", f]):
        r = run_module(*argv)
        assert_clean_error(r.returncode, r.stderr, f"config file {f} line 3", "'train.more'", "recursive alias")
        assert r.stdout == ""
    assert not run.exists()


DUPLICATES = [  # (file text, the dotted key, its line, the first line)
    ("train:\n  steps: 2\n  lr: 1.0e-3\n  steps: 3\n", "train.steps", 4, 2),
    ("train:\n  steps: 2\neval:\n  limit: 3\ntrain:\n  lr: 1.0e-3\n", "train", 5, 1),
    ("algo:\n  kl:\n    beta: 0.1\n    estimator: k3\n    beta: 0.2\n", "algo.kl.beta", 5, 3),
    ("data: {limit: 3, limit: 4}\n", "data.limit", 1, 1),
]


@pytest.mark.parametrize("text,key,line,first", DUPLICATES, ids=[d[1] for d in DUPLICATES])
def test_duplicate_yaml_key_is_refused(text, key, line, first, tmp_path):
    """YAML keeps the last of two equal keys without a word; tether refuses them, at any depth."""
    f = tmp_path / "dup.yaml"
    f.write_text(text)
    r = run_module("config", "--config", f)
    assert_clean_error(r.returncode, r.stderr, f"config file {f} line {line}: duplicate key {key!r}",
                       f"first at line {first}")


def test_merge_keys_may_still_be_overridden(tmp_path):
    """`<<: *base` then a key of base is YAML's override, not a duplicate."""
    from tether.config import _flatten, read_yaml_mapping

    f = tmp_path / "merge.yaml"
    f.write_text("x: &b {steps: 2, lr: 1.0e-3}\ny: {<<: *b, steps: 5}\n")
    assert read_yaml_mapping(f) == {"x": {"steps": 2, "lr": 1e-3}, "y": {"steps": 5, "lr": 1e-3}}
    f.write_text("train: {steps: 2}\neval: {limit: 2}\n")
    assert _flatten(read_yaml_mapping(f)) == {"train.steps": 2, "eval.limit": 2}


def test_duplicate_key_in_a_run_config_blocks_resume_with_its_line(tmp_path):
    """A run's config.yaml goes through the same reader on --resume (and tether eval / export)."""
    run = tmp_path / "run"
    ck = run / "checkpoints" / "step-000001"
    ck.mkdir(parents=True)
    (ck / "state.json").write_text('{"step": 1}')
    (run / "config.yaml").write_text("recipe: grpo\ntrain:\n  steps: 2\n  steps: 4\n")
    r = run_module("train", "--resume", run)
    assert_clean_error(r.returncode, r.stderr, f"cannot resume {run}", f"{run / 'config.yaml'} line 4",
                       "duplicate key 'train.steps'")
