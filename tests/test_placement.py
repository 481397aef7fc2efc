"""Where the ranks sit, checked at startup (issue 36, item 4): the ranks per node agreed by every
rank, the layer's communicators on the run's timeout, and a warning for a placement that splits
a node's ranks over hosts.

Why: each rank reads its ranks per node (D) from its own launcher variables; a heterogeneous
launch gave ranks different D, they built different groups, and the world-collective group
creation hung until the timeout -- which for the layer's own communicators was torch's default
(30 minutes on gloo, 10 on NCCL), not ``--distributed-timeout-minutes``. A cyclic placement
(``srun --distribution=cyclic``) ran the 8-bit "intra-node" hop across the network, silently.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from dist_harness import run_distributed
from megatron.distributed.quant.config import QuantizationConfig
from megatron.distributed.quant.placement import describe_ranks, placement_warning

CFG = QuantizationConfig(quantized_gradients=True)


def _agree_worker(rank: int, world: int, local_sizes: Dict[int, str]) -> Dict[str, Any]:
    import os

    import torch.distributed as dist

    from megatron.distributed.quant.placement import agree_intra_node_size

    os.environ.pop("LOCAL_WORLD_SIZE", None)
    if local_sizes.get(rank):
        os.environ["LOCAL_WORLD_SIZE"] = local_sizes[rank]
    try:
        d, hosts = agree_intra_node_size(CFG, dist.group.WORLD, 1)
        return {"d": d, "hosts": len(hosts)}
    except ValueError as exc:
        return {"error": str(exc)}


@pytest.mark.parametrize("local_sizes,expected", [
    ({0: "2", 1: "2", 2: "2", 3: "2"}, {"d": 2}),
    ({}, {"d": 4}),                                   # nobody says it: one host, 4 ranks on it
    ({0: "4", 1: "4", 2: "2", 3: "2"}, "ranks 0-1: 4; ranks 2-3: 2"),
    ({0: "2", 1: "2", 2: "2"}, "ranks 0-2: 2; ranks 3: unknown"),
    ({0: "3", 1: "3", 2: "3", 3: "3"}, "rank 0: the intra-node data-parallel size 3"),
])
def test_ranks_per_node_are_agreed_by_every_rank(tmp_path: Path, local_sizes, expected) -> None:
    """4 gloo ranks: the same D everywhere, or the same error on every rank (none hangs)."""
    results = run_distributed(4, _agree_worker, tmp_path, local_sizes)
    if isinstance(expected, dict):
        assert all(r == {**expected, "hosts": 4} for r in results), results
        return
    assert len({r.get("error") for r in results}) == 1, results
    assert expected in results[0]["error"], results[0]
    assert "--data-parallel-intra-node-size" in results[0]["error"]


def _timeout_worker(rank: int, world: int) -> Dict[str, Any]:
    import torch.distributed as dist

    from megatron.distributed.quant.topology import build_two_level_groups

    groups = build_two_level_groups(list(range(world)), 2, timeout=timedelta(minutes=3))
    found = {}
    for name in ("intra_group", "inter_group", "weights_group"):
        backend = getattr(groups, name)._get_backend(torch.device("cpu"))
        found[name] = backend.options._timeout.total_seconds()
    default = build_two_level_groups(list(range(world)), 2)
    found["default"] = default.intra_group._get_backend(
        torch.device("cpu")).options._timeout.total_seconds()
    dist.barrier()
    return found


def test_the_layers_communicators_take_the_runs_timeout(tmp_path: Path) -> None:
    """Real gloo groups: the given timeout, where torch's default (30 minutes) applied before."""
    for r in run_distributed(4, _timeout_worker, tmp_path):
        assert r == {"intra_group": 180.0, "inter_group": 180.0, "weights_group": 180.0,
                     "default": 1800.0}, r


def test_the_timeout_reaches_every_split_and_new_group(monkeypatch) -> None:
    """NCCL's split_group path and the new_group path both pass it on (recorded calls)."""
    from test_group_creation import RecordingDist, _Group, _tp2_dp_groups
    from megatron.distributed.quant import topology

    for backend, bound in (("nccl", True), ("gloo", False)):
        fake = RecordingDist(0, 16, backend=backend, bound=bound)
        timeouts = []
        plain_new_group, plain_split = fake.new_group, getattr(fake, "split_group", None)

        def new_group(ranks, backend=None, timeout=None, _f=plain_new_group):
            timeouts.append(timeout)
            return _f(ranks, backend)

        def split_group(parent_pg=None, split_ranks=None, timeout=None, _f=plain_split):
            timeouts.append(timeout)
            return _f(parent_pg, split_ranks)
        fake.new_group, fake.split_group = new_group, split_group
        monkeypatch.setattr(topology, "dist", fake)
        all_dp = _tp2_dp_groups(16)
        topology.build_two_level_groups_for_all(
            all_dp, 4, dp_groups=[_Group(all_dp[0], "megatron"), None],
            timeout=timedelta(minutes=7))
        assert timeouts and set(timeouts) == {timedelta(minutes=7)}, (backend, timeouts)


