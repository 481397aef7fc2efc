#!/usr/bin/env python3
"""Several data-parallel ranks on one GPU: the quantized collectives' CUDA stream path, checked
against the same ranks on the CPU, without a cluster.

Issue 25, item 1. NCCL refuses two ranks on one GPU, and our GPU machines have one, so the CUDA
path of the quantized collectives (communication stages on CUDA streams, events between them,
``record_stream`` of the middle hop's codes) had never run with more than one rank. Here P = M x D
virtual ranks are threads of one process (bench/virtual_world.py), each with its own compute
stream, its own :class:`~megatron.distributed.quant.runtime.QuantizationRuntime` and that
runtime's CUDA communication stages; the virtual collectives follow NCCL's stream semantics (no
host wait; receivers wait on the senders' events; senders' streams wait on the copies).

Each step runs, per rank, the calls megatron-core's bucket group makes through ddp.py:

* ``start_grad_sync``: the quantized reduce-scatter of the bucket (TLq-HS, 8-bit intra / 4-bit
  inter, LoCo error feedback, ``--gradient-alltoall-pipeline 2``) on the runtime's stages with
  overlap, then the handle's wait on the rank's compute stream;
* the step's NaN/Inf agreement (one host read per step, outside the no-sync window);
* ``start_param_sync``: the qWD all-gather of the updated shard (reference snapshot, master
  copy, quantized difference) on the stages, then the wait.

Round to nearest everywhere, so the kernels are bit-identical across backends: every rank's
reduce-scatter shard, its LoCo error state and every gathered parameter buffer must equal, bit
for bit, the same ranks run on the CPU (gloo-like transport, C++ kernels, inline). Step 2 has a
NaN in one rank's gradients: every rank must skip it. Before the last step the runtimes' state
is saved and loaded into fresh runtimes (``load_state_dict(state, device)``), whose last step
must come out bit-identical. The CUDA steps after the first (which compiles the kernels and
builds the cached index tables) run under ``set_sync_debug_mode("error")``: a host
synchronisation inside the per-bucket path raises. With ``TORCH_CUDA_SANITIZER=1`` in the
environment, torch's CUDA sanitizer also checks every cross-stream access.

    python bench/virtual_cuda_ranks.py                         # 2x2 and 2x4 on the GPU vs CPU
    python bench/virtual_cuda_ranks.py --layouts 2x2 --device cpu --steps 2   # CPU side only
    TORCH_CUDA_SANITIZER=1 python bench/virtual_cuda_ranks.py --layouts 2x2 --steps 3

Exit status 0: every comparison held; 1: a mismatch (printed); 2: usage.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from megatron.distributed.quant.config import QuantizationConfig  # noqa: E402
from megatron.distributed.quant.runtime import QuantizationRuntime  # noqa: E402
from megatron.distributed.quant.streams import STAGES, CommStreams  # noqa: E402
from quant_error_study import INDEX, KEY, VirtualCluster, weight_gather_step  # noqa: E402

CONFIG = QuantizationConfig(quantized_gradients=True, hadamard_transform=True, loco=True,
                            quantized_weights=True, stochastic_rounding=False,
                            gradient_alltoall_pipeline=2)
"""SDP4Bit + LoCo with pipelined hops, round to nearest (bit-identical kernels on every backend)."""


def parse_layouts(text: str) -> List[Tuple[int, int]]:
    out = []
    for part in text.split(","):
        m, d = part.lower().split("x")
        out.append((int(m), int(d)))
    return out


class Ranks:
    """One layout's virtual ranks on one device: runtimes, per-rank buffers and streams."""

    def __init__(self, m: int, d: int, device: torch.device, numel: int,
                 runtimes: Optional[List[QuantizationRuntime]] = None, *,
                 streamed: Optional[bool] = None,
                 rank_context: Optional[Callable[[], ContextManager[Any]]] = None) -> None:
        self.cl = VirtualCluster(m, d, CONFIG)
        if runtimes is not None:
            self.cl.runtimes = runtimes
        self.device = device
        self.numel = self.cl.pad(torch.zeros(numel)).numel()
        self.cuda = device.type == "cuda"
        """A real GPU: device synchronisation and the sync-debug mode."""
        self.streamed = self.cuda if streamed is None else streamed
        """Each rank on a compute stream of its own with CUDA communication stages: on a GPU,
        or with CPU tensors under tests/fake_cuda.py's ``torch.cuda`` (the suite's variant: the
        stream and lifetime logic without a GPU)."""
        self.rank_context = rank_context
        """Entered around each rank's calls in its thread (the suite's allocation check)."""
        self.compute = [torch.cuda.Stream(device) if self.streamed else None
                        for _ in range(self.cl.p)]
        if self.streamed:   # every rank's stages, created in a fixed order (a fake names them)
            for rt in self.cl.runtimes:
                rt.timing.overlapped = CommStreams("cuda", device)
                for name in STAGES:
                    rt.timing.overlapped.stage(name)
        self.params = [torch.zeros(self.numel, dtype=torch.bfloat16, device=device)
                       for _ in range(self.cl.p)]
        self.check_syncs = False
        """Run the ranks' calls under ``set_sync_debug_mode("error")`` (CUDA): off for the first
        step, which builds what is built once per process (Triton compiles, index tables)."""

    @contextlib.contextmanager
    def _on_rank_stream(self, rank: int) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.rank_context is not None:
                stack.enter_context(self.rank_context())
            if self.streamed:
                stack.enter_context(torch.cuda.stream(self.compute[rank]))
            yield

    def _streams(self, rt: QuantizationRuntime) -> Optional[CommStreams]:
        return rt.streams(self.device, overlap=True) if self.streamed else None

    def grad_step(self, grads: Sequence[torch.Tensor], it: int) -> Tuple[List[torch.Tensor], bool]:
        """Every rank's reduce-scatter shard (SUM of the pre-scaled buckets) and the agreed
        'skip this step'."""
        p = self.cl.p
        buckets = [self.cl.pad(g).mul_(1.0 / p).to(self.device) for g in grads[:p]]
        if self.cuda:
            torch.cuda.synchronize()

        def rank_work(r: int) -> torch.Tensor:
            rt = self.cl.runtimes[r]
            rt.set_iteration(it)
            with self._on_rank_stream(r):
                bucket = buckets[r]
                shard = bucket.view(rt.groups.dp_size, -1)[rt.groups.dp_rank]
                streams = self._streams(rt)
                handle = rt.reduce_scatter(bucket, shard, key=KEY, index=INDEX, streams=streams)
                if streams is not None:   # overlap: a handle, waited on the compute stream
                    handle.wait()
                return shard.clone()
        shards = self._no_sync(rank_work)
        skip = self.cl.run(lambda r: self.cl.runtimes[r].agree_nonfinite(self.device))
        if len(set(skip)) != 1:
            raise AssertionError(f"ranks disagree on skipping step {it}: {skip}")
        if skip[0]:
            self.cl.run(lambda r: self.cl.runtimes[r].on_step_skipped(None))
        return [s.cpu() for s in shards], bool(skip[0])

    def weight_step(self, master: torch.Tensor, it: int) -> List[torch.Tensor]:
        """qWD all-gather of the new master weights into every rank's bf16 parameter buffer."""
        master = self.cl.pad(master).to(self.device)
        if self.cuda:
            torch.cuda.synchronize()

        def rank_work(r: int) -> None:
            rt = self.cl.runtimes[r]
            with self._on_rank_stream(r):
                weight_gather_step(rt, self.params[r], master, it, streams=self._streams(rt))
        self._no_sync(rank_work)
        return [b.to("cpu", copy=True) for b in self.params]

    def _no_sync(self, fn) -> List[Any]:
        """Run ``fn`` on every rank; on CUDA with any host synchronisation an error, then wait
        for the device (outside the window)."""
        if not self.cuda or not self.check_syncs:
            out = self.cl.run(fn)
            if self.cuda:
                torch.cuda.synchronize()
            return out
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = self.cl.run(fn)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        return out

    def state(self) -> List[bytes]:
        """Every runtime's state_dict as the checkpoint would hold it (serialised)."""
        out = []
        for rt in self.cl.runtimes:
            buf = io.BytesIO()
            torch.save(rt.state_dict(), buf)
            out.append(buf.getvalue())
        return out

    def load(self, states: Sequence[bytes]) -> None:
        for rt, raw in zip(self.cl.runtimes, states):
            rt.load_state_dict(torch.load(io.BytesIO(raw), map_location="cpu"), self.device)


