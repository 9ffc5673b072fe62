"""A safe parser for the LaTeX subset of final math answers, and exact/symbolic comparison.

Model output is hostile input: nothing here calls ``sympify``/``eval`` on it. A hand-written
recursive-descent parser turns a bounded LaTeX subset into a tuple AST; purely numeric ASTs are
evaluated with exact ``fractions.Fraction`` arithmetic; only answers with roots, pi or variables
are built into sympy expressions, node by node. Every step checks a size limit *before* doing the
work (9^{9^{9}} is never computed), so a check costs milliseconds, not minutes or gigabytes.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

__all__ = ["AnswerRejected", "parse_answer", "rational_value", "symbolically_equal"]

# Limits; real answers are far below all of them. Breaking one scores 0.
MAX_NUMBER_DIGITS = 50  # per numeric literal
MAX_NESTING = 20  # parentheses/braces/unary-sign depth
MAX_RESULT_BITS = 4096  # any exact rational (numerator or denominator) built while evaluating
MAX_RADICAND_BITS = 256  # rationals under a root: sympy factors them, which is slow when huge
MAX_SYMBOLIC_DEGREE = 64  # |exponent| on a non-rational base; also the total over compound bases
MAX_SYMBOLIC_OPS = 200  # sympy count_ops of (answer - truth) before we refuse to simplify


class AnswerRejected(Exception):
    """The answer breaks a limit or leaves the supported grammar."""


_Reject = AnswerRejected

_TOKEN_RE = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(\\[a-zA-Z]+)|([a-zA-Z])|(\*\*|\S))")
_CMD_OPS = {"\\cdot": "*", "\\times": "*", "\\div": "/", "**": "^"}
_CLOSE = {"(": ")", "{": "}", "[": "]"}


def _tokenize(s: str) -> list[tuple[str, str]]:
    toks: list[tuple[str, str]] = []
    for m in _TOKEN_RE.finditer(s):
        num, cmd, var, op = m.groups()
        if num is not None:
            if len(num.replace(".", "")) > MAX_NUMBER_DIGITS:
                raise _Reject("number too long")
            toks.append(("num", num))
        elif cmd is not None:
            if cmd in _CMD_OPS:
                toks.append(("op", _CMD_OPS[cmd]))
            elif cmd in ("\\frac", "\\sqrt", "\\pi"):
                toks.append(("cmd", cmd))
            else:
                raise _Reject(f"unsupported command {cmd}")
        elif var is not None:
            toks.append(("var", var))
        elif op is not None:
            op = _CMD_OPS.get(op, op)
            if op not in "+-*/^(){}[]":
                raise _Reject(f"unsupported character {op!r}")
            toks.append(("op", op))
    return toks


class _Parser:
    """Recursive descent over: sums, products (explicit and implicit), unary signs, ``^``,
    ``\\frac``, ``\\sqrt[n]``, ``\\pi``, single-letter variables, numbers, and (), {}, [] groups.

    AST nodes are tuples: ("num", Fraction), ("var", name), ("pi",), ("neg", x),
    (op, a, b) for op in + - * / ^, ("sqrt", x, index-or-None).
    """

    def __init__(self, text: str) -> None:
        self.toks = _tokenize(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> tuple[str | None, str | None]:
        return self.toks[self.i] if self.i < len(self.toks) else (None, None)

    def take(self) -> tuple[str | None, str | None]:
        tok = self.peek()
        self.i += 1
        return tok

    def expect(self, text: str) -> None:
        if self.take()[1] != text:
            raise _Reject(f"expected {text!r}")

    def nest(self) -> None:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise _Reject("nested too deeply")

    def parse(self) -> tuple:
        node = self.expr()
        if self.i != len(self.toks):
            raise _Reject("trailing tokens")
        return node

    def expr(self) -> tuple:
        self.nest()
        node = self.term()
        while self.peek()[1] in ("+", "-"):
            op = self.take()[1]
            node = (op, node, self.term())
        self.depth -= 1
        return node

    def term(self) -> tuple:
        node = self.unary()
        while True:
            kind, text = self.peek()
            if text in ("*", "/"):
                self.take()
                node = (text, node, self.unary())
            elif kind in ("var", "cmd") or text in ("(", "{", "["):
                # Implicit product (2x, 2\pi, (a)(b)). A number right before \frac is a mixed
                # number in school notation (1\frac{1}{2} = 1.5), a product in LaTeX: ambiguous.
                if text == "\\frac" and self.toks[self.i - 1][0] == "num":
                    raise _Reject("mixed number")
                node = ("*", node, self.power())
            else:  # includes a number right after a factor: "2 3" is not 6
                return node

    def unary(self) -> tuple:
        text = self.peek()[1]
        if text in ("+", "-"):
            self.take()
            self.nest()
            node = self.unary()
            self.depth -= 1
            return ("neg", node) if text == "-" else node
        return self.power()

    def power(self) -> tuple:
        base = self.atom()
        if self.peek()[1] == "^":
            self.take()
            return ("^", base, self.exponent())
        return base  # a second "^" (2^3^2) is left over and rejected: LaTeX forbids it

    def exponent(self) -> tuple:
        text = self.peek()[1]
        if text in ("+", "-"):
            self.take()
            self.nest()
            node = self.exponent()
            self.depth -= 1
            return ("neg", node) if text == "-" else node
        return self.atom()

    def atom(self) -> tuple:
        kind, text = self.take()
        if kind == "num":
            return ("num", Fraction(text))
        if kind == "var":
            return ("var", text)
        if text == "\\pi":
            return ("pi",)
        if text in _CLOSE:
            node = self.expr()
            self.expect(_CLOSE[text])
            return node
        if text == "\\frac":
            return ("/", self.arg(), self.arg())
        if text == "\\sqrt":
            index = None
            if self.peek()[1] == "[":
                self.take()
                index = self.expr()
                self.expect("]")
            return ("sqrt", self.arg(), index)
        raise _Reject(f"unexpected token {text!r}")

    def arg(self) -> tuple:
        """A command argument: a {group}, or one character as in LaTeX (\\frac12 = 1/2)."""
        kind, text = self.peek()
        if text == "{":
            return self.atom()
        if kind == "num" and text[0].isdigit():
            if len(text) > 1:
                self.toks[self.i] = ("num", text[1:])
            else:
                self.i += 1
            return ("num", Fraction(text[0]))
        if kind == "var" or text == "\\pi":
            return self.atom()
        raise _Reject("bad command argument")


def _bits(q: Fraction) -> int:
    return max(q.numerator.bit_length(), q.denominator.bit_length())


def _rational_pow(base: Fraction, exp: Fraction) -> Fraction | None:
    """base**exp when it is rational and small; None when it may be irrational (4^{1/2} -> sympy)."""
    if exp.denominator != 1:
        return None
    e = exp.numerator
    if base == 0 and e < 0:
        raise _Reject("division by zero")
    if base in (0, 1) or e == 0:
        return base**e
    if base == -1:
        return Fraction(-1 if e % 2 else 1)
    # Check the size before computing: 9^{9^{9}} must never be attempted.
    if (_bits(base) - 1) * abs(e) > MAX_RESULT_BITS:
        raise _Reject("power too large")
    return base**e


def _rational(node: tuple) -> Fraction | None:
    """Exact value of a purely numeric AST, None if it has roots/pi/variables. Size-guarded."""
    op = node[0]
    if op == "num":
        return node[1]
    if op in ("var", "pi", "sqrt"):
        return None
    if op == "neg":
        v = _rational(node[1])
        return None if v is None else -v
    a = _rational(node[1])
    b = _rational(node[2]) if a is not None else None
    if a is None or b is None:
        return None
    if op == "+":
        r = a + b
    elif op == "-":
        r = a - b
    elif op == "*":
        r = a * b
    elif op == "/":
        if b == 0:
            raise _Reject("division by zero")
        r = a / b
    else:
        r = _rational_pow(a, b)
        if r is None:
            return None
    if _bits(r) > MAX_RESULT_BITS:
        raise _Reject("number too large")
    return r


class _SympyBuilder:
    """AST -> sympy expression, node by node, with the size limits checked before each step."""

    def __init__(self, sp: Any) -> None:
        self.sp = sp
        self.degree_left = MAX_SYMBOLIC_DEGREE  # shared by both sides of one comparison

    def rational_or_limit(self, x: Any) -> None:
        if x.is_Rational and _bits(Fraction(int(x.p), int(x.q))) > MAX_RADICAND_BITS:
            raise _Reject("radicand too large")

    def build(self, node: tuple) -> Any:
        sp, op = self.sp, node[0]
        exact = _rational(node)  # guarded exact arithmetic for every purely numeric subtree
        if exact is not None:
            return sp.Rational(exact.numerator, exact.denominator)
        if op == "var":
            return sp.Symbol(node[1])
        if op == "pi":
            return sp.pi
        if op == "neg":
            return -self.build(node[1])
        if op == "sqrt":
            x = self.build(node[1])
            self.rational_or_limit(x)
            if node[2] is None:
                return sp.sqrt(x)
            n = _rational(node[2])
            if n is None or n.denominator != 1 or not 2 <= n.numerator <= 64:
                raise _Reject("bad root index")
            k = int(n.numerator)
            if k % 2 and x.is_number and x.is_negative:  # \sqrt[3]{-8} = -2, not a complex root
                return -sp.root(-x, k)
            return sp.root(x, k)
        a, b = self.build(node[1]), self.build(node[2])
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op == "/":
            if b.is_zero:
                raise _Reject("division by zero")
            return a / b
        # op == "^". A rational base here has a non-integer exponent (4^{1/2}): a root.
        if a.is_Rational:
            self.rational_or_limit(a)
        if b.is_number:
            if not b.is_real:
                raise _Reject("complex exponent")
            if abs(b) > MAX_SYMBOLIC_DEGREE:
                raise _Reject("exponent too large")
            if not a.is_Atom:  # (x+1)^{k}: expanding costs grow with the total degree; x^{k} is free
                self.degree_left -= abs(b)
                if self.degree_left < 0:
                    raise _Reject("total degree too large")
        return a**b


def parse_answer(text: str) -> tuple:
    """AST of a normalised answer; raises AnswerRejected outside the grammar or the limits."""
    return _Parser(text).parse()


def rational_value(node: tuple) -> Fraction | None:
    """Exact value of a purely numeric AST, None if it has roots/pi/variables (AnswerRejected
    when a limit is broken, e.g. a power that would be too large)."""
    return _rational(node)


def symbolically_equal(a_node: tuple, b_node: tuple) -> bool:
    """Whether two ASTs denote the same expression (sympy; imported only here)."""
    import sympy as sp

    builder = _SympyBuilder(sp)
    a, b = builder.build(a_node), builder.build(b_node)
    diff = a - b
    if diff == 0:
        return True
    if sp.count_ops(diff) > MAX_SYMBOLIC_OPS:
        return False
    # A cheap numeric probe rejects almost every wrong answer before the expensive simplify.
    symbols = sorted(diff.free_symbols | a.free_symbols, key=str)
    point = {s: sp.Rational(7 + 3 * k, 11) for k, s in enumerate(symbols)}
    try:
        va, vd = complex(sp.N(a.subs(point), 30)), complex(sp.N(diff.subs(point), 30))
    except (TypeError, ValueError):  # not evaluable there (a pole, zoo): let simplify decide
        va = vd = complex("nan")
    if math.isfinite(abs(va)) and math.isfinite(abs(vd)) and abs(vd) > 1e-12 * max(1.0, abs(va)):
        return False
    # Polynomials and rational functions: cancel (expand + gcd) decides, much faster than simplify.
    if diff.is_rational_function() and sp.cancel(diff) == 0:
        return True
    return sp.simplify(diff) == 0 or bool(diff.equals(0))
