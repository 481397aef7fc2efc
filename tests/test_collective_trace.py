"""The collective-order check of every multi-rank test (tests/collective_trace.py) finds ranks
that issued different collectives on a communicator, and only those (issue 36, item 6)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from collective_trace import divergences
from dist_harness import run_distributed


def _worker(rank: int, world: int, diverge: bool) -> Dict[str, Any]:
    import torch.distributed as dist

    from megatron.distributed.quant.topology import build_two_level_groups

    groups = build_two_level_groups(list(range(world)), 2)
    x = torch.ones(8)
    dist.all_reduce(x)
    if groups.intra_group is not None:
        # a bucket of another dtype on one rank (same bytes: nothing fails, the data is wrong)
        y = torch.zeros(4, dtype=torch.float64 if diverge and rank == 3 else torch.int64)
        dist.broadcast(y, src=dist.get_process_group_ranks(groups.intra_group)[0],
                       group=groups.intra_group)
    return {"sum": float(x.sum())}


def test_a_healthy_job_passes_and_a_diverged_one_is_named(tmp_path: Path) -> None:
    (tmp_path / "ok").mkdir()
    (tmp_path / "bad").mkdir()
    assert [r["sum"] for r in run_distributed(4, _worker, tmp_path / "ok", False)] == [32.0] * 4
    with pytest.raises(AssertionError, match="issued different collectives") as info:
        run_distributed(4, _worker, tmp_path / "bad", True)
    text = str(info.value)
    assert "(ranks [2, 3]), collective #0" in text, text
    assert "rank 2: ('broadcast', 'torch.int64', 4" in text
    assert "rank 3: ('broadcast', 'torch.float64', 4" in text
    assert "ranks [0, 1]" not in text       # the other node's communicator agreed


def test_divergences_by_hand() -> None:
    key = ("5", (0, 1))
    same = {key: [("all_reduce", "torch.float32", 8)]}
    assert divergences([same, same]) == []
    longer = {key: same[key] + [("barrier", None, None)]}
    (problem,) = divergences([same, longer])
    assert "collective #1" in problem and "rank 0: nothing (1 in all)" in problem
    # a communicator without this rank is not compared with it
    assert divergences([same, same, {("6", (2,)): [("all_reduce", "torch.float32", 1)]}]) == []
