"""``from_hf`` + ``HFCheckpointer`` against transformers, the oracle: tiny random Qwen3 (tied and untied),
Llama 3.1 / 3.2 (``rope_scaling: llama3``) and Qwen2 checkpoints written by ``save_pretrained`` are
built, loaded and compared (fp32 logits within 1e-4), exported and loaded back by transformers (equal
logits), decoded greedily by our samplers (transformers' ``generate(do_sample=False)`` token for token)
and exported as PEFT adapters (equal to the merged weights, PEFT's model equal to ours)."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torchtune.modules.peft import get_adapter_state_dict, get_merged_lora_ckpt

from logitless.models import (HFCheckpointer, HFConfigError, from_hf, hf_config_from_model, hf_model_spec,
                              hf_tokenizer, model_family, read_hf_config)
from logitless.generation.compiled import CompiledSampler
from logitless.generation.eager import generate as eager_generate
from logitless.training import CheckpointManager, load_weights
from logitless.training.export import ModelExport

transformers = pytest.importorskip("transformers")

VOCAB = 97
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
#: family name -> (transformers config class, model class, config arguments)
FAMILY_CONFIGS = {
    # Qwen3-0.6B's shape: heads x head_dim (4 x 32) wider than hidden_size, tied head
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1_000_000.0, tie_word_embeddings=True)),
    "qwen3_untied": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, rope_theta=10_000.0,
                                                              tie_word_embeddings=False)),
    # Llama 3.2's RoPE scaling with an original context shorter than the test sequences, so it matters
    "llama3_2": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500_000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "llama3_1": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500_000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=10_000.0, tie_word_embeddings=False)),
}


def build_hf(family: str, seed: int = 0):
    """A random transformers model of ``family`` in fp32, eval mode: every RMSNorm scale drawn around 1
    (so the q/k norms' place relative to RoPE matters), layers and head large enough that greedy
    decoding moves between tokens instead of repeating the last one."""
    config_cls, model_cls, kw = FAMILY_CONFIGS[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**_COMMON, **kw)
    model = getattr(transformers, model_cls)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("proj.weight"):  # layers that move the residual away from the input token
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """``hf_checkpoint(family)`` -> ``(folder, transformers model)``: the model saved by ``save_pretrained``."""
    def make(family: str, seed: int = 0):
        model = build_hf(family, seed)
        folder = tmp_path / f"hf_{family}_{seed}"
        model.save_pretrained(str(folder))
        return folder, model

    return make


FAMILIES = list(FAMILY_CONFIGS)
# longer than the Llama configs' original context (16 positions): the scaled frequencies matter
TOKENS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(7))


def ours(folder, out, **lora):
    """The model from_hf builds for ``folder`` with the weights HFCheckpointer loads, and the checkpointer."""
    model = from_hf(folder, **lora).eval()
    ckpt = HFCheckpointer(checkpoint_dir=str(folder), output_dir=str(out))
    adapters = [k for k in model.state_dict() if "lora_" in k or k.endswith("magnitude")]
    load_weights(model, ckpt.load_checkpoint()["model"], allow_missing=adapters or None, source=str(folder))
    return model, ckpt


def hf_logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(hf_checkpoint, tmp_path, family):
    folder, hf = hf_checkpoint(family)
    model, ckpt = ours(folder, tmp_path / "out")
    model_type, built = {"qwen3": ("QWEN3", "qwen3"), "qwen3_untied": ("QWEN3", "qwen3"),
                         "llama3_2": ("LLAMA3_2", "llama"), "llama3_1": ("LLAMA3", "llama"),
                         "qwen2": ("QWEN2", "qwen2")}[family]
    assert ckpt._model_type_name == model_type and model_family(model) == built
    with torch.no_grad():
        got = model(TOKENS)
    torch.testing.assert_close(got, hf_logits(hf), rtol=0, atol=1e-4)


def test_torchtunes_norm_after_rope_order_is_not_qwen3(hf_checkpoint, tmp_path):
    """Why QKNormAttention exists: torchtune 0.6.1's MultiHeadAttention normalises q/k after RoPE."""
    from torchtune.modules import MultiHeadAttention

    folder, hf = hf_checkpoint("qwen3")
    model, _ = ours(folder, tmp_path / "out")
    for layer in model.layers:
        layer.attn.__class__ = MultiHeadAttention
    with torch.no_grad():
        assert (model(TOKENS) - hf_logits(hf)).abs().max() > 1e-2


@pytest.mark.parametrize("family,model_init", [("qwen3", "checkpoint"), ("qwen3_untied", "random"),
                                               ("llama3_2", "random"), ("llama3_1", "checkpoint")])
def test_export_loads_back_in_transformers_with_equal_logits(hf_checkpoint, tmp_path, family, model_init):
    folder, _ = hf_checkpoint(family)
    model, _ = ours(folder, tmp_path / "out")
    with torch.no_grad():  # trained weights: not the checkpoint's
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    cfg = OmegaConf.create({"model": {"_component_": "logitless.models.from_hf", "path": str(folder)},
                            "model_init": model_init, "output_dir": str(tmp_path / "out"), "tokenizer": None,
                            "checkpointer": {"_component_": "logitless.models.HFCheckpointer",
                                             "checkpoint_dir": str(folder), "output_dir": str(tmp_path / "out")}})
    mgr = CheckpointManager(cfg.checkpointer if model_init == "checkpoint" else None, cfg.output_dir,
                            export=ModelExport.for_run(cfg, model, lora=False))
    if model_init == "checkpoint":
        mgr.load_model_state()
    step = mgr.save(step=1, epoch=0, recipe_state={}, model_state={k: v.clone() for k, v in model.state_dict().items()})
    config = json.loads((step / "config.json").read_text())
    assert config["model_type"] == read_hf_config(folder)["model_type"] and config["dtype"] == "float32"
    back = transformers.AutoModelForCausalLM.from_pretrained(str(step), dtype=torch.float32).eval()
    assert type(back).__name__ == FAMILY_CONFIGS[family][1]
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(back), model(TOKENS), rtol=0, atol=1e-4)
    # and our path reads our own export back to the same weights (resume)
    again, _ = ours(step, tmp_path / "out2")
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def _hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["qwen3", "llama3_2"])
def test_greedy_decoding_equals_transformers_generate(hf_checkpoint, tmp_path, family, monkeypatch):
    folder, hf = hf_checkpoint(family)
    model, _ = ours(folder, tmp_path / "out")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [3], [40, 17, 33]]  # left padding in our batch
    n = 10
    want = [_hf_greedy(hf, p, n) for p in prompts]
    assert len({tuple(w) for w in want}) == len(prompts) and all(len(set(w)) > 1 for w in want)  # not one repeated token
    kw = dict(max_new_tokens=n, stop_tokens=[-1], pad_id=0, temperature=0)
    for name, sampler in {"eager": eager_generate, "compiled_sdpa": CompiledSampler(compile=False)}.items():
        assert sampler(model, prompts, **kw).completion_tokens.tolist() == want, name
    if family == "qwen3":  # the split-K step: q/k normalised, then rotated and cached by the Triton kernel
        from logitless.generation import decode_step

        rotary, fused = decode_step._fused_rotary, []
        monkeypatch.setattr(decode_step, "_fused_rotary", lambda *a: fused.append(rotary(*a)) or fused[-1])
        out = CompiledSampler(compile=False, decode_attention="split_k")(model, prompts, **dict(kw, max_new_tokens=4))
        assert out.completion_tokens.tolist() == [w[:4] for w in want]
        assert fused and all(spec is not None for spec in fused)


