#!/usr/bin/env python3
"""The speed planner against measured runs on the emulated two-node network (needs root).

Per link speed: set up the two namespaces (setup_netns.sh), run ``tools/planner.py --measure``
there (the collectives, kernels and compute of this launch; through ``pretrain_a2a_rs.py``, so
the reduce-scatter it times is the ring ``baseline-ring`` runs), then train each variant REPEATS
times (bench_emulated.py's commands), and print predicted vs measured ms/iteration with the error
(``--nproc-per-node 1``: one rank per emulated node, one per core of this 2-core machine):

    sudo python3 bench/emulated_network/check_planner.py --bandwidths 200mbit,500mbit,1gbit \\
        --repeats 3 --out bench/out/planner_check.md

Variants: ``baseline-ring`` (fp32 gradients, NCCL's ring reduce-scatter volume, no overlap: the
baseline the planner models), ``sdp4bit``, ``sdp4bit-overlap``.

``--record DIR`` keeps what a test needs to reproduce the check without root or a network: each
link's measurement JSON and every run's median with the trainer flags it ran
(bench/results/planner_check/, tests/test_planner.py); ``--from-dir WORK`` re-predicts a finished
check from its stored measurements and runs (no root), e.g. after a change to the model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import bench_emulated as emu  # noqa: E402

from megatron.distributed.quant.config import QuantizationConfig  # noqa: E402
from megatron.planner.measure import read_measurement  # noqa: E402
from megatron.planner.timeline import predict  # noqa: E402
from megatron.planner.variants import parse_run_args  # noqa: E402
from megatron.planner.workload import Workload  # noqa: E402


def predicted_ms(measurement: str, trainer_argv: List[str]) -> Dict[str, float]:
    cluster, rates = read_measurement(measurement)
    args = parse_run_args(trainer_argv)
    cfg = QuantizationConfig.from_args(args)
    p = predict("v", Workload.from_args(args, cluster), cfg, rates)
    return {"ms": 1e3 * p.iteration_s, "compute": 1e3 * p.compute_s,
            "optimizer": 1e3 * p.optimizer_s, "grad": 1e3 * p.grad_exposed_s,
            "weight": 1e3 * p.weight_exposed_s, "contention": 1e3 * p.contention_s}


def trainer_argv(variant: str, model: dict, iters: int, jsonl: str, dp_size: int = 4,
                 log_interval: int = 1, full: bool = False) -> List[str]:
    """The variant's pretrain_gpt.py flags (``full``: with the script that runs them first),
    with the trainer's level-1 timers (:data:`MEASURED_PARTS`)."""
    cmd = emu.train_args(model, variant, iters, jsonl, dp_size=dp_size,
                         extra=["--log-interval", str(log_interval), "--timing-log-level", "1"])
    return cmd if full else cmd[len(emu.variant_script(variant)):]


MEASURED_PARTS = {"fwd-bwd": ("timers_ms", "forward-backward"), "optimizer": ("timers_ms", "optimizer"),
                  "grad": (None, "comm_grad_exposed_ms"), "weight": (None, "comm_weight_exposed_ms")}
"""What the trainer times of each iteration, by the names the table uses: ``--timing-log-level
1``'s forward-backward pass (with the gradient reduction it waits for) and optimizer step (with,
without ``--overlap-param-gather``, the parameter gather), and the time its training thread waited
for the quantized layer's gradient and weight collectives (streams.CommTiming; megatron-core's
collectives are not timed)."""


def _parts(record: dict) -> Dict[str, float]:
    out = {}
    for name, (inside, key) in MEASURED_PARTS.items():
        value = (record.get(inside) or {}).get(key) if inside else record.get(key)
        if isinstance(value, (int, float)):
            out[name] = float(value)
    return out


