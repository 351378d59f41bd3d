"""A run directory's protection: one trainer at a time, a fresh run only into an empty directory,
a resume that fails leaves the run as it was, write failures end as clean errors.

What ``tether.train.train`` / ``resume`` do with a run directory ``RUN`` (through `RunDirectory`):

* **Validate first.** ``tether.assemble.build_parts`` loads the data rows, the reward spec and the agent's
  tools, then calls :meth:`RunDirectory.open`, then loads the model. A bad config, data file or
  reward leaves no directory behind (a rerun would be refused as "not empty"); a directory that
  cannot be created or written is a `RunError` before the slow model load. A fresh run whose
  trainer cannot be built (e.g. the model does not load) removes what it made.
* **Lock.** ``RUN/.lock`` (`RunLock`) keeps a second trainer out, fresh or ``--resume``: it fails
  at once with a `RunError` naming the directory and the holder's pid. Released when the run
  ends, also by an exception. Under torchrun only rank 0 takes it.
* **Fresh runs** refuse a directory that holds anything (but a lock file) unless
  ``run.overwrite`` (``tether train --overwrite``), which replaces only a run tether wrote, and
  only when nothing else is in it (the rule of `tether.rundir.owned`: the ``.tether.json`` marker, and
  every entry one a run writes): a mistyped ``--output-dir $HOME``, or a directory of yours that
  holds a ``config.yaml``, is never emptied. The old run is moved aside and deleted only once the
  new trainer is built (the model loaded); if that fails it is put back. ``config.yaml`` and the
  marker are written as the directory is opened.
* **Resume** (`resume_config`, `resume_checkpoint`): a missing directory, config.yaml or checkpoint is
  a `RunError` before the model loads; the checkpoint is the newest that passes its manifest
  (``tether.rundir.checkpoint.latest_checkpoint``). ``config.yaml`` is rewritten with the overrides only
  after the checkpoint has been restored (:meth:`RunDirectory.save_config`), atomically.
* **Write errors** while training (disk full, quota, read-only, permissions) become a `RunError`
  naming the path (:meth:`RunDirectory.write_errors`); the checkpoint and log writers leave no
  partial checkpoint and no torn row, so ``--resume`` continues once space is freed.
* **An environment that fails at once.** A user's environment is first run at the first step (its
  ``step`` needs the policy's turns). If it breaks its contract there (an `EnvError`) before that
  step is logged, a fresh run removes what it wrote (:meth:`RunDirectory.discard_unstarted`): there
  is nothing to resume, and a half-made directory would only block the rerun. A later failure keeps
  the run, as any other error does.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from .. import distributed as dist
from ..errors import ConfigError, EnvError, OutputError, RunError
from ..metrics import warn, write_text_atomic
from ..sections import as_dict
from ..userio import loads_json
from .checkpoint import checkpoints, pid_alive
from .owned import MARKER, RUN_KINDS, check_replaceable, is_run_dir, run_kind, write_marker
from .reader import RunDir
from .stop import resume_hint

LOCK_NAME = ".lock"
ASIDE_PREFIX = ".tether-replaced-"  # owned.RUN_NAMES lists it: a killed --overwrite's leftover is tether's

#: OSError codes that mean "this directory cannot be written" rather than a bug.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}

# flock errors of filesystems that do not support it (some network mounts)
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def write_config(cfg, path: Path) -> None:
    """``config.yaml`` as tether writes it: the resolved config (a pydantic section) as the YAML of the keys users
    write (loadable with ``--config``), atomically (never half a file). ``tether.resolve.save_config``."""
    write_text_atomic(path, yaml.safe_dump(as_dict(cfg), sort_keys=False))


class RunLock:
    """``RUN/.lock``: an exclusive ``fcntl.flock`` held while a trainer runs; the file names the holder.

    Why flock rather than a file created with ``O_CREAT|O_EXCL`` alone: the kernel drops a flock
    when its holder dies in any way (kill -9, OOM kill, power loss of a local disk), so a dead
    trainer never blocks the next one and a recycled pid cannot pass for a live trainer; and
    there is no take-over race between two trainers that find the same stale file. The file's
    content (pid, host, start time) makes the error message; content left by a holder that died
    is reported as a stale lock taken over. On a filesystem without flock the content decides:
    a lock of another host, or of a live pid on this one, is respected; one of a dead pid is
    taken over. The holder unlinks the file when it releases; a trainer that opened the old
    file just before sees a different inode at the path and retries.
    """

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self, warn: Callable[[str], None] = warn) -> None:
        """Take the lock or raise `RunError` naming the directory and the holder's pid."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                locked = _flock(fd)
                if locked is False:
                    raise RunError(self._busy(_read_holder(fd, wait=True)))
                try:
                    current = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    current = False
            except BaseException:
                os.close(fd)
                raise
            if current:
                break
            os.close(fd)  # the holder released (and unlinked) the file between our open and our flock
        try:
            holder = _read_holder(fd)
            me = {"pid": os.getpid(), "host": socket.gethostname()}
            if holder and (holder.get("pid"), holder.get("host")) != (me["pid"], me["host"]):
                if locked is None and (holder.get("host") != me["host"] or pid_alive(int(holder.get("pid", 0)))):
                    raise RunError(self._busy(holder))  # no flock here: trust the file
                warn(f"{self.path}: took over a stale lock of pid {holder.get('pid')} on {holder.get('host')} "
                     f"(that trainer is gone: killed or crashed)")
            data = json.dumps({**me, "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def _busy(self, holder: dict) -> str:
        who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}" if holder
               else "a process that has not written its pid yet")
        since = f", since {holder['since']}" if holder.get("since") else ""
        return (f"run directory {self.run_dir} is in use by another trainer ({who}{since}; lock {self.path}): "
                f"wait for it to end or stop it, or use another --output-dir")

    def release(self) -> None:
        """Unlink the lock file (while still holding it) and drop the lock; a no-op when not held."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


def _flock(fd: int) -> Optional[bool]:
    """True: locked; False: another process holds it; None: this filesystem has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return None
        raise
    return True


