"""Remote rollout workers (train.async.transport.address, `tether worker`; tether.asynchronous.remote) on loopback: the
trainer and a worker are two `tether` processes started separately, as on two nodes. A run trains with
staleness <= K and verified checksums and both exit 0; a worker killed or frozen mid-run is a
`tether: error:` in the trainer (closed connection at once, silence after train.async.transport.timeout_s), never a
hang; a wrong key or a missing one is refused.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import DIGITS, cli_args, rows, subprocess_env, tiny_config

# Slow (out of the default suite) until an intermittent abort is fixed: once in a loaded 2-core run the trainer
# died with "terminate called without an active exception" (SIGABRT) right after the worker connected
# (docs/async.md, known issue). Run them with `bash scripts/test.sh -m slow tests/test_async_remote.py`.
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]
TIMEOUT = 420
KEY = "loopback-test-secret-0123456789abcdef"  # the key rule: >= 32 characters, 8 of them different
OTHER_KEY = "another-loopback-secret-0123456789abcdef"
TETHER = str(Path(sys.executable).parent / "tether")


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("async_remote", DIGITS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list, log: Path, **env) -> subprocess.Popen:
    out = open(log, "w")
    return subprocess.Popen([TETHER, *args], stdout=out, stderr=subprocess.STDOUT,
                            env=subprocess_env(OMP_NUM_THREADS="1", **env))


def remote_run(workdir, model_dir, run, address: str, steps: int, **over) -> list:
    return cli_args(workdir, model_dir, run, steps, "grpo",
                    **{"train.async.max_staleness": 1, "train.async.verify_sync": True,
                       "train.async.transport.kind": "remote", "train.async.transport.address": address,
                       "eval.before": False, "eval.after": False, **over})


def wait_for(cond, what: str, procs: list, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in procs), f"a process ended while waiting for {what}"
        time.sleep(0.5)


def end(*procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(30)


def test_trainer_and_a_remote_worker_on_loopback(workdir, tiny_model_dir, tmp_path):
    addr, run = f"127.0.0.1:{free_port()}", tmp_path / "run"
    key = dict(TETHER_WORKER_KEY=KEY)
    trainer = start(remote_run(workdir, tiny_model_dir, run, addr, 4, **{"algo.tis_cap": 2.0}), tmp_path / "t.log",
                    **key)
    worker = start(["worker", addr, "--wait", "300"], tmp_path / "w.log", **key)
    try:
        assert trainer.wait(TIMEOUT) == 0, (tmp_path / "t.log").read_text()[-3000:]
        assert worker.wait(TIMEOUT) == 0, (tmp_path / "w.log").read_text()[-3000:]
    finally:
        end(trainer, worker)
    tlog, wlog = (tmp_path / "t.log").read_text(), (tmp_path / "w.log").read_text()
    assert f"rollout worker 0 connected: remote rollout worker 0 ({socket.gethostname()}, pid {worker.pid})" in tlog
    assert "rollout worker 0 ready (hf engine)" in wlog and "the trainer ended the run" in wlog
    ms = rows(run)
    assert [m["step"] for m in ms] == [1, 2, 3, 4]
    for step, m in enumerate(ms):  # verify_sync: every batch's checksum matched the pushed version's
        assert 0 <= m["async/staleness"] <= 1 and m["async/version"] == step - m["async/staleness"]
        assert m["async/worker"] == 0 and m["skipped_updates"] == 0
        if m["async/staleness"] == 0:  # the worker's HF log-probs = the trainer's at that version
            assert m["rollout_corr/ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert ms[-1]["async/version"] >= 1  # weights travelled: batches sampled by pushed versions after the first


def torchrun(nproc: int, *args) -> list:
    """``torchrun --nproc_per_node nproc -m tether ARGS`` on loopback (its own rendezvous port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), "-m", "tether", *map(str, args)]


