#!/usr/bin/env python3
"""CPU convergence comparison of the quantized-communication variants, over several seeds.

Runs ``pretrain_gpt.py`` once per (variant, seed) on CPU gloo ranks -- by default 4 ranks
emulating 2 "nodes" x 2 (``--data-parallel-intra-node-size 2``), so TLq really runs its two hops
(8-bit intra, 4-bit inter) -- and compares the final validation / train loss of each variant with
the baseline's, against the spread the seed alone causes (initialisation and data order). Within
one seed every variant sees the same initial weights and the same batches, so the per-seed
difference to the baseline is paired. Writes under ``--out`` (default ``bench/out/convergence``):

* ``<variant>/seed<S>.jsonl`` / ``.log`` -- the trainer's JSON lines (``--jsonl-log``) and console,
* ``convergence.md`` -- the tables (also printed), ``convergence.json`` -- the same numbers,
* ``loss_curves.png`` -- mean loss curves with a +/- one standard deviation band over the seeds,
  and the final validation loss of each variant with its spread.

A difference "exceeds the seed noise" when Welch's two-sided t-test of the variant's final
validation losses against the baseline's gives p < 0.05 (unpaired: the seeds' spread of both
sides is the noise); the paired t-test over the seeds (same seed, same data) is given beside it.

    python bench/convergence.py                                      # all variants, one seed
    python bench/convergence.py --seeds 1 2 3 --iters 1000 --layers 4 --hidden 256
    python bench/convergence.py --resume ...                         # skip finished runs
    python bench/convergence.py --report-only ...                    # re-render from the jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
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
    "SDP4Bit+LoCo": ["--quantized-weights", "--quantized-gradients", "--hadamard-transform",
                     "--loco"],
    "TLq-4bit": ["--quantized-gradients", "--gradient-quantization-bits-intra", "4"],
    "TLq-4bit+LoCo": ["--quantized-gradients", "--gradient-quantization-bits-intra", "4", "--loco"],
}

NOISE_P = 0.05  # two-sided significance level for "exceeds the seed noise"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1234],
                   help="one run per seed and variant (--seed: initialisation and data order)")
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
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                   help="model precision (bf16: megatron's --bf16, the baseline gathers bf16 "
                        "weights; fp32 only for variants without quantized weights)")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--data-path", default=None,
                   help="megatron .bin/.idx prefix; default: data/quickstart (examples/quickstart.sh) "
                        "if present, else --mock-data")
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                   help="further pretrain_gpt.py flags for every variant (must come last)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "convergence"))
    p.add_argument("--plot", default=None, help="also write the figure here (e.g. docs/img/...)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    p.add_argument("--report-only", action="store_true", help="only re-render tables/plot")
    p.add_argument("--resume", action="store_true",
                   help="skip runs whose jsonl already holds a finished run (summary record)")
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


def command(a: argparse.Namespace, name: str, seed: int, jsonl: Path) -> List[str]:
    return [
        a.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
        str(ROOT / "pretrain_gpt.py"), "--device", "cpu", "--distributed-backend", "gloo",
        "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
        "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
        "--max-position-embeddings", str(a.seq), "--micro-batch-size", str(a.mbs),
        "--global-batch-size", str(a.gbs), "--train-iters", str(a.iters), "--lr", str(a.lr),
        "--min-lr", str(a.lr / 10), "--lr-decay-style", "cosine", "--lr-warmup-iters",
        str(max(1, a.iters // 20)), "--clip-grad", "1.0", "--weight-decay", "0.1",
        *(["--bf16"] if a.precision == "bf16" else []),
        "--use-distributed-optimizer", "--seed", str(seed),
        "--log-interval", str(a.log_interval), "--eval-interval", str(a.eval_interval),
        "--eval-iters", str(a.eval_iters), "--jsonl-log", str(jsonl),
        "--data-parallel-intra-node-size", str(a.intra),
        *data_args(a), *VARIANTS[name], *a.extra,
    ]


def run_path(out: Path, name: str, seed: int, suffix: str) -> Path:
    return out / name / f"seed{seed}{suffix}"


def run_one(a: argparse.Namespace, name: str, seed: int, out: Path) -> float:
    jsonl = run_path(out, name, seed, ".jsonl")
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    if jsonl.exists():
        jsonl.unlink()  # the trainer appends
    cmd = command(a, name, seed, jsonl)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    t0 = time.time()
    log_path = run_path(out, name, seed, ".log")
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=a.timeout).returncode
    dt = time.time() - t0
    if rc != 0:
        raise RuntimeError(f"{name} seed {seed} failed (exit {rc}); see {log_path}")
    print(f"[convergence] {name} seed {seed}: {dt:.0f}s", flush=True)
    return dt


def load(jsonl: Path) -> Dict[str, list]:
    recs = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return {"train": [r for r in recs if r.get("type") == "train"],
            "valid": [r for r in recs if r.get("type") == "valid"],
            "summary": [r for r in recs if r.get("type") == "summary"]}


def load_finished(jsonl: Path) -> Optional[Dict[str, list]]:
    """The run's records if it finished (wrote its summary record), else None."""
    if not jsonl.exists():
        return None
    d = load(jsonl)
    return d if d["summary"] else None


