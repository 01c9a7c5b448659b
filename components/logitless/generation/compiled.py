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

import warnings
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

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

__all__ = ["CompiledSampler", "DECODE_ATTENTION", "generate"]

#: The grouped decode step's attention implementations (``CompiledSampler(decode_attention=...)``).
DECODE_ATTENTION = ("auto", "sdpa", "split_k")
#: Where ``shared_prompt_decode=None`` reads each group's prompt once: prompts of at least
#: ``SHARED_PROMPT_MIN_WIDTH`` columns whose K/V elements per row and layer (columns x K/V heads x
#: head_dim) reach ``SHARED_PROMPT_MIN_ELEMENTS``, in buckets of at least ``SHARED_PROMPT_MIN_ROWS``
#: rows. On an H200 at 64 rows (groups of 8 and 16), with the prefix kernel overlapping the rows'
#: (``benchmarks/results/decode_attention_shared_threshold_h200.csv``), the attention took 0.53-1.00x
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



def _check_int(name: str, value, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be {'None or ' if optional else ''}an int >= {minimum}, got {value!r}")

class CompiledSampler:
    """Sampler with shared-prompt prefill, static KV caches and a compiled decode step.

    Keep one instance per model for a training run: it holds the compiled step and, when
    ``keep_cache`` is on, the cache and step buffers, so that later calls of the same shape reuse the
    compiled code and the captured CUDA graph (new buffer addresses would force a re-capture).

    Args:
        compile (Optional[bool]): compile the decode step; None = on CUDA only.
        backend (Union[str, Callable]): ``torch.compile`` backend ("inductor"; "eager"/"aot_eager"
            for CPU tests).
        mode (Optional[str]): ``torch.compile`` mode; None = "reduce-overhead" (CUDA graphs) on CUDA
            with inductor, else the default mode.
        sync_every (int): steps between "all rows finished?" checks (the loop's only host syncs).
        cache_len_multiple (int): the cache length is the prompt width + ``max_new_tokens`` rounded up
            to this, so calls with similar prompt widths share one compiled graph.
        max_cache_len (Optional[int]): fixed cache length for every call (one graph for a whole run;
            set it to the longest prompt + ``max_new_tokens``); overrides ``cache_len_multiple``.
        keep_cache (Optional[bool]): keep the cache and step buffers between calls (detached from
            the model); None = whenever the step is compiled. ``release()`` frees them.
        grouped_attention (bool): decode with grouped-query attention that reads each K/V head
            once (default); False runs torchtune's layers as they are (K/V copied per query head).
        draws (str): ``"counter"`` (default): tokens are drawn inside the decode step from a
            counter-based stream keyed by (row key, step, token) (:func:`~logitless.generation.sampling.sample_counter`;
            the row keys come from ``generator``), so sampling is part of the captured graph and a
            row's tokens do not depend on the rest of the batch; ``"generator"``: drawn eagerly
            with ``torch.multinomial`` from ``generator`` after each step (the eager sampler's draws).
        compaction (bool): when rows finish, move the live ones into the next smaller batch bucket
            (halving down to ``min_bucket``) so finished rows stop costing decode steps; needs
            ``draws="counter"`` and layers the grouped decode step can run (else off).
        min_bucket (int): the smallest bucket compaction moves rows into.
        graph_sampling (bool): with counter draws, sample inside the compiled step (default);
            False samples the same draws eagerly after it.
        attention_window (Optional[int]): decode attention reads the cache up to the filled column
            rounded up to a multiple of this (one CUDA graph per window size), not the whole cache;
            None reads the whole cache at every step. Needs the grouped decode step.
        fused_projections (Union[bool, str]): the grouped decode step computes q/k/v with one GEMM
            and the MLP's gate/up with another (:class:`~logitless.generation.fused.FusedProjections`;
            plain ``nn.Linear`` projections only, LoRA ones stay separate), about 12% faster decode
            steps at 1.5B. ``"shared"``: the concatenated weights are the model's own: its q/k/v and
            gate/up parameters are re-pointed at row slices of them on the first call (the same
            ``nn.Parameter`` objects, which the optimizer keeps updating), so nothing is copied or
            held twice, and a parameter replaced since is copied back in at the next call. ``True``: a
            copy refreshed from the model at the start of every call, held (about half the model)
            for as long as the cache buffers are kept, i.e. through the update too. ``False``
            (default): separate GEMMs.
        prefill_chunk_tokens (Optional[int]): at most this many tokens (distinct prompts x prompt
            columns) per prefill forward: long prompts are prefilled in chunks of columns within a
            memory bound (:func:`~logitless.generation.prefill.prefill`); default
            :data:`~logitless.generation.prefill.DEFAULT_PREFILL_CHUNK_TOKENS` (8192: smaller
            prompt batches keep one forward); None = one forward whatever the width.
        decode_attention (str): the grouped decode step's attention. ``"split_k"``: the split-K
            Triton kernel (:func:`logitless.generation.kernels.decode_attention`) whose programs cover the
            cache in fixed splits and read only the filled columns (a count on the device), so its
            work follows the filled length and the rows of a compacted bucket, and one CUDA graph
            per bucket serves every step (``attention_window`` is not used). Off CUDA it runs plain
            PyTorch unless ``TRITON_INTERPRET=1``. ``"sdpa"``: ``F.scaled_dot_product_attention``
            over the window of ``attention_window``. ``"auto"`` (default): ``"split_k"`` on CUDA
            with ``grouped_attention``, else ``"sdpa"`` (on an H200 the kernel took 0.33-0.73x the
            windowed SDPA's time per layer, ``benchmarks/results/decode_attention_h200.csv``, and the
            1.5B decode step 0.84-0.91x, ``generation_roofline_h200.csv``).
        programmatic_launch (Optional[bool]): launch the compiled step's kernels (inductor's, with
            its ``triton.enable_pdl``, and the split-K attention's) as programmatic dependent
            launches: each kernel may be scheduled while the one before it finishes and waits for it
            before reading, which hides most of the gap between the step's few hundred small
            kernels. None (default) = where supported (a CUDA GPU of compute capability 9.0 or later,
            the inductor backend, a torch whose inductor has the option); True where it is not is an
            error. Same results either way.
        shared_prompt_decode (Optional[bool]): with the split-K decode attention, read each group's
            prompt columns once per step for all of its G rows (one program per prompt split whose
            query operand is every query head of the group's rows,
            :class:`~logitless.generation.kernels.decode_attention.SharedPrefix`), instead of once per row:
            the cache bytes a step reads fall by about ``(G - 1) / G`` of the prompt's share. It
            follows compaction (a group's live rows stay consecutive). None (default) = where it
            measured faster: ``num_generations > 1``, a prompt of at least
            :data:`SHARED_PROMPT_MIN_WIDTH` columns and :data:`SHARED_PROMPT_MIN_ELEMENTS` K/V elements
            per row and layer (columns x K/V heads x head_dim: 1024 columns at Qwen2.5-0.5B, 512 at
            1.5B, 256 at 7B) and, per batch bucket, at least :data:`SHARED_PROMPT_MIN_ROWS` rows.
            True: whenever ``num_generations > 1``; True without the split-K attention is an error. Same results
            either way.
    Example:
        >>> from logitless.models import qwen2_5_tiny
        >>> sampler = CompiledSampler(compile=False)
        >>> out = sampler(qwen2_5_tiny(), [[1, 2, 3], [4]], max_new_tokens=5, stop_tokens=[0],
        ...               pad_id=0, num_generations=2)
        >>> out.completion_tokens.shape[0]
        4
    """

    def __init__(self, *, compile: Optional[bool] = None, backend: Union[str, Callable] = "inductor",
                 mode: Optional[str] = None, sync_every: int = 16, cache_len_multiple: int = 256,
                 max_cache_len: Optional[int] = None, keep_cache: Optional[bool] = None,
                 grouped_attention: bool = True, draws: str = "counter", compaction: bool = True,
                 min_bucket: int = 8, attention_window: Optional[int] = 256,
                 graph_sampling: bool = True, fused_projections: Union[bool, str] = False,
                 prefill_chunk_tokens: Optional[int] = DEFAULT_PREFILL_CHUNK_TOKENS,
                 decode_attention: str = "auto", programmatic_launch: Optional[bool] = None,
                 shared_prompt_decode: Optional[bool] = None) -> None:
        if compile is not None and not isinstance(compile, bool):
            raise ValueError(f"compile must be None, True or False, got {compile!r}")
        if not (callable(backend) or (isinstance(backend, str) and backend)):
            raise ValueError(f"backend must be a torch.compile backend (name or callable), got {backend!r}")
        if draws not in ("counter", "generator"):
            raise ValueError(f"draws must be 'counter' or 'generator', got {draws!r}")
        if programmatic_launch is not None and not isinstance(programmatic_launch, bool):
            raise ValueError(f"programmatic_launch must be None, True or False, got {programmatic_launch!r}")
        if shared_prompt_decode is not None and not isinstance(shared_prompt_decode, bool):
            raise ValueError(f"shared_prompt_decode must be None, True or False, got {shared_prompt_decode!r}")
        if shared_prompt_decode and (decode_attention == "sdpa" or not grouped_attention):
            raise ValueError(f"shared_prompt_decode=True needs the split-K decode attention (decode_attention='split_k' "
                             f"or 'auto', grouped_attention=True); got decode_attention={decode_attention!r}, "
                             f"grouped_attention={grouped_attention!r}")
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {decode_attention!r}")
        if decode_attention == "split_k" and grouped_attention is False:
            raise ValueError("decode_attention='split_k' needs grouped_attention=True (the grouped decode step is "
                             "where it runs); got grouped_attention=False")
        if decode_attention == "split_k":
            register_decode_attention()
        _check_int("sync_every", sync_every, 1)
        _check_int("cache_len_multiple", cache_len_multiple, 1)
        _check_int("max_cache_len", max_cache_len, 2, optional=True)
        _check_int("min_bucket", min_bucket, 2)
        _check_int("attention_window", attention_window, 1, optional=True)
        check_prefill_chunk_tokens(prefill_chunk_tokens)
        for name, flag in (("grouped_attention", grouped_attention), ("compaction", compaction),
                           ("graph_sampling", graph_sampling)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if not (isinstance(fused_projections, bool) or fused_projections == "shared"):
            raise ValueError(f"fused_projections must be True, False or 'shared', got {fused_projections!r}")
        self.compile, self.backend, self.mode = compile, backend, mode
        self.sync_every, self.cache_len_multiple, self.max_cache_len = sync_every, cache_len_multiple, max_cache_len
        self.keep_cache = keep_cache
        self.grouped_attention = grouped_attention
        self.attention_window = attention_window
        self.draws = draws
        self.graph_sampling = graph_sampling
        self.fused_projections = fused_projections
        self.decode_attention = decode_attention
        self.programmatic_launch = programmatic_launch
        self.shared_prompt_decode = shared_prompt_decode
        self.compaction = compaction
        self.min_bucket = min_bucket
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._compiled = None
        self._state: Optional[DecodeBuffers] = None

    # ----------------------------------------------------------------------------------------- setup
    def _use_compile(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.compile is None else self.compile

    def uses_split_k(self, device: torch.device) -> bool:
        """Whether the grouped decode step on ``device`` attends through the split-K kernel
        (``decode_attention``: ``"split_k"``, or ``"auto"`` on CUDA with ``grouped_attention``)."""
        if self.decode_attention == "auto":
            if device.type != "cuda" or not self.grouped_attention:
                return False
            register_decode_attention()
            return True
        return self.decode_attention == "split_k"

    def uses_shared_prompt(self, model: nn.Module, device: torch.device, num_generations: int, width: int) -> bool:
        """Whether the decode steps of a call on ``device`` read each group's prompt columns once, in
        buckets of enough rows (``shared_prompt_decode``; None: see its rule in the class docstring).
        Needs the split-K attention (:meth:`uses_split_k`).

        Raises:
            ValueError: ``shared_prompt_decode=True`` where the split-K attention does not run.
        """
        if self.shared_prompt_decode is False:
            return False
        split_k = self.uses_split_k(device)
        if self.shared_prompt_decode and not split_k:
            raise ValueError(f"shared_prompt_decode=True needs the split-K decode attention, which decode_attention="
                             f"{self.decode_attention!r} does not run on {device} (use 'split_k')")
        if not (split_k and num_generations > 1):
            return False
        attn = attention_modules(model)[0]
        elements = width * attn.num_kv_heads * attn.head_dim  # one row's prompt keys (or values) in a layer
        return bool(self.shared_prompt_decode) or (width >= SHARED_PROMPT_MIN_WIDTH
                                                   and elements >= SHARED_PROMPT_MIN_ELEMENTS)

    def uses_programmatic_launch(self, device: torch.device) -> bool:
        """Whether the decode step's kernels on ``device`` are programmatic dependent launches
        (``programmatic_launch``; None: where supported).

        Raises:
            ValueError: ``programmatic_launch=True`` where it is not supported, naming why.
        """
        from logitless.generation.kernels.decode_attention.plan import supports_programmatic_launch

        if self.programmatic_launch is False:
            return False
        compiled = self._use_compile(device)
        inductor = self.backend == "inductor" and hasattr(torch._inductor.config.triton, "enable_pdl")
        supported = supports_programmatic_launch(device) and (inductor or not compiled)
        if self.programmatic_launch and not supported:
            raise ValueError(f"programmatic_launch=True needs a CUDA GPU of compute capability 9.0 or later and, "
                             f"when the step is compiled, the inductor backend of a torch with "
                             f"torch._inductor.config.triton.enable_pdl; got {device}, compile={compiled}, "
                             f"backend={self.backend!r}")
        return supported

    def _compile_options(self, device: torch.device) -> Tuple[Optional[str], Optional[Dict[str, object]]]:
        """``(mode, options)`` for ``torch.compile``: ``mode`` (None: "reduce-overhead", i.e. CUDA
        graphs, on CUDA with inductor), given as inductor options when programmatic launches are added."""
        mode = self.mode
        if mode is None and device.type == "cuda" and self.backend == "inductor":
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
            self._compiled = torch.compile(decode_step, backend=self.backend, mode=mode, options=options,
                                           dynamic=None if self.compaction or self.attention_window else False)
        return self._compiled

    def _cache_len(self, width: int, max_new_tokens: int) -> int:
        need = width + max_new_tokens
        if self.max_cache_len is not None:
            if need > self.max_cache_len:
                raise ValueError(f"max_new_tokens: prompt width {width} + max_new_tokens {max_new_tokens} "
                                 f"exceeds max_cache_len={self.max_cache_len}")
            return self.max_cache_len
        m = self.cache_len_multiple
        return -(-need // m) * m

    def _buffers(self, attns, rows: int, length: int, dtype, device, weight: torch.Tensor) -> DecodeBuffers:
        """The decode buffers of this shape: the kept ones when they match, else new ones."""
        if self._state is not None and self._state.key == DecodeBuffers.key_of(attns, rows, length, dtype, device,
                                                                               weight):
            return self._state
        self._state = None  # drop the old buffers before allocating new ones
        self._state = DecodeBuffers(attns, rows, length, dtype, device, weight, dynamic_rows=self.compaction)
        return self._state

    def _grouped_everywhere(self, model: nn.Module) -> bool:
        """Every layer runs the grouped decode step, which can read any window of any bucket."""
        return self.grouped_attention and all(groupable(decoding_layer(layer)) for layer in model.layers)

    def _sizes(self, rows: int, grouped: bool) -> List[int]:
        """The batch buckets, largest first: ``rows`` alone, or halving down to ``min_bucket``."""
        sizes = [rows]
        if not (self.compaction and self.draws == "counter" and grouped):
            return sizes
        while sizes[-1] > self.min_bucket and -(-sizes[-1] // 2) >= self.min_bucket:
            sizes.append(-(-sizes[-1] // 2))
        return sizes

    def _fused(self, state, model: nn.Module, grouped: bool) -> Optional[List[Dict]]:
        """Each layer's concatenated projections, refreshed from the model's current weights; None
        when fusion is off or the layers do not run the grouped decode step."""
        if not (self.fused_projections and grouped):
            return None
        layers = [decoding_layer(layer) for layer in model.layers]
        fused = state.fused
        share = self.fused_projections == "shared"
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
            if not (self._use_compile(device) if self.keep_cache is None else self.keep_cache):
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
        counter = self.draws == "counter"
        if counter and kernel_draw(logits, top_k, top_p):
            register_counter_draw()  # before tracing: the step calls the op
        if self.uses_split_k(device):
            # the split-K kernels' counters, outside the CUDA graphs' memory pool
            register_decode_attention().reserve_arrivals(device)
            register_decode_rotary()  # before tracing: the step calls the op
        grouped = self._grouped_everywhere(model)
        fused = self._fused(state, model, self.grouped_attention)
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
        windowed = self.attention_window is not None and grouped and not split_k  # split-K reads the filled columns
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
            if t % self.sync_every == 0:
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
                columns = state.columns[:min(length, -(-(width + t) // self.attention_window) * self.attention_window)]
                torch._dynamo.mark_static_address(columns)
                torch._dynamo.maybe_mark_dynamic(columns, 0)
            in_graph = counter and self.graph_sampling
            big = self.shared_prompt_decode or bucket["done"].shape[0] >= SHARED_PROMPT_MIN_ROWS  # else per row
            logits = step(model, bucket, shared, weight, self.grouped_attention, draw if in_graph else None, columns,
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
        **options: :class:`CompiledSampler` arguments (``compile``, ``backend``, ``mode``,
            ``sync_every``, ``cache_len_multiple``, ``max_cache_len``, ``keep_cache``,
            ``prefill_chunk_tokens``, ``decode_attention``, ...).

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


def __getattr__(name: str):
    # the class's former name, kept importable for a while
    if name == "FastGenerator":
        warnings.warn("logitless: FastGenerator is now logitless.generation.CompiledSampler; the old name will be "
                      "removed", FutureWarning, stacklevel=2)
        return CompiledSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
