"""What autograd keeps between forward and backward: O(N*H + V*H) for us, O(N*V) for torchtune."""

import torch
import torch.nn.functional as F
from torchtune.modules.loss import CEWithChunkedOutputLoss as TorchtuneChunkedCE

import logitless

N, H, V = 256, 16, 4096


def _saved_bytes(fn):
    """Bytes of distinct storages packed by autograd while ``fn`` builds its graph."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, labels


def test_chunked_keeps_no_logits_for_backward():
    hidden, weight, labels = _inputs()
    bound = 2 * (N * H + V * H) * 4 + 64 * N  # hidden, weight, fp32 dh/dW, O(N) rows
    logits_bytes = N * V * 4
    for fn in (
        lambda: logitless.linear_cross_entropy(hidden, weight, labels, impl="chunked", chunk_size=32),
        lambda: logitless.linear_cross_entropy(hidden, weight, labels, reduction="none", impl="chunked", chunk_size=32),
        lambda: logitless.linear_log_probs(hidden, weight, labels, impl="chunked", chunk_size=32),
    ):
        saved, out = _saved_bytes(fn)
        assert saved <= bound < logits_bytes, (saved, bound, logits_bytes)
        out = out if isinstance(out, tuple) else (out,)
        sum(o.sum() for o in out).backward()  # the graph is complete


def test_torchtune_chunked_loss_keeps_every_logit_chunk():
    hidden, weight, labels = _inputs()

    def torchtune_path():
        chunks = [F.linear(c, weight) for c in hidden.unsqueeze(0).chunk(8, dim=1)]
        return TorchtuneChunkedCE(num_output_chunks=8)(chunks, labels.unsqueeze(0))

    saved, _ = _saved_bytes(torchtune_path)
    assert saved >= N * V * 4
