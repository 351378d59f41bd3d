"""The ``dense`` retriever: ``sentence-transformers`` embeddings searched by inner product with
``faiss-cpu`` (extra ``tether[dense]``), the passage embeddings cached on disk. See
:mod:`tether.search.retrievers`."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from .corpus import Corpus, Passage
from .retriever_base import (
    RetrievalError,
    as_corpus,
    check_search_args,
    corpus_digest,
    default_cache_root,
    publish_index,
)


def default_prefixes(model: str) -> tuple[str, str]:
    """``("query: ", "passage: ")`` for a model whose name contains ``e5`` (the prefixes the
    E5 models were trained with), else ``("", "")``."""
    return ("query: ", "passage: ") if "e5" in str(model).lower() else ("", "")


class DenseRetriever:
    """Dense retrieval with ``sentence-transformers`` + ``faiss-cpu`` (extra ``tether[dense]``).

    Args:
        corpus: A corpus file or a loaded :class:`~tether.search.corpus.Corpus`.
        model: A sentence-transformers model name or local directory
            (default ``"intfloat/e5-base-v2"``, the retriever of the Search-R1 paper).
        query_prefix / passage_prefix: Text put before queries / passages; None (default)
            means ``"query: "`` / ``"passage: "`` when the model name contains ``e5``, else
            nothing.
        cache_dir: Cache root (default: :func:`default_cache_root`); embeddings live in
            ``<cache_dir>/dense/<corpus sha256>-<model digest>/``.
        batch_size: Encoding batch size. device: torch device for the encoder (default cpu).
        max_length: Encoder max sequence length (None: the model's).

    Passages are embedded from their raw ``contents`` (title line + text), as FlashRAG does.
    """

    kind = "dense"

    def __init__(
        self,
        corpus: Corpus | str | os.PathLike,
        *,
        model: str = "intfloat/e5-base-v2",
        query_prefix: str | None = None,
        passage_prefix: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        batch_size: int = 64,
        device: str = "cpu",
        max_length: int | None = None,
    ):
        try:
            import faiss
            from sentence_transformers import SentenceTransformer
        except ImportError as e:
            raise RetrievalError(
                f"the dense retriever needs the optional extra: pip install 'tether[dense]' "
                f"(sentence-transformers, faiss-cpu); missing: {e.name}"
            ) from None
        self.corpus = as_corpus(corpus)
        auto_q, auto_p = default_prefixes(model)
        self.query_prefix = auto_q if query_prefix is None else query_prefix
        self.passage_prefix = auto_p if passage_prefix is None else passage_prefix
        model_id = str(Path(model).expanduser().resolve()) if Path(model).expanduser().is_dir() else str(model)
        self.settings = {"model": model_id, "query_prefix": self.query_prefix,
                         "passage_prefix": self.passage_prefix, "max_length": max_length, "format": 1}
        self.batch_size = int(batch_size)
        self._encoder = SentenceTransformer(model, device=device)
        if max_length is not None:
            self._encoder.max_seq_length = int(max_length)
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root(self.corpus.path)
        self.index_dir = root / "dense" / f"{self.corpus.sha256}-{corpus_digest(self.settings)}"
        self.loaded_from_cache = False
        self.build_seconds = 0.0
        t0 = time.perf_counter()
        emb_file = self.index_dir / "embeddings.npy"
        emb = None
        if emb_file.is_file():
            emb = np.load(emb_file)
            if emb.shape[0] != len(self.corpus):
                emb = None
        if emb is None:
            emb = self._encode([self.passage_prefix + c for c in self.corpus.contents])
            self.index_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.index_dir.parent / f".{self.index_dir.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            np.save(tmp / "embeddings.npy", emb)
            (tmp / "meta.json").write_text(json.dumps(
                {"corpus_sha256": self.corpus.sha256, "num_docs": len(self.corpus), "settings": self.settings},
                indent=1))
            publish_index(tmp, self.index_dir, stale=True)
            self.build_seconds = time.perf_counter() - t0
        else:
            self.loaded_from_cache = True
        self._index = faiss.IndexFlatIP(emb.shape[1])
        self._index.add(np.ascontiguousarray(emb, dtype=np.float32))

    def _encode(self, texts: list[str]) -> np.ndarray:
        emb = self._encoder.encode(texts, batch_size=self.batch_size, normalize_embeddings=True,
                                   convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(emb, dtype=np.float32)

    def search(self, queries: list[str], k: int) -> list[list[Passage]]:
        """Top-``k`` passages per query by cosine similarity, best first."""
        queries = check_search_args(queries, k)
        if not queries:
            return []
        k = min(k, len(self.corpus))
        scores, idx = self._index.search(self._encode([self.query_prefix + q for q in queries]), k)
        return [[self.corpus.passage(int(i), float(s)) for s, i in zip(srow, irow) if i >= 0]
                for srow, irow in zip(scores, idx)]
