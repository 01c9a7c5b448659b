"""Concatenated input projections for the compiled decode step: one GEMM for q/k/v, one for gate/up.

A decode step multiplies a handful of rows by every weight of the model, so each projection is a
small, launch-bound GEMM; reading the q, k and v weights (and the MLP's gate and up weights) as one
matrix halves the launches per layer. The training model keeps torchtune's separate projections.
Two ways to give the step the concatenated weights:

* a copy (``share=False``): :meth:`FusedProjections.refresh` rewrites it from the policy's current
  weights at the start of every sampling call, so the decode step never reads a stale copy while
  the policy trains between calls. It costs one extra copy of the concatenated weights (about half
  of the model) for as long as it is kept;
* shared storage (``share=True``): the concatenated buffer is built once and the model's own
  parameters are re-pointed at row slices of it (``param.data``; the ``nn.Parameter`` objects, hence
  the optimizer's references and states, stay the same). The training step and the optimizer then
  write the very memory the decode step reads: no extra copy and nothing to refresh. A parameter
  that was replaced since (``load_state_dict(assign=True)``, a dtype change) is copied back in and
  re-pointed by :meth:`FusedProjections.refresh`; projections that already lie end to end in one
  storage (shared by another sampler of the same model) are used where they are, without a copy.
  ``model.state_dict()`` then holds disjoint views of one storage per group, which ``torch.save``
  and ``safetensors`` write as separate tensors.

Only plain ``nn.Linear`` projections are concatenated: a LoRA (or otherwise wrapped) projection
keeps its own modules, since merging its adapters into the copy would add a per-call merge of every
adapted weight.
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


def _slices(parts: Sequence[nn.Linear], fused: Projection) -> List[Projection]:
    """Each part's rows of the concatenated ``(weight, bias)``, as views."""
    weight, bias = fused
    out, row = [], 0
    for p in parts:
        n = p.weight.shape[0]
        out.append((weight[row:row + n], None if bias is None else bias[row:row + n]))
        row += n
    return out


def _is_view_of(t: torch.Tensor, view: torch.Tensor) -> bool:
    """True when ``t`` is exactly the memory of ``view`` (same start, shape, strides and dtype)."""
    return (t.data_ptr() == view.data_ptr() and t.shape == view.shape and t.stride() == view.stride()
            and t.dtype == view.dtype and t.device == view.device)


def _points_into(parts: Sequence[nn.Linear], fused: Projection) -> List[bool]:
    """Per part: whether its weight (and bias) are the part's rows of ``fused``."""
    return [_is_view_of(p.weight, w) and (b is None or _is_view_of(p.bias, b))
            for p, (w, b) in zip(parts, _slices(parts, fused))]


def _end_to_end(parts: Sequence[nn.Linear]) -> Optional[Projection]:
    """The concatenated ``(weight, bias)`` as views of the parts' own storage when the parts already
    lie end to end in it, in order (as :func:`_share` leaves them), else None."""
    def spanning(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        # one view from the first part over all parts' rows; set_ past the storage's end would
        # grow (reallocate) it, so that is ruled out first
        first, storage = tensors[0], tensors[0].untyped_storage()
        rows = sum(t.shape[0] for t in tensors)
        if not first.is_contiguous() or \
                (first.storage_offset() + rows * first[0].numel()) * first.element_size() > storage.nbytes():
            return None
        return first.new_empty(0).set_(storage, first.storage_offset(), (rows, *first.shape[1:]), first.stride())

    weight = spanning([p.weight.detach() for p in parts])
    bias = None if parts[0].bias is None else spanning([p.bias.detach() for p in parts])
    if weight is None or (parts[0].bias is not None and bias is None):
        return None
    return (weight, bias) if all(_points_into(parts, (weight, bias))) else None


@torch.no_grad()
def _share(parts: Sequence[nn.Linear], fused: Projection) -> None:
    """Copies each part's current values into its rows of ``fused`` (unless they are those rows
    already) and re-points the part's parameters there."""
    for p, (w, b), shared in zip(parts, _slices(parts, fused), _points_into(parts, fused)):
        if shared:
            continue
        w.copy_(p.weight)
        p.weight.data = w
        if b is not None:
            b.copy_(p.bias)
            p.bias.data = b


class FusedProjections:
    """The concatenated q/k/v and gate/up weights of a decoder's layers, in fixed buffers.

    Args:
        layers (Sequence[nn.Module]): the decoder layers as the decode step runs them (past
            activation checkpointing: :func:`logitless.generation.trunk.decoding_layer`).
        share (bool): re-point the layers' parameters at the buffers instead of keeping a copy
            (module docstring); False keeps a copy that :meth:`refresh` rewrites.

    Example:
        >>> fused = FusedProjections([decoding_layer(l) for l in model.layers], share=True)
        >>> fused.refresh([decoding_layer(l) for l in model.layers])   # every sampling call
        >>> weight, bias = fused.layers()[0]["qkv"]                     # (q + 2 kv, H), (q + 2 kv,)
        >>> model.layers[0].attn.q_proj.weight.data_ptr() == weight.data_ptr()
        True
    """

    def __init__(self, layers: Sequence[nn.Module], share: bool = False) -> None:
        self.share = share
        self._layers: List[Dict[str, Projection]] = []
        for layer in layers:
            buffers = {}
            for name, parts in _groups(layer).items():
                fused = _end_to_end(parts) if share else None
                if fused is None:
                    fused = _concat(parts)
                    if share:
                        _share(parts, fused)  # the parts' former storage is freed here
                buffers[name] = fused
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
        """Brings the buffers up to the current weights of ``layers`` (as built), in place: copies
        them in, or with ``share`` copies in and re-points only the parameters that no longer are
        their rows of the buffers (nothing at all while the sharing holds)."""
        for layer, buffers in zip(layers, self._layers):
            groups = _groups(layer)
            for name, (weight, bias) in buffers.items():
                parts = groups[name]
                if self.share:
                    _share(parts, (weight, bias))
                    continue
                torch.cat([p.weight for p in parts], out=weight)
                if bias is not None:
                    torch.cat([p.bias for p in parts], out=bias)

    def shares(self, layers: Sequence[nn.Module]) -> bool:
        """True when every concatenated projection of ``layers`` is, parameter by parameter, its
        rows of the buffers (the state :meth:`refresh` with ``share`` leaves)."""
        return all(all(_points_into(_groups(layer)[name], fused)) for layer, buffers in zip(layers, self._layers)
                   for name, fused in buffers.items())

    def layers(self) -> List[Dict[str, Projection]]:
        """Per layer ``{"qkv": (weight, bias), "gate_up": (weight, bias)}`` (the concatenated groups only)."""
        return self._layers

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers: with ``share`` they are the model's own weights, else a copy kept
        while sampling (:attr:`extra_bytes`)."""
        return sum(t.numel() * t.element_size() for buffers in self._layers for pair in buffers.values()
                   for t in pair if t is not None)

    @property
    def extra_bytes(self) -> int:
        """Bytes held beyond the model's weights: 0 with ``share``, else :attr:`nbytes`."""
        return 0 if self.share else self.nbytes