def collect(work: Path, bw: str, variants: List[str], warmup: int
            ) -> Dict[str, List[Dict[str, float]]]:
    """Each variant's runs at link ``bw`` from a check's work directory: per run the median
    ms/iteration ('ms') and of each of :data:`MEASURED_PARTS` the trainer logged."""
    measured: Dict[str, List[Dict[str, float]]] = {v: [] for v in variants}
    for v in variants:
        for jsonl in sorted(work.glob(f"{v}_{bw}_*.jsonl")):
            records = emu.parse_jsonl(str(jsonl))
            s = emu.summarize_iterations(records, warmup)
            if s["ms_per_iter_median"] is not None:
                parts = [_parts(r) for r in records if int(r["iteration"]) > warmup]
                measured[v].append({"ms": s["ms_per_iter_median"],
                                    **{k: statistics.median(p[k] for p in parts)
                                       for k in MEASURED_PARTS if parts and all(k in p for p in parts)}})
    return measured


def _median(runs: List[Dict[str, float]], key: str) -> float:
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else float("nan")


def predicted_rows(work: Path, bw: str, variants: List[str], model: dict, a: argparse.Namespace,
                   load: float) -> list:
    """(link, variant, prediction, median ms, runs' ms, max load, trainer flags, the median of
    each of :data:`MEASURED_PARTS`) per variant at link ``bw``, predicted from the check's
    measurement there."""
    rows = []
    for v, runs in collect(work, bw, variants, a.warmup).items():
        argv = trainer_argv(v, model, a.iters, "/dev/null", 2 * a.nproc_per_node, a.log_interval)
        pred = predicted_ms(str(work / f"measure_{bw}.json"), argv)
        parts = {k: _median(runs, k) for k in MEASURED_PARTS}
        rows.append((bw, v, pred, _median(runs, "ms"), [r["ms"] for r in runs], load, argv,
                     parts))
    return rows


def _json_number(x: float) -> Optional[float]:
    return None if math.isnan(x) else x   # JSON has no NaN


