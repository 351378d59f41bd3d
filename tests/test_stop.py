"""Graceful stop on SIGINT / SIGTERM (tether.rundir.stop, Trainer.run), tested as a user meets it:
``python -m tether train`` in a subprocess, a real signal, then ``--resume``.

To signal the trainer at a known point, the subprocess scores with ``gated``: from trainer step 2
on, the reward waits while a gate file exists (and says so with a ``.waiting`` file). The test
sends its signal(s) while step 2 waits, then opens the gate, so the outcome does not depend on
timing: a graceful stop ends after step 2, an abort inside step 2.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import DIGITS, rows, strip, subprocess_env, terminal_sigint, tiny_config
from tether.resolve import save_config
from tether.rundir import stop
from tether.rundir.checkpoint import latest_checkpoint
from tether.train import build_trainer, train

REWARD = DIGITS + '''
import os, signal, time


def gated(completion, example):
    """digits; from step 2 on (metrics.jsonl has a row), it waits while $TETHER_TEST_GATE exists."""
    gate, metrics = os.environ.get("TETHER_TEST_GATE", ""), os.environ.get("TETHER_TEST_METRICS", "")
    while gate and os.path.exists(gate) and os.path.exists(metrics) and os.path.getsize(metrics) > 0:
        open(gate + ".waiting", "w").close()
        time.sleep(0.01)
    return digits(completion, example)


def signals_self(completion, example):
    """digits; sends $TETHER_TEST_SIGNAL to this very process once (at the first call that finds it set),
    under torchrun only on rank $TETHER_TEST_SIGNAL_RANK when that is set. The tests run it in the
    trainer's process (data.reward_timeout=0): a user reward otherwise runs in a worker process."""
    if os.environ.get("TETHER_TEST_SIGNAL_RANK", os.environ.get("RANK")) == os.environ.get("RANK"):
        name = os.environ.pop("TETHER_TEST_SIGNAL", None)
        if name:
            os.kill(os.getpid(), getattr(signal, name))
    return digits(completion, example)
