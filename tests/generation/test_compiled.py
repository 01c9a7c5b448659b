"""The fast sampler against the eager reference sampler and a naive full-recompute loop (CPU, fp32)."""

import copy
import inspect

import pytest
import torch
from torchtune.models.qwen2._component_builders import lora_qwen2, qwen2

import logitless
from logitless.modules import wrap_output_head
from logitless.generation import compiled, decode_cache, decode_step
from logitless.generation.compiled import CompiledSampler, generate as fast_generate
from logitless.generation.eager import generate as eager_generate

VOCAB = 97
NEVER = [-1]  # a stop id no sampler can produce: completions run to max_new_tokens
PROMPTS = [[5, 6, 7, 8, 9], [3], [10, 11, 12]]  # different lengths: left padding matters


def tiny(tied=True, lora=False, seed=0, kv_heads=2):
    torch.manual_seed(seed)
    dims = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=kv_heads, embed_dim=32,
                intermediate_dim=64, max_seq_len=128, tie_word_embeddings=tied)
    if not lora:
        return _soften(qwen2(**dims))
    model = lora_qwen2(["q_proj", "v_proj"], apply_lora_to_mlp=False, apply_lora_to_output=not tied,
                       lora_rank=4, lora_alpha=8.0, **dims)
    with torch.no_grad():  # torchtune zero-inits lora_b; make the adapters matter
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.normal_(0, 0.1)
    return _soften(model)


def _soften(model):
    # nn.Embedding's N(0, 1) init makes a tied head repeat the last token with probability ~1;
    # smaller embeddings give spread-out distributions, so sampling tests see many tokens
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(0.1)
    return model


def naive_greedy(model, prompt, max_new_tokens, stop_tokens):
    """Full recompute of the unpadded sequence at every step, no cache: the independent oracle."""
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tok = int(model(torch.tensor([seq]))[0, -1].argmax())
            seq.append(tok)
            out.append(tok)
            if tok in stop_tokens:
                break
    return out


def completions(rollout):
    return [t[m].tolist() for t, m in zip(rollout.completion_tokens, rollout.completion_mask)]


def record_compactions(sampler):
    """The bucket sizes ``sampler`` compacts into from now on, in order (a list that fills as it runs)."""
    sizes, compact = [], sampler._compact
    sampler._compact = lambda state, bucket, size, pad_id: sizes.append(size) or compact(state, bucket, size, pad_id)
    return sizes


def uncompiled(**kw):
    return CompiledSampler(compile=False, **kw)


@pytest.mark.parametrize("tied,lora", [(True, False), (False, False), (False, True)])
def test_greedy_equals_reference_sampler_and_naive_loop(tied, lora):
    model = tiny(tied=tied, lora=lora).eval()
    kw = dict(max_new_tokens=9, stop_tokens=NEVER, pad_id=0, num_generations=2, temperature=1.0, top_k=1)
    assert all(decode_step.groupable(layer) for layer in model.layers)  # grouped path runs
    fast = uncompiled(cache_len_multiple=7)(model, PROMPTS, **kw)
    ref = eager_generate(model, PROMPTS, **kw)
    ungrouped = uncompiled(grouped_attention=False)(model, PROMPTS, **kw)
    assert torch.equal(ungrouped.completion_tokens, ref.completion_tokens)
    torch.testing.assert_close(ungrouped.sampler_log_probs, ref.sampler_log_probs, atol=1e-5, rtol=0)
    assert torch.equal(fast.completion_tokens, ref.completion_tokens)
    assert torch.equal(fast.completion_mask, ref.completion_mask)
    assert torch.equal(fast.prompt_tokens, ref.prompt_tokens)
    assert torch.equal(fast.prompt_mask, ref.prompt_mask)
    assert torch.equal(fast.truncated, ref.truncated) and bool(fast.truncated.all())
    torch.testing.assert_close(fast.sampler_log_probs, ref.sampler_log_probs, atol=1e-5, rtol=0)
    expected = [naive_greedy(model, p, 9, NEVER) for p in PROMPTS for _ in range(2)]
    assert completions(fast) == expected


