"""Run directories under faults: torn logs, non-empty and locked directories, concurrent trainers,
read-only directories, failed resumes, damaged checkpoints, a full disk (tether.rundir, tether.metrics,
tether.checkpoint). Every test runs on the tiny random model in seconds."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tether
from tether.algo.recipes import ConfigError
from tether.checkpoint import latest_checkpoint
from tether.cli import main
from tether.config import load_config
from tether.errors import RunError
from tether.metrics import JsonlWriter, read_metrics
from tether.testing import make_tiny_model_dir
from tether.train import resume, train

pytestmark = pytest.mark.faults

SRC = str(Path(tether.__file__).resolve().parents[1])
TIMING = ("time", "tokens_per_s", "peak_")
REWARD = '''
import os, time

def digits(completion, example):
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)

CALLS = {"n": 0}

def hold_after_first_step(completion, example):
    """Scores like digits; from the 5th call on (step 2 with 4 responses a step) it waits until the file
    $TETHER_TEST_FLAG exists (at most 120 s), so the trainer holds its run directory for the test."""
    CALLS["n"] += 1
    deadline = time.time() + 120
    while CALLS["n"] > 4 and not os.path.exists(os.environ["TETHER_TEST_FLAG"]) and time.time() < deadline:
        time.sleep(0.05)
    return digits(completion, example)
'''


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults_run")
    (d / "rew.py").write_text(REWARD)
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"question": f"Say some numbers {i}", "answer": str(i)}) + "\n")
    return d


def settings(work, model_dir, steps, **over) -> dict:
    base = {
        "model.name": str(model_dir), "data.task": str(work / "prompts.jsonl"),
        "data.reward": f"{work / 'rew.py'}:digits", "train.steps": steps, "train.lr": 1e-2,
        "rollout.max_new_tokens": 6, "rollout.prompts_per_step": 2, "rollout.n": 2, "algo.anchor.every": 1,
        "run.progress": False, "run.plot": False, "run.exact_kl_samples": 0, "run.save_every": 1,
    }
    base.update(over)
    return base


def cfg_for(work, model_dir, steps, **over):
    return load_config(None, settings(work, model_dir, steps, **over), recipe_name="ema_pg")


def cli_args(work, model_dir, out, steps, **over) -> list[str]:
    """``tether train`` arguments for the same run as ``cfg_for``."""
    vals = settings(work, model_dir, steps, **over)
    vals.pop("train.steps")
    return ["train", "--recipe", "ema_pg", "--output-dir", str(out), "--steps", str(steps),
            *[f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in vals.items()]]


def rows(run):
    return [json.loads(ln) for ln in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def strip(m):
    return {k: v for k, v in m.items() if not any(s in k for s in TIMING)}


def quiet(*a, **k):
    pass


def error_line(stderr: str) -> str:
    """The CLI's one error line (other stderr lines are progress bars and warnings), and no traceback."""
    errs = [ln for ln in stderr.splitlines() if ln.startswith("tether: error: ")]
    assert len(errs) == 1 and "Traceback" not in stderr, stderr
    return errs[0]


def no_model_load(monkeypatch):
    """Fail the test if the model is loaded: the check under test must come before it."""
    import tether.models
    monkeypatch.setattr(tether.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))


def assert_same_run(run, ref, steps):
    """Same metrics rows (timing stripped) and the same final policy weights as the uninterrupted ``ref``."""
    assert [r["step"] for r in rows(run)] == list(range(1, steps + 1))
    assert [strip(r) for r in rows(run)] == [strip(r) for r in rows(ref)]
    name = f"checkpoints/step-{steps:06d}/policy.safetensors"
    a, b = load_file(str(Path(run) / name)), load_file(str(Path(ref) / name))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def base_run(work, tiny_model_dir, tmp_path_factory):
    """2 steps with checkpoints step-1 and step-2: tests damage copies of it, and it is what an
    interrupted and resumed 2-step run must end as."""
    return train(cfg_for(work, tiny_model_dir, 2), tmp_path_factory.mktemp("base") / "run", log=quiet)


def copy_run(src, dst):
    shutil.copytree(src, dst)
    return dst


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = SRC + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


# ---------------------------------------------------------------- 1. metrics.jsonl / samples.jsonl


