"""PEFT adapter export: PEFT's formula on HF names, PEFT-loaded LoRA / DoRA == torchtune's model,
the family's row permutation (none for Qwen2, Llama's for Llama); random-init HF folders round-trip."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torchtune.models import convert_weights
from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf
from torchtune.modules.peft import get_adapter_state_dict, get_merged_lora_ckpt

from logitless.datasets import TINY_CHECKPOINT_DIR
from logitless.models import lora_qwen2_5_tiny, qwen2_5_tiny
from logitless.training import CheckpointManager, load_weights
from logitless.training.config import ConfigError
from logitless.training.export import ModelExport, model_arch, tune_to_peft_adapter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


MODEL = dict(_component_="logitless.models.lora_qwen2_5_tiny", lora_attn_modules=["q_proj", "k_proj", "v_proj",
             "output_proj"], apply_lora_to_mlp=True, lora_rank=4, lora_alpha=8.0)


def _run_cfg(out, **model):
    return OmegaConf.create({
        "model": dict(MODEL, **model), "model_init": "checkpoint", "output_dir": str(out),
        "tokenizer": {"_component_": "logitless.datasets.tiny_qwen2_5_tokenizer"},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                         "checkpoint_dir": str(TINY_CHECKPOINT_DIR), "checkpoint_files": ["model.safetensors"],
                         "model_type": "QWEN2", "output_dir": str(out)}})


def _trained_lora(cfg, seed=0):
    """The tiny LoRA model on the bundled base with adapters far from zero (as after training)."""
    kw = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "_component_"}
    model = lora_qwen2_5_tiny(**kw)
    mgr = CheckpointManager(cfg.checkpointer, cfg.output_dir, export=ModelExport.for_run(cfg, model, lora=True))
    load_weights(model, mgr.load_model_state(), allow_missing=[k for k in model.state_dict() if "lora_" in k or
                                                                  "magnitude" in k])
    if cfg.model.get("use_dora", False):
        for m in model.modules():  # DoRA magnitudes start at ||W|| per row: initialise them from the base
            if hasattr(m, "initialize_dora_magnitude"):
                m.initialize_dora_magnitude()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith("magnitude"):
                p.mul_(1 + 0.2 * torch.rand(p.shape, generator=g))
    return model, mgr


def _save(model, mgr, cfg):
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    merged = get_merged_lora_ckpt(dict(sd), rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha)
    return mgr.save(step=1, epoch=0, recipe_state={}, model_state=merged,
                    adapter_state=get_adapter_state_dict(sd, device=None))


def test_peft_formula_on_hf_names_gives_the_merged_hf_weights(tmp_path):
    cfg = _run_cfg(tmp_path)
    model, mgr = _trained_lora(cfg)
    step = _save(model, mgr, cfg)
    adapter_config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    peft_sd = load_file(str(step / "adapter" / "adapter_model.safetensors"))
    base_hf = load_file(str(TINY_CHECKPOINT_DIR / "model.safetensors"))
    merged_hf = load_file(str(step / "model-00001-of-00001.safetensors"))
    scale = adapter_config["lora_alpha"] / adapter_config["r"]
    adapted = {k.split(".lora_A.")[0] for k in peft_sd if ".lora_A." in k}
    assert len(adapted) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    for module in adapted:
        hf_key = module.removeprefix("base_model.model.") + ".weight"
        a, b = peft_sd[module + ".lora_A.weight"].double(), peft_sd[module + ".lora_B.weight"].double()
        want = base_hf[hf_key].double() + scale * b @ a  # PEFT's W + (alpha / r) B A on HF names
        torch.testing.assert_close(merged_hf[hf_key].double(), want, rtol=0, atol=1e-5, msg=hf_key)


@pytest.mark.parametrize("use_dora", [False, True])
def test_peft_model_on_the_base_folder_matches_torchtune_and_the_merged_folder(tmp_path, use_dora, peft_usable):
    cfg = _run_cfg(tmp_path, use_dora=use_dora)
    model, mgr = _trained_lora(cfg)
    step = _save(model, mgr, cfg)
    assert json.loads((step / "adapter" / "adapter_config.json").read_text())["use_dora"] is use_dora
    tokens = torch.randint(0, 2026, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.eval()(tokens)
        base = transformers.AutoModelForCausalLM.from_pretrained(str(TINY_CHECKPOINT_DIR), dtype=torch.float32)
        got = peft.PeftModel.from_pretrained(base, str(step / "adapter")).eval()(input_ids=tokens).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(step)).eval()(input_ids=tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(merged, want, rtol=1e-4, atol=1e-4)


def test_qwen2_adapter_is_not_rope_permuted_llama_adapter_is():
    """Qwen2: lora_B as torchtune holds it (its HF weights are not permuted). Llama: torchtune's own PEFT
    export, whose RoPE permutation is right for Llama (its tune->HF conversion permutes q/k rows)."""
    model = lora_qwen2_5_tiny(["q_proj", "k_proj", "v_proj"], lora_rank=4)
    g = torch.Generator().manual_seed(0)
    adapter = {k: torch.randn(v.shape, generator=g) for k, v in get_adapter_state_dict(model.state_dict()).items()}
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    arch = model_arch(model)
    qwen = tune_to_peft_adapter(adapter, shapes, "QWEN2", arch)
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
    assert torch.equal(qwen[key], adapter["layers.1.attn.k_proj.lora_b.weight"])
    llama = tune_to_peft_adapter(adapter, shapes, "LLAMA3", arch)
    want = convert_weights.tune_to_peft_adapter_weights(adapter, num_heads=arch["num_heads"],
                                                        num_kv_heads=arch["num_kv_heads"], dim=arch["dim"])
    assert set(llama) == set(want)
    for k in want:
        assert torch.equal(llama[k], want[k]), k
    assert not torch.equal(llama[key], qwen[key])
    # and the Llama lora_B rows move exactly as the base weight's rows do
    w = torch.randn(shapes["layers.0.attn.q_proj.weight"], generator=g)
    hf_w = convert_weights.tune_to_hf({"layers.0.attn.q_proj.weight": w}, num_heads=arch["num_heads"],
                                      num_kv_heads=arch["num_kv_heads"], dim=arch["dim"])["model.layers.0.self_attn.q_proj.weight"]
    b, a = adapter["layers.0.attn.q_proj.lora_b.weight"], adapter["layers.0.attn.q_proj.lora_a.weight"]
    merged_hf = convert_weights.tune_to_hf({"layers.0.attn.q_proj.weight": w + b @ a}, num_heads=arch["num_heads"],
                                           num_kv_heads=arch["num_kv_heads"], dim=arch["dim"])
    pk = "base_model.model.model.layers.0.self_attn.q_proj."
    torch.testing.assert_close(merged_hf["model.layers.0.self_attn.q_proj.weight"],
                               hf_w + llama[pk + "lora_B.weight"] @ llama[pk + "lora_A.weight"])
    assert qwen2_tune_to_hf({"layers.0.attn.q_proj.weight": w})["model.layers.0.self_attn.q_proj.weight"] is w


def test_unsupported_model_type_is_refused_before_training(tmp_path):
    cfg = _run_cfg(tmp_path)
    cfg.checkpointer.model_type = "PHI3_MINI"
    model = lora_qwen2_5_tiny(["q_proj"], lora_rank=4)
    with pytest.raises(ConfigError, match=r"config key 'checkpointer.model_type': 'PHI3_MINI'.*expected one of"):
        ModelExport.for_run(cfg, model, lora=True)


def test_random_init_folder_is_hf_and_resumes_to_the_same_weights(tmp_path):
    cfg = OmegaConf.create({"model": {"_component_": "logitless.models.qwen2_5_tiny_untied"}, "model_init": "random",
                            "tokenizer": {"_component_": "logitless.datasets.tiny_qwen2_5_tokenizer"}})
    torch.manual_seed(0)
    model = qwen2_5_tiny(tie_word_embeddings=False).to(torch.bfloat16)
    mgr = CheckpointManager(None, str(tmp_path), export=ModelExport.for_run(cfg, model, lora=False))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    step = mgr.save(step=2, epoch=0, recipe_state={}, model_state=state)
    config = json.loads((step / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is False
    back = mgr.load_model_state(step)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    tokens = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(step), dtype=torch.float32).eval()
    fp32 = qwen2_5_tiny(tie_word_embeddings=False)
    fp32.load_state_dict({k: v.float() for k, v in state.items()})
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, fp32.eval()(tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_init", ["checkpoint", "random"])
def test_real_model_folder_layout_keeps_the_source_files_and_fixes_the_dtype(tmp_path, model_init):
    """A `tune download`-style folder (weights + tokenizer + generation config): the checkpoint copies its
    tokenizer files unchanged; what the source lacks (here tokenizer_config.json when random) is generated."""
    import shutil

    from logitless.datasets import TINY_TOKENIZER_DIR

    src = tmp_path / "Qwen2.5-Tiny-Instruct"
    shutil.copytree(TINY_CHECKPOINT_DIR, src)
    for f in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copy(TINY_TOKENIZER_DIR / f, src / f)
    source_tok_cfg = json.loads((TINY_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    source_tok_cfg["chat_template"] = "{{ 'the source template' }}"
    if model_init == "checkpoint":
        (src / "tokenizer_config.json").write_text(json.dumps(source_tok_cfg))
        (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2028, 2026], "top_k": 20}))
    cfg = OmegaConf.create({
        "model": {"_component_": "logitless.models.qwen2_5_tiny"}, "model_init": model_init,
        "tokenizer": {"_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer", "path": str(src / "vocab.json"),
                      "merges_file": str(src / "merges.txt"), "special_tokens_path": str(src / "tokenizer.json")},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": str(src),
                         "checkpoint_files": ["model.safetensors"], "model_type": "QWEN2",
                         "output_dir": str(tmp_path / "out")}})
    model = qwen2_5_tiny()
    mgr = CheckpointManager(cfg.checkpointer if model_init == "checkpoint" else None, str(tmp_path / "out"),
                            export=ModelExport.for_run(cfg, model, lora=False))
    step = mgr.save(step=1, epoch=0, recipe_state={}, model_state=dict(model.state_dict()))
    for f in ("tokenizer.json", "vocab.json", "merges.txt"):
        assert (step / f).read_bytes() == (src / f).read_bytes(), f
    tok_cfg = json.loads((step / "tokenizer_config.json").read_text())
    gen = json.loads((step / "generation_config.json").read_text())
    if model_init == "checkpoint":
        assert tok_cfg["chat_template"] == "{{ 'the source template' }}" and gen["top_k"] == 20
    else:
        assert tok_cfg["eos_token"] == "<|im_end|>" and gen["eos_token_id"] == [2028, 2026]
    assert json.loads((step / "config.json").read_text())["torch_dtype"] == "float32"  # the source says bfloat16
    from torchtune import config as tt_config

    tok, tt = transformers.AutoTokenizer.from_pretrained(str(step)), tt_config.instantiate(cfg.tokenizer)
    for text in ("12 + 7 = 19<|im_end|>\n", "Reverse: river stone"):
        assert tok.encode(text, add_special_tokens=False) == tt.encode(text, add_bos=False, add_eos=False)
