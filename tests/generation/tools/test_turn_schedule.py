"""The multi-turn samplers' schedule: rows decode on their own clocks, tools of any latency give the
same trajectories, and the compiled turn sampler samples what the eager reference samples."""

import threading
import time

import pytest
import torch

from logitless.generation.sampling import prompt_generators
from logitless.generation.tools.compiled import CompiledTurnSampler
from logitless.generation.tools.eager import generate_turns
from logitless.generation.tools.session import TurnSession
from logitless.generation.tools import CHAT_FORMATS, ToolChat

from .test_eager_turns import PAD, ROWS, STOPS, TOKENIZER, ChattyEnvironment, tiny_model


class SlowEnvironment(ChattyEnvironment):
    """ChattyEnvironment whose answers take a row- and turn-dependent time (0-24 ms)."""

    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        time.sleep(((len(self.row["q"]) * 7 + turns * 5) % 4) * 0.008)
        return super().step(messages)


class LoggedEnvironment(ChattyEnvironment):
    """Records ``(row question, turn)`` at every step; the first row's first answer takes 0.5 s."""

    log = []
    lock = threading.Lock()

    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        with self.lock:
            self.log.append((self.row["q"], turns))
        if self.row is ROWS[0] and turns == 1:
            time.sleep(0.5)
        return super().step(messages)


def _session(env_cls, num_generations=2, max_turns=4):
    chat = ToolChat(CHAT_FORMATS["qwen2_5"], TOKENIZER)
    return TurnSession(chat, env_cls, ROWS, num_generations=num_generations, max_turns=max_turns, stop_ids=STOPS)


KW = dict(max_new_tokens=60, stop_tokens=STOPS, pad_id=PAD, temperature=1.0)


def _same(a, b, atol=1e-9):
    assert torch.equal(a.completion_tokens, b.completion_tokens)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.sampled_mask, b.sampled_mask)
    assert torch.equal(a.truncated, b.truncated)
    torch.testing.assert_close(a.sampler_log_probs, b.sampler_log_probs, rtol=0, atol=atol)
    assert [t.messages for t in a.trajectories] == [t.messages for t in b.trajectories]


def test_tool_latency_does_not_change_the_trajectories():
    """Draws are keyed by (row, position), rows write their own columns: when a tool answers moves a
    row in time only. Instant and slow (0-24 ms, different per row and turn) tools, float64."""
    model = tiny_model()
    instant = generate_turns(model, _session(ChattyEnvironment), generator=prompt_generators(0, 3, range(3)), **KW)
    slow = generate_turns(model, _session(SlowEnvironment), generator=prompt_generators(0, 3, range(3)), **KW)
    assert max(t.turns for t in instant.trajectories) >= 3
    assert len(set(int(m.sum()) for m in instant.completion_mask)) > 2  # rows of different lengths
    _same(instant, slow, atol=0)


def test_rows_do_not_wait_for_another_rows_tool():
    """While the first row's tool takes 0.5 s, the other rows go through later turns: some row's
    third environment step runs before the first row's second one (a turn barrier makes every row's
    next turn wait for the slowest tool, so no third step could come first)."""
    LoggedEnvironment.log = []
    out = generate_turns(tiny_model(), _session(LoggedEnvironment, num_generations=1),
                         generator=prompt_generators(0, 3, range(3)), **KW)
    log = LoggedEnvironment.log
    assert (ROWS[0]["q"], 2) in log, [t.turns for t in out.trajectories]
    first_slow_second = log.index((ROWS[0]["q"], 2))
    assert any(turn == 3 for _, turn in log[:first_slow_second]), log


@pytest.mark.parametrize("options", [dict(sync_every=1), dict(sync_every=4, fused_projections="shared"),
                                     dict(sync_every=16, fused_projections=True),
                                     dict(sync_every=2, decode_attention="split_k")])
def test_compiled_turn_sampler_equals_the_eager_reference(options):
    """The grouped-attention step with per-row columns (uncompiled on the CPU, the code the compiler
    traces; the split-K attention's reference on the CPU), the prompt prefilled once per group: the
    eager reference's tokens, masks and trajectories; log-probs to float64 rounding (fp32 through the
    split-K attention). Slow tools on one side only."""
    model = tiny_model()
    ref = generate_turns(model, _session(ChattyEnvironment), generator=prompt_generators(0, 4, range(3)), **KW)
    sampler = CompiledTurnSampler(compile=False, **options)
    out = sampler(model, _session(SlowEnvironment), generator=prompt_generators(0, 4, range(3)), **KW)
    atol = 1e-5 if "decode_attention" in options else 1e-9  # the split-K attention accumulates in fp32
    _same(out, ref, atol)
    again = sampler(model, _session(ChattyEnvironment), generator=prompt_generators(0, 4, range(3)), **KW)
    _same(again, ref, atol)  # the kept buffers are refilled, not reused stale


def test_compiled_turn_sampler_budget_and_greedy():
    """A budget that cuts rows mid-turn and mid-continuation, greedy: the same rows truncated, the
    same tokens as the eager reference; no row exceeds its budget."""
    model = tiny_model()
    kw = dict(KW, max_new_tokens=13, temperature=0.0)
    ref = generate_turns(model, _session(ChattyEnvironment), **kw)
    out = CompiledTurnSampler(compile=False, sync_every=3)(model, _session(ChattyEnvironment), **kw)
    _same(out, ref)
    assert bool(ref.truncated.any())
    assert int(out.completion_mask.sum(1).max()) <= 13


def test_draws_generator_is_refused():
    from logitless.generation.config import OptionError

    with pytest.raises(OptionError, match="draws='generator'.*counter"):
        CompiledTurnSampler(compile=False, draws="generator")


