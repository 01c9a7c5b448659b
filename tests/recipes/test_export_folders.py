"""Every checkpoint folder of a tiny run is a complete model folder: transformers (AutoModelForCausalLM +
AutoTokenizer) and PEFT (PeftModel on the base folder) load it and agree with torchtune's model."""

import json
import os
import pathlib

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from logitless.datasets import TINY_CHECKPOINT_DIR, tiny_qwen2_5_tokenizer
from logitless.models import lora_qwen2_5_tiny, qwen2_5_tiny
from logitless.training import CheckpointManager, complete_checkpoints
from full_sft_single_device import SFTRecipe

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


REPO = pathlib.Path(__file__).resolve().parents[2]
FAST = dict(max_steps=3, batch_size=4, gradient_accumulation_steps=1, save_every_n_steps=None,
            lr_scheduler__num_warmup_steps=1)
TEXTS = ["3+4", "12 + 7 = 19", "Hello world!  Two  spaces\n\nnew line", "héllo ünïcode 123456",
         "<|im_start|>user\nAdd 2 and 3<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>tail"]


@pytest.fixture
def repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)
    return REPO


def tiny_config(name, out, **overrides):
    cfg = OmegaConf.load(REPO / "configs" / f"{name}.yaml")
    cfg.output_dir = str(out)
    for k, v in overrides.items():
        OmegaConf.update(cfg, k.replace("__", "."), v, merge=False)
    return cfg


def stored_dtypes(folder):
    dtypes = set()
    for f in sorted(pathlib.Path(folder).glob("model*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            dtypes |= {fh.get_tensor(k).dtype for k in fh.keys()}
    return dtypes


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def assert_tokenizer_like_torchtune(folder):
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tt = tiny_qwen2_5_tokenizer()
    assert len(hf) == 2048
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False) == tt.encode(text, add_bos=False, add_eos=False), text
    assert hf.eos_token_id == tt.eos_id and hf.pad_token_id == tt.pad_id and hf.bos_token_id is None
    # the chat template lays messages out as torchtune's Qwen2.5 tokenizer does
    from torchtune.data import Message
    chat = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Add the two numbers.\n\n3 + 4"}]
    want, _ = tt.tokenize_messages([Message(role=m["role"], content=m["content"]) for m in chat]
                                   + [Message(role="assistant", content="")], add_eos=False)
    got = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    got = got["input_ids"] if isinstance(got, dict) or hasattr(got, "keys") else got
    assert list(got) == want


def assert_config_dtype_matches_weights(folder):
    (dtype,) = stored_dtypes(folder)
    config = json.loads((pathlib.Path(folder) / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    assert config.get("torch_dtype", name) == name and config.get("dtype", name) == name, config
    loaded = transformers.AutoConfig.from_pretrained(str(folder))
    assert getattr(loaded, "dtype", None) in (dtype, name)


@pytest.mark.parametrize("model_init", ["checkpoint", "random"])
def test_full_run_folders_load_in_transformers(repo_cwd, tmp_path, model_init):
    out = tmp_path / "full"
    recipe = SFTRecipe(tiny_config("tiny_full", out, model_init=model_init, **FAST))
    recipe.run()
    (step,) = complete_checkpoints(out)
    assert_tokenizer_like_torchtune(step)
    assert_config_dtype_matches_weights(step)
    gen = transformers.GenerationConfig.from_pretrained(str(step))
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert 2028 in eos and gen.pad_token_id == 2026
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(step)).eval()
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    trained = qwen2_5_tiny()  # torchtune's model on the trained weights (the recipe's returns hidden states)
    trained.load_state_dict(recipe.model.state_dict())
    with torch.no_grad():
        want = trained.eval()(tokens).float()
    torch.testing.assert_close(hf_logits(hf, tokens), want, rtol=1e-4, atol=1e-4)
    # everything written is listed in the completion marker
    meta = json.loads((step / "logitless_checkpoint.json").read_text())
    on_disk = {str(p.relative_to(step)) for p in step.rglob("*") if p.is_file()} - {"logitless_checkpoint.json"}
    assert set(meta["files"]) == on_disk


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A short tiny_lora run (once for the module): its config, recipe and only checkpoint folder."""
    out = tmp_path_factory.mktemp("lora")
    cwd = pathlib.Path.cwd()
    os.chdir(REPO)
    try:
        cfg = tiny_config("tiny_lora", out, **FAST)
        recipe = SFTRecipe(cfg, lora=True)
        recipe.run()
    finally:
        os.chdir(cwd)
    (step,) = complete_checkpoints(out)
    return cfg, recipe, step


def torchtune_lora_logits(cfg, recipe, step, tokens, tmp_path):
    """torchtune's LoRA model from the configured base + the saved (tune-format) adapters."""
    lora = lora_qwen2_5_tiny(**{k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "_component_"})
    base_sd = CheckpointManager(OmegaConf.create(dict(OmegaConf.to_container(cfg.checkpointer, resolve=True),
                                                      checkpoint_dir=str(TINY_CHECKPOINT_DIR))),
                                str(tmp_path)).load_model_state()
    lora.load_state_dict({**base_sd, **CheckpointManager.load_adapter_state(step)})
    assert all(torch.equal(v, recipe.model.state_dict()[k]) for k, v in lora.state_dict().items())
    with torch.no_grad():
        return lora.eval()(tokens).float()


TOKENS = torch.randint(0, 2026, (2, 24), generator=torch.Generator().manual_seed(0))


def test_lora_run_folder_is_the_merged_model(lora_run, tmp_path):
    cfg, recipe, step = lora_run
    assert_tokenizer_like_torchtune(step)
    assert_config_dtype_matches_weights(step)
    want = torchtune_lora_logits(cfg, recipe, step, TOKENS, tmp_path)
    # the folder itself is the merged model (no adapter applied on top of it a second time)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(step)).eval()
    torch.testing.assert_close(hf_logits(merged, TOKENS), want, rtol=1e-4, atol=1e-4)


def test_lora_run_adapter_loads_with_peft_on_the_base_folder(lora_run, tmp_path, peft_usable):
    cfg, recipe, step = lora_run
    want = torchtune_lora_logits(cfg, recipe, step, TOKENS, tmp_path)
    adapter_dir = step / "adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == cfg.model.lora_rank and config["lora_alpha"] == cfg.model.lora_alpha
    assert config["base_model_name_or_path"] == str((REPO / cfg.checkpointer.checkpoint_dir).resolve())
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj",
                                                       "gate_proj", "up_proj", "down_proj"])
    base = transformers.AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    torch.testing.assert_close(hf_logits(peft_model, TOKENS), want, rtol=1e-4, atol=1e-4)
