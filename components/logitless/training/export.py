"""What makes a checkpoint folder a complete model folder: tokenizer files, generation config, a
``config.json`` true to the model family whose dtype is the stored weights', HF weights for
random-init runs, and a PEFT adapter that is correct for the model family.

torchtune 0.6.1's PEFT export (``tune_to_peft_adapter_weights``) applies Llama's RoPE row permutation
to the q/k ``lora_B`` of every model; Qwen2's and Qwen3's HF weights are not permuted, so their
adapters come out wrong. :func:`tune_to_peft_adapter` instead asks the base model's own tune->HF
converter (:mod:`logitless.models.convert`) what it does to the rows of each adapted weight and
applies exactly that to ``lora_B`` (and DoRA magnitudes): the adapter then matches the base weights
HF loads, for every family (Llama's permutation for Llama, none for Qwen2 / Qwen3).

Layout written into a checkpoint folder (see docs/export.md)::

    config.json, model-*.safetensors, model.safetensors.index.json   the (merged) model
    tokenizer.json, tokenizer_config.json, vocab.json, merges.txt,    AutoTokenizer
    chat_template.jinja (where the source has one)
    generation_config.json
    adapter/adapter_model.safetensors, adapter/adapter_config.json    PEFT adapter (LoRA runs)

The adapter has its own sub-folder: transformers applies an ``adapter_config.json`` it finds next to
``config.json`` on top of the weights, which would add the adapter twice to merged weights.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from omegaconf import DictConfig
from safetensors.torch import load_file, save_file
from torch import nn
from torchtune import config as tt_config

from logitless.datasets import TINY_TOKENIZER_DIR, hf_generation_config, hf_tokenizer_config
from logitless.models import convert as weight_conversion
from logitless.models.hf import hf_config_from_model, model_type_of
from logitless.models.qwen3_tokenizer import QWEN3_CHAT_TEMPLATE, Qwen3Tokenizer
from logitless.training import model as model_utils
from logitless.training.config import ConfigError

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_FILES = ("tokenizer.json", TOKENIZER_CONFIG, "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja")  # transformers 5 keeps the template in its own file
HF_WEIGHTS = "model.safetensors"

# Tokenizer builders whose files ship with the package.
_BUNDLED_TOKENIZER_DIRS = {"logitless.datasets.tiny_qwen2_5_tokenizer": TINY_TOKENIZER_DIR}
# PEFT module names of torchtune's LoRA targets; the HF module name comes from the converter.
_PEFT_KEY = {"lora_a": "lora_A", "lora_b": "lora_B"}


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (how HF configs spell dtypes)."""
    return str(dtype).removeprefix("torch.")


def state_dtype(state: Dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype of a state dict's floating tensors.

    Raises:
        ValueError: when they do not share one dtype (naming the dtypes found).
    """
    found = {v.dtype for v in state.values() if torch.is_floating_point(v)}
    if len(found) != 1:
        raise ValueError(f"model state: expected one floating dtype, found {sorted(map(str, found))}")
    return found.pop()


def set_config_dtype(config_path: Path, dtype: torch.dtype) -> None:
    """Writes ``dtype`` (transformers 5) and ``torch_dtype`` (transformers 4, vLLM) into a config.json."""
    config = json.loads(config_path.read_text())
    config["dtype"] = config["torch_dtype"] = torch_dtype_name(dtype)
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def model_arch(model: nn.Module) -> Dict[str, int]:
    """Head counts and widths of a torchtune decoder (what the tune->HF converters take)."""
    attn = model.layers[0].attn
    return {"num_heads": attn.num_heads, "num_kv_heads": attn.num_kv_heads,
            "dim": model.tok_embeddings.embedding_dim, "head_dim": attn.head_dim}


def tune_to_hf_converter(model_type: str, arch: Dict[str, int]) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    """The tune->HF weight conversion of the checkpointer's ``model_type`` (:mod:`logitless.models.convert`).

    Args:
        model_type (str): the checkpointer's ``model_type`` (e.g. ``"QWEN2"``, ``"QWEN3"``, ``"LLAMA3"``).
        arch (Dict[str, int]): :func:`model_arch` of the model.

    Returns:
        Callable: state dict (tune names) -> state dict (HF names).

    Raises:
        ConfigError: naming ``checkpointer.model_type`` when the type has no conversion here.
    """
    if model_type not in weight_conversion.CONVERTIBLE_MODEL_TYPES:
        raise ConfigError(f"config key 'checkpointer.model_type': {model_type!r} has no PEFT adapter export; "
                          f"expected one of {list(weight_conversion.CONVERTIBLE_MODEL_TYPES)} for a LoRA run")
    return weight_conversion.tune_to_hf_converter(model_type, arch)


def _row_permutation(convert, key: str, shape: torch.Size) -> torch.Tensor:
    """Row index map of what ``convert`` does to a weight of ``shape`` stored at ``key``: HF row i is
    tune row ``map[i]``."""
    # an expanded column: no memory unless the converter permutes rows (then one int32 copy)
    probe = torch.arange(shape[0], dtype=torch.int32)[:, None].expand(shape[0], shape[1])
    (out,) = convert({key: probe}).values()
    if out.shape != probe.shape or not torch.equal(out, out[:, :1].expand_as(out)):  # mixes columns
        raise ValueError(f"tune->HF conversion of {key!r} is not a row permutation; cannot export its adapter")
    return out[:, 0].long()


def tune_to_peft_adapter(adapter_state: Dict[str, torch.Tensor], base_shapes: Dict[str, torch.Size],
                         model_type: str, arch: Dict[str, int]) -> Dict[str, torch.Tensor]:
    """torchtune LoRA / DoRA adapter weights in PEFT's format, correct for the model family.

    ``lora_A`` is unchanged; ``lora_B`` rows and DoRA magnitudes are permuted exactly as the base
    weight's rows are by torchtune's tune->HF conversion (none for Qwen2, Llama's RoPE permutation of
    q/k for Llama-style models), so that PEFT's ``W_hf + (alpha / r) B_hf A`` is the HF form of
    torchtune's merged weight.

    Args:
        adapter_state (Dict[str, torch.Tensor]): ``...lora_a.weight`` / ``...lora_b.weight`` /
            ``...magnitude`` tensors in torchtune names.
        base_shapes (Dict[str, torch.Size]): shapes of the adapted base weights (tune names).
        model_type (str): the checkpointer's ``model_type``.
        arch (Dict[str, int]): :func:`model_arch` of the model.

    Returns:
        Dict[str, torch.Tensor]: ``base_model.model.<hf module>.lora_A.weight`` /
        ``.lora_B.weight`` / ``.lora_magnitude_vector`` tensors.

    Raises:
        ValueError: on a key that is not an adapter tensor, or an unsupported ``model_type``.

    Example:
        >>> peft_sd = tune_to_peft_adapter(adapter, {k: v.shape for k, v in model.state_dict().items()},
        ...                                "QWEN2", model_arch(model))
    """
    convert = tune_to_hf_converter(model_type, arch)
    rows: Dict[tuple, torch.Tensor] = {}  # (module kind, shape) -> row index map
    out: Dict[str, torch.Tensor] = {}
    for key, value in adapter_state.items():
        if key.endswith(".magnitude"):
            module, suffix = key[: -len(".magnitude")], "lora_magnitude_vector"
        elif key.endswith((".lora_a.weight", ".lora_b.weight")):
            module, kind = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
            suffix = _PEFT_KEY[kind] + ".weight"
        else:
            raise ValueError(f"adapter state: {key!r} is not a LoRA/DoRA tensor (lora_a, lora_b, magnitude)")
        base_key = module + ".weight"
        if base_key not in base_shapes:
            raise ValueError(f"adapter state: {key!r} adapts {base_key!r}, which the model does not have")
        shape = torch.Size(base_shapes[base_key])
        # the permutation depends on the module kind and shape only; the key mapping on the layer too
        kind_key = (".".join(p if not p.isdigit() else "N" for p in module.split(".")), shape)
        if kind_key not in rows:
            rows[kind_key] = _row_permutation(convert, base_key, shape)
        (hf_key,) = convert({base_key: torch.empty(shape, device="meta")}).keys()
        if suffix != _PEFT_KEY["lora_a"] + ".weight":
            value = value[rows[kind_key]]
        out["base_model.model." + hf_key[: -len(".weight")] + "." + suffix] = value.contiguous()
    return out


def peft_adapter_config(adapter_config: Dict[str, Any], peft_state: Dict[str, torch.Tensor],
                        base_model_name_or_path: Optional[str]) -> Dict[str, Any]:
    """``adapter_config.json`` content for :func:`tune_to_peft_adapter`'s weights.

    Args:
        adapter_config (Dict[str, Any]): ``r``, ``lora_alpha``, ``use_dora`` (:func:`logitless.training.model.adapter_config`).
        peft_state (Dict[str, torch.Tensor]): the PEFT weights (their HF module names are the targets).
        base_model_name_or_path (Optional[str]): the base model (a hub id or a local folder).

    Returns:
        Dict[str, Any]: a LoRA config PEFT's ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` read.
    """
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in peft_state})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(adapter_config["r"]),
        "lora_alpha": float(adapter_config["lora_alpha"]),
        "lora_dropout": 0.0,
        "use_dora": bool(adapter_config.get("use_dora", False)),
        "use_rslora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "target_modules": targets,
        "modules_to_save": None,
    }


class ModelExport:
    """Completes checkpoint folders: tokenizer files, generation config, config dtype, PEFT adapter,
    and HF weights + config.json for random-init runs (no checkpointer).

    Args:
        model_type (Optional[str]): torchtune model type (the checkpointer's, or the model's family's:
            ``QWEN2``, ``QWEN3``, ``LLAMA3`` / ``LLAMA3_2``); None when unknown (another architecture
            without a checkpointer: torchtune-format weights, no PEFT export).
        arch (Dict[str, int]): :func:`model_arch` of the model.
        hf_config (Optional[Dict]): :func:`hf_config_from_model`, for random-init runs.
        tokenizer_cfg (Optional[DictConfig]): the recipe's ``tokenizer`` node.
        adapter_config (Optional[Dict]): LoRA runs: ``r``, ``lora_alpha``, ``use_dora``.
        base_model (Optional[str]): the adapter's ``base_model_name_or_path``.
        base_shapes (Optional[Dict]): shapes of the model's tensors (tune names; LoRA runs).

    Example:
        >>> export = ModelExport.for_run(cfg, model, lora=True)
        >>> CheckpointManager(cfg.checkpointer, cfg.output_dir, export=export)
    """

    def __init__(self, *, model_type: Optional[str], arch: Dict[str, int], hf_config: Optional[Dict[str, Any]] = None,
                 tokenizer_cfg: Optional[DictConfig] = None, adapter_config: Optional[Dict[str, Any]] = None,
                 base_model: Optional[str] = None, base_shapes: Optional[Dict[str, torch.Size]] = None):
        self.model_type, self.arch, self.hf_config = model_type, arch, hf_config
        self.tokenizer_cfg, self.adapter_config, self.base_model = tokenizer_cfg, adapter_config, base_model
        self.base_shapes = base_shapes or {}
        self._tokenizer = None
        if adapter_config is not None:
            if model_type is None:
                raise ConfigError("config key 'checkpointer.model_type': needed to export a PEFT adapter (the "
                                  "model is not a Qwen2 / Qwen3 / Llama decoder and model_init=random names no "
                                  "checkpointer)")
            tune_to_hf_converter(model_type, arch)  # raises for a type we cannot export, before any step

    @classmethod
    def for_run(cls, cfg: DictConfig, model: nn.Module, *, lora: bool) -> "ModelExport":
        """The export of a recipe run (SFT or GRPO): from its config and its freshly built model.

        Args:
            cfg (DictConfig): the validated recipe config (``model``, ``tokenizer``, ``checkpointer``,
                ``model_init``).
            model (nn.Module): the model as built (before sharding).
            lora (bool): a LoRA run (export the adapter).

        Returns:
            ModelExport: the export.
        """
        hf_config = hf_config_from_model(model)
        ckpt = cfg.get("checkpointer") if cfg.get("model_init", "checkpoint") == "checkpoint" else None
        model_type = str(ckpt.model_type) if ckpt is not None and ckpt.get("model_type") else model_type_of(model)
        base = None
        if ckpt is not None:
            base = str(Path(ckpt.checkpoint_dir).resolve())
        adapter = model_utils.adapter_config(cfg.model) if lora else None
        shapes = {k: v.shape for k, v in model.state_dict().items()} if lora else None
        return cls(model_type=model_type, arch=model_arch(model), hf_config=hf_config,
                   tokenizer_cfg=cfg.get("tokenizer"), adapter_config=adapter, base_model=base, base_shapes=shapes)

    # -------------------------------------------------------------- weights (random-init runs)
    @property
    def writes_hf_weights(self) -> bool:
        """Whether weights without a checkpointer can be written in HF format (a Qwen2 / Qwen3 / Llama model)."""
        return self.hf_config is not None

    def write_hf_weights(self, folder: Path, tune_state: Dict[str, torch.Tensor]) -> List[str]:
        """Writes ``model.safetensors`` (HF names) + ``config.json`` from the model; returns the weight files."""
        to_hf = weight_conversion.tune_to_hf_converter(self.model_type, self.arch)
        hf_state = {k: v.contiguous() for k, v in to_hf(dict(tune_state)).items()}
        save_file(hf_state, str(folder / HF_WEIGHTS), metadata={"format": "pt"})
        config = dict(self.hf_config, dtype=torch_dtype_name(state_dtype(hf_state)))
        config["torch_dtype"] = config["dtype"]
        tok = self.tokenizer
        if tok is not None and hasattr(tok, "eos_id"):
            config.update(bos_token_id=getattr(tok, "bos_id", None), eos_token_id=tok.eos_id)
        (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        return [HF_WEIGHTS]

    def read_hf_weights(self, folder: Path, files: List[str]) -> Dict[str, torch.Tensor]:
        """Inverse of :meth:`write_hf_weights`: torchtune-format weights."""
        hf_state: Dict[str, torch.Tensor] = {}
        for f in files:
            hf_state.update(load_file(str(folder / f)))
        tied = json.loads((folder / CONFIG).read_text()).get("tie_word_embeddings", False)
        return weight_conversion.hf_to_tune_converter(self.model_type, self.arch, tie_word_embeddings=tied)(hf_state)

    # -------------------------------------------------------------- tokenizer
    @property
    def tokenizer(self):
        """The run's torchtune tokenizer (built on first use), or None without a tokenizer config."""
        if self._tokenizer is None and self.tokenizer_cfg is not None:
            self._tokenizer = tt_config.instantiate(self.tokenizer_cfg)
        return self._tokenizer

    def _tokenizer_source(self) -> Optional[Path]:
        if self.tokenizer_cfg is None:
            return None
        bundled = _BUNDLED_TOKENIZER_DIRS.get(self.tokenizer_cfg.get("_component_"))
        if bundled is not None:
            return bundled
        for key in ("path", "merges_file", "special_tokens_path"):
            value = self.tokenizer_cfg.get(key)
            if value and Path(value).is_dir():  # a checkpoint folder (logitless.models.hf_tokenizer)
                return Path(value)
            if value and Path(value).is_file():
                return Path(value).parent
        return None

    def _is_qwen2_tokenizer(self) -> bool:
        tok = self.tokenizer
        return tok is not None and hasattr(tok, "special_tokens") and hasattr(tok, "encoder")

    def write_tokenizer_files(self, folder: Path) -> None:
        """Tokenizer files + generation config, unless already there (copied from the checkpoint dir)."""
        src = self._tokenizer_source()
        if src is not None:
            for name in TOKENIZER_FILES:
                if (src / name).is_file() and not (folder / name).exists():
                    shutil.copyfile(src / name, folder / name)
        has_files = (folder / "tokenizer.json").is_file() or (folder / "vocab.json").is_file()
        if not has_files:
            log.warning("checkpoint %s: no HF tokenizer files (the tokenizer %s has none to copy)", folder,
                        self.tokenizer_cfg.get("_component_") if self.tokenizer_cfg is not None else None)
        elif not (folder / TOKENIZER_CONFIG).is_file() and self._is_qwen2_tokenizer():
            template = {"chat_template": QWEN3_CHAT_TEMPLATE} if isinstance(self.tokenizer, Qwen3Tokenizer) else {}
            config = hf_tokenizer_config(self.tokenizer, **template)
            (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if not (folder / GENERATION_CONFIG).is_file() and self.tokenizer is not None and hasattr(self.tokenizer, "eos_id"):
            (folder / GENERATION_CONFIG).write_text(json.dumps(hf_generation_config(self.tokenizer), indent=2) + "\n")

    # -------------------------------------------------------------- the folder
    def write_adapter(self, folder: Path, adapter_state: Dict[str, torch.Tensor]) -> None:
        """``adapter/adapter_model.safetensors`` + ``adapter/adapter_config.json`` (PEFT format)."""
        if self.adapter_config is None:
            raise ValueError("ModelExport: adapter weights given, but the export has no adapter config (lora=False)")
        peft_state = tune_to_peft_adapter(adapter_state, self.base_shapes, self.model_type, self.arch)
        out = folder / ADAPTER_DIR
        out.mkdir(exist_ok=True)
        save_file(peft_state, str(out / PEFT_WEIGHTS), metadata={"format": "pt"})
        config = peft_adapter_config(self.adapter_config, peft_state, self.base_model)
        (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    def complete(self, folder: Path, *, model_state: Optional[Dict[str, torch.Tensor]],
                 adapter_state: Optional[Dict[str, torch.Tensor]]) -> None:
        """Adds everything beyond the weights to a checkpoint folder being written.

        Args:
            folder (Path): the folder (weights already written when ``model_state`` is given).
            model_state (Optional[Dict]): the saved weights (tune format), for config.json's dtype.
            adapter_state (Optional[Dict]): LoRA adapters (tune format), exported for PEFT.
        """
        if model_state is not None and (folder / CONFIG).is_file():
            set_config_dtype(folder / CONFIG, state_dtype(model_state))
        for stale in (PEFT_WEIGHTS, PEFT_CONFIG):  # copied from a resumed folder / torchtune's layout
            (folder / stale).unlink(missing_ok=True)
        if adapter_state is not None:
            self.write_adapter(folder, adapter_state)
        self.write_tokenizer_files(folder)
