"""Faults injected into the connection of remote rollout workers (`tether.asynchronous.channel`,
`tether.asynchronous.remote`; docs/reliability.md, "Threat model of remote workers"), on loopback: a message altered
or replayed after a genuine handshake is refused before it is unpickled; a peer that connects and says nothing is
dropped after the handshake timeout and a real worker still connects; a missing or weak $TETHER_WORKER_KEY is
refused before the model loads, by the trainer and by `tether worker`. Every wait here has its own bound (socket
timeouts, joins, a subprocess timeout).
"""

from __future__ import annotations

import pickle
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import DIGITS, assert_clean_error, cli_args, subprocess_env
from tether.asynchronous import channel

pytestmark = pytest.mark.faults

KEY = secrets.token_hex(32)
BOUND_S = 60  # every wait's bound: a hang guard, not a speed bar


class WritesMarker:
    """A pickle whose loading creates ``path`` (builtins.open(path, "w")): evidence that it was unpickled."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pair(key: bytes = KEY.encode()) -> tuple[channel.Channel, channel.Channel]:
    """(trainer's end, worker's end) of a genuine handshake over a loopback socket pair; the worker's hello is
    the trainer's first message, as in `RemoteWorkers`."""
    a, b = socket.socketpair()
    out: queue.Queue = queue.Queue()
    t = threading.Thread(target=lambda: out.put(channel.accept(a, key)), daemon=True)
    t.start()
    w = channel.connect(b, key, first_s=BOUND_S)
    w.send_bytes(pickle.dumps(("hello", {})))
    trainer, hello = out.get(timeout=BOUND_S)
    assert pickle.loads(hello) == ("hello", {})
    return trainer, w


def expect_refused(receiver: channel.Channel, marker: Path) -> str:
    with pytest.raises(channel.IntegrityError) as e:
        receiver.recv_bytes()
    assert not marker.exists()  # nothing of it was unpickled
    with pytest.raises(OSError):  # and the connection is closed
        receiver.recv_bytes()
    return str(e.value)


@pytest.mark.parametrize("direction", ["worker->trainer", "trainer->worker"])
@pytest.mark.parametrize("attack", ["tampered", "replayed", "reordered", "injected"])
def test_a_frame_altered_after_the_handshake_is_refused_before_unpickling(attack, direction, tmp_path):
    """Each frame's HMAC-SHA256 (per-session key, per-direction sequence number) is checked before the payload is
    handed on: a genuine frame whose payload an on-path attacker swapped for a code-running pickle, a genuine
    frame sent twice, two frames swapped, a frame MAC'd under another session's key: all refused, nothing
    unpickled, the connection closed with an error naming the peer."""
    marker = tmp_path / "unpickled"
    evil = pickle.dumps(WritesMarker(marker))
    pickle.loads(pickle.dumps(WritesMarker(tmp_path / "probe")))
    assert (tmp_path / "probe").exists()  # the payload is live: unpickling it would create the marker
    trainer, worker = pair()
    sender, receiver = (worker, trainer) if direction == "worker->trainer" else (trainer, worker)
    receiver.sock.settimeout(BOUND_S)
    harmless = pickle.dumps(("heartbeat",))
    if attack == "tampered":  # a genuine head and tags for a harmless payload of the same length, the payload swapped
        sender.sock.sendall(sender.frame(b"\0" * len(evil)) + evil)
    elif attack == "replayed":
        frame = sender.frame(harmless) + harmless
        sender.sock.sendall(frame + frame)
        assert pickle.loads(receiver.recv_bytes()) == ("heartbeat",)  # the first is fine
    elif attack == "reordered":
        first, second = sender.frame(harmless) + harmless, sender.frame(evil) + evil
        sender.sock.sendall(second + first)
    else:  # injected: a frame of another session (its keys were never this connection's)
        other, _ = pair()
        sender.sock.sendall(other.frame(evil) + evil)
    error = expect_refused(receiver, marker)
    assert "failed its HMAC-SHA256 check" in error and "was not unpickled" in error and receiver.peer in error
    assert not marker.exists()


def fake_cfg(address: str, timeout_s: float):
    """What `RemoteWorkers` reads of a run's config (picklable: it is sent to the worker as its setup)."""
    transport = SimpleNamespace(kind="remote", address=address, timeout_s=timeout_s, key_env="TETHER_WORKER_KEY")
    return SimpleNamespace(train=SimpleNamespace(async_=SimpleNamespace(transport=transport, worker_restarts=0,
                                                                        verify_logp_tol=1e-3)),
                           rollout=SimpleNamespace(engine=SimpleNamespace(kind="hf")))


