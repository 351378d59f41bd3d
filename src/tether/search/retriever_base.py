"""What every retriever shares: the :class:`Retriever` protocol, :class:`RetrievalError`, argument
checks, top-k selection and the on-disk index cache (where it lives, how it is keyed and published).

The retrievers themselves live in :mod:`tether.search.bm25`, :mod:`tether.search.dense` and
:mod:`tether.search.http_retriever`; :mod:`tether.search.retrievers` builds them by name and
documents them (caches and failures included).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from .corpus import Corpus, Passage, load_corpus

#: Environment variable naming the fallback cache root (default ``~/.cache/tether``).
CACHE_DIR_ENV = "TETHER_CACHE_DIR"


class RetrievalError(RuntimeError):
    """A search could not be served (server down, timeout, bad answer) or was invalid.

    Attributes:
        attempts: How many requests were made (0 for an invalid argument).
    """

    def __init__(self, message: str, attempts: int = 0):
        super().__init__(message)
        self.attempts = attempts


@runtime_checkable
class Retriever(Protocol):
    """Anything with a batched ``search``: one list of passages (best first) per query."""

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        ...


def check_search_args(queries: Sequence[str], k: int) -> list[str]:
    if isinstance(queries, str) or not isinstance(queries, (list, tuple)):
        raise RetrievalError(f"queries must be a list of strings, got {type(queries).__name__}")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise RetrievalError(f"queries[{i}] must be a string, got {type(q).__name__}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise RetrievalError(f"k must be a positive integer, got {k!r}")
    return list(queries)


def top_k_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k best scores, best first, ties broken by lower index."""
    n = scores.shape[0]
    k = min(k, n)
    if k < n:
        threshold = np.partition(scores, n - k)[n - k]
        cand = np.flatnonzero(scores >= threshold)
    else:
        cand = np.arange(n)
    order = cand[np.lexsort((cand, -scores[cand]))]
    return order[:k]


def _dir_writable(d: Path) -> bool:
    try:
        st = d.stat()
    except OSError:
        return False
    return bool(st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)) and os.access(d, os.W_OK)


def default_cache_root(corpus_path: str | os.PathLike | None = None) -> Path:
    """Where caches go when no ``cache_dir`` is given (see :mod:`tether.search.retrievers`)."""
    if corpus_path is not None:
        parent = Path(corpus_path).expanduser().resolve().parent
        beside = parent / ".tether_cache"
        if (beside.is_dir() and _dir_writable(beside)) or (not beside.exists() and _dir_writable(parent)):
            return beside
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tether"


def as_corpus(corpus: Corpus | str | os.PathLike) -> Corpus:
    if isinstance(corpus, Corpus):
        return corpus
    if corpus is None:
        raise RetrievalError("a local retriever needs corpus=PATH (a JSONL corpus file)")
    return load_corpus(corpus)


def corpus_digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def publish_index(tmp: Path, final: Path, stale: bool = False) -> None:
    """Atomically move a finished build directory into place (another process may have won).
    ``stale``: an existing ``final`` is an unusable old cache and is replaced."""
    if stale and final.exists():
        shutil.rmtree(final, ignore_errors=True)
    try:
        os.replace(tmp, final)
    except OSError:
        if final.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise
