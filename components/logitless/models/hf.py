"""One way to name a model: a Hugging Face checkpoint folder.

A folder written by ``save_pretrained`` (or ``tune download``) holds ``config.json``, the weights and
the tokenizer files. Three components read the same folder, so a config names it and nothing else::

    model:
      _component_: logitless.models.from_hf          # the torchtune decoder config.json describes
      path: ${checkpointer.checkpoint_dir}
    tokenizer:
      _component_: logitless.models.hf_tokenizer     # the family's torchtune tokenizer on its files
      path: ${checkpointer.checkpoint_dir}
      max_seq_len: 4096
    checkpointer:
      _component_: logitless.models.HFCheckpointer   # weight files and model_type from the folder
      checkpoint_dir: /models/Qwen3-1.7B
      output_dir: ${output_dir}

Families (``config.json`` ``model_type``) and what is built:

========== =================================== ============================== =================
model_type checkpoints                         model                          checkpointer type
========== =================================== ============================== =================
qwen2      Qwen2, Qwen2.5 (any size)           torchtune ``qwen2``            ``QWEN2``
qwen3      Qwen3 dense (0.6B-32B)              :func:`logitless.models.qwen3` ``QWEN3``
llama      Llama 3.0, 3.1, 3.2, 3.3            :func:`llama3_decoder`         ``LLAMA3`` / ``LLAMA3_2`` (tied)
========== =================================== ============================== =================

Anything else, or a field of these whose value the builders cannot reproduce (sliding-window
attention, a ``rope_scaling`` other than Llama 3's, attention biases where the family has none, an
activation other than SiLU), is refused with an :class:`HFConfigError` naming the ``config.json``
field, its value and what is expected, before any weight is allocated.
:func:`hf_config_from_model` is the way back: the ``config.json`` of a model these builders made.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from torch import nn
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.models.qwen2._component_builders import lora_qwen2, qwen2
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import RotaryPositionalEmbeddings, TiedLinear, TransformerDecoder
from torchtune.modules.peft import LORA_ATTN_MODULES

from logitless.models.llama3 import llama3_decoder, lora_llama3_decoder
from logitless.models.qwen3 import lora_qwen3, qwen3
from logitless.models.qwen3_tokenizer import qwen3_tokenizer
from logitless.modules.attention import QKNormAttention

__all__ = ["FAMILIES", "HFConfigError", "HFModelSpec", "from_hf", "hf_config_from_model", "hf_model_spec",
           "hf_tokenizer", "model_family", "read_hf_config"]

PathLike = Union[str, Path]
#: ``config.json`` ``model_type`` values :func:`from_hf` builds, with the checkpoints they cover.
FAMILIES = {"qwen2": "Qwen2, Qwen2.5", "qwen3": "Qwen3 dense", "llama": "Llama 3.x"}
_CONFIG = "config.json"


class HFConfigError(ValueError):
    """A ``config.json`` describes a model the builders cannot reproduce (the message names the field)."""


def read_hf_config(path: PathLike) -> Dict[str, Any]:
    """The ``config.json`` of a Hugging Face checkpoint folder (or the file itself).

    Raises:
        FileNotFoundError: naming the path when there is no ``config.json``.
        HFConfigError: when it is not a JSON object.
    """
    p = Path(path)
    f = p / _CONFIG if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"{p}: no {_CONFIG} (expected a Hugging Face checkpoint folder)")
    try:
        config = json.loads(f.read_text())
    except ValueError as e:
        raise HFConfigError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise HFConfigError(f"{f}: expected a JSON object, got {type(config).__name__}")
    return config


@dataclass(frozen=True)
class HFModelSpec:
    """What a ``config.json`` says about building, loading and saving its model.

    Attributes:
        family (str): a key of :data:`FAMILIES`.
        model_type (str): the torchtune checkpointer's ``model_type`` (``QWEN2``, ``QWEN3``, ``LLAMA3``, ``LLAMA3_2``).
        arch (Dict[str, Any]): the family builder's arguments.
        source (str): where the config came from (for messages).
    """

    family: str
    model_type: str
    arch: Dict[str, Any] = field(default_factory=dict)
    source: str = _CONFIG

    @property
    def tied(self) -> bool:
        return bool(self.arch["tie_word_embeddings"])

    @property
    def weight_arch(self) -> Dict[str, int]:
        """``num_heads``, ``num_kv_heads``, ``dim``, ``head_dim``: what the weight converters take."""
        a = self.arch
        return {"num_heads": a["num_heads"], "num_kv_heads": a["num_kv_heads"], "dim": a["embed_dim"],
                "head_dim": a.get("head_dim", a["embed_dim"] // a["num_heads"])}

    def build(self, *, max_seq_len: Optional[int] = None, lora: Optional[Dict[str, Any]] = None) -> TransformerDecoder:
        """The torchtune decoder (random weights); ``lora``: the ``lora_*`` builder's adapter arguments."""
        arch = dict(self.arch)
        if max_seq_len is not None:
            arch["max_seq_len"] = max_seq_len
        if self.family == "qwen2":
            return qwen2(**arch) if lora is None else lora_qwen2(**lora, **arch)
        if self.family == "qwen3":
            return qwen3(**arch) if lora is None else lora_qwen3(**lora, **arch)
        return llama3_decoder(**arch) if lora is None else lora_llama3_decoder(**lora, **arch)