def test_the_config_carries_the_runs_timeout() -> None:
    import argparse

    args = argparse.Namespace(distributed_timeout_minutes=25, quantized_gradients=True)
    assert QuantizationConfig.from_args(args).communicator_timeout == timedelta(minutes=25)
    assert CFG.communicator_timeout is None


def test_a_node_split_over_hosts_is_warned_about() -> None:
    hosts = ["a"] * 4 + ["b"] * 4
    assert placement_warning(hosts, list(range(8)), 4) is None            # node-major
    assert placement_warning(["a"] * 8, list(range(8)), 2) is None        # nodes emulated on a host
    cyclic = ["a", "b"] * 4                          # srun --distribution=cyclic
    note = placement_warning(cyclic, list(range(8)), 4)
    assert note is not None and "ranks 0-3 on a, b" in note and "ranks 4-7 on a, b" in note
    assert "--data-parallel-intra-node-size" in note and "intra-node" in note
    assert describe_ranks([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_the_trainer_warns_at_startup(monkeypatch) -> None:
    """The single-hardware-queue warning (streams.py) and the runtime's placement notes reach
    the startup warnings; no queue warning where nothing overlaps or on the CPU."""
    from megatron.distributed.quant import chunks, integration

    monkeypatch.setattr(chunks, "nobody_to_talk_to", lambda: False)

    class Chunk(torch.nn.Module):
        quant_runtime = type("rt", (), {"startup_notes": ["placement note"]})()

    def warnings(environ: dict, device: str = "cuda") -> list:
        return integration.startup_warnings(CFG, [Chunk()], device=device, overlap=True,
                                            tensor_parallel=1, sequence_parallel=False,
                                            environ=environ)
    warned = warnings({"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert warned[0] == "placement note"
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in warned[1] and "unset it" in warned[1]
    assert warnings({}) == ["placement note"]
    assert len(warnings({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, device="cpu")) == 1


def test_local_ranks_beyond_the_gpus_share_them_only_where_nccl_allows() -> None:
    """One GPU per local rank as torchrun places them; a fifth rank on 4 GPUs only with an NCCL
    that shares GPUs (>= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1), else one error naming the
    counts and the ways out (``set_device`` failed with an invalid device ordinal)."""
    from megatron.training.errors import StartupError
    from megatron.training.initialize import cuda_device_for_local_rank as place

    share = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "LOCAL_WORLD_SIZE": "4"}
    assert place(1, 8, (2, 21, 5), {}) == (1, None)
    index, note = place(3, 1, (2, 31, 0), share)
    assert index == 0 and "4 local ranks share 1 GPU(s)" in note and "not for speed" in note
    assert place(5, 4, (2, 30, 0), share)[0] == 1
    for version, env in (((2, 28, 9), share), ((2, 31, 0), {"LOCAL_WORLD_SIZE": "4"}),
                         (None, share)):
        with pytest.raises(StartupError, match="local rank 3 has no GPU of its own") as info:
            place(3, 1, version, env)
        assert "--nproc-per-node 1" in str(info.value)
        assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in str(info.value)
    with pytest.raises(StartupError, match="sees no CUDA device"):
        place(0, 0, (2, 31, 0), share)


def _paro_size_worker(rank: int, world: int) -> Dict[str, Any]:
    import torch.distributed as dist

    from megatron.distributed.quant.placement import agree_across_ranks

    agree_across_ranks(2, "the PaRO group size", "--paro-group-size")   # the same: passes
    try:
        agree_across_ranks(4 if rank < 2 else 2, "the PaRO group size", "--paro-group-size")
    except ValueError as exc:
        dist.barrier()
        return {"error": str(exc)}
    return {"error": None}


def test_a_per_rank_setting_that_differs_stops_every_rank(tmp_path: Path) -> None:
    results = run_distributed(4, _paro_size_worker, tmp_path)
    assert len({r["error"] for r in results}) == 1, results
    assert "ranks 0-1: 4; ranks 2-3: 2" in results[0]["error"]
    assert "--paro-group-size" in results[0]["error"]
