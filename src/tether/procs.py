"""Child processes that end with their parent (imports nothing from tether).

A ``kill -9`` of a tether process runs none of its cleanup, so a child it started (a sweep's ``tether train``,
the organism build's ``tether sft``) would go on holding a run's lock and every core. `die_with_parent` is the
``preexec_fn`` that prevents it: the child asks the kernel for SIGKILL when its parent dies (Linux
``PR_SET_PDEATHSIG``; elsewhere nothing is asked).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent(new_session: bool = False) -> Callable[[], None]:
    """A ``subprocess.Popen(preexec_fn=...)`` for a child that gets SIGKILL when this process dies; with
    ``new_session``, in a session of its own too (so that a terminal's Ctrl-C reaches only the parent, which
    forwards what it decides)."""
    parent = os.getpid()

    def preexec() -> None:  # pragma: no cover (runs in the child between fork and exec)
        if new_session:
            os.setsid()
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:  # the parent died before prctl
                os._exit(1)

    return preexec


def group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` still exists (a launched server's engine and workers
    included)."""
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