@pytest.mark.parametrize("kv_heads", [1, 2, 4])  # query heads per K/V head: 4, 2, 1
def test_temperature_zero_is_greedy_for_any_head_grouping(kv_heads):
    model = tiny(kv_heads=kv_heads).eval()
    out = uncompiled()(model, PROMPTS, max_new_tokens=6, stop_tokens=NEVER, pad_id=0, temperature=0)
    assert completions(out) == [naive_greedy(model, p, 6, NEVER) for p in PROMPTS]
    ref = eager_generate(model, PROMPTS, max_new_tokens=6, stop_tokens=NEVER, pad_id=0, temperature=0)
    torch.testing.assert_close(out.sampler_log_probs, ref.sampler_log_probs, atol=1e-5, rtol=0)


def test_attention_output_in_sequence_major_layout(monkeypatch):
    # CUDA's fp32 SDPA kernels return (B, H, L, D) results laid out as (B, L, H, D); the grouped
    # decode attention must not assume a contiguous result (it used .view, which fails there).
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def sequence_major(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(decode_step.F, "scaled_dot_product_attention", sequence_major)
    model = tiny(kv_heads=2).eval()
    out = uncompiled()(model, PROMPTS, max_new_tokens=4, stop_tokens=NEVER, pad_id=0, temperature=0)
    assert completions(out) == [naive_greedy(model, p, 4, NEVER) for p in PROMPTS]


def test_wrapped_model_in_hidden_mode_and_one_new_token():
    model = tiny().eval()
    expected = [naive_greedy(model, p, 5, NEVER) for p in PROMPTS]
    wrap_output_head(model).set_output_mode("hidden")  # as a logitless recipe leaves the policy
    out = uncompiled()(model, PROMPTS, max_new_tokens=5, stop_tokens=NEVER, pad_id=0, temperature=0)
    assert completions(out) == expected
    one = uncompiled()(model, PROMPTS, max_new_tokens=1, stop_tokens=NEVER, pad_id=0, temperature=0)
    assert completions(one) == [e[:1] for e in expected] and bool(one.truncated.all())
    assert model.output_mode_name == "hidden"


def test_layers_with_hooks_are_called_as_modules():
    # a user's hooks act through the layer's __call__: never bypass it then
    model = tiny().eval()
    expected = [naive_greedy(model, p, 4, NEVER) for p in PROMPTS]
    calls = []
    model.layers[1].register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[1]))
    assert not decode_step.groupable(model.layers[1]) and decode_step.groupable(model.layers[0])
    out = uncompiled()(model, PROMPTS, max_new_tokens=4, stop_tokens=NEVER, pad_id=0, temperature=0)
    assert completions(out) == expected
    assert calls == [5, 1, 1, 1]  # the prefill (width 5), then one call per decode step


def test_activation_checkpointing_is_skipped_when_decoding():
    """No-grad decoding keeps no activations: the checkpoint wrapper is stepped past (same tokens)."""
    from logitless.generation.trunk import decoding_layer
    from logitless.training.model import apply_activation_checkpointing

    model = tiny().eval()
    expected = [naive_greedy(model, p, 4, NEVER) for p in PROMPTS]
    apply_activation_checkpointing(model)
    assert all(decoding_layer(layer) is not layer and decode_step.groupable(decoding_layer(layer))
               for layer in model.layers)
    for sampler in (uncompiled(), eager_generate):
        out = sampler(model, PROMPTS, max_new_tokens=4, stop_tokens=NEVER, pad_id=0, temperature=0)
        assert completions(out) == expected


def training_log_probs(model, rollout, temperature):
    """log p(completion token) on the training path: hidden states of the unpadded sequence, then
    logitless.linear_log_probs at the sampling temperature."""
    wrapped = wrap_output_head(copy.deepcopy(model)).eval()
    wrapped.set_output_mode("hidden")
    result = torch.zeros_like(rollout.sampler_log_probs)
    with torch.no_grad():
        for i in range(rollout.prompt_tokens.shape[0]):
            prompt = rollout.prompt_tokens[i][rollout.prompt_mask[i]]
            comp = rollout.completion_tokens[i][rollout.completion_mask[i]]
            seq = torch.cat([prompt, comp])[None]
            hidden, weight = wrapped(seq)
            labels = torch.full_like(seq, -100)
            labels[0, len(prompt) - 1:-1] = comp  # position t predicts token t + 1
            logp, _ = logitless.linear_log_probs(hidden, weight, labels, temperature=temperature,
                                                 return_entropy=False, impl="reference")
            result[i, :len(comp)] = logp[0, len(prompt) - 1:-1]
    return result


