"""The calculator environment: its safe arithmetic evaluator (adversarial input never runs code, hangs or
raises) and its episodes on the arithmetic task and GSM8K examples."""

from __future__ import annotations

import ast
from fractions import Fraction
from pathlib import Path

import pytest

from tether.envs import ENVS, calculator, make_env
from tether.envs.calculator import (
    FINAL_TURN,
    MAX_CHARS,
    NO_ACTION,
    CalcError,
    CalculatorEnv,
    calculate,
    evaluate,
    format_value,
    parse_action,
)
from tether.tasks import ArithmeticTask
from tether.tasks.base import Example


def test_the_evaluator_never_calls_eval_exec_or_compile():
    """Read from the module's source: ``ast.parse`` only builds a tree; nothing compiles or runs the text."""
    tree = ast.parse(Path(calculator.__file__).read_text())
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not called & {"eval", "exec", "compile", "__import__", "getattr"}, called


# ---------------------------------------------------------------- the evaluator: exact results

@pytest.mark.parametrize("expr, shown", [
    ("6*7", "42"), ("0.1+0.2", "0.3"), ("0.1 * 3", "0.3"), ("1/3", "0.3333333333"), ("2/3", "0.6666666667"),
    ("-(-2)", "2"), ("-5 + 2", "-3"), ("-0.5", "-0.5"), ("+4", "4"), ("2.50 * 2", "5"), ("7 / 2", "3.5"),
    ("(12 + 30) * 2 / 4", "21"), ("1.5 - 1.5", "0"), (".5 + 1.", "1.5"), ("100 / 8", "12.5"),
    ("48 / 2 * 3 - 4", "68"), ("2 \u00d7 3 \u00f7 4 \u2212 1", "0.5"), ("  ( 1\n+ 2 )  ", "3"),
    ("999999999999999999 + 1", "1000000000000000000"), ("1 / 1024", "0.0009765625"),
    ("+".join(["1"] * 100), "100"),
])
def test_normal_expressions_have_exact_results(expr, shown):
    assert calculate(expr) == (shown, None)


def test_values_are_fractions_and_print_without_dot_zero():
    assert evaluate("0.1 + 0.2") == Fraction(3, 10)
    assert evaluate("4 / 2") == 2 and format_value(evaluate("4 / 2")) == "2"
    assert format_value(Fraction(-1, 3)) == "-0.3333333333"
    assert format_value(Fraction(1, 10**12)) == "0"  # rounds to nothing: no "-0" or "0."
    assert format_value(Fraction(-1, 10**12)) == "0"


# ---------------------------------------------------------------- the evaluator: adversarial input

