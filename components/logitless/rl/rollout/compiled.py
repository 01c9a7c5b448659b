"""The compiled sampler: shared-prompt prefill, static KV caches, a compiled decode step.

Same inputs, outputs and sampling semantics as :func:`logitless.rl.rollout.eager.generate` (the eager
reference sampler), four differences in how the work is done:

1. **Prefill once per group.** The P distinct prompts are prefilled as a batch of P (not P x G);
   each prompt's key/value cache entries are then copied into its G decode rows. A group's rows
   hold identical prompt entries, so decoding is unchanged and the prefill costs G times less.
   Long prompts are prefilled in chunks of columns, at most ``prefill_chunk_tokens`` tokens per
   forward (:mod:`logitless.rl.rollout.prefill`).
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
   the MLP's gate/up weights as another (:mod:`logitless.rl.rollout.fused`: a copy refreshed
   from the model's weights at the start of every call), halving the small launch-bound GEMMs
   per layer. The prefill runs the model's own layers.

Only ``[rows, V]`` logits of one position ever exist. The caches are attached to the model only
inside the call and detached on exit, even on error: a torchtune 0.6.1 model with caches set up but
disabled attends bidirectionally when called without a mask.
"""

import importlib
import warnings
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from logitless.first_start import note_compile
from logitless.modules.attention import QKNormAttention
from logitless.ops.dispatch import _interpreting
from logitless.rl.rollout.fused import FusedProjections
from logitless.rl.rollout.prefill import DEFAULT_PREFILL_CHUNK_TOKENS, check_prefill_chunk_tokens, prefill
from logitless.rl.rollout.result import Rollout, left_pad
from logitless.rl.rollout.sampling import (RandomSource, check_random_source, check_sampling_args, row_keys,
                                           sample_counter, sample_next, token_hashes)
from logitless.rl.rollout.trunk import _gathered_fsdp_unit, decoding_layer, last_position_logits, run_decoding_layer

__all__ = ["CompiledSampler", "DECODE_ATTENTION", "DECODE_LINEAR", "generate"]

#: The grouped decode step's attention implementations (``CompiledSampler(decode_attention=...)``).
DECODE_ATTENTION = ("auto", "sdpa", "split_k")
#: The grouped decode step's linear layers (``CompiledSampler(decode_linear=...)``).
DECODE_LINEAR = ("auto", "cublas", "triton")
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


def _register_decode_attention():
    # registers the op logitless::decode_attention (imports triton); returns its module
    return importlib.import_module("logitless.ops.triton.decode_attention")


#: logitless.ops.triton.decode_linear and .decode_rotary once registered (decode_linear when asked
#: for, decode_rotary with the split-K attention): the traced decode step reads them from here
#: (importing inside the step would break the graph)
_decode_linear = None
_decode_rotary = None


def _register_decode_linear():
    # registers the op logitless::decode_linear (imports triton); returns its module
    global _decode_linear
    _decode_linear = _decode_linear or importlib.import_module("logitless.ops.triton.decode_linear")
    return _decode_linear


def _register_decode_rotary():
    # registers the op logitless::decode_rotary_cache (imports triton); returns its module
    global _decode_rotary
    _decode_rotary = _decode_rotary or importlib.import_module("logitless.ops.triton.decode_rotary")
    return _decode_rotary


def _fused_rotary(attn: nn.Module, s: int, cache: Optional[Tuple[torch.Tensor, torch.Tensor]], split_k):
    """The :class:`~logitless.ops.triton.decode_rotary.RotaryTable` of ``attn``'s rotary module where
    the split-K step rotates and writes the caches in one launch (one token per row, a bucket's cache,
    no q/k norms after the rotation, a table covering every cache column), else None."""
    if _decode_rotary is None or split_k is None or cache is None or s != 1:
        return None
    if not _norms_before_rope(attn) and (attn.q_norm is not None or attn.k_norm is not None):
        return None  # torchtune's order normalises the rotated q/k: the kernel cannot rotate them
    spec = _decode_rotary.rotary_table(attn.pos_embeddings, attn.head_dim)
    if spec is None or spec.table.shape[0] < cache[0].shape[2] or spec.table.device != cache[0].device:
        return None
    return spec


def _norms_before_rope(attn: nn.Module) -> bool:
    """Whether ``attn`` normalises q and k before the rotary embedding (Qwen3's
    :class:`~logitless.modules.QKNormAttention`), so the decode step normalises the projections and
    then rotates them like any attention's; torchtune's ``MultiHeadAttention`` normalises after."""
    return type(attn) is QKNormAttention


def _register_counter_draw() -> None:
    # registers the op logitless::counter_draw (imports triton)
    importlib.import_module("logitless.ops.triton.counter_sampling")


def _kernel_draw(logits: torch.Tensor, top_k: Optional[int], top_p: Optional[float]) -> bool:
    """Whether the step draws through the Triton op ``logitless::counter_draw``: on CUDA, without
    top-k / top-p (the filters need a sort; :func:`sample_counter` keeps them)."""
    return logits.is_cuda and top_k is None and (top_p is None or top_p >= 1.0) and logits.stride(-1) == 1


