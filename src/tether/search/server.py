"""A Search-R1-compatible retrieval server over a local index: ``tether retrieve serve``.

Built on the standard library's ``http.server`` (no extra dependency). Connections wait in a
listen backlog of 1024 (the kernel may cap it at ``net.core.somaxconn``; the standard library's
default of 5 made bursts of clients get reset) and are served by a bounded pool of ``workers``
daemon threads (64 by default, ``--workers``), in the order their requests arrive: a burst beyond
the pool waits its turn instead of being refused or starting one thread per connection. A
connection gets a worker only once its request head has arrived (`tether.search.gate`): clients
that connect and send nothing, or half a head, never hold one, however many there are, and are
closed ``client_timeout`` after they connected. Reading and parsing
requests and writing answers run in parallel; the searches themselves run one at a time under
a lock, because neither built-in index is thread-safe (BM25 shares one PyStemmer stemmer, which
is not; dense shares one Hugging Face fast tokenizer, which can raise "Already borrowed" when
two threads use it at once); a retriever with a true ``thread_safe`` attribute is searched without the lock.
A worker holds an idle HTTP/1.1 keep-alive connection only while no other connection waits for
one (then it closes it; clients reconnect), and gives up on a client silent for
``client_timeout`` (``CLIENT_TIMEOUT_S``, 10 s, per read or write).

``POST /retrieve`` with ``{"queries": [str, ...], "topk": int, "return_scores": bool}``
answers ``{"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}`` (one list
per query, best first) when ``return_scores`` is true, and ``{"result": [[{"id", "contents"},
...], ...]}`` otherwise: the API of Search-R1's ``search_r1/search/retrieval_server.py``, so
Search-R1 clients and :class:`~tether.search.retrievers.HTTPRetriever` work with either.
``topk`` defaults to ``default_topk`` (3). ``GET /health`` answers
``{"status": "ok", "retriever", "num_docs"}``.

A malformed request gets a 4xx with ``{"error": message}``: invalid JSON or a body that is not
an object (400), ``queries`` missing or not a list of strings (400), ``topk`` not a positive
integer or above ``topk_max`` (400), more than ``max_queries`` queries or a body over 16 MiB
(413), an unknown path (404). JSON nested too deeply for the parser is invalid JSON (400). A
client that goes away before its answer is sent costs one line on stderr, not a traceback.

The server binds to 127.0.0.1 unless told otherwise: it has no authentication. A port outside
0-65535, a host that does not resolve or an address in use raises
:class:`~tether.search.retrievers.RetrievalError` (``tether retrieve serve`` checks them before
loading the index and exits 2 with one ``tether: error:`` line).
"""

from __future__ import annotations

import errno
import json
import queue
import select
import socket
import sys
import threading
import time
from contextlib import nullcontext
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from ..userio import loads_json
from .gate import HeadGate
from .retrievers import RetrievalError, Retriever, make_retriever

__all__ = ["RetrievalServer", "validate_request", "RequestError", "add_retrieve_parser", "check_listen_address"]

MAX_BODY_BYTES = 16 << 20
LISTEN_BACKLOG = 1024  # connections the kernel queues before accept (capped by net.core.somaxconn)
DEFAULT_WORKERS = 64  # threads serving connections; more connections wait their turn in arrival order
CLIENT_TIMEOUT_S = 10.0  # a worker gives up on a client silent this long (also ends idle keep-alive)


