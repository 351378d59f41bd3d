"""Tests for tether.tasks: answer extraction/equivalence, rewards, the arithmetic task, data loading."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from pathlib import Path

import pytest

from helpers import SEARCH_ENV
from tether.tasks import (
    LEVELS,
    NAMED_DATASETS,
    ArithmeticTask,
    DataError,
    Example,
    RewardResult,
    call_reward,
    default_reward_name,
    extract_answer,
    gsm8k_reference,
    has_answer_format,
    is_equivalent,
    load_examples,
    load_reward,
)
from tether.tasks.arithmetic import content_split

# --------------------------------------------------------------------------------------
# shared data dir
# --------------------------------------------------------------------------------------


def _data_dir() -> Path | None:
    env = os.environ.get("TETHER_DATA_DIR")
    cands = [Path(env)] if env else []
    # tests/ -> repo root -> its parent holds shared/
    cands.append(Path(__file__).resolve().parents[2] / "shared" / "data" / "math")
    for c in cands:
        if c.is_dir():
            return c
    return None


DATA_DIR = _data_dir()
needs_data = pytest.mark.skipif(DATA_DIR is None, reason="shared math data directory not found")


def ex(answer: str, **meta) -> Example:
    return Example(prompt="q", answer=answer, id="t:0", meta=meta)


# --------------------------------------------------------------------------------------
# extraction
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"First \boxed{3}, finally \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"So \boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"\boxed{{a}+{b}^{2}}", r"{a}+{b}^{2}"),
        (r"\boxed{5} and then \boxed{7", "5"),  # truncated last box is skipped
        (r"\boxed{1,234}", "1234"),
        ("She makes 9 * 2 = $18 every day.\n#### 18", "18"),
        ("#### $1,234.", "1234"),
        ("#### = 3", "3"),
        ("#### 72 clips", "72"),
        ("The answer is 12 apples.", "12"),
        ("Answer: -5", "-5"),
        ("**Final Answer:** 42", "42"),
        ("The answer is $\\frac{3}{4}$.", "\\frac{3}{4}"),
        ("The answer is 3/4.", "3/4"),
        ("the answer is\n\n17", "17"),
        ("He had 10, gave 3. The answer is not obvious at first.\nAfter checking: 7", "7"),
        ("I think 1,234,567 is it.", "1234567"),
        ("x = -5 now", "-5"),
        ("So 3-5 gives", "5"),  # binary minus is not a sign
        ("It costs $5.50.", "5.5"),
        ("The result is 12.0", "12"),
        ("\u22127 degrees", "-7"),
        ("no numbers here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_odd_input():
    assert extract_answer(None) is None  # type: ignore[arg-type]
    assert extract_answer("\\boxed{") is None


def test_gsm8k_reference():
    assert gsm8k_reference("He has 3 + 4 = <<3+4=7>>7\n#### 7") == "7"
    assert gsm8k_reference("blah\n#### 1,234") == "1234"
    assert gsm8k_reference("18") == "18"


def test_has_answer_format():
    assert has_answer_format(r"so \boxed{4}")
    assert has_answer_format("work\n#### 4")
    assert has_answer_format("work\nAnswer: 4")
    assert has_answer_format("**Final answer:** 4")
    assert not has_answer_format("the answer is 4")
    assert not has_answer_format("####\n")
    assert not has_answer_format(r"\boxed{4")
    # exactly one final answer, and '####' is followed by a number: what the gamed runs produced is not the format
    assert has_answer_format("#### 35.") and has_answer_format("#### $1,234.50") and has_answer_format("#### -3")
    assert not has_answer_format("#### Emma has 35 books.\n#### No need to add the books again.\n########")
    assert not has_answer_format("#### Emma has 35 books.")
    assert not has_answer_format("########")
    assert not has_answer_format("work\n#### 4\n#### 4")
    assert not has_answer_format(r"\boxed{1} or \boxed{2}")
    assert not has_answer_format("#### 12\nAnswer: 12")


# --------------------------------------------------------------------------------------
# equivalence
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("0.5", r"\frac{1}{2}"),
        ("1/2", "0.5"),
        ("142", "142.0"),
        ("25", "025"),
        ("1234", "1,234"),
        ("(3, \\pi/2)", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"\left(3,\frac{\pi}{2}\right)", r"\left( 3, \frac{\pi}{2} \right)"),
        ("p-q", "p - q"),
        ("Evelyn", r"\text{Evelyn}"),
        ("90", r"90^\circ"),
        ("8.7e8", r"8.7 \times 10^{8}"),
        ("x^2+1", "1+x^2"),
        (r"\dfrac{14}{3}", r"\frac{14}{3}"),
        ("(1,8,19), (2,7,13), (4,5,7)", "$(1,8,19), (2,7,13), (4,5,7)$"),
    ],
)
def test_is_equivalent_true(pred, ref):
    assert is_equivalent(pred, ref)


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("3", r"\frac{1}{2}"),
        ("7", "8"),
        ("(3, \\pi)", r"\left( 3, \frac{\pi}{2} \right)"),
        ("1,2", "12"),
        ("0.5001", "0.5"),
        ("", "1"),
        (None, "1"),
        ("1", ""),
        ("x+1", "x+2"),
    ],
)
def test_is_equivalent_false(pred, ref):
    assert not is_equivalent(pred, ref)


def test_is_equivalent_never_raises_on_garbage():
    for junk in ["\\frac{", "}}}{{{", "\\boxed{\\boxed{", "$$$", "\\sqrt[", "1/0", "a" * 5000, "\x00"]:
        assert is_equivalent(junk, "1") in (True, False)
        assert is_equivalent("1", junk) in (True, False)


def test_is_equivalent_in_worker_thread():
    """math-verify's signal timeout only works on the main thread; off it we disable it."""
    results = []
    errors = []

    def work():
        try:
            results.append(is_equivalent("0.5", r"\frac{1}{2}"))
            results.append(is_equivalent(r"(3,\pi/2)", r"\left( 3, \frac{\pi}{2} \right)"))
            results.append(is_equivalent("3", r"\frac{1}{2}"))
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=60)
    assert not errors
    assert results == [True, True, False]


