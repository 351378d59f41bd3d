"""The authenticated channel between a trainer and its remote rollout workers (`tether.asynchronous.remote`):
a handshake on the shared key ``$TETHER_WORKER_KEY`` and messages that each carry an HMAC-SHA256.

Protocol ``tether-worker/1``, over one TCP connection (the trainer listens, a worker connects):

    K = the key's UTF-8 bytes (at least 32 characters, 8 of them different: `check_key`)
    1. trainer -> worker: MAGIC (16 bytes) || Nt (32 fresh random bytes)
    2. worker -> trainer: MAGIC || Nw (32 fresh random bytes) || HMAC(P, "worker proof")
    3. trainer -> worker: HMAC(P, "trainer proof")       (only once the worker's proof verified)
       P = HMAC-SHA256(key = Nt || Nw, msg = K)          (HKDF-extract, RFC 5869, both nonces as the salt)
       sending keys: trainer's Kt = HMAC(P, "trainer->worker" || 0x01), worker's Kw = HMAC(P, "worker->trainer"
       || 0x01)  (HKDF-expand, one block each)
    4. then frames, each way:  n (8 bytes) || HMAC(Ks, "head" || seq || n) || HMAC(Ks, "body" || seq || n ||
       payload) || payload,   seq = 0, 1, 2 ... counted by both ends per direction (never sent), 8-byte
       big-endian integers, HMAC = HMAC-SHA256 (32 bytes), Ks = the sender's key.

Every step of the handshake is a fixed-size read under a timeout (`HANDSHAKE_S`), so a peer that connects
and says nothing, or something else, holds a thread and a socket for at most that long. Proofs are compared
in constant time. The receiver checks a frame's head tag before it allocates n bytes and its body tag
before it hands the payload on (the caller unpickles it), so a frame altered, injected, replayed, reordered
or dropped on the way, or keyed with another session's key, is an `IntegrityError` that names the peer and
closes the connection, and nothing of it is unpickled. Fresh nonces on both sides make every session's keys
new: a recorded session replays into no other.

What it does not do: encrypt (weights, prompts and rollouts cross the network in the clear: a private
network or a VPN / SSH tunnel for confidentiality), or make a key holder harmless (messages are pickles:
whoever holds the key can run code on the other side). A fake trainer receives a worker's proof, which an
offline search could test guesses of K against: hence keys that cannot be guessed (`check_key`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
import time
from typing import Optional

from ..errors import ConfigError

KEY_ENV = "TETHER_WORKER_KEY"
MIN_KEY_CHARS, MIN_KEY_DISTINCT = 32, 8
HANDSHAKE_S = 10.0  # seconds for a whole handshake (read at each call: tests shorten it)
MAGIC = b"tether-worker/1\n"
NONCE = 32
TAG = 32
MAKE_KEY = 'python -c "import secrets; print(secrets.token_hex(32))"'


class HandshakeError(ConnectionError):
    """The peer did not complete the handshake: another key, not a tether peer of this version, or too slow."""


class IntegrityError(ConnectionError):
    """A frame whose tags do not verify: altered, injected, replayed or reordered on the way."""


def check_key(key: Optional[str], env: str = KEY_ENV) -> bytes:
    """The key's bytes; a missing or guessable one is a `ConfigError` naming the rule. The rule: at least 32
    characters, at least 8 of them different (``secrets.token_hex(16)`` and longer pass; a word, a short
    password, a repeated pattern do not). Length is what protects the handshake against offline guessing."""
    how = (f"generate one with: export {env}=$({MAKE_KEY}), and give the trainer and every `tether worker` the "
           f"same value")
    if not key:
        raise ConfigError(f"remote rollout workers (train.async.transport.kind=remote, tether worker) need a shared "
                          f"secret in ${env}: {how}")
    if len(key) < MIN_KEY_CHARS or len(set(key)) < MIN_KEY_DISTINCT:
        raise ConfigError(f"${env} is too weak ({len(key)} characters, {len(set(key))} different): it needs at "
                          f"least {MIN_KEY_CHARS} characters, {MIN_KEY_DISTINCT} of them different; {how}")
    return key.encode()


def worker_key(env: str = KEY_ENV) -> bytes:
    """The shared secret in environment variable ``env`` (``train.async.transport.key_env``, `tether worker
    --key-env`; default ``$TETHER_WORKER_KEY``) checked by `check_key` (trainer and worker, before anything
    loads)."""
    return check_key(os.environ.get(env), env)


def _mac(key: bytes, *parts) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def _keys(key: bytes, nt: bytes, nw: bytes) -> tuple[bytes, bytes, bytes]:
    """(P, trainer's sending key, worker's sending key) of a session (the module doc, step 3)."""
    prk = _mac(nt + nw, key)
    return prk, _mac(prk, b"trainer->worker\x01"), _mac(prk, b"worker->trainer\x01")


def _read(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` bytes; EOFError if the peer closes first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 24))
        if not k:
            raise EOFError(f"the connection closed ({got} of {n} bytes of a message read)")
        got += k
    return buf


class Channel:
    """One end of an authenticated connection: `send_bytes` / `recv_bytes` (thread-safe each), `close`."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes, peer: str):
        self.sock, self.peer = sock, peer
        self._keys = (send_key, recv_key)
        self._seq = [0, 0]  # frames sent, frames received
        self._send_lock, self._recv_lock = threading.Lock(), threading.Lock()
        self.failed: Optional[IntegrityError] = None  # set before the channel closes itself on a bad frame

    def frame(self, payload: bytes) -> bytes:
        """The next frame's head (n and both tags) for ``payload``; counts it as sent."""
        key, seq = self._keys[0], self._seq[0]
        self._seq[0] += 1
        head = struct.pack(">QQ", seq, len(payload))
        return head[8:] + _mac(key, b"head", head) + _mac(key, b"body", head, payload)

    def send_bytes(self, payload: bytes) -> None:
        with self._send_lock:
            self.sock.sendall(self.frame(payload))
            self.sock.sendall(payload)

    def recv_bytes(self) -> bytearray:
        """The next frame's payload, its tags verified; raises `IntegrityError` (and closes) if they are not
        the sender's, EOFError / OSError when the connection ends."""
        with self._recv_lock:
            key, seq = self._keys[1], self._seq[1]
            got = _read(self.sock, 8 + 2 * TAG)
            head = struct.pack(">Q", seq) + bytes(got[:8])
            if not hmac.compare_digest(_mac(key, b"head", head), got[8:8 + TAG]):
                self._reject(seq, "its header")
            payload = _read(self.sock, struct.unpack(">Q", got[:8])[0])
            if not hmac.compare_digest(_mac(key, b"body", head, payload), got[8 + TAG:]):
                self._reject(seq, "its content")
            self._seq[1] += 1
            return payload

    def _reject(self, seq: int, what: str) -> None:
        self.failed = IntegrityError(f"message {seq} from {self.peer} failed its HMAC-SHA256 check ({what}): "
                                     f"altered, injected, replayed or reordered on the network, or not sent by the "
                                     f"peer that authenticated; the connection is closed and the message was not "
                                     f"unpickled")
        self.close()
        raise self.failed

    def close(self) -> None:
        """Close the socket, waking a thread blocked reading or writing it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _peer(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "?"
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else f"the socket {name or '(unnamed)'}"


def accept(sock: socket.socket, key: bytes) -> tuple[Channel, bytearray]:
    """The trainer's side of the handshake on an accepted ``sock``, and the worker's first message (its hello):
    both within `HANDSHAKE_S`, after which the timeout is lifted. Raises `HandshakeError` (EOFError, OSError
    when the connection breaks); the caller closes ``sock`` then."""
    peer, deadline = _peer(sock), _Deadline(sock, HANDSHAKE_S)
    nt = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + nt)
    got = deadline.read(len(MAGIC) + NONCE + TAG, "did not finish the handshake")
    if got[:len(MAGIC)] != MAGIC:
        raise HandshakeError(f"does not speak {MAGIC.strip().decode()} (not a tether worker of this version)")
    nw = bytes(got[len(MAGIC):len(MAGIC) + NONCE])
    prk, kt, kw = _keys(key, nt, nw)
    if not hmac.compare_digest(_mac(prk, b"worker proof"), got[-TAG:]):
        raise HandshakeError(f"did not prove it holds ${KEY_ENV} (another key?)")
    sock.sendall(_mac(prk, b"trainer proof"))
    channel = Channel(sock, kt, kw, peer)
    sock.settimeout(max(deadline.end - time.monotonic(), 1e-3))
    try:
        first = channel.recv_bytes()
    except socket.timeout:
        raise HandshakeError(f"did not send its first message within {HANDSHAKE_S:g} s") from None
    sock.settimeout(None)
    return channel, first


def connect(sock: socket.socket, key: bytes, first_s: float, name: str = "") -> Channel:
    """The worker's side of the handshake on a connected ``sock`` to the trainer (``name``: its address as the
    user gave it): waits up to ``first_s`` seconds for the trainer to begin (it accepts only while it wants
    workers), then `HANDSHAKE_S` for the rest. Raises `HandshakeError`; the caller closes ``sock``."""
    peer = name or _peer(sock)
    got = _Deadline(sock, max(first_s, HANDSHAKE_S)).read(
        len(MAGIC) + NONCE, f"the trainer at {peer} accepted the connection but did not begin the handshake "
                            f"(it has all its train.async.workers workers?)")
    if got[:len(MAGIC)] != MAGIC:
        raise HandshakeError(f"the server at {peer} does not speak {MAGIC.strip().decode()} (not a tether "
                             f"trainer of this version)")
    nt, nw = bytes(got[len(MAGIC):]), secrets.token_bytes(NONCE)
    prk, kt, kw = _keys(key, nt, nw)
    sock.sendall(MAGIC + nw + _mac(prk, b"worker proof"))
    try:
        proof = _Deadline(sock, HANDSHAKE_S).read(TAG, f"the trainer at {peer} did not finish the handshake")
    except EOFError:
        raise HandshakeError(f"the trainer at {peer} refused this worker's ${KEY_ENV} (it closed the connection "
                             f"at the key check: the keys differ?)") from None
    if not hmac.compare_digest(_mac(prk, b"trainer proof"), proof):
        raise HandshakeError(f"the trainer at {peer} did not prove it holds ${KEY_ENV} (another key, or not a "
                             f"tether trainer)")
    sock.settimeout(None)
    return Channel(sock, kw, kt, peer)


class _Deadline:
    """Fixed-size handshake reads that end by ``seconds`` from now (a `HandshakeError` after that)."""

    def __init__(self, sock: socket.socket, seconds: float):
        self.sock, self.seconds = sock, seconds
        self.end = time.monotonic() + seconds

    def read(self, n: int, what: str) -> bytearray:
        buf = bytearray()
        while len(buf) < n:
            left = self.end - time.monotonic()
            if left <= 0:
                raise HandshakeError(f"{what} within {self.seconds:g} s")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(n - len(buf))
            except socket.timeout:
                raise HandshakeError(f"{what} within {self.seconds:g} s") from None
            if not chunk:
                raise EOFError(f"{what}: the connection closed")
            buf += chunk
        return buf