def _read_holder(fd: int, wait: bool = False) -> dict:
    """The lock file's content ({} when empty or unreadable); ``wait``: give a holder that has just
    taken the lock a moment to write its name."""
    for _ in range(20 if wait else 1):
        raw = os.pread(fd, 4096, 0)
        if raw:
            try:
                out = loads_json(raw)
                return out if isinstance(out, dict) else {}
            except ValueError:
                pass  # being written, or not ours
        if wait:
            time.sleep(0.05)
    return {}


class RunDirectory:
    """One trainer's hold on its run directory: created, locked and checked by :meth:`open`, released
    by :meth:`release` (or undone by :meth:`abandon` when the trainer could not be built).

    ``fresh``: a new run, which needs an empty (or new) directory unless ``overwrite``; otherwise the
    resume of the run in it. ``kind``: ``"run"`` (``tether train``) or ``"sft"`` (``tether sft``), the
    marker written (`tether.rundir.owned`): ``--overwrite`` replaces only a run of the same kind. Under torchrun
    every rank calls :meth:`open`; rank 0 does the work and the others raise the same `RunError` if it fails.
    """

    def __init__(self, path: Path, *, fresh: bool, overwrite: bool = False, log: Callable[..., Any] = print,
                 kind: str = "run"):
        assert kind in RUN_KINDS, kind
        self.path = Path(path)
        self.fresh, self.overwrite, self.log, self.kind = fresh, overwrite, log, kind
        self.lock = RunLock(self.path)
        self._created = False  # this process made the directory
        self._wrote_config = self._wrote_marker = False
        self._aside: Optional[Path] = None  # the previous run, moved aside by run.overwrite until commit()

    def open(self, cfg) -> None:
        """Create (fresh run), lock and check the directory; a fresh run writes config.yaml."""
        err = None
        if dist.is_main():
            try:
                self._open(cfg)
            except RunError as e:
                err = e
        if dist.enabled():  # the other ranks must not go on to load the model (and hang in a collective)
            msg = dist.all_gather_objects(None if err is None else str(err))[0]
            if msg is not None and err is None:
                err = RunError(msg)
        if err is not None:
            raise err

    def _open(self, cfg) -> None:
        p = self.path
        try:
            if self.fresh:
                try:
                    p.mkdir(parents=True)
                    self._created = True
                except FileExistsError:
                    if not p.is_dir():
                        raise RunError(f"run directory {p} exists and is not a directory") from None
            elif not p.is_dir():
                what = "a file, not a run directory" if p.exists() else "no such directory"
                raise RunError(f"cannot resume {p}: {what}")
            self.lock.acquire()
            if self.fresh:
                old = sorted(e.name for e in p.iterdir() if e.name != LOCK_NAME)
                if old:
                    if not self.overwrite:
                        shown = ", ".join(old[:5]) + (", ..." if len(old) > 5 else "")
                        if not is_run_dir(p):  # a directory of the user's, or a part of a run: nothing to resume
                            raise RunError(f"run directory {p} is not empty ({shown}) and holds no tether run (no "
                                           f"config.yaml) to continue or replace; choose another --output-dir")
                        raise RunError(
                            f"run directory {p} is not empty ({shown}); a fresh run would mix with what is "
                            f"there. To continue that run: {resume_hint(p)}; to start a new one: "
                            f"another --output-dir; to replace it: --overwrite (run.overwrite=true)")
                    self._set_aside(old)
                write_marker(p, self.kind)
                self._wrote_marker = True
                self.save_config(cfg)
                self.log(f"[tether] run directory: {p}")
        except OSError as e:
            raise RunError(f"cannot use run directory {p}: {e.strerror or e} ({e.filename or p}); make it "
                           f"writable or choose another --output-dir") from None

    def _set_aside(self, names: list[str]) -> None:
        """run.overwrite: move the previous run's entries into ``RUN/.tether-replaced-<pid>/``, after
        `tether.rundir.owned.check_replaceable` has found that every one of them is tether's. They are deleted
        by :meth:`commit` once the new trainer is built, and put back by :meth:`abandon` if it cannot be
        (e.g. the model does not load): a failed ``--overwrite`` loses nothing."""
        try:
            check_replaceable(self.path, self.kind, ignore=(LOCK_NAME,))  # our own lock is not the user's entry
        except OutputError as e:
            raise RunError(str(e)) from None
        aside = self.path / f"{ASIDE_PREFIX}{os.getpid()}"
        aside.mkdir()
        self._aside = aside
        for name in names:
            if name != aside.name:
                os.rename(self.path / name, aside / name)

    def commit(self) -> None:
        """The new trainer is built: delete the previous run set aside by ``run.overwrite`` (rank 0)."""
        if self._aside is None:
            return
        n = sum(1 for _ in self._aside.iterdir())
        shutil.rmtree(self._aside)
        self._aside = None
        self.log(f"[tether] run.overwrite: deleted the previous run in {self.path} ({n} entries)")

    def save_config(self, cfg) -> None:
        """Write ``RUN/config.yaml`` atomically (rank 0). ``run.overwrite`` is saved false: it was an
        action on the directory, and a rerun of the saved config must not delete the run."""
        if not dist.is_main():
            return
        write_config(cfg.model_copy(update={"run": cfg.run.model_copy(update={"overwrite": False})}),
                     self.path / "config.yaml")
        self._wrote_config = True

    def abandon(self) -> None:
        """The trainer could not be built: a fresh run removes what :meth:`open` made; then release."""
        held = self.lock.held
        if self.fresh and held:
            for name in (("config.yaml",) if self._wrote_config else ()) + ((MARKER,) if self._wrote_marker else ()):
                with contextlib.suppress(OSError):
                    (self.path / name).unlink()
        if self._aside is not None:  # a failed --overwrite: the previous run goes back where it was
            for e in self._aside.iterdir():
                os.rename(e, self.path / e.name)
            self._aside.rmdir()
            self._aside = None
            self.log(f"[tether] run.overwrite failed: the previous run in {self.path} is left as it was")
        self.release()
        if self.fresh and held and self._created:
            with contextlib.suppress(OSError):
                self.path.rmdir()  # only if empty: nothing else was ever written there

    def release(self) -> None:
        self.lock.release()

    def discard_unstarted(self) -> bool:
        """A fresh run that stopped before its first step was logged (no metrics row, no checkpoint): remove what
        it wrote, and the directory if this run created it (rank 0; then the lock is released). True if removed.
        Nothing is removed unless every entry is one a run writes (`tether.rundir.owned`)."""
        p = self.path
        if not (self.fresh and self.lock.held and dist.is_main()) or checkpoints(p):
            return False
        try:
            if (p / "metrics.jsonl").is_file() and (p / "metrics.jsonl").stat().st_size:
                return False
            names = check_replaceable(p, self.kind, ignore=(LOCK_NAME,))
            for name in names:
                (shutil.rmtree if (p / name).is_dir() and not (p / name).is_symlink() else os.unlink)(p / name)
        except (OSError, OutputError):
            return False
        self.release()
        if self._created:
            with contextlib.suppress(OSError):
                p.rmdir()
        what = "removed the run directory" if self._created else "removed what the run wrote in"
        self.log(f"[tether] {what} {p}: the run stopped before its first step")
        return True

    @contextlib.contextmanager
    def write_errors(self):
        """Disk full, quota, read-only or permission errors on a path of the run: a `RunError` naming it. And an
        environment that breaks its contract before the first step is logged: the fresh run is discarded
        (:meth:`discard_unstarted`) and the `EnvError` goes on."""
        try:
            yield
        except EnvError:
            self.discard_unstarted()
            raise
        except OSError as e:
            if e.errno not in WRITE_ERRNOS or not self._inside(e.filename):
                raise
            if checkpoints(self.path):
                then = f"continue from its last checkpoint: {RUN_KINDS[self.kind]} --resume {self.path}"
            else:  # nothing to resume from: --resume would refuse
                then = (f"start it again (it has no checkpoint to resume from yet): {RUN_KINDS[self.kind]} ... "
                        f"--output-dir {self.path} --overwrite")
            raise RunError(f"cannot write {e.filename or self.path}: {e.strerror or os.strerror(e.errno)}; the run "
                           f"stopped. Free space (or fix permissions), then {then}") from e

    def _inside(self, filename) -> bool:
        if not filename:
            return True
        try:
            Path(os.fsdecode(filename)).resolve().relative_to(self.path.resolve())
        except ValueError:
            return False
        return True


