"""Validating dataset rows and converting them to :class:`Example` objects.

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
any training: a missing field, a wrong type or an invalid row raises :class:`DataError`
naming the source, the 1-based row and the field. An empty dataset is an error too.
:func:`tether.tasks.data.load_examples` reads the rows (:mod:`tether.tasks.files` for local
files) and hands them to :func:`collect_examples`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Sequence

from .base import DataError, Example
from .math import extract_boxed, gsm8k_reference, normalize_number, strip_delims

__all__ = ["DEFAULT_PROMPT_KEYS", "DEFAULT_ANSWER_KEYS", "row_to_example"]

#: Prompt fields tried in order when no ``prompt_key`` is given.
DEFAULT_PROMPT_KEYS = ("prompt", "question", "problem")
#: Answer fields tried in order when no ``answer_key`` is given (``solution`` only without ``answer``).
DEFAULT_ANSWER_KEYS = ("answer", "solution")

_HASHES_ANSWER_RE = re.compile(r"(?:^|\n)\s*####\s*\S")


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
    t = strip_delims(t)
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


def collect_examples(
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


def field_keys(explicit: str | None, preferred: Sequence[str], defaults: Sequence[str]) -> tuple[tuple[str, ...], bool]:
    if explicit:
        return (explicit,), True
    keys: list[str] = []
    for k in (*preferred, *defaults):
        if k not in keys:
            keys.append(k)
    return tuple(keys), False
