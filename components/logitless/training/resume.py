"""Starting a run: a new run in an empty folder, or a verified resume that continues a run's lineage.

:func:`start_run` runs before the model is built, once the run holds the lock on ``output_dir``
(:mod:`logitless.training.run_lock`: no other process writes there meanwhile). It decides, on rank
0, what the run starts from:

- ``resume_from_checkpoint: false``: a new run with a fresh run id. ``output_dir`` must be empty (or
  absent): a run never writes into, deletes from or overwrites another run's folder. A folder that
  holds only a run that saved no checkpoint (its run file and logs) is taken over, with a log line.
- ``true`` / ``"auto"``: the newest checkpoint of ``output_dir`` that verifies against its marker
  (sizes and sha256, :func:`~logitless.training.checkpoint.verify_checkpoint`); every newer step
  folder is skipped with a message naming the file and the problem (a missing marker included).
  ``true`` fails when none verifies; ``"auto"`` starts fresh in an empty folder (or restarts a run
  that saved nothing yet).
- a checkpoint folder path: that checkpoint, which must verify. ``output_dir`` must be empty or hold
  the same run, with no checkpoint past the one resumed.

Step folders of the run being continued that fail verification or never got their marker are
moved to ``output_dir/damaged/`` (:func:`~logitless.training.checkpoint.set_aside`, with the
reason in the log), so the run writes those steps again when it reaches them; step folders of
another run are never moved.

A resume continues the run id of its checkpoint, so retention keeps counting that lineage only.
The saved config (``recipe_state["config"]``) is compared with the new one: every changed key is
logged in one block; keys that break exact resume (the recipe's ``fixed_keys``: batch geometry,
seed, data, model...) are refused with a :class:`~logitless.training.config.ConfigError` listing
them, unless named in ``resume_allow_changes``. Changed optimizer hyper-parameters are applied to
the loaded optimizer by :func:`apply_optimizer_changes` (the saved state would otherwise win).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from logitless.training.checkpoint import (RUN_FILE, CheckpointManager, CheckpointSaveError, checkpoint_step,
                                          complete_checkpoints, log, new_run_id, read_marker, read_run_file,
                                          record_session, set_aside, step_folders, verify_checkpoint)
from logitless.training.config import ConfigError, Key, config_summary
from logitless.training.data_fingerprint import with_data_fingerprints
from logitless.training.run_lock import LOCK_FILE

RESUME_KEYS: Dict[str, Key] = {
    "resume_from_checkpoint": Key((bool, str), default=False,
                                  doc="false, true, 'auto' (newest checkpoint of output_dir that verifies; fresh "
                                      "when there is none) or a checkpoint folder"),
    "resume_allow_changes": Key(list, default=[],
                                doc="keys that may differ from the resumed checkpoint's config although they "
                                    "break exact resume, e.g. [seed, batch_size]"),
}
# Keys whose difference says nothing about the training itself.
_NOT_COMPARED = ("resume_from_checkpoint", "resume_allow_changes")
_ABSENT = "<absent>"
_ALLOWED_NOTE = "  (allowed by resume_allow_changes)"
# What a run leaves in output_dir before its first checkpoint: its run file and its logs.
_NOTHING_SAVED = (RUN_FILE, "logs", "torchtune_config.yaml")


@dataclass
class RunStart:
    """What :func:`start_run` decided.

    Args:
        run_id (str): the lineage this session writes under (give it to the CheckpointManager).
        checkpoint (Optional[Path]): the verified checkpoint to resume from, or None (fresh start).
        recipe_state (Optional[Dict]): its ``recipe_state.pt``.
        changes (Dict[str, Tuple[Any, Any]]): every config key that differs from the checkpoint's
            config, as ``{dotted key: (saved, now)}``.
    """

    run_id: str
    checkpoint: Optional[Path] = None
    recipe_state: Optional[Dict[str, Any]] = None
    changes: Dict[str, Tuple[Any, Any]] = field(default_factory=dict)


def _matches(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def validate_resume_config(cfg: DictConfig, fixed_keys: Sequence[str]) -> None:
    """Checks ``resume_from_checkpoint`` and ``resume_allow_changes`` (after :func:`validate_config`).

    Args:
        cfg (DictConfig): the recipe config.
        fixed_keys (Sequence[str]): the recipe's keys that break exact resume (dotted prefixes).

    Raises:
        ConfigError: naming the key, the value and what was expected.
    """
    r = cfg.resume_from_checkpoint
    if isinstance(r, str) and r != "auto" and not Path(r).is_dir():
        raise ConfigError(f"config key 'resume_from_checkpoint': {r!r} is not a folder; expected true, false, "
                          f"'auto' or a checkpoint folder (output_dir/step_NNNNNN)")
    allowed = cfg.resume_allow_changes
    allowed = OmegaConf.to_container(allowed) if isinstance(allowed, ListConfig) else allowed
    for a in allowed:
        if not isinstance(a, str) or not any(_matches(a, f) or _matches(f, a) for f in fixed_keys):
            raise ConfigError(f"config key 'resume_allow_changes': {a!r} is not a key that a resume refuses; "
                              f"expected entries among {list(fixed_keys)} (or keys under them)")


def _flatten(d: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(d, Mapping) and d:
        out: Dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: d}


def config_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> Dict[str, Tuple[Any, Any]]:
    """Every dotted key whose value differs between two config summaries.

    Args:
        saved (Mapping): the checkpoint's ``config_summary``.
        now (Mapping): this run's.

    Returns:
        Dict[str, Tuple[Any, Any]]: ``{key: (saved, now)}``, ``"<absent>"`` for a missing side.

    Example:
        >>> config_changes({"seed": 0, "optimizer": {"lr": 1e-3}}, {"seed": 0, "optimizer": {"lr": 2e-3}})
        {'optimizer.lr': (0.001, 0.002)}
    """
    a, b = _flatten(dict(saved)), _flatten(dict(now))
    out = {}
    for k in sorted(set(a) | set(b)):
        if any(_matches(k, n) for n in _NOT_COMPARED):
            continue
        va, vb = a.get(k, _ABSENT), b.get(k, _ABSENT)
        if va != vb:
            out[k] = (va, vb)
    return out


def _occupied(out: Path, entries: List[str], run: Optional[Dict[str, Any]]) -> ConfigError:
    shown = ", ".join(entries[:8]) + (f" and {len(entries) - 8} more" if len(entries) > 8 else "")
    ids = {run["run_id"]} if run and run.get("run_id") else set()
    ids |= {m["run_id"] for m in map(read_marker, complete_checkpoints(out)) if m and m.get("run_id")}
    owner = f"files of run {', '.join(sorted(ids))}" if ids else "files of another run"
    return ConfigError(
        f"config key 'output_dir': {str(out)!r} is not empty: it holds {owner} ({shown}). A new run never writes "
        f"into another run's folder (its checkpoints could be replaced or deleted by retention). Either resume "
        f"that run (resume_from_checkpoint=auto, or resume_from_checkpoint=<a checkpoint folder>), or choose "
        f"another output_dir.")


def _saved_nothing(entries: List[str], run: Optional[Dict[str, Any]]) -> bool:
    """The folder holds only what a run that never saved a checkpoint leaves: its run file and logs."""
    return bool(run and run.get("run_id")) and RUN_FILE in entries and set(entries) <= set(_NOTHING_SAVED)


@dataclass
class _Decision:
    """Rank 0's decision, broadcast to every rank."""

    checkpoint: Optional[Path]
    run_id: str
    notes: List[str] = field(default_factory=list)
    set_aside: List[Tuple[Path, str]] = field(default_factory=list)  # this run's damaged step folders


