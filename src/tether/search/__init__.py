"""Building blocks of a Search-R1-style search agent: protocol, reward, corpus, retrievers,
retrieval server, QA datasets and the ``search`` training task (registered in ``tether.tasks.TASKS`` when
this package is imported). See ``docs/search_agents.md``."""

from . import task  # noqa: F401  (registers the search task)
from .corpus import Corpus, CorpusError, Passage, load_corpus, split_contents
from .data import SEARCH_DATASETS, corpus_path, load_search_examples, search_data_dir
from .protocol import (
    DEFAULT_INSTRUCTION,
    INVALID_ACTION_MESSAGE,
    STOP_STRINGS,
    build_prompt,
    parse_action,
    render_observation,
    render_search_error,
    truncate_at_action,
)
from .retrievers import (
    RETRIEVERS,
    BM25Retriever,
    DenseRetriever,
    HTTPRetriever,
    RetrievalError,
    Retriever,
    make_retriever,
    register_retriever,
)
from .reward import SearchReward, SearchRewardResult, normalize_answer, score_response, search_reward

__all__ = [
    "Corpus", "CorpusError", "Passage", "load_corpus", "split_contents",
    "SEARCH_DATASETS", "corpus_path", "load_search_examples", "search_data_dir",
    "DEFAULT_INSTRUCTION", "INVALID_ACTION_MESSAGE", "STOP_STRINGS", "build_prompt", "parse_action",
    "render_observation", "render_search_error", "truncate_at_action",
    "RETRIEVERS", "BM25Retriever", "DenseRetriever", "HTTPRetriever", "RetrievalError", "Retriever",
    "make_retriever", "register_retriever",
    "SearchReward", "SearchRewardResult", "normalize_answer", "score_response", "search_reward",
]
