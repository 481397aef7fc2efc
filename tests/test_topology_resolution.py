"""Ranks per node outside torchrun (issue 25, review item 4).

Why: without ``LOCAL_WORLD_SIZE`` (``srun``, ``mpirun``) the intra-node size defaulted to the
whole data-parallel size, i.e. one node: a 2-node job ran one 8-bit all-to-all over the
inter-node network and the accounting called it intra-node. The resolver now reads the
launchers' own variables, else the runtime counts the data-parallel ranks per hostname, and a
layout that is not node-major is refused naming ``--data-parallel-intra-node-size``.
"""

from __future__ import annotations

import pytest

from megatron.distributed.quant.config import (QuantizationConfig, TopologyUnknownError,
                                               launcher_ranks_per_node, ranks_per_node_from_hosts)

CFG = QuantizationConfig(quantized_gradients=True)


@pytest.mark.parametrize("environ,expected", [
    ({"LOCAL_WORLD_SIZE": "8"}, (8, "LOCAL_WORLD_SIZE")),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, (4, "OMPI_COMM_WORLD_LOCAL_SIZE")),
    ({"MPI_LOCALNRANKS": "2"}, (2, "MPI_LOCALNRANKS")),
    ({"SLURM_NTASKS_PER_NODE": "8", "SLURM_TASKS_PER_NODE": "8(x4)"}, (8, "SLURM_NTASKS_PER_NODE")),
    ({"SLURM_TASKS_PER_NODE": "8(x2)"}, (8, "SLURM_TASKS_PER_NODE")),
    ({"SLURM_TASKS_PER_NODE": "4,4"}, (4, "SLURM_TASKS_PER_NODE")),
    ({"SLURM_TASKS_PER_NODE": "8,4(x2)"}, None),       # uneven nodes: no single D
    ({}, None),
])
def test_launcher_variables(environ, expected) -> None:
    assert launcher_ranks_per_node(environ) == expected


def test_srun_without_local_world_size_gives_the_node_size() -> None:
    """16 ranks on 2 nodes under ``srun``: D = 8 (it was 16, "one node")."""
    assert CFG.intra_node_size(16, 1, environ={"SLURM_TASKS_PER_NODE": "8(x2)"}) == 8
    assert CFG.intra_node_size(8, 2, environ={"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}) == 4


def test_no_launcher_variable_needs_the_hostnames_or_the_flag() -> None:
    with pytest.raises(TopologyUnknownError, match="--data-parallel-intra-node-size"):
        CFG.intra_node_size(16, 1, environ={})
    assert CFG.intra_node_size(16, 1, environ={}, dp_ranks_per_host=8) == 8
    explicit = QuantizationConfig(quantized_gradients=True, data_parallel_intra_node_size=4)
    assert explicit.intra_node_size(16, 1, environ={}) == 4


def test_ranks_per_host_from_hostnames() -> None:
    hosts = ["n0"] * 8 + ["n1"] * 8
    assert ranks_per_node_from_hosts(hosts, list(range(16))) == 8
    assert ranks_per_node_from_hosts(hosts, list(range(0, 16, 2))) == 4   # TP = 2
    assert ranks_per_node_from_hosts(hosts, [0, 8]) == 1                  # one DP rank per node
    with pytest.raises(TopologyUnknownError, match="--data-parallel-intra-node-size"):
        ranks_per_node_from_hosts(["n0", "n1"] * 2, [0, 1, 2, 3])         # not node-major
    with pytest.raises(TopologyUnknownError, match="not the same number"):
        ranks_per_node_from_hosts(["n0"] * 3 + ["n1"], [0, 1, 2, 3])
