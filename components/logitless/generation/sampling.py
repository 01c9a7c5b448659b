"""Next-token sampling from one row of logits per sequence: temperature, top-k, top-p, greedy.

Two ways to draw: :func:`sample_next` from ``torch.Generator`` streams (``torch.multinomial``), and
:func:`sample_counter` from a counter-based stream: the uniform behind token ``v`` of row ``r`` at
step ``t`` is a hash of ``(key[r], t, v)``, so a draw is a pure function of its inputs. It can run
inside a captured CUDA graph, and a row's tokens depend on its key only, not on the other rows of
the batch, its place in it, or the rank that samples it.

Random streams: a sampler draws either from one ``torch.Generator`` for the whole batch, or from one
generator per prompt (:func:`prompt_generators`), each drawing the tokens of its prompt's group only.
With per-prompt streams a group's completions depend on the seed, the step and the prompt's index,
not on which other prompts share the batch: the union of the rollouts of several data-parallel
ranks, each sampling its share of the prompts, is the rollout of one device sampling them all.
"""

from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch

from logitless.ops._validate import MAX_TEMPERATURE, MIN_TEMPERATURE

#: What a sampler accepts as its random source: None (torch's global generator), one generator for
#: the whole batch, or one generator per prompt (rows split into equal contiguous groups).
RandomSource = Union[None, torch.Generator, Sequence[torch.Generator]]


def prompt_generators(seed: int, step: int, prompt_indices: Sequence[int],
                      device: Union[str, torch.device] = "cpu") -> list:
    """One generator per prompt, seeded from ``(seed, step, prompt index)``.

    Args:
        seed (int): the run's seed.
        step (int): the training step (or any other counter that must give new samples).
        prompt_indices (Sequence[int]): the prompts' positions in the step's global batch.
        device: where the sampler's logits live.

    Returns:
        list: ``torch.Generator`` objects, one per prompt, in the order of ``prompt_indices``.

    Example:
        >>> a = prompt_generators(0, 3, [0, 1, 2, 3])
        >>> b = prompt_generators(0, 3, [2, 3])       # rank 1 of 2 draws the same streams as a[2:]
        >>> torch.rand(1, generator=a[2]) == torch.rand(1, generator=b[0])
        tensor([True])
    """
    gens = []
    for index in prompt_indices:
        # SeedSequence mixes the three integers into a well-spread 64-bit seed (no overflow, no
        # collisions between neighbouring steps and prompts as a linear formula would risk).
        key = np.random.SeedSequence([int(seed) % 2**63, int(step), int(index)])
        gens.append(torch.Generator(device=device).manual_seed(int(key.generate_state(1, np.uint64)[0])))
    return gens


def check_random_source(generator: RandomSource, num_prompts: int) -> None:
    """Raises ValueError unless ``generator`` is None, a generator, or one generator per prompt."""
    if generator is None or isinstance(generator, torch.Generator):
        return
    if len(generator) != num_prompts:
        raise ValueError(f"generator: expected one torch.Generator per prompt ({num_prompts}), "
                         f"got a sequence of {len(generator)}")