def test_finished_rows_hide_their_cache_columns():
    """A finished row's columns are hidden for the steps that remain (the split-K attention then
    reads nothing of them) but its prompt's last one: after the rollout every row has exactly one
    valid column, its prompt's last, and its outputs are what the eager reference wrote."""
    model = tiny_model()
    sampler = CompiledTurnSampler(compile=False, sync_every=2, keep_cache=True)
    out = sampler(model, _session(ChattyEnvironment), generator=prompt_generators(0, 4, range(3)), **KW)
    key_valid = sampler._buffers.state["key_valid"]
    width = out.prompt_tokens.shape[1]
    assert torch.equal(key_valid.sum(1), torch.ones(key_valid.shape[0], dtype=torch.long))
    assert bool(key_valid[:, width - 1].all())
    ref = generate_turns(model, _session(ChattyEnvironment), generator=prompt_generators(0, 4, range(3)), **KW)
    _same(out, ref)


def test_one_turn_compiled_turn_sampler_equals_the_single_turn_compiled_sampler():
    """No continuation (the environment is done at once): the compiled turn sampler samples what the
    single-turn compiled sampler samples, top-p included (the same counter streams and filters)."""
    from logitless.generation.compiled import CompiledSampler

    from .test_eager_turns import DoneEnvironment

    model = tiny_model(torch.float32)
    session = _session(DoneEnvironment, num_generations=3)
    stops = [STOPS[0]] + list(range(0, 2026, 7))
    kw = dict(max_new_tokens=12, stop_tokens=stops, pad_id=PAD, temperature=0.9, top_p=0.95)
    out = CompiledTurnSampler(compile=False, sync_every=3)(model, session, generator=prompt_generators(0, 5, range(3)),
                                                           **kw)
    ref = CompiledSampler(compile=False)(model, session.prompts, num_generations=3,
                                         generator=prompt_generators(0, 5, range(3)), **kw)
    assert torch.equal(out.completion_tokens, ref.completion_tokens)
    assert torch.equal(out.completion_mask, ref.completion_mask) and torch.equal(out.truncated, ref.truncated)
    torch.testing.assert_close(out.sampler_log_probs, ref.sampler_log_probs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("threshold", [2, 18])
def test_prefilled_continuations_equal_fed_ones(threshold):
    """A continuation of ``segment_prefill_tokens`` or more goes into its row's cache in one forward of
    that row: the rollout equals the one that feeds every continuation token by token (float64), in
    the eager reference and in the compiled turn sampler (grouped steps, torchtune's layers for the
    segment); with threshold 18 the 13- and 17-token continuations are fed, the 21- and 25-token ones
    prefilled."""
    model = tiny_model()
    fed = generate_turns(model, _session(ChattyEnvironment), generator=prompt_generators(0, 6, range(3)),
                         segment_prefill_tokens=None, **KW)
    lengths = [len(m["content"]) for t in fed.trajectories for m in t.turn_messages if m["role"] == "user"]
    assert len(set(lengths)) > 1
    eager = generate_turns(model, _session(ChattyEnvironment), generator=prompt_generators(0, 6, range(3)),
                           segment_prefill_tokens=threshold, **KW)
    compiled = CompiledTurnSampler(compile=False, sync_every=3)(
        model, _session(SlowEnvironment), generator=prompt_generators(0, 6, range(3)),
        segment_prefill_tokens=threshold, **KW)
    _same(eager, fed, atol=1e-9)
    _same(compiled, fed, atol=1e-9)


def test_bad_segment_prefill_tokens_is_named():
    with pytest.raises(ValueError, match="segment_prefill_tokens must be None .* or an int >= 2, got 1"):
        generate_turns(tiny_model(), _session(ChattyEnvironment), segment_prefill_tokens=1, **KW)
    with pytest.raises(ValueError, match="segment_prefill_tokens must be None .*'auto'.* got 'often'"):
        generate_turns(tiny_model(), _session(ChattyEnvironment), segment_prefill_tokens="often", **KW)


def test_auto_segment_prefill_is_each_samplers_default(monkeypatch):
    """``"auto"`` (the default): 128 tokens for the eager sampler, whose steps cost about a segment's
    forward, 1024 for the compiled one, whose steps are CUDA graphs; a model the compiled sampler
    cannot group falls back to the eager sampler and to its default."""
    from logitless.generation.tools import compiled as compiled_mod
    from logitless.generation.tools import eager as eager_mod
    from logitless.generation.tools.compiled import COMPILED_SEGMENT_PREFILL_TOKENS
    from logitless.generation.tools.eager import DEFAULT_SEGMENT_PREFILL_TOKENS

    assert (DEFAULT_SEGMENT_PREFILL_TOKENS, COMPILED_SEGMENT_PREFILL_TOKENS) == (128, 1024)
    seen = []

    class Seen(Exception):
        pass

    def drive(*args, prefill_tokens, **kwargs):
        seen.append(prefill_tokens)
        raise Seen  # the threshold is all this test needs, not the rollout

    monkeypatch.setattr(eager_mod, "drive_turns", drive)
    monkeypatch.setattr(compiled_mod, "drive_turns", drive)
    model = tiny_model()
    sampler = CompiledTurnSampler(compile=False)
    for sample in (generate_turns, sampler, "fallback"):
        if sample == "fallback":
            monkeypatch.setattr(sampler.single, "_grouped_everywhere", lambda m: False)
            sample = sampler
        with pytest.raises(Seen):
            sample(model, _session(ChattyEnvironment), generator=prompt_generators(0, 6, range(3)), **KW)
    assert seen == [128, 1024, 128]
