"""Question-answering datasets for search agents, as tether :class:`~tether.tasks.base.Example` lists.

``load_search_examples(source)`` accepts

* ``multihop`` (train, 700 questions) and ``multihop_dev`` (564): the closed-pool multi-hop set
  (HotpotQA, 2WikiMultihopQA, MuSiQue) whose paragraphs are all in the search data dir's
  ``corpus.jsonl``;
* the seven benchmarks of the Search-R1 paper, ``nq``, ``triviaqa``, ``popqa``, ``hotpotqa``,
  ``2wikimultihopqa``, ``musique``, ``bamboogle``, read from ``eval/<name>.jsonl`` in the search
  data dir, else from the hub (FlashRAG's ``RUC-NLPIR/FlashRAG_datasets``, needs ``datasets``);
* any ``.jsonl`` file, with ``question_key`` / ``answers_key`` naming its fields (default:
  ``question`` and the first present of ``golden_answers``, ``answers``, ``answer``);
* a hub id ``org/name`` or ``org/name:config`` (FlashRAG-style rows with ``question`` and
  ``golden_answers``), via ``datasets.load_dataset``.

The search data dir (:func:`search_data_dir`) is the first existing of ``data_dir``,
``$TETHER_SEARCH_DATA_DIR``, and ``<$TETHER_DATA_DIR>/../search`` or ``<$TETHER_DATA_DIR>/search``.

Each row becomes an ``Example`` with

* ``prompt``: the question wrapped in the instruction (``instruction``, default
  :data:`~tether.search.protocol.DEFAULT_INSTRUCTION` with ``max_searches`` filled in; pass
  ``instruction=None`` for the bare question);
* ``answer``: the first golden answer (a string, as everywhere in tether);
* ``meta["golden_answers"]``: every accepted answer (aliases), which the search reward scores
  against; ``meta["answers"]`` holds the same list when there are several, so tether's generic
  :func:`~tether.tasks.rewards.reference_answers` sees them too;
* ``meta["question"]`` (the bare question), ``meta["data_source"]`` (the row's field, else the
  dataset name), ``meta["supporting_ids"]`` (corpus ids of the gold paragraphs; ``[]`` when the
  row has none), and every other field of the row.

Ids are ``<name>_<split>:<0-based row>`` for named datasets (``multihop_dev:17``), the file stem
for files. A malformed row (invalid JSON, a missing or empty question, answers that are not a
non-empty list of strings, bad ``supporting_ids``) raises :class:`~tether.tasks.base.DataError`
naming the file and line, before anything is returned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..tasks.base import DataError, Example
from ..tasks.data import iter_jsonl
from .protocol import DEFAULT_INSTRUCTION, build_prompt

__all__ = [
    "SEARCH_DATA_DIR_ENV",
    "SearchDataset",
    "SEARCH_DATASETS",
    "search_data_dir",
    "load_search_examples",
    "corpus_path",
]

#: Environment variable naming the search data directory.
SEARCH_DATA_DIR_ENV = "TETHER_SEARCH_DATA_DIR"
_ANSWER_KEYS = ("golden_answers", "answers", "answer")


@dataclass(frozen=True)
class SearchDataset:
    """A search dataset known by name: its file in the search data dir and hub fallback."""

    name: str
    file: str
    split: str
    hub_id: str | None = None
    hub_config: str | None = None
    hub_split: str | None = None


#: Named search datasets (``multihop*`` are local only; the benchmarks fall back to FlashRAG's hub copy).
SEARCH_DATASETS: dict[str, SearchDataset] = {
    "multihop": SearchDataset("multihop", "multihop_train.jsonl", "train"),
    "multihop_dev": SearchDataset("multihop_dev", "multihop_dev.jsonl", "dev"),
    **{
        name: SearchDataset(name, f"eval/{name}.jsonl", split, "RUC-NLPIR/FlashRAG_datasets", name, split)
        for name, split in (("nq", "test"), ("triviaqa", "test"), ("popqa", "test"), ("hotpotqa", "dev"),
                            ("2wikimultihopqa", "dev"), ("musique", "dev"), ("bamboogle", "test"))
    },
}


def search_data_dir(data_dir: str | os.PathLike | None = None) -> Path | None:
    """The search data directory (see the module docstring), or None when none exists."""
    cands: list[Path] = []
    if data_dir:
        cands.append(Path(data_dir).expanduser())
    env = os.environ.get(SEARCH_DATA_DIR_ENV)
    if env:
        cands.append(Path(env).expanduser())
    base = os.environ.get("TETHER_DATA_DIR")
    if base:
        cands += [Path(base).expanduser().resolve().parent / "search", Path(base).expanduser() / "search"]
    return next((c for c in cands if c.is_dir()), None)


def corpus_path(data_dir: str | os.PathLike | None = None) -> Path:
    """The closed-pool corpus ``corpus.jsonl`` of the search data dir (raises DataError if absent)."""
    d = search_data_dir(data_dir)
    if d is None or not (d / "corpus.jsonl").is_file():
        raise DataError(f"no corpus.jsonl found: set ${SEARCH_DATA_DIR_ENV} to the search data directory"
                        + (f" (looked in {d})" if d else ""))
    return d / "corpus.jsonl"


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    for lineno, row in iter_jsonl(path):
        yield f"{path} line {lineno}", row


def _iter_hub(hub_id: str, config: str | None, split: str) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"loading {hub_id!r} from the hub needs the optional `datasets` package "
                        f"(pip install datasets), or set ${SEARCH_DATA_DIR_ENV} to a directory "
                        "with the files") from None
    try:
        ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as e:
        raise DataError(f"could not load hub dataset {hub_id!r} (config={config!r}, split={split!r}): {e}") from e
    for i, row in enumerate(ds, start=1):
        yield f"hub dataset {hub_id}:{config} ({split}) row {i}", dict(row)


def _row_to_example(row: Any, where: str, example_id: str, qkey: str, akey: str | None,
                    source_name: str, instruction: str | None, max_searches: int) -> Example:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    q = row.get(qkey)
    if not isinstance(q, str) or not q.strip():
        what = ("missing" if qkey not in row
                else "empty" if isinstance(q, str) else f"not a string ({type(q).__name__})")
        raise DataError(f"{where}: field {qkey!r} is {what}")
    keys = (akey,) if akey else _ANSWER_KEYS
    ak = next((k for k in keys if k in row), None)
    if ak is None:
        raise DataError(f"{where}: missing field {keys[0]!r} (have: {', '.join(row) or 'no fields'})")
    raw = row[ak]
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, (list, tuple)) or not raw:
        raise DataError(f"{where}: field {ak!r} must be a non-empty list of strings")
    answers: list[str] = []
    for j, a in enumerate(raw):
        if isinstance(a, bool) or not isinstance(a, (str, int, float)):
            raise DataError(f"{where}: field {ak!r} item {j} must be a string, got {type(a).__name__}")
        a = str(a).strip()
        if a and a not in answers:
            answers.append(a)
    if not answers:
        raise DataError(f"{where}: field {ak!r} has no non-empty answer")
    sup = row.get("supporting_ids", [])
    if not isinstance(sup, list) or any(isinstance(s, bool) or not isinstance(s, (str, int)) for s in sup):
        raise DataError(f"{where}: field 'supporting_ids' must be a list of corpus ids")
    meta = {k: v for k, v in row.items() if k not in (qkey, ak)}
    meta["question"] = q.strip()
    meta["golden_answers"] = answers
    if len(answers) > 1:
        meta["answers"] = list(answers)
    meta["supporting_ids"] = [str(s) for s in sup]
    meta.setdefault("data_source", source_name)
    prompt = q.strip() if instruction is None else build_prompt(q, max_searches, instruction)
    return Example(prompt=prompt, answer=answers[0], id=example_id, meta=meta)


def _collect(rows: Iterable[tuple[str, Any]], label: str, id_prefix: str, qkey: str, akey: str | None,
             source_name: str, instruction: str | None, max_searches: int, limit: int | None) -> list[Example]:
    out: list[Example] = []
    for where, row in rows:
        if limit is not None and len(out) >= limit:
            break
        out.append(_row_to_example(row, where, f"{id_prefix}:{len(out)}", qkey, akey, source_name,
                                   instruction, max_searches))
    if not out:
        raise DataError(f"{label}: dataset is empty (no rows)")
    return out


def load_search_examples(
    source: str | os.PathLike,
    *,
    data_dir: str | os.PathLike | None = None,
    question_key: str = "question",
    answers_key: str | None = None,
    instruction: str | None = DEFAULT_INSTRUCTION,
    max_searches: int = 4,
    limit: int | None = None,
    hub_split: str = "test",
) -> list[Example]:
    """Load a search QA dataset (see the module docstring).

    Args:
        source: A named dataset (:data:`SEARCH_DATASETS`), a ``.jsonl`` file, or a hub id.
        data_dir: The search data directory (before ``$TETHER_SEARCH_DATA_DIR``).
        question_key / answers_key: Field names for files and hub ids (``answers_key`` default:
            first of ``golden_answers``, ``answers``, ``answer``; a single string is one answer).
        instruction: Prompt template (``{question}``, ``{max_searches}``); None: bare question.
        max_searches: Search budget written into the prompt.
        limit: Keep the first ``limit`` rows only.
        hub_split: Split for hub ids (named benchmarks know theirs).

    Raises:
        DataError: unknown source, missing file, malformed row (file and line named), empty set.
    """
    if limit is not None and int(limit) <= 0:
        raise DataError(f"limit must be positive, got {limit}")
    src = os.fspath(source).strip()
    name = src.lower()
    kw = dict(qkey=question_key, akey=answers_key, instruction=instruction, max_searches=max_searches, limit=limit)
    if name in SEARCH_DATASETS and not Path(src).is_file():
        ds = SEARCH_DATASETS[name]
        d = search_data_dir(data_dir)
        if d is not None and (d / ds.file).is_file():
            f = d / ds.file
            return _collect(_iter_jsonl(f), str(f), f"{ds.name}_{ds.split}", source_name=ds.name, **kw)
        if ds.hub_id is None:
            raise DataError(f"dataset {ds.name!r}: {ds.file} not found (search data dir: {d or 'none found'}); "
                            f"set ${SEARCH_DATA_DIR_ENV} to the directory holding it")
        label = f"dataset {ds.name!r} (hub {ds.hub_id}:{ds.hub_config})"
        return _collect(_iter_hub(ds.hub_id, ds.hub_config, ds.hub_split), label, f"{ds.name}_{ds.split}",
                        source_name=ds.name, **kw)
    path = Path(src).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".jsonl":
            raise DataError(f"{src}: search datasets are read from .jsonl files")
        return _collect(_iter_jsonl(path), str(path), path.stem, source_name=path.stem, **kw)
    if "/" in src and not path.suffix and not src.startswith((".", "/", "~")):
        hub_id, _, config = src.partition(":")
        label = f"hub dataset {src!r}"
        return _collect(_iter_hub(hub_id, config or None, hub_split), label, f"{hub_id}_{hub_split}",
                        source_name=(config or hub_id), **kw)
    raise DataError(f"unknown search dataset {src!r}: not a file, not one of {', '.join(SEARCH_DATASETS)}, "
                    f"not a hub id 'org/name'")
