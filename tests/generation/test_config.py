"""The typed sampler config: what a ``generation:`` block becomes, and the errors that name its keys."""

import dataclasses
import pathlib

import pytest
from omegaconf import OmegaConf

from logitless.generation import CompiledSampler, CompiledSamplerConfig, SamplerConfig
from logitless.generation.config import GENERATION_KEYS, OptionError, check_stop_tokens
from logitless.generation.prefill import DEFAULT_PREFILL_CHUNK_TOKENS
from logitless.training import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["tiny_grpo.yaml", "tiny_grpo_chat.yaml", "qwen_grpo.yaml", "qwen_math_grpo.yaml"])
def test_every_shipped_generation_block_reads_into_the_config_it_spells(name):
    block = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / name).generation, resolve=True)
    cfg = SamplerConfig.from_config(block)
    for key, value in block.items():
        got = getattr(cfg, key) if hasattr(cfg, key) else getattr(cfg.compiled, key)
        assert got == (tuple(value) if isinstance(value, list) else value), key


def test_unset_keys_take_the_samplers_defaults():
    cfg = SamplerConfig.from_config({"max_new_tokens": 16})
    assert (cfg.temperature, cfg.top_k, cfg.top_p, cfg.stop_tokens, cfg.backend, cfg.rollout_copy) == \
        (1.0, None, None, None, "auto", "auto")
    assert cfg.prefill_chunk_tokens == DEFAULT_PREFILL_CHUNK_TOKENS
    assert cfg.compiled == CompiledSamplerConfig()
    # a CompiledSampler built from the config is the one built with no options
    assert CompiledSampler(cfg.compiled).config == CompiledSampler().config


def test_null_means_the_default_except_where_null_is_a_setting():
    cfg = SamplerConfig.from_config(OmegaConf.create({"max_new_tokens": 8, "sync_every": None, "compaction": None,
                                                      "attention_window": None, "prefill_chunk_tokens": None}))
    assert cfg.compiled.sync_every == 16 and cfg.compiled.compaction is True  # null: the default
    assert cfg.compiled.attention_window is None  # null: the whole cache
    assert cfg.prefill_chunk_tokens is None  # null: one prefill forward


@pytest.mark.parametrize("block, match", [
    ({"max_new_tokens": 8, "temprature": 0.5}, r"config key 'generation.temprature': unknown; allowed \["),
    ({"temperature": 0.5}, r"config key 'generation.max_new_tokens': required"),
    ({"max_new_tokens": 8, "backend": "vllm"}, r"config key 'generation.backend': expected one of"),
    ({"max_new_tokens": 8, "rollout_copy": 1}, r"config key 'generation.rollout_copy': expected one of"),
    ({"max_new_tokens": 8, "sync_every": 0}, r"config key 'generation.sync_every': sync_every must be an int >= 1, "
                                             r"got 0"),
    ({"max_new_tokens": 8, "max_cache_len": 1}, r"config key 'generation.max_cache_len': .*>= 2, got 1"),
    ({"max_new_tokens": 8, "fused_projections": "yes"}, r"config key 'generation.fused_projections': "),
    ({"max_new_tokens": 8, "decode_attention": "sdpa", "shared_prompt_decode": True},
     r"config key 'generation.shared_prompt_decode': shared_prompt_decode=True needs the split-K"),
    ({"max_new_tokens": 8, "prefill_chunk_tokens": 0}, r"generation.prefill_chunk_tokens must be an int >= 1"),
    ({"max_new_tokens": 8, "temperature": 0}, r"config key 'generation.temperature': .*got 0 \(0 = greedy"),
])
def test_bad_values_name_the_key_before_anything_is_built(block, match):
    with pytest.raises(ConfigError, match=match):
        SamplerConfig.from_config(block)


def test_compiled_options_raise_option_errors_naming_the_option():
    with pytest.raises(OptionError, match="min_bucket must be an int >= 2, got 1") as err:
        CompiledSamplerConfig(min_bucket=1)
    assert err.value.option == "min_bucket"
    with pytest.raises(TypeError, match="unexpected keyword argument 'decode_linear'"):  # an experiment now
        CompiledSamplerConfig(decode_linear="triton")


def test_a_sampler_takes_a_config_or_its_options_not_both():
    config = CompiledSamplerConfig(compile=False, sync_every=4)
    assert CompiledSampler(config).config is config
    assert CompiledSampler(compile=False, sync_every=4).config == config
    with pytest.raises(TypeError, match="not both"):
        CompiledSampler(config, sync_every=8)
    with pytest.raises(TypeError, match="must be a CompiledSamplerConfig"):
        CompiledSampler({"compile": False})


def test_sampling_args_carry_the_stop_tokens_and_the_calls_overrides():
    cfg = SamplerConfig.from_config({"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9})
    with pytest.raises(ValueError, match="stop_tokens: none set"):
        cfg.sampling_args()
    cfg = cfg.with_stop_tokens([3, 5])
    assert cfg.stop_tokens == (3, 5)
    assert cfg.sampling_args(temperature=0.0) == dict(max_new_tokens=8, temperature=0.0, top_k=None, top_p=0.9,
                                                      stop_tokens=[3, 5])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.temperature = 1.0


def test_stop_tokens_outside_the_vocabulary_are_named():
    check_stop_tokens([0, 31], 32, "generation.stop_tokens")
    check_stop_tokens([99], None, "tokenizer")  # unknown vocabulary: nothing to check
    with pytest.raises(ConfigError, match=r"config key 'tokenizer': stop token\(s\) \[32\] outside"):
        check_stop_tokens([5, 32], 32, "tokenizer")


def test_the_keys_are_the_ones_configs_use():
    assert set(GENERATION_KEYS) == {
        "max_new_tokens", "temperature", "top_k", "top_p", "stop_tokens", "backend", "rollout_copy",
        "prefill_chunk_tokens", "compile", "max_cache_len", "sync_every", "compaction", "attention_window", "draws",
        "fused_projections", "decode_attention", "programmatic_launch", "shared_prompt_decode"}