def _damaged_own(problems: Mapping[Path, List[str]], run_id: str, run: Optional[Dict[str, Any]],
                 resume_step: int) -> Tuple[List[Tuple[Path, str]], List[str]]:
    """Which damaged step folders are this run's (moved aside) and which are left (noted)."""
    aside, notes = [], []
    run_file_id = (run or {}).get("run_id")
    for d in sorted(problems, key=checkpoint_step):
        meta = read_marker(d)
        owner = meta.get("run_id") if meta else run_file_id  # no marker: the folder's run wrote it
        if owner == run_id:
            then = (f"the run writes step {checkpoint_step(d)} again when it gets there"
                    if checkpoint_step(d) > resume_step else "it is older than the step the run starts from")
            aside.append((d, f"{'; '.join(problems[d])}; {then}"))
        else:
            notes.append(f"Leaving {d} in place: it does not verify ({'; '.join(problems[d])}) but it is not this "
                         f"run's ({run_id}); a save of step {checkpoint_step(d)} will refuse to replace it")
    return aside, notes


def _decide(cfg: DictConfig) -> _Decision:
    """Rank 0's decision: the checkpoint (or None), the run id, log lines, folders to move aside."""
    out = Path(cfg.output_dir)
    entries = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) if out.is_dir() else []
    run = read_run_file(out)
    r = cfg.resume_from_checkpoint
    key = "config key 'resume_from_checkpoint'"
    if r is False:
        if not entries:
            return _Decision(None, new_run_id())
        if _saved_nothing(entries, run):
            return _Decision(None, new_run_id(), notes=[
                f"{out} holds run {run['run_id']}, which saved no checkpoint ({', '.join(entries)}): starting a new "
                f"run in its place. Its {RUN_FILE} is replaced; its logs are kept."])
        raise _occupied(out, entries, run)
    folders = step_folders(out)
    if isinstance(r, str) and r != "auto":
        ckpt = Path(r)
        problems = verify_checkpoint(ckpt)
        if problems:
            raise ConfigError(f"{key}: checkpoint {r!r} does not verify: " + "; ".join(problems))
        meta = read_marker(ckpt)
        inside = ckpt.resolve().parent == out.resolve()
        if entries and not inside and (run is None or run.get("run_id") != meta.get("run_id")):
            raise _occupied(out, entries, run)
        step = meta.get("step", checkpoint_step(ckpt)) or 0  # the marker's step: the folder may be renamed
        later = [d.name for d in complete_checkpoints(out) if checkpoint_step(d) > step]
        if later:
            raise ConfigError(f"{key}: output_dir {str(out)!r} holds checkpoints past {ckpt.name} ({', '.join(later)}); "
                              f"resuming {ckpt} there would mix two histories of the run. Resume into another "
                              f"output_dir (the checkpoint path can stay as it is)")
        run_id = meta.get("run_id") or new_run_id()
        incomplete = {d: verify_checkpoint(d) for d in folders if read_marker(d) is None}
        aside, notes = _damaged_own(incomplete, run_id, run, step)
        return _Decision(ckpt, run_id, [f"Resuming from {ckpt} (resume_from_checkpoint)", *notes], aside)
    # true / auto: the newest step folder that verifies; every newer one is named with its problems.
    notes, problems = [], {}
    chosen = None
    for d in reversed(folders):
        found = verify_checkpoint(d)
        if not found:
            chosen = d
            break
        problems[d] = found
        notes.append(f"Skipping checkpoint {d}: " + "; ".join(found))
    # older folders without a marker (never completed; not loaded, so not hashed)
    problems.update({d: verify_checkpoint(d) for d in folders
                     if d not in problems and d != chosen and read_marker(d) is None})
    if chosen is not None:
        meta = read_marker(chosen)
        run_id = meta.get("run_id") or new_run_id()
        step = meta.get("step", checkpoint_step(chosen)) or 0
        newer = [d.name for d in problems if checkpoint_step(d) > checkpoint_step(chosen)]
        why = f" (skipped newer, not verifying: {', '.join(newer)})" if newer else ""
        aside, left = _damaged_own(problems, run_id, run, step)
        return _Decision(chosen, run_id, [*notes, *left,
                                          f"Resuming from {chosen}: the newest checkpoint of {out} that verifies{why}"],
                         aside)
    completed = [d for d in problems if read_marker(d) is not None]
    if completed:
        raise ConfigError(f"{key}: {r!r}, but no checkpoint in {str(out)!r} verifies: "
                          + " | ".join(f"{d.name}: " + "; ".join(p) for d, p in problems.items()))
    if r is True:
        never = f" ({', '.join(d.name for d in problems)} never completed)" if problems else ""
        raise ConfigError(f"{key}: true, but {str(out)!r} holds no complete checkpoint{never} "
                          f"(use 'auto' to start fresh when there is none)")
    if not entries:
        return _Decision(None, new_run_id(), [f"No checkpoint in {out}: starting a new run (resume_from_checkpoint=auto)"])
    if run is not None and run.get("run_id"):
        aside, left = _damaged_own(problems, run["run_id"], run, 0)
        return _Decision(None, run["run_id"], [*notes, *left, f"Run {run['run_id']} in {out} saved no checkpoint yet: "
                                               f"starting it again from step 0 (resume_from_checkpoint=auto)"], aside)
    raise _occupied(out, entries, run)