def write_record(out: Path, work: Path, rows: list, meta: dict) -> None:
    """The check's measurements and runs, enough to predict every cell again (module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    cells = []
    for bw, v, pred, med, runs, load, argv, parts in rows:
        shutil.copyfile(work / f"measure_{bw}.json", out / f"measure_{bw}.json")
        cells.append({"link": bw, "variant": v, "measurement": f"measure_{bw}.json",
                      "trainer_argv": argv, "runs_ms": runs, "median_ms": med,
                      "predicted_ms": pred["ms"],
                      "predicted_parts_ms": {k: x for k, x in pred.items() if k != "ms"},
                      "measured_parts_ms": {k: _json_number(x) for k, x in parts.items()},
                      "max_load_avg": _json_number(load)})
    (out / "runs.json").write_text(json.dumps({**meta, "cells": cells}, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidths", default="200mbit,500mbit,1gbit")
    ap.add_argument("--variants", default="baseline-ring,sdp4bit,sdp4bit-overlap")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="iterations left out of the median")
    ap.add_argument("--log-interval", type=int, default=1,
                    help="the trainer's --log-interval (each run's median is over the logged "
                         "intervals; py-spy puts rank 0's logging at 0.3-2 ms per iteration)")
    ap.add_argument("--model", default="small")
    ap.add_argument("--nproc-per-node", type=int, default=2,
                    help="ranks per emulated node (2 nodes); 1 keeps one rank per core here")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "planner_check.md"))
    ap.add_argument("--record", default=None, help="also write the portable record to this folder")
    ap.add_argument("--from-dir", default=None,
                    help="re-predict a finished check from its work folder (no runs, no root)")
    a = ap.parse_args()
    model = emu.MODEL_PRESETS[a.model]
    dp = 2 * a.nproc_per_node
    variants = a.variants.split(",")
    rows = []
    if a.from_dir:
        work = Path(a.from_dir)
        for bw in a.bandwidths.split(","):
            rows += predicted_rows(work, bw, variants, model, a, float("nan"))
    elif os.geteuid() != 0:
        print("check_planner.py needs root (ip netns / tc)", file=sys.stderr)
        return 2
    else:
        scratch = REPO / "bench" / "out"      # not in a fresh clone (ignored by git)
        scratch.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="planner_check_", dir=scratch))
    for bw in ([] if a.from_dir else a.bandwidths.split(",")):
        state = work / f"state_{bw}"
        env = dict(os.environ, BANDWIDTH=bw, LATENCY="1ms", MTU="1500", NS_PREFIX=f"pc{os.getpid()}",
                   ADDR0="10.77.0.1", ADDR1="10.77.0.2", IF0="emu0", IF1="emu1", STATE_FILE=str(state))
        script = str(HERE / "setup_netns.sh")
        subprocess.run(["bash", script, "up"], env=env, check=True)
        try:
            topo = emu.Topology(namespaces=[f"pc{os.getpid()}n0", f"pc{os.getpid()}n1"],
                                ifnames=["emu0", "emu1"], nproc_per_node=a.nproc_per_node)
            m_json = str(work / f"measure_{bw}.json")
            base = trainer_argv("baseline", model, 2, str(work / "measure.jsonl"), dp)
            # through the ring launcher: --measure times the reduce-scatter baseline-ring runs
            cmds = emu.node_commands(topo, [*emu.variant_script("baseline-ring"), "--rs-script",
                                            "tools/planner.py", "--measure", "--out", m_json,
                                            "--", *base])
            for attempt in range(2):   # a launch that fails to start is retried once, said so
                rc = emu.run_nodes(cmds, a.timeout, str(work / f"measure_{bw}_{attempt}"))
                if not rc and Path(m_json).exists():
                    break
                print(f"{bw}: --measure attempt {attempt} failed (rc {rc})", file=sys.stderr, flush=True)
            if rc or not Path(m_json).exists():
                print(f"{bw}: --measure failed (rc {rc}), logs in {work}", file=sys.stderr)
                return 1
            loads: List[float] = []
            for r in range(a.repeats):
                for v in variants:
                    jsonl = str(work / f"{v}_{bw}_{r}.jsonl")
                    cmds = emu.node_commands(topo, trainer_argv(v, model, a.iters, jsonl, dp,
                                                                log_interval=a.log_interval,
                                                                full=True))
                    if emu.run_nodes(cmds, a.timeout, str(work / f"{v}_{bw}_{r}")):
                        print(f"{bw} {v} run {r} failed, logs in {work}", file=sys.stderr)
                        Path(jsonl).unlink(missing_ok=True)
                        continue
                    loads.append(os.getloadavg()[0])
            for row in predicted_rows(work, bw, variants, model, a, max(loads, default=0.0)):
                rows.append(row)
                _, v, pred, med, runs, _, _, _ = row
                print(f"{bw} {v}: predicted {pred['ms']:.0f} ms, measured {med:.0f} ms {runs}", flush=True)
        finally:
            subprocess.run(["bash", script, "down"], env=env, check=False)
    lines = [f"Planner check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, model {a.model}, "
             f"2 nodes x {a.nproc_per_node} ranks, "
             f"{a.repeats} runs per variant ({a.iters} iterations, median after {a.warmup}); "
             f"measurements in {work}", "",
             "| link | variant | predicted ms/iter (compute / optimizer / grad exposed / "
             "weight exposed / of which contention) "
             "| measured median ms/iter (fwd-bwd / optimizer / grad exposed / weight exposed) "
             "| runs (ms) | error | spread of runs | max load avg |",
             "|---|---|---:|---:|---|---:|---:|---:|"]
    for bw, v, pred, med, runs, load, _, parts in rows:
        spread = (max(runs) - min(runs)) / med if runs else float("nan")
        timed = ("" if all(math.isnan(x) for x in parts.values()) else " (" + " / ".join(
            "-" if math.isnan(parts[k]) else f"{parts[k]:.0f}" for k in MEASURED_PARTS) + ")")
        lines.append(f"| {bw} | {v} | {pred['ms']:.0f} ({pred['compute']:.0f} / "
                     f"{pred['optimizer']:.0f} / {pred['grad']:.0f} / "
                     f"{pred['weight']:.0f} / {pred['contention']:.0f}) | {med:.0f}{timed} | "
                     f"{', '.join(f'{x:.0f}' for x in runs)} | {100 * (pred['ms'] / med - 1):+.1f} % | "
                     f"{100 * spread:.0f} % | {load:.1f} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(lines) + "\n")
    if a.record:
        write_record(Path(a.record), work, rows,
                     {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "command": "python bench/emulated_network/check_planner.py "
                                 + " ".join(sys.argv[1:]),
                      "model": a.model, "nodes": 2, "nproc_per_node": a.nproc_per_node,
                      "iterations": a.iters, "median_after": a.warmup})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
