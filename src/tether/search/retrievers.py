"""Retrievers: ``search(queries, k) -> list[list[Passage]]``, batched, by name.

==========  ================================================================================
``bm25``    (default) Okapi BM25 over a local corpus with the ``bm25s`` library; text is
            lower-cased, English stop words removed and words stemmed with ``PyStemmer``'s
            English stemmer. The index is cached on disk (see *Caches*).
``dense``   (optional extra ``tether[dense]``) ``sentence-transformers`` embeddings, normalized,
            searched by inner product with ``faiss-cpu``. Models whose name contains ``e5``
            get the ``query: ``/``passage: `` prefixes (override with ``query_prefix`` /
            ``passage_prefix``). The passage embeddings are cached on disk.
``http``    A client for a Search-R1-compatible retrieval server (``POST /retrieve``), e.g.
            ``tether retrieve serve`` or Search-R1's own ``retrieval_server.py``.
==========  ================================================================================

Build one with :func:`make_retriever` (``make_retriever("bm25", corpus="corpus.jsonl")``,
``make_retriever("http", url="http://127.0.0.1:8000")``). Results are sorted by score, best
first; ties are broken by corpus order so that every run (and the server) returns the same list.
``k`` larger than the corpus returns the whole corpus.

Failures: :meth:`HTTPRetriever.search` raises :class:`RetrievalError` when the server cannot be
reached, times out, answers with an error or with a malformed body, after ``retries`` further
attempts (``timeout`` seconds each, ``backoff`` seconds apart, doubling); 4xx answers are not
retried. The agent loop catches it, appends
:func:`~tether.search.protocol.render_search_error` as the observation and counts the failure.
The local retrievers raise :class:`RetrievalError` only for invalid arguments.

Caches: an index is stored in a directory keyed by the corpus file's sha256 and the settings
that change it (BM25 parameters and tokenizer; dense model name, prefixes and max length), so
a changed corpus or setting builds a new index and an unchanged one is loaded. The cache root is
``cache_dir`` when given; otherwise ``.tether_cache/`` beside the corpus when that directory is
writable, else ``$TETHER_CACHE_DIR`` or ``~/.cache/tether`` (``$XDG_CACHE_HOME/tether``). A
directory whose permission bits deny writing counts as read-only even for root, so a shared
read-only data directory is never written to. Indexes are written to a temporary directory and
renamed into place, so an interrupted build never leaves a half-written cache.

Layout: the protocol, :class:`RetrievalError` and the cache helpers are in
:mod:`tether.search.retriever_base`; each retriever has its own module
(:mod:`tether.search.bm25`, :mod:`tether.search.dense`, :mod:`tether.search.http_retriever`).
This module holds the registry and re-exports all of them.
"""

from __future__ import annotations

from typing import Any, Callable

from .bm25 import BM25Retriever
from .dense import DenseRetriever, default_prefixes
from .http_retriever import HTTPRetriever
from .retriever_base import CACHE_DIR_ENV, RetrievalError, Retriever, default_cache_root

__all__ = [
    "Retriever",
    "RetrievalError",
    "BM25Retriever",
    "DenseRetriever",
    "HTTPRetriever",
    "RETRIEVERS",
    "make_retriever",
    "register_retriever",
    "default_cache_root",
    "default_prefixes",
    "CACHE_DIR_ENV",
]


# --------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------

#: Retriever factories by name; :func:`make_retriever` calls ``RETRIEVERS[kind](**options)``.
RETRIEVERS: dict[str, Callable[..., Retriever]] = {
    "bm25": BM25Retriever,
    "dense": DenseRetriever,
    "http": HTTPRetriever,
}


def register_retriever(name: str, factory: Callable[..., Retriever]) -> None:
    """Make ``make_retriever(name, ...)`` call ``factory(...)``."""
    RETRIEVERS[name] = factory


def make_retriever(kind: str = "bm25", **options: Any) -> Retriever:
    """Build a retriever by name: ``bm25`` / ``dense`` need ``corpus=PATH`` (plus their
    options), ``http`` needs ``url=...``. Raises :class:`RetrievalError` for an unknown name."""
    if kind not in RETRIEVERS:
        raise RetrievalError(f"unknown retriever {kind!r} (known: {', '.join(RETRIEVERS)})")
    return RETRIEVERS[kind](**options)
