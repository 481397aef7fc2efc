#!/usr/bin/env python3
"""The quantized layer as a cluster runs it: 4 processes (2 nodes x 2), one script, one report.

    python bench/nccl_processes.py --device cuda --out runs/nccl_processes     # NCCL processes
    python bench/nccl_processes.py --device cpu --out runs/nccl_processes_cpu  # gloo (what CI runs)

On one GPU the 4 NCCL processes share it (an NCCL >= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``,
e.g. ``.device/boot.sh``'s; the trainer places local rank l on GPU l % count). Every run is
``pretrain_gpt.py`` under torchrun, ``--data-parallel-intra-node-size 2``, deterministic (no
dropout, round to nearest), SDP4Bit + LoCo + ``--gradient-alltoall-pipeline 2`` with a NaN in
rank 1's gradient at iteration 3 (a wrapper adds it: the step must be skipped on every rank).
What must hold, each a row of the report:

1. overlap on (``--overlap-grad-reduce --overlap-param-gather``) and off: the same losses and
   gradient norms, bit for bit (one bucket: megatron-core makes one without overlap), and on
   several buckets the gradient overlap alone against both overlaps;
2. a save at iteration 4 and a resume to the end: the same as the uninterrupted run, bit for bit;
3. the loss within ``--loss-rtol`` (5 %) of megatron-core's baseline at the last iteration;
4. the NaN step skipped (one skipped iteration), also with ``TORCH_NCCL_NAN_CHECK=1`` (NCCL
   checks every floating-point collective input for NaN: the scales travel as bytes);
5. a PaRO strategy on the engine (``--paro-strategy IIG``) trains to finite losses;
6. peak GPU memory per process (max allocated, MB) with and without quantization at
   ``--memory-bucket`` (40M) elements per bucket, on a 125M-parameter shape (CUDA only).

Exit status 1 if a check failed; the report (markdown) is ``--out``/report.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent

WRAPPER = r'''
import os, sys
sys.path.insert(0, {repo!r})
import torch
from megatron.distributed.quant import integration

NAN_STEP, NAN_RANK = int(os.environ.get("NAN_STEP", "0")), int(os.environ.get("NAN_RANK", "1"))
MICRO = int(os.environ.get("MICRO_BATCHES", "1"))
wrap = integration.wrap_model

def wrap_and_poison(*args, **kwargs):
    chunks = wrap(*args, **kwargs)
    if NAN_STEP and int(os.environ["RANK"]) == NAN_RANK:
        param = next(p for n, p in chunks[0].named_parameters() if "linear_fc1.weight" in n)
        calls = {{"n": 0}}
        def hook(grad):
            calls["n"] += 1
            if (calls["n"] - 1) // MICRO + 1 == NAN_STEP:
                grad = grad.clone()
                grad.view(-1)[0] = float("nan")
            return grad
        param.register_hook(hook)
    return chunks

integration.wrap_model = wrap_and_poison
import pretrain_gpt
sys.exit(pretrain_gpt.main(sys.argv[1:]))
'''

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "128",
        "--make-vocab-size-divisible-by", "8"]
SHAPE_125M = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
              "--seq-length", "512", "--max-position-embeddings", "512", "--vocab-size", "50257"]
COMMON = ["--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-3", "--bf16",
          "--use-distributed-optimizer", "--mock-data", "--log-interval", "1", "--eval-iters",
          "0", "--split", "100,0,0", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--seed", "1234", "--data-parallel-intra-node-size", "2"]
SDP4BIT = ["--quantized-weights", "--quantized-gradients", "--hadamard-transform", "--loco",
           "--no-stochastic-rounding", "--gradient-alltoall-pipeline", "2"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000"]
NAN_STEP = 3
SAVE_AT = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, name: str, argv: List[str], device: str, env_extra: Dict[str, str],
            timeout: int) -> Tuple[int, str, List[dict]]:
    """One torchrun of 4 processes through the NaN wrapper; (status, log, train records)."""
    wrapper = out / "nan_wrapper.py"
    wrapper.write_text(WRAPPER.format(repo=str(REPO)))
    jsonl = out / f"{name}.jsonl"
    jsonl.unlink(missing_ok=True)
    backend = ["--device", "cuda", "--distributed-backend", "nccl"] if device == "cuda" else \
        ["--device", "cpu", "--distributed-backend", "gloo"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(wrapper),
           *argv, *backend, "--jsonl-log", str(jsonl)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=os.environ.get(
        "OMP_NUM_THREADS", "1"), MICRO_BATCHES="2", **env_extra)
    t0 = time.monotonic()
    try:
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=timeout)
        status, log = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired as exc:
        status, log = 124, f"timed out after {timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"
    (out / f"{name}.log").write_text(f"$ {' '.join(cmd)}\n{log}")
    records = []
    if jsonl.exists():
        records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    print(f"[nccl_processes] {name}: exit {status} in {time.monotonic() - t0:.0f} s", flush=True)
    return status, log, [r for r in records if r.get("type") == "train"]


def _series(records: List[dict]) -> Dict[int, Tuple[float, Optional[float]]]:
    return {r["iteration"]: (r["lm_loss"], r.get("grad_norm")) for r in records}


def _max_allocated(log: str) -> Optional[float]:
    found = [float(v) for v in re.findall(r"max allocated: ([0-9.]+)", log)]
    return max(found) if found else None


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "nccl_processes")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--loss-rtol", type=float, default=0.05)
    ap.add_argument("--memory-bucket", type=int, default=40_000_000)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    base = TINY + COMMON + ["--train-iters", str(a.iters)]
    nan = {"NAN_STEP": str(NAN_STEP)}
    rows: List[Tuple[str, bool, str]] = []

    def run(name: str, extra: List[str], env: Optional[Dict[str, str]] = None,
            args: Optional[List[str]] = None) -> Tuple[int, str, Dict[int, tuple]]:
        status, log, recs = _launch(a.out, name, (args or base) + extra, a.device, env or {},
                                    a.timeout)
        return status, log, _series(recs)

    _, _, baseline = run("baseline", [])
    # megatron-core makes one bucket without --overlap-grad-reduce: overlap on vs off compares
    # one bucket; several buckets compare the gradient overlap alone with both overlaps.
    s_off, _, off = run("sdp4bit-sync", SDP4BIT, nan)
    s_one, _, one = run("sdp4bit-overlap-one-bucket", SDP4BIT + OVERLAP[:2] + [
        "--ddp-bucket-size", str(10 ** 9)], nan)
    ok = s_off == 0 and s_one == 0 and len(off) == a.iters and one == off
    rows.append(("overlap on vs off (one bucket), bit for bit", ok,
                 f"{len(off)} iterations, losses and grad norms "
                 f"{'equal' if one == off else 'DIFFER'}"))
    s_on, _, on = run("sdp4bit-overlap", SDP4BIT + OVERLAP, nan)
    s_grad, _, grad = run("sdp4bit-grad-overlap", SDP4BIT + OVERLAP[:1] + OVERLAP[2:], nan)
    ok = s_on == 0 and s_grad == 0 and len(on) == a.iters and on == grad
    rows.append(("several buckets: gradient overlap vs both overlaps, bit for bit", ok,
                 f"{len(on)} iterations, {'equal' if on == grad else 'DIFFER'}"))

    ckpt = a.out / "ckpt"
    subprocess.run(["rm", "-rf", str(ckpt)], check=False)
    s1, _, first = run("sdp4bit-save", SDP4BIT + OVERLAP + ["--save", str(ckpt),
                                                          "--save-interval", str(SAVE_AT),
                                                          "--exit-interval", str(SAVE_AT)], nan)
    s2, _, resumed = run("sdp4bit-resume", SDP4BIT + OVERLAP + ["--load", str(ckpt)], nan)
    tail = {i: v for i, v in on.items() if i > SAVE_AT}
    ok = s1 == 0 and s2 == 0 and bool(tail) and resumed == tail
    rows.append((f"save at {SAVE_AT} and resume, bit for bit", ok,
                 f"iterations {sorted(resumed)} {'equal' if resumed == tail else 'DIFFER'}"))

    last = max(on) if on else None
    if last is not None and last in baseline:
        rel = abs(on[last][0] - baseline[last][0]) / abs(baseline[last][0])
        rows.append((f"loss at iteration {last} vs baseline", rel <= a.loss_rtol,
                     f"{on[last][0]:.4f} vs {baseline[last][0]:.4f} (rel. {rel:.2e}, "
                     f"tolerance {a.loss_rtol:g})"))
    else:
        rows.append(("loss vs baseline", False, "a run has no last iteration"))

    s_nan, _, records = _launch(a.out, "sdp4bit-nan-check", base + SDP4BIT + OVERLAP, a.device,
                                dict(nan, TORCH_NCCL_NAN_CHECK="1"), a.timeout)
    checked = _series(records)
    skipped = [r["iteration"] for r in records if r.get("skipped_iterations")]
    ok = s_nan == 0 and skipped == [NAN_STEP] and checked == on
    rows.append(("NaN step skipped with TORCH_NCCL_NAN_CHECK=1", ok,
                 f"exit {s_nan}, skipped at {skipped}, "
                 f"{'same as' if checked == on else 'DIFFERS from'} the run without the check"))

    s_paro, _, paro = run("paro-IIG", ["--paro-strategy", "IIG", "--paro-group-size", "2"]
                          + SDP4BIT[:4])
    finite = bool(paro) and all(v[0] == v[0] and abs(v[0]) < float("inf") for v in paro.values())
    rows.append(("PaRO IIG on the engine", s_paro == 0 and finite,
                 f"exit {s_paro}, {len(paro)} iterations, finite losses: {finite}"))

    if a.device == "cuda":
        mem_args = SHAPE_125M + COMMON + ["--train-iters", "3", "--ddp-bucket-size",
                                          str(a.memory_bucket)]
        for name, extra in (("memory-baseline", []), ("memory-sdp4bit", SDP4BIT + OVERLAP)):
            status, log, _ = _launch(a.out, name, mem_args + extra, a.device, {}, a.timeout)
            peak = _max_allocated(log)
            rows.append((f"peak memory per process, {name[7:]}", status == 0 and peak is not None,
                         f"max allocated {peak} MB (bucket {a.memory_bucket / 1e6:.0f}M)"))

    lines = [f"# 4 processes, 2 nodes x 2, {a.device} ({time.strftime('%Y-%m-%d %H:%M')})", "",
             "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {name} | {'PASS' if ok else 'FAIL'} | {detail} |" for name, ok, detail in rows]
    report = "\n".join(lines) + "\n"
    (a.out / "report.md").write_text(report)
    print(report)
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
