"""Faults of a probe (issue #37) around tether's other processes: a rollout worker killed with ``kill -9`` when no
restart is left (the clean error was followed by the resource tracker's "leaked semaphore" warning), and the
retrieval server with more half-open connections than workers (a real client waited 9.1 s).

Each test bounds its own waits (a deadline, a thread join with a timeout), so a hang fails it rather than CI."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import DIGITS, cli_args, subprocess_env

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def work(make_workdir):
    return make_workdir("faults_processes", DIGITS)


def _reader(p: subprocess.Popen, lines: list) -> threading.Thread:
    """A thread that appends ``p``'s output lines to ``lines`` until every writer of the pipe closed it (the
    trainer, and the resource tracker process that outlives it and prints its warnings last)."""
    def read():
        for line in p.stdout:
            lines.append(line)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


@pytest.mark.slow  # about 10 s: out of the default suite's 15 minutes, run by CI's slow step
def test_a_killed_worker_without_restarts_leaks_no_semaphore(work, tiny_model_dir, tmp_path):
    """`train.async.worker_restarts=0` and its rollout worker killed (kill -9) after the first step: the one error line,
    and no `resource_tracker: ... leaked semaphore` warning after it (the worker's model-load progress bar made a
    multiprocessing lock, a named semaphore a killed process never unlinks)."""
    run = tmp_path / "run"
    args = cli_args(work, tiny_model_dir, run, 10_000, "grpo", **{
        "train.async.max_staleness": 1, "train.async.worker_restarts": 0, "eval.before": False, "eval.after": False})
    p = subprocess.Popen([sys.executable, "-m", "tether", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=subprocess_env(OMP_NUM_THREADS="1"))
    lines: list[str] = []
    reader = _reader(p, lines)
    try:
        deadline = time.monotonic() + 240
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
            assert p.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        pid = next(int(ln.split("pid ")[1].rstrip(")\n")) for ln in lines if "rollout worker 0 started (pid" in ln)
        os.kill(pid, signal.SIGKILL)
        assert p.wait(120) == 2, "".join(lines)[-3000:]
        reader.join(30)  # the resource tracker exits (and closes the pipe) once it has cleaned up
        assert not reader.is_alive(), "the trainer's output pipe stayed open"
    finally:
        if p.poll() is None:
            p.kill()
    out = "".join(lines)
    assert f"rollout worker 0 (pid {pid}) died with exit code -9" in out, out[-3000:]
    assert "leaked semaphore" not in out, out[-3000:]


# ---------------------------------------------------------------- the retrieval server and half-open connections


def _server(tmp_path, **kw):
    from search_helpers import synthetic_corpus
    from tether.search.retrievers import BM25Retriever
    from tether.search.server import RetrievalServer

    r = BM25Retriever(synthetic_corpus(tmp_path / "c.jsonl", 5), cache_dir=tmp_path / "cache")
    srv = RetrievalServer(r, port=0, **kw).start()
    host, port = srv.url[len("http://"):].rsplit(":", 1)
    return srv, host, int(port)


def _half_open(host: str, port: int, n_silent: int, n_partial: int) -> list[socket.socket]:
    """``n_silent`` connections that send nothing and ``n_partial`` that send half a request head, held open."""
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(n_silent + n_partial)]
    for s in socks[n_silent:]:
        s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 40\r\n")  # no blank line
    return socks


def _retrieve(host: str, port: int, timeout: float) -> dict:
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request("POST", "/retrieve", body=json.dumps({"queries": ["item2"], "topk": 1}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200
        return json.loads(r.read())
    finally:
        c.close()


def test_half_open_connections_do_not_starve_a_real_client(tmp_path):
    """70 connections that sent nothing (more than the 64 workers) plus 10 with half a request head each held a
    worker for its 10 s read timeout: a real client waited 9.1 s. Now a connection gets a worker only once its head
    has arrived, and the real client is answered while all 80 are still held (its own 5 s timeout fails the test
    otherwise)."""
    srv, host, port = _server(tmp_path)  # 64 workers, a 10 s client timeout: the defaults
    socks = []
    try:
        socks = _half_open(host, port, 70, 10)
        time.sleep(0.3)  # the server has accepted them all
        t0 = time.monotonic()
        body = _retrieve(host, port, timeout=5)
        took = time.monotonic() - t0
        assert body["result"][0][0]["id"] == "p2"
        assert took < 3.0, f"answered after {took:.1f} s"
        for s in socks:  # still open: none was answered or closed meanwhile
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in socks:
            s.close()
        srv.shutdown()

