"""Run directories under faults: torn logs, non-empty and locked directories, concurrent trainers,
read-only directories, failed resumes, damaged checkpoints, a full disk (tether.rundir.guard, tether.metrics,
tether.rundir.checkpoint). Every test runs on the tiny random model in seconds."""

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

from helpers import DIGITS, FAULTS, cli_args, copy_run, rows, strip, subprocess_env, tiny_config
from tether.cli import main
from tether.errors import ConfigError, RunError
from tether.metrics import JsonlWriter, read_metrics
from tether.resolve import load_config
from tether.rundir.checkpoint import latest_checkpoint
from tether.testing import make_tiny_model_dir
from tether.train import resume, train

pytestmark = pytest.mark.faults

REWARD = DIGITS + '''
import os, time

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
def work(make_workdir):
    return make_workdir("faults_run", REWARD)


def cfg_for(work, model_dir, steps, **over):
    """The fault tests' tiny run (helpers.FAULTS) under ema_pg."""
    return tiny_config(work, model_dir, "ema_pg", steps, **{**FAULTS, **over})


def fault_args(work, model_dir, out, steps, **over) -> list[str]:
    """``tether train`` arguments for the same run as ``cfg_for``."""
    return cli_args(work, model_dir, out, steps, **{**FAULTS, **over})


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
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=subprocess_env(),
                       timeout=120)
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
    # complete JSON that is not an object is no torn write, even as the last line
    (tmp_path / "metrics.jsonl").write_text(good[0] + "\n[1]\n")
    with pytest.raises(RunError, match=r"metrics.jsonl: line 2 is a JSON list, not a row \(an object\)"):
        read_metrics(tmp_path)


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


# ---------------------------------------------------------------- 2. run directories and the lock


def test_fresh_run_refuses_a_non_empty_run_dir(work, tiny_model_dir, base_run, tmp_path, monkeypatch):
    run = copy_run(base_run, tmp_path / "run")
    config = (run / "config.yaml").read_bytes()
    no_model_load(monkeypatch)
    with pytest.raises(RunError) as e:
        train(cfg_for(work, tiny_model_dir, 1), run, log=quiet)
    msg = str(e.value)
    assert str(run) in msg and "not empty" in msg and f"--resume {run}" in msg and "--overwrite" in msg
    assert (run / "config.yaml").read_bytes() == config and [r["step"] for r in rows(run)] == [1, 2]
    assert not (run / ".lock").exists()
    # a directory that holds no run (the user's, or a run's checkpoints/) is not offered --resume or --overwrite,
    # which would both be refused
    for other in (run / "checkpoints", tmp_path / "mine"):
        other.mkdir(exist_ok=True)
        (other / "notes.txt").write_text("keep me")
        with pytest.raises(RunError) as e:
            train(cfg_for(work, tiny_model_dir, 1), other, log=quiet)
        msg = str(e.value)
        assert str(other) in msg and "holds no tether run" in msg and "another --output-dir" in msg, msg
        assert "--resume" not in msg and "--overwrite" not in msg and (other / "notes.txt").read_text() == "keep me"


def test_overwrite_replaces_the_old_run(work, tiny_model_dir, base_run, tmp_path, capsys):
    run = copy_run(base_run, tmp_path / "run")
    assert main(fault_args(work, tiny_model_dir, run, 1) + ["--overwrite"]) == 0
    assert [r["step"] for r in rows(run)] == [1]
    assert sorted(p.name for p in run.iterdir()) == [".tether.json", "checkpoints", "config.yaml", "metrics.jsonl",
                                                     "samples.jsonl"]
    assert [p.name for p in (run / "checkpoints").iterdir() if p.is_dir()] == ["step-000001"]
    assert load_config(str(run / "config.yaml")).run.overwrite is False  # a rerun of it does not delete again
    # never a directory that is not a run (tests/test_faults_overwrite.py has the other cases)
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("keep me")
    capsys.readouterr()
    assert main(fault_args(work, tiny_model_dir, other, 1) + ["--overwrite"]) == 2
    assert "not written by tether" in capsys.readouterr().err
    assert (other / "thesis.tex").read_text() == "keep me"


def test_overwrite_option_is_validated():
    with pytest.raises(ConfigError, match="run.overwrite=true needs run.output_dir"):
        load_config(None, {"run.overwrite": True})
    assert load_config(None, {"run.overwrite": True, "run.output_dir": "x"}).run.overwrite is True


def test_bad_config_data_or_model_leaves_no_run_dir(work, tiny_model_dir, tmp_path, monkeypatch):
    """The data rows, the reward spec and the model are checked / loaded before anything stays in the
    run directory, so the user's corrected rerun is not refused as 'not empty'."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "1"}\n{"question": "b"}\n')
    run = tmp_path / "run"
    with pytest.raises(Exception, match="bad.jsonl"):
        train(cfg_for(work, tiny_model_dir, 1, **{"data.task": str(bad)}), run, log=quiet)
    assert not run.exists()
    with pytest.raises(Exception, match="nope"):
        train(cfg_for(work, tiny_model_dir, 1, **{"data.reward": f"{work / 'rew.py'}:nope"}), run, log=quiet)
    assert not run.exists()
    import tether.models

    def no_such_model(*a, **k):
        raise OSError("cannot load the model")

    monkeypatch.setattr(tether.models, "load_model", no_such_model)
    with pytest.raises(OSError, match="cannot load the model"):
        train(cfg_for(work, tiny_model_dir, 1), run, log=quiet)
    assert not run.exists()
    existing = tmp_path / "made_by_user"
    existing.mkdir()
    with pytest.raises(OSError, match="cannot load the model"):
        train(cfg_for(work, tiny_model_dir, 1), existing, log=quiet)
    assert existing.is_dir() and not any(existing.iterdir())  # emptied of what the run wrote, not removed


def test_a_locked_run_dir_is_refused_at_once(work, tiny_model_dir, base_run, tmp_path, monkeypatch):
    """A second trainer, fresh or --resume, fails before its model load, naming the directory and
    the pid that holds the lock; the lock goes away with its holder."""
    from tether.rundir.guard import RunLock

    run = copy_run(base_run, tmp_path / "run")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    locks = [RunLock(run), RunLock(fresh)]
    for lk in locks:
        lk.acquire()
    no_model_load(monkeypatch)
    for call in (lambda: resume(run, log=quiet), lambda: train(cfg_for(work, tiny_model_dir, 1), fresh, log=quiet)):
        with pytest.raises(RunError) as e:
            call()
        assert "in use by another trainer" in str(e.value) and f"pid {os.getpid()}" in str(e.value)
    assert (fresh / ".lock").exists() and [p.name for p in fresh.iterdir()] == [".lock"]  # untouched
    for lk in locks:
        lk.release()
    assert not (run / ".lock").exists()


def test_lock_is_released_when_training_raises(work, tiny_model_dir, tmp_path, monkeypatch):
    import tether.train as train_mod

    def boom(self):
        raise RuntimeError("step failed")

    monkeypatch.setattr(train_mod.Trainer, "train_step", boom)
    with pytest.raises(RuntimeError, match="step failed"):
        train(cfg_for(work, tiny_model_dir, 1), tmp_path / "run", log=quiet)
    assert (tmp_path / "run" / "config.yaml").is_file() and not (tmp_path / "run" / ".lock").exists()
    from tether.rundir.guard import RunLock

    lock = RunLock(tmp_path / "run")
    lock.acquire(warn=lambda msg: pytest.fail(f"the lock was left behind: {msg}"))
    lock.release()


def test_stale_lock_of_a_killed_trainer_is_taken_over(tmp_path):
    """A process that holds the lock blocks others; once it is killed (kill -9: nothing is cleaned
    up, its lock file stays), the next trainer takes the lock over with a warning naming its pid."""
    from tether.rundir.guard import RunLock

    code = ("import sys, time; from tether.rundir.guard import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print('locked', flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         env=subprocess_env())
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(RunError, match=f"in use by another trainer \\(pid {p.pid} "):
            RunLock(tmp_path).acquire()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == p.pid
    warnings = []
    lock = RunLock(tmp_path)
    lock.acquire(warn=warnings.append)
    assert len(warnings) == 1 and f"stale lock of pid {p.pid}" in warnings[0]
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / ".lock").exists()


def test_lock_without_flock_falls_back_to_the_pid(tmp_path, monkeypatch):
    """On a filesystem without flock the lock file's pid decides: a live one blocks, a dead one is taken over."""
    import fcntl
    import socket

    from tether.rundir.guard import RunLock

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    try:
        (tmp_path / ".lock").write_text(json.dumps({"pid": live.pid, "host": socket.gethostname()}))
        with pytest.raises(RunError, match=f"pid {live.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        live.kill()
        live.wait(timeout=60)
    (tmp_path / ".lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    warnings = []
    lock = RunLock(tmp_path)
    lock.acquire(warn=warnings.append)
    assert f"stale lock of pid {dead.pid}" in warnings[0]
    lock.release()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions (the monkeypatched test covers it)")
def test_read_only_run_dir_is_a_clean_error(work, tiny_model_dir, tmp_path, monkeypatch, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    no_model_load(monkeypatch)
    try:
        for out in (ro, ro / "run"):  # a read-only run directory, an unwritable parent
            assert main(fault_args(work, tiny_model_dir, out, 1)) == 2
            assert str(out) in error_line(capsys.readouterr().err)
    finally:
        ro.chmod(0o700)


def test_unwritable_run_dir_is_a_clean_error_monkeypatched(work, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The read-only case as the kernel reports it to a non-root user (EACCES on creating a file or a
    directory), injected so that it also runs as root."""
    real_open, real_mkdir = os.open, Path.mkdir
    ro = tmp_path / "ro"
    ro.mkdir()

    def open_(path, flags, *a, **k):
        if str(path).startswith(str(ro)) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **k)

    def mkdir(self, *a, **k):
        if str(self).startswith(str(ro) + os.sep):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    no_model_load(monkeypatch)
    for out in (ro, ro / "run"):
        assert main(fault_args(work, tiny_model_dir, out, 1)) == 2
        err = error_line(capsys.readouterr().err)
        assert err.startswith("tether: error: cannot use run directory") and str(out) in err
        assert "Permission denied" in err
    assert not any(ro.iterdir())


# ---------------------------------------------------------------- 3./4. resume


def test_failed_resume_leaves_config_untouched(work, tiny_model_dir, base_run, tmp_path):
    """A resume with an override that breaks at restore (another model: other shapes) is a RunError naming
    the checkpoint and tensor, config.yaml stays byte-identical, and a plain resume then works."""
    run = copy_run(base_run, tmp_path / "run")
    before = (run / "config.yaml").read_bytes()
    other = make_tiny_model_dir(tmp_path / "wider", hidden_size=48)
    with pytest.raises(RunError, match=r"checkpoints/step-000002.*tensor '.*' has shape"):
        resume(run, {"model.name": str(other), "train.steps": 3}, log=quiet)
    assert (run / "config.yaml").read_bytes() == before
    assert not (run / ".lock").exists()
    resume(run, {"train.steps": 3}, log=quiet)
    assert [r["step"] for r in rows(run)] == [1, 2, 3]
    assert load_config(str(run / "config.yaml")).train.steps == 3  # written once the restore worked


def test_resume_problems_are_clean_errors(work, tiny_model_dir, base_run, tmp_path, capsys):
    nothing = tmp_path / "nothing"
    empty = tmp_path / "empty"
    empty.mkdir()
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    shutil.copy(base_run / "config.yaml", no_ckpt / "config.yaml")
    for d, what in ((nothing, "no such directory"), (empty, "no config.yaml"), (no_ckpt, "no checkpoint")):
        with pytest.raises(RunError, match=what):
            resume(d, log=quiet)
        capsys.readouterr()
        assert main(["train", "--resume", str(d)]) == 2
        err = error_line(capsys.readouterr().err)
        assert str(d) in err and what in err, err
    # a corrupt state.json in a checkpoint saved before manifests existed (nothing to verify it against)
    legacy = copy_run(base_run, tmp_path / "legacy")
    for ck in (legacy / "checkpoints").iterdir():
        if ck.is_dir():
            (ck / "manifest.json").unlink()
            (ck / "state.json").write_text('{"step": 2, "trainer": {')
    with pytest.raises(RunError, match=r"step-000002.*state.json|state.json.*step-000002"):
        resume(legacy, log=quiet)
    with pytest.raises(ConfigError, match="run.overwrite"):
        resume(legacy, {"run.overwrite": True}, log=quiet)


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
    import tether.rundir.checkpoint as ck

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


# ---------------------------------------------------------------- 6. disk full


ENOSPC_AT = ["policy.safetensors", "state.json", "latest", "metrics.jsonl"]


@pytest.mark.parametrize("where", ENOSPC_AT)
def test_disk_full_stops_cleanly_and_resume_matches(where, work, tiny_model_dir, base_run, tmp_path, monkeypatch,
                                                    capsys):
    """The disk fills while step 2 is written (a checkpoint file, the `latest` pointer, a metrics row): the
    CLI exits 2 with one line naming the path, no partial checkpoint is loadable, the log holds no torn
    row that blocks resume, and once space is freed --resume ends as the uninterrupted run."""
    import tether.metrics as mt
    import tether.rundir.checkpoint as ck

    run = tmp_path / "run"
    real_save, real_text, real_write = ck.save_file, ck._write_text_atomic, mt.JsonlWriter.write

    def save_file(tensors, path):  # what safetensors raises when the disk is full
        if Path(path).name == where and "step-000002" in str(path):
            from safetensors import SafetensorError
            raise SafetensorError(f'Error while serializing: I/O error: No space left on device (os error 28) '
                                  f'at path "{path}"')
        real_save(tensors, path)

    def write_text(path, text):
        if path.name == where and "step-000002" in str(path) + text:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_text(path, text)

    def write(self, row):  # the row is torn by the full disk (as a kill would leave it)
        if self.path.name == where and row.get("step") == 2:
            with open(self.path, "a") as f:
                f.write(json.dumps(row)[:30])
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, row)

    monkeypatch.setattr(ck, "save_file", save_file)
    monkeypatch.setattr(ck, "_write_text_atomic", write_text)
    monkeypatch.setattr(mt.JsonlWriter, "write", write)
    assert main(fault_args(work, tiny_model_dir, run, 2)) == 2
    err = error_line(capsys.readouterr().err)
    assert err.startswith("tether: error: cannot write ") and str(run) in err and f"--resume {run}" in err
    assert "No space left on device" in err
    if where in ("policy.safetensors", "state.json"):
        assert f"step-000002.tmp-{os.getpid()}/{where}" in err
    assert not any(".tmp-" in p.name for p in (run / "checkpoints").iterdir())  # no partial checkpoint left
    want = 2 if where == "latest" else 1  # `latest` is written after step-2 is complete
    assert latest_checkpoint(run) == run / "checkpoints" / f"step-{want:06d}"
    assert not (run / ".lock").exists()
    monkeypatch.undo()  # space is freed
    resume(run, log=quiet)
    assert_same_run(run, base_run, 2)


def test_disk_full_for_real_in_a_subprocess(work, tiny_model_dir, tmp_path):
    """A real write failure, not a mock: a file-size limit (EFBIG) that the first checkpoint exceeds,
    as safetensors reports it. The CLI exits 2 with one line naming the file; nothing partial stays."""
    run = tmp_path / "run"
    code = ("import resource, sys; from tether.cli import main; "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, *fault_args(work, tiny_model_dir, run, 2)], capture_output=True,
                       text=True, env=subprocess_env(), timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    err = error_line(r.stderr)
    assert "File too large" in err and "policy.safetensors" in err and f"--output-dir {run} --overwrite" in err, err
    assert not any((run / "checkpoints").iterdir()) and [r["step"] for r in rows(run)] == [1]


# ---------------------------------------------------------------- 7. two trainers at once


@pytest.mark.slow  # about 35 s: out of the default suite's 15 minutes, run by CI's slow step (and -m faults)
def test_two_concurrent_trainers(work, tiny_model_dir, tmp_path):
    """Two `tether train` processes started together on one directory: exactly one trains, the other
    exits 2 at once naming the holder's pid; a --resume meanwhile is refused too; the survivor's run
    is intact. The reward holds the winner at step 2 until the test lets it go."""
    run, flag = tmp_path / "run", tmp_path / "go"
    args = fault_args(work, tiny_model_dir, run, 3, **{"data.reward": f"{work / 'rew.py'}:hold_after_first_step"})
    e = {**subprocess_env(), "TETHER_TEST_FLAG": str(flag)}
    procs = [subprocess.Popen([sys.executable, "-m", "tether", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=e) for _ in range(2)]
    try:
        deadline = time.time() + 240
        while all(p.poll() is None for p in procs) and time.time() < deadline:
            time.sleep(0.2)
        loser = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not loser)
        out, err = loser.communicate(timeout=60)
        assert loser.returncode == 2, out + err
        assert "in use by another trainer" in err and f"pid {winner.pid} " in err and str(run) in err, err
        assert winner.poll() is None
        while not (run / "checkpoints" / "step-000001").is_dir() and time.time() < deadline:
            time.sleep(0.2)
        with pytest.raises(RunError, match=f"in use by another trainer \\(pid {winner.pid} "):
            resume(run, log=quiet)
    finally:
        flag.write_text("go")
        for p in procs:
            try:
                p.wait(timeout=240)
            except subprocess.TimeoutExpired:
                p.kill()
    out, err = winner.communicate()
    assert winner.returncode == 0, out + err
    assert [r["step"] for r in rows(run)] == [1, 2, 3]
    assert latest_checkpoint(run) == run / "checkpoints" / "step-000003"
    assert not (run / ".lock").exists()
