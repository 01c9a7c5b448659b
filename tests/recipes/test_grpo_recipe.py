"""grpo_single_device on the tiny config: end to end (CLI), metrics, exact resume, LoRA and full
references, and config errors raised before anything is built."""

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from logitless.rl.completion_log import read_completions
from grpo_single_device import GRPORecipe, run_grpo
from logitless.training import model as model_utils
from logitless.training.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["prompts_per_step=4", "num_generations=4", "micro_batch_size=8", "generation.max_new_tokens=3",
         "eval_num_prompts=4", "eval_every_n_steps=2", "log_every_n_steps=1", "cpu_threads=1"]


def tiny_cfg(tmp_path, *overrides):
    cfg = OmegaConf.load(ROOT / "configs/tiny_grpo.yaml")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"output_dir={tmp_path}", *SMALL, *overrides]))
    cfg.checkpointer.checkpoint_dir = str(ROOT / cfg.checkpointer.checkpoint_dir)
    return cfg


def _weights(step_dir):
    sd = {}
    for f in sorted(glob.glob(os.path.join(step_dir, "*.safetensors"))):
        sd.update(load_file(f))
    return sd


def test_cli_end_to_end(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "components"), str(ROOT / "recipes"),
                                                       os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(ROOT / "recipes/grpo_single_device.py"), "--config", str(ROOT / "configs/tiny_grpo.yaml"),
           f"output_dir={tmp_path}", "max_steps=2", *SMALL, "log_completions_every_n_steps=2", "peak_flops=1.0e12",
           f"checkpointer.checkpoint_dir={ROOT / 'components/logitless/rl/assets/tiny_grpo_warmstart'}"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    from logitless.training.metric_logging import read_disk_log

    log = read_disk_log(glob.glob(str(tmp_path / "logs" / "log_*.txt"))[0])
    for key in ("reward/mean", "reward/std", "reward/math_correctness/mean", "reward/math_correctness/std", "entropy",
                "clip_ratio/region", "completion_length/mean", "tokens_per_second", "peak_rss_gib", "loss",
                "grad_norm", "eval/accuracy", "sampling/logp_difference/mean", "sampling/logp_difference/max",
                "sampling/kl", "sampling/ratio_outside_cap", "sampling/importance_sampling_ratio/mean"):
        assert key in log, key
    # the sampler (the eager one on CPU, fp32, the policy's own weights) and the training pass agree
    assert max(log["sampling/logp_difference/max"].values()) < 1e-3
    assert sorted(log["reward/mean"]) == [1, 2]
    # the update's MFU against the given peak: its FLOPs over its time
    for step in (1, 2):
        flops, seconds = log["update_tflop"][step] * 1e12, log["time/update_s"][step]
        assert flops > 0 and log["update_mfu"][step] == pytest.approx(flops / (seconds * 1e12), rel=1e-3)
    assert not [k for k in log if k.startswith("reward/gsm8k")]  # named after the configured reward only
    # the completion table of step 2: in the run folder and in the disk logger's file
    table = read_completions(str(tmp_path / "logs" / "completions.jsonl"))
    in_log = read_completions(glob.glob(str(tmp_path / "logs" / "log_*.txt"))[0])
    assert table == in_log and len(table) == 8 and {r["step"] for r in table} == {2}
    assert set(table[0]) == {"step", "prompt", "completion", "math_correctness", "reward", "advantage"}
    assert (tmp_path / "step_000002" / "recipe_state.pt").is_file()