def _refused(changes: Mapping[str, Tuple[Any, Any]], fixed_keys: Sequence[str],
             allowed: Sequence[str]) -> List[str]:
    return [k for k in changes if any(_matches(k, f) for f in fixed_keys)
            and not any(_matches(k, a) for a in allowed)]


def start_run(cfg: DictConfig, *, fixed_keys: Sequence[str], runtime, recipe: Optional[str] = None) -> RunStart:
    """Decides what the run starts from, claims ``output_dir``, and checks the resumed config.

    Call it before the model is built. Rank 0 inspects ``output_dir`` and verifies checkpoints; every
    rank gets its decision (or its error).

    Args:
        cfg (DictConfig): the validated recipe config.
        fixed_keys (Sequence[str]): dotted keys (or prefixes) that may not change on resume unless
            named in ``resume_allow_changes``.
        runtime: the :class:`~logitless.training.distributed.Runtime` (``is_rank_zero``,
            ``broadcast_object``).
        recipe (Optional[str]): the recipe's name, recorded in the run file.

    Returns:
        RunStart: the run id, the checkpoint and its recipe state, the config changes.

    Raises:
        ConfigError: the folder belongs to another run, no checkpoint verifies (``true``, or a given
            path), or refused keys changed.

    Example:
        >>> start = start_run(cfg, fixed_keys=("batch_size", "seed"), runtime=runtime)
        >>> ckpt = CheckpointManager(cfg.checkpointer, cfg.output_dir, run_id=start.run_id)
    """
    decision: Any = None
    if runtime.is_rank_zero:
        try:
            decision = _decide(cfg)
        except ConfigError as e:
            decision = e
    decision = runtime.broadcast_object(decision)
    if isinstance(decision, ConfigError):
        raise decision
    checkpoint, run_id, notes = decision.checkpoint, decision.run_id, list(decision.notes)
    start = RunStart(run_id=run_id, checkpoint=checkpoint)
    if checkpoint is not None:
        start.recipe_state = CheckpointManager.load_recipe_state(checkpoint)
        saved = start.recipe_state.get("config")
        if saved is None:
            notes.append(f"{checkpoint} records no config: changes cannot be checked")
        else:
            start.changes = config_changes(saved, with_data_fingerprints(config_summary(cfg), cfg, saved=saved))
            allowed = list(cfg.get("resume_allow_changes") or [])
            refused = _refused(start.changes, fixed_keys, allowed)
            if refused:
                raise ConfigError(
                    "config keys changed since the checkpoint, which breaks exact resume: "
                    + "; ".join(f"'{k}': {start.changes[k][0]!r} -> {start.changes[k][1]!r}" for k in refused)
                    + f" (checkpoint {checkpoint}). Restore them, start a new run in another output_dir, or "
                    f"accept them with resume_allow_changes=[{', '.join(refused)}]")
            if start.changes:
                notes.append(f"Config changed since {checkpoint.name} (saved -> now):\n" + "\n".join(
                    f"  {k}: {a!r} -> {b!r}{_ALLOWED_NOTE if any(_matches(k, x) for x in allowed) else ''}"
                    for k, (a, b) in start.changes.items()))
    outcome: Any = None
    if runtime.is_rank_zero:  # the decision stands: repair this run's damage and record the session
        try:
            for n in notes:
                log.info(n)
            for folder, why in decision.set_aside:
                set_aside(folder, why)
            out = Path(cfg.output_dir)
            try:
                record_session(out, run_id, recipe=recipe, resumed_from=None if checkpoint is None else str(checkpoint),
                               new_run=checkpoint is None and read_run_file(out) is None)
            except FileExistsError:  # another process claimed the folder since _decide
                raise _occupied(out, sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE),
                                read_run_file(out)) from None
        except (ConfigError, CheckpointSaveError) as e:
            outcome = e
    outcome = runtime.broadcast_object(outcome)
    if outcome is not None:
        raise outcome
    return start


