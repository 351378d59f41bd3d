"""Edge faults through the real CLI (``python -m tether`` in a subprocess): YAML files that are no
config tree (a recursive alias, a duplicate key), `tether plot --out` paths, a resume whose
metrics.jsonl is a directory, and a reward that kills its worker process on every call.

Each case ends as one ``tether: error:`` line and exit code 2 (tests/test_errors.py), or, for the
reward, as a run that finishes with the failed calls counted in reward_errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import DIGITS, FAULTS, assert_clean_error, cli_args, rows, run_module

pytestmark = pytest.mark.faults


# ---------------------------------------------------------------- YAML files that are no config tree


def test_recursive_alias_in_a_config_file_is_one_error_line(tmp_path):
    """`train: &t {steps: 2, more: *t}` was a RecursionError traceback (config.flatten)."""
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
    from tether.config import flatten
    from tether.resolve import read_yaml_mapping

    f = tmp_path / "merge.yaml"
    f.write_text("x: &b {steps: 2, lr: 1.0e-3}\ny: {<<: *b, steps: 5}\n")
    assert read_yaml_mapping(f) == {"x": {"steps": 2, "lr": 1e-3}, "y": {"steps": 5, "lr": 1e-3}}
    f.write_text("train: {steps: 2}\neval: {limit: 2}\n")
    assert flatten(read_yaml_mapping(f)) == {"train.steps": 2, "eval.limit": 2}


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


# ---------------------------------------------------------------- tether plot --out


def _metrics_run(d: Path) -> Path:
    """A run directory with two metrics rows: all `tether plot` needs."""
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 0.1 * s, "kl": 0.01 * s}) + "\n"
                                             for s in (1, 2, 3)))
    return d


def _unwritable_outs(t: Path) -> list[Path]:
    """Paths that cannot be written even by root (tests may run as root, which chmod does not stop):
    under a regular file, and under /proc."""
    (t / "a_file").write_text("not a directory")
    outs = [t / "a_file" / "curves.png", t / "a_file" / "sub" / "curves.png"]
    if Path("/proc/self").is_dir():
        outs += [Path("/proc/tether-test-curves.png"), Path("/proc/self/no_such_dir/curves.png")]
    return outs


@pytest.mark.slow  # about 13 s: out of the default suite's 15 minutes, run by CI's slow step
def test_plot_to_an_unwritable_path_is_one_error_line(tmp_path):
    run = _metrics_run(tmp_path / "run")
    for out in _unwritable_outs(tmp_path):
        r = run_module("plot", run, "--out", out)
        assert_clean_error(r.returncode, r.stderr, f"cannot write the plot to {out}")
        assert r.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "run"]  # no temporary file left
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


@pytest.mark.slow  # about 18 s: out of the default suite's 15 minutes, run by CI's slow step
def test_plot_prints_the_path_it_wrote(tmp_path):
    """`--out DIR` wrote DIR.png (matplotlib adds the suffix) but printed DIR; an existing directory
    gets curves.png inside it; the printed path is always the file written, and it is an image."""
    run = _metrics_run(tmp_path / "run")
    (tmp_path / "existing").mkdir()
    cases = [(tmp_path / "cmp", tmp_path / "cmp.png"),
             (tmp_path / "existing", tmp_path / "existing" / "curves.png"),
             (f"{tmp_path / 'new_dir'}/", tmp_path / "new_dir" / "curves.png"),
             (tmp_path / "sub" / "cmp.png", tmp_path / "sub" / "cmp.png"),
             (tmp_path / "cmp.svg", tmp_path / "cmp.svg")]
    for out, written in cases:
        r = run_module("plot", run, "--out", out)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert r.stdout.strip() == str(written), (out, r.stdout)
        head = written.read_bytes()[:256]
        assert head.startswith(b"\x89PNG") if written.suffix == ".png" else b"<svg" in head
    assert not (tmp_path / "existing.png").exists()
    r = run_module("plot", run)  # the default: RUN/curves.png
    assert r.returncode == 0 and r.stdout.strip() == str(run / "curves.png")
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------- a tiny run through the CLI


REWARDS = DIGITS + '''
import os

def _called():
    with open(os.environ["TETHER_TEST_CALLS"], "a") as f:
        f.write(f"{os.getpid()}\\n")

def kill_own_worker(completion, example):
    """Dies as a segfault would: SIGKILL to its own process (the reward worker)."""
    _called()
    os.kill(os.getpid(), 9)

def exit_on_x(completion, example):
    """os._exit(1) when the response says "x", else 1.0."""
    _called()
    if completion == "x":
        os._exit(1)
    return 1.0
'''


@pytest.fixture(scope="module")
def work(make_workdir):
    return make_workdir("faults_edges", REWARDS)


@pytest.mark.slow  # about 23 s: out of the default suite's 15 minutes, run by CI's slow step
def test_resume_when_metrics_jsonl_is_a_directory(work, tiny_model_dir, tmp_path):
    """`--resume` trims metrics.jsonl to the checkpoint's step; a directory there was an
    IsADirectoryError traceback. Now: one error naming the path, exit 2; the checkpoints are
    untouched, and once the directory is moved away the resume completes."""
    run = tmp_path / "run"
    r = run_module(*cli_args(work, tiny_model_dir, run, 2, **FAULTS))
    assert r.returncode == 0, r.stderr
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    r = run_module("train", "--resume", run, "train.steps=3")
    assert_clean_error(r.returncode, r.stderr, f"{run / 'metrics.jsonl'} is a directory")
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step-000001", "step-000002"]
    assert not (run / ".lock").exists()
    r = run_module("plot", run)
    assert_clean_error(r.returncode, r.stderr, f"{run / 'metrics.jsonl'} is a directory")
    (run / "metrics.jsonl").rename(tmp_path / "moved_away")
    r = run_module("train", "--resume", run, "train.steps=3")
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in rows(run)] == [3]


# ---------------------------------------------------------------- a reward that kills its worker


CRASH_WARNING = "the reward worker process died during a call"
GAVE_UP_WARNING = "it is not restarted again"


@pytest.mark.slow  # about 9 s: out of the default suite's 15 minutes, run by CI's slow step
def test_reward_that_kills_its_worker_stops_being_restarted(work, tiny_model_dir, tmp_path):
    """Every call SIGKILLs the reward worker: it was restarted for each of the run's 8 calls. Now one
    warning at the first crash, one when it gives up after 3 in a row (2 restarts); the other calls
    score 0 unmade and count in reward_errors, and the run finishes."""
    run, calls = tmp_path / "run", tmp_path / "calls.txt"
    r = run_module(*cli_args(work, tiny_model_dir, run, 2, reward="kill_own_worker", **{**FAULTS, "run.save_every": 0}),
                   env={"TETHER_TEST_CALLS": str(calls)})
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("tether: warning:")]
    assert sum(CRASH_WARNING in w for w in warnings) == 1, r.stderr
    assert sum(GAVE_UP_WARNING in w for w in warnings) == 1, r.stderr
    pids = calls.read_text().split()
    assert len(pids) == 3 and len(set(pids)) == 3  # three calls made, each in its own worker: 2 restarts
    assert [(row["step"], row["reward_errors"]) for row in rows(run)] == [(1, 4), (2, 8)]
    assert all(row["reward_mean"] == 0 for row in rows(run))
    log = (run / "reward_errors.log").read_text()
    assert "the reward worker process died" in log


@pytest.mark.slow  # about 10 s: out of the default suite's 15 minutes, run by CI's slow step
def test_reward_worker_counts_crashes_in_a_row(work, tmp_path, monkeypatch):
    """The API under the trainer: a call that returns ends a row of crashes; 3 in a row end the restarts
    for good; a warning at the first crash and one at giving up, never one per call."""
    from tether.tasks.base import Example
    from tether.tasks.reward_worker import RewardWorker

    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("TETHER_TEST_CALLS", str(calls))
    said = []
    w = RewardWorker(f"{work / 'rew.py'}:exit_on_x", timeout=60, warn=said.append)
    try:
        ex = [Example(prompt="p", answer="1", id=str(i)) for i in range(8)]
        rewards, _, failures = w.score(["x", "ok", "x", "x", "ok", "x", "x", "ok"], ex)
        assert rewards == [0, 1, 0, 0, 1, 0, 0, 1] and [f.example_id for f in failures] == ["0", "2", "3", "5", "6"]
        assert w.crashes == 5 and w.restarts == 5 and not w.gave_up and len(said) == 1 and "exit code 1" in said[0]
        rewards, _, failures = w.score(["x", "x", "x", "ok", "ok"], ex[:5])
        assert w.gave_up and w.crashes == 8 and w.restarts == 7 and len(said) == 2 and "3 calls in a row" in said[1]
        assert rewards == [0] * 5 and all(f.kind == "crashed" for f in failures) and len(failures) == 5
        assert "not scored" in failures[-1].detail
        n_calls = len(calls.read_text().split())
        assert w.score(["ok"] * 4, ex[:4])[0] == [0] * 4 and len(said) == 2
        assert len(calls.read_text().split()) == n_calls == 11  # no call was made after giving up
    finally:
        w.close()


def test_plot_smooth_and_serve_topk_are_checked(tmp_path, capsys):
    """--smooth 0 or -3 (a moving-average window) and retrieve serve's --topk above --topk-max are refused by
    name, exit 2 (both were accepted)."""
    from tether.cli import main

    run = _metrics_run(tmp_path / "run")
    for bad in ("0", "-3"):
        with pytest.raises(SystemExit) as e:
            main(["plot", str(run), "--smooth", bad])
        assert e.value.code == 2 and f"argument --smooth: must be >= 1, got {bad}" in capsys.readouterr().err
    assert main(["retrieve", "serve", "--corpus", str(tmp_path / "c.jsonl"), "--topk", "10", "--topk-max", "5"]) == 2
    assert capsys.readouterr().err.strip() == "tether: error: --topk 10 (the default per request) is above --topk-max 5"