ADVERSARIAL = {
    "name": ("x + 1", "names are not allowed (x)"),
    "call": ("abs(-3)", "function calls are not allowed"),
    "import": ("__import__('os')", "function calls are not allowed"),
    "import system": ("__import__('os').system('touch PWNED')", "function calls are not allowed"),
    "attribute": ("(1).real", "attribute access is not allowed"),
    "dunder attribute": ("().__class__.__bases__", "attribute access is not allowed"),
    "power tower": ("9**9**9", "exponentiation (**) is not allowed"),
    "power": ("10**400", "exponentiation (**) is not allowed"),
    "lambda": ("(lambda: 1)()", "function calls are not allowed"),
    "bare lambda": ("lambda: 1", "lambda is not allowed"),
    "list comprehension": ("[x for x in range(9**9)]", "comprehensions are not allowed"),
    "generator": ("sum(x for x in range(10))", "function calls are not allowed"),
    "bare generator": ("(x for x in range(10))", "comprehensions are not allowed"),
    "subscript": ("[1, 2][0]", "subscripts are not allowed"),
    "string": ("'a' * 10", "only integers and decimals are allowed (str given)"),
    "floor division": ("7 // 2", "operator // is not allowed"),
    "modulo": ("7 % 2", "operator % is not allowed"),
    "bool": ("True + 1", "only integers and decimals are allowed (bool given)"),
    "exponent notation": ("1e400", "'1e400' is not a plain integer or decimal"),
    "underscores": ("1_000", "'1_000' is not a plain integer or decimal"),
    "hex": ("0xff", "'0xff' is not a plain integer or decimal"),
    "comparison": ("1 < 2", "comparisons are not allowed"),
    "thousands comma": ("1,234 + 1", "commas are not allowed"),
    "walrus": ("(y := 3)", "assignment is not allowed"),
    "division by zero": ("1 / (3 - 3)", "division by zero"),
    "huge number": ("1" + "0" * 400, "number too large"),
    "huge result": ("999999999999999999 * 999999999999999999", "result too large"),
    "long fraction": ("1" + "/7" * 30, "result has too many digits after the decimal point"),
    "many decimals": ("0." + "0" * 30 + "1", "number has too many digits after the decimal point"),
    "deep parentheses": ("(" * 10_000 + "1" + ")" * 10_000, "too long (20001 characters"),
    "deep parentheses within the length": ("(" * 200 + "1" + ")" * 200, "nested too deeply"),
    "deep unary minus": ("-" * 500 + "1", "nested too deeply"),
    "long chain": ("+".join(["1"] * 200), "nested too deeply"),
    "one megabyte": ("1+" * (2**19), f"too long (1048576 characters; at most {MAX_CHARS})"),
    "one megabyte of digits": ("9" * 2**20, "too long (1048576 characters"),
    "syntax": ("1 +", "syntax error"),
    "statement": ("import os", "syntax error"),
    "null byte": ("1\x00", "null bytes"),
    "empty": ("   ", "empty expression"),
}