'''
STEPS = 4
TIMEOUT = 240  # seconds: a hard limit on every wait (a broken stop must fail the test, not hang it)
pytestmark = pytest.mark.usefixtures("one_thread")  # in-process training too: no thread oversubscription


@pytest.fixture(scope="module")
def stopdir(make_workdir):
    return make_workdir("stop", REWARD)


def with_one_thread(fn):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocesses (OMP_NUM_THREADS=1): the same float rounding
    try:
        return fn()
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def reference(stopdir, tiny_model_dir, tmp_path_factory):
    """The metrics rows of an uninterrupted STEPS-step run."""
    run = tmp_path_factory.mktemp("reference") / "run"
    with_one_thread(lambda: train(tiny_config(stopdir, tiny_model_dir, "ema_pg", STEPS), run, log=lambda *a: None))
    return rows(run)


def start(args: list, log: Path, **env) -> subprocess.Popen:
    """``python -m tether ARGS`` in a fresh interpreter importing this checkout, output to ``log``."""
    full = subprocess_env(OMP_NUM_THREADS="1", **env)
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "tether", *args], stdout=out, stderr=subprocess.STDOUT,
                                env=full, preexec_fn=terminal_sigint)


def wait_for(what, cond, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"the trainer exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.02)


def finish(proc: subprocess.Popen, log: Path) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the trainer did not exit:\n{log.read_text()[-3000:]}")
    return rc, log.read_text()


def signalled_run(stopdir, tiny_model_dir, tmp_path, signals: list, **over):
    """Start a STEPS-step run with the gated reward, send ``signals`` (names) while step 2 waits in
    its reward (each after the previous one was acknowledged), open the gate; returns (run, rc, output)."""
    cfg = tiny_config(stopdir, tiny_model_dir, "ema_pg", STEPS, reward="gated",
                      **{"data.reward_timeout": 0, **over})  # the reward in the trainer: no reward time limit applies
    save_config(cfg, tmp_path / "cfg.yaml")
    run, gate, log = tmp_path / "run", tmp_path / "gate", tmp_path / "train.log"
    gate.touch()
    p = start(["train", "--config", str(tmp_path / "cfg.yaml"), "--output-dir", str(run)], log,
              TETHER_TEST_GATE=str(gate), TETHER_TEST_METRICS=str(run / "metrics.jsonl"))
    try:
        wait_for("step 2 to wait at the gate", lambda: Path(f"{gate}.waiting").exists(), p, log)
        for i, name in enumerate(signals):
            p.send_signal(getattr(signal, name))
            if i + 1 < len(signals):
                wait_for(f"{name} to be acknowledged", lambda: f"{name} received" in log.read_text(), p, log)
                time.sleep(stop.REPEAT_S + 0.2)  # a second stop, not the first delivered twice (step 2 waits)
        gate.unlink()
        rc, out = finish(p, log)
    finally:
        if p.poll() is None:
            p.kill()
    return run, rc, out


def resume_to_the_end(run: Path, tmp_path: Path) -> None:
    log = tmp_path / "resume.log"
    rc, out = finish(start(["train", "--resume", str(run)], log), log)
    assert rc == 0, out


@pytest.mark.faults
@pytest.mark.parametrize("name", [pytest.param("SIGTERM", marks=pytest.mark.slow),  # about 10 s: SIGINT's twin,
                                  "SIGINT"])  # run by CI's slow step (out of the default suite's 15 minutes)
def test_signal_stops_after_the_step_with_a_checkpoint_and_resumes_exactly(name, stopdir, tiny_model_dir,
                                                                            tmp_path, reference):
    run, rc, out = signalled_run(stopdir, tiny_model_dir, tmp_path, [name])  # run.save_every=0: no periodic save
    assert rc == 128 + getattr(signal, name), out  # 143 for SIGTERM, 130 for SIGINT
    assert f"Resume with: tether train --resume {run.absolute()}" in out, out
    assert "Traceback" not in out, out
    assert [r["step"] for r in rows(run)] == [1, 2]  # the step in progress finished, no further one
    assert latest_checkpoint(run).name == "step-000002"  # written at the stop although save_every=0
    resume_to_the_end(run, tmp_path)
    got = rows(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [strip(r) for r in got] == [strip(r) for r in reference]


@pytest.mark.faults
@pytest.mark.slow  # about 33 s: out of the default suite's 15 minutes, run by CI's slow step (and -m faults)
def test_a_second_signal_aborts_without_a_new_checkpoint(stopdir, tiny_model_dir, tmp_path, reference):
    """SIGTERM, then SIGINT while step 2 still runs: the process ends at once (inside step 2), writes
    no checkpoint, says so, and the run resumes from step 1's checkpoint to the same result."""
    run, rc, out = signalled_run(stopdir, tiny_model_dir, tmp_path, ["SIGTERM", "SIGINT"],
                                 **{"run.save_every": 1})
    assert rc == 130, out  # the signal that aborted: SIGINT
    assert "aborted by a second stop signal (SIGINT)" in out and "Traceback" not in out, out
    assert f"tether train --resume {run.absolute()}" in out, out
    assert [r["step"] for r in rows(run)] == [1]
    assert latest_checkpoint(run).name == "step-000001"
    assert not any(".tmp-" in p.name for p in (run / "checkpoints").iterdir())  # no write was even begun
    resume_to_the_end(run, tmp_path)
    assert [strip(r) for r in rows(run)] == [strip(r) for r in reference]


@pytest.mark.faults
def test_the_same_stop_delivered_twice_is_not_an_abort(tmp_path):
    """A signal right after the first (torchrun's agent forwarding the Ctrl-C its workers already got)
    does not abort; one that comes later does. Sent straight to the handler: the delivery is not timed."""
    gs = stop.GracefulStop(tmp_path, announce=False)
    gs._handle(signal.SIGINT, None)
    try:
        gs._handle(signal.SIGTERM, None)  # within REPEAT_S of the first
    except stop.Aborted:
        pytest.fail("the first stop, delivered twice, aborted the run")
    assert gs.requested() == "SIGINT"
    gs._first_at -= stop.REPEAT_S
    with pytest.raises(stop.Aborted, match=r"second stop signal \(SIGTERM\).*no checkpoint yet"):
        gs._handle(signal.SIGTERM, None)


@pytest.mark.faults
def test_python_api_returns_after_a_stop_and_restores_the_handlers(stopdir, tiny_model_dir, tmp_path, monkeypatch):
    """Trainer.run() returns the run dir after a graceful stop, with stopped_by set and a log line; the
    caller's handlers are back afterwards (a SIGTERM sent during the run did not kill this process)."""
    cfg = tiny_config(stopdir, tiny_model_dir, "ema_pg", STEPS, reward="signals_self", **{"data.reward_timeout": 0})
    mine = lambda signum, frame: None  # noqa: E731
    before_int = signal.getsignal(signal.SIGINT)
    monkeypatch.setenv("TETHER_TEST_SIGNAL", "SIGTERM")
    old = signal.signal(signal.SIGTERM, mine)
    lines = []
    try:
        t = build_trainer(cfg, tmp_path / "run", log=lines.append)
        assert t.run() == tmp_path / "run"
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is before_int
    finally:
        signal.signal(signal.SIGTERM, old)
    assert t.stopped_by == "SIGTERM" and stop.last_stop() == "SIGTERM"
    assert [r["step"] for r in rows(tmp_path / "run")] == [1]
    assert latest_checkpoint(tmp_path / "run").name == "step-000001"
    assert any("stopped by SIGTERM after step 1" in ln and "--resume" in ln for ln in lines), lines
    t2 = build_trainer(cfg, tmp_path / "run", log=lines.append)  # resumes to the end; not stopped this time
    t2.run(resume=True)
    assert t2.stopped_by is None and stop.last_stop() is None
    assert [r["step"] for r in rows(tmp_path / "run")] == list(range(1, STEPS + 1))


def test_ignored_signal_stays_ignored_and_threads_install_nothing(stopdir, tiny_model_dir, tmp_path, monkeypatch):
    """A process that ignores SIGINT (a background job, nohup) keeps ignoring it during a run; a run in a
    thread other than the main one (where Python allows no handlers) trains without touching signals."""
    cfg = tiny_config(stopdir, tiny_model_dir, "ema_pg", 2, reward="signals_self", **{"data.reward_timeout": 0})
    monkeypatch.setenv("TETHER_TEST_SIGNAL", "SIGINT")
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        t = build_trainer(cfg, tmp_path / "ignored", log=lambda *a: None)
        t.run()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)
    assert t.stopped_by is None and len(rows(tmp_path / "ignored")) == 2

    errors = []

    def in_thread():
        try:
            train(tiny_config(stopdir, tiny_model_dir, "ema_pg", 1), tmp_path / "thread", log=lambda *a: None)
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)

    th = threading.Thread(target=in_thread)
    th.start()
    th.join(TIMEOUT)
    assert not errors and len(rows(tmp_path / "thread")) == 1


@pytest.mark.faults
@pytest.mark.slow  # about 15 s: out of the default suite's 15 minutes, run by CI's slow step
def test_ranks_stop_at_the_same_step_when_one_is_signalled(stopdir, tiny_model_dir, tmp_path):
    """Under torchrun a SIGTERM that reaches rank 1 only stops both ranks after the same step (the flag
    is all-reduced once per step), both take part in the (collective) checkpoint, rank 0 alone reports it;
    the run then resumes, here in one process, to its end."""
    from test_distributed import MAIN, _env, _torchrun, _train_args

    reward = f"{stopdir / 'rew.py'}:signals_self"
    args = _train_args(stopdir, tiny_model_dir, str(tmp_path / "run"), steps=3,
                       **{"data.reward": reward, "data.reward_timeout": 0, "run.save_every": 0})
    env = dict(_env(), TETHER_TEST_SIGNAL="SIGTERM", TETHER_TEST_SIGNAL_RANK="1")
    p = subprocess.run(_torchrun(2, *args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    out = p.stdout + p.stderr
    assert out.count("stopped by SIGTERM after step 1 of 3") == 1, out[-6000:]  # rank 0 reports, for both
    assert "exitcode  : 143" in out, out[-6000:]  # torchrun's summary of the ranks' exit status
    assert [r["step"] for r in rows(tmp_path / "run")] == [1]
    assert latest_checkpoint(tmp_path / "run").name == "step-000001"
    r = subprocess.run([sys.executable, MAIN, "train", "--resume", str(tmp_path / "run")], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3]


def test_ctrl_c_outside_a_run_is_one_line_and_exit_130(monkeypatch, capsys):
    """Ctrl-C while the model loads (no handler yet, nothing to save) ends ``tether train`` with one line
    and exit 130, not a traceback."""
    import tether.train
    from tether.cli import main

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(tether.train, "train", interrupted)
    try:
        rc = main(["train", "train.steps=1", "run.progress=false"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped tether.cli.main (a traceback for the user)")
    assert rc == 130
    assert capsys.readouterr().err.strip() == "tether: interrupted (SIGINT)"


@pytest.mark.faults
def test_ctrl_c_under_torchrun_stops_gracefully(stopdir, tiny_model_dir, tmp_path):
    """Ctrl-C in a terminal signals the whole process group: each worker gets SIGINT from the terminal and
    again from torchrun's agent, which forwards it. That is one stop (a graceful one), not an abort."""
    from test_distributed import _env, _torchrun, _train_args

    run, gate, log = tmp_path / "run", tmp_path / "gate", tmp_path / "torchrun.log"
    gate.touch()
    args = _train_args(stopdir, tiny_model_dir, str(run), steps=STEPS,
                       **{"data.reward": f"{stopdir / 'rew.py'}:gated", "data.reward_timeout": 0, "run.save_every": 0})
    env = dict(_env(), TETHER_TEST_GATE=str(gate), TETHER_TEST_METRICS=str(run / "metrics.jsonl"))
    with open(log, "w") as out:
        p = subprocess.Popen(_torchrun(2, *args), cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True, preexec_fn=terminal_sigint)
    try:
        wait_for("step 2 to wait at the gate", lambda: Path(f"{gate}.waiting").exists(), p, log)
        os.killpg(p.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        wait_for("SIGINT to be acknowledged", lambda: "SIGINT received" in log.read_text(), p, log)
        gate.unlink()
        rc, out = finish(p, log)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert "stopped by SIGINT after step 2" in out and "aborted" not in out, out[-6000:]
    assert [r["step"] for r in rows(run)] == [1, 2]
    assert latest_checkpoint(run).name == "step-000002"
