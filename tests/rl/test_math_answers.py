"""Math answer checking: equivalent forms score 1, answers that only look close score 0.

The expected verdicts are the mathematical truth of each pair, stated independently of the checker:
each pair also carries the two exact values (Fractions, or None for non-numeric answers), and the
numeric pairs' verdict is asserted to be ``value_a == value_b`` (the exact comparison), so a wrong
expectation in the table cannot hide a checker bug.
"""

from fractions import Fraction as F

import pytest

from logitless.rl.math_answers import answers_match, extract_answer, extract_boxed, normalize_answer, reference_answer
from logitless.rl.rewards import math_correctness

HALF = F(1, 2)
NUMERIC = [  # (a, b, exact value of a, exact value of b)
    ("1/2", "0.5", HALF, HALF),
    ("\\frac{1}{2}", "0.5", HALF, HALF),
    ("\\dfrac12", "\\frac{1}{2}", HALF, HALF),
    ("\\tfrac{1}{2}", "1/2", HALF, HALF),
    ("\\boxed{\\dfrac12}", "0.5", HALF, HALF),   # a box as the reference or the prediction
    ("0.50", "\\frac{2}{4}", HALF, HALF),
    ("1,000", "1000", F(1000), F(1000)),
    ("1,234,567.5", "1234567.5", F(2469135, 2), F(2469135, 2)),
    ("$5", "5", F(5), F(5)),
    ("\\$5.00", "5", F(5), F(5)),
    ("5 dollars", "5", F(5), F(5)),
    ("\\text{5 dollars}", "5", F(5), F(5)),
    ("12 cm.", "12", F(12), F(12)),
    ("50\\%", "50", F(50), F(50)),
    ("-3", "-3", F(-3), F(-3)),
    ("-\\frac{1}{2}", "-0.5", -HALF, -HALF),
    ("5.0", "5", F(5), F(5)),
    # wrong answers that look close
    ("-3", "3", F(-3), F(3)),
    ("0.33", "1/3", F(33, 100), F(1, 3)),
    ("100", "1000", F(100), F(1000)),
    ("1,00", "100", None, F(100)),            # not a thousands grouping: no number at all
    ("12", "1.2", F(12), F(6, 5)),
    ("\\frac{1}{3}", "\\frac{1}{2}", F(1, 3), HALF),
    ("2/1", "1/2", F(2), HALF),
    ("0.51", "0.5", F(51, 100), HALF),
    ("-5 dollars", "5", F(-5), F(5)),
]


@pytest.mark.parametrize("a, b, va, vb", NUMERIC)
def test_numeric_answers(a, b, va, vb):
    b_ref = reference_answer(b)
    a_pred = extract_boxed(a) if "\\boxed" in a else a
    assert answers_match(a_pred, b_ref) is (va is not None and va == vb)
    assert answers_match(b_ref, a_pred) is (va is not None and va == vb)  # symmetric


@pytest.mark.parametrize("a, b, equal", [
    ("\\sqrt{8}", "2\\sqrt{2}", True),
    ("\\frac{\\pi}{2}", "\\pi/2", True),
    ("x^2 + 2x + 1", "(x+1)^2", True),
    ("2x", "x \\cdot 2", True),
    ("(1, 2)", "(1,2)", True),
    ("(1, 2)", "(2, 1)", False),
    ("\\sqrt{2}", "1.41421356", False),       # no rounding
    ("x^2", "2x", False),
    ("\\frac{x}{2}", "0.5x", True),
])
def test_symbolic_answers(a, b, equal):
    assert answers_match(a, b) is equal


def test_unparseable_text_compares_as_normalised_string():
    assert answers_match("\\text{ Monday }", "Monday") and not answers_match("Monday", "Tuesday")
    assert not answers_match(None, "5") and not answers_match("", "")


@pytest.mark.parametrize("completion, want", [
    ("3 + 4 = 7\n#### 7", "7"),
    ("so the answer is \\boxed{\\dfrac{1}{2}}.", "\\dfrac{1}{2}"),
    ("nested \\boxed{\\frac{\\sqrt{3}}{2}} done", "\\frac{\\sqrt{3}}{2}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("The answer is $18.", "$18"),
    ("The answer is 0.5.", "0.5"),
    ("half of 7 is 7/2", "7/2"),
    ("it costs -4 dollars", "-4"),
    ("\\boxed{unclosed and 3", "3"),
    ("no number here", None),
])
def test_extract_answer(completion, want):
    assert extract_answer(completion) == want


def test_references():
    assert reference_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert reference_answer("so $x = \\boxed{\\frac{3}{4}}$.") == "\\frac{3}{4}"  # a MATH solution
    assert reference_answer(" 7 ") == "7"
    assert normalize_answer(" $1,000$ dollars. ") == "1000"


def test_math_correctness_reward():
    completions = ["so \\boxed{\\dfrac12}", "#### 0.5", "I get 1/2", "#### 0.51", "\\boxed{2}", "nothing"]
    refs = ["0.5", "#### 1/2", "\\frac{1}{2}", "#### 1/2", "solution: \\boxed{\\frac{4}{2}}", "0"]
    assert math_correctness(["q"] * 6, completions, answer=refs) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