@pytest.mark.parametrize("draws", ["generator", "counter"])
def test_sampled_log_probs_equal_training_path_and_reference_draws(draws):
    model = tiny(seed=1).eval()
    kw = dict(max_new_tokens=10, stop_tokens=[7, 11, 19], pad_id=0, num_generations=3,
              temperature=0.7, top_k=40, top_p=0.95)
    fast = uncompiled(draws=draws)(model, PROMPTS, generator=torch.Generator().manual_seed(3), **kw)
    torch.testing.assert_close(fast.sampler_log_probs, training_log_probs(model, fast, 0.7),
                               atol=2e-5, rtol=0)
    if draws == "generator":
        # same draws as the reference sampler: prefill of one prompt per group changes nothing
        ref = eager_generate(model, PROMPTS, generator=torch.Generator().manual_seed(3), **kw)
        assert torch.equal(fast.completion_tokens, ref.completion_tokens)
        assert torch.equal(fast.completion_mask, ref.completion_mask)
    # G samples of one prompt differ (the rows really are independent after replication)
    assert len({tuple(c) for c in completions(fast)[:3]}) > 1


def test_stop_tokens_mask_the_rest_and_set_truncated():
    model = tiny().eval()
    free = uncompiled()(model, PROMPTS, max_new_tokens=8, stop_tokens=NEVER, pad_id=0, temperature=0)
    stop = int(free.completion_tokens[0, 2])  # row 0 must stop at step 2 (or earlier)
    out = uncompiled(sync_every=1)(model, PROMPTS, max_new_tokens=8, stop_tokens=[stop], pad_id=0,
                                   temperature=0)
    for i, row in enumerate(free.completion_tokens.tolist()):
        n = row.index(stop) + 1 if stop in row else len(row)
        assert out.completion_tokens[i, :n].tolist() == row[:n]
        assert out.completion_mask[i].tolist() == [True] * n + [False] * (out.completion_mask.shape[1] - n)
        assert (out.completion_tokens[i, n:] == 0).all()
        assert (out.sampler_log_probs[i, n:] == 0).all()
        assert bool(out.truncated[i]) == (stop not in row)
    assert out.completion_tokens.shape[1] == int(out.completion_lengths.max())


def test_early_exit_check_period_does_not_change_the_result():
    model = tiny().eval()
    kw = dict(max_new_tokens=12, stop_tokens=list(range(0, VOCAB, 3)), pad_id=0, num_generations=2)
    a = uncompiled(sync_every=1)(model, PROMPTS, generator=torch.Generator().manual_seed(0), **kw)
    b = uncompiled(sync_every=64)(model, PROMPTS, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(a.completion_tokens, b.completion_tokens)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.truncated, b.truncated)


def test_training_forward_is_causal_after_generation_even_on_error(monkeypatch):
    model = tiny().train()
    fresh = copy.deepcopy(model)
    tokens = torch.randint(1, VOCAB, (2, 12))
    uncompiled()(model, PROMPTS, max_new_tokens=4, stop_tokens=NEVER, pad_id=0, num_generations=2)
    assert model.training and not model.caches_are_setup()
    torch.testing.assert_close(model(tokens), fresh(tokens), atol=0, rtol=0)

    def boom(*args, **kwargs):
        raise RuntimeError("sampling failed")

    monkeypatch.setattr(compiled, "sample_next", boom)
    monkeypatch.setattr(decode_step, "sample_counter", boom)  # the draw inside the step
    with pytest.raises(RuntimeError, match="sampling failed"):
        CompiledSampler(compile=False, keep_cache=True)(model, PROMPTS, max_new_tokens=4, stop_tokens=NEVER,
                                                      pad_id=0)
    assert model.training and not model.caches_are_setup()
    assert not any(getattr(m, "cache_enabled", False) for m in model.modules())
    torch.testing.assert_close(model(tokens), fresh(tokens), atol=0, rtol=0)


