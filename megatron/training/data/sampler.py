"""Batches for one data-parallel rank that resume exactly where a run stopped.

:class:`PretrainingSampler` hands each DP rank its micro-batches of every global batch, starting
at ``consumed_samples``; :func:`build_data_iterator` wraps a dataset in a DataLoader over it
(optionally cycling, for validation), so a resumed run sees exactly the batches the uninterrupted
run would have seen.
"""

from __future__ import annotations

import argparse
from typing import Any, Iterator, List, Optional

import torch


class PretrainingSampler:
    """Sequential batches of micro-batch indices for this DP rank, starting at consumed_samples.

    Global batch g covers samples [g*GBS, (g+1)*GBS); each micro-step takes MBS*DP consecutive
    samples and DP rank r gets [r*MBS, (r+1)*MBS) of them -- so resuming at consumed_samples
    reproduces the exact data order.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int) -> None:
        self.total = total_samples
        self.consumed = consumed_samples
        self.mbs = micro_batch_size
        self.rank = dp_rank
        self.dp = dp_size

    def __len__(self) -> int:
        return max(0, (self.total - self.consumed) // (self.mbs * self.dp))

    def __iter__(self) -> Iterator[List[int]]:
        step = self.mbs * self.dp
        start = self.consumed
        while start + step <= self.total:
            yield list(range(start + self.rank * self.mbs, start + (self.rank + 1) * self.mbs))
            start += step


def build_data_iterator(dataset: Any, consumed: int, args: argparse.Namespace,
                        cyclic: bool = False) -> Optional[Iterator]:
    if dataset is None or len(dataset) == 0:
        return None
    from megatron.core import parallel_state as ps

    def make(consumed_: int):
        sampler = PretrainingSampler(len(dataset), consumed_ % max(1, len(dataset)),
                                     args.micro_batch_size, ps.get_data_parallel_rank(),
                                     ps.get_data_parallel_world_size())
        # Own generator: creating a DataLoader iterator draws a base seed, which must not
        # advance the global torch RNG (a resumed run builds its loaders after restoring it).
        gen = torch.Generator().manual_seed(args.seed)
        return iter(torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                                num_workers=args.num_workers, pin_memory=False,
                                                persistent_workers=False, generator=gen))

    if not cyclic:
        return make(consumed)

    def cycle():
        c = consumed
        while True:
            for batch in make(c):
                yield batch
            c = 0

    return cycle()
