"""Data loading with a resumable, seeded sampler: the order of every epoch is a function of the seed."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX, padded_collate_packed, padded_collate_sft


class ResumableSampler(Sampler[int]):
    """Shuffled (or sequential) indices for one rank, restartable mid-epoch.

    The order of epoch ``e`` is ``randperm(n, seed + e)`` split across ranks as
    ``torch.utils.data.DistributedSampler`` does (padded to equal shares, ``drop_last=False``).
    ``set_epoch(e, start=k)`` makes the next iteration skip the first ``k`` indices of this rank,
    which is how a resumed run continues exactly where the interrupted one stopped.

    Args:
        dataset_len (int): number of samples.
        shuffle (bool): shuffle each epoch.
        seed (int): base seed.
        rank (int): this process's rank.
        world_size (int): number of ranks.

    Example:
        >>> s = ResumableSampler(10, shuffle=True, seed=0)
        >>> s.set_epoch(0, start=4); len(list(s))
        6
    """

    def __init__(self, dataset_len: int, shuffle: bool = True, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        if dataset_len <= 0:
            raise ValueError(f"ResumableSampler: the dataset is empty (dataset_len={dataset_len})")
        self.n, self.shuffle, self.seed, self.rank, self.world_size = dataset_len, shuffle, seed, rank, world_size
        self.num_samples = -(-dataset_len // world_size)
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def indices(self) -> list:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.num_samples * self.world_size
        order = (order * (-(-total // self.n)))[:total]
        return order[self.rank:total:self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start


def is_packed(dataset: Dataset) -> bool:
    """True for torchtune's ``PackedDataset`` (rows carry ``input_pos`` and ``seq_lens``)."""
    from torchtune.datasets import PackedDataset

    return isinstance(dataset, PackedDataset)


def build_dataloader(
    dataset: Dataset,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    padding_idx: int = 0,
    ignore_index: int = CROSS_ENTROPY_IGNORE_IDX,
    collate_fn: Optional[Callable] = None,
    num_workers: int = 0,
) -> DataLoader:
    """A DataLoader over ``dataset`` with a :class:`ResumableSampler` (``loader.sampler``).

    Packed datasets get torchtune's ``padded_collate_packed`` (block-causal mask, ``input_pos``),
    others ``padded_collate_sft`` (right padding with ``padding_idx`` / ``ignore_index``).

    Args:
        dataset (Dataset): map-style dataset of ``{"tokens", "labels"}`` rows.
        batch_size (int): micro-batch size.
        shuffle (bool): shuffle every epoch.
        seed (int): sampler seed.
        rank (int): data-parallel rank.
        world_size (int): data-parallel size.
        padding_idx (int): token id used to pad.
        ignore_index (int): label of padded positions.
        collate_fn (Optional[Callable]): override the collate function.
        num_workers (int): DataLoader workers.

    Returns:
        DataLoader: the loader; ``drop_last=True`` so every micro-batch is full.

    Example:
        >>> dl = build_dataloader(ds, batch_size=4, seed=0)
        >>> dl.sampler.set_epoch(1, start=8)  # resume: epoch 1, two batches done
    """
    if collate_fn is None:
        collate_fn = (padded_collate_packed if is_packed(dataset)
                      else partial(padded_collate_sft, padding_idx=padding_idx, ignore_idx=ignore_index))
    sampler = ResumableSampler(len(dataset), shuffle=shuffle, seed=seed, rank=rank, world_size=world_size)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=True, num_workers=num_workers)


def batch_to_device(batch: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    """Moves every tensor of a collated batch (including a flex-attention BlockMask) to ``device``."""
    out = {}
    for k, v in batch.items():
        out[k] = v.to(device) if hasattr(v, "to") and not isinstance(v, (list, tuple)) else v
    return out
