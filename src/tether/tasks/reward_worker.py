"""A user reward in a worker process, with a time limit per call (``data.reward_timeout``).

Why a process. A reward call that hangs must not block training, and a hung Python call
cannot in general be stopped from inside its own process:

* a thread (run the call in a thread and stop waiting after the limit) abandons the call but
  cannot end it: an endless loop keeps a core, and half of the GIL, for the rest of the run,
  and every further hang adds another such thread;
* ``SIGALRM`` works in the main thread only and on Unix only, interrupts Python code only (not
  a long C call such as a regex match or a sympy simplification), and math-verify, which the
  ``math`` reward uses, already sets its own ``SIGALRM`` timer, which a second one would clobber;
* a process can be killed whatever it is doing. So the worker loads the reward from its spec
  string (the function need not be picklable), receives each step's responses in one message
  and sends one reply per call; when a reply does not come within the limit the worker is
  killed, that call scores 0 (a ``RewardFailure`` of kind ``"timeout"``), and a new worker
  scores the rest of the batch.

A reward that kills its worker (a segfault in a C extension, ``os._exit``, the OOM killer) costs
a restart per call. The first such crash is said once, as a warning; after ``MAX_CRASHES_IN_A_ROW``
calls in a row that crashed, the worker is not restarted again: every later call scores 0 without
being made and is a ``"crashed"`` failure too (the trainer counts them in ``reward_errors``), so a
broken reward costs a few restarts, not one per response for the rest of the run.

Costs: starting the worker (a fresh interpreter importing ``tether.tasks`` and the user's
module, about 0.3 s; again after each timeout or crash) and, per call, two pickles and two pipe hops
(tens of microseconds). The built-in rewards (arithmetic, gsm8k, math, search) do not use it:
they are tether's own bounded code and run in the trainer's process at no cost.

The worker is a plain ``python -m tether.tasks.reward_worker`` subprocess rather than a
``multiprocessing`` one: spawn re-imports the parent's ``__main__`` (a user's training script
without an ``if __name__ == "__main__":`` guard would start over in the worker), and fork
after torch has started its threads can deadlock. It reads pickled requests on its stdin and
writes pickled replies to a private copy of its stdout (the reward's own prints go to stderr),
ignores SIGINT (Ctrl-C is the trainer's to handle), and exits when the trainer closes the pipe
or dies.
"""

from __future__ import annotations

import functools
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Sequence

from ..errors import RewardError
from ..metrics import warn
from .base import Example
from .rewards import RewardFailure, is_builtin_reward, load_reward, score_one, score_responses

__all__ = ["MAX_CRASHES_IN_A_ROW", "RewardWorker", "reward_scorer"]

#: calls in a row that kill the worker after which it is not restarted again (see `RewardWorker`)
MAX_CRASHES_IN_A_ROW = 3

#: (texts, examples) -> (rewards, correct, failures), as ``tether.tasks.rewards.score_responses``
Scorer = Callable[[Sequence[str], Sequence[Example]], "tuple[list[float], list[bool], list[RewardFailure]]"]


def reward_scorer(spec: str, format_weight: float = 0.0, timeout: float = 0.0) -> Scorer:
    """How the trainer scores a step: the reward ``spec`` in a :class:`RewardWorker` with
    ``timeout`` seconds per call when it is a user reward (``module:function`` /
    ``file.py:function``) and ``timeout > 0``; otherwise in this process, with no limit.

    Raises:
        RewardError: the spec cannot be loaded (raised before anything else runs).
    """
    if timeout > 0 and not is_builtin_reward(spec):
        return RewardWorker(spec, format_weight=format_weight, timeout=timeout).score
    return functools.partial(score_responses, load_reward(spec, format_weight=format_weight))


