"""The decoder trunk as the samplers run it: embeddings -> layers -> final norm of the last position -> head.

Both samplers (eager and compiled) and their prefills call :func:`last_position_logits` (a chunked
prefill runs its earlier chunks through :func:`decoder_hidden`: caches filled, no head); only the way
one layer runs differs (torchtune's layer, or the compiled sampler's grouped-attention twin), so the
trunk itself exists once.
"""

from typing import Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

#: ``run_layer(index, layer, h) -> h``: how decoder layer ``index`` runs inside :func:`last_position_logits`.
LayerRunner = Callable[[int, nn.Module, torch.Tensor], torch.Tensor]


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
    (+35% time per token for Qwen2.5-1.5B on an H200); a sharded unit is called normally. A
    layer compiled for training (``nn.Module.compile``, the recipes' ``compile: True``) runs uncompiled.

    Args:
        layer (nn.Module): a decoder layer (plain, checkpoint-wrapped or an FSDP2 unit).
        h (torch.Tensor): ``(B, S, H)`` hidden states.
        mask (torch.Tensor): attention mask as torchtune's layer takes it.
        input_pos (torch.Tensor): positions of ``h``.

    Returns:
        torch.Tensor: the layer's output.
    """
    inner = decoding_layer(layer)
    if _gathered_fsdp_unit(inner):
        call = inner.forward
    elif getattr(inner, "_compiled_call_impl", None) is not None:
        # a layer compiled for training (``compile: True``): its graphs are traced for the update's
        # shapes; sampling calls it uncompiled (hooks kept) rather than tracing prefill and per-token
        # shapes into the same cache
        call = inner._call_impl
    else:
        call = inner
    return call(h, mask=mask, input_pos=input_pos)


def last_position_logits(model: nn.Module, tokens: torch.Tensor, *, input_pos: torch.Tensor, mask: torch.Tensor,
                         weight: Optional[torch.Tensor] = None,
                         run_layer: Optional[LayerRunner] = None, upcast: bool = True) -> torch.Tensor:
    """Runs the decoder trunk and projects only the last position: ``(B, V)`` fp32 logits.

    Mirrors ``TransformerDecoder.forward`` up to the final norm, then applies the head weight to one
    position per sequence, so neither a prefill nor a decode step ever materialises ``[B, S, V]``
    logits.

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` (not a ``torch.compile`` wrapper).
        tokens (torch.Tensor): ``(B, S)`` token ids.
        input_pos (torch.Tensor): ``(B, S)`` positions of ``tokens``.
        mask (torch.Tensor): attention mask as torchtune's layers take it.
        weight (Optional[torch.Tensor]): ``(V, H)`` head weight; None = ``logitless.modules.head_weight``
            (tied, untied or LoRA merged).
        run_layer (Optional[LayerRunner]): runs one layer on ``h``; None = :func:`run_decoding_layer`
            with ``mask`` and ``input_pos``.
        upcast (bool): return fp32 logits; False returns the head GEMM's output dtype, for a consumer
            that upcasts as it reads (no fp32 copy written; the values are the same).

    Returns:
        torch.Tensor: ``(B, V)`` logits of the last position (fp32 with ``upcast``).

    Example:
        >>> logits = last_position_logits(model, tokens, input_pos=pos, mask=mask)   # (B, V)
    """
    if weight is None:
        from logitless.modules import head_weight

        weight = head_weight(model)
    h = decoder_hidden(model, tokens, input_pos=input_pos, mask=mask, run_layer=run_layer)
    logits = F.linear(model.norm(h[:, -1]), weight)
    return logits.float() if upcast else logits


def decoder_hidden(model: nn.Module, tokens: torch.Tensor, *, input_pos: torch.Tensor, mask: torch.Tensor,
                   run_layer: Optional[LayerRunner] = None) -> torch.Tensor:
    """Runs the embeddings and every decoder layer (filling the attached KV caches); no final norm, no head.

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` (not a ``torch.compile`` wrapper).
        tokens (torch.Tensor): ``(B, S)`` token ids.
        input_pos (torch.Tensor): ``(B, S)`` positions of ``tokens``.
        mask (torch.Tensor): attention mask as torchtune's layers take it.
        run_layer (Optional[LayerRunner]): runs one layer on ``h``; None = :func:`run_decoding_layer`
            with ``mask`` and ``input_pos``.

    Returns:
        torch.Tensor: ``(B, S, H)`` output of the last layer.

    Example:
        >>> h = decoder_hidden(model, tokens, input_pos=pos, mask=mask)   # (B, S, H)
    """
    if run_layer is None:
        def run_layer(index, layer, h):
            return run_decoding_layer(layer, h, mask=mask, input_pos=input_pos)
    h = model.tok_embeddings(tokens)
    for index, layer in enumerate(model.layers):
        h = run_layer(index, layer, h)
    return h
