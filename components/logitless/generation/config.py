"""The samplers' settings as typed values, checked when they are made.

:class:`SamplerConfig` is a GRPO config's ``generation:`` block (its YAML keys are the field names,
the compiled sampler's keys included: :meth:`SamplerConfig.from_config` reads the block into the
nested :class:`CompiledSamplerConfig`); :class:`CompiledSamplerConfig` holds the options of
:class:`~logitless.generation.compiled.CompiledSampler`. A bad value raises an error naming the key,
the value and what was expected, before anything is built.

Example:
    >>> cfg = SamplerConfig.from_config({"max_new_tokens": 64, "temperature": 0.7, "backend": "compiled",
    ...                                  "max_cache_len": 1024})
    >>> cfg.compiled.max_cache_len, cfg.sampling_args(stop_tokens=[0])["temperature"]
    (1024, 0.7)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from omegaconf import DictConfig, OmegaConf

from logitless.generation.prefill import DEFAULT_PREFILL_CHUNK_TOKENS, check_prefill_chunk_tokens
from logitless.ops._validate import MAX_TEMPERATURE, MIN_TEMPERATURE
from logitless.training.config import ConfigError

__all__ = ["BACKENDS", "CompiledSamplerConfig", "DECODE_ATTENTION", "GENERATION_KEYS", "OptionError", "ROLLOUT_COPY",
           "SamplerConfig", "check_stop_tokens"]

#: ``generation.backend``: the compiled sampler on CUDA, the eager one elsewhere (``auto``), or either.
BACKENDS = ("auto", "eager", "compiled")
#: ``generation.rollout_copy`` (see :func:`~logitless.generation.builder.uses_rollout_copy`).
ROLLOUT_COPY = ("auto", True, False)
#: The grouped decode step's attention implementations (``CompiledSamplerConfig.decode_attention``).
DECODE_ATTENTION = ("auto", "sdpa", "split_k")
#: How the compiled sampler draws tokens (``CompiledSamplerConfig.draws``).
DRAWS = ("counter", "generator")
#: Keys of ``generation:`` that are one sampler call's arguments.
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "stop_tokens")
#: Keys of ``generation:`` that set the compiled sampler's options (:class:`CompiledSamplerConfig`).
COMPILED_KEYS = ("compile", "max_cache_len", "sync_every", "compaction", "attention_window", "draws",
                 "fused_projections", "decode_attention", "programmatic_launch", "shared_prompt_decode")
#: Every key of ``generation:``.
GENERATION_KEYS = SAMPLING_KEYS + ("backend", "rollout_copy", "prefill_chunk_tokens") + COMPILED_KEYS


class OptionError(ValueError):
    """A sampler option with a bad value.

    Attributes:
        option (str): the option's name (its YAML key under ``generation:``).
    """

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not _is_int(value) or value < minimum:
        raise OptionError(name, f"{name} must be {'None or ' if optional else ''}an int >= {minimum}, got {value!r}")


def _check_flag(name: str, value: Any, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        raise OptionError(name, f"{name} must be {'None, ' if optional else ''}True or False, got {value!r}")


@dataclass(frozen=True)
class CompiledSamplerConfig:
    """The options of :class:`~logitless.generation.compiled.CompiledSampler`. The YAML keys of
    ``generation:`` set the fields named in :data:`COMPILED_KEYS`; the others are for code (tests,
    benchmarks).

    Attributes:
        compile (Optional[bool]): compile the decode step; None = on CUDA only.
        backend (Union[str, Callable]): ``torch.compile`` backend ("inductor"; "eager"/"aot_eager"
            for CPU tests).
        mode (Optional[str]): ``torch.compile`` mode; None = "reduce-overhead" (CUDA graphs) on CUDA
            with inductor, else the default mode.
        sync_every (int): steps between "all rows finished?" checks (the loop's only host syncs).
        cache_len_multiple (int): the cache length is the prompt width + ``max_new_tokens`` rounded up
            to this, so calls with similar prompt widths share one compiled graph.
        max_cache_len (Optional[int]): fixed cache length for every call (one graph for a whole run;
            set it to the longest prompt + ``max_new_tokens``); overrides ``cache_len_multiple``.
        keep_cache (Optional[bool]): keep the cache and step buffers between calls (detached from
            the model); None = whenever the step is compiled. ``release()`` frees them.
        grouped_attention (bool): decode with grouped-query attention that reads each K/V head
            once (default); False runs torchtune's layers as they are (K/V copied per query head).
        draws (str): ``"counter"`` (default): tokens are drawn inside the decode step from a
            counter-based stream keyed by (row key, step, token) (:func:`~logitless.generation.sampling.sample_counter`;
            the row keys come from ``generator``), so sampling is part of the captured graph and a
            row's tokens do not depend on the rest of the batch; ``"generator"``: drawn eagerly
            with ``torch.multinomial`` from ``generator`` after each step (the eager sampler's draws).
        compaction (bool): when rows finish, move the live ones into the next smaller batch bucket
            (halving down to ``min_bucket``) so finished rows stop costing decode steps; needs
            ``draws="counter"`` and layers the grouped decode step can run (else off).
        min_bucket (int): the smallest bucket compaction moves rows into.
        graph_sampling (bool): with counter draws, sample inside the compiled step (default);
            False samples the same draws eagerly after it.
        attention_window (Optional[int]): decode attention reads the cache up to the filled column
            rounded up to a multiple of this (one CUDA graph per window size), not the whole cache;
            None reads the whole cache at every step. Needs the grouped decode step.
        fused_projections (Union[bool, str]): the grouped decode step computes q/k/v with one GEMM
            and the MLP's gate/up with another (:class:`~logitless.generation.fused.FusedProjections`;
            plain ``nn.Linear`` projections only, LoRA ones stay separate), about 12% faster decode
            steps at 1.5B. ``"shared"``: the concatenated weights are the model's own: its q/k/v and
            gate/up parameters are re-pointed at row slices of them on the first call (the same
            ``nn.Parameter`` objects, which the optimizer keeps updating), so nothing is copied or
            held twice, and a parameter replaced since is copied back in at the next call. ``True``: a
            copy refreshed from the model at the start of every call, held (about half the model)
            for as long as the cache buffers are kept, i.e. through the update too. ``False``
            (default): separate GEMMs.
        decode_attention (str): the grouped decode step's attention. ``"split_k"``: the split-K
            Triton kernel (:func:`logitless.generation.kernels.decode_attention`) whose programs cover the
            cache in fixed splits and read only the filled columns (a count on the device), so its
            work follows the filled length and the rows of a compacted bucket, and one CUDA graph
            per bucket serves every step (``attention_window`` is not used). Off CUDA it runs plain
            PyTorch unless ``TRITON_INTERPRET=1``. ``"sdpa"``: ``F.scaled_dot_product_attention``
            over the window of ``attention_window``. ``"auto"`` (default): ``"split_k"`` on CUDA
            with ``grouped_attention``, else ``"sdpa"`` (on an H200 the kernel took 0.33-0.73x the
            windowed SDPA's time per layer, ``experiments/results/decode_attention_h200.csv``, and the
            1.5B decode step 0.84-0.91x, ``generation_roofline_h200.csv``).
        programmatic_launch (Optional[bool]): launch the compiled step's kernels (inductor's, with
            its ``triton.enable_pdl``, and the split-K attention's) as programmatic dependent
            launches: each kernel may be scheduled while the one before it finishes and waits for it
            before reading, which hides most of the gap between the step's few hundred small
            kernels. None (default) = where supported (a CUDA GPU of compute capability 9.0 or later,
            the inductor backend, a torch whose inductor has the option); True where it is not is an
            error. Same results either way.
        shared_prompt_decode (Optional[bool]): with the split-K decode attention, read each group's
            prompt columns once per step for all of its G rows (one program per prompt split whose
            query operand is every query head of the group's rows,
            :class:`~logitless.generation.kernels.decode_attention.SharedPrefix`), instead of once per row:
            the cache bytes a step reads fall by about ``(G - 1) / G`` of the prompt's share. It
            follows compaction (a group's live rows stay consecutive). None (default) = where it
            measured faster: ``num_generations > 1``, a prompt of at least
            :data:`~logitless.generation.compiled.SHARED_PROMPT_MIN_WIDTH` columns and
            :data:`~logitless.generation.compiled.SHARED_PROMPT_MIN_ELEMENTS` K/V elements per row and
            layer (columns x K/V heads x head_dim: 1024 columns at Qwen2.5-0.5B, 512 at 1.5B, 256 at
            7B) and, per batch bucket, at least :data:`~logitless.generation.compiled.SHARED_PROMPT_MIN_ROWS`
            rows. True: whenever ``num_generations > 1``; True without the split-K attention is an
            error. Same results either way.

    Raises:
        OptionError: naming the option, its value and what was expected.

    Example:
        >>> CompiledSamplerConfig(compile=False, sync_every=4).sync_every
        4
    """

    compile: Optional[bool] = None
    backend: Union[str, Callable] = "inductor"
    mode: Optional[str] = None
    sync_every: int = 16
    cache_len_multiple: int = 256
    max_cache_len: Optional[int] = None
    keep_cache: Optional[bool] = None
    grouped_attention: bool = True
    draws: str = "counter"
    compaction: bool = True
    min_bucket: int = 8
    attention_window: Optional[int] = 256
    graph_sampling: bool = True
    fused_projections: Union[bool, str] = False
    decode_attention: str = "auto"
    programmatic_launch: Optional[bool] = None
    shared_prompt_decode: Optional[bool] = None

    def __post_init__(self) -> None:
        _check_flag("compile", self.compile, optional=True)
        if not (callable(self.backend) or (isinstance(self.backend, str) and self.backend)):
            raise OptionError("backend", f"backend must be a torch.compile backend (name or callable), "
                                         f"got {self.backend!r}")
        if self.draws not in DRAWS:
            raise OptionError("draws", f"draws must be 'counter' or 'generator', got {self.draws!r}")
        _check_flag("programmatic_launch", self.programmatic_launch, optional=True)
        _check_flag("shared_prompt_decode", self.shared_prompt_decode, optional=True)
        for name in ("grouped_attention", "compaction", "graph_sampling"):
            _check_flag(name, getattr(self, name))
        if self.shared_prompt_decode and (self.decode_attention == "sdpa" or not self.grouped_attention):
            raise OptionError("shared_prompt_decode",
                              f"shared_prompt_decode=True needs the split-K decode attention (decode_attention="
                              f"'split_k' or 'auto', grouped_attention=True); got decode_attention="
                              f"{self.decode_attention!r}, grouped_attention={self.grouped_attention!r}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise OptionError("decode_attention", f"decode_attention must be one of {DECODE_ATTENTION}, got "
                                                  f"{self.decode_attention!r}")
        if self.decode_attention == "split_k" and not self.grouped_attention:
            raise OptionError("decode_attention", "decode_attention='split_k' needs grouped_attention=True (the "
                                                  "grouped decode step is where it runs); got grouped_attention=False")
        _check_int("sync_every", self.sync_every, 1)
        _check_int("cache_len_multiple", self.cache_len_multiple, 1)
        _check_int("max_cache_len", self.max_cache_len, 2, optional=True)
        _check_int("min_bucket", self.min_bucket, 2)
        _check_int("attention_window", self.attention_window, 1, optional=True)
        if not (isinstance(self.fused_projections, bool) or self.fused_projections == "shared"):
            raise OptionError("fused_projections", f"fused_projections must be True, False or 'shared', got "
                                                   f"{self.fused_projections!r}")


def _check_sampling(values: Dict[str, Any], key: str) -> None:
    """The values of one call's sampling arguments, as a GRPO run takes them (see :class:`SamplerConfig`)."""
    n = values["max_new_tokens"]
    if not _is_int(n) or n < 1:
        raise ConfigError(f"config key '{key}.max_new_tokens': expected an int >= 1, got {n!r}")
    t = values["temperature"]
    if not (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
            and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        greedy = (" (0 = greedy sampling gives every completion of a group the same tokens, so every advantage "
                  "is 0: GRPO needs sampled completions)") if t == 0 else ""
        raise ConfigError(f"config key '{key}.temperature': expected a finite number in "
                          f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {t!r}{greedy}")
    k = values["top_k"]
    if k is not None and (not _is_int(k) or k < 1):
        raise ConfigError(f"config key '{key}.top_k': expected null or an int >= 1, got {k!r}")
    p = values["top_p"]
    if p is not None and not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1):
        raise ConfigError(f"config key '{key}.top_p': expected null or a number in (0, 1], got {p!r}")
    stops = values["stop_tokens"]
    if stops is not None and (not isinstance(stops, (list, tuple)) or not stops
                              or not all(_is_int(s) and s >= 0 for s in stops)):
        raise ConfigError(f"config key '{key}.stop_tokens': expected a non-empty list of token ids >= 0, "
                          f"got {stops!r}")


@dataclass(frozen=True)
class SamplerConfig:
    """What a GRPO recipe samples with: a config's ``generation:`` block.

    Attributes:
        max_new_tokens (int): completion length limit (>= 1).
        temperature (float): sampling temperature in ``[1e-4, 1e4]`` (the loss uses the same). 0 is
            refused: greedy completions of a group are all the same, so every advantage would be 0
            (a recipe's greedy evaluation passes ``temperature=0.0`` per call instead).
        top_k (Optional[int]): top-k filter (None: off).
        top_p (Optional[float]): nucleus filter in (0, 1] (None: off).
        stop_tokens (Optional[Tuple[int, ...]]): ids that end a completion; None = the tokenizer's
            (:class:`~logitless.generation.policy_sampler.PolicySampler` fills them in).
        backend (str): one of :data:`BACKENDS` (``auto``: compiled on CUDA, eager elsewhere).
        rollout_copy (Union[str, bool]): one of :data:`ROLLOUT_COPY`: sample a sharded policy through
            an unsharded copy (:func:`~logitless.generation.builder.uses_rollout_copy`).
        prefill_chunk_tokens (Optional[int]): at most this many tokens per prefill forward, for both
            samplers; None = one forward for the whole prompt batch.
        compiled (CompiledSamplerConfig): the compiled sampler's options.

    Raises:
        ConfigError: naming ``generation.<key>``, the value and what was expected.

    Example:
        >>> SamplerConfig(max_new_tokens=8, top_p=0.9).backend
        'auto'
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    stop_tokens: Optional[Tuple[int, ...]] = None
    backend: str = "auto"
    rollout_copy: Union[str, bool] = "auto"
    prefill_chunk_tokens: Optional[int] = DEFAULT_PREFILL_CHUNK_TOKENS
    compiled: CompiledSamplerConfig = field(default_factory=CompiledSamplerConfig)

    def __post_init__(self) -> None:
        if self.stop_tokens is not None and isinstance(self.stop_tokens, list):
            object.__setattr__(self, "stop_tokens", tuple(self.stop_tokens))
        _check_sampling({k: getattr(self, k) for k in SAMPLING_KEYS}, "generation")
        if self.backend not in BACKENDS:
            raise ConfigError(f"config key 'generation.backend': expected one of {BACKENDS}, got {self.backend!r}")
        if self.rollout_copy not in ROLLOUT_COPY or not isinstance(self.rollout_copy, (str, bool)):
            raise ConfigError(f"config key 'generation.rollout_copy': expected one of {ROLLOUT_COPY}, got "
                              f"{self.rollout_copy!r}")
        try:
            check_prefill_chunk_tokens(self.prefill_chunk_tokens, "generation.prefill_chunk_tokens")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not isinstance(self.compiled, CompiledSamplerConfig):
            raise ConfigError(f"generation: compiled must be a CompiledSamplerConfig, got {type(self.compiled).__name__}")

    @classmethod
    def from_config(cls, node: Union[DictConfig, Dict[str, Any]], key: str = "generation") -> "SamplerConfig":
        """The sampler config of a ``generation:`` mapping (YAML keys: :data:`GENERATION_KEYS`).

        A null compiled-sampler option means its default, except ``attention_window`` (null: the
        whole cache); a null ``prefill_chunk_tokens`` means one prefill forward.

        Args:
            node (Union[DictConfig, Dict[str, Any]]): the mapping.
            key (str): its config key, for the errors.

        Returns:
            SamplerConfig: the checked config.

        Raises:
            ConfigError: an unknown or missing key, or a bad value, naming ``<key>.<name>``.

        Example:
            >>> SamplerConfig.from_config(OmegaConf.create({"max_new_tokens": 16, "sync_every": 8})).compiled.sync_every
            8
        """
        values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        unknown = sorted(set(values) - set(GENERATION_KEYS))
        if unknown:
            raise ConfigError(f"config key '{key}.{unknown[0]}': unknown; allowed {sorted(GENERATION_KEYS)}")
        if "max_new_tokens" not in values:
            raise ConfigError(f"config key '{key}.max_new_tokens': required (completion length limit)")
        compiled = {k: values.pop(k) for k in COMPILED_KEYS if k in values}
        compiled = {k: v for k, v in compiled.items() if v is not None or k == "attention_window"}
        try:
            options = CompiledSamplerConfig(**compiled)
        except OptionError as e:
            raise ConfigError(f"config key '{key}.{e.option}': {e}") from None
        return cls(**values, compiled=options)

    def sampling_args(self, **overrides: Any) -> Dict[str, Any]:
        """One sampler call's sampling arguments (``max_new_tokens``, ``temperature``, ``top_k``,
        ``top_p``, ``stop_tokens``), with ``overrides`` for this call (``temperature=0.0``).

        Raises:
            ValueError: no stop tokens, neither set nor given.
        """
        args = {k: getattr(self, k) for k in SAMPLING_KEYS}
        args.update(overrides)
        if args["stop_tokens"] is None:
            raise ValueError("stop_tokens: none set in generation.stop_tokens nor given (PolicySampler.from_config "
                             "takes the tokenizer's)")
        args["stop_tokens"] = list(args["stop_tokens"])
        return args

    def with_stop_tokens(self, stop_tokens: Sequence[int]) -> "SamplerConfig":
        """This config with ``stop_tokens`` set (a copy: configs are frozen)."""
        return dataclasses.replace(self, stop_tokens=tuple(int(s) for s in stop_tokens))


def check_stop_tokens(stop_tokens: Sequence[int], vocab_size: Optional[int], key: str) -> None:
    """Raises ConfigError when a stop token is not an id of the model's vocabulary (it could never
    be sampled, so no completion would ever stop).

    Args:
        stop_tokens (Sequence[int]): the ids.
        vocab_size (Optional[int]): the model's vocabulary (None: unknown, nothing checked).
        key (str): where the ids come from (``generation.stop_tokens`` or ``tokenizer``).

    Example:
        >>> check_stop_tokens([0, 5], 32, "generation.stop_tokens")
    """
    if vocab_size is None:
        return
    bad = [s for s in stop_tokens if not 0 <= int(s) < vocab_size]
    if bad:
        raise ConfigError(f"config key {key!r}: stop token(s) {bad} outside the model's vocabulary; "
                          f"expected ids in [0, {vocab_size})")
