"""The eager multi-turn sampler: continuations appended to each row's KV cache give the tokens and
log-probs of a fresh forward over the whole conversation (greedy, float64); rows without turns equal
the single-turn compiled sampler (same counter draws); masks mark exactly the sampled tokens."""

import torch
from torch.nn import functional as F

from logitless.datasets import tiny_qwen2_5_tokenizer
from logitless.generation.tools import CHAT_FORMATS, ToolChat
from logitless.generation.tools.eager import generate_turns
from logitless.generation.tools.session import TurnSession
from logitless.models import qwen2_5_tiny
from logitless.generation.compiled import CompiledSampler
from logitless.generation.sampling import prompt_generators

TOKENIZER = tiny_qwen2_5_tokenizer()
IM_END = TOKENIZER.special_tokens["<|im_end|>"]
PAD = TOKENIZER.pad_id
ROWS = [{"q": "3+4="}, {"q": "What is 12 plus 30?"}, {"q": "Count: a b c d"}]


def tiny_model(dtype=torch.float64, seed=1):
    # untied: a random tied model greedily repeats its last input token, an untied one writes varied turns
    torch.manual_seed(seed)
    m = qwen2_5_tiny(vocab_size=2048, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=32,
                     intermediate_dim=64, max_seq_len=512, tie_word_embeddings=False)
    return m.to(dtype)


class ChattyEnvironment:
    """Answers every turn with a user message whose length depends on the row and the turn (so rows
    get continuations of different lengths, at different columns); done after three turns."""

    def reset(self, row):
        self.row = row
        return [{"role": "user", "content": row["q"]}]

    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        reply = "go on " * (1 + (len(self.row["q"]) + turns) % 4)
        return [{"role": "user", "content": reply.strip()}], turns >= 3, {"turns_seen": turns}


class DoneEnvironment(ChattyEnvironment):
    def step(self, messages):
        return [], True, {}


# a sixth of the vocabulary stops a turn, so a random policy's turns are a few tokens long
STOPS = [IM_END] + list(range(0, 2026, 6))


def _session(env_cls, num_generations=2, max_turns=4):
    chat = ToolChat(CHAT_FORMATS["qwen2_5"], TOKENIZER)
    return TurnSession(chat, env_cls, ROWS, num_generations=num_generations, max_turns=max_turns, stop_ids=STOPS)


def test_cache_extended_by_continuations_equals_a_fresh_forward():
    model = tiny_model()
    session = _session(ChattyEnvironment)
    out = generate_turns(model, session, max_new_tokens=60, stop_tokens=STOPS, pad_id=PAD, temperature=0.0)
    assert max(t.turns for t in out.trajectories) >= 3  # the test covers several continuations per row
    appended = (out.completion_mask & ~out.sampled_mask).sum(1)
    assert bool((appended > 0).all())
    assert len(set(appended.tolist())) > 1  # rows of different lengths, written at different columns
    for b in range(out.completion_tokens.shape[0]):
        prompt = out.prompt_tokens[b][out.prompt_mask[b]]
        length = int(out.completion_mask[b].sum())
        assert bool(out.completion_mask[b, :length].all())
        seq = torch.cat([prompt, out.completion_tokens[b, :length]])
        with torch.no_grad():
            logp = F.log_softmax(model(seq[None])[0].double(), -1)
        rows = out.sampled_mask[b, :length].nonzero().squeeze(1)
        pred = logp[len(prompt) - 1 + rows]
        assert torch.equal(pred.argmax(-1), out.completion_tokens[b, rows])  # greedy tokens of the fresh forward
        want = pred.gather(1, out.completion_tokens[b, rows][:, None]).squeeze(1)
        torch.testing.assert_close(out.sampler_log_probs[b, rows].double(), want, rtol=0, atol=1e-6)
        assert bool((out.sampler_log_probs[b][~out.sampled_mask[b]] == 0).all())
        # the appended tokens are the template's continuations, in order, after each turn
        text = TOKENIZER.decode(out.completion_tokens[b, :length].tolist(), skip_special_tokens=False)
        assert text.count("<|im_start|>user\n") == sum(m["role"] == "user" for m in out.trajectories[b].messages) - 1


def test_rows_that_never_continue_equal_the_single_turn_sampler():
    """With no continuation (the environment is done at once), generate_turns samples what the
    single-turn compiled sampler samples: the same counter streams (row key, position), tokens and
    log-probs."""
    model = tiny_model(torch.float32)
    session = _session(DoneEnvironment, num_generations=3)
    stops = [IM_END] + list(range(0, 2026, 7))
    kw = dict(max_new_tokens=12, stop_tokens=stops, pad_id=PAD, temperature=1.0)
    out = generate_turns(model, session, generator=prompt_generators(0, 5, range(3)), **kw)
    ref = CompiledSampler(compile=False)(model, session.prompts, num_generations=3,
                                         generator=prompt_generators(0, 5, range(3)), **kw)
    assert torch.equal(out.completion_tokens, ref.completion_tokens)
    assert torch.equal(out.completion_mask, ref.completion_mask)
    assert torch.equal(out.truncated, ref.truncated)
    torch.testing.assert_close(out.sampler_log_probs, ref.sampler_log_probs, rtol=0, atol=1e-5)
    assert torch.equal(out.sampled_mask, out.completion_mask) and torch.equal(out.loss_mask, out.completion_mask)
    assert [t.turns for t in out.trajectories] == [1] * 9


def test_budget_truncates_and_masks():
    model = tiny_model()
    session = _session(ChattyEnvironment)
    out = generate_turns(model, session, max_new_tokens=9, stop_tokens=STOPS, pad_id=PAD, temperature=0.0)
    for b, traj in enumerate(out.trajectories):
        length = int(out.completion_mask[b].sum())
        assert length <= 9
        if bool(out.truncated[b]):
            assert traj.out_of_budget
        else:
            assert traj.turns == 3 or not traj.out_of_budget
    assert bool(out.truncated.any())
