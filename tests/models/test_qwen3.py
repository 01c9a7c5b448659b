"""Qwen3 builders against transformers' Qwen3 at every released size (on the meta device), the LoRA /
DoRA builders, the tiny Qwen3 and its bundled Hugging Face folder."""

import pytest
import torch
from torchtune.modules import TiedLinear

from logitless.datasets import asset_path
from logitless.models import (HFCheckpointer, TINY_QWEN3_CONFIG, from_hf, hf_config_from_model,
                              lora_qwen3, lora_qwen3_0_6b, lora_qwen3_8b, qwen3, qwen3_0_6b, qwen3_14b, qwen3_1_7b,
                              qwen3_32b, qwen3_4b, qwen3_8b, qwen3_tiny)
from logitless.modules import QKNormAttention
from logitless.training import load_weights

transformers = pytest.importorskip("transformers")

# The released checkpoints' config.json (Qwen/Qwen3-<size>), as published: the builders must match them.
RELEASED = {
    qwen3_0_6b: dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, tie_word_embeddings=True),
    qwen3_1_7b: dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, tie_word_embeddings=True),
    qwen3_4b: dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                   num_key_value_heads=8, tie_word_embeddings=True),
    qwen3_8b: dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                   num_key_value_heads=8, tie_word_embeddings=False),
    qwen3_14b: dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                    num_key_value_heads=8, tie_word_embeddings=False),
    qwen3_32b: dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                    num_key_value_heads=8, tie_word_embeddings=False),
}
SHARED = dict(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
              attention_bias=False, hidden_act="silu")


@pytest.mark.parametrize("builder", list(RELEASED), ids=lambda b: b.__name__)
def test_builder_is_the_released_architecture(builder):
    """Same config.json fields and the same parameter tensors (names mapped, shapes) as transformers'
    Qwen3ForCausalLM of the published config; built on the meta device (no memory)."""
    from logitless.models import tune_to_hf_converter

    released = dict(SHARED, **RELEASED[builder])
    with torch.device("meta"):
        ours = builder()
        theirs = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**released))
    config = hf_config_from_model(ours)
    assert {k: config[k] for k in released} == released
    arch = {"num_heads": released["num_attention_heads"], "num_kv_heads": 8, "dim": released["hidden_size"],
            "head_dim": 128}
    shapes = {k: tuple(v.shape) for k, v in tune_to_hf_converter("QWEN3", arch)(ours.state_dict()).items()}
    want = {k: tuple(v.shape) for k, v in theirs.state_dict().items()
            if not (released["tie_word_embeddings"] and k == "lm_head.weight")}
    assert shapes == want
    assert isinstance(ours.output, TiedLinear) == released["tie_word_embeddings"]


def test_max_seq_len_is_the_rope_table_only():
    with torch.device("meta"):
        base = qwen3_0_6b(max_seq_len=32768)
    assert base.max_seq_len == 32768 and base.layers[0].attn.pos_embeddings.max_seq_len == 32768


def _tiny_arch(**kw):
    return dict(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=48,
                max_seq_len=64, head_dim=16, **kw)


@pytest.mark.parametrize("use_dora", [False, True])
def test_lora_model_with_zero_adapters_is_the_base_model(use_dora):
    torch.manual_seed(0)
    base = qwen3(**_tiny_arch(tie_word_embeddings=False))
    lora = lora_qwen3(["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                      apply_lora_to_output=True, lora_rank=4, lora_alpha=8.0, use_dora=use_dora,
                      **_tiny_arch(tie_word_embeddings=False))
    adapter = [k for k in lora.state_dict() if "lora_" in k or k.endswith("magnitude")]
    assert set(lora.state_dict()) - set(adapter) == set(base.state_dict())
    load_weights(lora, base.state_dict(), allow_missing=adapter)  # DoRA magnitudes from the base weights
    tokens = torch.randint(0, 64, (2, 9))
    with torch.no_grad():  # torchtune zero-initialises lora_b: the adapted model starts as the base
        torch.testing.assert_close(lora(tokens), base(tokens), rtol=0, atol=1e-5)
    assert all(type(layer.attn) is QKNormAttention for layer in lora.layers)


def test_builder_errors_name_the_argument():
    with pytest.raises(ValueError, match="apply_lora_to_output=True needs tie_word_embeddings=False"):
        lora_qwen3_0_6b(["q_proj"], apply_lora_to_output=True)
    with pytest.raises(ValueError, match=r"lora_attn_modules must name .* got \['gate_proj'\]"):
        lora_qwen3(["gate_proj"], lora_rank=4, lora_alpha=8.0, **_tiny_arch())
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"):
        qwen3(**dict(_tiny_arch(), num_kv_heads=3))
    with pytest.raises(ValueError, match="q_norm and k_norm are required"):
        QKNormAttention(embed_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, q_proj=torch.nn.Linear(32, 32),
                        k_proj=torch.nn.Linear(32, 16), v_proj=torch.nn.Linear(32, 16),
                        output_proj=torch.nn.Linear(32, 32))
    with pytest.raises(TypeError, match=r"qwen3_tiny: unknown argument\(s\) \['width'\]"):
        qwen3_tiny(width=3)
    with torch.device("meta"):
        assert not isinstance(lora_qwen3_8b(["q_proj"], apply_lora_to_output=True).output, TiedLinear)


def test_bundled_tiny_qwen3_is_the_tiny_builder_and_transformers_agrees():
    folder = asset_path("qwen3_tiny")
    model = from_hf(folder).eval()
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in qwen3_tiny().state_dict().items()}
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        load_weights(model, HFCheckpointer(checkpoint_dir=folder, output_dir=out).load_checkpoint()["model"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, TINY_QWEN3_CONFIG["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.float()(tokens), hf(input_ids=tokens).logits, rtol=0, atol=1e-4)
    norms = model.layers[0].attn.q_norm.scale
    assert norms.std() > 0.05  # the q/k norm scales are not all 1: their order relative to RoPE matters