def start_pool(address: str, log: list, timeout_s: float = BOUND_S):
    """`RemoteWorkers` (n=1, a tiny linear "model") constructed in a thread: it returns once a worker connects."""
    from tether.asynchronous.remote import RemoteWorkers

    out: queue.Queue = queue.Queue()

    def build():
        try:
            out.put(RemoteWorkers(fake_cfg(address, timeout_s), torch.nn.Linear(2, 2), n=1, lookahead=2,
                                  verify=False, log=log.append))
        except BaseException as e:  # noqa: BLE001  handed to the test
            out.put(e)

    threading.Thread(target=build, daemon=True).start()
    return out


def dial(address: str) -> socket.socket:
    """A TCP connection to ``address``, retried while the trainer's thread has not begun listening."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + BOUND_S
    while True:
        try:
            return socket.create_connection((host, int(port)), timeout=BOUND_S)
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, f"nothing listened on {address}"
            time.sleep(0.05)


def worker_end(address: str) -> channel.Channel:
    """A genuine worker's connection (as `tether worker` makes it): handshake, hello, the trainer's setup."""
    sock = dial(address)
    w = channel.connect(sock, KEY.encode(), first_s=BOUND_S, name=address)
    w.sock.settimeout(BOUND_S)
    w.send_bytes(pickle.dumps(("hello", dict(host="fake", pid=1))))
    kind, setup = pickle.loads(w.recv_bytes())
    assert kind == "setup" and setup["rank"] == 0
    return w


@pytest.mark.parametrize("attack", ["tampered", "replayed"])
def test_the_trainer_refuses_a_tampered_or_replayed_message_and_names_the_worker(attack, tmp_path, monkeypatch):
    """The real trainer side (`RemoteWorkers`): after a genuine worker's handshake, a message whose payload was
    swapped for a code-running pickle, or a genuine heartbeat sent twice, stops the run with a `WorkerError`
    naming the worker and the failed check; the marker pickle is never loaded; the worker's connection closes."""
    from tether.asynchronous.workers import Job, WorkerError

    monkeypatch.setenv("TETHER_WORKER_KEY", KEY)
    address, log, marker = f"127.0.0.1:{free_port()}", [], tmp_path / "unpickled"
    built = start_pool(address, log, timeout_s=30)
    w = worker_end(address)
    pool = built.get(timeout=BOUND_S)
    assert not isinstance(pool, BaseException), pool
    try:
        evil, harmless = pickle.dumps(WritesMarker(marker)), pickle.dumps(("heartbeat",))
        if attack == "tampered":
            w.sock.sendall(w.frame(b"\0" * len(evil)) + evil)
        else:
            frame = w.frame(harmless) + harmless
            w.sock.sendall(frame + frame)
        pool.submit(Job(0, [], None, 0))
        with pytest.raises(WorkerError) as e:
            pool.next_batch()
    finally:
        pool.close()
    assert not marker.exists()
    msg = str(e.value)
    assert msg.startswith("remote rollout worker 0 (fake, pid 1) sent a message that failed its integrity check"), msg
    assert "failed its HMAC-SHA256 check" in msg and "was not unpickled" in msg
    deadline = time.monotonic() + BOUND_S
    with pytest.raises((EOFError, OSError)):  # the trainer closed the worker's connection
        while time.monotonic() < deadline:
            w.recv_bytes()  # the weights, maybe a job, then the end
    w.close()


def handshake_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "tether-handshake"]


@pytest.mark.slow  # about 11 s: out of the default suite's 15 minutes, run by CI's slow step
def test_an_unfinished_handshake_times_out_and_a_real_worker_still_connects(monkeypatch):
    """A peer that connects and sends nothing is dropped after the handshake timeout (its thread ends, the
    trainer closes the socket: the peer reads EOF), the rejection is logged, and a genuine worker connects."""
    monkeypatch.setenv("TETHER_WORKER_KEY", KEY)
    monkeypatch.setattr(channel, "HANDSHAKE_S", 1.0)
    address, log = f"127.0.0.1:{free_port()}", []
    built = start_pool(address, log)
    silent = dial(address)
    deadline = time.monotonic() + BOUND_S
    try:
        got = b""
        while True:  # the trainer's opening, then EOF once it gives up on this peer
            assert time.monotonic() < deadline, "the trainer kept a silent peer's connection open"
            chunk = silent.recv(4096)
            if not chunk:
                break
            got += chunk
        assert got.startswith(channel.MAGIC)
    finally:
        silent.close()
    while handshake_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not handshake_threads()  # its thread has ended
    w = worker_end(address)  # the trainer still takes a real worker
    pool = built.get(timeout=BOUND_S)
    assert not isinstance(pool, BaseException), pool
    assert any("rejected a rollout worker connection from 127.0.0.1:" in ln and "did not finish the handshake "
               "within 1 s" in ln for ln in log), log  # logged by the accept loop before it took the worker
    pool.close()
    assert pickle.loads(w.recv_bytes())[0] == "weights" and pickle.loads(w.recv_bytes()) == ("stop",)
    w.close()


