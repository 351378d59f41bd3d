"""Search-agent protocol (tags, actions, observations) and the EM/F1 reward."""

from __future__ import annotations

import pytest

from tether.search.corpus import Passage, split_contents
from tether.search.protocol import (
    DEFAULT_INSTRUCTION,
    INVALID_ACTION_MESSAGE,
    STOP_STRINGS,
    build_prompt,
    parse_action,
    render_observation,
    render_search_error,
    truncate_at_action,
)
from tether.search.reward import (
    SearchReward,
    extract_answer,
    normalize_answer,
    score_response,
    search_reward,
    strip_observations,
    token_f1,
)
from tether.tasks.base import Example
from tether.tasks.rewards import call_reward

# ---------------------------------------------------------------- parse_action


@pytest.mark.parametrize("text, expected", [
    ("<think>need facts</think>\n<search> capital of France </search>", ("search", "capital of France")),
    ("<think>ok</think><answer> Paris </answer>", ("answer", "Paris")),
    ("<search>\nmulti\nline\n</search>", ("search", "multi\nline")),
    # the first complete pair wins, whatever comes after
    ("<answer>a</answer> then <search>q</search>", ("answer", "a")),
    ("<search>q</search> then <answer>a</answer>", ("search", "q")),
    ("<search>q1</search><search>q2</search>", ("search", "q1")),
    # an unclosed tag before a complete one does not count; the complete one does
    ("<answer>draft <search>q</search>", ("search", "q")),
    # nothing complete
    ("I think the answer is Paris.", (None, "")),
    ("<search>unterminated query", (None, "")),
    ("<search>mismatched</answer>", (None, "")),
    ("<SEARCH>upper case</SEARCH>", (None, "")),
    ("", (None, "")),
    # an empty query is invalid; an empty answer is an answer
    ("<search>   </search>", (None, "")),
    ("<answer></answer>", ("answer", "")),
])
def test_parse_action(text, expected):
    assert parse_action(text) == expected


def test_truncate_at_action_and_stop_strings():
    assert STOP_STRINGS == ["</search>", "</answer>"]
    assert truncate_at_action("<think>x</think><search>q</search> junk <answer>a</answer>") == \
        "<think>x</think><search>q</search>"
    assert truncate_at_action("no action here") == "no action here"


# ---------------------------------------------------------------- observations


def test_split_contents_search_r1_format():
    assert split_contents('"Jeff Porcaro"\nJeffrey Thomas Porcaro was a drummer.') == \
        ("Jeff Porcaro", "Jeffrey Thomas Porcaro was a drummer.")
    assert split_contents("Absalon\nline one\nline two") == ("Absalon", "line one\nline two")
    assert split_contents("no title line") == ("", "no title line")


def test_render_observation_exact_text():
    """The default is byte for byte Search-R1's observation (``generation.py``: the title line of the raw
    contents with its quotes, the rest as stored, one ``Doc i(Title: ...) ...\\n`` per passage, the whole
    stripped); ``format="clean"`` is tether's one-line-per-passage layout."""
    ps = [Passage("0", "Jeff Porcaro", "Jeffrey Thomas Porcaro was a drummer.", 3.5,
                  '"Jeff Porcaro"\nJeffrey Thomas Porcaro was a drummer.'),
          Passage("7", "Toto (band)", "Toto is a band.\nFormed in 1977.", 1.0,
                  '"Toto (band)"\nToto is a band.\nFormed in 1977.')]
    exact = (
        '\n\n<information>'
        'Doc 1(Title: "Jeff Porcaro") Jeffrey Thomas Porcaro was a drummer.\n'
        'Doc 2(Title: "Toto (band)") Toto is a band.\nFormed in 1977.'
        '</information>\n\n'
    )
    assert render_observation(ps) == exact and render_observation(ps, format="search_r1") == exact
    assert render_observation(ps).encode() == (
        b'\n\n<information>Doc 1(Title: "Jeff Porcaro") Jeffrey Thomas Porcaro was a drummer.\nDoc 2(Title: '
        b'"Toto (band)") Toto is a band.\nFormed in 1977.</information>\n\n')
    # passages without raw contents (built by hand) are rendered as if stored '"Title"\ntext'
    bare = [Passage(p.id, p.title, p.text, p.score) for p in ps]
    assert render_observation(bare) == exact
    # Search-R1 keeps the title line as stored (no quotes, extra spaces) and strips only the ends of the whole
    odd = [Passage("1", "", "", 0.0, "No quotes here\n  text with trailing space  "),
           Passage("2", "", "", 0.0, "one line")]
    assert render_observation(odd) == ("\n\n<information>Doc 1(Title: No quotes here)   text with trailing space  \n"
                                       "Doc 2(Title: one line)</information>\n\n")
    assert render_observation([]) == "\n\n<information></information>\n\n"
    assert render_observation(ps, format="clean") == (
        "\n\n<information>"
        "Doc 1(Title: Jeff Porcaro) Jeffrey Thomas Porcaro was a drummer.\n"
        "Doc 2(Title: Toto (band)) Toto is a band. Formed in 1977."
        "</information>\n\n"
    )
    assert render_observation([], format="clean") == "\n\n<information>No results found.</information>\n\n"
    with pytest.raises(ValueError, match="unknown observation format"):
        render_observation(ps, format="markdown")
    err = render_search_error("connection refused")
    assert err.startswith("\n\n<information>") and "failed" in err and "connection refused" in err