@pytest.mark.slow
def test_ctrl_c_ends_with_one_line_naming_the_last_checkpoint(tmp_path, ctrl_c):
    small = [o for o in SMALL if not o.startswith("eval_every")]
    args = ["run", "grpo_single_device", "--config", str(ROOT / "configs/tiny_grpo.yaml"), "max_steps=200",
            "save_every_n_steps=1", "keep_last_n_checkpoints=2", "eval_every_n_steps=null", *small]
    status, log, reports = ctrl_c(args, tmp_path / "run", after_step=1)
    assert status == 130, log[-3000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    from logitless.training import complete_checkpoints

    newest = complete_checkpoints(tmp_path / "run")[-1]
    (report,) = reports  # one line, naming the newest complete checkpoint
    assert log.count("Interrupted") == 1 and report[1] == newest, log[-3000:]
    assert 1 <= int(newest.name[5:]) <= report[0] < 200


LORA = ["model._component_=logitless.models.lora_qwen2_5_tiny", "model.lora_attn_modules=[q_proj,v_proj]",
        "model.lora_rank=4", "model.lora_alpha=8", "optimizer.lr=1e-2", "loss.beta=0.05"]


# Dynamic sampling draws further prompts from the prompt stream (its position is saved), and the KL
# reference moves towards the policy every step (it is saved once it has moved): with this seed every
# step samples a second round, and some step runs out of rounds and trains on fewer than 4 groups.
DYNAMIC_SYNC = ["dynamic_sampling=true", "dynamic_sampling_max_rounds=2", "loss.beta=0.05",
                "ref_model_sync_steps=1", "ref_model_mixup_alpha=0.5"]


@pytest.mark.parametrize("extra", [[], LORA, DYNAMIC_SYNC], ids=["full", "lora", "dynamic_sampling_ref_sync"])
def test_exact_resume(tmp_path, extra):
    straight = GRPORecipe(tiny_cfg(tmp_path / "a", "max_steps=4", "save_every_n_steps=2", *extra)).run()
    GRPORecipe(tiny_cfg(tmp_path / "b", "max_steps=2", *extra)).run()
    resumed = GRPORecipe(tiny_cfg(tmp_path / "b", "max_steps=4", "resume_from_checkpoint=True", *extra)).run()
    assert [h["step"] for h in resumed] == [3, 4]
    keys = ["reward/mean", "loss", "grad_norm", "entropy", "completion_length/mean"]
    if extra is DYNAMIC_SYNC:
        keys += ["kl", "dynamic_sampling/rounds", "dynamic_sampling/filled_fraction", "dynamic_sampling/dropped_groups"]
        assert all(h["dynamic_sampling/rounds"] == 2 for h in straight)  # refills drew further prompts
        assert min(h["dynamic_sampling/filled_fraction"] for h in straight) < 1
        assert all(h["kl"] > 0 for h in straight[1:])
    for want, got in zip(straight[2:], resumed):
        for key in keys:
            assert want[key] == got[key], (key, want[key], got[key])
    if extra is LORA:  # compare the saved adapters
        a = torch.load(tmp_path / "a" / "step_000004" / "adapter_model.pt")
        b = torch.load(tmp_path / "b" / "step_000004" / "adapter_model.pt")
    else:
        a, b = _weights(tmp_path / "a" / "step_000004"), _weights(tmp_path / "b" / "step_000004")
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


TOOLS_SMALL = ["prompts_per_step=4", "num_generations=4", "micro_batch_size=16", "generation.max_new_tokens=72",
               "dataset.num_samples=16", "eval_every_n_steps=null", "log_every_n_steps=1",
               "log_completions_every_n_steps=null", "cpu_threads=1"]


def tiny_tools_cfg(tmp_path, *overrides):
    cfg = OmegaConf.load(ROOT / "configs/tiny_grpo_tools.yaml")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"output_dir={tmp_path}", *TOOLS_SMALL, *overrides]))
    cfg.checkpointer.checkpoint_dir = str(ROOT / "components/logitless/rl/assets/tiny_grpo_tools_warmstart")
    return cfg


@pytest.mark.slow
def test_compiled_turn_sampler_in_the_recipe_samples_what_the_eager_one_does(tmp_path):
    """generation.backend: compiled on a tool config (the compiled turn sampler, uncompiled on the CPU):
    two steps with the same rollouts as the eager turn sampler, so the same rewards, turns and calls."""
    eager = GRPORecipe(tiny_tools_cfg(tmp_path / "eager", "max_steps=2")).run()
    compiled = GRPORecipe(tiny_tools_cfg(tmp_path / "compiled", "max_steps=2", "generation.backend=compiled",
                                         "generation.fused_projections=shared")).run()
    assert sum(h["tools/calls_per_row"] for h in eager) > 0
    for want, got in zip(eager, compiled):
        for key in ("reward/mean", "turns/mean", "tools/calls_per_row", "sampled_tokens/mean",
                    "completion_length/mean"):
            assert want[key] == got[key], (key, want[key], got[key])
        assert abs(want["loss"] - got["loss"]) < 1e-4


