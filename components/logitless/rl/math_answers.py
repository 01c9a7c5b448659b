"""Math answer checking: find a final answer in a completion and decide whether it equals a reference.

Two answers are equal when, after normalisation (``$``, ``\\text{...}``, trailing unit words,
thousands separators, ``\\dfrac`` / ``\\tfrac``, ``\\left`` / ``\\right``, spacing commands, a
trailing ``%`` or degree sign), they are the same string, the same exact rational number
(``0.5 == 1/2 == \\frac{1}{2} == \\dfrac12``; no rounding: ``0.33 != 1/3``), or sympy proves their
difference zero (``\\sqrt{8} == 2\\sqrt{2}``, ``\\frac{\\pi}{2} == \\pi/2``, tuples element-wise).
LaTeX is converted to sympy syntax by a small rewriter (``\\frac``, ``\\sqrt``, ``\\cdot``,
``\\times``, ``^``, ``\\pi``, braces), so no parser beyond sympy (a dependency of torch) is needed;
what it cannot parse is compared as a normalised string only.

Example:
    >>> answers_match(extract_answer("... so the answer is \\\\boxed{\\\\dfrac12}."), "0.5")
    True
"""

import re
from fractions import Fraction
from typing import Any, Optional, Union

__all__ = ["answers_match", "extract_answer", "extract_boxed", "normalize_answer", "parse_answer",
           "reference_answer"]

# A plain number: optional sign, thousands groups "1,234,567" or plain digits, optional decimals.
_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_NUM_RE = re.compile(rf"^(?:{_NUM})$")
_FRACTION_RE = re.compile(rf"^({_NUM})\s*/\s*({_NUM})$")
_ANY_NUMBER_RE = re.compile(rf"(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?")
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.+?)\s*(?:\.(?:\s|$)|\n|$)", re.IGNORECASE)
# "<number> <words>" ("5 dollars", "12 cm."): the number; a unit never makes an answer wrong.
# A single letter right after the number ("2x") is a variable, not a unit.
_NUMBER_WITH_UNITS_RE = re.compile(
    rf"^({_NUM}(?:\s*/\s*{_NUM})?)(?:\s+[A-Za-z]+\.?|[A-Za-z]{{2,}}\.?)(?:\s+[A-Za-z]+\.?)*\s*$")
_MAX_SYMPY_CHARS = 120  # sympy on long or adversarial strings can take seconds; compare those as strings


def extract_boxed(text: str) -> Optional[str]:
    """Contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; ``\\boxed 5`` too.

    Args:
        text (str): a completion or a MATH solution.

    Returns:
        Optional[str]: the contents, or None when there is no complete box.

    Example:
        >>> extract_boxed("so x = \\\\boxed{\\\\frac{1}{2}}.")
        '\\\\frac{1}{2}'
    """
    boxed, fbox = text.rfind("\\boxed"), text.rfind("\\fbox")
    if max(boxed, fbox) < 0:
        return None
    rest = text[boxed + len("\\boxed"):] if boxed > fbox else text[fbox + len("\\fbox"):]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):  # "\boxed 5"
        m = re.match(r"\s*([^\s$]+)", rest)
        return m.group(1) if m else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for j, ch in enumerate(rest):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return rest[1:j]
    return None


def extract_answer(completion: str) -> Optional[str]:
    """The final answer of a completion, as text: after the last ``####``, else the last ``\\boxed{}``,
    else after the last "answer is" / "answer:", else the last number (``3/4`` included).

    Args:
        completion (str): generated text.

    Returns:
        Optional[str]: the answer's text (not normalised), or None when there is none.

    Example:
        >>> extract_answer("3 + 4 = 7 apples, then half: 7/2")
        '7/2'
    """
    found = _HASH_RE.findall(completion)
    if found and found[-1].strip():
        return found[-1].strip()
    boxed = extract_boxed(completion)
    if boxed is not None:
        return boxed
    found = _ANSWER_IS_RE.findall(completion)
    if found:
        return found[-1]
    numbers = _ANY_NUMBER_RE.findall(completion)
    return numbers[-1] if numbers else None


def reference_answer(reference: Any) -> str:
    """The answer inside a reference field: after ``####`` (GSM8K), else in the last ``\\boxed{}``
    (a MATH solution), else the whole field.

    Example:
        >>> reference_answer("48/2 = 24 clips ... #### 72")
        '72'
    """
    text = str(reference)
    found = _HASH_RE.findall(text)
    if found and found[-1].strip():
        return found[-1].strip()
    boxed = extract_boxed(text)
    return boxed if boxed is not None else text.strip()