def resumed_values(run_dir: Path, overrides: Optional[dict], kind: str) -> tuple[dict, dict]:
    """``(saved config.yaml as a mapping, overrides)`` of the ``kind`` run (``"run"`` / ``"sft"``) in
    ``run_dir``, for a resume: the checks a training run and an SFT run share.

    Raises `RunError` for a missing directory or config.yaml, a run of the other kind (naming the
    command that resumes it), a run without checkpoint; `ConfigError` for ``run.overwrite`` or another
    ``run.output_dir`` among the overrides.
    """
    run = _reader(run_dir).open()
    run_dir = run.path
    actual = run_kind(run_dir)
    if actual != kind:
        what = {"run": "a training run", "sft": "an SFT run"}[actual]
        raise RunError(f"cannot resume {run_dir} with {RUN_KINDS[kind]}: it is {what}; resume it with: "
                       f"{resume_hint(run_dir)}")
    saved = run.raw_config()  # unreadable, not UTF-8, not YAML, not a mapping: named with the line
    overrides = dict(overrides or {})
    if "run.overwrite" in overrides:
        raise ConfigError("run.overwrite (--overwrite) starts a fresh run in a used directory; --resume continues "
                          "the run in place: drop one of them")
    if not run.has_checkpoint():
        raise RunError(run.no_checkpoint())
    given = overrides.get("run.output_dir")
    if given not in (None, "") and Path(str(given)).resolve() != run_dir.resolve():
        raise ConfigError(f"run.output_dir={given} cannot apply to --resume {run_dir}: a resumed run stays in its "
                          f"own directory; drop the override")
    return saved, overrides