def inputs(p: int, numel: int, steps: int, nan_step: int, seed: int
           ) -> Tuple[List[List[torch.Tensor]], List[torch.Tensor]]:
    """Per step: every rank's gradient bucket (one NaN on rank 1 at ``nan_step``) and the master
    weights after the step."""
    g = torch.Generator().manual_seed(seed)
    grads, masters = [], []
    w = torch.randn(numel, generator=g) * 0.02
    for s in range(steps):
        step_grads = [torch.randn(numel, generator=g) * (1.0 + 0.1 * r) for r in range(p)]
        if s == nan_step:
            step_grads[1 % p][5] = float("nan")
        grads.append(step_grads)
        w = w - 1e-3 * torch.randn(numel, generator=g)
        masters.append(w.clone())
    return grads, masters


def resume_step(steps: int) -> int:
    """The step (0-based) the resumed runtimes start from: the last one, after the NaN step."""
    return steps - 1


def run_layout(m: int, d: int, devices: Sequence[str], numel: int, steps: int,
               seed: int, **ranks_kwargs: Any) -> Dict[str, Any]:
    """Every step of the layout on each device; ``ranks_kwargs`` go to :class:`Ranks` (the
    suite's fake-CUDA variant: ``streamed``, ``rank_context``)."""
    p = m * d
    nan_step = 1 if steps > 2 else -1
    grads, masters = inputs(p, numel, steps, nan_step, seed)
    resumed_at = resume_step(steps)
    record: Dict[str, Dict[str, Any]] = {}
    for dev in devices:
        t0 = time.perf_counter()
        ranks = Ranks(m, d, torch.device(dev), numel, **ranks_kwargs)
        shards, skips, params, saved = [], [], [], None
        for s in range(steps):
            ranks.check_syncs = s > 0
            if s == resumed_at:
                saved = ranks.state()
                saved_params = [b.clone() for b in ranks.params]
            sh, skip = ranks.grad_step(grads[s], s + 1)
            shards.append(sh)
            skips.append(skip)
            # a skipped step leaves the weights alone: nothing to gather
            params.append([b.to("cpu", copy=True) for b in ranks.params] if skip
                          else ranks.weight_step(masters[s], s + 1))
        rec = {"shards": shards, "skips": skips, "params": params, "state": ranks.state(),
               "seconds": time.perf_counter() - t0}
        if saved is not None:  # fresh runtimes from the saved state, then the last step
            resumed = Ranks(m, d, torch.device(dev), numel, **ranks_kwargs)
            resumed.check_syncs = True
            resumed.load(saved)
            resumed.params = [b.to(dev) for b in saved_params]
            rec["resumed"] = [resumed.grad_step(grads[resumed_at], resumed_at + 1)[0]]
            rec["resumed_params"] = resumed.weight_step(masters[resumed_at], resumed_at + 1)
        record[dev] = rec
        print(f"[virtual_cuda_ranks] {m}x{d} on {dev}: {steps} steps in {rec['seconds']:.1f} s, "
              f"skipped steps {[i + 1 for i, k in enumerate(skips) if k]}", flush=True)
    return record


