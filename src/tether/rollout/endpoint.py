"""A vLLM-style token-in / token-out endpoint in front of any tether engine (``POST /inference/v1/generate``,
``GET /v1/models``), on loopback, for clients that call vLLM themselves: verifiers 0.4's ``TrainClient``
(`tether.agents.verifiers_v1`).

Why tether serves this rather than pointing the client at vLLM directly: verifiers' client (through the
``renderers`` package) reads every log-prob entry of the answer as ``{"token": "token_id:<id>", "logprob": ...}``,
and vLLM 0.32's ``/inference/v1/generate`` answers ``{"token_id": <id>, "logprob": ...}`` (its tokens-only shape,
no ``token`` string), which the client refuses ("choice.logprobs.content[0].token must be 'token_id:181'"). So
this is the thinnest adapter: a request becomes one ``engine.generate`` call of the run's own engine (the served
engine: its vLLM servers, with their weights versions, sticky sessions and the sampler's log-probs; or the hf
engine on CPU without vLLM, recording the log-probs of what it samples), and the answer carries both fields. The
same adapter serves the hf engine, so the route also runs in tether's default environment.

What a request may ask (vLLM's ``SamplingParams`` keys verifiers sends): ``n``, ``temperature``, ``top_p``,
``top_k``, ``max_tokens`` (required: vLLM's default of 16 is never assumed), ``min_tokens``, ``stop`` (strings),
``stop_token_ids`` (the renderer's: a row ends at the first of them, inclusive, as at EOS), ``seed``; ``logprobs``,
``skip_special_tokens``, ``detokenize`` and ``include_stop_str_in_output`` are accepted (the answer always has the
sampled token's log-prob, never top alternatives); any other key is a 400 naming it, so a setting is never silently
dropped. A bearer token (made here, handed to the client through an environment variable) guards both routes.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import secrets
import threading
import time
import uuid
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from ..userio import loads_json
from .base import SamplingParams

#: sampling keys accepted and honoured; `IGNORED` accepted and without effect on what tether returns
HONOURED = ("n", "temperature", "top_p", "top_k", "max_tokens", "min_tokens", "stop", "stop_token_ids", "seed")
IGNORED = ("logprobs", "skip_special_tokens", "detokenize", "include_stop_str_in_output",
           "spaces_between_special_tokens")
MAX_BODY = 64 << 20


class RequestError(ValueError):
    """A request the endpoint refuses (HTTP 400), with the reason."""


def sampling_from(body: dict, default_seed: Optional[int] = None) -> tuple[SamplingParams, list[int]]:
    """A request's ``sampling_params`` as tether's `SamplingParams`, and its ``stop_token_ids``."""
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise RequestError("sampling_params must be an object")
    unknown = sorted(set(sp) - set(HONOURED) - set(IGNORED))
    if unknown:
        raise RequestError(f"sampling_params {unknown} are not supported by tether's endpoint (supported: "
                           f"{', '.join(HONOURED)})")
    if sp.get("max_tokens") is None:
        raise RequestError("sampling_params.max_tokens is required (vLLM's default of 16 is never assumed)")
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    seed = sp.get("seed", default_seed)
    params = SamplingParams(n=int(sp.get("n") or 1), temperature=float(sp.get("temperature", 1.0)),
                            top_p=float(sp.get("top_p", 1.0)), top_k=max(0, int(sp.get("top_k") or 0)),
                            max_new_tokens=int(sp["max_tokens"]), min_new_tokens=int(sp.get("min_tokens") or 0),
                            stop=stop, seed=None if seed is None else int(seed))
    try:
        params.validate()
    except ValueError as e:
        raise RequestError(f"sampling_params: {e}") from None
    return params, [int(t) for t in (sp.get("stop_token_ids") or [])]


def _cut(ids: list[int], logps: list[float], versions: list[int], stops: list[int], reason: str):
    """A row cut at the first of the renderer's stop ids (kept, as EOS is), when the engine went past it."""
    for k, t in enumerate(ids):
        if t in stops:
            return ids[: k + 1], logps[: k + 1], versions[: k + 1], "stop"
    return ids, logps, versions, reason