def test_compiled_step_matches_uncompiled_and_is_reused(monkeypatch, caplog):
    from torch._dynamo.utils import counters

    from logitless import first_start

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(first_start, "_NOTED", set())  # as in a fresh process
    model = tiny().eval()
    kw = dict(max_new_tokens=6, stop_tokens=NEVER, pad_id=0, num_generations=2, temperature=0)
    # aot_eager functionalises the in-place cache updates as inductor does, without a C++ build
    sampler = CompiledSampler(compile=True, backend="aot_eager", cache_len_multiple=16)
    with caplog.at_level("INFO", logger="logitless"):
        first = sampler(model, PROMPTS, **kw)
    # the compilation was announced before it ran, once
    noted = [r for r in caplog.records if r.name == "logitless"]
    assert [r.getMessage().split(": once per process")[0] for r in noted] == ["Compiling the sampler's decode step"]
    assert counters["stats"]["unique_graphs"] == 1  # fullgraph: the whole step is one graph
    assert torch.equal(first.completion_tokens, uncompiled()(model, PROMPTS, **kw).completion_tokens)
    caches = sampler._state.caches
    other = [[4, 4, 2], [9, 8, 7, 6], [1]]  # another width, same cache bucket: same graph and buffers
    second = sampler(model, other, **kw)
    assert sampler._state.caches is caches
    assert counters["stats"]["unique_graphs"] == 1  # no recompilation
    assert len([r for r in caplog.records if r.name == "logitless"]) == 1  # and no second announcement
    assert completions(second) == [naive_greedy(model, p, 6, NEVER) for p in other for _ in range(2)]
    assert not model.caches_are_setup()
    sampler.release()
    assert sampler._state is None


def test_module_generate_reuses_one_sampler_per_model():
    model = tiny().eval()
    kw = dict(max_new_tokens=3, stop_tokens=NEVER, pad_id=0, temperature=0, compile=False)
    fast_generate(model, PROMPTS, **kw)
    sampler = compiled._SAMPLERS[model]
    out = fast_generate(model, PROMPTS, **kw)
    assert compiled._SAMPLERS[model] is sampler
    assert completions(out) == [naive_greedy(model, p, 3, NEVER) for p in PROMPTS]


