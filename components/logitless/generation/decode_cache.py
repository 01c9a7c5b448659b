"""The compiled sampler's persistent tensors: KV caches, batch buckets, compaction and the segment
table of a shared prompt.

A captured CUDA graph reads and writes its tensors where they are, so everything a decode step
touches lives in buffers allocated once per shape and updated in place (:class:`DecodeBuffers`):
one static torchtune ``KVCache`` per attention layer, the outputs, and per batch bucket (the first
``size`` rows of the caches) the step's inputs. When rows finish, :meth:`DecodeBuffers.compact` moves
the live ones into a smaller bucket, so finished rows stop costing decode steps.

The caches are attached to the model only for a call (:func:`attach` / :func:`detach`): a torchtune
0.6.1 model with caches set up but disabled attends bidirectionally when called without a mask.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from logitless.generation.sampling import token_hashes

__all__ = ["DecodeBuffers", "attach", "attention_modules", "detach", "new_caches", "replicate_prompts"]


def attention_modules(model: nn.Module) -> List[nn.Module]:
    """The self-attention modules of a torchtune decoder, in layer order.

    Raises:
        ValueError: a model without any ``MultiHeadAttention``.
    """
    from torchtune.modules import MultiHeadAttention

    attns = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not attns:
        raise ValueError(f"model must be a torchtune TransformerDecoder with MultiHeadAttention layers, "
                         f"got {type(model).__name__} without any")
    return attns


def new_caches(attns: Sequence[nn.Module], batch: int, length: int, dtype: torch.dtype,
               device: torch.device) -> List[nn.Module]:
    """One preallocated torchtune ``KVCache`` per attention module."""
    from torchtune.modules import KVCache

    with device:
        return [KVCache(batch_size=batch, max_seq_len=length, num_kv_heads=a.num_kv_heads,
                        head_dim=a.head_dim, dtype=dtype) for a in attns]


def attach(attns: Sequence[nn.Module], caches: Sequence[nn.Module]) -> None:
    """Gives each attention module its cache, enabled."""
    for attn, cache in zip(attns, caches):
        attn.kv_cache = cache
        attn.cache_enabled = True


def detach(attns: Sequence[nn.Module]) -> None:
    """Takes the caches away (torchtune's ``delete_kv_caches`` end state: the model is causal again)."""
    for attn in attns:
        attn.kv_cache = None
        attn.cache_enabled = False


def replicate_prompts(small: Sequence[nn.Module], big: Sequence[nn.Module], groups: int, width: int) -> None:
    """Copies each prompt's cache entries (``small``: one row per prompt) into its ``groups``
    consecutive decode rows of ``big`` and points the caches' write position at column ``width``
    (the first completion token)."""
    for src, dst in zip(small, big):
        rows, heads, length, dim = dst.k_cache.shape
        for name in ("k_cache", "v_cache"):
            out = getattr(dst, name)
            out.zero_()  # stale columns from a previous call: masked, but keep them finite
            view = out.view(rows // groups, groups, heads, length, dim)
            view[..., :width, :].copy_(getattr(src, name)[:, None])
        dst.cache_pos.copy_(torch.arange(length, device=dst.cache_pos.device) + width)


class DecodeBuffers:
    """The decode caches, the outputs and the step inputs of one shape, reused while it is unchanged.

    Args:
        attns (Sequence[nn.Module]): the model's attention modules.
        rows (int): decode rows (prompts x completions per prompt).
        length (int): cache columns.
        dtype (torch.dtype): the caches' dtype.
        device (torch.device): where everything lives.
        weight (torch.Tensor): the head weight (a Parameter is used in place; anything else is copied
            into :attr:`weight` at each call, a fixed address).
        dynamic_rows (bool): mark the buckets' row dimension dynamic (compaction: one compilation for
            every bucket size).

    Attributes:
        key (tuple): what the buffers were made for (:meth:`key_of`).
        caches (List[nn.Module]): the decode caches.
        shared (Dict[str, torch.Tensor]): the step's column, fill and token counters, the outputs (one
            spare row, where a bucket's finished filler rows write), the stop-token table, the token
            hashes of the counter draws and, with a shared prompt, its segment table.
        buckets (Dict[int, Dict[str, torch.Tensor]]): each bucket's step inputs, by size.
        columns (torch.Tensor): ``0 .. length - 1``, the columns of a windowed attention.
        weight (Optional[torch.Tensor]): the fixed buffer of a head weight that is not a Parameter.
        segments (Optional[Tuple[int, int, int]]): this call's shared prompt (group size, rows per
            segment, segments); None without one.
        fused (Any): the sampler's concatenated projections, kept (and freed) with the buffers.
    """

    def __init__(self, attns: Sequence[nn.Module], rows: int, length: int, dtype: torch.dtype, device: torch.device,
                 weight: torch.Tensor, *, dynamic_rows: bool):
        self.key = self.key_of(attns, rows, length, dtype, device, weight)
        self.dynamic_rows = dynamic_rows
        vocab = weight.shape[0]
        self.shared: Dict[str, torch.Tensor] = {  # one extra output row: where finished filler rows of a bucket write
            "col": torch.zeros(1, dtype=torch.long, device=device),
            "n_filled": torch.ones(1, dtype=torch.long, device=device),  # col + 1: the columns attention reads
            "t": torch.zeros(1, dtype=torch.long, device=device),
            "out_tokens": torch.zeros(rows + 1, length, dtype=torch.long, device=device),
            "out_mask": torch.zeros(rows + 1, length, dtype=torch.bool, device=device),
            "out_logp": torch.zeros(rows + 1, length, dtype=torch.float32, device=device),
            "is_stop": torch.zeros(vocab, dtype=torch.bool, device=device),
            "token_hash": token_hashes(vocab, device),
        }
        self.caches = new_caches(attns, rows, length, dtype, device)
        self.buckets: Dict[int, Dict[str, torch.Tensor]] = {}
        self.columns = torch.arange(length, device=device)
        self.weight = None if isinstance(weight, nn.Parameter) else torch.empty_like(weight)
        self.segments: Optional[Tuple[int, int, int]] = None
        self.fused = None
        # fixed addresses: CUDA graphs read these in place instead of copying them every replay
        static = list(self.shared.values()) + [self.columns]
        static += [t for c in self.caches for t in (c.k_cache, c.v_cache, c.cache_pos)]
        static.append(weight if self.weight is None else self.weight)
        for t in static:
            torch._dynamo.mark_static_address(t)

    @staticmethod
    def key_of(attns: Sequence[nn.Module], rows: int, length: int, dtype: torch.dtype, device: torch.device,
               weight: torch.Tensor) -> tuple:
        """What buffers made from these arguments serve: equal keys, the same buffers."""
        return rows, length, dtype, device, len(attns), tuple(weight.shape), weight.dtype

    @property
    def length(self) -> int:
        """Cache columns."""
        return self.key[1]

    def bucket(self, size: int, views: bool) -> Dict[str, torch.Tensor]:
        """The step inputs of a batch bucket of ``size`` rows (the first ``size`` rows of the caches;
        ``views``: with the bucket's views of the caches, which the grouped decode step writes)."""
        bucket = self.buckets.get(size)
        if bucket is not None:
            return bucket
        device = self.shared["col"].device
        bucket = {
            "tokens": torch.zeros(size, 1, dtype=torch.long, device=device),
            "input_pos": torch.zeros(size, 1, dtype=torch.long, device=device),
            "key_valid": torch.ones(size, self.length, dtype=torch.bool, device=device),
            "keys": torch.zeros(size, dtype=torch.long, device=device),
            "done": torch.ones(size, dtype=torch.bool, device=device),
            "slots": torch.zeros(size, dtype=torch.long, device=device),
        }
        tensors = list(bucket.values())
        if views:
            bucket["caches"] = [(c.k_cache[:size], c.v_cache[:size]) for c in self.caches]
            tensors += [t for pair in bucket["caches"] for t in pair]
        for t in tensors:
            torch._dynamo.mark_static_address(t)
            if self.dynamic_rows:  # "maybe": dynamo may keep a size it has to specialise (one row)
                torch._dynamo.maybe_mark_dynamic(t, 0)
        self.buckets[size] = bucket
        return bucket

    def compact(self, bucket: Dict[str, torch.Tensor], size: int, pad_id: int) -> Dict[str, torch.Tensor]:
        """Moves the live rows of ``bucket`` (caches, step inputs, keys, output slots) to the first
        rows of the ``size``-row bucket; its other rows are finished fillers writing to the spare
        output row. Returns the new bucket."""
        live = (~bucket["done"]).nonzero().squeeze(1)
        n = live.numel()
        new = self.bucket(size, views=True)
        for cache in self.caches:
            cache.k_cache[:n] = cache.k_cache.index_select(0, live)
            cache.v_cache[:n] = cache.v_cache.index_select(0, live)
        for name in ("tokens", "input_pos", "key_valid", "keys", "slots"):
            new[name][:n] = bucket[name].index_select(0, live)
        new["done"][:n] = False
        new["done"][n:] = True
        new["slots"][n:] = self.shared["out_tokens"].shape[0] - 1
        new["tokens"][n:] = pad_id
        new["input_pos"][n:] = 0
        new["key_valid"][n:] = True
        if self.segments is not None:
            self._set_segments(new["slots"][:n], n)
        return new

    def share_prompt(self, heads_per_kv: int, rows: int, groups: int, width: int) -> int:
        """Sets up the shared-prompt segment table of a call (every group's rows, cut into segments
        of at most :func:`~logitless.generation.kernels.decode_attention.prefix_rows` rows) in
        :attr:`shared`'s static buffers; returns the rows per segment."""
        from logitless.generation.kernels.decode_attention.plan import prefix_rows

        per = prefix_rows(heads_per_kv, groups)
        shared = self.shared
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
        self.segments = (groups, per, count)
        self._set_segments(torch.arange(rows, device=device), rows)
        return per

    def _set_segments(self, slots: torch.Tensor, live: int) -> None:
        """Fills the segment table for a bucket whose first ``live`` rows hold the original rows
        ``slots`` (ascending, so each group's rows stay consecutive); later rows are in none."""
        from logitless.generation.kernels.decode_attention.plan import group_segments

        groups, per, count = self.segments
        num_groups = count // -(-groups // per)
        start, rows = group_segments(slots, groups, per, num_groups)
        self.shared["seg_start"].copy_(start)
        self.shared["seg_rows"].copy_(rows)
        self.shared["covered"].fill_(live)
