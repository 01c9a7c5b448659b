"""Full fine-tuning on one device (GPU or CPU), and the SFT loop every SFT recipe runs.
Run: tune run full_sft_single_device --config configs/tiny_full.yaml

This file is the SFT recipe to read and edit (``logitless cp full_sft_single_device my_sft.py``):
:class:`SFTRecipe` sets up from the config (each step a builder of :mod:`logitless.training`),
trains (micro-batches, one optimizer step, metrics, checkpoints) and cleans up. The other SFT
recipes run this class and differ only where it takes ``lora`` and ``distributed``:

- ``lora_sft_single_device`` (``lora=True``): a ``lora_*`` model, trained adapters over a frozen
  base; each checkpoint saves the adapters separately and, with ``merge_adapters``, the merged model.
- ``full_sft_distributed`` / ``lora_sft_distributed`` (``distributed=True``): the Runtime joins the
  process group, FSDP2 shards the model, each rank loads its share of every batch.

The loss is whatever ``loss._component_`` names (``logitless.losses.*``); the recipe uses only the
loss contract (:class:`~logitless.training.sft.SFTObjective`).
"""

import sys
from typing import List

# before torchtune: registers ${logitless_asset:...} and drops torchao's import-time cpp-extension notice
import logitless  # noqa: F401, I001
import torch
from omegaconf import DictConfig
from torchtune import config, training
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX

from logitless.first_start import use_persistent_compile_cache
from logitless.training.builders import (build_checkpoint_manager, build_model_with_weights, build_optimizer,
                                         setup_process, wrap_model)
from logitless.training.cli import report_errors
from logitless.training.dataloader import batch_to_device
from logitless.training.distributed import free_finished_run
from logitless.training.interrupt import exit_on_interrupt
from logitless.training.metric_logging import build_metric_logger
from logitless.training.preflight import check_device
from logitless.training.progress import ProgressBar, StepTimer, is_due, peak_memory_gib
from logitless.training.resume import start_run
from logitless.training.run_lock import OutputDirLock
from logitless.training.run_state import restore_training_state, save_checkpoint, training_state
from logitless.training.sft import SFTObjective
from logitless.training.sft_config import SFT_FIXED_ON_RESUME, validate_sft_config
from logitless.training.sft_data import build_sft_dataloader, build_sft_dataset
from logitless.training.step import TrainStep


