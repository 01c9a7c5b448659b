"""GRPO on one device (GPU or CPU), full or LoRA policy, and the GRPO loop grpo_distributed runs too.
Run: tune run grpo_single_device --config configs/tiny_grpo.yaml

This file is the GRPO recipe to read and edit (``logitless cp grpo_single_device my_grpo.py``):
:class:`GRPORecipe` sets up from the config, then each step samples ``num_generations`` completions
of ``prompts_per_step`` prompts, scores them with the configured rewards, computes group-relative
advantages and runs ``num_iterations`` optimizer steps over the batch in micro-batches of
``micro_batch_size`` completions with ``logitless.losses.GRPOLoss``. A ``lora_*`` model trains its
adapters only (the reference is then the policy with its adapters disabled).

The prompts come from one prompt stream (the dataset, reshuffled each epoch); with
``dynamic_sampling`` a step drops the groups whose rewards are all equal and samples further rounds
of prompts from the same stream until it has ``prompts_per_step`` groups
(:mod:`logitless.rl.dynamic_sampling`). With ``ref_model_sync_steps`` the frozen KL reference moves
towards the policy every N steps (:meth:`logitless.rl.reference.ReferencePolicy.mix_in`). A
checkpoint holds the stream's position and a moved reference, so a resumed run continues exactly.

``grpo_distributed`` runs this class with ``distributed=True``: each rank samples, scores and trains
on its contiguous share of the step's prompts (a group never spans two ranks), from one random
stream per prompt seeded by ``(seed, step, prompt index)``; rewards, lengths and truncation flags
are gathered, so advantages, loss normalisers and every logged metric are those of the whole batch,
and a run samples the same completions as one device does.
"""

import sys
import time
from typing import Dict, List

# before torchtune: registers ${logitless_asset:...} and drops torchao's import-time cpp-extension notice
import logitless  # noqa: F401, I001
import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config
from torchtune.utils import get_logger

from logitless.first_start import use_persistent_compile_cache
from logitless.rl.advantages import advantage_settings, compute_advantages
from logitless.rl.completion_log import CompletionLogger
from logitless.rl.config import GRPO_FIXED_ON_RESUME, validate_grpo_config
from logitless.rl.dynamic_sampling import GroupFill, ScoredRollout, micro_batch_size_for
from logitless.rl.evaluation import greedy_accuracy
from logitless.rl.metrics import TURN_COLUMNS, gather_columns, rollout_metrics, turn_columns, turn_metrics, update_flops
from logitless.generation.policy_sampler import PolicySampler
from logitless.rl.prompt_sets import build_prompt_datasets, fit_prompts, prompt_stream_indices
from logitless.rl.reference import build_reference, reference_sync_due
from logitless.rl.reward_models import place_reward_models
from logitless.rl.rewards import build_reward_specs, compute_rewards
from logitless.generation import prompt_generators
from logitless.rl.shared_batch import step_packing_attention, training_batch, use_prompt_sharing
from logitless.rl.update import grpo_update
from logitless.training import model as model_utils
from logitless.training.builders import (build_checkpoint_manager, build_model_with_weights, build_optimizer,
                                         fsdp_options, load_resumed_weights, setup_process, wrap_model)