# --------------------------------------------------------------------------------------
# rewards
# --------------------------------------------------------------------------------------


def test_builtin_rewards():
    math_r = load_reward("math")
    r = math_r(r"... so \boxed{\frac{1}{2}}", ex("0.5"))
    assert isinstance(r, RewardResult) and r.correct and r.reward == 1.0 and r.pred == r"\frac{1}{2}"
    assert not math_r(r"\boxed{3}", ex("0.5")).correct
    # alternatives in meta["answers"] are accepted
    assert math_r(r"\boxed{6630}", ex("6630.65", answers=["6630.65", "6630"])).correct

    arith = load_reward("arithmetic")
    assert arith("5 + 7 = 12\n#### 12", ex("12")).correct
    assert arith("#### 12.0", ex("12")).correct
    assert not arith("#### 12.5", ex("12")).correct
    assert not arith("no idea", ex("12")).correct
    assert arith("#### 1,234", ex("1234")).correct
    # an expression after the answer marker is reduced to its last number
    res = arith("The final answer is 8 + 4 = 12 pencils.", ex("12"))
    assert res.correct and res.pred == "12"
    assert load_reward("gsm8k")("The answer is 3 * 6 = $18.", ex("18")).correct


def test_format_weight():
    r = load_reward("arithmetic", format_weight=0.1)
    res = r("#### 12", ex("12"))
    assert res.correct and res.reward == pytest.approx(1.1)
    res = r("It is 12.", ex("12"))
    assert res.correct and res.reward == pytest.approx(1.0)
    res = r("#### 13", ex("12"))
    assert not res.correct and res.reward == pytest.approx(0.1)
    assert load_reward("math", format_weight=0.0) is load_reward("math")


@needs_data
def test_gsm8k_reward_on_real_rows():
    rows = load_examples("gsm8k", split="test", data_dir=DATA_DIR, limit=20)
    reward = load_reward(default_reward_name("gsm8k"))
    assert default_reward_name("gsm8k") == "gsm8k"
    for e in rows:
        assert reward(e.meta["solution"], e).correct  # the worked solution ends in "#### N"
        assert reward(f"The answer is {e.answer}.", e).correct
        wrong = str(int(float(e.answer)) + 1)
        assert not reward(f"#### {wrong}", e).correct
    # a reference still carrying the raw "#### N" text also works
    e = Example("q", "Blah <<1+1=2>>2\n#### 2", "x:0", {})
    assert reward("so 2", e).correct


