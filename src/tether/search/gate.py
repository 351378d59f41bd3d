"""The retrieval server's front door: an accepted connection waits here, without a worker, until its
request head has arrived.

A worker thread given a connection blocks reading it; had workers taken connections as they were
accepted, a client that connects and sends nothing (or half a request head) would hold one for the
read timeout, and as many such half-open connections as workers would make every real client wait
(70 of them against the 64 workers: 9.1 s for a real request). :class:`HeadGate` watches the new
connections from one thread (a ``selectors`` loop) and hands a connection on (``ready``) only once
its head is complete in the socket's buffer, read with ``MSG_PEEK`` so that nothing is consumed and
the handler reads the request as it always did. A connection whose head is incomplete is looked at
again every ``recheck_s`` (its unread bytes would keep a level-triggered selector busy); one that
has not sent a whole head within ``timeout`` seconds of its accept, or closes before, is closed
(``drop``) without a worker ever waiting on it.
"""

from __future__ import annotations

import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["HeadGate", "MAX_HEAD_BYTES"]

#: A head this long is handed on even without its end (the handler refuses an over-long line itself).
MAX_HEAD_BYTES = 65536


@dataclass
class _Conn:
    sock: socket.socket
    addr: Any
    since: float  # time.monotonic() of the accept
    recheck: float = 0.0  # when an incomplete head is peeked at again (0: watched by the selector)


def _complete(data: bytes) -> bool:
    """Whether ``data`` holds a whole request head (the blank line after the headers), or is too long to wait on."""
    return b"\r\n\r\n" in data or b"\n\n" in data or len(data) >= MAX_HEAD_BYTES


class HeadGate:
    """Holds accepted connections until their request head has arrived, then calls ``ready(sock, addr)`` (from the
    gate's thread; the socket is blocking again). ``drop(sock)`` closes one that timed out or went away.

    Args:
        ready: takes a connection whose head is complete (e.g. queues it for a worker).
        drop: closes a connection the gate gives up on.
        timeout: seconds from the accept for the whole head to arrive.
        recheck_s: how often an incomplete head is peeked at again.
    """

    def __init__(self, ready: Callable[[socket.socket, Any], None], drop: Callable[[socket.socket], None],
                 timeout: float, recheck_s: float = 0.05):
        self._ready, self._drop, self.timeout, self.recheck_s = ready, drop, float(timeout), float(recheck_s)
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._conns: dict[int, _Conn] = {}  # fileno -> connection, while in the gate
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tether-retrieve-gate", daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket, addr: Any) -> None:
        """A connection just accepted (any thread)."""
        self._new.put(_Conn(sock, addr, time.monotonic()))
        self._wake()

    def __len__(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        """Stop the gate; the connections in it are dropped."""
        self._closed = True
        self._wake()
        self._thread.join(timeout=5.0)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # the pipe is full (a wake-up is pending anyway) or closed
            pass

    # ------------------------------------------------------------ the gate's thread

    def _run(self) -> None:
        try:
            while not self._closed:
                self._take_new()
                now = time.monotonic()
                due = [c.recheck for c in self._conns.values() if c.recheck] + \
                      [c.since + self.timeout for c in self._conns.values()]
                wait = max(0.0, min(due, default=now + 1.0) - now)
                for key, _ in self._sel.select(timeout=min(wait, 1.0)):
                    if key.data is None:
                        self._drain_wake()
                    else:
                        self._look(key.data)
                now = time.monotonic()
                for c in [c for c in self._conns.values() if c.recheck and c.recheck <= now]:
                    self._look(c)
                for c in [c for c in self._conns.values() if now - c.since >= self.timeout]:
                    self._leave(c)
                    self._drop(c.sock)
        finally:
            for c in list(self._conns.values()):
                self._leave(c)
                self._drop(c.sock)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _take_new(self) -> None:
        while True:
            try:
                c = self._new.get_nowait()
            except queue.Empty:
                return
            try:
                c.sock.setblocking(False)
                self._sel.register(c.sock, selectors.EVENT_READ, c)
            except (OSError, ValueError):  # closed already
                self._drop(c.sock)
                continue
            self._conns[c.sock.fileno()] = c

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:  # BlockingIOError: drained
            pass

    def _look(self, c: _Conn) -> None:
        """Peek at what ``c`` has sent: hand it on once its head is complete; drop it if it closed."""
        try:
            data = c.sock.recv(MAX_HEAD_BYTES, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:  # reset by the client
            data = b""
        if not data:  # the client closed before sending a whole request: nothing to answer
            self._leave(c)
            self._drop(c.sock)
        elif _complete(data):
            self._leave(c)
            try:
                c.sock.setblocking(True)
            except OSError:
                self._drop(c.sock)
                return
            self._ready(c.sock, c.addr)
        elif not c.recheck:  # part of a head: stop watching (its unread bytes keep it readable), look again soon
            self._sel.unregister(c.sock)
            c.recheck = time.monotonic() + self.recheck_s
        else:
            c.recheck = time.monotonic() + self.recheck_s

    def _leave(self, c: _Conn) -> None:
        self._conns.pop(c.sock.fileno(), None)
        if not c.recheck:
            try:
                self._sel.unregister(c.sock)
            except (KeyError, ValueError, OSError):
                pass
