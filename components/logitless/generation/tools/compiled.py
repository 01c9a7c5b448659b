"""The compiled multi-turn sampler: tool rollouts at the speed of the compiled single-turn sampler.

:class:`CompiledTurnSampler` samples what :func:`~logitless.generation.tools.eager.generate_turns`
samples (the same state, draws and host loop: :mod:`logitless.generation.tools.turn_step`,
:mod:`logitless.generation.tools.turn_loop`), with the compiled sampler's machinery where the work is:

1. **Prefill once per group**: the P distinct prompts run as a batch of P, their cache entries are
   copied into each group's G rows (:func:`~logitless.generation.decode_cache.replicate_prompts`).
2. **One compiled step for every row, whatever its turn**: the grouped-attention decode layers
   (query heads sharing a K/V head folded into one attention, the concatenated q/k/v and gate/up
   projections, the split-K attention kernel on CUDA) with each row writing its own cache column,
   the head on the last position and the counter draw, all in a captured CUDA graph
   (``mode="reduce-overhead"``). A tool's answer is fed through the same step, one token per step,
   while the other rows decode: no forward of another shape is ever compiled. The split-K kernel's
   columns per split are fixed by the cache's shape (the single-turn sampler chooses them from the
   fill, which here follows the batch's longest row): a row's attention does not depend on where the
   other rows are.
3. **Host syncs every ``sync_every`` steps** only, to hand ended turns to their environments and
   take their answers (a row's turn end is seen up to ``sync_every`` steps late; the row is
   paused on the device meanwhile, so no token is lost, only those steps of its slot).

The cache and step buffers of one shape (rows, cache columns) are kept between calls, so the
captured graph is replayed; the cache has ``prompt width + max_new_tokens + 1`` columns rounded up
to ``cache_len_multiple``. Finished rows are not compacted into smaller batches: they idle in their
slot until the rollout ends, with their cache columns hidden so the attention reads almost nothing
for them (:func:`~logitless.generation.tools.turn_step.retire_rows`). A model whose layers cannot run
the grouped step (hooks, another attention class) is sampled by the eager reference instead.

Example:
    >>> sampler = CompiledTurnSampler(compile=False)
    >>> rollout = sampler(model, session, max_new_tokens=256, stop_tokens=[im_end], pad_id=0)
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from logitless._platform import sm_count
from logitless.first_start import note_compile
from logitless.generation.compiled import CompiledSampler
from logitless.generation.config import CompiledSamplerConfig, OptionError
from logitless.generation.decode_cache import attention_modules, new_caches, replicate_prompts
from logitless.generation.decode_step import kernel_draw, register_counter_draw, register_decode_attention
from logitless.generation.kernels.decode_attention.plan import default_split_len
from logitless.generation.prefill import DEFAULT_PREFILL_CHUNK_TOKENS
from logitless.generation.result import Rollout, left_pad
from logitless.generation.sampling import RandomSource
from logitless.generation.tools.eager import check_turn_args, check_turn_length, generate_turns, turn_keys
from logitless.generation.tools.session import TurnSession
from logitless.generation.tools.turn_loop import drive_turns, turn_rollout
from logitless.generation.tools.turn_step import (TurnState, advance, grouped_turn_step, new_turn_state,
                                                  prefill_segment)

__all__ = ["COMPILED_SEGMENT_PREFILL_TOKENS", "CompiledTurnSampler"]

#: The compiled sampler's default ``segment_prefill_tokens``. Its steps are CUDA graphs (1.6 ms for
#: 64 rows of a 0.5B model on an H100) while a segment's forward runs the model's layers eagerly
#: (35-45 ms) and holds every row, so feeding an answer through the steps wins until answers are
#: about this long (measured break-even at 64 rows and 4 turns, ``bench_tool_rollouts.py``).
COMPILED_SEGMENT_PREFILL_TOKENS = 1024


class _Buffers:
    """The kept caches and step state of one shape (a captured graph reads them in place)."""

    def __init__(self, key: tuple, caches: List[nn.Module], state: TurnState):
        self.key, self.caches, self.state = key, caches, state
        self.pairs = [(c.k_cache, c.v_cache) for c in caches]
        self.fused = None  # the sampler's concatenated projections (CompiledSampler._fused keeps them here)
        self.weight: Optional[torch.Tensor] = None  # a head weight that is not a Parameter, at a fixed address
        for t in list(state.values()) + [t for pair in self.pairs for t in pair]:
            torch._dynamo.mark_static_address(t)


class CompiledTurnSampler:
    """Multi-turn sampler with a compiled decode step (see the module docstring).

    Keep one instance per model for a training run (it holds the compiled step and the buffers).
    :attr:`last_steps` holds the decode steps of the last call.

    Args:
        config (Optional[CompiledSamplerConfig]): the compiled sampler's options (``compile``,
            ``sync_every``, ``fused_projections``, ``decode_attention``, ``programmatic_launch``,
            ``cache_len_multiple``, ``max_cache_len``, ``backend``, ``mode``, ``keep_cache``); None = made from
            ``options``. ``draws`` must be ``"counter"`` (the turn sampler's draws are keyed by position).
        prefill_chunk_tokens (Optional[int]): tokens per prompt-prefill forward (None: one forward).
        **options: the fields of a :class:`CompiledSamplerConfig`, when no ``config`` is given.

    Raises:
        OptionError: a bad option, or ``draws="generator"``.
    """

    def __init__(self, config: Optional[CompiledSamplerConfig] = None, *,
                 prefill_chunk_tokens: Optional[int] = DEFAULT_PREFILL_CHUNK_TOKENS, **options):
        self.single = CompiledSampler(config, prefill_chunk_tokens=prefill_chunk_tokens, **options)
        self.config = self.single.config
        if self.config.draws != "counter":
            raise OptionError("draws", f"draws={self.config.draws!r}: the multi-turn sampler draws each row's token t "
                                       f"from the counter stream of (row, t) only; use draws='counter'")
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._compiled = None
        self._buffers: Optional[_Buffers] = None
        self.last_steps = 0  # decode steps of the last call (every row in each)

    def _step_fn(self, device: torch.device):
        if not self.single._use_compile(device):
            return grouped_turn_step
        if self._compiled is None:
            mode, options = self.single._compile_options(device)
            graphs = mode == "reduce-overhead" or bool((options or {}).get("triton.cudagraphs"))
            note_compile("the multi-turn sampler's decode step" + (" and its CUDA graph" if graphs else ""))
            self._compiled = torch.compile(grouped_turn_step, backend=self.config.backend, mode=mode, options=options,
                                           dynamic=False)
        return self._compiled

    def _kept(self, attns, state: TurnState, columns: int, dtype, device) -> _Buffers:
        """The buffers of this shape, refilled from ``state`` (the kept ones when the shape matches)."""
        key = (tuple(state["out_tokens"].shape), columns, dtype, device, len(attns), state["is_stop"].shape[0])
        kept = self._buffers
        if kept is None or kept.key != key:
            self._buffers = None  # free the old buffers first
            kept = self._buffers = _Buffers(key, new_caches(attns, state["tokens"].shape[0], columns, dtype, device),
                                            state)
            return kept
        for name, value in state.items():
            kept.state[name].copy_(value)
        return kept

    def release(self) -> None:
        """Frees the kept cache and step buffers (the compiled step stays)."""
        self._buffers = None

    @torch.no_grad()
    def __call__(
        self,
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
        prefill_chunk_tokens: Optional[int] = None,
        segment_prefill_tokens: Union[int, str, None] = "auto",
    ) -> Rollout:
        """Samples a multi-turn trajectory for every row of ``session``.

        Args: as :func:`~logitless.generation.tools.eager.generate_turns` (``prefill_chunk_tokens``:
            None keeps the sampler's own). A continuation prefilled in one forward
            (``segment_prefill_tokens``; ``"auto"``: :data:`COMPILED_SEGMENT_PREFILL_TOKENS`, or the
            eager sampler's default where a model falls back to it) runs the model's own layers,
            outside the CUDA graph.

        Returns:
            Rollout: as :func:`~logitless.generation.tools.eager.generate_turns` returns it.

        Raises:
            ValueError: on bad arguments or a model whose caches are already set up.
        """
        from logitless.modules import head_weight

        chunk = self.prefill_chunk_tokens if prefill_chunk_tokens is None else prefill_chunk_tokens
        check_turn_args(model, session, max_new_tokens, stop_tokens, temperature, top_k, top_p, generator, chunk,
                        segment_prefill_tokens)
        if not self.single._grouped_everywhere(model):
            return generate_turns(model, session, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens,
                                  pad_id=pad_id, temperature=temperature, top_k=top_k, top_p=top_p,
                                  generator=generator, prefill_chunk_tokens=chunk,
                                  segment_prefill_tokens=segment_prefill_tokens)
        attns = attention_modules(model)
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        self.single.uses_programmatic_launch(device)  # an unsupported programmatic_launch=True: an error now
        g = session.num_generations
        prompts, prompt_mask = left_pad(session.prompts, pad_id, device)
        width = prompts.shape[1]
        check_turn_length(model, width, max_new_tokens)
        columns = self.single._cache_len(width, max_new_tokens, extra=1)  # the last column: idle rows' scratch
        full_mask = prompt_mask.repeat_interleave(g, dim=0)
        draw = (temperature, top_k, top_p, pad_id)
        was_training = model.training
        model.eval()
        try:
            weight = head_weight(model)  # a Parameter (tied or untied head) is read in place
            state = new_turn_state(full_mask, turn_keys(generator, temperature, len(session.prompts), g, device),
                                   budget=max_new_tokens, columns=columns, vocab=weight.shape[0],
                                   stop_tokens=stop_tokens, pad_id=pad_id)
            kept = self._kept(attns, state, columns, dtype, device)
            state = kept.state
            if not isinstance(weight, nn.Parameter):  # e.g. a merged LoRA head: into a fixed buffer
                if kept.weight is None or kept.weight.shape != weight.shape or kept.weight.dtype != weight.dtype:
                    kept.weight = torch.empty_like(weight)
                    torch._dynamo.mark_static_address(kept.weight)
                weight = kept.weight.copy_(weight)
            logits, small = self.single._prefill(model, attns, prompts, prompt_mask, weight, dtype)
            replicate_prompts(small, kept.caches, g, width)
            del small
            if kernel_draw(logits, top_k, top_p):
                register_counter_draw()  # before tracing: the step calls the op
            split_k = self.single.uses_split_k(device)
            split_len = 0
            if split_k:
                register_decode_attention().reserve_arrivals(device)
                attn = attns[0]
                split_len = default_split_len(state["tokens"].shape[0], attn.num_kv_heads, columns, sm_count(device))
            programmatic = self.single.uses_programmatic_launch(device)
            fused = self.single._fused(kept, model, True)
            advance(state, logits.repeat_interleave(g, dim=0), draw)
            step = self._step_fn(device)
            graphs = self.single._use_compile(device) and device.type == "cuda"

            def one_step():
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                step(model, state, kept.pairs, weight, draw, fused, split_k, programmatic, split_len)

            truncated, self.last_steps = drive_turns(
                session, state, one_step, sync_every=self.config.sync_every,
                prefill_tokens=(COMPILED_SEGMENT_PREFILL_TOKENS if segment_prefill_tokens == "auto"
                                else segment_prefill_tokens),
                prefill=lambda b, ids: prefill_segment(model, attns, kept.pairs, state, b, ids))
            rollout = turn_rollout(state, prompts.repeat_interleave(g, dim=0), full_mask, truncated, session)
        finally:
            model.train(was_training)
            if not (self.single._use_compile(device) if self.config.keep_cache is None else self.config.keep_cache):
                self._buffers = None
        return rollout
