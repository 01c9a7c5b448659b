"""The compiled sampler's concatenated q/k/v and gate/up projections against the layers' own (CPU)."""

import pytest
import torch

from logitless.generation import decode_step
from logitless.generation.compiled import CompiledSampler
from logitless.generation.fused import FusedProjections
from logitless.generation.trunk import decoding_layer

from .test_compiled import NEVER, PROMPTS, tiny

GREEDY = dict(max_new_tokens=6, stop_tokens=NEVER, pad_id=0, num_generations=2, temperature=0)


def _pair(model, dtype, mode=True, **kw):
    model = model.to(dtype).eval()
    plain = CompiledSampler(compile=False, fused_projections=False)(model, PROMPTS, **GREEDY, **kw)
    fused = CompiledSampler(compile=False, fused_projections=mode)(model, PROMPTS, **GREEDY, **kw)
    return fused, plain


def _layers(model):
    return [decoding_layer(layer) for layer in model.layers]


def _parts(model):
    return [p for layer in model.layers for m in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj,
                                                  layer.mlp.w1, layer.mlp.w3) for p in m.parameters()]


def _distinct_bytes(tensors):
    """Bytes of the distinct storages behind ``tensors`` (what they hold in memory together)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.parametrize("mode", [True, "shared"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_projections_give_the_unfused_tokens_and_log_probs(dtype, mode, monkeypatch):
    calls = []
    linear = decode_step.F.linear

    def spy(x, weight, *args):
        calls.append(tuple(weight.shape))
        return linear(x, weight, *args)

    monkeypatch.setattr(decode_step.F, "linear", spy)
    model = tiny(kv_heads=2)
    fused, plain = _pair(model, dtype, mode)
    # the fused path ran: q (4 heads x 8) + k and v (2 x 8 each) = 64 rows, gate + up = 2 x 64 rows
    assert (64, 32) in calls and (128, 32) in calls
    assert torch.equal(fused.completion_tokens, plain.completion_tokens)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(fused.sampler_log_probs, plain.sampler_log_probs, rtol=0, atol=tol)


@pytest.mark.parametrize("mode", [True, "shared"])
def test_fused_projections_follow_the_weights_after_an_optimizer_step(mode):
    model = tiny().double().eval()
    # buffers (and the fused weights) kept between calls
    sampler = CompiledSampler(compile=False, keep_cache=True, fused_projections=mode)
    before = sampler(model, PROMPTS, **GREEDY).sampler_log_probs.clone()  # kept buffers are reused
    copy = sampler._state.fused
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    h = model(torch.tensor([PROMPTS[0]]))
    (h[0, -1, 3] - h[0, -1].logsumexp(0)).backward()  # push every projection towards token 3
    opt.step()
    after = sampler(model, PROMPTS, **GREEDY)
    assert sampler._state.fused is copy  # the same buffers, rewritten in place (shared: written by the step)
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


def test_shared_projections_are_the_models_parameters_with_no_copy():
    model = tiny().eval()
    params = {name: p for name, p in model.named_parameters()}
    values = {name: p.detach().clone() for name, p in params.items()}
    before = _distinct_bytes(list(model.parameters()))
    sampler = CompiledSampler(compile=False, keep_cache=True, fused_projections="shared")
    sampler(model, PROMPTS, **GREEDY)
    fusion = sampler._state.fused
    assert fusion.shares(_layers(model)) and fusion.extra_bytes == 0
    # the same Parameter objects (an optimizer built before keeps them), the same values
    assert all(p is params[name] for name, p in model.named_parameters())
    assert all(torch.equal(p, values[name]) for name, p in model.named_parameters())
    # q/k/v and gate/up of a layer are rows of the fused buffers: one storage each, nothing held twice
    qkv, gate_up = fusion.layers()[1]["qkv"][0], fusion.layers()[1]["gate_up"][0]
    attn, mlp = model.layers[1].attn, model.layers[1].mlp
    assert attn.k_proj.weight.data_ptr() == qkv[attn.q_proj.weight.shape[0]].data_ptr()
    assert mlp.w3.weight.data_ptr() == gate_up[mlp.w1.weight.shape[0]].data_ptr()
    assert _distinct_bytes(list(model.parameters()) + [t for layer in fusion.layers() for pair in layer.values()
                                                       for t in pair if t is not None]) == before
    assert _distinct_bytes(_parts(model)) == fusion.nbytes


def test_shared_projections_copy_back_a_replaced_parameter():
    model = tiny().double().eval()
    sampler = CompiledSampler(compile=False, keep_cache=True, fused_projections="shared")
    sampler(model, PROMPTS, **GREEDY)
    fusion = sampler._state.fused
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    state["layers.0.attn.k_proj.weight"].normal_(0, 0.5)
    state["layers.1.mlp.w1.weight"].normal_(0, 0.5)
    model.load_state_dict(state, assign=True)  # new tensors: the sharing is broken
    assert not fusion.shares(_layers(model))
    after = sampler(model, PROMPTS, **GREEDY)
    assert sampler._state.fused is fusion and fusion.shares(_layers(model))
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    fresh = CompiledSampler(compile=False, fused_projections=False)(model, PROMPTS, **GREEDY)
    assert torch.equal(after.completion_tokens, fresh.completion_tokens)
    torch.testing.assert_close(after.sampler_log_probs, fresh.sampler_log_probs, rtol=0, atol=1e-12)


def test_two_shared_samplers_read_one_buffer():
    model = tiny().eval()
    first = CompiledSampler(compile=False, keep_cache=True, fused_projections="shared")
    second = CompiledSampler(compile=False, keep_cache=True, fused_projections="shared")
    first(model, PROMPTS, **GREEDY)
    bytes_once = _distinct_bytes(list(model.parameters()))
    second(model, PROMPTS, **GREEDY)
    a, b = first._state.fused.layers(), second._state.fused.layers()
    assert all(a[i][name][0].data_ptr() == b[i][name][0].data_ptr() for i in range(len(a)) for name in a[i])
    assert _distinct_bytes(list(model.parameters())) == bytes_once
    first(model, PROMPTS, **GREEDY)  # neither re-points the parameters away from the other
    assert second._state.fused.shares(_layers(model))


def test_shared_projections_follow_a_dtype_change():
    model = tiny().eval()
    sampler = CompiledSampler(compile=False, keep_cache=True, fused_projections="shared")
    sampler(model, PROMPTS, **GREEDY)
    model.double()  # new float64 tensors for every parameter
    after = sampler(model, PROMPTS, **GREEDY)
    assert sampler._state.fused.shares(_layers(model))
    assert sampler._state.fused.layers()[0]["qkv"][0].dtype == torch.float64
    fresh = CompiledSampler(compile=False, fused_projections=False)(model, PROMPTS, **GREEDY)
    assert torch.equal(after.completion_tokens, fresh.completion_tokens)
    torch.testing.assert_close(after.sampler_log_probs, fresh.sampler_log_probs, rtol=0, atol=1e-12)


def test_projections_in_one_storage_out_of_order_are_copied_not_grown():
    # k, q, v rows of one buffer in that order: not end to end as q, k, v, so the sharing copies
    # them into a new buffer; viewing past the old buffer's end would have reallocated it
    model = tiny().eval()
    attn = model.layers[0].attn
    parts = (attn.k_proj, attn.q_proj, attn.v_proj)
    with torch.no_grad():
        weights = torch.cat([m.weight for m in parts])
        for m, w in zip(parts, weights.split([m.weight.shape[0] for m in parts])):
            m.weight.data = w
    values = [m.weight.detach().clone() for m in parts]
    ptr, nbytes = weights.untyped_storage().data_ptr(), weights.untyped_storage().nbytes()
    fusion = FusedProjections(_layers(model), share=True)
    assert (weights.untyped_storage().data_ptr(), weights.untyped_storage().nbytes()) == (ptr, nbytes)
    assert fusion.shares(_layers(model))
    assert all(torch.equal(m.weight, v) for m, v in zip(parts, values))


def test_lora_layers_share_only_their_plain_projections():
    model = tiny(tied=False, lora=True).double().eval()
    q_storage = model.layers[0].attn.q_proj.weight.untyped_storage().data_ptr()
    fused, plain = _pair(model, torch.float64, "shared")
    assert torch.equal(fused.completion_tokens, plain.completion_tokens)
    torch.testing.assert_close(fused.sampler_log_probs, plain.sampler_log_probs, rtol=0, atol=1e-12)
    mlp = model.layers[0].mlp
    assert mlp.w1.weight.untyped_storage().data_ptr() == mlp.w3.weight.untyped_storage().data_ptr()
    assert model.layers[0].attn.q_proj.weight.untyped_storage().data_ptr() == q_storage  # LoRA: untouched


@pytest.mark.parametrize("value", [1, "copy", None])
def test_fused_projections_flag_is_checked(value):
    with pytest.raises(ValueError, match=f"fused_projections must be True, False or 'shared', got {value!r}"):
        CompiledSampler(fused_projections=value)
