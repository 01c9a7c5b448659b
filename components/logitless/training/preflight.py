"""Checks that run before the model is built: values torch would reject late, the device, and the
lengths of the training rows against the model's ``max_seq_len``.

:func:`validate_config` checks types, ranges and components; this module checks what needs a
little more than the config's shape (:func:`check_components` runs the config checks in order): the
optimizer's numeric arguments (torch rejects them only when the optimizer is built, after the
model), the LR schedule's (built on a one-parameter stand-in optimizer), the loss (built: a loss holds
no weights, so its own validation runs in microseconds), the LoRA arguments (module names from the
model family's list), the checkpointer's ``model_type``, ``max_seq_len`` limits, whether the device
exists on this machine, the model's limits (read from a parameter-free ``meta``-device build of the
configured builder, which costs no memory), and every SFT row's length, with a count of what is
truncated or dropped.

Example:
    >>> check_device("cuda")            # on a machine without CUDA
    Traceback (most recent call last):
    ConfigError: config key 'device': 'cuda', but CUDA is not available on this machine ...
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset

from logitless.training.config import ConfigError, resolve_component

#: What a recipe does with a row longer than the model (or tokenizer) ``max_seq_len`` (``on_too_long``).
ON_TOO_LONG = ("truncate", "drop", "error")


# ----------------------------------------------------------------------------- config values
def check_device(device: str, key: str = "device", *, available: bool = True) -> None:
    """Raises ConfigError unless ``device`` is ``auto``, ``cpu``, or a CUDA device this machine has.

    Args:
        device (str): ``"auto" | "cpu" | "cuda" | "cuda:N"``.
        key (str): the config key, for the message.
        available (bool): also require the device on this machine (False: the spelling only, for
            validating a GPU config on a CPU machine; a recipe checks both before it builds anything).

    Raises:
        ConfigError: naming the key, the value and what is available.

    Example:
        >>> check_device("cpu")
    """
    if device in ("auto", "cpu"):
        return
    index = None
    if isinstance(device, str) and device.startswith("cuda:"):
        index = device[len("cuda:"):]
        if not index.isdigit():
            index = "bad"
    if not isinstance(device, str) or (device != "cuda" and index in (None, "bad")):
        raise ConfigError(f"config key {key!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if not available:
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"config key {key!r}: {device!r}, but CUDA is not available on this machine "
                          f"(torch {torch.__version__}); expected 'cpu' or 'auto'")
    if index is not None and int(index) >= torch.cuda.device_count():
        raise ConfigError(f"config key {key!r}: {device!r}, but this machine has {torch.cuda.device_count()} "
                          f"CUDA device(s); expected cuda:0 to cuda:{torch.cuda.device_count() - 1}")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# argument -> (what is expected, test); checked only where the optimizer takes the argument
_OPTIMIZER_ARGS = {
    "lr": ("a finite number >= 0", lambda v: _finite(v) and v >= 0),
    "eps": ("a finite number > 0", lambda v: _finite(v) and v > 0),
    "weight_decay": ("a finite number >= 0", lambda v: _finite(v) and v >= 0),
    "momentum": ("a finite number >= 0", lambda v: _finite(v) and v >= 0),
    "betas": ("two numbers, each in [0, 1)",
              lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_finite(b) and 0 <= b < 1 for b in v)),
}


def check_optimizer(node: Optional[DictConfig], key: str = "optimizer") -> None:
    """Checks the optimizer's numeric arguments that the config sets (lr, betas, eps, weight_decay,
    momentum), which torch would reject only once the model is built, without naming the key.

    Args:
        node (Optional[DictConfig]): the ``optimizer`` component node (already validated by
            :func:`validate_config`, so every argument it holds exists in the optimizer).
        key (str): the config key, for the message.

    Raises:
        ConfigError: naming ``optimizer.<arg>``, the value and what was expected.

    Example:
        >>> check_optimizer(OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": -1e-3}))
        Traceback (most recent call last):
        ConfigError: config key 'optimizer.lr': expected a finite number >= 0, got -0.001
    """
    if node is None:
        return
    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    for arg, (expected, ok) in _OPTIMIZER_ARGS.items():
        v = values.get(arg)
        if v is None or isinstance(v, torch.Tensor):  # a tensor lr is torch's own feature
            continue
        if not ok(v):
            raise ConfigError(f"config key '{key}.{arg}': expected {expected}, got {v!r}")


def _values(node: Any) -> Dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def _builder_error(key: str, node: Any, e: BaseException) -> ConfigError:
    """A component's own error at construction as a ConfigError naming the argument it is about.

    Our components (and torch's) start their messages with the argument's name ("beta must be a
    number >= 0, got 'abc'"); the key is then ``<key>.<argument>``, else the component's key.
    """
    msg = str(e) or type(e).__name__
    given = [k for k in _values(node) if k != "_component_"]
    first = re.match(r"\W*([A-Za-z_]\w*)", msg)
    where = f"{key}.{first.group(1)}" if first and first.group(1) in given else key
    return ConfigError(f"config key {where!r} ({node.get('_component_')}): {msg}")


def _needed_inputs(loss_class: type) -> List[str]:
    """Arguments of ``loss_class.normalised_loss`` after (outputs, labels, total) that have no default."""
    params = list(inspect.signature(loss_class.normalised_loss).parameters.values())[4:]  # self, outputs, labels, total
    return [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _losses_for(expected: type, inputs: Optional[Sequence[str]]) -> List[str]:
    """The ``logitless.losses`` classes a recipe can run: ``expected`` ones that need no other inputs."""
    import logitless.losses as losses

    found = [getattr(losses, n) for n in losses.__all__]
    return [f"logitless.losses.{c.__name__}" for c in found
            if inspect.isclass(c) and issubclass(c, expected) and not inspect.isabstract(c)
            and (inputs is None or set(_needed_inputs(c)) <= set(inputs))]


def check_loss(node: DictConfig, key: str = "loss", *, expected: type,
               inputs: Optional[Sequence[str]] = None) -> None:
    """Builds the loss component once, before the model, so its own argument checks run then.

    A loss holds no weights: building it costs microseconds. Its arguments' types were checked
    against its signature by :func:`~logitless.training.config.validate_config`; here its own
    validation (ranges, choices, combinations) runs, and the result must be an ``expected`` loss whose
    ``normalised_loss`` needs no input the recipe does not give it.

    Args:
        node (DictConfig): the ``loss`` component node.
        key (str): its config key.
        expected (type): the loss class the recipe drives (``logitless.losses.StepLoss`` for SFT,
            ``GRPOLoss`` for GRPO).
        inputs (Optional[Sequence[str]]): the keyword inputs the recipe passes ``normalised_loss``
            besides ``(outputs, labels, total)`` (SFT: none; None: not checked).

    Raises:
        ConfigError: naming ``loss.<argument>`` (or ``loss._component_``), the value and what was expected.

    Example:
        >>> check_loss(OmegaConf.create({"_component_": "logitless.losses.GRPOLoss", "loss_type": "foo"}),
        ...            expected=GRPOLoss)
        Traceback (most recent call last):
        ConfigError: config key 'loss.loss_type' (logitless.losses.GRPOLoss): loss_type must be one of ...
    """
    from torchtune import config as tt_config

    try:
        with warnings.catch_warnings():  # a deprecation warns once, when the recipe builds the loss
            warnings.simplefilter("ignore")
            loss = tt_config.instantiate(node)
    except (ValueError, TypeError, ArithmeticError) as e:
        raise _builder_error(key, node, e) from e
    expected_names = f"expected one of {_losses_for(expected, inputs)}"
    if not isinstance(loss, expected):
        raise ConfigError(f"config key '{key}._component_': {node._component_} builds a {type(loss).__name__}, "
                          f"not a {expected.__module__}.{expected.__name__}; {expected_names}")
    missing = [n for n in _needed_inputs(type(loss)) if inputs is not None and n not in inputs]
    if missing:
        raise ConfigError(f"config key '{key}._component_': {node._component_} needs {missing} at every step, which "
                          f"this recipe does not have; {expected_names}")


# argument -> (what is expected, test); checked only where the LR schedule takes the argument
_SCHEDULER_ARGS = {
    "num_warmup_steps": ("an int >= 0", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "num_training_steps": ("an int >= 1", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
    "num_cycles": ("a finite number", _finite),
    "last_epoch": ("an int >= -1", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= -1),
}


def check_lr_scheduler(node: Optional[DictConfig], key: str = "lr_scheduler", *,
                       num_training_steps: Optional[int] = None) -> None:
    """Checks the LR schedule's step counts and builds it on a one-parameter stand-in optimizer, so
    an argument it rejects (or a schedule that gives a non-finite learning rate) fails before the model.

    Args:
        node (Optional[DictConfig]): the ``lr_scheduler`` component node (None: no schedule).
        key (str): its config key.
        num_training_steps (Optional[int]): what the recipe will pass when the config does not set it
            (None: a stand-in of 1; the real count is known once the data is loaded).

    Raises:
        ConfigError: naming ``lr_scheduler.<argument>``, the value and what was expected.

    Example:
        >>> check_lr_scheduler(OmegaConf.create({"_component_": "torchtune.training.lr_schedulers."
        ...                    "get_cosine_schedule_with_warmup", "num_warmup_steps": -5}))
        Traceback (most recent call last):
        ConfigError: config key 'lr_scheduler.num_warmup_steps': expected an int >= 0, got -5
    """
    if node is None:
        return
    from torchtune import config as tt_config

    values = _values(node)
    for arg, (expected, ok) in _SCHEDULER_ARGS.items():
        if arg in values and not ok(values[arg]):
            raise ConfigError(f"config key '{key}.{arg}': expected {expected}, got {values[arg]!r}")
    params = inspect.signature(resolve_component(node._component_, key)).parameters
    extra = {"num_training_steps": num_training_steps or 1} if (
        "num_training_steps" in params and "num_training_steps" not in values) else {}
    stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    try:
        tt_config.instantiate(node, stand_in, **extra)
    except (ValueError, TypeError, ArithmeticError) as e:
        raise _builder_error(key, node, e) from e
    lr = stand_in.param_groups[0]["lr"]
    if not (isinstance(lr, float) and math.isfinite(lr) and lr >= 0):
        raise ConfigError(f"config key {key!r} ({node._component_}): gives a learning-rate factor of {lr!r} at step 0; "
                          f"expected a finite number >= 0")


def lora_module_names(builder: Any) -> Tuple[str, ...]:
    """The attention projections a LoRA builder can adapt: the ``Literal`` its ``lora_attn_modules``
    annotation lists (torchtune's builders), else torchtune's ``LORA_ATTN_MODULES``.

    Example:
        >>> lora_module_names(torchtune.models.qwen2_5.lora_qwen2_5_0_5b)
        ('q_proj', 'k_proj', 'v_proj', 'output_proj')
    """
    from torchtune.modules.peft import LORA_ATTN_MODULES

    try:
        hint = typing.get_type_hints(builder).get("lora_attn_modules")
    except Exception:  # noqa: BLE001 -- unresolvable annotations: torchtune's list
        hint = None
    args = typing.get_args(hint) if hint is not None else ()
    literal = args[0] if args and typing.get_origin(args[0]) is typing.Literal else LORA_ATTN_MODULES
    return typing.get_args(literal)


def check_lora_model(node: DictConfig, key: str = "model") -> None:
    """Checks a ``lora_*`` model builder's adapter arguments (torchtune builds ``rank 0`` into a
    ZeroDivisionError after the base is loaded, and skips an unknown module name silently).

    Args:
        node (DictConfig): the ``model`` node of a LoRA builder.
        key (str): its config key.

    Raises:
        ConfigError: naming ``model.<argument>``, the value and what was expected.

    Example:
        >>> check_lora_model(OmegaConf.create({"_component_": "logitless.models.lora_qwen2_5_tiny",
        ...                                    "lora_attn_modules": ["bogus"]}))
        Traceback (most recent call last):
        ConfigError: config key 'model.lora_attn_modules': 'bogus' is not a module of ...
    """
    values = _values(node)
    rank = values.get("lora_rank", 1)
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
        raise ConfigError(f"config key '{key}.lora_rank': expected an int >= 1, got {rank!r}")
    alpha = values.get("lora_alpha", 1.0)
    if not (_finite(alpha) and alpha > 0):
        raise ConfigError(f"config key '{key}.lora_alpha': expected a finite number > 0, got {alpha!r}")
    dropout = values.get("lora_dropout", 0.0)
    if not (_finite(dropout) and 0 <= dropout < 1):
        raise ConfigError(f"config key '{key}.lora_dropout': expected a number in [0, 1), got {dropout!r}")
    modules = values.get("lora_attn_modules", [])
    names = lora_module_names(resolve_component(node._component_, key))
    if not isinstance(modules, list):
        raise ConfigError(f"config key '{key}.lora_attn_modules': expected a list of names from {list(names)}, "
                          f"got {modules!r}")
    for m in modules:
        if m not in names:
            raise ConfigError(f"config key '{key}.lora_attn_modules': {m!r} is not a module of "
                              f"{node._component_}; expected names from {list(names)}")
    if not modules and not values.get("apply_lora_to_mlp") and not values.get("apply_lora_to_output"):
        raise ConfigError(f"config key '{key}.lora_attn_modules': [] with apply_lora_to_mlp and apply_lora_to_output "
                          f"off leaves no adapter to train; expected at least one module from {list(names)}")


def check_checkpointer(node: Optional[DictConfig], key: str = "checkpointer") -> None:
    """Checks the checkpointer's ``model_type`` against torchtune's model types (torchtune reads it
    only when it loads, as a bare ``KeyError``).

    Raises:
        ConfigError: naming ``checkpointer.model_type``, the value and the known types.
    """
    if node is None or "model_type" not in node:
        return
    from torchtune.training.checkpointing._utils import ModelType

    model_type = node.model_type
    if model_type not in ModelType.__members__:
        raise ConfigError(f"config key '{key}.model_type': {model_type!r} is not a torchtune model type; expected "
                          f"one of {list(ModelType.__members__)}")


def check_max_seq_len(node: Optional[DictConfig], key: str) -> None:
    """``max_seq_len`` of a tokenizer or model builder must be null or an int >= 1 (a tokenizer cuts
    every row to it: a negative value leaves no token, and a run that trains nothing)."""
    if node is None or "max_seq_len" not in node:
        return
    v = _values(node)["max_seq_len"]
    if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise ConfigError(f"config key '{key}.max_seq_len': expected null or an int >= 1, got {v!r}")


def check_components(cfg: DictConfig, *, loss_class: type, loss_inputs: Optional[Sequence[str]] = None,
                     num_training_steps: Optional[int] = None) -> None:
    """The config checks every recipe runs before it builds anything (after :func:`validate_config`):
    ``device`` spelling, optimizer and LR-schedule values, the loss (built), LoRA arguments,
    the checkpointer's ``model_type``, and the ``max_seq_len`` of tokenizer and model.

    Args:
        cfg (DictConfig): the validated recipe config.
        loss_class (type): the loss class the recipe drives.
        loss_inputs (Optional[Sequence[str]]): what the recipe passes the loss besides outputs, labels and
            the step's counts (:func:`check_loss`).
        num_training_steps (Optional[int]): given to the LR schedule when its config lacks it.

    Raises:
        ConfigError: the first mistake, naming its key, its value and what was expected.
    """
    check_device(cfg.device, available=False)  # the recipe checks that it exists on this machine
    check_optimizer(cfg.optimizer)
    check_lr_scheduler(cfg.get("lr_scheduler"), num_training_steps=num_training_steps)
    check_loss(cfg.loss, expected=loss_class, inputs=loss_inputs)
    if "lora_rank" in cfg.model:
        check_lora_model(cfg.model)
    check_checkpointer(cfg.get("checkpointer"))
    check_max_seq_len(cfg.tokenizer, "tokenizer")
    check_max_seq_len(cfg.model, "model")


# ----------------------------------------------------------------------------- model limits
@dataclass
class ModelLimits:
    """What the configured model accepts, read without allocating its weights.

    Attributes:
        max_seq_len (Optional[int]): the longest sequence its forward takes (None: unknown).
        vocab_size (Optional[int]): rows of its token embedding (None: unknown).
    """

    max_seq_len: Optional[int] = None
    vocab_size: Optional[int] = None


def model_limits(model_node: DictConfig) -> ModelLimits:
    """Builds the configured model on the ``meta`` device (no memory, no initialisation) and reads
    its ``max_seq_len`` and vocabulary size, so the data can be checked against them before the
    real build. A builder that cannot run on ``meta`` gives unknown limits (the real build reports
    its own errors).

    Args:
        model_node (DictConfig): the ``model`` component node.

    Returns:
        ModelLimits: the limits (fields None where unknown).

    Example:
        >>> model_limits(OmegaConf.create({"_component_": "logitless.models.qwen2_5_tiny"}))
        ModelLimits(max_seq_len=1024, vocab_size=2048)
    """
    from torchtune import config as tt_config

    try:
        with torch.device("meta"):
            model = tt_config.instantiate(model_node)
    except Exception:  # noqa: BLE001 -- the real build, moments later, raises with its own message
        return ModelLimits()
    limit = getattr(model, "max_seq_len", None)
    emb = getattr(model, "tok_embeddings", None)
    vocab = getattr(emb, "num_embeddings", None)
    return ModelLimits(limit if isinstance(limit, int) else None, vocab if isinstance(vocab, int) else None)


# ----------------------------------------------------------------------------- datasets
def instantiate_dataset(node: DictConfig, key: str, *args: Any) -> Any:
    """``torchtune.config.instantiate(node, *args)`` for a data component (dataset or tokenizer),
    turning the ValueError / OSError a builder raises on bad data (a missing column, an empty
    prompt, a row of the wrong type, a missing file) into a ConfigError that names the key.

    Args:
        node (DictConfig): the component node.
        key (str): its config key (``"dataset"``, ``"eval_dataset"``, ``"tokenizer"``).
        *args: positional arguments (the tokenizer, for a dataset).

    Returns:
        the built object.

    Raises:
        ConfigError: ``config key '<key>' (<component>): <the builder's message>``.
    """
    from torchtune import config as tt_config

    try:
        return tt_config.instantiate(node, *args)
    except (ValueError, OSError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config key {key!r} ({node.get('_component_')}): {e}") from e


@dataclass
class LengthReport:
    """What the length check did to a dataset, for the log at start.

    Attributes:
        rows (int): rows in the dataset.
        kept (int): rows trained on.
        too_long (int): rows longer than ``limit``.
        truncated (int): too-long rows kept, cut to ``limit`` tokens.
        untrained (int): rows dropped because no trained label is left within ``limit``.
        limit (int): the length limit.
        limit_source (str): where the limit comes from (a config key or the model).
        action (str): the ``on_too_long`` setting.
    """

    rows: int
    kept: int
    too_long: int
    truncated: int
    untrained: int
    limit: Optional[int]
    limit_source: str
    action: str

    def message(self, what: str = "dataset") -> str:
        """One line for the log: counts of rows kept, truncated and dropped."""
        if self.limit is None:
            return f"{what}: {self.rows} rows, no length limit known"
        dropped = self.rows - self.kept
        return (f"{what}: {self.kept} of {self.rows} rows kept; {self.too_long} longer than {self.limit} tokens "
                f"({self.limit_source}), {self.truncated} of them truncated; {dropped} dropped "
                f"({self.untrained} with no trained token within the limit); on_too_long={self.action!r}")


class RowSubset(Dataset):
    """The rows ``indices`` of ``dataset``, each cut to ``max_len`` tokens when that is set.

    Args:
        dataset (Dataset): map-style dataset of ``{"tokens", "labels", ...}`` rows.
        indices (Sequence[int]): rows kept, in order.
        max_len (Optional[int]): cut ``tokens`` and ``labels`` to this length.

    Example:
        >>> RowSubset([{"tokens": [1, 2, 3], "labels": [1, 2, 3]}], [0], max_len=2)[0]["tokens"]
        [1, 2]
    """

    def __init__(self, dataset: Any, indices: Sequence[int], max_len: Optional[int] = None):
        self.dataset, self.indices, self.max_len = dataset, list(indices), max_len

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        row = self.dataset[self.indices[i]]
        return row if self.max_len is None else self.cut(row)

    def cut(self, row: Dict[str, Any]) -> Dict[str, Any]:
        """``row`` cut to ``max_len`` tokens (a subclass cuts other fields)."""
        return {**row, **{k: row[k][:self.max_len] for k in ("tokens", "labels") if k in row}}


@contextlib.contextmanager
def _untruncated(tokenizer: Any):
    """Lets ``tokenizer`` tokenise without its ``max_seq_len`` cut for the scan, so true lengths show."""
    limit = getattr(tokenizer, "max_seq_len", None)
    if limit is None:
        yield
        return
    tokenizer.max_seq_len = None
    try:
        yield
    finally:
        tokenizer.max_seq_len = limit


def _row(dataset: Any, i: int, key: str) -> Dict[str, Any]:
    try:
        return dataset[i]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"config key {key!r}: row {i} cannot be read ({type(e).__name__}: {e})") from e


def fit_sft_dataset(dataset: Any, *, tokenizer: Any, model_max_seq_len: Optional[int], on_too_long: str,
                    ignore_index: int = -100, key: str = "dataset") -> Tuple[Any, Optional[LengthReport]]:
    """Checks every SFT row against the length limit before training, and applies ``on_too_long``.

    The limit is the smaller of ``tokenizer.max_seq_len`` and the model's ``max_seq_len``. Each
    row is tokenised once without the tokenizer's cut (so the true length shows). A row longer
    than the limit is kept and cut to it (``"truncate"``, torchtune's behaviour, now counted),
    dropped (``"drop"``), or refused (``"error"``). A row with no trained label left within the
    limit (its prompt fills it) trains nothing and is dropped in every mode; a dataset with no row
    left is an error. Packed datasets are checked by their pack length only.

    Args:
        dataset: map-style dataset of ``{"tokens", "labels"}`` rows (or torchtune's PackedDataset).
        tokenizer: the recipe's tokenizer (its ``max_seq_len``, if any, is the truncation length).
        model_max_seq_len (Optional[int]): the model's limit (None: unknown).
        on_too_long (str): ``"truncate" | "drop" | "error"``.
        ignore_index (int): label value of untrained positions.
        key (str): the dataset's config key, for messages.

    Returns:
        Tuple[Any, Optional[LengthReport]]: the dataset to train on (the same object when nothing
        changes) and the report (None for a packed dataset).

    Raises:
        ConfigError: a too-long row with ``on_too_long="error"`` (naming the row, its length and the
        limit), a row that cannot be read, or no row left.

    Example:
        >>> ds, report = fit_sft_dataset(rows, tokenizer=tok, model_max_seq_len=1024, on_too_long="drop")
        >>> print(report.message())
    """
    if on_too_long not in ON_TOO_LONG:
        raise ConfigError(f"config key 'on_too_long': expected one of {list(ON_TOO_LONG)}, got {on_too_long!r}")
    from logitless.training.dataloader import is_packed

    tok_limit = getattr(tokenizer, "max_seq_len", None)
    if is_packed(dataset):
        pack = getattr(dataset, "max_seq_len", tok_limit)
        if model_max_seq_len is not None and pack is not None and pack > model_max_seq_len:
            raise ConfigError(f"config key 'tokenizer.max_seq_len': packs of {pack} tokens exceed the model's "
                              f"max_seq_len={model_max_seq_len}; expected at most {model_max_seq_len}")
        return dataset, None
    limits = [(v, s) for v, s in ((tok_limit, "tokenizer.max_seq_len"),
                                  (model_max_seq_len, "the model's max_seq_len")) if isinstance(v, int)]
    limit, source = min(limits) if limits else (None, "")
    if limit is not None and limit < 1:  # a negative cut would slice from the end and keep the rows
        limit_key = source if source == "tokenizer.max_seq_len" else "model.max_seq_len"
        raise ConfigError(f"config key {limit_key!r}: {limit} leaves no token to train on; expected null or an "
                          f"int >= 1")
    n = len(dataset)
    kept: List[int] = []
    too_long = truncated = untrained = 0
    first_long: Optional[Tuple[int, int]] = None
    with _untruncated(tokenizer):
        for i in range(n):
            row = _row(dataset, i, key)
            tokens, labels = row.get("tokens"), row.get("labels")
            if tokens is None or labels is None:
                raise ConfigError(f"config key {key!r}: row {i} has no 'tokens'/'labels' "
                                  f"(keys {sorted(row)}); expected SFT rows {{'tokens', 'labels'}}")
            length = len(tokens)
            cut = length if limit is None else min(length, limit)
            is_long = cut < length
            if is_long:
                too_long += 1
                first_long = first_long or (i, length)
                if on_too_long != "truncate":
                    continue
            # labels[0] is never a target: the label shift makes position t predict labels[t + 1]
            if not any(int(y) != ignore_index for y in labels[1:cut]):
                untrained += 1
                continue
            truncated += is_long
            kept.append(i)
    if on_too_long == "error" and first_long is not None:
        i, length = first_long
        raise ConfigError(f"config key 'on_too_long': 'error', and {key} row {i} has {length} tokens, more than "
                          f"{limit} ({source}); {too_long} of {n} rows are too long. Expected every row within the "
                          f"limit: raise {source}, shorten the data, or set on_too_long to truncate or drop")
    report = LengthReport(n, len(kept), too_long, truncated, untrained, limit, source, on_too_long)
    if not kept:
        raise ConfigError(f"config key {key!r}: no row left to train on: {report.message(key)}. Expected at least "
                          f"one row with a trained label within {limit} tokens")
    # the tokenizer cuts to its own limit; the model's, when smaller (or the only one), is ours to apply
    max_len = model_max_seq_len if (model_max_seq_len is not None and truncated
                                    and (tok_limit is None or tok_limit > model_max_seq_len)) else None
    if len(kept) == n and max_len is None:
        return dataset, report
    return RowSubset(dataset, kept, max_len), report


__all__ = ["ON_TOO_LONG", "LengthReport", "ModelLimits", "RowSubset", "check_checkpointer", "check_components",
           "check_device", "check_lora_model", "check_loss", "check_lr_scheduler", "check_max_seq_len",
           "check_optimizer", "fit_sft_dataset", "instantiate_dataset", "lora_module_names", "model_limits"]
