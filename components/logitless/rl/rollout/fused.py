"""Concatenated input projections for the compiled decode step: one GEMM for q/k/v, one for gate/up.

A decode step multiplies a handful of rows by every weight of the model, so each projection is a
small, launch-bound GEMM; reading the q, k and v weights (and the MLP's gate and up weights) as one
matrix halves the launches per layer. The training model keeps torchtune's separate projections:
the concatenated weights are a copy that :meth:`FusedProjections.refresh` rewrites from the
policy's current weights at the start of every sampling call, so the decode step never reads a
stale copy while the policy trains between calls.

Only plain ``nn.Linear`` projections are concatenated: a LoRA (or otherwise wrapped) projection
keeps its own modules, since merging its adapters into the copy would add a per-call merge of every
adapted weight. The cost is one extra copy of the concatenated weights while sampling.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["FusedProjections"]

#: (weight, bias or None) of one concatenated projection, as ``F.linear`` takes them.
Projection = Tuple[torch.Tensor, Optional[torch.Tensor]]


def _plain_linears(modules: Sequence[Optional[nn.Module]]) -> bool:
    """True when every module is an ``nn.Linear`` (exactly) without hooks, with full (not sharded)
    weights of one dtype and device, and either all or none with a bias."""
    from torch.distributed.tensor import DTensor

    if not all(type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks) for m in modules):
        return False
    weights = [m.weight for m in modules]
    if any(isinstance(w, DTensor) for w in weights):
        return False
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return False
    return len({m.bias is None for m in modules}) == 1


def _groups(layer: nn.Module) -> Dict[str, List[nn.Linear]]:
    """The projections of ``layer`` that read the same input and may be concatenated:
    ``{"qkv": [q, k, v], "gate_up": [w1, w3]}``, each present only where all its parts are plain."""
    from torchtune.modules import FeedForward

    out = {}
    attn = getattr(layer, "attn", None)
    if attn is not None:
        parts = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        if _plain_linears(parts):
            out["qkv"] = parts
    mlp = getattr(layer, "mlp", None)
    if type(mlp) is FeedForward and mlp.w3 is not None and _plain_linears([mlp.w1, mlp.w3]):
        out["gate_up"] = [mlp.w1, mlp.w3]
    return out


def _concat(parts: Sequence[nn.Linear]) -> Projection:
    weight = torch.cat([p.weight.detach() for p in parts])
    bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
    return weight, bias


class FusedProjections:
    """The concatenated q/k/v and gate/up weights of a decoder's layers, in fixed buffers.

    Args:
        layers (Sequence[nn.Module]): the decoder layers as the decode step runs them (past
            activation checkpointing: :func:`logitless.rl.rollout.trunk.decoding_layer`).

    Example:
        >>> fused = FusedProjections([decoding_layer(l) for l in model.layers])
        >>> fused.refresh([decoding_layer(l) for l in model.layers])   # every sampling call
        >>> weight, bias = fused.layers()[0]["qkv"]                     # (q + 2 kv, H), (q + 2 kv,)
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self._layers: List[Dict[str, Projection]] = []
        for layer in layers:
            buffers = {name: _concat(parts) for name, parts in _groups(layer).items()}
            for weight, bias in buffers.values():
                # fixed addresses: a captured CUDA graph reads them in place
                for t in (weight,) if bias is None else (weight, bias):
                    torch._dynamo.mark_static_address(t)
            self._layers.append(buffers)

    def matches(self, layers: Sequence[nn.Module]) -> bool:
        """True when ``layers`` have the projections (names, shapes, dtypes) the buffers were built for."""
        if len(layers) != len(self._layers):
            return False
        for layer, buffers in zip(layers, self._layers):
            groups = _groups(layer)
            if set(groups) != set(buffers):
                return False
            for name, parts in groups.items():
                weight, bias = buffers[name]
                if (sum(p.weight.shape[0] for p in parts), parts[0].weight.shape[1]) != tuple(weight.shape) \
                        or parts[0].weight.dtype != weight.dtype or (parts[0].bias is None) != (bias is None):
                    return False
        return True

    @torch.no_grad()
    def refresh(self, layers: Sequence[nn.Module]) -> None:
        """Copies the current weights of ``layers`` (as built) into the buffers, in place."""
        for layer, buffers in zip(layers, self._layers):
            groups = _groups(layer)
            for name, (weight, bias) in buffers.items():
                parts = groups[name]
                torch.cat([p.weight for p in parts], out=weight)
                if bias is not None:
                    torch.cat([p.bias for p in parts], out=bias)

    def layers(self) -> List[Dict[str, Projection]]:
        """Per layer ``{"qkv": (weight, bias), "gate_up": (weight, bias)}`` (the concatenated groups only)."""
        return self._layers

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers (the extra memory while sampling)."""
        return sum(t.numel() * t.element_size() for buffers in self._layers for pair in buffers.values()
                   for t in pair if t is not None)