@pytest.mark.parametrize("kwargs,name", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(num_generations=0), "num_generations"),
    (dict(stop_tokens=[]), "stop_tokens"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(temperature=-1.0), "temperature"),
])
def test_bad_call_arguments_name_the_argument(kwargs, name):
    args = dict(max_new_tokens=2, stop_tokens=[0], pad_id=0, num_generations=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        uncompiled()(tiny(), PROMPTS, **args)


@pytest.mark.parametrize("kwargs,name", [
    (dict(sync_every=0), "sync_every"),
    (dict(cache_len_multiple=0), "cache_len_multiple"),
    (dict(max_cache_len=1), "max_cache_len"),
    (dict(compile="yes"), "compile"),
    (dict(grouped_attention=None), "grouped_attention"),
    (dict(decode_attention="flash"), "decode_attention must be one of \\('auto', 'sdpa', 'split_k'\\), got 'flash'"),
    (dict(decode_attention="split_k", grouped_attention=False), "split_k' needs grouped_attention=True"),
    (dict(programmatic_launch="auto"), "programmatic_launch must be None, True or False, got 'auto'"),
])
def test_bad_options_name_the_option(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CompiledSampler(**kwargs)


def test_auto_decode_attention_is_split_k_on_cuda_only():
    """The default picks the split-K kernel on CUDA (where it was measured faster than SDPA) and SDPA
    elsewhere or where the grouped decode step (the kernel's only caller) is off."""
    auto = CompiledSampler()
    assert auto.config.decode_attention == "auto"
    assert auto.uses_split_k(torch.device("cuda")) and not auto.uses_split_k(torch.device("cpu"))
    assert not CompiledSampler(grouped_attention=False).uses_split_k(torch.device("cuda"))
    assert not CompiledSampler(decode_attention="sdpa").uses_split_k(torch.device("cuda"))
    assert CompiledSampler(decode_attention="split_k").uses_split_k(torch.device("cpu"))
    assert torch.ops.logitless.decode_attention.default is not None  # registered by the CUDA choice


def test_programmatic_launch_adds_pdl_to_the_cuda_graph_mode_where_supported(monkeypatch):
    """On a Hopper GPU the default compiles the step with CUDA graphs (what mode="reduce-overhead"
    sets) plus inductor's programmatic dependent launches; torch.compile takes a mode or options, so
    the mode is given as its options then. Elsewhere, or when turned off, the mode stays as it was."""
    from torch._inductor import list_mode_options

    from logitless.generation.kernels.decode_attention import plan as da

    cuda = torch.device("cuda")
    monkeypatch.setattr(da, "supports_programmatic_launch", lambda device: device.type == "cuda")
    assert list_mode_options("reduce-overhead") == {"triton.cudagraphs": True}
    assert CompiledSampler()._compile_options(cuda) == (None, {"triton.cudagraphs": True, "triton.enable_pdl": True})
    assert CompiledSampler(mode="max-autotune")._compile_options(cuda) == (
        None, {**list_mode_options("max-autotune"), "triton.enable_pdl": True})
    assert CompiledSampler(programmatic_launch=False)._compile_options(cuda) == ("reduce-overhead", None)
    assert CompiledSampler(backend="aot_eager")._compile_options(cuda) == (None, None)
    assert not CompiledSampler().uses_programmatic_launch(torch.device("cpu"))
    assert CompiledSampler(compile=False).uses_programmatic_launch(cuda)  # the split-K kernels alone
    monkeypatch.setattr(da, "supports_programmatic_launch", lambda device: False)  # e.g. an A100
    assert CompiledSampler()._compile_options(cuda) == ("reduce-overhead", None)


def test_programmatic_launch_true_where_unsupported_stops_before_any_compute():
    sampler = CompiledSampler(compile=False, programmatic_launch=True)
    with pytest.raises(ValueError, match="programmatic_launch=True needs a CUDA GPU of compute capability 9.0"):
        sampler(tiny(), PROMPTS, max_new_tokens=3, stop_tokens=[0], pad_id=0)
    assert sampler._state is None  # nothing allocated


def test_refuses_model_with_caches_and_too_small_cache():
    model = tiny()
    with pytest.raises(ValueError, match="max_cache_len"):
        CompiledSampler(compile=False, max_cache_len=6)(model, PROMPTS, max_new_tokens=4, stop_tokens=[0],
                                                      pad_id=0)
    model.setup_caches(1, torch.float32, decoder_max_seq_len=8)
    with pytest.raises(ValueError, match="already set up"):
        uncompiled()(model, PROMPTS, max_new_tokens=2, stop_tokens=[0], pad_id=0)


def test_compiled_step_with_compaction_is_one_graph_for_every_bucket():
    from torch._dynamo.utils import counters

    from logitless.generation import prompt_generators

    torch._dynamo.reset()
    counters.clear()
    model = tiny(seed=2).eval()
    prompts = PROMPTS + [[3, 4], [8, 8, 8]]
    kw = dict(max_new_tokens=16, stop_tokens=list(range(1, VOCAB, 4)), pad_id=0, num_generations=4,
              temperature=1.0)
    sampler = CompiledSampler(compile=True, backend="aot_eager", cache_len_multiple=16, min_bucket=2, sync_every=1)
    sizes = record_compactions(sampler)
    out = sampler(model, prompts, generator=prompt_generators(0, 0, range(5)), **kw)
    assert len(sizes) >= 2  # 20 rows -> 10 -> 5 -> ... as rows finish
    assert counters["stats"]["unique_graphs"] == 1  # the batch dimension is dynamic: no recompilation
    ref = uncompiled(compaction=False)(model, prompts, generator=prompt_generators(0, 0, range(5)), **kw)
    assert torch.equal(out.completion_tokens, ref.completion_tokens)
    torch.testing.assert_close(out.sampler_log_probs, ref.sampler_log_probs, atol=1e-5, rtol=0)


def test_attention_window_reads_the_filled_columns_only_and_changes_nothing(monkeypatch):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny(seed=3).eval()
    kw = dict(max_new_tokens=14, stop_tokens=NEVER, pad_id=0, num_generations=2, temperature=0)
    lengths = []
    sdpa = decode_step.F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        lengths.append(k.shape[2])
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(decode_step.F, "scaled_dot_product_attention", spy)
    whole = uncompiled(attention_window=None, cache_len_multiple=32)(model, PROMPTS, **kw)
    assert set(lengths[4:]) == {32}  # (after the prefill's) every step reads the whole cache
    lengths.clear()
    windowed = uncompiled(attention_window=4, cache_len_multiple=32)(model, PROMPTS, **kw)
    decode = lengths[2:]  # the prefill runs torchtune's attention on its own cache
    assert sorted(set(decode)) == [8, 12, 16, 20]  # width 5 + up to 13 new columns, in steps of 4
    assert decode == sorted(decode)
    assert torch.equal(windowed.completion_tokens, whole.completion_tokens)
    torch.testing.assert_close(windowed.sampler_log_probs, whole.sampler_log_probs, atol=1e-6, rtol=0)
    monkeypatch.undo()
    sampler = CompiledSampler(compile=True, backend="aot_eager", attention_window=4, cache_len_multiple=32)
    compiled_out = sampler(model, PROMPTS, **kw)
    assert torch.equal(compiled_out.completion_tokens, whole.completion_tokens)
    assert counters["stats"]["unique_graphs"] <= 2  # the window is a dynamic size after its first change


def test_compiled_step_samples_a_single_row():
    torch._dynamo.reset()
    model = tiny().eval()
    kw = dict(max_new_tokens=5, stop_tokens=NEVER, pad_id=0, temperature=0)
    sampler = CompiledSampler(compile=True, backend="aot_eager", cache_len_multiple=16)
    out = sampler(model, PROMPTS[:1], **kw)
    assert completions(out) == [naive_greedy(model, PROMPTS[0], 5, NEVER)]


def _kernel_launches(monkeypatch):
    """Records the split-K kernels' launches as (rows, shared prefix or None) (they run on CPU tensors
    under the Triton interpreter), and those with a new token to rotate and write in ``launches.new_token``."""
    from logitless.generation.kernels.decode_attention import op as module

    class Launches(list):
        new_token = 0

    launches = Launches()
    launch = module._launch
    signature = inspect.signature(launch)

    def record(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        launches.append((args[0].shape[0], bound.get("prefix")))
        launches.new_token += bound.get("new_token") is not None
        return launch(*args, **kwargs)

    monkeypatch.setattr(module, "_launch", record)
    return launches, module.triton_interpreting()


def test_split_k_greedy_equals_sdpa_with_compaction_and_left_padding(monkeypatch):
    model = tiny(seed=2, tied=False).eval()  # its greedy completions do not repeat one token
    prompts = PROMPTS + [[3, 4], [8, 8, 8, 8, 8, 8, 8]]
    launches, interpreted = _kernel_launches(monkeypatch)
    kw = dict(max_new_tokens=8, pad_id=0, num_generations=2, temperature=0)
    free = uncompiled(compaction=False)(model, prompts, stop_tokens=NEVER, **kw).completion_tokens
    stops = sorted({int(free[2 * p, 1 + p]) for p in range(len(prompts))})  # rows end at different steps
    runs = {}
    for attention in ("sdpa", "split_k"):
        sampler = uncompiled(decode_attention=attention, min_bucket=2, sync_every=1, cache_len_multiple=16)
        moves = record_compactions(sampler)
        runs[attention] = sampler(model, prompts, stop_tokens=stops, **kw)
        assert moves  # compaction ran: 10 rows -> 5 -> ...
    sdpa, split_k = runs["sdpa"], runs["split_k"]
    assert sdpa.completion_lengths.min() < sdpa.completion_lengths.max()
    assert torch.equal(split_k.completion_tokens, sdpa.completion_tokens)
    assert torch.equal(split_k.completion_mask, sdpa.completion_mask)
    torch.testing.assert_close(split_k.sampler_log_probs, sdpa.sampler_log_probs, atol=1e-5, rtol=0)
    assert completions(split_k) == [naive_greedy(model, p, 8, stops) for p in prompts for _ in range(2)]
    if interpreted:  # the kernel itself ran (else the plain PyTorch fallback did), in smaller buckets too
        rows = [n for n, _ in launches]
        assert max(rows) == 10 and min(rows) < 10


def test_shared_prompt_decode_rule():

    cpu = torch.device("cpu")
    model = tiny()  # 2 K/V heads of 8: a prompt needs 2^13 columns to reach the rule's elements
    auto = CompiledSampler(decode_attention="split_k")
    min_elements, wide = compiled.SHARED_PROMPT_MIN_ELEMENTS, compiled.SHARED_PROMPT_MIN_WIDTH
    assert not auto.uses_shared_prompt(model, cpu, 8, wide)  # a small head: the per-row kernel measured faster
    assert auto.uses_shared_prompt(model, cpu, 8, min_elements // 16)
    assert not auto.uses_shared_prompt(model, cpu, 8, min_elements // 16 - 1)
    big_heads = tiny(kv_heads=2)
    for attn in decode_cache.attention_modules(big_heads):
        attn.head_dim = 128  # Qwen2.5-1.5B's K/V heads: 512 columns
    assert auto.uses_shared_prompt(big_heads, cpu, 8, 512)
    assert not auto.uses_shared_prompt(big_heads, cpu, 8, 511)  # a short prompt
    for attn in decode_cache.attention_modules(big_heads):
        attn.num_kv_heads, attn.head_dim = 8, 128  # Llama-3-8B's: the elements at 128 columns, not the width
    assert auto.uses_shared_prompt(big_heads, cpu, 8, wide)
    assert not auto.uses_shared_prompt(big_heads, cpu, 8, wide - 1)
    assert not auto.uses_shared_prompt(big_heads, cpu, 1, wide)  # nothing shared with one completion per prompt
    forced = CompiledSampler(decode_attention="split_k", shared_prompt_decode=True)
    assert forced.uses_shared_prompt(model, cpu, 2, 1) and not forced.uses_shared_prompt(model, cpu, 1, 1)
    assert not CompiledSampler(decode_attention="split_k", shared_prompt_decode=False).uses_shared_prompt(
        big_heads, cpu, 8, wide)
    assert not CompiledSampler().uses_shared_prompt(big_heads, cpu, 8, wide)  # auto attention off CUDA: SDPA
    with pytest.raises(ValueError, match="shared_prompt_decode=True needs the split-K decode attention"):
        CompiledSampler(shared_prompt_decode=True).uses_shared_prompt(model, cpu, 8, wide)
    with pytest.raises(ValueError, match="shared_prompt_decode=True needs the split-K decode attention"):
        CompiledSampler(decode_attention="sdpa", shared_prompt_decode=True)
    with pytest.raises(ValueError, match="shared_prompt_decode must be None, True or False, got 'yes'"):
        CompiledSampler(shared_prompt_decode="yes")


@pytest.mark.parametrize("max_queries", [128, 4])  # a group in one segment; cut into segments of 2 rows
def test_shared_prompt_decode_samples_as_split_k_through_compaction_and_left_padding(monkeypatch, max_queries):
    from logitless.generation import prompt_generators

    from logitless.generation.kernels.decode_attention import plan

    monkeypatch.setattr(plan, "MAX_PREFIX_QUERIES", max_queries)
    launches, interpreted = _kernel_launches(monkeypatch)
    model = tiny(seed=2, tied=False).eval()
    prompts = PROMPTS + [[3, 4], [8, 8, 8, 8, 8, 8, 8]]
    kw = dict(max_new_tokens=8, stop_tokens=list(range(1, VOCAB, 3)), pad_id=0, num_generations=4, temperature=1.0)
    runs, segments = {}, {}
    for share in (False, True):
        sampler = uncompiled(decode_attention="split_k", shared_prompt_decode=share, min_bucket=2, sync_every=1,
                             keep_cache=True, cache_len_multiple=16)
        moves = record_compactions(sampler)
        launches.clear()
        runs[share] = sampler(model, prompts, generator=prompt_generators(0, 0, range(len(prompts))), **kw)
        assert moves  # 20 rows -> 10 -> ...
        segments[share] = sampler._state.segments
        if interpreted:  # the shared-prefix kernels ran (launches with a prefix), in smaller buckets too
            shared = [prefix is not None for _, prefix in launches]
            assert launches and shared == [share] * len(launches)
            assert min(n for n, _ in launches) < 20
    assert segments[False] is None and segments[True] == (4, 4 if max_queries == 128 else 2,
                                                          5 if max_queries == 128 else 10)
    lengths = runs[True].completion_lengths.view(len(prompts), 4)
    assert (lengths.min(1).values < lengths.max(1).values).any()  # a group's rows finish at different steps
    assert torch.equal(runs[True].completion_tokens, runs[False].completion_tokens)
    assert torch.equal(runs[True].completion_mask, runs[False].completion_mask)
    torch.testing.assert_close(runs[True].sampler_log_probs, runs[False].sampler_log_probs, atol=1e-5, rtol=0)


def _tiny_llama3(version):
    """A two-layer torchtune Llama 3 (``RotaryPositionalEmbeddings``) or 3.1 (``Llama3ScaledRoPE``)."""
    from torchtune.models.llama3._component_builders import llama3
    from torchtune.models.llama3_1._component_builders import llama3_1

    torch.manual_seed(4)
    build = llama3 if version == "3" else llama3_1
    return _soften(build(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=128,
                         intermediate_dim=64))


@pytest.mark.parametrize("shared_prompt", [False, True], ids=["inside_attention", "before_shared_prefix"])
@pytest.mark.parametrize("family", ["qwen2", "llama3", "llama3_1"])
def test_split_k_step_rotates_and_writes_the_cache_as_the_module(monkeypatch, family, shared_prompt):
    """The rotary embedding and cache write of the kernels (inside the attention's launch per row, in a
    launch before it with a shared prompt) give the module's tokens and log-probs."""
    model = (tiny(seed=2, tied=False) if family == "qwen2" else _tiny_llama3(family[len("llama"):])).eval()
    prompts = PROMPTS + [[3, 4], [8, 8, 8, 8, 8, 8, 8]]
    kw = dict(max_new_tokens=8, stop_tokens=[7, 11], pad_id=0, num_generations=2, temperature=1.0)
    fused, runs = [], {}
    rotary = decode_step._fused_rotary
    launches, interpreted = _kernel_launches(monkeypatch)
    for name in ("module", "fused"):
        choose = (lambda *a: None) if name == "module" else (lambda *a: fused.append(rotary(*a)) or fused[-1])
        monkeypatch.setattr(decode_step, "_fused_rotary", choose)
        sampler = uncompiled(decode_attention="split_k", min_bucket=2, sync_every=1, cache_len_multiple=16,
                             shared_prompt_decode=shared_prompt)
        runs[name] = sampler(model, prompts, generator=torch.Generator().manual_seed(3), **kw)
        if name == "module":
            assert launches.new_token == 0
    assert fused and all(spec is not None for spec in fused)  # every layer of every step took the kernel
    assert fused[0].interleaved == (family != "qwen2")
    if interpreted:  # the kernels ran: with a new token to rotate and write exactly without a shared prompt
        assert (launches.new_token > 0) != shared_prompt
        assert all((prefix is not None) == shared_prompt for _, prefix in launches)
    assert torch.equal(runs["fused"].completion_tokens, runs["module"].completion_tokens)
    assert torch.equal(runs["fused"].completion_mask, runs["module"].completion_mask)
    torch.testing.assert_close(runs["fused"].sampler_log_probs, runs["module"].sampler_log_probs, atol=1e-5, rtol=0)


def _one_graph_for_every_bucket_samples_as_eager(**options):
    """A compiled sampler with ``options`` (split-K, compaction down to buckets of 2) samples in one
    graph, recompiled neither by the buckets nor by the filled length, the tokens, mask and log-probs
    of the uncompiled sampler without compaction."""
    from torch._dynamo.utils import counters

    from logitless.generation import prompt_generators

    torch._dynamo.reset()
    counters.clear()
    model = tiny(seed=2).eval()
    kw = dict(max_new_tokens=8, stop_tokens=list(range(1, VOCAB, 3)), pad_id=0, num_generations=4,
              temperature=1.0)
    sampler = CompiledSampler(compile=True, backend="aot_eager", cache_len_multiple=16, min_bucket=2, sync_every=1,
                              decode_attention="split_k", **options)
    sizes = record_compactions(sampler)
    out = sampler(model, PROMPTS, generator=prompt_generators(0, 0, range(3)), **kw)
    assert sizes  # 12 rows -> 6 -> ...
    assert counters["stats"]["unique_graphs"] == 1
    ref = uncompiled(compaction=False)(model, PROMPTS, generator=prompt_generators(0, 0, range(3)), **kw)
    assert torch.equal(out.completion_tokens, ref.completion_tokens)
    assert torch.equal(out.completion_mask, ref.completion_mask)
    torch.testing.assert_close(out.sampler_log_probs, ref.sampler_log_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shared_prompt", [False, True])
def test_split_k_compiled_step_is_one_graph_for_every_bucket_and_samples_as_sdpa(shared_prompt):
    # split-K reads up to the filled length without a window: the window of 4 recompiles nothing
    _one_graph_for_every_bucket_samples_as_eager(attention_window=4, shared_prompt_decode=shared_prompt)
