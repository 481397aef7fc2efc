"""Megatron-LM's ``--profile`` flags and memory report.

Why: "where does the step go?" is the first question about a slow run. As in Megatron-LM,
``--profile --use-pytorch-profiler --profile-step-start S --profile-step-end E --profile-ranks R``
writes a torch.profiler trace of iterations [S, E) under ``--tensorboard-dir`` (without
``--use-pytorch-profiler``: ``cudaProfilerStart/Stop`` for Nsight Systems), and a memory report
follows the first logged iterations. The trace's top operators also go to the log, so a change's
"top kernels before / after" reads without opening the trace.
"""

from __future__ import annotations

import argparse
import os
import resource
from typing import Any, Optional

import torch

__all__ = ["add_profile_args", "StepProfiler", "memory_report"]

TOP_OPERATORS = 15
"""Rows of the operator table printed when the profiled range ends."""


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's profiling flags (same names and defaults)."""
    g = parser.add_argument_group("profiling")
    g.add_argument("--profile", action="store_true",
                   help="Profile iterations [--profile-step-start, --profile-step-end): with "
                        "--use-pytorch-profiler a torch.profiler trace under --tensorboard-dir "
                        "(or the save directory) and the top operators in the log; else "
                        "cudaProfilerStart/Stop for nsys --capture-range=cudaProfilerApi.")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="Use torch.profiler for --profile.")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="First profiled iteration (1-based, as logged).")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="Profiling stops before this iteration.")
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0],
                   help="Global ranks that profile.")


def validate_profile_args(args: argparse.Namespace) -> Optional[str]:
    """An error message for profile flags that cannot work, else None."""
    if not getattr(args, "profile", False):
        return None
    if args.profile_step_end <= args.profile_step_start or args.profile_step_start < 1:
        return (f"--profile-step-start {args.profile_step_start} / --profile-step-end "
                f"{args.profile_step_end}: need 1 <= start < end")
    if not args.use_pytorch_profiler and getattr(args, "device", "cuda") != "cuda":
        return ("--profile without --use-pytorch-profiler drives Nsight Systems through "
                "cudaProfilerStart/Stop, which needs CUDA; add --use-pytorch-profiler")
    return None


class StepProfiler:
    """Starts and stops the profiler at iteration boundaries (:meth:`before_step` /
    :meth:`after_step` with the 1-based iteration about to run / just run)."""

    def __init__(self, args: argparse.Namespace, rank: int, log: Any = print) -> None:
        self.args = args
        self.active_rank = bool(getattr(args, "profile", False)) and rank in args.profile_ranks
        self.log = log
        self.rank = rank
        self._prof: Optional[Any] = None
        self._cuda = getattr(args, "device", "cpu") == "cuda"
        self.trace_dir = (getattr(args, "tensorboard_dir", None)
                          or os.path.join(getattr(args, "save", None) or ".", "profile"))

    def before_step(self, iteration: int) -> None:
        if not self.active_rank or iteration != self.args.profile_step_start:
            return
        if self.args.use_pytorch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self._cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self._prof.start()
        else:
            torch.cuda.cudart().cudaProfilerStart()
            self._prof = "nsys"

    def after_step(self, iteration: int, *, last: bool = False) -> None:
        """Stop after iteration ``profile_step_end - 1`` (or at the run's end, ``last``)."""
        if self._prof is None or (iteration < self.args.profile_step_end - 1 and not last):
            return
        prof, self._prof = self._prof, None
        if prof == "nsys":
            torch.cuda.cudart().cudaProfilerStop()
            return
        if self._cuda:
            torch.cuda.synchronize()
        prof.stop()
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"trace_rank{self.rank}_iter"
                            f"{self.args.profile_step_start}-{iteration}.pt.trace.json")
        prof.export_chrome_trace(path)
        sort = "cuda_time_total" if self._cuda else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=TOP_OPERATORS)
        self.log(f" > profile of iterations {self.args.profile_step_start}-{iteration} "
                 f"(rank {self.rank}): {path}\n{table}")


def memory_report(device: str, iteration: int, rank: int) -> str:
    """Megatron-LM's memory line (MB) for CUDA; the process's peak RSS on CPU."""
    mb = 1024.0 * 1024.0
    if device == "cuda":
        return (f"[Rank {rank}] (after {iteration} iterations) memory (MB) | allocated: "
                f"{torch.cuda.memory_allocated() / mb:.1f} | max allocated: "
                f"{torch.cuda.max_memory_allocated() / mb:.1f} | reserved: "
                f"{torch.cuda.memory_reserved() / mb:.1f} | max reserved: "
                f"{torch.cuda.max_memory_reserved() / mb:.1f}")
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB) | host peak RSS: "
            f"{peak_kb / 1024.0:.1f}")
