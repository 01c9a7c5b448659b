"""The body of ``recipes/grpo_single_device.py`` and ``recipes/grpo_distributed.py``: GRPO with a
full or LoRA policy, on one device or with FSDP2 over every rank.

Each step: take ``prompts_per_step`` prompts (a deterministic order from ``seed``), sample
``num_generations`` completions each with the KV-cached sampler, score them with the configured
reward functions, compute group-relative advantages, then run ``num_iterations`` optimizer steps over
the batch in micro-batches of ``micro_batch_size`` completions with ``logitless.losses.GRPOLoss``.

Distributed, the step's prompts are split contiguously over the ranks (a group never spans two).
Each rank samples its share with an unsharded rollout copy of the policy, refreshed from the
shards before each sampling phase (``generation.rollout_copy``; the compiled sampler needs weights
whose storage never moves), or else with the shards gathered for the call (``Runtime.full_weights``),
and scores it; the per-completion rewards, lengths and truncation flags
are gathered, so advantages (``advantage_scale: batch`` included) and every logged metric are
those of the whole batch; the update normalises over the global batch (``grpo_update``). Sampling
draws from one random stream per prompt, seeded by ``(seed, step, prompt index)``, so the run
samples the same completions as one device does, whatever the number of ranks.

Set-up order: validate the whole config -> process group / device / seed -> tokenizer, data (every
prompt's length checked against the model's max_seq_len: :mod:`logitless.rl.preflight`),
rewards -> run start (output_dir ownership, verified checkpoint, config changes:
:func:`logitless.training.resume.start_run`) -> policy (+ weights, LoRA freeze) -> rollout copy (sharded runs) -> reference (frozen copy, or adapters disabled for LoRA;
only if beta > 0) -> resume -> FSDP2 -> optimizer -> loop. Checkpoints, resume, sharding, metric
logging and the progress bar come from :mod:`logitless.training`; everything GRPO-specific from
:mod:`logitless.rl`.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Dict, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config as tt_config
from torchtune import training as tt_training
from torchtune.utils import get_logger

from logitless.rl.advantages import group_advantages
from logitless.rl.completion_log import CompletionLogger
from logitless.rl.metrics import rollout_metrics
from logitless.rl.preflight import check_generation, check_stop_tokens, fit_prompt_dataset
from logitless.rl.reference import build_reference
from logitless.rl.reward_models import place_reward_models
from logitless.rl.rewards import build_reward_specs, compute_rewards
from logitless.rl.rollout import SAMPLER_KEYS, build_sampler, prompt_generators, uses_rollout_copy
from logitless.rl.shared_batch import (ATTENTION_SETTINGS, PROMPT_SHARING, flex_available, packed_length,
                                       packing_attention, training_batch, use_prompt_sharing)
from logitless.rl.update import grpo_update
from logitless.training import model as model_utils
from logitless.training.checkpoint import CheckpointManager, set_rng_state
from logitless.training.cli import report_errors
from logitless.training.export import ModelExport
from logitless.training.config import ConfigError, Key, config_summary, validate_config
from logitless.training.distributed import FSDP_KEYS, Runtime, launched_world_size
from logitless.training.metric_logging import build_metric_logger
from logitless.training.nonfinite import NonFiniteGuard, check_finite_weights
from logitless.training.preflight import ON_TOO_LONG, check_device, check_optimizer, instantiate_dataset, model_limits
from logitless.training.progress import ProgressBar, peak_memory_gib
from logitless.training.resume import RESUME_KEYS, apply_optimizer_changes, start_run, validate_resume_config
from logitless.training.threads import CPU_THREADS_KEY, apply_cpu_threads, check_cpu_threads

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
                              "and the packed group is short enough to pay, decided per step)"),
    "prompt_sharing_attention": Key(str, default="auto", choices=ATTENTION_SETTINGS,
                                    doc="attention of the packed groups: auto (sdpa up to 12288 packed tokens, "
                                        "flex beyond on CUDA), sdpa (dense mask, any device) or flex "
                                        "(FlexAttention block mask, CUDA; compiles once per 1024-token bucket)"),
    "advantage_scale": Key(str, default="group", choices=("group", "batch", "none")),
    "generation": Key(object, doc="{max_new_tokens, temperature, top_k, top_p, stop_tokens}"),
    "clip_grad_norm": Key((float, None), default=None),
    "max_consecutive_skipped_steps": Key((int, None), default=3, min=1,
                                         doc="an optimizer step with a NaN/inf gradient norm or loss is skipped; "
                                             "stop after this many in a row (null: never)"),
    "enable_activation_checkpointing": Key(bool, default=False),
    "log_every_n_steps": Key(int, default=1, min=1),
    "log_completions_every_n_steps": Key((int, None), default=None, min=1,
                                         doc="completion table (prompt, completion, rewards, advantage) every N steps"),
    "log_completions_num_rows": Key((int, None), default=8, min=1, doc="completions per table (null: all)"),
    "save_every_n_steps": Key((int, None), default=None, min=1),
    "save_final_checkpoint": Key(bool, default=True),
    "keep_last_n_checkpoints": Key((int, None), default=None, min=1),
    "merge_adapters": Key(bool, default=True, doc="LoRA: save merged HF weights in every checkpoint (a complete "
                                                   "model folder); False: adapters only (docs/export.md)"),
    "eval_every_n_steps": Key((int, None), default=None, min=1),
    "eval_num_prompts": Key((int, None), default=None, min=1),
    "eval_batch_size": Key(int, default=64, min=1),
    "eval_reward": Key((str, None), default=None, doc="reward whose mean is eval accuracy (default: first)"),
    "on_too_long": Key(str, default="drop", choices=ON_TOO_LONG,
                       doc="prompts with prompt + max_new_tokens > the model's max_seq_len: drop, keep their end "
                           "(truncate), or stop with an error; counts are logged at start"),
}
# Keys a resume refuses to see changed (they break exact resume) unless named in resume_allow_changes.
GRPO_FIXED_ON_RESUME = ("seed", "prompts_per_step", "num_generations", "dataset", "tokenizer", "model", "model_init",
                        "dtype", "optimizer._component_", "lr_scheduler._component_", "checkpointer.checkpoint_dir",
                        "checkpointer.checkpoint_files", "checkpointer.model_type")
_GEN_KEYS = {"max_new_tokens", "temperature", "top_k", "top_p", "stop_tokens", *SAMPLER_KEYS}


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
    unknown = set(gen.keys()) - _GEN_KEYS
    if unknown:
        raise ConfigError(f"config key 'generation.{sorted(unknown)[0]}': unknown; allowed {sorted(_GEN_KEYS)}")
    check_generation(gen)
    check_device(cfg.device, available=False)  # GRPORecipe checks that it exists here
    check_cpu_threads(cfg.cpu_threads)
    check_optimizer(cfg.optimizer)
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
    temp = float(gen.get("temperature", 1.0))
    loss_temp = float(cfg.loss.get("temperature", 1.0))
    if temp > 0 and not math.isclose(temp, loss_temp):
        raise ConfigError(f"config key 'loss.temperature': {loss_temp} differs from generation.temperature={temp}; "
                          f"the log-probs must use the sampling temperature (set loss.temperature: "
                          f"${{generation.temperature}})")
    if cfg.prompt_sharing_attention == "flex" and (cfg.device == "cpu" or not torch.cuda.is_available()):
        raise ConfigError(f"config key 'prompt_sharing_attention': 'flex' needs a CUDA device (device={cfg.device!r}, "
                          f"CUDA available: {torch.cuda.is_available()}); use 'sdpa'")
    sampler_options = {k: gen[k] for k in SAMPLER_KEYS if k in gen}
    on_cuda = cfg.device != "cpu" and torch.cuda.is_available()
    try:
        build_sampler(sampler_options, torch.device("cuda" if on_cuda else "cpu"), sharded=distributed,
                      cpu_offload=bool(cfg.get("fsdp_cpu_offload", False)))
    except ValueError as e:
        raise ConfigError(f"config key 'generation': {e}") from None
    if cfg.eval_every_n_steps is not None and cfg.eval_dataset is None:
        raise ConfigError("config key 'eval_dataset': required when eval_every_n_steps is set")
    build_reward_specs(OmegaConf.to_container(cfg.rewards, resolve=True))  # names the bad entry
    return cfg


class GRPORecipe:
    """GRPO on one device or with FSDP2 over every rank (see the module docstring).

    Args:
        cfg (DictConfig): the config (validated here, before anything is built).
        distributed (bool): FSDP2 over the ranks of ``torchrun`` / ``tune run --nproc_per_node``.

    Example:
        >>> history = GRPORecipe(OmegaConf.load("configs/tiny_grpo.yaml")).run()
        >>> history[-1]["reward/mean"]
    """

    def __init__(self, cfg: DictConfig, *, distributed: bool = False):
        self.distributed = distributed
        self.cfg = validate_grpo_config(cfg, distributed=distributed,
                                        world_size=launched_world_size() if distributed else 1)
        check_device(self.cfg.device)
        self.is_lora = "lora_rank" in cfg.model
        self.prompt_sharing = use_prompt_sharing(cfg.prompt_sharing, micro_batch_size=cfg.micro_batch_size,
                                                 num_generations=cfg.num_generations)
        self.history: List[Dict[str, float]] = []

    # ------------------------------------------------------------------ set-up
    def _setup(self) -> Optional[Dict[str, Any]]:
        cfg = self.cfg
        apply_cpu_threads(cfg.cpu_threads, cfg.device)
        self.runtime = Runtime.setup(cfg.device, distributed=self.distributed)
        self.device = self.runtime.device
        self.flex_ok = flex_available(self.device)
        self.dtype = tt_training.get_dtype(cfg.dtype, device=self.device)
        self.seed = tt_training.set_seed(cfg.seed)
        self.tokenizer = instantiate_dataset(cfg.tokenizer, "tokenizer")
        self.dataset = instantiate_dataset(cfg.dataset, "dataset", self.tokenizer)
        self.eval_dataset = (instantiate_dataset(cfg.eval_dataset, "eval_dataset", self.tokenizer)
                             if cfg.eval_dataset is not None and cfg.eval_every_n_steps is not None else None)
        self.rewards = build_reward_specs(OmegaConf.to_container(cfg.rewards, resolve=True))
        place_reward_models(self.rewards, self.device)  # reward models run on the policy's device
        gen = OmegaConf.to_container(cfg.generation, resolve=True)
        limits = model_limits(cfg.model)
        check_stop_tokens(gen.get("stop_tokens", []), limits.vocab_size, "generation.stop_tokens")
        gen.setdefault("stop_tokens", list(getattr(self.tokenizer, "stop_tokens", [self.tokenizer.eos_id])))
        check_stop_tokens(gen["stop_tokens"], limits.vocab_size, "tokenizer")
        self._fit_prompts(limits.max_seq_len, gen)
        sampler_options = {k: gen.pop(k) for k in SAMPLER_KEYS if k in gen}
        offload = bool(cfg.get("fsdp_cpu_offload", False))
        self.sample_fn, self.eval_sample_fn = build_sampler(sampler_options, self.device, sharded=self.distributed,
                                                            cpu_offload=offload)
        rollout_copy = uses_rollout_copy(sampler_options, self.device, sharded=self.distributed, cpu_offload=offload)
        self.gen_kwargs = gen
        self.pad_id = self.tokenizer.pad_id if getattr(self.tokenizer, "pad_id", None) is not None else 0

        # output_dir ownership, verified checkpoint, config changes: decided before the model is built
        start = start_run(cfg, fixed_keys=GRPO_FIXED_ON_RESUME, runtime=self.runtime,
                          recipe="grpo_distributed" if self.distributed else "grpo_single_device")
        resume_dir = start.checkpoint
        self.ckpt = CheckpointManager(cfg.checkpointer if cfg.model_init == "checkpoint" else None,
                                      cfg.output_dir, is_rank_zero=self.runtime.is_rank_zero,
                                      keep_last_n=cfg.keep_last_n_checkpoints, run_id=start.run_id)
        model = model_utils.build_model(cfg.model, device=self.device, dtype=self.dtype, seed=self.seed,
                                         embedding_std=model_utils.random_init_std(cfg.model_init))
        self.ckpt.export = ModelExport.for_run(cfg, model, lora=self.is_lora)
        adapter_keys = model_utils.adapter_keys(model) if self.is_lora else None
        if cfg.model_init == "checkpoint":
            model_utils.load_weights(model, self.ckpt.load_model_state(), allow_missing=adapter_keys,
                                     source=str(cfg.checkpointer.checkpoint_dir))
        if self.is_lora:
            model_utils.setup_lora(model)
        # Sharded runs sample through an unsharded copy whose storage never moves (compiled sampler,
        # CUDA graphs); its weights are refreshed from the shards before each sampling phase.
        self.rollout_model, self._rollout_synced = None, False
        if rollout_copy:
            self.rollout_model = model_utils.build_model(cfg.model, device=self.device, dtype=self.dtype,
                                                         seed=self.seed).eval().requires_grad_(False)
        self.loss_fn = tt_config.instantiate(cfg.loss)
        self.loss_fn.set_model_output(model)
        # the reference is the policy before any training (also when resuming)
        self.reference = build_reference(model, getattr(self.loss_fn, "beta", 0.0), self.is_lora)
        if resume_dir is not None:
            if self.is_lora:
                model_utils.load_weights(model, self.ckpt.load_adapter_state(resume_dir),
                                         allow_missing=[k for k in model.state_dict() if k not in adapter_keys],
                                         source=str(resume_dir))
            else:
                model_utils.load_weights(model, self.ckpt.load_model_state(resume_dir), source=str(resume_dir))
        if cfg.enable_activation_checkpointing:
            model_utils.apply_activation_checkpointing(model)
        fsdp = {"cpu_offload": cfg.get("fsdp_cpu_offload", False),
                "reshard_after_forward": cfg.get("fsdp_reshard_after_forward", True)}
        self.runtime.shard(model, **fsdp)
        if self.reference is not None and self.reference.model is not model:  # a frozen copy: sharded alike
            self.runtime.shard(self.reference.model, **fsdp)
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = tt_config.instantiate(cfg.optimizer, params)
        self.lr_scheduler = (tt_config.instantiate(cfg.lr_scheduler, self.optimizer)
                             if cfg.lr_scheduler is not None else None)
        state = start.recipe_state
        self.guard = NonFiniteGuard(cfg.max_consecutive_skipped_steps)
        if state is not None and state.get("nonfinite") is not None:
            self.guard.load_state_dict(state["nonfinite"])
        if state is not None:
            self.runtime.load_optimizer_state_dict(model, self.optimizer, state["optimizer"])
            if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            apply_optimizer_changes(self.optimizer, self.lr_scheduler, start.changes,
                                    log_rank_zero=self.runtime.is_rank_zero)
            set_rng_state(self.runtime.own_rng_state(state["rng"]))
        return state

    def _fit_prompts(self, max_seq_len: Optional[int], gen: Dict[str, Any]) -> None:
        """Checks every prompt (training and eval) against the sampler's length limit, at start."""
        known = [v for v in (max_seq_len, gen.get("max_cache_len")) if v is not None]
        limit = min(known) if known else None
        for key in ("dataset", "eval_dataset"):
            ds = getattr(self, key)
            if ds is None:
                continue
            ds, report = fit_prompt_dataset(ds, max_seq_len=limit, max_new_tokens=gen["max_new_tokens"],
                                            on_too_long=self.cfg.on_too_long, key=key)
            setattr(self, key, ds)
            if self.runtime.is_rank_zero:
                get_logger("INFO").info(report.message(key))

    # ------------------------------------------------------------------ pieces of a step
    def prompt_indices(self, step: int) -> List[int]:
        """Dataset rows of GRPO step ``step`` (0-based), in batch order: a fixed shuffle per epoch, so
        resume needs only the step."""
        n, k = len(self.dataset), self.cfg.prompts_per_step
        rows = []
        for idx in range(step * k, (step + 1) * k):
            epoch, pos = divmod(idx, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
            rows.append(int(perm[pos]))
        return rows

    @contextlib.contextmanager
    def _sampling_weights(self):
        """The policy's full weights for a sampling phase (every rank enters it).

        Refreshes the rollout copy from the shards, or, without a copy, keeps the shards gathered
        for the phase (``Runtime.full_weights``; a no-op on one device).
        """
        if self.rollout_model is not None:
            # Frozen weights (a LoRA policy's base) cannot change: copied once.
            self.runtime.copy_full_weights(self.model, self.rollout_model, trainable_only=self._rollout_synced)
            self._rollout_synced = True
            yield
            return
        with self.runtime.full_weights(self.model):
            yield

    def _sample(self, rows, num_generations: int, generator, evaluation: bool = False, **overrides):
        kwargs = {**self.gen_kwargs, **overrides}
        sample = self.eval_sample_fn if evaluation else self.sample_fn
        policy = self.rollout_model if self.rollout_model is not None else self.model
        rollout = sample(policy, [r["prompt_tokens"] for r in rows], num_generations=num_generations,
                         pad_id=self.pad_id, generator=generator, **kwargs)
        texts = [self.tokenizer.decode(t[m].tolist(), skip_special_tokens=True)
                 for t, m in zip(rollout.completion_tokens.cpu(), rollout.completion_mask.cpu())]
        prompts = [r["prompt"] for r in rows for _ in range(num_generations)]
        fields = {k: [r[k] for r in rows for _ in range(num_generations)]
                  for k in rows[0] if k not in ("prompt", "prompt_tokens")}
        return rollout, prompts, texts, fields

    def _gather(self, columns: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Per-completion values of every rank's share, in batch order (one collective for all)."""
        names = list(columns)
        table = self.runtime.all_gather(torch.stack([columns[k].float().cpu() for k in names], dim=1))
        return {k: table[:, i] for i, k in enumerate(names)}

    def _peak_memory(self) -> Dict[str, float]:
        """Peak memory of the busiest rank."""
        mem = peak_memory_gib(self.device)
        peaks = self.runtime.all_reduce(torch.tensor(list(mem.values()), dtype=torch.float64), op="max")
        return dict(zip(mem, peaks.tolist()))

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Greedy accuracy (mean of ``eval_reward``) on the held-out prompts, split over the ranks."""
        cfg = self.cfg
        rows = [self.eval_dataset[i] for i in range(len(self.eval_dataset))][: cfg.eval_num_prompts]
        rows = [rows[i] for i in self.runtime.share(len(rows))]
        name = cfg.eval_reward or self.rewards[0].name
        total = torch.zeros(2, dtype=torch.float64)  # score sum, prompts
        with self._sampling_weights():
            for start in range(0, len(rows), cfg.eval_batch_size):
                chunk = rows[start:start + cfg.eval_batch_size]
                _, prompts, texts, fields = self._sample(chunk, 1, None, evaluation=True, temperature=0.0)
                scores = compute_rewards(self.rewards, prompts, texts, fields, batch_id="eval")[name]
                total += torch.tensor([float(scores.double().sum()), len(chunk)], dtype=torch.float64)
        total = self.runtime.all_reduce(total)
        return {"eval/accuracy": float(total[0] / total[1])}

    def train_step(self, step: int) -> Dict[str, float]:
        """One GRPO step (generation, rewards, advantages, update); returns the whole batch's metrics."""
        cfg = self.cfg
        group_size = cfg.num_generations
        t0 = time.perf_counter()
        share = self.runtime.share(cfg.prompts_per_step)  # this rank's prompts (equal shares: validated)
        indices = self.prompt_indices(step)
        rows = [self.dataset[indices[i]] for i in share]
        generators = prompt_generators(self.seed, step, share, self.device)
        with self._sampling_weights():
            rollout, prompts, texts, fields = self._sample(rows, group_size, generators)
        t_gen = time.perf_counter()
        rewards = compute_rewards(self.rewards, prompts, texts, fields, batch_id=f"step {step + 1}")
        batch_values = self._gather({**rewards, "length": rollout.completion_lengths, "truncated": rollout.truncated})
        lengths, truncated = batch_values.pop("length"), batch_values.pop("truncated")
        advantages = group_advantages(batch_values["total"], group_size, scale=cfg.advantage_scale)
        self.last_rollout = (prompts, texts, rewards, advantages[share.start * group_size:share.stop * group_size])
        attention = self._packing_attention(rollout)
        batch = training_batch(rollout, prompt_sharing=attention is not None, pad_id=self.pad_id,
                               ignore_index=self.loss_fn.ignore_index, attention=attention or "sdpa")
        upd = grpo_update(self.model, self.loss_fn, self.optimizer, batch,
                          advantages[share.start * group_size:share.stop * group_size].to(self.device),
                          micro_batch_size=cfg.micro_batch_size, num_iterations=cfg.num_iterations,
                          reference=self.reference, clip_grad_norm=cfg.clip_grad_norm,
                          lr_scheduler=self.lr_scheduler, data_parallel=self.runtime if self.distributed else None,
                          guard=self.guard, step=step + 1)
        if self.reference is not None:
            self.runtime.release(self.reference.model)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_end = time.perf_counter()
        n_tokens = float(self.runtime.all_reduce(torch.tensor(
            float(rollout.prompt_mask.sum()) + float(rollout.completion_lengths.sum()), dtype=torch.float64)))
        metrics = rollout_metrics(batch_values, lengths, truncated.bool())
        metrics.update(upd)
        metrics.update({"prompt_sharing": float(attention is not None),
                        "prompt_sharing_flex": float(attention == "flex")})
        metrics.update({
            "lr": self.optimizer.param_groups[0]["lr"], "step_time_s": t_end - t0,
            "time/generation_s": t_gen - t0, "time/update_s": t_end - t_gen,
            "tokens_per_second": n_tokens / (t_end - t0), **self._peak_memory()})
        return metrics

    def _packing_attention(self, rollout) -> Optional[str]:
        """The attention this step's update packs each group with, or None for the expanded batch;
        decided from the longest packed group over all ranks, so that every rank runs the same path."""
        if not self.prompt_sharing:
            return None
        length = int(self.runtime.all_reduce(torch.tensor(float(packed_length(rollout))), op="max"))
        inner = getattr(self.model, "_orig_mod", self.model)
        return packing_attention(length, attention=self.cfg.prompt_sharing_attention,
                                 max_seq_len=getattr(inner, "max_seq_len", None), flex_ok=self.flex_ok,
                                 must_pack=self.cfg.prompt_sharing is True)

    def save(self, step: int) -> None:
        """Complete checkpoint (weights or adapters + optimizer, scheduler, step, RNG); all ranks take
        part, rank 0 writes."""
        # every rank checks its shards and raises together: never a checkpoint of NaN/inf weights
        check_finite_weights(dict(self.model.named_parameters()), what=f"checkpoint step_{step:06d}",
                             all_reduce=self.runtime.all_reduce)
        state = {"step": step, "optimizer": self.runtime.optimizer_state_dict(self.model, self.optimizer),
                 "nonfinite": self.guard.state_dict(),
                 "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                 "rng": self.runtime.rng_states(), "seed": self.seed, "world_size": self.runtime.world_size,
                 "config": config_summary(self.cfg)}
        full_sd = self.runtime.full_state_dict(self.model)
        if self.runtime.is_rank_zero:
            if self.is_lora:
                adapter, merged = model_utils.lora_states(full_sd, self.cfg.model, merge=self.cfg.merge_adapters)
                self.ckpt.save(step=step, epoch=0, recipe_state=state, model_state=merged, adapter_state=adapter)
            else:
                self.ckpt.save(step=step, epoch=0, recipe_state=state, model_state=full_sd)
        self.runtime.barrier()

    # ------------------------------------------------------------------ loop
    def run(self) -> List[Dict[str, float]]:
        """Trains for ``max_steps`` GRPO steps; returns the metrics of every step this process ran."""
        cfg = self.cfg
        state = self._setup()
        step = state["step"] if state is not None else 0
        rank_zero = self.runtime.is_rank_zero
        logger = build_metric_logger(cfg.metric_logger, cfg.output_dir, is_rank_zero=rank_zero)
        if state is None and rank_zero:
            logger.log_config(cfg)
        completion_log = CompletionLogger(cfg.output_dir, logger, every_n_steps=cfg.log_completions_every_n_steps,
                                          num_rows=cfg.log_completions_num_rows, enabled=rank_zero)
        bar = ProgressBar(cfg.max_steps, initial=step, enabled=rank_zero)
        last_saved = step if state is not None else -1
        self.model.train()
        while step < cfg.max_steps:
            metrics = self.train_step(step)
            step += 1
            if cfg.eval_every_n_steps is not None and step % cfg.eval_every_n_steps == 0:
                metrics.update(self.evaluate())
            self.history.append({"step": step, **metrics})
            bar.bar.set_description(f"reward {metrics['reward/mean']:.3f}", refresh=False)
            bar.update(metrics)
            if step % cfg.log_every_n_steps == 0 or step == cfg.max_steps:
                logger.log_dict(metrics, step=step)
            if completion_log.due(step):
                completion_log.log(step, *self.last_rollout)
            if cfg.save_every_n_steps is not None and step % cfg.save_every_n_steps == 0:
                self.save(step)
                last_saved = step
        if cfg.save_final_checkpoint and last_saved != step:
            self.save(step)
        bar.close()
        self.ckpt.log_final(step)
        logger.close()
        self.runtime.shutdown()
        return self.history


@report_errors
def recipe_main(cfg: DictConfig, *, distributed: bool = False) -> None:
    """Entry point of ``recipes/grpo_single_device.py`` and ``recipes/grpo_distributed.py``; a
    ConfigError ends the run with one line on stderr and exit status 2
    (:func:`~logitless.training.cli.report_errors`)."""
    GRPORecipe(cfg, distributed=distributed).run()
