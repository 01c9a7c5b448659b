"""The compiled sampler's decode step: one new token per row through the decoder, then its draw.

:func:`decode_step` is what ``torch.compile`` traces (and CUDA graphs capture): the trunk on each
row's last token, with every layer that allows it run as a grouped-query twin of torchtune's
(:func:`groupable`): the query heads that share a K/V head folded into one SDPA call so the cache is
read once, optionally with the concatenated q/k/v and gate/up projections
(:class:`~logitless.generation.fused.FusedProjections`) and the split-K attention kernel
(:mod:`logitless.generation.kernels.decode_attention`), whose rotary embedding and cache write run
inside it or in one launch before it (:mod:`logitless.generation.kernels.decode_rotary`); then the
head on the last position and the counter-based draw of the next token (:func:`record`, through the
Triton op of :mod:`logitless.generation.kernels.counter_sampling` on CUDA). Every input and output
is a persistent buffer updated in place (:class:`~logitless.generation.decode_cache.DecodeBuffers`),
so a captured graph serves every step.

The kernels' ops are registered before tracing (``register_*``): importing inside the step would
break the graph.
"""

import importlib
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from logitless.generation.sampling import sample_counter
from logitless.modules.attention import QKNormAttention
from logitless.generation.trunk import _gathered_fsdp_unit, decoding_layer, last_position_logits, run_decoding_layer

__all__ = ["decode_step", "groupable", "kernel_draw", "record", "register_counter_draw", "register_decode_attention",
           "register_decode_rotary", "write_tokens"]


def register_decode_attention():
    # registers the op logitless::decode_attention (imports triton); returns its module
    return importlib.import_module("logitless.generation.kernels.decode_attention")


#: logitless.generation.kernels.decode_rotary once registered (with the split-K attention): the traced
#: decode step reads it from here (importing inside the step would break the graph)
_decode_rotary = None


def register_decode_rotary():
    # registers the op logitless::decode_rotary_cache (imports triton); returns its module
    global _decode_rotary
    _decode_rotary = _decode_rotary or importlib.import_module("logitless.generation.kernels.decode_rotary")
    return _decode_rotary


