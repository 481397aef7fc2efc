"""Per-step data-parallel communication of a distributed optimizer, plain vs SDP4Bit-quantized.

Run under torchrun (one process per rank; gloo on CPU). One "step" is what the distributed
optimizer moves per iteration for N parameters:

* baseline : ``reduce_scatter_tensor`` of the fp32 gradient buffer (N fp32) into each rank's N/P
             shard, then ``all_gather_into_tensor`` of the bf16 parameter shards (N bf16);
* sdp4bit  : ``two_level_reduce_scatter`` (TLq-HS: 8-bit intra / 4-bit inter, group 128/128,
             Hadamard) and ``quantized_all_gather`` (qWD: 4-bit weight differences, group 2048)
             from ``megatron.distributed.quant.collectives``;
* sdp4bit-two-messages : the same with codes and scales sent as two messages on every hop (the
             collectives before they packed them into one across nodes), to measure what the
             second message's latency costs.

Both variants run in the same invocation on the same process groups. Each rank prints nothing but
the launcher-facing JSON line of global rank 0 (``BENCH_RESULT {...}``) and, when ``--out`` is
given, writes it there. If ``EMU_IFNAME`` names an interface of this network namespace, local
rank 0 of every node reads its tx byte counter around the timed loop, so the result carries the
real bytes that crossed the emulated inter-node link (TCP/IP headers included).

    torchrun --nnodes 2 --node-rank K --nproc-per-node 2 --master-addr 10.77.0.1 \
        bench/emulated_network/bench_collectives.py --numel 25000000 --iters 5 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

VARIANTS = ("baseline", "sdp4bit", "sdp4bit-two-messages")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=25_000_000,
                   help="parameters N (rounded up to the quantized collectives' padding multiple)")
    p.add_argument("--iters", type=int, default=5, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {VARIANTS}, run in this order")
    p.add_argument("--intra-size", type=int, default=None,
                   help="DP ranks per node (default LOCAL_WORLD_SIZE)")
    p.add_argument("--bits-intra", type=int, default=8)
    p.add_argument("--bits-inter", type=int, default=4)
    p.add_argument("--gq-group-size-intra", type=int, default=128)
    p.add_argument("--gq-group-size-inter", type=int, default=128)
    p.add_argument("--no-hadamard", dest="hadamard", action="store_false")
    p.add_argument("--weight-bits", type=int, default=4)
    p.add_argument("--wq-group-size", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--out", default=None, help="write rank 0's JSON result here")
    return p.parse_args(argv)


def padded_numel(numel: int, dp_size: int, intra_size: int, args: argparse.Namespace) -> int:
    from megatron.distributed.quant.collectives.common import required_padding_multiple
    mult = required_padding_multiple(dp_size, intra_size, args.gq_group_size_intra,
                                     args.gq_group_size_inter, weight_group_size=args.wq_group_size)
    return -(-numel // mult) * mult


def read_tx_bytes(ifname: Optional[str]) -> Optional[int]:
    if not ifname:
        return None
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def main(argv: Optional[List[str]] = None) -> Dict:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from megatron.distributed.quant.collectives import gradients, weights
    from megatron.distributed.quant.collectives.gradients import two_level_reduce_scatter
    from megatron.distributed.quant.collectives.weights import quantized_all_gather
    from megatron.distributed.quant.topology import build_two_level_groups
    from megatron.distributed.quant.config import HopSpec

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    intra = args.intra_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    groups = build_two_level_groups(list(range(world)), intra)
    n = padded_numel(args.numel, world, intra, args)
    s = n // world
    ifname = os.environ.get("EMU_IFNAME") if local_rank == 0 else None

    gen = torch.Generator().manual_seed(1234 + rank)
    grad = torch.randn(n, generator=gen) * 1e-3               # fp32 main grads
    params_bf16 = (torch.randn(n, generator=torch.Generator().manual_seed(7)) * 0.02).to(torch.bfloat16)
    shard_out = torch.empty(s, dtype=torch.float32)
    gathered = torch.empty(n, dtype=torch.bfloat16)

    def step(variant: str) -> Dict[str, float]:
        t0 = time.perf_counter()
        if variant == "baseline":
            dist.reduce_scatter_tensor(shard_out, grad)
            t1 = time.perf_counter()
            my = params_bf16[rank * s:(rank + 1) * s].clone()
            dist.all_gather_into_tensor(gathered, my)
        else:
            two_level_reduce_scatter(
                grad, shard_out, groups,
                intra=HopSpec(args.bits_intra, args.gq_group_size_intra, hadamard=args.hadamard),
                inter=HopSpec(args.bits_inter, args.gq_group_size_inter, hadamard=args.hadamard),
                generator=gen)
            t1 = time.perf_counter()
            # fp32 master shard = reference + a small update (what the optimizer step produces)
            ref = params_bf16
            master = ref[rank * s:(rank + 1) * s].float() + shard_out * 1e-2
            quantized_all_gather(master, ref, gathered, groups.dp_group, mode="diff",
                                 spec=HopSpec(args.weight_bits, args.wq_group_size), generator=gen)
        t2 = time.perf_counter()
        return {"rs": t1 - t0, "ag": t2 - t1, "total": t2 - t0}

    # exact reference for the accuracy line
    exact = torch.empty(s, dtype=torch.float32)
    dist.reduce_scatter_tensor(exact, grad)

    results: Dict[str, Dict] = {}
    one_message = gradients._one_message   # collectives.common's, looked up by both paths
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; choose from {VARIANTS}")
        for path in (gradients, weights):
            path._one_message = (lambda link: False) if variant == "sdp4bit-two-messages" \
                else one_message
        for _ in range(args.warmup):
            step(variant)
        dist.barrier()
        tx0 = read_tx_bytes(ifname)
        times = []
        for _ in range(args.iters):
            dist.barrier()
            times.append(step(variant))
        dist.barrier()
        tx1 = read_tx_bytes(ifname)
        # the slowest rank defines the step time
        tot = torch.tensor([t["total"] for t in times], dtype=torch.float64)
        dist.all_reduce(tot, op=dist.ReduceOp.MAX)
        link = torch.tensor([float(tx1 - tx0) if tx0 is not None and tx1 is not None else 0.0,
                             1.0 if tx0 is not None else 0.0], dtype=torch.float64)
        dist.all_reduce(link)
        rel_err = float((shard_out - exact).norm() / exact.norm()) if variant != "baseline" else 0.0
        err = torch.tensor([rel_err], dtype=torch.float64)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        results[variant] = {
            "ms_per_step_median": 1e3 * statistics.median(tot.tolist()),
            "ms_per_step_all": [round(1e3 * v, 2) for v in tot.tolist()],
            "ms_rs_median_rank0": 1e3 * statistics.median(t["rs"] for t in times),
            "ms_ag_median_rank0": 1e3 * statistics.median(t["ag"] for t in times),
            # tx of both veth ends = every byte that crossed the link, both directions
            "inter_node_bytes_per_step": (link[0].item() / args.iters) if link[1].item() > 0 else None,
            "grad_rel_err_vs_exact": err.item(),
        }
    out = {"numel": n, "world": world, "intra_size": intra, "iters": args.iters,
           "warmup": args.warmup, "hadamard": args.hadamard, "results": results}
    if rank == 0:
        print("BENCH_RESULT " + json.dumps(out), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