def test_compiled_decode_step_equals_transformers_generate(hf_checkpoint, tmp_path):
    """The captured decode step itself (torch.compile of the grouped step, q/k norms inside it)."""
    folder, hf = hf_checkpoint("qwen3")
    model, _ = ours(folder, tmp_path / "out")
    prompts = [[5, 6, 7, 8], [3, 9]]
    want = [_hf_greedy(hf, p, 4) for p in prompts]
    torch._dynamo.reset()
    out = CompiledSampler(compile=True, backend="aot_eager")(model, prompts, max_new_tokens=4, stop_tokens=[-1],
                                                             pad_id=0, temperature=0)
    assert out.completion_tokens.tolist() == want


@pytest.mark.parametrize("family", ["qwen3", "llama3_1"])
def test_peft_adapter_equals_merged_weights_and_peft_model_equals_ours(hf_checkpoint, tmp_path, family, peft_usable):
    import peft

    folder, _ = hf_checkpoint(family)
    lora = dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                lora_rank=4, lora_alpha=8.0)
    model, _ = ours(folder, tmp_path / "out", **lora)
    with torch.no_grad():  # adapters far from zero, as after training
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    cfg = OmegaConf.create({"model": {"_component_": "logitless.models.from_hf", "path": str(folder), **lora},
                            "model_init": "checkpoint", "output_dir": str(tmp_path / "out"), "tokenizer": None,
                            "checkpointer": {"_component_": "logitless.models.HFCheckpointer",
                                             "checkpoint_dir": str(folder), "output_dir": str(tmp_path / "out")}})
    mgr = CheckpointManager(cfg.checkpointer, cfg.output_dir, export=ModelExport.for_run(cfg, model, lora=True))
    mgr.load_model_state()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    merged = get_merged_lora_ckpt(dict(sd), rank=4, alpha=8.0)
    step = mgr.save(step=1, epoch=0, recipe_state={}, model_state=merged,
                    adapter_state=get_adapter_state_dict(sd, device=None))
    adapter = load_file(str(step / "adapter" / "adapter_model.safetensors"))
    base_hf, merged_hf = load_file(str(folder / "model.safetensors")), load_file(str(step / "model-00001-of-00001.safetensors"))
    modules = {k.split(".lora_A.")[0] for k in adapter if ".lora_A." in k}
    assert len(modules) == 2 * 7
    for module in modules:  # PEFT's W + (alpha / r) B A on HF names is the merged HF weight
        key = module.removeprefix("base_model.model.") + ".weight"
        a, b = adapter[module + ".lora_A.weight"].double(), adapter[module + ".lora_B.weight"].double()
        torch.testing.assert_close(merged_hf[key].double(), base_hf[key].double() + 2.0 * b @ a, rtol=0, atol=1e-5,
                                   msg=key)
    with torch.no_grad():
        want = model(TOKENS)
        base = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        got = peft.PeftModel.from_pretrained(base, str(step / "adapter")).eval()(input_ids=TOKENS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_sharded_folder_round_trips_through_the_checkpointer(hf_checkpoint, tmp_path):
    folder, hf = hf_checkpoint("qwen3")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="150KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    ckpt = HFCheckpointer(checkpoint_dir=str(sharded), output_dir=str(tmp_path / "out"))
    assert [p.name for p in ckpt._checkpoint_paths] == files
    state = ckpt.load_checkpoint()
    ckpt.save_checkpoint(state, epoch=0)
    written = tmp_path / "out" / "epoch_0"
    assert json.loads((written / "model.safetensors.index.json").read_text())["weight_map"].keys() == \
        index["weight_map"].keys()
    assert (written / "config.json").is_file()  # the folder's other files come along
    back = transformers.AutoModelForCausalLM.from_pretrained(str(written), dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(back), hf_logits(hf), rtol=0, atol=0)


def test_checkpointer_refuses_another_familys_model_type(hf_checkpoint, tmp_path):
    folder, _ = hf_checkpoint("qwen3")
    with pytest.raises(ValueError, match=r"model_type 'QWEN2' does not read .* a qwen3 checkpoint"):
        HFCheckpointer(checkpoint_dir=str(folder), output_dir=str(tmp_path / "out"), model_type="QWEN2")


@pytest.mark.parametrize("family", FAMILIES)
def test_config_of_the_built_model_reads_back_as_the_same_model(hf_checkpoint, family):
    folder, _ = hf_checkpoint(family)
    spec = hf_model_spec(read_hf_config(folder))
    assert hf_model_spec(hf_config_from_model(spec.build())).arch == spec.arch


@pytest.mark.parametrize("edit,field", [
    ({"model_type": "qwen3_moe"}, "model_type"),
    ({"model_type": "mistral"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_parameters"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"head_dim": "wide"}, "head_dim"),
])
def test_unsupported_config_is_refused_naming_the_field(hf_checkpoint, edit, field):
    folder, _ = hf_checkpoint("qwen3")
    config = read_hf_config(folder)
    config.update(edit)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConfigError, match=rf"config.json field '{field}': .* is not supported; expected"):
        from_hf(folder)


@pytest.mark.parametrize("scaling,field", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     "rope_scaling.original_max_position_embeddings"),
])
def test_llama_rope_scaling_other_than_llama3_is_refused(hf_checkpoint, scaling, field):
    folder, _ = hf_checkpoint("llama3_2")
    config = {k: v for k, v in read_hf_config(folder).items() if k != "rope_parameters"}
    (folder / "config.json").write_text(json.dumps(dict(config, rope_theta=500000.0, rope_scaling=scaling)))
    with pytest.raises(HFConfigError, match=rf"field '{field}'"):
        from_hf(folder)


def test_transformers_4_config_layout_builds_the_same_model(hf_checkpoint):
    """Hub checkpoints carry rope_theta / rope_scaling (transformers 4); transformers 5 writes rope_parameters."""
    folder, _ = hf_checkpoint("llama3_2")
    v5 = read_hf_config(folder)
    params = v5.pop("rope_parameters")
    v4 = dict(v5, rope_theta=params.pop("rope_theta"), rope_scaling=params)
    assert hf_model_spec(v4).arch == hf_model_spec(read_hf_config(folder)).arch
    assert hf_model_spec(v4).arch["rope_scaling"]["factor"] == 32.0


def test_tokenizer_errors_name_the_argument_and_the_file(hf_checkpoint):
    folder, _ = hf_checkpoint("llama3_2")
    with pytest.raises(ValueError, match="enable_thinking=False applies to Qwen3's chat template"):
        hf_tokenizer(folder, enable_thinking=False)
    with pytest.raises(FileNotFoundError, match=r"original/tokenizer.model not found"):
        hf_tokenizer(folder)