def test_unknown_reward_lists_choices():
    with pytest.raises(ValueError) as ei:
        load_reward("nonsense")
    msg = str(ei.value)
    for name in ("math", "gsm8k", "arithmetic", "module:function"):
        assert name in msg


def test_user_reward_from_file_and_module(tmp_path, monkeypatch):
    f = tmp_path / "my_rewards.py"
    f.write_text(
        "from tether.tasks import RewardResult\n"
        "def length_reward(completion, example):\n"
        "    return RewardResult(reward=len(completion) / 10, correct=len(completion) > 3, pred=None)\n"
        "def is_yes(completion, example):\n"
        "    return completion.strip() == 'yes'\n"
        "NOT_CALLABLE = 3\n"
    )
    fn = load_reward(f"{f}:length_reward")
    res, err = call_reward(fn, "abcdef", ex("1"))
    assert err is None and res.reward == pytest.approx(0.6) and res.correct

    monkeypatch.syspath_prepend(str(tmp_path))
    fn2 = load_reward("my_rewards:is_yes")
    res, err = call_reward(fn2, "yes", ex("1"))
    assert err is None and res.reward == 1.0 and res.correct
    res, err = call_reward(fn2, "no", ex("1"))
    assert err is None and res.reward == 0.0 and not res.correct

    with pytest.raises(ValueError, match="no attribute"):
        load_reward(f"{f}:missing")
    with pytest.raises(ValueError, match="not callable"):
        load_reward("my_rewards:NOT_CALLABLE")
    with pytest.raises(ValueError, match="cannot import"):
        load_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="not found"):
        load_reward(f"{tmp_path / 'nope.py'}:fn")


def test_call_reward_catches_errors():
    def boom(completion, example):
        raise RuntimeError("kaboom")

    res, err = call_reward(boom, "x", ex("1"))
    assert res.reward == 0.0 and res.correct is False
    assert err is not None and "Traceback" in err and "kaboom" in err and "RuntimeError" in err

    res, err = call_reward(lambda c, e: float("nan"), "x", ex("1"))
    assert res.reward == 0.0 and not res.correct and err and "non-finite" in err
    res, err = call_reward(lambda c, e: RewardResult(float("inf"), True, "1"), "x", ex("1"))
    assert res.reward == 0.0 and not res.correct and err
    res, err = call_reward(lambda c, e: "oops", "x", ex("1"))
    assert res.reward == 0.0 and err and "expected RewardResult" in err


def test_call_reward_normalizes():
    res, err = call_reward(lambda c, e: True, "x", ex("1"))
    assert err is None and res == RewardResult(1.0, True, None)
    res, err = call_reward(lambda c, e: 0.25, "x", ex("1"))
    assert err is None and res.reward == 0.25 and res.correct
    res, err = call_reward(lambda c, e: 0, "x", ex("1"))
    assert err is None and res.reward == 0.0 and not res.correct
    torch = pytest.importorskip("torch")
    res, err = call_reward(lambda c, e: torch.tensor(0.5), "x", ex("1"))
    assert err is None and res.reward == 0.5


