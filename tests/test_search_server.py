"""`tether retrieve serve` as a real subprocess, queried with the HTTP retriever."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import tether
from search_helpers import synthetic_corpus, write_jsonl
from tether.cli import main
from tether.search.protocol import render_observation
from tether.search.retrievers import BM25Retriever, HTTPRetriever, RetrievalError
from tether.search.server import RetrievalServer

START_TIMEOUT_S = 120  # generous: the subprocess imports numpy/bm25s and builds the index on a shared CPU


def _read_url(proc: subprocess.Popen, timeout: float) -> str:
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if line.startswith("[tether] serving") and " on http://" in line:
            return line.rsplit(" on ", 1)[1].strip()
    raise AssertionError(f"server printed no URL (exit code {proc.poll()}); output: {''.join(seen)!r}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A `tether retrieve serve` subprocess on a free port over a small corpus; always killed."""
    d = tmp_path_factory.mktemp("serve")
    corpus = synthetic_corpus(d / "corpus.jsonl", n=40)
    env = dict(os.environ)
    src = str(Path(tether.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "tether.cli", "retrieve", "serve", "--corpus", str(corpus), "--port", "0",
           "--topk-max", "10", "--max-queries", "8", "--cache-dir", str(d / "cache")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = _read_url(proc, START_TIMEOUT_S)
        assert url.startswith("http://127.0.0.1:")
        yield {"url": url, "corpus": corpus, "cache": d / "cache", "proc": proc}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _post(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/retrieve", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_server_matches_in_process_bm25(server):
    client = HTTPRetriever(server["url"], timeout=30, retries=0)
    local = BM25Retriever(server["corpus"], cache_dir=server["cache"])
    queries = ["river mountain castle", "item17", "comet falcon lantern", "the of", "item3 saffron"]
    remote = client.search(queries, k=4)  # one batched request
    expected = local.search(queries, k=4)
    assert [[p.id for p in r] for r in remote] == [[p.id for p in r] for r in expected]
    for rr, ee in zip(remote, expected):
        for a, b in zip(rr, ee):
            assert (a.title, a.text, a.contents) == (b.title, b.text, b.contents)
            assert a.score == pytest.approx(b.score, rel=1e-5)
    # round trip, reported (not asserted): 20 batched requests of 8 queries
    t0 = time.perf_counter()
    for _ in range(20):
        client.search(["river castle", "item5", "comet", "harbor glacier", "x", "willow", "item9", "marble"], k=3)
    print(f"\n[server] round trip {1000 * (time.perf_counter() - t0) / 20:.1f} ms per request of 8 queries, k=3")
    # Search-R1 clients may ask without scores: bare documents
    status, body = _post(server["url"], json.dumps({"queries": ["item17"], "topk": 2}).encode())
    assert status == 200 and set(body["result"][0][0]) == {"id", "contents"}
    assert body["result"][0][0]["id"] == "p17"


def test_server_answers_only_matching_passages(server):
    """A query matching one passage gets one; stop words only or unknown words get an empty list (no
    zero-score padding in corpus order), with and without scores, and the client renders it."""
    for return_scores in (True, False):
        status, body = _post(server["url"], json.dumps({"queries": ["item17", "the", "the of and", "zzyzx"],
                                                        "topk": 3, "return_scores": return_scores}).encode())
        assert status == 200 and [len(r) for r in body["result"]] == [1, 0, 0, 0]
        doc = body["result"][0][0]["document"] if return_scores else body["result"][0][0]
        assert doc["id"] == "p17"
    client = HTTPRetriever(server["url"], timeout=30, retries=0)
    one, none = client.search(["item17", "the"], k=3)
    assert [p.id for p in one] == ["p17"] and none == []
    assert render_observation(none) == "\n\n<information></information>\n\n"
    assert render_observation(one) == f'\n\n<information>Doc 1(Title: "Entry 17") {one[0].text}</information>\n\n'


@pytest.mark.parametrize("payload, status, message", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "must be a JSON object"),
    (json.dumps({"topk": 3}).encode(), 400, "missing field 'queries'"),
    (json.dumps({"queries": "river"}).encode(), 400, "must be a list of strings"),
    (json.dumps({"queries": ["a", 3]}).encode(), 400, "'queries'[1] must be a string"),
    (json.dumps({"queries": ["a"], "topk": 0}).encode(), 400, "positive integer"),
    (json.dumps({"queries": ["a"], "topk": "3"}).encode(), 400, "positive integer"),
    (json.dumps({"queries": ["a"], "topk": 11}).encode(), 400, "maximum 10"),
    (json.dumps({"queries": ["q"] * 9}).encode(), 413, "too many queries"),
])
def test_server_rejects_malformed_requests(server, payload, status, message):
    code, body = _post(server["url"], payload)
    assert code == status and message in body["error"]


def test_client_reports_4xx_without_retrying(server):
    client = HTTPRetriever(server["url"], timeout=30, retries=3, backoff=5.0)
    with pytest.raises(RetrievalError) as e:
        client.search(["river"], k=50)
    assert e.value.attempts == 1 and "HTTP 400" in str(e.value) and "maximum" in str(e.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_client_reports_a_server_that_is_down():
    client = HTTPRetriever(f"http://127.0.0.1:{_free_port()}", timeout=2, retries=2, backoff=0.05)
    t0 = time.perf_counter()
    with pytest.raises(RetrievalError) as e:
        client.search(["anything", "else"], k=3)
    assert e.value.attempts == 3 and "after 3 attempts" in str(e.value)
    assert time.perf_counter() - t0 < 30  # hang guard only


def test_client_times_out_on_a_server_that_never_answers():
    with socket.socket() as s:  # accepts connections (backlog) but never replies
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        client = HTTPRetriever(f"http://127.0.0.1:{s.getsockname()[1]}", timeout=0.5, retries=1, backoff=0.0)
        t0 = time.perf_counter()
        with pytest.raises(RetrievalError) as e:
            client.search(["q"], k=1)
        assert e.value.attempts == 2 and "timed out" in str(e.value).lower()
        assert time.perf_counter() - t0 < 30  # hang guard only


def test_in_process_server_health_and_bad_corpus(tmp_path):
    r = BM25Retriever(synthetic_corpus(tmp_path / "c.jsonl", 5), cache_dir=tmp_path / "cache")
    srv = RetrievalServer(r, port=0).start()
    try:
        with urllib.request.urlopen(srv.url + "/health", timeout=30) as resp:
            assert json.loads(resp.read()) == {"status": "ok", "retriever": "bm25", "num_docs": 5}
        assert HTTPRetriever(srv.url + "/retrieve", retries=0).search(["item2"], 1)[0][0].id == "p2"
        req = urllib.request.Request(srv.url + "/nope", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 404 and "unknown path" in json.loads(e.value.read())["error"]
    finally:
        srv.shutdown()
    # a missing corpus is a clean CLI error, not a traceback
    assert main(["retrieve", "serve", "--corpus", str(tmp_path / "missing.jsonl"), "--port", "0"]) == 2


def test_serve_errors_name_the_corpus_or_the_cache_dir(tmp_path, capsys):
    """A corpus with nothing BM25 can index, or a --cache-dir that is a file: one `tether: error:` line, exit 2."""
    stop = write_jsonl(tmp_path / "stop.jsonl", [{"id": "1", "title": "the", "text": "of and a"},
                                                 {"id": "2", "title": "a", "text": "the ."}])
    assert main(["retrieve", "serve", "--corpus", str(stop), "--port", "0", "--cache-dir", str(tmp_path / "c")]) == 2
    assert f"tether: error: {stop}: no passage has a word BM25 can index" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    ok = synthetic_corpus(tmp_path / "ok.jsonl", 4)
    assert main(["retrieve", "serve", "--corpus", str(ok), "--port", "0", "--cache-dir", str(tmp_path / "afile")]) == 2
    err = capsys.readouterr().err
    assert "tether: error: cannot create the BM25 index cache" in err and "--cache-dir" in err, err


def _raw_post(body: bytes) -> bytes:
    return (b"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


def _read_answers(sock: socket.socket, n: int) -> list[dict]:
    """n HTTP answers read off a raw socket (Content-Length framed)."""
    f = sock.makefile("rb")
    out = []
    for _ in range(n):
        assert f.readline().startswith(b"HTTP/1.1 200"), "not a 200 answer"
        length = None
        while (line := f.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        out.append(json.loads(f.read(length)))
    return out


def test_idle_keep_alive_client_does_not_hold_the_only_worker(tmp_path):
    """With one worker, a client idling on a kept-alive connection gives the worker up as soon as
    another connection waits (client_timeout is 300 s, so only that can answer the second client)."""
    r = BM25Retriever(synthetic_corpus(tmp_path / "c.jsonl", 5), cache_dir=tmp_path / "cache")
    srv = RetrievalServer(r, port=0, workers=1, client_timeout=300).start()
    host, port = srv.url[len("http://"):].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=60) as idle:
            idle.sendall(_raw_post(json.dumps({"queries": ["item1"], "topk": 1}).encode()))
            assert _read_answers(idle, 1)[0]["result"][0][0]["id"] == "p1"
            # the idle connection is still open; a second client must be answered anyway
            status, body = _post(srv.url, json.dumps({"queries": ["item2"], "topk": 1}).encode())
            assert status == 200 and body["result"][0][0]["id"] == "p2"
            assert idle.recv(1) == b""  # the server closed the idle one
    finally:
        srv.shutdown()


def test_pipelined_requests_on_one_connection_are_all_answered(tmp_path):
    r = BM25Retriever(synthetic_corpus(tmp_path / "c.jsonl", 5), cache_dir=tmp_path / "cache")
    srv = RetrievalServer(r, port=0, workers=1, client_timeout=300).start()
    host, port = srv.url[len("http://"):].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(b"".join(_raw_post(json.dumps({"queries": [f"item{i}"], "topk": 1}).encode()) for i in range(3)))
            answers = _read_answers(s, 3)
        assert [a["result"][0][0]["id"] for a in answers] == ["p0", "p1", "p2"]
    finally:
        srv.shutdown()


def test_in_process_server_bind_problems_raise_retrieval_error(tmp_path):
    r = BM25Retriever(synthetic_corpus(tmp_path / "c.jsonl", 5), cache_dir=tmp_path / "cache")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        with pytest.raises(RetrievalError, match="already in use"):
            RetrievalServer(r, port=busy.getsockname()[1])
    for port in (-1, 65536):
        with pytest.raises(RetrievalError, match="0-65535"):
            RetrievalServer(r, port=port)
    with pytest.raises(RetrievalError, match="does not resolve"):
        RetrievalServer(r, host="no.such.host.invalid", port=0)


def test_connections_without_a_whole_request_head_are_closed_after_the_client_timeout(tmp_path):
    """A connection that sends nothing, or half a request head, waits in the server's gate (tether.search.gate)
    without a worker and is closed `client_timeout` after it connected; the server answers on (one worker)."""
    r = BM25Retriever(synthetic_corpus(tmp_path / "c.jsonl", 5), cache_dir=tmp_path / "cache")
    srv = RetrievalServer(r, port=0, workers=1, client_timeout=1.0).start()
    host, port = srv.url[len("http://"):].rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(5)]
    try:
        for s in socks[3:]:
            s.sendall(b"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no blank line: half a head
        deadline = time.monotonic() + 10
        for s in socks:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            assert s.recv(1) == b"", "the server sent something to a connection without a request"
        status, body = _post(srv.url, json.dumps({"queries": ["item2"], "topk": 1}).encode())
        assert status == 200 and body["result"][0][0]["id"] == "p2"
    finally:
        for s in socks:
            s.close()
        srv.shutdown()
