"""The random generators a checkpoint saves and a resume restores: python, numpy, torch, CUDA
and megatron-core's tensor-parallel RNG tracker (dropout).

Why a module of its own: restoring them decides something -- the tracker's states are restored
only when they come from the same kind of generator as this run's (CPU or CUDA) -- and that
decision is the same whichever format (``torch`` or ``torch_dist``) carried the states.
"""

from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch


def get_rng_state() -> Dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _tracker_states_fit(saved: Dict[str, torch.Tensor],
                        current: Dict[str, torch.Tensor]) -> bool:
    """Whether the saved tensor-parallel RNG states are states of this run's generator kind.

    On a GPU the tracker holds CUDA generator states (16 bytes); in CPU mode, CPU generator
    states (5056 bytes). megatron-core's ``set_states`` checks nothing, and a state of the other
    kind fails at the first dropout after the resume ("RNG state is wrong size")."""
    return all(name not in current or saved[name].numel() == current[name].numel()
               for name in saved)


def set_rng_state(state: Dict[str, Any], log: Any = print) -> None:
    """Restore the generators of a checkpoint. The tensor-parallel tracker's states (dropout)
    are restored only when they come from the same kind of generator: a checkpoint written on
    CPU and resumed on a GPU (or the reverse) keeps the tracker states seeded from ``--seed``,
    with a line saying so, instead of failing at the first dropout."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = get_cuda_rng_tracker()
    if _tracker_states_fit(state["tracker"], tracker.get_states()):
        tracker.set_states(state["tracker"])
    else:
        log(" > the checkpoint's tensor-parallel RNG states (dropout) come from another kind of "
            "generator (saved on CPU and resumed on a GPU, or the reverse): not restored; they "
            "stay seeded from --seed, so dropout masks differ from an uninterrupted run")
