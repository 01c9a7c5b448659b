"""The GRPO recipes' config: its keys (:data:`GRPO_SCHEMA`), the keys a resume may not change, and
:func:`validate_grpo_config`, which checks a whole config (generation, rewards, batch geometry over
the ranks, prompt sharing) before anything is built.

Used by both GRPO recipes (``recipes/grpo_single_device.py`` holds their loop).
"""

from __future__ import annotations

import math
from typing import Dict

import torch
from omegaconf import DictConfig, OmegaConf

from logitless.generation.builder import build_sampler, build_turn_sampler
from logitless.generation.config import SamplerConfig
from logitless.generation.tools.config import TURN_KEYS, check_turn_config
from logitless.losses import GRPOLoss
from logitless.rl.advantages import ADVANTAGE_ESTIMATORS, SCALE_REWARDS, advantage_settings
from logitless.rl.preflight import ON_MISSING_ANSWER
from logitless.rl.reference import check_reference_sync
from logitless.rl.rewards import build_reward_specs
from logitless.rl.shared_batch import ATTENTION_SETTINGS, PROMPT_SHARING, use_prompt_sharing
from logitless.training.checkpoint import ON_SAVE_ERROR_KEY
from logitless.training.config import ConfigError, Key, validate_config
from logitless.training.data_fingerprint import FINGERPRINT_KEY
from logitless.training.distributed import FSDP_KEYS
from logitless.training.preflight import ON_TOO_LONG, check_components
from logitless.training.resume import RESUME_KEYS, validate_resume_config
from logitless.training.threads import CPU_THREADS_KEY, check_cpu_threads