def _attention_modules(model: nn.Module) -> List[nn.Module]:
    """The self-attention modules of a torchtune decoder, in layer order."""
    from torchtune.modules import MultiHeadAttention

    attns = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not attns:
        raise ValueError(f"model must be a torchtune TransformerDecoder with MultiHeadAttention layers, "
                         f"got {type(model).__name__} without any")
    return attns


def _new_caches(attns: Sequence[nn.Module], batch: int, length: int, dtype: torch.dtype,
                device: torch.device) -> List[nn.Module]:
    """One preallocated torchtune ``KVCache`` per attention module."""
    from torchtune.modules import KVCache

    with device:
        return [KVCache(batch_size=batch, max_seq_len=length, num_kv_heads=a.num_kv_heads,
                        head_dim=a.head_dim, dtype=dtype) for a in attns]


def _attach(attns: Sequence[nn.Module], caches: Sequence[nn.Module]) -> None:
    for attn, cache in zip(attns, caches):
        attn.kv_cache = cache
        attn.cache_enabled = True


def _detach(attns: Sequence[nn.Module]) -> None:
    # same end state as torchtune's delete_kv_caches: no cache, so the model is causal again
    for attn in attns:
        attn.kv_cache = None
        attn.cache_enabled = False


def _groupable(layer: nn.Module) -> bool:
    """True for a torchtune self-attention layer whose parts may be called directly: a plain one
    without hooks, or an FSDP2 unit with its weights gathered (its hooks are FSDP's bookkeeping);
    ``layer`` is already past activation checkpointing (:func:`decoding_layer`)."""
    from torchtune.modules import MultiHeadAttention, TransformerSelfAttentionLayer

    if type(layer.attn) is not MultiHeadAttention and not _norms_before_rope(layer.attn):
        return False
    if layer.attn._forward_hooks or layer.attn._forward_pre_hooks:
        return False
    if _gathered_fsdp_unit(layer):
        return isinstance(layer, TransformerSelfAttentionLayer)
    return type(layer) is TransformerSelfAttentionLayer and not (layer._forward_hooks or layer._forward_pre_hooks)


