"""Tools and environments from a recipe's YAML: the keys, their checks, and what they build.

.. code-block:: yaml

    tools:                                   # callables the model may call, by dotted path
      - logitless.generation.tools.builtin.calculator
    environment: null                        # or {_component_: my_pkg.Game, <its arguments>}
    multi_turn:
      max_turns: 4                           # model turns per trajectory
      tool_timeout_s: 10                     # per tool call
      step_timeout_s: 60                     # per environment step
      chat_format: auto                      # qwen2_5 | qwen3 | llama3 (auto: the tokenizer's family)
      segment_prefill_tokens: auto           # a tool answer this long or longer: one forward (null: never;
                                             # auto: the sampler's own, 128 eager, 1024 compiled)

``tools`` alone: every trajectory starts from its row's chat messages and each turn's calls are run
(:class:`~logitless.generation.tools.environment.ToolEnvironment`). ``environment`` names a class
built once per trajectory with the given arguments; ``tools`` then only says which schemas the
prompt shows. Either one turns multi-turn rollouts on; ``generation.max_new_tokens`` is then the
budget of each whole trajectory after its prompt (the model's tokens and the appended ones).

:func:`check_turn_config` checks all of it before anything is built (every tool imports and has a
schema, the environment class has ``reset`` and ``step``, the settings are in range), each error
naming its key; :func:`build_tool_turns` builds the run's :class:`ToolTurns`.

Example:
    >>> check_turn_config(cfg)                           # ConfigError naming the key
    >>> turns = build_tool_turns(cfg, tokenizer)         # None without tools and environment
    >>> session = turns.session(rows, num_generations=8)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from logitless.generation.tools.chat_format import CHAT_FORMATS, ToolChat, chat_format_for
from logitless.generation.tools.environment import ToolEnvironment, check_environment_class
from logitless.generation.tools.execution import ToolExecutor
from logitless.generation.tools.schema import ToolSchemaError, tool_schema
from logitless.generation.tools.session import TurnSession
from logitless.training.config import ConfigError, Key, resolve_component

__all__ = ["TURN_KEYS", "ToolTurns", "TurnSettings", "build_tool_turns", "check_turn_config", "load_tools",
           "uses_turns"]


@dataclass(frozen=True)
class TurnSettings:
    """The ``multi_turn`` block.

    Attributes:
        max_turns (int): model turns per trajectory (>= 1).
        tool_timeout_s (float): seconds a tool call may take.
        step_timeout_s (float): seconds an environment step may take.
        chat_format (str): ``"auto"`` or a key of :data:`~logitless.generation.tools.chat_format.CHAT_FORMATS`.
        segment_prefill_tokens (Union[str, int, None]): a continuation (tool answer and chat headers) of
            at least this many tokens goes into its row's cache in one forward; shorter ones are fed one
            token per decode step (None: always fed; ``"auto"``: the sampler's own default,
            :data:`~logitless.generation.tools.eager.DEFAULT_SEGMENT_PREFILL_TOKENS` for the eager one,
            :data:`~logitless.generation.tools.compiled.COMPILED_SEGMENT_PREFILL_TOKENS` for the compiled one).
    """

    max_turns: int = 4
    tool_timeout_s: float = 10.0
    step_timeout_s: float = 60.0
    chat_format: str = "auto"
    segment_prefill_tokens: Union[str, int, None] = "auto"


TURN_KEYS: Dict[str, Key] = {
    "tools": Key((list, None), default=None, doc="dotted paths of the functions the model may call"),
    "environment": Key((None,), default=None, component=True,
                       doc="a class with reset(row) -> messages and step(messages) -> (messages, done, info)"),
    "multi_turn": Key(object, default=None,
                      doc="{max_turns, tool_timeout_s, step_timeout_s, chat_format, segment_prefill_tokens} of "
                          "tool / environment turns"),
}


def load_tools(paths: Sequence[str], key: str = "tools") -> List[Callable]:
    """Imports the tools named by dotted paths and checks each has a JSON schema and a unique name.

    Args:
        paths (Sequence[str]): dotted import paths.
        key (str): the config key, for messages.

    Returns:
        List[Callable]: the tools.

    Raises:
        ConfigError: naming ``key[i]``: not a string, not importable, not callable, no schema (a
            missing docstring or type hint), or a name used twice.

    Example:
        >>> [t.__name__ for t in load_tools(["logitless.generation.tools.builtin.calculator"])]
        ['calculator']
    """
    tools, names = [], {}
    for i, path in enumerate(paths):
        where = f"{key}[{i}]"
        if not isinstance(path, str) or not path:
            raise ConfigError(f"config key {where!r}: expected a dotted path to a function, got {path!r}")
        fn = resolve_component(path, where)
        if not callable(fn):
            raise ConfigError(f"config key {where!r}: {path} is a {type(fn).__name__}, not a function")
        try:
            tool_schema(fn)
        except ToolSchemaError as e:
            raise ConfigError(f"config key {where!r}: {e}") from None
        name = fn.__name__
        if name in names:
            raise ConfigError(f"config key {where!r}: {path} is named {name!r} like {key}[{names[name]}]; the model "
                              f"calls tools by name, so names must be unique")
        names[name] = i
        tools.append(fn)
    return tools


def _settings(node: Any) -> TurnSettings:
    raw = {} if node is None else (OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig)
                                   else dict(node))
    known = set(TurnSettings.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"config key 'multi_turn.{unknown[0]}': unknown; allowed {sorted(known)}")
    out = TurnSettings(**raw)
    if isinstance(out.max_turns, bool) or not isinstance(out.max_turns, int) or out.max_turns < 1:
        raise ConfigError(f"config key 'multi_turn.max_turns': expected an int >= 1, got {out.max_turns!r}")
    for name in ("tool_timeout_s", "step_timeout_s"):
        value = getattr(out, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"config key 'multi_turn.{name}': expected a number of seconds > 0, got {value!r}")
    prefill = out.segment_prefill_tokens
    if prefill is not None and prefill != "auto" and (isinstance(prefill, bool) or not isinstance(prefill, int)
                                                      or prefill < 2):
        raise ConfigError(f"config key 'multi_turn.segment_prefill_tokens': expected 'auto', null or an int >= 2, "
                          f"got {prefill!r}")
    if out.chat_format != "auto" and out.chat_format not in CHAT_FORMATS:
        raise ConfigError(f"config key 'multi_turn.chat_format': expected 'auto' or one of {sorted(CHAT_FORMATS)}, "
                          f"got {out.chat_format!r}")
    return out


def uses_turns(cfg: DictConfig) -> bool:
    """Whether the config asks for tool / environment turns (``tools`` or ``environment`` set)."""
    return bool(cfg.get("tools")) or cfg.get("environment") is not None


def check_turn_config(cfg: DictConfig) -> Optional[TurnSettings]:
    """Checks ``tools``, ``environment`` and ``multi_turn`` (see the module docstring).

    Args:
        cfg (DictConfig): the recipe config (its top-level keys already type-checked).

    Returns:
        Optional[TurnSettings]: the settings, or None when the run has no turns.

    Raises:
        ConfigError: naming the key.
    """
    tools = cfg.get("tools")
    if isinstance(tools, ListConfig):
        tools = OmegaConf.to_container(tools, resolve=True)
    if tools is not None and not tools:
        raise ConfigError("config key 'tools': an empty list; name at least one function, or null")
    if not uses_turns(cfg):
        if cfg.get("multi_turn") is not None:
            raise ConfigError("config key 'multi_turn': set, but neither 'tools' nor 'environment' is: there is "
                              "nothing to take turns with")
        return None
    load_tools(tools or [])
    if cfg.get("environment") is not None:
        try:
            check_environment_class(resolve_component(cfg.environment.get("_component_"), "environment"))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return _settings(cfg.get("multi_turn"))


class ToolTurns:
    """What a run's multi-turn rollouts are made of: the chat, the tools and the environments.

    Args:
        chat (ToolChat): the chat format bound to the tokenizer and the tool schemas.
        environment_factory (Callable[[], Any]): one environment per trajectory.
        settings (TurnSettings): ``multi_turn``.
        stop_ids (Sequence[int]): the sampler's stop tokens.
    """

    def __init__(self, chat: ToolChat, environment_factory: Callable[[], Any], settings: TurnSettings,
                 stop_ids: Sequence[int]):
        self.chat, self.environment_factory, self.settings = chat, environment_factory, settings
        self.stop_ids = [int(s) for s in stop_ids]

    def session(self, rows: Sequence[Mapping[str, Any]], num_generations: int) -> TurnSession:
        """The session of one rollout: ``num_generations`` trajectories per row."""
        return TurnSession(self.chat, self.environment_factory, rows, num_generations=num_generations,
                           max_turns=self.settings.max_turns, stop_ids=self.stop_ids,
                           step_timeout_s=self.settings.step_timeout_s)

    def render_prompts(self, dataset: Any, key: str = "dataset") -> Any:
        """``dataset`` with each row's ``prompt_tokens`` / ``prompt`` rendered as the rollout renders
        them (the environment's ``reset`` messages with the tools), so that length checks and logs see
        the real prompt.

        Raises:
            ConfigError: naming ``key`` when a row cannot start a trajectory (no chat messages for the
                tools' environment, or a ``reset`` that fails).
        """
        if dataset is None:
            return None
        rows = getattr(dataset, "rows", None)
        if rows is None:
            raise ConfigError(f"config key {key!r}: tool turns need a prompt dataset whose rows can be re-rendered "
                              f"(logitless.rl.prompts.PromptDataset), got {type(dataset).__name__}")
        for i, row in enumerate(rows):
            try:
                messages = self.environment_factory().reset(row)
                ids, text = self.chat.prompt(messages)
            except Exception as e:  # noqa: BLE001 - named with the row
                raise ConfigError(f"config key {key!r}: row {i} cannot start a trajectory: {type(e).__name__}: "
                                  f"{e}") from e
            row["prompt_tokens"], row["prompt"] = ids, text
        return dataset


def build_tool_turns(cfg: DictConfig, tokenizer: Any, stop_ids: Sequence[int]) -> Optional[ToolTurns]:
    """The run's :class:`ToolTurns`, or None when it has no tools and no environment.

    Args:
        cfg (DictConfig): a config that passed :func:`check_turn_config`.
        tokenizer: the run's tokenizer (its family picks ``chat_format: auto``).
        stop_ids (Sequence[int]): the sampler's stop tokens (they must include the format's end of turn).

    Returns:
        Optional[ToolTurns]: the turns.

    Raises:
        ConfigError: the chat format does not fit the tokenizer, or its end of turn is not a stop token.
    """
    from torchtune import config as tt_config

    settings = check_turn_config(cfg)
    if settings is None:
        return None
    tools = load_tools(OmegaConf.to_container(cfg.tools, resolve=True) if cfg.get("tools") else [])
    try:
        chat = ToolChat(chat_format_for(tokenizer, settings.chat_format), tokenizer,
                        tools=[tool_schema(t) for t in tools])
    except ValueError as e:
        raise ConfigError(f"config key 'multi_turn.chat_format': {e}") from None
    if chat.end_of_turn_id not in set(int(s) for s in stop_ids):
        raise ConfigError(f"config key 'generation.stop_tokens': {list(stop_ids)} does not hold "
                          f"{chat.format.end_of_turn!r} (id {chat.end_of_turn_id}), the end of a model turn in the "
                          f"{chat.format.name} chat format; a turn could never end")
    if cfg.get("environment") is not None:
        factory = functools.partial(tt_config.instantiate, cfg.environment)
    else:
        executor = ToolExecutor(tools, timeout_s=settings.tool_timeout_s)
        factory = functools.partial(ToolEnvironment, executor)
    return ToolTurns(chat, factory, settings, stop_ids)
