"""Which sampler a GRPO recipe uses, chosen in YAML (``generation.backend``): eager or compiled."""

import functools
import warnings
from typing import Any, Callable, Dict, Tuple

import torch

from logitless.generation.compiled import CompiledSampler
from logitless.generation.eager import generate
from logitless.generation.prefill import check_prefill_chunk_tokens

#: Keys of ``generation:`` that configure the sampler itself rather than one call of it.
SAMPLER_KEYS = ("backend", "compile", "max_cache_len", "sync_every", "rollout_copy", "compaction", "attention_window",
                "draws", "fused_projections", "prefill_chunk_tokens", "decode_attention", "programmatic_launch",
                "shared_prompt_decode")
#: The keys passed to :class:`CompiledSampler` as they are.
_COMPILED_KEYS = ("compile", "max_cache_len", "sync_every", "compaction", "attention_window", "draws",
                  "fused_projections", "prefill_chunk_tokens", "decode_attention", "programmatic_launch",
                  "shared_prompt_decode")
#: The keys whose null is a setting (not "the default").
_NULLABLE_KEYS = ("attention_window", "prefill_chunk_tokens")
BACKENDS = ("auto", "eager", "compiled")
#: Former backend names, still accepted with a FutureWarning.
RENAMED_BACKENDS = {"fast": "compiled"}
ROLLOUT_COPY = ("auto", True, False)


def sampler_backend(options: Dict[str, Any]) -> str:
    """``generation.backend`` checked, with a former name mapped to its current one.

    Args:
        options (Dict[str, Any]): the sampler keys of ``generation:``.

    Returns:
        str: one of :data:`BACKENDS`.

    Raises:
        ValueError: an unknown backend.

    Example:
        >>> sampler_backend({})
        'auto'
    """
    backend = options.get("backend", "auto")
    if backend in RENAMED_BACKENDS:
        warnings.warn(f"generation.backend: {backend!r} is now {RENAMED_BACKENDS[backend]!r}; the old name will be "
                      f"removed", FutureWarning, stacklevel=3)
        return RENAMED_BACKENDS[backend]
    if backend not in BACKENDS:
        raise ValueError(f"generation.backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def uses_rollout_copy(options: Dict[str, Any], device: torch.device, *, sharded: bool,
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
        options (Dict[str, Any]): the sampler keys of ``generation:``.
        device (torch.device): where the policy lives.
        sharded (bool): the policy is FSDP2-sharded.
        cpu_offload (bool): FSDP2 keeps the shards on the CPU (``fsdp_cpu_offload``).

    Returns:
        bool: sample through a copy.

    Raises:
        ValueError: an unknown value, or ``true`` with CPU offload.
    """
    choice = options.get("rollout_copy", "auto")
    if choice not in ROLLOUT_COPY:
        raise ValueError(f"generation.rollout_copy must be one of {ROLLOUT_COPY}, got {choice!r}")
    if not sharded:
        return False
    if cpu_offload:
        if choice is True:
            raise ValueError("generation.rollout_copy: true does not work with fsdp_cpu_offload: true (the "
                             "shards live on the CPU); use rollout_copy: auto or false")
        return False
    if choice == "auto":
        return sampler_backend(options) in ("auto", "compiled") and device.type == "cuda"
    return bool(choice)


def build_sampler(options: Dict[str, Any], device: torch.device, *,
                  sharded: bool = False, cpu_offload: bool = False) -> Tuple[Callable, Callable]:
    """Returns ``(train_sampler, eval_sampler)``, both with :func:`logitless.generation.eager.generate`'s call.

    Args:
        options (Dict[str, Any]): ``backend`` (``"auto"``: compiled on CUDA, eager elsewhere |
            ``"eager"`` | ``"compiled"``; ``"fast"`` is its former name), and for ``compiled``:
            ``compile`` (default: on CUDA), ``max_cache_len`` (one cache length, so one compilation,
            for the whole run), ``sync_every``, ``compaction``, ``attention_window`` (null: the whole
            cache), ``draws``, ``fused_projections``, ``decode_attention`` (``auto`` | ``sdpa`` | ``split_k``),
            ``programmatic_launch`` (null: where supported), ``shared_prompt_decode`` (null: where it
            measured faster) (:class:`CompiledSampler`); for both, ``prefill_chunk_tokens`` (tokens per prefill
            forward; null: one forward; absent: the samplers' default,
            :data:`~logitless.generation.prefill.DEFAULT_PREFILL_CHUNK_TOKENS`).
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

    Example:
        >>> sample, sample_eval = build_sampler({"backend": "eager"}, torch.device("cpu"))
    """
    backend = sampler_backend(options)
    if "prefill_chunk_tokens" in options:
        check_prefill_chunk_tokens(options["prefill_chunk_tokens"], "generation.prefill_chunk_tokens")
    if uses_rollout_copy(options, device, sharded=sharded, cpu_offload=cpu_offload):
        sharded = False  # the samplers run on the unsharded copy
    if sharded and options.get("compile"):
        raise ValueError("generation.compile: true is not supported with FSDP without a rollout copy (the "
                         "gathered weights move between steps, which CUDA graphs cannot follow); use "
                         "rollout_copy: true, compile: false or backend: eager")
    if backend == "auto":
        backend = "compiled" if device.type == "cuda" and not sharded else "eager"
    if backend == "eager":
        if "prefill_chunk_tokens" not in options:
            return generate, generate
        eager = functools.partial(generate, prefill_chunk_tokens=options["prefill_chunk_tokens"])
        return eager, eager
    kwargs = {k: options[k] for k in _COMPILED_KEYS if k in options and (options[k] is not None or k in _NULLABLE_KEYS)}
    if sharded:
        kwargs["compile"] = False
    return CompiledSampler(**kwargs), CompiledSampler(**kwargs)