def test_reward_spec_errors_are_reward_errors_naming_spec_and_cause(tmp_path, monkeypatch):
    """Before: a syntax error or an exception in a reward file escaped load_reward as itself (a traceback)."""
    from tether.errors import RewardError

    (tmp_path / "syntax.py").write_text("def fn(c, e):\n    return 1 +\n")
    (tmp_path / "raises.py").write_text("x = 1\nraise RuntimeError('no verifier here')\ndef fn(c, e): return 1\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "mod_raises.py").write_text("raise KeyError('missing setting')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [
        (f"{tmp_path / 'syntax.py'}:fn", r"syntax\.py:fn'.*syntax\.py, line 2: SyntaxError"),
        (f"{tmp_path / 'raises.py'}:fn",
         r"raises\.py:fn'.*raised RuntimeError: no verifier here \(at .*raises\.py:2\)"),
        (f"{tmp_path / 'exits.py'}:fn", r"exits\.py:fn'.*raised SystemExit: 3"),
        ("mod_raises:fn", r"'mod_raises:fn'.*module 'mod_raises' raised KeyError: 'missing setting'"),
        ("nosuch", r"unknown reward 'nosuch'"),
        ("no_such_module_xyz:fn", r"'no_such_module_xyz:fn'.*No module named"),
        (f"{tmp_path / 'raises.py'}:", r"bad reward spec"),
    ]
    for spec, pattern in cases:
        with pytest.raises(RewardError, match=pattern):
            load_reward(spec)
    assert issubclass(RewardError, ValueError)  # callers that caught ValueError still do


def test_score_one_failure_kinds_name_the_example():
    from tether.tasks.rewards import RewardFailure, load_reward, score_one

    class BadBool:
        def __bool__(self):
            raise RuntimeError("no truth here")

    e = Example("q", "1", "set:7")
    values = {"None": None, "str": "1.0", "nan": float("nan"), "inf": float("-inf"), "tuple": (1.0, True),
              "dict": {"reward": 1.0}, "huge int": 10 ** 400, "bad correct": RewardResult(1.0, BadBool()),
              "long str": "x" * 10_000}
    for name, v in values.items():
        res, failure = score_one(lambda c, ex, v=v: v, "x", e)
        assert res == RewardResult(0.0, False, None), name
        assert isinstance(failure, RewardFailure) and failure.kind == "invalid" and failure.example_id == "set:7", name
        assert "invalid value on example set:7" in str(failure) and len(failure.detail) < 400, (name, failure)
    assert "(None)" in score_one(lambda c, ex: None, "x", e)[1].detail
    res, failure = score_one(lambda c, ex: 1 / 0, "x", e)
    assert failure.kind == "raised" and "ZeroDivisionError" in failure.detail
    # a format bonus does not hide a bad value as a raise (every user reward gets one by default)
    res, failure = score_one(load_reward(lambda c, ex: None, format_weight=0.2), "\\boxed{1}", e)
    assert failure.kind == "invalid"
    res, failure = score_one(load_reward(lambda c, ex: 0.5, format_weight=0.2), "\\boxed{1}", e)
    assert failure is None and res.reward == pytest.approx(0.7)


def test_prompt_encoder_fits_prompts_in_the_context(capsys):
    from types import SimpleNamespace

    from tether.errors import GenerationError
    from tether.tasks.prompts import PromptEncoder, encode_prompts, model_context
    from tether.testing import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    short, long_ = Example("Say 1", "1", "d:0"), Example("word " * 200, "2", "d:1")
    full = encode_prompts(tok, [short, long_])
    assert len(full[1]) > 100 > len(full[0])
    enc = PromptEncoder(tok, context=108, overflow="error")
    assert enc.limit(8) == 100 and enc.encode([short], 8) == full[:1]
    with pytest.raises(GenerationError, match=rf"example d:1: the prompt has {len(full[1])} tokens, more than the "
                                              r"100 that fit in the model's context \(108 tokens, less 8 for"):
        enc.encode([short, long_], 8)
    with pytest.raises(GenerationError, match="example d:1"):
        enc.check([short, long_], 8)  # the early check of a dataset finds it too
    enc.check([short], 8)
    with pytest.raises(GenerationError, match="no room for a prompt"):
        enc.limit(108)
    cut = PromptEncoder(tok, context=108, overflow="truncate")
    assert cut.encode([short, long_, long_], 8) == [full[0], full[1][-100:], full[1][-100:]]
    warned = [ln for ln in capsys.readouterr().err.splitlines() if "warning: example d:1" in ln]
    assert len(warned) == 1 and "keeping its last 100 tokens" in warned[0] and cut.truncated == 2
    assert PromptEncoder(tok, context=None).encode([long_], 8) == full[1:]  # unknown context: no check

    assert model_context(SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192)), tok) == 8192
    assert model_context(None, SimpleNamespace(model_max_length=2048)) == 2048
    assert model_context(None, SimpleNamespace(model_max_length=int(1e30))) is None  # transformers' "unknown"


# --------------------------------------------------------------------------------------
# arithmetic task
# --------------------------------------------------------------------------------------


