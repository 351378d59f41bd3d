"""Failures of asynchronous RL with real processes (docs/async.md, "Stopping, failures, resume"): a rollout
worker killed with ``kill -9`` mid-run is restarted and the job it held resubmitted (``train.async.worker_restarts``),
or, with no restart left, the run stops with one error line after a checkpoint of its last completed step,
from which ``--resume`` continues; a resume pushes the checkpoint's step as the first version and continues the data
stream where the consumed jobs ended.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import DIGITS, cli_args, rows, subprocess_env, tiny_config, worker_pid
from tether.rundir.checkpoint import checkpoints
from tether.train import build_trainer

pytestmark = pytest.mark.usefixtures("one_thread")
TIMEOUT = 420
TETHER = str(Path(sys.executable).parent / "tether")
QUIET = dict(log=lambda *a: None)


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("async_failures", DIGITS)


def asynchronous(k: int, **over) -> dict:
    return {"train.async.max_staleness": k, "train.async.verify_sync": True, "eval.before": False, "eval.after": False,
            **over}


def ids(t) -> list:
    return [e.id for e in t._last_batch.examples]


@pytest.mark.slow  # about 17 s: out of the default suite's 15 minutes, run by CI's slow step
def test_a_killed_local_worker_is_restarted_and_its_job_resubmitted(workdir, tiny_model_dir, tmp_path):
    """kill -9 on the worker after step 1 (it holds job 1, or has sent it): the trainer restarts it, resubmits
    what it held, and trains on with staleness <= K; the same examples per step as a run without the kill
    (the data stream is the trainer's, and a resubmitted job keeps its examples)."""
    steps, logs = 4, []
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", steps, **asynchronous(1))
    t = build_trainer(cfg, tmp_path / "run", log=logs.append)
    try:
        ms, seen = [t.train_step()], [ids(t)]
        old = t.feed.pool.pids()[0]
        os.kill(old, signal.SIGKILL)
        for _ in range(steps - 1):
            ms.append(t.train_step())
            seen.append(ids(t))
        new = t.feed.pool.pids()[0]
    finally:
        t.close()
    assert new != old and ms[-1]["async/restarts"] == 1
    assert any(f"rollout worker 0 (pid {old}) died with exit code -9" in ln and "restarting it (restart 1 of "
               "train.async.worker_restarts=2)" in ln for ln in logs), logs
    for step, m in enumerate(ms):
        assert 0 <= m["async/staleness"] <= 1 and m["async/version"] == step - m["async/staleness"]
    assert t.feed.consumed == steps and t.state()["data_position"] == cfg.rollout.prompts_per_step * steps
    ref = build_trainer(tiny_config(workdir, tiny_model_dir, "grpo", steps, **asynchronous(1)), tmp_path / "ref",
                        **QUIET)
    try:
        want = []
        for _ in range(steps):
            ref.train_step()
            want.append(ids(ref))
    finally:
        ref.close()
    assert seen == want


@pytest.mark.slow  # about 12 s: out of the default suite's 15 minutes, run by CI's slow step
def test_resume_pushes_the_checkpoint_version_and_continues_the_stream(workdir, tiny_model_dir, tmp_path):
    """K = 2: after 2 steps (jobs 2 and 3 in flight, not saved: a stop discards them) a checkpoint; a new
    trainer restored from it pushes version 2 first, so its first batch is sampled by version 2 (staleness 0),
    with the examples of job 2, as in an uninterrupted run; job count and data position are the consumed jobs'."""
    over = asynchronous(2)
    t = build_trainer(tiny_config(workdir, tiny_model_dir, "grpo", 4, **over), tmp_path / "run", **QUIET)
    P = t.cfg.rollout.prompts_per_step
    try:
        seen = []
        for _ in range(2):
            t.train_step()
            seen.append(ids(t))
        ckpt = t.save()
        assert t.feed.submitted == 4 and t.state()["async_"]["jobs"] == 2 and t.state()["data_position"] == 2 * P
        for _ in range(2):
            t.train_step()
            seen.append(ids(t))
    finally:
        t.close()
    r = build_trainer(tiny_config(workdir, tiny_model_dir, "grpo", 4, **over), tmp_path / "run", **QUIET)
    try:
        r.restore(ckpt)
        assert r.step == 2 and max(r.feed.pool.checksums) == 2 and r.feed.pool.shared.version.value == 2
        assert (r.feed.submitted, r.data.position) == (2, 2 * P)
        m = r.train_step()
        assert (m["async/version"], m["async/staleness"]) == (2, 0)  # the first push after resume: step 2
        assert ids(r) == seen[2]
        r.train_step()
        assert ids(r) == seen[3]
    finally:
        r.close()


@pytest.mark.slow  # about 24 s: out of the default suite's 15 minutes, run by CI's slow step
def test_kill_9_without_restarts_stops_with_a_checkpoint_and_resumes(workdir, tiny_model_dir, tmp_path):
    """`tether train` with train.async.worker_restarts=0; its worker is killed (kill -9) after the first step: exit 2,
    one `tether: error:` naming the worker, the exit code and the checkpoint of the last completed step, which
    `--resume` continues (to two steps further: the run is planned far longer than the kill can take to land,
    since on a fast machine 8 tiny steps finished between the first metrics row and the kill)."""
    run, log = tmp_path / "run", tmp_path / "train.log"
    planned = 10_000
    args = cli_args(workdir, tiny_model_dir, run, planned, "grpo",
                    **asynchronous(1, **{"train.async.worker_restarts": 0}))
    env = subprocess_env(OMP_NUM_THREADS="1")
    with open(log, "w") as out:
        p = subprocess.Popen([TETHER, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not ((run / "metrics.jsonl").exists() and rows(run)):
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        pid = worker_pid(log)
        os.kill(pid, signal.SIGKILL)
        assert p.wait(TIMEOUT) == 2, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    text = log.read_text()
    done = len(rows(run))
    assert 1 <= done < planned
    assert f"tether: error: trainer step {done + 1}: rollout worker 0 (pid {pid}) died with exit code -9" in text, text
    assert f"step {done}'s checkpoint: " in text and f"tether train --resume {run.absolute()}" in text, text
    assert checkpoints(run)[0].name == f"step-{done:06d}"
    r = subprocess.run([TETHER, "train", "--resume", str(run), f"train.steps={done + 2}"], env=env,
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    ms = rows(run)
    assert [m["step"] for m in ms] == list(range(1, done + 3))
    assert ms[done]["async/version"] == done  # the first batch after resume: sampled by the checkpoint's version
