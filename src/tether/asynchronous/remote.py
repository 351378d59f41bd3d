"""Remote rollout workers over TCP (``train.async.transport.address``; docs/async.md): the network transport of
`tether.asynchronous.workers`.

    node A: tether train ... train.async.max_staleness=1 train.async.transport.address=10.0.0.5:29600  (listens)
    node B: tether worker 10.0.0.5:29600                                                (connects)

The trainer (`RemoteWorkers`, the `WorkerPool` interface the trainer uses for local workers too) listens
on ``train.async.transport.address`` and waits up to ``train.async.transport.timeout_s`` for ``train.async.workers``
workers. A worker (`serve`, the ``tether worker`` command) connects, and is sent the run's config, its
rank, whether to verify and the probe's ids; it builds model, engine (``hf`` or ``vllm``) and agent from
the config as a local worker does (`Sampler`), so ``model.name``, a custom agent's module and an
environment's files must exist on its node under the same names. Then, over one connection per worker:

    trainer -> worker: ("weights", version, tensors, alias)   every pushed version, tied tensors once
                       ("job", Job)                            a step's examples and seed
                       ("stop",)                               the run ended: the worker exits 0
    worker -> trainer: ("batch", rank, Rollout)                tagged with its version (+ checksum / probe)
                       ("error", rank, text)                   its exception, named
                       ("heartbeat",)                          every few seconds, also while generating

Messages are pickled (standard pickle, tensors on the CPU) over a `tether.asynchronous.channel.Channel`: a
handshake on the secret in ``$TETHER_WORKER_KEY`` proves the key both ways (unfinished handshakes time
out), and each message carries an HMAC-SHA256 under a per-session key, checked before it is unpickled
(the traffic is not encrypted: bind the cluster's private interface, e.g. ``10.0.0.5:29600``, not
``0.0.0.0``, or use a tunnel; docs/reliability.md, "Threat model of remote workers"). Each connection has
a sender thread (so a push never blocks the trainer on the network; a version not yet sent when a newer
one is pushed is skipped) and a receiver thread. A weights message precedes, on the same connection,
every job submitted after that push, and a worker loads the newest version it has received before each
job, so the staleness argument of the local workers holds unchanged. Jobs go to the worker with the
fewest jobs in flight. A closed connection (the worker died) is an error at once, a worker silent for
``train.async.transport.timeout_s`` (hung, or its node gone) one after that time: both `WorkerError`, which the
CLI prints as ``tether: error: trainer step N: remote rollout worker i (host, pid P) ...``.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import threading
import time
from typing import Callable, Optional

from . import channel
from .channel import KEY_ENV, Channel, HandshakeError, IntegrityError, worker_key
from .weights import copy_weights, unique_weights
from .workers import Job, Sampler, WorkerError, WorkerPool, error_text

GONE = "(it died, or its node went away)"
PRIVATE = "bind the cluster's private interface (e.g. 10.0.0.5:29600), not 0.0.0.0"


def parse_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (an IPv6 host in brackets); anything else is a `WorkerError`."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise WorkerError(f"a rollout worker's address is HOST:PORT with a port in 1-65535, got {address!r}")
    return host.strip("[]"), int(port)


def _dumps(msg) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


# ------------------------------------------------------------------ the trainer's side


class _Link:
    """One connected worker: its connection, sender thread (jobs, the newest weights, stop) and receiver thread."""

    def __init__(self, pool: "RemoteWorkers", rank: int, conn: Channel, info: dict):
        self.pool, self.rank, self.conn, self.info = pool, rank, conn, info
        self.outbox: queue.Queue = queue.Queue()
        self.sent_version = -1
        self.last_seen = time.monotonic()
        self.sender = threading.Thread(target=self._send_loop, name=f"tether-link-{rank}-send", daemon=True)
        self.receiver = threading.Thread(target=self._recv_loop, name=f"tether-link-{rank}-recv", daemon=True)
        self.sender.start()
        self.receiver.start()

    def _send_loop(self) -> None:
        try:
            while True:
                item = self.outbox.get()
                if item is None:  # stop
                    self.conn.send_bytes(_dumps(("stop",)))
                    return
                if item == "weights":
                    version, payload = self.pool.weights
                    if version > self.sent_version:  # a newer push supersedes one not sent yet
                        self.conn.send_bytes(payload)
                        self.sent_version = version
                else:
                    self.conn.send_bytes(item)
        except (OSError, EOFError, ValueError) as e:
            if not self.pool.closing and self.conn.failed is None:  # else the receiver reports the bad frame
                self.pool.inbox.put(("lost", self.rank, f"closed the connection (while the trainer was sending: "
                                                        f"{type(e).__name__}: {e}) {GONE}", self))

    def _recv_loop(self) -> None:
        try:
            while True:
                data = self.conn.recv_bytes()
                if self.pool.closing:  # the run ended: nothing more is read (no unpickling of tensors in a
                    return  # daemon thread while the interpreter shuts down: that aborted the trainer once)
                msg = pickle.loads(data)
                self.last_seen = time.monotonic()
                if msg[0] != "heartbeat" and self.pool.links[self.rank] is self:  # not a replaced worker's
                    self.pool.inbox.put(msg)
        except (OSError, EOFError, ValueError) as e:
            if not self.pool.closing:
                if isinstance(e, IntegrityError):  # nothing of it was unpickled; the channel closed itself
                    what = f"sent a message that failed its integrity check: {e}"
                elif isinstance(e, (EOFError, ConnectionResetError, BrokenPipeError)):
                    what = f"closed the connection {GONE}"
                else:
                    what = f"lost the connection ({type(e).__name__}: {e}) {GONE}"
                self.pool.inbox.put(("lost", self.rank, what, self))


class RemoteWorkers(WorkerPool):
    """``n`` remote ``tether worker`` processes for the trainer (the `RolloutWorkers` interface).

    Listens on ``cfg.train.async.transport.address`` and returns once ``n`` workers have connected (authenticated
    with ``$TETHER_WORKER_KEY``) and version ``version`` of ``model`` is queued for them; raises
    `WorkerError` if they have not within ``train.async.transport.timeout_s``.
    """

    def __init__(self, cfg, model, n: int, lookahead: int, verify: bool, version: int = 0,
                 log: Callable = print, tokenizer=None):
        super().__init__(cfg, n, lookahead, verify, tokenizer, log)
        transport = cfg.train.async_.transport
        self.key_env = transport.key_env
        self.key, self.address = worker_key(self.key_env), transport.address
        self.timeout = transport.timeout_s
        self.heartbeat_s = max(0.2, min(5.0, self.timeout / 5))
        self.inbox: queue.Queue = queue.Queue()
        self.links: list[_Link] = []
        self.closing = False
        self.weights = (-1, b"")
        host, port = parse_address(self.address)
        try:
            self.server = socket.create_server((host, port))
        except OSError as e:
            raise WorkerError(f"cannot listen for rollout workers on {self.address} (train.async.transport.address): "
                              f"{e}") from e
        if host in ("0.0.0.0", "::", ""):
            log(f"[tether] warning: train.async.transport.address={self.address} listens on every interface: any "
                f"host that reaches the port can try the handshake; {PRIVATE}")
        try:
            self.setup = dict(cfg=cfg, verify=verify, probe=self.probe, heartbeat_s=self.heartbeat_s)
            for rank, (conn, info) in enumerate(self._accept(n, self.key, log)):
                self.links.append(None)
                self._connect(rank, conn, info)
            self.push(model, version)
        except BaseException:
            self.close()
            raise

    def _accept(self, n: int, key: bytes, log: Callable) -> list:
        """``n`` authenticated connections and their hello. Each handshake runs in a thread of its own, bounded
        by `channel.HANDSHAKE_S`, so that a peer that connects and says nothing holds neither the trainer nor,
        for longer than that, a thread and a socket; one that finishes after ``n`` others did is closed."""
        log(f"[tether] waiting for {n} rollout worker(s) on {self.address}: run `tether worker {self.address}` on "
            f"the rollout nodes with ${self.key_env} set (train.async.transport.timeout_s={self.timeout:g})")
        deadline = time.monotonic() + self.timeout
        done: queue.Queue = queue.Queue()
        got, over = [], threading.Event()

        def handshake(sock: socket.socket, peer: str) -> None:
            try:
                conn, hello = channel.accept(sock, key)
                kind, info = pickle.loads(hello)  # authenticated: sent by a holder of the key
                if kind != "hello":
                    raise HandshakeError(f"its first message is {kind!r}, not a hello")
            except (OSError, EOFError, ValueError, pickle.UnpicklingError) as e:
                sock.close()
                done.put((None, f"{peer}: {e}" if isinstance(e, HandshakeError) else f"{peer}: {type(e).__name__}: "
                                                                                     f"{e}"))
                return
            done.put((conn, dict(info, peer=peer.rpartition(":")[0])))
            if over.is_set():  # _accept returned meanwhile: nobody takes it
                conn.close()

        self.server.settimeout(0.2)
        try:
            while len(got) < n:
                if time.monotonic() > deadline:
                    for conn, _ in got:
                        conn.close()
                    raise WorkerError(f"{len(got)} of {n} rollout worker(s) connected to {self.address} within "
                                      f"train.async.transport.timeout_s={self.timeout:g} s (start `tether worker "
                                      f"{self.address}` with ${self.key_env} on each rollout node)")
                try:
                    sock, (host, port, *_) = self.server.accept()
                    threading.Thread(target=handshake, args=(sock, f"{host}:{port}"), daemon=True,
                                     name="tether-handshake").start()
                except socket.timeout:
                    pass
                while not done.empty():
                    conn, info = done.get()
                    if conn is None:
                        log(f"[tether] rejected a rollout worker connection from {info}")
                    else:
                        got.append((conn, info))
        finally:
            over.set()
        while not done.empty():  # finished between the last look and `over`
            conn, _ = done.get()
            if conn is not None:
                conn.close()
        return got

    def _connect(self, rank: int, conn: Channel, info: dict) -> None:
        conn.send_bytes(_dumps(("setup", dict(self.setup, rank=rank))))
        self.links[rank] = _Link(self, rank, conn, info)
        self.log(f"[tether] rollout worker {rank} connected: {self.describe(rank)}")

    def _restart(self, rank: int) -> None:
        """A replacement for a lost worker: the next ``tether worker`` that connects (within
        ``train.async.transport.timeout_s``; something on its node restarts it) takes its rank and the newest
        version."""
        self.links[rank].conn.close()
        (conn, info), = self._accept(1, self.key, self.log)
        self._connect(rank, conn, info)
        self.links[rank].outbox.put("weights")

    def describe(self, rank: int) -> str:
        i = self.links[rank].info if rank < len(self.links) and self.links[rank] else {}
        return f"remote rollout worker {rank} ({i.get('host', '?')}, pid {i.get('pid', '?')})"

    def _send(self, job: Job, rank: Optional[int] = None) -> int:
        rank = self._least_busy() if rank is None else rank
        self.links[rank].outbox.put(_dumps(("job", job)))
        return rank

    def _receive(self, timeout: float):
        try:
            msg = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if msg[0] == "lost":
            if msg[3] is self.links[msg[1]]:  # not a replaced worker's connection
                self._lost(msg[1], msg[2])
            return None
        return msg

    def _check_alive(self) -> None:
        now = time.monotonic()
        for link in self.links:
            if now - link.last_seen > self.timeout:
                self._lost(link.rank, f"sent nothing (not even a heartbeat) for {now - link.last_seen:.0f} s > "
                                      f"train.async.transport.timeout_s={self.timeout:g}: hung, or its node or "
                                      f"the network is gone")

    def _publish(self, weights: dict, version: int) -> None:
        stored, alias = unique_weights(weights)
        tensors = {name: weights[name].detach().to("cpu", copy=True) for name in stored}
        self.weights = (version, _dumps(("weights", version, tensors, alias)))  # serialized once for all workers
        for link in self.links:
            link.outbox.put("weights")

    def close(self) -> None:
        """Tell the workers the run ended (they exit 0), then close the connections and the listener."""
        if self.closing:
            return
        self.closing = True
        links = [link for link in self.links if link is not None]  # None: a rank whose setup failed
        for link in links:
            link.outbox.put(None)
        deadline = time.monotonic() + 10.0
        for link in links:
            link.sender.join(timeout=max(0.0, deadline - time.monotonic()))
        for link in links:  # a worker told to stop exits and closes its end: the receiver ends on EOF
            link.receiver.join(timeout=max(0.0, deadline - time.monotonic()))
            link.conn.close()
        self.server.close()


# ------------------------------------------------------------------ the worker's side (`tether worker`)


def _connect(address: str, key: bytes, wait_s: float, log: Callable) -> Channel:
    """The authenticated channel to the trainer at ``address``: connection attempts retried for ``wait_s``
    seconds while nothing listens there, then the handshake (`tether.asynchronous.channel.connect`)."""
    host, port = parse_address(address)
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=channel.HANDSHAKE_S)
        except OSError as e:  # refused, unreachable, an unknown host: retried until the deadline
            if time.monotonic() > deadline:
                raise WorkerError(f"no trainer answered at {address} within {wait_s:g} s ({e}); is "
                                  f"train.async.transport.address={address} set there, and the port reachable?") from e
            if not said:
                log(f"[tether] waiting for the trainer at {address} ...")
                said = True
            time.sleep(1.0)
            continue
        try:
            return channel.connect(sock, key, first_s=deadline - time.monotonic(), name=address)
        except (OSError, EOFError) as e:
            sock.close()
            if isinstance(e, HandshakeError):
                raise WorkerError(str(e)) from None
            raise WorkerError(f"the trainer at {address} broke the connection during the handshake "
                              f"({type(e).__name__}: {e})") from e


def _hello(conn: Channel, address: str) -> dict:
    """Say hello (host, pid) to the trainer; its answer: the run's setup (config, rank, verify, probe)."""
    conn.send_bytes(_dumps(("hello", dict(host=socket.gethostname(), pid=os.getpid()))))
    try:
        kind, setup = pickle.loads(conn.recv_bytes())
    except EOFError:
        raise WorkerError(f"the trainer at {address} closed the connection before sending the run's config "
                          f"(it already has its train.async.workers workers?)") from None
    except OSError as e:
        raise WorkerError(f"lost the trainer at {address} before the run's config: {type(e).__name__}: {e}") from None
    return setup