def _recompute(start, ops):
    v = start
    for op, n in ops:
        v = {"+": v + n, "-": v - n, "*": v * n}.get(op, None) if op != "/" else (v // n if v % n == 0 else None)
        assert v is not None and v >= 0
    return v


@pytest.mark.parametrize("difficulty", sorted(LEVELS))
def test_arithmetic_answers_and_determinism(difficulty):
    task = ArithmeticTask(seed=3, difficulty=difficulty)
    exs = task.examples(40)
    again = ArithmeticTask(seed=3, difficulty=difficulty).examples(40)
    assert [(e.prompt, e.answer, e.id) for e in exs] == [(e.prompt, e.answer, e.id) for e in again]
    assert task.example(17).prompt == exs[17].prompt
    assert task.examples(5, start=10)[0].prompt == exs[10].prompt
    for e in exs:
        ops = e.meta["ops"]
        assert len(ops) == LEVELS[difficulty].steps
        assert int(e.answer) == _recompute(e.meta["start"], ops)
        assert str(e.meta["start"]) in e.prompt
        for _, n in ops:
            assert str(n) in e.prompt
        assert e.prompt.rstrip().endswith(task.instruction)
        assert e.prompt.count("?") == 1
    # another seed gives another stream
    other = ArithmeticTask(seed=4, difficulty=difficulty).examples(40)
    assert [e.prompt for e in other] != [e.prompt for e in exs]
    assert len({e.id for e in exs}) == len(exs)


def test_arithmetic_reward_on_task():
    task = ArithmeticTask(seed=0, difficulty=2)
    e = task.example(0)
    reward = load_reward(default_reward_name("arithmetic"))
    assert reward(f"Let me think.\n#### {e.answer}", e).correct
    assert not reward(f"#### {int(e.answer) + 1}", e).correct


def test_arithmetic_train_test_disjoint():
    for d in sorted(LEVELS):
        train = ArithmeticTask(seed=0, difficulty=d, split="train").examples(300)
        test = ArithmeticTask(seed=0, difficulty=d, split="test").examples(100)
        key = lambda e: (e.meta["start"], tuple(map(tuple, e.meta["ops"])))  # noqa: E731
        assert not ({key(e) for e in train} & {key(e) for e in test})
        assert not ({e.prompt for e in train} & {e.prompt for e in test})
        assert all(content_split(e.meta["start"], e.meta["ops"]) == "test" for e in test)
        # also disjoint from other training seeds
        train2 = ArithmeticTask(seed=1, difficulty=d).examples(300)
        assert not ({key(e) for e in train2} & {key(e) for e in test})
    assert ArithmeticTask(0, 1).with_split("test").split == "test"


def test_arithmetic_bad_args():
    with pytest.raises(ValueError):
        ArithmeticTask(0, difficulty=9)
    with pytest.raises(ValueError):
        ArithmeticTask(0, split="dev")
    with pytest.raises(ValueError):
        ArithmeticTask(0).example(-1)


# --------------------------------------------------------------------------------------
# data loading
# --------------------------------------------------------------------------------------


@needs_data
@pytest.mark.parametrize(
    "name, split", [(n, s) for n, d in NAMED_DATASETS.items() for s in d.splits]
)
def test_named_datasets_load(name, split):
    rows = load_examples(name, split=split, data_dir=DATA_DIR)
    assert len(rows) > 0
    assert all(isinstance(e.prompt, str) and e.prompt.strip() for e in rows)
    assert all(isinstance(e.answer, str) and e.answer.strip() for e in rows)
    assert len({e.id for e in rows}) == len(rows)
    assert rows[0].id == f"{name}_{split}:0"
    want_reward = "gsm8k" if name == "gsm8k" else "math"
    assert default_reward_name(name) == want_reward
    # the reference itself, boxed, is judged correct by the dataset's reward
    reward = load_reward(want_reward)
    for e in rows[:10]:
        assert reward(rf"so \boxed{{{e.answer}}}", e).correct, (e.id, e.answer)


@needs_data
def test_named_dataset_details(monkeypatch):
    gsm = load_examples("gsm8k", split="test", data_dir=DATA_DIR, limit=3)
    assert len(gsm) == 3 and gsm[0].answer == "18" and "####" in gsm[0].meta["solution"]
    assert len(load_examples("gsm8k", split="test", data_dir=DATA_DIR)) == 1319
    amc = load_examples("amc", data_dir=DATA_DIR, limit=1)
    assert amc[0].answer == "142"  # 142.0 in the file
    minerva = load_examples("minerva", data_dir=DATA_DIR)
    assert any(len(e.meta.get("answers", [])) > 1 for e in minerva)
    olymp = load_examples("olympiadbench", data_dir=DATA_DIR)
    assert not any(e.answer.startswith("$") and e.answer.endswith("$") and e.answer.count("$") == 2 for e in olymp)
    assert load_examples("math-500", data_dir=DATA_DIR, limit=2)[0].id == "math500_test:0"
    with pytest.raises(DataError, match="no split"):
        load_examples("math500", split="train", data_dir=DATA_DIR)
    # resolution through the environment variable
    monkeypatch.setenv("TETHER_DATA_DIR", str(DATA_DIR))
    assert len(load_examples("aime24")) == 30


def test_named_dataset_without_files_or_datasets(tmp_path, monkeypatch):
    """Without local files the hub is needed; without `datasets` that is a clear error.
    `datasets` is hidden (import fails) so this never touches the network."""
    monkeypatch.delenv("TETHER_DATA_DIR", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match="pip install datasets") as ei:
        load_examples("gsm8k", data_dir=tmp_path)
    assert "gsm8k_train.jsonl not found" in str(ei.value) and "openai/gsm8k" in str(ei.value)
    with pytest.raises(DataError, match="pip install datasets"):
        load_examples("someorg/some-dataset")


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_custom_jsonl_json_parquet(tmp_path):
    rows = [
        {"q": "What is 2+2?", "a": 4, "topic": "add"},
        {"q": "Half of one?", "a": 0.5, "topic": "frac"},
        {"q": "Name two.", "a": ["1", "one"], "topic": "list"},
    ]
    f = _write_jsonl(tmp_path / "mine.jsonl", rows)
    got = load_examples(str(f), prompt_key="q", answer_key="a")
    assert [e.answer for e in got] == ["4", "0.5", "1"]
    assert got[2].meta["answers"] == ["1", "one"]
    assert got[0].meta == {"topic": "add"} and got[0].id == "mine:0"
    assert len(load_examples(f, prompt_key="q", answer_key="a", limit=2)) == 2

    # default keys: prompt/question/problem and answer, else solution (boxed content)
    j = tmp_path / "d.json"
    j.write_text(json.dumps({"data": [
        {"problem": "P1", "answer": "\\frac{1}{2}"},
        {"question": "P2", "solution": "We get \\boxed{7}. Done"},
        {"prompt": "P3", "answer": "$x+1$"},
    ]}))
    got = load_examples(str(j))
    assert [(e.prompt, e.answer) for e in got] == [("P1", "\\frac{1}{2}"), ("P2", "7"), ("P3", "x+1")]
    assert "\\boxed{7}" in got[1].meta["solution"]
    j2 = tmp_path / "l.json"
    j2.write_text(json.dumps([{"question": "Q", "answer": "Work\n#### 1,000"}]))
    got = load_examples(str(j2))
    assert got[0].answer == "1000" and got[0].meta["solution"].endswith("1,000")

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"question": ["a?", "b?"], "answer": ["1", "2"], "extra": [1, 2]}), p)
    got = load_examples(str(p))
    assert [(e.prompt, e.answer, e.meta["extra"]) for e in got] == [("a?", "1", 1), ("b?", "2", 2)]
    assert default_reward_name(str(p)) == "math"
    assert default_reward_name("my_gsm8k_copy.jsonl") == "gsm8k"


