"""The SFT recipe body shared by ``full_sft_single_device``, ``lora_sft_single_device`` and
``full_sft_distributed``: the recipe files only choose ``lora`` and ``distributed``.

Order of set-up (nothing is built before the whole config is validated):
validate config -> process group / device / seed -> tokenizer, dataset and every row's length
(:func:`~logitless.training.preflight.fit_sft_dataset`) -> run start (output_dir ownership, verified
checkpoint, config changes: :func:`~logitless.training.resume.start_run`) -> model (+ weights) -> LoRA freeze ->
loss protocol (``loss_fn.set_model_output``) -> activation checkpointing -> compile -> FSDP2 ->
optimizer / LR schedule -> data loader -> resume state -> train loop (TrainStep) -> checkpoints.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from omegaconf import DictConfig
from torchtune import config as tt_config
from torchtune import training as tt_training
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX
from torchtune.utils import get_logger

from logitless.training import model as model_utils
from logitless.training.checkpoint import CheckpointManager, set_rng_state
from logitless.training.cli import report_errors
from logitless.training.export import ModelExport
from logitless.training.config import ConfigError, Key, config_summary, validate_config
from logitless.training.dataloader import batch_to_device, build_dataloader
from logitless.training.distributed import FSDP_KEYS, Runtime
from logitless.training.metric_logging import build_metric_logger
from logitless.training.nonfinite import check_finite_weights
from logitless.training.preflight import (ON_TOO_LONG, check_device, check_optimizer, fit_sft_dataset,
                                          instantiate_dataset, model_limits)
from logitless.training.progress import ProgressBar, StepTimer, peak_memory_gib
from logitless.training.resume import RESUME_KEYS, apply_optimizer_changes, start_run, validate_resume_config
from logitless.training.sft import SFTObjective
from logitless.training.step import TrainStep
from logitless.training.threads import CPU_THREADS_KEY, apply_cpu_threads, check_cpu_threads

SFT_SCHEMA: Dict[str, Key] = {
    "output_dir": Key(str, doc="folder for checkpoints and logs"),
    "model": Key(component=True, doc="model builder"),
    "tokenizer": Key(component=True, doc="tokenizer builder"),
    "dataset": Key(component=True, positional=1, doc="dataset builder, called with the tokenizer"),
    "loss": Key(component=True, doc="a logitless.losses component"),
    "optimizer": Key(component=True, positional=1, doc="optimizer, called with the parameters"),
    "lr_scheduler": Key((None,), default=None, component=True, positional=1, supplied=("num_training_steps",),
                        doc="called with the optimizer (and num_training_steps unless set)"),
    "checkpointer": Key((None,), default=None, component=True),
    "metric_logger": Key((None,), default=None, component=True),
    "model_init": Key(str, default="checkpoint", choices=("checkpoint", "random"),
                      doc="'random' skips loading weights (benchmarks, machines without downloads)"),
    **RESUME_KEYS,
    "seed": Key(int, default=0),
    "shuffle": Key(bool, default=True),
    "batch_size": Key(int, default=2, min=1, doc="micro-batch size per device"),
    "gradient_accumulation_steps": Key(int, default=1, min=1),
    "epochs": Key(int, default=1, min=1),
    "max_steps_per_epoch": Key((int, None), default=None, min=1),
    "max_steps": Key((int, None), default=None, min=1, doc="stop after this many optimizer steps in total"),
    "clip_grad_norm": Key((float, None), default=None),
    "max_consecutive_skipped_steps": Key((int, None), default=3, min=1,
                                         doc="a step with a NaN/inf gradient norm or loss is skipped; stop "
                                             "after this many in a row (null: never)"),
    "dtype": Key(str, default="bf16", choices=("bf16", "fp32")),
    "device": Key(str, default="auto", doc="'auto' (cuda if available), 'cpu', 'cuda'"),
    "cpu_threads": CPU_THREADS_KEY,
    "enable_activation_checkpointing": Key(bool, default=False),
    "compile": Key(bool, default=False),
    "log_every_n_steps": Key(int, default=1, min=1),
    "save_every_n_steps": Key((int, None), default=None, min=1),
    "save_final_checkpoint": Key(bool, default=True),
    "keep_last_n_checkpoints": Key((int, None), default=None, min=1),
    "num_workers": Key(int, default=0, min=0),
    "on_too_long": Key(str, default="truncate", choices=ON_TOO_LONG,
                       doc="rows longer than max_seq_len (tokenizer's or model's): cut, drop, or stop with an error; "
                           "counts are logged at start"),
}
# Keys a resume refuses to see changed (they break exact resume) unless named in resume_allow_changes.
SFT_FIXED_ON_RESUME = ("batch_size", "gradient_accumulation_steps", "seed", "shuffle", "max_steps_per_epoch",
                       "dataset", "tokenizer", "model", "model_init", "dtype", "optimizer._component_",
                       "lr_scheduler._component_", "checkpointer.checkpoint_dir", "checkpointer.checkpoint_files",
                       "checkpointer.model_type")
LORA_KEYS: Dict[str, Key] = {
    "merge_adapters": Key(bool, default=True,
                          doc="save the base weights with the adapters merged (HF format) in every checkpoint, "
                              "so each folder is a complete model; False: adapters only (docs/export.md)"),
}


def validate_sft_config(cfg: DictConfig, *, lora: bool = False, distributed: bool = False) -> DictConfig:
    """Validates an SFT config (see :data:`SFT_SCHEMA`) before anything is built.

    Args:
        cfg (DictConfig): the config.
        lora (bool): LoRA recipe (adds ``merge_adapters``; the model must be a ``lora_*`` builder).
        distributed (bool): FSDP2 recipe (adds ``fsdp_*`` keys).

    Returns:
        DictConfig: ``cfg`` with defaults filled in.

    Raises:
        ConfigError: naming the key.

    Example:
        >>> validate_sft_config(OmegaConf.load("configs/tiny_full.yaml"))
    """
    schema = dict(SFT_SCHEMA)
    if lora:
        schema.update(LORA_KEYS)
    if distributed:
        schema.update(FSDP_KEYS)
    init = cfg.get("model_init", "checkpoint")
    skip = ("checkpointer",) if init == "random" else ()
    validate_config(cfg, schema, skip_file_checks=skip)
    validate_resume_config(cfg, SFT_FIXED_ON_RESUME)
    if cfg.model_init == "checkpoint" and cfg.checkpointer is None:
        raise ConfigError("config key 'checkpointer': required when model_init='checkpoint' "
                          "(or set model_init=random)")
    if lora:
        for k in ("lora_rank", "lora_alpha", "lora_attn_modules"):
            if k not in cfg.model:
                raise ConfigError(f"config key 'model.{k}': the LoRA recipe needs a lora_* model builder "
                                  f"(got {cfg.model._component_!r} without {k})")
    check_device(cfg.device, available=False)  # SFTRecipe checks that it exists here
    check_optimizer(cfg.optimizer)
    if cfg.clip_grad_norm is not None and not cfg.clip_grad_norm > 0:
        raise ConfigError(f"config key 'clip_grad_norm': expected a value > 0 or null, got {cfg.clip_grad_norm!r}")
    check_cpu_threads(cfg.cpu_threads)
    return cfg


class SFTRecipe:
    """Full or LoRA supervised fine-tuning, on one device or with FSDP2.

    Args:
        cfg (DictConfig): the recipe config (validated here).
        lora (bool): train LoRA adapters only (base frozen), save them separately.
        distributed (bool): FSDP2 over all ranks of the process group (``tune run --nproc_per_node``).

    Example:
        >>> SFTRecipe(OmegaConf.load("configs/tiny_full.yaml")).run()
    """

    def __init__(self, cfg: DictConfig, *, lora: bool = False, distributed: bool = False):
        self.cfg = validate_sft_config(cfg, lora=lora, distributed=distributed)
        check_device(self.cfg.device)
        self.lora, self.distributed = lora, distributed
        self.losses: List[float] = []  # loss of every optimizer step run by this process

    # ------------------------------------------------------------------ set-up
    def _setup_runtime(self) -> None:
        cfg = self.cfg
        self.runtime = Runtime.setup(cfg.device, distributed=self.distributed)
        self.device, self.rank, self.world_size = self.runtime.device, self.runtime.rank, self.runtime.world_size
        self.is_rank_zero = self.runtime.is_rank_zero
        self.dtype = tt_training.get_dtype(cfg.dtype, device=self.device)
        self.seed = tt_training.set_seed(cfg.seed)

    def _setup_model(self, resume_dir) -> None:
        cfg = self.cfg
        self.ckpt = CheckpointManager(cfg.checkpointer if cfg.model_init == "checkpoint" else None,
                                      cfg.output_dir, is_rank_zero=self.is_rank_zero,
                                      keep_last_n=cfg.keep_last_n_checkpoints, run_id=self.start.run_id)
        model = model_utils.build_model(cfg.model, device=self.device, dtype=self.dtype, seed=self.seed,
                                         embedding_std=model_utils.random_init_std(cfg.model_init))
        self.ckpt.export = ModelExport.for_run(cfg, model, lora=self.lora)
        adapter_keys = model_utils.adapter_keys(model) if self.lora else None
        if cfg.model_init == "checkpoint" or (resume_dir is not None and not self.lora):
            sd = self.ckpt.load_model_state(resume_dir, base_only=self.lora)
            model_utils.load_weights(model, sd, allow_missing=adapter_keys,
                                     source=str(resume_dir or cfg.checkpointer.checkpoint_dir))
            del sd
        if self.lora:
            if resume_dir is not None:
                model_utils.load_weights(
                    model, self.ckpt.load_adapter_state(resume_dir),
                    allow_missing=[k for k in model.state_dict() if k not in adapter_keys], source=str(resume_dir))
            model_utils.setup_lora(model)
        self.loss_fn = tt_config.instantiate(cfg.loss)
        self.objective = SFTObjective(model, self.loss_fn)  # calls loss_fn.set_model_output(model)
        if cfg.enable_activation_checkpointing:
            model_utils.apply_activation_checkpointing(model)
        if cfg.compile:
            model_utils.compile_layers(model)
        if self.distributed:
            self.runtime.shard(model, cpu_offload=cfg.fsdp_cpu_offload,
                               reshard_after_forward=cfg.fsdp_reshard_after_forward)
        self.model = model

    def _setup_optim(self, recipe_state: Optional[Dict[str, Any]]) -> None:
        cfg = self.cfg
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = tt_config.instantiate(cfg.optimizer, params)
        self.lr_scheduler = None
        if cfg.lr_scheduler is not None:
            kw = {} if "num_training_steps" in cfg.lr_scheduler else {"num_training_steps": self.total_steps}
            self.lr_scheduler = tt_config.instantiate(cfg.lr_scheduler, self.optimizer, **kw)
        if recipe_state is not None:
            self.runtime.load_optimizer_state_dict(self.model, self.optimizer, recipe_state["optimizer"])
            if self.lr_scheduler is not None and recipe_state.get("lr_scheduler") is not None:
                self.lr_scheduler.load_state_dict(recipe_state["lr_scheduler"])
            apply_optimizer_changes(self.optimizer, self.lr_scheduler, self.start.changes,
                                    log_rank_zero=self.is_rank_zero)
        self.train_step = TrainStep(self.model, self.optimizer, self.lr_scheduler,
                                    clip_grad_norm=cfg.clip_grad_norm, runtime=self.runtime,
                                    max_consecutive_skipped_steps=cfg.max_consecutive_skipped_steps)
        if recipe_state is not None and recipe_state.get("nonfinite") is not None:
            self.train_step.guard.load_state_dict(recipe_state["nonfinite"])

    def _setup_dataset(self) -> None:
        """Tokenizer and dataset, every row checked against the length limit (before the model)."""
        cfg = self.cfg
        self.tokenizer = instantiate_dataset(cfg.tokenizer, "tokenizer")
        ds = instantiate_dataset(cfg.dataset, "dataset", self.tokenizer)
        self.dataset, report = fit_sft_dataset(
            ds, tokenizer=self.tokenizer, model_max_seq_len=model_limits(cfg.model).max_seq_len,
            on_too_long=cfg.on_too_long, ignore_index=cfg.loss.get("ignore_index", CROSS_ENTROPY_IGNORE_IDX))
        if report is not None and self.is_rank_zero:
            get_logger("INFO").info(report.message())

    def _setup_data(self) -> None:
        cfg = self.cfg
        ds = self.dataset
        pad = getattr(self.tokenizer, "pad_id", 0)
        self.dataloader = build_dataloader(
            ds, batch_size=cfg.batch_size, shuffle=cfg.shuffle, seed=cfg.seed, rank=self.rank,
            world_size=self.world_size, padding_idx=0 if pad is None else pad,
            ignore_index=getattr(self.loss_fn, "ignore_index", CROSS_ENTROPY_IGNORE_IDX),
            num_workers=cfg.num_workers)
        ga = cfg.gradient_accumulation_steps
        self.steps_per_epoch = len(self.dataloader) // ga
        if cfg.max_steps_per_epoch is not None:
            self.steps_per_epoch = min(self.steps_per_epoch, cfg.max_steps_per_epoch)
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"config key 'batch_size': {len(ds)} rows give {len(self.dataloader)} micro-batches of "
                f"{cfg.batch_size} per rank, fewer than gradient_accumulation_steps={ga}")
        self.total_steps = cfg.epochs * self.steps_per_epoch
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)

    # ------------------------------------------------------------------ checkpoints
    def _recipe_state(self) -> Dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "micro_batches_in_epoch": self.mb_in_epoch,
                "optimizer": self.runtime.optimizer_state_dict(self.model, self.optimizer),
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "rng": self.runtime.rng_states(), "seed": self.seed, "world_size": self.world_size,
                "nonfinite": self.train_step.guard.state_dict(), "config": config_summary(self.cfg)}

    def save(self) -> None:
        """Saves a complete checkpoint of the current step (all ranks take part, rank 0 writes)."""
        cfg = self.cfg
        # every rank checks its shards and raises together: never a checkpoint of NaN/inf weights
        check_finite_weights(dict(self.model.named_parameters()), what=f"checkpoint step_{self.step:06d}",
                             all_reduce=self.runtime.all_reduce)
        state = self._recipe_state()
        full_sd = self.runtime.full_state_dict(self.model)
        if self.is_rank_zero:
            if self.lora:
                adapter, merged = model_utils.lora_states(full_sd, cfg.model, merge=cfg.merge_adapters)
                self.ckpt.save(step=self.step, epoch=self.epoch, recipe_state=state, model_state=merged,
                               adapter_state=adapter)
            else:
                self.ckpt.save(step=self.step, epoch=self.epoch, recipe_state=state, model_state=full_sd)
        self.runtime.barrier()

    def _name(self) -> str:
        return ("lora" if self.lora else "full") + "_sft_" + ("distributed" if self.distributed else "single_device")

    # ------------------------------------------------------------------ loop
    def run(self) -> List[float]:
        """Trains; returns the loss of every optimizer step this process ran."""
        cfg = self.cfg
        apply_cpu_threads(cfg.cpu_threads, cfg.device)
        self._setup_runtime()
        self._setup_dataset()  # config and data checks first: a run that fails them claims no folder
        # output_dir ownership, verified checkpoint, config changes: decided before the model is built
        self.start = start_run(cfg, fixed_keys=SFT_FIXED_ON_RESUME, runtime=self.runtime, recipe=self._name())
        resume_dir, recipe_state = self.start.checkpoint, self.start.recipe_state
        self._setup_model(resume_dir)
        self._setup_data()
        self._setup_optim(recipe_state)
        self.step, self.epoch, self.mb_in_epoch = 0, 0, 0
        if recipe_state is not None:
            self.step, self.epoch = recipe_state["step"], recipe_state["epoch"]
            self.mb_in_epoch = recipe_state["micro_batches_in_epoch"]
            set_rng_state(self.runtime.own_rng_state(recipe_state["rng"]))
        logger = build_metric_logger(cfg.metric_logger, cfg.output_dir, is_rank_zero=self.is_rank_zero)
        if self.is_rank_zero and recipe_state is None:
            logger.log_config(cfg)
        bar = ProgressBar(self.total_steps, initial=self.step, enabled=self.is_rank_zero)
        ga = cfg.gradient_accumulation_steps
        it = None
        timer = StepTimer(self.device)
        last_saved = self.step if resume_dir is not None else -1
        self.model.train()
        while self.step < self.total_steps:
            if it is None or self.mb_in_epoch // ga >= self.steps_per_epoch:
                if it is not None:
                    self.epoch, self.mb_in_epoch = self.epoch + 1, 0
                self.dataloader.sampler.set_epoch(self.epoch, start=self.mb_in_epoch * cfg.batch_size)
                it = iter(self.dataloader)
            mbs = [batch_to_device(next(it), self.device) for _ in range(ga)]
            self.mb_in_epoch += ga
            res = self.train_step(mbs, self.objective, step=self.step + 1)
            self.step += 1
            self.losses.append(res.loss)
            n_tok = self.runtime.all_reduce(torch.tensor(float(sum(mb["tokens"].numel() for mb in mbs))))
            metrics = {"loss": res.loss, "lr": self.optimizer.param_groups[0]["lr"],
                       "num_tokens": res.num_units, "skipped": float(res.skipped),
                       "skipped_steps": res.skipped_steps, **timer.lap(int(n_tok.item())),
                       **peak_memory_gib(self.device)}
            if res.grad_norm is not None:
                metrics["grad_norm"] = res.grad_norm
            bar.update(metrics)
            if self.step % cfg.log_every_n_steps == 0 or self.step == self.total_steps:
                logger.log_dict(metrics, step=self.step)
            if cfg.save_every_n_steps is not None and self.step % cfg.save_every_n_steps == 0:
                self.save()
                last_saved = self.step
        if cfg.save_final_checkpoint and last_saved != self.step:
            self.save()
        bar.close()
        self.ckpt.log_final(self.step)
        logger.close()
        self.runtime.shutdown()
        return self.losses


@report_errors
def recipe_main(cfg: DictConfig, *, lora: bool = False, distributed: bool = False) -> None:
    """Entry point used by the recipe files: ``SFTRecipe(cfg, ...).run()``; a ConfigError ends the
    run with one line on stderr and exit status 2 (:func:`~logitless.training.cli.report_errors`)."""
    SFTRecipe(cfg, lora=lora, distributed=distributed).run()