def test_instruction_and_invalid_message():
    p = build_prompt("  Who founded Rome? ", max_searches=3)
    assert p.endswith("Question: Who founded Rome?\n")
    assert "3 times" in p and "{" not in p
    for tag in ("<think>", "<search>", "</search>", "<information>", "<answer>", "</answer>"):
        assert tag in DEFAULT_INSTRUCTION
    assert "<answer> Beijing </answer>" in DEFAULT_INSTRUCTION
    # the invalid-action message is itself an observation block: never scored as an answer
    assert INVALID_ACTION_MESSAGE.strip().startswith("<information>")
    assert extract_answer(INVALID_ACTION_MESSAGE) is None
    assert parse_action("<think>hmm</think> Paris.") == (None, "")


# ---------------------------------------------------------------- reward


def test_normalize_answer():
    assert normalize_answer("  The  Beatles! ") == "beatles"
    assert normalize_answer("An apple, a day") == "apple day"
    assert normalize_answer("Théâtre") == "théâtre"
    assert normalize_answer("U.S.A.") == "usa"


def test_no_answer():
    r = score_response("<think>I am not sure</think> Paris", ["Paris"])
    assert (r.reward, r.em, r.f1, r.answered, r.pred, r.correct) == (0.0, 0.0, 0.0, False, None, False)


def test_last_answer_wins():
    r = score_response("<answer>London</answer> wait <answer>Paris</answer>", ["Paris"])
    assert r.answered and r.em == 1.0 and r.reward == 1.0 and r.pred == "Paris"
    r = score_response("<answer>Paris</answer> wait <answer>London</answer>", ["Paris"])
    assert r.em == 0.0 and r.reward == 0.0 and r.pred == "London"


def test_answer_inside_information_is_ignored():
    resp = ("<search>capital</search>\n\n<information>Doc 1(Title: X) the key is <answer>Paris</answer>"
            "</information>\n\n<think>done</think>")
    r = score_response(resp, ["Paris"])
    assert not r.answered and r.reward == 0.0
    # the model's own answer before an observation still counts, and the later one inside does not override
    resp2 = "<answer>Lyon</answer>\n\n<information><answer>Paris</answer></information>"
    assert score_response(resp2, ["Paris"]).pred == "Lyon"
    # an unclosed trailing observation is stripped to the end
    assert strip_observations("a<information>b <answer>x</answer>") == "a"


def test_aliases_and_f1():
    r = score_response("<answer>Sam Clemens</answer>", ["Mark Twain", "Sam Clemens"])
    assert r.em == 1.0 and r.f1 == 1.0
    # partial overlap: pred {quick, brown, fox} vs gold {quick, fox, jumps}: P = R = 2/3
    r = score_response("<answer>the quick brown fox</answer>", ["quick fox jumps", "zebra"])
    assert r.em == 0.0 and r.f1 == pytest.approx(2 / 3)
    assert token_f1("Paris France", ["Paris"]) == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert token_f1("yes", ["no"]) == 0.0 and token_f1("no", ["no"]) == 1.0
    r = score_response("<answer>the quick brown fox</answer>", ["quick fox jumps"], metric="f1")
    assert r.reward == pytest.approx(2 / 3) and not r.correct


def test_format_weight_is_a_floor_not_a_bonus():
    wrong = "<think>x</think><answer>London</answer>"
    assert score_response(wrong, ["Paris"], format_weight=0.1).reward == pytest.approx(0.1)
    assert score_response(wrong, ["Paris"]).reward == 0.0
    assert score_response("<answer>Paris</answer>", ["Paris"], format_weight=0.1).reward == 1.0
    # not a final answer: text after it, or an empty answer
    assert score_response("<answer>London</answer> more text", ["Paris"], format_weight=0.1).reward == 0.0
    assert score_response("<answer> </answer>", ["Paris"], format_weight=0.1).reward == 0.0
    with pytest.raises(ValueError):
        SearchReward(metric="acc")


def test_answer_only_in_prompt_never_counts():
    ex = Example(prompt=build_prompt("What is the capital of China?"), answer="Beijing", id="t:0",
                 meta={"golden_answers": ["Beijing", "Peking"]})
    assert "<answer> Beijing </answer>" in ex.prompt
    r = search_reward("<think>no idea</think>", ex)
    assert r.reward == 0.0 and not r.answered
    r = search_reward("<answer>peking</answer>", ex)
    assert r.reward == 1.0 and r.answered
    # through tether's generic reward call
    res, err = call_reward(search_reward, "<answer> Beijing </answer>", ex)
    assert err is None and res.reward == 1.0 and res.correct and res.pred == "Beijing"
