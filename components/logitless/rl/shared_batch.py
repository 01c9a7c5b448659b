"""Prompt once per group in the GRPO update: a batch of whole groups, each packed as
``[prompt | completion 1 | ... | completion G]`` (:func:`logitless.modules.pack_groups`).

The policy, old and reference passes all go through :meth:`SharedGroupBatch.forward`: one forward of
the packed groups (the prompt's keys and values computed once, the G completions' gradients summed
into them), then only the rows that predict completion tokens reach the head
(:func:`logitless.modules.gather_predicting_rows`). Its output and :attr:`SharedGroupBatch.head_labels`
have the ``(B*G, T)`` layout of :meth:`logitless.rl.batch.PolicyBatch.forward` (the response-only
head of the expanded batch), so :func:`logitless.rl.update.grpo_update` and ``GRPOLoss`` take either.
"""

from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

import torch
from torch import nn

from logitless.first_start import note_compile
from logitless.modules import HeadInput, unwrap_compiled
from logitless.modules.cascade_attention import cascade_layout, enable_cascade_attention
from logitless.modules.prompt_sharing import SharedPromptBatch, gather_predicting_rows, pack_groups, segment_mask
from logitless.generation.result import Rollout

ATTENTION = ("cascade", "sdpa", "flex")
#: ``prompt_sharing_attention`` in a config: ``auto`` chooses per step (:func:`packing_attention`).
ATTENTION_SETTINGS = ("auto",) + ATTENTION
#: The flex path pads packed groups to a multiple of this many tokens: torchtune compiles
#: FlexAttention for static shapes, so every distinct length compiles anew, and past torch's
#: recompile limit it would run uncompiled (slow, and it materialises the scores).
FLEX_LENGTH_MULTIPLE = 1024


