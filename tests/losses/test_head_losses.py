"""Loss components against torchtune's own loss and the float64 reference."""

import pytest
import torch
import torch.nn.functional as F
from torchtune.modules.loss import CEWithChunkedOutputLoss as TorchtuneChunkedCE

from logitless.losses import (
    CEWithChunkedOutputLoss,
    EntropyWithChunkedOutputLoss,
    LinearCrossEntropyLoss,
    TokenLogProbs,
)
from logitless.modules import HeadInput
from logitless.ops import reference

B, S, H, V = 2, 16, 8, 53


def _head(seed=0, ignore_frac=0.3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[torch.rand(B, S, generator=g) < ignore_frac] = -100
    return hidden, weight, labels


def test_logit_list_matches_torchtune():
    hidden, weight, labels = _head()
    chunks = [F.linear(c, weight) for c in hidden.chunk(4, dim=1)]
    want = TorchtuneChunkedCE(num_output_chunks=4)(chunks, labels)
    got = CEWithChunkedOutputLoss(num_output_chunks=4)(chunks, labels)
    torch.testing.assert_close(got, want.float().to(got.dtype))


def test_all_ignored_is_zero_where_torchtune_is_nan():
    hidden, weight, labels = _head(ignore_frac=1.1)
    chunks = [F.linear(c, weight) for c in hidden.chunk(4, dim=1)]
    assert torch.isnan(TorchtuneChunkedCE(num_output_chunks=4)(chunks, labels))
    for outputs in (chunks, HeadInput(hidden, weight)):
        loss = CEWithChunkedOutputLoss(num_output_chunks=4)(outputs, labels)
        loss.backward()
        assert loss.item() == 0.0
        assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0
        hidden.grad = weight.grad = None


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_hidden_path_matches_reference(reduction):
    hidden, weight, labels = _head(seed=3)
    want = reference.cross_entropy(hidden, weight, labels, reduction=reduction)
    for loss_fn in (
        CEWithChunkedOutputLoss(reduction=reduction, chunk_size=5),
        LinearCrossEntropyLoss(impl="chunked", reduction=reduction, chunk_size=5),
    ):
        got = loss_fn(HeadInput(hidden, weight), labels)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("use_hidden", [True, False])
def test_entropy_loss_matches_reference_with_gradients(use_hidden):
    hidden, weight, labels = _head(seed=4)
    _, ent = reference.log_probs(hidden, weight, labels, temperature=0.8)
    want = ent.sum() / (labels != -100).sum()
    (want_dh,) = torch.autograd.grad(want, hidden)
    loss_fn = EntropyWithChunkedOutputLoss(num_output_chunks=4, temperature=0.8, chunk_size=6)
    outputs = HeadInput(hidden, weight) if use_hidden else [F.linear(c, weight) for c in hidden.chunk(4, dim=1)]
    got = loss_fn(outputs, labels)
    (got_dh,) = torch.autograd.grad(got, hidden)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(got_dh.double(), want_dh, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("use_hidden", [True, False])
def test_token_log_probs_match_reference(use_hidden):
    hidden, weight, labels = _head(seed=5)
    want_lp, want_ent = reference.log_probs(hidden, weight, labels, temperature=0.6)
    fn = TokenLogProbs(temperature=0.6, impl="chunked", chunk_size=7)
    outputs = HeadInput(hidden, weight) if use_hidden else [F.linear(c, weight) for c in hidden.chunk(4, dim=1)]
    logp, ent = fn(outputs, labels)
    assert logp.shape == labels.shape and ent.shape == labels.shape
    torch.testing.assert_close(logp.double(), want_lp, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ent.double(), want_ent, rtol=1e-6, atol=1e-7)


def test_constructor_errors():
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        CEWithChunkedOutputLoss(reduction="none")
    with pytest.raises(ValueError, match="impl must be one of"):
        LinearCrossEntropyLoss(impl="fast")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        TokenLogProbs(temperature=0)
