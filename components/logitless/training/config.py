"""Config validation: every mistake is reported with its key before any model is built.

A recipe declares its top-level keys as a schema of :class:`Key` entries; :func:`validate_config`
checks types and ranges, fills defaults, rejects unknown keys, resolves every ``_component_`` and
checks its arguments against the callable's signature (names, required arguments, and the types its
annotations state: :func:`check_argument_types`), and checks that the files a component reads exist.
"""

from __future__ import annotations

import collections.abc
import inspect
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

_MISSING = object()

# Arguments of a component that name a file or folder that must exist.
FILE_ARGS = ("path", "merges_file", "special_tokens_path", "checkpoint_dir", "tokenizer_path")
# ``source`` values for which ``data_files`` are local files (HF ``load_dataset`` loader names).
LOCAL_DATASET_LOADERS = ("json", "csv", "parquet", "text", "arrow")


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type, or names something that does not exist."""


@dataclass
class Key:
    """Specification of one top-level config key.

    Args:
        types (type | tuple): accepted Python types (``None`` in the tuple allows null).
        default: value filled in when the key is absent; leave unset for a required key.
        choices (Optional[Sequence]): allowed values.
        min (Optional[float]): inclusive lower bound for numbers.
        component (bool): the value is a node with ``_component_`` (or null if ``None`` in types).
        positional (int): how many leading positional arguments the recipe passes itself when it
            instantiates the component (1 for a dataset's tokenizer, an optimizer's params, an LR
            scheduler's optimizer); they are not required in the config.
        supplied (Tuple[str, ...]): keyword arguments the recipe supplies when the config does not
            (e.g. ``num_training_steps`` of an LR scheduler).
        doc (str): what the key means, used in error messages.

    Example:
        >>> Key(int, default=1, min=1, doc="micro-batch size")
    """

    types: Any = object
    default: Any = _MISSING
    choices: Optional[Sequence[Any]] = None
    min: Optional[float] = None
    component: bool = False
    positional: int = 0
    supplied: Tuple[str, ...] = ()
    doc: str = ""

    @property
    def required(self) -> bool:
        return self.default is _MISSING


def _types_tuple(types: Any) -> tuple:
    t = types if isinstance(types, tuple) else (types,)
    return tuple(type(None) if x is None else x for x in t)


def _type_names(types: Any) -> str:
    return " or ".join("null" if x is type(None) else x.__name__ for x in _types_tuple(types))


def _check_value(key: str, spec: Key, value: Any) -> None:
    allowed = _types_tuple(spec.types)
    if spec.component:
        if value is None and type(None) in allowed:
            return
        if not isinstance(value, (DictConfig, Mapping)) or "_component_" not in value:
            raise ConfigError(
                f"config key {key!r}: expected a component (a mapping with '_component_'), got {value!r}"
            )
        return
    if isinstance(value, ListConfig):
        value = OmegaConf.to_container(value)
    if isinstance(value, bool) and bool not in allowed and object not in allowed:
        raise ConfigError(f"config key {key!r}: expected {_type_names(spec.types)}, got {value!r} (bool)")
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        pass  # an int is a fine float
    elif not isinstance(value, allowed):
        raise ConfigError(
            f"config key {key!r}: expected {_type_names(spec.types)}"
            f"{' (' + spec.doc + ')' if spec.doc else ''}, got {value!r} ({type(value).__name__})"
        )
    if spec.choices is not None and value not in spec.choices:
        raise ConfigError(f"config key {key!r}: expected one of {list(spec.choices)}, got {value!r}")
    if spec.min is not None and value is not None and not isinstance(value, bool) and value < spec.min:
        raise ConfigError(f"config key {key!r}: expected a value >= {spec.min}, got {value!r}")


def resolve_component(path: str, key: str) -> Callable:
    """Imports the object named by a dotted ``_component_`` path.

    Args:
        path (str): e.g. ``"torchtune.models.qwen2_5.qwen2_5_0_5b"``.
        key (str): the config key, for the error message.

    Returns:
        Callable: the object.

    Raises:
        ConfigError: naming the key and the path when it cannot be imported.

    Example:
        >>> resolve_component("torch.optim.AdamW", "optimizer")
        <class 'torch.optim.adamw.AdamW'>
    """
    from torchtune.config._utils import _get_component_from_path

    if not isinstance(path, str) or not path:
        raise ConfigError(f"config key '{key}._component_': expected a dotted import path, got {path!r}")
    try:
        return _get_component_from_path(path)
    except Exception as e:  # InstantiationError, ImportError, AttributeError
        raise ConfigError(f"config key '{key}._component_': cannot import {path!r} ({e})") from None


def _check_component(key: str, node: DictConfig, positional: int, supplied: Iterable[str],
                     check_files: bool) -> None:
    obj = resolve_component(node.get("_component_"), key)
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    params = sig.parameters
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    given = [k for k in node.keys() if k != "_component_"]
    if not has_var_kw:
        accepted = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = [k for k in given if k not in accepted]
        if unknown:
            raise ConfigError(
                f"config key '{key}.{unknown[0]}': {node._component_} has no argument {unknown[0]!r}; "
                f"it accepts {sorted(accepted)}"
            )
    pos_params = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_recipe = set(pos_params[:positional]) | set(supplied)
    for n, p in params.items():
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or p.default is not p.empty:
            continue
        if n not in given and n not in by_recipe:
            raise ConfigError(f"config key '{key}.{n}': required by {node._component_} but missing")
    check_argument_types(key, obj, {k: node[k] for k in given})
    if check_files:
        # only arguments the callable declares: a stand-in that swallows a real builder's file
        # arguments in **kwargs (synthetic data) does not read them
        declared = {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD}
        _check_files(key, node, declared)


def _hints(obj: Callable) -> Dict[str, Any]:
    """The resolved annotations of ``obj``'s arguments (a class: of its ``__init__``); {} when they
    cannot be resolved (a forward reference to a name the module does not define)."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        return typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 -- unresolvable annotations: nothing to check against
        return {}


def _expected(hint: Any) -> Optional[Tuple[str, Callable[[Any], bool]]]:
    """(what ``hint`` expects, in words; a test of a plain config value), or None when ``hint`` is not
    one a YAML value can be checked against (a class, a callable, ``Any``): such an argument is left to
    the component."""
    if hint is type(None):
        return "null", lambda v: v is None
    if hint is bool:
        return "a bool", lambda v: isinstance(v, bool)
    if hint is int:
        return "an int", lambda v: isinstance(v, int) and not isinstance(v, bool)
    if hint is float:  # an int is a fine float; a bool is not a number here
        return "a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is str:
        return "a string", lambda v: isinstance(v, str)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return f"one of {list(args)}", lambda v: any(v == a and type(v) is type(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [_expected(a) for a in args]
        if any(p is None for p in parts):
            return None
        return " or ".join(p[0] for p in parts), lambda v: any(p[1](v) for p in parts)
    if origin in (list, tuple, collections.abc.Sequence):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return None  # a fixed-length tuple (e.g. betas): the component checks it
        item = _expected(args[0]) if args else ("anything", lambda v: True)
        if item is None:
            return None
        return f"a list of {item[0]}", lambda v: isinstance(v, (list, tuple)) and all(item[1](x) for x in v)
    return None


def check_argument_types(key: str, component: Callable, values: Mapping[str, Any]) -> None:
    """Checks the config's arguments of a component against the types its signature annotates.

    Only plain annotations are checked: ``int`` (not a bool), ``float`` (an int or a float, not a
    bool), ``bool``, ``str``, ``Literal[...]``, ``Optional`` / unions of these, and lists of them.
    A nested component (a mapping with ``_component_``) and an argument annotated with anything else
    (a class, a callable, ``Any``) are left to the component. YAML reads ``1e-3`` as a string and
    ``True`` as a bool: both are refused where a number is annotated, instead of being used as text
    or as 1.

    Args:
        key (str): the component's config key, for messages.
        component (Callable): the resolved ``_component_``.
        values (Mapping[str, Any]): the arguments the config gives.

    Raises:
        ConfigError: ``config key '<key>.<arg>': <component> expects <type>, got <value> (<type>)``.

    Example:
        >>> check_argument_types("loss", GRPOLoss, {"beta": "abc"})
        Traceback (most recent call last):
        ConfigError: config key 'loss.beta': logitless.losses.grpo.GRPOLoss expects a number, got 'abc' (str)
    """
    hints = _hints(component)
    name = f"{getattr(component, '__module__', '')}.{getattr(component, '__qualname__', component)}"
    for arg, value in values.items():
        if arg not in hints:
            continue
        if isinstance(value, (DictConfig, ListConfig)):
            if isinstance(value, DictConfig) and "_component_" in value:
                continue  # a nested component: instantiate checks it
            value = OmegaConf.to_container(value, resolve=True)
        elif isinstance(value, Mapping) and "_component_" in value:
            continue
        expected = _expected(hints[arg])
        if expected is not None and not expected[1](value):
            raise ConfigError(f"config key '{key}.{arg}': {name} expects {expected[0]}, "
                              f"got {value!r} ({type(value).__name__})")


def _check_files(key: str, node: DictConfig, declared: Optional[set] = None) -> None:
    if declared is not None:
        # data_files goes through **load_dataset_kwargs: checked whenever the callable takes a source
        keep = set(declared) | ({"data_files"} if "source" in declared else set())
        node = {k: v for k, v in node.items() if k in keep}
    for arg in FILE_ARGS:
        v = node.get(arg, None)
        if isinstance(v, str) and v and not os.path.exists(v):
            raise ConfigError(f"config key '{key}.{arg}': {v!r} does not exist")
    ckpt_dir = node.get("checkpoint_dir", None)
    files = node.get("checkpoint_files", None)
    if isinstance(ckpt_dir, str) and files is not None:
        names = list(files.values()) if isinstance(files, (DictConfig, Mapping)) else list(files)
        if isinstance(files, (DictConfig, Mapping)) and {"filename_format", "max_filename"} <= set(files):
            names = []  # torchtune's formatted file list; torchtune validates it
        for f in names:
            if not os.path.exists(os.path.join(ckpt_dir, str(f))):
                raise ConfigError(
                    f"config key '{key}.checkpoint_files': {f!r} not found in checkpoint_dir {ckpt_dir!r}"
                )
    if node.get("source", None) in LOCAL_DATASET_LOADERS:
        data_files = node.get("data_files", None)
        if data_files is None:
            raise ConfigError(f"config key '{key}.data_files': required when source={node['source']!r}")
        flat = [data_files] if isinstance(data_files, str) else (
            list(data_files.values()) if isinstance(data_files, (DictConfig, Mapping)) else list(data_files))
        for f in flat:
            for g in ([f] if isinstance(f, str) else list(f)):
                if "*" not in g and not os.path.exists(g):
                    raise ConfigError(f"config key '{key}.data_files': {g!r} does not exist")


def validate_config(
    cfg: DictConfig,
    schema: Mapping[str, Key],
    *,
    skip_file_checks: Iterable[str] = (),
    extra_allowed: Iterable[str] = (),
) -> DictConfig:
    """Checks ``cfg`` against ``schema`` and fills in defaults (in place).

    Args:
        cfg (DictConfig): the recipe config (after CLI overrides).
        schema (Mapping[str, Key]): allowed top-level keys.
        skip_file_checks (Iterable[str]): component keys whose files are not checked (e.g.
            ``"checkpointer"`` when weights are not loaded).
        extra_allowed (Iterable[str]): further top-level keys tolerated and not checked.

    Returns:
        DictConfig: ``cfg`` itself, with defaults filled.

    Raises:
        ConfigError: naming the first offending key, what was expected and what was received.

    Example:
        >>> validate_config(cfg, {"batch_size": Key(int, default=1, min=1)})
    """
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"config: expected a DictConfig, got {type(cfg).__name__}")
    _check_interpolations(cfg)
    allowed = set(schema) | set(extra_allowed)
    for k in cfg.keys():
        if k not in allowed:
            raise ConfigError(f"config key {k!r}: unknown; allowed top-level keys are {sorted(allowed)}")
    skip = set(skip_file_checks)
    for k, spec in schema.items():
        if k not in cfg or OmegaConf.is_missing(cfg, k):
            if spec.required:
                raise ConfigError(
                    f"config key {k!r}: required ({_type_names(spec.types)}"
                    f"{', ' + spec.doc if spec.doc else ''}) but missing"
                )
            with _open_struct(cfg):
                cfg[k] = spec.default
            continue
        value = cfg[k]
        _check_value(k, spec, value)
        if spec.component and value is not None:
            _check_component(k, value, spec.positional, spec.supplied, check_files=k not in skip)
    return cfg


def _check_interpolations(cfg: DictConfig) -> None:
    # every ${...} must resolve (e.g. ${logitless_asset:NAME} to a bundled file) before anything reads it
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as e:
        reason = str(getattr(e, "msg", e)).split("\n    full_key:")[0]  # omegaconf appends the key again
        raise ConfigError(f"config key '{e.full_key}': cannot be resolved ({reason})") from None


class _open_struct:
    def __init__(self, cfg: DictConfig):
        self.cfg, self.was = cfg, OmegaConf.is_struct(cfg)

    def __enter__(self):
        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc):
        OmegaConf.set_struct(self.cfg, self.was)


def config_summary(cfg: DictConfig) -> Dict[str, Any]:
    """Plain-dict copy of ``cfg`` (resolved), for logging and for the checkpoint.

    Args:
        cfg (DictConfig): the config.

    Returns:
        Dict[str, Any]: the resolved container.

    Example:
        >>> config_summary(OmegaConf.create({"a": 1}))
        {'a': 1}
    """
    return OmegaConf.to_container(cfg, resolve=True)


__all__ = ["ConfigError", "Key", "validate_config", "resolve_component", "config_summary",
           "check_argument_types", "FILE_ARGS", "LOCAL_DATASET_LOADERS"]
