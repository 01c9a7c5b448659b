#!/usr/bin/env python
"""Build the bundled tiny Qwen3 checkpoint folder ``components/logitless/datasets/assets/qwen3_tiny/``.

Deterministic (fixed seed); rerun it to regenerate every file. Everything but ``vocab.json`` /
``merges.txt`` is written by transformers itself, as in a downloaded ``Qwen/Qwen3-*`` folder:

- ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``: the bundled byte-level BPE
  (``assets/tokenizer``, 2026 tokens) with Qwen3's 26 added tokens at ids 2026-2051 (Qwen2.5's 22,
  then ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``), flagged special or not
  as Qwen3's are (``<think>`` and the tool tags are not: decoding keeps them), eos ``<|im_end|>``, pad
  ``<|endoftext|>``, and Qwen3's chat template (``logitless.models.QWEN3_CHAT_TEMPLATE``);
- ``vocab.json``, ``merges.txt``: copies of the bundled BPE files (torchtune's tokenizer reads them;
  Qwen3 checkpoints on the hub ship them too);
- ``config.json``, ``generation_config.json``, ``model.safetensors``: a ``Qwen3ForCausalLM`` of
  ``logitless.models.TINY_QWEN3_CONFIG`` in bf16, random init (seed 0): linear layers N(0, 0.02),
  embedding N(0, 1/128) so initial logits have std ~1, the per-head q/k norm scales 1 + N(0, 0.1) so
  that the norm-before-RoPE order matters, the other norms 1.

    python scripts/make_tiny_qwen3.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "components" / "logitless" / "datasets" / "assets"
QWEN3_ADDED = ("<tool_response>", "</tool_response>", "<think>", "</think>")
NOT_SPECIAL = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
               "<|repo_name|>", "<|file_sep|>") + QWEN3_ADDED


def write_tokenizer(src: Path, out: Path):
    """Qwen3's added tokens on the bundled BPE, saved by transformers; returns the HF tokenizer."""
    import tokenizers
    import transformers

    from logitless.models import QWEN3_CHAT_TEMPLATE

    spec = json.loads((src / "tokenizer.json").read_text())
    template = dict(spec["added_tokens"][0])
    for content in QWEN3_ADDED:
        spec["added_tokens"].append(dict(template, id=spec["added_tokens"][-1]["id"] + 1, content=content))
    for token in spec["added_tokens"]:
        token["special"] = token["content"] not in NOT_SPECIAL
    tok = transformers.Qwen2Tokenizer(tokenizer_object=tokenizers.Tokenizer.from_str(json.dumps(spec)),
                                      eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
                                      unk_token=None, errors="replace", add_prefix_space=False,
                                      model_max_length=1024)
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(src / name, out / name)
    return tok


def write_model(out: Path, tok, seed: int = 0) -> None:
    """The tiny Qwen3 as transformers writes it (bf16)."""
    import torch
    import transformers

    from logitless.models import TINY_QWEN3_CONFIG as c

    config = transformers.Qwen3Config(
        vocab_size=c["vocab_size"], hidden_size=c["embed_dim"], intermediate_size=c["intermediate_dim"],
        num_hidden_layers=c["num_layers"], num_attention_heads=c["num_heads"], num_key_value_heads=c["num_kv_heads"],
        head_dim=c["head_dim"], max_position_embeddings=c["max_seq_len"], rms_norm_eps=c["norm_eps"],
        rope_theta=c["rope_base"], tie_word_embeddings=c["tie_word_embeddings"], max_window_layers=c["num_layers"],
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    g = torch.Generator().manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * c["embed_dim"] ** -0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.pad_token_id, eos_token_id=[tok.eos_token_id, tok.pad_token_id], pad_token_id=tok.pad_token_id)
    model.to(torch.bfloat16).save_pretrained(str(out))


def main() -> None:
    out = ASSETS / "qwen3_tiny"
    out.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(ASSETS / "tokenizer", out)
    write_model(out, tok)
    print(f"wrote {sorted(p.name for p in out.iterdir())} to {out}")


if __name__ == "__main__":
    main()
