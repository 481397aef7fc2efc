#!/usr/bin/env python3
"""Quantization error vs nodes: the product's quantized collectives replayed on a virtual M x D
data-parallel layout (up to 16 x 8 = 128 ranks) in one process, on real GPT gradients.

Why: the two-level reduce-scatter re-quantizes a sum of D terms on the intra-node hop and of M
terms on the inter-node hop, so its error depends on M and D, which 4 CPU ranks cannot show.
Here every virtual rank is a thread that owns a real ``QuantizationRuntime`` (config, two-level
groups built by ``topology.build_two_level_groups``, seeded generators, LoCo buffers) and calls
``runtime.reduce_scatter`` / ``runtime.all_gather`` with the call sequence of megatron-core's
bucket groups (``ddp.py``); only ``torch.distributed`` is replaced, by an exact in-process
transport (bench/virtual_world.py). Nothing of the algorithm is re-implemented: the kernels,
partition layout (swizzle), stochastic rounding streams and error feedback are the product's.
At 2 x 2 the per-rank outputs equal 4 real gloo ranks' bit for bit
(tests/test_quant_error_study.py).

Gradients: per-rank micro-batch gradients of the quickstart GPT on the quickstart corpus along
the exact training trajectory (bench/quant_study_grads.py). Each is one fp32 bucket, zero-padded
as megatron-core's buffer pads it for quantization, pre-scaled by 1/P as megatron-core does
(``gradient_scaling_factor``), so the quantized SUM is the mean; the reference is the exact mean
of the fp32 gradients computed in fp64.

Measured (relative L2 error ||q - ref|| / ||ref|| and cosine similarity, over the whole bucket):

* ``e2e``: the reduce-scatter's output against the exact mean;
* ``hop1``: the intra-node hop alone (two-level layouts): the codes and scales each rank receives
  on the intra all-to-all (step 2), observed on the virtual wire and dequantize-summed with the
  product's ``dequantize_sum`` (step 3 before requantization), against the exact sum of the same
  D ranks' partitions;
* ``hop2``: the inter-node hop alone: the output against the exact sum over nodes of the hop-1
  results (what an exact inter hop would have produced from them);
* one-hop layouts (M = 1: intra only; D = 1: inter only) are the grid's first row / column;
* series (>= 50 consecutive steps, state carried by the runtimes): LoCo vs none, and the weight
  all-gather (qWD / qW, 4 bits): reconstructed bf16 weights against the exact ones, relative to
  the weights and to the step's update, and the cosine of the reconstructed vs exact update.

    python bench/quant_error_study.py            # the full study (docs/results.md)
    python bench/quant_error_study.py --quick    # seconds: small layouts, few steps (tests)
    python bench/quant_error_study.py --report-only   # tables / plots again from the JSON
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from megatron.distributed.quant.collectives.common import (  # noqa: E402
    required_padding_multiple_from_config)
from megatron.distributed.quant.collectives.gradients import swizzle_order  # noqa: E402
from megatron.distributed.quant.config import QuantizationConfig  # noqa: E402
from megatron.distributed.quant.kernels.dispatch import (QuantizedTensor,  # noqa: E402
                                                         dequantize_sum)
from megatron.distributed.quant.runtime import QuantizationRuntime  # noqa: E402
from virtual_world import VirtualDist, build_virtual_groups, installed  # noqa: E402

KEY, INDEX = "chunk0/bucket0", 0
"""The buffer name and seed index megatron-core's first bucket gets (ddp.py)."""

