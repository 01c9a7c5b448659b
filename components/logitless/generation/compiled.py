"""The compiled sampler: shared-prompt prefill, static KV caches, a compiled decode step.

Same inputs, outputs and sampling semantics as :func:`logitless.generation.eager.generate` (the eager
reference sampler), four differences in how the work is done:

1. **Prefill once per group.** The P distinct prompts are prefilled as a batch of P (not P x G);
   each prompt's key/value cache entries are then copied into its G decode rows. A group's rows
   hold identical prompt entries, so decoding is unchanged and the prefill costs G times less.
   Long prompts are prefilled in chunks of columns, at most ``prefill_chunk_tokens`` tokens per
   forward (:mod:`logitless.generation.prefill`).
2. **Static caches, a few fixed shapes.** The decode caches are torchtune ``KVCache`` modules of a
   fixed ``[N, kv_heads, L, head_dim]`` (``N = P x G``, ``L`` = prompt width + new tokens rounded up
   to ``cache_len_multiple``, or ``max_cache_len``). All step inputs and outputs live in persistent
   buffers updated in place, so a captured CUDA graph reads and writes them where they are. When
   rows finish, the live ones move into the next smaller batch bucket (N, N/2, ... rows: the first
   rows of the same caches), and decode attention reads the filled window of the cache only.
3. **Compiled decode step, sampling included.** ``torch.compile`` of the trunk + final norm + head
   projection of the last position + the draw of the next token from a counter-based stream keyed
   by (row, step, token) and its bookkeeping (``mode="reduce-overhead"`` on CUDA: a CUDA graph per
   bucket and window; no graph break). The host syncs only for the live-row count
   every ``sync_every`` steps. ``draws="generator"`` samples eagerly with ``torch.multinomial``
   instead (the eager sampler's draws, without compaction).
4. **Grouped-query decode attention.** torchtune's attention copies K/V once per query head
   before SDPA (7x the cache for Qwen2.5-0.5B, every layer and step); the decode step instead
   folds the query heads that share a K/V head into SDPA's query axis (same result, the cache is
   read once). ``grouped_attention=False`` keeps torchtune's layers as they are.
   On CUDA (``decode_attention="auto"``, the default) a split-K Triton kernel replaces SDPA
   there: its reads follow the filled columns and the live rows (no window: one CUDA graph per
   bucket for every step); it measured 1.4-3x faster than the windowed SDPA on an H200.
5. **Fewer, larger GEMMs.** The grouped decode step reads the q/k/v weights as one matrix and
   the MLP's gate/up weights as another (:mod:`logitless.generation.fused`: a copy refreshed
   from the model's weights at the start of every call), halving the small launch-bound GEMMs
   per layer. The prefill runs the model's own layers.

Only ``[rows, V]`` logits of one position ever exist. The caches are attached to the model only
inside the call and detached on exit, even on error: a torchtune 0.6.1 model with caches set up but
disabled attends bidirectionally when called without a mask.

This module is the driver (options, compilation, the prefill and the sampling loop); the traced
step is :mod:`logitless.generation.decode_step`, the buffers, buckets and compaction
:mod:`logitless.generation.decode_cache`.
"""

import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from logitless.generation.config import CompiledSamplerConfig
from logitless.generation.decode_cache import (DecodeBuffers, attach, attention_modules, detach, new_caches,
                                               replicate_prompts)
from logitless.generation.decode_step import (decode_step, groupable, kernel_draw, record, register_counter_draw,
                                              register_decode_attention, register_decode_rotary, write_tokens)
from logitless.generation.fused import FusedProjections
from logitless.generation.prefill import DEFAULT_PREFILL_CHUNK_TOKENS, check_prefill_chunk_tokens, prefill
from logitless.generation.result import Rollout, left_pad
from logitless.generation.sampling import (RandomSource, check_random_source, check_sampling_args, row_keys,
                                           sample_next)
from logitless.generation.trunk import decoding_layer
from logitless.first_start import note_compile

__all__ = ["CompiledSampler", "SHARED_PROMPT_MIN_ELEMENTS", "SHARED_PROMPT_MIN_ROWS", "SHARED_PROMPT_MIN_WIDTH",
           "generate"]

