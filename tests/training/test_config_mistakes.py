"""Mistakes in the loss, LR schedule, LoRA, checkpointer and tokenizer settings of an SFT config fail in
the recipe's constructor, before anything is built or any folder claimed, as one ConfigError naming
the key, the value and what was expected (they used to surface after the model build, as a
traceback naming no key, or not at all)."""

import pathlib

import pytest
from omegaconf import OmegaConf

from logitless.training import ConfigError
from full_sft_single_device import SFTRecipe

REPO = pathlib.Path(__file__).resolve().parents[2]
LINEAR_CE = {"_component_": "logitless.losses.LinearCrossEntropyLoss", "impl": "chunked"}


@pytest.fixture(autouse=True)
def no_model_build(monkeypatch):
    import logitless.training.model as m

    def boom(*a, **k):
        raise AssertionError("a model was built before the config was validated")

    monkeypatch.setattr(m, "build_model", boom)


def _cfg(name, tmp_path, monkeypatch, override):
    monkeypatch.chdir(REPO)
    cfg = OmegaConf.merge(OmegaConf.load(f"configs/{name}"), override)
    cfg.output_dir = str(tmp_path / "out")
    return cfg


@pytest.mark.parametrize("override, match", [
    # the loss: its arguments' types from its signature, then its own checks, before the model
    ({"loss": {"num_output_chunks": "abc"}},
     r"config key 'loss.num_output_chunks': logitless.losses.ce.CEWithChunkedOutputLoss expects an int, "
     r"got 'abc' \(str\)$"),
    ({"loss": {"num_output_chunks": 0}},
     r"config key 'loss.num_output_chunks' \(logitless.losses.CEWithChunkedOutputLoss\): num_output_chunks must be "
     r"an int >= 1, got 0$"),
    ({"loss": {**LINEAR_CE, "impl": "bogus"}},
     r"config key 'loss.impl' \(logitless.losses.LinearCrossEntropyLoss\): impl must be one of "
     r"\('auto', 'triton', 'chunked', 'reference'\), got 'bogus'$"),
    ({"loss": {**LINEAR_CE, "temperature": 0}},
     r"config key 'loss.temperature' \(logitless.losses.LinearCrossEntropyLoss\): temperature must be > 0 .*got 0$"),
    ({"loss": {**LINEAR_CE, "temperature": True}},
     r"config key 'loss.temperature': .*LinearCrossEntropyLoss expects a number, got True \(bool\)$"),
    ({"loss": {**LINEAR_CE, "reduction": "none"}},
     r"config key 'loss.reduction' \(logitless.losses.LinearCrossEntropyLoss\): reduction must be 'mean' or 'sum'"),
    # the LR schedule
    ({"lr_scheduler": {"num_warmup_steps": "abc"}},
     r"config key 'lr_scheduler.num_warmup_steps': .*get_cosine_schedule_with_warmup expects an int, got 'abc'"),
    ({"lr_scheduler": {"num_warmup_steps": -5}},
     r"config key 'lr_scheduler.num_warmup_steps': expected an int >= 0, got -5$"),
    ({"lr_scheduler": {"num_cycles": float("nan")}}, r"config key 'lr_scheduler.num_cycles': expected a finite number"),
    # the checkpointer and the tokenizer
    ({"checkpointer": {"model_type": "LLAMA9"}},
     r"config key 'checkpointer.model_type': 'LLAMA9' is not a torchtune model type; expected one of \[.*'QWEN2'"),
    ({"tokenizer": {"max_seq_len": -3}}, r"config key 'tokenizer.max_seq_len': expected null or an int >= 1, got -3$"),
    ({"tokenizer": {"max_seq_len": 0}}, r"config key 'tokenizer.max_seq_len': expected null or an int >= 1, got 0$"),
    ({"model": {"max_seq_len": True}}, r"config key 'model.max_seq_len': .*qwen2_5_tiny expects an int, got True"),
    ({"optimizer": {"lr": True}}, r"config key 'optimizer.lr': expected a finite number >= 0, got True$"),
])
def test_sft_config_mistakes_fail_before_the_model(tmp_path, monkeypatch, override, match):
    cfg = _cfg("tiny_full.yaml", tmp_path, monkeypatch, override)
    with pytest.raises(ConfigError, match=match):
        SFTRecipe(cfg)
    assert not (tmp_path / "out").exists()  # nothing claimed: the corrected run may use the folder


