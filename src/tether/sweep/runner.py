"""Running a sweep's share of runs: ``tether train`` subprocesses in lanes, resumable, with records.

* **Lanes.** At most ``lanes`` runs at once, each a ``python -m tether train`` process with ``threads``
  threads (OMP_NUM_THREADS / MKL_NUM_THREADS / OPENBLAS_NUM_THREADS; torch takes its intra-op thread
  count from OMP_NUM_THREADS) and TOKENIZERS_PARALLELISM=false. Runs start in sorted (arm, seed) order.
* **What each run does** (`action`): a run with a ``done`` record is never run again; one with a
  ``failed`` record is skipped (reported as failed) unless ``retry_failed``; any other run continues
  from its newest checkpoint (``tether train --resume RUN``) when it has one, else starts afresh
  (``--overwrite`` where a killed attempt left a run directory without a checkpoint).
* **Done** means: exit status 0 and metrics.jsonl has the row of the last step (``train.steps``)
  carrying the final held-out evaluation (``eval/...`` keys) when the run evaluates after training.
  Exit 0 without that row is a failure. Exit 130 / 143 (the run stopped on SIGINT / SIGTERM after a
  checkpoint) is neither: no record is written, and the next ``tether sweep`` resumes it.
* **Kills.** Each child runs in its own session and gets SIGKILL when the sweep dies (Linux
  PR_SET_PDEATHSIG), so a ``kill -9`` of the sweep leaves no trainer running with the run's lock; the
  next ``tether sweep`` resumes the runs it killed. SIGINT / SIGTERM to the sweep forwards one SIGTERM
  to every running child (each finishes its step, checkpoints and exits), waits for them, and exits
  130 / 143; a second signal kills the children at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import tether

from ..errors import OutputError, RunError
from ..procs import die_with_parent
from ..userio import claim_output_dir
from . import layout

STOPPED_CODES = (130, 143)  # tether train stopped on SIGINT / SIGTERM, checkpoint written: resume later
TAIL_LINES = 30


def action(out: Path, arm: str, seed: int, retry_failed: bool) -> str:
    """What run (arm, seed) needs: ``done`` / ``failed`` (skip), ``resume``, ``overwrite`` or ``fresh``."""
    rec = layout.read_record(out, arm, seed)
    if rec is not None and (rec["state"] == layout.DONE or not retry_failed):
        return rec["state"]
    from ..rundir.checkpoint import checkpoints  # deferred: pulls in torch

    rd = layout.run_dir(out, arm, seed)
    if any((p / "state.json").is_file() for p in checkpoints(rd)):  # complete checkpoints (not step-N.tmp-PID)
        return "resume"
    return "overwrite" if rd.exists() and any(rd.iterdir()) else "fresh"


def train_command(spec, arm: str, seed: int, out: Path, act: str) -> list[str]:
    """The ``tether train`` arguments (after ``python -m tether``) of run (arm, seed) for action ``act``."""
    rd = str(layout.run_dir(out, arm, seed))
    if act == "resume":
        return ["train", "--resume", rd]
    return ["train", *spec.train_args(spec.arm(arm), seed), f"run.output_dir={rd}", "run.progress=false",
            *(["--overwrite"] if act == "overwrite" else [])]


def final_row(run: Path, cfg) -> Optional[dict]:
    """The metrics row of the run's last step, if the run finished: the row of step ``train.steps``, holding
    ``eval/...`` keys when the run evaluates after training (``cfg``: its `tether.config.Config`)."""
    from ..metrics import read_jsonl  # deferred: pulls in torch
    from ..resolve import evaluating  # deferred: pulls in torch

    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = read_jsonl(path, warn=lambda _msg: None)[0]
    last = [r for r in rows if r.get("step") == cfg.train.steps]
    if not last:
        return None
    row = {k: v for r in last for k, v in r.items()}
    wants_eval = evaluating(cfg) and (cfg.eval.after or cfg.eval.every)
    if wants_eval and not any(k.startswith("eval/") for k in row):
        return None
    return row


def child_env(threads: int) -> dict:
    """The environment of a run's process: ``threads`` threads for OpenMP / MKL / OpenBLAS (torch's intra-op
    count follows OMP_NUM_THREADS), no tokenizer threads, this tether importable."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    src = str(Path(tether.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@dataclass
class Job:
    """A running ``tether train`` process and what its record needs."""

    arm: str
    seed: int
    act: str
    argv: list[str]
    proc: Any = None
    started: float = 0.0
    err_offset: int = 0
    files: list = field(default_factory=list)


