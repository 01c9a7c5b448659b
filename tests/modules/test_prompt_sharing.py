"""Prompt once per group gives the log-probs and gradients of the expanded batch."""

import copy

import pytest
import torch

import logitless
from logitless.modules import (
    completion_rows,
    gather_predicting_rows,
    pack_groups,
    shift_labels,
    wrap_output_head,
)

VOCAB = 97  # conftest.tiny_qwen2 builds models with this vocabulary


def _groups(seed=0, g=3, lc=5):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (4, 7)]
    completions = torch.randint(0, VOCAB, (2, g, lc), generator=gen)
    lengths = torch.randint(1, lc + 1, (2, g), generator=gen)
    mask = torch.arange(lc) < lengths.unsqueeze(-1)
    return prompts, completions, mask


def _expanded_log_probs(model, prompts, completions, mask):
    """One ordinary causal sequence [prompt, completion] per completion."""
    out = []
    for i, prompt in enumerate(prompts):
        g, lc = completions.shape[1:]
        seqs = torch.cat([prompt.expand(g, -1), completions[i]], dim=1)
        labels = torch.full_like(seqs, -100)
        labels[:, prompt.numel():] = torch.where(mask[i], completions[i], -100)
        head = model(seqs)
        logp, ent = logitless.linear_log_probs(head.hidden, head.weight, shift_labels(labels), impl="chunked")
        out.append((logp[:, prompt.numel() - 1 : -1], ent[:, prompt.numel() - 1 : -1]))
    return torch.stack([o[0] for o in out]), torch.stack([o[1] for o in out])


@pytest.mark.parametrize("tied,family", [(True, "qwen2"), (False, "qwen2"), (True, "qwen3"), (False, "qwen3"),
                                         (True, "llama")])
def test_shared_prompt_matches_expanded_batch(make_model, tied, family):
    expanded = wrap_output_head(make_model(tied, family=family))
    expanded.set_output_mode("hidden")
    shared = copy.deepcopy(expanded)
    prompts, completions, mask = _groups()
    up_lp = torch.randn(completions.shape)
    up_ent = torch.randn(completions.shape)

    want_lp, want_ent = _expanded_log_probs(expanded, prompts, completions, mask)
    ((want_lp * up_lp).sum() + (want_ent * up_ent).sum()).backward()

    batch = pack_groups(prompts, completions, mask)
    assert batch.tokens.shape[1] < sum(p.numel() for p in prompts) * 3 + completions.numel()
    head = gather_predicting_rows(shared(batch.tokens, mask=batch.mask, input_pos=batch.input_pos), batch)
    got_lp, got_ent = logitless.linear_log_probs(head.hidden, head.weight, batch.targets, impl="chunked")
    ((got_lp * up_lp).sum() + (got_ent * up_ent).sum()).backward()

    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, rtol=1e-5, atol=1e-5)
    assert (got_lp[~mask] == 0).all()
    for (name, p), q in zip(expanded.named_parameters(), shared.parameters()):
        # fp32 rounding of a sum over a different order: within 1e-6 of the gradient's scale
        atol = 1e-6 * max(1.0, p.grad.abs().max().item())
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=atol, msg=name)


def test_completion_rows_drop_prompt_positions():
    hidden = torch.randn(2, 6, 4)
    labels = torch.tensor([[-100, -100, 3, 4, -100, -100], [-100, 1, 2, 3, 4, -100]])
    weight = torch.randn(9, 4)
    head, sel_labels, selected = completion_rows(logitless.modules.HeadInput(hidden, weight), labels)
    assert head.hidden.shape == (6, 4) and sel_labels.tolist() == [3, 4, 1, 2, 3, 4]
    got, _ = logitless.linear_log_probs(head.hidden, weight, sel_labels, impl="chunked")
    want, _ = logitless.linear_log_probs(hidden, weight, labels, impl="reference")
    torch.testing.assert_close(got, want[selected])


def test_pack_groups_rejects_bad_shapes():
    prompts, completions, mask = _groups()
    with pytest.raises(ValueError, match="one prompt per group"):
        pack_groups(prompts[:1], completions, mask)
    with pytest.raises(ValueError, match="completions and completion_mask must both be"):
        pack_groups(prompts, completions[0], mask[0])
    with pytest.raises(ValueError, match="seq_len must be"):
        pack_groups(prompts, completions, mask, seq_len=5)