SFT_LOSSES = (r"expected one of \['logitless.losses.CEWithChunkedOutputLoss', 'logitless.losses.LinearCrossEntropyLoss', "
              r"'logitless.losses.EntropyWithChunkedOutputLoss'\]$")


@pytest.mark.parametrize("component, why", [
    ("torch.nn.CrossEntropyLoss", "builds a CrossEntropyLoss, not a logitless.losses._base.StepLoss"),
    ("logitless.losses.TokenLogProbs", "builds a TokenLogProbs, not a logitless.losses._base.StepLoss"),
    # a StepLoss, but one that needs each step's advantages: it failed at step 1
    ("logitless.losses.GRPOLoss", r"needs \['advantages'\] at every step, which this recipe does not have"),
])
def test_a_component_the_sft_loop_cannot_run_is_refused(tmp_path, monkeypatch, component, why):
    # torch's loss, logitless' per-token log-probs (a head module, not a loss) and the GRPO objective
    # used to fail after the model build
    cfg = _cfg("tiny_full.yaml", tmp_path, monkeypatch, {})
    cfg.loss = {"_component_": component}
    with pytest.raises(ConfigError, match=rf"config key 'loss._component_': {component} {why}; {SFT_LOSSES}"):
        SFTRecipe(cfg)


@pytest.mark.parametrize("override, match", [
    ({"lora_rank": 0}, r"config key 'model.lora_rank': expected an int >= 1, got 0$"),
    ({"lora_rank": 2.5}, r"config key 'model.lora_rank': .*lora_qwen2_5_tiny expects an int, got 2.5"),
    ({"lora_alpha": 0}, r"config key 'model.lora_alpha': expected a finite number > 0, got 0$"),
    ({"lora_dropout": 1.0}, r"config key 'model.lora_dropout': expected a number in \[0, 1\), got 1.0$"),
    ({"lora_attn_modules": ["bogus"]},
     r"config key 'model.lora_attn_modules': 'bogus' is not a module of logitless.models.lora_qwen2_5_tiny; "
     r"expected names from \['q_proj', 'k_proj', 'v_proj', 'output_proj'\]$"),
    ({"lora_attn_modules": [], "apply_lora_to_mlp": False},
     r"config key 'model.lora_attn_modules': \[\] with apply_lora_to_mlp and apply_lora_to_output off leaves no "
     r"adapter to train"),
])
def test_lora_config_mistakes_fail_before_the_model(tmp_path, monkeypatch, override, match):
    cfg = _cfg("tiny_lora.yaml", tmp_path, monkeypatch, {"model": override})
    with pytest.raises(ConfigError, match=match):
        SFTRecipe(cfg, lora=True)


def test_the_lora_module_names_are_the_model_familys():
    # torchtune's builders list them in a Literal annotation; a builder without one gets torchtune's list
    from torchtune.models.qwen2_5 import lora_qwen2_5_0_5b
    from torchtune.modules.peft import LORA_ATTN_MODULES

    from logitless.models import lora_qwen2_5_tiny
    from logitless.training.preflight import lora_module_names

    assert lora_module_names(lora_qwen2_5_0_5b) == ("q_proj", "k_proj", "v_proj", "output_proj")
    assert lora_module_names(lora_qwen2_5_tiny) == LORA_ATTN_MODULES.__args__


def test_argument_types_from_annotations():
    from typing import List, Literal, Optional, Union

    from logitless.training.config import check_argument_types

    def component(a: int, b: float, c: Optional[str] = None, d: List[Literal["x", "y"]] = (),
                  e: Union[int, str] = 0, f: object = None, g: bool = False):
        pass

    good = {"a": 3, "b": 2, "c": None, "d": ["x", "y"], "e": "s", "f": "anything", "g": True}
    check_argument_types("k", component, good)
    for arg, value, expected in [("a", True, r"an int, got True \(bool\)"), ("a", 1.5, "an int"),
                                 ("b", "1e-3", r"a number, got '1e-3' \(str\)"), ("b", False, "a number"),
                                 ("c", 3, "a string or null"), ("d", ["z"], r"a list of one of \['x', 'y'\]"),
                                 ("e", 1.0, "an int or a string"), ("g", 1, "a bool")]:
        with pytest.raises(ConfigError, match=rf"config key 'k.{arg}': .*component expects {expected}"):
            check_argument_types("k", component, {**good, arg: value})
    # a nested component is left to its own builder
    check_argument_types("k", component, {"a": OmegaConf.create({"_component_": "x.y"})})