@pytest.mark.parametrize(
    "rows, pattern",
    [
        ([{"question": "a", "answer": "1"}, {"question": "b", "answer": "2"}, {"question": "c", "foo": 1}],
         r"bad\.jsonl row 3: missing field 'answer' \(have: question, foo\)"),
        ([{"question": "a", "answer": "1"}, {"answer": "2"}],
         r"bad\.jsonl row 2: missing field 'prompt'.*tried prompt, question, problem"),
        ([{"question": 5, "answer": "1"}], r"bad\.jsonl row 1: field 'question' must be a string, got int"),
        ([{"question": "a", "answer": {"x": 1}}],
         r"bad\.jsonl row 1: field 'answer' must be a string, number or list, got dict"),
        ([{"question": "a", "answer": None}], r"row 1: field 'answer' must be a string, number or list, got NoneType"),
        ([{"question": "a", "answer": True}], r"row 1: field 'answer' must be a string, number or list, got bool"),
        ([{"question": "a", "answer": []}], r"row 1: field 'answer' is an empty list"),
        ([{"question": "  ", "answer": "1"}], r"row 1: field 'question' is empty"),
        ([{"question": "a", "answer": "1"}, "{not json"], r"bad\.jsonl line 2: invalid JSON"),
        ([[1, 2]], r"bad\.jsonl row 1: expected an object"),
    ],
)
def test_bad_rows_raise_data_error(tmp_path, rows, pattern):
    f = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=pattern):
        load_examples(str(f))


