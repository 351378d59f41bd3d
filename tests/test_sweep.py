"""tether sweep: the spec (keys, shorthands, errors before any run starts), real sweeps of tiny runs through
the CLI (2 arms x 2 seeds in 2 lanes, then the report; shards merged by the report; kill -9 and resume;
a failed run recorded and retried), and the report's statistics against hand-computed values on a
synthetic sweep."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import DIGITS, run_module, subprocess_env, tiny_settings
from tether.cli import main
from tether.config import parse_overrides
from tether.errors import ConfigError
from tether.sweep import layout
from tether.sweep.report import compute, write_report
from tether.sweep.results import collect
from tether.sweep.spec import check_arms, load_spec, override_text, parse_shard, parse_spec, shard

ROOT = Path(__file__).resolve().parents[1]
METRIC = "eval/arithmetic/avg@1"

#: a reward that takes 0.2 s per response: a run of 4 steps x 16 responses lasts long enough to be killed
SLOW = DIGITS + "\nimport time\n\ndef slow(completion, example):\n    time.sleep(0.2)\n    return digits(completion, " \
                "example)\n"


@pytest.fixture(scope="module")
def work(make_workdir):
    return make_workdir("sweep", SLOW)


def base(work, model_dir, steps: int = 2, **over) -> dict:
    """A tiny run's overrides (tests/helpers.py) with a held-out evaluation (4 arithmetic problems) at every
    step, and a checkpoint at every step."""
    return {**tiny_settings(work, model_dir, steps), "eval.benchmarks": ["arithmetic"], "eval.limit": 4,
            "eval.every": 1, "eval.max_new_tokens": 8, "run.save_every": 1, **over}


def write_spec(path: Path, overrides: dict, **top) -> Path:
    path.write_text(yaml.safe_dump({"base": {"overrides": overrides}, **top}, sort_keys=False))
    return path


def sweep(*args, timeout: float = 300):
    return run_module("sweep", *args, timeout=timeout)


# ---------------------------------------------------------------- the spec


def test_spec_keys_shorthands_and_shards():
    spec = parse_spec({"base": {"recipe": "grpo", "overrides": {"train": {"steps": 3}}},
                       "axes": {"recipe": ["grpo", "ema_pg"], "train.lr": [1e-6, 1e-5]},
                       "arms": {"mine": {"algo.kl.beta": 0.01}}, "seeds": [0, 7]})
    assert [a.name for a in spec.arms] == ["grpo+lr=1.0e-06", "grpo+lr=1.0e-05", "ema_pg+lr=1.0e-06",
                                           "ema_pg+lr=1.0e-05", "mine"]
    assert spec.arm("ema_pg+lr=1.0e-05").overrides == {"recipe": "ema_pg", "train.lr": 1e-5}
    assert spec.overrides(spec.arm("mine"), 7) == {"train.steps": 3, "algo.kl.beta": 0.01, "train.seed": 7,
                                                   "recipe": "grpo"}
    runs = spec.runs()
    assert len(runs) == 10 and runs == sorted(runs)
    assert shard(runs, 1, 3) + shard(runs, 2, 3) + shard(runs, 3, 3) != runs  # round robin, not blocks
    assert sorted(shard(runs, 1, 3) + shard(runs, 2, 3) + shard(runs, 3, 3)) == runs
    assert shard(runs, 2, 3) == runs[1::3] and parse_shard("2/3") == (2, 3) and parse_shard(None) == (1, 1)
    assert parse_spec({"seeds": 2}).arms[0].name == "base"
    # every value goes through a command line unchanged
    for v in (1e-5, "ema_pg", ["arithmetic", "gsm8k"], True, "1e-5", {"a": 1}, "two words", None, 3, "yes", ""):
        assert parse_overrides([f"k={override_text(v)}"])["k"] == v


def test_a_sweep_recorded_with_the_flat_keys_goes_on_with_the_nested_ones(tmp_path):
    """A sweep directory whose sweep.json holds the earlier flat keys (train.max_staleness) accepts the same spec
    written with the nested ones (train.async): its finished runs are the same runs; another setting is refused."""
    old = {"spec": "s.yaml", "name": "n", "metric": METRIC, "seeds": [0],
           "base": {"config": None, "recipe": "ema_pg", "task": None, "overrides": {"train.steps": 2}},
           "arms": {"sync": {"train.max_staleness": 0}, "K1": {"train.max_staleness": 1},
                    "K4": {"train.max_staleness": 4, "train.async_correction": False}}}
    (tmp_path / "sweep.json").write_text(json.dumps(old))
    new = parse_spec({"base": {"recipe": "ema_pg", "overrides": {"train.steps": 2}}, "seeds": [0, 1],
                      "arms": {"sync": {"train.async": None}, "K1": {"train.async.max_staleness": 1},
                               "K4": {"train.async.max_staleness": 4, "train.async.correction": False}}})
    layout.write_sweep(tmp_path, new)
    assert layout.read_sweep(tmp_path)["arms"]["K4"] == {"train.async.max_staleness": 4,
                                                          "train.async.correction": False}
    other = parse_spec({"base": {"recipe": "ema_pg", "overrides": {"train.steps": 2}}, "seeds": [0],
                        "arms": {"K1": {"train.async.max_staleness": 2}}})
    with pytest.raises(ConfigError, match="arm 'K1' had overrides"):
        layout.write_sweep(tmp_path, other)


@pytest.mark.parametrize("raw, needle", [
    ({"seed": 2}, "unknown key 'seed'. Did you mean 'seeds'?"),
    ({"seeds": 2, "base": {"overides": {}}}, "base: unknown key 'overides'. Did you mean 'overrides'?"),
    ({"axes": {"recipe": ["grpo"]}}, "seeds: required"),
    ({"seeds": 0}, "seeds: a count must be >= 1"),
    ({"seeds": [1, 1]}, "lists a seed twice"),
    ({"seeds": 2, "base": {"overrides": {"train.seed": 3}}}, "base.overrides: train.seed is set by the sweep"),
    ({"seeds": 2, "axes": {"a": {"x": {"train.lr": 1}}, "b": {"y": {"train.lr": 2}}}},
     "axes.a.x and axes.b.y both set train.lr"),
    ({"seeds": 2, "axes": {"lr": [1, 2]}}, "a list of values needs a dotted config key"),
    ({"seeds": 2, "arms": {"a/b": {}}}, "cannot name an arm's directory"),
    ({"seeds": 2, "base": {"config": "/no/such.yaml"}}, "base.config: /no/such.yaml is not a file"),
])
def test_spec_errors_name_the_key(raw, needle):
    with pytest.raises(ConfigError) as e:
        parse_spec(raw)
    assert needle in str(e.value)


def test_a_bad_arm_is_refused_before_any_run(tmp_path, capsys):
    """Every arm resolves with load_config first: one bad override in one arm stops the sweep at once, with
    every bad arm named with the spec key that set it, and nothing is created."""
    spec = write_spec(tmp_path / "s.yaml", {"train.steps": 2},
                      axes={"lr": {"ok": {"train.lr": 1e-5}, "bad": {"train.lrr": 1e-5}},
                            "recipe": ["grpo", "ema_pg"]}, seeds=2)
    t0 = time.time()
    assert main(["sweep", str(spec), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "tether: error:" in err and "2 of 4 arm(s) do not resolve; no run was started" in err
    assert "arm 'bad+grpo' (axes.lr.bad)" in err and "arm 'bad+ema_pg' (axes.lr.bad)" in err
    assert "Did you mean 'train.lr'?" in err and "ok+" not in err
    assert not (tmp_path / "out").exists() and time.time() - t0 < 10
    # the same check in check_arms, for the library
    with pytest.raises(ConfigError, match="arm 'bad'"):
        check_arms(parse_spec({"seeds": 1, "arms": {"bad": {"algo.kl.beta": "much"}}}))


def test_example_spec_dry_run(capsys):
    assert main(["sweep", str(ROOT / "configs" / "sweeps" / "example.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "4 arm(s) x 3 seed(s) = 12 run(s)" in out
    assert "grpo+lr=1.0e-06 seed 2 [fresh]: tether train " in out and "recipe=grpo train.lr=1.0e-06" in out
    assert "train.seed=2 run.output_dir=DIR/runs/grpo+lr=1.0e-06/seed-2 run.progress=false" in out


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_specs_resolve(path):
    """Every spec under configs/sweeps (docs/evidence.md's among them) parses and every arm resolves to a valid
    config, so a renamed key or recipe fails here rather than in a sweep hours long; each has a metric and the
    seeds docs/evidence.md's comparisons need."""
    spec = load_spec(path)
    configs = check_arms(spec)
    assert len(configs) == len(spec.arms) >= 1
    assert spec.metric, f"{path.name}: no metric"
    if path.name.startswith("evidence_"):  # ten seeds an arm on the organism, five on SmolLM2 (hours a run)
        assert len(spec.seeds) >= (5 if "smollm2" in path.name else 10)
        assert all(c.run.save_every == 0 for c in configs.values())


def test_runs_get_one_thread():
    """A run's process has OMP_NUM_THREADS etc. = --threads, and torch (imported as tether train imports it)
    takes its thread count from it: tether sets none of its own."""
    from tether.sweep.runner import child_env

    env = child_env(1)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1" and env["TOKENIZERS_PARALLELISM"] == "false"
    r = subprocess.run([sys.executable, "-c", "import tether.train, torch; print(torch.get_num_threads())"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "1", r.stderr


# ---------------------------------------------------------------- real sweeps


@pytest.fixture(scope="module")
def swept(work, tiny_model_dir, tmp_path_factory):
    """2 arms (grpo, ema_pg) x 2 seeds of 2 steps, in 2 lanes, through the CLI in a subprocess."""
    d = tmp_path_factory.mktemp("swept")
    spec = write_spec(d / "spec.yaml", base(work, tiny_model_dir), axes={"recipe": ["grpo", "ema_pg"]}, seeds=2,
                      metric=METRIC, name="tiny")
    t0 = time.time()
    r = sweep(spec, "--out", d / "S", "--lanes", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    return d, spec, r, time.time() - t0


def test_sweep_end_to_end_and_report(swept, tmp_path, capsys):
    d, spec, r, _ = swept
    assert "4 to run in 2 lane(s) of 1 thread(s)" in r.stdout and "all 4 run(s) of this share are done" in r.stdout
    assert r.stdout.count("[done] ") == 4
    for arm in ("grpo", "ema_pg"):
        for s in (0, 1):
            rec = layout.read_record(d / "S", arm, s)
            assert rec["state"] == "done" and rec["returncode"] == 0 and rec["final"]["step"] == 2
            assert METRIC in rec["final"] and f"train.seed={s}" in rec["command"] and f"recipe={arm}" in rec["command"]
            cfg = yaml.safe_load((layout.run_dir(d / "S", arm, s) / "config.yaml").read_text())
            assert cfg["train"]["seed"] == s and cfg["recipe"] == arm and cfg["run"]["progress"] is False
    # same seed, same prompts and initial weights: the two arms' first rollouts are the same
    first = {arm: json.loads((layout.run_dir(d / "S", arm, 0) / "metrics.jsonl").read_text().splitlines()[1])
             for arm in ("grpo", "ema_pg")}
    assert first["grpo"]["step"] == 1 and first["grpo"]["reward_mean"] == first["ema_pg"]["reward_mean"]
    md = tmp_path / "rep" / "report.md"
    assert main(["sweep", "report", str(d / "S"), "--out", str(md), "--also", "reward_mean", "--last-n", "2"]) == 0
    text = md.read_text()
    assert f"### `{METRIC}` per arm" in text and "### `reward_mean` per arm" in text
    assert "| grpo | 2 |" in text and "| ema_pg | 2 |" in text and "| grpo | ema_pg |" in text
    assert "Evaluation noise (policy held fixed)" in text and "![learning curves](report.png)" in text
    assert md.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = json.loads(md.with_suffix(".json").read_text())["results"]
    assert res[0]["metric"] == METRIC and res[0]["bands"]["grpo"]["steps"] == [0.0, 1.0, 2.0]
    assert set(res[1]["arms"]["grpo"]["per_seed"]) == {"0", "1"}
    assert not (tmp_path / "rep" / "report-forest.png").exists()  # no baseline: every pair, no forest
    # against a baseline: the forest plot of the paired differences (rliable's interval estimates) beside it
    b = tmp_path / "rep" / "b.md"
    assert main(["sweep", "report", str(d / "S"), "--out", str(b), "--baseline", "grpo",
                 "--set", "first=0", "--set", "second=1"]) == 0
    forest = tmp_path / "rep" / "b-forest.png"
    assert forest.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and b"written by tether sweep report" in forest.read_bytes()
    assert "![paired differences](b-forest.png)" in b.read_text()


def test_at_most_six_curves_on_one_axis(monkeypatch, tmp_path):
    """Eight arms: the curves go to two panels of one row (six and two), each line its own colour there."""
    from tether.sweep import report

    figs = []
    monkeypatch.setattr(report, "_save", lambda fig, png: figs.append(fig))
    band = {"steps": [0.0, 1.0], "mean": [0.1, 0.2], "low": [0.0, 0.1], "high": [0.2, 0.3], "n": [2, 2]}
    report.plot([("m", {f"arm{i}": band for i in range(8)})], tmp_path / "x.png", "t")
    axes = [ax for ax in figs[0].axes if ax.lines]
    assert [len(ax.lines) for ax in axes] == [6, 2]
    colours = [ln.get_color() for ln in axes[0].lines]
    assert len(set(colours)) == 6


def test_a_learning_rate_grid_keeps_to_one_axis():
    """LoRA's layout: four grids of four learning rates; each grid gets its own axis (not six curves cut across
    two grids), arms without a learning rate pack six to an axis as before, and a grid over six is split."""
    from tether.sweep.report import curve_groups

    arms = [f"{r}_lr={lr}" for r in ("full", "r1", "r8", "r64") for lr in ("1e-05", "3e-05", "1e-04", "3e-04")]
    arms.append("full_lr=3e-06")  # added to the spec later: still drawn with its grid
    groups = curve_groups(arms)
    assert [sorted({g.split("_lr=")[0] for g in grp}) for grp in groups] == [["full"], ["r1"], ["r8"], ["r64"]]
    assert groups[0][0] == "full_lr=3e-06" and [len(g) for g in groups] == [5, 4, 4, 4]  # in lr order
    assert [len(g) for g in curve_groups([f"arm{i}" for i in range(8)])] == [6, 2]
    assert [len(g) for g in curve_groups([f"a+lr={i}" for i in range(8)] + ["b+lr=1", "b+lr=2"])] == [6, 4]


@pytest.mark.slow  # about 15 s: out of the default suite's 15 minutes, run by CI's slow step
def test_shards_into_two_dirs_report_as_one_sweep(swept, tmp_path):
    """--shard 1/2 and 2/2 into separate DIRs (run at once); the report over both equals the report of the
    unsharded sweep (the runs are deterministic on one CPU thread)."""
    d, spec, _, _ = swept
    procs = [subprocess.Popen([sys.executable, "-m", "tether", "sweep", str(spec), "--out", str(tmp_path / f"S{i}"),
                               "--shard", f"{i}/2", "--lanes", "1"], env=subprocess_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (1, 2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, out + err
    assert sorted(p.name for p in (tmp_path / "S1" / "runs").glob("*/seed-*.json")) == ["seed-0.json"] * 2
    assert sorted(p.name for p in (tmp_path / "S2" / "runs").glob("*/seed-*.json")) == ["seed-1.json"] * 2
    kw = dict(metric="reward_mean", extra_metrics=(METRIC,), last_n=2, reps=500)
    one = write_report([d / "S"], tmp_path / "one.md", **kw)
    two = write_report([tmp_path / "S1", tmp_path / "S2"], tmp_path / "two.md", **kw)
    results = [json.loads(p.with_suffix(".json").read_text())["results"] for p in (one, two)]
    assert results[0] == results[1]
    assert results[0][0]["arms"]["grpo"]["n"] == 2
    # the same run done in two DIRs is ambiguous
    from tether.errors import OutputError
    with pytest.raises(OutputError, match="is done in two directories"):
        collect([d / "S", tmp_path / "S1"])


@pytest.mark.slow  # 35 s: two runs, a kill, a resume
@pytest.mark.faults
def test_resume_after_kill_9(work, tiny_model_dir, tmp_path):
    """kill -9 of the sweep's process group once its first run is recorded done and the other has a
    checkpoint: its trainer dies with it (no lock left held), and the same command again leaves the done run
    untouched and resumes the other from its checkpoint; both end done."""
    over = base(work, tiny_model_dir, steps=4)
    spec = write_spec(tmp_path / "s.yaml", over, arms={"fast": {}, "slow": {"data.reward": f"{work / 'rew.py'}:slow"}},
                      seeds=[0])
    out = tmp_path / "S"
    cmd = [sys.executable, "-m", "tether", "sweep", str(spec), "--out", str(out), "--lanes", "2"]
    p = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    slow_ckpts = layout.run_dir(out, "slow", 0) / "checkpoints"
    try:
        deadline = time.time() + 240
        while not (layout.read_record(out, "fast", 0) and list(slow_ckpts.glob("step-??????/state.json"))):
            assert p.poll() is None and time.time() < deadline, "the sweep ended or stalled before the kill point"
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGKILL)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert layout.read_record(out, "slow", 0) is None  # killed mid-run: no record
    fast_rec, fast_metrics = layout.record_path(out, "fast", 0), layout.run_dir(out, "fast", 0) / "metrics.jsonl"
    before = (fast_rec.stat().st_mtime_ns, fast_metrics.stat().st_mtime_ns)
    r = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 done, 0 failed before (skipped), 1 to run" in r.stdout
    assert (fast_rec.stat().st_mtime_ns, fast_metrics.stat().st_mtime_ns) == before
    rec = layout.read_record(out, "slow", 0)
    assert rec["state"] == "done" and rec["action"] == "resume" and rec["command"].startswith("tether train --resume")
    rows = [json.loads(ln) for ln in (layout.run_dir(out, "slow", 0) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # each step once: resumed, not restarted or repeated


@pytest.mark.slow  # about 15 s: out of the default suite's 15 minutes, run by CI's slow step
def test_failed_run_is_recorded_and_retried(work, tiny_model_dir, tmp_path, capsys):
    """A run that fails is recorded with its exit status and stderr tail, the sweep exits 1 and the report
    lists it; the next sweep skips it; --retry-failed runs it again."""
    (tmp_path / "rew.py").write_text(DIGITS)  # no function `later` yet
    spec = write_spec(tmp_path / "s.yaml", base(work, tiny_model_dir, **{"data.reward": f"{tmp_path}/rew.py:later"}),
                      seeds=1)
    out = tmp_path / "S"
    r = sweep(spec, "--out", out, "--lanes", "1")
    assert r.returncode == 1 and "[FAILED] base seed 0: exited with status 2" in r.stdout, r.stdout
    rec = layout.read_record(out, "base", 0)
    assert rec["state"] == "failed" and "tether: error:" in rec["stderr_tail"] and "later" in rec["stderr_tail"]
    md = write_report([out], tmp_path / "r.md", metric="reward_mean", reps=100)
    assert "**failed**: base seed 0" in md.read_text() and "later" in md.read_text()
    (tmp_path / "rew.py").write_text(DIGITS + "\nlater = digits\n")
    assert main(["sweep", str(spec), "--out", str(out), "--dry-run"]) == 0
    assert "base seed 0 [failed]" in capsys.readouterr().out  # skipped from now on
    assert main(["sweep", str(spec), "--out", str(out), "--dry-run", "--retry-failed"]) == 0
    assert "base seed 0 [fresh]" in capsys.readouterr().out
    r = sweep(spec, "--out", out, "--lanes", "1", "--retry-failed")
    assert r.returncode == 0, r.stdout + r.stderr
    assert layout.read_record(out, "base", 0)["state"] == "done"


# ---------------------------------------------------------------- the statistics, by hand

STEPS = (0, 2, 10)
CURVES = {("A", 0): (0.2, 0.4, 0.6), ("A", 1): (0.3, 0.5, 0.5), ("A", 2): (0.2, 0.3, 0.7),
          ("B", 0): (0.2, 0.3, 0.4), ("B", 1): (0.3, 0.2, 0.25), ("B", 2): (0.2, 0.3, 0.7)}


def _synthetic(d: Path) -> Path:
    """Two arms x seeds 0-2 written by hand (eval at steps 0, 2, 10; reward_mean = step / 10 at steps 1-10);
    A seed 1 logged a NaN loss, A seed 3 failed, B seed 3 never ran."""
    (d / "sweep.json").write_text(json.dumps({"spec": "hand", "name": "synthetic", "metric": "eval/x/avg@1",
                                              "seeds": [0, 1, 2, 3], "base": {},
                                              "arms": {"A": {"recipe": "grpo"}, "B": {"recipe": "ema_pg"}}}))
    for (arm, s), ys in CURVES.items():
        evals = dict(zip(STEPS, ys))
        rows = [{"step": 0, "eval/x/avg@1": evals[0], "eval/x/n_problems": 100}]
        for t in range(1, 11):
            row = {"step": t, "reward_mean": t / 10, "pg_loss": "nan" if (arm, s, t) == ("A", 1, 5) else 0.1,
                   "grad_norm": 1.0}
            if t in evals:
                row.update({"eval/x/avg@1": evals[t], "eval/x/n_problems": 100})
            rows.append(row)
        rd = layout.run_dir(d, arm, s)
        rd.mkdir(parents=True)
        (rd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        layout.write_record(d, arm, s, {"state": "done", "arm": arm, "seed": s})
    layout.write_record(d, "A", 3, {"state": "failed", "error": "exited with status 1",
                                    "stderr_tail": "Traceback ...\nRuntimeError: boom"})
    return d


def test_report_statistics_by_hand(tmp_path):
    col = collect([_synthetic(tmp_path)])
    res = compute(col, "eval/x/avg@1", reps=1000, seed=0)
    a, b = res["arms"]["A"], res["arms"]["B"]
    # finals: A 0.6, 0.5, 0.7; B 0.4, 0.25, 0.7
    assert a["per_seed"] == {0: 0.6, 1: 0.5, 2: 0.7} and a["n"] == 3
    assert a["mean"] == pytest.approx(0.6) and a["sd"] == pytest.approx(0.1)
    assert a["se"] == pytest.approx(0.1 / math.sqrt(3))
    assert b["mean"] == pytest.approx(0.45) and b["sd"] == pytest.approx(math.sqrt(0.0525))
    # AUC: trapezoids over steps 0, 2, 10 divided by 10; A seed 0: (2 * 0.3 + 8 * 0.5) / 10 = 0.46
    auc = {k: (2 * (y[0] + y[1]) / 2 + 8 * (y[1] + y[2]) / 2) / 10 for k, y in CURVES.items()}
    assert a["auc_per_seed"][0] == pytest.approx(0.46)
    assert a["auc"]["mean"] == pytest.approx(sum(auc[("A", s)] for s in range(3)) / 3)
    # collapse: A seed 1 (NaN loss) and A seed 3 (failed) of A's 4 counted runs; B seed 1 (0.25 < its 0.3 start)
    assert set(a["collapsed"]) == {1, 3} and a["collapse_rate"] == pytest.approx(2 / 4)
    assert set(b["collapsed"]) == {1} and b["collapse_rate"] == pytest.approx(1 / 3) and b["incomplete"] == [3]
    # paired differences A - B by seed: 0.2, 0.25, 0.0
    p = res["pairs"][0]
    assert (p["a"], p["b"]) == ("A", "B")
    d = p["paired"]
    assert d["n"] == 3 and d["mean"] == pytest.approx(0.15) and d["se"] == pytest.approx(math.sqrt(0.0175 / 3))
    half = 4.302652729911275 * math.sqrt(0.0175 / 3)  # t_{0.975, 2}
    assert d["ci"] == pytest.approx((0.15 - half, 0.15 + half))
    # probability of improvement = the Mann-Whitney fraction: pairs where A beats B, ties count half
    mw = sum((x > y) + 0.5 * (x == y) for x in (0.6, 0.5, 0.7) for y in (0.4, 0.25, 0.7)) / 9
    assert mw == pytest.approx(6.5 / 9) and p["poi"][0] == pytest.approx(mw) and 0 <= p["poi"][1] <= p["poi"][2] <= 1
    # the bootstrap CI contains the mean and is reproducible with a fixed seed
    assert a["ci"][1] <= a["mean"] <= a["ci"][2] and a["ci"][1] < a["ci"][2]
    again = compute(col, "eval/x/avg@1", reps=1000, seed=0)
    assert again["arms"]["A"]["ci"] == a["ci"] and again["pairs"][0]["poi"] == p["poi"]
    assert a["iqm"][0] == pytest.approx(0.6)  # 3 runs: floor(3/4) = 0 cut at each end, the mean
    # a training metric: its mean over the last N steps
    train = compute(col, "reward_mean", last_n=3, reps=100)
    assert train["arms"]["A"]["per_seed"][0] == pytest.approx(0.9)
    # the band at step 2 for A: mean 0.4 +- 1.96 s.e. of (0.4, 0.5, 0.3)
    band = res["bands"]["A"]
    i = band["steps"].index(2.0)
    assert band["mean"][i] == pytest.approx(0.4) and band["high"][i] == pytest.approx(0.4 + 1.96 * 0.1 / math.sqrt(3))
    md = write_report([tmp_path], tmp_path / "r.md", reps=200).read_text()
    assert "| A | 3 | 0.6 | 0.05774 | 0.1 |" in md and "s0: 0.6, s1: 0.5, s2: 0.7" in md
    assert "**failed**: A seed 3" in md and "RuntimeError: boom" in md and "incomplete (not counted): B seed 3" in md
    assert "Evaluation noise (policy held fixed)" in md and "not a significance measure" in md


def test_a_replication_runs_other_seeds_of_some_arms_and_the_report_pools_the_sets(tmp_path, capsys):
    """tether sweep --seeds / --arms (a second, disjoint seed set of only the arms a comparison needs) and tether sweep
    report --set (each pair within each set and pooled, with the verdict)."""
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"base": {"overrides": {"train.steps": 1}}, "axes": {"recipe": ["grpo", "ema_pg"]},
                                    "seeds": 10}))
    assert main(["sweep", str(spec), "--dry-run", "--seeds", "10-12", "--arms", "grpo"]) == 0
    out = capsys.readouterr().out
    assert "1 arm(s) x 3 seed(s)" in out and "train.seed=12" in out and "ema_pg" not in out
    for bad, needle in ((["--seeds", "3-1"], "expected a count"), (["--arms", "grpp"], "did you mean 'grpo'")):
        assert main(["sweep", str(spec), "--dry-run", *bad]) == 2
        assert needle in capsys.readouterr().err
    # two seed sets of the synthetic sweep: A - B = 0.2, 0.25, 0.0 on seeds 0, 1, 2
    d = tmp_path / "S"
    d.mkdir()
    _synthetic(d)
    md = tmp_path / "r.md"
    assert main(["sweep", "report", str(d), "--out", str(md), "--reps", "50", "--set", "first=0-1",
                 "--set", "second=2"]) == 0
    text = md.read_text()
    assert "### Replication of `eval/x/avg@1` over seed sets" in text
    assert "not shown (a set has < 2 paired seeds)" in text
    res = json.loads(md.with_suffix(".json").read_text())["results"][0]["pairs"][0]
    assert res["sets"]["first"]["mean"] == pytest.approx(0.225) and res["sets"]["second"]["n"] == 1
    # the AUCs by hand (trapezoids over steps 0, 2, 10, over 10): A 0.46, 0.48, 0.45; B 0.33, 0.23, 0.45
    assert res["paired_auc"]["diffs"] == pytest.approx({"0": 0.13, "1": 0.25, "2": 0.0})  # JSON keys
    assert res["sets_auc"]["first"]["mean"] == pytest.approx(0.19) and res["sets_auc"]["second"]["n"] == 1
    assert "| A | B | AUC | 0.19 " in text and res["replication_auc"].startswith("not shown")
    assert main(["sweep", "report", str(d), "--out", str(md), "--set", "a=0-1", "--set", "b=1-2"]) == 2
    assert "share seeds [1]" in capsys.readouterr().err


def test_replication_verdicts():
    from tether.sweep.report import replication

    same = {"x": {"n": 10, "mean": 0.1}, "y": {"n": 10, "mean": 0.05}}
    assert replication(same, {"ci": (0.01, 0.14)}) == "replicates"
    assert replication(same, {"ci": (-0.01, 0.14)}).startswith("not shown")
    assert replication({"x": {"n": 10, "mean": 0.1}, "y": {"n": 10, "mean": -0.02}}, {"ci": (0.01, 0.1)}) == \
        "sets disagree"


def test_an_archived_sweep_and_a_replication_of_it_report_together(tmp_path):
    """An archived sweep recorded a synchronous arm as ``train.async: None`` (migrated from train.max_staleness: 0)
    and today's spec writes ``train.async: none``: the same arm, so a replication on other seeds merges with the
    archive in one report, and resumes into its directory; another value is still another arm."""
    old = {"spec": "s.yaml", "name": "n", "metric": METRIC, "seeds": [0],
           "base": {"config": None, "recipe": "ema_pg", "task": None, "overrides": {"train.steps": 2}},
           "arms": {"sync": {"train.max_staleness": 0, "train.lr": 3e-5}}}
    (tmp_path / "sweep.json").write_text(json.dumps(old))
    assert layout.same_overrides(layout.migrated(old)["arms"]["sync"], {"train.async": "none", "train.lr": 3e-5})
    assert not layout.same_overrides({"train.async": "none"}, {"train.async": 1})
    assert not layout.same_overrides({"train.async": "none", "train.lr": 3e-5}, {"train.async": "none"})
    new = parse_spec({"base": {"recipe": "ema_pg", "overrides": {"train.steps": 2}}, "seeds": [1],
                      "arms": {"sync": {"train.async": "none", "train.lr": 3e-5}}})
    layout.write_sweep(tmp_path, new)  # resumes into the archive's directory: not refused
    other = tmp_path / "rep"
    other.mkdir()
    (other / "sweep.json").write_text(json.dumps({**old, "arms": {"sync": {"train.async": "none",
                                                                          "train.lr": 3e-5}}}))
    collect([tmp_path, other])  # one arm in both: no "not the same arm"
    (other / "sweep.json").write_text(json.dumps({**old, "arms": {"sync": {"train.async": 1, "train.lr": 3e-5}}}))
    with pytest.raises(ConfigError, match="not the same arm"):
        collect([tmp_path, other])
