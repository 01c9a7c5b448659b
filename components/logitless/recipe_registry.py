"""The recipes and configs logitless ships, as ``tune ls`` lists torchtune's own.

torchtune's ``tune ls`` / ``tune cp`` only know torchtune's built-in recipes, so ``logitless ls`` /
``logitless cp`` read this registry instead. Recipes are installed as top-level modules (``tune run
NAME`` runs a custom recipe as the module NAME); configs are package data under ``logitless/configs``
(the repo's ``configs/`` folder, which that path links to in a checkout).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from logitless.resources import CONFIGS_DIR

_FULL = ("tiny_full", "tiny_qwen3_full", "qwen2_5_0_5b_full", "qwen2_5_1_5b_full", "qwen2_5_7b_full", "qwen3_1_7b_full")
_LORA = ("tiny_lora", "qwen2_5_0_5b_lora", "qwen2_5_1_5b_lora", "qwen2_5_7b_lora", "qwen3_1_7b_lora")
_GRPO = ("tiny_grpo", "tiny_grpo_chat", "tiny_grpo_tools", "tiny_qwen3_grpo", "qwen_grpo", "qwen_math_grpo",
         "qwen_tools_grpo", "qwen3_1_7b_grpo", "qwen3_1_7b_grpo_thinking", "qwen3_8b_lora_grpo", "llama3_2_1b_grpo")


@dataclass(frozen=True)
class Recipe:
    """One ``tune run`` entry point.

    Args:
        name (str): the module name ``tune run`` takes.
        configs (Tuple[str, ...]): names of the configs it runs (``logitless/configs/NAME.yaml``).
        distributed (bool): launched with ``tune run --nproc_per_node N``.
        summary (str): one line for ``logitless ls``.
        loop (Optional[str]): the recipe whose file holds the loop this one runs (None: its own file).
    """

    name: str
    configs: Tuple[str, ...]
    distributed: bool = False
    summary: str = ""
    loop: Optional[str] = None


_SFT_LOOP, _GRPO_LOOP = "full_sft_single_device", "grpo_single_device"
RECIPES: Tuple[Recipe, ...] = (
    Recipe("full_sft_single_device", _FULL, summary="full fine-tuning on one device"),
    Recipe("lora_sft_single_device", _LORA, summary="LoRA fine-tuning on one device", loop=_SFT_LOOP),
    Recipe("full_sft_distributed", _FULL, distributed=True, summary="full fine-tuning with FSDP2", loop=_SFT_LOOP),
    Recipe("lora_sft_distributed", _LORA, distributed=True, summary="LoRA fine-tuning with FSDP2", loop=_SFT_LOOP),
    Recipe("grpo_single_device", _GRPO, summary="GRPO on one device"),
    Recipe("grpo_distributed", _GRPO, distributed=True, summary="GRPO with FSDP2", loop=_GRPO_LOOP),
)


def get_recipe(name: str) -> Recipe | None:
    """The registered recipe called ``name``, or None."""
    return next((r for r in RECIPES if r.name == name), None)


def config_names() -> List[str]:
    """Every registered config name, in registry order, once each."""
    return list(dict.fromkeys(c for r in RECIPES for c in r.configs))


def config_path(name: str) -> Path:
    """Path of the bundled config ``name`` (``"tiny_grpo"`` or ``"tiny_grpo.yaml"``).

    Raises:
        FileNotFoundError: naming the config and the folder searched.

    Example:
        >>> config_path("tiny_grpo").name
        'tiny_grpo.yaml'
    """
    stem = name[:-len(".yaml")] if name.endswith(".yaml") else name
    path = CONFIGS_DIR / f"{stem}.yaml"
    if stem not in config_names() or not path.is_file():
        raise FileNotFoundError(f"no bundled config {name!r} in {CONFIGS_DIR} (`logitless ls` lists them)")
    return path


def recipe_path(name: str) -> Path:
    """Path of the installed recipe module ``name``.

    Raises:
        FileNotFoundError: naming the recipe when it is not registered or not importable.

    Example:
        >>> recipe_path("grpo_single_device").name
        'grpo_single_device.py'
    """
    spec = importlib.util.find_spec(name) if get_recipe(name) is not None else None
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"no installed recipe {name!r} (`logitless ls` lists them)")
    return Path(spec.origin)


__all__ = ["RECIPES", "Recipe", "config_names", "config_path", "get_recipe", "recipe_path"]
