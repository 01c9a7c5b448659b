"""The wrapped decoder gives the same loss and gradients as the plain one with full-logit CE."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torchtune.generation import generate
from torchtune.modules import TiedLinear

from logitless.losses import CEWithChunkedOutputLoss, LinearCrossEntropyLoss
from logitless.modules import HeadInput, head_weight, shift_labels, wrap_output_head

VOCAB = 97  # conftest.tiny_qwen2 builds models with this vocabulary


def _batch(seed=1, batch=3, seq=20):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = tokens.clone()
    labels[:, :5] = -100  # a prompt
    return tokens, shift_labels(labels)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied,lora,family", [(True, False, "qwen2"), (False, False, "qwen2"), (False, True, "qwen2"),
                                              (True, True, "qwen2"), (True, False, "qwen3"), (False, True, "qwen3"),
                                              (True, True, "llama"), (False, False, "llama")])
@pytest.mark.parametrize("loss_cls", [CEWithChunkedOutputLoss, LinearCrossEntropyLoss])
def test_wrapped_matches_plain_cross_entropy(make_model, tied, lora, family, loss_cls):
    plain = make_model(tied, lora, family=family)
    wrapped = copy.deepcopy(plain)
    tokens, labels = _batch()

    logits = plain(tokens)
    want = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    want.backward()

    loss_fn = loss_cls() if loss_cls is CEWithChunkedOutputLoss else loss_cls(impl="chunked", chunk_size=7)
    loss_fn.set_model_output(wrapped)
    out = wrapped(tokens)
    assert isinstance(out, HeadInput)
    got = loss_fn(out, labels)
    got.backward()

    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want_g, got_g = _grads(plain), _grads(wrapped)
    assert want_g.keys() == got_g.keys() and len(want_g) > 0
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], rtol=1e-4, atol=1e-6, msg=name)


def test_state_dict_keys_and_head_weight_unchanged(make_model):
    for tied in (True, False):
        model = make_model(tied)
        keys = list(model.state_dict().keys())
        wrap_output_head(model)
        assert list(model.state_dict().keys()) == keys
        expected = model.tok_embeddings.weight if tied else model.output.weight
        assert isinstance(model.output, TiedLinear) == tied
        assert head_weight(model) is expected
        assert wrap_output_head(model) is model  # idempotent


def test_logit_chunks_mode_splits_before_projection(make_model):
    model = wrap_output_head(make_model(False))
    tokens, _ = _batch()
    full = model(tokens)
    model.set_output_mode("logit_chunks", 4)
    chunks = model(tokens)
    assert len(chunks) == 4
    torch.testing.assert_close(torch.cat([c.float() for c in chunks], dim=1), full)
    model.set_num_output_chunks(0)  # torchtune's API still works
    assert torch.equal(model(tokens), full)


@pytest.mark.parametrize("use_cache", [False, True])
def test_generation_works_on_a_wrapped_model(make_model, use_cache):
    plain = make_model(True)
    wrapped = wrap_output_head(copy.deepcopy(plain))
    wrapped.set_output_mode("hidden")
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_generated_tokens=5, top_k=1, temperature=1.0)
    if use_cache:
        for m in (plain, wrapped):
            m.setup_caches(batch_size=2, dtype=torch.float32, decoder_max_seq_len=16)
        # caches enabled: decoding gets logits whatever the training mode is
        got, got_logits = generate(wrapped, prompt, **kwargs)
    else:
        with wrapped.output_mode("logits"):
            got, got_logits = generate(wrapped, prompt, **kwargs)
        assert wrapped.output_mode_name == "hidden"
    want, want_logits = generate(plain, prompt, **kwargs)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits)


def test_bad_modes_and_models(make_model):
    model = wrap_output_head(make_model(True))
    with pytest.raises(ValueError, match="mode must be one of"):
        model.set_output_mode("probs")
    with pytest.raises(ValueError, match="num_chunks must be a positive int"):
        model.set_output_mode("logit_chunks", 0)
    with pytest.raises(ValueError, match="must be a torchtune TransformerDecoder"):
        wrap_output_head(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="call loss_fn.set_model_output"):
        LinearCrossEntropyLoss()(torch.randn(2, 3, VOCAB), torch.zeros(2, 3, dtype=torch.long))


def test_lora_head_with_dropout_is_rejected_in_training():
    from torchtune.models.qwen2._component_builders import lora_qwen2

    model = lora_qwen2(["q_proj"], apply_lora_to_output=True, vocab_size=VOCAB, num_layers=1,
                       num_heads=2, num_kv_heads=1, embed_dim=16, intermediate_dim=32,
                       max_seq_len=16, lora_rank=2, lora_alpha=4.0, lora_dropout=0.1)
    with pytest.raises(ValueError, match="lora_dropout=0.0"):
        head_weight(model)
    model.eval()
    assert head_weight(model).shape == (VOCAB, 16)
