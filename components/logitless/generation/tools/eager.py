"""The eager multi-turn sampler: the reference for rollouts whose rows call tools between turns.

:func:`generate_turns` prefills the prompts, then runs one plain forward per step through torchtune's
own layers (:func:`~logitless.generation.tools.turn_step.eager_turn_step`), driven by
:func:`~logitless.generation.tools.turn_loop.drive_turns`:

- every row decodes on its own schedule: a row whose turn ends at a stop token (the chat format's
  end of turn) pauses while its calls are parsed and its environment step runs on its own thread;
  the other rows go on decoding;
- as soon as a row's environment has answered, its continuation (the template's tokens for the
  environment's messages and the next assistant header) is fed through the following steps, one
  token per step, into the row's own KV-cache columns (no prefill of the history; a continuation of
  ``segment_prefill_tokens`` or more goes in with one forward of that row); then the row samples
  its next turn;
- a row ends when its environment is done, it has had ``max_turns`` turns, the next continuation
  does not fit its budget (``truncated``), or its ``max_new_tokens`` budget (model and context
  tokens together) runs out mid-turn (``truncated``).

Token ``t`` of a row is drawn from the counter-based stream of ``(row key, t)``, the compiled
sampler's draw: what a row samples depends on its key and its own conversation, not on when its
tool answered or what the other rows did, so a rollout is reproducible (and exact resume holds)
with tools of any latency. :class:`~logitless.generation.tools.compiled.CompiledTurnSampler` runs
the same steps compiled, for GPUs.

KV cache: ``prompt width + max_new_tokens + 1`` columns per row (the last one a scratch column, where
idle rows write and no query looks). Every forward runs every row (a waiting or finished row costs
its share of the batch).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import nn

from logitless.generation.decode_step import register_counter_draw
from logitless.generation.prefill import DEFAULT_PREFILL_CHUNK_TOKENS, check_prefill_chunk_tokens, prefill
from logitless.generation.result import Rollout, left_pad
from logitless.generation.sampling import RandomSource, check_random_source, check_sampling_args, row_keys
from logitless.generation.tools.session import TurnSession
from logitless.generation.tools.turn_loop import drive_turns, turn_rollout
from logitless.generation.tools.turn_step import advance, eager_turn_step, new_turn_state, prefill_segment

__all__ = ["DEFAULT_SEGMENT_PREFILL_TOKENS", "check_turn_args", "check_turn_length", "generate_turns", "turn_keys"]


def check_turn_args(model: nn.Module, session: TurnSession, max_new_tokens: int, stop_tokens: Sequence[int],
                    temperature: float, top_k: Optional[int], top_p: Optional[float], generator: RandomSource,
                    prefill_chunk_tokens: Optional[int] = None,
                    segment_prefill_tokens: Union[int, str, None] = None) -> None:
    """The checks of a multi-turn sampler call, before any compute.

    Raises:
        ValueError: naming the argument and what was expected.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if len(stop_tokens) == 0:
        raise ValueError("stop_tokens must hold at least one token id (the chat format's end of turn)")
    check_sampling_args(temperature, top_k, top_p)
    check_prefill_chunk_tokens(prefill_chunk_tokens)
    if segment_prefill_tokens not in (None, "auto") and (not isinstance(segment_prefill_tokens, int)
                                                         or isinstance(segment_prefill_tokens, bool)
                                                         or segment_prefill_tokens < 2):
        raise ValueError(f"segment_prefill_tokens must be None (feed every continuation one token per step), 'auto' "
                         f"(the sampler's default) or an int >= 2, got {segment_prefill_tokens!r}")
    check_random_source(generator, len(session.prompts))
    if model.caches_are_setup():
        raise ValueError("the model already has KV caches set up; the multi-turn samplers set up and delete their own")


def check_turn_length(model: nn.Module, width: int, max_new_tokens: int) -> None:
    """Raises ValueError when the longest prompt and the budget exceed the model's ``max_seq_len``."""
    limit = getattr(model, "max_seq_len", None)
    if isinstance(limit, int) and width + max_new_tokens > limit:
        raise ValueError(f"the longest prompt ({width} tokens) + max_new_tokens ({max_new_tokens}) = "
                         f"{width + max_new_tokens} exceeds the model's max_seq_len={limit}; shorten the prompts or "
                         f"max_new_tokens")


