"""The math reward rule: ``extract_final_answer`` and ``verify_math_answer`` (pure functions).

Spec: the final answer is the content of the last ``\\boxed{...}`` (balanced braces), else the rest
of the line after the last ``####``; with neither the score is 0.0 (no guessing from stray numbers).
``\\frac{1}{2}``, ``1/2`` and ``0.5`` are equal, ``1,000`` equals ``1000``, surrounding spaces and a
trailing period do not matter. The result is 1.0 or 0.0, never an exception, in bounded time on any
input.
"""

from __future__ import annotations

import random
import time

import pytest

from nemo_like.environments.math_environment import extract_final_answer, verify_math_answer


def B(s: str) -> str:
    return "\\boxed{" + s + "}"


# A loaded 2-core CI box: generous, but far below what an unguarded 9^{9^{9}} or sympify would take.
HOSTILE_LIMIT_S = 5.0


# ------------------------------------------------------------------------------ extraction
@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (B("42"), "42"),
        ("reasoning ... so the answer is " + B("42") + ".", "42"),
        (B("3") + " no wait " + B("4"), "4"),  # the last box counts
        (B("\\frac{1}{2}"), "\\frac{1}{2}"),  # balanced nested braces
        (B("a{b{c}d}e"), "a{b{c}d}e"),
        (B("\\{1,2\\}"), "\\{1,2\\}"),  # escaped (set) braces do not nest
        ("\\boxed {7}", "7"),  # whitespace between \boxed and {
        (B("1") + " and a bare \\boxed later", "1"),  # \boxed without a brace is not a box
        ("#### 72", "72"),
        ("Natalia sold 48/2 = 24 clips.\n#### 72\n", "72"),
        ("#### 1\n#### 2  \nthe end", "2"),  # the last ####, rest of its line, stripped
        ("#### 1 #### 2", "2"),
        ("####", ""),
        (B("5") + "\n#### 6", "5"),  # a box beats ####
        ("#### 6\n" + B("5"), "5"),
    ],
)
def test_extract_final_answer(response: str, expected: str) -> None:
    assert extract_final_answer(response) == expected


@pytest.mark.parametrize(
    "response",
    [
        "",
        "The answer is 42.",  # no box, no ####: nothing is guessed
        "42",
        "### 42",
        "\\boxed 42",
        B("1") + " then \\boxed{2",  # the last box is unclosed: no fallback to the earlier one
        B("x" * 500),  # over-long answer
        "\\boxed{" + "{" * 1000,
    ],
)
def test_extract_final_answer_none(response: str) -> None:
    assert extract_final_answer(response) is None


