"""The Qwen3 and Llama 3.x configs. The tiny Qwen3 (a Hugging Face folder read by from_hf, hf_tokenizer
and HFCheckpointer) trains on CPU: full SFT (loss falls, exact resume from its own checkpoint), LoRA SFT
(PEFT adapter on the base equals the merged folder in transformers) and a few GRPO steps (Qwen3's chat
template with thinking off, rewards on the answer, export). The real configs validate with the
random-weight overrides their headers document, and name their missing download without them."""

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from full_sft_single_device import SFTRecipe
from grpo_single_device import GRPORecipe
from logitless.rl.completion_log import read_completions
from logitless.rl.config import validate_grpo_config
from logitless.training import complete_checkpoints
from logitless.training.config import ConfigError
from logitless.training.sft_config import validate_sft_config

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
FAST = dict(max_steps=6, batch_size=4, gradient_accumulation_steps=1, save_every_n_steps=None,
            lr_scheduler__num_warmup_steps=1)
REWARD_MODULE = '''
def visible(prompts, completions, **columns):
    """The share of the answer's characters that are not whitespace: spread out for a random policy."""
    return [sum(not ch.isspace() for ch in c) / max(len(c), 1) for c in completions]
'''


def tiny(name, out, **overrides):
    cfg = OmegaConf.load(ROOT / "configs" / f"{name}.yaml")
    cfg.output_dir = str(out)
    for k, v in overrides.items():
        OmegaConf.update(cfg, k.replace("__", "."), v, merge=False)
    return cfg