def test_the_two_node_layout_under_torchrun_on_loopback(workdir, tiny_model_dir, tmp_path):
    """docs/async.md's layout, both sides launched by torchrun: 2 FSDP trainer ranks listening on
    train.async.transport.address and `torchrun --nproc_per_node 2 -m tether worker` (2 workers, one per process). Both
    exit 0; both workers sampled; every batch within K with verified checksums."""
    addr, run = f"127.0.0.1:{free_port()}", tmp_path / "run"
    env = subprocess_env(OMP_NUM_THREADS="1", TETHER_WORKER_KEY=KEY)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    args = remote_run(workdir, tiny_model_dir, run, addr, 4, **{"train.async.workers": 2})
    with open(tmp_path / "t.log", "w") as tl, open(tmp_path / "w.log", "w") as wl:
        trainer = subprocess.Popen(torchrun(2, *args), stdout=tl, stderr=subprocess.STDOUT, env=env)
        workers = subprocess.Popen(torchrun(2, "worker", addr, "--wait", 300), stdout=wl, stderr=subprocess.STDOUT,
                                   env=env)
        try:
            assert trainer.wait(TIMEOUT) == 0, (tmp_path / "t.log").read_text()[-3000:]
            assert workers.wait(TIMEOUT) == 0, (tmp_path / "w.log").read_text()[-3000:]
        finally:
            end(trainer, workers)
    tlog, wlog = (tmp_path / "t.log").read_text(), (tmp_path / "w.log").read_text()
    assert "rollout worker 0 connected" in tlog and "rollout worker 1 connected" in tlog, tlog[-3000:]
    assert wlog.count("the trainer ended the run") == 2, wlog[-3000:]
    ms = rows(run)
    assert [m["step"] for m in ms] == [1, 2, 3, 4] and all(0 <= m["async/staleness"] <= 1 for m in ms)
    assert {m["async/worker"] for m in ms} == {0, 1} and all(m["skipped_updates"] == 0 for m in ms)


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_remote_worker_that_dies_or_freezes_is_an_error_not_a_hang(fault, workdir, tiny_model_dir, tmp_path):
    """SIGKILL: the closed connection stops the trainer at its next batch. SIGSTOP: the connection stays open
    and silent; the trainer stops after train.async.transport.timeout_s. Either way one `tether: error:` line,
    exit 2."""
    addr, run = f"127.0.0.1:{free_port()}", tmp_path / "run"
    key = dict(TETHER_WORKER_KEY=KEY)
    worker = start(["worker", addr, "--wait", "300"], tmp_path / "w.log", **key)  # first: it waits for the trainer
    trainer = start(remote_run(workdir, tiny_model_dir, run, addr, 5000, **{"train.async.transport.timeout_s": 20,
                                                                           "train.async.worker_restarts": 0}),
                    tmp_path / "t.log", **key)
    try:
        wait_for(lambda: (run / "metrics.jsonl").exists() and rows(run), "the first step", [trainer, worker])
        os.kill(worker.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        t0 = time.monotonic()
        assert trainer.wait(TIMEOUT) == 2
        waited = time.monotonic() - t0
    finally:
        end(trainer, worker)
    tlog = (tmp_path / "t.log").read_text()
    assert "tether: error: trainer step " in tlog and ": remote rollout worker 0 (" in tlog, tlog[-3000:]
    if fault == "killed":
        assert "closed the connection" in tlog and "(it died, or its node went away)" in tlog, tlog[-3000:]
    else:
        assert "sent nothing (not even a heartbeat)" in tlog, tlog[-3000:]
        assert "train.async.transport.timeout_s=20" in tlog, tlog[-3000:]
        assert waited >= 15
    done = len(rows(run))
    assert done < 5000 and f"step {done}'s checkpoint: " in tlog and "tether train --resume" in tlog, tlog[-3000:]


def test_a_killed_remote_worker_is_replaced_by_the_next_that_connects(workdir, tiny_model_dir, tmp_path):
    """train.async.worker_restarts (default 2): the trainer waits for a new `tether worker` (as a supervisor loop on the
    worker's node would start it), gives it the dead one's rank, the newest version and the jobs it held."""
    addr, run = f"127.0.0.1:{free_port()}", tmp_path / "run"
    key = dict(TETHER_WORKER_KEY=KEY)
    worker = start(["worker", addr, "--wait", "300"], tmp_path / "w.log", **key)
    trainer = start(remote_run(workdir, tiny_model_dir, run, addr, 40, **{"train.async.transport.timeout_s": 120}),
                    tmp_path / "t.log", **key)
    second = None
    try:
        wait_for(lambda: (run / "metrics.jsonl").exists() and rows(run), "the first step", [trainer, worker])
        os.kill(worker.pid, signal.SIGKILL)
        second = start(["worker", addr, "--wait", "300"], tmp_path / "w2.log", **key)
        assert trainer.wait(TIMEOUT) == 0, (tmp_path / "t.log").read_text()[-3000:]
        assert second.wait(TIMEOUT) == 0, (tmp_path / "w2.log").read_text()[-3000:]
    finally:
        end(trainer, worker, *([second] if second else []))
    tlog = (tmp_path / "t.log").read_text()
    assert "closed the connection" in tlog and "; restarting it (restart 1 of" in tlog, tlog[-3000:]
    assert f"rollout worker 0 connected: remote rollout worker 0 ({socket.gethostname()}, pid {second.pid})" in tlog
    ms = rows(run)
    assert [m["step"] for m in ms] == list(range(1, 41)) and ms[-1]["async/restarts"] == 1
    assert all(0 <= m["async/staleness"] <= 1 for m in ms)


def test_keys_and_addresses(workdir, tiny_model_dir, tmp_path, monkeypatch):
    """No key: a config error before anything starts; a worker with the wrong key is refused (exit 2) and the
    trainer, still waiting, says so and gives up after train.async.transport.timeout_s; bad addresses are config
    errors."""
    from tether.errors import ConfigError
    from tether.cli import main

    remote = {"train.async.transport.kind": "remote"}
    with pytest.raises(ConfigError, match="train.async.transport.address: Value error, must be HOST:PORT"):
        tiny_config(workdir, tiny_model_dir, "grpo", 2, **remote, **{"train.async.transport.address": "x"})
    with pytest.raises(ConfigError, match="train.async.transport.timeout_s is a key of train.async.transport.kind="
                                          "remote, and train.async.transport.kind is 'local'"):
        tiny_config(workdir, tiny_model_dir, "grpo", 2, **{"train.async.max_staleness": 1,
                                                           "train.async.transport.timeout_s": 5})
    with pytest.raises(ConfigError, match="train.async.transport.kind=remote needs train.async.transport.address"):
        tiny_config(workdir, tiny_model_dir, "grpo", 2, **remote)
    monkeypatch.delenv("TETHER_WORKER_KEY", raising=False)
    assert main(["worker", "127.0.0.1:1", "--wait", "0"]) == 2

    addr = f"127.0.0.1:{free_port()}"
    trainer = start(remote_run(workdir, tiny_model_dir, tmp_path / "run", addr, 2,
                               **{"train.async.transport.timeout_s": 60}), tmp_path / "t.log", TETHER_WORKER_KEY=KEY)
    try:
        wait_for(lambda: "waiting for 1 rollout worker" in (tmp_path / "t.log").read_text(), "the trainer", [trainer])
        bad = subprocess.run([TETHER, "worker", addr, "--wait", "10"], capture_output=True, text=True, timeout=120,
                             env=subprocess_env(OMP_NUM_THREADS="1", TETHER_WORKER_KEY=OTHER_KEY))
        assert bad.returncode == 2 and "tether: error: the trainer at" in bad.stderr and "refused" in bad.stderr
        assert trainer.wait(TIMEOUT) == 2
    finally:
        end(trainer)
    tlog = (tmp_path / "t.log").read_text()
    assert "rejected a rollout worker connection from 127.0.0.1" in tlog
    assert "tether: error: 0 of 1 rollout worker(s) connected to" in tlog, tlog[-2000:]
    assert not (tmp_path / "run").exists()  # a trainer that could not start leaves no run directory


CRASHING_AGENT = '''
from tether.agents import SingleTurnAgent


class Crashing(SingleTurnAgent):
    def rollout(self, examples, params):
        raise RuntimeError("boom in the remote worker")


def crashing(engine, tokenizer, **options):
    return Crashing(engine, tokenizer, **options)
'''


def test_a_remote_worker_that_raises_is_named_on_both_sides(workdir, tiny_model_dir, tmp_path):
    (tmp_path / "crash.py").write_text(CRASHING_AGENT)
    addr, run = f"127.0.0.1:{free_port()}", tmp_path / "run"
    key = dict(TETHER_WORKER_KEY=KEY)
    agent = {"rollout.agent": f"{tmp_path}/crash.py:crashing"}
    trainer = start(remote_run(workdir, tiny_model_dir, run, addr, 3, **agent), tmp_path / "t.log", **key)
    worker = start(["worker", addr, "--wait", "300"], tmp_path / "w.log", **key)
    try:
        assert trainer.wait(TIMEOUT) == 2 and worker.wait(TIMEOUT) == 2
    finally:
        end(trainer, worker)
    tlog, wlog = (tmp_path / "t.log").read_text(), (tmp_path / "w.log").read_text()
    assert "tether: error: trainer step 1: remote rollout worker 0 (" in tlog, tlog[-3000:]
    assert "failed: RuntimeError: boom in the remote worker (at crash.py:" in tlog, tlog[-3000:]
    assert "tether: error: rollout worker 0 failed: RuntimeError: boom in the remote worker" in wlog, wlog[-3000:]
