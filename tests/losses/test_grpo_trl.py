"""GRPOLoss against TRL's GRPO objective in float64: every loss_type, the two-sided clip, the KL
estimators and their bias correction, the sampler-trainer importance weights (TRL's four modes), the
high-entropy token mask, the entropy bonus; loss, gradients and logged metrics, on the reference,
chunked and (CPU interpreter) Triton heads, fused and unfused.

The oracle, :func:`trl_objective`, is written here from TRL 1.16.0's public definitions (``trl``
itself is not a test dependency: a clean install would bring ``datasets``, ``pyarrow`` and
``accelerate``, and ``GRPOTrainer._compute_loss`` is a method of a whole trainer): the importance
ratio and its metrics of ``GRPOTrainer._generate_and_score_completions``,
``GRPOTrainer.get_high_entropy_mask`` and ``GRPOTrainer._compute_loss``, for one micro-batch on one
process (``gradient_accumulation_steps = steps_per_generation = 1``, where TRL's micro-batch is the
whole batch). KL estimators TRL lacks (k1, k2, low_var_kl) follow verl's ``kl_penalty``.
"""

import math

import pytest
import torch

try:
    from logitless.ops.triton import head
except ImportError:  # no triton: the triton cases are skipped
    head = None
from logitless.losses.grpo import GRPOLoss
from logitless.modules import HeadInput
from logitless.rl.metrics import sampler_mismatch_metrics

IGN = -100
T = 0.8
B, S, H, V = 6, 9, 12, 37
LENGTHS = [5, 6, 2, 1, 4, 3]  # completion tokens after 2 prompt positions


