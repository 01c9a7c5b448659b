"""torchtune's Hugging Face checkpointer for any folder :func:`logitless.models.from_hf` reads.

:class:`HFCheckpointer` is ``torchtune.training.FullModelHFCheckpointer`` with two differences:

* ``model_type`` and ``checkpoint_files`` default to what the folder says: the family of its
  ``config.json`` (:func:`logitless.models.hf_model_spec`) and the files of its
  ``model.safetensors.index.json`` (else ``model.safetensors``, else every ``*.safetensors``);
* it reads and writes ``QWEN3``, which torchtune 0.6.1 does not know, with the same layout
  torchtune writes for the other types (``<output_dir>/epoch_<n>/model-0000k-of-0000n.safetensors``,
  the index, the folder's other files copied) and :mod:`logitless.models.convert`'s key map.

Every other model type is torchtune's own code path, unchanged. Adapters: logitless recipes never
hand them to a checkpointer (their :class:`~logitless.training.CheckpointManager` exports the PEFT
adapter itself, correctly for the family); for ``QWEN3`` this class refuses them.

Example:
    >>> ckpt = HFCheckpointer(checkpoint_dir="/models/Qwen3-1.7B", output_dir="/tmp/run")
    >>> ckpt._model_type_name, ckpt.load_checkpoint()["model"]["layers.0.attn.q_norm.scale"].shape
    ('QWEN3', torch.Size([128]))
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from safetensors.torch import save_file
from torchtune import training
from torchtune.training import FullModelHFCheckpointer
from torchtune.training.checkpointing._utils import (
    SAFETENSOR_INDEX_FNAME,
    SHARD_FNAME,
    SUFFIXES_TO_NOT_COPY,
    copy_files,
    safe_torch_load,
)

from logitless.models.convert import hf_to_tune_converter, tune_to_hf_converter
from logitless.models.hf import hf_model_spec, read_hf_config

__all__ = ["HFCheckpointer", "hf_weight_files"]

# Model types torchtune's checkpointer does not know, converted here.
_OWN_TYPES = ("QWEN3",)
# The types a family's folder may be read as (LLAMA3 and LLAMA3_2 convert alike).
_FAMILY_TYPES = {"qwen2": ("QWEN2",), "qwen3": ("QWEN3",), "llama": ("LLAMA3", "LLAMA3_2", "LLAMA2")}


def hf_weight_files(checkpoint_dir: Union[str, Path]) -> List[str]:
    """The weight files of a Hugging Face folder: those its safetensors index names, else
    ``model.safetensors``, else every ``*.safetensors`` (sorted).

    Raises:
        FileNotFoundError: naming the folder when it holds no safetensors weights.
    """
    d = Path(checkpoint_dir)
    index = d / SAFETENSOR_INDEX_FNAME
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (d / "model.safetensors").is_file():
        return ["model.safetensors"]
    found = sorted(p.name for p in d.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{d}: no {SAFETENSOR_INDEX_FNAME}, model.safetensors or *.safetensors weights")
    return found


class HFCheckpointer(FullModelHFCheckpointer):
    """``FullModelHFCheckpointer`` whose folder names its own ``model_type`` and files; adds ``QWEN3``.

    Args:
        checkpoint_dir (str): a Hugging Face checkpoint folder (``config.json`` + safetensors).
        output_dir (str): where ``epoch_<n>/`` folders are written.
        checkpoint_files (Optional[List[str]]): weight files; default :func:`hf_weight_files`.
        model_type (Optional[str]): torchtune's ``model_type``; default the folder's family's
            (``QWEN2``, ``QWEN3``, ``LLAMA3``, ``LLAMA3_2``). One of another family is refused.
        **kwargs: ``FullModelHFCheckpointer``'s other arguments (``adapter_checkpoint``,
            ``recipe_checkpoint``, ``resume_from_checkpoint``, ``safe_serialization``,
            ``should_load_recipe_state``).

    Raises:
        HFConfigError: the folder's ``config.json`` describes a model ``from_hf`` does not build.
        ValueError: ``model_type`` of another family than the folder's.
    """

    def __init__(self, checkpoint_dir: str, output_dir: str, checkpoint_files: Optional[List[str]] = None,
                 model_type: Optional[str] = None, **kwargs: Any):
        folder = Path(checkpoint_dir)
        spec = hf_model_spec(read_hf_config(folder), source=str(folder / "config.json"))
        allowed = _FAMILY_TYPES[spec.family]
        model_type = spec.model_type if model_type is None else str(model_type)
        if model_type not in allowed:
            raise ValueError(f"HFCheckpointer: model_type {model_type!r} does not read {folder}, a {spec.family} "
                             f"checkpoint; expected one of {list(allowed)} (or leave it unset)")
        self._model_type_name = model_type
        self._spec = spec
        # torchtune's constructor resolves the paths; an own type is handed in as its nearest relative
        super().__init__(checkpoint_dir=str(folder), checkpoint_files=list(checkpoint_files or hf_weight_files(folder)),
                         model_type="QWEN2" if model_type in _OWN_TYPES else model_type, output_dir=output_dir,
                         **kwargs)

    @property
    def _own(self) -> bool:
        return self._model_type_name in _OWN_TYPES

    def load_checkpoint(self) -> Dict[str, Any]:
        """torchtune-format weights (``{"model": state_dict, ...}``), as ``FullModelHFCheckpointer``."""
        if not self._own:
            return super().load_checkpoint()
        self._weight_map = {}
        merged = {}
        for index, path in enumerate(self._checkpoint_paths):
            part = safe_torch_load(path)
            for key in part:
                self._weight_map[key] = f"{index + 1:04}"
            merged.update(part)
            del part
            gc.collect()
        convert = hf_to_tune_converter(self._model_type_name, self._spec.weight_arch,
                                       tie_word_embeddings=self._spec.tied)
        state: Dict[str, Any] = {training.MODEL_KEY: convert(merged)}
        if self._adapter_checkpoint:
            state[training.ADAPTER_KEY] = safe_torch_load(self._adapter_checkpoint)
        if self._should_load_recipe_state:
            state.update(safe_torch_load(self._recipe_checkpoint, mmap=False))
        return state

    def save_checkpoint(self, state_dict: Dict[str, Any], epoch: int, intermediate_checkpoint: bool = False,
                        adapter_only: bool = False) -> None:
        """Writes ``<output_dir>/epoch_<epoch>/`` in Hugging Face format, as ``FullModelHFCheckpointer``."""
        if not self._own:
            return super().save_checkpoint(state_dict, epoch, intermediate_checkpoint=intermediate_checkpoint,
                                           adapter_only=adapter_only)
        if adapter_only or training.ADAPTER_KEY in state_dict or intermediate_checkpoint:
            raise ValueError(f"HFCheckpointer ({self._model_type_name}): writes model weights only; adapters and "
                             f"recipe state are saved by logitless's CheckpointManager")
        if self._weight_map is None:
            raise RuntimeError("HFCheckpointer.save_checkpoint: load_checkpoint() first (it learns the file layout)")
        out = self._output_dir / f"epoch_{epoch}"
        out.mkdir(parents=True, exist_ok=True)
        hf_state = tune_to_hf_converter(self._model_type_name, self._spec.weight_arch)(state_dict[training.MODEL_KEY])
        shards: Dict[str, Dict[str, Any]] = {}
        for key, value in hf_state.items():
            if key not in self._weight_map:
                raise KeyError(f"HFCheckpointer: {key!r} is not in the checkpoint that was loaded "
                               f"({self._checkpoint_dir}); the model does not match its files")
            shards.setdefault(self._weight_map[key], {})[key] = value.contiguous()
        names = {i: SHARD_FNAME.format(cpt_idx=i.zfill(5), num_shards=str(len(shards)).zfill(5)) + ".safetensors"
                 for i in shards}
        total = 0
        for i, part in shards.items():
            save_file(part, str(out / names[i]), metadata={"format": "pt"})
            total += sum(v.numel() * v.element_size() for v in part.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: names[self._weight_map[k]] for k in sorted(hf_state)}}
        (out / SAFETENSOR_INDEX_FNAME).write_text(json.dumps(index, indent=2))
        copy_files(self._checkpoint_dir, out, ignore_suffixes=SUFFIXES_TO_NOT_COPY)
