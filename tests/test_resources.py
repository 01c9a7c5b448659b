"""Bundled files found through the package: the ``logitless_asset`` resolver in any config."""

import pathlib

import pytest
from omegaconf import OmegaConf

import logitless

PACKAGE = pathlib.Path(logitless.__file__).resolve().parent


@pytest.mark.parametrize("name,folder", [("rl/tiny_grpo_warmstart", "rl/assets/tiny_grpo_warmstart"),
                                         ("datasets/qwen2_5_tiny", "datasets/assets/qwen2_5_tiny"),
                                         ("datasets/tokenizer/vocab.json", "datasets/assets/tokenizer/vocab.json")])
def test_asset_interpolation_is_an_absolute_path_in_the_package(tmp_path, monkeypatch, name, folder):
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.create({"checkpoint_dir": "${logitless_asset:" + name + "}"})
    assert cfg.checkpoint_dir == str(PACKAGE / folder)
    assert pathlib.Path(cfg.checkpoint_dir).exists()


def test_the_old_data_prefix_still_resolves_with_a_warning(tmp_path, monkeypatch):
    # Configs written before logitless/data became logitless/datasets keep running.
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.create({"d": "${logitless_asset:data/qwen2_5_tiny}"})
    with pytest.warns(FutureWarning, match=r"'data/' assets moved to 'datasets/'; write logitless_asset:datasets/qwen2_5_tiny"):
        assert cfg.d == str(PACKAGE / "datasets" / "assets" / "qwen2_5_tiny")


@pytest.mark.parametrize("name", ["rl/no_such_asset", "nopackage/x", "datasets", "../datasets/assets/tokenizer"])
def test_unknown_asset_names_the_asset_and_the_folder(name):
    cfg = OmegaConf.create({"d": "${logitless_asset:" + name + "}"})
    with pytest.raises(Exception, match=r"logitless_asset") as e:
        cfg.d
    assert name in str(e.value)


def test_every_tiny_config_points_at_existing_assets_from_any_folder(tmp_path, monkeypatch):
    root = PACKAGE.parents[1]
    monkeypatch.chdir(tmp_path)
    for name in ("tiny_full", "tiny_lora", "tiny_grpo"):
        cfg = OmegaConf.load(root / "configs" / f"{name}.yaml")
        assert pathlib.Path(cfg.checkpointer.checkpoint_dir).is_absolute(), name
        assert (pathlib.Path(cfg.checkpointer.checkpoint_dir) / "model.safetensors").is_file(), name


def test_a_bad_asset_in_a_recipe_config_is_a_config_error_naming_the_key():
    from logitless.training.config import ConfigError, Key, validate_config

    cfg = OmegaConf.create({"checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                                             "checkpoint_dir": "${logitless_asset:datasets/qwen2_5_tinyy}",
                                             "checkpoint_files": ["model.safetensors"], "model_type": "QWEN2",
                                             "output_dir": "/tmp/x"}})
    with pytest.raises(ConfigError, match=r"config key 'checkpointer.checkpoint_dir':.*'qwen2_5_tinyy'.*qwen2_5_tiny"):
        validate_config(cfg, {"checkpointer": Key(component=True)})