#: Continuations of at least this many tokens go into their row's cache in one forward of that row
#: rather than one token per step (the eager sampler's default). Fed, a continuation costs its row one
#: step per token but no extra work (the steps run for the other rows anyway); prefilled, it costs one
#: forward during which no other row moves. An eager step costs about what that forward costs (both are
#: bound by the host's launches), so here even a short answer is worth its forward.
DEFAULT_SEGMENT_PREFILL_TOKENS = 128


def turn_keys(generator: RandomSource, temperature: float, num_prompts: int, num_generations: int,
              device: torch.device) -> torch.Tensor:
    """The rows' counter-stream keys (:func:`~logitless.generation.sampling.row_keys`); zeros when
    greedy, which draws nothing (no generator, not even torch's global one, is consumed)."""
    if temperature == 0:
        return torch.zeros(num_prompts * num_generations, dtype=torch.long, device=device)
    return row_keys(generator, num_prompts, num_generations, device)


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
    segment_prefill_tokens: Union[int, str, None] = "auto",
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
        generator (RandomSource): where the rows' counter-stream keys come from: one generator, or one
            per prompt (:func:`~logitless.generation.sampling.row_keys`, as the compiled sampler draws them).
        prefill_chunk_tokens (Optional[int]): tokens per prompt-prefill forward (None: one forward).
        segment_prefill_tokens (Optional[int]): a continuation of at least this many tokens goes into
            its row's cache in one forward of that row (:func:`~logitless.generation.tools.turn_step.prefill_segment`);
            shorter ones are fed one token per step, alongside the other rows' tokens; None: always fed;
            ``"auto"``: :data:`DEFAULT_SEGMENT_PREFILL_TOKENS`.

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

    check_turn_args(model, session, max_new_tokens, stop_tokens, temperature, top_k, top_p, generator,
                    prefill_chunk_tokens, segment_prefill_tokens)
    param = next(model.parameters())
    device = param.device
    g = session.num_generations
    tokens, prompt_mask = left_pad(session.prompts, pad_id, device)
    tokens = tokens.repeat_interleave(g, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(g, dim=0)
    n, width = tokens.shape
    check_turn_length(model, width, max_new_tokens)
    columns = width + max_new_tokens + 1
    weight = head_weight(model)
    keys = turn_keys(generator, temperature, len(session.prompts), g, device)
    state = new_turn_state(prompt_mask, keys, budget=max_new_tokens, columns=columns, vocab=weight.shape[0],
                           stop_tokens=stop_tokens, pad_id=pad_id)
    draw = (temperature, top_k, top_p, pad_id)
    if device.type == "cuda":
        register_counter_draw()  # advance() draws through the Triton op on CUDA
    was_training = model.training
    model.eval()
    try:
        with local_kv_cache(model, batch_size=n, device=device, dtype=param.dtype, decoder_max_seq_len=columns):
            attns = [m for m in model.modules() if isinstance(m, MultiHeadAttention) and m.kv_cache is not None]
            logits = prefill(model, tokens, input_pos=(prompt_mask.long().cumsum(1) - 1).clamp(min=0),
                             prompt_mask=prompt_mask, chunk_tokens=prefill_chunk_tokens, weight=weight)
            advance(state, logits, draw)
            caches = [(a.kv_cache.k_cache, a.kv_cache.v_cache) for a in attns]
            truncated, _ = drive_turns(
                session, state, lambda: eager_turn_step(model, attns, caches, state, weight, draw), sync_every=1,
                prefill_tokens=(DEFAULT_SEGMENT_PREFILL_TOKENS if segment_prefill_tokens == "auto"
                                else segment_prefill_tokens),
                prefill=lambda b, ids: prefill_segment(model, attns, caches, state, b, ids))
    finally:
        model.train(was_training)
    return turn_rollout(state, tokens, prompt_mask, truncated, session)
