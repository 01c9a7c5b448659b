"""The fused head's workspace stays within its budget: the peak of the bytes it allocates beyond
its inputs, counted tensor by tensor as they are created and freed (CPU, Triton interpreter)."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from logitless.ops.triton import head


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the storages created inside the mode and alive at once (storages the given
    tensors already own are not counted; a storage counts while any tensor viewing it lives)."""

    def __init__(self, *known: torch.Tensor):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.live, self.total, self.peak = {}, 0, 0

    def _drop(self, ptr):
        nbytes, count = self.live[ptr]
        if count > 1:
            self.live[ptr] = (nbytes, count - 1)
        else:
            del self.live[ptr]
            self.total -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in self.known or ptr == 0:
                continue
            nbytes, count = self.live.get(ptr, (t.untyped_storage().nbytes(), 0))
            if count == 0:
                self.total += nbytes
                self.peak = max(self.peak, self.total)
            self.live[ptr] = (nbytes, count + 1)
            weakref.finalize(t, self._drop, ptr)
        return out


N, H, V, IGN = 96, 40, 203, -100
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * H ** -0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.randperm(N, generator=g)[: N // 10]] = IGN  # 10% ignored: the rows are compacted
    return hidden.to(DEV), weight.to(DEV), labels.to(DEV)


def test_forward_workspace_counts_the_gathered_rows(monkeypatch):
    # Blocks of 32 rows: the logits tile and the block's gathered hidden rows share the budget,
    # and only one block's rows are gathered at a time.
    budget = 32 * (96 + H) * 4
    monkeypatch.setattr(head, "FORWARD_WORKSPACE_BYTES", budget)
    monkeypatch.setattr(head, "MAX_BLOCK_ROWS", 32)
    monkeypatch.setattr(head, "MIN_SLAB", 16)
    hidden, weight, labels = _inputs()
    # the op's own code (a mode does not see inside the registered op's call)
    with torch.no_grad(), PeakBytes(hidden, weight, labels) as mode:
        logp, ent, _ = head.head_forward(hidden, weight, labels, IGN, 1.0)
    per_row = N * (4 + 4 + 8 + 12 + 4 + 8 + 1 + 8)  # outputs, state, label logit, indices, masks
    assert mode.peak <= budget + per_row + 1024, (mode.peak, budget, per_row)
    # and the values are those of float64
    hidden, weight, labels, logp, ent = (t.cpu() for t in (hidden, weight, labels, logp, ent))
    z = hidden.double() @ weight.double().T
    valid = labels != IGN
    ref = torch.log_softmax(z, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    torch.testing.assert_close(logp[valid].double(), ref[valid], rtol=0, atol=1e-5)
    assert torch.all(logp[~valid] == 0)
    p = torch.softmax(z, -1)
    torch.testing.assert_close(ent[valid].double(), -(p * p.log()).sum(-1)[valid], rtol=0, atol=1e-5)


@pytest.mark.parametrize("row_bytes", [0, 7168, 1 << 20])
def test_forward_tiles_keep_logits_and_rows_within_the_budget(row_bytes):
    for rows, vocab, itemsize, budget in [(8192, 152064, 2, 80 << 20), (29491, 128256, 2, 80 << 20),
                                          (100, 50, 4, 1 << 20), (7373, 151936, 4, 80 << 20)]:
        block, cols = head.forward_tiles(rows, vocab, itemsize, budget, row_bytes)
        assert 1 <= block <= rows and 1 <= cols <= vocab
        assert block * (cols * itemsize + row_bytes) <= budget or block == 1, (rows, vocab, block, cols)
    assert head.forward_tiles(8192, 152064, 2, 80 << 20, 3584 * 2) == (4096, 6656)


def test_pinned_one_pass_holds_one_chunk_of_pinned_dlogits(monkeypatch):
    # 29 chunks of 16 rows with the labels' columns pinned: the pass keeps the pinned columns' dW
    # rows as fp32 sums (k x H) and one chunk's pinned dlogits, not every row's until the end.
    n, hid, n_c = 512, 8, 16
    monkeypatch.setattr(head, "WORKSPACE_BYTES", n_c * V * 4)
    monkeypatch.setattr(head, "FUSED_MAX_CHUNKS", 2)
    monkeypatch.setattr(head, "PINNED_MAX_CHUNKS", 96)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, hid, generator=g)
    weight = torch.randn(V, hid, generator=g) * hid ** -0.5
    labels = torch.randint(0, V, (n,), generator=g)
    labels[torch.randperm(n, generator=g)[: n // 10]] = IGN
    hidden, weight, labels = hidden.to(DEV), weight.to(DEV), labels.to(DEV)
    rows = int((labels != IGN).sum())
    k = min(rows, V, head.PINNED_COLUMNS)
    assert head.one_pass_pins(rows, n_c, 0, V, need_dw=True, itemsize=4) == k  # the pinned one pass runs
    with torch.no_grad(), PeakBytes(hidden, weight, labels) as mode:
        loss, dh, dw = head.ce_fused(hidden, weight, labels, IGN, 1.0, True, True, True)
    grads = (n + V) * hid * 4
    bound = grads + head.WORKSPACE_BYTES + k * hid * 4 + n_c * (-(-k // 8) * 8) * 4 + 2 * n_c * hid * 4 + 64 * n + 4096
    assert mode.peak <= bound < grads + rows * k * 4, (mode.peak, bound)
    # the values are those of float64
    loss, dh, dw = loss.cpu(), dh.cpu(), dw.cpu()
    h64, w64 = hidden.cpu().double().requires_grad_(), weight.cpu().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h64 @ w64.T, labels.cpu(), ignore_index=IGN)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(dh.double(), h64.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(dw.double(), w64.grad, rtol=0, atol=1e-6)