#: Where ``shared_prompt_decode=None`` reads each group's prompt once: prompts of at least
#: ``SHARED_PROMPT_MIN_WIDTH`` columns whose K/V elements per row and layer (columns x K/V heads x
#: head_dim) reach ``SHARED_PROMPT_MIN_ELEMENTS``, in buckets of at least ``SHARED_PROMPT_MIN_ROWS``
#: rows. On an H200 at 64 rows (groups of 8 and 16), with the prefix kernel overlapping the rows'
#: (``experiments/results/decode_attention_shared_threshold_h200.csv``), the attention took 0.53-1.00x
#: the per-row kernel's time at 2^17 elements and above (Qwen2.5-0.5B with 1024-column prompts,
#: 1.5B with 512 and 1024, 7B with 512), 0.74-0.90x at 1.5B with 256 columns but 0.82-1.14x at 0.5B
#: with 512 (2^16 elements), and 0.96-1.22x with 128-column prompts; it took longer at 16 rows
#: (``decode_attention_shared_h200.csv``).
SHARED_PROMPT_MIN_ELEMENTS, SHARED_PROMPT_MIN_WIDTH, SHARED_PROMPT_MIN_ROWS = 2 ** 17, 256, 32


def _check_args(max_new_tokens, num_generations, stop_tokens, temperature, top_k, top_p) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be an int >= 1, got {num_generations!r}")
    if len(stop_tokens) == 0:
        raise ValueError("stop_tokens must hold at least one token id (e.g. the tokenizer's eos_id)")
    check_sampling_args(temperature, top_k, top_p)



