"""The compiled multi-turn sampler on a GPU (CUDA graphs, split-K attention with per-row write columns,
the Triton counter draw with per-row steps) against the eager reference, Qwen3 and Qwen2.5 shapes,
random fp32 weights; tools with latency give the same trajectories (skipped without CUDA)."""

import time

import pytest
import torch

from logitless.generation.sampling import prompt_generators
from logitless.generation.tools.compiled import CompiledTurnSampler
from logitless.generation.tools.eager import generate_turns
from logitless.generation.tools.session import TurnSession

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = 4
G = 4


class FixedChat:
    """Token ids instead of a template: prompt ``p`` is ``prompts[p]``; every answer appends
    ``answer`` (a row- and turn-independent segment) after the turn."""

    def __init__(self, prompts, answer):
        self.prompts, self.answer = prompts, answer
        self.next = 0

    def prompt(self, messages):
        return self.prompts[messages[0]["p"]], ""

    def parse(self, turn_ids, stop_ids=()):
        from logitless.generation.tools import ParsedTurn

        return ParsedTurn("")

    def continuation(self, history, new_messages):
        return self.answer[:new_messages[0]["k"]], ""


class Environment:
    """Answers with a row-dependent number of tokens after ``delay(row, turn)`` seconds; done after 3 turns."""

    def __init__(self, delay):
        self.delay = delay

    def reset(self, row):
        self.p = row["p"]
        return [{"role": "user", "p": row["p"]}]

    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        time.sleep(self.delay(self.p, turns))
        return [{"role": "tool", "k": 5 + 7 * ((self.p + turns) % 3)}], turns >= 3, {}


def _model(name):
    from logitless.models import build_named

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_named(name)
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(0.02)
    return model.eval().requires_grad_(False)


def _session(vocab, delay):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, vocab, (40 + 30 * p,), generator=g).tolist() for p in range(PROMPTS)]
    chat = FixedChat(prompts, torch.randint(10, vocab, (30,), generator=g).tolist())
    # about one token in 24 ends a turn: a few turns of different lengths within the budget
    stops = torch.randperm(vocab, generator=g)[:vocab // 24].tolist()
    session = TurnSession(chat, lambda: Environment(delay), [{"p": p} for p in range(PROMPTS)], num_generations=G,
                          max_turns=4, stop_ids=stops)
    return session, stops


def _run(sampler, model, delay, temperature):
    vocab = model.tok_embeddings.num_embeddings
    session, stops = _session(vocab, delay)
    return sampler(model, session, max_new_tokens=160, stop_tokens=stops, pad_id=0, temperature=temperature,
                   generator=prompt_generators(0, 7, range(PROMPTS), "cuda"))


@pytest.mark.parametrize("name", ["qwen3_0_6b", "qwen2_5_0_5b"])
def test_compiled_turns_equal_eager_turns(name):
    model = _model(name)
    instant = lambda p, turn: 0.0  # noqa: E731
    ref = _run(generate_turns, model, instant, 1.0)
    assert (ref.completion_mask & ~ref.sampled_mask).any(1).float().mean() > 0.5  # most rows read an answer
    sampler = CompiledTurnSampler(compile=True, fused_projections="shared", sync_every=8)
    out = _run(sampler, model, instant, 1.0)
    same = (out.completion_tokens == ref.completion_tokens).all(1) if out.completion_tokens.shape == \
        ref.completion_tokens.shape else torch.zeros(1, dtype=torch.bool)
    # fp32, two kernels' rounding: a near-tie may flip one draw in a long rollout, not more
    assert same.float().mean() >= 0.9, same
    rows = same.nonzero().squeeze(1)
    torch.testing.assert_close(out.sampler_log_probs[rows], ref.sampler_log_probs[rows], rtol=0, atol=2e-3)
    assert torch.equal(out.sampled_mask[rows], ref.sampled_mask[rows])


def test_tool_latency_moves_rows_in_time_not_their_tokens():
    model = _model("qwen3_0_6b")
    sampler = CompiledTurnSampler(compile=True, fused_projections="shared", sync_every=4)
    instant = _run(sampler, model, lambda p, turn: 0.0, 1.0)
    slow = _run(sampler, model, lambda p, turn: 0.004 * ((p * 3 + turn) % 5), 1.0)
    # draws keyed by (row, position), own columns, a split-K partition fixed by the cache's shape: the
    # schedule moves rows in time, their logits stay bit-identical
    assert torch.equal(slow.completion_tokens, instant.completion_tokens)
    assert torch.equal(slow.sampler_log_probs, instant.sampler_log_probs)


def test_prefilled_answers_equal_eager_and_ignore_latency():
    """Answers of 12 and 19 tokens go in with one forward of their row (``segment_prefill_tokens=8``),
    5-token ones are fed: the compiled sampler matches the eager one doing the same, and a tool's
    latency still leaves every token and log-prob bit-identical (the segment forward's shape is the
    answer's, whatever the other rows are doing)."""
    model = _model("qwen2_5_0_5b")
    vocab = model.tok_embeddings.num_embeddings

    def run(sampler, delay):
        session, stops = _session(vocab, delay)
        return sampler(model, session, max_new_tokens=160, stop_tokens=stops, pad_id=0, temperature=1.0,
                       generator=prompt_generators(0, 7, range(PROMPTS), "cuda"), segment_prefill_tokens=8)

    ref = run(generate_turns, lambda p, turn: 0.0)
    fed = ref.completion_mask & ~ref.sampled_mask
    assert (fed.sum(1) >= 12).float().mean() > 0.5  # most rows read a prefilled answer
    sampler = CompiledTurnSampler(compile=True, fused_projections="shared", sync_every=4)
    instant = run(sampler, lambda p, turn: 0.0)
    same = (instant.completion_tokens == ref.completion_tokens).all(1) if instant.completion_tokens.shape == \
        ref.completion_tokens.shape else torch.zeros(1, dtype=torch.bool)
    assert same.float().mean() >= 0.9, same
    rows = same.nonzero().squeeze(1)
    torch.testing.assert_close(instant.sampler_log_probs[rows], ref.sampler_log_probs[rows], rtol=0, atol=2e-3)
    slow = run(sampler, lambda p, turn: 0.004 * ((p * 3 + turn) % 5))
    assert torch.equal(slow.completion_tokens, instant.completion_tokens)
    assert torch.equal(slow.sampler_log_probs, instant.sampler_log_probs)
