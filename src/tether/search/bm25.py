"""The ``bm25`` retriever: Okapi BM25 over a local corpus (``bm25s`` + ``PyStemmer``), its index
cached on disk. See :mod:`tether.search.retrievers`."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from ..errors import OutputError
from ..userio import loads_json
from .corpus import Corpus, CorpusError, Passage
from .retriever_base import (
    as_corpus,
    check_search_args,
    corpus_digest,
    default_cache_root,
    publish_index,
    top_k_indices,
)


class BM25Retriever:
    """BM25 over a local corpus (``bm25s`` + ``PyStemmer``; see :mod:`tether.search.retrievers`).

    Args:
        corpus: A corpus file (JSONL, see :mod:`tether.search.corpus`) or a loaded
            :class:`~tether.search.corpus.Corpus`.
        cache_dir: Cache root (default: :func:`default_cache_root`). The index lives in
            ``<cache_dir>/bm25/<corpus sha256>-<settings digest>/``.
        k1, b, method: BM25 parameters (``bm25s`` defaults; ``method="lucene"`` is Lucene's
            BM25, the one pyserini uses).
        stemmer: ``PyStemmer`` language (``"english"``), or None for no stemming.
        stopwords: ``bm25s`` stop-word list name (``"en"``), or None.

    Attributes:
        corpus: The loaded corpus.
        index_dir: The cache directory of this index.
        loaded_from_cache: True when the index was loaded rather than built.
        build_seconds: Time spent building (0.0 when loaded) ; ``load_seconds`` likewise.
    """

    kind = "bm25"

    def __init__(
        self,
        corpus: Corpus | str | os.PathLike,
        *,
        cache_dir: str | os.PathLike | None = None,
        k1: float = 1.5,
        b: float = 0.75,
        method: str = "lucene",
        stemmer: str | None = "english",
        stopwords: str | None = "en",
    ):
        import bm25s

        self.corpus = as_corpus(corpus)
        self.settings = {"k1": float(k1), "b": float(b), "method": method, "stemmer": stemmer,
                         "stopwords": stopwords, "format": 1}
        self._stemmer = None
        if stemmer:
            import Stemmer

            self._stemmer = Stemmer.Stemmer(stemmer)
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root(self.corpus.path)
        self.index_dir = root / "bm25" / f"{self.corpus.sha256}-{corpus_digest(self.settings)}"
        self.loaded_from_cache = False
        self.build_seconds = 0.0
        self.load_seconds = 0.0
        t0 = time.perf_counter()
        self._model = None
        if self._cache_valid():
            try:
                self._model = bm25s.BM25.load(str(self.index_dir / "index"), load_vocab=True)
                self.loaded_from_cache = True
                self.load_seconds = time.perf_counter() - t0
            except Exception:  # an unreadable cache is rebuilt, not fatal
                shutil.rmtree(self.index_dir, ignore_errors=True)
        if self._model is None:
            t0 = time.perf_counter()
            self._model = self._build()
            self.build_seconds = time.perf_counter() - t0

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        import bm25s

        return bm25s.tokenize(texts, lower=True, stopwords=self.settings["stopwords"], stemmer=self._stemmer,
                              return_ids=False, show_progress=False)

    def _cache_valid(self) -> bool:
        meta = self.index_dir / "meta.json"
        if not meta.is_file():
            return False
        try:
            m = loads_json(meta.read_text())
        except (OSError, ValueError):
            return False
        return m.get("corpus_sha256") == self.corpus.sha256 and m.get("num_docs") == len(self.corpus)

    def _build(self):
        import bm25s

        tokens = self._tokenize([f"{t}\n{x}" for t, x in zip(self.corpus.titles, self.corpus.texts)])
        if not any(tokens):
            raise CorpusError(f"{self.corpus.path}: no passage has a word BM25 can index (every title and text is "
                              f"stop words ({self.settings['stopwords']}), single characters or punctuation)")
        model = bm25s.BM25(k1=self.settings["k1"], b=self.settings["b"], method=self.settings["method"])
        model.index(tokens, show_progress=False)
        try:
            self.index_dir.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create the BM25 index cache {self.index_dir.parent} ({e.strerror or e}); "
                              f"`tether retrieve serve --cache-dir` names a writable directory") from None
        tmp = self.index_dir.parent / f".{self.index_dir.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save(str(tmp / "index"), show_progress=False)
        meta = {"corpus_sha256": self.corpus.sha256, "corpus_path": str(self.corpus.path),
                "num_docs": len(self.corpus), "settings": self.settings, "bm25s": bm25s.__version__}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        publish_index(tmp, self.index_dir, stale=not self._cache_valid())
        return model

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every passage (corpus order) for one query."""
        ids = self._model.get_tokens_ids(self._tokenize([query])[0])
        if not ids:
            return np.zeros(len(self.corpus), dtype=np.float32)
        return np.asarray(self._model.get_scores_from_ids(ids), dtype=np.float32)

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """Up to ``k`` passages per query, best first: only passages that match the query (a
        positive BM25 score), as Search-R1's BM25 server does. Fewer than ``k`` match: fewer are
        returned; a query with no indexed word (stop words only, unknown words) returns none."""
        queries = check_search_args(queries, k)
        out = []
        for q in queries:
            s = self.scores(q)
            out.append([self.corpus.passage(int(i), float(s[i])) for i in top_k_indices(s, k) if s[i] > 0])
        return out
