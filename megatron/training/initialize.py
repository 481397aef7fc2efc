"""Process-level setup: device/CPU mode, torch.distributed, model-parallel groups, seeds.

Why here: every entry point (pretrain_gpt.py, tests, tools) needs the same order of operations
-- CPU mode must be patched in before megatron-core allocates anything, the process groups must
exist before the num-microbatches calculator and the models, and the RNG tracker must be seeded
after the groups exist (its seed depends on the TP/PP rank).
"""

from __future__ import annotations

import argparse
import os
import random
from datetime import timedelta
from typing import Mapping, Optional, Tuple

import numpy as np
import torch

from megatron.training import attempt, cpu_mode
from megatron.training.errors import StartupError


def initialize_distributed(args: argparse.Namespace) -> None:
    """``torch.distributed`` from the torchrun environment, then megatron-core's groups."""
    if args.device == "cpu":
        # The trainer enters ``cpu_mode.cpu_mode()`` around the whole run; a caller that did not
        # (an older entry point) gets the entered-forever form instead.
        if cpu_mode.is_cpu_mode():
            cpu_mode.refresh_cpu_mode()
        else:
            cpu_mode.enable_cpu_mode()
    else:
        index, note = cuda_device_for_local_rank(
            int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count(), _nccl_version(),
            os.environ)
        torch.cuda.set_device(index)
        if note is not None and int(os.environ.get("RANK", "0")) == 0:
            print(f" > {note}", flush=True)

    if not torch.distributed.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # plain `python pretrain_gpt.py`: one process
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        kwargs = {}
        if args.device == "cuda":
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        timeout = timedelta(minutes=args.distributed_timeout_minutes)
        store = attempt_store(rank, world_size, timeout)
        torch.distributed.init_process_group(
            backend=args.distributed_backend, store=store, world_size=world_size, rank=rank,
            timeout=timeout, **kwargs)
        if rank == 0:
            print(f" > {attempt.current().describe()}", flush=True)
    args.rank = torch.distributed.get_rank()
    args.world_size = torch.distributed.get_world_size()
    if args.world_size > 1:   # one rank's failure stops every rank with its cause (failures.py)
        from megatron.distributed import failures

        failures.install(failures.default_store(), args.rank, args.world_size)
        failures.watch()

    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
            distributed_timeout_minutes=args.distributed_timeout_minutes)
    assert parallel_state.get_data_parallel_world_size() == args.data_parallel_size, (
        "data-parallel size from WORLD_SIZE at parse time differs from the process group")


def attempt_store(rank: int, world_size: int, timeout: timedelta) -> "torch.distributed.Store":
    """The launcher's store (``env://``: torchrun's agent store, or one rank 0 hosts) under a
    prefix of this attempt's own (:mod:`.attempt`): a restarted job's process groups never
    meet the keys of the attempt that died."""
    store, _, _ = next(torch.distributed.rendezvous("env://", rank=rank, world_size=world_size,
                                                    timeout=timeout))
    store.set_timeout(timeout)
    agreed = attempt.agree(store, rank, world_size, timeout.total_seconds())
    attempt.set_current(agreed)
    return torch.distributed.PrefixStore(agreed.prefix, store)


MULTI_RANK_GPU_NCCL = (2, 30, 0)
"""The first NCCL that lets several ranks of a job share one GPU (with
``NCCL_MULTI_RANK_GPU_ENABLE=1``); older ones refuse the communicator."""


def ranks_can_share_a_gpu(nccl_version: Optional[Tuple[int, ...]],
                          environ: Mapping[str, str]) -> bool:
    """Whether the loaded NCCL places several ranks on one GPU: NCCL >= 2.30 with
    ``NCCL_MULTI_RANK_GPU_ENABLE=1``."""
    return (nccl_version is not None and tuple(nccl_version) >= MULTI_RANK_GPU_NCCL
            and environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1")


def cuda_device_for_local_rank(local_rank: int, device_count: int,
                               nccl_version: Optional[Tuple[int, ...]],
                               environ: Mapping[str, str]) -> Tuple[int, Optional[str]]:
    """(CUDA device index of this local rank, a startup note or None).

    One GPU per local rank, as torchrun places them. More local ranks than GPUs (several ranks
    on one GPU, for correctness and memory checks on one machine) only where the loaded NCCL
    allows it (:func:`ranks_can_share_a_gpu`): then rank ``l`` takes GPU ``l % count``; elsewhere
    a :class:`StartupError` naming the counts, not ``set_device``'s invalid device ordinal."""
    if device_count < 1:
        raise StartupError("--device cuda, but torch sees no CUDA device (CUDA_VISIBLE_DEVICES="
                           f"{environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); pass --device cpu "
                           "to train on the CPU")
    if local_rank < device_count:
        return local_rank, None
    version = "unknown" if nccl_version is None else ".".join(map(str, nccl_version))
    local_world = environ.get("LOCAL_WORLD_SIZE", "?")
    if not ranks_can_share_a_gpu(nccl_version, environ):
        raise StartupError(
            f"local rank {local_rank} has no GPU of its own: this node runs {local_world} ranks "
            f"on {device_count} visible CUDA device(s), and NCCL {version} cannot place several "
            f"ranks on one GPU. Launch at most {device_count} processes per node (torchrun "
            f"--nproc-per-node {device_count}), or, to check correctness with several ranks per "
            "GPU, load NCCL >= 2.30 and set NCCL_MULTI_RANK_GPU_ENABLE=1")
    return local_rank % device_count, (
        f"{local_world} local ranks share {device_count} GPU(s) (NCCL {version}, "
        "NCCL_MULTI_RANK_GPU_ENABLE=1): local rank l runs on cuda:(l % "
        f"{device_count}). The ranks time-share each GPU: right for correctness and memory "
        "checks, not for speed")


def _nccl_version() -> Optional[Tuple[int, ...]]:
    """The version of the NCCL this process loaded (a preloaded newer library included)."""
    try:
        return tuple(torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 -- a build without NCCL
        return None


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a rendezvous of this machine's processes)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_random_seed(seed: int, device: str) -> None:
    """Seed python/numpy/torch per pipeline stage (as Megatron-LM) and the TP RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # On CPU the tracker forks the CPU generator (see cpu_mode patch 2); on GPU the CUDA one.
    model_parallel_cuda_manual_seed(seed)


def init_num_microbatches(args: argparse.Namespace) -> None:
    """megatron-core's global num-microbatches calculator (constant batch size, or growing with
    --rampup-batch-size); replaces one a previous initialization in this process left."""
    from megatron.distributed.mcore_compat.process_globals import \
        reinit_num_microbatches_calculator

    reinit_num_microbatches_calculator(
        rank=args.rank, rampup_batch_size=getattr(args, "rampup_batch_size", None),
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size, data_parallel_size=args.data_parallel_size)


def initialize_megatron(args: argparse.Namespace) -> None:
    """Everything before model construction, in the order megatron-core needs."""
    initialize_distributed(args)
    init_num_microbatches(args)
    set_random_seed(args.seed, args.device)