@pytest.mark.parametrize("expr, why", list(ADVERSARIAL.values()), ids=list(ADVERSARIAL))
def test_adversarial_input_is_refused_with_a_reason(expr, why, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    value, error = calculate(expr)
    assert value is None and error and why in error, error
    with pytest.raises(CalcError):
        evaluate(expr)
    assert not (tmp_path / "PWNED").exists()


def test_adversarial_input_in_an_episode_is_an_observation():
    env = CalculatorEnv(max_turns=10)
    env.reset(Example("What is 2 + 2?", "4", "q"))
    for expr in ["__import__('os')", "9**9**9", "1/0", "(" * 10_000 + ")" * 10_000, "1" * 2**20]:
        [r] = env.step([f"Let me compute. <calc>{expr}</calc>"])
        assert r.observation.startswith("<result>invalid expression: ") and r.observation.endswith("</result>")
        assert not r.done and r.info["error"] and r.info["result"] is None and len(r.info["expression"]) <= 200


def test_not_a_string_is_refused():
    with pytest.raises(CalcError, match="not a string"):
        evaluate(12)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the protocol

@pytest.mark.parametrize("text, action", [
    ("I need <calc>3 * 4</calc>", ("calc", "3 * 4")),
    ("<calc>1+1</calc> and <calc>2+2</calc>", ("calc", "1+1")),
    ("So the total is 12.\n#### 12", ("answer", "12")),
    ("#### 12\n<calc>1+1</calc>", ("answer", "12")),
    ("<calc>1+1</calc><result>2</result> so #### 2", ("calc", "1+1")),
    ("#### ", (None, "")),
    ("nothing to do", (None, "")),
    ("<calc>1+1", (None, "")),
])
def test_parse_action(text, action):
    assert parse_action(text) == action


# ---------------------------------------------------------------- episodes

def test_registered_and_built_by_name():
    assert ENVS["calculator"] is CalculatorEnv and "calculator" in ENVS.names()
    env = make_env("calculator", max_turns=3)
    assert isinstance(env, CalculatorEnv) and env.max_turns == 3 and env.stop == ("</calc>",)
    assert env.reward is None and env.final_turn is FINAL_TURN


def test_bad_options_are_errors():
    with pytest.raises(ValueError, match="max_turns must be >= 2"):
        CalculatorEnv(max_turns=1)
    with pytest.raises(ValueError, match="max_turns must be an integer >= 1"):
        CalculatorEnv(max_turns=0)
    with pytest.raises(ValueError, match="unknown environment 'calculater'.*Did you mean 'calculator'"):
        make_env("calculater")
    with pytest.raises(ValueError, match="environment 'calculator':.*colour"):
        make_env("calculator", colour="red")


def test_reset_tells_the_protocol_on_the_arithmetic_task_and_gsm8k():
    arith = ArithmeticTask(seed=0, difficulty=2).example(0)
    gsm = Example(prompt="Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                         "clips in May. How many clips did Natalia sell altogether in April and May?",
                  answer="72", id="gsm8k_test:0", meta={"solution": "48/2 = 24\n48+24 = 72\n#### 72"})
    env = CalculatorEnv(max_turns=4)
    for ex in (arith, gsm):
        start = env.reset(ex)
        assert isinstance(start.prompt, str) and start.prompt.endswith(ex.prompt)
        assert "<calc>" in start.prompt and "</calc>" in start.prompt and "<result>" in start.prompt
        assert "####" in start.prompt and "up to 3 times" in start.prompt
        assert start.info == {"id": ex.id, "calls": 3}
    chat = CalculatorEnv(system_prompt="You are careful.").reset(gsm).prompt
    assert chat[0] == {"role": "system", "content": "You are careful."} and chat[1]["role"] == "user"
    assert chat[1]["content"].endswith(gsm.prompt)


def test_an_episode_calls_then_answers():
    ex = Example("Natalia sold 48 clips in April and half as many in May. How many in all?", "72", "g:0")
    env = CalculatorEnv(max_turns=3)
    env.reset(ex)
    assert env.active() == [0] and env.stop_strings() == ["</calc>"]
    [r] = env.step(["In May she sold <calc>48 / 2</calc>"])
    assert (r.observation, r.reward, r.done) == ("<result>24</result>", 0.0, False)
    assert r.info == {"action": "calc", "expression": "48 / 2", "result": "24", "error": None, "calls": 1,
                      "tool_calls": 1}
    [r] = env.step([" clips. In all: <calc>48 + 24</calc>"])
    assert r.observation == "<result>72</result>" + FINAL_TURN.note  # the next turn is the last
    assert env.stop_strings() == []
    [r] = env.step([" clips.\n#### 72"])
    assert r.done and not r.truncated and r.observation is None and r.info == {"action": "answer", "answer": "72"}
    assert env.active() == []


def test_the_turn_budget_ends_an_episode_and_the_last_call_does_not_run():
    env = CalculatorEnv(max_turns=2)
    env.reset(Example("1 + 1?", "2", "a"))
    [r] = env.step(["hmm"])
    assert r.observation == NO_ACTION + FINAL_TURN.note and not r.done and r.info == {"action": None, "invalid": True}
    [r] = env.step(["<calc>1 + 1</calc>"])
    assert r.done and r.truncated and r.observation is None and r.info == {"action": "calc", "budget_spent": True}
    with pytest.raises(ValueError, match="one action per active episode"):
        env.step(["more"])


def test_a_batch_of_episodes_steps_together():
    task = ArithmeticTask(seed=1, difficulty=1)
    exs = task.examples(3)
    env = CalculatorEnv(max_turns=3)
    for ex in exs:
        env.reset(ex)
    assert env.active() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"one action per active episode \(3\), got 2 actions"):
        env.step(["a", "b"])
    rs = env.step([f"#### {exs[0].answer}", "<calc>2 + 3</calc>", "<calc>2 ** 3</calc>"])
    assert [r.done for r in rs] == [True, False, False]
    assert [r.observation for r in rs[1:]] == ["<result>5</result>",
                                              "<result>invalid expression: exponentiation (**) is not allowed</result>"]
    assert env.active() == [1, 2]
    env.end(2)  # the agent stops one (its context is full)
    [r] = env.step(["#### 5"])
    assert r.done and env.active() == []
    env.reset(exs[0])  # nothing active: a new batch
    assert env.active() == [0] and len(env.episodes) == 1