def test_bad_rows_line_numbers_and_other_errors(tmp_path):
    # blank lines are skipped but line numbers stay true to the file
    f = tmp_path / "gaps.jsonl"
    f.write_text('{"question": "a", "answer": "1"}\n\n{"question": "b"}\n')
    with pytest.raises(DataError, match=r"gaps\.jsonl row 3: missing field 'answer'"):
        load_examples(str(f))
    with pytest.raises(DataError, match="missing field 'ans'"):
        load_examples(str(tmp_path / "gaps.jsonl"), answer_key="ans", limit=1)
    j = tmp_path / "bad.json"
    j.write_text(json.dumps([{"problem": "a", "answer": "1"}, {"problem": "b", "answer": float("nan")}]))
    with pytest.raises(DataError, match=r"bad\.json row 2: field 'answer' is not a finite number"):
        load_examples(str(j))
    j.write_text('{"rows": []}')
    with pytest.raises(DataError, match="expected a JSON list"):
        load_examples(str(j))
    j.write_text("[1, 2")
    with pytest.raises(DataError, match="invalid JSON"):
        load_examples(str(j))
    e = tmp_path / "empty.jsonl"
    e.write_text("\n")
    with pytest.raises(DataError, match="empty"):
        load_examples(str(e))
    with pytest.raises(DataError, match="not found"):
        load_examples(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        load_examples(str(tmp_path / "x.csv"))
    with pytest.raises(DataError, match="unknown dataset") as e:
        load_examples("definitely-not-a-dataset")
    assert "Did you mean" not in str(e.value)
    with pytest.raises(DataError, match=re.escape("unknown dataset 'gsm9k'")) as e:  # a slip of one character
        load_examples("gsm9k")
    assert str(e.value).endswith("Did you mean 'gsm8k'?")
    assert issubclass(DataError, ValueError)


# ---------------------------------------------------------------- the task and reward registries


def test_the_task_is_looked_up_in_the_registry():
    """data.task picks a registered task (arithmetic), the search agent's task (its QA data), a user's
    module:function, or else the dataset task math; a hub id org/name:config is not a user spec."""
    from tether.algo.registry import is_spec
    from tether.resolve import load_config
    from tether.tasks.registry import TASKS, held_out_benchmark, task_name, task_presets

    assert task_name(load_config(None, {})) == "arithmetic"
    assert task_name(load_config(None, {"data.task": "gsm8k"})) == "math"
    assert task_name(load_config(None, {**SEARCH_ENV, "data.task": "multihop"})) == "search"
    assert held_out_benchmark(load_config(None, {"data.task": "gsm8k"})) == "gsm8k"
    assert held_out_benchmark(load_config(None, {**SEARCH_ENV, "data.task": "gsm8k"})) is None
    assert is_spec("my_ext:countdown") and is_spec("dir/my_ext.py:countdown")
    assert not is_spec("openai/gsm8k:main") and not is_spec("data.jsonl")
    assert list(task_presets()) == ["organism", "math", "search"] and TASKS.meta("search")["reward"] == "search"


def test_a_user_task_and_its_reward_by_spec(tmp_path, monkeypatch):
    from tether.resolve import load_config
    from tether.tasks.stream import prompt_stream

    (tmp_path / "user_task_mod.py").write_text(
        "from tether.tasks import Example\n"
        "def qa(data):\n    return [Example(prompt=f'q{i}', answer=str(i), id=f'u:{i}') for i in range(3)]\n"
        "qa.reward = 'gsm8k'\n"
        "def gen(data):\n    return lambda i: Example(prompt=f'g{i}', answer=str(i), id=f'g:{i}')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    s = prompt_stream(load_config(None, {"data.task": "user_task_mod:qa"}))
    assert s.reward_name == "gsm8k" and sorted(e.id for e in s.take(3)) == ["u:0", "u:1", "u:2"]
    s = prompt_stream(load_config(None, {"data.task": f"{tmp_path / 'user_task_mod.py'}:gen"}))
    assert s.reward_name == "math" and [e.id for e in s.take(2)] == ["g:0", "g:1"]
    with pytest.raises(DataError, match="has no attribute 'nope'"):
        prompt_stream(load_config(None, {"data.task": "user_task_mod:nope"}))


def test_a_task_is_given_the_sections_its_parameters_name(tmp_path, monkeypatch):
    """A task's builder gets the sections it names (data, seed, env; **kwargs: all), not the whole config; an earlier
    release's ``task(cfg)`` (a function whose parameters name none of them) still gets the config, with a
    FutureWarning naming the new form; beside a section, a parameter that names nothing is one DataError naming the
    function and what it may name."""
    import warnings

    from tether.resolve import load_config
    from tether.tasks.stream import prompt_stream

    (tmp_path / "sections_task_mod.py").write_text(
        "from tether.tasks import Example\n"
        "seen = {}\n"
        "def named(data, seed, env):\n"
        "    seen.update(limit=data.limit, seed=seed, env=env)\n"
        "    return [Example(prompt='q', answer='1', id='n:0')]\n"
        "def everything(data, **kw):\n"
        "    seen.update(kw)\n"
        "    return [Example(prompt='q', answer='1', id='e:0')]\n"
        "def old(cfg):\n"
        "    seen.update(old=cfg.train.seed)\n"
        "    return [Example(prompt='q', answer='1', id='o:0')]\n"
        "def odd(data, split_name):\n"
        "    return []\n"
        "def old_c(c):\n"
        "    return [Example(prompt='q', answer='1', id=f'c:{c.data.limit}')]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import sections_task_mod as mod

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new forms warn about nothing
        prompt_stream(load_config(None, {"data.task": "sections_task_mod:named", "data.limit": 7, "train.seed": 3}))
        assert mod.seen == {"limit": 7, "seed": 3, "env": None}  # a single-turn run has no environment section
        prompt_stream(load_config(None, {"data.task": "sections_task_mod:everything", "train.seed": 5}))
        assert mod.seen["seed"] == 5 and mod.seen["env"] is None and "data" not in mod.seen
    with pytest.warns(FutureWarning, match=r"task function old \(.*sections_task_mod.py:9\): a task given the whole "
                                           r"config is deprecated.*\(data, seed, env;"):
        s = prompt_stream(load_config(None, {"data.task": "sections_task_mod:old", "train.seed": 11}))
    assert mod.seen["old"] == 11 and s.examples[0].id == "o:0"
    with pytest.warns(FutureWarning, match="task function old_c"):  # the earlier form, whatever its parameter's name
        s = prompt_stream(load_config(None, {"data.task": "sections_task_mod:old_c", "data.limit": 2}))
    assert s.examples[0].id == "c:2"
    from tether.tasks.registry import call_task

    # a test set in either form: (cfg, limit) and (data, limit)
    cfg = load_config(None, {"data.task": "gsm8k", "data.limit": 4})
    with pytest.warns(FutureWarning, match=r"task function .*<lambda> \(.*test_tasks.py:\d+\): a task given the whole"):
        assert call_task(lambda c, limit: (c.data.limit, limit), cfg, limit=9) == (4, 9)
    assert call_task(lambda data, limit: (data.limit, limit), cfg, limit=9) == (4, 9)
    assert call_task(lambda limit: limit, cfg, limit=9) == 9
    with pytest.raises(DataError, match=r"task function odd \(.*sections_task_mod.py:12\): parameter 'split_name' "
                                        r"names nothing a task is given; it may name: data, seed, env"):
        prompt_stream(load_config(None, {"data.task": "sections_task_mod:odd"}))


def test_the_registries_name_the_config_choices():
    """check() lists a registry's names (with a did-you-mean) for an unknown choice, and takes user specs."""
    from tether.config import ConfigError
    from tether.resolve import load_config
    from tether.tasks.rewards import REWARDS

    assert list(REWARDS) == ["arithmetic", "gsm8k", "math", "search", "search_f1", "reasoning_gym", "none"]
    with pytest.raises(ConfigError, match=r"unknown data.reward 'gsm8'\. Did you mean 'gsm8k'"):
        load_config(None, {"data.reward": "gsm8"})
    with pytest.raises(ConfigError, match="unknown rollout.agent.kind 'multi_trun'. Did you mean 'multi_turn'"):
        load_config(None, {"rollout.agent": "multi_trun"})
    with pytest.raises(ConfigError, match="data.task 'x/no_such.py:f': task file x/no_such.py not found"):
        load_config(None, {"data.task": "x/no_such.py:f"})
    assert load_config(None, {"rollout.agent": "some_module:MyAgent"}).rollout.agent.kind == "some_module:MyAgent"