def finished(jsonl: Path) -> bool:
    return load_finished(jsonl) is not None


def _bits(rec: dict, key: str, default: Optional[float]) -> str:
    v = rec.get(key, default)
    return "-" if v is None else f"{v:.2f}"


def _mean_std(xs: List[float]) -> tuple:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else float("nan"))


def _fmt(mean: float, std: float, digits: int = 4) -> str:
    return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def compare(base: List[float], other: List[float], paired: bool) -> Dict[str, float]:
    """Difference of ``other`` to ``base`` and whether the seeds' spread explains it.

    ``welch_p``: Welch's t-test (unequal variances), the seed-to-seed spread of both sides is the
    noise. ``paired_p``: t-test of the per-seed differences (same seed = same initial weights and
    batches), NaN when the seeds do not line up. Both NaN with fewer than two seeds.
    """
    from scipy import stats

    res = {"delta": statistics.fmean(other) - statistics.fmean(base),
           "welch_p": float("nan"), "paired_p": float("nan"), "paired_std": float("nan")}
    if len(base) > 1 and len(other) > 1:
        if statistics.stdev(base) == 0 and statistics.stdev(other) == 0:
            res["welch_p"] = 1.0 if res["delta"] == 0 else 0.0
        else:
            res["welch_p"] = float(stats.ttest_ind(other, base, equal_var=False).pvalue)
    if paired and len(base) > 1:
        diffs = [o - b for o, b in zip(other, base)]
        res["paired_std"] = statistics.stdev(diffs)
        if res["paired_std"] == 0:
            res["paired_p"] = 1.0 if res["delta"] == 0 else 0.0
        else:
            res["paired_p"] = float(stats.ttest_rel(other, base).pvalue)
    return res


def collect(a: argparse.Namespace, out: Path) -> Dict[str, Dict[int, Dict[str, list]]]:
    """variant -> seed -> loaded records, finished runs only."""
    runs: Dict[str, Dict[int, Dict[str, list]]] = {}
    for name in a.variants:
        for seed in a.seeds:
            path = run_path(out, name, seed, ".jsonl")
            d = load_finished(path)
            if d and d["train"] and d["valid"]:
                runs.setdefault(name, {})[seed] = d
    return runs


