"""The eager reference sampler: batched sampling of GRPO groups with a KV cache on a torchtune
``TransformerDecoder``, one plain forward per token (no compilation, no fixed shapes).

What it guarantees (each one a known pitfall):

- prompts are left-padded, with position ids that start at each prompt's first real token and a
  mask that hides the padding;
- only the last position's logits exist at any time (``[N, V]``, projected from the final hidden
  state through the model's head weight): ``[N, T, V]`` logits are never produced, not even for the
  prompt prefill (torchtune's ``generate`` keeps all of them in fp32);
- the prompt prefill runs in chunks of at most ``prefill_chunk_tokens`` tokens per forward
  (:mod:`logitless.generation.prefill`), so long prompts stay within a memory bound;
- tokens after a stop token are ``pad_id`` and masked out; completions without a stop token are
  flagged ``truncated``;
- the KV caches live only inside :func:`generate` (``torchtune.modules.common_utils.local_kv_cache``)
  and are deleted on exit, even on error, so a later training forward cannot hit the
  "caches set up but disabled, no mask -> bidirectional attention" behaviour of torchtune 0.6.1.
"""

from typing import Optional, Sequence

import torch
from torch import nn

from logitless.generation.prefill import (DEFAULT_PREFILL_CHUNK_TOKENS, causal_key_mask, check_prefill_chunk_tokens,
                                          prefill)
from logitless.generation.result import Rollout, left_pad
from logitless.generation.sampling import RandomSource, check_random_source, check_sampling_args, sample_next
from logitless.generation.trunk import last_position_logits


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_tokens: Sequence[int],
    pad_id: int,
    num_generations: int = 1,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: RandomSource = None,
    prefill_chunk_tokens: Optional[int] = DEFAULT_PREFILL_CHUNK_TOKENS,
) -> Rollout:
    """Samples ``num_generations`` completions for every prompt.

    The model is switched to ``eval()`` for the call and restored afterwards; KV caches are set up for ``N = len(prompts) * num_generations`` sequences
    and deleted before returning.

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` (wrapped or not; LoRA or not)
            without KV caches set up.
        prompts (Sequence[Sequence[int]]): token ids of each prompt (unpadded).
        max_new_tokens (int): completion length limit (>= 1).
        stop_tokens (Sequence[int]): ids that end a completion (kept in it, and masked-in).
        pad_id (int): id written after a completion ends and used for left padding.
        num_generations (int): completions per prompt (G); groups are contiguous.
        temperature (float): sampling temperature (0 = greedy).
        top_k (Optional[int]): top-k filter.
        top_p (Optional[float]): nucleus filter.
        generator (RandomSource): random source on the model's device: one generator, or one per
            prompt (:func:`logitless.generation.sampling.prompt_generators`) so that a group's completions do
            not depend on the other prompts of the batch.
        prefill_chunk_tokens (Optional[int]): at most this many tokens (rows x prompt columns) per
            prefill forward (:func:`logitless.generation.prefill.prefill`: long prompts run in
            chunks of columns); None = the whole prompt batch in one forward.

    Returns:
        Rollout: tokens, masks, truncation flags and sampler log-probs.

    Raises:
        ValueError: on bad arguments or a model whose caches are already set up.

    Example:
        >>> from torchtune.models.qwen2 import qwen2
        >>> m = qwen2(vocab_size=32, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=16,
        ...           intermediate_dim=32, max_seq_len=64, tie_word_embeddings=True)
        >>> out = generate(m, [[1, 2, 3], [4]], max_new_tokens=5, stop_tokens=[0], pad_id=0,
        ...                num_generations=2)
        >>> out.completion_tokens.shape[0]
        4
    """
    from torchtune.modules.common_utils import local_kv_cache

    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be an int >= 1, got {num_generations!r}")
    if len(stop_tokens) == 0:
        raise ValueError("stop_tokens must hold at least one token id (e.g. the tokenizer's eos_id)")
    check_sampling_args(temperature, top_k, top_p)
    check_prefill_chunk_tokens(prefill_chunk_tokens)
    check_random_source(generator, len(prompts))
    if model.caches_are_setup():
        raise ValueError("the model already has KV caches set up; generate() sets up and deletes its own "
                         "(call torchtune.modules.common_utils.delete_kv_caches(model) first)")

    param = next(model.parameters())
    device = param.device
    tokens, prompt_mask = left_pad(prompts, pad_id, device)
    tokens = tokens.repeat_interleave(num_generations, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)
    n, p = tokens.shape
    total = p + max_new_tokens
    limit = getattr(model, "max_seq_len", None)
    if isinstance(limit, int) and total > limit:
        raise ValueError(f"the longest prompt ({p} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                         f"the model's max_seq_len={limit}; shorten the prompts (max_prompt_tokens) or max_new_tokens")
    key_valid = torch.cat([prompt_mask, torch.ones(n, max_new_tokens, dtype=torch.bool, device=device)], 1)
    positions = (key_valid.long().cumsum(1) - 1).clamp(min=0)
    stops = torch.as_tensor(list(stop_tokens), device=device)
    out_tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_mask = torch.zeros((n, max_new_tokens), dtype=torch.bool, device=device)
    out_logp = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    was_training = model.training
    model.eval()
    steps = 0
    try:
        with local_kv_cache(model, batch_size=n, device=device, dtype=param.dtype,
                            decoder_max_seq_len=total):
            logits = prefill(model, tokens, input_pos=positions[:, :p], prompt_mask=prompt_mask,
                             chunk_tokens=prefill_chunk_tokens)
            for t in range(max_new_tokens):
                nxt, logp = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                        generator=generator)
                live = ~done
                out_tokens[:, t] = torch.where(live, nxt, torch.full_like(nxt, pad_id))
                out_mask[:, t] = live
                out_logp[:, t] = torch.where(live, logp, torch.zeros_like(logp))
                done = done | (live & torch.isin(nxt, stops))
                steps = t + 1
                if t + 1 == max_new_tokens or bool(done.all()):
                    break
                col = p + t
                logits = last_position_logits(model, out_tokens[:, t:t + 1], input_pos=positions[:, col:col + 1],
                                              mask=causal_key_mask(key_valid, col, col + 1))
    finally:
        model.train(was_training)
    return Rollout(
        prompt_tokens=tokens,
        prompt_mask=prompt_mask,
        completion_tokens=out_tokens[:, :steps],
        completion_mask=out_mask[:, :steps],
        truncated=~done,
        sampler_log_probs=out_logp[:, :steps],
        num_generations=num_generations,
    )