def make_inputs(seed=0, sampler_spread=0.3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.6
    labels = torch.randint(0, V, (B, S), generator=g)
    for i, n in enumerate(LENGTHS):
        labels[i, :2] = IGN
        labels[i, 2 + n:] = IGN
    cur = torch.log_softmax(hidden @ weight.T / T, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    noise = lambda scale: scale * torch.randn(B, S, generator=g, dtype=torch.float64)  # noqa: E731
    valid = labels != IGN
    old = torch.where(valid, cur + noise(0.35), 0.0)  # ratios on both sides of every clip range
    ref = torch.where(valid, cur + noise(0.3), 0.0)
    ref[0, 3] += 4.0  # one token far from the reference: k3 = 48, past low_var_kl's clamp of 10
    sampler = torch.where(valid, old + noise(sampler_spread), 0.0)
    # completion 2's sequence weight past 3, completion 5's below 0.5: sequence modes clamp or mask
    sampler[2] -= 1.0 * valid[2]
    sampler[5] += 0.3 * valid[5]
    adv = torch.tensor([1.2, -0.8, 0.5, -1.5, 0.9, -0.6], dtype=torch.float64)
    truncated = torch.tensor([False, True, False, False, False, False])
    return hidden, weight, labels, adv, old, ref, sampler, truncated


def trl_objective(per_token_logps, entropies, *, mask, advantages, old, ref, sampler, cfg, max_len):
    """TRL's GRPO loss and metrics of one micro-batch (see the module docstring), float64.

    ``cfg`` holds GRPOLoss's keyword arguments (TRL's names: ``epsilon_low`` = ``epsilon``,
    ``vllm_importance_sampling_*`` = ``sampler_correction*``); ``sampler`` None: no correction.
    """
    eps_low = cfg.get("epsilon", 0.2)
    eps_high = cfg.get("epsilon_high", eps_low)
    beta = cfg.get("beta", 0.0)
    loss_type = cfg.get("loss_type", "dapo")
    q = cfg.get("top_entropy_quantile", 1.0)
    metrics = {}
    mask = mask.to(per_token_logps.dtype)
    # the sampler-trainer importance ratio (a constant of the generation batch)
    is_ratio = None
    if sampler is not None:
        mode = cfg.get("sampler_correction_mode", "sequence_mask")
        c_max, c_min = cfg.get("sampler_correction_clip_max", 3.0), cfg.get("sampler_correction_clip_min")
        diff = torch.nan_to_num((old - sampler) * mask, nan=0.0)
        sequence_level_is = mode in ("sequence_mask", "sequence_truncate")
        is_ratio = torch.exp(diff.sum(-1, keepdim=True) if sequence_level_is else diff)
        if mode.endswith("truncate"):
            is_ratio = torch.clamp(is_ratio, min=c_min, max=c_max)
        else:
            lo = c_min if c_min is not None else -math.inf
            hi = c_max if c_max is not None else math.inf
            is_ratio = is_ratio.masked_fill((is_ratio < lo) | (is_ratio > hi), 0.0)
        delta = torch.abs(old - sampler)[mask.bool()]
        metrics["sampling/logp_difference/mean"] = delta.mean()
        metrics["sampling/logp_difference/max"] = delta.max()
        flat = is_ratio.flatten() if sequence_level_is else is_ratio[mask.bool()]
        metrics["sampling/importance_sampling_ratio/min"] = flat.min()
        metrics["sampling/importance_sampling_ratio/mean"] = flat.mean()
        metrics["sampling/importance_sampling_ratio/max"] = flat.max()
    entropy_mask = None
    if q < 1.0:
        local = entropies.detach()[mask.bool()].float()
        threshold = torch.quantile(local, 1 - q)
        entropy_mask = ((entropies.detach() * mask) >= threshold) & mask.bool()
    advantages = advantages.unsqueeze(1)
    log_ratio = per_token_logps - old
    if cfg.get("importance_sampling_level", "token") == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)
    if beta != 0.0:
        kl_estimator = cfg.get("kl_estimator", "k3")
        if kl_estimator == "k3":
            per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        elif kl_estimator == "k1":  # verl's kl_penalty
            per_token_kl = per_token_logps - ref
        elif kl_estimator == "k2":
            per_token_kl = 0.5 * (per_token_logps - ref).square()
        else:
            d = torch.clamp(ref - per_token_logps, min=-20, max=20)
            per_token_kl = torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)
        if cfg.get("use_bias_correction_kl", False):
            per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=eps_high).detach() * advantages * per_token_logps
    elif loss_type == "sapo":
        temps = torch.where(advantages > 0, cfg.get("sapo_temperature_pos", 1.0),
                            cfg.get("sapo_temperature_neg", 1.05)).to(coef_1.dtype)
        per_token_loss = -torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps * advantages
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if cfg.get("delta") is not None:
            coef_1 = torch.clamp(coef_1, max=cfg["delta"])
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if is_ratio is not None:
        per_token_loss = per_token_loss * is_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_len)
    else:  # dapo, cispo: num_items_in_batch, the loss tokens of the generation batch
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if cfg.get("entropy_coef", 0.0):
        effective = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - cfg["entropy_coef"] * (entropies * effective).sum() / effective.sum().clamp(min=1.0)

    def global_masked_mean(x):
        if x.shape[1] == 1:  # sequence-level ratios: one value per completion
            return x.sum() / x.shape[0]
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    if beta != 0.0:
        metrics["kl"] = global_masked_mean(per_token_kl)
    metrics["entropy"] = global_masked_mean(entropies)
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        low = ((coef_1 < 1 - eps_low) & (advantages < 0)).to(mask.dtype)
        high = ((coef_1 > 1 + eps_high) & (advantages > 0)).to(mask.dtype)
        metrics["clip_ratio/low"] = global_masked_mean(low)
        metrics["clip_ratio/high"] = global_masked_mean(high)
        metrics["clip_ratio/region"] = global_masked_mean(torch.maximum(low, high))
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"] = global_masked_mean(((coef_1 > eps_high) & (advantages > 0)).to(mask.dtype))
    return loss, {k: v.detach() for k, v in metrics.items()}