def _start(job: Job, out: Path, env: dict) -> None:
    out_path, err_path = layout.log_paths(out, job.arm, job.seed)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fo, fe = open(out_path, "ab"), open(err_path, "ab")
    job.err_offset = fe.tell()
    job.files = [fo, fe]
    job.started = time.time()
    job.proc = subprocess.Popen([sys.executable, "-m", "tether", *job.argv], stdout=fo, stderr=fe,
                                stdin=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent(new_session=True))


def _tail(path: Path, offset: int, n: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.replace("\r", "\n").splitlines()[-n:])


def _finish(job: Job, rc: int, out: Path, cfg) -> Optional[dict]:
    """Write the record of a process that ended with ``rc``; returns it (None: stopped by a signal)."""
    for f in job.files:
        f.close()
    if rc in STOPPED_CODES:
        return None
    rec = {"arm": job.arm, "seed": job.seed, "returncode": rc, "action": job.act,
           "command": "tether " + " ".join(job.argv), "started": time.strftime(
               "%Y-%m-%d %H:%M:%S", time.localtime(job.started)), "wall_s": round(time.time() - job.started, 3),
           "run_dir": str(layout.run_dir(Path("."), job.arm, job.seed))}
    row, damage = None, None
    try:
        row = final_row(layout.run_dir(out, job.arm, job.seed), cfg) if rc == 0 else None
    except RunError as e:  # a damaged metrics.jsonl
        damage = str(e)
    if row is not None:
        rec.update(state=layout.DONE, final=row)
    else:
        tail = _tail(layout.log_paths(out, job.arm, job.seed)[1], job.err_offset)
        why = (f"exited with status {rc}" if rc != 0 else damage or f"exited 0 without the row of its last step "
               f"(step {cfg.train.steps}) and its final evaluation in metrics.jsonl")
        rec.update(state=layout.FAILED, error=why, stderr_tail=tail)
    layout.write_record(out, job.arm, job.seed, rec)
    return rec


class _Signals:
    """SIGINT / SIGTERM while the sweep runs: remember the first (and count them) instead of dying."""

    def __init__(self):
        self.got: list[int] = []

    def __enter__(self):
        self.old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        self.got.append(signum)

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)


def lock_path(out: Path, shard: tuple[int, int]) -> Path:
    return Path(out) / f".sweep-{shard[0]}-of-{shard[1]}.lock"


