"""The KV-cached sampler: masking after stop tokens, left padding, no full logits, caches torn down,
and log-probs of the training path equal to the sampler's (fp32, CPU)."""

import pytest
import torch
from torch.nn import functional as F

from logitless.losses.grpo import GRPOLoss
from logitless.models import qwen2_5_tiny
from logitless.rl.batch import policy_batch, policy_forward
from logitless.generation.eager import generate
from logitless.generation.result import left_pad
from logitless.generation.sampling import sample_next

V = 64
EOS = 3
PAD = 0


def tiny_policy(seed=0):
    torch.manual_seed(seed)
    m = qwen2_5_tiny(vocab_size=V, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=32, intermediate_dim=64,
                     max_seq_len=128)
    with torch.no_grad():
        m.tok_embeddings.weight.mul_(0.3)  # a spread-out distribution, so sampling is not degenerate
    return m


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def test_left_pad():
    toks, mask = left_pad([[5, 6], [7]], pad_id=0)
    assert toks.tolist() == [[5, 6], [0, 7]] and mask.tolist() == [[True, True], [False, True]]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        left_pad([[1], []], pad_id=0)


def test_stop_tokens_masking_and_truncation():
    m = tiny_policy()
    with torch.no_grad():  # make EOS likely so that some completions stop early
        m.tok_embeddings.weight[EOS] *= 4
    out = generate(m, PROMPTS, max_new_tokens=6, stop_tokens=[EOS], pad_id=PAD, num_generations=4,
                   temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert out.completion_tokens.shape[0] == 12 and out.num_generations == 4
    stopped = 0
    for toks, mask, trunc in zip(out.completion_tokens.tolist(), out.completion_mask.tolist(), out.truncated.tolist()):
        if EOS in toks:
            k = toks.index(EOS)
            stopped += 1
            assert not trunc
            assert mask == [True] * (k + 1) + [False] * (len(toks) - k - 1)
            assert all(t == PAD for t in toks[k + 1:])
        else:
            assert trunc and all(mask)
    assert 0 < stopped < 12
    assert (out.sampler_log_probs[~out.completion_mask] == 0).all()


def test_groups_are_contiguous_copies_of_the_prompt():
    out = generate(tiny_policy(), PROMPTS, max_new_tokens=2, stop_tokens=[EOS], pad_id=PAD, num_generations=3)
    for i, p in enumerate(PROMPTS):
        for j in range(3):
            row = out.prompt_tokens[i * 3 + j][out.prompt_mask[i * 3 + j]].tolist()
            assert row == p


def test_no_full_logits_and_caches_deleted():
    m = tiny_policy()

    def forbidden(*a, **k):
        raise AssertionError("the sampler must not run the [B, S, V] output projection")

    m.output.forward = forbidden
    generate(m, PROMPTS, max_new_tokens=3, stop_tokens=[EOS], pad_id=PAD, num_generations=2)
    assert not m.caches_are_setup() and not m.caches_are_enabled()
    assert all(layer.attn.kv_cache is None for layer in m.layers)


def test_refuses_model_with_caches():
    m = tiny_policy()
    m.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=16)
    with pytest.raises(ValueError, match="already has KV caches"):
        generate(m, PROMPTS, max_new_tokens=2, stop_tokens=[EOS], pad_id=PAD)
    with pytest.raises(RuntimeError, match="KV caches"):
        policy_forward(m, policy_batch(generate(tiny_policy(), PROMPTS, max_new_tokens=2, stop_tokens=[EOS],
                                                pad_id=PAD)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(stop_tokens=[]), "stop_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=1e-30), r"temperature must be 0 \(greedy\) or a finite number in \[0.0001, 10000.0\], got 1e-30"),
    (dict(temperature=float("inf")), r"temperature must be 0 \(greedy\) or a finite number in .*got inf"),
    (dict(temperature=float("nan")), r"temperature must be 0 \(greedy\) or a finite number in .*got nan"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=1.5), "top_p"),
    (dict(num_generations=0), "num_generations"),
    (dict(max_new_tokens=200), "exceeds the model's max_seq_len=128"),
])
def test_bad_arguments(kwargs, match):
    args = dict(max_new_tokens=2, stop_tokens=[EOS], pad_id=PAD)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        generate(tiny_policy(), PROMPTS, **args)


def _unpadded_log_probs(model, prompt, completion, temperature):
    """Reference: one unpadded sequence through the plain model (no cache, no mask), full logits."""
    seq = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(seq)[0].double() / temperature
    logsm = torch.log_softmax(logits, -1)
    return torch.stack([logsm[len(prompt) - 1 + j, t] for j, t in enumerate(completion)])


def test_training_path_log_probs_equal_sampler_and_unpadded_reference():
    temperature = 0.7
    m = tiny_policy(1)
    out = generate(m, PROMPTS, max_new_tokens=5, stop_tokens=[EOS], pad_id=PAD, num_generations=2,
                   temperature=temperature, generator=torch.Generator().manual_seed(1))
    batch = policy_batch(out)
    loss_fn = GRPOLoss(temperature=temperature, impl="chunked")
    loss_fn.set_model_output(m)
    with torch.no_grad():
        train_logp = loss_fn.log_probs(policy_forward(m, batch), batch.labels)
    p = out.prompt_tokens.shape[1]
    t = out.completion_tokens.shape[1]
    # the label shift puts completion token j at position p - 1 + j
    aligned = train_logp[:, p - 1:p - 1 + t]
    torch.testing.assert_close(aligned, out.sampler_log_probs, rtol=1e-5, atol=1e-5)
    assert (train_logp[:, :p - 1] == 0).all()
    m.set_output_mode("logits")
    for i in range(len(out.prompt_tokens)):
        prompt = out.prompt_tokens[i][out.prompt_mask[i]].tolist()
        comp = out.completion_tokens[i][out.completion_mask[i]].tolist()
        ref = _unpadded_log_probs(m, prompt, comp, temperature)
        torch.testing.assert_close(aligned[i, :len(comp)].double(), ref, rtol=1e-5, atol=1e-5)


def test_greedy_is_argmax_of_full_forward():
    m = tiny_policy(2)
    out = generate(m, PROMPTS, max_new_tokens=4, stop_tokens=[EOS], pad_id=PAD, temperature=0.0)
    for i, prompt in enumerate(PROMPTS):
        seq = list(prompt)
        for j in range(out.completion_tokens.shape[1]):
            if not out.completion_mask[i, j]:
                break
            with torch.no_grad():
                nxt = int(m(torch.tensor([seq]))[0, -1].argmax())
            assert nxt == int(out.completion_tokens[i, j])
            seq.append(nxt)


def test_sample_next_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    tok, lp = sample_next(logits, temperature=1.0, top_k=2, generator=g)
    assert set(tok.tolist()) == {0, 1}
    torch.testing.assert_close(lp, torch.log(torch.tensor([0.5, 0.3]))[tok])  # untruncated log-probs
    tok, _ = sample_next(logits, temperature=1.0, top_p=0.6, generator=g)
    assert set(tok.tolist()) == {0, 1}
    tok, _ = sample_next(logits, temperature=1.0, top_p=0.5, generator=g)
    assert set(tok.tolist()) == {0}
    tok, lp = sample_next(logits[:1], temperature=2.0, generator=g)
    torch.testing.assert_close(lp, F.log_softmax(logits[:1] / 2.0, -1)[0, tok])
    tok, _ = sample_next(logits, temperature=1.0, generator=g)
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.04, rtol=0)
