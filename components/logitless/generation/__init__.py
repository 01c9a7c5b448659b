"""Sampling completions from a torchtune decoder: the shared sampling math, the eager reference
sampler, the compiled sampler and its decode kernels, and the GRPO recipe's policy sampler.

- :mod:`~logitless.generation.config`: :class:`SamplerConfig` (a GRPO config's ``generation:`` block)
  and :class:`CompiledSamplerConfig` (the compiled sampler's options), checked when they are made;
- :mod:`~logitless.generation.sampling`: next-token sampling (temperature, top-k, top-p, greedy) and
  the per-prompt random streams;
- :mod:`~logitless.generation.result`: :class:`Rollout` (what every sampler returns) and :func:`left_pad`;
- :mod:`~logitless.generation.trunk`: the decoder trunk both samplers run (embeddings, layers, final
  norm, head on the last position only);
- :mod:`~logitless.generation.prefill`: the prompt prefill both samplers run, in chunks of at most
  ``prefill_chunk_tokens`` tokens per forward;
- :mod:`~logitless.generation.eager`: :func:`generate`, the reference sampler (one plain forward per token);
- :mod:`~logitless.generation.compiled`: :class:`CompiledSampler` (prompt prefilled once per group,
  static KV caches, compiled decode step), with its traced step in
  :mod:`~logitless.generation.decode_step` and its buffers in :mod:`~logitless.generation.decode_cache`;
- :mod:`~logitless.generation.fused`: :class:`~logitless.generation.fused.FusedProjections`, the compiled
  decode step's concatenated q/k/v and gate/up weights (refreshed from the policy every call);
- :mod:`~logitless.generation.builder`: :func:`build_sampler`, the choice made by ``generation.backend``;
- :mod:`~logitless.generation.policy_sampler`: :class:`PolicySampler`, what a GRPO recipe samples its
  policy with (one device or sharded);
- :mod:`~logitless.generation.kernels`: the compiled sampler's Triton decode kernels (attention,
  rotary embedding and cache write, the counter-based draw);
- :mod:`~logitless.generation.tools`: tool and environment turns (multi-turn rollouts): tool schemas,
  tool-call parsing, chat formats with tools, the tool executor and the eager turn sampler.

Example:
    >>> from logitless.generation import SamplerConfig, build_sampler
    >>> config = SamplerConfig.from_config({"max_new_tokens": 64, "temperature": 0.7, "backend": "auto"})
    >>> sample, sample_eval = build_sampler(config, torch.device("cpu"))
"""

# Public: __all__ (docs/CONTRACT.md). The other names are internal, imported here for the recipes and tests.
from logitless.generation.builder import build_sampler, uses_rollout_copy
from logitless.generation.compiled import CompiledSampler
from logitless.generation.config import CompiledSamplerConfig, SamplerConfig
from logitless.generation.eager import generate
from logitless.generation.result import Rollout, left_pad
from logitless.generation.sampling import prompt_generators, sample_next

__all__ = ["CompiledSamplerConfig", "SamplerConfig"]