@pytest.mark.slow
def test_exact_resume_with_tool_turns(tmp_path):
    """Draws are keyed by (row, position), so they do not depend on the tools' timing: a run resumed
    at step 2 equals the straight run (metrics of the turns included, final weights bit for bit)."""
    straight = GRPORecipe(tiny_tools_cfg(tmp_path / "a", "max_steps=4", "save_every_n_steps=2")).run()
    GRPORecipe(tiny_tools_cfg(tmp_path / "b", "max_steps=2", "save_every_n_steps=2")).run()
    resumed = GRPORecipe(tiny_tools_cfg(tmp_path / "b", "max_steps=4", "save_every_n_steps=2",
                                        "resume_from_checkpoint=True")).run()
    assert [h["step"] for h in resumed] == [3, 4]
    assert sum(h["tools/calls_per_row"] for h in straight) > 0  # the policy called the tool
    keys = ["reward/mean", "loss", "grad_norm", "entropy", "completion_length/mean", "turns/mean",
            "tools/calls_per_row", "tools/errors_per_row", "sampled_tokens/mean"]
    for want, got in zip(straight[2:], resumed):
        for key in keys:
            assert want[key] == got[key], (key, want[key], got[key])
    a, b = _weights(tmp_path / "a" / "step_000004"), _weights(tmp_path / "b" / "step_000004")
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_entry_point_frees_the_finished_run_before_it_returns(tmp_path, refs_at_cleanup, one_rank_launch):
    """The policy, its optimizer and the sampler are gone when ``run_grpo`` returns: sharded modules
    left to the interpreter's exit can abort a finished distributed run (gloo, SIGABRT after the
    final checkpoint); FSDP2 on a one-rank group puts them in reference cycles."""
    alive = refs_at_cleanup(GRPORecipe, "model", "optimizer", "sampler")
    run_grpo(tiny_cfg(tmp_path, "max_steps=1"), distributed=True)
    assert len(alive) == 3 and [r() for r in alive] == [None] * 3


