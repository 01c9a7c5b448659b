"""GRPOLoss's fused objective on the GPU with every term of current GRPO practice (skipped without CUDA).

On CUDA the fused head compiles the per-chunk objective (``torch.func.grad_and_value``) and replays
it from a CUDA graph kept across calls (``ops/triton/token_objective.py``); the CPU tests run it
eagerly. Here the sampler importance weights, ``delta``, the high-entropy mask, the KL estimators,
CISPO and SAPO go through that path at the 0.5B head: the objective must compile and be captured
(never fall back to the eager chunk rule), and the loss, dh and dW must match the unfused path and
a float64 reference of the same inputs.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

IGN = -100
T = 0.9
B, S, H, V = 16, 256, 896, 151936  # the 0.5B head, 4096 rows

CONFIGS = {
    "full": dict(loss_type="dapo", epsilon_high=0.28, delta=4.0, beta=0.04, entropy_coef=0.01,
                 top_entropy_quantile=0.2, sampler_correction_mode="token_truncate", use_bias_correction_kl=True),
    "sequence_mask": dict(loss_type="grpo", beta=0.04, kl_estimator="low_var_kl"),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0, beta=0.02, kl_estimator="k2"),
    "sapo": dict(loss_type="sapo", entropy_coef=0.01, kl_estimator="k1", beta=0.02),
}


def _inputs(seed=0):
    from logitless.ops import linear_log_probs

    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(B, S, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) * (2.0 / H**0.5)).bfloat16()
    labels = torch.randint(0, V, (B, S), device="cuda", generator=g)
    lengths = torch.randint(S // 4, S, (B,), device="cuda", generator=g)
    labels[torch.arange(S, device="cuda")[None] >= lengths[:, None]] = IGN
    with torch.no_grad():
        cur, ent = linear_log_probs(hidden, weight, labels, temperature=T)
    noise = lambda s: s * torch.randn(B, S, device="cuda", generator=g)  # noqa: E731
    valid = labels != IGN
    old = torch.where(valid, cur + noise(0.2), float("-inf"))  # -inf off the completions: must not leak
    ref = torch.where(valid, cur + noise(0.2), float("nan"))
    sampler = torch.where(valid, old + noise(0.05), float("-inf"))
    adv = torch.randn(B, device="cuda", generator=g)
    return hidden, weight, labels, adv, old, ref, sampler, ent


def _run(loss_fn, inputs, impl_dtype):
    from logitless.modules import HeadInput

    hidden, weight, labels, adv, old, ref, sampler, ent = inputs
    h = hidden.detach().to(impl_dtype).requires_grad_(True)
    w = weight.detach().to(impl_dtype).requires_grad_(True)
    keep = None
    if loss_fn.top_entropy_quantile < 1:
        keep = loss_fn.high_entropy_mask(ent, loss_fn.loss_mask(labels))
    loss, metrics = loss_fn(HeadInput(h, w), labels, adv, old_log_probs=old, ref_log_probs=ref,
                            sampler_log_probs=sampler, entropy_mask=keep)
    loss.backward()
    return loss.detach(), h.grad, w.grad, metrics


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300)).item()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_objective_compiles_captures_and_matches(name, monkeypatch):
    from logitless.losses.grpo import GRPOLoss
    from logitless.ops.triton import token_objective as TO

    # every call on the one pass, its chunks' objective compiled and replayed from the kept graph
    monkeypatch.setattr(TO.ChunkUpstreams, "replayable", staticmethod(lambda *a: True))
    eager_calls = []
    coefficients = TO._coefficients
    monkeypatch.setattr(TO, "_coefficients", lambda *a: eager_calls.append(1) or coefficients(*a))
    inputs = _inputs()
    fused = GRPOLoss(temperature=T, impl="triton", fused=True, **CONFIGS[name])
    got = _run(fused, inputs, torch.bfloat16)
    code = GRPOLoss._row_objective.__code__
    assert code not in TO._UNCOMPILABLE and code not in TO._UNCAPTURABLE and not eager_calls
    again = _run(fused, inputs, torch.bfloat16)  # a second call replays the kept graph: the same numbers
    for a, b in zip(got[:3], again[:3]):
        assert torch.equal(a, b)
    unfused = _run(GRPOLoss(temperature=T, impl="triton", fused=False, **CONFIGS[name]), inputs, torch.bfloat16)
    want = _run(GRPOLoss(temperature=T, impl="reference", fused=False, **CONFIGS[name]), inputs, torch.float64)
    assert torch.isfinite(got[0]) and abs(float(want[0])) > 1e-4
    # The default GEMMs (cuBLAS) round the logits to bf16, as torch's and Liger's heads do: on this head
    # the unfused loss is 1e-4 to 1e-2 (relative; 'full' sums terms of both signs) from float64. The
    # fused path must be as close as the unfused one of the same GEMMs.
    assert _rel(got[0], want[0]) < max(1.5 * _rel(unfused[0], want[0]), 1e-4)
    # bf16 gradients: as close to float64 as the unfused path's (plain bf16 rounding, a few 1e-3)
    for i in (1, 2):
        assert _rel(got[i], want[i]) < max(1.5 * _rel(unfused[i], want[i]), 1e-2)
    for k, v in want[3].items():
        # clip fractions may flip a few of the ~2,500 tokens at a bf16 ratio's rounding
        assert abs(float(got[3][k]) - float(v)) < 5e-3 * max(1.0, abs(float(v))), k
