"""Sampling GRPO rollouts: the shared sampling math, the eager reference sampler, the compiled sampler.

- :mod:`~logitless.rl.rollout.sampling`: next-token sampling (temperature, top-k, top-p, greedy) and
  the per-prompt random streams;
- :mod:`~logitless.rl.rollout.result`: :class:`Rollout` (what every sampler returns) and :func:`left_pad`;
- :mod:`~logitless.rl.rollout.trunk`: the decoder trunk both samplers run (embeddings, layers, final
  norm, head on the last position only);
- :mod:`~logitless.rl.rollout.prefill`: the prompt prefill both samplers run, in chunks of at most
  ``prefill_chunk_tokens`` tokens per forward;
- :mod:`~logitless.rl.rollout.eager`: :func:`generate`, the reference sampler (one plain forward per token);
- :mod:`~logitless.rl.rollout.compiled`: :class:`CompiledSampler` (prompt prefilled once per group,
  static KV caches, compiled decode step);
- :mod:`~logitless.rl.rollout.fused`: :class:`~logitless.rl.rollout.fused.FusedProjections`, the compiled
  decode step's concatenated q/k/v and gate/up weights (refreshed from the policy every call);
- :mod:`~logitless.rl.rollout.builder`: :func:`build_sampler`, the choice made by ``generation.backend``.

Example:
    >>> from logitless.rl.rollout import build_sampler, prompt_generators
    >>> sample, sample_eval = build_sampler({"backend": "auto"}, torch.device("cpu"))
"""

from logitless.rl.rollout.builder import BACKENDS, SAMPLER_KEYS, build_sampler, uses_rollout_copy
from logitless.rl.rollout.compiled import CompiledSampler
from logitless.rl.rollout.eager import generate
from logitless.rl.rollout.result import Rollout, left_pad
from logitless.rl.rollout.sampling import prompt_generators, sample_next

__all__ = [
    "BACKENDS", "CompiledSampler", "Rollout", "SAMPLER_KEYS", "build_sampler", "generate", "left_pad",
    "prompt_generators", "sample_next", "uses_rollout_copy",
]
