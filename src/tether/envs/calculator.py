"""The ``calculator`` environment: arithmetic word problems (the arithmetic task, GSM8K) with a calculator.

Protocol. The prompt (:data:`INSTRUCTION`) tells the model the tool. In a turn the model either

* calls the calculator, ``<calc>(12 + 30) * 2 / 4</calc>``: generation stops at ``</calc>``
  (:attr:`CalculatorEnv.stop`) and the environment appends the value right after it, as the
  observation ``<result>21</result>``; a bad expression gets ``<result>invalid expression:
  REASON</result>`` (:func:`evaluate`'s reason), and the model goes on; or
* gives the final answer after ``####`` (``#### 21``, GSM8K's format, which the ``arithmetic`` and
  ``gsm8k`` rewards read): the episode ends.

The turn's action is whichever of the two comes first in its text (the first complete
``<calc>...</calc>``, or ``####`` followed by something on its line). A turn with neither gets
:data:`NO_ACTION` as its observation. The turn budget is ``max_turns`` (default 4: up to 3 calls);
its last turn has no stop string and no call runs in it (:data:`FINAL_TURN`: the observation
before it says so), and it ends the episode. The steps' reward parts are 0: the task's reward
scores the episode's text.

Values. :func:`evaluate` computes exactly, with :class:`fractions.Fraction`, and never runs code:
it reads the expression's ``ast`` and accepts only number literals (integers and decimals such as
``0.5`` or ``.5``; no exponent notation ``1e5``, no ``1_000``), ``+ - * /``, parentheses and unary
``-`` / ``+``. ``**`` is not allowed at all. Bounds: :data:`MAX_CHARS` characters,
:data:`MAX_DEPTH` levels of nesting (parentheses, and the expression tree), :data:`MAX_ABS` for
every number (literal, intermediate and result) and :data:`MAX_DENOMINATOR` for its exact
denominator. :func:`format_value` prints a value: integers without ``.0`` (``42``), exact decimals
exactly (``0.1 + 0.2`` gives ``0.3``), others rounded to :data:`DECIMALS` places (``1/3`` gives
``0.3333333333``).
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction
from typing import Optional

from ..tasks.base import Example
from ..tasks.prompts import chat_messages
from .base import Episode, FinalTurn, Start, StepResult, TextEnv

__all__ = ["CalcError", "evaluate", "format_value", "calculate", "parse_action", "CalculatorEnv", "INSTRUCTION",
           "NO_ACTION", "FINAL_TURN", "MAX_CHARS", "MAX_DEPTH", "MAX_ABS", "MAX_DENOMINATOR", "DECIMALS"]

#: Most characters in an expression (longer input is refused before it is parsed).
MAX_CHARS = 512
#: Most levels of nesting: of parentheses, and of the expression tree (unary minus chains included).
MAX_DEPTH = 100
#: Largest absolute value of any number: a literal, an intermediate value or the result.
MAX_ABS = 10**18
#: Largest denominator of an exact value (``1 / 7 / 7 / ...`` runs out of it).
MAX_DENOMINATOR = 10**18
#: Decimal places of a value that is not an exact decimal of at most that many places.
DECIMALS = 10

_LITERAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
_TRANSLATE = str.maketrans({"\u00d7": "*", "\u00f7": "/", "\u2212": "-"})  # x, division sign, minus sign
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}
_SYMBOLS = {ast.FloorDiv: "//", ast.Mod: "%", ast.MatMult: "@", ast.LShift: "<<", ast.RShift: ">>",
            ast.BitOr: "|", ast.BitXor: "^", ast.BitAnd: "&"}
_REFUSED = {  # node type -> why it is refused
    ast.Name: "names are not allowed", ast.Call: "function calls are not allowed",
    ast.Attribute: "attribute access is not allowed", ast.Subscript: "subscripts are not allowed",
    ast.Lambda: "lambda is not allowed", ast.ListComp: "comprehensions are not allowed",
    ast.SetComp: "comprehensions are not allowed", ast.DictComp: "comprehensions are not allowed",
    ast.GeneratorExp: "comprehensions are not allowed",
    ast.Tuple: "commas are not allowed (write 1234, not 1,234)", ast.Compare: "comparisons are not allowed",
    ast.BoolOp: "and / or are not allowed", ast.IfExp: "if-else is not allowed",
    ast.NamedExpr: "assignment is not allowed", ast.JoinedStr: "strings are not allowed",
}


class CalcError(ValueError):
    """An expression the calculator refuses; the message says why (shown to the model)."""


def evaluate(expr: str) -> Fraction:
    """The exact value of the arithmetic expression ``expr`` (see the module docstring for what is
    allowed). Raises :class:`CalcError` naming why for anything else; never runs code, and its work
    is bounded by :data:`MAX_CHARS` whatever the input."""
    if not isinstance(expr, str):
        raise CalcError(f"not a string ({type(expr).__name__})")
    if len(expr) > MAX_CHARS:
        raise CalcError(f"too long ({len(expr)} characters; at most {MAX_CHARS})")
    text = " ".join(expr.translate(_TRANSLATE).split())
    if not text:
        raise CalcError("empty expression")
    depth = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if depth > MAX_DEPTH:
            raise CalcError(f"nested too deeply (more than {MAX_DEPTH} levels of parentheses)")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CalcError(f"syntax error ({e.msg})") from None
    except (ValueError, RecursionError, MemoryError) as e:  # e.g. a null byte
        raise CalcError(f"cannot be parsed ({type(e).__name__}: {str(e)[:80]})") from None
    return _value(tree.body, text, 1)


def _checked(v: Fraction, what: str) -> Fraction:
    if abs(v) > MAX_ABS:
        raise CalcError(f"{what} too large (more than 10^{len(str(MAX_ABS)) - 1} in absolute value)")
    if v.denominator > MAX_DENOMINATOR:
        raise CalcError(f"{what} has too many digits after the decimal point")
    return v


def _literal(node: ast.Constant, text: str) -> Fraction:
    if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
        raise CalcError(f"only integers and decimals are allowed ({type(node.value).__name__} given)")
    src = ast.get_source_segment(text, node) or ""
    if not _LITERAL.fullmatch(src):
        raise CalcError(f"{src[:20]!r} is not a plain integer or decimal")
    return _checked(Fraction(src), "number")


def _value(node: ast.AST, text: str, depth: int) -> Fraction:
    """The value of ``node`` (a recursive walk; its depth is bounded by :data:`MAX_DEPTH`)."""
    if depth > MAX_DEPTH:
        raise CalcError(f"nested too deeply (more than {MAX_DEPTH} levels)")
    if isinstance(node, ast.Constant):
        return _literal(node, text)
    if isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.USub, ast.UAdd)):
            raise CalcError(f"{'not' if isinstance(node.op, ast.Not) else '~'} is not allowed")
        v = _value(node.operand, text, depth + 1)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Pow):
            raise CalcError("exponentiation (**) is not allowed")
        if type(node.op) in _SYMBOLS:
            raise CalcError(f"operator {_SYMBOLS[type(node.op)]} is not allowed (only + - * /)")
        a = _value(node.left, text, depth + 1)
        b = _value(node.right, text, depth + 1)
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise CalcError("division by zero")
            return _checked(a / b, "result")
        return _checked(_OPS[type(node.op)](a, b), "result")
    why = _REFUSED.get(type(node), f"{type(node).__name__} is not allowed")
    if isinstance(node, ast.Name):
        why += f" ({node.id[:20]})"
    raise CalcError(why)


def format_value(v: Fraction) -> str:
    """``v`` as the calculator prints it: an integer without ``.0``, an exact decimal of at most
    :data:`DECIMALS` places exactly, anything else rounded (half to even) to :data:`DECIMALS` places."""
    if v.denominator == 1:
        return str(v.numerator)
    scaled = abs(v) * 10**DECIMALS
    n = scaled.numerator if scaled.denominator == 1 else round(scaled)
    whole, frac = divmod(n, 10**DECIMALS)
    digits = str(frac).rjust(DECIMALS, "0").rstrip("0")
    if not whole and not digits:
        return "0"
    return ("-" if v < 0 else "") + str(whole) + (f".{digits}" if digits else "")


def calculate(expr: str) -> tuple[Optional[str], Optional[str]]:
    """``(printed value, None)`` for a good expression, ``(None, reason)`` for a refused one."""
    try:
        return format_value(evaluate(expr)), None
    except CalcError as e:
        return None, str(e)


_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_ANSWER = re.compile(r"####[ \t]*([^\s#][^\n]*)")


def parse_action(text: str) -> tuple[Optional[str], str]:
    """The action of one turn: ``("calc", expression)``, ``("answer", the rest of the ``####`` line)``
    or ``(None, "")``; of a call and an answer, the one that comes first in ``text``."""
    call, answer = _CALL.search(text or ""), _ANSWER.search(text or "")
    if answer and (call is None or answer.start() < call.start()):
        return "answer", answer.group(1).strip()
    if call:
        return "calc", call.group(1).strip()
    return None, ""


#: The prompt: the tool protocol, then the problem (``{calls}``: the calls the budget allows).
INSTRUCTION = (
    "Solve the problem below. You may use a calculator: write an expression between <calc> and </calc>, "
    "for example <calc>(12 + 30) * 2 / 4</calc>, and its value comes back right after it, as "
    "<result>21</result>. Expressions may use numbers, + - * / and parentheses. You can use the calculator "
    "up to {calls} times. When you are done, give the final answer as a number after '####', "
    "for example #### 21.\nProblem: {question}"
)
#: The observation of a turn with neither a call nor a final answer (no "####" in it, nor in the note below: the
#: reward reads the whole episode text, and a "####" there would spoil the answer-format check).
NO_ACTION = ("\n<result>no calculator call and no final answer: write <calc>expression</calc> to calculate, "
             "or give the final answer as the problem asks.</result>\n")
#: The last turn: no stop string (no call runs), and the observation before it says so.
FINAL_TURN = FinalTurn(stop=(), note="\n(No calculator calls are left: give the final answer now.)\n")


class CalculatorEnv(TextEnv):
    """The ``calculator`` environment (module docstring): ``<calc>`` calls, a ``####`` final answer.

    Args:
        max_turns: the turn budget (default 4: up to 3 calls, then the final turn); at least 2.
        reward: the reward spec scoring the episode's text (default None: the task's reward,
            ``arithmetic`` or ``gsm8k``).
        system_prompt: a system message; when given, ``reset`` opens with chat messages instead of text.
    """

    name = "calculator"
    stop = ("</calc>",)
    max_turns = 4
    final_turn = FINAL_TURN
    observation_tail = "</result>"

    def __init__(self, *, max_turns: Optional[int] = None, reward: Optional[str] = None, system_prompt: str = ""):
        super().__init__(max_turns=max_turns, reward=reward)
        if self.max_turns < 2:
            raise ValueError(f"calculator environment: max_turns must be >= 2 (a call and the answer), "
                             f"got {self.max_turns}")
        self.system_prompt = system_prompt

    def start(self, example: Example) -> Start:
        """The prompt (:data:`INSTRUCTION` around ``example.prompt``): text, or chat messages with a
        system prompt; info: the example's id and the calls allowed."""
        text = INSTRUCTION.format(calls=self.max_turns - 1, question=example.prompt)
        prompt = chat_messages(Example(text, example.answer, example.id), self.system_prompt) \
            if self.system_prompt else text
        return Start(prompt=prompt, info={"id": example.id, "calls": self.max_turns - 1})

    def act(self, episode: Episode, action: str) -> StepResult:
        """Run the turn's call (its value or the reason it is refused), end on an answer or at the
        budget's last turn (where a call does not run), or remind the model of the protocol."""
        kind, content = parse_action(action)
        if kind == "answer":
            return StepResult(done=True, info={"action": "answer", "answer": content})
        if episode.final:  # no call runs: the base class ends the episode (truncated)
            return StepResult(info={"action": kind, "budget_spent": True})
        if kind is None:
            return StepResult(observation=NO_ACTION, info={"action": None, "invalid": True})
        calls = episode.state["calls"] = episode.state.get("calls", 0) + 1
        value, error = calculate(content)
        shown = value if error is None else f"invalid expression: {error}"
        return StepResult(observation=f"<result>{shown}</result>",
                          info={"action": "calc", "expression": content[:200], "result": value, "error": error,
                                "calls": calls, "tool_calls": 1})