class CompiledSampler:
    """Sampler with shared-prompt prefill, static KV caches and a compiled decode step.

    Keep one instance per model for a training run: it holds the compiled step and, when
    ``keep_cache`` is on, the cache and step buffers, so that later calls of the same shape reuse the
    compiled code and the captured CUDA graph (new buffer addresses would force a re-capture).

    Args:
        config (Optional[CompiledSamplerConfig]): the options (what each one does:
            :class:`~logitless.generation.config.CompiledSamplerConfig`); None = made from ``options``.
        prefill_chunk_tokens (Optional[int]): at most this many tokens (distinct prompts x prompt
            columns) per prefill forward: long prompts are prefilled in chunks of columns within a
            memory bound (:func:`~logitless.generation.prefill.prefill`); default
            :data:`~logitless.generation.prefill.DEFAULT_PREFILL_CHUNK_TOKENS` (8192: smaller
            prompt batches keep one forward); None = one forward whatever the width.
        **options: the fields of a :class:`~logitless.generation.config.CompiledSamplerConfig`, when no
            ``config`` is given (``CompiledSampler(compile=False, sync_every=4)``).

    Raises:
        OptionError: an option with a bad value, naming it.
        TypeError: both ``config`` and ``options``.

    Example:
        >>> from logitless.models import qwen2_5_tiny
        >>> sampler = CompiledSampler(compile=False)
        >>> out = sampler(qwen2_5_tiny(), [[1, 2, 3], [4]], max_new_tokens=5, stop_tokens=[0],
        ...               pad_id=0, num_generations=2)
        >>> out.completion_tokens.shape[0]
        4
    """

    def __init__(self, config: Optional[CompiledSamplerConfig] = None, *,
                 prefill_chunk_tokens: Optional[int] = DEFAULT_PREFILL_CHUNK_TOKENS, **options) -> None:
        if config is not None and options:
            raise TypeError(f"CompiledSampler: give a config or its options, not both (got a config and "
                            f"{sorted(options)})")
        if config is not None and not isinstance(config, CompiledSamplerConfig):
            raise TypeError(f"CompiledSampler: config must be a CompiledSamplerConfig, got {type(config).__name__}")
        self.config = config if config is not None else CompiledSamplerConfig(**options)
        check_prefill_chunk_tokens(prefill_chunk_tokens)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        if self.config.decode_attention == "split_k":
            register_decode_attention()
        self._compiled = None
        self._state: Optional[DecodeBuffers] = None

    # ----------------------------------------------------------------------------------------- setup
    def _use_compile(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.config.compile is None else self.config.compile

    def uses_split_k(self, device: torch.device) -> bool:
        """Whether the grouped decode step on ``device`` attends through the split-K kernel
        (``decode_attention``: ``"split_k"``, or ``"auto"`` on CUDA with ``grouped_attention``)."""
        if self.config.decode_attention == "auto":
            if device.type != "cuda" or not self.config.grouped_attention:
                return False
            register_decode_attention()
            return True
        return self.config.decode_attention == "split_k"

    def uses_shared_prompt(self, model: nn.Module, device: torch.device, num_generations: int, width: int) -> bool:
        """Whether the decode steps of a call on ``device`` read each group's prompt columns once, in
        buckets of enough rows (``shared_prompt_decode``; None: see its rule in the class docstring).
        Needs the split-K attention (:meth:`uses_split_k`).

        Raises:
            ValueError: ``shared_prompt_decode=True`` where the split-K attention does not run.
        """
        if self.config.shared_prompt_decode is False:
            return False
        split_k = self.uses_split_k(device)
        if self.config.shared_prompt_decode and not split_k:
            raise ValueError(f"shared_prompt_decode=True needs the split-K decode attention, which decode_attention="
                             f"{self.config.decode_attention!r} does not run on {device} (use 'split_k')")
        if not (split_k and num_generations > 1):
            return False
        attn = attention_modules(model)[0]
        elements = width * attn.num_kv_heads * attn.head_dim  # one row's prompt keys (or values) in a layer
        return bool(self.config.shared_prompt_decode) or (width >= SHARED_PROMPT_MIN_WIDTH
                                                   and elements >= SHARED_PROMPT_MIN_ELEMENTS)

    def uses_programmatic_launch(self, device: torch.device) -> bool:
        """Whether the decode step's kernels on ``device`` are programmatic dependent launches
        (``programmatic_launch``; None: where supported).

        Raises:
            ValueError: ``programmatic_launch=True`` where it is not supported, naming why.
        """
        from logitless.generation.kernels.decode_attention.plan import supports_programmatic_launch

        if self.config.programmatic_launch is False:
            return False
        compiled = self._use_compile(device)
        inductor = self.config.backend == "inductor" and hasattr(torch._inductor.config.triton, "enable_pdl")
        supported = supports_programmatic_launch(device) and (inductor or not compiled)
        if self.config.programmatic_launch and not supported:
            raise ValueError(f"programmatic_launch=True needs a CUDA GPU of compute capability 9.0 or later and, "
                             f"when the step is compiled, the inductor backend of a torch with "
                             f"torch._inductor.config.triton.enable_pdl; got {device}, compile={compiled}, "
                             f"backend={self.config.backend!r}")
        return supported

    def _compile_options(self, device: torch.device) -> Tuple[Optional[str], Optional[Dict[str, object]]]:
        """``(mode, options)`` for ``torch.compile``: ``mode`` (None: "reduce-overhead", i.e. CUDA
        graphs, on CUDA with inductor), given as inductor options when programmatic launches are added."""
        mode = self.config.mode
        if mode is None and device.type == "cuda" and self.config.backend == "inductor":
            mode = "reduce-overhead"
        if not self.uses_programmatic_launch(device):
            return mode, None
        from torch._inductor import list_mode_options

        # torch.compile takes a mode or options, not both: the mode's own options, plus PDL
        return None, {**list_mode_options(mode or "default"), "triton.enable_pdl": True}

    def _step_fn(self, device: torch.device):
        if not self._use_compile(device):
            return decode_step
        if self._compiled is None:
            mode, options = self._compile_options(device)
            # not fullgraph: a graph break on another torch version costs speed, not the run
            # (tests/generation/test_compiled.py checks the step is one graph)
            # the batch dimension of the bucket buffers is marked dynamic (one compilation for every
            # bucket; a CUDA graph is captured per bucket size), everything else is static
            graphs = mode == "reduce-overhead" or bool((options or {}).get("triton.cudagraphs"))
            note_compile("the sampler's decode step" + (" and its CUDA graphs (one per batch size)" if graphs else ""))
            self._compiled = torch.compile(decode_step, backend=self.config.backend, mode=mode, options=options,
                                           dynamic=None if self.config.compaction or self.config.attention_window else False)
        return self._compiled

    def _cache_len(self, width: int, max_new_tokens: int, extra: int = 0) -> int:
        """Cache columns for ``width`` prompt columns, ``max_new_tokens`` and ``extra`` more (the
        multi-turn sampler's scratch column), rounded up to ``cache_len_multiple``."""
        need = width + max_new_tokens + extra
        if self.config.max_cache_len is not None:
            if need > self.config.max_cache_len:
                more = f" + {extra} scratch column" if extra else ""
                raise ValueError(f"max_new_tokens: prompt width {width} + max_new_tokens {max_new_tokens}{more} "
                                 f"exceeds max_cache_len={self.config.max_cache_len}")
            return self.config.max_cache_len
        m = self.config.cache_len_multiple
        return -(-need // m) * m

    def _buffers(self, attns, rows: int, length: int, dtype, device, weight: torch.Tensor) -> DecodeBuffers:
        """The decode buffers of this shape: the kept ones when they match, else new ones."""
        if self._state is not None and self._state.key == DecodeBuffers.key_of(attns, rows, length, dtype, device,
                                                                               weight):
            return self._state
        self._state = None  # drop the old buffers before allocating new ones
        self._state = DecodeBuffers(attns, rows, length, dtype, device, weight, dynamic_rows=self.config.compaction)
        return self._state

    def _grouped_everywhere(self, model: nn.Module) -> bool:
        """Every layer runs the grouped decode step, which can read any window of any bucket."""
        return self.config.grouped_attention and all(groupable(decoding_layer(layer)) for layer in model.layers)

    def _sizes(self, rows: int, grouped: bool) -> List[int]:
        """The batch buckets, largest first: ``rows`` alone, or halving down to ``min_bucket``."""
        sizes = [rows]
        if not (self.config.compaction and self.config.draws == "counter" and grouped):
            return sizes
        while sizes[-1] > self.config.min_bucket and -(-sizes[-1] // 2) >= self.config.min_bucket:
            sizes.append(-(-sizes[-1] // 2))
        return sizes

    def _fused(self, state, model: nn.Module, grouped: bool) -> Optional[List[Dict]]:
        """Each layer's concatenated projections, refreshed from the model's current weights; None
        when fusion is off or the layers do not run the grouped decode step."""
        if not (self.config.fused_projections and grouped):
            return None
        layers = [decoding_layer(layer) for layer in model.layers]
        fused = state.fused
        share = self.config.fused_projections == "shared"
        if fused is None or not fused.matches(layers) or fused.share != share:
            state.fused = fused = None  # drop the old copy before allocating a new one
            state.fused = fused = FusedProjections(layers, share=share)
        fused.refresh(layers)
        return fused.layers()

    def release(self) -> None:
        """Frees the kept cache and step buffers (the compiled step stays)."""
        self._state = None

    # --------------------------------------------------------------------------------------- phases
    def _prefill(self, model, attns, tokens, prompt_mask, weight, dtype) -> Tuple[torch.Tensor, list]:
        """Runs the distinct prompts once (in chunks of at most ``prefill_chunk_tokens`` tokens);
        returns last-position logits ``(P, V)`` and their caches."""
        rows, width = tokens.shape
        caches = new_caches(attns, rows, width, dtype, tokens.device)
        attach(attns, caches)
        try:
            positions = (prompt_mask.long().cumsum(1) - 1).clamp(min=0)
            logits = prefill(model, tokens, input_pos=positions, prompt_mask=prompt_mask,
                             chunk_tokens=self.prefill_chunk_tokens, weight=weight)
        finally:
            detach(attns)
        return logits, caches

    # ------------------------------------------------------------------------------------------ call
    @torch.no_grad()
    def __call__(
        self,
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

        Args:
            model (nn.Module): a torchtune ``TransformerDecoder`` (wrapped or not; LoRA or not)
                without KV caches set up; switched to ``eval()`` for the call, then restored.
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

        Returns:
            Rollout: as :func:`logitless.generation.eager.generate` returns it.

        Raises:
            ValueError: on bad arguments or a model whose caches are already set up.
        """
        from logitless.modules import head_weight

        _check_args(max_new_tokens, num_generations, stop_tokens, temperature, top_k, top_p)
        check_random_source(generator, len(prompts))
        if model.caches_are_setup():
            raise ValueError("model: KV caches are already set up; the fast sampler attaches its own "
                             "(call torchtune.modules.common_utils.delete_kv_caches(model) first)")
        attns = attention_modules(model)
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
        self.uses_programmatic_launch(device)  # programmatic_launch=True where unsupported: an error before any compute
        tokens, prompt_mask = left_pad(prompts, pad_id, device)
        groups = num_generations
        rows, width = tokens.shape[0] * groups, tokens.shape[1]
        length = self._cache_len(width, max_new_tokens)

        was_training = model.training
        model.eval()
        try:
            weight = head_weight(model)  # a Parameter (tied/untied head) is used in place
            state = self._buffers(attns, rows, length, dtype, device, weight)
            if state.weight is not None:  # e.g. a merged LoRA head: copy into the fixed buffer
                state.weight.copy_(weight)
                weight = state.weight
            logits, small = self._prefill(model, attns, tokens, prompt_mask, weight, dtype)
            replicate_prompts(small, state.caches, groups, width)
            del small
            full_mask = prompt_mask.repeat_interleave(groups, dim=0)
            attach(attns, state.caches)
            try:
                out = self._decode(model, state, logits.repeat_interleave(groups, dim=0), full_mask,
                                   weight, groups=groups, max_new_tokens=max_new_tokens,
                                   stop_tokens=stop_tokens, pad_id=pad_id, temperature=temperature,
                                   top_k=top_k, top_p=top_p, generator=generator)
            finally:
                detach(attns)
        finally:
            model.train(was_training)
            if not (self._use_compile(device) if self.config.keep_cache is None else self.config.keep_cache):
                self._state = None
        out_tokens, out_mask, out_logp, done = out
        steps = max(int(out_mask.sum(dim=1).max()), 1)  # the call's only other host sync
        return Rollout(
            prompt_tokens=tokens.repeat_interleave(groups, dim=0),
            prompt_mask=full_mask,
            completion_tokens=out_tokens[:, :steps],
            completion_mask=out_mask[:, :steps],
            truncated=~done,
            sampler_log_probs=out_logp[:, :steps],
            num_generations=groups,
        )

    def _decode(self, model, state, logits, prompt_mask, weight, *, groups, max_new_tokens, stop_tokens, pad_id,
                temperature, top_k, top_p, generator):
        """The sampling loop: token 0 from the prefill's ``logits``, then one step per token.

        With counter draws the step samples and writes inside the captured graph, and the host
        only checks every ``sync_every`` steps how many rows are live: it stops when none is and
        moves the live rows into a smaller bucket when they fit (:meth:`_compact`).
        """
        device = logits.device
        rows, width = prompt_mask.shape
        step = self._step_fn(device)
        graphs = self._use_compile(device) and device.type == "cuda"
        counter = self.config.draws == "counter"
        if counter and kernel_draw(logits, top_k, top_p):
            register_counter_draw()  # before tracing: the step calls the op
        if self.uses_split_k(device):
            # the split-K kernels' counters, outside the CUDA graphs' memory pool
            register_decode_attention().reserve_arrivals(device)
            register_decode_rotary()  # before tracing: the step calls the op
        grouped = self._grouped_everywhere(model)
        fused = self._fused(state, model, self.config.grouped_attention)
        sizes = self._sizes(rows, grouped)
        shared = state.shared
        length = state.length
        split_k = self.uses_split_k(device)
        programmatic = self.uses_programmatic_launch(device)
        shared_prompt = 0  # rows per segment of a shared prompt (0: none)
        state.segments = None
        if grouped and self.uses_shared_prompt(model, device, groups, width):
            attn = attention_modules(model)[0]
            shared_prompt = state.share_prompt(attn.num_heads // attn.num_kv_heads, rows, groups, width)
        windowed = self.config.attention_window is not None and grouped and not split_k  # split-K reads the filled columns
        bucket = state.bucket(rows, views=grouped)
        # every row starts live, in its own slot; token 0 is written at t = 0
        bucket["key_valid"].fill_(True)
        bucket["key_valid"][:, :width].copy_(prompt_mask)
        bucket["input_pos"].copy_(prompt_mask.sum(dim=1, keepdim=True))
        bucket["done"].fill_(False)
        bucket["slots"].copy_(torch.arange(rows, device=device))
        shared["col"].fill_(width)
        shared["n_filled"].fill_(width + 1)
        shared["t"].zero_()
        shared["out_tokens"].fill_(pad_id)
        shared["out_mask"].zero_()
        shared["out_logp"].zero_()
        vocab = shared["is_stop"].shape[0]
        shared["is_stop"].zero_()
        ids = torch.as_tensor([s for s in stop_tokens if 0 <= s < vocab], dtype=torch.long, device=device)
        shared["is_stop"][ids] = True  # an id outside the vocabulary is never drawn
        draw = (temperature, top_k, top_p, pad_id)
        if counter:
            bucket["keys"].copy_(row_keys(generator, rows // groups, groups, device))
            record(bucket, shared, logits, draw)
        else:
            write_tokens(bucket, shared, *sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                                generator=generator), pad_id)
        logits = None
        for t in range(1, max_new_tokens):
            if t % self.config.sync_every == 0:
                live = int((~bucket["done"]).sum())
                if live == 0:
                    break
                smaller = [s for s in sizes if s >= live and s < bucket["done"].shape[0]]
                if smaller:
                    bucket = self._compact(state, bucket, min(smaller), pad_id)
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            columns = None
            if windowed:  # this step writes column width + t - 1
                columns = state.columns[:min(length, -(-(width + t) // self.config.attention_window) * self.config.attention_window)]
                torch._dynamo.mark_static_address(columns)
                torch._dynamo.maybe_mark_dynamic(columns, 0)
            in_graph = counter and self.config.graph_sampling
            big = self.config.shared_prompt_decode or bucket["done"].shape[0] >= SHARED_PROMPT_MIN_ROWS  # else per row
            logits = step(model, bucket, shared, weight, self.config.grouped_attention, draw if in_graph else None, columns,
                          fused, split_k, programmatic, shared_prompt if big else 0)
            if counter and not in_graph:
                record(bucket, shared, logits, draw)
                logits = None
            elif not counter:
                write_tokens(bucket, shared, *sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                                    generator=generator), pad_id)
                logits = None  # the step's output buffer is overwritten by the next replay
        done = (shared["out_mask"] & shared["is_stop"][shared["out_tokens"].clamp(0, vocab - 1)]).any(dim=1)
        return (shared["out_tokens"][:rows, :max_new_tokens], shared["out_mask"][:rows, :max_new_tokens],
                shared["out_logp"][:rows, :max_new_tokens], done[:rows])

    @staticmethod
    def _compact(state: DecodeBuffers, bucket: Dict[str, torch.Tensor], size: int,
                 pad_id: int) -> Dict[str, torch.Tensor]:
        """Moves the live rows of ``bucket`` into the ``size``-row bucket (:meth:`DecodeBuffers.compact`)."""
        return state.compact(bucket, size, pad_id)


_SAMPLERS: "weakref.WeakKeyDictionary[nn.Module, CompiledSampler]" = weakref.WeakKeyDictionary()


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
    **options,
) -> Rollout:
    """Drop-in for :func:`logitless.generation.eager.generate` backed by a per-model :class:`CompiledSampler`.

    The sampler (compiled step, kept buffers) is created on the first call for ``model`` and reused
    while ``options`` are unchanged, so a training loop gets one compilation.

    Args:
        model, prompts, max_new_tokens, stop_tokens, pad_id, num_generations, temperature, top_k,
        top_p, generator: as in :func:`logitless.generation.eager.generate`.
        **options: :class:`CompiledSampler` arguments: ``prefill_chunk_tokens`` and the fields of
            :class:`~logitless.generation.config.CompiledSamplerConfig` (``compile``, ``backend``,
            ``sync_every``, ``max_cache_len``, ``decode_attention``, ...).

    Returns:
        Rollout: tokens, masks, truncation flags and sampler log-probs.

    Example:
        >>> from logitless.models import qwen2_5_tiny
        >>> out = generate(qwen2_5_tiny(), [[1, 2, 3]], max_new_tokens=4, stop_tokens=[0], pad_id=0,
        ...                num_generations=2, compile=False)
        >>> out.prompt_tokens.shape
        torch.Size([2, 3])
    """
    sampler = _SAMPLERS.get(model)
    if sampler is None or getattr(sampler, "_options", None) != options:
        sampler = CompiledSampler(**options)
        sampler._options = dict(options)
        _SAMPLERS[model] = sampler
    return sampler(model, prompts, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens, pad_id=pad_id,
                   num_generations=num_generations, temperature=temperature, top_k=top_k, top_p=top_p,
                   generator=generator)
