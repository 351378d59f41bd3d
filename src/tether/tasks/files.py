"""Local dataset files read as ``(row number, row)`` pairs, 1-based (the line number for JSONL).

* ``.jsonl``: one JSON object per line, blank lines skipped (:func:`iter_jsonl`, also used by
  :mod:`tether.search` for its own data and corpus files);
* ``.json``: a list of objects, or ``{"data": [...]}``;
* ``.parquet``: read in batches (needs ``pyarrow``).

An unreadable file, bytes that are not UTF-8, invalid JSON (JSON nested too deeply for the parser
included: `tether.userio.loads_json`) or an unreadable parquet page raise :class:`DataError`
naming the file and the line or row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from ..userio import JSONTooDeep, json_error, loads_json, read_utf8
from .base import DataError

__all__ = ["iter_jsonl"]


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
                row = loads_json(line)
            except json.JSONDecodeError as e:
                raise error(f"{label} line {lineno}: invalid JSON ({json_error(e)})") from None
            yield lineno, row


def _iter_json(path: Path, label: str) -> Iterator[tuple[int, Any]]:
    text = read_utf8(path, label, DataError)
    try:
        data = loads_json(text)
    except json.JSONDecodeError as e:
        where = "" if isinstance(e, JSONTooDeep) else f" at line {e.lineno} column {e.colno}"
        raise DataError(f"{label}: invalid JSON{where}: {e.msg}") from None
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


def iter_file(path: Path, label: str) -> Iterator[tuple[int, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return iter_jsonl(path, label)
    if suffix == ".json":
        return _iter_json(path, label)
    if suffix == ".parquet":
        return _iter_parquet(path, label)
    raise DataError(f"{label}: unsupported file type {suffix!r} (use .jsonl, .json or .parquet)")
