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


def test_adapter_keys_are_torchtunes_adapter_params_for_lora_and_dora():
    """One rule for every recipe: the adapter keys are exactly the parameters torchtune's
    get_adapter_params names (DoRA adds the magnitudes), and no base tensor."""
    from torchtune.modules.peft import get_adapter_params

    from logitless.training.model import adapter_keys, is_adapter_key

    for use_dora in (False, True):
        cfg = OmegaConf.create({"_component_": "logitless.models.lora_qwen2_5_tiny", "lora_rank": 4, "lora_alpha": 8,
                                "lora_attn_modules": ["q_proj", "v_proj"], "apply_lora_to_mlp": True,
                                "use_dora": use_dora})
        model = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32, seed=0)
        assert sorted(adapter_keys(model)) == sorted(get_adapter_params(model)), use_dora
        assert any(k.endswith("magnitude") for k in adapter_keys(model)) is use_dora
    assert not is_adapter_key("layers.0.attn.q_proj.weight") and not is_adapter_key("output.tied_module.weight")


def test_dora_magnitudes_follow_the_base_weights_they_are_loaded_with():
    """torchtune allocates DoRA magnitudes uninitialised: build_model sets them, load_weights resets
    them from a base checkpoint (the row norms of W) and keeps those an adapter checkpoint holds."""
    from logitless.training.model import adapter_keys, load_weights

    cfg = OmegaConf.create({"_component_": "logitless.models.lora_qwen2_5_tiny", "lora_rank": 4, "lora_alpha": 8,
                            "lora_attn_modules": ["q_proj"], "use_dora": True})
    kw = dict(device=torch.device("cpu"), dtype=torch.float32)
    model = build_model(cfg, seed=0, **kw)
    q = model.layers[0].attn.q_proj
    torch.testing.assert_close(q.magnitude, q.weight.norm(dim=1))  # lora_b starts at 0: ||W + BA|| = ||W||
    base = {k: v * 2.0 for k, v in build_model(cfg, seed=1, **kw).state_dict().items()
            if k not in adapter_keys(model)}
    load_weights(model, base, allow_missing=adapter_keys(model))
    torch.testing.assert_close(q.magnitude, base["layers.0.attn.q_proj.weight"].norm(dim=1))
    saved = {k: torch.full_like(v, 0.5) if k.endswith("magnitude") else v for k, v in model.state_dict().items()
             if k in adapter_keys(model)}
    load_weights(model, saved, allow_missing=[k for k in model.state_dict() if k not in saved])
    assert torch.equal(q.magnitude, torch.full_like(q.magnitude, 0.5))
