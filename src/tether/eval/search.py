"""Search-agent metrics over an evaluation's per-problem rows (``tether eval --agent search``).

Per benchmark and per ``data_source``: exact match (EM) and token F1 of the last ``<answer>``
(the search reward's rules, ``tether.search.reward``), the answered rate, the mean number of
searches, and the gold-paragraph recall of the searches made: the fraction of a question's
``supporting_ids`` among the passages the agent was shown (questions without supporting ids
are left out of the recall).

A passage shown without an id (``""``: a retrieval server that answers documents without ids,
such as Search-R1's BM25 server, see :class:`tether.search.http_retriever.HTTPRetriever`) makes
that response's recall **unknown** unless the passages with ids already cover every gold
paragraph: an unknown recall is left out of ``gold_recall`` (absent when every one is unknown)
and counted in ``gold_recall_unknown`` (a number of responses, not a mean), never scored 0.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

from ..search.reward import golden_answers, score_response
from ..tasks.base import Example


def gold_recall(gold: set[str], retrieved: Sequence) -> Optional[float]:
    """The fraction of ``gold`` among ``retrieved`` ids; None (unknown) when some retrieved passage
    has no id (``""`` or None) and the identified ones do not already cover all of ``gold``."""
    known = {str(r) for r in retrieved if r is not None and str(r) != ""}
    hits = len(gold & known)
    if hits < len(gold) and len(known) < len(retrieved):
        return None
    return hits / len(gold)


def search_metrics(rows: Sequence[dict], examples: Sequence[Example]) -> dict[str, float]:
    """``em``, ``f1``, ``answered_rate``, ``searches``, ``gold_recall`` (and ``gold_recall_unknown``
    when some recall is unknown) overall and as ``<source>/<metric>``."""
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    unknown: dict[str, int] = defaultdict(int)
    by_id = {ex.id: ex for ex in examples}
    for row in rows:
        ex = by_id[row["id"]]
        source = str(ex.meta.get("data_source", "all")) if isinstance(ex.meta, dict) else "all"
        gold = set(ex.meta.get("supporting_ids") or []) if isinstance(ex.meta, dict) else set()
        keys = ("all",) if source == "all" else ("all", source)
        for j, text in enumerate(row["responses"]):
            r = score_response(text, golden_answers(ex))
            info = (row.get("info") or [{}] * len(row["responses"]))[j]
            vals = {"em": r.em, "f1": r.f1, "answered_rate": float(r.answered),
                    "searches": float(info.get("searches", 0))}
            if gold:
                recall = gold_recall(gold, info.get("retrieved") or [])
                if recall is None:
                    for key in keys:
                        unknown[key] += 1
                else:
                    vals["gold_recall"] = recall
            for key in keys:
                for k, v in vals.items():
                    acc[key][k].append(v)
    out: dict[str, float] = {}
    for key, d in acc.items():
        for k, v in d.items():
            out[k if key == "all" else f"{key}/{k}"] = sum(v) / len(v)
    for key, n in unknown.items():
        out["gold_recall_unknown" if key == "all" else f"{key}/gold_recall_unknown"] = float(n)
    return out
