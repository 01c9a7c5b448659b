"""Atomic HF-format checkpoints with the recipe state, and exact resume.

Layout of ``output_dir``::

    step_000020/                    one complete checkpoint (appears only once fully written)
        model-00001-of-00001.safetensors, model.safetensors.index.json, config.json, ...
                                    HF weights written by the torchtune checkpointer (full runs, or
                                    LoRA runs with ``merge_adapters``: base + adapters merged)
        adapter_model.pt / adapter_model.safetensors / adapter_config.json   LoRA adapters
        recipe_state.pt             optimizer, LR scheduler, step, epoch, data position, RNG, seed
        logitless_checkpoint.json   written last: step, epoch, files, config
    .tmp-step_000020-<pid>/         a save in progress (removed on the next start)

Every save is first written to a temporary folder, then renamed into place with one
``os.replace``: an interrupted run leaves either the previous checkpoint or the new one, never a
half-written one that resume would load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file
from torchtune import config as tt_config
from torchtune import training as tt_training

from logitless.training.nonfinite import check_finite_weights

MARKER = "logitless_checkpoint.json"
RECIPE_STATE = "recipe_state.pt"
_STEP_PREFIX = "step_"


def rng_state() -> Dict[str, Any]:
    """Snapshot of the Python, NumPy, torch (and CUDA) generators of this process."""
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: Dict[str, Any]) -> None:
    """Restores a snapshot made by :func:`rng_state`."""
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(root))


def complete_checkpoints(output_dir: str | os.PathLike) -> List[Path]:
    """Complete ``step_*`` folders of ``output_dir``, oldest first.

    Args:
        output_dir: the run's output folder.

    Returns:
        List[Path]: folders that contain the completion marker, sorted by step.

    Example:
        >>> complete_checkpoints("outputs/tiny_full")[-1].name
        'step_000040'
    """
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = []
    for d in out.iterdir():
        if d.is_dir() and d.name.startswith(_STEP_PREFIX) and (d / MARKER).is_file():
            try:
                found.append((int(d.name[len(_STEP_PREFIX):]), d))
            except ValueError:
                continue
    return [d for _, d in sorted(found)]


class CheckpointManager:
    """Loads the initial weights, saves complete checkpoints atomically, and finds the one to resume.

    Args:
        checkpointer_cfg (Optional[DictConfig]): the recipe's ``checkpointer`` node (a torchtune
            checkpointer, normally ``FullModelHFCheckpointer``), or None when the model starts
            from random weights (checkpoints are then written as torchtune-format safetensors).
        output_dir (str): where ``step_*`` folders go.
        is_rank_zero (bool): only rank 0 writes.
        keep_last_n (Optional[int]): delete older complete checkpoints beyond this many.

    Example:
        >>> ckpt = CheckpointManager(cfg.checkpointer, cfg.output_dir)
        >>> sd = ckpt.load_model_state()                  # tune-format state dict
        >>> ckpt.save(step=10, epoch=0, model_state=model.state_dict(), recipe_state={...})
    """

    def __init__(self, checkpointer_cfg: Optional[DictConfig], output_dir: str, *, is_rank_zero: bool = True,
                 keep_last_n: Optional[int] = None):
        self.cfg = checkpointer_cfg
        self.output_dir = Path(output_dir)
        self.is_rank_zero = is_rank_zero
        self.keep_last_n = keep_last_n
        self._checkpointer = None
        if is_rank_zero:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            for d in self.output_dir.glob(".tmp-" + _STEP_PREFIX + "*"):
                shutil.rmtree(d, ignore_errors=True)  # leftovers of an interrupted save

    # ---------------------------------------------------------------- loading
    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint folder, or None."""
        found = complete_checkpoints(self.output_dir)
        return found[-1] if found else None

    def _instantiate(self, checkpoint_dir: Optional[Path] = None, files: Optional[List[str]] = None):
        cfg = OmegaConf.create(OmegaConf.to_container(self.cfg, resolve=True))
        cfg.output_dir = str(self.output_dir)
        cfg.should_load_recipe_state = False
        for k in ("resume_from_checkpoint", "recipe_checkpoint", "adapter_checkpoint"):
            cfg.pop(k, None)
        if checkpoint_dir is not None:
            cfg.checkpoint_dir = str(checkpoint_dir)
            cfg.checkpoint_files = files
        return tt_config.instantiate(cfg)

    def load_model_state(self, resume_dir: Optional[Path] = None, *, base_only: bool = False) -> Dict[str, torch.Tensor]:
        """Tune-format model state dict from the configured checkpoint or from ``resume_dir``.

        Args:
            resume_dir (Optional[Path]): a complete checkpoint folder; its HF weights are loaded
                (unless ``base_only``).
            base_only (bool): load the configured base checkpoint even when resuming (LoRA: the
                base stays frozen, only the adapters come from ``resume_dir``).

        Returns:
            Dict[str, torch.Tensor]: torchtune-format weights.

        Raises:
            FileNotFoundError: when ``resume_dir`` has no model weights.
        """
        if resume_dir is not None and not base_only:
            meta = json.loads((resume_dir / MARKER).read_text())
            files = meta.get("model_files") or []
            if not files:
                raise FileNotFoundError(f"checkpoint {resume_dir} has no model weights to resume from")
            if meta.get("format") == "torchtune":
                sd = {}
                for f in files:
                    sd.update(load_file(str(resume_dir / f)))
                return sd
            self._checkpointer = self._instantiate(resume_dir, files)
        else:
            if self.cfg is None:
                raise ValueError("CheckpointManager: no checkpointer configured, nothing to load")
            self._checkpointer = self._instantiate()
        return self._checkpointer.load_checkpoint()[tt_training.MODEL_KEY]

    @staticmethod
    def load_recipe_state(resume_dir: Path) -> Dict[str, Any]:
        """The recipe state saved with a checkpoint (optimizer, scheduler, step, data position, RNG)."""
        return torch.load(resume_dir / RECIPE_STATE, map_location="cpu", weights_only=False)

    @staticmethod
    def load_adapter_state(resume_dir: Path) -> Dict[str, torch.Tensor]:
        """LoRA adapter weights (tune format) saved with a checkpoint."""
        p = resume_dir / "adapter_model.pt"
        if not p.is_file():
            raise FileNotFoundError(f"checkpoint {resume_dir} has no adapter_model.pt to resume LoRA from")
        return torch.load(p, map_location="cpu", weights_only=True)

    # ---------------------------------------------------------------- saving
    def save(
        self,
        *,
        step: int,
        epoch: int,
        recipe_state: Dict[str, Any],
        model_state: Optional[Dict[str, torch.Tensor]] = None,
        adapter_state: Optional[Dict[str, torch.Tensor]] = None,
        adapter_config: Optional[Dict[str, Any]] = None,
        extra_meta: Optional[Dict[str, Any]] = None,
    ) -> Optional[Path]:
        """Writes one complete checkpoint atomically (rank 0 only; other ranks return None).

        Args:
            step (int): optimizer steps done; names the folder ``step_{step:06d}``.
            epoch (int): current epoch (recorded).
            recipe_state (Dict[str, Any]): saved as ``recipe_state.pt``.
            model_state (Optional[Dict]): full tune-format weights (full fine-tuning, or merged LoRA);
                None to skip (adapter-only LoRA checkpoint).
            adapter_state (Optional[Dict]): LoRA adapter weights.
            adapter_config (Optional[Dict]): torchtune adapter config (rank, alpha, target modules).
            extra_meta (Optional[Dict]): recorded in the marker file.

        Returns:
            Optional[Path]: the checkpoint folder on rank 0.

        Raises:
            NonFiniteWeightsError: a weight holds NaN or inf; nothing is written.
        """
        if not self.is_rank_zero:
            return None
        name = f"{_STEP_PREFIX}{step:06d}"
        for part in (model_state, adapter_state):
            if part is not None:
                check_finite_weights(part, what=f"checkpoint {name}")
        staging = self.output_dir / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        meta: Dict[str, Any] = {"step": step, "epoch": epoch, "model_files": [], "format": None}
        if self.cfg is not None and (model_state is not None or adapter_state is not None):
            ckpt = self._checkpointer if self._checkpointer is not None else self._instantiate()
            if ckpt._weight_map is None:  # never loaded (e.g. adapters only): load to learn the layout
                ckpt.load_checkpoint()
            state: Dict[str, Any] = {}
            if model_state is not None:
                state[tt_training.MODEL_KEY] = dict(model_state)
            if adapter_state is not None:
                state[tt_training.ADAPTER_KEY] = dict(adapter_state)
            if adapter_config is not None:
                state[tt_training.ADAPTER_CONFIG] = dict(adapter_config)
            prev = ckpt._output_dir
            ckpt._output_dir = staging  # torchtune 0.6.1 writes to <_output_dir>/epoch_<n>/
            try:
                ckpt.save_checkpoint(state, epoch=0, intermediate_checkpoint=False,
                                     adapter_only=model_state is None)
            finally:
                ckpt._output_dir = prev
            written = staging / "epoch_0"
            meta["format"] = "hf"
            meta["model_files"] = sorted(p.name for p in written.glob("model-*.safetensors")) + \
                sorted(p.name for p in written.glob("model-*.bin"))
        else:
            written = staging / "epoch_0"
            written.mkdir()
            if model_state is not None:
                save_file({k: v.contiguous() for k, v in model_state.items()}, str(written / "model.safetensors"))
                meta["format"] = "torchtune"
                meta["model_files"] = ["model.safetensors"]
            if adapter_state is not None:
                torch.save(adapter_state, written / "adapter_model.pt")
        for stale in (MARKER, RECIPE_STATE):  # copied from a resumed checkpoint folder
            (written / stale).unlink(missing_ok=True)
        torch.save(recipe_state, written / RECIPE_STATE)
        meta.update(extra_meta or {})
        (written / MARKER).write_text(json.dumps(meta, indent=2, default=str) + "\n")
        _fsync_tree(written)
        final = self.output_dir / name
        if final.exists():
            trash = self.output_dir / f".tmp-{name}-old-{os.getpid()}"
            os.replace(final, trash)
            os.replace(written, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(written, final)
        _fsync_dir(self.output_dir)
        shutil.rmtree(staging, ignore_errors=True)
        if self.keep_last_n is not None:
            for old in complete_checkpoints(self.output_dir)[: -self.keep_last_n]:
                shutil.rmtree(old, ignore_errors=True)
        return final
