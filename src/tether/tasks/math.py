"""Answer extraction and equivalence checking for math-style verifiable rewards.

* :func:`extract_answer` pulls the final answer out of a model completion.
* :func:`is_equivalent` decides whether a predicted answer equals a reference answer, using
  cheap string / numeric checks first and the ``math_verify`` library for LaTeX.
* :func:`gsm8k_reference` turns a GSM8K ``answer`` field (worked solution ending in
  ``#### N``) into the reference number.
* :func:`has_answer_format` tells whether a completion states its answer in one of the
  recognised final-answer formats (used by the optional format bonus).

Everything here is pure string processing and never raises on odd input.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import threading

__all__ = [
    "extract_answer",
    "extract_boxed",
    "last_number",
    "is_equivalent",
    "gsm8k_reference",
    "has_answer_format",
    "parse_number",
    "normalize_number",
]

logger = logging.getLogger(__name__)

#: Seconds math-verify may spend parsing / comparing one expression (signal based; only used
#: when called from the main thread, see :func:`is_equivalent`).
MATH_VERIFY_TIMEOUT_S = 3
#: Answers longer than this are not handed to math-verify (sympy can be very slow on huge
#: expressions and there is no timeout outside the main thread).
MAX_VERIFY_CHARS = 400
#: Relative tolerance for numeric comparison.
REL_TOL = 1e-6
ABS_TOL = 1e-9

# A plain number: optional minus (not when it is a binary minus glued to a word/number),
# thousands groups or plain digits, optional decimals.
_NUM = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUM_RE = re.compile(r"(?<![\w.])" + _NUM + r"(?!\d)")
_PLAIN_NUM_RE = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$")
_THOUSANDS_RE = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_ANSWER_RE = re.compile(
    r"(?:final\s+answer|answer)\s*(?:\*\*|\*|\\\]|\})?\s*(?:is\b\s*:?|:|=)", re.IGNORECASE
)
_HASHES_RE = re.compile(r"####")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FORMAT_LINE_RE = re.compile(
    r"^\s*[*_#>\s]*(?:final\s+answer|answer)\s*[*_]*\s*[:=]\s*[*_]*\s*\S", re.IGNORECASE | re.MULTILINE
)
_HASHES_LINE_RE = re.compile(r"####([^\n]*)")  # every '####' and the rest of its line ('########': two)
_BOXED_START_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


# --------------------------------------------------------------------------------------
# extraction
# --------------------------------------------------------------------------------------


def _matching_brace(text: str, open_idx: int) -> int | None:
    """Index of the ``}`` matching the ``{`` at ``open_idx`` (None when unbalanced)."""
    depth = 0
    i = open_idx
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n and text[i + 1] in "{}":
            i += 2  # escaped brace \{ or \}
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``.

    Braces are matched, so nested groups such as ``\\boxed{\\frac{1}{2}}`` are returned
    whole. A final ``\\boxed{`` that is never closed (a truncated completion) is skipped in
    favour of the previous complete one. Returns None when there is no complete box.
    """
    if not isinstance(text, str):
        return None
    starts = [m.end() - 1 for m in _BOXED_RE.finditer(text)]
    for open_idx in reversed(starts):
        close = _matching_brace(text, open_idx)
        if close is not None:
            return text[open_idx + 1 : close].strip()
    return None


def normalize_number(s: str) -> str:
    """Canonical string for a number written in text: drops ``$``, thousands commas and a
    trailing period (``"$1,234."`` -> ``"1234"``); integral floats lose their ``.0``
    (``"142.0"`` -> ``"142"``) and leading zeros go (``"025"`` -> ``"25"``). Strings that are not a
    plain number come back stripped but otherwise unchanged."""
    t = s.strip().replace("\u2212", "-")
    t = t.replace("\\$", "").replace("$", "").strip()
    t = t.rstrip(".").strip() if not t.endswith("..") else t
    if _THOUSANDS_RE.match(t):
        t = t.replace(",", "")
    if _PLAIN_NUM_RE.match(t) and "e" not in t.lower():
        if "." in t:
            try:
                f = float(t)
            except ValueError:  # pragma: no cover - regex guarantees a float
                return s.strip()
            if f.is_integer() and abs(f) < 1e15:
                return str(int(f))
            t = t.rstrip("0").rstrip(".") if "." in t else t
            return t
        sign = "-" if t.startswith("-") else ""
        digits = t.lstrip("+-").lstrip("0") or "0"
        return sign + digits if digits != "0" else "0"
    return s.strip()


def strip_delims(s: str) -> str:
    """Remove one layer of surrounding math delimiters: ``$..$``, ``$$..$$``, ``\\(..\\)``,
    ``\\[..\\]``."""
    t = s.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(t) >= len(left) + len(right) and t.startswith(left) and t.endswith(right):
            inner = t[len(left) : len(t) - len(right)].strip()
            if inner and (left != "$" or "$" not in inner.replace("\\$", "")):
                return inner
    return t


_EXPR_CONT = set("/^*+-\\=_{")


def _number_or_expr(s: str, whole: bool) -> str | None:
    """A leading number followed by words/punctuation is that number alone; anything else
    is an expression (cut at the end of the sentence unless ``whole``)."""
    m = re.match(r"(?:\\\$|\$)?\s*(" + _NUM + r")", s)
    if m:
        after = s[m.end() :]
        glued_letter = bool(after) and after[0].isalpha()
        if not glued_letter and after.lstrip()[:1] not in _EXPR_CONT:
            return normalize_number(m.group(1))
    if not whole:
        cut = re.search(r"\.(?:\s|$)", s)
        if cut:
            s = s[: cut.start()]
    return _finish(s)


def _candidate_from_rest(rest: str) -> str | None:
    """Turn the text after an answer marker (``####``, ``answer is``) into an answer."""
    rest = rest.strip().lstrip("*:=_ \t").strip()
    if not rest:
        return None
    for left, right in (("$$", "$$"), ("\\(", "\\)"), ("\\[", "\\]"), ("$", "$")):
        if rest.startswith(left) and right in rest[len(left) :]:
            inner = rest[len(left) : rest.index(right, len(left))]
            if inner.strip():
                return _number_or_expr(inner.strip(), whole=True)
    return _number_or_expr(rest, whole=False)


def _finish(s: str) -> str | None:
    s = s.strip().rstrip(".").strip().strip("*").strip()
    if not s:
        return None
    return normalize_number(s)


def _looks_like_prose(s: str) -> bool:
    """``answer is not clear ...``: more than three words, no digit, no LaTeX."""
    return len(s.split()) > 3 and not any(c.isdigit() for c in s) and "\\" not in s


def extract_answer(text: str) -> str | None:
    """Extract the final answer from a completion.

    Tried in order, the first that yields something wins:

    1. the content of the last complete ``\\boxed{...}`` (balanced braces);
    2. the text after the last ``####`` on its line (``#### 42``);
    3. the text after the last ``answer is`` / ``answer:`` / ``final answer =`` marker
       (case-insensitive; a leading number is taken alone, so ``The answer is 12 apples.``
       gives ``12``; ``$...$`` math is unwrapped; prose of more than three words with no
       digit and no LaTeX, as in ``the answer is not clear``, is skipped);
    4. the last number in the text.

    Numbers are normalized (``$``, thousands commas and a trailing ``.`` dropped,
    ``12.0`` -> ``12``). A minus sign counts only when it is not a binary minus
    (``3-5`` ends with ``5``; ``x = -5`` with ``-5``). Returns None when nothing is found.
    """
    if not isinstance(text, str) or not text:
        return None
    try:
        text = text.replace("\u2212", "-")
        boxed = extract_boxed(text)
        if boxed:
            return normalize_number(strip_delims(boxed))
        hashes = list(_HASHES_RE.finditer(text))
        if hashes:
            rest = text[hashes[-1].end() :].split("\n", 1)[0]
            cand = _candidate_from_rest(rest.lstrip("#"))
            if cand:
                return cand
        answers = list(_ANSWER_RE.finditer(text))
        for m in reversed(answers):
            rest = text[m.end() :]
            line = rest.split("\n", 1)[0]
            if not line.strip() and rest.strip():
                # "Answer:\n42" -> look at the next non-empty line
                line = rest.strip().split("\n", 1)[0]
            cand = _candidate_from_rest(line)
            if cand and not _looks_like_prose(cand):
                return cand
        nums = _NUM_RE.findall(text)
        if nums:
            return normalize_number(nums[-1])
    except Exception:  # pragma: no cover - defensive: extraction must never raise
        logger.debug("extract_answer failed", exc_info=True)
    return None


def last_number(text: str | None) -> str | None:
    """The last plain number in ``text``, normalized (``"8 + 4 = 12 pencils"`` -> ``"12"``),
    or None. Same number rules as step 4 of :func:`extract_answer`."""
    if not isinstance(text, str):
        return None
    nums = _NUM_RE.findall(text.replace("\u2212", "-"))
    return normalize_number(nums[-1]) if nums else None


def gsm8k_reference(answer_field: str) -> str:
    """Reference number of a GSM8K ``answer`` field: the number after the last ``####``
    with commas (and ``$``) removed, e.g. ``"...\\n#### 1,234"`` -> ``"1234"``. Text without
    ``####`` is returned normalized as a whole."""
    s = str(answer_field)
    idx = s.rfind("####")
    if idx >= 0:
        s = s[idx + 4 :].strip().split("\n", 1)[0]
    return normalize_number(s)


def has_answer_format(text: str) -> bool:
    """True when ``text`` states exactly one final answer, in a recognised format:

    * a complete ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces;
    * ``####`` followed, on the same line, by a number (GSM8K's format: ``#### 42``,
      ``#### $1,234.50``, a trailing period allowed);
    * a line that starts with ``Answer:`` or ``Final answer:`` (case-insensitive, ``=``
      also accepted, Markdown ``**``/``#`` decoration allowed) followed by something.

    A response that states several final answers (two ``\\boxed``, a list of ``####`` lines,
    ``########``) or whose ``####`` is followed by words (``#### Emma has 35 books.``) is not in
    the format: the format bonus (``data.format_weight``) is for stating one answer where the
    grader looks, and responses of repeated ``#### ...`` lines that collected it without a
    correct answer took over training once (docs/results.md).
    """
    if not isinstance(text, str) or not text:
        return False
    boxes = len(_BOXED_START_RE.findall(text))
    hashes = _HASHES_LINE_RE.findall(text)
    lines = _FORMAT_LINE_RE.findall(text)
    if boxes + len(hashes) + len(lines) != 1:
        return False
    if boxes:
        return extract_boxed(text) is not None
    if hashes:
        return parse_number(hashes[0].strip().rstrip(".")) is not None
    return True


# --------------------------------------------------------------------------------------
# equivalence
# --------------------------------------------------------------------------------------

_SCI_RE = re.compile(
    r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*(?:\\times|\\cdot|\*|x|×)\s*10\s*\^\s*\{?\s*([+-]?\d+)\s*\}?$"
)
_POW10_RE = re.compile(r"^([+-]?)10\s*\^\s*\{?\s*([+-]?\d+)\s*\}?$")
_FRAC_RE = re.compile(
    r"^([+-]?)\\[dt]?frac\s*\{\s*([+-]?\d+(?:\.\d+)?)\s*\}\s*\{\s*([+-]?\d+(?:\.\d+)?)\s*\}$"
)
_FRAC_SHORT_RE = re.compile(r"^([+-]?)\\[dt]?frac(\d)(\d)$")
_SLASH_RE = re.compile(r"^([+-]?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)$")


def parse_number(s: str) -> float | None:
    """Parse ``s`` as a single real number, or return None.

    Understands plain numbers (``1,234.5``, ``-3``, ``.5``, ``1e-3``), money and
    percent/degree decorations (``$5``, ``50\\%``, ``90^\\circ``), scientific notation in
    LaTeX (``8.7 \\times 10^{8}``, ``10^{-3}``) and simple fractions (``3/4``,
    ``\\frac{1}{2}``, ``-\\dfrac{3}{4}``, ``\\frac12``).
    """
    if not isinstance(s, str):
        return None
    t = strip_delims(s).replace("\u2212", "-")
    t = t.replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", "")
    t = t.replace("\\left", "").replace("\\right", "").strip()
    for suffix in ("\\%", "%", "^\\circ", "^{\\circ}", "°"):
        if t.endswith(suffix):
            t = t[: -len(suffix)].strip()
    if t.endswith(".") and not t.endswith(".."):
        t = t[:-1].strip()
    if not t:
        return None
    if _THOUSANDS_RE.match(t):
        t = t.replace(",", "")
    try:
        if _PLAIN_NUM_RE.match(t):
            return float(t)
        m = _SCI_RE.match(t)
        if m:
            return float(m.group(1)) * 10.0 ** int(m.group(2))
        m = _POW10_RE.match(t)
        if m:
            v = 10.0 ** int(m.group(2))
            return -v if m.group(1) == "-" else v
        m = _FRAC_RE.match(t) or _FRAC_SHORT_RE.match(t)
        if m:
            den = float(m.group(3))
            if den == 0:
                return None
            v = float(m.group(2)) / den
            return -v if m.group(1) == "-" else v
        m = _SLASH_RE.match(t)
        if m:
            den = float(m.group(2))
            if den == 0:
                return None
            return float(m.group(1)) / den
    except (ValueError, OverflowError):
        return None
    return None


_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def norm_str(s: str) -> str:
    t = strip_delims(s)
    t = _TEXT_RE.sub(r"\1", t)
    for a, b in (
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\ ", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\$", ""),
        ("$", ""),
    ):
        t = t.replace(a, b)
    t = re.sub(r"\s+", "", t)
    return t.rstrip(".")


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


