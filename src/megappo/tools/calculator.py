"""A calculator tool: arithmetic on numbers, evaluated by walking Python's syntax tree (no eval)."""
from __future__ import annotations

import ast
import math
import operator
from typing import Any, Optional

from .base import Tool, function_schema

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt}
MAX_EXPONENT = 1000          # 9**9**9 would take the process's memory and minutes
MAX_DIGITS = 4000
MAX_LENGTH = 2000


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; the message says why."""


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(b) > MAX_EXPONENT or isinstance(a, int) and isinstance(b, int)
                                             and a.bit_length() * b > MAX_DIGITS * 3.33):
            raise CalculatorError(f"the power is too large (exponent at most {MAX_EXPONENT}, result at most "
                                  f"{MAX_DIGITS} digits)")
        try:
            out = _BINARY[type(node.op)](a, b)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large for a float") from None
        if isinstance(out, complex):
            raise CalculatorError("the result is not a real number")
        if isinstance(out, float) and not math.isfinite(out):
            raise CalculatorError("the result is too large for a float")
        if isinstance(out, int) and out.bit_length() > MAX_DIGITS * 3.33:
            raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
        return out
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        try:
            return _FUNCTIONS[node.func.id](*[_eval(a) for a in node.args])
        except (TypeError, ValueError, OverflowError) as e:
            raise CalculatorError(f"{node.func.id}: {e}") from None
    what = type(node).__name__ if not isinstance(node, ast.Constant) else repr(node.value)
    raise CalculatorError(f"{what} is not allowed: use numbers, + - * / // % ** and parentheses, "
                          f"and {', '.join(_FUNCTIONS)}")


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses, abs, round,
    min, max, sqrt; ``^`` is read as a power, as models write it); :class:`CalculatorError` for
    anything else."""
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression ({e.msg})") from None
    return _eval(tree)


def format_number(x: int | float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e16:
        return str(int(x))
    return repr(x) if isinstance(x, int) else f"{x:.12g}"


class Calculator(Tool):
    """The ``calculator`` tool: ``{"expression": "12 * (3 + 4)"}`` -> ``84``."""

    def __init__(self, config: Optional[dict] = None, tool_schema: Optional[dict] = None):
        super().__init__(config, tool_schema or function_schema(
            "calculator", "Evaluate an arithmetic expression exactly (+ - * / // % **, parentheses, abs, round, "
            "min, max, sqrt).", {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4) / 5"}},
            ["expression"]))

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        try:
            return format_number(calculate(parameters["expression"])), 0.0, {}
        except CalculatorError as e:
            return f"Error: {e}", 0.0, {"calculator_error": 1}