_TLQ = QuantizationConfig(quantized_gradients=True)   # 8-bit intra / 4-bit inter, groups 512 / 128
_HS = replace(_TLQ, hadamard_transform=True)
GRID: Dict[str, QuantizationConfig] = {
    "TLq": _TLQ,
    "TLq-HS": _HS,
    "TLq 4-bit intra": replace(_TLQ, gradient_quantization_bits_intra=4),
    "TLq-HS 2-bit inter": replace(_HS, gradient_quantization_bits_inter=2),
    "TLq-HS 8-bit inter": replace(_HS, gradient_quantization_bits_inter=8),
    "TLq-HS 4-bit intra": replace(_HS, gradient_quantization_bits_intra=4),
    "TLq-HS gs-inter 32": replace(_HS, gq_group_size_inter=32),
    "TLq-HS gs-inter 512": replace(_HS, gq_group_size_inter=512),
    "TLq-HS gs-intra 128": replace(_HS, gq_group_size_intra=128),
    "TLq-HS gs-intra 2048": replace(_HS, gq_group_size_intra=2048),
}
"""One-step configurations run at every M x D of the grid (flags: config.py field names)."""
SERIES: Dict[str, QuantizationConfig] = {
    "TLq 4-bit intra": GRID["TLq 4-bit intra"],
    "TLq 4-bit intra + LoCo": replace(GRID["TLq 4-bit intra"], loco=True),
    "TLq-HS": _HS,
    "TLq-HS + LoCo": replace(_HS, loco=True),
}
"""Gradient configurations run on consecutive steps with persistent runtimes (LoCo state)."""
WEIGHTS: Dict[str, QuantizationConfig] = {
    "qWD": QuantizationConfig(quantized_weights=True),
    "qW": QuantizationConfig(quantized_weights=True, weight_quantization_mode="direct"),
}
"""Weight all-gather configurations (4 bits, groups of 2048), run on consecutive steps."""


# ------------------------------------------------------------------------------------------------
# what one rank does: the call sequence of ddp.QuantizedBucketGroup (shared with the test)
# ------------------------------------------------------------------------------------------------

def reduce_scatter_step(rt: QuantizationRuntime, bucket: torch.Tensor,
                        iteration: int) -> torch.Tensor:
    """``start_grad_sync`` on one bucket already pre-scaled by 1/P: the SUM lands in place in
    this rank's shard of the bucket; then the step's NaN/Inf agreement (``prepare_grads``)."""
    rt.set_iteration(iteration)
    shard = bucket.view(rt.groups.dp_size, -1)[rt.groups.dp_rank]
    rt.reduce_scatter(bucket, shard, key=KEY, index=INDEX)
    if rt.agree_nonfinite(bucket.device):
        raise FloatingPointError("non-finite quantized gradients")
    return shard.clone()


def weight_gather_step(rt: QuantizationRuntime, params: torch.Tensor, master: torch.Tensor,
                       iteration: int, streams: Optional[Any] = None) -> None:
    """One optimizer step's weight path: the hook snapshots the qWD reference shard, the
    optimizer copies the new master shard into the param buffer (cast to its dtype), then
    ``start_param_sync`` gathers every shard into ``params`` (in place, as the param buffer);
    with ``streams`` (overlap) on the runtime's stages, waited on the caller's stream."""
    rt.set_iteration(iteration)
    p, r = rt.groups.dp_size, rt.groups.dp_rank
    shard = params.view(p, -1)[r]
    rt.note_weights_updated(KEY, shard)
    shard.copy_(master.view(p, -1)[r])
    updated, ref = rt.take_update(KEY)
    assert updated
    new = shard.detach().clone()
    if ref is not None:
        shard.copy_(ref)
    handle = rt.all_gather(new, params, key=KEY, index=INDEX, reference=params, streams=streams)
    if streams is not None:
        handle.wait()


