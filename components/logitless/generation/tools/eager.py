"""The eager multi-turn sampler: the reference for rollouts whose rows call tools between turns.

:func:`generate_turns` samples like :func:`logitless.generation.eager.generate` (one plain forward
per token, the last position's logits only, the same sampling math and random streams) and drives a
:class:`~logitless.generation.tools.session.TurnSession` between turns:

- a row's turn ends at a stop token (the chat format's end of turn); its calls are parsed and its
  environment step starts at once on its own thread, while the other rows go on decoding;
- when no row is decoding any more, the sampler collects each waiting row's continuation (the
  template's tokens for the environment's messages and the next assistant header) and appends all
  of them in one forward: a prefill of the new tokens only, written into each row's KV cache after
  its own last token; the rows then decode their next turn;
- a row ends when its environment is done, it has had ``max_turns`` turns, the next continuation
  does not fit its budget (``truncated``), or its ``max_new_tokens`` budget (model and context tokens
  together) runs out mid-turn (``truncated``).

Turns are synchronised at that barrier, so the schedule (which forward each token is in, which draws
each random stream makes) does not depend on how long the tools take: a rollout is reproducible,
and exact resume holds, with tools of any latency. A tool still overlaps the decoding of every row
that has not finished its turn.

KV cache: each row's tokens fill its own cache columns contiguously after the (left-padded) prompt,
so rows drift apart as their turns differ in length; a forward writes each row's keys and values at
that row's columns (:class:`_RowColumnsCache`) and attends, per row, to its prompt and its own
earlier columns. Columns a forward computes for a row with nothing to add go to one scratch column
past the budget, which no real query attends to. The cache holds ``prompt width + max_new_tokens +
1`` columns.

This reference runs every row in every forward (a waiting or finished row costs its share of the
batch); it is meant for correctness and small runs (CPU, tests).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from logitless.generation.tools.session import TurnSession
from logitless.generation.prefill import DEFAULT_PREFILL_CHUNK_TOKENS, check_prefill_chunk_tokens, prefill
from logitless.generation.result import Rollout, left_pad
from logitless.generation.sampling import RandomSource, check_random_source, check_sampling_args, sample_next
from logitless.generation.trunk import decoder_hidden

__all__ = ["generate_turns"]


class _RowColumnsCache(nn.Module):
    """Stands in for a layer's torchtune ``KVCache`` during one forward: ``update`` writes query ``j``
    of row ``b`` at column ``columns[b, j]`` and returns the whole cache (the mask selects)."""

    def __init__(self, cache: nn.Module, columns: torch.Tensor) -> None:
        super().__init__()
        self.k_cache, self.v_cache, self.columns = cache.k_cache, cache.v_cache, columns

    def update(self, k_val: torch.Tensor, v_val: torch.Tensor):
        rows = torch.arange(k_val.shape[0], device=k_val.device)[:, None]
        # advanced indices around a slice put their dims first: [B, S, heads, head_dim]
        self.k_cache[rows, :, self.columns] = k_val.transpose(1, 2).to(self.k_cache.dtype)
        self.v_cache[rows, :, self.columns] = v_val.transpose(1, 2).to(self.v_cache.dtype)
        return self.k_cache, self.v_cache


@contextlib.contextmanager
def _write_at(attns: List[nn.Module], columns: torch.Tensor) -> Iterator[None]:
    caches = [attn.kv_cache for attn in attns]
    try:
        for attn, cache in zip(attns, caches):
            attn.kv_cache = _RowColumnsCache(cache, columns)
        yield
    finally:
        for attn, cache in zip(attns, caches):
            attn.kv_cache = cache


def _row_forward(model: nn.Module, attns: List[nn.Module], tokens: torch.Tensor, columns: torch.Tensor,
                 pad: torch.Tensor, key_valid: torch.Tensor, last: torch.Tensor, weight: torch.Tensor,
                 scratch: int) -> torch.Tensor:
    """One forward of ``tokens`` (``[N, S]``) written at ``columns`` (``scratch`` for nothing to add);
    returns the fp32 logits of position ``last[b]`` of each row."""
    n, s = tokens.shape
    real = columns != scratch
    positions = torch.where(real, columns - pad[:, None], torch.zeros_like(columns))
    keys = torch.arange(key_valid.shape[1], device=tokens.device)
    # a real query sees the row's valid columns up to its own; a scratch query only itself
    mask = (key_valid[:, None, :] & (keys <= columns[:, :, None]) & real[:, :, None]) | (keys == columns[:, :, None])
    with _write_at(attns, columns):
        h = decoder_hidden(model, tokens, input_pos=positions, mask=mask)
    h_last = h[torch.arange(n, device=h.device), last]
    return F.linear(model.norm(h_last), weight).float()


@torch.no_grad()
def generate_turns(
    model: nn.Module,
    session: TurnSession,
    *,
    max_new_tokens: int,
    stop_tokens: Sequence[int],
    pad_id: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: RandomSource = None,
    prefill_chunk_tokens: Optional[int] = DEFAULT_PREFILL_CHUNK_TOKENS,
) -> Rollout:
    """Samples a multi-turn trajectory for every row of ``session`` (see the module docstring).

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` without KV caches set up.
        session (TurnSession): the rows' environments and prompts (``session.prompts``, G rows each).
        max_new_tokens (int): each row's budget of tokens after its prompt: its own and the appended ones.
        stop_tokens (Sequence[int]): ids that end a turn (the chat format's end of turn among them).
        pad_id (int): filler id.
        temperature (float): sampling temperature (0 = greedy).
        top_k (Optional[int]): top-k filter.
        top_p (Optional[float]): nucleus filter.
        generator (RandomSource): one generator, or one per prompt (as :func:`~logitless.generation.eager.generate`).
        prefill_chunk_tokens (Optional[int]): tokens per prompt-prefill forward (None: one forward).

    Returns:
        Rollout: ``completion_tokens`` hold each row's turns and the continuations between them;
        ``completion_mask`` every real token; ``sampled_mask`` the tokens the policy sampled (the
        only ones with ``sampler_log_probs`` and in :attr:`~logitless.generation.result.Rollout.loss_mask`);
        ``truncated`` rows cut by the budget; ``trajectories`` the session's conversations and counters.

    Raises:
        ValueError: on bad arguments or a model whose caches are already set up.

    Example:
        >>> rollout = generate_turns(model, session, max_new_tokens=256, stop_tokens=[im_end], pad_id=0)
        >>> rollout.loss_mask.sum() <= rollout.completion_mask.sum()
        tensor(True)
    """
    from torchtune.modules import MultiHeadAttention
    from torchtune.modules.common_utils import local_kv_cache

    from logitless.modules import head_weight

    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if len(stop_tokens) == 0:
        raise ValueError("stop_tokens must hold at least one token id (the chat format's end of turn)")
    check_sampling_args(temperature, top_k, top_p)
    check_prefill_chunk_tokens(prefill_chunk_tokens)
    check_random_source(generator, len(session.prompts))
    if model.caches_are_setup():
        raise ValueError("the model already has KV caches set up; generate_turns() sets up and deletes its own")

    param = next(model.parameters())
    device = param.device
    g = session.num_generations
    tokens, prompt_mask = left_pad(session.prompts, pad_id, device)
    tokens = tokens.repeat_interleave(g, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(g, dim=0)
    n, p = tokens.shape
    budget = max_new_tokens
    scratch = p + budget  # the one column no real query attends to
    limit = getattr(model, "max_seq_len", None)
    if isinstance(limit, int) and p + budget > limit:
        raise ValueError(f"the longest prompt ({p} tokens) + max_new_tokens ({budget}) = {p + budget} exceeds the "
                         f"model's max_seq_len={limit}; shorten the prompts or max_new_tokens")
    key_valid = torch.cat([prompt_mask, torch.ones(n, budget, dtype=torch.bool, device=device),
                           torch.zeros(n, 1, dtype=torch.bool, device=device)], 1)
    pad = (~prompt_mask).sum(1)  # left padding: position of column c is c - pad
    stops = torch.as_tensor(list(stop_tokens), device=device)
    out_tokens = torch.full((n, budget), pad_id, dtype=torch.long, device=device)
    out_mask = torch.zeros((n, budget), dtype=torch.bool, device=device)
    sampled = torch.zeros((n, budget), dtype=torch.bool, device=device)
    out_logp = torch.zeros((n, budget), dtype=torch.float32, device=device)
    length = torch.zeros(n, dtype=torch.long)  # completion tokens of each row so far (host)
    turn_start = torch.zeros(n, dtype=torch.long)
    decoding = torch.ones(n, dtype=torch.bool)
    truncated = torch.zeros(n, dtype=torch.bool)
    weight = head_weight(model)
    was_training = model.training
    model.eval()
    try:
        with local_kv_cache(model, batch_size=n, device=device, dtype=param.dtype, decoder_max_seq_len=scratch + 1):
            attns = [m for m in model.modules() if isinstance(m, MultiHeadAttention) and m.kv_cache is not None]
            logits = prefill(model, tokens, input_pos=(prompt_mask.long().cumsum(1) - 1).clamp(min=0),
                             prompt_mask=prompt_mask, chunk_tokens=prefill_chunk_tokens, weight=weight)
            while bool(decoding.any()):
                # one turn of every decoding row, token by token
                while True:
                    nxt, logp = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                            generator=generator)
                    rows = decoding.nonzero().squeeze(1)
                    at = length[rows]
                    rows_d, at_d = rows.to(device), at.to(device)
                    out_tokens[rows_d, at_d] = nxt[rows_d]
                    out_mask[rows_d, at_d] = True
                    sampled[rows_d, at_d] = True
                    out_logp[rows_d, at_d] = logp[rows_d]
                    col = torch.full((n, 1), scratch, dtype=torch.long, device=device)
                    col[rows_d, 0] = p + at_d
                    length[rows] += 1
                    stopped = torch.isin(nxt, stops).cpu() & decoding
                    cut = decoding & ~stopped & (length == budget)  # out of tokens mid-turn
                    for b in (stopped | cut).nonzero().squeeze(1).tolist():
                        session.end_turn(b, out_tokens[b, turn_start[b]:length[b]].tolist(), last=bool(cut[b]))
                    truncated |= cut
                    decoding &= ~(stopped | cut)
                    if not bool(decoding.any()):
                        # this step's tokens are in no cache yet: the continuation's forward writes them
                        unfed = stopped
                        break
                    logits = _row_forward(model, attns, torch.where(col == scratch, pad_id, nxt[:, None]), col, pad,
                                          key_valid, torch.zeros(n, dtype=torch.long, device=device), weight, scratch)
                # the barrier: every waiting row's continuation, appended in one forward
                segments = {}
                for b in (~truncated).nonzero().squeeze(1).tolist():
                    ids = session.continuation(b, budget - int(length[b]))
                    if ids is None:
                        truncated[b] = session.trajectories[b].out_of_budget
                    else:
                        segments[b] = ids
                if not segments:
                    break
                width = max(len(ids) for ids in segments.values()) + 1
                seg = torch.full((n, width), pad_id, dtype=torch.long, device=device)
                col = torch.full((n, width), scratch, dtype=torch.long, device=device)
                last = torch.zeros(n, dtype=torch.long, device=device)
                for b, ids in segments.items():
                    k, t = len(ids), int(length[b])
                    out_tokens[b, t:t + k], out_mask[b, t:t + k] = torch.as_tensor(ids, device=device), True
                    first = t - int(unfed[b])  # the turn's stop token first, if no forward wrote it
                    seg[b, :t + k - first] = out_tokens[b, first:t + k]
                    col[b, :t + k - first] = p + torch.arange(first, t + k, device=device)
                    last[b] = t + k - first - 1
                    length[b] = turn_start[b] = t + k
                    decoding[b] = True
                logits = _row_forward(model, attns, seg, col, pad, key_valid, last, weight, scratch)
    finally:
        model.train(was_training)
    steps = int(length.max())
    return Rollout(
        prompt_tokens=tokens,
        prompt_mask=prompt_mask,
        completion_tokens=out_tokens[:, :steps],
        completion_mask=out_mask[:, :steps],
        truncated=truncated.to(device),
        sampler_log_probs=out_logp[:, :steps],
        num_generations=g,
        sampled_mask=sampled[:, :steps],
        trajectories=session.trajectories,
    )