_mv_warning_silenced = False


def _silence_mv_timeout_warning() -> None:
    """math-verify logs a one-off warning when its timeout is disabled; we disable it on
    purpose off the main thread (signals only work there), so mark it as already shown."""
    global _mv_warning_silenced
    if _mv_warning_silenced:
        return
    try:
        import math_verify.grader as _g
        import math_verify.parser as _p

        _g.TIMEOUT_WARNING_SHOWN = True
        _p.TIMEOUT_WARNING_SHOWN = True
    except Exception:  # pragma: no cover
        pass
    _mv_warning_silenced = True


@functools.lru_cache(maxsize=8192)
def _mv_parse(s: str, use_signal_timeout: bool):
    from math_verify import parse

    unescaped_dollar = "$" in s.replace("\\$", "")
    wrapped = s if ("\\boxed" in s or unescaped_dollar) else f"${s}$"
    timeout = MATH_VERIFY_TIMEOUT_S if use_signal_timeout else None
    if timeout is None:
        _silence_mv_timeout_warning()
    return tuple(parse(wrapped, parsing_timeout=timeout))


def _math_verify_equal(pred: str, ref: str) -> bool:
    from math_verify import verify

    use_signal = _in_main_thread()
    gold = _mv_parse(strip_delims(ref), use_signal)
    target = _mv_parse(strip_delims(pred), use_signal)
    if not gold or not target:
        return False
    timeout = MATH_VERIFY_TIMEOUT_S if use_signal else None
    return bool(verify(list(gold), list(target), timeout_seconds=timeout))