# ----------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize(
    ("response", "truth"),
    [
        # fractions / decimals
        (B("\\frac{1}{2}"), "1/2"),
        (B("1/2"), "0.5"),
        (B("0.5"), "\\frac{1}{2}"),
        (B("\\dfrac{1}{2}"), "0.5"),
        (B("\\tfrac{1}{2}"), "0.5"),
        (B("\\frac12"), "1/2"),
        (B("0.50"), "1/2"),
        (B(".5"), "1/2"),
        (B("\\frac{2}{4}"), "0.5"),
        (B("3/6"), "\\frac{1}{2}"),
        (B("1.5"), "\\frac{3}{2}"),
        (B("5.0"), "5"),
        (B("05"), "5"),
        # thousands separators
        (B("1,000"), "1000"),
        (B("1000"), "1,000"),
        (B("100,000"), "100000"),
        (B("1,000.5"), "1000.5"),
        (B("1{,}000"), "1000"),
        ("#### 1,000", "1000"),
        # spaces, trailing period, math-mode markup
        (B(" 42 "), "42"),
        (B("42."), "42"),
        (B("42"), "  42.  "),
        ("#### 42.", "42"),
        ("####   7  ", "7"),
        (B("\\ 1 / 2 "), "0.5"),
        (B("\\left(1\\right)"), "1"),
        (B("$5$"), "5"),
        ("#### $1,000", "1000"),
        (B("\\text{5}"), "5"),
        (B("5 \\text{ cm}"), "5"),
        (B("30^\\circ"), "30"),
        (B("x = 5"), "5"),
        # arithmetic and signs
        (B("-3"), "-3"),
        (B("+5"), "5"),
        (B("-0"), "0"),
        (B("2^{10}"), "1024"),
        (B("10^{-2}"), "0.01"),
        (B("2\\times 3"), "6"),
        (B("2 \\cdot 3"), "6"),
        # symbolic (sympy path)
        (B("\\sqrt{8}"), "2\\sqrt{2}"),
        (B("\\sqrt{4}"), "2"),
        (B("4^{1/2}"), "2"),
        (B("\\frac{\\sqrt{3}}{2}"), "\\frac{1}{2}\\sqrt{3}"),
        (B("\\sqrt{2}/2"), "\\frac{1}{\\sqrt{2}}"),
        (B("\\pi/2"), "\\frac{\\pi}{2}"),
        (B("x+1"), "1+x"),
        (B("(x+1)^2"), "x^2+2x+1"),
        (B("\\sqrt[3]{-8}"), "-2"),
        # the ground truth may itself be a worked solution
        (B("72"), "Natalia sold 48/2 = 24 clips.\n#### 72"),
        (B("1/2"), B("0.5")),
        (B("3") + " no, actually " + B("4"), "4"),
        # non-numeric answers compare as normalised text
        (B("\\text{Yes}"), "Yes"),
        (B("(1,2)"), "(1, 2)"),
        (B("x=5"), "x=5"),
    ],
)
def test_equivalent_answers_score_one(response: str, truth: str) -> None:
    assert verify_math_answer(response, truth) == 1.0


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        # close is not equal
        (B("0.51"), "1/2"),
        (B("0.333"), "1/3"),
        (B("1/3"), "0.333"),
        (B("\\frac{1}{2}"), "\\frac{1}{3}"),
        (B("0.5000001"), "\\frac{1}{2}"),
        (B("\\pi"), "3.14159"),
        (B("\\sqrt{2}"), "1.41421356"),
        (B("-3"), "3"),
        (B("-1/2"), "1/2"),
        (B("\\sqrt{x^{2}}"), "x"),
        (B("x+2"), "x+1"),
        # the last box counts, not any box
        (B("3") + B("4"), "3"),
        (B("3") + " or maybe " + B("4"), "3"),
        (B("5") + "\n#### 6", "6"),
        # no final answer: never guessed from stray numbers
        ("42", "42"),
        ("The answer is 42.", "42"),
        ("The answer is $\\frac{1}{2}$", "1/2"),
        ("### 42", "42"),
        (B("42") + " \\boxed{43", "42"),  # last box unclosed
        (B(""), ""),
        (B(""), "0"),
        (B("   "), "0"),
        ("####", "0"),
        ("####\n42", "42"),
        # separators only where they are thousands separators; no gluing of digits
        (B("1,000"), "1"),
        (B("1,2"), "12"),
        (B("2 3"), "23"),
        ("#### 1 000", "1000"),
        # order matters in tuples; case in text
        (B("(1,2)"), "(2,1)"),
        (B("yes"), "Yes"),
        (B("y=5"), "x=5"),
        # garbage in the box
        (B("1e3"), "1000"),
        (B("\\frac{1}{0}"), "1"),
        (B("1/0"), "0"),
        (B("0^{-1}"), "0"),
        (B("x/(x-x)"), "1"),
        (B("\\unknowncommand{1}"), "1"),
    ],
)
def test_wrong_or_missing_answers_score_zero(response: str, truth: str) -> None:
    assert verify_math_answer(response, truth) == 0.0


@pytest.mark.parametrize(("response", "truth"), [(B("\\$18.90"), "18.90"), (B("\\$5"), "5"), ("#### \\$1,000", "1000")])
def test_escaped_dollar_sign_is_ignored(response: str, truth: str) -> None:
    assert verify_math_answer(response, truth) == 1.0


def test_symmetric_on_plain_answers() -> None:
    pairs = [("1/2", "0.5"), ("\\frac{1}{2}", "0.5"), ("1,000", "1000"), ("0.51", "1/2"), ("\\sqrt{8}", "2\\sqrt{2}")]
    for a, b in pairs:
        assert verify_math_answer(B(a), b) == verify_math_answer(B(b), a)