class GenerateEndpoint:
    """The endpoint (module doc) over ``engine`` on ``127.0.0.1`` (a free port); ``url``, ``token`` (the bearer),
    ``close()``. ``model``: the name it serves (``/v1/models``); ``max_model_len``: the longest prompt + response
    it admits (the engine's, else ``max_len``)."""

    def __init__(self, engine, *, model: str = "tether", max_len: int = 0, seed: Optional[int] = None):
        self.engine, self.model, self.token = engine, model, secrets.token_hex(16)
        self.max_model_len = int(getattr(engine, "max_model_len", 0) or max_len or 0)
        self.seed = seed
        self._count = 0
        self._lock = threading.Lock()  # an engine that is not thread-safe (hf) runs one request at a time
        self._shared = bool(getattr(engine, "thread_safe", False))
        self._batcher = _Batcher(engine)
        self._busy, self._busy_since, self._busy_s = 0, 0.0, 0.0  # requests generating; since when; seconds so far
        self.versions: dict[str, list[list[int]]] = {}  # session id -> each call's token versions (served engine)
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # no per-request lines on stderr
                pass

            def _send(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if self.headers.get("Authorization", "") == f"Bearer {endpoint.token}":
                    return True
                self._send(401, {"error": "Unauthorized"})
                return False

            def do_GET(self):
                if not self._authorized():
                    return
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": endpoint.model, "object": "model",
                                                                 "max_model_len": endpoint.max_model_len}]})
                else:
                    self._send(404, {"error": f"no route {self.path}"})

            def do_POST(self):
                if not self._authorized():
                    return
                if self.path.rstrip("/") != "/inference/v1/generate":
                    self._send(404, {"error": f"no route {self.path}"})
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    self._send(413, {"error": "request too large"})
                    return
                try:
                    body = loads_json(self.rfile.read(length).decode("utf-8"))
                    if not isinstance(body, dict):
                        raise RequestError("the body must be a JSON object")
                    self._send(200, endpoint.generate(body, self.headers.get("X-Session-ID")))
                except (RequestError, ValueError) as e:
                    self._send(400, {"error": str(e)})
                except Exception as e:  # noqa: BLE001  (the engine's failure: the client reports it, the run names it)
                    endpoint.failure = e
                    self._send(500, {"error": f"{type(e).__name__}: {e}"})

        self.failure: Optional[BaseException] = None  # the last engine failure (the agent raises it after the rollout)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="tether-endpoint")
        self._thread.start()

    def generate(self, body: dict, session: Optional[str] = None) -> dict:
        """One request: ``token_ids`` and ``sampling_params`` in; vLLM's answer shape out, with both log-prob forms."""
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise RequestError("token_ids must be a non-empty list of token ids")
        if self.max_model_len and len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; the model admits {self.max_model_len}")
        with self._lock:
            self._count += 1
            default_seed = None if self.seed is None else (self.seed * 1_000_003 + self._count) % 2**31
        params, stops = sampling_from(body, default_seed)
        self._generating(+1)
        try:
            if self._shared:  # the served engine: its requests go to its servers concurrently
                sessions = [session] * params.n if session else None
                rb = self.engine.generate([ids], params, sessions=sessions)
                rows = list(range(len(rb)))
            else:  # one engine call for the requests that arrive together (the hf engine batches them)
                rb, rows = self._batcher.submit(ids, params)
        finally:
            self._generating(-1)
        choices = []
        for k, i in enumerate(rows):
            m = rb.response_mask[i]
            toks = rb.response_ids[i][m].tolist()
            logps = rb.sampler_logp[i][m].tolist() if rb.sampler_logp is not None else None
            if logps is None:
                raise RuntimeError("the engine reported no log-probs of the tokens it sampled")
            vers = rb.token_version[i][m].tolist() if rb.token_version is not None else [-1] * len(toks)
            toks, logps, vers, reason = _cut(toks, logps, vers, stops, rb.finish_reason[i])
            if session and rb.token_version is not None:
                self.versions.setdefault(session, []).append(vers)
            choices.append({"index": k, "token_ids": toks, "finish_reason": reason, "stop_reason": None,
                            "logprobs": {"content": [{"token": f"token_id:{t}", "token_id": t, "logprob": lp}
                                                     for t, lp in zip(toks, logps)]}})
        return {"request_id": f"tether-{uuid.uuid4().hex}", "model": self.model, "prompt_token_ids": ids,
                "choices": choices, "usage": {"prompt_tokens": len(ids),
                                              "completion_tokens": sum(len(c["token_ids"]) for c in choices)}}

    def _generating(self, d: int) -> None:
        """One request starts (+1) or ends (-1) generating; `busy_s` adds the time at least one was."""
        with self._lock:
            now = time.perf_counter()
            if self._busy == 0 and d > 0:
                self._busy_since = now
            self._busy += d
            if self._busy == 0:
                self._busy_s += now - self._busy_since

    @property
    def busy_s(self) -> float:
        """Wall-clock seconds during which at least one request was generating (concurrent requests counted once):
        the generation time of the rollouts the endpoint served (`RolloutBatch.gen_time_s`)."""
        with self._lock:
            return self._busy_s + (time.perf_counter() - self._busy_since if self._busy else 0.0)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._batcher.close()


class _Batcher:
    """Requests to an engine that is not thread-safe, run by one thread: the requests waiting when it frees up (those
    with the same sampling parameters) go to the engine as one ``generate`` call, so the concurrent episodes of a
    step are one batch. ``submit`` returns the call's batch and the request's rows in it."""

    def __init__(self, engine, wait_s: float = 0.02):
        self.engine, self.wait_s = engine, wait_s
        self._q: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tether-endpoint-batcher")
        self._thread.start()

    def submit(self, ids: list[int], params: SamplingParams):
        fut: Future = Future()
        self._q.put((ids, params, fut))
        return fut.result()

    def _run(self) -> None:
        while True:
            first = self._q.get()
            if first is None:
                return
            batch, deadline = [first], time.monotonic() + self.wait_s
            while True:
                try:
                    item = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    self._q.put(None)
                    break
                batch.append(item)
            key = lambda p: dataclasses.replace(p, seed=None)  # noqa: E731  (requests that sample alike)
            while batch:
                same = [b for b in batch if key(b[1]) == key(batch[0][1])]
                batch = [b for b in batch if key(b[1]) != key(batch[0][1])]
                try:
                    rb = self.engine.generate([b[0] for b in same], same[0][1])
                except BaseException as e:  # noqa: BLE001  (every waiting request gets the engine's error)
                    for b in same:
                        b[2].set_exception(e)
                    continue
                n = same[0][1].n
                for g, b in enumerate(same):
                    b[2].set_result((rb, list(range(g * n, (g + 1) * n))))

    def close(self) -> None:
        self._q.put(None)
