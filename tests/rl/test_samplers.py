import pytest
import torch

from logitless.rl import fast_generation
from logitless.rl.generation import generate
from logitless.rl.samplers import build_sampler


def test_backend_selection():
    assert build_sampler({"backend": "auto"}, torch.device("cpu")) == (generate, generate)
    assert build_sampler({}, torch.device("cpu"))[0] is generate
    train, evaluation = build_sampler({"backend": "fast", "compile": False, "sync_every": 4}, torch.device("cpu"))
    assert isinstance(train, fast_generation.FastGenerator) and isinstance(evaluation, fast_generation.FastGenerator)
    assert train is not evaluation  # separate buffers: eval batches have another size
    train_cuda, _ = build_sampler({"backend": "auto", "compile": False}, torch.device("cuda"))
    assert isinstance(train_cuda, fast_generation.FastGenerator)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="generation.backend must be one of"):
        build_sampler({"backend": "vllm"}, torch.device("cpu"))