def _fused_rotary(attn: nn.Module, s: int, cache: Optional[Tuple[torch.Tensor, torch.Tensor]], split_k):
    """The :class:`~logitless.generation.kernels.decode_rotary.RotaryTable` of ``attn``'s rotary module where
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


def register_counter_draw() -> None:
    # registers the op logitless::counter_draw (imports triton)
    importlib.import_module("logitless.generation.kernels.counter_sampling")


def kernel_draw(logits: torch.Tensor, top_k: Optional[int], top_p: Optional[float]) -> bool:
    """Whether the step draws through the Triton op ``logitless::counter_draw``: on CUDA, without
    top-k / top-p (the filters need a sort; :func:`sample_counter` keeps them)."""
    return logits.is_cuda and top_k is None and (top_p is None or top_p >= 1.0) and logits.stride(-1) == 1


def groupable(layer: nn.Module) -> bool:
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


def _grouped_attention(attn: nn.Module, x: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor,
                       cache: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                       col: Optional[torch.Tensor] = None, window=None,
                       qkv: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None,
                       split_k: Optional[Tuple] = None, per_row_columns: bool = False) -> torch.Tensor:
    """torchtune's cached self-attention without expanding K/V to every query head.

    ``MultiHeadAttention`` copies the whole cache ``num_heads // num_kv_heads`` times per layer
    and step before SDPA. Here the query heads that share a K/V head are folded into the query
    length instead (query head ``h`` reads K/V head ``h // group``, torchtune's order), so SDPA
    reads the cache once; the result is the same attention. With ``cache`` (the first ``B`` rows of
    the layer's cache, as a batch bucket sees them) the new key and value are written at column
    ``col`` there instead of through ``attn.kv_cache``, and attention reads its first ``window``
    columns only (all with None). ``qkv`` (weight, bias) of the concatenated q/k/v projections
    (:class:`FusedProjections`) computes them with one GEMM. With ``split_k`` = ``(key_valid,
    n_filled, programmatic_launch, shared_prefix, rotations, split_len)`` (``(B, L)`` bool, ``(1,)`` int64,
    bool, a :class:`~logitless.generation.kernels.decode_attention.SharedPrefix` or None, a dict the step
    fills with each rotary table's per-row coefficients, the columns per split or 0 for the kernel's
    choice from the fill) one new token per row attends through the split-K kernel
    (:func:`logitless.generation.kernels.decode_attention`), which reads the first ``n_filled`` columns of the
    cache only (each group's prompt columns once, with a shared prefix), instead of SDPA under
    ``mask``. Where :func:`_fused_rotary` allows, the compiler's three or four kernels of rotary
    embedding and cache write go: into the attention's own launch without a shared prefix
    (:class:`~logitless.generation.kernels.decode_attention.NewToken`), else into one launch before it
    (:func:`logitless.generation.kernels.decode_rotary.decode_rotary_cache`; inside the attention it measured
    slower there, the shared-prefix programs all rotating their rows' queries).
    ``per_row_columns``: ``col`` is ``(B,)``, each row's own write column (a multi-turn rollout's rows
    are at different columns, :mod:`logitless.generation.tools.turn_step`); rotary embedding and
    cache write then run here, not inside the split-K launch.
    """
    b, s, _ = x.shape
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if qkv is None:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    else:
        q, k, v = F.linear(x, *qkv).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    norms_first = _norms_before_rope(attn)
    if norms_first:  # Qwen3: per-head norms of the projections, then the rotary embedding below
        q, k = attn.q_norm(q.view(b, s, heads, dim)), attn.k_norm(k.view(b, s, kv_heads, dim))
    rotary = None if per_row_columns else _fused_rotary(attn, s, cache, split_k)
    if rotary is not None and split_k[3] is None:  # rotary embedding and cache write inside the attention
        key_valid, n_filled, programmatic, _, rotations, _ = split_k
        if id(rotary.table) not in rotations:  # once a step for the layers that share a rotary module
            rotations[id(rotary.table)] = _decode_rotary.rotation_coefficients(rotary, input_pos.view(b), dim, q.dtype)
        out = torch.ops.logitless.decode_attention_new_token(
            q.view(b, heads, dim), cache[0], cache[1], key_valid, n_filled, k.view(b, kv_heads, dim),
            v.view(b, kv_heads, dim), *rotations[id(rotary.table)], rotary.interleaved, dim ** -0.5, 0, 0, 0, 0,
            programmatic)
        return attn.output_proj(out.reshape(b, 1, heads * dim))
    if rotary is not None:  # with a shared prompt: rotary embedding and cache write in one launch before it
        q = torch.ops.logitless.decode_rotary_cache(q.view(b, heads, dim), k.view(b, kv_heads, dim),
                                                    v.view(b, kv_heads, dim), input_pos.view(b), *rotary, col,
                                                    cache[0], cache[1], split_k[2])[:, :, None]
        return _split_k_attention(attn, q, cache, split_k)
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
    elif per_row_columns:  # one new token per row, at the row's own column
        rows = torch.arange(b, device=col.device)
        cache[0][rows, :, col] = k[:, :, 0]
        cache[1][rows, :, col] = v[:, :, 0]
        k, v = cache
    else:
        # written into the bucket's cache itself, then read through a narrowed view
        cache[0].index_copy_(2, col, k)
        cache[1].index_copy_(2, col, v)
        k, v = cache
        if window is not None:
            k, v = k.narrow(2, 0, window), v.narrow(2, 0, window)
    if split_k is not None:
        return _split_k_attention(attn, q, (k, v), split_k)
    group = heads // kv_heads
    q = q.reshape(b, kv_heads, group * s, dim)
    length = mask.shape[-1]
    mask = mask[:, None, None].expand(b, 1, group, s, length).reshape(b, 1, group * s, length)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # reshape, not view: some SDPA kernels (fp32 on CUDA) return a (B, L, H, D) memory layout.
    return attn.output_proj(out.reshape(b, heads, s, dim).transpose(1, 2).reshape(b, s, heads * dim))


def _split_k_attention(attn: nn.Module, q: torch.Tensor, cache: Tuple[torch.Tensor, torch.Tensor],
                       split_k: Tuple) -> torch.Tensor:
    """The output projection of one new token per row (``q``: ``(B, Hq, 1, D)``, rotated) attending
    through the split-K kernel to the filled columns of ``cache`` (see :func:`_grouped_attention`)."""
    b, heads, _, dim = q.shape
    k, v = cache
    # the raw op (registered by the sampler): launch parameters 0 = the kernel's defaults
    key_valid, n_filled, programmatic, prefix, _, split_len = split_k
    if prefix is None:
        out = torch.ops.logitless.decode_attention(q.squeeze(2), k, v, key_valid, n_filled, dim ** -0.5, split_len, 0,
                                                   0, 0, programmatic)
    else:
        out = torch.ops.logitless.decode_attention_shared_prefix(q.squeeze(2), k, v, key_valid, n_filled, *prefix,
                                                                 dim ** -0.5, 0, 0, 0, 0, 0, programmatic)
    return attn.output_proj(out.reshape(b, 1, heads * dim))


def _layer_step(layer: nn.Module, h: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor,
                grouped: bool, cache: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                col: Optional[torch.Tensor] = None, window=None,
                fused: Optional[Dict[str, Tuple[torch.Tensor, Optional[torch.Tensor]]]] = None,
                split_k: Optional[Tuple] = None, per_row_columns: bool = False) -> torch.Tensor:
    """One decoder layer for one new token: torchtune's layer, or its grouped-attention twin (with
    ``fused``, the layer's concatenated projections of :class:`FusedProjections`; with ``split_k``,
    the split-K attention of :func:`_grouped_attention`; ``per_row_columns``: ``col`` holds each
    row's write column)."""
    layer = decoding_layer(layer)
    if not (grouped and groupable(layer)):
        return run_decoding_layer(layer, h, mask=mask, input_pos=input_pos)
    fused = fused or {}
    h = layer.sa_scale(_grouped_attention(layer.attn, layer.sa_norm(h), input_pos, mask, cache, col, window,
                                          fused.get("qkv"), split_k, per_row_columns)) + h
    x = layer.mlp_norm(h)
    if "gate_up" not in fused:
        return h + layer.mlp_scale(layer.mlp(x))
    # torchtune's FeedForward: w2(act(w1 x) * w3 x)
    gate, up = F.linear(x, *fused["gate_up"]).chunk(2, dim=-1)
    return h + layer.mlp_scale(layer.mlp.w2(layer.mlp.activation(gate) * up))


def record(rows: Dict[str, torch.Tensor], shared: Dict[str, torch.Tensor], logits: torch.Tensor,
            draw: Tuple) -> None:
    """Samples token ``t`` of every row of a bucket from ``logits`` with the counter-based stream and
    writes it: into the outputs (at the row's original index), the finished flags and the next
    step's input; ``t`` advances. All in place, no host sync: it runs inside the captured graph."""
    temperature, top_k, top_p, pad_id = draw
    step = shared["t"]
    if kernel_draw(logits, top_k, top_p):  # the same draw in two launches (generation/kernels/counter_sampling.py)
        nxt, logp = torch.ops.logitless.counter_draw(logits, rows["keys"], step, float(temperature))
    else:
        nxt, logp = sample_counter(logits, rows["keys"], step, temperature=temperature, top_k=top_k, top_p=top_p,
                                   token_hash=shared["token_hash"])
    write_tokens(rows, shared, nxt, logp, pad_id)


def write_tokens(rows: Dict[str, torch.Tensor], shared: Dict[str, torch.Tensor], nxt: torch.Tensor,
           logp: torch.Tensor, pad_id: int) -> None:
    """Writes sampled token ``t`` of a bucket's rows (see :func:`record`)."""
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


def decode_step(model: nn.Module, rows: Dict[str, torch.Tensor], shared: Dict[str, torch.Tensor],
                 weight: torch.Tensor, grouped: bool = True, draw: Optional[Tuple] = None,
                 columns: Optional[torch.Tensor] = None, fused: Optional[List[Dict]] = None,
                 split_k: bool = False, programmatic_launch: bool = False, shared_prompt: int = 0):
    """One decode step of a bucket of rows at cache column ``shared["col"]`` (a ``(1,)`` tensor,
    not an int, so the compiled step is the same graph at every column).

    Runs the trunk on the rows' last tokens; with ``draw`` (temperature, top_k, top_p, pad_id) it
    also samples and writes the next token (:func:`record`) and returns None, else it returns the
    ``(rows, V)`` logits (the head GEMM's dtype). Positions and the column advance in place.
    ``columns`` (the column indices ``0 .. W-1`` of a window holding every filled column) limits
    attention to the window; its length turns dynamic at its first change (one recompilation), after
    which each window size is one more CUDA graph. ``fused`` holds each layer's concatenated projections
    (:meth:`FusedProjections.layers`; None runs the layers' own). ``split_k``: the grouped layers
    attend through the split-K kernel, whose reads follow the filled columns (``shared["n_filled"]``,
    ``col + 1``, a device tensor), so no window is needed and every step is the same graph; ``programmatic_launch``: the
    split-K kernels are programmatic dependent launches; ``shared_prompt`` (> 0, with ``split_k``):
    the split-K kernels read each group's prompt columns once, for segments of at most that many
    rows described by ``shared``'s ``prompt_width``, ``seg_start``, ``seg_rows`` and ``covered``.
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
    filled = (key_valid, n_filled, programmatic_launch, prefix, {}, 0) if split_k else None

    def run_layer(index, layer, h):
        return _layer_step(layer, h, input_pos, mask, grouped, caches[index] if caches else None, col, window,
                           fused[index] if fused else None, filled)

    # the head GEMM's dtype: every draw upcasts as it reads (no fp32 copy of the logits)
    logits = last_position_logits(model, tokens, input_pos=input_pos, mask=mask, weight=weight, run_layer=run_layer,
                                  upcast=False)
    input_pos.add_(1)
    col.add_(1)
    n_filled.add_(1)
    if draw is None:
        return logits
    record(rows, shared, logits, draw)
    return None