def logits_of(folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_tiny_qwen3_sft_loss_falls_and_resumes_exactly_from_its_own_folder(tmp_path):
    over = dict(FAST, save_every_n_steps=3, keep_last_n_checkpoints=None)
    losses = SFTRecipe(tiny("tiny_qwen3_full", tmp_path / "a", **over)).run()
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 1.0, losses
    step = tmp_path / "a" / "step_000003"
    (tmp_path / "b").mkdir()
    shutil.copytree(step, tmp_path / "b" / step.name)
    resumed = SFTRecipe(tiny("tiny_qwen3_full", tmp_path / "b", resume_from_checkpoint=True, **over)).run()
    assert resumed == losses[3:]  # the QWEN3 weights read back from the step folder by HFCheckpointer
    final = complete_checkpoints(tmp_path / "a")[-1]
    tok = transformers.AutoTokenizer.from_pretrained(str(final))
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3's template came along
    assert json.loads((final / "config.json").read_text())["model_type"] == "qwen3"


def test_tiny_qwen3_fsdp2_on_one_rank_trains_and_saves_as_one_device(tmp_path, one_rank_launch):
    """FSDP2 shards the QKNormAttention layers, gathers them for the save: the same folder as one device."""
    from full_sft_single_device import run_sft

    over = dict(FAST, max_steps=3)
    SFTRecipe(tiny("tiny_qwen3_full", tmp_path / "one", **over)).run()
    run_sft(tiny("tiny_qwen3_full", tmp_path / "fsdp", **over), lora=False, distributed=True)
    one, fsdp = (load_file(str(complete_checkpoints(tmp_path / d)[-1] / "model-00001-of-00001.safetensors"))
                 for d in ("one", "fsdp"))
    assert one.keys() == fsdp.keys()
    for k in one:
        torch.testing.assert_close(fsdp[k], one[k], rtol=1e-5, atol=1e-6, msg=k)


def test_tiny_qwen3_lora_sft_exports_a_peft_adapter_for_qwen3(tmp_path, peft_usable):
    import peft

    cfg = tiny("tiny_qwen3_full", tmp_path / "lora", **dict(FAST, max_steps=3), optimizer__lr=1e-2)
    cfg.model.update(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
                     lora_rank=4, lora_alpha=8.0)
    SFTRecipe(cfg, lora=True).run()
    step = complete_checkpoints(tmp_path / "lora")[-1]
    tokens = torch.randint(0, 2026, (2, 20), generator=torch.Generator().manual_seed(0))
    base = transformers.AutoModelForCausalLM.from_pretrained(cfg.checkpointer.checkpoint_dir, dtype=torch.float32)
    with torch.no_grad():
        peft_logits = peft.PeftModel.from_pretrained(base, str(step / "adapter")).eval()(input_ids=tokens).logits
    merged = logits_of(step, tokens)
    assert (merged - logits_of(cfg.checkpointer.checkpoint_dir, tokens)).abs().max() > 1e-3  # the adapters trained
    torch.testing.assert_close(peft_logits, merged, rtol=0, atol=1e-4)


def test_tiny_qwen3_grpo_steps_update_the_policy_and_export(tmp_path, monkeypatch):
    (tmp_path / "visible_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tiny("tiny_qwen3_grpo", tmp_path / "run", max_steps=2, prompts_per_step=4, num_generations=4,
               micro_batch_size=16, eval_every_n_steps=None, log_completions_every_n_steps=1,
               log_completions_num_rows=None, cpu_threads=1)
    cfg.rewards.append({"function": "visible_reward.visible", "weight": 1.0})
    history = GRPORecipe(cfg).run()
    assert len(history) == 2 and all(h["reward/visible/std"] > 0 for h in history)  # advantages to learn from
    rows = read_completions(str(tmp_path / "run" / "logs" / "completions.jsonl"))
    assert len(rows) == 2 * 16
    assert all(r["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for r in rows)
    step = complete_checkpoints(tmp_path / "run")[-1]
    base = load_file(str(Path(cfg.checkpointer.checkpoint_dir) / "model.safetensors"))
    trained = load_file(str(step / "model-00001-of-00001.safetensors"))
    assert set(trained) == set(base)
    assert any(not torch.equal(trained[k].float(), base[k].float()) for k in base)
    logits_of(step, torch.tensor([[1, 2, 3]]))


def documented_random_overrides(name):
    """The ``tune run ... model_init=random ...`` command of a config's header, as CLI overrides."""
    lines = (ROOT / "configs" / f"{name}.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "tune run" in line and "model_init=random" in line)
    command = []
    for line in lines[start:]:
        command.append(line.lstrip("#").strip().rstrip("\\"))
        if not line.rstrip().endswith("\\"):
            break
    args = shlex.split(" ".join(command))
    return args[args.index("--config") + 2:]


def apply_overrides(cfg, overrides):
    """What ``tune run``'s parser does with ``key=value`` and ``~key`` overrides."""
    for arg in overrides:
        if arg.startswith("~"):
            parent, _, leaf = arg[1:].rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            del node[leaf]
        else:
            cfg.merge_with(OmegaConf.from_dotlist([arg]))
    return cfg


@pytest.mark.parametrize("name", ["qwen3_1_7b_grpo", "qwen3_1_7b_grpo_thinking", "qwen3_8b_lora_grpo",
                                  "llama3_2_1b_grpo", "qwen3_1_7b_full", "qwen3_1_7b_lora", "qwen_tools_grpo"])
def test_real_configs_run_with_the_documented_random_weight_overrides(tmp_path, name):
    from torchtune import config as tt_config

    grpo = name.endswith(("grpo", "thinking"))
    validate = validate_grpo_config if grpo else (lambda c: validate_sft_config(c, lora=name.endswith("lora")))
    raw = OmegaConf.load(ROOT / "configs" / f"{name}.yaml")
    with pytest.raises(ConfigError, match=rf"'{raw.checkpointer.checkpoint_dir}[^']*' does not exist"):
        validate(raw)  # without overrides: the download it needs, named
    cfg = apply_overrides(OmegaConf.load(ROOT / "configs" / f"{name}.yaml"), documented_random_overrides(name))
    cfg.output_dir = str(tmp_path)
    validate(cfg)
    if cfg.get("tools"):  # the prompts render with the tool's schema, as the recipe's set-up does
        from logitless.generation.tools.config import build_tool_turns
        from logitless.rl.prompt_sets import build_prompt_datasets

        tokenizer, dataset, _ = build_prompt_datasets(cfg)
        turns = build_tool_turns(cfg, tokenizer, tokenizer.stop_tokens)
        assert '"name": "python"' in turns.render_prompts(dataset)[0]["prompt"]
    with torch.device("meta"):
        model = tt_config.instantiate(cfg.model)
    family = "llama" if name.startswith("llama") else ("qwen2" if name.startswith("qwen_") else "qwen3")
    from logitless.models import model_family

    assert model_family(model) == family
    assert ("lora_rank" in cfg.model) == any("lora_" in k for k in model.state_dict())