from logitless.training.cli import report_errors
from logitless.training.distributed import free_finished_run, launched_world_size
from logitless.training.flops import DecoderFlops, mfu, peak_bf16_flops
from logitless.training.interrupt import exit_on_interrupt
from logitless.training.metric_logging import build_metric_logger
from logitless.training.nonfinite import NonFiniteGuard
from logitless.training.preflight import check_device
from logitless.training.progress import ProgressBar, busiest_rank_peak_memory_gib, is_due
from logitless.training.resume import start_run
from logitless.training.run_lock import OutputDirLock
from logitless.training.run_state import restore_training_state, save_checkpoint, training_state


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
        self.advantage_estimator, self.scale_rewards = advantage_settings(self.cfg)
        self.output_lock = OutputDirLock(self.cfg.output_dir)  # taken in setup(), held until the run ends
        self.history: List[Dict[str, float]] = []  # metrics of every step this process ran

    def setup(self) -> None:
        """Builds everything from the config, in an order that fails early: output_dir is locked
        first (another process writing there stops the run at once), prompts, rewards and sampler
        are checked before the output folder is claimed, the folder and resume before the policy is
        built."""
        cfg = self.cfg
        self.runtime, self.dtype, self.seed = setup_process(cfg, distributed=self.distributed)
        self.output_lock.acquire(self.runtime)  # one run per output_dir (rank 0 holds it for the job)
        self.device = self.runtime.device
        self.tokenizer, self.dataset, self.eval_dataset = build_prompt_datasets(cfg)
        self.rewards = build_reward_specs(OmegaConf.to_container(cfg.rewards, resolve=True))
        place_reward_models(self.rewards, self.device)  # reward models run on the policy's device
        self.sampler = PolicySampler.from_config(cfg, self.tokenizer, self.runtime)
        if self.sampler.turns is not None:  # prompts as the rollout renders them: with the tools
            self.dataset = self.sampler.turns.render_prompts(self.dataset, "dataset")
            self.eval_dataset = self.sampler.turns.render_prompts(self.eval_dataset, "eval_dataset")
        # every prompt must hold the values its rewards read and fit the sampler's length limit
        limits = dict(rewards=self.rewards, max_seq_len=self.sampler.max_seq_len,
                      max_new_tokens=self.sampler.max_new_tokens, log=self.runtime.is_rank_zero,
                      rollout_columns=self.sampler.reward_columns)
        self.dataset = fit_prompts(self.dataset, "dataset", cfg, **limits)
        self.eval_dataset = fit_prompts(self.eval_dataset, "eval_dataset", cfg, **limits)
        # output_dir ownership, verified checkpoint, config changes: decided before the policy is built
        start = start_run(cfg, fixed_keys=GRPO_FIXED_ON_RESUME, runtime=self.runtime,
                          recipe="grpo_distributed" if self.distributed else "grpo_single_device")
        self.ckpt = build_checkpoint_manager(cfg, self.runtime, run_id=start.run_id)
        self.model = build_model_with_weights(cfg, self.ckpt, device=self.device, dtype=self.dtype, seed=self.seed,
                                              lora=self.is_lora)
        self.sampler.build_rollout_copy(cfg.model, dtype=self.dtype, seed=self.seed)
        self.loss_fn = config.instantiate(cfg.loss)
        self.loss_fn.set_model_output(self.model)
        # the reference is the policy before any training (also when resuming)
        self.reference = build_reference(self.model, getattr(self.loss_fn, "beta", 0.0), self.is_lora)
        # a reference synced towards the policy (ref_model_sync_steps) is part of the run's state
        self.reference_moved = start.recipe_state is not None and "reference_model" in start.recipe_state
        if self.reference_moved and self.reference is not None:
            model_utils.load_weights(self.reference.model, start.recipe_state["reference_model"],
                                     source=f"{start.checkpoint} (reference_model)")
        if start.checkpoint is not None:
            load_resumed_weights(self.model, self.ckpt, start.checkpoint, lora=self.is_lora)
        wrap_model(self.model, cfg, self.runtime)  # activation checkpointing, FSDP2
        if self.reference is not None and self.reference.model is not self.model:  # a frozen copy: sharded alike
            self.runtime.shard(self.reference.model, **fsdp_options(cfg))
        self.optimizer, self.lr_scheduler = build_optimizer(cfg, self.model)
        self.flops = DecoderFlops(self.model)  # after wrapping: sees activation checkpointing
        self.peak_flops = cfg.peak_flops or (peak_bf16_flops(self.device) if cfg.dtype == "bf16" else None)
        self.guard = NonFiniteGuard(cfg.max_consecutive_skipped_steps)
        self.step = 0
        self.prompts_drawn = 0  # position in the prompt stream (dynamic sampling draws more than a step's)
        if start.recipe_state is not None:
            self.step = start.recipe_state["step"]
            self.prompts_drawn = start.recipe_state.get("prompts_drawn", self.step * cfg.prompts_per_step)
            restore_training_state(start.recipe_state, runtime=self.runtime, model=self.model,
                                   optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, guard=self.guard,
                                   changes=start.changes)
        self.metric_logger = build_metric_logger(cfg.metric_logger, cfg.output_dir,
                                                 is_rank_zero=self.runtime.is_rank_zero)
        if start.recipe_state is None and self.runtime.is_rank_zero:
            self.metric_logger.log_config(cfg)

    def train(self) -> None:
        """Runs GRPO steps up to ``max_steps``: step, eval, metrics, completion tables, checkpoints."""
        cfg, rank_zero = self.cfg, self.runtime.is_rank_zero
        completion_log = CompletionLogger(cfg.output_dir, self.metric_logger, enabled=rank_zero,
                                          every_n_steps=cfg.log_completions_every_n_steps,
                                          num_rows=cfg.log_completions_num_rows)
        bar = ProgressBar(cfg.max_steps, initial=self.step, enabled=rank_zero)
        final_save = cfg.max_steps if cfg.save_final_checkpoint else None
        self.model.train()
        while self.step < cfg.max_steps:
            metrics = self.train_step(self.step)
            self.step += 1
            if cfg.eval_every_n_steps is not None and self.step % cfg.eval_every_n_steps == 0:
                metrics.update(greedy_accuracy(self.model, self.sampler, self.eval_dataset, self.rewards,
                                               num_prompts=cfg.eval_num_prompts, runtime=self.runtime,
                                               reward=cfg.eval_reward or self.rewards[0].name,
                                               batch_size=cfg.eval_batch_size))
            self.history.append({"step": self.step, **metrics})
            bar.bar.set_description(f"reward {metrics['reward/mean']:.3f}", refresh=False)
            bar.update(metrics)
            if is_due(self.step, cfg.log_every_n_steps, last_step=cfg.max_steps):
                self.metric_logger.log_dict(metrics, step=self.step)
            if completion_log.due(self.step) and self.last_rollout is not None:
                completion_log.log(self.step, *self.last_rollout)
            if is_due(self.step, cfg.save_every_n_steps, last_step=final_save):
                self.save()
        bar.close()
        self.ckpt.log_final(self.step)

    def sample_round(self, step: int, num_prompts: int, first: int = 0) -> ScoredRollout:
        """Samples and scores the next ``num_prompts`` prompts of the prompt stream (this rank's share;
        the step's batch, or a refill of dynamic sampling whose prompts follow the step's ``first``)."""
        group_size = self.cfg.num_generations
        share = self.runtime.share(num_prompts)  # this rank's prompts (equal shares: validated / rounded)
        indices = prompt_stream_indices(self.prompts_drawn, num_prompts, num_rows=len(self.dataset), seed=self.seed)
        self.prompts_drawn += num_prompts
        rows = [self.dataset[indices[i]] for i in share]
        streams = [first + i for i in share]  # one random stream per prompt of the step
        with self.sampler.weights(self.model):
            rollout, prompts, texts, fields = self.sampler.sample(
                self.model, rows, group_size, prompt_generators(self.seed, step, streams, self.device))
        rewards = compute_rewards(self.rewards, prompts, texts, fields, batch_id=f"step {step + 1}")
        values = gather_columns({**rewards, "length": rollout.completion_lengths, "truncated": rollout.truncated,
                                 **turn_columns(rollout)}, self.runtime.all_gather)
        return ScoredRollout(rollout, prompts, texts, rewards, values,
                             slice(share.start * group_size, share.stop * group_size))

    def sample_step(self, step: int):
        """The step's groups: one round, or with ``dynamic_sampling`` rounds until ``prompts_per_step``
        groups have a reward spread (at most ``dynamic_sampling_max_rounds``).

        Returns:
            Tuple: the batch to train on (None: no group with a spread), every completion sampled
            (its values, all rounds), the dynamic-sampling metrics.
        """
        cfg = self.cfg
        if not cfg.dynamic_sampling:
            batch = self.sample_round(step, cfg.prompts_per_step)
            return batch, batch.values, {}
        fill = GroupFill(cfg.prompts_per_step, cfg.num_generations, runtime=self.runtime, pad_id=self.sampler.pad_id)
        for _ in range(cfg.dynamic_sampling_max_rounds):
            fill.add(self.sample_round(step, fill.next_round_size(), first=fill.sampled_groups))
            if fill.full:
                break
        if not fill.full and self.runtime.is_rank_zero:
            get_logger("INFO").warning(f"step {step + 1}: {fill.shortfall()}")
        return fill.batch(), fill.sampled_values(), fill.metrics()

    def train_step(self, step: int) -> Dict[str, float]:
        """One GRPO step (generation, rewards, advantages, update); returns the whole batch's metrics."""
        cfg, group_size = self.cfg, self.cfg.num_generations
        t0 = time.perf_counter()
        batch, sampled, sampling_metrics = self.sample_step(step)
        t_gen = time.perf_counter()
        sampled = dict(sampled)
        lengths, truncated = sampled.pop("length"), sampled.pop("truncated")
        turns = {k: sampled.pop(k) for k in TURN_COLUMNS if k in sampled}
        # rewards, lengths and truncation of every completion sampled (all rounds of dynamic sampling)
        metrics = {**rollout_metrics(sampled, lengths, truncated.bool()), **turn_metrics(turns), **sampling_metrics}
        self.last_rollout = None
        if batch is None:  # dynamic sampling found no group with a reward spread: nothing to learn from
            self.sync_reference(step)
            return {**metrics, "lr": self.optimizer.param_groups[0]["lr"], "step_time_s": t_gen - t0,
                    "time/generation_s": t_gen - t0}
        if cfg.dynamic_sampling:
            metrics["dynamic_sampling/batch_reward_mean"] = float(batch.values["total"].mean())
        advantages = compute_advantages(batch.values["total"], group_size, estimator=self.advantage_estimator,
                                        scale_rewards=self.scale_rewards, lengths=batch.values["length"])
        own_advantages = advantages[batch.rows]
        rollout = batch.rollout
        self.last_rollout = (batch.prompts, batch.texts, batch.rewards, own_advantages,
                             None if rollout.trajectories is None else [t.turn_messages for t in rollout.trajectories])
        attention = step_packing_attention(rollout, self.model, enabled=self.prompt_sharing,
                                           attention=cfg.prompt_sharing_attention,
                                           must_pack=cfg.prompt_sharing is True, all_reduce=self.runtime.all_reduce)
        train_batch = training_batch(rollout, prompt_sharing=attention is not None, pad_id=self.sampler.pad_id,
                                     ignore_index=self.loss_fn.ignore_index, attention=attention or "cascade")
        micro_batch_size = micro_batch_size_for(len(own_advantages), cfg.micro_batch_size, group_size)
        upd = grpo_update(self.model, self.loss_fn, self.optimizer, train_batch, own_advantages.to(self.device),
                          micro_batch_size=micro_batch_size, num_iterations=cfg.num_iterations,
                          reference=self.reference, clip_grad_norm=cfg.clip_grad_norm,
                          lr_scheduler=self.lr_scheduler, data_parallel=self.runtime if self.distributed else None,
                          guard=self.guard, step=step + 1, sampler_log_probs=rollout.sampler_log_probs)
        if self.reference is not None:
            self.runtime.release(self.reference.model)
        self.sync_reference(step)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_end = time.perf_counter()
        n_tokens, flops = self.runtime.all_reduce(torch.tensor(
            [float(rollout.prompt_mask.sum()) + float(rollout.completion_lengths.sum()),
             update_flops(self.flops, rollout.prompt_mask.sum(1), rollout.completion_lengths, group_size=group_size,
                          prompt_once=attention is not None, num_iterations=cfg.num_iterations,
                          reference=self.reference is not None,
                          old_pass=self.loss_fn.needs_old_log_probs(cfg.num_iterations, True))],
            dtype=torch.float64)).tolist()
        utilisation = mfu(flops, t_end - t_gen, self.peak_flops, self.runtime.world_size)
        return {**metrics, **upd,
                "prompt_sharing": float(attention is not None), "prompt_sharing_flex": float(attention == "flex"),
                "lr": self.optimizer.param_groups[0]["lr"], "step_time_s": t_end - t0,
                "time/generation_s": t_gen - t0, "time/update_s": t_end - t_gen,
                "tokens_per_second": n_tokens / (t_end - t0), "update_tflop": flops / 1e12,
                **({} if utilisation is None else {"update_mfu": utilisation}),
                **busiest_rank_peak_memory_gib(self.device, self.runtime.all_reduce)}

    def sync_reference(self, step: int) -> None:
        """TR-DPO: every ``ref_model_sync_steps`` steps, reference <- alpha * policy + (1 - alpha) * reference."""
        if self.reference is not None and reference_sync_due(step + 1, self.cfg.ref_model_sync_steps):
            self.reference.mix_in(self.model, self.cfg.ref_model_mixup_alpha)
            self.reference_moved = True

    def save(self) -> None:
        """A complete checkpoint of the current step (weights or adapters + optimizer, scheduler,
        step, RNG); all ranks take part, rank 0 writes."""
        state = {"step": self.step, "prompts_drawn": self.prompts_drawn,
                 **training_state(self.runtime, self.model, self.optimizer, self.lr_scheduler,
                                  self.guard, seed=self.seed, cfg=self.cfg)}
        if self.reference_moved and self.reference is not None:  # no longer the starting weights
            state["reference_model"] = self.runtime.full_state_dict(self.reference.model)
        save_checkpoint(self.ckpt, self.runtime, self.model, step=self.step, epoch=0, recipe_state=state,
                        lora_model_cfg=self.cfg.model if self.is_lora else None,
                        merge_adapters=self.cfg.merge_adapters)

    def cleanup(self) -> None:
        self.metric_logger.close()
        self.runtime.shutdown()
        self.output_lock.release()

    def run(self) -> List[Dict[str, float]]:
        """``setup()``, ``train()``, ``cleanup()``; returns the metrics of every step this process ran.
        ``output_dir`` is unlocked however the run ends."""
        try:
            self.setup()
            self.train()
            self.cleanup()
        finally:
            self.output_lock.release()
        return self.history


@report_errors
def run_grpo(cfg: DictConfig, *, distributed: bool) -> None:
    """Runs :class:`GRPORecipe`; a ConfigError ends the run with one line on stderr and exit status 2,
    Ctrl-C with one line naming the last checkpoint and exit status 130. The finished recipe is freed
    before returning (:func:`~logitless.training.distributed.free_finished_run`)."""
    use_persistent_compile_cache()  # compiled code is kept across runs (logitless.first_start)
    recipe = GRPORecipe(cfg, distributed=distributed)
    with exit_on_interrupt(recipe.cfg.output_dir, steps_done=lambda: getattr(recipe, "step", None)):
        recipe.run()
    del recipe  # nothing may hold the finished run when free_finished_run collects its reference cycles
    free_finished_run()


@config.parse
def main(cfg: DictConfig) -> None:
    run_grpo(cfg, distributed=False)


if __name__ == "__main__":
    sys.exit(main())
