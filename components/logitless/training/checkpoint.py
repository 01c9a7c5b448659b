"""Atomic, verified HF-format checkpoints with the recipe state; what a run owns in its folder.

Layout of ``output_dir``::

    logitless_run.json              the run that owns the folder: run id, one entry per session
    step_000020/                    one complete checkpoint (appears only once fully written)
        model-00001-of-00001.safetensors, model.safetensors.index.json, config.json, ...
                                    HF weights written by the torchtune checkpointer (full runs, or
                                    LoRA runs with ``merge_adapters``: base + adapters merged)
        tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, generation_config.json
        adapter/adapter_model.safetensors, adapter/adapter_config.json   PEFT adapter (LoRA)
        adapter_model.pt            LoRA adapters in torchtune format (resume)
        recipe_state.pt             optimizer, LR scheduler, step, epoch, data position, RNG, seed, config
        logitless_checkpoint.json   written last: step, epoch, run id, size and sha256 of every file
    .tmp-step_000020-<run>-<pid>/   a save in progress, or a checkpoint being removed by retention
                                    (removed when the same run starts again)
    damaged/step_000020-<time>/     a step folder of this run that failed verification or lacked its
                                    marker, moved aside (never deleted) when the run resumed
    .logitless.lock                 held by the running process (:mod:`logitless.training.run_lock`)

Every save is first written to a temporary folder, then renamed into place with one
``os.replace``: an interrupted run leaves either the previous checkpoint or the new one. The
completion marker records each file's size and sha256, so a checkpoint damaged afterwards (a
truncated copy, a full disk) is recognised by :func:`verify_checkpoint` before resume loads it.

A run knows what it owns by its run id, recorded in ``logitless_run.json`` and in every marker;
a resume continues the run id of the checkpoint it starts from (:mod:`logitless.training.resume`
decides). Retention (``keep_last_n``) counts and deletes only checkpoints of that run id, first
renaming each to a temporary name, so no ``step_*`` folder is ever left without its marker; a save
never replaces a folder that another run wrote.

A save that fails with an OS error (a full disk, a quota, a lost mount) raises a
:class:`CheckpointSaveError` naming the checkpoint, the folder, the error and the space the
checkpoint needs against the space that was free; its partial files are removed and the earlier
checkpoints stay as they were. ``on_save_error`` (``stop`` or ``continue``) says whether the run
stops there or trains on and tries again at its next save.

Everything beyond the weights comes from :class:`logitless.training.export.ModelExport` (see
docs/export.md): with one, every folder is a model folder that transformers, PEFT and vLLM load.
"""

from __future__ import annotations

import datetime
import errno as errno_codes
import hashlib
import json
import logging
import os
import random
import re
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Union

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file
from torchtune import config as tt_config
from torchtune import training as tt_training
from torchtune.utils import get_logger

log = get_logger()

from logitless.training.config import Key
from logitless.training.export import ModelExport
from logitless.training.nonfinite import check_finite_weights

MARKER = "logitless_checkpoint.json"
RECIPE_STATE = "recipe_state.pt"
RUN_FILE = "logitless_run.json"
#: Where step folders that fail verification are moved, inside ``output_dir``.
DAMAGED_DIR = "damaged"
ON_SAVE_ERROR = ("stop", "continue")
ON_SAVE_ERROR_KEY = Key(str, default="stop", choices=ON_SAVE_ERROR,
                        doc="a checkpoint save that fails (disk full, any OS error): 'stop' the run with the "
                            "error, or 'continue' training and try again at the next save")
_STEP_PREFIX = "step_"
_HASH_BLOCK = 16 << 20
# What torch.save reports when its writer hits an OS error (it does not keep the errno).
_TORCH_WRITE_FAILURE = re.compile(r"inline_container|PytorchStreamWriter|file write failed|unexpected pos|iostream error")
_OS_ERROR_CODE = re.compile(r"os error (\d+)")  # safetensors' I/O errors carry the errno in the text


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint (or the run file) into ``output_dir`` failed with an OS error; the message
    names what, where, the error and the space needed. Nothing partial is left behind."""


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


def new_run_id() -> str:
    """A fresh run id: UTC start time and a random suffix, e.g. ``20260123-055501-3f9c2a1b``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8]


