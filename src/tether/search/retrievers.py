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
At most ``k`` passages per query: ``bm25`` returns only the passages that match the query (a
positive score), so fewer than ``k`` when fewer match and none for a query of stop words or
unknown words; ``dense`` returns ``min(k, corpus size)``; ``http`` what the server answers.

``http`` takes an optional ``corpus`` too (``search.corpus``; none by default): the file the server
indexes, used only to recover the ids of documents the server sends without one (Search-R1's
servers send none), so that gold recall can be measured (:class:`HTTPRetriever`).

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

from ..algo.registry import Registry
from ..errors import ConfigError
from .bm25 import BM25Retriever
from .data import corpus_path
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
    "retriever_from_config",
    "register_retriever",
    "default_cache_root",
    "default_prefixes",
    "CACHE_DIR_ENV",
]


# --------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------

def _corpus(s) -> dict[str, Any]:
    """The corpus option of a local retriever: ``env.retriever.corpus``, else the search data dir's corpus.jsonl."""
    return {"corpus": s.corpus or corpus_path(s.data_dir or None)}


#: Retriever factories by name; :func:`make_retriever` calls ``RETRIEVERS[kind](**options)``. Metadata:
#: ``options(section) -> dict``, the options its ``rollout.agent.env.retriever`` section gives the factory (which keys
#: each kind has is its section's, `tether.config.agent`; a user's retriever, ``env.retriever.kind=module:name``, has
#: every key, and carries ``options`` as an attribute; by default it gets ``corpus=`` like bm25).
RETRIEVERS: Registry[Callable[..., Retriever]] = Registry(
    "retriever", defaults={"options": _corpus}, error=RetrievalError)
RETRIEVERS.register("bm25")(BM25Retriever)
RETRIEVERS.register("dense", options=lambda s: {**_corpus(s), "model": s.dense_model})(DenseRetriever)
RETRIEVERS.register("http", options=lambda s: {"url": s.url, "timeout": s.timeout, "retries": s.retries,
                                               **({"corpus": s.corpus} if s.corpus else {})})(HTTPRetriever)


def register_retriever(name: str, factory: Callable[..., Retriever], **meta: Any) -> None:
    """Make ``make_retriever(name, ...)`` call ``factory(...)`` (``meta``: see :data:`RETRIEVERS`)."""
    if name in RETRIEVERS:
        del RETRIEVERS[name]
    RETRIEVERS.register(name, **meta)(factory)


def make_retriever(kind: str = "bm25", **options: Any) -> Retriever:
    """Build a retriever by name (or a user's ``module:name``): ``bm25`` / ``dense`` need ``corpus=PATH``
    (plus their options), ``http`` needs ``url=...``. Raises :class:`RetrievalError` for an unknown name."""
    return RETRIEVERS.resolve(kind)[0](**options)


def retriever_from_config(s) -> Retriever:
    """The retriever ``s.kind`` names, with its options from ``s`` (a ``tether.config.RetrieverConfig``,
    ``rollout.agent.env.retriever``)."""
    try:
        factory, meta = RETRIEVERS.resolve(s.kind)
    except RetrievalError as e:  # a user's retriever that does not load: a config error, before the model load
        raise ConfigError(f"rollout.agent.env.retriever.kind: {e}") from e
    return factory(**meta["options"](s))
