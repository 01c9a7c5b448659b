"""Sampling completions from the policy for a GRPO step or an evaluation, on one device or sharded.

:class:`PolicySampler` holds what the config's ``generation:`` block sets up once (the sampler chosen
by ``generation.backend``, the sampling arguments, the stop tokens checked against the vocabulary)
and how a sharded policy is sampled: through an unsharded rollout copy refreshed from the shards
before each sampling phase (``generation.rollout_copy``; the compiled sampler needs weights whose
storage never moves), or with the shards gathered for the phase (``Runtime.full_weights``).

Example:
    >>> sampler = PolicySampler.from_config(cfg, tokenizer, runtime)
    >>> sampler.build_rollout_copy(cfg.model, dtype=dtype, seed=seed)  # after start_run: builds a model
    >>> with sampler.weights(policy):
    ...     rollout, prompts, texts, fields = sampler.sample(policy, rows, 4, generators)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig
from torch import nn

from logitless.generation.builder import build_sampler, build_turn_sampler, uses_rollout_copy
from logitless.generation.config import SamplerConfig, check_stop_tokens
from logitless.generation.result import Rollout
from logitless.generation.tools.config import ToolTurns, build_tool_turns
from logitless.generation.tools.eager import generate_turns
from logitless.rl.prompts import PROMPT_KEYS
from logitless.rl.rewards import COMPLETION_IDS
from logitless.training import model as model_utils
from logitless.training.distributed import Runtime
from logitless.training.preflight import model_limits


#: What a tool rollout adds to the reward functions' keyword arguments: each trajectory's messages
#: and its environment's info.
TRAJECTORY_COLUMNS = ("conversation", "environment_info")


class PolicySampler:
    """Samples a policy's completions and decodes them.

    Args:
        sample_fn (Callable): the training sampler (``generate``'s call).
        eval_sample_fn (Callable): the evaluation sampler.
        config (SamplerConfig): the ``generation:`` block, its stop tokens set.
        tokenizer (Any): decodes completions; its ``pad_id`` (0 when None) left-pads prompts.
        runtime (Runtime): gathers a sharded policy's weights.
        rollout_copy (bool): sample through an unsharded copy (:meth:`build_rollout_copy` builds it).
        max_seq_len (Optional[int]): the longest sequence the sampler can run (model and
            ``generation.max_cache_len``); None when unknown.
        turns (Optional[ToolTurns]): tool / environment turns: every call samples multi-turn
            trajectories with ``turn_sample_fns``.
        turn_sample_fns (Optional[Tuple[Callable, Callable]]): the training and evaluation samplers of
            multi-turn rollouts (:func:`~logitless.generation.builder.build_turn_sampler`); None = the eager
            reference (:func:`~logitless.generation.tools.eager.generate_turns`) for both.
    """

    def __init__(self, sample_fn: Callable, eval_sample_fn: Callable, config: SamplerConfig, tokenizer: Any,
                 runtime: Runtime, *, rollout_copy: bool = False, max_seq_len: Optional[int] = None,
                 turns: Optional[ToolTurns] = None, turn_sample_fns: Optional[Tuple[Callable, Callable]] = None):
        self.sample_fn, self.eval_sample_fn, self.config = sample_fn, eval_sample_fn, config
        self.turns = turns
        self.turn_sample_fn, self.eval_turn_sample_fn = turn_sample_fns or (generate_turns, generate_turns)
        self.tokenizer, self.runtime = tokenizer, runtime
        self.pad_id = tokenizer.pad_id if getattr(tokenizer, "pad_id", None) is not None else 0
        self.rollout_copy, self.max_seq_len = rollout_copy, max_seq_len
        self.rollout_model: Optional[nn.Module] = None
        self._rollout_synced = False

    @classmethod
    def from_config(cls, cfg: DictConfig, tokenizer: Any, runtime: Runtime) -> "PolicySampler":
        """The sampler of a validated GRPO config (nothing is built that holds weights).

        Args:
            cfg (DictConfig): the config (``generation``, ``model``, ``fsdp_cpu_offload``).
            tokenizer (Any): its ``stop_tokens`` (or ``eos_id``) end completions unless
                ``generation.stop_tokens`` is set.
            runtime (Runtime): where the policy lives, and whether it is sharded.

        Returns:
            PolicySampler: the sampler.

        Raises:
            ConfigError: a bad ``generation`` value, a stop token outside the model's vocabulary, or
                tool turns that do not fit the tokenizer (:func:`~logitless.generation.tools.config.build_tool_turns`).
        """
        config = SamplerConfig.from_config(cfg.generation)
        limits = model_limits(cfg.model)
        check_stop_tokens(config.stop_tokens or [], limits.vocab_size, "generation.stop_tokens")
        if config.stop_tokens is None:
            config = config.with_stop_tokens(getattr(tokenizer, "stop_tokens", [tokenizer.eos_id]))
        check_stop_tokens(config.stop_tokens, limits.vocab_size, "tokenizer")
        known = [v for v in (limits.max_seq_len, config.compiled.max_cache_len) if v is not None]
        offload = bool(cfg.get("fsdp_cpu_offload", False))
        sample_fn, eval_sample_fn = build_sampler(config, runtime.device, sharded=runtime.distributed,
                                                  cpu_offload=offload)
        turns = build_tool_turns(cfg, tokenizer, config.stop_tokens)
        turn_sample_fns = None if turns is None else build_turn_sampler(config, runtime.device,
                                                                        sharded=runtime.distributed,
                                                                        cpu_offload=offload)
        return cls(sample_fn, eval_sample_fn, config, tokenizer, runtime,
                   rollout_copy=uses_rollout_copy(config, runtime.device, sharded=runtime.distributed,
                                                  cpu_offload=offload),
                   max_seq_len=min(known) if known else None,
                   turns=turns, turn_sample_fns=turn_sample_fns)

    @property
    def max_new_tokens(self) -> int:
        return self.config.max_new_tokens

    @property
    def reward_columns(self) -> Tuple[str, ...]:
        """The keyword arguments :meth:`sample` adds to a row's columns for the reward functions."""
        return (COMPLETION_IDS,) + (TRAJECTORY_COLUMNS if self.turns is not None else ())

    def build_rollout_copy(self, model_cfg: DictConfig, *, dtype: torch.dtype, seed: int) -> None:
        """Builds the unsharded copy the policy is sampled through, when the sampler uses one."""
        if self.rollout_copy:
            self.rollout_model = model_utils.build_model(model_cfg, device=self.runtime.device, dtype=dtype,
                                                         seed=seed).eval().requires_grad_(False)

    @contextlib.contextmanager
    def weights(self, policy: nn.Module) -> Iterator[None]:
        """The policy's full weights for a sampling phase (every rank enters it).

        Refreshes the rollout copy from the shards, or, without a copy, keeps the shards gathered
        for the phase (``Runtime.full_weights``; a no-op on one device).
        """
        if self.rollout_model is not None:
            # Frozen weights (a LoRA policy's base) cannot change: copied once.
            self.runtime.copy_full_weights(policy, self.rollout_model, trainable_only=self._rollout_synced)
            self._rollout_synced = True
            yield
            return
        with self.runtime.full_weights(policy):
            yield

    def sample(self, policy: nn.Module, rows: Sequence[Dict[str, Any]], num_generations: int, generator: Any,
               *, evaluation: bool = False, **overrides: Any) -> Tuple[Rollout, List[str], List[str], Dict[str, list]]:
        """``num_generations`` completions of each row's prompt (inside :meth:`weights`).

        Args:
            policy (nn.Module): the policy (sampled through its rollout copy when there is one).
            rows (Sequence[Dict]): dataset rows (``prompt_tokens``, ``prompt`` and other columns).
            num_generations (int): completions per prompt.
            generator (Any): the random streams (one per prompt), or None for greedy sampling.
            evaluation (bool): use the evaluation sampler.
            **overrides: sampling arguments for this call (``temperature=0.0``).

        Returns:
            Tuple: the rollout, and per completion (in rollout order) its prompt text, its decoded
            text and the row's other columns (``{column: [value, ...]}``) with ``completion_ids``
            (its token ids, stop token included): the reward functions' keyword arguments. With tool
            turns the text is the model's last turn, ``completion_ids`` the tokens it sampled (every
            turn), and the columns add each trajectory's ``conversation`` (its messages) and
            ``environment_info``.
        """
        model = self.rollout_model if self.rollout_model is not None else policy
        fields = {k: [r[k] for r in rows for _ in range(num_generations)] for k in rows[0] if k not in PROMPT_KEYS}
        if self.turns is not None:
            session = self.turns.session(rows, num_generations)
            sample_turns = self.eval_turn_sample_fn if evaluation else self.turn_sample_fn
            rollout = sample_turns(model, session, pad_id=self.pad_id, generator=generator,
                                   prefill_chunk_tokens=self.config.prefill_chunk_tokens,
                                   segment_prefill_tokens=self.turns.settings.segment_prefill_tokens,
                                   **self.config.sampling_args(**overrides))
            conversation, info = TRAJECTORY_COLUMNS
            fields[conversation] = [t.messages for t in rollout.trajectories]
            fields[info] = [t.info for t in rollout.trajectories]
            fields[COMPLETION_IDS] = [t[m].tolist() for t, m in zip(rollout.completion_tokens.cpu(),
                                                                    rollout.loss_mask.cpu())]
            prompts = [text for text in session.prompt_texts for _ in range(num_generations)]
            return rollout, prompts, [t.final_answer for t in rollout.trajectories], fields
        sample = self.eval_sample_fn if evaluation else self.sample_fn
        rollout = sample(model, [r["prompt_tokens"] for r in rows], num_generations=num_generations,
                         pad_id=self.pad_id, generator=generator, **self.config.sampling_args(**overrides))
        completion_ids = [t[m].tolist() for t, m in zip(rollout.completion_tokens.cpu(), rollout.completion_mask.cpu())]
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
        prompts = [r["prompt"] for r in rows for _ in range(num_generations)]
        # the sampled token ids reach every reward function too (TRL's keyword): token-length rewards
        return rollout, prompts, texts, {**fields, COMPLETION_IDS: completion_ids}


__all__ = ["PolicySampler"]
