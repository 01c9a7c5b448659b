"""Metric loggers from config: torchtune's DiskLogger by default, W&B / TensorBoard / stdout by config."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from omegaconf import DictConfig
from torchtune import config as tt_config
from torchtune.training.metric_logging import DiskLogger


class _NullLogger:
    def log(self, *a: Any, **k: Any) -> None: ...
    def log_dict(self, *a: Any, **k: Any) -> None: ...
    def log_config(self, *a: Any, **k: Any) -> None: ...
    def close(self) -> None: ...


def build_metric_logger(logger_cfg: Optional[DictConfig], output_dir: str, *, is_rank_zero: bool = True):
    """Instantiates ``metric_logger`` from config, or a ``DiskLogger`` in ``<output_dir>/logs``.

    Args:
        logger_cfg (Optional[DictConfig]): a ``_component_`` node (e.g.
            ``torchtune.training.metric_logging.WandBLogger``) or None for the default.
        output_dir (str): the run's folder (default log location).
        is_rank_zero (bool): other ranks get a logger that drops everything.

    Returns:
        A torchtune ``MetricLoggerInterface`` (``log``, ``log_dict``, ``log_config``, ``close``).

    Example:
        >>> logger = build_metric_logger(None, "outputs/run")
        >>> logger.log_dict({"loss": 1.0}, step=1)
    """
    if not is_rank_zero:
        return _NullLogger()
    if logger_cfg is None:
        return DiskLogger(log_dir=os.path.join(output_dir, "logs"))
    return tt_config.instantiate(logger_cfg)


def read_disk_log(path: str) -> Dict[str, Dict[int, float]]:
    """Parses a torchtune ``DiskLogger`` file into ``{metric: {step: value}}``.

    Args:
        path (str): a ``log_*.txt`` file.

    Returns:
        Dict[str, Dict[int, float]]: the logged scalars; a later line for the same step wins.

    Example:
        >>> read_disk_log(glob.glob("outputs/run/logs/log_*.txt")[0])["loss"][1]
    """
    out: Dict[str, Dict[int, float]] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("Step "):
                continue
            head, _, rest = line.partition("|")
            step = int(head.split()[1])
            for item in rest.split():
                k, _, v = item.partition(":")
                try:
                    out.setdefault(k, {})[step] = float(v)
                except ValueError:
                    continue
    return out


