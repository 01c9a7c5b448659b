import pytest
import torch

from logitless.generation import CompiledSampler, SamplerConfig, build_sampler, generate, uses_rollout_copy
from logitless.training import ConfigError


def yaml(keys):
    """The sampler config of a ``generation:`` block holding ``keys`` (and a completion length)."""
    return SamplerConfig.from_config({"max_new_tokens": 4, **keys})


def test_backend_selection():
    assert build_sampler(yaml({"backend": "auto"}), torch.device("cpu")) == (generate, generate)
    assert build_sampler(yaml({}), torch.device("cpu"))[0] is generate
    train, evaluation = build_sampler(yaml({"backend": "compiled", "compile": False, "sync_every": 4}),
                                      torch.device("cpu"))
    assert isinstance(train, CompiledSampler) and isinstance(evaluation, CompiledSampler)
    assert train is not evaluation  # separate buffers: eval batches have another size
    train_cuda, _ = build_sampler(yaml({"backend": "auto", "compile": False}), torch.device("cuda"))
    assert isinstance(train_cuda, CompiledSampler)


def test_unknown_backend_is_rejected():
    with pytest.raises(ConfigError, match="config key 'generation.backend': expected one of .*got 'vllm'"):
        build_sampler(yaml({"backend": "vllm"}), torch.device("cpu"))


def test_sharded_policies_without_a_rollout_copy_sample_eagerly_and_uncompiled():
    no_copy = {"rollout_copy": False}
    assert build_sampler(yaml({"backend": "auto", **no_copy}), torch.device("cuda"), sharded=True) == \
        (generate, generate)
    fast, _ = build_sampler(yaml({"backend": "compiled", **no_copy}), torch.device("cuda"), sharded=True)
    assert fast.config.compile is False
    with pytest.raises(ValueError, match="generation.compile: true is not supported with FSDP"):
        build_sampler(yaml({"backend": "compiled", "compile": True, **no_copy}), torch.device("cuda"), sharded=True)


def test_sharded_policies_on_cuda_sample_a_rollout_copy_like_one_device():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    # auto: a copy with the fast backend on CUDA, then the sampler is the one-device one (compiled)
    assert uses_rollout_copy(yaml({}), cuda, sharded=True)
    assert uses_rollout_copy(yaml({"backend": "compiled"}), cuda, sharded=True)
    assert not uses_rollout_copy(yaml({"backend": "eager"}), cuda, sharded=True)
    assert not uses_rollout_copy(yaml({}), cpu, sharded=True)
    assert not uses_rollout_copy(yaml({"rollout_copy": True}), cuda, sharded=False)  # one device: nothing to copy
    assert uses_rollout_copy(yaml({"rollout_copy": True, "backend": "eager"}), cpu, sharded=True)
    train, _ = build_sampler(yaml({"backend": "auto"}), cuda, sharded=True)
    assert isinstance(train, CompiledSampler) and train.config.compile is None  # None: on CUDA
    train, _ = build_sampler(yaml({"backend": "compiled", "compile": True}), cuda, sharded=True)
    assert train.config.compile is True
    with pytest.raises(ConfigError, match="config key 'generation.rollout_copy': expected one of"):
        uses_rollout_copy(yaml({"rollout_copy": "yes"}), cuda, sharded=True)
    # FSDP CPU offload: shards on the CPU; auto samples on the gathered shards, true is refused
    assert not uses_rollout_copy(yaml({}), cuda, sharded=True, cpu_offload=True)
    assert build_sampler(yaml({}), cuda, sharded=True, cpu_offload=True) == (generate, generate)
    with pytest.raises(ValueError, match="rollout_copy: true does not work with fsdp_cpu_offload"):
        uses_rollout_copy(yaml({"rollout_copy": True}), cuda, sharded=True, cpu_offload=True)


