"""Cascade attention computes what SDPA computes with the packing's dense mask (float64 reference),
forward and backward, with equal and unequal prompt lengths, as a bare op and inside a torchtune model."""

import copy

import pytest
import torch
import torch.nn.functional as F

from logitless.modules import pack_groups
from logitless.modules.cascade_attention import (CascadeLayout, cascade_attention, cascade_layout,
                                                 enable_cascade_attention)
from logitless.modules.prompt_sharing import segment_mask

VOCAB = 97  # conftest.tiny_qwen2 builds models with this vocabulary


def _dense_mask(prompt_lengths, g, t):
    """The packing's mask from its segment ids (the same function as the SDPA and flex paths)."""
    prompts = [torch.arange(n) for n in prompt_lengths]
    completions = torch.zeros(len(prompts), g, t, dtype=torch.long)
    packed = pack_groups(prompts, completions, torch.ones_like(completions, dtype=torch.bool))
    return packed.mask[:, None]


@pytest.mark.parametrize("prompt_lengths", [[6, 6], [3, 9, 1]], ids=["equal", "unequal"])
def test_cascade_equals_dense_mask_attention(prompt_lengths):
    g, t, h, d = 3, 5, 2, 8
    b, s = len(prompt_lengths), max(prompt_lengths) + g * t
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    up = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    layout = cascade_layout(prompt_lengths, g, t, q.device)
    assert (layout.prompt_mask is None) == (len(set(prompt_lengths)) == 1)

    got = cascade_attention(q, k, v, layout)
    got_grads = torch.autograd.grad((got * up).sum(), (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_dense_mask(prompt_lengths, g, t))
    want_grads = torch.autograd.grad((want * up).sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for name, a, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10, msg=name)


def test_layout_masks_are_the_dense_mask_blocks():
    """The masked path's two masks are the dense mask's prompt block and each completion's columns."""
    lengths, g, t = [2, 5], 2, 3
    layout = cascade_layout(lengths, g, t, torch.device("cpu"))
    dense = _dense_mask(lengths, g, t)[:, 0]
    p = max(lengths)
    torch.testing.assert_close(layout.prompt_mask[:, 0], dense[:, :p, :p])
    for i in range(len(lengths)):
        for j in range(g):
            rows = slice(p + j * t, p + (j + 1) * t)
            want = torch.cat([dense[i, rows, :p], dense[i, rows, rows]], dim=1)
            torch.testing.assert_close(layout.completion_mask[i * g + j, 0], want)


def test_cascade_rejects_a_length_that_is_not_the_layout():
    q = torch.randn(1, 2, 20, 8)
    with pytest.raises(ValueError, match="packed length 20 is not prompt_len .* = 4 \\+ 3 x 5"):
        cascade_attention(q, q, q, CascadeLayout(4, 3, 5))


def test_model_with_cascade_layout_equals_dense_mask(make_model):
    """A torchtune decoder given the layout as its mask == the same decoder given the dense mask,
    for every packed row and every parameter gradient; other masks still reach torchtune's call."""
    model = make_model(False).double()
    cascade = copy.deepcopy(model)
    assert enable_cascade_attention(cascade) == len(cascade.layers) and enable_cascade_attention(cascade) == 0
    gen = torch.Generator().manual_seed(1)
    lengths, g, t = [4, 7], 3, 5
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    completions = torch.randint(0, VOCAB, (2, g, t), generator=gen)
    packed = pack_groups(prompts, completions, torch.ones_like(completions, dtype=torch.bool))
    up = torch.randn(*packed.tokens.shape, VOCAB, generator=gen, dtype=torch.float64)

    want = model(packed.tokens, mask=packed.mask, input_pos=packed.input_pos)
    (want * up).sum().backward()
    got = cascade(packed.tokens, mask=cascade_layout(lengths, g, t, packed.tokens.device), input_pos=packed.input_pos)
    (got * up).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    for (name, p), c in zip(model.named_parameters(), cascade.parameters()):
        torch.testing.assert_close(c.grad, p.grad, rtol=1e-8, atol=1e-9, msg=name)
    # a dense mask and no mask still go through torchtune's own attention
    torch.testing.assert_close(cascade(packed.tokens, mask=packed.mask, input_pos=packed.input_pos), want.detach())
    torch.testing.assert_close(cascade(packed.tokens), model(packed.tokens))


def test_pack_groups_right_aligns_prompts():
    """Completions start at the same column in every row, after the longest prompt."""
    prompts = [torch.tensor([5, 6]), torch.tensor([7, 8, 9, 10])]
    completions = torch.tensor([[[11, 12]], [[13, 14]]])
    packed = pack_groups(prompts, completions, torch.ones_like(completions, dtype=torch.bool), pad_id=0)
    assert packed.tokens.tolist() == [[0, 0, 5, 6, 11, 12], [7, 8, 9, 10, 13, 14]]
    assert packed.input_pos.tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    assert packed.segments.tolist() == [[1, 1, -1, -1, 0, 0], [-1, -1, -1, -1, 0, 0]]
    assert packed.predict_rows.tolist() == [[[3, 4]], [[3, 4]]]
    # padding sees only itself; the prompt never sees padding
    pos = torch.arange(6)
    mask = segment_mask(packed.segments, pos[:, None], pos[None, :], 1, batch=0)
    assert mask[:2].tolist() == [[True] + [False] * 5, [False, True] + [False] * 4]
    assert not mask[2:, :2].any()