def _check_arguments(address: str, wait_s: float) -> None:
    """`tether worker`'s address and --wait, before anything connects (a WorkerError names the bad one)."""
    parse_address(address)
    if not 0 <= wait_s < float("inf"):
        raise WorkerError(f"--wait must be a number of seconds >= 0, got {wait_s}")


def serve(address: str, wait_s: float = 600.0, log: Callable = print, key_env: str = KEY_ENV) -> int:
    """``tether worker ADDRESS``: connect to the trainer listening at ``address`` (retrying for ``wait_s``
    seconds while it starts), build the model, engine and agent from the run's config it sends, and answer
    its jobs with rollouts until it says stop (returns 0). A lost trainer ends the process (exit 2). The shared
    secret is read from environment variable ``key_env`` (the trainer's ``train.async.transport.key_env``)."""
    _check_arguments(address, wait_s)
    key = worker_key(key_env)  # a missing or weak key: refused before anything connects or loads
    conn = _connect(address, key, wait_s, log)
    setup = _hello(conn, address)
    rank = setup["rank"]
    log(f"[tether] rollout worker {rank} connected to the trainer at {address}")
    send_lock, stop = threading.Lock(), threading.Event()
    state = {"weights": None, "busy": False}
    jobs: queue.Queue = queue.Queue()

    def send(msg) -> None:
        with send_lock:
            conn.send_bytes(_dumps(msg))

    def heartbeat() -> None:
        while not stop.wait(setup["heartbeat_s"]):
            try:
                send(("heartbeat",))
            except (OSError, ValueError):
                return

    def receive() -> None:
        try:
            while True:
                msg = pickle.loads(conn.recv_bytes())
                if msg[0] == "weights":
                    state["weights"] = msg[1:]  # (version, tensors, alias): the newest replaces the older
                elif msg[0] == "job":
                    jobs.put(msg[1])
                elif msg[0] == "stop":
                    break
            end, code = "[tether] the trainer ended the run: rollout worker exits", 0
        except (OSError, EOFError, ValueError) as e:
            why = str(e) if isinstance(e, IntegrityError) else type(e).__name__
            end, code = f"tether: error: rollout worker {rank} lost the trainer at {address} ({why})", 2
        stop.set()
        if state["busy"] or code:  # nothing worth finishing: the trainer no longer waits for this batch
            log(end)
            os._exit(code)
        jobs.put(None)

    def pull() -> None:  # the newest version received (the weights always precede the jobs that need them)
        version, tensors, alias = state["weights"]
        if version != s.version:
            s.load(lambda model: copy_weights(model, tensors, alias) or version)

    threading.Thread(target=heartbeat, name="tether-worker-heartbeat", daemon=True).start()
    threading.Thread(target=receive, name="tether-worker-receive", daemon=True).start()
    try:
        s = Sampler(setup["cfg"], rank, setup["verify"], setup["probe"])
        log(f"[tether] rollout worker {rank} ready ({setup['cfg'].rollout.engine.kind} engine)")
        while True:
            job: Optional[Job] = jobs.get()
            if job is None:
                break
            state["busy"] = True
            send(("batch", rank, s.run(job, pull)))
            state["busy"] = False
    except BaseException as e:  # noqa: BLE001  the trainer names it; then this process ends too
        state["busy"] = False  # the trainer's stop (an answer to the error below) must not end this process with 0
        try:
            send(("error", rank, error_text(e)))
        except (OSError, ValueError):
            pass
        if isinstance(e, Exception) and not isinstance(e, WorkerError):  # one `tether: error:` line here too
            raise WorkerError(f"rollout worker {rank} failed: {error_text(e)} (reported to the trainer)") from e
        raise
    finally:
        stop.set()
    log("[tether] the trainer ended the run: rollout worker exits")
    conn.close()
    return 0
