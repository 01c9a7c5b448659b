"""Loss components against torchtune's own loss and the float64 reference."""

import pytest
import torch
import torch.nn.functional as F
from torchtune.modules.loss import CEWithChunkedOutputLoss as TorchtuneChunkedCE

from logitless.losses import (
    CEWithChunkedOutputLoss,
    EntropyWithChunkedOutputLoss,
    LinearCrossEntropyLoss,
    LossOutput,
    LossUnits,
    StepLoss,
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


def _micro_batches(hidden, weight, labels, use_hidden):
    """Two micro-batches of one row each (different token counts), as the model would return them."""
    out = []
    for r in (slice(0, 1), slice(1, 2)):
        h = hidden[r]
        outputs = HeadInput(h, weight) if use_hidden else [F.linear(c, weight) for c in h.chunk(4, dim=1)]
        out.append((outputs, labels[r]))
    return out


@pytest.mark.parametrize("make, use_hidden", [
    (lambda: CEWithChunkedOutputLoss(num_output_chunks=4, chunk_size=5), True),
    (lambda: CEWithChunkedOutputLoss(num_output_chunks=4), False),
    (lambda: CEWithChunkedOutputLoss(num_output_chunks=4, reduction="sum"), False),
    (lambda: LinearCrossEntropyLoss(impl="chunked", chunk_size=5, reduction="sum"), True),
    (lambda: EntropyWithChunkedOutputLoss(num_output_chunks=4, temperature=0.8), True),
    (lambda: EntropyWithChunkedOutputLoss(num_output_chunks=4, temperature=0.8), False),
], ids=["chunked_ce_hidden", "chunked_ce_logits", "chunked_ce_sum_logits", "linear_ce_sum", "entropy_hidden",
        "entropy_logits"])
def test_loss_contract_shares_add_up_to_the_mean_over_every_token(make, use_hidden):
    """The engine's contract: counts from the labels, then each micro-batch's share normalised by the
    step's total; the shares (and their gradients) add up to the float64 mean over every token of
    the step, whatever the loss's public ``reduction``."""
    loss_fn = make()
    hidden, weight, labels = _head(seed=7)
    labels[0, : S // 2] = -100  # the two rows carry very different token counts
    if isinstance(loss_fn, EntropyWithChunkedOutputLoss):
        _, ent = reference.log_probs(hidden, weight, labels, temperature=0.8)
        want = ent.sum() / (labels != -100).sum()
    else:
        want = reference.cross_entropy(hidden, weight, labels, reduction="mean")
    (want_dh,) = torch.autograd.grad(want, hidden)
    mbs = _micro_batches(hidden, weight, labels, use_hidden)
    units = [loss_fn.loss_units(lab) for _, lab in mbs]
    total = LossUnits.total(units)
    assert total == LossUnits(tokens=int((labels != -100).sum()), sequences=B, micro_batches=2)
    shares = [loss_fn.normalised_loss(out, lab, total) for out, lab in mbs]
    assert all(isinstance(s, LossOutput) and s.metrics == {} for s in shares)
    got = sum(s.loss for s in shares)
    (got_dh,) = torch.autograd.grad(got, hidden)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(got_dh.double(), want_dh, rtol=1e-5, atol=1e-8)


def test_step_losses_follow_the_contract_and_log_probs_do_not():
    for loss_fn in (CEWithChunkedOutputLoss(), LinearCrossEntropyLoss(), EntropyWithChunkedOutputLoss()):
        assert isinstance(loss_fn, StepLoss)
    assert not isinstance(TokenLogProbs(), StepLoss)  # per-token values, not a loss

    class Incomplete(StepLoss):
        def loss_units(self, labels, **inputs):
            return LossUnits()

    with pytest.raises(TypeError, match="normalised_loss"):
        Incomplete()
    with pytest.raises(TypeError, match="unexpected inputs"):
        CEWithChunkedOutputLoss().loss_units(torch.zeros(1, 2, dtype=torch.long), truncated=None)
