"""Loading datasets of prompts with verifiable answers into :class:`Example` lists.

``load_examples(source)`` accepts

* a local file: ``.jsonl`` (one JSON object per line, blank lines skipped), ``.json`` (a
  list of objects, or ``{"data": [...]}``) or ``.parquet`` (needs ``pyarrow``);
* a named dataset (:data:`NAMED_DATASETS`: ``gsm8k``, ``math500``, ``aime24``, ``amc``,
  ``minerva``, ``olympiadbench``), read from ``data_dir``, else ``$TETHER_DATA_DIR``, else
  downloaded from its usual Hugging Face hub id (needs the optional ``datasets`` package);
* a hub dataset id ``org/name`` (optionally ``org/name:config``), via
  ``datasets.load_dataset`` when ``datasets`` is installed.

Rows become examples in :mod:`tether.tasks.rows` (field mapping, answer canonicalization,
validation: a bad row raises :class:`DataError` naming the file, the 1-based row -- the line
number for JSONL -- and the field; an empty dataset is an error too). Local files are read by
:mod:`tether.tasks.files`. This module keeps the named datasets, the hub reader and
:func:`load_examples`, and re-exports the names of both (``row_to_example``, the default
keys, ``iter_jsonl``), so ``from tether.tasks.data import ...`` is unchanged.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .base import DataError, Example
from .files import iter_file, iter_jsonl  # noqa: F401  (iter_jsonl: re-exported)
from .rows import DEFAULT_ANSWER_KEYS, DEFAULT_PROMPT_KEYS, collect_examples, field_keys, row_to_example

__all__ = [
    "NamedDataset",
    "NAMED_DATASETS",
    "DATASET_ALIASES",
    "DEFAULT_PROMPT_KEYS",
    "DEFAULT_ANSWER_KEYS",
    "DATA_DIR_ENV",
    "load_examples",
    "default_reward_name",
    "resolve_dataset_name",
    "row_to_example",
]

#: Environment variable naming the directory that holds the named datasets' files.
DATA_DIR_ENV = "TETHER_DATA_DIR"

_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(?::[\w.-]+)?$")


@dataclass(frozen=True)
class NamedDataset:
    """A dataset known by name: local file names per split and its hub fallback."""

    name: str
    files: dict  # split -> file name inside the data dir
    default_split: str
    hub_id: str
    hub_config: str | None
    hub_splits: dict  # our split -> hub split name
    prompt_keys: tuple = ()
    answer_keys: tuple = ()
    reward: str = "math"

    @property
    def splits(self) -> list[str]:
        """Available split names."""
        return list(self.files)


#: Datasets known by name. ``gsm8k`` has ``train``/``test`` (default ``train``); the others
#: are evaluation sets with a single ``test`` split.
NAMED_DATASETS: dict[str, NamedDataset] = {
    "gsm8k": NamedDataset(
        "gsm8k",
        {"train": "gsm8k_train.jsonl", "test": "gsm8k_test.jsonl"},
        "train",
        "openai/gsm8k",
        "main",
        {"train": "train", "test": "test"},
        ("question",),
        ("answer",),
        "gsm8k",
    ),
    "math500": NamedDataset(
        "math500", {"test": "math.json"}, "test", "HuggingFaceH4/MATH-500", None,
        {"test": "test"}, ("problem",), ("answer",),
    ),
    "aime24": NamedDataset(
        "aime24", {"test": "aime.json"}, "test", "HuggingFaceH4/aime_2024", None,
        {"test": "train"}, ("problem",), ("answer",),
    ),
    "amc": NamedDataset(
        "amc", {"test": "amc.json"}, "test", "AI-MO/aimo-validation-amc", None,
        {"test": "train"}, ("problem",), ("answer",),
    ),
    "minerva": NamedDataset(
        "minerva", {"test": "minerva.json"}, "test", "math-ai/minervamath", None,
        {"test": "test"}, ("problem", "question"), ("answer",),
    ),
    "olympiadbench": NamedDataset(
        "olympiadbench", {"test": "olympiad_bench.json"}, "test", "math-ai/olympiadbench", None,
        {"test": "test"}, ("problem", "question"), ("answer", "final_answer"),
    ),
}

#: Alternative spellings accepted for the named datasets.
DATASET_ALIASES = {
    "math": "math500",
    "math-500": "math500",
    "math_500": "math500",
    "aime": "aime24",
    "aime2024": "aime24",
    "aime_2024": "aime24",
    "amc23": "amc",
    "minervamath": "minerva",
    "minerva_math": "minerva",
    "olympiad_bench": "olympiadbench",
    "olympiad": "olympiadbench",
}


def resolve_dataset_name(source: str) -> str | None:
    """Canonical name of a named dataset (``"math-500"`` -> ``"math500"``), or None."""
    key = str(source).strip().lower()
    if key in NAMED_DATASETS:
        return key
    return DATASET_ALIASES.get(key)


def default_reward_name(source: str) -> str:
    """Default reward for a dataset source: ``"gsm8k"`` for GSM8K (named, or a file/hub id
    whose name contains ``gsm8k``), ``"arithmetic"`` for the synthetic task
    (``"arithmetic"``/``"arith"``), ``"math"`` for everything else."""
    s = str(source).strip()
    name = resolve_dataset_name(s)
    if name is not None:
        return NAMED_DATASETS[name].reward
    if s.lower() in ("arithmetic", "arith"):
        return "arithmetic"
    if "gsm8k" in Path(s).name.lower() or "gsm8k" in s.lower().split("/")[-1]:
        return "gsm8k"
    return "math"


def _iter_hub(hub_id: str, config: str | None, split: str, label: str) -> Iterator[tuple[int, Any]]:
    try:
        import datasets  # noqa: F401  (optional dependency)
    except ImportError:
        raise DataError(
            f"{label}: loading a dataset from the Hugging Face hub needs the optional `datasets` "
            f"package (pip install datasets), or pass a local .jsonl/.json/.parquet file "
            f"(or set ${DATA_DIR_ENV} to a directory with the named datasets' files)"
        ) from None
    try:
        ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as e:
        raise DataError(f"{label}: could not load hub dataset {hub_id!r} "
                        f"(config={config!r}, split={split!r}): {e}") from e
    for i, row in enumerate(ds, start=1):
        yield i, dict(row)


def _data_dirs(data_dir: str | os.PathLike | None) -> list[Path]:
    dirs = []
    if data_dir:
        dirs.append(Path(data_dir).expanduser())
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        dirs.append(Path(env).expanduser())
    return dirs


def _load_file_or_hub(
    src: str, path: Path, *, split: str | None, prompt_key: str | None, answer_key: str | None, limit: int | None
) -> list[Example]:
    """:func:`load_examples` for a source that is a local file (``path``) or a hub id ``org/name[:config]``."""
    if path.is_file():
        pkeys, pexp = field_keys(prompt_key, (), DEFAULT_PROMPT_KEYS)
        akeys, aexp = field_keys(answer_key, (), DEFAULT_ANSWER_KEYS)
        return collect_examples(
            iter_file(path, src), label=src, id_prefix=path.stem, prompt_keys=pkeys,
            answer_keys=akeys, explicit_prompt=pexp, explicit_answer=aexp, limit=limit,
        )
    if path.suffix.lower() in _FILE_SUFFIXES or path.exists():
        kind = "is not a regular file" if path.exists() else "not found"
        raise DataError(f"dataset file {src!r} {kind}")
    if _HUB_ID_RE.match(src):
        hub_id, _, config = src.partition(":")
        hub_split = split or "train"
        pkeys, pexp = field_keys(prompt_key, (), DEFAULT_PROMPT_KEYS)
        akeys, aexp = field_keys(answer_key, (), DEFAULT_ANSWER_KEYS)
        return collect_examples(
            _iter_hub(hub_id, config or None, hub_split, f"hub dataset {src!r} ({hub_split})"),
            label=f"hub dataset {src!r} ({hub_split})", id_prefix=f"{hub_id}_{hub_split}",
            prompt_keys=pkeys, answer_keys=akeys, explicit_prompt=pexp, explicit_answer=aexp, limit=limit,
        )
    close = difflib.get_close_matches(src.lower(), [*NAMED_DATASETS, *DATASET_ALIASES], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise DataError(
        f"unknown dataset {src!r}: not an existing file, not a named dataset "
        f"({', '.join(NAMED_DATASETS)}), and not a hub id 'org/name'.{hint}"
    )


def _load_named(
    named: str,
    *,
    split: str | None,
    prompt_key: str | None,
    answer_key: str | None,
    data_dir: str | os.PathLike | None,
    limit: int | None,
) -> list[Example]:
    """:func:`load_examples` for a named dataset: its file in the first data dir that has it, else the hub."""
    ds = NAMED_DATASETS[named]
    sp = split or ds.default_split
    if sp not in ds.files:
        raise DataError(f"dataset {named!r} has no split {sp!r} (available: {', '.join(ds.splits)})")
    pkeys, pexp = field_keys(prompt_key, ds.prompt_keys, DEFAULT_PROMPT_KEYS)
    akeys, aexp = field_keys(answer_key, ds.answer_keys, DEFAULT_ANSWER_KEYS)
    fname = ds.files[sp]
    tried = _data_dirs(data_dir)
    for d in tried:
        f = d / fname
        if f.is_file():
            return collect_examples(
                iter_file(f, str(f)), label=str(f), id_prefix=f"{named}_{sp}", prompt_keys=pkeys,
                answer_keys=akeys, explicit_prompt=pexp, explicit_answer=aexp, limit=limit,
            )
    where = ", ".join(str(d) for d in tried) if tried else f"no data_dir given and ${DATA_DIR_ENV} unset"
    label = f"dataset {named!r} ({sp}; {fname} not found in: {where}; hub {ds.hub_id})"
    return collect_examples(
        _iter_hub(ds.hub_id, ds.hub_config, ds.hub_splits[sp], label), label=label,
        id_prefix=f"{named}_{sp}", prompt_keys=pkeys, answer_keys=akeys,
        explicit_prompt=pexp, explicit_answer=aexp, limit=limit,
    )


def load_examples(
    source: str | os.PathLike,
    *,
    split: str | None = None,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    data_dir: str | os.PathLike | None = None,
    limit: int | None = None,
) -> list[Example]:
    """Load a dataset as a list of :class:`Example` (sources: the module docstring; rows: :mod:`tether.tasks.rows`).

    Args:
        source: A ``.jsonl``/``.json``/``.parquet`` file, a named dataset (see
            :data:`NAMED_DATASETS`, aliases in :data:`DATASET_ALIASES`), or a hub id
            ``org/name`` / ``org/name:config``.
        split: Named datasets: ``"train"``/``"test"`` for ``gsm8k`` (default ``"train"``),
            ``"test"`` (the default) for the others. Hub ids: the split to load (default
            ``"train"``). Ignored for local files.
        prompt_key: Field holding the prompt (default: first of ``prompt``, ``question``,
            ``problem``).
        answer_key: Field holding the answer (default: ``answer``, else ``solution``).
        data_dir: Directory with the named datasets' files; tried before ``$TETHER_DATA_DIR``,
            and the hub is used only when neither has the file.
        limit: Keep only the first ``limit`` rows (only those are read and validated).

    Example ids are ``"<prefix>:<0-based row index>"`` with prefix ``<name>_<split>`` for
    named datasets (``"gsm8k_test:17"``), the file stem for files, ``<org/name>_<split>`` for
    hub ids.

    Raises:
        DataError: unknown source, unreadable file, bad row (message names file, row and
            field), empty dataset, or a hub dataset requested without ``datasets`` installed.
    """
    if limit is not None:
        limit = int(limit)
        if limit <= 0:
            raise DataError(f"limit must be positive, got {limit}")
    src = os.fspath(source).strip() if isinstance(source, (str, os.PathLike)) else None
    if not src:
        raise DataError(f"dataset source must be a non-empty string, got {source!r}")

    named = resolve_dataset_name(src)
    path = Path(src).expanduser()
    if named is None or path.is_file():
        return _load_file_or_hub(src, path, split=split, prompt_key=prompt_key, answer_key=answer_key, limit=limit)
    return _load_named(named, split=split, prompt_key=prompt_key, answer_key=answer_key, data_dir=data_dir,
                       limit=limit)