class RequestError(ValueError):
    """A malformed request: ``status`` is the HTTP code to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def validate_request(body: Any, *, topk_max: int, max_queries: int, default_topk: int) -> tuple[list[str], int, bool]:
    """Check a decoded ``/retrieve`` body; returns ``(queries, topk, return_scores)``.

    Raises:
        RequestError: with the status and message the client gets.
    """
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
    if "queries" not in body:
        raise RequestError("missing field 'queries' (a list of strings)")
    queries = body["queries"]
    if not isinstance(queries, list):
        raise RequestError(f"'queries' must be a list of strings, got {type(queries).__name__}")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise RequestError(f"'queries'[{i}] must be a string, got {type(q).__name__}")
    if len(queries) > max_queries:
        raise RequestError(f"too many queries: {len(queries)} > {max_queries} per request", 413)
    topk = body.get("topk", default_topk)
    if topk is None:
        topk = default_topk
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise RequestError(f"'topk' must be a positive integer, got {topk!r}")
    if topk > topk_max:
        raise RequestError(f"'topk' {topk} is above this server's maximum {topk_max}")
    rs = body.get("return_scores", False)
    if not isinstance(rs, bool):
        raise RequestError(f"'return_scores' must be true or false, got {rs!r}")
    return queries, topk, rs


_log_lock = threading.Lock()


def _log(line: str) -> None:
    """One whole line on stderr (``print`` from two threads can interleave a message and a newline)."""
    with _log_lock:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _check_port(port: Any, name: str = "port") -> int:
    if isinstance(port, str) and port.strip().lstrip("-").isdigit():
        port = int(port)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise RetrievalError(f"{name} must be in 0-65535 (0 picks a free one), got {port!r}")
    return port


def _address_family(host: str, port: int) -> socket.AddressFamily:
    """The family to listen on for ``host`` (IPv4 when it has both); a host that does not resolve
    raises :class:`RetrievalError`."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise RetrievalError(f"cannot listen on {host}:{port}: the host {host!r} does not resolve ({reason})") from e
    families = [info[0] for info in infos]
    return socket.AF_INET if socket.AF_INET in families else families[0]


def _bind_error(host: str, port: int, e: OSError) -> RetrievalError:
    where = f"cannot listen on {host}:{port}"
    if e.errno == errno.EADDRINUSE:
        why = "address already in use (another server? pick another --port, or --port 0 for a free one)"
    elif e.errno == errno.EADDRNOTAVAIL:
        why = "the address is not one of this machine's"
    elif e.errno == errno.EACCES:
        why = "permission denied (ports below 1024 need privileges)"
    else:
        why = e.strerror or str(e)
    return RetrievalError(f"{where}: {why}")


def check_listen_address(host: str, port: int) -> None:
    """Raise :class:`RetrievalError` unless ``host:port`` can be listened on now: the port is in
    0-65535, the host resolves and nothing holds the address. ``tether retrieve serve`` calls it
    before loading the index (which may take minutes), then binds for real."""
    port = _check_port(port)
    family = _address_family(host, port)
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        probe.bind((host, port))
    except OSError as e:
        raise _bind_error(host, port, e) from e
    finally:
        probe.close()


