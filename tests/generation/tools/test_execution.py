"""Tools that raise, hang past their timeout or return non-text become tool messages and counted
errors; so do malformed calls and failing environments. Nothing stops the rollout."""

import threading
import time

import pytest

from logitless.datasets import tiny_qwen2_5_tokenizer
from logitless.generation.tools import CHAT_FORMATS, ToolCall, ToolChat, ToolExecutor, tool_schema
from logitless.generation.tools.environment import ToolEnvironment
from logitless.generation.tools.session import TurnSession

RELEASE = threading.Event()  # lets the hung tool's thread finish when the test module ends


def add(a: int, b: int) -> str:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b)


def explode(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ZeroDivisionError(f"cannot divide {x} by zero")


def hang(x: int) -> str:
    """Never answers in time.

    Args:
        x: Anything.
    """
    RELEASE.wait(30)
    return "late"


def count(x: int) -> int:
    """Returns a number instead of text.

    Args:
        x: Anything.
    """
    return x


def slow(x: int) -> str:
    """Takes 0.3 s.

    Args:
        x: Anything.
    """
    time.sleep(0.3)
    return str(x)


@pytest.fixture(scope="module", autouse=True)
def _release_hung_threads():
    yield
    RELEASE.set()


TOOLS = [add, explode, hang, count, slow]


def test_every_failure_is_a_tool_message_with_its_kind():
    executor = ToolExecutor(TOOLS, timeout_s=0.2)
    started = time.perf_counter()
    out = executor.run([ToolCall("add", {"a": 2, "b": 3}), ToolCall("explode", {"x": 7}), ToolCall("hang", {"x": 1}),
                        ToolCall("count", {"x": 4}), ToolCall("nope", {}), ToolCall("add", {"a": 1})])
    assert time.perf_counter() - started < 2.0  # the hung call is abandoned at its timeout
    assert [o.error for o in out] == [None, "raised", "timeout", "not_text", "unknown_tool", "bad_arguments"]
    assert out[0].content == "5"
    assert out[1].content == "Error: explode raised ZeroDivisionError: cannot divide 7 by zero"
    assert out[2].content == "Error: hang did not answer within 0.2 s."
    assert out[3].content == "Error: count returned int, not text."
    assert out[4].content.startswith("Error: there is no tool named 'nope'")
    assert "missing a required argument: 'b'" in out[5].content


def test_calls_of_a_turn_run_concurrently():
    executor = ToolExecutor([slow], timeout_s=5.0)
    started = time.perf_counter()
    out = executor.run([ToolCall("slow", {"x": i}) for i in range(4)])
    assert [o.content for o in out] == ["0", "1", "2", "3"]
    assert time.perf_counter() - started < 1.0  # 4 x 0.3 s in sequence would be 1.2 s


def test_bad_executor_arguments():
    with pytest.raises(ValueError, match="timeout_s must be a number > 0"):
        ToolExecutor([add], timeout_s=0)
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolExecutor([add, add])


def _chat():
    tokenizer = tiny_qwen2_5_tokenizer()
    return tokenizer, ToolChat(CHAT_FORMATS["qwen2_5"], tokenizer, tools=[tool_schema(f) for f in TOOLS])


ROW = {"prompt_messages": [{"role": "user", "content": "Try every tool."}]}


def test_a_turn_of_failing_calls_continues_the_conversation():
    tokenizer, chat = _chat()
    executor = ToolExecutor(TOOLS, timeout_s=0.2)
    session = TurnSession(chat, lambda: ToolEnvironment(executor), [ROW], num_generations=1, max_turns=3,
                          stop_ids=[tokenizer.eos_id])
    calls = ['{"name": "add", "arguments": {"a": 2, "b": 3}}', '{"name": "explode", "arguments": {"x": 1}}',
             '{"name": "hang", "arguments": {"x": 1}}', '{"name": "count", "arguments": {"x": 1}}',
             '{"name": "add", "arguments": {"a": 2,,}}']
    text = "".join(f"<tool_call>\n{c}\n</tool_call>\n" for c in calls).rstrip()
    session.end_turn(0, chat.encode(text) + [tokenizer.eos_id])
    ids = session.continuation(0, room=1000)
    assert ids is not None
    rendered = tokenizer.decode(ids, skip_special_tokens=False)
    answers = [m["content"] for m in session.trajectories[0].messages if m["role"] == "tool"]
    assert answers[0] == "5" and answers[1].startswith("Error: explode raised ZeroDivisionError")
    assert answers[2].startswith("Error: hang did not answer") and answers[3].startswith("Error: count returned int")
    assert answers[4].startswith("Error: tool call 5 is not valid JSON")
    assert all(f"<tool_response>\n{a}\n</tool_response>" in rendered for a in answers)
    assert rendered.endswith("<|im_start|>assistant\n")
    traj = session.trajectories[0]
    assert (traj.turns, traj.tool_calls, traj.tool_errors, traj.environment_errors) == (1, 5, 4, 0)
    # a continuation longer than the room left ends the trajectory, marked as cut by the budget
    session.end_turn(0, chat.encode(text) + [tokenizer.eos_id])
    assert session.continuation(0, room=len(ids)) is None and traj.out_of_budget


class BrokenEnvironment:
    def __init__(self, mode):
        self.mode = mode

    def reset(self, row):
        return list(row["prompt_messages"])

    def step(self, messages):
        if self.mode == "raise":
            raise RuntimeError("the game crashed")
        if self.mode == "hang":
            RELEASE.wait(30)
        return "not a triple"


@pytest.mark.parametrize("mode, error", [("raise", "environment step raised RuntimeError: the game crashed"),
                                         ("hang", "environment step timed out after 0.2 s"),
                                         ("bad", "environment step raised TypeError: environment.step must return")])
def test_a_failing_environment_ends_its_trajectory_only(mode, error):
    tokenizer, chat = _chat()
    session = TurnSession(chat, lambda: BrokenEnvironment(mode), [ROW], num_generations=2, max_turns=3,
                          stop_ids=[tokenizer.eos_id], step_timeout_s=0.2)
    for row in range(2):
        session.end_turn(row, chat.encode("hello") + [tokenizer.eos_id])
    assert [session.continuation(row, room=100) for row in range(2)] == [None, None]
    for traj in session.trajectories:
        assert traj.environment_errors == 1 and traj.info["error"].startswith(error)


def test_group_rows_must_share_their_prompt():
    _, chat = _chat()
    counter = iter(range(10))

    class Drifting:
        def reset(self, row):
            return [{"role": "user", "content": f"variant {next(counter)}"}]

        def step(self, messages):
            return [], True, {}

    with pytest.raises(ValueError, match="different prompts"):
        TurnSession(chat, Drifting, [ROW], num_generations=2, max_turns=2)
