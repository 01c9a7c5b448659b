"""Bad configs fail before anything is built, naming the key, what was expected and what was received."""

import pytest
from omegaconf import OmegaConf

from logitless.training import ConfigError, Key, validate_config
from full_sft_single_device import SFTRecipe

TINY = "configs/tiny_full.yaml"


@pytest.fixture
def cfg(monkeypatch, tmp_path):
    import pathlib

    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[2])
    c = OmegaConf.load(TINY)
    c.output_dir = str(tmp_path / "out")
    return c


@pytest.fixture(autouse=True)
def no_model_build(monkeypatch):
    """Any attempt to build a model during validation fails the test."""
    import logitless.training.model as m

    def boom(*a, **k):
        raise AssertionError("a model was built before the config was validated")

    monkeypatch.setattr(m, "build_model", boom)


@pytest.mark.parametrize("override, match", [
    ({"batch_sise": 4}, r"config key 'batch_sise': unknown"),
    ({"batch_size": "eight"}, r"config key 'batch_size': expected int.*got 'eight' \(str\)"),
    ({"batch_size": 0}, r"config key 'batch_size': expected a value >= 1, got 0"),
    ({"dtype": "fp8"}, r"config key 'dtype': expected one of \['bf16', 'fp32'\], got 'fp8'"),
    ({"compile": "yes"}, r"config key 'compile': expected bool"),
    ({"checkpointer": {"checkpoint_dir": "/nope/dir"}}, r"config key 'checkpointer.checkpoint_dir': '/nope/dir' does not exist"),
    ({"checkpointer": {"checkpoint_files": ["missing.safetensors"]}}, r"'checkpointer.checkpoint_files': 'missing.safetensors' not found"),
    ({"model": {"num_layer": 3}}, r"config key 'model.num_layer': .*qwen2_5_tiny has no argument 'num_layer'"),
    ({"loss": {"_component_": "logitless.losses.NoSuchLoss"}}, r"config key 'loss._component_': cannot import 'logitless.losses.NoSuchLoss'"),
    ({"optimizer": {"_component_": "torch.optim.SGD", "lr": None, "weight_decay": 0.0, "fused": False}}, None),
    ({"lr_scheduler": {"num_warmup_step": 3}}, r"'lr_scheduler.num_warmup_step'"),
    ({"resume_from_checkpoint": "maybe"}, r"config key 'resume_from_checkpoint': 'maybe' is not a folder; expected true, false, 'auto'"),
    ({"model_init": "zeros"}, r"config key 'model_init': expected one of \['checkpoint', 'random'\]"),
])
def test_bad_values_name_the_key(cfg, override, match):
    cfg = OmegaConf.merge(cfg, override)
    if match is None:
        SFTRecipe(cfg)  # valid: nothing built in the constructor
        return
    with pytest.raises(ConfigError, match=match):
        SFTRecipe(cfg)


def test_missing_required_and_component_args(cfg):
    del cfg["loss"]
    with pytest.raises(ConfigError, match=r"config key 'loss': required"):
        SFTRecipe(cfg)


def test_required_component_argument(cfg):
    cfg.tokenizer = {"_component_": "torchtune.models.qwen2_5.qwen2_5_tokenizer",
                     "path": "components/logitless/datasets/assets/tokenizer/vocab.json"}
    with pytest.raises(ConfigError, match=r"config key 'tokenizer.merges_file': required"):
        SFTRecipe(cfg)


def test_random_init_skips_checkpoint_files_and_lora_needs_lora_model(cfg):
    cfg.checkpointer.checkpoint_dir = "/not/downloaded"
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        SFTRecipe(cfg)
    cfg.model_init = "random"
    SFTRecipe(cfg)
    with pytest.raises(ConfigError, match=r"config key 'model.lora_rank': the LoRA recipe needs"):
        SFTRecipe(cfg, lora=True)


def test_local_dataset_file_is_checked(cfg):
    cfg.dataset = {"_component_": "logitless.datasets.alpaca_dataset", "source": "json", "data_files": "nope.json"}
    with pytest.raises(ConfigError, match=r"config key 'dataset.data_files': 'nope.json' does not exist"):
        SFTRecipe(cfg)


def test_validate_config_fills_defaults():
    c = OmegaConf.create({"a": 2})
    validate_config(c, {"a": Key(int, min=1), "b": Key((float, None), default=None), "c": Key(str, default="x")})
    assert c.b is None and c.c == "x"
    with pytest.raises(ConfigError, match=r"config key 'a': expected int, got 1.5 \(float\)"):
        validate_config(OmegaConf.create({"a": 1.5}), {"a": Key(int)})
