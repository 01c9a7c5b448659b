"""tools / environment / multi_turn in a GRPO config: checked before anything is built, every error
naming its key; what they build."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from logitless.datasets import tiny_qwen2_5_tokenizer
from logitless.generation.tools.config import build_tool_turns, check_turn_config, load_tools
from logitless.generation.tools.environment import ToolEnvironment
from logitless.rl.config import validate_grpo_config
from logitless.training.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]
CALC = "logitless.generation.tools.builtin.calculator"


def _cfg(*overrides):
    cfg = OmegaConf.load(ROOT / "configs/tiny_grpo_tools.yaml")
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(["model_init=random", *overrides]))


class NoStep:
    def reset(self, row):
        return []


@pytest.mark.parametrize("overrides, message", [
    (["tools=[no.such.module.fn]"], "config key 'tools[0]._component_': cannot import 'no.such.module.fn'"),
    ([f"tools=[{CALC},json.dumps]"], "config key 'tools[1]': tool 'dumps': argument 'obj' has no type hint"),
    ([f"tools=[{CALC},{CALC}]"], "config key 'tools[1]': logitless.generation.tools.builtin.calculator is named "
                                 "'calculator' like tools[0]"),
    (["tools=[]"], "config key 'tools': an empty list"),
    (["multi_turn.max_turns=0"], "config key 'multi_turn.max_turns': expected an int >= 1, got 0"),
    (["multi_turn.tool_timeout_s=-1"], "config key 'multi_turn.tool_timeout_s': expected a number of seconds > 0"),
    (["multi_turn.chat_format=mistral"], "config key 'multi_turn.chat_format': expected 'auto' or one of"),
    (["multi_turn.max_tools=2"], "config key 'multi_turn.max_tools': unknown"),
    (["multi_turn.segment_prefill_tokens=1"], "config key 'multi_turn.segment_prefill_tokens': expected 'auto', "
                                              "null or an int >= 2, got 1"),
    (["multi_turn.segment_prefill_tokens=often"], "config key 'multi_turn.segment_prefill_tokens': expected 'auto', "
                                                  "null or an int >= 2, got 'often'"),
    (["tools=null"], "config key 'multi_turn': set, but neither 'tools' nor 'environment' is"),
    (["generation.backend=compiled", "generation.draws=generator"],
     "config key 'generation.draws': draws='generator': the multi-turn sampler draws"),
    (["on_too_long=truncate"], "config key 'on_too_long': 'truncate' cannot cut a tool rollout's prompt"),
    (["environment._component_=tests.generation.tools.test_config.NoStep"], "config key 'environment"),
    (["environment._component_=logitless.generation.tools.builtin._MAX_EXPONENT"],
     "config key 'environment': expected a class with reset(row) and step(messages)"),
])
def test_bad_turn_settings_name_their_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        validate_grpo_config(_cfg(*overrides))
    assert message in str(e.value)


def test_an_environment_without_step_is_named():
    with pytest.raises(ValueError, match="NoStep has no step method"):
        from logitless.generation.tools.environment import check_environment_class
        check_environment_class(NoStep)


def test_the_tiny_config_builds_its_turns():
    cfg = validate_grpo_config(_cfg())
    settings = check_turn_config(cfg)
    assert (settings.max_turns, settings.tool_timeout_s, settings.chat_format) == (3, 5, "auto")
    tokenizer = tiny_qwen2_5_tokenizer()
    turns = build_tool_turns(cfg, tokenizer, tokenizer.stop_tokens)
    assert turns.chat.format.name == "qwen2_5" and [t["function"]["name"] for t in turns.chat.tools] == ["calculator"]
    assert isinstance(turns.environment_factory(), ToolEnvironment)
    with pytest.raises(ConfigError, match="config key 'generation.stop_tokens': \\[2026\\] does not hold '<\\|im_end\\|>'"):
        build_tool_turns(cfg, tokenizer, [2026])
    assert [f.__name__ for f in load_tools([CALC])] == ["calculator"]
    assert check_turn_config(_cfg("tools=null", "multi_turn=null")) is None


class _Called(Exception):
    pass


@pytest.mark.parametrize("setting", ["auto", None, 64])
def test_segment_prefill_tokens_reaches_the_turn_sampler(setting):
    """The setting reaches the turn sampler as it is ('auto': the sampler's own default)."""
    from logitless.generation.config import SamplerConfig
    from logitless.generation.policy_sampler import PolicySampler

    cfg = validate_grpo_config(_cfg(f"multi_turn.segment_prefill_tokens={'null' if setting is None else setting}"))
    assert check_turn_config(cfg).segment_prefill_tokens == setting
    tokenizer = tiny_qwen2_5_tokenizer()
    turns = build_tool_turns(cfg, tokenizer, tokenizer.stop_tokens)
    seen = {}

    def sampler(model, session, **kwargs):
        seen.update(kwargs)
        raise _Called

    policy = PolicySampler(None, None, SamplerConfig(max_new_tokens=8, stop_tokens=tokenizer.stop_tokens), tokenizer,
                           None, turns=turns, turn_sample_fns=(sampler, sampler))
    with pytest.raises(_Called):
        policy.sample(object(), [{"prompt_messages": [{"role": "user", "content": "1+1="}], "answer": "2"}], 2, None)
    assert seen["segment_prefill_tokens"] == setting