def test_a_worker_with_another_key_is_refused_both_ways(monkeypatch):
    """The handshake proves the key both ways: a worker with another key is refused by the trainer, and a
    worker facing a trainer with another key refuses it (each `HandshakeError` says which)."""
    other = secrets.token_hex(32).encode()
    a, b = socket.socketpair()
    errors: queue.Queue = queue.Queue()

    def trainer():
        try:
            channel.accept(a, KEY.encode())
        except (channel.HandshakeError, EOFError, OSError) as e:
            errors.put(e)
        a.close()

    threading.Thread(target=trainer, daemon=True).start()
    with pytest.raises(channel.HandshakeError, match=r"refused this worker's \$TETHER_WORKER_KEY"):
        channel.connect(b, other, first_s=BOUND_S, name="t:1")
    assert "did not prove it holds $TETHER_WORKER_KEY" in str(errors.get(timeout=BOUND_S))
    b.close()


@pytest.mark.parametrize("key,ok", [(None, False), ("", False), ("x" * 31 + "y", False), ("ab" * 20, False),
                                    ("0123456789abcdef" * 2, True), (secrets.token_hex(16), True),
                                    (secrets.token_hex(32), True)])
def test_the_key_rule(key, ok):
    """At least 32 characters, 8 of them different; the message says how to generate one."""
    from tether.errors import ConfigError

    if ok:
        assert channel.check_key(key) == key.encode()
        return
    with pytest.raises(ConfigError, match="secrets.token_hex") as e:
        channel.check_key(key)
    assert "at least 32 characters" in str(e.value) or key in (None, "")


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("faults_remote", DIGITS)


@pytest.mark.parametrize("key", [None, "short-secret"])
def test_the_trainer_refuses_a_missing_or_weak_key_before_the_model_loads(key, workdir, tiny_model_dir, tmp_path):
    """`tether train ... train.async.transport.address=...` with $TETHER_WORKER_KEY unset or short: one `tether: error:`
    line, exit 2, before the model loads (no "loading model" line) and before a run directory exists."""
    run = tmp_path / "run"
    args = cli_args(workdir, tiny_model_dir, run, 2, "grpo", **{
        "train.async.max_staleness": 1, "train.async.transport.kind": "remote",
        "train.async.transport.address": f"127.0.0.1:{free_port()}", "train.async.transport.timeout_s": 5,
        "eval.before": False, "eval.after": False})
    env = subprocess_env(OMP_NUM_THREADS="1")
    env.pop("TETHER_WORKER_KEY", None)
    if key is not None:
        env["TETHER_WORKER_KEY"] = key
    p = subprocess.run([sys.executable, "-m", "tether", *args], capture_output=True, text=True, env=env,
                       timeout=300)
    assert "loading model" not in p.stdout + p.stderr and "waiting for" not in p.stdout, p.stdout + p.stderr
    assert_clean_error(p.returncode, p.stderr, "$TETHER_WORKER_KEY", "secrets.token_hex(32)")
    assert not run.exists()


@pytest.mark.parametrize("key", [None, "short-secret"])
def test_a_worker_refuses_a_missing_or_weak_key_before_it_connects(key, monkeypatch, capsys):
    """`tether worker` with $TETHER_WORKER_KEY unset or short: one `tether: error:` line naming the rule, exit 2,
    before it tries the address (nothing listens there: it would say so after --wait)."""
    from tether.cli import main

    if key is None:
        monkeypatch.delenv("TETHER_WORKER_KEY", raising=False)
    else:
        monkeypatch.setenv("TETHER_WORKER_KEY", key)
    assert main(["worker", f"127.0.0.1:{free_port()}", "--wait", "0"]) == 2
    err = capsys.readouterr().err
    assert_clean_error(2, err, "$TETHER_WORKER_KEY", "secrets.token_hex(32)")
    assert "no trainer answered" not in err