def test_torn_last_line_is_dropped_on_resume(base_run, tmp_path, capsys):
    """A kill mid-write tears the last line of metrics.jsonl and samples.jsonl; --resume drops it
    with a warning naming the file and line, instead of crashing on it for good."""
    run = copy_run(base_run, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / "step-000002")
    for name in ("metrics.jsonl", "samples.jsonl"):
        with open(run / name, "a") as f:
            f.write('{"step": 3, "reward_me')
    n_metrics = len((run / "metrics.jsonl").read_text().splitlines())
    resume(run, {"train.steps": 3}, log=quiet)
    err = capsys.readouterr().err
    assert f"{run / 'metrics.jsonl'}: line {n_metrics} is incomplete" in err
    assert f"{run / 'samples.jsonl'}: line" in err
    assert [r["step"] for r in rows(run)] == [1, 2, 3]
    samples = [json.loads(ln) for ln in (run / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [1, 2, 3]
    assert [strip(r) for r in rows(run)[:2]] == [strip(r) for r in rows(base_run)]


def test_trimming_on_resume_is_atomic(tmp_path):
    """Trimming the rows after the checkpoint step replaces the file atomically: a writer that dies
    in the middle (here: a file-size limit hit, EFBIG, in a real process) keeps every row."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "reward_mean": 0.5, "pad": "x" * 200}) + "\n" for s in range(1, 7)]
    path.write_text("".join(lines))
    before = path.read_bytes()
    code = ("import resource, sys; from pathlib import Path; from tether.metrics import JsonlWriter; "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300)); JsonlWriter(Path(sys.argv[1]), 5)")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env(), timeout=120)
    assert r.returncode != 0, r.stdout + r.stderr  # the limit stopped the rewrite
    assert path.read_bytes() == before  # ... and the file still holds all 6 rows (before: 1 row and a torn one)
    w = JsonlWriter(path, truncate_after_step=5)  # the next resume trims it
    w.close()
    assert path.read_text() == "".join(lines[:5])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_read_metrics_skips_torn_last_line_but_not_a_bad_middle_line(tmp_path, capsys):
    good = [json.dumps({"step": s, "reward_mean": 0.1 * s}) for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(good) + '\n{"step": 3, "rew')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert f"{tmp_path / 'metrics.jsonl'}: line 3 is incomplete" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(good[0] + '\n{"step": 2, "rew\n' + good[1] + "\n")
    with pytest.raises(RunError, match=r"metrics.jsonl: line 2 is not a JSON row"):
        read_metrics(tmp_path)
    assert main(["plot", str(tmp_path)]) == 2
    assert "metrics.jsonl: line 2" in capsys.readouterr().err


def test_failed_append_leaves_no_torn_row(tmp_path, monkeypatch):
    """A row whose write fails half-way (disk full) is cut back out of the file at once."""
    path = tmp_path / "metrics.jsonl"
    w = JsonlWriter(path)
    w.write({"step": 1, "reward_mean": 0.5})
    real = JsonlWriter._write_all

    def half_then_full(self, data):
        real(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(JsonlWriter, "_write_all", half_then_full)
    with pytest.raises(OSError) as e:
        w.write({"step": 2, "reward_mean": 0.25})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
    w.close()
    assert path.read_text() == json.dumps({"step": 1, "reward_mean": 0.5}) + "\n"


# ---------------------------------------------------------------- 5. checkpoint integrity


def _truncate(p):
    p.write_bytes(p.read_bytes()[:-100])


def _flip(p):
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x01
    p.write_bytes(bytes(b))


DAMAGE = {  # name -> (damage the newest checkpoint, what the warning says)
    "truncated": (lambda c: _truncate(c / "policy.safetensors"), "policy.safetensors has"),
    "flipped": (lambda c: _flip(c / "optimizer.safetensors"), "optimizer.safetensors does not match its sha256"),
    "missing": (lambda c: (c / "rng.safetensors").unlink(), "rng.safetensors is missing"),
    "bad_state_json": (lambda c: (c / "state.json").write_text('{"step": 2, "trainer"'), "state.json"),
    "bad_manifest": (lambda c: (c / "manifest.json").write_text("{not json"), "manifest.json is unreadable"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_falls_back_to_the_previous_one(damage, base_run, tmp_path, capsys):
    from tether.eval.cli import resolve_eval_spec
    from tether.export import resolve_run_checkpoint

    run = copy_run(base_run, tmp_path / "run")
    newest, previous = run / "checkpoints" / "step-000002", run / "checkpoints" / "step-000001"
    do, says = DAMAGE[damage]
    do(newest)
    assert latest_checkpoint(run) == previous
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged" in err and says in err, err
    assert resolve_run_checkpoint(run).checkpoint == previous  # tether export
    assert resolve_eval_spec(run).checkpoint == previous  # tether eval
    do(previous)
    with pytest.raises(RunError, match="no valid checkpoint.*step-000002.*step-000001"):
        latest_checkpoint(run)


def test_resume_from_the_previous_checkpoint_when_the_newest_is_damaged(base_run, tmp_path, capsys):
    run = copy_run(base_run, tmp_path / "run")
    _flip(run / "checkpoints" / "step-000002" / "policy.safetensors")
    resume(run, log=quiet)
    assert "step-000002 is damaged" in capsys.readouterr().err
    assert_same_run(run, base_run, 2)  # step 2 redone from step 1, exactly


def test_checkpoint_without_manifest_loads_unverified(base_run, tmp_path, capsys):
    run = copy_run(base_run, tmp_path / "run")
    (run / "checkpoints" / "step-000002" / "manifest.json").unlink()
    assert latest_checkpoint(run) == run / "checkpoints" / "step-000002"
    assert "loaded without verification" in capsys.readouterr().err


def test_prune_leaves_a_live_trainers_temp_checkpoint(tmp_path):
    """Checkpoint cleanup removes leftovers of dead writers (and its own), never a temp directory of a
    process that still runs (another trainer's checkpoint in progress)."""
    import tether.checkpoint as ck

    root = tmp_path / "checkpoints"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    try:
        for name in ("step-000001", "step-000002", f"step-000003.tmp-{live.pid}", f"step-000003.tmp-{dead.pid}",
                     f"step-000002.tmp-{os.getpid()}"):
            (root / name).mkdir(parents=True)
            (root / name / "policy.safetensors").write_bytes(b"x")
        ck._prune(root, keep=2)
        assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002", f"step-000003.tmp-{live.pid}"]
    finally:
        live.kill()
        live.wait(timeout=60)
