"""Shared training machinery for the SFT and GRPO recipes (their loops live in ``recipes/``).

One concern per module:

- :mod:`~logitless.training.config`: config validation (:func:`validate_config`, :class:`Key`, :class:`ConfigError`).
- :mod:`~logitless.training.preflight`: checks before the model is built (optimizer values, device,
  every SFT row's length against ``max_seq_len`` with counts, ``on_too_long``).
- :mod:`~logitless.training.cli`: :func:`report_errors`, a ConfigError as one line on stderr (exit 2), a
  CheckpointSaveError likewise (exit 1).
- :mod:`~logitless.training.step`: :class:`TrainStep`, the one optimizer-step engine of SFT and GRPO
  (accumulation normalised over the whole batch of every rank, reductions through ``Runtime``,
  clipping, step, schedule, non-finite skips) running a :class:`StepObjective`.
- :mod:`~logitless.training.nonfinite`: :class:`NonFiniteGuard` (skip steps with a NaN/inf gradient norm or
  loss, count them, stop after too many in a row) and :func:`check_finite_weights` (no NaN checkpoint).
- :mod:`~logitless.training.checkpoint`: :class:`CheckpointManager`, atomic HF-format checkpoints with
  the recipe state, a checksummed completion marker and the run id that owns them;
  :func:`verify_checkpoint`; :class:`CheckpointSaveError` (a save that failed for space, named);
  :func:`rng_state` / :func:`set_rng_state`.
- :mod:`~logitless.training.run_lock`: :class:`OutputDirLock`, one run per ``output_dir`` (an OS lock
  held for the run's life, naming its holder to a second process).
- :mod:`~logitless.training.resume`: :func:`start_run` (new run in an empty folder, or resume from the
  newest verifying checkpoint, with the config changes checked) and :func:`apply_optimizer_changes`.
- :mod:`~logitless.training.dataloader`: :class:`ResumableSampler`, :func:`build_dataloader`.
- :mod:`~logitless.training.model`: build in a dtype, load weights naming mismatches, LoRA, AC, compile.
- :mod:`~logitless.training.progress`: tqdm bar, tokens/s, peak memory.
- :mod:`~logitless.training.flops`: model FLOPs of forward/backward passes and peak bf16 FLOP/s of known GPUs (MFU).
- :mod:`~logitless.training.metric_logging`: torchtune metric loggers (DiskLogger by default).
- :mod:`~logitless.training.sft`: :class:`SFTObjective` (forward + label shift + loss contract).
- :mod:`~logitless.training.sft_config`: the SFT recipes' config schema and :func:`validate_sft_config`.
- :mod:`~logitless.training.sft_data`: the SFT tokenizer, fitted dataset and loader with the run's step counts.
- :mod:`~logitless.training.builders`: set-up steps of every recipe (checkpoint manager, model with its
  weights, activation checkpointing / compile / FSDP2, optimizer and LR schedule).
- :mod:`~logitless.training.run_state`: the state a checkpoint saves besides the weights, restoring it,
  and :func:`save_checkpoint`.
- :mod:`~logitless.training.threads`: ``cpu_threads`` (torch's CPU threads per recipe process, ``auto`` by default).
"""

# Public: __all__ (docs/CONTRACT.md). The other names are internal, imported here for the recipes and tests.
from logitless.training.checkpoint import (CheckpointManager, complete_checkpoints, rng_state, set_rng_state,
                                          verify_checkpoint)
from logitless.training.config import ConfigError, Key, config_summary, resolve_component, validate_config
from logitless.training.dataloader import ResumableSampler, batch_to_device, build_dataloader, is_packed
from logitless.training.metric_logging import build_metric_logger, read_disk_log
from logitless.training.nonfinite import (NonFiniteGuard, NonFiniteStepsError, NonFiniteWeightsError,
                                          check_finite_weights)
from logitless.training.model import CheckpointMismatchError, build_model, check_state_dict, load_weights
from logitless.training.progress import ProgressBar, StepTimer, peak_memory_gib
from logitless.training.resume import RunStart, apply_optimizer_changes, start_run
from logitless.training.sft import SFTObjective
from logitless.training.step import StepObjective, StepResult, TrainStep

__all__ = ["ConfigError"]
