"""The sampler a GRPO recipe uses, chosen in YAML (``generation.backend``)."""

from typing import Any, Callable, Dict, Tuple

import torch

from logitless.rl import fast_generation
from logitless.rl.generation import generate

#: Keys of ``generation:`` that configure the sampler itself rather than one call of it.
SAMPLER_KEYS = ("backend", "compile", "max_cache_len", "sync_every")
BACKENDS = ("auto", "eager", "fast")


def build_sampler(options: Dict[str, Any], device: torch.device, *,
                  sharded: bool = False) -> Tuple[Callable, Callable]:
    """Returns ``(train_sampler, eval_sampler)``, both with :func:`logitless.rl.generation.generate`'s call.

    Args:
        options (Dict[str, Any]): ``backend`` (``"auto"``: fast on CUDA, eager elsewhere | ``"eager"`` |
            ``"fast"``), and for ``fast``: ``compile`` (default: on CUDA), ``max_cache_len`` (one cache
            length, so one compilation, for the whole run) and ``sync_every``.
        device (torch.device): where the policy lives.
        sharded (bool): the policy is FSDP2-sharded and sampled with its weights gathered for the
            call (``Runtime.full_weights``). The gathered weights get new storage at every gather,
            which a captured CUDA graph cannot follow, so ``auto`` means ``eager`` and ``fast``
            runs uncompiled (``compile: true`` is refused).

    Returns:
        Tuple[Callable, Callable]: the sampler of the training rollouts and the one of the greedy
        evaluation (a separate fast sampler: another batch size would re-capture the CUDA graph).

    Example:
        >>> sample, sample_eval = build_sampler({"backend": "eager"}, torch.device("cpu"))
    """
    backend = options.get("backend", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"generation.backend must be one of {BACKENDS}, got {backend!r}")
    if sharded and options.get("compile"):
        raise ValueError("generation.compile: true is not supported with FSDP (the gathered weights move "
                         "between steps, which CUDA graphs cannot follow); use compile: false or backend: eager")
    if backend == "auto":
        backend = "fast" if device.type == "cuda" and not sharded else "eager"
    if backend == "eager":
        return generate, generate
    kwargs = {k: options[k] for k in ("compile", "max_cache_len", "sync_every") if options.get(k) is not None}
    if sharded:
        kwargs["compile"] = False
    return fast_generation.FastGenerator(**kwargs), fast_generation.FastGenerator(**kwargs)
