"""The generators of a checkpoint on resume, across devices (megatron/training/checkpoint/rng_state.py).

The tensor-parallel RNG tracker (dropout) holds CUDA generator states on a GPU and CPU generator
states in CPU mode; megatron-core's ``set_states`` checks nothing, so a checkpoint written on one
and resumed on the other failed at the first dropout ("RNG state is wrong size")."""

from __future__ import annotations

from typing import List

import torch

from dist_harness import model_parallel_world_of_one
from megatron.training.checkpoint import rng_state


def _dropout_draw() -> torch.Tensor:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        return torch.nn.functional.dropout(torch.ones(256), 0.5)


def test_same_kind_states_are_restored_and_other_kind_states_kept_seeded() -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with model_parallel_world_of_one(seed=3):
        saved = rng_state.get_rng_state()
        want = _dropout_draw()
        lines: List[str] = []
        rng_state.set_rng_state(saved, lines.append)        # same kind: restored
        assert torch.equal(_dropout_draw(), want) and lines == []

        # What a GPU run writes: 16-byte CUDA generator states under the same names.
        gpu_saved = dict(saved, tracker={name: torch.zeros(16, dtype=torch.uint8)
                                         for name in saved["tracker"]})
        before = {n: s.clone() for n, s in get_cuda_rng_tracker().get_states().items()}
        rng_state.set_rng_state(gpu_saved, lines.append)
        assert len(lines) == 1 and "another kind of generator" in lines[0]
        after = get_cuda_rng_tracker().get_states()
        assert after.keys() == before.keys()
        assert all(torch.equal(after[n], before[n]) for n in before)
        assert torch.equal(torch.get_rng_state(), saved["torch"])   # the rest is restored
        _dropout_draw()                                             # and dropout still runs