def apply_optimizer_changes(optimizer: torch.optim.Optimizer, lr_scheduler: Optional[Any],
                            changes: Mapping[str, Tuple[Any, Any]], *, log_rank_zero: bool = True) -> List[str]:
    """Applies changed ``optimizer.*`` hyper-parameters to an optimizer whose saved state was loaded.

    Loading an optimizer state restores the saved param-group settings (lr, weight decay, betas...);
    a resume with new values in the config applies them here. A new ``lr`` also becomes the LR
    scheduler's base (``base_lrs``, ``initial_lr``) and the current lr is rescaled to the schedule's
    factor at this step.

    Args:
        optimizer (torch.optim.Optimizer): with the saved state loaded.
        lr_scheduler (Optional): with the saved state loaded (a ``LambdaLR`` or any scheduler with
            ``base_lrs``), or None.
        changes (Mapping): :attr:`RunStart.changes`.
        log_rank_zero (bool): log the applied changes (rank 0).

    Returns:
        List[str]: one line per applied change, ``"optimizer.lr: 0.003 -> 0.001 applied"``.

    Raises:
        ConfigError: a changed ``optimizer.*`` key is not a param-group setting of this optimizer.

    Example:
        >>> apply_optimizer_changes(opt, sched, {"optimizer.lr": (3e-3, 1e-3)})
        ['optimizer.lr: 0.003 -> 0.001 applied (param groups and LR scheduler base_lrs)']
    """
    lines = []
    for key, (old, new) in changes.items():
        if not key.startswith("optimizer.") or key.count(".") != 1 or key == "optimizer._component_":
            continue
        name = key.split(".", 1)[1]
        if any(name not in g for g in optimizer.param_groups) or new == _ABSENT:
            raise ConfigError(f"config key '{key}': changed since the checkpoint ({old!r} -> {new!r}) but it is not a "
                              f"setting of {type(optimizer).__name__}'s param groups that can be applied to the "
                              f"loaded optimizer; restore it or start a new run")
        value = tuple(new) if isinstance(new, list) else new
        if name == "lr" and lr_scheduler is not None and hasattr(lr_scheduler, "base_lrs"):
            lambdas = getattr(lr_scheduler, "lr_lambdas", None)
            for i, g in enumerate(optimizer.param_groups):
                old_base = lr_scheduler.base_lrs[i]
                if lambdas is not None:
                    factor = lambdas[i](lr_scheduler.last_epoch)
                else:
                    factor = g["lr"] / old_base if old_base else 1.0
                lr_scheduler.base_lrs[i] = value
                g["initial_lr"] = value
                g["lr"] = value * factor
            if hasattr(lr_scheduler, "_last_lr"):
                lr_scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
            where = "param groups and LR scheduler base_lrs"
        else:
            for g in optimizer.param_groups:
                g[name] = value
            where = "param groups"
        lines.append(f"{key}: {old!r} -> {new!r} applied ({where})")
    if lines and log_rank_zero:
        log.info("Optimizer settings changed on resume:\n  " + "\n  ".join(lines))
    return lines


__all__ = ["RESUME_KEYS", "RunStart", "apply_optimizer_changes", "config_changes", "start_run",
           "validate_resume_config"]
