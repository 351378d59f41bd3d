"""The text protocol of a Search-R1-style search agent: tags, action parsing, observations.

One episode is a single growing assistant turn. The model reasons inside ``<think>...</think>``,
asks the search engine with ``<search>query</search>`` and finishes with
``<answer>...</answer>``. Generation stops at :data:`STOP_STRINGS`; the environment then either
appends the search results as an observation::

    \\n\\n<information>Doc 1(Title: "Jeff Porcaro") Jeffrey Thomas Porcaro ...
    Doc 2(Title: "Toto (band)") Toto is an American rock band ...</information>\\n\\n

(:func:`render_observation`: by default byte for byte what Search-R1's
``search_r1/llm_agent/generation.py`` shows the model, see :data:`OBSERVATION_FORMATS`) and
lets the model continue, or ends the episode on an answer. A turn with neither action gets
:data:`INVALID_ACTION_MESSAGE` appended instead (also an ``<information>`` block, so it is
masked and stripped like any observation).

Action rule (:func:`parse_action`): the action of a turn is the *first complete*
``<search>...</search>`` or ``<answer>...</answer>`` pair in the text the model generated in
that turn (opening and closing tag must match; tags are lower-case; content is stripped).
Anything after that pair is ignored, which is what the stop strings produce anyway;
:func:`truncate_at_action` cuts a turn's text there for engines that overshoot a stop string.
A ``<search>`` with an empty query is not a valid action (kind ``None``); an empty
``<answer></answer>`` is a valid (and wrong) answer. This is Search-R1's rule
(``re.search(r"<(search|answer)>(.*?)</\\1>", text, re.DOTALL)``) except for the empty query.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

from .corpus import Passage

__all__ = [
    "STOP_STRINGS",
    "DEFAULT_INSTRUCTION",
    "INVALID_ACTION_MESSAGE",
    "parse_action",
    "truncate_at_action",
    "OBSERVATION_FORMATS",
    "render_observation",
    "render_search_error",
    "build_prompt",
]

#: Strings at which generation stops so the environment can act on the turn.
STOP_STRINGS = ["</search>", "</answer>"]

#: The instruction that wraps a question (``{question}`` and ``{max_searches}`` are filled by
#: :func:`build_prompt`). Written for tether; same protocol as Search-R1's prompt.
DEFAULT_INSTRUCTION = (
    "Answer the question below. Each time you start or receive new information, first reason "
    "about it inside <think> and </think>. If you are missing knowledge, query a search engine "
    "by writing <search> your query </search>; the top results will be returned to you between "
    "<information> and </information>. You may search as often as you need, up to {max_searches} "
    "times. Once you know enough, give the final answer inside <answer> and </answer>, with no "
    "explanation, for example <answer> Beijing </answer>.\nQuestion: {question}\n"
)

#: Appended (as an observation) to a turn that contains neither a complete search nor answer.
INVALID_ACTION_MESSAGE = (
    "\n\n<information>Invalid action: no complete search or answer tag was found. To search, "
    "write the query as <search> query </search>; to finish, write the final answer as "
    "<answer> answer </answer>.</information>\n\n"
)

_ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def parse_action(text: str) -> tuple[Optional[str], str]:
    """The action of one generated turn: ``("search", query)``, ``("answer", answer)`` or
    ``(None, "")`` (see the module docstring for the rule)."""
    m = _ACTION_RE.search(text or "")
    if m is None:
        return None, ""
    kind, content = m.group(1), m.group(2).strip()
    if kind == "search" and not content:
        return None, ""
    return kind, content


def truncate_at_action(text: str) -> str:
    """``text`` up to and including the closing tag of its first complete action (unchanged
    when it has none)."""
    m = _ACTION_RE.search(text or "")
    return text if m is None else text[: m.end()]


def _one_line(s: str) -> str:
    return " ".join(s.split())


#: The layouts :func:`render_observation` can produce (the first is the default).
#:
#: ``"search_r1"``: exactly Search-R1's observation. Each passage's raw corpus ``contents`` is split at
#: its first newline into the title line (kept as stored, quotes included) and the rest (kept as
#: stored, newlines included), rendered ``Doc {i}(Title: {title}) {text}\\n``; the concatenation is
#: stripped of surrounding whitespace and wrapped in ``\\n\\n<information>...</information>\\n\\n``.
#: No passages gives ``<information></information>``.
#:
#: ``"clean"``: tether's earlier layout. The title has its quotes stripped, whitespace inside a title
#: or text (newlines included) is collapsed so each passage is one line, and no passages gives
#: ``<information>No results found.</information>``.
OBSERVATION_FORMATS = ("search_r1", "clean")


def _raw_contents(p: Passage) -> str:
    """The passage as a Search-R1 corpus ``contents`` string (``"Title"\\ntext`` when it has none)."""
    return p.contents or f'"{p.title}"\n{p.text}'


def render_observation(passages: Iterable[Passage], format: str = "search_r1") -> str:
    """The observation appended after a search, in one of :data:`OBSERVATION_FORMATS`.

    ``"search_r1"`` (default), for passages with contents ``'"T"\\ntext'`` and ``'"T2"\\ntext2'``:
    ``'\\n\\n<information>Doc 1(Title: "T") text\\nDoc 2(Title: "T2") text2</information>\\n\\n'``;
    ``"clean"``: ``'\\n\\n<information>Doc 1(Title: T) text\\nDoc 2(Title: T2) text2</information>\\n\\n'``.

    Raises:
        ValueError: an unknown ``format``.
    """
    if format == "search_r1":
        body = ""
        for i, p in enumerate(passages, start=1):
            title, _, text = _raw_contents(p).partition("\n")
            body += f"Doc {i}(Title: {title}) {text}\n"
        return f"\n\n<information>{body.strip()}</information>\n\n"
    if format == "clean":
        lines = [f"Doc {i}(Title: {_one_line(p.title)}) {_one_line(p.text)}" for i, p in enumerate(passages, start=1)]
        body = "\n".join(lines) if lines else "No results found."
        return f"\n\n<information>{body}</information>\n\n"
    raise ValueError(f"unknown observation format {format!r} (known: {', '.join(OBSERVATION_FORMATS)})")


def render_search_error(reason: str = "") -> str:
    """The observation for a search that failed (retrieval server down, timeout): tells the
    model the search did not run, so it can retry or answer."""
    detail = f" ({_one_line(reason)})" if reason else ""
    return f"\n\n<information>The search failed{detail}; no results.</information>\n\n"


def build_prompt(question: str, max_searches: int = 4, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The user prompt for ``question``: ``instruction`` with ``{question}`` and
    ``{max_searches}`` filled in."""
    return instruction.replace("{max_searches}", str(int(max_searches))).replace("{question}", question.strip())