def report(a: argparse.Namespace, out: Path, times: Dict[str, float]) -> str:
    runs = collect(a, out)
    if "baseline" not in runs:
        raise SystemExit(f"no finished baseline run under {out}")
    base_seeds = sorted(runs["baseline"])
    base_val = [runs["baseline"][s]["valid"][-1]["lm_loss"] for s in base_seeds]
    summary = {"config": {k: getattr(a, k) for k in (
        "seeds", "nproc", "intra", "iters", "layers", "hidden", "heads", "seq", "mbs", "gbs",
        "lr", "precision", "eval_interval", "eval_iters")}, "variants": {}}
    nodes = a.nproc // a.intra
    lines = [
        f"GPT ({a.layers} layers, hidden {a.hidden}, {a.heads} heads, seq {a.seq}, global batch "
        f"{a.gbs}, lr {a.lr} cosine, {a.precision}), {a.iters} iterations, {a.nproc} CPU ranks as "
        f"{nodes} node(s) x {a.intra}, seeds {', '.join(map(str, a.seeds))}. Final validation "
        f"loss = the evaluation after the last iteration ({a.eval_iters} batches); final train "
        "loss = mean of the last log interval. Δ = variant mean - baseline mean; 'exceeds seed "
        f"noise' = Welch's t-test p < {NOISE_P} against the baseline's seeds (the paired test "
        "over the same seeds is beside it). Bits per element are what each link carried per "
        "value (codes + fp32 scales).",
        "",
        "| variant | seeds | final val loss (mean ± std) | Δ vs baseline | Δ % | Welch p | paired p "
        "| exceeds seed noise | final train loss | grad intra b/el | grad inter b/el | weight b/el "
        "| wall s / run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    per_seed = ["| variant | " + " | ".join(f"seed {s}" for s in a.seeds) + " |",
                "|---|" + "---|" * len(a.seeds)]
    for name in a.variants:
        if name not in runs:
            continue
        seeds = sorted(runs[name])
        vals = [runs[name][s]["valid"][-1]["lm_loss"] for s in seeds]
        trains = [runs[name][s]["train"][-1]["lm_loss"] for s in seeds]
        last = runs[name][seeds[0]]["train"][-1]
        vm, vs = _mean_std(vals)
        tm, ts = _mean_std(trains)
        cmp = compare(base_val, vals, paired=seeds == base_seeds)
        wall = [times[k] for k in (f"{name}/seed{s}" for s in seeds) if k in times]
        quant = "grad_total_bytes" in last
        g_default = None if quant else 32.0
        w_default = None if "weight_total_bytes" in last else (16.0 if a.precision == "bf16" else 32.0)
        w_key = "weight_inter_bits_per_element" if nodes > 1 else "weight_intra_bits_per_element"
        is_base = name == "baseline"
        delta = "-" if is_base else f"{cmp['delta']:+.4f}"
        delta_pct = "-" if is_base else f"{100 * cmp['delta'] / statistics.fmean(base_val):+.2f}%"
        welch = "-" if is_base or math.isnan(cmp["welch_p"]) else f"{cmp['welch_p']:.3f}"
        paired = "-" if is_base or math.isnan(cmp["paired_p"]) else f"{cmp['paired_p']:.3f}"
        exceeds = "-" if is_base or math.isnan(cmp["welch_p"]) else (
            ("**yes** (higher)" if cmp["delta"] > 0 else "**yes** (lower)")
            if cmp["welch_p"] < NOISE_P else "no")
        lines.append(
            f"| {name} | {len(seeds)} | {_fmt(vm, vs)} | "
            f"{delta} | {delta_pct} | {welch} | {paired} | {exceeds} | {_fmt(tm, ts)} | "
            f"{_bits(last, 'grad_intra_bits_per_element', g_default if a.intra > 1 else None)} | "
            f"{_bits(last, 'grad_inter_bits_per_element', g_default if nodes > 1 else None)} | "
            f"{_bits(last, w_key, w_default)} | "
            f"{'-' if not wall else f'{statistics.fmean(wall):.0f}'} |")
        per_seed.append(f"| {name} | " + " | ".join(
            f"{runs[name][s]['valid'][-1]['lm_loss']:.4f}" if s in runs[name] else "-"
            for s in a.seeds) + " |")
        summary["variants"][name] = {"seeds": seeds, "final_val": vals, "final_train": trains,
                                     "val_mean": vm, "val_std": vs, **cmp}
    md = "\n".join(lines + ["", "Final validation loss per seed:", ""] + per_seed) + "\n"
    (out / "convergence.md").write_text(md)
    (out / "convergence.json").write_text(json.dumps(summary, indent=1, default=str))
    try:
        plot(a, runs, out / "loss_curves.png", extra=a.plot)
    except ImportError:
        print("[convergence] matplotlib missing: no plot", file=sys.stderr)
    return md