def _strip_text_commands(s: str) -> str:
    # \text{ dollars} / \mbox{cm} / \textbf{5}: keep the contents (units are dropped later)
    return re.sub(r"\\(?:text|textbf|textrm|mathrm|mbox|operatorname)\s*\{([^{}]*)\}", r" \1 ", s)


def normalize_answer(answer: str) -> str:
    """A canonical text form of an answer (see the module docstring for what is removed).

    Example:
        >>> normalize_answer(" $1,000$ dollars. ")
        '1000'
    """
    s = _strip_text_commands(str(answer))
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\(?:left|right|displaystyle)\b", "", s)
    s = re.sub(r"\\[,;:! ]", "", s).replace("~", " ")
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)
    s = s.replace("\\%", "%").strip().rstrip(".").strip()
    if s.endswith("%"):
        s = s[:-1].strip()
    m = _NUMBER_WITH_UNITS_RE.match(s)
    if m:
        s = m.group(1)
    if _NUM_RE.match(s) or _FRACTION_RE.match(s):
        s = s.replace(",", "").replace(" ", "")
    return re.sub(r"\s+", " ", s).strip()


def _latex_to_sympy_syntax(s: str) -> str:
    # \frac12 -> \frac{1}{2}; \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt\s*(\d+|[a-zA-Z])", r"\\sqrt{\1}", s)
    for _ in range(8):  # nested fractions, innermost first
        new = re.sub(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"((\1)/(\2))", s)
        new = re.sub(r"\\sqrt\s*\{([^{}]*)\}", r"sqrt(\1)", new)
        if new == s:
            break
        s = new
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/").replace("\\pi", "pi")
    s = s.replace("\\infty", "oo").replace("^", "**").replace("{", "(").replace("}", ")")
    return s


def parse_answer(answer: str) -> Union[Fraction, Any, None]:
    """The value of a normalised answer: an exact ``Fraction`` for numbers and ``a/b``, else a sympy
    expression (LaTeX rewritten to sympy syntax), else None.

    Example:
        >>> parse_answer("\\\\frac{3}{4}")
        Fraction(3, 4)
    """
    s = normalize_answer(answer)
    if _NUM_RE.match(s):
        return Fraction(s.replace(",", ""))
    m = _FRACTION_RE.match(s)
    if m:
        den = Fraction(m.group(2).replace(",", ""))
        return Fraction(m.group(1).replace(",", "")) / den if den else None
    if not s or len(s) > _MAX_SYMPY_CHARS:
        return None
    converted = _latex_to_sympy_syntax(s)
    if "\\" in converted:
        return None  # LaTeX the rewriter does not know
    try:
        from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application, parse_expr,
                                                standard_transformations)

        expr = parse_expr(converted, transformations=standard_transformations + (
            implicit_multiplication_application, convert_xor), evaluate=True)
    except Exception:  # sympy raises many types on text it cannot read
        return None
    if getattr(expr, "is_Rational", False):
        return Fraction(int(expr.p), int(expr.q))
    return expr


def _values_equal(a: Any, b: Any) -> bool:
    import sympy

    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    a = sympy.Rational(a.numerator, a.denominator) if isinstance(a, Fraction) else a
    b = sympy.Rational(b.numerator, b.denominator) if isinstance(b, Fraction) else b
    if isinstance(a, tuple) or isinstance(b, tuple) or isinstance(a, sympy.Tuple) or isinstance(b, sympy.Tuple):
        if not (isinstance(a, (tuple, sympy.Tuple)) and isinstance(b, (tuple, sympy.Tuple)) and len(a) == len(b)):
            return False
        return all(_values_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0)
    except Exception:  # incomparable objects (a set and a number...)
        return False


def answers_match(predicted: Optional[str], reference: Any) -> bool:
    """Whether a predicted answer equals a reference answer (see the module docstring).

    Args:
        predicted (Optional[str]): the model's answer text (e.g. from :func:`extract_answer`); None is wrong.
        reference (Any): the reference answer text (already extracted, e.g. by :func:`reference_answer`).

    Returns:
        bool: equal as normalised strings, exact numbers or sympy expressions.

    Example:
        >>> answers_match("1,000", "1000"), answers_match("0.33", "1/3")
        (True, False)
    """
    if predicted is None:
        return False
    p, r = normalize_answer(predicted), normalize_answer(str(reference))
    if not p:
        return False
    if p == r:
        return True
    a, b = parse_answer(p), parse_answer(r)
    if a is None or b is None:
        return False
    return _values_equal(a, b)
