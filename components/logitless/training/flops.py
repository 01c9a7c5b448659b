"""Model FLOPs of a decoder's forward and backward passes, and the peak FLOP/s of known GPUs, for
model FLOPs utilisation (MFU): the FLOPs the model needs for the tokens it processed, divided by
the time taken and the device's peak dense bf16 FLOP/s.

Conventions (one multiply-add = 2 FLOPs; the usual ``6 N`` per token of full fine-tuning):

* **Matmul weights.** Every 2-D weight inside the decoder layers (projections, MLP, LoRA adapters,
  a LoRA layer's frozen base weight) plus the output head (``vocab x dim``, tied or not). The
  embedding lookup, norms, biases, activations and the loss are not counted.
* **Forward.** ``2 x weights x tokens`` for the layers; the head on the positions it is applied
  to; attention ``4 x sum_layers(heads x head_dim) x pairs``, ``pairs`` the (query, key) pairs a
  causal mask lets attend: ``n (n + 1) / 2`` for a sequence of ``n`` tokens (scores and the
  weighted sum of values, 2 FLOPs each per pair and dimension).
* **Backward.** Every matmul needs the gradient of its input (``2 x`` its weights per token) and a
  trainable one also that of its weight (another ``2 x``): a full fine-tune costs 2x the forward,
  a LoRA one (frozen base weights) about 1x plus the adapters' 2x. Attention's backward is 2x its
  forward.
* **Activation checkpointing** recomputes the layers' forward during the backward. That is not
  work the model needs, so MFU leaves it out (PaLM's definition, what torchtitan and Megatron
  report); ``training(..., hardware=True)`` adds it (hardware FLOPs, for HFU).

A device outside :data:`PEAK_BF16_FLOPS` has no peak, hence no MFU (the metric is left out rather
than guessed).
"""

from typing import Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["PEAK_BF16_FLOPS", "DecoderFlops", "causal_pairs", "mfu", "peak_bf16_flops"]

#: Peak dense (no sparsity) bf16 tensor-core FLOP/s by GPU, matched in this order against the lower-case
#: ``torch.cuda.get_device_name()``: the first entry whose name part occurs in it wins.
PEAK_BF16_FLOPS: Tuple[Tuple[str, float], ...] = (
    ("h200", 989e12),       # H200 SXM / NVL and GH200: H100 SXM's tensor cores
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h100", 989e12),       # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("a100", 312e12),
)


def peak_bf16_flops(device: torch.device) -> Optional[float]:
    """The peak dense bf16 FLOP/s of ``device`` from :data:`PEAK_BF16_FLOPS`; None for a CPU or a GPU
    not in the table (then no MFU is reported).

    Example:
        >>> peak_bf16_flops(torch.device("cuda"))   # on an H200
        989000000000000.0
    """
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((peak for part, peak in PEAK_BF16_FLOPS if part in name), None)


def _matmul_weights(module: nn.Module) -> Tuple[int, int]:
    """(trainable, frozen) elements of the 2-D weights of every matmul inside ``module``."""
    trainable = frozen = 0
    for m in module.modules():
        weight = m._parameters.get("weight")
        if weight is None or weight.dim() != 2 or isinstance(m, nn.Embedding):
            continue
        if weight.requires_grad:
            trainable += weight.numel()
        else:
            frozen += weight.numel()
    return trainable, frozen


class DecoderFlops:
    """FLOP counts of a torchtune ``TransformerDecoder`` (see the module docstring for the convention).

    Args:
        model (nn.Module): the decoder (plain, LoRA, activation-checkpointed or FSDP2-sharded: sizes
            are the full ones).

    Example:
        >>> flops = DecoderFlops(model)
        >>> flops.training(tokens=4096, head_tokens=2048, pairs=4 * 1024 * 1025 // 2)
    """

    def __init__(self, model: nn.Module) -> None:
        self.layer_trainable, self.layer_frozen = _matmul_weights(model.layers)
        vocab, dim = model.tok_embeddings.weight.shape
        self.head = vocab * dim
        output = getattr(model, "output", None)
        head_param = output.weight if isinstance(output, nn.Module) and hasattr(output, "weight") \
            else model.tok_embeddings.weight  # tied: the head is the embedding matrix
        self.head_trainable = bool(head_param.requires_grad)
        self.attention_width = sum(layer.attn.num_heads * layer.attn.head_dim
                                   for layer in (getattr(l, "_checkpoint_wrapped_module", l) for l in model.layers))
        self.checkpointed = any(hasattr(layer, "_checkpoint_wrapped_module") for layer in model.layers)

    def _layers_forward(self, tokens: float, pairs: float) -> float:
        return 2 * (self.layer_trainable + self.layer_frozen) * tokens + 4 * self.attention_width * pairs

    def forward(self, *, tokens: float, head_tokens: float, pairs: float) -> float:
        """FLOPs of one forward pass.

        Args:
            tokens (float): tokens through the layers.
            head_tokens (float): positions the output head is applied to.
            pairs (float): attended (query, key) pairs per layer (:func:`causal_pairs`).

        Returns:
            float: FLOPs.
        """
        return self._layers_forward(tokens, pairs) + 2 * self.head * head_tokens

    def training(self, *, tokens: float, head_tokens: float, pairs: float, hardware: bool = False) -> float:
        """FLOPs of one forward + backward pass; arguments as in :meth:`forward`.

        Args:
            hardware (bool): also count the layers' recomputation under activation checkpointing
                (the FLOPs the device runs, not the ones the model needs).
        """
        layers = self.layer_trainable + self.layer_frozen
        backward = (2 * (layers + self.layer_trainable) * tokens + 8 * self.attention_width * pairs
                    + 2 * self.head * head_tokens * (2 if self.head_trainable else 1))
        recompute = self._layers_forward(tokens, pairs) if hardware and self.checkpointed else 0.0
        return self.forward(tokens=tokens, head_tokens=head_tokens, pairs=pairs) + backward + recompute


def causal_pairs(lengths: Sequence[int]) -> int:
    """(query, key) pairs of causal attention over sequences of ``lengths`` tokens: ``sum n (n + 1) / 2``.

    Example:
        >>> causal_pairs([3, 1])
        7
    """
    return sum(int(n) * (int(n) + 1) // 2 for n in lengths)


def mfu(flops: float, seconds: float, peak: Optional[float], devices: int = 1) -> Optional[float]:
    """Model FLOPs utilisation: ``flops / (seconds x peak x devices)``; None without a peak.

    Example:
        >>> mfu(494.5e12, 1.0, 989e12)
        0.5
    """
    if not peak or seconds <= 0:
        return None
    return flops / (seconds * peak * devices)
