"""kill -9 at random points of ``python -m tether train``, then ``--resume``: the run ends where an
uninterrupted one does (the same metrics rows, steps 1..N once each, the same final weights).

Checkpoints are written atomically, metrics rows after the checkpoint's step are redone on
resume, and the RNG, data position, optimizer and anchor state travel in the checkpoint; a
SIGKILL gives no process a chance to clean up, so this is the test of all of that together.
"""

import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import DIGITS, rows, strip, tiny_config
from test_stop import TIMEOUT, finish, start, with_one_thread
from tether.resolve import save_config
from tether.rundir.checkpoint import latest_checkpoint
from tether.train import train

STEPS = 8
KILLS = 5  # the first during the model load, the others during training


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("kill", DIGITS)


def metric_lines(run: Path) -> int:
    """Complete lines in metrics.jsonl (a line being written does not count)."""
    try:
        return (run / "metrics.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def kill_after(p: subprocess.Popen, log: Path, run: Path, rng: random.Random, phase: str, step_s: float) -> str:
    """SIGKILL ``p`` at a random point of ``phase``; returns what was aimed at (for the failure message).

    ``load``: a random delay after the trainer says it loads the model (model load, engine, the first
    generation). ``train``: a random delay of 0-2 steps (``step_s`` seconds each) after 1-3 steps past
    the latest checkpoint were logged: in the checkpoint write that follows an even step
    (run.save_every=2), in the next step's generation or update, with rows logged after the checkpoint.
    """
    if phase == "load":
        cond, delay = (lambda: "loading model" in log.read_text()), rng.uniform(0.0, 2.0)
        aim = f"{delay:.2f} s after the model load began"
    else:
        delay = rng.uniform(0.0, 2.0) * step_s
        ckpt = latest_checkpoint(run) if (run / "checkpoints" / "latest").is_file() else None
        target = min(STEPS - 1, (int(ckpt.name.split("-")[1]) if ckpt else 0) + rng.randint(1, 3))
        cond = lambda: metric_lines(run) >= target  # noqa: E731
        aim = f"{delay:.2f} s after metrics row {target}"
    deadline = time.monotonic() + TIMEOUT
    while not cond() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(delay)
    p.kill()  # SIGKILL
    return aim


@pytest.mark.faults
@pytest.mark.slow  # about 31 s: out of the default suite's 15 minutes, run by CI's slow step
def test_kill_9_at_random_points_then_resume_equals_an_uninterrupted_run(workdir, tiny_model_dir, tmp_path):
    over = {"run.save_every": 2}  # a kill lands in a checkpoint write, or with rows logged after the checkpoint
    ref = tmp_path / "reference"
    with_one_thread(lambda: train(tiny_config(workdir, tiny_model_dir, "ema_pg", STEPS, **over), ref,
                                  log=lambda *a: None))
    step_s = sum(r["time_step_s"] for r in rows(ref)) / STEPS  # the kill points scale with the machine's speed
    save_config(tiny_config(workdir, tiny_model_dir, "ema_pg", STEPS, **over), tmp_path / "cfg.yaml")
    run, log = tmp_path / "run", tmp_path / "train.log"
    fresh = ["train", "--config", str(tmp_path / "cfg.yaml"), "--output-dir", str(run)]
    history = []

    def launch() -> subprocess.Popen:
        if (run / "checkpoints" / "latest").is_file():  # written only after a complete checkpoint
            return start(["train", "--resume", str(run)], log, PYTHONUNBUFFERED="1")
        shutil.rmtree(run, ignore_errors=True)  # killed before the first checkpoint: start over
        return start(fresh, log, PYTHONUNBUFFERED="1")

    for k in range(KILLS):
        rng = random.Random(k)
        p = launch()
        aim = kill_after(p, log, run, rng, "load" if k == 0 else "train", step_s)
        rc = p.wait(timeout=TIMEOUT)
        ckpt = latest_checkpoint(run) if (run / "checkpoints").is_dir() else None
        history.append(f"kill {k}: {aim}: rc {rc}, {metric_lines(run)} rows, checkpoint {ckpt and ckpt.name}")
    print("\n".join(history))  # where the kills landed (pytest -s shows it)
    rc, out = finish(launch(), log)
    assert rc == 0, "\n".join(history) + "\n" + out[-3000:]

    got, want = rows(run), rows(ref)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), history
    assert [strip(r) for r in got] == [strip(r) for r in want], history
    for name in ("policy", "anchor"):
        a = load_file(str(latest_checkpoint(ref) / f"{name}.safetensors"))
        b = load_file(str(latest_checkpoint(run) / f"{name}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), (name, history)
    assert latest_checkpoint(run).name == f"step-{STEPS:06d}"
    assert not list((run / "checkpoints").glob("*.tmp-*")), history  # the last save cleaned what kills left