def _draw(probs: torch.Tensor, generator: RandomSource) -> torch.Tensor:
    """One token per row of ``probs``; with a sequence of generators, each draws its own rows."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    rows, rest = divmod(probs.shape[0], len(generator))
    if rest:
        raise ValueError(f"generator: {len(generator)} generators cannot split {probs.shape[0]} rows "
                         f"into equal groups")
    return torch.cat([torch.multinomial(probs[i * rows:(i + 1) * rows], 1, generator=g)
                      for i, g in enumerate(generator)]).squeeze(-1)


def check_sampling_args(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """Raises ValueError naming the argument when a sampling setting is out of range.

    Args:
        temperature (float): 0 (greedy) or in ``[1e-4, 1e4]`` (the head ops' range).
        top_k (Optional[int]): None or >= 1.
        top_p (Optional[float]): None or in (0, 1].
    """
    # the head ops' range (their temperature is the sampler's): 1/T scales the logits, and below 1e-4
    # fp32 logits / T overflow to inf and the softmax to NaN
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE)):
        raise ValueError(f"temperature must be 0 (greedy) or a finite number in [{MIN_TEMPERATURE}, "
                         f"{MAX_TEMPERATURE}], got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (0 < float(top_p) <= 1):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")


def filter_logits(scaled: torch.Tensor, top_k: Optional[int], top_p: Optional[float]) -> torch.Tensor:
    """``scaled`` with ``-inf`` outside the top-k tokens and outside the top-p nucleus.

    Args:
        scaled (torch.Tensor): ``(B, V)`` tempered fp32 logits.
        top_k (Optional[int]): keep the k most likely tokens.
        top_p (Optional[float]): keep the smallest set whose probability reaches ``top_p``.

    Returns:
        torch.Tensor: ``(B, V)`` logits whose softmax is the distribution to draw from.
    """
    filtered = scaled
    if top_k is not None and top_k < filtered.shape[-1]:
        kth = torch.topk(filtered, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked strictly above it already reach top_p
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    return filtered


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: RandomSource = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row and returns it with its log-probability.

    The log-probability is that of the full tempered distribution ``log_softmax(logits / T)``
    (what the training path computes), not of the top-k/top-p truncated one; with
    ``temperature == 0`` the argmax is taken and the log-probability is at ``T = 1``.

    Args:
        logits (torch.Tensor): ``(B, V)`` scores of the next token (any float dtype; upcast here).
        temperature (float): divides the logits; 0 = greedy.
        top_k (Optional[int]): keep the k most likely tokens.
        top_p (Optional[float]): keep the smallest set whose probability reaches ``top_p``.
        generator (RandomSource): random source on the logits' device: one generator, or one per
            group of rows (``B`` must be a multiple of their number; each draws its own rows).

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: tokens ``(B,)`` int64 and log-probs ``(B,)`` fp32.

    Example:
        >>> tok, lp = sample_next(torch.tensor([[0.0, 5.0, 1.0]]), temperature=0)
        >>> tok.tolist()
        [1]
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(filter_logits(scaled, top_k, top_p), dim=-1)
    tokens = _draw(probs, generator)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two xor-shift-multiply rounds) of int64 values in ``[0, 2**32)``.

    The multiplier is below 2**31, so every product fits in int64 and the result is the same on
    every device and backend (no overflow).
    """
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def token_hashes(vocab: int, device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """``(V,)`` int64 hash of every token id, the per-token input of :func:`counter_uniform`.

    Computed once and passed in as a tensor: inside a compiled kernel an ``arange`` is an int32
    index, whose arithmetic would differ from int64's.
    """
    return _mix32((torch.arange(vocab, device=device, dtype=torch.int64) * 0x61C88647) & _MASK32)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in (0, 1) from 32-bit hashes: the midpoints of ``2**23`` equal cells.

    The top 23 bits pick the cell. Each midpoint ``(j + 0.5) / 2**23`` is an exact fp32 value in
    ``[2**-24, 1 - 2**-24]``, so ``-log(-log(u))`` is finite for every hash; with 24 bits,
    ``(2**24 - 1) + 0.5`` rounds to ``2**24`` in fp32 and made one hash value in ``2**24`` exactly 1
    (a token drawn whatever its probability: about once every two steps at 64 rows x 151,936 tokens).

    Args:
        bits (torch.Tensor): int64 values in ``[0, 2**32)``.

    Returns:
        torch.Tensor: fp32 uniforms, the shape of ``bits``.

    Example:
        >>> uniform_from_bits(torch.tensor([0, 2**32 - 1])).tolist() == [2**-24, 1 - 2**-24]
        True
    """
    return ((bits >> 9).float() + 0.5) * (1.0 / 2**23)


def counter_uniform(keys: torch.Tensor, step: torch.Tensor, vocab: int,
                    token_hash: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Uniforms in (0, 1) for every ``(row, token)``, a function of ``(keys[row], step, token)`` only.

    Args:
        keys (torch.Tensor): ``(B,)`` int64 row keys (any 64-bit values).
        step (torch.Tensor): ``(1,)`` or ``(B,)`` int64 step counter.
        vocab (int): V.
        token_hash (Optional[torch.Tensor]): :func:`token_hashes` of ``vocab`` (computed here if None).

    Returns:
        torch.Tensor: ``(B, V)`` fp32 uniforms (:func:`uniform_from_bits`).

    Example:
        >>> u = counter_uniform(torch.tensor([7, 8]), torch.tensor([0]), 5)
        >>> bool((u[1] == counter_uniform(torch.tensor([8]), torch.tensor([0]), 5)[0]).all())  # row 8 alone
        True
    """
    if token_hash is None:
        token_hash = token_hashes(vocab, keys.device)
    lo, hi = keys & _MASK32, (keys >> 32) & _MASK32
    row = _mix32(lo ^ _mix32(hi ^ _mix32(step & _MASK32)))[:, None]
    bits = _mix32(_mix32(row ^ token_hash[None, :]) ^ row)
    return uniform_from_bits(bits)


def sample_counter(
    logits: torch.Tensor,
    keys: torch.Tensor,
    step: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    token_hash: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_next` with a counter-based draw: Gumbel-max over :func:`counter_uniform`.

    ``argmax(filtered + Gumbel noise)`` is a draw from ``softmax(filtered)``, the distribution
    :func:`sample_next` draws from; the log-probability is the same (full tempered distribution,
    ``T = 1`` for greedy). No host sync, no generator state: it can be captured in a CUDA graph.

    Args:
        logits (torch.Tensor): ``(B, V)`` scores of the next token.
        keys (torch.Tensor): ``(B,)`` int64 row keys (:func:`row_keys`).
        step (torch.Tensor): ``(1,)`` int64 step counter (the completion position), or ``(B,)``:
            each row's own (the rows of a multi-turn rollout are at different positions).
        temperature, top_k, top_p: as in :func:`sample_next`.
        token_hash (Optional[torch.Tensor]): :func:`token_hashes` of V, precomputed.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: tokens ``(B,)`` int64 and log-probs ``(B,)`` fp32.

    Example:
        >>> tok, lp = sample_counter(torch.zeros(2, 4), torch.tensor([1, 2]), torch.tensor([0]))
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    gumbel = -torch.log(-torch.log(counter_uniform(keys, step, logits.shape[-1], token_hash)))
    tokens = (filter_logits(scaled, top_k, top_p) + gumbel).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def row_keys(generator: RandomSource, num_prompts: int, num_generations: int,
             device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    """The counter-based stream's key of every row, drawn once per call from ``generator``.

    With one generator per prompt each prompt draws one key and its G rows get ``(key, j)``
    mixed, so a group's tokens depend on its prompt's stream only (as :func:`sample_next`'s draws
    do); with one generator (or None: torch's global one) one key is drawn for the batch and mixed
    with the row index.

    Args:
        generator (RandomSource): None, a generator, or one generator per prompt.
        num_prompts (int): P.
        num_generations (int): G (rows per prompt, contiguous).
        device: where the keys go.

    Returns:
        torch.Tensor: ``(P * G,)`` int64 keys.

    Example:
        >>> a = row_keys(prompt_generators(0, 1, [0, 1]), 2, 4)
        >>> b = row_keys(prompt_generators(0, 1, [1]), 1, 4)
        >>> bool((a[4:] == b).all())
        True
    """
    def draw(gen):
        # a generator draws on its own device; the key is moved afterwards
        where = gen.device if isinstance(gen, torch.Generator) else "cpu"
        return torch.randint(0, 2**62, (1,), generator=gen, device=where).to(device)

    check_random_source(generator, num_prompts)
    if generator is None or isinstance(generator, torch.Generator):
        base = draw(generator).expand(num_prompts * num_generations)
        index = torch.arange(num_prompts * num_generations, device=device)
    else:
        base = torch.cat([draw(g) for g in generator]).repeat_interleave(num_generations)
        index = torch.arange(num_generations, device=device).repeat(num_prompts)
    lo, hi = base & _MASK32, (base >> 32) & _MASK32
    return (_mix32(hi ^ _mix32(index)) << 31) ^ _mix32(lo ^ _mix32(index + 0x5BD1E995))