class RewardWorker:
    """Scores responses with the reward ``spec`` in a worker process, at most ``timeout`` seconds
    per call (see the module docstring).

    Args:
        spec: a reward spec for :func:`tether.tasks.rewards.load_reward` (loaded in the worker,
            with this process's ``sys.path`` and working directory).
        format_weight: as for ``load_reward``.
        timeout: seconds per call (> 0).
        max_crashes: calls in a row that kill the worker after which it is not restarted again;
            every later call then scores 0, unmade, with a ``"crashed"`` failure (``gave_up``).
        warn: where the two warnings go (the first crash, and giving up; each said once);
            default ``tether.metrics.warn`` (one ``tether: warning:`` line on stderr).

    Raises:
        RewardError: the spec does not load (the message ``load_reward`` gives in the worker).

    ``restarts`` counts the workers started after a timeout or a crash; ``crashes`` the calls
    during which the worker died; ``gave_up`` is True once ``max_crashes`` came in a row (a call
    that returns, or times out, ends a row).
    """

    def __init__(self, spec: str, format_weight: float = 0.0, timeout: float = 10.0,
                 max_crashes: int = MAX_CRASHES_IN_A_ROW, warn: Callable[[str], None] | None = None):
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        if max_crashes < 1:
            raise ValueError(f"max_crashes must be >= 1, got {max_crashes!r}")
        self.spec, self.format_weight, self.timeout = spec, float(format_weight), float(timeout)
        self.max_crashes, self._warn = int(max_crashes), warn
        self.restarts = self.crashes = self._crashes_in_row = 0
        self.gave_up = False
        self._start_s = 0.0  # how long the last worker took to start and load the reward
        self._live: list = [None]  # the running worker (a Popen), shared with the finalizer
        self._replies: queue.Queue = queue.Queue()
        weakref.finalize(self, _stop, self._live)  # the worker ends with this object (or at exit)
        self._start()

    # ------------------------------------------------------------ the worker's life

    def _start(self) -> None:
        """Start a worker and wait until it has loaded the reward (no limit: imports may be slow)."""
        t0 = time.perf_counter()
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # where the tether package lives
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = subprocess.Popen([sys.executable, "-m", "tether.tasks.reward_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env)
        self._live[0] = proc
        self._replies = queue.Queue()  # one queue per worker: a killed worker's replies cannot leak
        threading.Thread(target=_read_replies, args=(proc.stdout, self._replies), daemon=True,
                         name="tether-reward-replies").start()
        reply = self._replies.get() if self._send(("load", self.spec, self.format_weight, list(sys.path))) else None
        if reply is None or reply[0] != "ok":
            _stop(self._live)
            if reply is None:
                raise RewardError(f"reward {self.spec!r}: the reward worker process exited while loading it "
                                  f"(exit code {proc.returncode})")
            raise RewardError(reply[1])
        self._start_s = time.perf_counter() - t0

    def _send(self, msg) -> bool:
        """Send one request; False if the worker is gone."""
        proc = self._live[0]
        try:
            pickle.dump(msg, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def close(self) -> None:
        """Stop the worker (it is also stopped when this object is collected, or at exit)."""
        _stop(self._live)

    def _say(self, msg: str) -> None:
        if self._warn is not None:
            self._warn(msg)
        else:
            warn(msg)

    def _crashed(self, code, example_id: str) -> None:
        """Count a call during which the worker died; warn on the first; give up after ``max_crashes`` in a row."""
        self.crashes += 1
        self._crashes_in_row += 1
        if self._crashes_in_row >= self.max_crashes:
            self.gave_up = True
            self._say(f"reward {self.spec!r}: the reward worker process died during {self._crashes_in_row} calls in "
                      f"a row (last exit code {code}); it is not restarted again: every later call scores 0 "
                      f"and counts in reward_errors. Fix the reward, then resume the run from a checkpoint")
        elif self.crashes == 1:
            self._say(f"reward {self.spec!r}: the reward worker process died during a call (exit code {code}, "
                      f"example {example_id}); it is restarted for the next call ({self._start_s:.2f} s a start), "
                      f"and after {self.max_crashes} crashes in a row no more: later calls then score 0")

    # ------------------------------------------------------------ scoring

    def score(self, texts: Sequence[str], examples: Sequence[Example]
              ) -> tuple[list[float], list[bool], list[RewardFailure]]:
        """Score each response against its example, as ``score_responses`` does, in the worker.

        A call with no result after ``timeout`` seconds scores 0 with a ``"timeout"`` failure
        and one that kills the worker (a segfault, ``sys.exit``) a ``"crashed"`` one; in both
        cases a new worker scores the rest, except after ``max_crashes`` crashes in a row: then
        this and every later call scores 0 unmade, with a ``"crashed"`` failure each.
        """
        n = len(texts)
        rewards, correct, failures = [0.0] * n, [False] * n, []
        i = 0
        while i < n:
            if self.gave_up:
                failures += [RewardFailure(str(ex.id), "crashed", f"not scored: the reward worker process died during "
                                           f"{self.max_crashes} calls in a row and is not restarted")
                             for ex in examples[i:]]
                break
            proc = self._live[0]
            if proc is None or proc.poll() is not None:  # stopped after a timeout, or died while idle
                _stop(self._live)
                self.restarts += 1
                self._start()
            sent = self._send(("score", list(zip(texts[i:], examples[i:]))))
            while i < n:
                try:
                    reply = self._replies.get(timeout=self.timeout) if sent else None
                except queue.Empty:
                    failures.append(RewardFailure(str(examples[i].id), "timeout",
                                                  f"no result after {self.timeout:g} s (data.reward_timeout); "
                                                  f"the call was stopped"))
                    _stop(self._live)
                    self._crashes_in_row = 0  # it hung, it did not die
                    i += 1
                    break
                if reply is None:  # the worker died during the call
                    code = self._live[0].wait() if self._live[0] is not None else None
                    failures.append(RewardFailure(str(examples[i].id), "crashed",
                                                  f"the worker process exited (code {code}) during the call"))
                    _stop(self._live)
                    self._crashed(code, str(examples[i].id))
                    i += 1
                    break
                self._crashes_in_row = 0
                rewards[i], correct[i], failure = reply
                if failure is not None:
                    failures.append(failure)
                i += 1
        return rewards, correct, failures


def _read_replies(stream, replies: queue.Queue) -> None:
    """Reader thread: each pickled reply of one worker into ``replies``; ``None`` when it ends."""
    try:
        while True:
            replies.put(pickle.load(stream))
    except Exception:  # EOFError when the worker exits
        pass
    finally:
        replies.put(None)


def _stop(live: list) -> None:
    """Kill the worker in ``live[0]`` (if any) and reap it."""
    proc, live[0] = live[0], None
    if proc is None:
        return
    if proc.poll() is None:
        proc.kill()
    try:
        proc.stdin.close()
    except (OSError, ValueError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


# ---------------------------------------------------------------- the worker process


def _exit_with_parent(parent: int) -> None:
    """Watchdog thread: end the worker when the trainer is gone, even in the middle of a hung call."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def main() -> None:
    """The worker: load the reward, then score batches until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies = os.fdopen(os.dup(1), "wb")  # the protocol's channel; fd 1 becomes stderr, so prints cannot corrupt it
    os.dup2(2, 1)
    requests = os.fdopen(os.dup(0), "rb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()

    def send(obj) -> None:
        pickle.dump(obj, replies, protocol=pickle.HIGHEST_PROTOCOL)
        replies.flush()

    _, spec, format_weight, path = pickle.load(requests)
    sys.path[:] = path
    try:
        fn = load_reward(spec, format_weight=format_weight)
    except Exception as e:
        send(("error", str(e) if isinstance(e, RewardError) else f"reward {spec!r}: {type(e).__name__}: {e}"))
        return
    send(("ok",))
    while True:
        try:
            _, batch = pickle.load(requests)
        except EOFError:
            return
        for text, example in batch:
            res, failure = score_one(fn, text, example)
            send((res.reward, bool(res.correct), failure))


if __name__ == "__main__":
    try:
        main()
    except (BrokenPipeError, ConnectionResetError, pickle.UnpicklingError):  # the trainer is gone (killed): no one
        os._exit(0)  # to report to, and no traceback for its stderr file (os._exit: no flush of a broken pipe)