class _Fields:
    """Typed reads of ``config.json`` fields with errors naming the field."""

    def __init__(self, config: Mapping[str, Any], source: str):
        self.config, self.source = config, source

    def fail(self, name: str, expected: str) -> HFConfigError:
        value = self.config.get(name, "<missing>")
        return HFConfigError(f"{self.source} field {name!r}: {value!r} is not supported; expected {expected}")

    def int(self, name: str, default: Any = ...) -> int:
        value = self.config.get(name, default)
        if value is ... or isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(name, "a positive integer")
        return value

    def float(self, name: str, default: Any = ...) -> float:
        value = self.config.get(name, default)
        if value is ... or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.fail(name, "a positive number")
        return float(value)

    def float_in(self, mapping: Mapping[str, Any], name: str, key: str, default: float) -> float:
        value = mapping.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise HFConfigError(f"{self.source} field {name!r}: {value!r} is not supported; expected a positive number")
        return float(value)

    def equals(self, name: str, allowed: tuple, default: Any, expected: str) -> Any:
        value = self.config.get(name, default)
        if value not in allowed:
            raise self.fail(name, expected)
        return value


def _rope_fields(config: Mapping[str, Any], f: "_Fields"):
    """``(rope_theta, scaling or None, the scaling's field name)`` from transformers 4's ``rope_theta`` /
    ``rope_scaling`` or transformers 5's ``rope_parameters`` (``rope_type: default`` = no scaling)."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = f.float_in(params, "rope_parameters.rope_theta", "rope_theta", 10_000.0)
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
        return theta, scaling, "rope_parameters"
    scaling = config.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise f.fail("rope_scaling", "null or a mapping")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return f.float("rope_theta", 10_000.0), scaling, "rope_scaling"


def hf_model_spec(config: Mapping[str, Any], source: str = _CONFIG) -> HFModelSpec:
    """Reads a ``config.json`` into an :class:`HFModelSpec`, refusing what cannot be built exactly.

    Args:
        config (Mapping[str, Any]): the parsed ``config.json``.
        source (str): its path, named in errors.

    Returns:
        HFModelSpec: family, checkpointer model type and builder arguments.

    Raises:
        HFConfigError: naming the first field whose value is not supported.

    Example:
        >>> hf_model_spec(read_hf_config("/models/Qwen3-1.7B")).model_type
        'QWEN3'
    """
    f = _Fields(config, source)
    family = config.get("model_type")
    if family not in FAMILIES:
        raise f.fail("model_type", "one of " + ", ".join(f"{k!r} ({v})" for k, v in FAMILIES.items()))
    heads, width = f.int("num_attention_heads"), f.int("hidden_size")
    f.equals("hidden_act", ("silu",), "silu", "'silu' (SwiGLU MLP)")
    arch = dict(vocab_size=f.int("vocab_size"), num_layers=f.int("num_hidden_layers"), num_heads=heads,
                num_kv_heads=f.int("num_key_value_heads", heads), embed_dim=width,
                intermediate_dim=f.int("intermediate_size"), max_seq_len=f.int("max_position_embeddings"),
                norm_eps=f.float("rms_norm_eps", 1e-6),
                tie_word_embeddings=f.equals("tie_word_embeddings", (True, False), False, "true or false"))
    if arch["num_heads"] % arch["num_kv_heads"]:
        raise f.fail("num_key_value_heads", f"a divisor of num_attention_heads ({heads})")
    theta, scaling, scaling_key = _rope_fields(config, f)
    arch["rope_base"] = theta
    if family in ("qwen2", "qwen3"):
        f.equals("use_sliding_window", (False, None), False, "false (sliding-window attention is not built)")
        if scaling is not None:
            raise f.fail(scaling_key, "no RoPE scaling for Qwen (null / rope_type 'default')")
    layer_types = config.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        raise f.fail("layer_types", "'full_attention' for every layer (sliding-window attention is not built)")
    if family == "qwen2":
        if config.get("head_dim", width // heads) != width // heads:
            raise f.fail("head_dim", f"hidden_size // num_attention_heads = {width // heads}")
        return HFModelSpec("qwen2", "QWEN2", arch, source)
    if family == "qwen3":
        f.equals("attention_bias", (False,), False, "false (Qwen3 has no q/k/v biases)")
        arch["head_dim"] = f.int("head_dim", 128)  # transformers' Qwen3Config default
        return HFModelSpec("qwen3", "QWEN3", arch, source)
    f.equals("attention_bias", (False,), False, "false (Llama has no attention biases)")
    f.equals("mlp_bias", (False,), False, "false (Llama has no MLP biases)")
    if config.get("head_dim", width // heads) != width // heads:
        raise f.fail("head_dim", f"hidden_size // num_attention_heads = {width // heads}")
    if scaling is not None:
        if scaling.get("rope_type", scaling.get("type")) != "llama3":
            raise f.fail(scaling_key, "null or {rope_type: llama3, factor, low_freq_factor, high_freq_factor, "
                                      "original_max_position_embeddings}")
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if k not in scaling]
        if missing:
            raise HFConfigError(f"{source} field '{scaling_key}.{missing[0]}': required with rope_type 'llama3' "
                                f"but missing")
        scaling = {k: scaling[k] for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings") if k in scaling}
    arch["rope_scaling"] = scaling
    return HFModelSpec("llama", "LLAMA3_2" if arch["tie_word_embeddings"] else "LLAMA3", arch, source)


def from_hf(path: PathLike, *, max_seq_len: Optional[int] = None,
            lora_attn_modules: Optional[List[LORA_ATTN_MODULES]] = None, apply_lora_to_mlp: bool = False,
            apply_lora_to_output: bool = False, lora_rank: int = 8, lora_alpha: float = 16.0,
            lora_dropout: float = 0.0, use_dora: bool = False, quantize_base: bool = False) -> TransformerDecoder:
    """The torchtune decoder a Hugging Face checkpoint folder's ``config.json`` describes (random
    weights: the recipe's checkpointer loads them), with LoRA / DoRA adapters when
    ``lora_attn_modules`` is given.

    Args:
        path: the checkpoint folder (or its ``config.json``).
        max_seq_len (Optional[int]): RoPE positions (default the config's ``max_position_embeddings``).
        lora_attn_modules (Optional[List[str]]): attention projections to adapt (``q_proj``,
            ``k_proj``, ``v_proj``, ``output_proj``); None builds the plain model.
        apply_lora_to_mlp (bool): adapt the MLP projections.
        apply_lora_to_output (bool): adapt the head (untied models).
        lora_rank (int): adapter rank.
        lora_alpha (float): adapter scale numerator.
        lora_dropout (float): adapter input dropout.
        use_dora (bool): DoRA adapters.
        quantize_base (bool): NF4 base weights (QLoRA).

    Returns:
        TransformerDecoder: the model (Qwen2 / Qwen3 / Llama, see the module docstring).

    Raises:
        FileNotFoundError: no ``config.json`` at ``path``.
        HFConfigError: naming the ``config.json`` field that is not supported.

    Example:
        >>> model = from_hf("/models/Qwen3-1.7B")
        >>> lora = from_hf("/models/Llama-3.2-1B-Instruct", lora_attn_modules=["q_proj", "v_proj"], lora_rank=16)
    """
    spec = hf_model_spec(read_hf_config(path), source=str(Path(path) / _CONFIG if Path(path).is_dir() else path))
    lora = None
    if lora_attn_modules is not None:
        lora = dict(lora_attn_modules=list(lora_attn_modules), apply_lora_to_mlp=apply_lora_to_mlp,
                    apply_lora_to_output=apply_lora_to_output, lora_rank=lora_rank, lora_alpha=lora_alpha,
                    lora_dropout=lora_dropout, use_dora=use_dora, quantize_base=quantize_base)
    return spec.build(max_seq_len=max_seq_len, lora=lora)


def hf_tokenizer(path: PathLike, max_seq_len: Optional[int] = None, *, enable_thinking: Optional[bool] = None,
                 prompt_template: Optional[Any] = None):
    """The torchtune tokenizer of a Hugging Face checkpoint folder, by its ``config.json`` family.

    * ``qwen2``: torchtune's Qwen2.5 tokenizer (Qwen2's when the folder has no ``<tool_call>`` token)
      on ``vocab.json`` / ``merges.txt``, special tokens from ``tokenizer.json``;
    * ``qwen3``: :class:`~logitless.models.qwen3_tokenizer.Qwen3Tokenizer` on the same files, with
      Qwen3's chat template and ``enable_thinking`` (default True, as Hugging Face's template);
    * ``llama``: torchtune's Llama 3 tokenizer on ``original/tokenizer.model`` (the tiktoken file
      ``tune download`` fetches with the Meta checkpoints), special tokens from ``tokenizer.json``.

    Args:
        path: the checkpoint folder.
        max_seq_len (Optional[int]): truncation length of tokenised messages.
        enable_thinking (Optional[bool]): Qwen3 only: the generation prompt opens the think block
            (True) or closes an empty one so the model answers directly (False).
        prompt_template (Optional): torchtune prompt template.

    Returns:
        the torchtune tokenizer (``encode``, ``decode``, ``tokenize_messages``, ``eos_id``, ``stop_tokens``).

    Raises:
        FileNotFoundError: naming the tokenizer file the family needs when it is missing.
        ValueError: ``enable_thinking`` for a family whose template has no thinking switch.

    Example:
        >>> tok = hf_tokenizer("/models/Qwen3-1.7B", max_seq_len=2048, enable_thinking=False)
    """
    folder = Path(path)
    spec = hf_model_spec(read_hf_config(folder), source=str(folder / _CONFIG))
    if enable_thinking is not None and spec.family != "qwen3":
        raise ValueError(f"hf_tokenizer: enable_thinking={enable_thinking!r} applies to Qwen3's chat template; "
                         f"{folder} is a {spec.family} checkpoint (leave it unset)")

    def need(name: str, hint: str = "") -> str:
        f = folder / name
        if not f.is_file():
            raise FileNotFoundError(f"hf_tokenizer: {f} not found; a {FAMILIES[spec.family]} tokenizer needs it{hint}")
        return str(f)

    special = folder / "tokenizer.json"
    special_path = str(special) if special.is_file() else None
    if spec.family == "llama":
        from torchtune.models.llama3 import llama3_tokenizer

        return llama3_tokenizer(need("original/tokenizer.model", " (tune download fetches it with the weights)"),
                                special_tokens_path=special_path, max_seq_len=max_seq_len,
                                prompt_template=prompt_template)
    if spec.family == "qwen3":
        build = partial(qwen3_tokenizer, enable_thinking=True if enable_thinking is None else enable_thinking)
    else:
        from torchtune.models.qwen2 import qwen2_tokenizer
        from torchtune.models.qwen2_5 import qwen2_5_tokenizer
        from torchtune.modules.transforms.tokenizers import parse_hf_tokenizer_json

        qwen2_5 = special_path is None or "<tool_call>" in parse_hf_tokenizer_json(special_path)
        build = qwen2_5_tokenizer if qwen2_5 else qwen2_tokenizer
    kw = dict(special_tokens_path=special_path, max_seq_len=max_seq_len, prompt_template=prompt_template)
    if (folder / "vocab.json").is_file() or special_path is None:
        return build(need("vocab.json"), need("merges.txt"), **kw)
    # a folder saved by transformers 5 has tokenizer.json only: its BPE model holds the vocab and merges,
    # which torchtune's tokenizer reads (once, in its constructor) from files
    with tempfile.TemporaryDirectory(prefix="logitless-bpe-") as tmp:
        vocab, merges = _bpe_files(special, Path(tmp))
        return build(vocab, merges, **kw)


def _bpe_files(tokenizer_json: Path, out: Path) -> Tuple[str, str]:
    """``vocab.json`` and ``merges.txt`` of a byte-level BPE ``tokenizer.json``, written into ``out``."""
    model = json.loads(tokenizer_json.read_text()).get("model", {})
    if model.get("type") != "BPE":
        raise FileNotFoundError(f"hf_tokenizer: {tokenizer_json.parent} has no vocab.json / merges.txt and its "
                                f"tokenizer.json holds a {model.get('type')!r} model, not the byte-level BPE expected")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (out / "vocab.json").write_text(json.dumps(model["vocab"]))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return str(out / "vocab.json"), str(out / "merges.txt")


# ---------------------------------------------------------------------------- model -> config.json
def model_family(model: nn.Module) -> Optional[str]:
    """The :data:`FAMILIES` key of a decoder these builders made (Qwen2 / Qwen3 / Llama), or None.

    Qwen3 is recognised by its :class:`QKNormAttention`, Qwen2 by Qwen2's rotary embedding on
    torchtune's attention, Llama by torchtune's Llama rotary embeddings.
    """
    layers = getattr(model, "layers", None)
    attn = getattr(layers[0], "attn", None) if layers else None
    if attn is None:
        return None
    rope = getattr(attn, "pos_embeddings", None)
    if isinstance(attn, QKNormAttention) and type(rope) is Qwen2RotaryPositionalEmbeddings:
        return "qwen3"
    if type(rope) is Qwen2RotaryPositionalEmbeddings and getattr(attn, "q_norm", None) is None:
        return "qwen2"
    if type(rope) in (RotaryPositionalEmbeddings, Llama3ScaledRoPE) and getattr(attn, "q_norm", None) is None:
        return "llama"
    return None


def _tied(model: nn.Module) -> bool:
    return isinstance(model.output, TiedLinear)


def hf_config_from_model(model: nn.Module) -> Optional[Dict[str, Any]]:
    """``config.json`` content (no dtype) of a decoder :func:`from_hf`'s builders made, or None for
    another model (its architecture cannot be named for transformers).

    Args:
        model (nn.Module): a Qwen2 / Qwen3 / Llama ``TransformerDecoder`` (plain or LoRA, tied or not).

    Returns:
        Optional[Dict[str, Any]]: ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` / ``LlamaForCausalLM``
        config that transformers (and :func:`hf_model_spec`) read back as the same model.

    Example:
        >>> hf_config_from_model(from_hf("/models/Qwen3-1.7B"))["head_dim"]
        128
    """
    family = model_family(model)
    if family is None:
        return None
    layers, emb = model.layers, model.tok_embeddings
    attn, rope = layers[0].attn, layers[0].attn.pos_embeddings
    config: Dict[str, Any] = {
        "hidden_act": "silu",
        "hidden_size": emb.embedding_dim,
        "intermediate_size": int(layers[0].mlp.w1.weight.shape[0]),
        "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "num_hidden_layers": len(layers),
        "vocab_size": emb.num_embeddings,
        "max_position_embeddings": int(model.max_seq_len),
        "rope_theta": float(rope.base),
        "rms_norm_eps": float(model.norm.eps),
        "tie_word_embeddings": _tied(model),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if family == "llama":
        scaling = None
        if isinstance(rope, Llama3ScaledRoPE):
            scaling = {"rope_type": "llama3", "factor": float(rope.scale_factor),
                       "low_freq_factor": float(rope.low_freq_factor), "high_freq_factor": float(rope.high_freq_factor),
                       "original_max_position_embeddings": int(rope.old_context_len)}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **config, "rope_scaling": scaling,
                "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    qwen = {**config, "max_window_layers": len(layers), "use_sliding_window": False, "sliding_window": None}
    if family == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **qwen, "attention_bias": False,
                "rope_scaling": None}
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **qwen}


def model_type_of(model: nn.Module) -> Optional[str]:
    """The checkpointer ``model_type`` of a decoder these builders made (None for another model)."""
    family = model_family(model)
    if family is None:
        return None
    return {"qwen2": "QWEN2", "qwen3": "QWEN3"}.get(family, "LLAMA3_2" if _tied(model) else "LLAMA3")