def test_full_finetune_with_frozen_reference(tmp_path):
    recipe = GRPORecipe(tiny_cfg(tmp_path, "max_steps=2", "loss.beta=0.05", "save_final_checkpoint=False",
                                 "optimizer.lr=1e-2", "num_iterations=1"))  # step 1's metrics: before any update
    hist = recipe.run()
    assert recipe.reference is not None and recipe.reference.model is not recipe.model
    assert not any(p.requires_grad for p in recipe.reference.model.parameters())
    assert hist[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert hist[1]["kl"] > 0


def test_lora_reference_is_the_policy_with_adapters_disabled(tmp_path):
    recipe = GRPORecipe(tiny_cfg(
        tmp_path, "max_steps=2", "loss.beta=0.05", "optimizer.lr=5e-2", "save_final_checkpoint=False",
        "num_iterations=2",
        "model._component_=logitless.models.lora_qwen2_5_tiny", "model.lora_attn_modules=[q_proj,v_proj]",
        "model.lora_rank=4", "model.lora_alpha=8"))
    hist = recipe.run()
    assert recipe.reference.model is recipe.model and recipe.reference.disable_adapters
    trainable = [n for n, p in recipe.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # metrics are those of the last iteration: after one optimizer step the policy has left the
    # reference (KL > 0) and the recomputed old log-probs (ratios != 1)
    assert hist[0]["kl"] > 0 and hist[1]["kl"] > 0


def test_dora_starts_at_the_base_trains_and_saves_its_magnitudes(tmp_path):
    """DoRA on the warm-start checkpoint: the magnitudes are adapter parameters (missing from the base
    checkpoint, trained, saved), initialised to the base weights' row norms so that the policy starts
    equal to the base (KL 0 to the adapters-disabled reference before the first update)."""
    recipe = GRPORecipe(tiny_cfg(tmp_path, "max_steps=2", "num_iterations=1", *LORA, "model.use_dora=True"))
    hist = recipe.run()
    assert hist[0]["kl"] == pytest.approx(0.0, abs=1e-6) and hist[1]["kl"] > 0
    trainable = {n for n, p in recipe.model.named_parameters() if p.requires_grad}
    adapter = torch.load(tmp_path / "step_000002" / "adapter_model.pt")
    magnitudes = sorted(k for k in adapter if k.endswith(".magnitude"))
    assert len(magnitudes) == 2 * 2 and set(magnitudes) <= trainable  # 2 layers x (q_proj, v_proj)
    for key in magnitudes:
        base_rows = recipe.model.state_dict()[key.removesuffix("magnitude") + "weight"].norm(dim=1)
        assert not torch.equal(adapter[key], base_rows), key  # trained
        # started at ||W|| per row: two AdamW steps (lr 1e-2, no decay) move an entry by at most ~2 lr
        torch.testing.assert_close(adapter[key], base_rows, rtol=0.0, atol=2.01e-2, msg=key)


@pytest.mark.parametrize("override, match", [
    ("num_generations=1", "num_generations"),
    ("micro_batch_size=5", "micro_batch_size"),
    ("loss.temperature=0.5", "loss.temperature"),
    ("rewards=[{function: logitless.rl.rewards.nope}]", "cannot be imported"),
    ("generation.temprature=1.0", "generation.temprature"),
    ("dynamic_sampling=maybe", "config key 'dynamic_sampling': expected bool"),
    ("dynamic_sampling_max_rounds=0", "config key 'dynamic_sampling_max_rounds': expected a value >= 1, got 0"),
    ("advantage_estimator=ppo", "config key 'advantage_estimator': expected one of .*got 'ppo'"),
    ("scale_rewards=token", "config key 'scale_rewards': expected one of .*got 'token'"),
    ("ref_model_sync_steps=0", "config key 'ref_model_sync_steps': expected a value >= 1, got 0"),
    ("ref_model_sync_steps=2", "config key 'ref_model_sync_steps': 2 syncs the KL reference, but loss.beta=0.0"),
    ("ref_model_mixup_alpha=1.5", "config key 'ref_model_mixup_alpha': expected a value in \\(0, 1\\]"),
])
def test_config_errors(tmp_path, override, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        GRPORecipe(tiny_cfg(tmp_path, override))


def test_reference_sync_is_refused_under_lora(tmp_path):
    with pytest.raises(ConfigError, match="'ref_model_sync_steps': 2 is not supported with a LoRA policy"):
        GRPORecipe(tiny_cfg(tmp_path, "ref_model_sync_steps=2", *LORA))


def test_dynamic_sampling_trains_on_groups_with_spread_and_rewards_see_token_lengths(tmp_path):
    """Every group a step trains on has a reward spread; the prompt stream advances by the rounds
    sampled; the soft overlong punishment sees each completion's token count (training and eval)."""
    cfg = tiny_cfg(tmp_path, "max_steps=2", "dynamic_sampling=true", "dynamic_sampling_max_rounds=3",
                   "save_final_checkpoint=False", "log_completions_every_n_steps=1", "log_completions_num_rows=null")
    cfg.rewards.append({"function": {"_component_": "logitless.rl.length_rewards.SoftOverlongPunishment",
                                     "max_completion_length": "${generation.max_new_tokens}", "overlong_buffer": 2},
                        "weight": 0.1, "name": "overlong"})
    recipe = GRPORecipe(cfg)
    hist = recipe.run()
    assert recipe.prompts_drawn == sum(h["dynamic_sampling/sampled_groups"] for h in hist)
    assert max(h["dynamic_sampling/rounds"] for h in hist) > 1 and "eval/accuracy" in hist[-1]
    rows = read_completions(str(tmp_path / "logs" / "completions.jsonl"))
    for step, h in enumerate(hist, 1):
        got = [r for r in rows if r["step"] == step]
        assert len(got) == 4 * 4 * h["dynamic_sampling/filled_fraction"]
        for g in range(0, len(got), 4):
            assert len({r["reward"] for r in got[g:g + 4]}) > 1  # a reward spread in every trained group
        assert h["dynamic_sampling/batch_reward_mean"] == pytest.approx(sum(r["reward"] for r in got) / len(got))
        # max_new_tokens 3, buffer 2: 1 token -> 0, 2 -> -0.5, 3 -> -1
        assert {r["overlong"] for r in got} <= {0.0, -0.5, -1.0} and any(r["overlong"] < 0 for r in got)
        assert all(r["reward"] == pytest.approx(r["math_correctness"] + 0.1 * r["overlong"]) for r in got)


@pytest.mark.parametrize("override, match", [
    ("loss.sampler_correction_mode=tokn", r"config key 'loss.sampler_correction_mode' \(logitless.losses.GRPOLoss\): sampler_correction_mode "
                                          r"must be one of"),
    ("loss.top_entropy_quantile=2", r"config key 'loss.top_entropy_quantile' \(logitless.losses.GRPOLoss\): .* in \[0, 1\]"),
    ("loss.loss_type=cispo", r"config key 'loss.epsilon_high' \(logitless.losses.GRPOLoss\): epsilon_high is the cap of the importance weight "
                             r"with loss_type='cispo' \(a ratio >= 1.*got 0.28"),
    ("loss.sampler_corection=false", r"config key 'loss.sampler_corection': .* no argument 'sampler_corection'"),
])
def test_loss_options_are_checked_with_the_config(tmp_path, override, match):
    with pytest.raises(ConfigError, match=match):
        GRPORecipe(tiny_cfg(tmp_path, override))
    assert not any(tmp_path.iterdir())  # before the output folder is claimed


def test_prompt_sharing_matches_expanded_recipe_step(tmp_path):
    """prompt_sharing on (one packed sequence per group) vs off: same sampling, same first update."""
    shared = GRPORecipe(tiny_cfg(tmp_path / "on", "max_steps=2", "prompt_sharing=true", "loss.beta=0.05",
                                 "num_iterations=2", "save_final_checkpoint=False"))
    expanded = GRPORecipe(tiny_cfg(tmp_path / "off", "max_steps=1", "prompt_sharing=false", "loss.beta=0.05",
                                   "num_iterations=2", "save_final_checkpoint=False"))
    on, off = shared.run(), expanded.run()
    assert shared.prompt_sharing and not expanded.prompt_sharing
    assert [h["step"] for h in on] == [1, 2] and all(torch.isfinite(torch.tensor(h["loss"])) for h in on)
    assert on[0]["reward/mean"] == off[0]["reward/mean"]
    for key in ("loss", "grad_norm", "entropy", "kl", "clip_ratio/region"):
        assert on[0][key] == pytest.approx(off[0][key], rel=1e-4, abs=1e-6), key
    assert GRPORecipe(tiny_cfg(tmp_path, "micro_batch_size=2")).prompt_sharing is False  # auto: not whole groups


def test_prompt_sharing_decides_per_step(tmp_path, monkeypatch):
    """auto packs with cascade attention: the update of prompt_sharing=false, up to summation order.
    The dense-mask path runs groups past its length limit expanded, with the same result as
    prompt_sharing=false; prompt_sharing=true still packs them."""
    import sys

    monkeypatch.setattr(sys.modules["logitless.rl.shared_batch"], "AUTO_MAX_PACKED_SDPA", 1)
    args = ("max_steps=1", "save_final_checkpoint=False")
    auto = GRPORecipe(tiny_cfg(tmp_path / "auto", "prompt_sharing=auto", *args)).run()
    dense = GRPORecipe(tiny_cfg(tmp_path / "dense", "prompt_sharing_attention=sdpa", *args)).run()
    off = GRPORecipe(tiny_cfg(tmp_path / "off", "prompt_sharing=false", *args)).run()
    on = GRPORecipe(tiny_cfg(tmp_path / "on", "prompt_sharing=true", "prompt_sharing_attention=sdpa", *args)).run()
    assert [m[0]["prompt_sharing"] for m in (auto, dense, off, on)] == [1.0, 0.0, 0.0, 1.0]
    assert dense[0]["loss"] == off[0]["loss"] and dense[0]["grad_norm"] == off[0]["grad_norm"]
    assert auto[0]["loss"] == pytest.approx(off[0]["loss"], rel=1e-5, abs=1e-7)
    assert auto[0]["grad_norm"] == pytest.approx(off[0]["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("overrides, match", [
    (["prompt_sharing=true", "micro_batch_size=2"],
     "config key 'micro_batch_size': 2 must be a multiple of num_generations=4"),
    (["prompt_sharing=sometimes"], "prompt_sharing"),
    (["prompt_sharing_attention=dense"], "prompt_sharing_attention"),
    (["prompt_sharing_attention=flex", "device=cpu"], "'prompt_sharing_attention': 'flex' needs a CUDA device"),
])
def test_prompt_sharing_config_errors(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        GRPORecipe(tiny_cfg(tmp_path, *overrides))


def test_qwen_config_validates_with_random_weights_and_synthetic_prompts():
    from logitless.rl.config import validate_grpo_config

    cfg = OmegaConf.load(ROOT / "configs/qwen_grpo.yaml")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([
        "model_init=random", "tokenizer._component_=logitless.datasets.synthetic_tokenizer",
        "dataset._component_=logitless.rl.prompts.synthetic_prompt_dataset", "eval_every_n_steps=null"]))
    validate_grpo_config(cfg)
    assert cfg.loss.temperature == cfg.generation.temperature
    with pytest.raises(ConfigError, match="does not exist"):  # the real config points at tune download paths
        validate_grpo_config(OmegaConf.load(ROOT / "configs/qwen_grpo.yaml"))


def test_generation_decode_attention_is_checked_from_yaml():
    from logitless.rl.config import validate_grpo_config

    def qwen(*overrides):
        cfg = OmegaConf.load(ROOT / "configs/qwen_grpo.yaml")
        return OmegaConf.merge(cfg, OmegaConf.from_dotlist([
            "model_init=random", "tokenizer._component_=logitless.datasets.synthetic_tokenizer",
            "dataset._component_=logitless.rl.prompts.synthetic_prompt_dataset", "eval_every_n_steps=null",
            "generation.backend=compiled", *overrides]))

    assert validate_grpo_config(qwen("generation.decode_attention=split_k")).generation.decode_attention == "split_k"
    with pytest.raises(ConfigError, match="config key 'generation.decode_attention': decode_attention must be one "
                                          "of \\('auto', 'sdpa', 'split_k'\\), got 'flash'"):
        validate_grpo_config(qwen("generation.decode_attention=flash"))
    with pytest.raises(ConfigError, match="config key 'generation.decode_linear': unknown"):  # an experiment now
        validate_grpo_config(qwen("generation.decode_linear=triton"))


def test_another_runs_folder_and_changed_group_size_are_refused_before_the_policy_is_built(tmp_path, monkeypatch):
    GRPORecipe(tiny_cfg(tmp_path, "max_steps=1")).run()
    before = sorted(p.name for p in tmp_path.iterdir())

    def fail(*a, **k):
        raise AssertionError("the policy was built before the output folder / resume was checked")

    monkeypatch.setattr(model_utils, "build_model", fail)
    with pytest.raises(ConfigError, match=r"config key 'output_dir': .* is not empty: it holds files of run .*step_000001"
                                          r".*resume_from_checkpoint=auto.*another output_dir"):
        GRPORecipe(tiny_cfg(tmp_path, "max_steps=2", "num_generations=2")).run()
    with pytest.raises(ConfigError, match=r"'num_generations': 4 -> 2.*resume_allow_changes=\[num_generations\]"):
        GRPORecipe(tiny_cfg(tmp_path, "max_steps=2", "num_generations=2", "resume_from_checkpoint=auto")).run()
    assert sorted(p.name for p in tmp_path.iterdir()) == before



def test_a_locked_output_dir_stops_grpo_before_anything_is_built(tmp_path, monkeypatch):
    from logitless.training.run_lock import OutputDirInUseError, OutputDirLock

    def fail(*a, **k):
        raise AssertionError("something was built while another run held output_dir")

    monkeypatch.setattr(model_utils, "build_model", fail)
    monkeypatch.setattr(sys.modules["grpo_single_device"], "build_prompt_datasets", fail)
    with OutputDirLock(tmp_path):
        with pytest.raises(OutputDirInUseError, match=rf"'{tmp_path}' is in use by another run: pid {os.getpid()} "):
            GRPORecipe(tiny_cfg(tmp_path, "max_steps=1")).run()
    assert list(tmp_path.iterdir()) == []


REWARD_MODULE = '''
SEEN = []

def sum_from_columns(prompts, completions, a, b, **kwargs):
    SEEN.append(sorted(kwargs))
    return [float(c.strip() == str(x + y)) for c, x, y in zip(completions, a, b)]
'''


def test_chat_dataset_columns_reach_rewards_and_completion_table(tmp_path, monkeypatch):
    """configs/tiny_grpo_chat.yaml (conversational prompts) with a reward reading the dataset's ``a`` and
    ``b`` columns: it agrees with math_correctness on ``answer`` for every completion, and the completion
    table holds each reward and the group advantage computed from the rows themselves."""
    (tmp_path / "column_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = OmegaConf.load(ROOT / "configs/tiny_grpo_chat.yaml")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([
        f"output_dir={tmp_path / 'run'}", *SMALL, "max_steps=2", "eval_every_n_steps=null",
        "save_final_checkpoint=False",        "log_completions_every_n_steps=1", "log_completions_num_rows=null"]))
    cfg.rewards.append({"function": "column_rewards.sum_from_columns", "weight": 0.0})
    cfg.checkpointer.checkpoint_dir = str(ROOT / cfg.checkpointer.checkpoint_dir)
    for key in ("dataset", "eval_dataset"):
        cfg[key].data_files = str(ROOT / cfg[key].data_files)
    hist = GRPORecipe(cfg).run()
    import column_rewards

    # every other column and the sampled token ids, once per step
    assert column_rewards.SEEN == [["answer", "completion_ids"], ["answer", "completion_ids"]]
    rows = read_completions(str(tmp_path / "run" / "logs" / "completions.jsonl"))
    assert [r["step"] for r in rows] == [1] * 16 + [2] * 16
    for r in rows:
        assert r["prompt"].startswith("<|im_start|>system\n") and r["prompt"].endswith("<|im_start|>assistant\n")
        assert r["sum_from_columns"] == r["math_correctness"] == r["reward"]
    for step in (1, 2):
        got = [r for r in rows if r["step"] == step]
        assert hist[step - 1]["reward/math_correctness/mean"] == pytest.approx(
            sum(r["reward"] for r in got) / 16, abs=1e-6)
        for g in range(4):
            group = torch.tensor([r["reward"] for r in got[4 * g:4 * g + 4]], dtype=torch.float64)
            std = group.std()
            want = torch.zeros(4) if std == 0 else (group - group.mean()) / (std + 1e-4)
            assert [r["advantage"] for r in got[4 * g:4 * g + 4]] == pytest.approx(want.tolist(), abs=1e-5)


def test_compiled_layers_train_like_eager_layers(tmp_path, monkeypatch):
    """``compile: True`` (torchtune's per-layer compile, as the SFT recipes take it) gives the update
    the same steps as the eager layers; the samplers keep running the layers uncompiled."""
    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")  # torchtune's compile_model reads it
    torch._dynamo.reset()
    try:
        common = ("max_steps=2", "save_final_checkpoint=False", "eval_every_n_steps=null")
        compiled = GRPORecipe(tiny_cfg(tmp_path / "compiled", "compile=true", *common))
        eager = GRPORecipe(tiny_cfg(tmp_path / "eager", *common))
        on, off = compiled.run(), eager.run()
    finally:
        torch._dynamo.reset()
    from torchtune.modules import TransformerSelfAttentionLayer

    def compiled_layers(recipe):
        layers = [m for m in recipe.model.modules() if isinstance(m, TransformerSelfAttentionLayer)]
        return len(layers), sum(getattr(m, "_compiled_call_impl", None) is not None for m in layers)

    n, k = compiled_layers(compiled)
    assert n > 0 and k == n and compiled_layers(eager)[1] == 0
    assert [h["step"] for h in on] == [1, 2]
    for a, b in zip(on, off):
        assert a["reward/mean"] == b["reward/mean"]  # same samples: the samplers ran the same layers
        for key in ("loss", "grad_norm", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