@pytest.mark.parametrize("sampler", [generate, CompiledSampler(compile=False)], ids=["eager", "fast"])
def test_per_prompt_streams_make_a_groups_completions_independent_of_the_batch(sampler):
    """What lets data-parallel ranks sample their share of the prompts and get the one-device rollout."""
    from logitless.models import qwen2_5_tiny
    from logitless.generation.sampling import prompt_generators

    torch.manual_seed(0)
    model = qwen2_5_tiny(vocab_size=64, num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1,
                         intermediate_dim=64, max_seq_len=64).eval()
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(0.1)  # a spread-out distribution, so draws differ
    prompts = [[5, 6, 7, 8], [9], [10, 11], [12, 13, 14]]
    kw = dict(max_new_tokens=6, stop_tokens=[3], pad_id=0, num_generations=3)
    whole = sampler(model, prompts, generator=prompt_generators(7, 2, range(4)), **kw)
    for share in (range(0, 2), range(2, 4), range(3, 4)):
        part = sampler(model, [prompts[i] for i in share], generator=prompt_generators(7, 2, share), **kw)
        rows = slice(share.start * 3, share.stop * 3)
        width = part.completion_tokens.shape[1]
        assert torch.equal(part.completion_tokens, whole.completion_tokens[rows, :width])
        assert not whole.completion_mask[rows, width:].any()
    assert len({tuple(r) for r in whole.completion_tokens.tolist()}) > 4  # real samples, not one answer
    other_step = sampler(model, prompts, generator=prompt_generators(7, 3, range(4)), **kw)
    assert not torch.equal(other_step.completion_tokens, whole.completion_tokens)
    with pytest.raises(ValueError, match=r"expected one torch.Generator per prompt \(4\), got a sequence of 2"):
        sampler(model, prompts, generator=prompt_generators(7, 2, range(2)), **kw)


def test_the_former_backend_name_fast_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="config key 'generation.backend': expected one of .*got 'fast'"):
        yaml({"backend": "fast"})


def test_compiled_sampler_options_pass_through_from_yaml():
    train, evaluation = build_sampler(yaml({"backend": "compiled", "compaction": False, "attention_window": None,
                                       "draws": "generator", "sync_every": 4, "fused_projections": False}),
                                      torch.device("cpu"))
    for s in (train, evaluation):
        assert (s.config.compaction, s.config.attention_window, s.config.draws, s.config.sync_every,
                s.config.fused_projections) == \
            (False, None, "generator", 4, False)
    with pytest.raises(ConfigError, match="generation.draws': draws must be 'counter' or 'generator', got 'philox'"):
        build_sampler(yaml({"backend": "compiled", "draws": "philox"}), torch.device("cpu"))


def test_programmatic_launch_reaches_the_sampler_from_yaml():
    train, evaluation = build_sampler(yaml({"backend": "compiled", "programmatic_launch": False}),
                                      torch.device("cpu"))
    assert train.config.programmatic_launch is evaluation.config.programmatic_launch is False
    assert build_sampler(yaml({"backend": "compiled"}), torch.device("cpu"))[0].config.programmatic_launch is None
    with pytest.raises(ConfigError, match="generation.programmatic_launch': programmatic_launch must be None, True "
                                          "or False, got 'yes'"):
        build_sampler(yaml({"backend": "compiled", "programmatic_launch": "yes"}), torch.device("cpu"))


def test_decode_attention_reaches_the_sampler_from_yaml():
    train, evaluation = build_sampler(yaml({"backend": "compiled", "decode_attention": "split_k"}),
                                      torch.device("cpu"))
    assert train.config.decode_attention == evaluation.config.decode_attention == "split_k"
    assert build_sampler(yaml({"backend": "compiled"}), torch.device("cpu"))[0].config.decode_attention == "auto"
    with pytest.raises(ConfigError, match="generation.decode_attention': decode_attention must be one of "
                                          "\\('auto', 'sdpa', 'split_k'\\), got 'flash'"):
        build_sampler(yaml({"backend": "compiled", "decode_attention": "flash"}), torch.device("cpu"))