class VirtualCluster:
    """M x D virtual ranks, each with the product's runtime for ``cfg`` (persistent state)."""

    def __init__(self, m: int, d: int, cfg: QuantizationConfig) -> None:
        self.m, self.d, self.p = m, d, m * d
        self.cfg = replace(cfg, data_parallel_intra_node_size=d)
        self.vdist = VirtualDist(self.p)
        with installed(self.vdist):
            groups = build_virtual_groups(self.vdist, d)
        self.runtimes = [QuantizationRuntime(self.cfg, g) for g in groups]
        for rt in self.runtimes:
            rt.register(KEY, INDEX)
        self.multiple = required_padding_multiple_from_config(self.cfg, self.p, d)

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """Zero-padded to the bucket multiple the quantized collectives need
        (mcore_compat.ddp_buckets' PaddedParamAndGradBuffer pads each bucket the same way)."""
        n = -(-flat.numel() // self.multiple) * self.multiple
        return torch.nn.functional.pad(flat, (0, n - flat.numel()))

    def run(self, fn: Callable[[int], Any]) -> List[Any]:
        with installed(self.vdist):
            return self.vdist.run(fn)

    def reduce_scatter(self, grads: Sequence[torch.Tensor], iteration: int,
                       observe_hop1: bool = False
                       ) -> Tuple[torch.Tensor, Optional[List[torch.Tensor]]]:
        """The quantized mean of ``grads[:P]`` (padded bucket) and, with ``observe_hop1`` on a
        two-level layout, every rank's dequantized intra-node sum (slot order)."""
        buckets = [self.pad(g).mul_(1.0 / self.p) for g in grads[:self.p]]
        observe = observe_hop1 and self.m > 1 and self.d > 1
        self.vdist.record, self.vdist.received = observe, {}
        shards = self.run(lambda r: reduce_scatter_step(self.runtimes[r], buckets[r], iteration))
        self.vdist.record = False
        hop1 = None
        if observe:
            c, n = self.cfg, buckets[0].numel()
            hop1 = []
            for r, rt in enumerate(self.runtimes):
                (_, codes), (_, scales) = [e for e in self.vdist.received[r]
                                           if e[0] is rt.groups.intra_group][:2]
                scales = scales.view(torch.float32)   # they travel as bytes (collectives)
                q = QuantizedTensor(codes, scales, c.gradient_quantization_bits_intra,
                                    c.gq_group_size_intra, n)
                hop1.append(dequantize_sum(q, self.d, hadamard=c.hadamard_transform,
                                           hadamard_block=c.hadamard_block_size))
            self.vdist.received = {}
        return torch.cat(shards), hop1


# ------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------

def rel_cos(q: torch.Tensor, ref: torch.Tensor) -> Tuple[float, float]:
    """(||q - ref|| / ||ref||, cos(q, ref)) in fp64."""
    q, ref = q.double().reshape(-1), ref.double().reshape(-1)
    rn = ref.norm()
    return float((q - ref).norm() / rn), float(q.dot(ref) / (q.norm() * rn).clamp_min(1e-300))


def hop_errors(cl: VirtualCluster, grads: Sequence[torch.Tensor], out: torch.Tensor,
               hop1: List[torch.Tensor], ref: torch.Tensor) -> Dict[str, float]:
    """Per-hop errors of a two-level reduce-scatter from the observed intra-node sums."""
    m, d, p = cl.m, cl.d, cl.p
    order = swizzle_order(d, m)
    node_sums = [sum(cl.pad(grads[n * d + j]).mul_(1.0 / p).double() for j in range(d)).view(p, -1)
                 for n in range(m)]   # the buckets as the ranks sent them, summed exactly
    exact1, deq1 = [], []
    for r in range(p):
        node, local = divmod(r, d)
        exact1.append(node_sums[node][order[local * m:(local + 1) * m]].reshape(-1))
        deq1.append(hop1[r].double())
    rel1, cos1 = rel_cos(torch.cat(deq1), torch.cat(exact1))
    # the exact inter hop on the hop-1 results: partition order[l*M + k] of every node's rank l
    from_hop1 = torch.zeros_like(out, dtype=torch.float64).view(p, -1)
    for r in range(p):
        local = r % d
        pieces = deq1[r].view(m, -1)
        for k in range(m):
            from_hop1[order[local * m + k]] += pieces[k]
    n_ref = ref.numel()
    from_hop1 = from_hop1.view(-1)[:n_ref]
    rel2 = float((out.double().view(-1)[:n_ref] - from_hop1).norm() / ref.double().norm())
    _, cos2 = rel_cos(out.view(-1)[:n_ref], from_hop1)
    return {"hop1_rel": rel1, "hop1_cos": cos1, "hop2_rel": rel2, "hop2_cos": cos2,
            # hop 1's error as it reaches the output (same denominator as hop2 / e2e)
            "hop1_out_rel": rel_cos(from_hop1, ref)[0]}


# ------------------------------------------------------------------------------------------------
# the study
# ------------------------------------------------------------------------------------------------

def parse_layouts(text: str) -> List[Tuple[int, int]]:
    return [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",") if item]


