"""Which sampler a GRPO recipe uses, chosen in YAML (``generation.backend``): eager or compiled."""

import dataclasses
import functools
from typing import Callable, Tuple

import torch

from logitless.generation.compiled import CompiledSampler
from logitless.generation.config import SamplerConfig
from logitless.generation.eager import generate
from logitless.generation.prefill import DEFAULT_PREFILL_CHUNK_TOKENS

__all__ = ["build_sampler", "build_turn_sampler", "uses_rollout_copy"]


def uses_rollout_copy(config: SamplerConfig, device: torch.device, *, sharded: bool,
                      cpu_offload: bool = False) -> bool:
    """Whether a sharded policy is sampled through an unsharded copy (``generation.rollout_copy``).

    Under FSDP2 the gathered weights get new storage at every gather, which the compiled sampler's
    captured CUDA graph cannot follow. A persistent unsharded copy of the policy, refreshed from
    the shards before each sampling phase (:meth:`Runtime.copy_full_weights`), keeps one storage,
    so the compiled sampler runs as on one GPU. The cost is one full copy of the policy per rank
    for the whole run, instead of only while sampling. ``auto`` uses the copy with the compiled
    backend on CUDA, unless FSDP's CPU offload is on: that run saves GPU memory, and its CPU shards
    cannot be gathered into a GPU copy. The option is ignored on one device.

    Args:
        config (SamplerConfig): the ``generation:`` block.
        device (torch.device): where the policy lives.
        sharded (bool): the policy is FSDP2-sharded.
        cpu_offload (bool): FSDP2 keeps the shards on the CPU (``fsdp_cpu_offload``).

    Returns:
        bool: sample through a copy.

    Raises:
        ValueError: ``rollout_copy: true`` with CPU offload.

    Example:
        >>> uses_rollout_copy(SamplerConfig(max_new_tokens=8), torch.device("cpu"), sharded=True)
        False
    """
    choice = config.rollout_copy
    if not sharded:
        return False
    if cpu_offload:
        if choice is True:
            raise ValueError("generation.rollout_copy: true does not work with fsdp_cpu_offload: true (the "
                             "shards live on the CPU); use rollout_copy: auto or false")
        return False
    if choice == "auto":
        return config.backend in ("auto", "compiled") and device.type == "cuda"
    return bool(choice)


def build_sampler(config: SamplerConfig, device: torch.device, *,
                  sharded: bool = False, cpu_offload: bool = False) -> Tuple[Callable, Callable]:
    """Returns ``(train_sampler, eval_sampler)``, both with :func:`logitless.generation.eager.generate`'s call.

    Args:
        config (SamplerConfig): ``backend`` (``"auto"``: compiled on CUDA, eager elsewhere |
            ``"eager"`` | ``"compiled"``), ``prefill_chunk_tokens`` (both samplers) and the compiled
            sampler's options (``config.compiled``).
        device (torch.device): where the policy lives.
        sharded (bool): the policy is FSDP2-sharded. With a rollout copy (:func:`uses_rollout_copy`)
            the samplers see that unsharded copy and behave as on one device. Without it they run on
            the weights gathered for the call (``Runtime.full_weights``), which get new storage at
            every gather, which a captured CUDA graph cannot follow. Then ``auto`` means ``eager``
            and ``compiled`` runs uncompiled (``compile: true`` is refused).
        cpu_offload (bool): FSDP2 keeps the shards on the CPU (no rollout copy then).

    Returns:
        Tuple[Callable, Callable]: the sampler of the training rollouts and the one of the greedy
        evaluation (a separate compiled sampler: another batch size would re-capture the CUDA graph).

    Raises:
        ValueError: a setting that cannot run on this device or sharding, naming the key.

    Example:
        >>> sample, sample_eval = build_sampler(SamplerConfig(max_new_tokens=8, backend="eager"), torch.device("cpu"))
    """
    backend, options = _backend(config, device, sharded=sharded, cpu_offload=cpu_offload)
    if backend == "eager":
        if config.prefill_chunk_tokens == DEFAULT_PREFILL_CHUNK_TOKENS:
            return generate, generate
        eager = functools.partial(generate, prefill_chunk_tokens=config.prefill_chunk_tokens)
        return eager, eager
    return tuple(CompiledSampler(options, prefill_chunk_tokens=config.prefill_chunk_tokens) for _ in range(2))


def build_turn_sampler(config: SamplerConfig, device: torch.device, *,
                       sharded: bool = False, cpu_offload: bool = False) -> Tuple[Callable, Callable]:
    """Returns ``(train_sampler, eval_sampler)`` of multi-turn (tool) rollouts, both with
    :func:`logitless.generation.tools.eager.generate_turns`'s call: the eager reference, or
    :class:`~logitless.generation.tools.compiled.CompiledTurnSampler` with the compiled sampler's
    options, chosen as :func:`build_sampler` chooses.

    Args: as :func:`build_sampler`.

    Returns:
        Tuple[Callable, Callable]: the samplers of the training and the evaluation rollouts.

    Raises:
        ValueError: a setting that cannot run on this device or sharding, naming the key.

    Example:
        >>> sample, sample_eval = build_turn_sampler(SamplerConfig(max_new_tokens=8, backend="eager"),
        ...                                          torch.device("cpu"))
    """
    from logitless.generation.tools.compiled import CompiledTurnSampler
    from logitless.generation.tools.eager import generate_turns

    backend, options = _backend(config, device, sharded=sharded, cpu_offload=cpu_offload)
    if backend == "eager":
        eager = functools.partial(generate_turns, prefill_chunk_tokens=config.prefill_chunk_tokens)
        return eager, eager
    return tuple(CompiledTurnSampler(options, prefill_chunk_tokens=config.prefill_chunk_tokens) for _ in range(2))


def _backend(config: SamplerConfig, device: torch.device, *, sharded: bool, cpu_offload: bool):
    """``(backend, compiled options)``: ``"eager"`` or ``"compiled"`` (``auto`` resolved), the compiled
    sampler's options uncompiled where CUDA graphs cannot follow the weights."""
    if uses_rollout_copy(config, device, sharded=sharded, cpu_offload=cpu_offload):
        sharded = False  # the samplers run on the unsharded copy
    options = config.compiled
    if sharded and options.compile:
        raise ValueError("generation.compile: true is not supported with FSDP without a rollout copy (the "
                         "gathered weights move between steps, which CUDA graphs cannot follow); use "
                         "rollout_copy: true, compile: false or backend: eager")
    backend = config.backend
    if backend == "auto":
        backend = "compiled" if device.type == "cuda" and not sharded else "eager"
    if backend == "compiled" and sharded:
        options = dataclasses.replace(options, compile=False)
    return backend, options