@dataclass
class SharedGroupBatch:
    """Whole groups of one generation batch, their prompt stored once (unpadded).

    Attributes:
        prompts (List[torch.Tensor]): B 1-D prompts without their left padding.
        completions (torch.Tensor): ``(B, G, T)`` completion tokens (``pad_id`` after the stop token).
        loss_mask (torch.Tensor): ``(B, G, T)`` bool, True at the completion tokens in the loss: those the
            policy sampled (:attr:`logitless.generation.result.Rollout.loss_mask`). Attention does not read it:
            every completion column is context, tool and environment tokens included.
        truncated (torch.Tensor): ``(B*G,)`` bool, completions that hit the length limit.
        pad_id (int): filler token of the packed sequences.
        ignore_index (int): label of positions without a token.
        attention (str): ``"cascade"`` (each completion attends to its prompt's keys and its own:
            only the scores the mask keeps, every device; :mod:`logitless.modules.cascade_attention`),
            ``"sdpa"`` (dense boolean mask, every device) or ``"flex"`` (a FlexAttention ``BlockMask``
            that skips the masked blocks; CUDA only, through torchtune's flex path).
    """

    prompts: List[torch.Tensor]
    completions: torch.Tensor
    loss_mask: torch.Tensor
    truncated: torch.Tensor
    pad_id: int = 0
    ignore_index: int = -100
    attention: str = "cascade"

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")

    @property
    def num_generations(self) -> int:
        """G, completions per group."""
        return self.completions.shape[1]

    def __len__(self) -> int:
        """Number of completions (B*G), as ``len(PolicyBatch)``."""
        return self.completions.shape[0] * self.completions.shape[1]

    @property
    def head_labels(self) -> torch.Tensor:
        """``(B*G, T)`` completion tokens, ``ignore_index`` outside :attr:`loss_mask` (padding, tool and
        environment tokens) (row ``b*G + j``: group b, sample j)."""
        labels = torch.where(self.loss_mask, self.completions,
                             torch.full_like(self.completions, self.ignore_index))
        return labels.reshape(len(self), -1)

    def micro_batches(self, size: int) -> Iterator["SharedGroupBatch"]:
        """Consecutive micro-batches of ``size`` completions (``size // G`` whole groups).

        Args:
            size (int): completions per micro-batch: a multiple of G that divides ``len(self)``.

        Returns:
            Iterator[SharedGroupBatch]: the micro-batches, in row order.
        """
        g = self.num_generations
        if size < 1 or size % g or len(self) % size:
            raise ValueError(f"micro_batch_size={size} must be a multiple of num_generations={g} (whole groups) "
                             f"and divide the batch of {len(self)} completions when prompts are shared")
        k = size // g
        for start in range(0, len(self.prompts), k):
            stop = start + k
            yield SharedGroupBatch(self.prompts[start:stop], self.completions[start:stop],
                                   self.loss_mask[start:stop], self.truncated[start * g:stop * g],
                                   self.pad_id, self.ignore_index, self.attention)

    def pack(self, seq_len: Optional[int] = None) -> SharedPromptBatch:
        """The packed tokens, positions and mask of these groups (:func:`logitless.modules.pack_groups`;
        no dense mask on the flex path), ``seq_len`` long (default: as short as possible)."""
        return pack_groups(self.prompts, self.completions, self.loss_mask, pad_id=self.pad_id,
                           ignore_index=self.ignore_index, seq_len=seq_len, dense_mask=self.attention == "sdpa")

    def packed_length(self) -> int:
        """Longest prompt + G x completion length: the shortest packing of these groups."""
        return max(p.numel() for p in self.prompts) + self.num_generations * self.completions.shape[2]

    def forward(self, model: nn.Module) -> HeadInput:
        """One forward of the packed groups; the hidden rows that predict each completion token.

        Args:
            model (nn.Module): the policy or reference, output mode ``hidden``, without KV caches.

        Returns:
            HeadInput: ``(B*G, T, H)`` hidden states aligned with :attr:`head_labels`.

        Example:
            >>> loss_fn.set_model_output(model)
            >>> logp = loss_fn.log_probs(batch.forward(model), batch.head_labels)  # (B*G, T)
        """
        from logitless.rl.batch import policy_forward

        length = self.packed_length()
        inner = unwrap_compiled(model)
        limit = getattr(inner, "max_seq_len", None)
        if limit is not None and length > limit:
            raise ValueError(f"prompt_sharing: the packed groups are {length} tokens long (longest "
                             f"prompt + G x completion length), more than the model's max_seq_len={limit}; "
                             f"set prompt_sharing: false")
        if self.attention == "cascade":
            enable_cascade_attention(inner)
            packed = self.pack()
            layout = cascade_layout([p.numel() for p in self.prompts], self.num_generations,
                                    self.completions.shape[2], self.completions.device)
            out = policy_forward(model, packed._replace(mask=layout))
        elif self.attention == "flex":
            if not flex_available(self.completions.device):
                raise ValueError("attention='flex' needs CUDA (torchtune uses FlexAttention on sm >= 7.5 GPUs "
                                 "only); use attention='cascade'")
            bucket = -(-length // FLEX_LENGTH_MULTIPLE) * FLEX_LENGTH_MULTIPLE
            packed = self.pack(seq_len=min(bucket, limit) if limit is not None else bucket)
            _allow_flex_recompiles(limit)
            out = policy_forward(model, packed._replace(mask=flex_block_mask(packed, self.num_generations)))
        else:
            packed = self.pack()
            out = policy_forward(model, packed)
        if not isinstance(out, HeadInput):
            raise TypeError(f"prompt sharing needs the model in 'hidden' output mode (a HeadInput), got "
                            f"{type(out).__name__}; call loss_fn.set_model_output(model) first")
        head = gather_predicting_rows(out, packed)
        return HeadInput(head.hidden.reshape(len(self), self.completions.shape[2], -1), head.weight)


def _allow_flex_recompiles(max_seq_len: Optional[int]) -> None:
    # One compiled FlexAttention per length bucket (torchtune compiles it with static shapes): let
    # torch keep one per bucket up to max_seq_len instead of falling back to the uncompiled kernel
    # after 8 (measured: a 7B update took 8.4 s and 115 GiB instead of 1.0 s and 59 GiB).
    import torch._dynamo

    buckets = -(-(max_seq_len or 65536) // FLEX_LENGTH_MULTIPLE) + 8
    config = torch._dynamo.config
    if config.recompile_limit < buckets:
        config.recompile_limit = buckets


def flex_block_mask(packed: SharedPromptBatch, num_generations: int, block_size: int = 128):
    """The FlexAttention ``BlockMask`` of packed groups, built from their segment ids.

    Blocks where the mask is all False (a completion's queries against another completion's keys)
    are skipped by the kernel, so attention costs about ``P^2/2 + G (P T + T^2/2)`` scores per group
    instead of the dense ``(P + G T)^2``. On CUDA the mask is evaluated by a compiled kernel block by
    block: no ``S x S`` tensor exists at any point (the uncompiled evaluation materialises index
    tensors of ~24 bytes per mask element: +8.5 GiB at 25600 packed tokens, measured on the H200).

    Args:
        packed (SharedPromptBatch): from :func:`logitless.modules.pack_groups` (its ``segments``).
        num_generations (int): G.
        block_size (int): FlexAttention block size.

    Returns:
        torch.nn.attention.flex_attention.BlockMask: for ``flex_attention(q, k, v, block_mask=...)``.

    Example:
        >>> bm = flex_block_mask(pack_groups(prompts, completions, completion_mask, dense_mask=False), G)
    """
    from torch.nn.attention.flex_attention import create_block_mask

    segments = packed.segments
    b, s = segments.shape

    def mask_mod(batch, head, q_idx, kv_idx):
        return segment_mask(segments, q_idx, kv_idx, num_generations, batch=batch)

    build = _compiled_create_block_mask() if segments.is_cuda else create_block_mask
    return build(mask_mod, B=b, H=None, Q_LEN=s, KV_LEN=s, device=segments.device,
                 BLOCK_SIZE=block_size)


_COMPILED_CREATE_BLOCK_MASK = []


def _compiled_create_block_mask():
    # torch.compile(create_block_mask), made once: the form torch recommends in place of the
    # deprecated ``_compile=True`` flag (one compiled graph per length bucket, guarded on shapes).
    if not _COMPILED_CREATE_BLOCK_MASK:
        from torch.nn.attention.flex_attention import create_block_mask

        note_compile("flex attention's block mask for prompt sharing (again at each new length bucket)")
        _COMPILED_CREATE_BLOCK_MASK.append(torch.compile(create_block_mask))
    return _COMPILED_CREATE_BLOCK_MASK[0]


def shared_batch(rollout: Rollout, *, pad_id: int = 0, ignore_index: int = -100,
                 attention: str = "cascade") -> SharedGroupBatch:
    """Groups a rollout's rows (contiguous groups of G) and strips each prompt's left padding.

    Args:
        rollout (Rollout): from a sampler (:mod:`logitless.generation`) (N = prompts x G rows).
        pad_id (int): filler token of the packed sequences.
        ignore_index (int): label of positions without a token.
        attention (str): ``"cascade"``, ``"sdpa"`` or ``"flex"`` (CUDA), see :class:`SharedGroupBatch`.

    Returns:
        SharedGroupBatch: ``N / G`` groups.

    Raises:
        ValueError: N is not a multiple of G, or the rows of a group do not share one prompt.

    Example:
        >>> batch = shared_batch(rollout)
        >>> len(batch) == rollout.completion_tokens.shape[0]
        True
    """
    g = rollout.num_generations
    n, t = rollout.completion_tokens.shape
    if g < 1 or n % g:
        raise ValueError(f"the rollout's {n} rows are not whole groups of num_generations={g}")
    b = n // g
    tokens = rollout.prompt_tokens.reshape(b, g, -1)
    masks = rollout.prompt_mask.reshape(b, g, -1)
    if not (bool((tokens == tokens[:, :1]).all()) and bool((masks == masks[:, :1]).all())):
        raise ValueError("prompt sharing needs contiguous groups: the G rows of each group must hold the same prompt")
    prompts = [tokens[i, 0][masks[i, 0]] for i in range(b)]
    return SharedGroupBatch(prompts, rollout.completion_tokens.reshape(b, g, t),
                            rollout.loss_mask.reshape(b, g, t).to(torch.bool), rollout.truncated.clone(),
                            pad_id, ignore_index, attention)


PROMPT_SHARING = (True, False, "auto")
#: The longest packed group that ``prompt_sharing_attention: sdpa`` packs (longer ones run expanded
#: unless ``prompt_sharing: true``). The dense mask makes that attention quadratic in the packed
#: length (the scores of every completion against every other one are computed, then masked), which
#: outgrows what packing saves in the linear layers: H200, Qwen2.5-0.5B, G=16, 1024-token prompt,
#: update time packed vs expanded: 9216 packed tokens 0.26 vs 0.28 s, 17408 tokens 0.72 vs 0.38 s
#: (``experiments/results/prompt_sharing_scaling_h200.csv``).
AUTO_MAX_PACKED_SDPA = 12288


def packed_length(rollout: Rollout) -> int:
    """Tokens of the longest packed group of ``rollout``: its longest prompt + G x completion length.

    Example:
        >>> packed_length(rollout)  # doctest: +SKIP
        9216
    """
    return int(rollout.prompt_mask.sum(1).max()) + rollout.num_generations * rollout.completion_tokens.shape[1]


def flex_available(device: torch.device) -> bool:
    """Whether torchtune runs FlexAttention for packed groups on ``device`` (CUDA, sm >= 7.5)."""
    from torchtune.utils._import_guard import _SUPPORTS_FLEX_ATTENTION

    return device.type == "cuda" and bool(_SUPPORTS_FLEX_ATTENTION)


def packing_attention(length: int, *, attention: str, max_seq_len: Optional[int],
                      must_pack: bool = False) -> Optional[str]:
    """Per step: the attention to pack groups of ``length`` tokens with, or None to run them expanded.

    ``auto`` is cascade attention (:mod:`logitless.modules.cascade_attention`): it computes only the
    scores the packing's mask keeps, so packing pays at every length, on every device, with no length
    buckets to compile. The dense-mask SDPA path is quadratic in the packed length and pays up to
    :data:`AUTO_MAX_PACKED_SDPA` tokens; FlexAttention (CUDA) skips the masked blocks but compiles once
    per length bucket. Packed groups must fit the model's ``max_seq_len`` (torchtune's decoder checks
    the sequence length).

    Args:
        length (int): :func:`packed_length` (the largest over data-parallel ranks).
        attention (str): the ``prompt_sharing_attention`` setting: ``auto``, ``cascade``, ``sdpa`` or ``flex``.
        max_seq_len (Optional[int]): the model's limit (None: none).
        must_pack (bool): ``prompt_sharing: true``: never None (the forward then raises past
            ``max_seq_len``).

    Returns:
        Optional[str]: ``"cascade"``, ``"sdpa"``, ``"flex"``, or None (expanded batch).

    Example:
        >>> packing_attention(17408, attention="auto", max_seq_len=32768)
        'cascade'
        >>> packing_attention(17408, attention="sdpa", max_seq_len=32768) is None
        True
    """
    if attention not in ATTENTION_SETTINGS:
        raise ValueError(f"config key 'prompt_sharing_attention': expected one of {list(ATTENTION_SETTINGS)}, "
                         f"got {attention!r}")
    if attention == "auto":
        attention = "cascade"
    fits = (max_seq_len is None or length <= max_seq_len) and (attention != "sdpa" or length <= AUTO_MAX_PACKED_SDPA)
    return attention if fits or must_pack else None


def step_packing_attention(rollout: Rollout, model: nn.Module, *, enabled: bool, attention: str, must_pack: bool,
                           all_reduce: Callable[..., torch.Tensor]) -> Optional[str]:
    """:func:`packing_attention` for one GRPO step, decided from the longest packed group over all
    ranks (every rank calls it), so that every rank runs the same path.

    Args:
        rollout (Rollout): this rank's share of the step's completions.
        model (nn.Module): the policy (its ``max_seq_len`` bounds a packed group).
        enabled (bool): :func:`use_prompt_sharing`'s answer for the run (False: always expanded).
        attention (str): the ``prompt_sharing_attention`` setting.
        must_pack (bool): ``prompt_sharing: true``.
        all_reduce (Callable): ``Runtime.all_reduce``.

    Returns:
        Optional[str]: ``"cascade"``, ``"sdpa"``, ``"flex"``, or None (expanded batch).
    """
    if not enabled:
        return None
    length = int(all_reduce(torch.tensor(float(packed_length(rollout))), op="max"))
    max_seq_len = getattr(unwrap_compiled(model), "max_seq_len", None)
    return packing_attention(length, attention=attention, max_seq_len=max_seq_len, must_pack=must_pack)


def use_prompt_sharing(setting, *, micro_batch_size: int, num_generations: int) -> bool:
    """Resolves the ``prompt_sharing`` setting of a GRPO config.

    Args:
        setting: True, False or ``"auto"`` (possible when ``micro_batch_size`` is a multiple of G;
            each step then decides with :func:`packing_attention`).
        micro_batch_size (int): completions per forward/backward.
        num_generations (int): G.

    Returns:
        bool: whether the update may pack each group's prompt once.

    Raises:
        ValueError: an unknown setting, or ``True`` with a micro-batch that is not whole groups
            (the message names the config keys).

    Example:
        >>> use_prompt_sharing("auto", micro_batch_size=8, num_generations=4)
        True
    """
    if setting not in PROMPT_SHARING or not isinstance(setting, (bool, str)):
        raise ValueError(f"config key 'prompt_sharing': expected one of {list(PROMPT_SHARING)}, got {setting!r}")
    whole_groups = micro_batch_size % num_generations == 0
    if setting is True and not whole_groups:
        raise ValueError(f"config key 'micro_batch_size': {micro_batch_size} must be a multiple of num_generations="
                         f"{num_generations} with prompt_sharing: true (a micro-batch holds whole groups); "
                         f"change it or set prompt_sharing: auto / false")
    return whole_groups if setting == "auto" else bool(setting)


def training_batch(rollout: Rollout, *, prompt_sharing: bool, pad_id: int = 0, ignore_index: int = -100,
                   attention: str = "cascade"):
    """The update's batch of a rollout: shared prompts, or one row per completion.

    Args:
        rollout (Rollout): the sampled groups.
        prompt_sharing (bool): pack each group's prompt once (:func:`shared_batch`) or not
            (:func:`logitless.rl.batch.policy_batch`; its head is response-only too).
        pad_id (int): filler token of packed sequences.
        ignore_index (int): label of positions without a token.
        attention (str): attention of the shared path, ``"cascade"``, ``"sdpa"`` or ``"flex"`` (CUDA).

    Returns:
        SharedGroupBatch | PolicyBatch: what :func:`logitless.rl.update.grpo_update` takes.

    Example:
        >>> batch = training_batch(rollout, prompt_sharing=True)
    """
    if prompt_sharing:
        return shared_batch(rollout, pad_id=pad_id, ignore_index=ignore_index, attention=attention)
    from logitless.rl.batch import policy_batch

    return policy_batch(rollout, ignore_index=ignore_index)