GRPO_SCHEMA: Dict[str, Key] = {
    "output_dir": Key(str, doc="folder for checkpoints and logs"),
    "model": Key(component=True, doc="model builder (a lora_* builder trains LoRA adapters only)"),
    "tokenizer": Key(component=True),
    "dataset": Key(component=True, positional=1, doc="prompt dataset, called with the tokenizer"),
    "eval_dataset": Key((None,), default=None, component=True, positional=1),
    "rewards": Key(list, doc="list of {function: dotted.path, weight: float, name: str}"),
    "loss": Key(component=True, doc="logitless.losses.GRPOLoss"),
    "optimizer": Key(component=True, positional=1),
    "lr_scheduler": Key((None,), default=None, component=True, positional=1),
    "checkpointer": Key((None,), default=None, component=True),
    "metric_logger": Key((None,), default=None, component=True),
    "model_init": Key(str, default="checkpoint", choices=("checkpoint", "random")),
    **RESUME_KEYS,
    "seed": Key(int, default=0),
    "device": Key(str, default="auto"),
    "dtype": Key(str, default="bf16", choices=("bf16", "fp32")),
    "cpu_threads": CPU_THREADS_KEY,
    "max_steps": Key(int, min=1, doc="GRPO steps (one generation batch each)"),
    "prompts_per_step": Key(int, min=1),
    "num_generations": Key(int, min=2, doc="completions per prompt (G); >= 2 to form a group"),
    "micro_batch_size": Key(int, min=1, doc="completions per forward/backward"),
    "num_iterations": Key(int, default=1, min=1, doc="optimizer steps per generation batch"),
    "prompt_sharing": Key((bool, str), default="auto", choices=PROMPT_SHARING,
                          doc="prompt once per group in the update (auto: when micro_batch_size is a multiple of G "
                              "and the packed group fits the model's max_seq_len, decided per step)"),
    "prompt_sharing_attention": Key(str, default="auto", choices=ATTENTION_SETTINGS,
                                    doc="attention of the packed groups: auto (= cascade), cascade (each completion "
                                        "attends to its prompt and itself, only the scores the mask keeps, any "
                                        "device), sdpa (dense mask, any device, packs up to 12288 tokens) or flex "
                                        "(FlexAttention block mask, CUDA; compiles once per 1024-token bucket)"),
    "advantage_estimator": Key(str, default="group_mean", choices=ADVANTAGE_ESTIMATORS,
                               doc="baseline of the advantages: group_mean (GRPO), rloo (leave-one-out), "
                                   "reinforce_pp (REINFORCE++: batch whitening), reinforce_pp_baseline (group mean, "
                                   "then whitening)"),
    "scale_rewards": Key((bool, str, None), default=None, choices=(True, False, None, *SCALE_REWARDS),
                         doc="divide the centred rewards by the group's std, the batch's, or none (TRL's names; "
                             "true = group, false = none; null: the estimator's default)"),
    "advantage_scale": Key((str, None), default=None, choices=(None, *SCALE_REWARDS),
                           doc="the former name of scale_rewards"),
    "dynamic_sampling": Key(bool, default=False,
                            doc="drop groups whose rewards are all equal and sample further prompts until the step "
                                "has prompts_per_step groups (DAPO)"),
    "dynamic_sampling_max_rounds": Key(int, default=4, min=1,
                                       doc="most sampling rounds of prompts_per_step prompts per step, the first "
                                           "included; when they run out the step trains on the groups it kept"),
    "ref_model_sync_steps": Key((int, None), default=None, min=1,
                                doc="every this many steps: reference <- alpha * policy + (1 - alpha) * reference "
                                    "(TR-DPO; null: a fixed reference)"),
    "ref_model_mixup_alpha": Key(float, default=0.6, doc="alpha of ref_model_sync_steps, in (0, 1]"),
    "generation": Key(object, doc="{max_new_tokens, temperature, top_k, top_p, stop_tokens}"),
    **TURN_KEYS,
    "clip_grad_norm": Key((float, None), default=None),
    "max_consecutive_skipped_steps": Key((int, None), default=3, min=1,
                                         doc="an optimizer step with a NaN/inf gradient norm or loss is skipped; "
                                             "stop after this many in a row (null: never)"),
    "enable_activation_checkpointing": Key(bool, default=False),
    "compile": Key(bool, default=False,
                   doc="torch.compile each policy layer for the update (torchtune's per-layer compile); the "
                       "samplers run the layers uncompiled (the compiled sampler compiles its own decode step)"),
    "peak_flops": Key((float, None), default=None, min=1,
                      doc="peak FLOP/s of one device for update_mfu (null: the table of known GPUs in bf16, "
                          "logitless.training.flops; a device outside it logs no update_mfu)"),
    "log_every_n_steps": Key(int, default=1, min=1),
    "log_completions_every_n_steps": Key((int, None), default=None, min=1,
                                         doc="completion table (prompt, completion, rewards, advantage) every N steps"),
    "log_completions_num_rows": Key((int, None), default=8, min=1, doc="completions per table (null: all)"),
    "save_every_n_steps": Key((int, None), default=None, min=1),
    "save_final_checkpoint": Key(bool, default=True),
    "keep_last_n_checkpoints": Key((int, None), default=None, min=1),
    "on_save_error": ON_SAVE_ERROR_KEY,
    "merge_adapters": Key(bool, default=True, doc="LoRA: save merged HF weights in every checkpoint (a complete "
                                                   "model folder); False: adapters only (docs/export.md)"),
    "eval_every_n_steps": Key((int, None), default=None, min=1),
    "eval_num_prompts": Key((int, None), default=None, min=1),
    "eval_batch_size": Key(int, default=64, min=1),
    "eval_reward": Key((str, None), default=None, doc="reward whose mean is eval accuracy (default: first)"),
    "on_missing_answer": Key(str, default="drop", choices=ON_MISSING_ANSWER,
                             doc="prompts whose answer (a column a reward function needs) is missing or empty: "
                                 "drop them (counted in the log at start) or stop with an error naming the row"),
    "on_too_long": Key(str, default="drop", choices=ON_TOO_LONG,
                       doc="prompts with prompt + max_new_tokens > the model's max_seq_len: drop, keep their end "
                           "(truncate), or stop with an error; counts are logged at start"),
}
# Keys a resume refuses to see changed (they break exact resume) unless named in resume_allow_changes;
# data_fingerprint.dataset: the training data files' sizes and hashes (training.data_fingerprint).
GRPO_FIXED_ON_RESUME = ("seed", "prompts_per_step", "num_generations", "dataset", "tokenizer", "model", "model_init",
                        "dtype", "optimizer._component_", "lr_scheduler._component_", "checkpointer.checkpoint_dir",
                        "checkpointer.checkpoint_files", "checkpointer.model_type", f"{FINGERPRINT_KEY}.dataset",
                        "tools", "environment")


