"""Completion tables of a GRPO run: prompt, completion, each reward, the total and the advantage.

Every ``log_completions_every_n_steps`` steps the first ``log_completions_num_rows`` completions of
the step (whole groups first, in batch order; on several ranks, rank 0's share) are

- appended to ``<output_dir>/logs/completions.jsonl``, one JSON object per completion:
  ``{"step", "prompt", "completion", "<reward name>"..., "reward", "advantage"}``, and for a
  multi-turn rollout ``"turns"``: each message after the prompt (the model's turns with their tool
  calls, the tool and environment answers), ``completion`` being the model's last turn;
- handed to the configured torchtune metric logger: a ``wandb.Table`` for ``WandBLogger``, a
  Markdown table (``add_text``) for ``TensorBoardLogger``, and one ``Completions step N | {json}``
  line per row for ``DiskLogger`` (its log file) and ``StdoutLogger`` (these lines never start
  with ``Step``, so scalar parsers such as :func:`logitless.training.metric_logging.read_disk_log`
  skip them). Other loggers get the JSONL file only.

Example:
    >>> log = CompletionLogger("outputs/run", logger, every_n_steps=10, num_rows=8)  # doctest: +SKIP
    >>> if log.due(step):  # doctest: +SKIP
    ...     log.log(step, prompts, completions, rewards, advantages)
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

__all__ = ["COMPLETIONS_FILE", "CompletionLogger", "completion_rows", "read_completions"]

#: The run's completion table, relative to ``output_dir``.
COMPLETIONS_FILE = os.path.join("logs", "completions.jsonl")
TEXT_PREFIX = "Completions step"


def completion_rows(step: int, prompts: Sequence[str], completions: Sequence[str],
                    rewards: Mapping[str, torch.Tensor], advantages: torch.Tensor,
                    num_rows: Optional[int] = None,
                    turns: Optional[Sequence[List[Dict[str, Any]]]] = None) -> List[Dict[str, Any]]:
    """The table's rows: one dict per completion, rewards under their configured names.

    Args:
        step (int): the GRPO step (1-based, as logged).
        prompts (Sequence[str]): N prompts (one per completion).
        completions (Sequence[str]): N completion texts.
        rewards (Mapping[str, torch.Tensor]): ``{name: (N,)}`` from ``compute_rewards``; ``"total"``
            is written as ``reward``.
        advantages (torch.Tensor): ``(N,)`` advantages of these completions.
        num_rows (Optional[int]): keep the first rows only (None: all).
        turns (Optional[Sequence[List[Dict]]]): per completion of a multi-turn rollout, the messages
            after its prompt (``Trajectory.turn_messages``).

    Returns:
        List[Dict[str, Any]]: ``{"step", "prompt", "completion", <name>..., "reward", "advantage"[, "turns"]}``.

    Example:
        >>> completion_rows(1, ["1+1="], ["2"], {"math_correctness": torch.ones(1), "total": torch.ones(1)},
        ...                 torch.zeros(1))[0]["reward"]
        1.0
    """
    n = len(completions)
    if (len(prompts) != n or len(advantages) != n or any(len(v) != n for v in rewards.values())
            or (turns is not None and len(turns) != n)):
        raise ValueError(f"completion table: {len(prompts)} prompts, {n} completions, {len(advantages)} advantages "
                         f"and rewards of lengths {[len(v) for v in rewards.values()]}; expected one each")
    names = [k for k in rewards if k != "total"]
    values = {k: rewards[k].tolist() for k in rewards}
    adv = advantages.detach().float().cpu().tolist()
    rows = []
    for i in range(n if num_rows is None else min(n, num_rows)):
        row: Dict[str, Any] = {"step": step, "prompt": prompts[i], "completion": completions[i]}
        row.update({k: values[k][i] for k in names})
        row["reward"] = values["total"][i] if "total" in values else sum(values[k][i] for k in names)
        row["advantage"] = adv[i]
        if turns is not None:
            row["turns"] = [_turn(m) for m in turns[i]]
        rows.append(row)
    return rows


def _turn(message: Mapping[str, Any]) -> Dict[str, Any]:
    """A message as the table shows it: role, content, and the tool calls and call errors it made."""
    out = {"role": message.get("role"), "content": message.get("content", "")}
    if message.get("tool_calls"):
        out["tool_calls"] = [c.get("function", c) for c in message["tool_calls"]]
    if message.get("tool_call_errors"):
        out["tool_call_errors"] = list(message["tool_call_errors"])
    return out


def read_completions(path: str) -> List[Dict[str, Any]]:
    """Rows of a ``completions.jsonl`` file (or of a DiskLogger file's ``Completions step`` lines).

    Example:
        >>> rows = read_completions("outputs/tiny_grpo/logs/completions.jsonl")  # doctest: +SKIP
        >>> [(r["completion"], r["reward"]) for r in rows if r["step"] == 10]  # doctest: +SKIP
    """
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith(TEXT_PREFIX):
                line = line.partition("|")[2].strip()
            elif not line.startswith("{"):
                continue
            rows.append(json.loads(line))
    return rows


def _markdown(rows: List[Dict[str, Any]]) -> str:
    cols = list(rows[0])

    def esc(v: Any) -> str:
        return (f"{v:.4g}" if isinstance(v, float) else str(v)).replace("|", "\\|").replace("\n", "\\n")

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(esc(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def log_table(metric_logger: Any, step: int, rows: List[Dict[str, Any]]) -> None:
    """Hands the rows to a torchtune metric logger in the form it supports (see the module docstring)."""
    if not rows:
        return
    kind = type(metric_logger).__name__
    if kind == "WandBLogger":
        wandb = getattr(metric_logger, "_wandb", None)
        if wandb is not None and wandb.run is not None:
            cols = list(rows[0])
            cell = lambda v: json.dumps(v, ensure_ascii=False) if isinstance(v, list) else v  # noqa: E731 (turns)
            wandb.log({"completions": wandb.Table(columns=cols, data=[[cell(r[c]) for c in cols] for r in rows]),
                       "global_step": step})
    elif kind == "TensorBoardLogger":
        writer = getattr(metric_logger, "_writer", None)
        if writer is not None:
            writer.add_text("completions", _markdown(rows), global_step=step)
    elif kind in ("DiskLogger", "StdoutLogger"):
        text = "".join(f"{TEXT_PREFIX} {step} | {json.dumps(r, ensure_ascii=False)}\n" for r in rows)
        handle = getattr(metric_logger, "_file", None)
        if handle is not None:
            handle.write(text)
            handle.flush()
        else:
            print(text, end="", flush=True)


class CompletionLogger:
    """Writes a step's completion table to the run folder and the metric logger (module docstring).

    Args:
        output_dir (str): the run's folder (the table goes to ``<output_dir>/logs/completions.jsonl``).
        metric_logger: the run's torchtune metric logger.
        every_n_steps (Optional[int]): log at steps divisible by this (None: never).
        num_rows (Optional[int]): completions per table (None: the whole step).
        enabled (bool): False on ranks other than 0.

    Example:
        >>> log = CompletionLogger("outputs/run", logger, every_n_steps=10, num_rows=8)  # doctest: +SKIP
    """

    def __init__(self, output_dir: str, metric_logger: Any, *, every_n_steps: Optional[int],
                 num_rows: Optional[int] = 8, enabled: bool = True):
        self.path = os.path.join(output_dir, COMPLETIONS_FILE)
        self.metric_logger = metric_logger
        self.every_n_steps = every_n_steps
        self.num_rows = num_rows
        self.enabled = enabled and every_n_steps is not None

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1-based) logs a table."""
        return self.enabled and step % self.every_n_steps == 0

    def log(self, step: int, prompts: Sequence[str], completions: Sequence[str],
            rewards: Mapping[str, torch.Tensor], advantages: torch.Tensor,
            turns: Optional[Sequence[List[Dict[str, Any]]]] = None) -> List[Dict[str, Any]]:
        """Appends the table of step ``step`` to the JSONL file and hands it to the metric logger
        (``turns``: see :func:`completion_rows`).

        Returns:
            List[Dict[str, Any]]: the rows written.
        """
        rows = completion_rows(step, prompts, completions, rewards, advantages, self.num_rows, turns)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        log_table(self.metric_logger, step, rows)
        return rows
