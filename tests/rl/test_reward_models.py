"""A sequence-classification reward model built in the test (tiny, random): batched scores equal the
model's own logit on each text alone (no padding), it runs without gradients, and it plugs into
the YAML reward list as a component."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from logitless.datasets import TINY_TOKENIZER_DIR  # noqa: E402
from logitless.rl.reward_models import SequenceClassifierReward, place_reward_models  # noqa: E402
from logitless.rl.rewards import build_reward_specs, compute_rewards  # noqa: E402


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(TINY_TOKENIZER_DIR / "tokenizer.json"),
                                               pad_token="<|endoftext|>", eos_token="<|im_end|>")
    tok.save_pretrained(out)
    cfg = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                                   pad_token_id=tok.pad_token_id, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.Qwen2ForSequenceClassification(cfg).save_pretrained(out)
    return out


def _alone(path, text):
    """The reference: the model on one unpadded text, loaded independently."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return float(model(**tok([text], return_tensors="pt")).logits[0, 0])


def test_batched_scores_match_each_text_alone(reward_model_dir):
    prompts = ["1+1=", "a much longer prompt about 3+4=", "9+0="]
    completions = ["2", " it is 7, I think", ""]
    rm = SequenceClassifierReward(str(reward_model_dir), batch_size=2)
    got = rm(prompts, completions, answer=["2", "7", "9"])
    want = [_alone(reward_model_dir, p + c) for p, c in zip(prompts, completions)]
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(v, 4) for v in got)) == 3  # a random model still tells the texts apart
    assert not any(p.requires_grad for p in rm.model.parameters()) and not rm.model.training


def test_reward_model_from_yaml_on_the_policy_device(reward_model_dir):
    specs = build_reward_specs([{"function": {"_component_": "logitless.rl.reward_models.SequenceClassifierReward",
                                              "path": str(reward_model_dir), "batch_size": 4},
                                 "weight": 0.5}])
    assert specs[0].name == "reward_model" and specs[0].function.model is None  # loaded on first use
    place_reward_models(specs, torch.device("cpu"))
    out = compute_rewards(specs, ["1+1="], ["2"])
    assert out["reward_model"].item() == pytest.approx(_alone(reward_model_dir, "1+1=2"), abs=1e-5)
    assert out["total"].item() == pytest.approx(0.5 * out["reward_model"].item(), abs=1e-6)
    assert specs[0].function.model.device == torch.device("cpu")


@pytest.mark.parametrize("kwargs, match", [
    ({"path": "/no/such/folder"}, "path='/no/such/folder': expected a Hugging Face checkpoint folder"),
    ({"batch_size": 0}, "batch_size=0: expected an int >= 1"),
    ({"dtype": "fp8"}, "dtype='fp8': expected one of"),
])
def test_bad_arguments_are_named(reward_model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SequenceClassifierReward(**{"path": str(reward_model_dir), **kwargs})
    entry = {"function": {"_component_": "logitless.rl.reward_models.SequenceClassifierReward",
                          "path": str(reward_model_dir), **kwargs}}
    with pytest.raises(ValueError, match=r"config key 'rewards\[0\]\.function': .*cannot be built"):
        build_reward_specs([entry])


def test_missing_transformers_is_a_clear_error(reward_model_dir, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(ImportError, match="optional dependency 'transformers'"):
        SequenceClassifierReward(str(reward_model_dir))(["q"], ["a"])
