#!/usr/bin/env python3
"""Tiny-GPT CPU convergence comparison of the quantized-communication variants.

Runs ``pretrain_gpt.py`` once per variant (same seed, same data order, same model) on CPU gloo
ranks -- by default 4 ranks emulating 2 "nodes" x 2 (``--data-parallel-intra-node-size 2``), so
TLq really runs its two hops (8-bit intra, 4-bit inter) -- and compares final train / validation
loss against the baseline plus the bits per element each link carried (from the trainer's
communication report). Writes under ``--out`` (default ``bench/out/convergence``):

* ``<variant>.jsonl`` -- the trainer's per-interval JSON lines (``--jsonl-log``),
* ``convergence.md`` -- the markdown table (also printed),
* ``loss_curves.png`` -- train (and validation) loss curves.

Default config is sized for <= ~10 minutes on 2 cores; scale up with ``--iters``, ``--hidden``,
``--layers``, ``--seq``, ``--gbs``. See bench/CONVERGENCE.md.

    python bench/convergence.py                         # all variants, defaults
    python bench/convergence.py --variants baseline SDP4Bit --iters 200
    python bench/convergence.py --report-only           # re-render from existing jsonl files
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]

# name -> extra pretrain_gpt.py flags (the two-level topology flag is added for every variant)
VARIANTS: Dict[str, List[str]] = {
    "baseline": [],
    "qW-4bit": ["--quantized-weights", "--weight-quantization-mode", "direct"],
    "qWD": ["--quantized-weights"],
    "TLq": ["--quantized-gradients"],
    "TLq-HS": ["--quantized-gradients", "--hadamard-transform"],
    "SDP4Bit": ["--quantized-weights", "--quantized-gradients", "--hadamard-transform"],
    "TLq-4bit": ["--quantized-gradients", "--gradient-quantization-bits-intra", "4"],
    "TLq-4bit+LoCo": ["--quantized-gradients", "--gradient-quantization-bits-intra", "4", "--loco"],
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--nproc", type=int, default=4, help="CPU ranks (data-parallel size)")
    p.add_argument("--intra", type=int, default=2,
                   help="--data-parallel-intra-node-size: ranks per emulated node")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-path", default=None,
                   help="megatron .bin/.idx prefix; default: data/quickstart (examples/quickstart.sh) "
                        "if present, else --mock-data")
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="further pretrain_gpt.py flags for every variant (must come last)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "convergence"))
    p.add_argument("--timeout", type=int, default=900, help="seconds per variant")
    p.add_argument("--report-only", action="store_true", help="only re-render table/plot")
    p.add_argument("--resume", action="store_true",
                   help="skip variants whose jsonl already holds a finished run (summary record)")
    p.add_argument("--python", default=sys.executable)
    return p.parse_args(argv)


def data_args(a: argparse.Namespace) -> List[str]:
    """Real text if available (loss differences mean something), else synthetic tokens."""
    prefix = a.data_path
    qs = ROOT / "data" / "quickstart"
    if prefix is None and (qs / "stdlib_text_document.bin").exists():
        prefix = str(qs / "stdlib_text_document")
        a.vocab_file = a.vocab_file or str(qs / "tokenizer" / "vocab.json")
        a.merge_file = a.merge_file or str(qs / "tokenizer" / "merges.txt")
    if prefix is None:
        return ["--mock-data"]
    out = ["--data-path", prefix, "--split", "949,50,1"]
    if a.vocab_file and a.merge_file:
        out += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", a.vocab_file,
                "--merge-file", a.merge_file]
    return out


def command(a: argparse.Namespace, name: str, jsonl: Path) -> List[str]:
    return [
        a.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
        str(ROOT / "pretrain_gpt.py"), "--device", "cpu", "--distributed-backend", "gloo",
        "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
        "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
        "--max-position-embeddings", str(a.seq), "--micro-batch-size", str(a.mbs),
        "--global-batch-size", str(a.gbs), "--train-iters", str(a.iters), "--lr", str(a.lr),
        "--min-lr", str(a.lr / 10), "--lr-decay-style", "cosine", "--lr-warmup-iters",
        str(max(1, a.iters // 20)), "--clip-grad", "1.0", "--weight-decay", "0.1",
        "--bf16", "--use-distributed-optimizer", "--seed", str(a.seed),
        "--log-interval", str(a.log_interval), "--eval-interval", str(a.eval_interval),
        "--eval-iters", str(a.eval_iters), "--jsonl-log", str(jsonl),
        "--data-parallel-intra-node-size", str(a.intra),
        *data_args(a), *VARIANTS[name], *a.extra,
    ]


def run_variant(a: argparse.Namespace, name: str, out: Path) -> float:
    jsonl = out / f"{name}.jsonl"
    if jsonl.exists():
        jsonl.unlink()  # the trainer appends
    cmd = command(a, name, jsonl)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=a.timeout).returncode
    dt = time.time() - t0
    if rc != 0:
        raise RuntimeError(f"{name} failed (exit {rc}); see {out / (name + '.log')}")
    print(f"[convergence] {name}: {dt:.0f}s", flush=True)
    return dt


def load(jsonl: Path) -> Dict[str, list]:
    recs = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return {"train": [r for r in recs if r.get("type") == "train"],
            "valid": [r for r in recs if r.get("type") == "valid"],
            "summary": [r for r in recs if r.get("type") == "summary"]}


def _bits(rec: dict, key: str, default: Optional[float]) -> str:
    v = rec.get(key, default)
    return "-" if v is None else f"{v:.2f}"


def report(a: argparse.Namespace, out: Path, times: Dict[str, float]) -> str:
    rows, curves = [], {}
    base_train = base_val = None
    for name in a.variants:
        path = out / f"{name}.jsonl"
        if not path.exists():
            continue
        d = load(path)
        if not d["train"]:
            continue
        last = d["train"][-1]
        final_train = last["lm_loss"]  # mean over the last log interval
        final_val = d["valid"][-1]["lm_loss"] if d["valid"] else None
        if name == "baseline":
            base_train, base_val = final_train, final_val
        curves[name] = d
        rows.append((name, final_train, final_val, last, times.get(name)))

    def pct(x: Optional[float], ref: Optional[float]) -> str:
        if x is None or ref is None or not math.isfinite(x):
            return "-"
        return f"{100.0 * (x - ref) / ref:+.2f}%"

    lines = [
        f"Tiny GPT ({a.layers} layers, hidden {a.hidden}, seq {a.seq}, global batch {a.gbs}), "
        f"{a.iters} iterations, {a.nproc} CPU ranks as {a.nproc // a.intra} node(s) x {a.intra}; "
        "train loss = mean of the last log interval. Bits per element are what each link "
        "carried per value (codes + fp32 scales); baseline: fp32 gradients, bf16 weights.",
        "",
        "| variant | final train loss | vs baseline | final val loss | vs baseline | grad intra b/el "
        "| grad inter b/el | weight intra b/el | weight inter b/el | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, tr, va, last, t in rows:
        quant = "grad_total_bytes" in last
        g_default = 32.0 if not quant else None
        w_default = 16.0 if "weight_total_bytes" not in last else None
        lines.append(
            f"| {name} | {tr:.4f} | {pct(tr, base_train)} | "
            f"{'-' if va is None else f'{va:.4f}'} | {pct(va, base_val)} | "
            f"{_bits(last, 'grad_intra_bits_per_element', g_default if a.intra > 1 else None)} | "
            f"{_bits(last, 'grad_inter_bits_per_element', g_default if a.nproc > a.intra else None)} | "
            f"{_bits(last, 'weight_intra_bits_per_element', w_default if a.intra > 1 else None)} | "
            f"{_bits(last, 'weight_inter_bits_per_element', w_default if a.nproc > a.intra else None)} | "
            f"{'-' if t is None else f'{t:.0f}'} |")
    md = "\n".join(lines) + "\n"
    (out / "convergence.md").write_text(md)
    try:
        plot(curves, out / "loss_curves.png")
    except ImportError:
        print("[convergence] matplotlib missing: no plot", file=sys.stderr)
    return md


def plot(curves: Dict[str, Dict[str, list]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, d in curves.items():
        style = "-" if name == "baseline" else "--"
        axes[0].plot([r["iteration"] for r in d["train"]], [r["lm_loss"] for r in d["train"]],
                     style, label=name, linewidth=2 if name == "baseline" else 1.2)
        if d["valid"]:
            axes[1].plot([r["iteration"] for r in d["valid"]], [r["lm_loss"] for r in d["valid"]],
                         style + "o", label=name, markersize=3)
    axes[0].set_title("train loss")
    axes[1].set_title("validation loss")
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    a = parse_args(argv)
    if a.nproc % a.intra:
        raise SystemExit("--nproc must be a multiple of --intra")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    times: Dict[str, float] = {}
    if (out / "times.json").exists():
        times = json.loads((out / "times.json").read_text())
    if not a.report_only:
        for name in a.variants:
            done = out / f"{name}.jsonl"
            if a.resume and done.exists() and load(done)["summary"]:
                print(f"[convergence] {name}: finished run found, reused", flush=True)
                continue
            times[name] = run_variant(a, name, out)
            (out / "times.json").write_text(json.dumps(times))
    md = report(a, out, times)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
