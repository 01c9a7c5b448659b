"""One decode step of a multi-turn rollout: every row on its own schedule, one token per step.

The rows of a tool rollout drift apart: one is sampling its second turn while another waits for its
tool and a third is still reading a tool's answer. The state here (:func:`new_turn_state`) lets one
fixed-shape step serve all of them, so a turn costs what a token of a single-turn rollout costs and
the step can be compiled and captured in a CUDA graph like the single-turn sampler's:

- **Own columns.** Row ``b`` writes its next key/value at its own cache column ``fill[b]``: its
  prompt (left-padded to the batch's width) and then its tokens, contiguous whatever the other rows
  do. A row with nothing to do this step (waiting for its tool, or finished) writes at the
  ``scratch`` column, the last one, which no key mask ever shows. ``key_valid`` is exact: a column
  is valid once written for its row.
- **Appended tokens go through the same step.** A tool answer (the template's tokens for the
  environment's messages and the next assistant header) is written into the row's output first,
  ``length[b] .. forced_end[b] - 1``; each step then feeds the row's previous token and, while the
  row is inside that span, takes the written token as the row's next one instead of sampling. An
  answer of ``k`` tokens costs the row ``k`` steps in which the other rows go on decoding: in a
  memory-bound decode step one more token per row is almost free, and no forward of another shape
  (a prefill of the segment) exists to compile. A long answer is the exception: :func:`prefill_segment`
  writes it in one forward of its row alone.
- **Finished rows hidden.** :func:`retire_rows` hides a finished row's columns, so the attention of
  the steps that remain reads almost nothing for it.
- **Draws keyed by position.** Token ``t`` of row ``b`` is drawn from the counter-based stream of
  ``(key[b], t)`` (:func:`~logitless.generation.sampling.sample_counter`), as the compiled
  single-turn sampler draws it: what a row samples depends on its key and its own tokens, not on
  which step it reaches position ``t`` at. A tool that answers later shifts the row in time, not
  its tokens: bit for bit on a CPU, and on a GPU through :func:`grouped_turn_step`, whose split-K
  attention takes a split length fixed by the cache's shape (a split chosen from the fill follows the
  batch's longest row and moved the last bits of logits: 45% of rows differed between instant and
  50 ms tools on an H100, 0% with the fixed split).

:func:`advance` (the draw and the bookkeeping) is shared by the eager step (:func:`eager_turn_step`,
the reference: torchtune's layers) and the compiled one (:func:`grouped_turn_step`: the compiled
single-turn sampler's grouped-attention layers with per-row write columns). The host loop that drives
the turns is :mod:`logitless.generation.tools.turn_loop`.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from logitless.generation.decode_step import _layer_step, kernel_draw
from logitless.generation.sampling import sample_counter, token_hashes
from logitless.generation.trunk import decoder_hidden, last_position_logits

__all__ = ["TurnState", "advance", "eager_turn_step", "grouped_turn_step", "new_turn_state", "prefill_segment",
           "retire_rows", "write_columns"]

#: The buffers of one rollout's rows (:func:`new_turn_state`), by name.
TurnState = Dict[str, torch.Tensor]

#: ``(temperature, top_k, top_p, pad_id)`` of a rollout.
Draw = Tuple[float, Optional[int], Optional[float], int]


def new_turn_state(prompt_mask: torch.Tensor, keys: torch.Tensor, *, budget: int, columns: int, vocab: int,
                   stop_tokens: Sequence[int], pad_id: int) -> TurnState:
    """The per-row buffers of a multi-turn rollout, every row active at completion position 0, as a
    step leaves them after the prompt's last token: :func:`advance` on the prefill's logits comes next.

    Args:
        prompt_mask (torch.Tensor): ``(N, W)`` bool, the left-padded prompts' real columns.
        keys (torch.Tensor): ``(N,)`` int64 counter-stream keys
            (:func:`~logitless.generation.sampling.row_keys`).
        budget (int): completion tokens per row (sampled and appended).
        columns (int): cache columns, at least ``W + budget + 1`` (the last one is the scratch column).
        vocab (int): V (the stop-token table and the token hashes).
        stop_tokens (Sequence[int]): ids whose draw ends a turn (ids outside the vocabulary never come).
        pad_id (int): filler of the outputs.

    Returns:
        TurnState: ``tokens`` ``(N, 1)`` (each row's next input), ``input_pos`` ``(N, 1)``, ``fill``
        ``(N,)`` (its next column), ``key_valid`` ``(N, columns)``, ``n_filled`` ``(1,)`` (columns a
        split-K attention reads), ``keys``, ``active`` / ``stopped`` / ``cut`` ``(N,)`` bool,
        ``length`` ``(N,)`` (completion tokens so far), ``forced_end`` ``(N,)`` (appended tokens end
        there), the outputs ``out_tokens`` / ``out_mask`` / ``out_sampled`` / ``out_logp`` ``(N + 1,
        budget + 1)`` (a spare row and column where idle rows write), ``is_stop`` and ``token_hash``
        ``(V,)``, and the scalars ``width``, ``budget`` and ``scratch`` as ``(1,)`` tensors.

    Raises:
        ValueError: ``columns`` too small.
    """
    n, width = prompt_mask.shape
    if columns < width + budget + 1:
        raise ValueError(f"columns: {columns} cache columns cannot hold a {width}-column prompt, {budget} "
                         f"completion tokens and the scratch column")
    device = prompt_mask.device
    key_valid = torch.zeros(n, columns, dtype=torch.bool, device=device)
    key_valid[:, :width] = prompt_mask
    is_stop = torch.zeros(vocab, dtype=torch.bool, device=device)
    ids = torch.as_tensor([s for s in stop_tokens if 0 <= s < vocab], dtype=torch.long, device=device)
    is_stop[ids] = True

    def rows(dtype, value=0):
        return torch.full((n,), value, dtype=dtype, device=device)

    def out(dtype, value=0):
        return torch.full((n + 1, budget + 1), value, dtype=dtype, device=device)

    return {
        "tokens": torch.full((n, 1), pad_id, dtype=torch.long, device=device),
        # as a step leaves them after feeding the prompt's last token: advance() on the prefill's logits
        # takes token 0 and moves every row to column ``width``, position ``prompt length``
        "input_pos": prompt_mask.sum(1, keepdim=True).long() - 1,
        "fill": rows(torch.long, width - 1),
        "key_valid": key_valid,
        "n_filled": torch.full((1,), width, dtype=torch.long, device=device),
        "keys": keys.to(device=device, dtype=torch.long).clone(),
        "active": rows(torch.bool, True),
        "stopped": rows(torch.bool, False),
        "cut": rows(torch.bool, False),
        "length": rows(torch.long),
        "forced_end": rows(torch.long),
        "out_tokens": out(torch.long, pad_id),
        "out_mask": out(torch.bool, False),
        "out_sampled": out(torch.bool, False),
        "out_logp": out(torch.float32),
        "is_stop": is_stop,
        "token_hash": token_hashes(vocab, device),
        "width": torch.full((1,), width, dtype=torch.long, device=device),
        "budget": torch.full((1,), budget, dtype=torch.long, device=device),
        "scratch": torch.full((1,), columns - 1, dtype=torch.long, device=device),
    }


def write_columns(state: TurnState) -> torch.Tensor:
    """Where each row writes this step (its ``fill`` column when active, else the scratch column),
    marking the written columns valid for their rows (the scratch column stays hidden). Returns
    ``(N,)`` column indices."""
    active = state["active"]
    col = torch.where(active, state["fill"], state["scratch"])
    rows = torch.arange(col.shape[0], device=col.device)
    state["key_valid"].index_put_((rows, col), active)
    # the split-K attention reads the first n_filled columns: every row's written ones
    state["n_filled"].copy_(state["fill"].max().reshape(1) + 1)
    return col


def retire_rows(state: TurnState, rows: Sequence[int]) -> None:
    """Hides every cache column of finished rows but their prompt's last one (always a real token),
    so the split-K attention reads almost nothing for them (it loads only valid keys and values) in
    the steps that remain: a finished row costs its share of the step's GEMMs, which read the weights
    once for all rows, and little else. Its outputs are not touched."""
    if not rows:
        return
    index = torch.as_tensor(list(rows), device=state["key_valid"].device)
    state["key_valid"].index_fill_(0, index, False)
    state["key_valid"][index, state["width"] - 1] = True


def advance(state: TurnState, logits: torch.Tensor, draw: Draw) -> None:
    """Takes each active row's next token (drawn, or the next appended one), writes it to the outputs
    and moves the row on; a drawn stop token pauses the row (``stopped``), as does the budget running
    out (``cut``). In place, no host sync: it runs inside a captured graph.

    Args:
        state (TurnState): the rows (:func:`new_turn_state`).
        logits (torch.Tensor): ``(N, V)`` next-token scores of every row (idle rows' are ignored).
        draw (Draw): ``(temperature, top_k, top_p, pad_id)``.
    """
    temperature, top_k, top_p, _ = draw
    active, pos = state["active"], state["length"]
    if kernel_draw(logits, top_k, top_p):  # the op is registered by the sampler (register_counter_draw)
        nxt, logp = torch.ops.logitless.counter_draw(logits, state["keys"], pos, float(temperature))
    else:
        nxt, logp = sample_counter(logits, state["keys"], pos, temperature=temperature, top_k=top_k, top_p=top_p,
                                   token_hash=state["token_hash"])
    n = active.shape[0]
    rows = torch.arange(n, device=active.device)
    forced = pos < state["forced_end"]
    out_tokens = state["out_tokens"]
    token = torch.where(forced, out_tokens[rows, pos], nxt)
    at = (torch.where(active, rows, n), pos)  # idle rows write to the spare row
    out_tokens.index_put_(at, token)
    drawn = active & ~forced
    state["out_mask"].index_put_(at, active)
    state["out_sampled"].index_put_(at, drawn)
    state["out_logp"].index_put_(at, torch.where(drawn, logp, torch.zeros_like(logp)))
    step = active.long()
    pos.add_(step)
    state["fill"].add_(step)
    state["input_pos"].add_(step[:, None])
    state["tokens"].copy_(torch.where(active, token, state["tokens"][:, 0])[:, None])
    stop = drawn & state["is_stop"][token]
    cut = active & ~stop & (pos >= state["budget"])
    state["stopped"].copy_(state["stopped"] | stop)
    state["cut"].copy_(state["cut"] | cut)
    active.copy_(active & ~(stop | cut))


# ----------------------------------------------------------------------------------------- eager step
class _RowColumnsCache(nn.Module):
    """Stands in for a layer's torchtune ``KVCache`` during one forward: ``update`` writes query ``j``
    of row ``b`` at column ``columns[b, j]`` of ``k_cache`` / ``v_cache`` and returns them whole (the
    mask selects)."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, columns: torch.Tensor) -> None:
        super().__init__()
        self.k_cache, self.v_cache, self.columns = k_cache, v_cache, columns

    def update(self, k_val: torch.Tensor, v_val: torch.Tensor):
        rows = torch.arange(k_val.shape[0], device=k_val.device)[:, None]
        # advanced indices around a slice put their dims first: (B, S, heads, dim)
        self.k_cache[rows, :, self.columns] = k_val.transpose(1, 2).to(self.k_cache.dtype)
        self.v_cache[rows, :, self.columns] = v_val.transpose(1, 2).to(self.v_cache.dtype)
        return self.k_cache, self.v_cache


@contextlib.contextmanager
def _write_at(attns: List[nn.Module], caches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
              columns: torch.Tensor) -> Iterator[None]:
    """Each attention module writes into and reads from ``caches`` (its ``(k, v)``) at ``columns``."""
    kept = [(attn.kv_cache, attn.cache_enabled) for attn in attns]
    try:
        for attn, (k, v) in zip(attns, caches):
            attn.kv_cache, attn.cache_enabled = _RowColumnsCache(k, v, columns), True
        yield
    finally:
        for attn, (cache, enabled) in zip(attns, kept):
            attn.kv_cache, attn.cache_enabled = cache, enabled


def prefill_segment(model: nn.Module, attns: List[nn.Module], caches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                    state: TurnState, row: int, ids: Sequence[int]) -> None:
    """Appends a long continuation to one row in one forward of that row alone, instead of feeding
    it one token per step: the row's pending token (its turn's stop token) and ``ids[:-1]`` are
    written at its next columns, ``ids`` go into its outputs as context, and the row is left as
    ``len(ids)`` forced steps would leave it (``ids[-1]`` its next input, active). The forward has the
    same shape whenever it runs (one row, ``len(ids)`` tokens), so where the other rows are does not
    change its result.

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder``.
        attns (List[nn.Module]): its attention modules.
        caches (Sequence[Tuple[torch.Tensor, torch.Tensor]]): each layer's ``(k, v)`` cache of every row.
        state (TurnState): the rows (the row paused after its turn).
        row (int): the row.
        ids (Sequence[int]): the continuation (at least 2 tokens).
    """
    device = state["fill"].device
    k = len(ids)
    fill, pos, length = (int(state[name][row]) for name in ("fill", "input_pos", "length"))
    tokens = torch.cat([state["tokens"][row], torch.as_tensor(list(ids[:-1]), dtype=torch.long, device=device)])
    columns = fill + torch.arange(k, device=device)
    valid = state["key_valid"][row].clone()
    valid[fill:fill + k] = True
    keys = torch.arange(valid.shape[0], device=device)
    mask = valid[None, :] & (keys[None, :] <= columns[:, None])  # (k, columns): causal within the segment
    one_row = [(kc[row:row + 1], vc[row:row + 1]) for kc, vc in caches]
    with _write_at(attns, one_row, columns[None]):
        decoder_hidden(model, tokens[None], input_pos=(pos + torch.arange(k, device=device))[None], mask=mask[None])
    state["key_valid"][row, fill:fill + k] = True
    state["out_tokens"][row, length:length + k] = torch.as_tensor(list(ids), dtype=torch.long, device=device)
    state["out_mask"][row, length:length + k] = True
    state["fill"][row] += k
    state["input_pos"][row] += k
    state["length"][row] += k
    state["forced_end"][row] = length + k
    state["tokens"][row] = ids[-1]
    state["active"][row] = True


def eager_turn_step(model: nn.Module, attns: List[nn.Module], caches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                    state: TurnState, weight: torch.Tensor, draw: Draw) -> None:
    """One step through torchtune's own layers (the reference): each row's token written at its
    column (:func:`write_columns`), attending to its valid columns; then :func:`advance`.

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder``.
        attns (List[nn.Module]): its attention modules.
        caches (Sequence[Tuple[torch.Tensor, torch.Tensor]]): each layer's ``(k, v)`` cache,
            ``[N, kv_heads, columns, head_dim]``.
        state (TurnState): the rows.
        weight (torch.Tensor): the head weight.
        draw (Draw): ``(temperature, top_k, top_p, pad_id)``.
    """
    col = write_columns(state)
    with _write_at(attns, caches, col[:, None]):
        h = decoder_hidden(model, state["tokens"], input_pos=state["input_pos"], mask=state["key_valid"][:, None, :])
    advance(state, F.linear(model.norm(h[:, -1]), weight).float(), draw)


# -------------------------------------------------------------------------------------- compiled step
def grouped_turn_step(model: nn.Module, state: TurnState, caches: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                      weight: torch.Tensor, draw: Draw, fused: Optional[List[Dict]] = None, split_k: bool = False,
                      programmatic_launch: bool = False, split_len: int = 0) -> None:
    """One step through the compiled sampler's grouped-attention layers (what ``torch.compile``
    traces): each row's key/value written at its own column, attention under the exact key mask (or
    the split-K kernel over the first ``n_filled`` columns), the head on the last position, then
    :func:`advance`. Every input lives in ``state`` and ``caches``, updated in place.

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` whose layers are all
            :func:`~logitless.generation.decode_step.groupable`.
        state (TurnState): the rows.
        caches (Sequence[Tuple[torch.Tensor, torch.Tensor]]): each layer's ``(k, v)`` cache,
            ``[N, kv_heads, columns, head_dim]``.
        weight (torch.Tensor): the head weight.
        draw (Draw): ``(temperature, top_k, top_p, pad_id)``.
        fused (Optional[List[Dict]]): each layer's concatenated projections
            (:class:`~logitless.generation.fused.FusedProjections`), or None.
        split_k (bool): attend through the split-K kernel.
        programmatic_launch (bool): its launches are programmatic dependent launches.
        split_len (int): the split-K kernel's columns per split (0: its choice from the fill, which
            follows the batch's longest row and can move a row's logits in their last bits).
    """
    col = write_columns(state)
    key_valid, input_pos = state["key_valid"], state["input_pos"]
    mask = key_valid[:, None, :]
    # a split length fixed by the cache's shape, not chosen from the fill: the fill follows the batch's
    # longest row, and a row's attention must not change with where the other rows are
    filled = (key_valid, state["n_filled"], programmatic_launch, None, {}, split_len) if split_k else None

    def run_layer(index, layer, h):
        return _layer_step(layer, h, input_pos, mask, True, caches[index], col, None,
                           fused[index] if fused else None, filled, per_row_columns=True)

    logits = last_position_logits(model, state["tokens"], input_pos=input_pos, mask=mask, weight=weight,
                                  run_layer=run_layer, upcast=False)
    advance(state, logits, draw)