def _reader(run_dir: Path):
    return RunDir(run_dir, verb="resume", error=RunError)


def restore_latest(run_dir: Path, restore: Callable[[Path], None], guard: Optional[RunDirectory], cfg) -> Path:
    """Resume a run in place: ``restore`` its newest valid checkpoint (`resume_checkpoint`), then have
    ``guard`` rewrite config.yaml with the resumed ``cfg``: only now, so a resume that fails leaves
    config.yaml as it was. Returns the checkpoint."""
    ckpt = resume_checkpoint(run_dir)  # the newest that verifies; RunError if none
    restore(ckpt)
    if guard is not None:
        guard.save_config(cfg)
    return ckpt


def resume_checkpoint(run_dir: Path) -> Path:
    """The checkpoint to resume from: the newest that passes its manifest (older ones if it is damaged).

    Rank 0 verifies (it reads every file once; `tether.rundir.reader.RunDir.checkpoint`) and the other ranks
    get its choice. Raises `RunError` if there is none or none is valid.
    """
    found, err = None, None
    if dist.is_main():
        try:
            found = str(_reader(run_dir).checkpoint())
        except RunError as e:
            err = str(e)
    if dist.enabled():
        found, err = dist.all_gather_objects((found, err))[0]
    if err is not None:
        raise RunError(err)
    return Path(found)