def _band(records_by_seed: List[List[dict]]) -> tuple:
    """Iterations common to every seed, and the mean / std of lm_loss there."""
    common = sorted(set.intersection(*(set(r["iteration"] for r in recs) for recs in records_by_seed)))
    by_seed = [{r["iteration"]: r["lm_loss"] for r in recs} for recs in records_by_seed]
    means = [statistics.fmean(d[i] for d in by_seed) for i in common]
    stds = [statistics.stdev(d[i] for d in by_seed) if len(by_seed) > 1 else 0.0 for i in common]
    return common, means, stds


def plot(a: argparse.Namespace, runs: Dict[str, Dict[int, Dict[str, list]]], path: Path,
         extra: Optional[str] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [1.2, 1.2, 1]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = [n for n in a.variants if n in runs]
    for k, name in enumerate(names):
        color = "black" if name == "baseline" else colors[k % len(colors)]
        width = 2.2 if name == "baseline" else 1.2
        for ax, kind in ((axes[0], "train"), (axes[1], "valid")):
            its, mean, std = _band([runs[name][s][kind] for s in sorted(runs[name])])
            ax.plot(its, mean, color=color, linewidth=width, label=name)
            ax.fill_between(its, [m - s for m, s in zip(mean, std)],
                            [m + s for m, s in zip(mean, std)], color=color, alpha=0.15)
    # zoom both curves on the second half of training, where the differences are
    for ax, kind in ((axes[0], "train"), (axes[1], "valid")):
        tail = [r["lm_loss"] for n in names for d in runs[n].values() for r in d[kind]
                if r["iteration"] >= a.iters // 2]
        if tail:
            lo, hi = min(tail), max(tail)
            ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
            ax.set_xlim(a.iters // 2, a.iters)
    n_seeds = max(len(runs[n]) for n in names)
    axes[0].set_title(f"train loss, mean ± std over {n_seeds} seed(s) (second half)")
    axes[1].set_title("validation loss, mean ± std (second half)")
    for ax in axes[:2]:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    finals = [[runs[n][s]["valid"][-1]["lm_loss"] for s in sorted(runs[n])] for n in names]
    base = finals[names.index("baseline")] if "baseline" in names else None
    if base is not None and len(base) > 1:
        bm, bs = _mean_std(base)
        axes[2].axhspan(bm - bs, bm + bs, color="black", alpha=0.1, label="baseline ± std")
    for k, (name, vals) in enumerate(zip(names, finals)):
        m, s = _mean_std(vals)
        axes[2].errorbar([k], [m], yerr=[0 if math.isnan(s) else s], fmt="o", capsize=4,
                         color="black" if name == "baseline" else colors[k % len(colors)])
        axes[2].scatter([k] * len(vals), vals, s=10, color="grey", zorder=3)
    axes[2].set_xticks(range(len(names)))
    axes[2].set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    axes[2].set_title("final validation loss (dots: seeds)")
    axes[2].grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    if extra:
        fig.savefig(extra, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    a = parse_args(argv)
    if a.nproc % a.intra:
        raise SystemExit("--nproc must be a multiple of --intra")
    fp32_weights = [n for n in a.variants if "--quantized-weights" in VARIANTS[n]]
    if a.precision == "fp32" and fp32_weights and not a.report_only:
        raise SystemExit(f"--precision fp32: {', '.join(fp32_weights)} quantize weights, which "
                         "needs bf16 parameters on megatron-core's optimizer (the trainer refuses it)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    times: Dict[str, float] = {}
    if (out / "times.json").exists():
        times = json.loads((out / "times.json").read_text())
    if not a.report_only:
        # seed-major order: a partial study already holds every variant for the first seeds
        for seed in a.seeds:
            for name in a.variants:
                if a.resume and finished(run_path(out, name, seed, ".jsonl")):
                    print(f"[convergence] {name} seed {seed}: finished run found, reused", flush=True)
                    continue
                times[f"{name}/seed{seed}"] = run_one(a, name, seed, out)
                (out / "times.json").write_text(json.dumps(times, indent=1))
    md = report(a, out, times)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