# ------------------------------------------------------------------------ hostile input
@pytest.fixture(scope="module")
def warm_sympy() -> None:
    """Import sympy once so its import time is not billed to the first hostile case."""
    assert verify_math_answer(B("\\sqrt{8}"), "2\\sqrt{2}") == 1.0


def _nasty_str() -> str:
    class Nasty(str):
        def rfind(self, *a, **k):  # type: ignore[override]
            raise RuntimeError("gotcha")

        def find(self, *a, **k):  # type: ignore[override]
            raise RuntimeError("gotcha")

    return Nasty(B("1"))


MB = 1 << 20
HOSTILE = [
    # huge numbers: must be refused before being computed
    ("power_tower", B("9^{9^{9}}"), "1"),
    ("power_tower_both", B("9^{9^{9}}"), "9^{9^{9}}+0"),
    ("huge_power", B("10^{100000}"), "10^{100000}+0"),
    ("tetration", B("2^{2^{2^{2^{2}}}}"), "2^{65536}"),
    ("huge_power_product", B("9^{99999}\\cdot 9^{99999}"), "9^{199998}"),
    ("huge_root", B("\\sqrt{2^{4000}}"), "2^{2000}"),
    ("huge_symbolic_power", B("((x+1)^{64})^{64}"), "1"),
    ("symbolic_power_vs_expanded", B("(x^{64})^{64}"), "x^{4096}"),
    ("many_digits", B("9" * 150), "1"),
    ("many_digits_both", B("9" * 150), "9" * 149 + "8"),
    ("decimal_many_digits", B("0." + "3" * 150), "1/3"),
    # deep nesting
    ("deep_parens", B("(" * 500 + "1" + ")" * 500), "1"),
    ("deep_braces", B("{" * 150 + "1" + "}" * 150), "1"),
    ("many_signs", B("-" * 190 + "1"), "1"),
    ("deep_sqrt", B("\\sqrt{" * 19 + "2" + "}" * 19), "2"),
    ("deep_exponents", B("x^{" * 30 + "x" + "}" * 30), "x"),
    ("deep_nested_roots", B("\\sqrt[64]{" * 4 + "x+1" + "}" * 4), "(x+1)^{\\frac{1}{16777216}}+1"),
    ("brace_bomb_unclosed", "\\boxed{" + "{" * MB, "1"),
    # thousands of terms
    ("thousand_terms", B("+".join(["1"] * 1000)), "1000"),
    ("thousand_terms_truth", B("1000"), "+".join(["1"] * 1000)),
    ("many_symbol_terms", B("+".join("abcdefghijklmnopqrstuvwxyz") + "+" + "+".join("abcdefghijk")), "a"),
    ("big_polynomial", B("(a+b+c+d+e+f+g+h+i+j+k+l+m)^{30}"), "(m+l+k+j+i+h+g+f+e+d+c+b+a)^{30}+1"),
    ("product_of_many_factors", B("".join(f"(x+{k})" for k in range(1, 17))), "".join(f"(x+{k})" for k in range(16, 0, -1)) + "+1"),
    # megabyte strings
    ("mb_of_x", "x" * MB, "1"),
    ("mb_in_box", B("1" * MB), "1" * MB),
    ("mb_of_boxes", "\\boxed{" * (MB // 7), "1"),
    ("mb_of_bare_boxed", "\\boxed" * (MB // 6) + "{1}", "0"),
    ("mb_of_closing_braces", B("1") + "}" * MB, "2"),
    ("mb_of_hashes", "####" * (MB // 4) + " 1", "2"),
    ("mb_of_backslashes", "\\" * MB + B("1"), "2"),
    ("mb_truth", B("1"), "#### " + "9" * MB),
    ("mb_truth_plain", B("1"), "1" * MB),
    ("mb_both_plain", "7" * MB, "7" * MB),
    ("mb_response_and_box", "blah " * (MB // 5) + B("2"), "3"),
    # odd characters
    ("nul_and_surrogate", "\x00" + B("1\ud800") + "\udfff", "1"),
    ("newlines_in_box", B("1\n\n\n2"), "12"),
]


@pytest.mark.parametrize(("response", "truth"), [pytest.param(r, t, id=i) for i, r, t in HOSTILE])
def test_hostile_input_scores_zero_fast(warm_sympy: None, response: str, truth: str) -> None:
    start = time.monotonic()
    score = verify_math_answer(response, truth)
    elapsed = time.monotonic() - start
    assert score == 0.0
    assert elapsed < HOSTILE_LIMIT_S, f"took {elapsed:.2f}s"


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        pytest.param(B("9^{9^{9}}"), "9^{9^{9}}", id="same_tower_text"),  # equal text: no computation needed
        pytest.param(B("1") + "}" * MB, "1", id="mb_trailing_braces"),
        pytest.param("{" * MB + B("1"), "1", id="mb_leading_braces"),
        pytest.param("\\boxed" * (MB // 6) + "{1}", "1", id="mb_bare_boxed_then_box"),
        pytest.param("#" * MB + " 1", "1", id="mb_hashes"),
        pytest.param("x" * MB + "\n" + B("1/2"), "0.5", id="mb_prefix"),
        pytest.param(B("(" * 19 + "1" + ")" * 19), "1", id="nesting_within_limit"),
        pytest.param(B("+".join(["1"] * 60)), "60", id="sixty_terms"),
        pytest.param(B("+".join(["x"] * 60)), "60x", id="sixty_symbol_terms"),
        pytest.param(B("(a+b+c+d+e+f+g+h)^{32}"), "(h+g+f+e+d+c+b+a)^{32}", id="reordered_power"),
        pytest.param(B("9" * 49), "9" * 49, id="long_number"),
    ],
)
def test_hostile_looking_but_correct_answers_still_score(warm_sympy: None, response: str, truth: str) -> None:
    start = time.monotonic()
    assert verify_math_answer(response, truth) == 1.0
    assert time.monotonic() - start < HOSTILE_LIMIT_S


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        (None, "1"),
        (B("1"), None),
        (None, None),
        (1, "1"),
        (B("5"), 5),  # the pure function wants strings; MathEnvironment converts numbers
        (b"\\boxed{1}", "1"),
        (B("1"), b"1"),
        ([B("1")], "1"),
        ({"content": B("1")}, "1"),
        (1.5, 1.5),
        (float("nan"), float("nan")),
        (object(), object()),
        (_nasty_str(), "1"),
    ],
)
def test_non_str_inputs_score_zero(response: object, truth: object) -> None:
    assert verify_math_answer(response, truth) == 0.0  # type: ignore[arg-type]


def test_random_latex_soup_never_raises(warm_sympy: None) -> None:
    """Seeded fuzz over answer-like tokens: always exactly 0.0 or 1.0, and fast."""
    tokens = ["1", "2", "0", "9", "x", "y", "\\pi", "+", "-", "*", "/", "^", "(", ")", "{", "}", "[", "]",
              "\\frac", "\\sqrt", "\\cdot", ",", ".", " ", "=", "\\{", "\\}", "\\", "$", "%", "99", "#"]
    rng = random.Random(1234)
    start = time.monotonic()
    worst = 0.0
    for _ in range(300):
        a = "".join(rng.choice(tokens) for _ in range(rng.randint(1, 30)))
        b = "".join(rng.choice(tokens) for _ in range(rng.randint(1, 12)))
        t0 = time.monotonic()
        for resp, truth in ((B(a), b), ("#### " + a, b), (B(a), a)):
            assert verify_math_answer(resp, truth) in (0.0, 1.0), (resp, truth)
        worst = max(worst, time.monotonic() - t0)
    assert worst < HOSTILE_LIMIT_S
    assert time.monotonic() - start < 30.0


def test_return_type_is_float() -> None:
    for r, t in [(B("1"), "1"), (B("2"), "1"), ("x", "1"), (None, None)]:
        score = verify_math_answer(r, t)  # type: ignore[arg-type]
        assert type(score) is float
