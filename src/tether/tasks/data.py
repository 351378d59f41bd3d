"""Loading datasets of prompts with verifiable answers into :class:`Example` lists.

``load_examples(source)`` accepts

* a local file: ``.jsonl`` (one JSON object per line, blank lines skipped), ``.json`` (a
  list of objects, or ``{"data": [...]}``) or ``.parquet`` (needs ``pyarrow``);
* a named dataset (:data:`NAMED_DATASETS`: ``gsm8k``, ``math500``, ``aime24``, ``amc``,
  ``minerva``, ``olympiadbench``), read from ``data_dir``, else ``$TETHER_DATA_DIR``, else
  downloaded from its usual Hugging Face hub id (needs the optional ``datasets`` package);
* a hub dataset id ``org/name`` (optionally ``org/name:config``), via
  ``datasets.load_dataset`` when ``datasets`` is installed.

Field mapping: the prompt is the first present of ``prompt``, ``question``, ``problem`` (or
``prompt_key``); the answer is ``answer`` (or ``answer_key``), falling back to ``solution``
only when there is no ``answer``. The answer is canonicalized:

* ``int``/``float`` -> canonical number string (``142.0`` -> ``"142"``);
* a string: surrounding ``$...$`` and whitespace removed, plain numbers normalized
  (``"1,234"`` -> ``"1234"``, ``"025"`` -> ``"25"``); a GSM8K-style worked solution ending in
  ``#### N`` becomes ``N`` and one containing ``\\boxed{...}`` becomes the last box's content
  (the full text is kept in ``meta["solution"]``);
* a non-empty list of equivalent forms: ``answer`` is the first, all of them go to
  ``meta["answers"]`` (the ``math`` reward accepts any).

Every other field of the row goes to ``meta``. Rows are validated as they are loaded, before
any training: a missing field, a wrong type or an invalid JSON line raises :class:`DataError`
naming the file, the 1-based row (the line number for JSONL) and the field. An empty dataset
is an error too.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from .base import DataError, Example
from .math import _strip_delims, extract_boxed, gsm8k_reference, normalize_number

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
#: Prompt fields tried in order when no ``prompt_key`` is given.
DEFAULT_PROMPT_KEYS = ("prompt", "question", "problem")
#: Answer fields tried in order when no ``answer_key`` is given (``solution`` only without ``answer``).
DEFAULT_ANSWER_KEYS = ("answer", "solution")

_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(?::[\w.-]+)?$")
_HASHES_ANSWER_RE = re.compile(r"(?:^|\n)\s*####\s*\S")


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


# --------------------------------------------------------------------------------------
# row validation / conversion
# --------------------------------------------------------------------------------------


def _have(row: dict) -> str:
    return ", ".join(str(k) for k in row) or "no fields"


def _canonical_scalar(value: Any, where: str, key: str) -> str:
    if isinstance(value, bool) or value is None:
        raise DataError(
            f"{where}: field {key!r} must be a string, number or list, got {type(value).__name__}"
        )
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DataError(f"{where}: field {key!r} is not a finite number ({value!r})")
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    if isinstance(value, str):
        return _canonical_text(value)
    raise DataError(
        f"{where}: field {key!r} must be a string, number or list, got {type(value).__name__}"
    )


def _canonical_text(s: str) -> str:
    t = s.strip()
    if _HASHES_ANSWER_RE.search(t):
        return gsm8k_reference(t)
    if "\\boxed" in t or "\\fbox" in t:
        boxed = extract_boxed(t)
        if boxed:
            t = boxed
    t = _strip_delims(t)
    return normalize_number(t)


def _answer_has_solution(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    t = value.strip()
    return bool(_HASHES_ANSWER_RE.search(t)) or (
        ("\\boxed" in t or "\\fbox" in t) and extract_boxed(t) is not None and len(t) > len(extract_boxed(t)) + 8
    )


def row_to_example(
    row: Any,
    *,
    where: str,
    example_id: str,
    prompt_keys: Sequence[str] = DEFAULT_PROMPT_KEYS,
    answer_keys: Sequence[str] = DEFAULT_ANSWER_KEYS,
    explicit_prompt: bool = False,
    explicit_answer: bool = False,
) -> Example:
    """Validate one row and convert it to an :class:`Example`.

    Args:
        row: The parsed row (must be a dict).
        where: Location used in error messages, e.g. ``"data.jsonl row 3"``.
        example_id: The id to give the example.
        prompt_keys / answer_keys: Fields tried in order (a single explicit key when
            ``explicit_*`` is set).

    Raises:
        DataError: not an object, missing field, wrong type, empty prompt or answer.
    """
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with fields, got {type(row).__name__}")
    pkey = next((k for k in prompt_keys if k in row), None)
    if pkey is None:
        hint = "" if explicit_prompt else f"; tried {', '.join(prompt_keys)}; set prompt_key to choose a field"
        raise DataError(f"{where}: missing field {prompt_keys[0]!r} (have: {_have(row)}){hint}")
    akey = next((k for k in answer_keys if k in row), None)
    if akey is None:
        hint = "" if explicit_answer else f"; tried {', '.join(answer_keys)}; set answer_key to choose a field"
        raise DataError(f"{where}: missing field {answer_keys[0]!r} (have: {_have(row)}){hint}")
    prompt = row[pkey]
    if not isinstance(prompt, str):
        raise DataError(f"{where}: field {pkey!r} must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise DataError(f"{where}: field {pkey!r} is empty")
    raw = row[akey]
    meta = {k: v for k, v in row.items() if k not in (pkey, akey)}
    if isinstance(raw, (list, tuple)):
        if not raw:
            raise DataError(f"{where}: field {akey!r} is an empty list")
        forms = []
        for j, item in enumerate(raw):
            if isinstance(item, (list, tuple, dict)):
                raise DataError(
                    f"{where}: field {akey!r} item {j} must be a string or number, got {type(item).__name__}"
                )
            c = _canonical_scalar(item, where, f"{akey}[{j}]")
            if c and c not in forms:
                forms.append(c)
        if not forms:
            raise DataError(f"{where}: field {akey!r} is empty")
        answer = forms[0]
        if len(forms) > 1:
            meta["answers"] = forms
    else:
        answer = _canonical_scalar(raw, where, akey)
        if _answer_has_solution(raw) and "solution" not in meta:
            meta["solution"] = raw
    if not answer:
        raise DataError(f"{where}: field {akey!r} is empty")
    return Example(prompt=prompt, answer=answer, id=example_id, meta=meta)


# --------------------------------------------------------------------------------------
# readers: yield (row_number, row) with 1-based row numbers (line numbers for JSONL)
# --------------------------------------------------------------------------------------


def iter_jsonl(path: str | os.PathLike, label: str | None = None, error: type[DataError] = DataError,
               raw_hash=None) -> Iterator[tuple[int, Any]]:
    """``(line number, row)`` of each non-blank line of a JSONL file.

    A line that is not UTF-8 or not JSON raises ``error`` naming ``label`` (default: the path)
    and the line. ``raw_hash`` (a hashlib object), when given, is fed every raw line, blank
    lines included, so it ends as the hash of the whole file.
    """
    label = label or str(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise error(f"{label}: cannot read the file: {e.strerror or e}") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            if raw_hash is not None:
                raw_hash.update(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{label} line {lineno}: not valid UTF-8 (byte {e.start}: {e.reason})") from None
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{label} line {lineno}: invalid JSON ({e.msg} at column {e.colno})") from None


def _iter_json(path: Path, label: str) -> Iterator[tuple[int, Any]]:
    from ..errors import read_utf8
    text = read_utf8(path, label, DataError)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{label}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{label}: expected a JSON list of objects or {{\"data\": [...]}}, got {type(data).__name__}")
    for i, row in enumerate(data, start=1):
        yield i, row


def _iter_parquet(path: Path, label: str) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{label}: reading .parquet files needs pyarrow (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{label}: cannot read parquet file: {e}") from None
    i = 0
    batches = pf.iter_batches(batch_size=1024)
    while True:
        try:  # a damaged page or a string column that is not UTF-8 fails here, mid-file
            batch = next(batches, None)
            rows = [] if batch is None else batch.to_pylist()
        except Exception as e:
            raise DataError(f"{label}: cannot read parquet rows after row {i}: {e}") from None
        if batch is None:
            return
        for row in rows:
            i += 1
            yield i, row


def _iter_file(path: Path, label: str) -> Iterator[tuple[int, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return iter_jsonl(path, label)
    if suffix == ".json":
        return _iter_json(path, label)
    if suffix == ".parquet":
        return _iter_parquet(path, label)
    raise DataError(f"{label}: unsupported file type {suffix!r} (use .jsonl, .json or .parquet)")


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
        raise DataError(f"{label}: could not load hub dataset {hub_id!r} (config={config!r}, split={split!r}): {e}") from e
    for i, row in enumerate(ds, start=1):
        yield i, dict(row)


def _collect(
    rows: Iterable[tuple[int, Any]],
    *,
    label: str,
    id_prefix: str,
    prompt_keys: Sequence[str],
    answer_keys: Sequence[str],
    explicit_prompt: bool,
    explicit_answer: bool,
    limit: int | None,
) -> list[Example]:
    out: list[Example] = []
    for index, (rownum, row) in enumerate(rows):
        if limit is not None and len(out) >= limit:
            break
        out.append(
            row_to_example(
                row,
                where=f"{label} row {rownum}",
                example_id=f"{id_prefix}:{index}",
                prompt_keys=prompt_keys,
                answer_keys=answer_keys,
                explicit_prompt=explicit_prompt,
                explicit_answer=explicit_answer,
            )
        )
    if not out:
        raise DataError(f"{label}: dataset is empty (no rows)")
    return out


def _keys(explicit: str | None, preferred: Sequence[str], defaults: Sequence[str]) -> tuple[tuple[str, ...], bool]:
    if explicit:
        return (explicit,), True
    keys: list[str] = []
    for k in (*preferred, *defaults):
        if k not in keys:
            keys.append(k)
    return tuple(keys), False


def _data_dirs(data_dir: str | os.PathLike | None) -> list[Path]:
    dirs = []
    if data_dir:
        dirs.append(Path(data_dir).expanduser())
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        dirs.append(Path(env).expanduser())
    return dirs


def load_examples(
    source: str | os.PathLike,
    *,
    split: str | None = None,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    data_dir: str | os.PathLike | None = None,
    limit: int | None = None,
) -> list[Example]:
    """Load a dataset as a list of :class:`Example` (validated; see the module docstring).

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
        if path.is_file():
            pkeys, pexp = _keys(prompt_key, (), DEFAULT_PROMPT_KEYS)
            akeys, aexp = _keys(answer_key, (), DEFAULT_ANSWER_KEYS)
            return _collect(
                _iter_file(path, src), label=src, id_prefix=path.stem, prompt_keys=pkeys,
                answer_keys=akeys, explicit_prompt=pexp, explicit_answer=aexp, limit=limit,
            )
        if path.suffix.lower() in _FILE_SUFFIXES or path.exists():
            kind = "is not a regular file" if path.exists() else "not found"
            raise DataError(f"dataset file {src!r} {kind}")
        if _HUB_ID_RE.match(src):
            hub_id, _, config = src.partition(":")
            hub_split = split or "train"
            pkeys, pexp = _keys(prompt_key, (), DEFAULT_PROMPT_KEYS)
            akeys, aexp = _keys(answer_key, (), DEFAULT_ANSWER_KEYS)
            return _collect(
                _iter_hub(hub_id, config or None, hub_split, f"hub dataset {src!r} ({hub_split})"),
                label=f"hub dataset {src!r} ({hub_split})", id_prefix=f"{hub_id}_{hub_split}",
                prompt_keys=pkeys, answer_keys=akeys, explicit_prompt=pexp, explicit_answer=aexp, limit=limit,
            )
        raise DataError(
            f"unknown dataset {src!r}: not an existing file, not a named dataset "
            f"({', '.join(NAMED_DATASETS)}), and not a hub id 'org/name'"
        )

    ds = NAMED_DATASETS[named]
    sp = split or ds.default_split
    if sp not in ds.files:
        raise DataError(f"dataset {named!r} has no split {sp!r} (available: {', '.join(ds.splits)})")
    pkeys, pexp = _keys(prompt_key, ds.prompt_keys, DEFAULT_PROMPT_KEYS)
    akeys, aexp = _keys(answer_key, ds.answer_keys, DEFAULT_ANSWER_KEYS)
    fname = ds.files[sp]
    tried = _data_dirs(data_dir)
    for d in tried:
        f = d / fname
        if f.is_file():
            return _collect(
                _iter_file(f, str(f)), label=str(f), id_prefix=f"{named}_{sp}", prompt_keys=pkeys,
                answer_keys=akeys, explicit_prompt=pexp, explicit_answer=aexp, limit=limit,
            )
    where = ", ".join(str(d) for d in tried) if tried else f"no data_dir given and ${DATA_DIR_ENV} unset"
    label = f"dataset {named!r} ({sp}; {fname} not found in: {where}; hub {ds.hub_id})"
    return _collect(
        _iter_hub(ds.hub_id, ds.hub_config, ds.hub_splits[sp], label), label=label,
        id_prefix=f"{named}_{sp}", prompt_keys=pkeys, answer_keys=akeys,
        explicit_prompt=pexp, explicit_answer=aexp, limit=limit,
    )
