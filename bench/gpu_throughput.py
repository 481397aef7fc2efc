#!/usr/bin/env python3
"""Throughput on one GPU: our trainer (baseline and SDP4Bit) against a plain PyTorch GPT.

Issue 23, item 5. For each shape (the SDP4Bit recipes' 125M / 350M / 1.3B, or ``--toy`` on CPU)
it runs, each as its own subprocess:

* ``baseline``: ``examples/sdp4bit/run_<shape>.sh`` as shipped (``VARIANT=baseline``), launched
  by ``torchrun --nproc-per-node 1`` on mock data. The command is the recipe's own (``ECHO_ONLY=1``
  prints it), with only these changes: ``--micro-batch-size`` / ``--global-batch-size``
  (default the recipe's micro-batch and a global batch of 16, what issue 23 measured), the
  iteration count, ``--log-interval 1 --eval-iters 0 --jsonl-log``, no ``--save / --load /
  --tensorboard-dir``, and no activation recomputation unless ``--recompute`` (the reference has
  none: like for like);
* ``sdp4bit``: the same with ``VARIANT=sdp4bit`` (``--quantized-weights --quantized-gradients
  --hadamard-transform`` and the recipe's bits and group sizes; data-parallel size 1);
* ``reference``: ``bench/reference_gpt.py`` (SDPA, fused AdamW, bf16 autocast, no recompute);
  ``reference-compile`` (``--runs``): the same under ``torch.compile``.

ms/iteration is the median of the iterations after ``--warmup`` (ours: the ``ms_per_iteration``
of each ``--jsonl-log`` record, Megatron's "elapsed time per iteration", ``--log-interval 1``);
TFLOP/s is Megatron-LM's model-FLOPs count (``megatron/training/model/flops.py``, one definition
for every row) at that median; peak memory is ``torch.cuda.max_memory_allocated`` at the end of
the run in every process (ours: read by the small wrapper ``--_trainer`` that torchrun starts and
that runs ``pretrain_gpt.py`` in-process; the trainer's own memory report, when its log or jsonl
has one, is kept in the JSON as ``trainer_memory_report``); on CPU the process's peak RSS.
The last column is ms/iteration over the reference's (same shape).

    python bench/gpu_throughput.py                                   # 125m,350m,1.3b on cuda
    python bench/gpu_throughput.py --shapes 125m --iters 10 --out bench/out/gpu_throughput.json
    python bench/gpu_throughput.py --device cpu --toy --iters 3      # CPU, toy shape (the tests)
    python bench/gpu_throughput.py --dry-run                         # commands + flag checks only
    python bench/gpu_throughput.py --count-parameters --shapes 125m,1.3b   # ours vs reference

Exit status: 0 every run finished, 1 a run failed (its row says so; the others still run), 2 a
usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import re
import resource
import runpy
import shlex
import signal
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

RUNS = ("baseline", "sdp4bit", "reference", "reference-compile")
DEFAULT_RUNS = "baseline,sdp4bit,reference"
DEFAULT_SHAPES = "125m,350m,1.3b"
RECIPES = {"125m": "run_125m.sh", "350m": "run_350m.sh", "1.3b": "run_1.3b.sh",
           "toy": "run_125m.sh"}  # toy: the 125M recipe with its model flags overridden
# The recipe flags the benchmark replaces: name -> takes a value.
REPLACED = {"--num-layers": True, "--hidden-size": True, "--num-attention-heads": True,
            "--seq-length": True, "--max-position-embeddings": True,
            "--micro-batch-size": True, "--global-batch-size": True, "--train-iters": True,
            "--save": True, "--load": True, "--save-interval": True, "--tensorboard-dir": True,
            "--log-interval": True, "--eval-interval": True, "--eval-iters": True,
            "--jsonl-log": True, "--device": True}
RECOMPUTE = {"--recompute-activations": False, "--recompute-granularity": True,
             "--recompute-method": True, "--recompute-num-layers": True}
PARAMS_RE = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank "
                       r"\(0, 0\): (\d+)")
ITER_MS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
# Megatron-LM's report: "[Rank 0] (after 1 iterations) memory (MB) | allocated: .. | max allocated: .."
MEM_RE = re.compile(r"memory \(MB\) \| allocated: ([\d.]+) \| max allocated: ([\d.]+)"
                    r"(?: \| reserved: ([\d.]+) \| max reserved: ([\d.]+))?")
RSS_RE = re.compile(r"memory \(MB\) \| host peak RSS: ([\d.]+)")  # the same report on CPU


def _shapes():
    from reference_gpt import SHAPES

    return SHAPES


# ----------------------------------------------------------------------------------- commands
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _drop(tokens: List[str], flags: Dict[str, bool]) -> List[str]:
    out, i = [], 0
    while i < len(tokens):
        if tokens[i] in flags:
            i += 2 if flags[tokens[i]] else 1
        else:
            out.append(tokens[i])
            i += 1
    return out


def recipe_args(shape_name: str, variant: str) -> List[str]:
    """The pretrain_gpt.py arguments of the shape's recipe (ECHO_ONLY=1), on mock data."""
    shape = _shapes()[shape_name]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHRUN", "DRY_RUN", "RUN_DIR", "MASTER_"))}
    env.update(ECHO_ONLY="1", VARIANT=variant, GPUS_PER_NODE="1", NNODES="1", NODE_RANK="0",
               DATA_PATH="mock", TOKENIZER_TYPE="NullTokenizer",
               VOCAB_SIZE=str(shape["vocab_size"]), SEQ_LENGTH=str(shape["seq_length"]))
    script = ROOT / "examples" / "sdp4bit" / RECIPES[shape_name]
    res = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    if res.returncode != 0:
        raise SystemExit(f"gpu_throughput: {script} ECHO_ONLY=1 failed:\n{res.stderr}")
    cmd = shlex.split(res.stdout.strip().splitlines()[-1])
    return cmd[cmd.index("pretrain_gpt.py") + 1:]


