"""Values at masked positions never reach the loss arithmetic.

Old / reference / sampler log-probs (and per-token advantages, and the high-entropy token mask) at
positions outside the loss mask -- prompt and padding positions, completions dropped by
``mask_truncated_completions`` -- hold whatever the caller's buffers hold there: -inf from a masked
log-softmax, -1e4 from a fill value, NaN. The loss, both gradients and the metrics must equal those
of the same call with finite values there, for every loss_type and option.
"""

import math

import pytest
import torch

from logitless.losses.grpo import GRPOLoss
from logitless.modules import HeadInput

IGN = -100
T = 0.7
FILLS = [float("-inf"), -1e4, float("nan"), float("inf")]


def _inputs(seed=0, b=4, s=7, h=8, v=13):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, v, (b, s), generator=g)
    for i, n in enumerate([4, 5, 2, 3]):  # prompt positions (first 2) and padding ignored
        labels[i, :2] = IGN
        labels[i, 2 + n:] = IGN
    adv = torch.randn(b, s, generator=g, dtype=torch.float64)
    old = torch.randn(b, s, generator=g, dtype=torch.float64) * 0.3 - 2.0
    ref = torch.randn(b, s, generator=g, dtype=torch.float64) * 0.3 - 2.0
    sampler = old + torch.randn(b, s, generator=g, dtype=torch.float64) * 0.2
    truncated = torch.tensor([False, True, False, False])
    return hidden, weight, labels, adv, old, ref, sampler, truncated


def _call(fn, hidden, weight, labels, adv, old, ref, sampler, truncated, dtype, entropy_mask=None):
    h = hidden.to(dtype).requires_grad_()
    w = weight.to(dtype).requires_grad_()
    loss, metrics = fn(HeadInput(h, w), labels, adv, old_log_probs=old, ref_log_probs=ref, sampler_log_probs=sampler,
                       entropy_mask=entropy_mask, truncated=truncated)
    loss.backward()
    return loss.detach(), h.grad, w.grad, metrics


#: Options beyond the loss_type (the sampler correction, in its default mode when not named, is on
#: in every case).
OPTIONS = {
    "k3": dict(),
    "delta_k1_sequence_mask": dict(delta=1.5, kl_estimator="k1", sampler_correction_clip_min=0.5),
    "k2_bias_token_mask": dict(kl_estimator="k2", use_bias_correction_kl=True, sampler_correction_mode="token_mask"),
    "low_var_token_truncate": dict(kl_estimator="low_var_kl", sampler_correction_mode="token_truncate"),
    "sequence_truncate_topent": dict(sampler_correction_mode="sequence_truncate", top_entropy_quantile=0.5),
}
#: (loss_type, fused, importance_sampling_level, options): every loss_type fused and unfused, every
#: option on some of them.
CASES = [(lt, False, "token", "k3") for lt in ("grpo", "bnpo", "dr_grpo", "dapo")] + \
        [(lt, True, "token", "k3") for lt in ("grpo", "bnpo", "dr_grpo", "dapo")] + \
        [("grpo", False, "sequence", "k3"), ("dapo", False, "sequence", "sequence_truncate_topent"),
         ("dapo", True, "token", "delta_k1_sequence_mask"), ("bnpo", False, "token", "delta_k1_sequence_mask"),
         ("cispo", True, "token", "k2_bias_token_mask"), ("cispo", False, "token", "low_var_token_truncate"),
         ("sapo", True, "token", "sequence_truncate_topent"), ("sapo", False, "sequence", "k2_bias_token_mask"),
         ("dr_grpo", True, "token", "low_var_token_truncate")]


@pytest.mark.parametrize("loss_type,fused,level,options", CASES)
@pytest.mark.parametrize("impl", ["reference", "chunked"])
@pytest.mark.parametrize("fill", FILLS, ids=["-inf", "-1e4", "nan", "inf"])
def test_masked_old_ref_sampler_and_advantages_do_not_matter(loss_type, fused, level, options, impl, fill):
    kwargs = dict(OPTIONS[options], epsilon_high=1.28 if loss_type == "cispo" else 0.28)
    hidden, weight, labels, adv, old, ref, sampler, truncated = _inputs()
    fn = GRPOLoss(temperature=T, impl=impl, loss_type=loss_type, fused=fused, beta=0.1, entropy_coef=0.01,
                  importance_sampling_level=level, max_completion_length=6, mask_truncated_completions=True,
                  **kwargs)
    mask = fn.loss_mask(labels, truncated)
    assert (~mask).any() and (mask & truncated[:, None]).sum() == 0 and (labels[1] != IGN).any()
    dirty = [torch.where(mask, t, torch.full_like(t, fill)) for t in (adv, old, ref, sampler)]
    dtype = torch.float64 if impl == "reference" else torch.float32
    entropy_mask = dirty_entropy_mask = None
    if fn.top_entropy_quantile < 1:
        with torch.no_grad():
            _, ent = fn.log_probs_and_entropy(HeadInput(hidden.to(dtype), weight.to(dtype)), labels)
        entropy_mask = fn.high_entropy_mask(ent, mask)
        dirty_entropy_mask = entropy_mask | ~mask  # True outside the loss mask: still no policy term there
    want = _call(fn, hidden, weight, labels, adv, old, ref, sampler, truncated, dtype, entropy_mask)
    got = _call(fn, hidden, weight, labels, *dirty, truncated, dtype, dirty_entropy_mask)
    assert math.isfinite(float(want[0])) and abs(float(want[0])) > 1e-4
    assert torch.equal(got[0], want[0]), (float(got[0]), float(want[0]))
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    for k in want[3]:
        assert torch.equal(got[3][k], want[3][k]), k


@pytest.mark.parametrize("fused", [False, True])
def test_sequence_advantage_of_a_fully_masked_completion_does_not_matter(fused):
    """A (B,) advantage of a completion with no loss token (dropped as truncated) may be NaN."""
    hidden, weight, labels, adv, old, ref, sampler, truncated = _inputs(1)
    fn = GRPOLoss(temperature=T, impl="chunked", fused=fused, mask_truncated_completions=True)
    seq_adv = adv[:, 0].clone()
    want = _call(fn, hidden, weight, labels, seq_adv, old, ref, sampler, truncated, torch.float32)
    seq_adv[1] = float("nan")  # completion 1 is truncated: no token of it is in the loss
    got = _call(fn, hidden, weight, labels, seq_adv, old, ref, sampler, truncated, torch.float32)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)


def test_non_finite_values_inside_the_mask_are_still_an_error():
    hidden, weight, labels, adv, old, ref, sampler, truncated = _inputs(2)
    fn = GRPOLoss(temperature=T, impl="reference")
    bad = adv.clone()
    bad[0, 3] = float("nan")  # row 0, position 3: a completion token
    with pytest.raises(ValueError, match=r"advantages.*NaN or inf.*1 position"):
        fn(HeadInput(hidden, weight), labels, bad)
