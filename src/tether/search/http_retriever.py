"""The ``http`` retriever: a client of a Search-R1-compatible retrieval server (``POST /retrieve``),
with timeouts and retries. See :mod:`tether.search.retrievers`."""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

from ..userio import loads_json
from .corpus import Corpus, Passage, split_contents
from .retriever_base import RetrievalError, as_corpus, check_search_args


class HTTPRetriever:
    """Client of a Search-R1-compatible retrieval server.

    One ``search`` call is one ``POST {url}/retrieve`` with
    ``{"queries": [...], "topk": k, "return_scores": true}`` (all of a turn's queries in one
    request); the answer ``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}``
    becomes one list of passages per query (servers that leave out scores, i.e. send bare
    documents, are accepted with score 0).

    Documents without an ``id`` (Search-R1's BM25 server sends ``{"title", "text", "contents"}``
    only) become passages with ``id == ""``: tether's evaluation then reports the gold recall of
    those searches as unknown rather than 0 (``tether.eval.search``). Give ``corpus`` (the file
    the server indexes) to recover their ids: a document is matched on its exact ``contents``,
    else on its title and text (whitespace collapsed, title quotes stripped).

    Args:
        url: Server address, ``http://host:port`` (``/retrieve`` is appended) or the full
            endpoint URL.
        timeout: Seconds per attempt (connect + answer).
        retries: Further attempts after a failed one (connection error, timeout, 5xx,
            malformed body). A 4xx answer is not retried.
        backoff: Seconds before the first retry, doubled each time.
        corpus: Optional corpus file (or loaded :class:`~tether.search.corpus.Corpus`) that
            names the documents the server answers without an id (see above).

    Raises (from :meth:`search`): :class:`RetrievalError` once every attempt failed; the whole
    call takes at most about ``(retries + 1) * timeout + backoff * (2**retries - 1)`` seconds.
    """

    kind = "http"

    def __init__(self, url: str, *, timeout: float = 30.0, retries: int = 2, backoff: float = 0.5,
                 corpus: Corpus | str | os.PathLike | None = None):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise RetrievalError(f"url must start with http:// or https://, got {url!r}")
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        if self.timeout <= 0 or self.retries < 0 or self.backoff < 0:
            raise RetrievalError("timeout must be > 0, retries and backoff >= 0")
        self.corpus = as_corpus(corpus) if corpus is not None else None
        self._ids_by_contents: dict[str, str] = {}
        self._ids_by_title_text: dict[tuple[str, str], str] = {}
        if self.corpus is not None:
            c = self.corpus
            for pid, cont, title, text in zip(reversed(c.ids), reversed(c.contents), reversed(c.titles),
                                              reversed(c.texts)):  # reversed: the first row wins a duplicate
                self._ids_by_contents[cont] = pid
                self._ids_by_title_text[_title_text_key(title, text)] = pid

    def _post(self, payload: dict) -> Any:
        data = json.dumps(payload).encode("utf-8")
        req = urllib.request.Request(self.url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return loads_json(resp.read().decode("utf-8"))

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """Top-``k`` passages per query from the server (raises :class:`RetrievalError`)."""
        queries = check_search_args(queries, k)
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
                result = _parse_result(body, len(queries))
            except RetrievalError as e:
                last = f"malformed answer from {self.url}: {e}"
                continue
            return [[self._with_id(p) for p in row] for row in result] if self.corpus is not None else result
        raise RetrievalError(f"{last} (after {attempts} attempt{'s' if attempts > 1 else ''})", attempts)

    def _with_id(self, p: Passage) -> Passage:
        """``p`` with the corpus id of its contents (or title and text) when the server sent none."""
        if p.id:
            return p
        pid = self._ids_by_contents.get(p.contents) or self._ids_by_title_text.get(_title_text_key(p.title, p.text))
        return Passage(pid, p.title, p.text, p.score, p.contents) if pid else p

    def __repr__(self) -> str:
        return f"HTTPRetriever({self.url!r}, timeout={self.timeout}, retries={self.retries})"


def _title_text_key(title: str, text: str) -> tuple[str, str]:
    return " ".join(title.split()).strip('"'), " ".join(text.split())


def _read_error(e: urllib.error.HTTPError) -> str:
    try:
        text = e.read().decode("utf-8", "replace")
    except Exception:
        return str(e.reason)
    try:
        j = loads_json(text)
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
    pid = item.get("id")
    return Passage("" if pid is None else str(pid), title, text, float(score), contents)


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