def ours_args(shape_name: str, variant: str, *, device: str, iters: int, warmup: int,
              mbs: int, gbs: int, recompute: bool, jsonl: Optional[str]) -> List[str]:
    shape = _shapes()[shape_name]
    drop = dict(REPLACED, **({} if recompute else RECOMPUTE))
    args = _drop(recipe_args(shape_name, variant), drop)
    args += ["--num-layers", str(shape["num_layers"]), "--hidden-size", str(shape["hidden_size"]),
             "--num-attention-heads", str(shape["num_attention_heads"]),
             "--seq-length", str(shape["seq_length"]),
             "--max-position-embeddings", str(shape["seq_length"]),
             "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
             "--train-iters", str(warmup + iters), "--log-interval", "1",
             "--eval-iters", "0", "--device", device]
    if jsonl:
        args += ["--jsonl-log", jsonl]
    return args


def ours_command(trainer_args: List[str], peak_json: str) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            str(Path(__file__).resolve()), "--_trainer", peak_json, "--", *trainer_args]


def reference_command(shape_name: str, *, device: str, iters: int, warmup: int, mbs: int,
                      gbs: int, compile: bool, json_path: str) -> List[str]:
    cmd = [sys.executable, str(ROOT / "bench" / "reference_gpt.py"), "--shape", shape_name,
           "--device", device, "--iters", str(iters), "--warmup", str(warmup),
           "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), "--json", json_path]
    return cmd + (["--compile"] if compile else [])


# ----------------------------------------------------------------------------------- wrapper
def _peak_memory() -> Dict[str, Any]:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated()),
                "peak_memory_kind": "torch.cuda.max_memory_allocated"}
    return {"peak_memory_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
            "peak_memory_kind": "peak RSS of the process (CPU)"}