class SFTRecipe:
    """Full or LoRA supervised fine-tuning, on one device or with FSDP2.

    Args:
        cfg (DictConfig): the recipe config (validated here, before anything is built).
        lora (bool): train LoRA adapters only (base frozen), save them separately.
        distributed (bool): FSDP2 over all ranks of the process group (``tune run --nproc_per_node``).

    Example:
        >>> recipe = SFTRecipe(OmegaConf.load("configs/tiny_full.yaml"))
        >>> losses = recipe.run()  # setup(), train(), cleanup()
    """

    def __init__(self, cfg: DictConfig, *, lora: bool = False, distributed: bool = False):
        self.cfg = validate_sft_config(cfg, lora=lora, distributed=distributed)
        check_device(self.cfg.device)
        self.lora, self.distributed = lora, distributed
        self.name = ("lora" if lora else "full") + "_sft_" + ("distributed" if distributed else "single_device")
        self.output_lock = OutputDirLock(self.cfg.output_dir)  # taken in setup(), held until the run ends
        self.losses: List[float] = []  # loss of every optimizer step run by this process

    def setup(self) -> None:
        """Builds everything from the config, in an order that fails early: output_dir is locked
        first (another process writing there stops the run at once), config and data checks claim no
        output folder, and the folder and resume are settled before the model is built."""
        cfg = self.cfg
        self.runtime, self.dtype, self.seed = setup_process(cfg, distributed=self.distributed)
        self.output_lock.acquire(self.runtime)  # one run per output_dir (rank 0 holds it for the job)
        self.device = self.runtime.device
        self.tokenizer, self.dataset = build_sft_dataset(cfg, log=self.runtime.is_rank_zero)
        # output_dir ownership, verified checkpoint, config changes: decided before the model is built
        self.start = start_run(cfg, fixed_keys=SFT_FIXED_ON_RESUME, runtime=self.runtime, recipe=self.name)
        self.ckpt = build_checkpoint_manager(cfg, self.runtime, run_id=self.start.run_id)
        self.model = build_model_with_weights(cfg, self.ckpt, device=self.device, dtype=self.dtype, seed=self.seed,
                                              lora=self.lora, resume_dir=self.start.checkpoint)
        self.loss_fn = config.instantiate(cfg.loss)
        # calls loss_fn.set_model_output(model); activation offloading around the model's forward, as torchtune's
        self.objective = SFTObjective(self.model, self.loss_fn, activations=training.get_act_offloading_ctx_manager(
            self.model, cfg.enable_activation_offloading))
        wrap_model(self.model, cfg, self.runtime)  # activation checkpointing, compile, FSDP2
        self.dataloader, self.steps_per_epoch, self.total_steps = build_sft_dataloader(
            cfg, self.dataset, self.tokenizer, self.runtime,
            ignore_index=getattr(self.loss_fn, "ignore_index", CROSS_ENTROPY_IGNORE_IDX))
        self.optimizer, self.lr_scheduler = build_optimizer(cfg, self.model, num_training_steps=self.total_steps)
        self.train_step = TrainStep(self.model, self.optimizer, self.lr_scheduler,
                                    clip_grad_norm=cfg.clip_grad_norm, runtime=self.runtime,
                                    max_consecutive_skipped_steps=cfg.max_consecutive_skipped_steps)
        self.step, self.epoch, self.mb_in_epoch = 0, 0, 0  # optimizer steps, data epoch, micro-batches in it
        state = self.start.recipe_state
        if state is not None:
            self.step, self.epoch, self.mb_in_epoch = state["step"], state["epoch"], state["micro_batches_in_epoch"]
            restore_training_state(state, runtime=self.runtime, model=self.model, optimizer=self.optimizer,
                                   lr_scheduler=self.lr_scheduler, guard=self.train_step.guard,
                                   changes=self.start.changes)
        self.metric_logger = build_metric_logger(cfg.metric_logger, cfg.output_dir,
                                                 is_rank_zero=self.runtime.is_rank_zero)
        if self.runtime.is_rank_zero and state is None:
            self.metric_logger.log_config(cfg)

    def train(self) -> None:
        """Optimizer steps up to ``total_steps``: each over ``gradient_accumulation_steps`` micro-batches."""
        cfg, ga = self.cfg, self.cfg.gradient_accumulation_steps
        bar = ProgressBar(self.total_steps, initial=self.step, enabled=self.runtime.is_rank_zero)
        timer = StepTimer(self.device)
        final_save = self.total_steps if cfg.save_final_checkpoint else None
        batches = None
        self.model.train()
        while self.step < self.total_steps:
            if batches is None or self.mb_in_epoch // ga >= self.steps_per_epoch:  # (re)start an epoch
                if batches is not None:
                    self.epoch, self.mb_in_epoch = self.epoch + 1, 0
                self.dataloader.sampler.set_epoch(self.epoch, start=self.mb_in_epoch * cfg.batch_size)
                batches = iter(self.dataloader)
            micro_batches = [batch_to_device(next(batches), self.device) for _ in range(ga)]
            self.mb_in_epoch += ga
            result = self.train_step(micro_batches, self.objective, step=self.step + 1)
            self.step += 1
            self.losses.append(result.loss)
            tokens = self.runtime.all_reduce(torch.tensor(float(sum(mb["tokens"].numel() for mb in micro_batches))))
            metrics = {"loss": result.loss, "lr": self.optimizer.param_groups[0]["lr"],
                       "num_tokens": result.num_units, "skipped": float(result.skipped),
                       "skipped_steps": result.skipped_steps, **timer.lap(int(tokens.item())),
                       **peak_memory_gib(self.device)}
            if result.grad_norm is not None:
                metrics["grad_norm"] = result.grad_norm
            bar.update(metrics)
            if is_due(self.step, cfg.log_every_n_steps, last_step=self.total_steps):
                self.metric_logger.log_dict(metrics, step=self.step)
            if is_due(self.step, cfg.save_every_n_steps, last_step=final_save):
                self.save()
        bar.close()
        self.ckpt.log_final(self.step)

    def save(self) -> None:
        """A complete checkpoint of the current step (all ranks take part, rank 0 writes)."""
        state = {"step": self.step, "epoch": self.epoch, "micro_batches_in_epoch": self.mb_in_epoch,
                 **training_state(self.runtime, self.model, self.optimizer, self.lr_scheduler, self.train_step.guard,
                                  seed=self.seed, cfg=self.cfg)}
        save_checkpoint(self.ckpt, self.runtime, self.model, step=self.step, epoch=self.epoch, recipe_state=state,
                        lora_model_cfg=self.cfg.model if self.lora else None,
                        merge_adapters=self.cfg.get("merge_adapters", True))

    def cleanup(self) -> None:
        self.metric_logger.close()
        self.runtime.shutdown()
        self.output_lock.release()

    def run(self) -> List[float]:
        """``setup()``, ``train()``, ``cleanup()``; returns the loss of every optimizer step this process ran.
        ``output_dir`` is unlocked however the run ends."""
        try:
            self.setup()
            self.train()
            self.cleanup()
        finally:
            self.output_lock.release()
        return self.losses


@report_errors
def run_sft(cfg: DictConfig, *, lora: bool, distributed: bool) -> None:
    """Runs :class:`SFTRecipe`; a ConfigError ends the run with one line on stderr and exit status 2,
    Ctrl-C with one line naming the last checkpoint and exit status 130. The finished recipe is freed
    before returning (:func:`~logitless.training.distributed.free_finished_run`)."""
    use_persistent_compile_cache()  # compiled code is kept across runs (logitless.first_start)
    recipe = SFTRecipe(cfg, lora=lora, distributed=distributed)
    with exit_on_interrupt(recipe.cfg.output_dir, steps_done=lambda: getattr(recipe, "step", None)):
        recipe.run()
    del recipe  # nothing may hold the finished run when free_finished_run collects its reference cycles
    free_finished_run()


@config.parse
def main(cfg: DictConfig) -> None:
    run_sft(cfg, lora=False, distributed=False)


if __name__ == "__main__":
    sys.exit(main())