def compare(m: int, d: int, record: Dict[str, Dict[str, Any]], steps: int) -> List[str]:
    """Mismatches between the CUDA and CPU runs (empty: bit-identical)."""
    bad: List[str] = []
    gpu, cpu = record["cuda"], record["cpu"]
    if gpu["skips"] != cpu["skips"]:
        bad.append(f"skipped steps differ: cuda {gpu['skips']} cpu {cpu['skips']}")
    for s in range(steps):
        for r, (a, b) in enumerate(zip(gpu["shards"][s], cpu["shards"][s])):
            if not gpu["skips"][s] and not torch.equal(a, b):
                diff = (a - b).abs().max().item()
                bad.append(f"step {s + 1} rank {r}: reduce-scatter shard differs (max {diff:.3g})")
        for r, (a, b) in enumerate(zip(gpu["params"][s], cpu["params"][s])):
            if not torch.equal(a, b):
                bad.append(f"step {s + 1} rank {r}: gathered parameters differ")
    for r, (a, b) in enumerate(zip(gpu["state"], cpu["state"])):
        sa, sb = torch.load(io.BytesIO(a)), torch.load(io.BytesIO(b))
        if not _same_state(sa, sb):
            bad.append(f"rank {r}: quantization state (LoCo errors, qWD references) differs")
    bad += resume_mismatches(gpu, steps, "cuda") + resume_mismatches(cpu, steps, "cpu")
    return [f"{m}x{d}: {b}" for b in bad]