def read_run_file(output_dir: Union[str, os.PathLike]) -> Optional[Dict[str, Any]]:
    """The contents of ``output_dir/logitless_run.json``, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((Path(output_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None


def record_session(output_dir: Union[str, os.PathLike], run_id: str, *, resumed_from: Optional[str] = None,
                   recipe: Optional[str] = None, new_run: bool = False) -> Path:
    """Claims ``output_dir`` for ``run_id`` and appends this session to its run file (atomically).

    Args:
        output_dir: the run's output folder (created when missing).
        run_id (str): the run id this session writes under.
        resumed_from (Optional[str]): the checkpoint folder this session starts from.
        recipe (Optional[str]): the recipe's name, recorded.
        new_run (bool): claim the folder for a new run: fails if a run file exists (two runs started
            at once into one empty folder: the second one stops).

    Returns:
        Path: the run file.

    Raises:
        FileExistsError: ``new_run`` and the folder already has a run file.

    Example:
        >>> record_session("outputs/tiny_full", new_run_id(), recipe="full_sft_single_device")
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RUN_FILE
    if new_run:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # atomic claim
    prev = read_run_file(out)
    sessions = prev.get("sessions", []) if prev and prev.get("run_id") == run_id else []
    sessions.append({"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "recipe": recipe, "resumed_from": resumed_from, "pid": os.getpid()})
    text = json.dumps({"run_id": run_id, "sessions": sessions}, indent=2) + "\n"
    tmp = out / f".tmp-{RUN_FILE}-{os.getpid()}"
    free = _free_bytes(out)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise save_error(e, what=f"the run file {path}", folder=out, needed=len(text), free=free) from e
    return path


def _human(n: Optional[float]) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _free_bytes(path: Path) -> Optional[int]:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _state_nbytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) state: what saving it writes, give or take the headers."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(_state_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_nbytes(v) for v in obj)
    return 0


def _os_error_code(error: BaseException) -> Optional[int]:
    """The errno behind a failed write: an OSError's, or the one safetensors writes in its message."""
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno
    m = _OS_ERROR_CODE.search(str(error))
    return int(m.group(1)) if m else None


def save_error(error: BaseException, *, what: str, folder: Path, needed: int,
               free: Optional[int]) -> Optional[CheckpointSaveError]:
    """The :class:`CheckpointSaveError` for a write into ``folder`` that failed with ``error``, or None
    when ``error`` is not a write failure (a bug keeps its own exception and traceback).

    torch.save reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc] unexpected
    pos``, without the errno; such a failure, or any write failure while the file system has less free
    space than the checkpoint needs, is reported as "no space left on device".

    Args:
        error (BaseException): what the write raised.
        what (str): what was being written, e.g. ``"checkpoint step_000006"``.
        folder (Path): where.
        needed (int): bytes the whole write needs.
        free (Optional[int]): bytes free on ``folder``'s file system when the write began.

    Returns:
        Optional[CheckpointSaveError]: the error to raise.
    """
    code = _os_error_code(error)
    if code is None and not (isinstance(error, RuntimeError) and _TORCH_WRITE_FAILURE.search(str(error))):
        return None
    if code is None:  # torch.save's writer: a full disk is the likely cause when the space ran out
        free_now = _free_bytes(folder)
        full = (free is not None and free < needed) or (free_now is not None and free_now < (1 << 20))
    else:
        full = code == errno_codes.ENOSPC
    if full:
        cause = "no space left on device"
    elif code is not None:
        cause = f"{os.strerror(code)} (errno {code}, {errno_codes.errorcode.get(code, '?')})"
    else:
        cause = "the file could not be written"
    detail = str(error).strip()
    return CheckpointSaveError(
        f"could not write {what} to {folder}: {cause} ({type(error).__name__}: {detail}). It needs about "
        f"{_human(needed)}; {_human(free)} was free on that file system when the save began.")


def read_marker(checkpoint_dir: Union[str, os.PathLike]) -> Optional[Dict[str, Any]]:
    """The completion marker of a checkpoint folder, or None when it is missing or unreadable."""
    try:
        meta = json.loads((Path(checkpoint_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def file_digest(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of one file, as the completion marker records it."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_HASH_BLOCK)
            if not block:
                break
            h.update(block)
            size += len(block)
    return {"size": size, "sha256": h.hexdigest()}


def verify_checkpoint(checkpoint_dir: Union[str, os.PathLike]) -> List[str]:
    """Checks a checkpoint folder against its completion marker.

    Every file the marker lists must exist with the recorded size and sha256. A marker written
    before checksums were recorded (no ``files`` entry) is checked for the presence of its model
    files and ``recipe_state.pt`` only.

    Args:
        checkpoint_dir: a ``step_*`` folder.

    Returns:
        List[str]: the problems found, each naming the file (empty: the checkpoint verifies).

    Example:
        >>> verify_checkpoint("outputs/tiny_full/step_000050")
        ['outputs/tiny_full/step_000050/recipe_state.pt: 1024 bytes, the marker records 5123 (truncated?)']
    """
    d = Path(checkpoint_dir)
    if not d.is_dir():
        return [f"{d}: not a folder"]
    meta = read_marker(d)
    if meta is None:
        what = "missing" if not (d / MARKER).exists() else "unreadable"
        return [f"{d / MARKER}: {what} (the checkpoint was not completely written)"]
    files = meta.get("files")
    if files is None:  # written by an older logitless: presence only
        names = list(meta.get("model_files") or []) + [RECIPE_STATE]
        return [f"{d / n}: missing" for n in names if not (d / n).is_file()]
    problems = []
    for name, want in sorted(files.items()):
        f = d / name
        if not f.is_file():
            problems.append(f"{f}: missing")
            continue
        size = f.stat().st_size
        if size != want["size"]:
            problems.append(f"{f}: {size} bytes, the marker records {want['size']}"
                            f"{' (truncated?)' if size < want['size'] else ''}")
        elif file_digest(f)["sha256"] != want["sha256"]:
            problems.append(f"{f}: sha256 differs from the one the marker records (the file was modified or damaged)")
    return problems


def checkpoint_step(checkpoint_dir: Union[str, os.PathLike]) -> Optional[int]:
    """The step a ``step_NNNNNN`` folder name encodes, or None for another name."""
    name = Path(checkpoint_dir).name
    if not name.startswith(_STEP_PREFIX):
        return None
    try:
        return int(name[len(_STEP_PREFIX):])
    except ValueError:
        return None


@contextmanager
def _quiet_torchtune_checkpointer() -> Iterator[None]:
    """Drops the torchtune checkpointer's log lines (they name the temporary folder) while saving."""
    tt_log = logging.getLogger("torchtune.utils._logging")

    def keep(record: logging.LogRecord) -> bool:
        return record.module != "_checkpointer"

    tt_log.addFilter(keep)
    try:
        yield
    finally:
        tt_log.removeFilter(keep)


def step_folders(output_dir: str | os.PathLike) -> List[Path]:
    """Every ``step_*`` folder of ``output_dir``, complete or not, oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(checkpoint_step(d), d) for d in out.iterdir() if d.is_dir() and checkpoint_step(d) is not None]
    return [d for _, d in sorted(found)]


def set_aside(folder: Union[str, os.PathLike], reason: str) -> Path:
    """Moves a damaged step folder to ``<output_dir>/damaged/<name>-<UTC time>`` and logs why.

    A run does this only to its own step folders (a save that never completed, or one that fails
    verification) so that it can write that step again; nothing is deleted.

    Args:
        folder: the ``step_*`` folder.
        reason (str): why, for the log line.

    Returns:
        Path: where the folder now is.

    Example:
        >>> set_aside("outputs/run/step_000006", "logitless_checkpoint.json: missing")
        PosixPath('outputs/run/damaged/step_000006-20260123T055501Z')
    """
    src = Path(folder)
    dst_dir = src.parent / DAMAGED_DIR
    dst_dir.mkdir(exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dst = dst_dir / f"{src.name}-{stamp}"
    n = 1
    while dst.exists():
        n += 1
        dst = dst_dir / f"{src.name}-{stamp}-{n}"
    os.replace(src, dst)
    log.info(f"Moved {src} aside to {dst}: {reason}")
    return dst


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
    return [d for d in step_folders(output_dir) if (d / MARKER).is_file()]


class CheckpointManager:
    """Loads the initial weights, saves complete verified checkpoints atomically, keeps the last few.

    A manager writes for one run id (a lineage: the run and its resumes). The marker of every
    checkpoint it saves records that id with the size and sha256 of each file; retention
    (``keep_last_n``) counts and deletes only checkpoints of that id, up to the step just saved; a
    step folder written by another run is never replaced (``save`` raises instead), while an
    incomplete one of this run (no marker) is moved aside and written again. A save that fails with
    an OS error raises :class:`CheckpointSaveError` and leaves nothing partial. Log lines name final
    folders only: torchtune's checkpointer, which names the temporary one, is silenced while it writes.

    Args:
        checkpointer_cfg (Optional[DictConfig]): the recipe's ``checkpointer`` node (a torchtune
            checkpointer, normally ``FullModelHFCheckpointer``), or None when the model starts
            from random weights (checkpoints are then written in HF format by ``export`` when it
            can describe the model, else as torchtune-format safetensors).
        output_dir (str): where ``step_*`` folders go.
        is_rank_zero (bool): only rank 0 writes.
        keep_last_n (Optional[int]): delete this run's older checkpoints beyond this many.
        run_id (Optional[str]): the run id recorded in each marker (a fresh one when None; a recipe
            passes the one :func:`logitless.training.resume.start_run` chose).
        export (Optional[ModelExport]): completes each folder (tokenizer files, generation config,
            config dtype, PEFT adapter); None writes the weights and adapters only.
        on_save_error (str): ``"stop"`` (default) or ``"continue"``: what
            :meth:`record_save_outcome` does with a save that failed (raise, or log and go on).

    Example:
        >>> ckpt = CheckpointManager(cfg.checkpointer, cfg.output_dir, run_id=start.run_id)
        >>> sd = ckpt.load_model_state()                  # tune-format state dict
        >>> ckpt.save(step=10, epoch=0, model_state=model.state_dict(), recipe_state={...})
        >>> ckpt.log_final()                              # "final model: outputs/run/step_000010"
    """

    def __init__(self, checkpointer_cfg: Optional[DictConfig], output_dir: str, *, is_rank_zero: bool = True,
                 keep_last_n: Optional[int] = None, run_id: Optional[str] = None,
                 export: Optional[ModelExport] = None, on_save_error: str = "stop"):
        if on_save_error not in ON_SAVE_ERROR:
            raise ValueError(f"CheckpointManager: on_save_error must be one of {list(ON_SAVE_ERROR)}, "
                             f"got {on_save_error!r}")
        self.on_save_error = on_save_error
        self.failed_save: Optional[CheckpointSaveError] = None
        self.cfg = checkpointer_cfg
        self.export = export
        self.output_dir = Path(output_dir)
        self.is_rank_zero = is_rank_zero
        self.keep_last_n = keep_last_n
        self.run_id = run_id or new_run_id()
        self.last_saved: Optional[Path] = None
        self._checkpointer = None
        if is_rank_zero:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            for d in self.output_dir.glob(f".tmp-{_STEP_PREFIX}*-{self.run_id}-*"):
                shutil.rmtree(d, ignore_errors=True)  # leftovers of this run's interrupted save

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
            if meta.get("format") == "hf" and self.cfg is None:  # written by ModelExport (random init)
                if self.export is None or not self.export.writes_hf_weights:
                    raise ValueError(f"checkpoint {resume_dir}: HF weights written without a checkpointer; "
                                     f"reading them needs the run's ModelExport (a Qwen2 model)")
                return self.export.read_hf_weights(resume_dir, files)
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
        extra_meta: Optional[Dict[str, Any]] = None,
        extra_files: Optional[Mapping[str, Union[str, os.PathLike]]] = None,
    ) -> Optional[Path]:
        """Writes one complete checkpoint atomically (rank 0 only; other ranks return None).

        Args:
            step (int): optimizer steps done; names the folder ``step_{step:06d}``.
            epoch (int): current epoch (recorded).
            recipe_state (Dict[str, Any]): saved as ``recipe_state.pt``.
            model_state (Optional[Dict]): full tune-format weights (full fine-tuning, or merged LoRA);
                None to skip (adapter-only LoRA checkpoint).
            adapter_state (Optional[Dict]): LoRA adapter weights (tune format): saved as
                ``adapter_model.pt`` for resume, and in PEFT format under ``adapter/`` by ``export``.
            extra_meta (Optional[Dict]): recorded in the marker file.
            extra_files (Optional[Mapping[str, path]]): more files for the folder, as
                ``{name in the folder: source file}`` (e.g. tokenizer files); copied before the marker
                is written, so they are checksummed like the rest.

        Returns:
            Optional[Path]: the checkpoint folder on rank 0.

        Raises:
            FileExistsError: when ``step_{step:06d}`` exists and was written by another run.
            NonFiniteWeightsError: a weight holds NaN or inf; nothing is written.
            CheckpointSaveError: an OS error (a full disk...) stopped the write; its partial files are
                removed and the earlier checkpoints kept.
        """
        if not self.is_rank_zero:
            return None
        name = f"{_STEP_PREFIX}{step:06d}"
        for part in (model_state, adapter_state):
            if part is not None:
                check_finite_weights(part, what=f"checkpoint {name}")
        final = self.output_dir / name
        if final.exists():
            marker = read_marker(final)
            owner = (marker or {}).get("run_id")
            if marker is None and (read_run_file(self.output_dir) or {}).get("run_id") == self.run_id:
                set_aside(final, f"{final / MARKER} is missing or unreadable (a save of this run that never "
                                 f"completed); step {step} is written again now")
            elif owner != self.run_id:
                what = f"run {owner}" if owner else "another run (it has no completion marker)"
                raise FileExistsError(f"{final} was written by {what}, not by this run ({self.run_id}); "
                                      f"not replacing it")
        staging = self.output_dir / f".tmp-{name}-{self.run_id}-{os.getpid()}"
        needed = sum(_state_nbytes(x) for x in (model_state, adapter_state, recipe_state)) + \
            sum(os.path.getsize(src) for src in (extra_files or {}).values())
        free = _free_bytes(self.output_dir)
        try:
            meta = self._write(staging, step=step, epoch=epoch, recipe_state=recipe_state, model_state=model_state,
                               adapter_state=adapter_state, extra_meta=extra_meta, extra_files=extra_files)
            self._publish(staging / "epoch_0", final)
        except Exception as e:
            shutil.rmtree(staging, ignore_errors=True)
            error = save_error(e, what=f"checkpoint {name}", folder=self.output_dir, needed=needed, free=free)
            if error is None:
                raise
            newest = self.own_checkpoints()
            raise CheckpointSaveError(f"{error} The partial save was removed; the earlier checkpoints are kept "
                                      f"(newest: {newest[-1] if newest else 'none'}).") from e
        shutil.rmtree(staging, ignore_errors=True)
        size = sum(f["size"] for f in meta["files"].values())
        log.info(f"Saved checkpoint of step {step} to {final} ({len(meta['files']) + 1} files, "
                 f"{size / 1024 ** 3:.2f} GiB)")
        self.last_saved = final
        self._apply_retention(step)
        return final

    def _write(self, staging: Path, *, step: int, epoch: int, recipe_state: Dict[str, Any],
               model_state: Optional[Dict[str, torch.Tensor]], adapter_state: Optional[Dict[str, torch.Tensor]],
               extra_meta: Optional[Dict[str, Any]],
               extra_files: Optional[Mapping[str, Union[str, os.PathLike]]]) -> Dict[str, Any]:
        """Writes the whole checkpoint into ``staging/epoch_0``, its marker last; returns the marker."""
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        meta: Dict[str, Any] = {"step": step, "epoch": epoch, "run_id": self.run_id, "model_files": [],
                                "format": None}
        written = staging / "epoch_0"
        # Adapters never go through torchtune's checkpointer: its PEFT export permutes q/k rows for
        # every model (wrong for Qwen2); ModelExport writes them.
        if self.cfg is not None and model_state is not None:
            ckpt = self._checkpointer if self._checkpointer is not None else self._instantiate()
            if ckpt._weight_map is None:  # never loaded: load to learn the layout
                ckpt.load_checkpoint()
            prev = ckpt._output_dir
            ckpt._output_dir = staging  # torchtune 0.6.1 writes to <_output_dir>/epoch_<n>/
            try:
                with _quiet_torchtune_checkpointer():
                    ckpt.save_checkpoint({tt_training.MODEL_KEY: dict(model_state)}, epoch=0,
                                         intermediate_checkpoint=False)
            finally:
                ckpt._output_dir = prev
            meta["format"] = "hf"
            meta["model_files"] = sorted(p.name for p in written.glob("model-*.safetensors")) + \
                sorted(p.name for p in written.glob("model-*.bin"))
        else:
            written.mkdir()
            if model_state is not None and self.export is not None and self.export.writes_hf_weights:
                meta["format"] = "hf"
                meta["model_files"] = self.export.write_hf_weights(written, model_state)
            elif model_state is not None:
                save_file({k: v.contiguous() for k, v in model_state.items()}, str(written / "model.safetensors"))
                meta["format"] = "torchtune"
                meta["model_files"] = ["model.safetensors"]
        for stale in (MARKER, RECIPE_STATE, "adapter_model.pt"):  # copied from a resumed checkpoint folder
            (written / stale).unlink(missing_ok=True)
        if adapter_state is not None:
            torch.save(adapter_state, written / "adapter_model.pt")
        if self.export is not None:
            self.export.complete(written, model_state=model_state, adapter_state=adapter_state)
        for rel, src in (extra_files or {}).items():
            dst = written / rel
            if Path(rel).is_absolute() or ".." in Path(rel).parts or dst.name in (MARKER, RECIPE_STATE):
                raise ValueError(f"CheckpointManager.save: extra_files name {rel!r} must be a relative path "
                                 f"inside the checkpoint folder, other than {MARKER} and {RECIPE_STATE}")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        torch.save(recipe_state, written / RECIPE_STATE)
        meta.update(extra_meta or {})
        meta["files"] = {p.relative_to(written).as_posix(): file_digest(p)
                         for p in sorted(written.rglob("*")) if p.is_file()}
        (written / MARKER).write_text(json.dumps(meta, indent=2, default=str) + "\n")  # last: completes it
        _fsync_tree(written)
        return meta

    def _publish(self, written: Path, final: Path) -> None:
        """Renames a written checkpoint into place; the folder it replaces (this run's) is restored if that fails."""
        if not final.exists():
            os.replace(written, final)
        else:
            trash = self.output_dir / f".tmp-{final.name}-{self.run_id}-old-{os.getpid()}"
            os.replace(final, trash)
            try:
                os.replace(written, final)
            except BaseException:
                os.replace(trash, final)
                raise
            shutil.rmtree(trash, ignore_errors=True)
        _fsync_dir(self.output_dir)

    def own_checkpoints(self) -> List[Path]:
        """Complete checkpoints of ``output_dir`` written under this manager's run id, oldest first."""
        return [d for d in complete_checkpoints(self.output_dir) if (read_marker(d) or {}).get("run_id") == self.run_id]

    def _apply_retention(self, step: int) -> None:
        # Only this run's checkpoints up to the step just saved: a later step of this run (left by a
        # resume that fell back past a damaged checkpoint) is replaced when the run reaches it again.
        # Each is first renamed out of the step_* names, so a kill during the removal leaves no step
        # folder without its marker, only a temporary folder that the run removes when it starts again.
        if self.keep_last_n is None:
            return
        mine = [d for d in self.own_checkpoints() if checkpoint_step(d) <= step]
        for old in mine[: -self.keep_last_n]:
            trash = self.output_dir / f".tmp-{old.name}-{self.run_id}-removed-{os.getpid()}"
            os.replace(old, trash)
            shutil.rmtree(trash, ignore_errors=True)
            log.info(f"Removed checkpoint {old} (keep_last_n_checkpoints={self.keep_last_n})")

    def record_save_outcome(self, error: Optional[CheckpointSaveError]) -> None:
        """Applies ``on_save_error`` to the outcome of a save (every rank calls it with rank 0's outcome).

        Args:
            error (Optional[CheckpointSaveError]): None when the save succeeded.

        Raises:
            CheckpointSaveError: the save failed and ``on_save_error`` is ``stop``.
        """
        self.failed_save = error
        if error is None:
            return
        if self.on_save_error == "stop":
            raise CheckpointSaveError(f"{error} The run stops here (on_save_error=stop): free some space and "
                                      f"resume with resume_from_checkpoint=auto, or set on_save_error=continue "
                                      f"to train on and try again at each save.")
        if self.is_rank_zero:
            log.warning(f"{error} Training goes on (on_save_error=continue): the next save tries again.")

    def log_final(self, step: int) -> Optional[Path]:
        """Logs, once at the end of a run, the folder of the final model; returns it.

        Args:
            step (int): the step the run ended at.

        Returns:
            Optional[Path]: the checkpoint of ``step`` saved by this session, or None (other ranks,
            or no checkpoint of the last step).

        Raises:
            CheckpointSaveError: the run's last save failed (``on_save_error: continue``): what it
                trained since its last checkpoint is not saved.
        """
        if self.failed_save is not None:
            newest = self.own_checkpoints() if self.is_rank_zero else []
            raise CheckpointSaveError(f"The run ended at step {step}, but its last save failed, so the steps since "
                                      f"its newest checkpoint ({newest[-1] if newest else 'none'}) are not saved: "
                                      f"{self.failed_save}")
        if not self.is_rank_zero:
            return None
        if self.last_saved is not None and checkpoint_step(self.last_saved) == step:
            log.info(f"Final model (step {step}): {self.last_saved}")
            return self.last_saved
        newest = self.own_checkpoints()
        log.info(f"Run ended at step {step} without a checkpoint of that step (save_final_checkpoint: false); "
                 f"newest checkpoint of this run: {newest[-1] if newest else 'none'}")
        return None
