"""tool_schema equals transformers' get_json_schema (what apply_chat_template(tools=[fn]) renders)."""

import enum
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import pytest

from logitless.generation.tools import ToolSchemaError, tool_schema

get_json_schema = pytest.importorskip("transformers.utils").get_json_schema


def add(a: int, b: int) -> str:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum, as text.
    """
    return str(a + b)


def search(query: str, limit: int = 10, lang: Optional[str] = None, tags: List[str] = None,
           exact: bool = False) -> List[Dict[str, Any]]:
    """Searches a document collection and returns
    the best matches.

    Args:
        query: The text to look for; it may span
            several lines of description.
        limit: How many results to return.
        lang (str): The language (choices: ["en", "fr"])
        tags: Tags every result must carry.
        exact: Match the whole query only.

    Raises:
        ValueError: on an empty query.
    """
    return []


class Unit(enum.Enum):
    CELSIUS = "c"
    FAHRENHEIT = "f"


def weather(city: str, unit: Unit, days: Literal[1, 3, 7] = 1, box: Tuple[float, float] = (0.0, 0.0),
            extra: Dict[str, int] = None, value: Union[int, str, None] = None, anything: Any = None,
            mixed: Union[int, List[str]] = 0) -> object:
    """Weather forecast.

    Args:
        city: City name.
        unit: Temperature unit.
        days: Forecast length in days.
        box: A bounding box.
        extra: Extra integer options.
        value: An id or a name.
        anything: Whatever else.
        mixed: A number or names.
    """
    return None


class Calculator:
    def multiply(self, x: float, y: float) -> float:
        """Multiplies two numbers.

        Args:
            x: The first factor.
            y: The second factor.
        Returns:
            The product.
        """
        return x * y


@pytest.mark.parametrize("fn", [add, search, weather, Calculator().multiply, Calculator.multiply],
                         ids=["add", "search", "weather", "bound_method", "method"])
def test_schema_equals_transformers(fn):
    assert tool_schema(fn) == get_json_schema(fn)


def _no_doc(a: int):
    return a


def _no_hint(a, b: int):
    """Adds.

    Args:
        a: first.
        b: second.
    """


def _undocumented(a: int, b: int):
    """Adds.

    Args:
        a: first.
    """


def _custom_class(a: Calculator):
    """Uses a calculator.

    Args:
        a: the calculator.
    """


@pytest.mark.parametrize("fn, words", [(_no_doc, "no docstring"), (_no_hint, "'a' has no type hint"),
                                       (_undocumented, "description of argument 'b'"),
                                       (_custom_class, "cannot write the type hint")])
def test_bad_tools_name_the_tool_and_argument(fn, words):
    with pytest.raises(ToolSchemaError, match=fn.__name__) as e:
        tool_schema(fn)
    assert words in str(e.value)
