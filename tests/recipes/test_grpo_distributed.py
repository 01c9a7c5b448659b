"""grpo_distributed on two CPU processes (FSDP2 over gloo, fp32): the same per-step metrics and final
weights as grpo_single_device on the same seed, exact resume from a mid-run checkpoint, and config
errors raised before anything is built."""

import glob
import os
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from safetensors.torch import load_file

from grpo_single_device import GRPORecipe
from logitless.training import read_disk_log
from logitless.training.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
# 8 prompts x G=4: 4 prompts and 2 micro-batches of 8 completions per rank (4 on one device). beta > 0
# (a sharded frozen reference), two iterations (old log-probs), batch-scaled advantages (global std).
OVERRIDES = ["prompts_per_step=8", "num_generations=4", "micro_batch_size=8", "generation.max_new_tokens=3",
             "max_steps=4", "save_every_n_steps=2", "keep_last_n_checkpoints=null", "eval_every_n_steps=2",
             "eval_num_prompts=5", "loss.beta=0.05", "num_iterations=2", "scale_rewards=batch",
             "cpu_threads=1", "device=cpu"]
COMPARED = ("reward/mean", "reward/std", "reward/math_correctness/mean", "loss", "kl", "grad_norm", "entropy",
            "clip_ratio/region", "completion_length/mean", "truncated_fraction", "num_loss_tokens", "eval/accuracy")


def tiny_cfg(out, *overrides):
    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "configs/tiny_grpo.yaml"),
                          OmegaConf.from_dotlist([f"output_dir={out}", *overrides]))
    cfg.checkpointer.checkpoint_dir = str(ROOT / cfg.checkpointer.checkpoint_dir)
    return cfg


def logged(out):
    (path,) = glob.glob(os.path.join(out, "logs", "log_*.txt"))
    return read_disk_log(path)


def weights(step_dir):
    return {k: v for f in sorted(glob.glob(os.path.join(step_dir, "*.safetensors"))) for k, v in load_file(f).items()}


def run_two_ranks(tune_cli, out, *extra):
    args = ["run", "--nproc_per_node", "2", "grpo_distributed", "--config", "configs/tiny_grpo.yaml", *OVERRIDES, *extra]
    p = tune_cli(args, out, env={"OMP_NUM_THREADS": "1"})
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log[-4000:]
    return logged(out)


@pytest.mark.slow
def test_two_cpu_ranks_match_single_device_and_resume_exactly(tmp_path, tune_cli):
    dist = run_two_ranks(tune_cli, tmp_path / "dist")
    single = GRPORecipe(tiny_cfg(tmp_path / "single", *OVERRIDES)).run()
    assert sorted(dist["loss"]) == [1, 2, 3, 4]
    assert any(h["reward/mean"] > 0 for h in single) and single[-1]["kl"] > 0  # the comparison has signal
    # Same completions (per-prompt sampling streams); the numbers differ only by summation order
    # (other batch shapes and padding per rank, the gradient reduce-scatter): fp32, rel 1e-4.
    for h in single:
        for key in COMPARED:
            if key in h:
                assert dist[key][h["step"]] == pytest.approx(h[key], rel=1e-4, abs=1e-6), (h["step"], key)
    # Final weights: each tensor within 1% of how far training moved it (0.2% at most here). Not the
    # key biases: their exact gradient is zero (a key bias adds the same q.b to all of a query's
    # scores), so each run moves them by its own rounding noise, which AdamW scales to lr-sized steps.
    a, b = weights(tmp_path / "dist" / "step_000004"), weights(tmp_path / "single" / "step_000004")
    start = weights(ROOT / "components/logitless/rl/assets/tiny_grpo_warmstart")
    assert a.keys() == b.keys() == start.keys()
    for k in (k for k in a if not k.endswith("k_proj.bias")):
        moved = (b[k] - start[k]).abs().max()
        assert moved > 0 and (a[k] - b[k]).abs().max() <= 0.01 * moved, k
    # a copy of the step-2 checkpoint (rank 0 wrote HF weights, the full optimizer state and every
    # rank's RNG) resumes to the same steps 3 and 4
    os.makedirs(tmp_path / "resumed")
    shutil.copytree(tmp_path / "dist" / "step_000002", tmp_path / "resumed" / "step_000002")
    resumed = run_two_ranks(tune_cli, tmp_path / "resumed", "resume_from_checkpoint=auto")
    assert sorted(resumed["loss"]) == [3, 4]
    for key in COMPARED:
        for step in set(dist[key]) - {1, 2}:
            assert resumed[key][step] == pytest.approx(dist[key][step], rel=1e-6, abs=1e-9), (step, key)


LORA = ["model._component_=logitless.models.lora_qwen2_5_tiny", "model.lora_attn_modules=[q_proj,v_proj]",
        "model.lora_rank=4", "model.lora_alpha=8", "optimizer.lr=1e-2"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", [[], LORA], ids=["full", "lora"])
def test_sampling_through_a_rollout_copy_matches_gathered_shards(tmp_path, tune_cli, policy):
    # generation.rollout_copy: the ranks sample with an unsharded copy refreshed from the shards
    # before each sampling phase (training and eval), instead of gathering the shards; same
    # sampler, same weights, so the same completions and the same metrics as the default run.
    # LoRA: the frozen base is copied once, the adapters before every phase.
    steps = ["max_steps=3", "save_every_n_steps=100", *policy]
    gathered = run_two_ranks(tune_cli, tmp_path / "gathered", *steps)
    copied = run_two_ranks(tune_cli, tmp_path / "copied", *steps, "generation.rollout_copy=true")
    assert gathered["eval/accuracy"].keys() == copied["eval/accuracy"].keys() == {2}
    assert any(gathered["kl"][step] > 0 for step in (2, 3))  # the policy moved between phases
    for key in COMPARED:
        for step in gathered.get(key, {}):
            assert copied[key][step] == pytest.approx(gathered[key][step], rel=1e-6, abs=1e-9), (step, key)


@pytest.mark.parametrize("overrides, match", [
    (["prompts_per_step=3"], "config key 'prompts_per_step': 3 prompts cannot be split evenly over 2 ranks; "
                             "expected a multiple of the world size 2"),
    (["prompts_per_step=4", "micro_batch_size=16"],
     r"config key 'micro_batch_size': 16 does not divide the 8 completions per rank"),
    (["generation.backend=compiled", "generation.compile=true"], "generation.compile"),
    (["generation.rollout_copy=sometimes"], r"config key 'generation.rollout_copy': expected one of"),
    (["generation.rollout_copy=true", "fsdp_cpu_offload=true"], "rollout_copy: true does not work with fsdp_cpu"),
])
def test_config_errors_before_anything_is_built(tmp_path, monkeypatch, overrides, match):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; no process group is joined
    cfg = tiny_cfg(tmp_path, "num_generations=4", "micro_batch_size=8", *overrides)
    with pytest.raises(ConfigError, match=match):
        GRPORecipe(cfg, distributed=True)
    assert not (tmp_path / "logs").exists()