def is_equivalent(pred: str | None, ref: str) -> bool:
    """Whether the predicted answer ``pred`` is mathematically equal to the reference ``ref``.

    Checks, cheapest first:

    1. normalized string equality (whitespace, ``$``, ``\\left``/``\\right``, ``\\text{}``,
       ``\\dfrac`` ignored);
    2. if both parse as plain numbers (see :func:`parse_number`): numeric equality with
       relative tolerance 1e-6 -- this decides the answer, math-verify is not consulted;
    3. otherwise ``math_verify.parse`` on both (wrapped in ``$...$`` unless they already
       contain ``\\boxed``) and ``math_verify.verify(gold, pred)``, so LaTeX references such as
       ``\\frac{1}{2}`` or ``\\left( 3, \\frac{\\pi}{2} \\right)`` match ``0.5`` / ``(3, \\pi/2)``.

    math-verify guards parsing with ``signal.alarm``, which only works in the main thread:
    there a :data:`MATH_VERIFY_TIMEOUT_S` timeout is used; in any other thread the timeout is
    disabled (``parsing_timeout=None`` / ``timeout_seconds=None``) and inputs longer than
    :data:`MAX_VERIFY_CHARS` are not handed to math-verify at all. Never raises: any error
    (or timeout) counts as not equivalent.
    """
    try:
        if pred is None or ref is None:
            return False
        pred = str(pred).strip()
        ref = str(ref).strip()
        if not pred or not ref:
            return False
        if norm_str(pred) == norm_str(ref):
            return True
        a, b = parse_number(pred), parse_number(ref)
        if a is not None and b is not None:
            if math.isnan(a) or math.isnan(b):
                return False
            return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)
        if len(pred) > MAX_VERIFY_CHARS or len(ref) > MAX_VERIFY_CHARS:
            return False
        return _math_verify_equal(pred, ref)
    except BaseException as e:  # math-verify's TimeoutException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        logger.debug("is_equivalent(%r, %r) failed", pred, ref, exc_info=True)
        return False