#: (GRPOLoss keyword arguments, whether the sampler's log-probs are passed)
SCENARIOS = {
    "dapo_delta_token_truncate_kl_bias_topent": (dict(
        loss_type="dapo", epsilon_high=0.28, delta=1.5, beta=0.05, use_bias_correction_kl=True,
        top_entropy_quantile=0.5, entropy_coef=0.02, sampler_correction_mode="token_truncate",
        sampler_correction_clip_max=1.3, sampler_correction_clip_min=0.8), True),
    "grpo_sequence_mask": (dict(loss_type="grpo", beta=0.04, entropy_coef=0.03, sampler_correction_clip_min=0.5),
                           True),
    "cispo_token_mask": (dict(loss_type="cispo", epsilon_high=1.2, beta=0.05, sampler_correction_mode="token_mask",
                              sampler_correction_clip_max=1.4), True),
    "sapo_sequence_truncate_topent": (dict(loss_type="sapo", sapo_temperature_neg=1.3, entropy_coef=0.01,
                                           top_entropy_quantile=0.3, sampler_correction_mode="sequence_truncate",
                                           sampler_correction_clip_max=2.0), True),
    "bnpo_no_sampler": (dict(loss_type="bnpo", beta=0.1, use_bias_correction_kl=True), False),
    "dr_grpo_top1_token_truncate": (dict(loss_type="dr_grpo", max_completion_length=7, top_entropy_quantile=0.0,
                                         entropy_coef=0.05, sampler_correction_mode="token_truncate"), True),
    "gspo_sequence_level": (dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.1, beta=0.02,
                                 use_bias_correction_kl=True, entropy_coef=0.03), True),
    "dapo_truncated_masked": (dict(loss_type="dapo", mask_truncated_completions=True, beta=0.03,
                                   top_entropy_quantile=0.6, entropy_coef=0.02), True),
    "kl_k1": (dict(loss_type="dapo", beta=0.2, kl_estimator="k1"), False),
    "kl_k2": (dict(loss_type="dapo", beta=0.2, kl_estimator="k2"), False),
    "kl_low_var_bias": (dict(loss_type="dapo", beta=0.2, kl_estimator="low_var_kl", use_bias_correction_kl=True), False),
}


def run_ours(name, impl, fused, dtype=torch.float64, seed=0):
    """GRPOLoss on the scenario: (loss, grad h, grad W, metrics incl. sampling/*) on float64 inputs
    cast to ``dtype``."""
    kwargs, with_sampler = SCENARIOS[name]
    hidden, weight, labels, adv, old, ref, sampler, truncated = make_inputs(seed)
    dev = "cuda" if torch.cuda.is_available() and impl == "triton" else "cpu"
    h = hidden.to(dtype).to(dev).requires_grad_()
    w = weight.to(dtype).to(dev).requires_grad_()
    fn = GRPOLoss(temperature=T, impl=impl, fused=fused, **kwargs)
    labels, truncated = labels.to(dev), truncated.to(dev)
    mask = fn.loss_mask(labels, truncated)
    entropy_mask = None
    if fn.top_entropy_quantile < 1:  # from the old-policy pass: the current policy, as in one iteration
        with torch.no_grad():
            _, ent = fn.log_probs_and_entropy(HeadInput(h, w), labels)
        entropy_mask = fn.high_entropy_mask(ent, mask)
    cast = lambda t: t.to(dtype).to(dev)  # noqa: E731
    loss, metrics = fn(HeadInput(h, w), labels, cast(adv), old_log_probs=cast(old), ref_log_probs=cast(ref),
                       sampler_log_probs=cast(sampler) if with_sampler else None, entropy_mask=entropy_mask,
                       truncated=truncated)
    loss.backward()
    metrics = {k: v.double().cpu() for k, v in metrics.items()}
    if with_sampler:
        metrics.update({k: torch.tensor(v, dtype=torch.float64) for k, v in
                        sampler_mismatch_metrics(cast(old), cast(sampler), mask, fn).items()})
    return loss.detach().double().cpu(), h.grad.double().cpu(), w.grad.double().cpu(), metrics


def run_trl(name, seed=0):
    kwargs, with_sampler = SCENARIOS[name]
    hidden, weight, labels, adv, old, ref, sampler, truncated = make_inputs(seed)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logsm = torch.log_softmax(h @ w.T / T, -1)
    logps = logsm.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    entropies = -(logsm.exp() * logsm).sum(-1)
    mask = labels != IGN
    if kwargs.get("mask_truncated_completions"):
        mask = mask & ~truncated[:, None]
    loss, metrics = trl_objective(logps, entropies, mask=mask, advantages=adv, old=old, ref=ref,
                                  sampler=sampler if with_sampler else None, cfg=kwargs,
                                  max_len=kwargs.get("max_completion_length"))
    loss.backward()
    return loss.detach(), h.grad, w.grad, metrics


