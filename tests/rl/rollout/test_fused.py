"""The compiled sampler's concatenated q/k/v and gate/up projections against the layers' own (CPU)."""

import pytest
import torch

from logitless.rl.rollout import compiled
from logitless.rl.rollout.compiled import CompiledSampler
from logitless.rl.rollout.fused import FusedProjections
from logitless.rl.rollout.trunk import decoding_layer

from .test_compiled import NEVER, PROMPTS, tiny

GREEDY = dict(max_new_tokens=6, stop_tokens=NEVER, pad_id=0, num_generations=2, temperature=0)


def _pair(model, dtype, **kw):
    model = model.to(dtype).eval()
    fused = CompiledSampler(compile=False, fused_projections=True)(model, PROMPTS, **GREEDY, **kw)
    plain = CompiledSampler(compile=False, fused_projections=False)(model, PROMPTS, **GREEDY, **kw)
    return fused, plain


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_projections_give_the_unfused_tokens_and_log_probs(dtype, monkeypatch):
    calls = []
    linear = compiled.F.linear

    def spy(x, weight, *args):
        calls.append(tuple(weight.shape))
        return linear(x, weight, *args)

    monkeypatch.setattr(compiled.F, "linear", spy)
    model = tiny(kv_heads=2)
    fused, plain = _pair(model, dtype)
    # the fused path ran: q (4 heads x 8) + k and v (2 x 8 each) = 64 rows, gate + up = 2 x 64 rows
    assert (64, 32) in calls and (128, 32) in calls
    assert torch.equal(fused.completion_tokens, plain.completion_tokens)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(fused.sampler_log_probs, plain.sampler_log_probs, rtol=0, atol=tol)


def test_fused_projections_follow_the_weights_after_an_optimizer_step():
    model = tiny().double().eval()
    sampler = CompiledSampler(compile=False, keep_cache=True, fused_projections=True)  # buffers (and the fused copy) kept
    before = sampler(model, PROMPTS, **GREEDY).sampler_log_probs.clone()  # kept buffers are reused
    copy = sampler._state["fused"]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    h = model(torch.tensor([PROMPTS[0]]))
    (h[0, -1, 3] - h[0, -1].logsumexp(0)).backward()  # push every projection towards token 3
    opt.step()
    after = sampler(model, PROMPTS, **GREEDY)
    assert sampler._state["fused"] is copy  # the same buffers, rewritten in place
    fresh = CompiledSampler(compile=False, fused_projections=False)(model, PROMPTS, **GREEDY)
    assert torch.equal(after.completion_tokens, fresh.completion_tokens)
    torch.testing.assert_close(after.sampler_log_probs, fresh.sampler_log_probs, rtol=0, atol=1e-12)
    assert not torch.equal(after.sampler_log_probs, before)


def test_lora_projections_stay_separate_and_match():
    model = tiny(tied=False, lora=True).double().eval()
    fusion = FusedProjections([decoding_layer(layer) for layer in model.layers])
    # LoRA on q and v: q/k/v stay separate; the MLP has no adapters, so gate/up are concatenated
    assert [set(layer) for layer in fusion.layers()] == [{"gate_up"}, {"gate_up"}]
    assert fusion.nbytes == 2 * (2 * 64 * 32) * 8
    fused, plain = _pair(model, torch.float64)
    assert torch.equal(fused.completion_tokens, plain.completion_tokens)
    torch.testing.assert_close(fused.sampler_log_probs, plain.sampler_log_probs, rtol=0, atol=1e-12)


def test_fused_memory_is_one_copy_of_the_concatenated_projections():
    model = tiny()
    fusion = FusedProjections([decoding_layer(layer) for layer in model.layers])
    per_layer = sum(p.weight.numel() + (0 if p.bias is None else p.bias.numel())
                    for layer in model.layers for p in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj,
                                                        layer.mlp.w1, layer.mlp.w3)) // len(model.layers)
    assert fusion.nbytes == len(model.layers) * per_layer * 4


def test_fused_projections_flag_is_checked():
    with pytest.raises(ValueError, match="fused_projections must be True or False, got 1"):
        CompiledSampler(fused_projections=1)
