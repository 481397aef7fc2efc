#!/usr/bin/env python3
"""Will it pay off on my cluster? Predict each variant's iteration time, TFLOP/s, bytes and memory.

Plan a recipe on 16 nodes x 8 GPUs with 100 Gbit/s per node (no GPU needed):

    python tools/planner.py --recipe examples/sdp4bit/run_1.3b.sh --nodes 16 --gpus-per-node 8 \\
        --inter-gbit 100

or any ``pretrain_gpt.py`` flags after ``--``. An MoE run (``--num-experts``, e.g.
``examples/moe/run_8x0.8b.sh``) is planned with its active parameters' FLOPs and, with
``--expert-model-parallel-size`` > 1, its expert buffers over the expert-data-parallel group (the
``expert`` columns). Rates default to the project's H200 measurements;
``--compute-json`` / ``--kernels-json`` take ``bench/gpu_throughput.py --out`` / ``bench/bench_quant.py
--json`` files, ``--gpu A100`` carries them to another GPU by the ratio of peaks. On the real
cluster, measure the links, kernels and compute of the launch and what overlap costs (about a
minute) and predict for it:

    torchrun --nnodes 16 --nproc-per-node 8 ... tools/planner.py --measure --out plan.json \\
        -- <pretrain_gpt.py flags>
    python tools/planner.py --measured plan.json -- <pretrain_gpt.py flags>

The model, its assumptions and its checks against measured runs: docs/planner.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron.planner import calibration, report, variants  # noqa: E402
from megatron.planner.cluster import GBIT, Cluster, Link  # noqa: E402
from megatron.planner.measure import read_measurement  # noqa: E402
from megatron.planner.timeline import Prediction, predict, predict_paro  # noqa: E402
from megatron.planner.workload import Workload  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", help="a recipe script (e.g. examples/sdp4bit/run_1.3b.sh): its "
                                     "pretrain_gpt.py flags (ECHO_ONLY=1, VARIANT=baseline)")
    ap.add_argument("--nodes", type=int, help="nodes (default: --measured's, else 1)")
    ap.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: --measured's, else 8)")
    ap.add_argument("--inter-gbit", type=float, help="inter-node bandwidth per node, all NICs, "
                                                     "Gbit/s per direction (default 100)")
    ap.add_argument("--inter-latency-us", type=float, default=None, help="per message (default 5)")
    ap.add_argument("--intra-gbyte", type=float, default=None,
                    help="intra-node bandwidth per GPU, GB/s per direction (default 450: NVLink 4)")
    ap.add_argument("--intra-latency-us", type=float, default=None, help="per message (default 3)")
    ap.add_argument("--gpu", help=f"carry the rates to this GPU by peak ratio ({', '.join(calibration.PEAK_TFLOPS)})")
    ap.add_argument("--compute-json", help="bench/gpu_throughput.py --out file")
    ap.add_argument("--kernels-json", help="bench/bench_quant.py --json file")
    ap.add_argument("--measured", help="a tools/planner.py --measure --out file: links and rates")
    ap.add_argument("--variants", default="", help="comma-separated labels (default all): "
                    + ", ".join(v[0] for v in variants.RECIPE_VARIANTS))
    ap.add_argument("--paro", action="store_true", help="add the PaRO strategies (TP = PP = 1)")
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0, help="for the recommendation")
    ap.add_argument("--json", help="also write the predictions here")
    ap.add_argument("--measure", action="store_true",
                    help="under torchrun: time this launch's links, kernels, compute and "
                         "what overlap costs")
    ap.add_argument("--out", help="with --measure: where rank 0 writes the measurement")
    ap.add_argument("--compute-steps", type=int, default=8,
                    help="with --measure: forward + backward steps and optimizer updates timed")
    return ap


def _cluster(a: argparse.Namespace, measured: Optional[Cluster]) -> Cluster:
    base = measured or Cluster(1, 8, Link(450e9, 3e-6), Link(100 * GBIT, 5e-6), name="stated links")
    intra = Link(a.intra_gbyte * 1e9 if a.intra_gbyte else base.intra.bandwidth,
                 a.intra_latency_us * 1e-6 if a.intra_latency_us is not None else base.intra.latency)
    inter = Link(a.inter_gbit * GBIT if a.inter_gbit else base.inter.bandwidth,
                 a.inter_latency_us * 1e-6 if a.inter_latency_us is not None else base.inter.latency)
    cluster = replace(base, nodes=a.nodes or base.nodes,
                      gpus_per_node=a.gpus_per_node or base.gpus_per_node, intra=intra, inter=inter)
    if cluster.measured and (cluster.nodes, cluster.gpus_per_node, cluster.intra, cluster.inter) != (
            base.nodes, base.gpus_per_node, base.intra, base.inter):
        # the collectives were timed on the measured layout and links, not on the ones stated
        print(f"note: {a.measured}'s timed collectives are not used for another layout or stated "
              f"links; the formulas are", file=sys.stderr)
        cluster = replace(cluster, measured={})
    for link, used, flag in (("inter", cluster.nodes > 1, "--inter-gbit"),
                             ("intra", cluster.gpus_per_node > 1, "--intra-gbyte")):
        if used and math.isinf(getattr(cluster, link).bandwidth):
            raise SystemExit(f"error: {a.measured} has no {link}-node link (the measured launch had "
                             f"none); give {flag}")
    return cluster


def plan(argv: Sequence[str], cluster: Cluster, rates: calibration.DeviceRates,
         labels: Sequence[str] = (), paro: bool = False):
    """(predictions, skipped rows, the baseline workload) for the run ``argv`` on ``cluster``."""
    rows: List[Prediction] = []
    skipped = []
    work = None
    for v in variants.variants_for(argv, labels):
        w = Workload.from_args(v.args, cluster)
        work = work or w
        rows.append(predict(v.label, w, v.quant, rates))
    if paro and work is not None:
        from megatron.distributed.quant.paro.strategy import VALID_STRATEGIES

        for s in VALID_STRATEGIES:
            row, why = predict_paro(s, work, rates)
            if row is None:
                skipped.append((f"PaRO {s}", why))
            else:
                rows.append(row)
    return rows, skipped, work


def run_measure(a: argparse.Namespace, run_argv: List[str]) -> int:
    import torch.distributed as dist

    from megatron.planner.measure import measure, write_measurement
    from megatron.planner.compute_probe import forward_backward_seconds
    from megatron.planner.workload import set_padded_vocab_size
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron

    args = parse_args(run_argv)
    set_padded_vocab_size(args)
    initialize_megatron(args)
    cluster, rates = measure(args, compute_steps=a.compute_steps,
                             compute_seconds=forward_backward_seconds)
    if dist.get_rank() == 0:
        if a.out:
            write_measurement(a.out, cluster, rates)
        slowdowns = ", ".join(f"{k} {c.compute:.2f}x, {c.communication:.2f}x"
                              for k, c in sorted(rates.contention.items()))
        print(f"[planner] measured: {cluster.describe()}; {rates.device}: "
              f"{rates.compute[0].tflops:.3g} model TFLOP/s per rank; overlap slowdowns "
              f"(compute, collective): {slowdowns or 'none'}; {rates.source}", flush=True)
        rows, skipped, work = plan(run_argv, cluster, rates, [x for x in a.variants.split(",") if x])
        print(work.describe())
        print(report.format_table(rows, skipped), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_argv: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, run_argv = argv[:i], argv[i + 1:]
    a = build_parser().parse_args(argv)
    if a.measure:
        if not run_argv:
            build_parser().error("--measure needs the run's pretrain_gpt.py flags after --")
        return run_measure(a, run_argv)
    measured_cluster, rates = (read_measurement(a.measured) if a.measured
                               else (None, calibration.default_rates()))
    cluster = _cluster(a, measured_cluster)
    if a.recipe:
        try:
            run_argv = variants.recipe_command(a.recipe, cluster.nodes, cluster.gpus_per_node) + run_argv
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if not run_argv:
        build_parser().error("give the run: --recipe SCRIPT or pretrain_gpt.py flags after --")
    if a.compute_json:
        rates = calibration.load_compute_json(a.compute_json, rates)
    if a.kernels_json:
        rates = calibration.load_kernels_json(a.kernels_json, rates)
    if a.gpu:
        rates = calibration.for_gpu(rates, a.gpu)
    labels = [x for x in a.variants.split(",") if x]
    try:
        rows, skipped, work = plan(run_argv, cluster, rates, labels, a.paro)
    except ValueError as e:   # a layout the run cannot have, an unknown variant: say which flag
        print(f"error: {e}", file=sys.stderr)
        return 2
    best, why = report.recommend(rows, a.gpu_memory_gib * 2**30)
    print(f"cluster: {cluster.describe()}")
    print(f"run: {work.describe()}")
    print(f"rates: {rates.device}; {rates.source}")
    print()
    print(report.format_table(rows, skipped))
    for note in sorted({f"{r.variant}: {n}" for r in rows for n in r.notes}):
        print(f"note: {note}")
    print()
    print(f"recommended: {best.variant if best else 'none'} ({why})")
    if a.json:
        Path(a.json).write_text(json.dumps({"cluster": cluster.describe(), "run": work.describe(),
                                            "rates": rates.source,
                                            "rows": [asdict(r) for r in rows],
                                            "recommended": best.variant if best else None},
                                           indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