def trainer_main(argv: List[str]) -> int:
    """``--_trainer PEAK_JSON -- ARGS``: pretrain_gpt.py ARGS in this process (what torchrun
    starts), then this process's peak memory to PEAK_JSON -- the same allocator statistic the
    reference reports, whatever the trainer logs."""
    peak_json, args = argv[0], argv[argv.index("--") + 1:]
    sys.argv = [str(ROOT / "pretrain_gpt.py"), *args]
    code: Any = 0
    try:
        runpy.run_path(str(ROOT / "pretrain_gpt.py"), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    code = code if isinstance(code, int) else (0 if code is None else 1)
    if os.environ.get("RANK", "0") == "0":
        Path(peak_json).write_text(json.dumps(_peak_memory()) + "\n")
    return code


# ----------------------------------------------------------------------------------- parsing
def _median_after(ms_by_iter: Dict[int, float], warmup: int) -> Optional[float]:
    measured = [ms for it, ms in sorted(ms_by_iter.items()) if it > warmup]
    measured = measured or list(ms_by_iter.values())
    return statistics.median(measured) if measured else None


def parse_ours(log_text: str, jsonl: Path, warmup: int) -> Dict[str, Any]:
    """ms/iteration per iteration (jsonl, else the log lines), parameters, memory reports."""
    out: Dict[str, Any] = {}
    ms_by_iter: Dict[int, float] = {}
    trainer_tflops: Dict[int, float] = {}
    mem_report: Dict[str, float] = {}
    if jsonl.exists():
        for line in jsonl.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            for k, v in rec.items():
                if "memory" in k or "alloc" in k or "reserved" in k:
                    if isinstance(v, (int, float)):
                        mem_report[k] = max(float(v), mem_report.get(k, float("-inf")))
            if rec.get("type") == "train" and "ms_per_iteration" in rec:
                ms_by_iter[int(rec["iteration"])] = float(rec["ms_per_iteration"])
                if "tflops_per_gpu" in rec:
                    trainer_tflops[int(rec["iteration"])] = float(rec["tflops_per_gpu"])
        out["source"] = "jsonl"
    if not ms_by_iter:
        ms_by_iter = {int(i): float(ms) for i, ms in ITER_MS_RE.findall(log_text)}
        out["source"] = "log"
    for m in MEM_RE.finditer(log_text):
        keys = ("allocated_mb", "max_allocated_mb", "reserved_mb", "max_reserved_mb")
        for k, v in zip(keys, m.groups()):
            if v is not None:
                mem_report[k] = max(float(v), mem_report.get(k, float("-inf")))
    for m in RSS_RE.finditer(log_text):
        mem_report["host_peak_rss_mb"] = max(float(m.group(1)),
                                             mem_report.get("host_peak_rss_mb", float("-inf")))
    params = PARAMS_RE.search(log_text)
    out.update(ms_per_iteration=_median_after(ms_by_iter, warmup),
               ms_per_iteration_all=[ms for _, ms in sorted(ms_by_iter.items())],
               trainer_tflops_per_gpu={str(k): v for k, v in sorted(trainer_tflops.items())},
               parameters=int(params.group(1)) if params else None,
               trainer_memory_report=mem_report or None)
    return out


# ----------------------------------------------------------------------------------- running
def _env(device: str) -> Dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # The same thread count for ours (torchrun would set 1) and the reference.
    env.setdefault("OMP_NUM_THREADS", "1" if device == "cuda" else str(os.cpu_count() or 1))
    return env


_CHILD: Optional[subprocess.Popen] = None


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM first: torchrun then stops its worker (which runs in its own session)."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _on_signal(signum: int, _frame: Any) -> None:
    if _CHILD is not None and _CHILD.poll() is None:
        _stop(_CHILD)
    sys.exit(128 + signum)


def _run_child(cmd: List[str], log: Any, device: str, timeout: int) -> Any:
    """Run one measurement; on a timeout or when this process is stopped, stop it too."""
    global _CHILD
    _CHILD = subprocess.Popen(cmd, cwd=ROOT, env=_env(device), stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        return _CHILD.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(_CHILD)
        return "timeout"
    finally:
        _CHILD = None


def run_one(shape_name: str, run: str, a: argparse.Namespace, work: Path) -> Dict[str, Any]:
    from reference_gpt import flops_args
    from megatron.training.model.flops import tflops_per_gpu, training_flops_per_iteration

    shape = _shapes()[shape_name]
    mbs = a.micro_batch_size or shape["micro_batch_size"]
    gbs = a.global_batch_size or shape["global_batch_size"]
    tag = f"{shape_name}-{run}"
    log, result_json = work / f"{tag}.log", work / f"{tag}.json"
    for p in (log, result_json, work / f"{tag}.jsonl", work / f"{tag}.peak.json"):
        p.unlink(missing_ok=True)
    if run.startswith("reference"):
        cmd = reference_command(shape_name, device=a.device, iters=a.iters, warmup=a.warmup,
                                mbs=mbs, gbs=gbs, compile=run == "reference-compile",
                                json_path=str(result_json))
    else:
        targs = ours_args(shape_name, run, device=a.device, iters=a.iters, warmup=a.warmup,
                          mbs=mbs, gbs=gbs, recompute=a.recompute,
                          jsonl=str(work / f"{tag}.jsonl"))
        cmd = ours_command(targs, str(work / f"{tag}.peak.json"))
    row: Dict[str, Any] = {"shape": shape_name, "run": run + ("+recompute" if a.recompute and
                                                              not run.startswith("reference") else ""),
                           "micro_batch_size": mbs, "global_batch_size": gbs,
                           "command": shlex.join(cmd), "log": str(log)}
    print(f"[gpu_throughput] {tag}: {row['command']}", flush=True)
    with open(log, "w", encoding="utf-8") as fh:
        rc = _run_child(cmd, fh, a.device, a.timeout)
    text = log.read_text(encoding="utf-8", errors="replace")
    row["exit"] = rc
    if rc != 0:
        row["error"] = f"exit {rc}, see {log}: " + " / ".join(text.strip().splitlines()[-3:])[-400:]
        print(f"[gpu_throughput] {tag}: FAILED ({row['error']})", flush=True)
        return row
    if run.startswith("reference"):
        ref = json.loads(result_json.read_text())
        row.update({k: ref[k] for k in ("ms_per_iteration", "ms_per_iteration_all", "parameters",
                                        "peak_memory_bytes", "peak_memory_kind", "gpu")})
    else:
        row.update(parse_ours(text, work / f"{tag}.jsonl", a.warmup))
        peak = work / f"{tag}.peak.json"
        if peak.exists():
            row.update(json.loads(peak.read_text()))
    if row.get("ms_per_iteration") is None:
        row["error"] = f"no ms/iteration found in {log}"
        return row
    fargs = flops_args(shape, gbs)
    row["flops_per_iteration"] = training_flops_per_iteration(fargs)
    row["tflops_per_gpu"] = tflops_per_gpu(fargs, row["ms_per_iteration"] / 1000.0)
    print(f"[gpu_throughput] {tag}: {row['ms_per_iteration']:.1f} ms/iteration, "
          f"{_fmt(row['tflops_per_gpu'])} TFLOP/s", flush=True)
    return row


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "n/a"
    if x >= 100:
        return f"{x:.1f}"
    if x >= 0.01:
        return f"{x:.3g}" if x < 1 else f"{x:.2f}"
    return f"{x:.3g}"


def add_ratios(rows: List[Dict[str, Any]]) -> None:
    for row in rows:
        ref = next((r for r in rows if r["shape"] == row["shape"] and r["run"] == "reference"
                    and r.get("ms_per_iteration")), None)
        ms = row.get("ms_per_iteration")
        row["ratio_to_reference"] = (ms / ref["ms_per_iteration"]) if (ref and ms) else None


def markdown_table(rows: List[Dict[str, Any]]) -> str:
    lines = ["| shape | run | ms/iteration | TFLOP/s | peak memory GiB | ours/reference |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['shape']} | {r['run']} | failed | n/a | n/a | n/a |")
            continue
        mem = r.get("peak_memory_bytes")
        ratio = r.get("ratio_to_reference")
        lines.append(f"| {r['shape']} | {r['run']} | {r['ms_per_iteration']:.1f} | "
                     f"{_fmt(r['tflops_per_gpu'])} | "
                     f"{'n/a' if mem is None else f'{mem / 2**30:.2f}'} | "
                     f"{'n/a' if ratio is None else f'{ratio:.2f}'} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- other modes
def dry_run(shapes: Sequence[str], runs: Sequence[str], a: argparse.Namespace) -> int:
    """Print every command; check our flags with pretrain_gpt.py --dry-run (in-process, world 1)
    and the reference's with its own parser. Needs no GPU."""
    import pretrain_gpt
    import reference_gpt

    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    failed = 0
    for shape_name in shapes:
        shape = _shapes()[shape_name]
        mbs = a.micro_batch_size or shape["micro_batch_size"]
        gbs = a.global_batch_size or shape["global_batch_size"]
        for run in runs:
            tag = f"{shape_name}-{run}"
            if run.startswith("reference"):
                cmd = reference_command(shape_name, device=a.device, iters=a.iters,
                                        warmup=a.warmup, mbs=mbs, gbs=gbs,
                                        compile=run == "reference-compile", json_path="REF.json")
                try:
                    reference_gpt.build_parser().parse_args(cmd[2:])
                    ok = True
                except SystemExit:
                    ok = False
            else:
                targs = ours_args(shape_name, run, device=a.device, iters=a.iters,
                                  warmup=a.warmup, mbs=mbs, gbs=gbs, recompute=a.recompute,
                                  jsonl="OURS.jsonl")
                cmd = ours_command(targs, "PEAK.json")
                buf = io.StringIO()
                try:
                    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                        rc = pretrain_gpt.main(targs + ["--dry-run"])
                except SystemExit as exc:
                    rc = exc.code
                ok = rc == 0 and "DRY_RUN_QUANT" in buf.getvalue()
                if not ok:
                    print(buf.getvalue()[-2000:])
            failed |= not ok
            print(f"[gpu_throughput] {tag}: {shlex.join(cmd)}")
            print(f"[gpu_throughput] {tag}: flags {'parse' if ok else 'REFUSED'}", flush=True)
    print(f"[gpu_throughput] dry run: {len(shapes) * len(runs)} commands, "
          f"{'all flags parse' if not failed else 'some flags refused'}")
    return 1 if failed else 0


def count_parameters(shapes: Sequence[str]) -> List[Dict[str, Any]]:
    """Ours (the recipe's model flags through the trainer's parse_args / initialize_megatron /
    build_transformer_config / model_provider) and the reference, both built on the meta device:
    no memory, no initialisation cost, any shape on any machine."""
    import torch

    import reference_gpt
    from megatron.training import cpu_mode
    from megatron.training.arguments.parser import padded_vocab_size
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.model.config_builders import build_transformer_config
    from megatron.training.components import model_provider

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    rows = []
    with cpu_mode.cpu_mode():
        for i, shape_name in enumerate(shapes):
            argv = ours_args(shape_name, "baseline", device="cpu", iters=1, warmup=0, mbs=1,
                             gbs=1, recompute=False, jsonl=None)
            args = parse_args(argv)
            if i == 0:
                initialize_megatron(args)
            vocab = padded_vocab_size(_shapes()[shape_name]["vocab_size"], args)
            with torch.device("meta"):
                ours = model_provider(args, build_transformer_config(args), vocab, True, True)
                ref = reference_gpt.GPT(**_shapes()[shape_name])
            rows.append({"shape": shape_name, "padded_vocab_size": vocab,
                         "ours": sum(p.numel() for p in ours.parameters()),
                         "reference": sum(p.numel() for p in ref.parameters()),
                         "formula": reference_gpt.parameter_count(_shapes()[shape_name])})
        torch.distributed.destroy_process_group()
    return rows


# ----------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help=f"comma-separated (default {DEFAULT_SHAPES})")
    p.add_argument("--toy", action="store_true", help="the toy shape (2x64, seq 64): CPU tests")
    p.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated from {','.join(RUNS)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--iters", type=int, default=20, help="measured iterations per run")
    p.add_argument("--warmup", type=int, default=5, help="iterations before the measured ones")
    p.add_argument("--micro-batch-size", type=int, default=None, help="default: the recipe's")
    p.add_argument("--global-batch-size", type=int, default=None, help="default 16 (toy 4)")
    p.add_argument("--recompute", action="store_true",
                   help="keep the recipes' --recompute-activations (selective) for ours")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--work-dir", default=str(ROOT / "bench" / "out" / "gpu_throughput"),
                   help="logs and per-run files")
    p.add_argument("--out", default=None, help="write every row (and the table) as JSON here")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands and check their flags; run nothing")
    p.add_argument("--count-parameters", action="store_true",
                   help="ours vs the reference's parameter count per shape (meta device)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_trainer"]:
        return trainer_main(argv[1:])
    a = build_parser().parse_args(argv)
    shapes = ["toy"] if a.toy and a.shapes is None else (a.shapes or DEFAULT_SHAPES).split(",")
    runs = a.runs.split(",")
    bad = [s for s in shapes if s not in _shapes()] + [r for r in runs if r not in RUNS]
    if bad:
        print(f"gpu_throughput: unknown shape/run {bad}; shapes {sorted(_shapes())}, runs "
              f"{list(RUNS)}", file=sys.stderr)
        return 2
    if a.count_parameters:
        rows = count_parameters(shapes)
        print("| shape | ours (megatron-core GPTModel) | reference | formula |\n|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['shape']} | {r['ours']:,} | {r['reference']:,} | {r['formula']:,} |")
        if a.out:
            Path(a.out).write_text(json.dumps({"parameters": rows}, indent=1) + "\n")
        return 0 if all(r["ours"] == r["reference"] == r["formula"] for r in rows) else 1
    if a.dry_run:
        return dry_run(shapes, runs, a)
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_throughput: torch sees no CUDA device (use --device cpu --toy on a CPU "
                  "machine)", file=sys.stderr)
            return 2
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    started = datetime.datetime.now(datetime.timezone.utc)
    rows = [run_one(s, r, a, work) for s in shapes for r in runs]
    add_ratios(rows)
    table = markdown_table(rows)
    import torch

    device = (torch.cuda.get_device_name(0) if a.device == "cuda"
              else f"CPU ({os.cpu_count()} cores)")
    header = (f"gpu_throughput {started:%Y-%m-%d %H:%M} UTC, {device}, torch {torch.__version__}, "
              f"{a.iters} measured iterations after {a.warmup} (median), "
              f"peak memory: {'torch.cuda.max_memory_allocated' if a.device == 'cuda' else 'peak RSS per process'}")
    print("\n" + header + "\n\n" + table)
    for s in shapes:
        counts = {r["run"]: r.get("parameters") for r in rows if r["shape"] == s}
        known = {v for v in counts.values() if v}
        print(f"\n{s}: parameters " + ", ".join(f"{k} {v:,}" if v else f"{k} n/a"
                                                 for k, v in counts.items())
              + ("" if len(known) <= 1 else "  WARNING: the counts differ"))
        sample = next((r for r in rows if r["shape"] == s), None)
        if sample:
            print(f"{s}: micro-batch {sample['micro_batch_size']}, global batch "
                  f"{sample['global_batch_size']}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"header": header, "device": device,
                                           "argv": argv, "rows": rows, "table": table},
                                          indent=1) + "\n")
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
