"""The ``http`` retriever: a client of a Search-R1-compatible retrieval server (``POST /retrieve``),
with timeouts and retries. See :mod:`tether.search.retrievers`."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

from .corpus import Passage, split_contents
from .retriever_base import RetrievalError, _check_args


class HTTPRetriever:
    """Client of a Search-R1-compatible retrieval server.

    One ``search`` call is one ``POST {url}/retrieve`` with
    ``{"queries": [...], "topk": k, "return_scores": true}`` (all of a turn's queries in one
    request); the answer ``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}``
    becomes one list of passages per query (servers that leave out scores, i.e. send bare
    documents, are accepted with score 0).

    Args:
        url: Server address, ``http://host:port`` (``/retrieve`` is appended) or the full
            endpoint URL.
        timeout: Seconds per attempt (connect + answer).
        retries: Further attempts after a failed one (connection error, timeout, 5xx,
            malformed body). A 4xx answer is not retried.
        backoff: Seconds before the first retry, doubled each time.

    Raises (from :meth:`search`): :class:`RetrievalError` once every attempt failed; the whole
    call takes at most about ``(retries + 1) * timeout + backoff * (2**retries - 1)`` seconds.
    """

    kind = "http"

    def __init__(self, url: str, *, timeout: float = 30.0, retries: int = 2, backoff: float = 0.5):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise RetrievalError(f"url must start with http:// or https://, got {url!r}")
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        if self.timeout <= 0 or self.retries < 0 or self.backoff < 0:
            raise RetrievalError("timeout must be > 0, retries and backoff >= 0")

    def _post(self, payload: dict) -> Any:
        data = json.dumps(payload).encode("utf-8")
        req = urllib.request.Request(self.url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return json.loads(resp.read().decode("utf-8"))

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """Top-``k`` passages per query from the server (raises :class:`RetrievalError`)."""
        queries = _check_args(queries, k)
        if not queries:
            return []
        payload = {"queries": queries, "topk": k, "return_scores": True}
        last = ""
        attempts = 0
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            attempts += 1
            try:
                body = self._post(payload)
            except urllib.error.HTTPError as e:
                detail = _read_error(e)
                last = f"HTTP {e.code} from {self.url}: {detail}"
                if 400 <= e.code < 500:
                    raise RetrievalError(last, attempts) from None
                continue
            except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
                reason = getattr(e, "reason", e)
                last = f"request to {self.url} failed: {type(reason).__name__}: {reason}"
                continue
            try:
                return _parse_result(body, len(queries))
            except RetrievalError as e:
                last = f"malformed answer from {self.url}: {e}"
                continue
        raise RetrievalError(f"{last} (after {attempts} attempt{'s' if attempts > 1 else ''})", attempts)

    def __repr__(self) -> str:
        return f"HTTPRetriever({self.url!r}, timeout={self.timeout}, retries={self.retries})"


def _read_error(e: urllib.error.HTTPError) -> str:
    try:
        text = e.read().decode("utf-8", "replace")
    except Exception:
        return str(e.reason)
    try:
        j = json.loads(text)
        if isinstance(j, dict) and ("error" in j or "detail" in j):
            return str(j.get("error", j.get("detail")))
    except ValueError:
        pass
    return text[:500] or str(e.reason)


def _doc_to_passage(item: Any, score: float) -> Passage:
    if not isinstance(item, dict):
        raise RetrievalError(f"a document must be an object, got {type(item).__name__}")
    if "contents" in item and isinstance(item["contents"], str):
        title, text = split_contents(item["contents"])
        contents = item["contents"]
    elif isinstance(item.get("text"), str):
        title, text = str(item.get("title", "")).strip().strip('"'), item["text"].strip()
        contents = f'"{title}"\n{text}'
    else:
        raise RetrievalError("a document has neither 'contents' nor 'text'")
    return Passage(str(item.get("id", "")), title, text, float(score), contents)


def _parse_result(body: Any, n: int) -> list[list[Passage]]:
    if not isinstance(body, dict) or not isinstance(body.get("result"), list):
        raise RetrievalError("expected an object with a 'result' list")
    result = body["result"]
    if len(result) != n:
        raise RetrievalError(f"{len(result)} result lists for {n} queries")
    out = []
    for hits in result:
        if not isinstance(hits, list):
            raise RetrievalError("each result must be a list")
        row = []
        for h in hits:
            if isinstance(h, dict) and "document" in h:
                row.append(_doc_to_passage(h["document"], float(h.get("score", 0.0))))
            else:
                row.append(_doc_to_passage(h, 0.0))
        out.append(row)
    return out