def sampling_noise(grads: Sequence[torch.Tensor], mean: torch.Tensor) -> float:
    """Relative standard error of the P-rank mean gradient, sqrt(sum ||g_r - mean||^2 /
    (P (P - 1))) / ||mean||: the minibatch noise the quantization error is to be compared with
    (an error well below it is like a slightly smaller batch)."""
    p = len(grads)
    if p < 2:
        return float("nan")
    dev = sum(float((g.double() - mean).norm() ** 2) for g in grads)
    return (dev / (p * (p - 1))) ** 0.5 / float(mean.norm())


def grid_rows(grads: List[torch.Tensor], refs: Dict[int, torch.Tensor], step: int,
              layouts: Sequence[Tuple[int, int]], base: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One step of every :data:`GRID` configuration at every layout (fresh runtimes, seed
    shifted by the step so the steps' rounding draws differ)."""
    rows = []
    noise = {p: sampling_noise(grads[:p], refs[p]) for p in {m * d for m, d in layouts}}
    for name, cfg in GRID.items():
        for m, d in layouts:
            cl = VirtualCluster(m, d, replace(cfg, seed=cfg.seed + step))
            ref = refs[m * d]
            out, hop1 = cl.reduce_scatter(grads, step, observe_hop1=True)
            rel, cos = rel_cos(out[:ref.numel()], ref)
            row = dict(base, config=name, M=m, D=d, P=m * d, e2e_rel=rel, e2e_cos=cos,
                       noise_rel=noise[m * d],
                       bits_intra=cfg.gradient_quantization_bits_intra,
                       bits_inter=cfg.gradient_quantization_bits_inter,
                       gs_intra=cfg.gq_group_size_intra, gs_inter=cfg.gq_group_size_inter,
                       hadamard=cfg.hadamard_transform)
            if hop1 is not None:
                row.update(hop_errors(cl, grads, out, hop1, ref))
            elif m == 1 or d == 1:   # one hop: it is the end-to-end figure
                h = "hop1" if m == 1 else "hop2"
                row.update({f"{h}_rel": rel, f"{h}_cos": cos})
            rows.append(row)
    return rows


class WeightSeries:
    """qWD / qW at one layout over consecutive steps: the ranks' bf16 param buffers persist."""

    def __init__(self, name: str, m: int, d: int, w0: torch.Tensor) -> None:
        self.name, self.cl = name, VirtualCluster(m, d, WEIGHTS[name])
        self.params = [self.cl.pad(w0.to(torch.bfloat16)) for _ in range(self.cl.p)]
        self.prev = self.params[0].float()

    def step(self, w: torch.Tensor, w_prev: torch.Tensor, step: int,
             base: Dict[str, Any]) -> Dict[str, Any]:
        """Gather the new master weights ``w``; errors vs bf16(w) and vs the update w - w_prev."""
        cl, master, n = self.cl, self.cl.pad(w), w.numel()
        cl.run(lambda r: weight_gather_step(cl.runtimes[r], self.params[r], master, step))
        if not all(torch.equal(self.params[0], b) for b in self.params[1:]):
            raise AssertionError(f"{self.name} {cl.m}x{cl.d}: replicas differ")
        recon, exact = self.params[0].float(), w.to(torch.bfloat16).float()
        rel, cos = rel_cos(recon[:n], exact)
        upd = (w - w_prev).double()
        row = dict(base, kind="weight", config=self.name, M=cl.m, D=cl.d, rel=rel, cos=cos,
                   rel_to_update=float((recon[:n] - exact).double().norm() / upd.norm()),
                   update_cos=rel_cos((recon - self.prev)[:n], upd)[1])
        self.prev = recon
        return row


def run_study(args: argparse.Namespace) -> Dict[str, Any]:
    """Grid (one-step errors at every M x D, the first ``--grid-steps`` steps) and series
    (consecutive steps, persistent runtimes) along the exact trajectory of the quickstart GPT."""
    from quant_study_grads import GptGradients

    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    grid_layouts = [(m, d) for m in args.m for d in args.d]
    series_layouts = parse_layouts(args.series_layouts)
    p_series = max([m * d for m, d in series_layouts] or [1])
    p_grid = max(m * d for m, d in grid_layouts)
    gpt = GptGradients(seed=args.seed, micro_batch_size=args.micro_batch_size)
    print(f"[study] GPT with {gpt.numel} parameters; {args.warmup} exact warm-up steps", flush=True)
    for s in range(args.warmup):   # off the initialization, on 4 micro-batches per step
        gpt.apply(torch.stack(gpt.gradients(-1 - s, 4)).double().mean(0).float())
    grid: List[Dict[str, Any]] = []
    series_rows: List[Dict[str, Any]] = []
    series = {(name, m, d): VirtualCluster(m, d, cfg) for name, cfg in SERIES.items()
              for m, d in series_layouts}
    w_prev = gpt.weights()
    weights = [WeightSeries(name, m, d, w_prev) for name in WEIGHTS for m, d in series_layouts]
    sums: Dict[Tuple[str, int, int], List[Any]] = {}
    t_grads = 0.0
    for step in range(args.steps):
        tg = time.perf_counter()
        torch.set_num_threads(args.threads)
        p_max = max(p_series, p_grid if step < args.grid_steps else 1)
        grads = gpt.gradients(step, p_max)   # rank r's micro-batch: the same at every layout
        torch.set_num_threads(1)          # the virtual ranks run single-threaded kernels
        t_grads += time.perf_counter() - tg
        sizes = {m * d for m, d in grid_layouts + series_layouts} | {p_series}
        refs = {p: torch.stack(grads[:p]).double().mean(0) for p in sizes if p <= p_max}
        base = {"step": step, "loss": gpt.step_loss}
        if step < args.grid_steps:
            grid += grid_rows(grads, refs, step, grid_layouts, base)
            print(f"[study] grid step {step} done ({time.perf_counter() - t0:.0f} s)", flush=True)
        for (name, m, d), cl in series.items():
            ref = refs[m * d]
            out = cl.reduce_scatter(grads, step)[0][:ref.numel()]
            rel, cos = rel_cos(out, ref)
            acc = sums.setdefault((name, m, d), [0.0, 0.0])   # what error feedback bounds:
            acc[0], acc[1] = acc[0] + out.double(), acc[1] + ref   # the error of the sum
            series_rows.append(dict(base, kind="grad", config=name, M=m, D=d, rel=rel, cos=cos,
                                    cum_rel=rel_cos(acc[0], acc[1])[0]))
        gpt.apply(refs[p_series].float())   # exact step: global batch = the series' P ranks
        w = gpt.weights()
        series_rows += [ws.step(w, w_prev, step, base) for ws in weights]
        w_prev = w
        if step % 10 == 0 or step == args.steps - 1:
            print(f"[study] step {step}: loss {gpt.step_loss:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    gpt.close()
    return {"grid": grid, "series": series_rows, "params": gpt.numel,
            "seconds": time.perf_counter() - t0, "gradient_seconds": t_grads}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from quant_study_report import write_outputs

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="M in {1,2}, D in {1,2}, series at 2x2 for 3 steps (~30 s smoke run)")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="nodes")
    ap.add_argument("--d", type=int, nargs="+", default=[1, 2, 4, 8], help="ranks per node")
    ap.add_argument("--series-layouts", default="2x2,4x8,16x8", help="MxD list for the series")
    ap.add_argument("--steps", type=int, default=50, help="consecutive measured steps")
    ap.add_argument("--grid-steps", type=int, default=2, help="steps the grid is averaged over")
    ap.add_argument("--warmup", type=int, default=100, help="exact steps before measuring")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the GPT")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"),
                    help="CSV / JSON directory")
    ap.add_argument("--img", default=str(ROOT / "docs" / "img"), help="plot directory")
    ap.add_argument("--results-md", default=str(ROOT / "docs" / "results.md"),
                    help="markdown file whose study section is (re)written; '' = none")
    ap.add_argument("--report-only", action="store_true",
                    help="re-render tables and plots from OUT/quant_error_study.json")
    args = ap.parse_args(argv)
    if args.report_only:
        write_outputs(json.loads((Path(args.out) / "quant_error_study.json").read_text()), args)
        return 0
    if args.quick:
        args.m, args.d, args.series_layouts = [1, 2], [1, 2], "2x2"
        args.steps, args.grid_steps, args.warmup = 3, 1, 2
    res = run_study(args)
    res["command"] = "python bench/quant_error_study.py" + (" " + " ".join(argv) if argv else "")
    write_outputs(res, args)
    print(f"[study] done in {res['seconds']:.0f} s (gradients {res['gradient_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