def _project(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, gated: bool = False,
             linear: Optional[Tuple[int, bool]] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on ``x``'s last dimension, or with ``gated`` the MLP's
    ``silu(x W_gate.T) * (x W_up.T)`` of a ``[gate; up]`` weight. ``linear`` = ``(SM count,
    programmatic launch)`` runs it through :func:`logitless.ops.triton.decode_linear` where it takes
    the operands (few rows, one dtype, a plain tensor on CUDA or under the interpreter); None = cuBLAS."""
    rows, k = x.numel() // x.shape[-1], x.shape[-1]
    if linear is not None:
        if _decode_linear is None:
            raise RuntimeError("decode_linear is not registered: call _register_decode_linear() before the step")
    if linear is not None and rows <= _decode_linear.MAX_ROWS and weight.dtype == x.dtype \
            and not isinstance(weight, DTensor) and (x.is_cuda or _interpreting()):
        n = weight.shape[0] // (2 if gated else 1)
        launch = _decode_linear.decode_linear_launch(n, k, gated, linear[0])
        out = _decode_linear.decode_linear(x.reshape(rows, k), weight.contiguous(), bias, gated=gated, launch=launch,
                                           programmatic=linear[1])
        return out.view(*x.shape[:-1], n)
    out = F.linear(x, weight, bias)
    if not gated:
        return out
    gate, up = out.chunk(2, dim=-1)
    return F.silu(gate) * up


def _linear_module(module: nn.Module, x: torch.Tensor, linear: Optional[Tuple[int, bool]]) -> torch.Tensor:
    """``module(x)``; a plain ``nn.Linear`` (no hooks) through :func:`_project` with ``linear``."""
    if linear is not None and type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks):
        return _project(x, module.weight, module.bias, linear=linear)
    return module(x)


def _grouped_attention(attn: nn.Module, x: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor,
                       cache: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                       col: Optional[torch.Tensor] = None, window=None,
                       qkv: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None,
                       split_k: Optional[Tuple] = None, linear: Optional[Tuple[int, bool]] = None) -> torch.Tensor:
    """torchtune's cached self-attention without expanding K/V to every query head.

    ``MultiHeadAttention`` copies the whole cache ``num_heads // num_kv_heads`` times per layer
    and step before SDPA. Here the query heads that share a K/V head are folded into the query
    length instead (query head ``h`` reads K/V head ``h // group``, torchtune's order), so SDPA
    reads the cache once; the result is the same attention. With ``cache`` (the first ``B`` rows of
    the layer's cache, as a batch bucket sees them) the new key and value are written at column
    ``col`` there instead of through ``attn.kv_cache``, and attention reads its first ``window``
    columns only (all with None). ``qkv`` (weight, bias) of the concatenated q/k/v projections
    (:class:`FusedProjections`) computes them with one GEMM. With ``split_k`` = ``(key_valid,
    n_filled, programmatic_launch, shared_prefix, rotations)`` (``(B, L)`` bool, ``(1,)`` int64, bool, a
    :class:`~logitless.ops.triton.decode_attention.SharedPrefix` or None, a dict the step fills with
    each rotary table's per-row coefficients) one new token per row attends through the split-K kernel
    (:func:`logitless.ops.triton.decode_attention`), which reads the first ``n_filled`` columns of the
    cache only (each group's prompt columns once, with a shared prefix), instead of SDPA under
    ``mask``. Where :func:`_fused_rotary` allows, the compiler's three or four kernels of rotary
    embedding and cache write go: into the attention's own launch without a shared prefix
    (:class:`~logitless.ops.triton.decode_attention.NewToken`), else into one launch before it
    (:func:`logitless.ops.triton.decode_rotary.decode_rotary_cache`; inside the attention it measured
    slower there, the shared-prefix programs all rotating their rows' queries). ``linear``: the
    projections' kernel (:func:`_project`).
    """
    b, s, _ = x.shape
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if qkv is None:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    else:
        q, k, v = _project(x, *qkv, linear=linear).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    norms_first = _norms_before_rope(attn)
    if norms_first:  # Qwen3: per-head norms of the projections, then the rotary embedding below
        q, k = attn.q_norm(q.view(b, s, heads, dim)), attn.k_norm(k.view(b, s, kv_heads, dim))
    rotary = _fused_rotary(attn, s, cache, split_k)
    if rotary is not None and split_k[3] is None:  # rotary embedding and cache write inside the attention
        key_valid, n_filled, programmatic, _, rotations = split_k
        if id(rotary.table) not in rotations:  # once a step for the layers that share a rotary module
            rotations[id(rotary.table)] = _decode_rotary.rotation_coefficients(rotary, input_pos.view(b), dim, q.dtype)
        out = torch.ops.logitless.decode_attention_new_token(
            q.view(b, heads, dim), cache[0], cache[1], key_valid, n_filled, k.view(b, kv_heads, dim),
            v.view(b, kv_heads, dim), *rotations[id(rotary.table)], rotary.interleaved, dim ** -0.5, 0, 0, 0, 0,
            programmatic)
        return _linear_module(attn.output_proj, out.reshape(b, 1, heads * dim), linear)
    if rotary is not None:  # with a shared prompt: rotary embedding and cache write in one launch before it
        q = torch.ops.logitless.decode_rotary_cache(q.view(b, heads, dim), k.view(b, kv_heads, dim),
                                                    v.view(b, kv_heads, dim), input_pos.view(b), *rotary, col,
                                                    cache[0], cache[1], split_k[2])[:, :, None]
        return _split_k_attention(attn, q, cache, split_k, linear)
    q = q.view(b, s, heads, dim)
    k = k.view(b, s, kv_heads, dim)
    v = v.view(b, s, kv_heads, dim)
    if attn.pos_embeddings is not None:
        q = attn.pos_embeddings(q, input_pos=input_pos)
        k = attn.pos_embeddings(k, input_pos=input_pos)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if attn.q_norm is not None and not norms_first:
        q = attn.q_norm(q)
    if attn.k_norm is not None and not norms_first:
        k = attn.k_norm(k)
    if cache is None:
        k, v = attn.kv_cache.update(k, v)
    else:
        # written into the bucket's cache itself, then read through a narrowed view
        cache[0].index_copy_(2, col, k)
        cache[1].index_copy_(2, col, v)
        k, v = cache
        if window is not None:
            k, v = k.narrow(2, 0, window), v.narrow(2, 0, window)
    if split_k is not None:
        return _split_k_attention(attn, q, (k, v), split_k, linear)
    group = heads // kv_heads
    q = q.reshape(b, kv_heads, group * s, dim)
    length = mask.shape[-1]
    mask = mask[:, None, None].expand(b, 1, group, s, length).reshape(b, 1, group * s, length)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # reshape, not view: some SDPA kernels (fp32 on CUDA) return a (B, L, H, D) memory layout.
    return _linear_module(attn.output_proj, out.reshape(b, heads, s, dim).transpose(1, 2).reshape(b, s, heads * dim),
                          linear)


def _split_k_attention(attn: nn.Module, q: torch.Tensor, cache: Tuple[torch.Tensor, torch.Tensor], split_k: Tuple,
                       linear: Optional[Tuple[int, bool]]) -> torch.Tensor:
    """The output projection of one new token per row (``q``: ``(B, Hq, 1, D)``, rotated) attending
    through the split-K kernel to the filled columns of ``cache`` (see :func:`_grouped_attention`)."""
    b, heads, _, dim = q.shape
    k, v = cache
    # the raw op (registered by the sampler): launch parameters 0 = the kernel's defaults
    key_valid, n_filled, programmatic, prefix, _ = split_k
    if prefix is None:
        out = torch.ops.logitless.decode_attention(q.squeeze(2), k, v, key_valid, n_filled, dim ** -0.5, 0, 0, 0,
                                                   0, programmatic)
    else:
        out = torch.ops.logitless.decode_attention_shared_prefix(q.squeeze(2), k, v, key_valid, n_filled, *prefix,
                                                                 dim ** -0.5, 0, 0, 0, 0, 0, programmatic)
    return _linear_module(attn.output_proj, out.reshape(b, 1, heads * dim), linear)


def _layer_step(layer: nn.Module, h: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor,
                grouped: bool, cache: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                col: Optional[torch.Tensor] = None, window=None,
                fused: Optional[Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]] = None,
                split_k: Optional[Tuple] = None, linear: Optional[Tuple[int, bool]] = None) -> torch.Tensor:
    """One decoder layer for one new token: torchtune's layer, or its grouped-attention twin (with
    ``fused``, the layer's concatenated projections of :class:`FusedProjections`; with ``split_k``,
    the split-K attention of :func:`_grouped_attention`; with ``linear``, its plain projections
    through :func:`_project`'s kernel, the SiLU MLP's activation inside the gate/up product)."""
    layer = decoding_layer(layer)
    if not (grouped and _groupable(layer)):
        return run_decoding_layer(layer, h, mask=mask, input_pos=input_pos)
    fused = fused or {}
    h = layer.sa_scale(_grouped_attention(layer.attn, layer.sa_norm(h), input_pos, mask, cache, col, window,
                                          fused.get("qkv"), split_k, linear)) + h
    x = layer.mlp_norm(h)
    if "gate_up" not in fused:
        return h + layer.mlp_scale(layer.mlp(x))
    # torchtune's FeedForward: w2(act(w1 x) * w3 x)
    if linear is not None and type(layer.mlp.activation) is nn.SiLU:
        act = _project(x, *fused["gate_up"], gated=True, linear=linear)
    else:
        gate, up = F.linear(x, *fused["gate_up"]).chunk(2, dim=-1)
        act = layer.mlp.activation(gate) * up
    return h + layer.mlp_scale(_linear_module(layer.mlp.w2, act, linear))


def _record(rows: Dict[str, torch.Tensor], shared: Dict[str, torch.Tensor], logits: torch.Tensor,
            draw: Tuple) -> None:
    """Samples token ``t`` of every row of a bucket from ``logits`` with the counter-based stream and
    writes it: into the outputs (at the row's original index), the finished flags and the next
    step's input; ``t`` advances. All in place, no host sync: it runs inside the captured graph."""
    temperature, top_k, top_p, pad_id = draw
    step = shared["t"]
    if _kernel_draw(logits, top_k, top_p):  # the same draw in two launches (ops/triton/counter_sampling.py)
        nxt, logp = torch.ops.logitless.counter_draw(logits, rows["keys"], step, float(temperature))
    else:
        nxt, logp = sample_counter(logits, rows["keys"], step, temperature=temperature, top_k=top_k, top_p=top_p,
                                   token_hash=shared["token_hash"])
    _write(rows, shared, nxt, logp, pad_id)


def _write(rows: Dict[str, torch.Tensor], shared: Dict[str, torch.Tensor], nxt: torch.Tensor,
           logp: torch.Tensor, pad_id: int) -> None:
    """Writes sampled token ``t`` of a bucket's rows (see :func:`_record`)."""
    done, slots, step = rows["done"], rows["slots"], shared["t"]
    live = ~done
    nxt = torch.where(live, nxt, torch.full_like(nxt, pad_id))
    at = (slots, step.expand_as(slots))
    shared["out_tokens"].index_put_(at, nxt)
    shared["out_mask"].index_put_(at, live)
    shared["out_logp"].index_put_(at, torch.where(live, logp, torch.zeros_like(logp)))
    done.copy_(done | (live & shared["is_stop"][nxt]))
    rows["tokens"].copy_(nxt[:, None])
    step.add_(1)


def _decode_step(model: nn.Module, rows: Dict[str, torch.Tensor], shared: Dict[str, torch.Tensor],
                 weight: torch.Tensor, grouped: bool = True, draw: Optional[Tuple] = None,
                 columns: Optional[torch.Tensor] = None, fused: Optional[List[Dict]] = None,
                 split_k: bool = False, programmatic_launch: bool = False, shared_prompt: int = 0,
                 linear_sms: int = 0):
    """One decode step of a bucket of rows at cache column ``shared["col"]`` (a ``(1,)`` tensor,
    not an int, so the compiled step is the same graph at every column).

    Runs the trunk on the rows' last tokens; with ``draw`` (temperature, top_k, top_p, pad_id) it
    also samples and writes the next token (:func:`_record`) and returns None, else it returns the
    ``(rows, V)`` logits (the head GEMM's dtype). Positions and the column advance in place.
    ``columns`` (the column indices ``0 .. W-1`` of a window holding every filled column) limits
    attention to the window; its length turns dynamic at its first change (one recompilation), after
    which each window size is one more CUDA graph. ``fused`` holds each layer's concatenated projections
    (:meth:`FusedProjections.layers`; None runs the layers' own). ``split_k``: the grouped layers
    attend through the split-K kernel, whose reads follow the filled columns (``shared["n_filled"]``,
    ``col + 1``, a device tensor), so no window is needed and every step is the same graph; ``programmatic_launch``: the
    split-K kernels are programmatic dependent launches; ``shared_prompt`` (> 0, with ``split_k``):
    the split-K kernels read each group's prompt columns once, for segments of at most that many
    rows described by ``shared``'s ``prompt_width``, ``seg_start``, ``seg_rows`` and ``covered``;
    ``linear_sms`` (> 0): the grouped layers' plain projections run through
    :func:`logitless.ops.triton.decode_linear`, tiled for that many SMs (0: cuBLAS).
    """
    tokens, input_pos, key_valid, col = rows["tokens"], rows["input_pos"], rows["key_valid"], shared["col"]
    caches = rows.get("caches")
    window = None
    if columns is None:
        columns = torch.arange(key_valid.shape[1], device=key_valid.device)
    else:  # attend over the filled window only: the first len(columns) columns of the cache
        # narrow, not a slice: a slice's clamp to the size would specialise the window to it
        window = columns.shape[0]
        key_valid = key_valid.narrow(1, 0, window)
    mask = key_valid[:, None, :] & (columns <= col)
    # this step's key is written at column col
    prefix = None  # else the fields of a decode_attention.SharedPrefix
    if shared_prompt:
        prefix = (shared["prompt_width"], shared["seg_start"], shared["seg_rows"], shared["covered"], shared_prompt)
    # the filled count is a buffer of its own, not col + 1: the compiler would recompute that sum in a
    # launch of its own before every layer's attention
    n_filled = shared["n_filled"]
    filled = (key_valid, n_filled, programmatic_launch, prefix, {}) if split_k else None
    linear = (linear_sms, programmatic_launch) if linear_sms else None

    def run_layer(index, layer, h):
        return _layer_step(layer, h, input_pos, mask, grouped, caches[index] if caches else None, col, window,
                           fused[index] if fused else None, filled, linear)

    # the head GEMM's dtype: every draw upcasts as it reads (no fp32 copy of the logits)
    logits = last_position_logits(model, tokens, input_pos=input_pos, mask=mask, weight=weight, run_layer=run_layer,
                                  upcast=False)
    input_pos.add_(1)
    col.add_(1)
    n_filled.add_(1)
    if draw is None:
        return logits
    _record(rows, shared, logits, draw)
    return None


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
            counter-based stream keyed by (row key, step, token) (:func:`~logitless.rl.rollout.sampling.sample_counter`;
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
            and the MLP's gate/up with another (:class:`~logitless.rl.rollout.fused.FusedProjections`;
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
            memory bound (:func:`~logitless.rl.rollout.prefill.prefill`); default
            :data:`~logitless.rl.rollout.prefill.DEFAULT_PREFILL_CHUNK_TOKENS` (8192: smaller
            prompt batches keep one forward); None = one forward whatever the width.
        decode_attention (str): the grouped decode step's attention. ``"split_k"``: the split-K
            Triton kernel (:func:`logitless.ops.triton.decode_attention`) whose programs cover the
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
            :class:`~logitless.ops.triton.decode_attention.SharedPrefix`), instead of once per row:
            the cache bytes a step reads fall by about ``(G - 1) / G`` of the prompt's share. It
            follows compaction (a group's live rows stay consecutive). None (default) = where it
            measured faster: ``num_generations > 1``, a prompt of at least
            :data:`SHARED_PROMPT_MIN_WIDTH` columns and :data:`SHARED_PROMPT_MIN_ELEMENTS` K/V elements
            per row and layer (columns x K/V heads x head_dim: 1024 columns at Qwen2.5-0.5B, 512 at
            1.5B, 256 at 7B) and, per batch bucket, at least :data:`SHARED_PROMPT_MIN_ROWS` rows.
            True: whenever ``num_generations > 1``; True without the split-K attention is an error. Same results
            either way.
        decode_linear (str): the grouped decode step's plain projections (q/k/v, output, MLP gate/up
            and down; LoRA-wrapped ones keep their modules). ``"triton"``:
            :func:`logitless.ops.triton.decode_linear`, whose programs split the columns and the
            reduction so that every SM streams weights, with the SiLU MLP's activation inside the
            fused gate/up product (``fused_projections``); off CUDA it runs ``F.linear`` unless
            ``TRITON_INTERPRET=1``. It rounds the gate/up product once (cuBLAS rounds the two
            products, then the activation), so results can differ from cuBLAS's in the last bits.
            ``"cublas"`` and ``"auto"`` (default): ``F.linear``. On an H200 the kernel is slower than
            cuBLAS today (Qwen2.5-1.5B, 64 rows: decode step 2.79 ms against 2.43 ms;
            ``benchmarks/results/decode_linear_h200.csv``, docs/generation.md), so it is opt-in.

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
                 shared_prompt_decode: Optional[bool] = None, decode_linear: str = "auto") -> None:
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
            _register_decode_attention()
        if decode_linear not in DECODE_LINEAR:
            raise ValueError(f"decode_linear must be one of {DECODE_LINEAR}, got {decode_linear!r}")
        if decode_linear == "triton" and grouped_attention is False:
            raise ValueError("decode_linear='triton' needs grouped_attention=True (the grouped decode step is where it "
                             "runs); got grouped_attention=False")
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
        self.decode_linear = decode_linear
        self.compaction = compaction
        self.min_bucket = min_bucket
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._compiled = None
        self._state: Optional[Dict[str, object]] = None

    # ----------------------------------------------------------------------------------------- setup
    def _use_compile(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.compile is None else self.compile

    def uses_split_k(self, device: torch.device) -> bool:
        """Whether the grouped decode step on ``device`` attends through the split-K kernel
        (``decode_attention``: ``"split_k"``, or ``"auto"`` on CUDA with ``grouped_attention``)."""
        if self.decode_attention == "auto":
            if device.type != "cuda" or not self.grouped_attention:
                return False
            _register_decode_attention()
            return True
        return self.decode_attention == "split_k"

    def uses_decode_linear(self, device: torch.device) -> bool:
        """Whether the grouped decode step on ``device`` runs its plain projections through
        :func:`logitless.ops.triton.decode_linear`: only with ``decode_linear="triton"`` (``"auto"`` is
        cuBLAS, measured faster on an H200)."""
        return self.decode_linear == "triton"

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
        attn = _attention_modules(model)[0]
        elements = width * attn.num_kv_heads * attn.head_dim  # one row's prompt keys (or values) in a layer
        return bool(self.shared_prompt_decode) or (width >= SHARED_PROMPT_MIN_WIDTH
                                                   and elements >= SHARED_PROMPT_MIN_ELEMENTS)

    def uses_programmatic_launch(self, device: torch.device) -> bool:
        """Whether the decode step's kernels on ``device`` are programmatic dependent launches
        (``programmatic_launch``; None: where supported).

        Raises:
            ValueError: ``programmatic_launch=True`` where it is not supported, naming why.
        """
        from logitless.ops.triton.decode_attention import supports_programmatic_launch

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
            return _decode_step
        if self._compiled is None:
            mode, options = self._compile_options(device)
            # not fullgraph: a graph break on another torch version costs speed, not the run
            # (tests/rl/rollout/test_compiled.py checks the step is one graph)
            # the batch dimension of the bucket buffers is marked dynamic (one compilation for every
            # bucket; a CUDA graph is captured per bucket size), everything else is static
            graphs = mode == "reduce-overhead" or bool((options or {}).get("triton.cudagraphs"))
            note_compile("the sampler's decode step" + (" and its CUDA graphs (one per batch size)" if graphs else ""))
            self._compiled = torch.compile(_decode_step, backend=self.backend, mode=mode, options=options,
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

    def _buffers(self, attns, rows: int, length: int, dtype, device, weight: torch.Tensor) -> Dict[str, object]:
        """The decode caches, the outputs and the step inputs, reused while the shape is unchanged."""
        key = (rows, length, dtype, device, len(attns), tuple(weight.shape), weight.dtype)
        if self._state is not None and self._state["key"] == key:
            return self._state
        self._state = None  # drop the old buffers before allocating new ones
        vocab = weight.shape[0]
        shared = {  # one extra output row: where finished filler rows of a bucket write
            "col": torch.zeros(1, dtype=torch.long, device=device),
            "n_filled": torch.ones(1, dtype=torch.long, device=device),  # col + 1: the columns attention reads
            "t": torch.zeros(1, dtype=torch.long, device=device),
            "out_tokens": torch.zeros(rows + 1, length, dtype=torch.long, device=device),
            "out_mask": torch.zeros(rows + 1, length, dtype=torch.bool, device=device),
            "out_logp": torch.zeros(rows + 1, length, dtype=torch.float32, device=device),
            "is_stop": torch.zeros(vocab, dtype=torch.bool, device=device),
            "token_hash": token_hashes(vocab, device),
        }
        columns = torch.arange(length, device=device)
        state = {
            "key": key,
            "caches": _new_caches(attns, rows, length, dtype, device),
            "shared": shared,
            "buckets": {},
            "columns": columns,
            "weight": None if isinstance(weight, nn.Parameter) else torch.empty_like(weight),
        }
        # fixed addresses: CUDA graphs read these in place instead of copying them every replay
        static = list(shared.values()) + [columns]
        static += [t for c in state["caches"] for t in (c.k_cache, c.v_cache, c.cache_pos)]
        static.append(weight if state["weight"] is None else state["weight"])
        for t in static:
            torch._dynamo.mark_static_address(t)
        self._state = state
        return state

    def _bucket(self, state, size: int, views: bool) -> Dict[str, torch.Tensor]:
        """The step inputs of a batch bucket of ``size`` rows (the first ``size`` rows of the caches)."""
        bucket = state["buckets"].get(size)
        if bucket is not None:
            return bucket
        length = state["key"][1]
        device = state["shared"]["col"].device
        bucket = {
            "tokens": torch.zeros(size, 1, dtype=torch.long, device=device),
            "input_pos": torch.zeros(size, 1, dtype=torch.long, device=device),
            "key_valid": torch.ones(size, length, dtype=torch.bool, device=device),
            "keys": torch.zeros(size, dtype=torch.long, device=device),
            "done": torch.ones(size, dtype=torch.bool, device=device),
            "slots": torch.zeros(size, dtype=torch.long, device=device),
        }
        tensors = list(bucket.values())
        if views:
            bucket["caches"] = [(c.k_cache[:size], c.v_cache[:size]) for c in state["caches"]]
            tensors += [t for pair in bucket["caches"] for t in pair]
        for t in tensors:
            torch._dynamo.mark_static_address(t)
            if self.compaction:  # "maybe": dynamo may keep a size it has to specialise (one row)
                torch._dynamo.maybe_mark_dynamic(t, 0)
        state["buckets"][size] = bucket
        return bucket

    def _grouped_everywhere(self, model: nn.Module) -> bool:
        """Every layer runs the grouped decode step, which can read any window of any bucket."""
        return self.grouped_attention and all(_groupable(decoding_layer(layer)) for layer in model.layers)

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
        fused = state.get("fused")
        share = self.fused_projections == "shared"
        if fused is None or not fused.matches(layers) or fused.share != share:
            state["fused"] = fused = None  # drop the old copy before allocating a new one
            state["fused"] = fused = FusedProjections(layers, share=share)
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
        caches = _new_caches(attns, rows, width, dtype, tokens.device)
        _attach(attns, caches)
        try:
            positions = (prompt_mask.long().cumsum(1) - 1).clamp(min=0)
            logits = prefill(model, tokens, input_pos=positions, prompt_mask=prompt_mask,
                             chunk_tokens=self.prefill_chunk_tokens, weight=weight)
        finally:
            _detach(attns)
        return logits, caches

    @staticmethod
    def _replicate(small: Sequence[nn.Module], big: Sequence[nn.Module], groups: int, width: int) -> None:
        """Copies each prompt's cache entries into its ``groups`` consecutive decode rows and points
        the caches' write position at column ``width`` (the first completion token)."""
        for src, dst in zip(small, big):
            rows, heads, length, dim = dst.k_cache.shape
            for name in ("k_cache", "v_cache"):
                out = getattr(dst, name)
                out.zero_()  # stale columns from a previous call: masked, but keep them finite
                view = out.view(rows // groups, groups, heads, length, dim)
                view[..., :width, :].copy_(getattr(src, name)[:, None])
            dst.cache_pos.copy_(torch.arange(length, device=dst.cache_pos.device) + width)

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
            prompt (:func:`logitless.rl.rollout.sampling.prompt_generators`) so that a group's completions do
            not depend on the other prompts of the batch.

        Returns:
            Rollout: as :func:`logitless.rl.rollout.eager.generate` returns it.

        Raises:
            ValueError: on bad arguments or a model whose caches are already set up.
        """
        from logitless.modules import head_weight

        _check_args(max_new_tokens, num_generations, stop_tokens, temperature, top_k, top_p)
        check_random_source(generator, len(prompts))
        if model.caches_are_setup():
            raise ValueError("model: KV caches are already set up; the fast sampler attaches its own "
                             "(call torchtune.modules.common_utils.delete_kv_caches(model) first)")
        attns = _attention_modules(model)
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
            if state["weight"] is not None:  # e.g. a merged LoRA head: copy into the fixed buffer
                state["weight"].copy_(weight)
                weight = state["weight"]
            logits, small = self._prefill(model, attns, tokens, prompt_mask, weight, dtype)
            self._replicate(small, state["caches"], groups, width)
            del small
            full_mask = prompt_mask.repeat_interleave(groups, dim=0)
            _attach(attns, state["caches"])
            try:
                out = self._decode(model, state, logits.repeat_interleave(groups, dim=0), full_mask,
                                   weight, groups=groups, max_new_tokens=max_new_tokens,
                                   stop_tokens=stop_tokens, pad_id=pad_id, temperature=temperature,
                                   top_k=top_k, top_p=top_p, generator=generator)
            finally:
                _detach(attns)
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
        if counter and _kernel_draw(logits, top_k, top_p):
            _register_counter_draw()  # before tracing: the step calls the op
        if self.uses_split_k(device):
            # the split-K kernels' counters, outside the CUDA graphs' memory pool
            _register_decode_attention().reserve_arrivals(device)
            _register_decode_rotary()  # before tracing: the step calls the op
        linear_sms = 0  # the decode products' kernel: 0 = cuBLAS, else decode_linear tiled for this many SMs
        if self.uses_decode_linear(device):
            linear_sms = _register_decode_linear()._num_sms(device)  # before tracing: the step calls the op
        grouped = self._grouped_everywhere(model)
        fused = self._fused(state, model, self.grouped_attention)
        sizes = self._sizes(rows, grouped)
        shared = state["shared"]
        length = state["key"][1]
        split_k = self.uses_split_k(device)
        programmatic = self.uses_programmatic_launch(device)
        shared_prompt = 0  # rows per segment of a shared prompt (0: none)
        state["segments"] = None
        if grouped and self.uses_shared_prompt(model, device, groups, width):
            shared_prompt = self._prompt_segments(state, model, rows, groups, width)
        windowed = self.attention_window is not None and grouped and not split_k  # split-K reads the filled columns
        bucket = self._bucket(state, rows, views=grouped)
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
            _record(bucket, shared, logits, draw)
        else:
            _write(bucket, shared, *sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
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
                columns = state["columns"][:min(length, -(-(width + t) // self.attention_window) * self.attention_window)]
                torch._dynamo.mark_static_address(columns)
                torch._dynamo.maybe_mark_dynamic(columns, 0)
            in_graph = counter and self.graph_sampling
            big = self.shared_prompt_decode or bucket["done"].shape[0] >= SHARED_PROMPT_MIN_ROWS  # else per row
            logits = step(model, bucket, shared, weight, self.grouped_attention, draw if in_graph else None, columns,
                          fused, split_k, programmatic, shared_prompt if big else 0, linear_sms)
            if counter and not in_graph:
                _record(bucket, shared, logits, draw)
                logits = None
            elif not counter:
                _write(bucket, shared, *sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                                    generator=generator), pad_id)
                logits = None  # the step's output buffer is overwritten by the next replay
        done = (shared["out_mask"] & shared["is_stop"][shared["out_tokens"].clamp(0, vocab - 1)]).any(dim=1)
        return (shared["out_tokens"][:rows, :max_new_tokens], shared["out_mask"][:rows, :max_new_tokens],
                shared["out_logp"][:rows, :max_new_tokens], done[:rows])

    def _compact(self, state, bucket, size: int, pad_id: int) -> Dict[str, torch.Tensor]:
        """Moves the live rows of ``bucket`` (caches, step inputs, keys, output slots) to the first
        rows of the ``size``-row bucket; its other rows are finished fillers writing to the spare
        output row. Returns the new bucket."""
        live = (~bucket["done"]).nonzero().squeeze(1)
        n = live.numel()
        new = self._bucket(state, size, views=True)
        for cache in state["caches"]:
            cache.k_cache[:n] = cache.k_cache.index_select(0, live)
            cache.v_cache[:n] = cache.v_cache.index_select(0, live)
        for name in ("tokens", "input_pos", "key_valid", "keys", "slots"):
            new[name][:n] = bucket[name].index_select(0, live)
        new["done"][:n] = False
        new["done"][n:] = True
        new["slots"][n:] = state["shared"]["out_tokens"].shape[0] - 1
        new["tokens"][n:] = pad_id
        new["input_pos"][n:] = 0
        new["key_valid"][n:] = True
        if state.get("segments") is not None:
            self._set_segments(state, new["slots"][:n], n)
        return new

    def _prompt_segments(self, state, model: nn.Module, rows: int, groups: int, width: int) -> int:
        """Sets up the shared-prompt segment table of a call (every group's rows, cut into segments
        of at most :func:`~logitless.ops.triton.decode_attention.prefix_rows` rows) in ``shared``'s
        static buffers; returns the rows per segment."""
        from logitless.ops.triton.decode_attention import prefix_rows

        attn = _attention_modules(model)[0]
        per = prefix_rows(attn.num_heads // attn.num_kv_heads, groups)
        shared = state["shared"]
        device = shared["col"].device
        count = rows // groups * -(-groups // per)  # segments of group_segments' table
        if shared.get("seg_start") is None or shared["seg_start"].shape[0] != count:
            shared["seg_start"] = torch.zeros(count, dtype=torch.int32, device=device)
            shared["seg_rows"] = torch.zeros(count, dtype=torch.int32, device=device)
            shared["prompt_width"] = torch.zeros(1, dtype=torch.long, device=device)
            shared["covered"] = torch.zeros(1, dtype=torch.long, device=device)
            for name in ("seg_start", "seg_rows", "prompt_width", "covered"):
                torch._dynamo.mark_static_address(shared[name])
        shared["prompt_width"].fill_(width)
        state["segments"] = (groups, per, count)
        self._set_segments(state, torch.arange(rows, device=device), rows)
        return per

    @staticmethod
    def _set_segments(state, slots: torch.Tensor, live: int) -> None:
        """Fills the segment table for a bucket whose first ``live`` rows hold the original rows
        ``slots`` (ascending, so each group's rows stay consecutive); later rows are in none."""
        from logitless.ops.triton.decode_attention import group_segments

        groups, per, count = state["segments"]
        shared = state["shared"]
        num_groups = count // -(-groups // per)
        start, rows = group_segments(slots, groups, per, num_groups)
        shared["seg_start"].copy_(start)
        shared["seg_rows"].copy_(rows)
        shared["covered"].fill_(live)


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
    """Drop-in for :func:`logitless.rl.rollout.eager.generate` backed by a per-model :class:`CompiledSampler`.

    The sampler (compiled step, kept buffers) is created on the first call for ``model`` and reused
    while ``options`` are unchanged, so a training loop gets one compilation.

    Args:
        model, prompts, max_new_tokens, stop_tokens, pad_id, num_generations, temperature, top_k,
        top_p, generator: as in :func:`logitless.rl.rollout.eager.generate`.
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
        warnings.warn("logitless: FastGenerator is now logitless.rl.rollout.CompiledSampler; the old name will be "
                      "removed", FutureWarning, stacklevel=2)
        return CompiledSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