def validate_grpo_config(cfg: DictConfig, *, distributed: bool = False, world_size: int = 1) -> DictConfig:
    """Validates a GRPO config before anything is built.

    Args:
        cfg (DictConfig): the config.
        distributed (bool): the FSDP2 recipe (adds the ``fsdp_*`` keys; ``generation.compile`` refused).
        world_size (int): ranks the step's prompts are split over.

    Returns:
        DictConfig: ``cfg`` with defaults filled in.

    Raises:
        ConfigError: naming the key, what it holds and what was expected.

    Example:
        >>> validate_grpo_config(OmegaConf.load("configs/tiny_grpo.yaml"), distributed=True, world_size=4)
    """
    skip = ["checkpointer"] if cfg.get("model_init", "checkpoint") == "random" else []
    # a synthetic tokenizer/dataset swapped in by one _component_ override ignores the real one's files
    skip += [k for k in ("tokenizer", "dataset", "eval_dataset")
             if isinstance(cfg.get(k), DictConfig) and "synthetic" in str(cfg[k].get("_component_", ""))]
    validate_config(cfg, {**GRPO_SCHEMA, **(FSDP_KEYS if distributed else {})}, skip_file_checks=skip)
    validate_resume_config(cfg, GRPO_FIXED_ON_RESUME)
    if cfg.model_init == "checkpoint" and cfg.checkpointer is None:
        raise ConfigError("config key 'checkpointer': required when model_init='checkpoint' (or model_init=random)")
    gen = cfg.generation
    if not isinstance(gen, DictConfig) or "max_new_tokens" not in gen:
        raise ConfigError(f"config key 'generation': expected a mapping with max_new_tokens, got {gen!r}")
    sampler_config = SamplerConfig.from_config(gen)  # every generation key, named when it is bad
    check_cpu_threads(cfg.cpu_threads)
    check_components(cfg, loss_class=GRPOLoss)
    if cfg.prompts_per_step % world_size:
        raise ConfigError(f"config key 'prompts_per_step': {cfg.prompts_per_step} prompts cannot be split evenly "
                          f"over {world_size} ranks; expected a multiple of the world size {world_size}")
    n = cfg.prompts_per_step // world_size * cfg.num_generations
    if n % cfg.micro_batch_size:
        per = "per step (prompts_per_step x num_generations)" if world_size == 1 else \
            f"per rank (prompts_per_step / {world_size} ranks x num_generations)"
        raise ConfigError(f"config key 'micro_batch_size': {cfg.micro_batch_size} does not divide the "
                          f"{n} completions {per}")
    try:
        use_prompt_sharing(cfg.prompt_sharing, micro_batch_size=cfg.micro_batch_size,
                           num_generations=cfg.num_generations)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    temp = float(sampler_config.temperature)
    loss_temp = float(cfg.loss.get("temperature", 1.0))
    if temp > 0 and not math.isclose(temp, loss_temp):
        raise ConfigError(f"config key 'loss.temperature': {loss_temp} differs from generation.temperature={temp}; "
                          f"the log-probs must use the sampling temperature (set loss.temperature: "
                          f"${{generation.temperature}})")
    if cfg.prompt_sharing_attention == "flex" and (cfg.device == "cpu" or not torch.cuda.is_available()):
        raise ConfigError(f"config key 'prompt_sharing_attention': 'flex' needs a CUDA device (device={cfg.device!r}, "
                          f"CUDA available: {torch.cuda.is_available()}); use 'auto' (cascade)")
    on_cuda = cfg.device != "cpu" and torch.cuda.is_available()
    try:
        build_sampler(sampler_config, torch.device("cuda" if on_cuda else "cpu"), sharded=distributed,
                      cpu_offload=bool(cfg.get("fsdp_cpu_offload", False)))
    except ValueError as e:
        raise ConfigError(f"config key 'generation': {e}") from None
    if check_turn_config(cfg) is not None:
        try:
            build_turn_sampler(sampler_config, torch.device("cuda" if on_cuda else "cpu"), sharded=distributed,
                               cpu_offload=bool(cfg.get("fsdp_cpu_offload", False)))
        except ValueError as e:
            key = f"generation.{e.option}" if getattr(e, "option", None) else "generation"
            raise ConfigError(f"config key '{key}': {e}") from None
        if cfg.on_too_long == "truncate":
            raise ConfigError("config key 'on_too_long': 'truncate' cannot cut a tool rollout's prompt (it is rendered "
                              "from its messages at every step); use drop or error")
    if cfg.eval_every_n_steps is not None and cfg.eval_dataset is None:
        raise ConfigError("config key 'eval_dataset': required when eval_every_n_steps is set")
    build_reward_specs(OmegaConf.to_container(cfg.rewards, resolve=True))  # names the bad entry
    advantage_settings(cfg)
    check_reference_sync(cfg)
    return cfg


__all__ = ["GRPO_FIXED_ON_RESUME", "GRPO_SCHEMA", "validate_grpo_config"]
