"""Model FLOP counts against hand counts from the config numbers, the peak table, and the GRPO
update's count against an explicit count of attended pairs."""

import pytest
import torch
from torchtune.models.qwen2._component_builders import lora_qwen2, qwen2
from torchtune.training import set_activation_checkpointing
from torchtune.modules import TransformerSelfAttentionLayer

from logitless.rl.metrics import update_flops
from logitless.training import flops as flops_module
from logitless.training.flops import DecoderFlops, causal_pairs, mfu, peak_bf16_flops

V, L, HEADS, KV, D, I = 97, 2, 4, 2, 32, 64
HD = D // HEADS
RANK = 4


def _dims(tied):
    return dict(vocab_size=V, num_layers=L, num_heads=HEADS, num_kv_heads=KV, embed_dim=D, intermediate_dim=I,
                max_seq_len=128, tie_word_embeddings=tied)


def _layer_weights():
    # q, k, v, o, then gate, up, down
    return D * HEADS * HD + 2 * D * KV * HD + HEADS * HD * D + 3 * D * I


def test_full_finetune_is_three_forwards_by_hand():
    model = qwen2(**_dims(tied=False))
    t, head_t, pairs = 50, 20, 400
    forward = 2 * L * _layer_weights() * t + 2 * V * D * head_t + 4 * L * HEADS * HD * pairs
    f = DecoderFlops(model)
    assert f.forward(tokens=t, head_tokens=head_t, pairs=pairs) == forward
    assert f.training(tokens=t, head_tokens=head_t, pairs=pairs) == 3 * forward


def test_lora_backward_computes_input_gradients_of_the_frozen_weights():
    model = lora_qwen2(["q_proj", "v_proj"], lora_rank=RANK, lora_alpha=8.0, **_dims(tied=True))
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    t, head_t, pairs = 50, 20, 400
    adapters = L * (RANK * D + RANK * HEADS * HD + RANK * D + RANK * KV * HD)  # q and v: A (r x D), B (out x r)
    frozen = L * _layer_weights()
    attention = 4 * L * HEADS * HD * pairs
    forward = 2 * (frozen + adapters) * t + 2 * V * D * head_t + attention
    backward = 2 * (frozen + adapters) * t + 2 * adapters * t + 2 * attention + 2 * V * D * head_t
    f = DecoderFlops(model)
    assert f.training(tokens=t, head_tokens=head_t, pairs=pairs) == forward + backward


def test_activation_checkpointing_recompute_counts_as_hardware_not_model_flops():
    model = qwen2(**_dims(tied=True))
    plain = DecoderFlops(model).training(tokens=10, head_tokens=4, pairs=55)
    set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    layers_forward = 2 * L * _layer_weights() * 10 + 4 * L * HEADS * HD * 55
    assert DecoderFlops(model).training(tokens=10, head_tokens=4, pairs=55) == plain  # MFU: model FLOPs
    assert DecoderFlops(model).training(tokens=10, head_tokens=4, pairs=55, hardware=True) == plain + layers_forward


def _packed_pairs(p, cs):
    """Attended pairs of a packed group counted on its mask: prompt causal, each completion sees the
    prompt and its own prefix."""
    n = p + sum(cs)
    owner = torch.tensor([-1] * p + [i for i, c in enumerate(cs) for _ in range(c)])
    pos = torch.arange(n)
    causal = pos[:, None] >= pos[None, :]
    visible = (owner[None, :] == -1) | (owner[:, None] == owner[None, :])
    return int((causal & visible).sum())


@pytest.mark.parametrize("prompt_once", [False, True])
@pytest.mark.parametrize("iterations,reference", [(1, False), (2, True)])
def test_update_flops_count_every_pass_on_the_real_tokens(prompt_once, iterations, reference):
    model = qwen2(**_dims(tied=True))
    f = DecoderFlops(model)
    prompts, completions, g = [5, 5, 3, 3], [2, 7, 1, 4], 2
    if prompt_once:
        tokens = 5 + 3 + sum(completions)
        pairs = _packed_pairs(5, [2, 7]) + _packed_pairs(3, [1, 4])
    else:
        tokens = sum(prompts) + sum(completions)
        pairs = sum((p + c) * (p + c + 1) // 2 for p, c in zip(prompts, completions))
    size = dict(tokens=tokens, head_tokens=sum(completions), pairs=pairs)
    expected = iterations * f.training(**size) + ((iterations > 1) + reference) * f.forward(**size)
    got = update_flops(f, torch.tensor(prompts), torch.tensor(completions), group_size=g, prompt_once=prompt_once,
                       num_iterations=iterations, reference=reference)
    assert got == expected


def test_causal_pairs_and_mfu():
    assert causal_pairs([3, 1]) == 6 + 1
    assert mfu(494.5e12, 2.0, 989e12, devices=2) == pytest.approx(0.125)
    assert mfu(1e12, 1.0, None) is None


@pytest.mark.parametrize("name,peak", [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                       ("NVIDIA H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                       ("NVIDIA GeForce RTX 4090", None)])
def test_peak_table_by_device_name_and_unknown_devices_have_none(monkeypatch, name, peak):
    monkeypatch.setattr(flops_module.torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_bf16_flops(torch.device("cuda", 0)) == peak
    assert peak_bf16_flops(torch.device("cpu")) is None
