"""Prompt once per group and the response-only head in the GRPO update: the same update (loss,
metrics, every parameter gradient, old and reference log-probs) as the expanded batch that runs the
head on every position."""

import copy
import dataclasses

import pytest
import torch

from logitless.losses.grpo import GRPOLoss
from logitless.models import qwen2_5_tiny
from logitless.rl.batch import policy_batch
from logitless.generation.eager import generate
from logitless.rl.reference import ReferencePolicy
from logitless.rl.shared_batch import (AUTO_MAX_PACKED_SDPA, flex_available, packed_length, packing_attention,
                                       shared_batch, training_batch, use_prompt_sharing)
from logitless.rl.update import batch_log_probs, grpo_update

G = 4
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]  # different lengths: left padding in the expanded batch


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it applies (one dict per optimizer step)."""

    def __init__(self, named_params, lr):
        named_params = list(named_params)
        super().__init__([p for _, p in named_params], lr=lr)
        self.names = {id(p): n for n, p in named_params}
        self.grads = []

    def step(self, closure=None):
        self.grads.append({self.names[id(p)]: p.grad.detach().clone()
                           for group in self.param_groups for p in group["params"]})
        return super().step(closure)


def _model():
    torch.manual_seed(0)
    m = qwen2_5_tiny(vocab_size=48, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=32, intermediate_dim=64)
    with torch.no_grad():
        m.tok_embeddings.weight.mul_(0.3)
    return m


@pytest.fixture(scope="module")
def setup():
    base = _model()
    rollout = generate(base, PROMPTS, max_new_tokens=5, stop_tokens=[3, 4, 17], pad_id=0, num_generations=G,
                       temperature=0.9, generator=torch.Generator().manual_seed(1))
    lengths = rollout.completion_lengths
    assert lengths.min() < lengths.max() and rollout.truncated.any() and not rollout.truncated.all()
    assert not rollout.prompt_mask.all()
    return base, rollout


def _update(base, batch, loss_kwargs, micro_batch_size, num_iterations=2):
    model = copy.deepcopy(base)
    loss_fn = GRPOLoss(temperature=0.9, impl="chunked", max_completion_length=5, **loss_kwargs)
    opt = RecordingSGD(model.named_parameters(), lr=0.1)
    ref = ReferencePolicy.frozen_copy(base) if loss_kwargs.get("beta", 0) > 0 else None
    adv = torch.linspace(-1.5, 1.0, len(batch))
    metrics = grpo_update(model, loss_fn, opt, batch, adv, micro_batch_size=micro_batch_size,
                          num_iterations=num_iterations, reference=ref)
    return metrics, opt.grads


def _assert_same_update(got, want):
    (m1, g1), (m2, g2) = got, want
    assert m1.keys() == m2.keys()
    for k in m2:
        assert m1[k] == pytest.approx(m2[k], rel=1e-5, abs=1e-6), k
    assert len(g1) == len(g2)
    for it, (a, b) in enumerate(zip(g1, g2)):
        assert a.keys() == b.keys()
        for name in b:
            # fp32, different summation orders: elementwise rtol, atol relative to the tensor's scale
            scale = float(b[name].abs().max())
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6 * max(scale, 1.0),
                                       msg=lambda m: f"iteration {it}: {name}: {m}")


CASES = [
    dict(loss_type="dapo", beta=0.1),
    dict(loss_type="grpo", beta=0.1, entropy_coef=0.01),
    dict(loss_type="dr_grpo", beta=0.0, epsilon_high=0.28),
    dict(loss_type="bnpo", beta=0.05, importance_sampling_level="sequence", mask_truncated_completions=True),
]


@pytest.mark.parametrize("loss_kwargs", CASES, ids=[c["loss_type"] for c in CASES])
def test_shared_prompt_update_equals_expanded_full_head(setup, loss_kwargs):
    """beta > 0 (reference pass) and num_iterations=2 (old log-probs, ratio != 1) on both paths; the
    expanded batch runs the head on every position (``prompt_len=None``)."""
    base, rollout = setup
    full = dataclasses.replace(policy_batch(rollout), prompt_len=None)
    want = _update(base, full, loss_kwargs, micro_batch_size=G)
    got = _update(base, shared_batch(rollout), loss_kwargs, micro_batch_size=G)
    _assert_same_update(got, want)
    if loss_kwargs["beta"] > 0:
        assert got[0]["kl"] > 0  # the second iteration is measured after one step away from the reference


def test_response_only_head_equals_full_head(setup):
    base, rollout = setup
    kwargs = dict(loss_type="dapo", beta=0.1, entropy_coef=0.01)
    batch = policy_batch(rollout)
    assert batch.head_labels.shape == rollout.completion_tokens.shape
    want = _update(base, dataclasses.replace(batch, prompt_len=None), kwargs, micro_batch_size=6)
    _assert_same_update(_update(base, batch, kwargs, micro_batch_size=6), want)


@pytest.mark.parametrize("attention", ["cascade", "sdpa"])
def test_shared_micro_batches_of_several_groups(setup, attention):
    """Three groups per micro-batch (prompts of different lengths packed together: cascade attention's
    masked path) == one per micro-batch (equal lengths: its mask-free causal path)."""
    base, rollout = setup
    kwargs = dict(loss_type="dapo", beta=0.1)
    batch = shared_batch(rollout, attention=attention)
    _assert_same_update(_update(base, batch, kwargs, micro_batch_size=3 * G),
                        _update(base, batch, kwargs, micro_batch_size=G))


@pytest.mark.parametrize("attention", ["cascade", "sdpa"])
def test_old_log_probs_match_the_sampler_and_the_expanded_batch(setup, attention):
    """Independent check of the layout: the training path's log-probs are the sampler's own."""
    base, rollout = setup
    model = copy.deepcopy(base)
    loss_fn = GRPOLoss(temperature=0.9, impl="chunked")
    loss_fn.set_model_output(model)
    shared = batch_log_probs(model, loss_fn, shared_batch(rollout, attention=attention), micro_batch_size=3 * G)
    expanded = batch_log_probs(model, loss_fn, policy_batch(rollout), micro_batch_size=3)
    assert shared.shape == rollout.completion_tokens.shape
    torch.testing.assert_close(shared, expanded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared, rollout.sampler_log_probs, rtol=1e-4, atol=1e-4)
    assert (shared[~rollout.completion_mask] == 0).all()
    ref = ReferencePolicy.frozen_copy(base)
    ref_lp = torch.cat([ref.log_probs(loss_fn, mb) for mb in shared_batch(rollout, attention=attention).micro_batches(G)])
    torch.testing.assert_close(ref_lp, shared, rtol=1e-5, atol=1e-5)


def test_shared_batch_strips_padding_and_keeps_groups(setup):
    _, rollout = setup
    batch = shared_batch(rollout, pad_id=0)
    assert [p.tolist() for p in batch.prompts] == PROMPTS
    assert len(batch) == len(PROMPTS) * G and batch.num_generations == G
    torch.testing.assert_close(batch.head_labels, policy_batch(rollout).head_labels)
    packed = batch.pack()
    assert packed.tokens.shape[1] == max(map(len, PROMPTS)) + G * rollout.completion_tokens.shape[1]
    assert isinstance(training_batch(rollout, prompt_sharing=True), type(batch))
    assert not isinstance(training_batch(rollout, prompt_sharing=False), type(batch))


def test_errors(setup):
    base, rollout = setup
    with pytest.raises(ValueError, match="micro_batch_size=2 must be a multiple of num_generations=4"):
        list(shared_batch(rollout).micro_batches(2))
    model = copy.deepcopy(base)
    with pytest.raises(ValueError, match="micro_batch_size=6 must be a multiple"):
        grpo_update(model, GRPOLoss(), torch.optim.SGD(model.parameters(), lr=0.1), shared_batch(rollout),
                    torch.zeros(len(PROMPTS) * G), micro_batch_size=6)
    swapped = dataclasses.replace(rollout, prompt_tokens=rollout.prompt_tokens.roll(1, dims=0),
                                  prompt_mask=rollout.prompt_mask.roll(1, dims=0))
    with pytest.raises(ValueError, match="same prompt"):
        shared_batch(swapped)
    with pytest.raises(ValueError, match="not whole groups"):
        shared_batch(dataclasses.replace(rollout, num_generations=5))
    short = copy.deepcopy(base)
    short.max_seq_len = 10
    loss_fn = GRPOLoss()
    loss_fn.set_model_output(short)
    with pytest.raises(ValueError, match="max_seq_len=10; set prompt_sharing: false"):
        shared_batch(rollout).forward(short)
    GRPOLoss().set_model_output(model)
    model.set_output_mode("logits")
    with pytest.raises(TypeError, match="'hidden' output mode"):
        shared_batch(rollout).forward(model)


def test_use_prompt_sharing():
    assert use_prompt_sharing("auto", micro_batch_size=8, num_generations=4) is True
    assert use_prompt_sharing("auto", micro_batch_size=6, num_generations=4) is False
    assert use_prompt_sharing(False, micro_batch_size=8, num_generations=4) is False
    assert use_prompt_sharing(True, micro_batch_size=4, num_generations=4) is True
    with pytest.raises(ValueError, match="config key 'micro_batch_size': 6 must be a multiple of num_generations=4"):
        use_prompt_sharing(True, micro_batch_size=6, num_generations=4)
    with pytest.raises(ValueError, match="config key 'prompt_sharing'"):
        use_prompt_sharing("yes", micro_batch_size=8, num_generations=4)


def test_packed_length_and_auto_decision(setup):
    """The packed length is what SharedGroupBatch.pack builds; auto packs only what fits and pays."""
    _, rollout = setup
    length = packed_length(rollout)
    assert length == shared_batch(rollout).pack().tokens.shape[1] == max(map(len, PROMPTS)) + G * 5
    choose = lambda n, att, limit=None, must=False: packing_attention(  # noqa: E731
        n, attention=att, max_seq_len=limit, must_pack=must)
    long = AUTO_MAX_PACKED_SDPA + 1
    # auto: cascade attention at any length (its cost is what the mask keeps)
    assert choose(length, "auto") == choose(long, "auto") == "cascade"
    # never past the model's positions, unless prompt_sharing: true insists (the forward raises)
    assert choose(length, "auto", limit=length - 1) is None and choose(long, "flex", limit=long - 1) is None
    assert choose(length, "sdpa", limit=length - 1, must=True) == "sdpa"
    # explicit settings: the dense mask only while it pays, cascade and flex at any length
    assert choose(long, "sdpa") is None and choose(long, "sdpa", must=True) == "sdpa"
    assert choose(length, "sdpa") == "sdpa"
    assert choose(long, "flex") == "flex" and choose(long, "cascade") == "cascade"
    with pytest.raises(ValueError, match="config key 'prompt_sharing_attention'.*'dense'"):
        choose(length, "dense")
    assert not flex_available(torch.device("cpu"))


def test_flex_block_mask_equals_the_dense_mask(setup):
    """The BlockMask of the flex path attends exactly as SDPA with the dense mask (eager flex on CPU)."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from logitless.rl.shared_batch import flex_block_mask

    _, rollout = setup
    packed = shared_batch(rollout, attention="sdpa").pack()
    b, s = packed.tokens.shape
    q, k, v = (torch.randn(b, 2, s, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        got = flex_attention(q, k, v, block_mask=flex_block_mask(packed, G, block_size=16))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=packed.mask[:, None])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the flex path packs without the dense mask; everything else is the same
    lean = shared_batch(rollout, attention="flex").pack()
    assert lean.mask is None
    for name in ("tokens", "input_pos", "predict_rows", "targets", "segments"):
        torch.testing.assert_close(getattr(lean, name), getattr(packed, name), msg=name)


def test_padded_packing_gives_the_same_rows(setup):
    """The flex path pads packed groups to a length multiple: padding rows change nothing."""
    from logitless.modules import gather_predicting_rows
    from logitless.rl.batch import policy_forward

    base, rollout = setup
    model = copy.deepcopy(base)
    GRPOLoss().set_model_output(model)
    groups = shared_batch(rollout, attention="sdpa")
    tight, padded = groups.pack(), groups.pack(seq_len=groups.packed_length() + 37)
    assert padded.tokens.shape[1] == tight.tokens.shape[1] + 37
    with torch.no_grad():
        want = gather_predicting_rows(policy_forward(model, tight), tight).hidden
        got = gather_predicting_rows(policy_forward(model, padded), padded).hidden
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_flex_attention_needs_cuda(setup):
    base, rollout = setup
    model = copy.deepcopy(base)
    GRPOLoss().set_model_output(model)
    with pytest.raises(ValueError, match="attention='flex' needs CUDA"):
        shared_batch(rollout, attention="flex").forward(model)
    with pytest.raises(ValueError, match="attention must be one of"):
        shared_batch(rollout, attention="dense")