class _Handler(BaseHTTPRequestHandler):
    server: "_HTTPServer"
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.timeout = self.server.owner.client_timeout  # for every read and write on the connection
        super().setup()

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()
        while not self.close_connection and self._await_next_request():
            self.handle_one_request()

    def _await_next_request(self) -> bool:
        """Between two requests on a kept-alive connection: True when the client sent more (or closed:
        the next read sees it), False when it stayed silent for the timeout or when another connection
        waits for a worker (an idle client must not hold one; it reconnects when it needs to)."""
        sock = self.connection
        deadline = time.monotonic() + self.timeout
        try:
            while True:
                sock.settimeout(0)  # a pipelined request may sit in rfile's buffer, not in the socket
                try:
                    if self.rfile.peek(1):
                        return True
                finally:
                    sock.settimeout(self.timeout)
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if select.select([sock], [], [], min(0.05, left))[0]:
                    return True
                if self.server.waiting():
                    return False
        except (OSError, ValueError):  # the client went away between requests: nothing was lost
            return False

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if self.server.owner.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, obj: Any) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        if self.server.waiting():  # keep a connection open only while no other one waits for a worker
            self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        owner = self.server.owner
        if self.path.rstrip("/") == "/health":
            self._send(200, {"status": "ok",
                             "retriever": getattr(owner.retriever, "kind", type(owner.retriever).__name__),
                             "num_docs": owner.num_docs})
        else:
            self._send(404, {"error": f"unknown path {self.path!r}; POST /retrieve or GET /health"})

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        owner = self.server.owner
        if self.path.rstrip("/") != "/retrieve":
            self._send(404, {"error": f"unknown path {self.path!r}; POST /retrieve"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self._send(400, {"error": "invalid Content-Length"})
            return
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            self._send(413, {"error": f"body of {length} bytes is over the {MAX_BODY_BYTES} byte limit"})
            return
        raw = self.rfile.read(length) if length > 0 else b""
        try:
            body = loads_json(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            self._send(400, {"error": f"the body is not valid JSON: {e}"})
            return
        except RecursionError:  # e.g. "[" * 200000: the parser recurses once per level
            self._send(400, {"error": "the body is not valid JSON: nested too deeply for the parser"})
            return
        try:
            queries, topk, return_scores = validate_request(
                body, topk_max=owner.topk_max, max_queries=owner.max_queries, default_topk=owner.default_topk)
        except RequestError as e:
            self._send(e.status, {"error": str(e)})
            return
        try:
            with owner.lock:
                hits = owner.retriever.search(queries, topk) if queries else []
        except RetrievalError as e:
            self._send(400, {"error": str(e)})
            return
        except Exception as e:  # a retriever bug must not kill the server
            self._send(500, {"error": f"{type(e).__name__}: {e}"})
            return
        result = []
        for row in hits:
            docs = [{"id": p.id, "contents": p.contents or f'"{p.title}"\n{p.text}'} for p in row]
            result.append([{"document": d, "score": p.score} for d, p in zip(docs, row)] if return_scores else docs)
        self._send(200, {"result": result})


class _HTTPServer(HTTPServer):
    """``HTTPServer`` with a real listen backlog and a bounded pool of daemon worker threads."""

    request_queue_size = LISTEN_BACKLOG
    owner: "RetrievalServer"

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, workers: int, head_timeout: float):
        self.address_family = family
        self._pending: queue.SimpleQueue = queue.SimpleQueue()  # connections with a whole request head, for a worker
        self._workers: list[threading.Thread] = []  # a failed bind calls server_close before any starts
        self._gate = None
        super().__init__(address, _Handler)
        self._gate = HeadGate(lambda sock, addr: self._pending.put((sock, addr)), self.shutdown_request, head_timeout)
        self._workers = [threading.Thread(target=self._work, name=f"tether-retrieve-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._workers:
            t.start()

    def process_request(self, request, client_address) -> None:
        self._gate.add(request, client_address)  # a worker takes it once its request head has arrived

    def waiting(self) -> bool:
        """Whether accepted connections wait for a worker."""
        return not self._pending.empty()

    def _work(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:  # noqa: BLE001 - reported by handle_error, the worker lives on
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        """One line for a client that went away or went silent; the standard traceback for anything
        else (a bug in tether)."""
        e = sys.exc_info()[1]
        who = ":".join(map(str, client_address[:2])) if isinstance(client_address, tuple) else str(client_address)
        if isinstance(e, ConnectionError):  # BrokenPipeError, ConnectionResetError, ConnectionAbortedError
            _log(f"[tether] retrieve: client {who} went away before the answer was sent")
        elif isinstance(e, TimeoutError):
            _log(f"[tether] retrieve: client {who} was silent for {self.owner.client_timeout:g} s in the middle of "
                 "a request; connection closed")
        else:
            super().handle_error(request, client_address)

    def server_close(self) -> None:
        """Close the listening socket; the workers finish the connections already accepted, then stop."""
        super().server_close()
        if self._gate is not None:
            self._gate.close()  # connections that never sent a whole head are closed
        for _ in self._workers:
            self._pending.put(None)
        deadline = time.monotonic() + 2.0  # daemon threads: a worker stuck on a slow client is left behind
        for t in self._workers:
            t.join(timeout=max(0.0, deadline - time.monotonic()))


class RetrievalServer:
    """Serve ``retriever`` over HTTP (see the module docstring).

    Args:
        retriever: Any :class:`~tether.search.retrievers.Retriever`.
        host / port: Bind address (default 127.0.0.1; port 0 picks a free port, see ``url``).
        topk_max: Largest ``topk`` accepted. max_queries: most queries per request.
        default_topk: ``topk`` when the request has none.
        workers: Threads serving connections (a bounded pool; more connections wait in arrival order).
        client_timeout: Seconds a worker waits on a silent client (per read or write; also how long an
            idle kept-alive connection is held while no other connection waits).

    Raises:
        RetrievalError: a port outside 0-65535, a host that does not resolve, an address in use.
    """

    def __init__(self, retriever: Retriever, *, host: str = "127.0.0.1", port: int = 8000, topk_max: int = 50,
                 max_queries: int = 1024, default_topk: int = 3, verbose: bool = False,
                 workers: int = DEFAULT_WORKERS, client_timeout: float = CLIENT_TIMEOUT_S):
        self.retriever = retriever
        self.topk_max = int(topk_max)
        self.max_queries = int(max_queries)
        self.default_topk = min(int(default_topk), self.topk_max)
        self.verbose = verbose
        corpus = getattr(retriever, "corpus", None)
        self.num_docs = len(corpus) if corpus is not None else None
        if int(workers) < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if not client_timeout > 0:
            raise ValueError(f"client_timeout must be > 0, got {client_timeout}")
        self.client_timeout = float(client_timeout)
        # neither built-in index is thread-safe: searches run one at a time unless the retriever says otherwise
        self.lock = nullcontext() if getattr(retriever, "thread_safe", False) is True else threading.Lock()
        port = _check_port(port)
        family = _address_family(host, port)
        try:
            self._httpd = _HTTPServer((host, port), family, int(workers), self.client_timeout)
        except OSError as e:
            raise _bind_error(host, port, e) from e
        self._httpd.owner = self
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` actually bound."""
        host, port = self._httpd.server_address[:2]
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown` (or Ctrl-C)."""
        self._httpd.serve_forever(poll_interval=0.2)

    def start(self) -> "RetrievalServer":
        """Serve from a background daemon thread (for in-process use and tests)."""
        self._thread = threading.Thread(target=self.serve_forever, name="tether-retrieval-server", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop serving and close the socket."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()


def _serve(args) -> int:
    for flag in ("topk", "topk_max", "max_queries", "workers"):
        if getattr(args, flag) < 1:
            print(f"tether: error: --{flag.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.topk > args.topk_max:
        print(f"tether: error: --topk {args.topk} (the default per request) is above --topk-max {args.topk_max}",
              file=sys.stderr)
        return 2
    try:  # before the index load, which may take minutes
        _check_port(args.port, "--port")
        check_listen_address(args.host, args.port)
    except RetrievalError as e:
        print(f"tether: error: {e}", file=sys.stderr)
        return 2
    options: dict[str, Any] = {"corpus": args.corpus}
    if args.cache_dir:
        options["cache_dir"] = args.cache_dir
    if args.retriever == "dense" and args.model:
        options["model"] = args.model
    try:
        retriever = make_retriever(args.retriever, **options)
    except RetrievalError as e:
        print(f"tether: error: {e}", file=sys.stderr)
        return 2
    built = getattr(retriever, "build_seconds", 0.0)
    how = "loaded from cache" if getattr(retriever, "loaded_from_cache", False) else f"built in {built:.1f} s"
    try:
        server = RetrievalServer(retriever, host=args.host, port=args.port, topk_max=args.topk_max,
                                 max_queries=args.max_queries, default_topk=args.topk, verbose=args.verbose,
                                 workers=args.workers)
    except RetrievalError as e:  # the address was taken while the index loaded
        print(f"tether: error: {e}", file=sys.stderr)
        return 2
    n = server.num_docs
    print(f"[tether] serving {args.retriever} over {args.corpus} ({n} passages; index {how}) on {server.url}",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server._httpd.server_close()
    return 0


def add_retrieve_parser(sub) -> None:
    """Register ``tether retrieve serve`` on an ``argparse`` subparsers object."""
    r = sub.add_parser("retrieve", help="retrieval for search agents (serve a local index over HTTP)")
    rsub = r.add_subparsers(dest="retrieve_cmd", required=True, metavar="serve")
    s = rsub.add_parser("serve", help="serve a Search-R1-compatible POST /retrieve API over a local corpus",
                        description="Build (or load from cache) an index over a JSONL corpus ({id, contents}) and "
                        "serve POST /retrieve {queries, topk, return_scores} like Search-R1's retrieval server.")
    s.add_argument("--corpus", required=True,
                   help="JSONL corpus file, rows {\"id\", \"contents\": \"\\\"Title\\\"\\ntext\"}")
    s.add_argument("--retriever", choices=["bm25", "dense"], default="bm25", help="index kind (default bm25)")
    s.add_argument("--model", default=None,
                   help="dense only: sentence-transformers model (default intfloat/e5-base-v2)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; the API has no auth)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one, printed)")
    s.add_argument("--topk", type=int, default=3, help="topk when a request gives none (default 3)")
    s.add_argument("--topk-max", dest="topk_max", type=int, default=50, help="largest topk accepted (default 50)")
    s.add_argument("--max-queries", dest="max_queries", type=int, default=1024, help="most queries per request")
    s.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help=f"threads serving connections (default "
                   f"{DEFAULT_WORKERS}; more wait their turn; searches still run one at a time)")
    s.add_argument("--cache-dir", dest="cache_dir", default=None, help="index cache root (default: beside the "
                   "corpus if writable, else $TETHER_CACHE_DIR or ~/.cache/tether)")
    s.add_argument("--verbose", action="store_true", help="log every request to stderr")
    s.set_defaults(fn=_serve)
