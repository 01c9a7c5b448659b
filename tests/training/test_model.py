"""logitless.training.model: building models for the recipes."""

import math

import torch
from omegaconf import OmegaConf

from logitless.training.model import build_model, random_init_std


def test_random_init_redraws_only_the_embeddings_at_hf_scale():
    """model_init=random: token embeddings N(0, 0.02), every other tensor as torchtune draws it, and a
    tied-head model starts near the uniform-prediction loss ln(V) instead of hundreds of nats."""
    cfg = OmegaConf.create({"_component_": "logitless.models.qwen2_5_tiny"})
    kw = dict(device=torch.device("cpu"), dtype=torch.float32, seed=0)
    plain = build_model(cfg, **kw)
    hf = build_model(cfg, embedding_std=random_init_std("random"), **kw)
    assert random_init_std("checkpoint") is None
    for (name, a), (_, b) in zip(plain.state_dict().items(), hf.state_dict().items()):
        if "tok_embeddings" not in name:
            torch.testing.assert_close(a, b, msg=name)
    emb = hf.tok_embeddings.weight
    assert abs(emb.std().item() - 0.02) < 0.002
    tokens = torch.randint(0, emb.shape[0], (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = hf(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert abs(loss.item() - math.log(emb.shape[0])) < 0.5