def assert_matches_trl(ours, trl, rtol, atol):
    loss, dh, dw, metrics = ours
    t_loss, t_dh, t_dw, t_metrics = trl
    assert abs(float(t_loss)) > 1e-3  # non-trivial
    torch.testing.assert_close(loss, t_loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(dh, t_dh, rtol=rtol, atol=atol)
    torch.testing.assert_close(dw, t_dw, rtol=rtol, atol=atol)
    assert set(t_metrics) <= set(metrics), sorted(set(t_metrics) - set(metrics))
    for k, v in t_metrics.items():
        torch.testing.assert_close(metrics[k], v, rtol=rtol, atol=atol, msg=k)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("impl,fused", [("reference", False), ("reference", True), ("chunked", False),
                                        ("chunked", True)])
def test_equals_trl_in_float64(name, impl, fused):
    if fused and SCENARIOS[name][0].get("importance_sampling_level") == "sequence":
        pytest.skip("sequence-level ratios are unfused")
    assert_matches_trl(run_ours(name, impl, fused), run_trl(name), rtol=1e-6, atol=1e-9)


@pytest.mark.skipif(head is None, reason="no triton")
@pytest.mark.parametrize("name", ["dapo_delta_token_truncate_kl_bias_topent", "cispo_token_mask",
                                  "sapo_sequence_truncate_topent", "kl_low_var_bias"])
def test_triton_fused_equals_trl(name, monkeypatch):
    # 5 rows per chunk: several row chunks and column splits in every call (fp32, the head's dtype)
    monkeypatch.setattr(head, "WORKSPACE_BYTES", 5 * 37 * 4)
    monkeypatch.setattr(head, "FORWARD_WORKSPACE_BYTES", 8 * 32 * 4)
    monkeypatch.setattr(head, "MAX_BLOCK_ROWS", 8)
    monkeypatch.setattr(head, "MIN_SLAB", 32)
    assert_matches_trl(run_ours(name, "triton", True, dtype=torch.float32), run_trl(name), rtol=1e-4, atol=1e-6)


def test_scenarios_exercise_every_branch():
    """The inputs reach each clamp the scenarios name (a test that could not fail otherwise)."""
    hidden, weight, labels, adv, old, ref, sampler, truncated = make_inputs()
    mask = labels != IGN
    cur = torch.log_softmax(hidden @ weight.T / T, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    r = torch.exp(cur - old)[mask]
    a = adv[:, None].expand_as(mask)[mask]
    assert ((r > 1.5) & (a < 0)).any()                     # delta caps some r A
    assert ((r > 1.2) & (a > 0)).any()                     # cispo's cap
    token_w = torch.exp(old - sampler)[mask]
    assert (token_w > 1.4).any() and (token_w < 0.8).any()  # token truncation / masking on both sides
    seq_w = torch.exp(torch.where(mask, old - sampler, 0.0).sum(1))
    assert (seq_w > 3).any() and (seq_w < 0.5).any() and ((seq_w > 0.5) & (seq_w < 2)).any()
    assert (torch.exp(ref - cur) - (ref - cur) - 1)[mask].max() > 10  # low_var_kl's clamp


def test_without_the_new_options_the_loss_is_todays():
    """Sampler log-probs with sampler_correction=False, no entropy mask, delta None, k3 without bias
    correction: the same loss, gradients and metrics as a call without any of them."""
    hidden, weight, labels, adv, old, ref, sampler, truncated = make_inputs(3)
    outs = []
    for kwargs, extra in ((dict(), {}), (dict(sampler_correction=False), dict(sampler_log_probs=sampler))):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        fn = GRPOLoss(temperature=T, impl="chunked", beta=0.1, entropy_coef=0.02, **kwargs)
        loss, metrics = fn(HeadInput(h, w), labels, adv, old_log_probs=old, ref_log_probs=ref, **extra)
        loss.backward()
        outs.append((loss, h.grad, w.grad, metrics))
    (l0, h0, w0, m0), (l1, h1, w1, m1) = outs
    assert torch.equal(l0, l1) and torch.equal(h0, h1) and torch.equal(w0, w1)
    assert m0.keys() == m1.keys() and all(torch.equal(m0[k], m1[k]) for k in m0)


def test_sampler_ratio_of_one_changes_nothing():
    """Sampler log-probs equal to the old ones: every mode's weight is exactly 1."""
    hidden, weight, labels, adv, old, ref, _, _ = make_inputs(4)
    base = GRPOLoss(temperature=T, impl="reference", sampler_correction=False)(
        HeadInput(hidden, weight), labels, adv, old_log_probs=old)[0]
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        fn = GRPOLoss(temperature=T, impl="reference", sampler_correction_mode=mode)
        loss, _ = fn(HeadInput(hidden, weight), labels, adv, old_log_probs=old, sampler_log_probs=old.clone())
        assert torch.equal(loss, base), mode


def test_entropy_threshold_is_torch_quantile():
    fn = GRPOLoss(top_entropy_quantile=0.2)
    values = torch.rand(1001, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    assert float(fn.entropy_threshold(values)) == float(torch.quantile(values.float(), 0.8))
    values[:7] = values[7]  # ties at the threshold are kept (>=)
    fn0 = GRPOLoss(top_entropy_quantile=0.0)
    assert float(fn0.entropy_threshold(values)) == float(values.float().max())
    assert float(GRPOLoss(top_entropy_quantile=1.0).entropy_threshold(values)) == float(values.float().min())
    assert fn.entropy_threshold(torch.zeros(0)).isinf()


def test_entropy_bonus_is_the_token_mean_of_the_accumulated_batch():
    """Split into micro-batches of different token counts, the bonus is the mean entropy per token
    of the whole batch for every loss_type (TRL averages per-micro-batch means instead: the same
    with one micro-batch or equal counts)."""
    hidden, weight, labels, adv, old, _, _, _ = make_inputs(5)
    logsm = torch.log_softmax(hidden @ weight.T / T, -1)
    ent = -(logsm.exp() * logsm).sum(-1)
    mask = labels != IGN
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "sapo"):
        with_bonus = GRPOLoss(temperature=T, impl="reference", loss_type=loss_type, entropy_coef=0.5,
                              max_completion_length=7)
        without = GRPOLoss(temperature=T, impl="reference", loss_type=loss_type, max_completion_length=7)
        total = with_bonus.num_loss_tokens(labels)
        diff = 0.0
        for rows in (slice(0, 1), slice(1, 6)):
            kw = dict(old_log_probs=old[rows], total_sequences=B, total_tokens=total, num_micro_batches=2)
            args = (HeadInput(hidden[rows], weight), labels[rows], adv[rows])
            diff += float(with_bonus(*args, **kw)[0] - without(*args, **kw)[0])
        assert math.isclose(diff, -0.5 * float(ent[mask].mean()), rel_tol=1e-9), loss_type


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_type="cispo"), "epsilon_high"),
    (dict(loss_type="cispo", epsilon_high=0.28), "epsilon_high is the cap"),
    (dict(delta=1.0), "delta"),
    (dict(delta=2.0, loss_type="sapo"), "delta"),
    (dict(sapo_temperature_neg=0.0), "sapo_temperature_neg"),
    (dict(kl_estimator="k4"), "kl_estimator"),
    (dict(use_bias_correction_kl="yes"), "use_bias_correction_kl"),
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile"),
    (dict(sampler_correction_mode="token"), "sampler_correction_mode"),
    (dict(sampler_correction_clip_min=3.0, sampler_correction_clip_max=2.0), "sampler_correction_clip_min"),
    (dict(sampler_correction_mode="token_truncate", sampler_correction_clip_max=None), "clip_max"),
    (dict(sampler_correction=1), "sampler_correction"),
])
def test_bad_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOLoss(**kwargs)


def test_bad_sampler_call_arguments_are_named():
    hidden, weight, labels, adv, old, _, sampler, _ = make_inputs(6)
    fn = GRPOLoss(temperature=T, impl="reference")
    with pytest.raises(ValueError, match="needs old_log_probs"):
        fn(HeadInput(hidden, weight), labels, adv, sampler_log_probs=sampler)
    with pytest.raises(ValueError, match="sampler_log_probs must have"):
        fn(HeadInput(hidden, weight), labels, adv, old_log_probs=old, sampler_log_probs=sampler[:, :3])
    bad = sampler.clone()
    bad[0, 2] = float("nan")  # a completion token
    with pytest.raises(ValueError, match=r"sampler_log_probs contain NaN or inf at 1 position"):
        fn(HeadInput(hidden, weight), labels, adv, old_log_probs=old, sampler_log_probs=bad)
    with pytest.raises(ValueError, match="entropy_mask must be a bool"):
        fn(HeadInput(hidden, weight), labels, adv, entropy_mask=torch.ones(B, S))
