"""Batched sampling of GRPO groups with a KV cache on a torchtune ``TransformerDecoder``.

What it guarantees (each one a known pitfall):

- prompts are left-padded, with position ids that start at each prompt's first real token and a
  mask that hides the padding;
- only the last position's logits exist at any time (``[N, V]``, projected from the final hidden
  state through the model's head weight): ``[N, T, V]`` logits are never produced, not even for the
  prompt prefill (torchtune's ``generate`` keeps all of them in fp32);
- tokens after a stop token are ``pad_id`` and masked out; completions without a stop token are
  flagged ``truncated``;
- the KV caches live only inside :func:`generate` (``torchtune.modules.common_utils.local_kv_cache``)
  and are deleted on exit, even on error, so a later training forward cannot hit the
  "caches set up but disabled, no mask -> bidirectional attention" behaviour of torchtune 0.6.1.
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from logitless.rl.sampling import RandomSource, check_random_source, check_sampling_args, sample_next


@dataclass
class Rollout:
    """The sampled completions of a batch of groups.

    Attributes:
        prompt_tokens (torch.Tensor): ``(N, P)`` int64, left-padded with ``pad_id``; N = prompts * G,
            each prompt repeated for its G generations (contiguous groups).
        prompt_mask (torch.Tensor): ``(N, P)`` bool, True at real prompt tokens.
        completion_tokens (torch.Tensor): ``(N, T)`` int64, right-padded with ``pad_id``; T is the
            longest completion (<= max_new_tokens).
        completion_mask (torch.Tensor): ``(N, T)`` bool, True up to and including the first stop token.
        truncated (torch.Tensor): ``(N,)`` bool, True where no stop token was produced.
        sampler_log_probs (torch.Tensor): ``(N, T)`` fp32 log-probs of the sampled tokens under the
            full tempered distribution (0 where masked); for diagnostics and tests only: the
            training path recomputes old log-probs.
        num_generations (int): G.
    """

    prompt_tokens: torch.Tensor
    prompt_mask: torch.Tensor
    completion_tokens: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor
    sampler_log_probs: torch.Tensor
    num_generations: int

    @property
    def completion_lengths(self) -> torch.Tensor:
        """``(N,)`` int64 number of completion tokens (stop token included)."""
        return self.completion_mask.sum(dim=1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device=None):
    """Left-pads token lists into a batch.

    Args:
        prompts (Sequence[Sequence[int]]): token ids, each non-empty.
        pad_id (int): filler id.
        device: where to put the tensors.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: tokens ``(B, P)`` int64 and mask ``(B, P)`` bool.

    Example:
        >>> left_pad([[5, 6], [7]], pad_id=0)[0].tolist()
        [[5, 6], [0, 7]]
    """
    if len(prompts) == 0:
        raise ValueError("prompts must hold at least one prompt, got an empty list")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = True
    return tokens.to(device), mask.to(device)


def _gathered_fsdp_unit(layer: nn.Module) -> bool:
    """True for an FSDP2 unit whose weights are gathered (inside ``Runtime.full_weights``)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return isinstance(layer, FSDPModule) and not isinstance(next(layer.parameters(), None), DTensor)


def decoding_layer(layer: nn.Module) -> nn.Module:
    """The module a no-grad decode step runs for ``layer``: past an activation-checkpointing wrapper,
    since decoding without gradients keeps no activations to recompute.

    Example:
        >>> decoding_layer(model.layers[0]) is model.layers[0]    # no activation checkpointing
        True
    """
    return getattr(layer, "_checkpoint_wrapped_module", layer)


def run_decoding_layer(layer: nn.Module, h: torch.Tensor, *, mask: torch.Tensor,
                       input_pos: torch.Tensor) -> torch.Tensor:
    """``layer(h, mask=mask, input_pos=input_pos)`` for a decode step, minus what serves training only.

    Activation checkpointing is skipped (:func:`decoding_layer`). An FSDP2 unit whose weights are
    gathered for the whole sampling call runs its ``forward`` without FSDP's per-call hooks, which
    would only find the weights gathered and record bookkeeping for a backward that never comes
    (+35% time per token for Qwen2.5-1.5B on an H200); a sharded unit is called normally.

    Args:
        layer (nn.Module): a decoder layer (plain, checkpoint-wrapped or an FSDP2 unit).
        h (torch.Tensor): ``(B, S, H)`` hidden states.
        mask (torch.Tensor): attention mask as torchtune's layer takes it.
        input_pos (torch.Tensor): positions of ``h``.

    Returns:
        torch.Tensor: the layer's output.
    """
    inner = decoding_layer(layer)
    call = inner.forward if _gathered_fsdp_unit(inner) else inner
    return call(h, mask=mask, input_pos=input_pos)


def _last_logits(model: nn.Module, tokens: torch.Tensor, *, input_pos: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """Runs the decoder trunk and projects only the last position: ``(B, V)`` fp32 logits.

    Mirrors ``TransformerDecoder.forward`` up to the final norm, then applies the head weight
    (``logitless.modules.head_weight``: tied, untied or LoRA) to one position per sequence, so
    neither the prefill nor a decode step ever materialises ``[B, S, V]`` logits.
    """
    from logitless.modules import head_weight

    h = model.tok_embeddings(tokens)
    for layer in model.layers:
        h = run_decoding_layer(layer, h, mask=mask, input_pos=input_pos)
    h = model.norm(h[:, -1])
    return F.linear(h, head_weight(model)).float()


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
            prompt (:func:`logitless.rl.sampling.prompt_generators`) so that a group's completions do
            not depend on the other prompts of the batch.

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
    cols = torch.arange(total, device=device)
    stops = torch.as_tensor(list(stop_tokens), device=device)

    def mask_rows(start: int, stop: int) -> torch.Tensor:
        rows = torch.arange(start, stop, device=device)
        m = key_valid[:, None, :] & (cols[None, None, :] <= rows[None, :, None])
        # a padded query row must attend somewhere (itself) or SDPA returns NaN
        return m | (cols[None, None, :] == rows[None, :, None])

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
            logits = _last_logits(model, tokens, input_pos=positions[:, :p], mask=mask_rows(0, p))
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
                logits = _last_logits(model, out_tokens[:, t:t + 1], input_pos=positions[:, col:col + 1],
                                      mask=mask_rows(col, col + 1))
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