def resume_mismatches(rec: Dict[str, Any], steps: int, dev: str) -> List[str]:
    """The step after a resume must equal the uninterrupted run's, bit for bit."""
    if "resumed" not in rec:
        return []
    resumed_at, bad = resume_step(steps), []
    for r, (a, b) in enumerate(zip(rec["resumed"][0], rec["shards"][resumed_at])):
        if not torch.equal(a, b):
            bad.append(f"{dev}: resumed step {resumed_at + 1} rank {r}: shard differs")
    for r, (a, b) in enumerate(zip(rec["resumed_params"], rec["params"][resumed_at])):
        if not torch.equal(a, b):
            bad.append(f"{dev}: resumed step {resumed_at + 1} rank {r}: parameters differ")
    return bad


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_same_state(x, y) for x, y in zip(a, b)))
    return a == b


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="2x2,2x4", help="M x D layouts, comma-separated")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps (step 2 has a NaN)")
    ap.add_argument("--numel", type=int, default=1 << 20, help="bucket elements per rank")
    ap.add_argument("--device", choices=("both", "cpu"), default="both",
                    help="both: CUDA vs CPU (needs a GPU); cpu: the CPU side alone")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    try:
        layouts = parse_layouts(args.layouts)
    except ValueError:
        ap.error(f"--layouts {args.layouts!r}: expected e.g. 2x2,2x4")
    if args.device == "both" and not torch.cuda.is_available():
        ap.error("--device both needs a CUDA device (use --device cpu for the CPU side alone)")
    devices = ["cuda", "cpu"] if args.device == "both" else ["cpu"]
    torch.set_num_threads(1)   # the virtual ranks' CPU kernels run side by side
    sanitizer = os.environ.get("TORCH_CUDA_SANITIZER", "") not in ("", "0")
    print(f"[virtual_cuda_ranks] layouts {args.layouts}, {args.steps} steps, {args.numel} "
          f"elements per rank, devices {devices}, CUDA sanitizer {'on' if sanitizer else 'off'}",
          flush=True)
    failures: List[str] = []
    for m, d in layouts:
        record = run_layout(m, d, devices, args.numel, args.steps, args.seed)
        if "cuda" in record:
            bad = compare(m, d, record, args.steps)
            failures += bad
            print(f"[virtual_cuda_ranks] {m}x{d}: "
                  + ("CUDA == CPU bit for bit (shards, parameters, LoCo/qWD state; resume)"
                     if not bad else f"{len(bad)} mismatches"), flush=True)
    for f in failures:
        print(f"MISMATCH {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
