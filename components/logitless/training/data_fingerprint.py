"""Fingerprints of the local data files a run reads, so that a resume onto changed data is refused.

A checkpoint records, next to its config, the size and a sha256 of every local file its ``dataset``
and ``eval_dataset`` read (their ``data_files``, ``data_dir``, or a local ``source`` folder). A resume
compares them with the files as they are now, through the same mechanism as the config keys that
break exact resume: the fingerprints join the compared config summary under ``data_fingerprint``,
and a changed training file (``data_fingerprint.dataset``) is refused unless
``resume_allow_changes`` names ``data_fingerprint``; a changed evaluation file is only reported, as
a changed ``eval_dataset`` key is.

The hash covers every byte of a file up to :data:`FULL_HASH_MAX_BYTES` (1 GiB, about a second to
read); a larger file is fingerprinted by its size and the sha256 of its first and last
:data:`SAMPLE_BYTES` (16 MiB each), which the recorded string says. Hub datasets (``source:
openai/gsm8k``) and the data bundled with the package have no local file named in the config and
are not fingerprinted. A file's hash is computed once per process while its size, inode and
modification times stay the same (each save records the files as they are then).

Example:
    >>> data_fingerprints(cfg)
    {'dataset': {'data/train.jsonl': '183204 bytes, sha256 9f2c...'}}
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any, Dict, List, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from logitless.datasets._files import local_data_files
from logitless.training.config import LOCAL_DATASET_LOADERS

#: The config-summary key the fingerprints are compared under (``resume_allow_changes: [data_fingerprint]``).
FINGERPRINT_KEY = "data_fingerprint"
#: Data components whose files are fingerprinted.
DATA_KEYS = ("dataset", "eval_dataset")
#: Files up to this size are hashed whole.
FULL_HASH_MAX_BYTES = 1 << 30
#: Bytes hashed at each end of a larger file.
SAMPLE_BYTES = 16 << 20
_BLOCK = 1 << 20


def data_files_of(node: Any) -> List[str]:
    """The local files a data component reads, as its config names them: ``data_files`` (a path, a
    list, a ``{split: ...}`` mapping, globs expanded), every file under ``data_dir``, and every file
    under a ``source`` that is a local path.

    Example:
        >>> data_files_of(OmegaConf.create({"_component_": "...", "source": "json", "data_files": "a.jsonl"}))
        ['a.jsonl']
    """
    if not isinstance(node, (DictConfig, Mapping)):
        return []
    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    files = local_data_files(values.get("data_files"))
    source = values.get("source")
    for folder in (values.get("data_dir"), None if source in LOCAL_DATASET_LOADERS else source):
        if isinstance(folder, str) and os.path.exists(folder):
            files += [folder] if os.path.isfile(folder) else sorted(
                os.path.join(root, f) for root, _, names in os.walk(folder) for f in names)
    return [f for f in dict.fromkeys(files) if os.path.isfile(f)]


def _amount(n: int) -> str:
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n} bytes"


@functools.lru_cache(maxsize=256)
def _fingerprint(path: str, size: int, changed: tuple) -> str:
    del changed  # part of the cache key only: a rewritten file is hashed again
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FULL_HASH_MAX_BYTES:
            for block in iter(lambda: f.read(_BLOCK), b""):
                digest.update(block)
            return f"{size} bytes, sha256 {digest.hexdigest()}"
        digest.update(f.read(SAMPLE_BYTES))
        f.seek(size - SAMPLE_BYTES)
        digest.update(f.read(SAMPLE_BYTES))
    return f"{size} bytes, sha256 of the first and last {_amount(SAMPLE_BYTES)} {digest.hexdigest()}"


def file_fingerprint(path: str) -> str:
    """``"<size> bytes, sha256 <hex>"`` of a file (of its first and last 16 MiB above 1 GiB, as it says).

    Example:
        >>> file_fingerprint("data/train.jsonl")
        '183204 bytes, sha256 9f2c...'
    """
    st = os.stat(path)
    return _fingerprint(os.path.realpath(path), st.st_size, (st.st_ino, st.st_mtime_ns, st.st_ctime_ns))


def data_fingerprints(cfg: DictConfig, keys: tuple = DATA_KEYS) -> Dict[str, Dict[str, str]]:
    """``{data key: {file as the config names it: fingerprint}}`` for every data component of ``cfg``.

    Args:
        cfg (DictConfig): the recipe config.
        keys (tuple): its data components.

    Returns:
        Dict[str, Dict[str, str]]: one entry per key present (empty when it names no local file).
    """
    return {k: {f: file_fingerprint(f) for f in data_files_of(cfg.get(k))} for k in keys if cfg.get(k) is not None}


def with_data_fingerprints(summary: Dict[str, Any], cfg: DictConfig, *,
                           saved: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """``summary`` (a :func:`~logitless.training.config.config_summary`) with the data fingerprints
    under ``data_fingerprint``: what a checkpoint records, and what a resume compares with it.

    Args:
        summary (Dict[str, Any]): the config summary.
        cfg (DictConfig): the config whose data files are fingerprinted.
        saved (Optional[Mapping]): the checkpoint's recorded summary, when comparing with one: a
            checkpoint that records no fingerprints (written before they were) is compared without them.

    Returns:
        Dict[str, Any]: a new dict.
    """
    if saved is not None and FINGERPRINT_KEY not in saved:
        return dict(summary)
    return {**summary, FINGERPRINT_KEY: data_fingerprints(cfg)}


__all__ = ["DATA_KEYS", "FINGERPRINT_KEY", "FULL_HASH_MAX_BYTES", "SAMPLE_BYTES", "data_files_of",
           "data_fingerprints", "file_fingerprint", "with_data_fingerprints"]