def share_lock(out: Path, shard: tuple[int, int]) -> tuple[int, bool]:
    """An exclusive flock on ``DIR/.sweep-I-of-N.lock`` held while this share runs: the same share started
    twice into one DIR is refused at once (OutputError), instead of two trainers racing for each run. The
    kernel drops the lock when the sweep dies, however it dies. Returns (fd, whether this call created the
    file). ``DIR`` must exist (`claim_sweep_dir`)."""
    import fcntl

    path = lock_path(out, shard)
    try:
        fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        fd, created = os.open(path, os.O_RDWR), False
    except OSError as e:
        raise OutputError(f"cannot write --out {out}: {e.strerror or e} ({path})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise OutputError(f"{out}: share {shard[0]}/{shard[1]} of this sweep is already running there (the lock "
                          f"{path.name} is held); wait for it or stop it") from None
    return fd, created


def claim_sweep_dir(out: Path) -> Path:
    """``--out DIR`` checked before anything runs (`tether.userio.claim_output_dir`): a directory (made if
    absent) that takes new files; an existing directory with a ``runs/`` of its own and no ``sweep.json`` (not a
    sweep's) is refused."""
    return claim_output_dir(out, "--out", owns=lambda p: (p / "sweep.json").is_file() or not (p / "runs").exists())


def run_sweep(spec, configs: dict, out: Path, runs: list[tuple[str, int]], *, lanes: int, threads: int = 1,
              retry_failed: bool = False, shard: tuple[int, int] = (1, 1), echo: Callable[[str], None] = print) -> int:
    """Run ``runs`` (this share's (arm, seed) list) of ``spec`` into sweep directory ``out``; ``configs``:
    arm -> its resolved Config (`tether.sweep.spec.check_arms`). Returns the exit status: 0 when every run
    of the share is done, 1 when one failed, 130 / 143 when stopped by SIGINT / SIGTERM. A DIR refused before
    its sweep.json is written keeps nothing of this call (not even the lock file)."""
    out = claim_sweep_dir(Path(out))
    fd, created = share_lock(out, shard)
    try:
        try:
            layout.write_sweep(out, spec)
        except BaseException:
            if created:
                lock_path(out, shard).unlink(missing_ok=True)
            raise
        return _run_share(spec, configs, out, runs, lanes, threads, retry_failed, echo)
    finally:
        os.close(fd)


def _run_share(spec, configs, out, runs, lanes, threads, retry_failed, echo) -> int:
    from tqdm import tqdm

    acts = {r: action(out, *r, retry_failed) for r in runs}
    todo = [Job(a, s, acts[(a, s)], train_command(spec, a, s, out, acts[(a, s)]))
            for a, s in runs if acts[(a, s)] not in (layout.DONE, layout.FAILED)]
    done = sum(v == layout.DONE for v in acts.values())
    failed = [r for r in runs if acts[r] == layout.FAILED]
    echo(f"[sweep] {out}: {len(runs)} run(s) in this share: {done} done, {len(failed)} failed before (skipped), "
         f"{len(todo)} to run in {min(lanes, max(len(todo), 1))} lane(s) of {threads} "
         f"thread(s)")
    env = child_env(threads)
    tqdm.monitor_interval = 0  # no monitor thread: children are forked (preexec_fn) from a single thread
    bar = tqdm(total=len(runs), initial=done, desc="sweep", unit="run", smoothing=0, file=sys.stderr,
               bar_format="{desc}: {n}/{total} done [{elapsed}<{remaining}]{postfix}", mininterval=1.0)
    running: list[Job] = []
    with _Signals() as sig:
        try:
            while (todo or running) and not sig.got:
                while todo and len(running) < lanes:
                    job = todo.pop(0)
                    _start(job, out, env)
                    running.append(job)
                time.sleep(0.1)
                for job in [j for j in running if j.proc.poll() is not None]:
                    running.remove(job)
                    rec = _finish(job, job.proc.returncode, out, configs[job.arm])
                    bar.write(_line(job, rec))
                    if rec is not None and rec["state"] == layout.FAILED:
                        failed.append((job.arm, job.seed))
                        bar.set_postfix_str(f"{len(failed)} failed", refresh=False)
                    bar.update(1)
        finally:
            code = _stop_children(running, sig, out, configs, bar)
            bar.close()
    if code:
        echo(f"[sweep] stopped ({signal.Signals(code - 128).name}); the same command resumes it")
        return code
    if failed:
        echo(f"[sweep] {len(failed)} run(s) failed (see each runs/<arm>/seed-<s>.err; --retry-failed re-runs "
             f"them): " + ", ".join(f"{a} seed {s}" for a, s in failed))
        return 1
    echo(f"[sweep] all {len(runs)} run(s) of this share are done: tether sweep report {out}")
    return 0


def _line(job: Job, rec: Optional[dict]) -> str:
    name = f"{job.arm} seed {job.seed}"
    if rec is None:
        return (f"[stopped] {name}: stopped by a signal; the next tether sweep continues it (from its checkpoint, "
                f"if it wrote one)")
    if rec["state"] == layout.DONE:
        evals = {k: v for k, v in rec["final"].items() if k.startswith("eval/") and "/avg@" in k}
        shown = ", ".join(f"{k} {v:.3f}" for k, v in evals.items() if isinstance(v, float))
        return f"[done] {name} ({rec['wall_s']:.1f} s{', ' + job.act if job.act == 'resume' else ''})" + (
            f": {shown}" if shown else "")
    last = rec["stderr_tail"].splitlines()[-1] if rec.get("stderr_tail") else ""
    return f"[FAILED] {name}: {rec['error']}" + (f": {last}" if last else "")


def _stop_children(running: list[Job], sig: _Signals, out: Path, configs: dict, bar) -> int:
    """On a stop signal: SIGTERM to each running child, wait for them (a second signal: SIGKILL); record
    those that finished anyway. Returns 128 + the first signal's number, or 0 when there was none."""
    if not sig.got and not running:
        return 0
    for job in running:
        job.proc.send_signal(signal.SIGTERM)
    seen = len(sig.got)
    while any(j.proc.poll() is None for j in running):
        if len(sig.got) > seen:
            for j in running:
                if j.proc.poll() is None:
                    j.proc.kill()
        time.sleep(0.1)
    for job in running:  # a run that finished meanwhile is recorded; one stopped or killed is resumed later
        if job.proc.returncode == 0:
            bar.write(_line(job, _finish(job, 0, out, configs[job.arm])))
        else:
            for f in job.files:
                f.close()
            bar.write(_line(job, None))
    return 128 + sig.got[0] if sig.got else 0
