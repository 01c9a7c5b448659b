"""Tools shipped with logitless, ready to name in a config's ``tools:`` list.

- :func:`calculator`: evaluates an arithmetic expression (numbers, ``+ - * / // % **``, parentheses),
  parsed with :mod:`ast`, never ``eval``: a model's text cannot run code through it.
- :func:`python`: runs a Python program in a separate interpreter and returns what it printed. The
  program runs in a subprocess (``python -I``: no user site, no environment variables, no current
  directory on the path) in an empty temporary folder, with a wall-clock timeout, a CPU-time and a
  memory limit, and ``socket`` made unusable before the program starts. This keeps a model's
  mistakes (an endless loop, a huge allocation, a stray request) inside the call; it is not a
  security boundary against code written to escape it: run untrusted policies in a container.

Example:
    >>> calculator("1234 + 5678")
    '6912'
    >>> python("print(sum(range(10)))")
    '45\\n'
"""

from __future__ import annotations

import ast
import operator
import os
import subprocess
import sys
import tempfile

__all__ = ["calculator", "python", "run_python"]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
#: The largest exponent ``**`` takes (a model asking for 9**9**9 gets an error, not a hung process).
_MAX_EXPONENT = 1000


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_EXPONENT})")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression and returns its value.

    Args:
        expression: The expression, e.g. "1234 + 5678" or "(3 - 7) * 2 / 5".
    """
    value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


# Runs before the program: no sockets, limits on CPU time and memory (the parent passes them).
_PRELUDE = """
import resource, socket, sys
cpu, memory = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in this sandbox")
socket.socket = socket.create_connection = socket.getaddrinfo = _no_network
del resource, socket, cpu, memory, _no_network
sys.argv = ["program"]
exec(compile(sys.stdin.read(), "program", "exec"), {"__name__": "__main__"})
"""


#: The python tool's limits (not arguments: the model must not choose them).
PYTHON_TIMEOUT_S = 10.0
PYTHON_MEMORY_MB = 1024
PYTHON_MAX_OUTPUT_CHARS = 4000


def python(code: str) -> str:
    """Runs a Python program and returns what it printed (standard output, then standard error).

    Args:
        code: The program's source; print the values you need.
    """
    return run_python(code, PYTHON_TIMEOUT_S, PYTHON_MEMORY_MB, PYTHON_MAX_OUTPUT_CHARS)


def run_python(code: str, timeout_s: float, memory_mb: int, max_output_chars: int) -> str:
    """:func:`python` with explicit limits: wall-clock seconds, MiB of memory, characters of output
    returned (the rest is cut, with a note saying how much)."""
    with tempfile.TemporaryDirectory(prefix="logitless-python-") as folder:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", _PRELUDE, str(max(1, int(timeout_s))),
                                   str(int(memory_mb) * 2**20)],
                                  input=code, capture_output=True, text=True, timeout=timeout_s, cwd=folder,
                                  env={"PATH": os.environ.get("PATH", "")})
        except subprocess.TimeoutExpired:
            return f"Error: the program did not finish within {timeout_s:g} s."
    out = done.stdout + (done.stderr if done.returncode or done.stderr else "")
    if len(out) > max_output_chars:
        out = out[:max_output_chars] + f"\n... ({len(out) - max_output_chars} more characters cut)"
    return out
