"""Emulated two-node benchmark driver: baselines vs SDP4Bit over a rate-limited veth link.

The network namespaces are created by ``setup_netns.sh up`` (``run_bench.sh`` does both and
cleans up); this driver only launches one ``torchrun`` per namespace ("node"), waits with a time
limit, collects the results and writes a markdown table.

Modes:

* ``train``       : ``pretrain_gpt.py --device cpu --distributed-backend gloo --mock-data
                    --use-distributed-optimizer --bf16`` on a small GPT; ms/iter is the median of
                    the per-iteration times in ``--jsonl-log`` after warm-up;
* ``collectives`` : ``bench_collectives.py`` (the distributed optimizer's per-step reduce-scatter +
                    all-gather, plain vs quantized) — the harness check that needs no trainer.

Inter-node bytes are read from the veth byte counters of both namespaces (every byte that crossed
the emulated link, both directions, TCP/IP headers included). In ``train`` mode a sampler thread
records the counters each time the trainer appends a JSON line, so the bytes per iteration are
taken over the same post-warm-up iterations as the timing.

Train-mode variants (``--variants``, run in the given order; ``--repeats R`` runs the whole list R
times back to back and reports the median over the R invocations):

* ``baseline``        : megatron-core's default data parallelism (gloo's all-reduce-based
                        reduce-scatter, fp32 gradients, no overlap);
* ``baseline-bf16``   : the strongest unquantized peer: bf16 gradients (``--grad-reduce-in-bf16``),
                        an exact reduce-scatter with ring volume (``ring_volume_rs.py``; algorithm
                        ``--bf16-rs-algo``, default ring), ``--overlap-grad-reduce
                        --overlap-param-gather --overlap-param-gather-with-optimizer-step
                        --ddp-bucket-size B``;
* ``sdp4bit``         : SDP4Bit (``SDP4BIT_FLAGS``), no overlap;
* ``sdp4bit-overlap`` : SDP4Bit + ``--grad-accum-dtype bf16`` (bf16 gradient buffers, like
                        baseline-bf16) + ``--overlap-grad-reduce --overlap-param-gather
                        --overlap-param-gather-with-optimizer-step --ddp-bucket-size B
                        --gradient-alltoall-pipeline K``;
* ``limit``           : exactly ``sdp4bit-overlap``, run with the tc qdiscs removed from both veth
                        ends (``setup_netns.sh unlimit``, re-applied with ``limit`` right after):
                        the physical floor of this model on this machine;
* ``sdp4bit-torch``, ``baseline-a2a``, ``baseline-ring``: see ``VARIANT_ENV`` / ``VARIANT_SCRIPT``.

``--no-netns`` runs one torchrun with ``--nproc-per-node 4`` on loopback (quick functional check;
there ``limit`` is just the ``sdp4bit-overlap`` arguments).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
DEFAULT_OUT = os.path.join(REPO, "bench", "out", "emulated_network.md")

# --- model presets (GPT sizes; step is communication bound: tiny seq/batch) --------------------
MODEL_PRESETS: Dict[str, Dict[str, int]] = {
    # seq 8 / micro-batch 1: bf16 matmuls on a CPU without AVX512-BF16 are slow, so few tokens per
    # step keep the step communication bound (one rank, small: 0.67 s/iter at seq 8, 1.8 s at 32).
    # name: layers, hidden, heads, seq, vocab           ~params (output layer tied to embeddings)
    "tiny": dict(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=8, vocab_size=8192),     # ~3.7M
    "small": dict(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=8, vocab_size=8192),    # ~16.8M
    "medium": dict(num_layers=6, hidden_size=640, num_attention_heads=10, seq_length=8, vocab_size=8192),  # ~34.8M
    # Mixtral-style: 8 experts (MLP 4h) top-2, EP 2 (on 2 nodes x 2 the expert-DP group has one
    # rank per node, as EP 8 on 8-GPU nodes): ~20.0M params, ~7.3M active per token
    "moe-small": dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=8,
                      vocab_size=8192, num_experts=8, expert_model_parallel_size=2),
}
MOE_FLAGS = ["--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
             "--moe-token-dispatcher-type", "alltoall"]
"""The router of the MoE presets (besides --num-experts / --expert-model-parallel-size)."""

# --- variants ------------------------------------------------------------------------------------
# SDP4Bit as in the paper: TLq-HS 8-bit intra / 4-bit inter gradients (group 128/128, Hadamard)
# and qWD 4-bit weight differences (group 2048).
SDP4BIT_FLAGS = [
    "--quantized-weights", "--weight-quantization-bits", "4", "--wq-group-size", "2048",
    "--quantized-gradients", "--gradient-quantization-bits-intra", "8",
    "--gradient-quantization-bits-inter", "4", "--gq-group-size-intra", "128",
    "--gq-group-size-inter", "128", "--hadamard-transform",
]
DEFAULT_BUCKET_SIZE = 4_000_000  # elements per DDP bucket: ~4 buckets for the small model (16.8M)
DEFAULT_PIPELINE = 2             # --gradient-alltoall-pipeline K of sdp4bit-overlap / limit
# baseline-bf16's reduce-scatter algorithm. ring by default: it is NCCL's algorithm and moves the
# fewest bytes across the link on 2 nodes x 2 ranks (1.5N elements vs 2N for a2a: 3 vs 4 B/param
# in bf16), and it was the faster of the two fp32 ring-volume baselines in 5 of the 6 runs that
# measured both (4 of 5 at 1 Gbit/s, 1 of 1 at 200 Mbit/s; docs/emulated_network.md, "Against
# ring-volume reduce-scatter baselines"). Not yet measured in bf16 with overlap, hence the knob:
# --bf16-rs-algo a2a / BF16_RS_ALGO=a2a (one gloo collective, run by gloo's own threads).
DEFAULT_BF16_RS_ALGO = "ring"
DEFAULT_TRAIN_VARIANTS = "baseline,baseline-bf16,sdp4bit,sdp4bit-overlap,limit"
DEFAULT_COLLECTIVE_VARIANTS = "baseline,sdp4bit"
# both overlapping peers start the next forward's weight gathers right after the optimizer step
OVERLAP_FLAGS = ["--overlap-grad-reduce", "--overlap-param-gather",
                 "--overlap-param-gather-with-optimizer-step"]

TRAIN_VARIANTS: Dict[str, List[str]] = {"baseline": [], "sdp4bit": SDP4BIT_FLAGS,
                                         "sdp4bit-torch": SDP4BIT_FLAGS,
                                         "baseline-a2a": [], "baseline-ring": [],
                                         # flags built by variant_flags() (knobs)
                                         "baseline-bf16": [], "sdp4bit-overlap": [], "limit": []}
# the unquantized variants; the fastest of them (by median ms/iter) is the "strongest baseline"
BASELINES = ("baseline", "baseline-bf16", "baseline-a2a", "baseline-ring")
# run with the link limit removed (setup_netns.sh unlimit ... limit); same args as sdp4bit-overlap
UNLIMITED_VARIANTS = ("limit",)
# Benchmark-only baselines: the same exact training as "baseline", but megatron-core's gradient
# reduce-scatter (an all-reduce on gloo, 2x NCCL's ring bytes) is replaced for gloo groups by an
# exact reduce-scatter with ring volume, (P-1)/P*N elements sent per rank (ring_volume_rs.py):
# baseline-a2a = all_to_all_single + local sum in rank order, baseline-ring = P2P ring.
# baseline-bf16 uses the same launcher with bf16 gradients and overlap (its algorithm is a knob).
RS_LAUNCHER = os.path.join(HERE, "pretrain_a2a_rs.py")
VARIANT_SCRIPT: Dict[str, List[str]] = {
    "baseline-a2a": [RS_LAUNCHER, "--rs-algo", "a2a"],
    "baseline-ring": [RS_LAUNCHER, "--rs-algo", "ring"],
}
RS_VARIANTS = ("baseline-a2a", "baseline-ring", "baseline-bf16")  # run through RS_LAUNCHER
# per-variant environment of the ranks: sdp4bit-torch = SDP4Bit with the pure-PyTorch reference
# quantizer (the state before the C++ CPU kernels), for before/after comparisons in one invocation
VARIANT_ENV: Dict[str, Dict[str, str]] = {"sdp4bit-torch": {"QUANT_KERNELS": "torch"}}
COLLECTIVE_VARIANTS = ("baseline", "sdp4bit", "sdp4bit-two-messages")
# per-iteration communication times the trainer may log with --jsonl-log (total vs exposed =
# waited on by the main thread); shown when present
COMM_KEYS = ("comm_grad_intra_ms", "comm_grad_inter_ms", "comm_grad_exposed_ms", "comm_weight_ms",
             "comm_weight_exposed_ms")


def variant_flags(variant: str, bucket_size: int = DEFAULT_BUCKET_SIZE,
                  pipeline: int = DEFAULT_PIPELINE) -> List[str]:
    """pretrain_gpt.py flags that distinguish ``variant`` (appended to the common model flags)."""
    if variant not in TRAIN_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {sorted(TRAIN_VARIANTS)}")
    if variant == "baseline-bf16":
        return ["--grad-reduce-in-bf16", *OVERLAP_FLAGS, "--ddp-bucket-size", str(bucket_size)]
    if variant in ("sdp4bit-overlap", *UNLIMITED_VARIANTS):
        # bf16 gradient buffers, as baseline-bf16's --grad-reduce-in-bf16 (the sums after
        # dequantization stay fp32)
        return [*SDP4BIT_FLAGS, "--grad-accum-dtype", "bf16", *OVERLAP_FLAGS,
                "--ddp-bucket-size", str(bucket_size), "--gradient-alltoall-pipeline", str(pipeline)]
    return list(TRAIN_VARIANTS[variant])


def variant_script(variant: str, bf16_rs_algo: str = DEFAULT_BF16_RS_ALGO) -> List[str]:
    """The script (and its own flags) a variant's ranks run."""
    if variant == "baseline-bf16":
        if bf16_rs_algo not in ("a2a", "ring"):
            raise ValueError(f"bf16_rs_algo must be a2a or ring, got {bf16_rs_algo!r}")
        # --rs-async thread: megatron-core's async reduce-scatters (--overlap-grad-reduce) run on
        # the launcher's worker thread, overlapping the backward pass (ring_volume_rs.py)
        return [RS_LAUNCHER, "--rs-algo", bf16_rs_algo, "--rs-async", "thread"]
    return list(VARIANT_SCRIPT.get(variant, [os.path.join(REPO, "pretrain_gpt.py")]))


def approx_gpt_params(num_layers: int, hidden_size: int, vocab_size: int, seq_length: int,
                      untied: bool = False, num_experts: int = 0, **_: int) -> int:
    """Parameter count of a Megatron GPT (12h^2+13h per layer, embeddings, final LN; the output
    layer shares the word embeddings unless ``untied``, Megatron's default); with
    ``num_experts`` E each layer's MLP (8h^2+5h) is E of them plus the router (h x E)."""
    h = hidden_size
    per_layer = 12 * h * h + 13 * h
    if num_experts:
        per_layer += (num_experts - 1) * (8 * h * h + 5 * h) + h * num_experts
    emb = vocab_size * h + seq_length * h
    return num_layers * per_layer + emb + 2 * h + (vocab_size * h if untied else 0)


@dataclass
class Topology:
    namespaces: List[str]
    ifnames: List[str]
    master_addr: str = "10.77.0.1"
    master_port: int = 29555
    nproc_per_node: int = 2
    use_netns: bool = True

    @property
    def nnodes(self) -> int:
        return len(self.namespaces) if self.use_netns else 1

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node if self.use_netns else 2 * self.nproc_per_node


def node_commands(topo: Topology, script_and_args: Sequence[str], threads: int = 1,
                  extra_env: Optional[Dict[str, str]] = None) -> List[List[str]]:
    """One command line per emulated node (``ip netns exec NS env ... torchrun ...``)."""
    cmds = []
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
    env.update(extra_env or {})
    if not topo.use_netns:
        env_list = [f"{k}={v}" for k, v in env.items()]
        return [["env", *env_list, "torchrun", "--nnodes", "1", "--node-rank", "0",
                 "--nproc-per-node", str(topo.world), "--master-addr", "127.0.0.1",
                 "--master-port", str(topo.master_port), *script_and_args]]
    for k, (ns, ifname) in enumerate(zip(topo.namespaces, topo.ifnames)):
        node_env = dict(env)
        # gloo binds to the veth address; same-namespace peers reach it through `lo`.
        node_env["GLOO_SOCKET_IFNAME"] = ifname
        node_env["EMU_IFNAME"] = ifname
        env_list = [f"{k2}={v}" for k2, v in node_env.items()]
        cmds.append(["ip", "netns", "exec", ns, "env", *env_list, "torchrun",
                     "--nnodes", str(topo.nnodes), "--node-rank", str(k),
                     "--nproc-per-node", str(topo.nproc_per_node), "--master-addr", topo.master_addr,
                     "--master-port", str(topo.master_port), *script_and_args])
    return cmds


def train_args(model: Dict[str, int], variant: str, iters: int, jsonl: str,
               micro_batch_size: int = 1, dp_size: int = 4, extra: Sequence[str] = (),
               bucket_size: int = DEFAULT_BUCKET_SIZE, pipeline: int = DEFAULT_PIPELINE,
               bf16_rs_algo: str = DEFAULT_BF16_RS_ALGO) -> List[str]:
    """pretrain_gpt.py arguments of one variant (the same model for every variant)."""
    flags = variant_flags(variant, bucket_size, pipeline)  # raises on an unknown variant
    m = model
    args = [
        *variant_script(variant, bf16_rs_algo),
        "--device", "cpu", "--distributed-backend", "gloo", "--mock-data",
        "--use-distributed-optimizer", "--bf16",
        "--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden_size"]),
        "--num-attention-heads", str(m["num_attention_heads"]),
        "--seq-length", str(m["seq_length"]), "--max-position-embeddings", str(m["seq_length"]),
        "--vocab-size", str(m["vocab_size"]),
        "--micro-batch-size", str(micro_batch_size),
        "--global-batch-size", str(micro_batch_size * dp_size),
        "--train-iters", str(iters), "--lr", "1e-4", "--eval-iters", "0",
        "--log-interval", "1", "--jsonl-log", jsonl,
    ]
    if m.get("num_experts"):
        args += ["--num-experts", str(m["num_experts"]), "--expert-model-parallel-size",
                 str(m["expert_model_parallel_size"]), *MOE_FLAGS]
    return args + flags + list(extra)


def collective_args(numel: int, iters: int, warmup: int, variants: Sequence[str], out_json: str,
                    extra: Sequence[str] = ()) -> List[str]:
    return [os.path.join(HERE, "bench_collectives.py"), "--numel", str(numel), "--iters", str(iters),
            "--warmup", str(warmup), "--variants", ",".join(variants), "--out", out_json, *extra]


# --- results parsing -----------------------------------------------------------------------------

_TIME_KEYS = ("ms_per_iteration", "elapsed_time_per_iteration_ms", "iteration_time_ms", "elapsed_ms", "time_ms",
              "ms_per_iter", "iter_time_ms")
_TIME_KEYS_S = ("elapsed_time_per_iteration", "iteration_time", "iteration_time_s", "elapsed_s",
                "time_s", "time")


def iteration_ms(record: dict) -> Optional[float]:
    """Per-iteration time in ms from one --jsonl-log record (tolerates several key spellings)."""
    for key in _TIME_KEYS:
        if isinstance(record.get(key), (int, float)):
            return float(record[key])
    for key in _TIME_KEYS_S:
        if isinstance(record.get(key), (int, float)):
            return 1e3 * float(record[key])
    return None


def parse_jsonl(path: str) -> List[dict]:
    """Training-interval records (those with an iteration number and a time)."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if (isinstance(rec, dict) and "iteration" in rec and rec.get("type", "train") == "train"
                    and iteration_ms(rec) is not None):
                out.append(rec)
    return out


def summarize_iterations(records: Sequence[dict], warmup: int) -> Dict[str, object]:
    """Median ms/iter over the records with iteration > warmup."""
    times = [iteration_ms(r) for r in records if int(r["iteration"]) > warmup]
    times = [t for t in times if t is not None]
    if not times:
        return {"ms_per_iter_median": None, "n": 0, "ms_all": []}
    return {"ms_per_iter_median": statistics.median(times), "n": len(times),
            "ms_all": [round(t, 1) for t in times]}


def logged_inter_bytes(records: Sequence[dict], warmup: int) -> Optional[float]:
    """Median over post-warm-up records of the trainer's own inter-node byte accounting
    (``grad_inter_bytes + weight_inter_bytes`` from ``communication_report``; logged by rank 0,
    quantized runs only). None when the trainer logs nothing of the kind."""
    vals = []
    for r in records:
        if int(r["iteration"]) <= warmup:
            continue
        keys = [k for k in r if k.endswith("_inter_bytes") and not k.startswith(("total", "grad_total",
                                                                                  "weight_total"))
                and "baseline" not in k]
        if keys:
            vals.append(sum(float(r[k]) for k in keys))
    return statistics.median(vals) if vals else None


def comm_medians(records: Sequence[dict], warmup: int) -> Dict[str, float]:
    """Median over the post-warm-up records of each ``COMM_KEYS`` field the trainer logged
    (per-iteration communication ms, total vs exposed); {} when it logs none of them."""
    out = {}
    for key in COMM_KEYS:
        vals = [float(r[key]) for r in records
                if int(r["iteration"]) > warmup and isinstance(r.get(key), (int, float))]
        if vals:
            out[key] = statistics.median(vals)
    return out


def speedups(ms: Dict[str, Optional[float]], baseline: str = "baseline") -> Dict[str, Optional[float]]:
    base = ms.get(baseline)
    return {k: (base / v if base and v else None) for k, v in ms.items()}


def strongest_baseline(ms: Dict[str, Optional[float]]) -> Optional[str]:
    """The fastest (lowest median ms/iter) of the unquantized ``BASELINES`` that ran; None if none."""
    done = [(v, b) for b, v in ms.items() if b in BASELINES and v]
    return min(done)[1] if done else None


def aggregate_runs(runs: Sequence[Dict[str, object]]) -> Dict[str, object]:
    """One variant's row from its per-invocation results (``ms`` None = that invocation failed):
    medians over the successful invocations of ms/iter, bytes/iter and every comm field."""
    ok = [r for r in runs if r.get("ms") is not None]

    def med(vals):
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    comm_keys = [k for k in COMM_KEYS if any(k in (r.get("comm") or {}) for r in ok)]
    return {"ms": med([r["ms"] for r in ok]), "bytes": med([r.get("bytes") for r in ok]),
            "n": sum(int(r.get("n") or 0) for r in ok),
            "comm": {k: med([(r.get("comm") or {}).get(k) for r in ok]) for k in comm_keys},
            "runs": list(runs)}


def build_rows(variants: Sequence[str], runs: Dict[str, Sequence[Dict[str, object]]]
               ) -> Dict[str, object]:
    """Rows of the train table (one per variant, in order) with the speedups vs ``baseline`` and
    vs the strongest baseline present, and the ratio to ``limit``."""
    rows = [dict(variant=v, **aggregate_runs(runs.get(v, []))) for v in variants]
    ms_by = {r["variant"]: r["ms"] for r in rows}
    strongest = strongest_baseline(ms_by)
    sp = speedups(ms_by)
    sp_strong = speedups(ms_by, baseline=strongest) if strongest else {}
    lim = ms_by.get("limit")
    for r in rows:
        r["speedup"] = sp[r["variant"]]
        r["speedup_strongest"] = sp_strong.get(r["variant"])
        r["vs_limit"] = r["ms"] / lim if (lim and r["ms"]) else None
    return {"rows": rows, "ms": ms_by, "strongest": strongest, "limit_ran": bool(lim)}


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _x(v: Optional[float]) -> str:
    return f"{v:.2f}x" if v else "n/a"


def fmt_runs(runs: Sequence[Dict[str, object]]) -> str:
    """'1520 (load 14.2); FAILED; 1490 (load 9.8)': each invocation's median ms/iter and the median
    1-min load average over its timed iterations."""
    parts = []
    for r in runs:
        if r.get("ms") is None:
            parts.append("FAILED")
        else:
            load = r.get("load")
            parts.append(f"{r['ms']:.0f} (load {f'{load:.1f}' if load is not None else 'n/a'})")
    return "; ".join(parts) if parts else "n/a"


def markdown_table(rows: List[Dict[str, object]], unit: str = "ms/iter",
                   refs: Sequence[str] = (), strongest: Optional[str] = None,
                   limit: bool = False) -> str:
    """One row per variant. Optional columns: per-invocation ms with load average (rows with
    ``runs``), "speedup vs REF" per extra reference (``speedup_vs`` dict), "speedup vs the
    strongest baseline" (``speedup_strongest``), "ms / limit" (``vs_limit``)."""
    per_inv = any(r.get("runs") for r in rows)
    n_inv = max((len(r.get("runs") or []) for r in rows), default=0)
    head = ["variant", f"{unit} (median{f' of {n_inv} invocations' if n_inv > 1 else ''})"]
    align = ["---", "---:"]
    if per_inv:
        head.append(f"per invocation: {unit} (1-min load avg)")
        align.append("---")
    head += ["inter-node bytes / iter", "speedup vs baseline"]
    align += ["---:", "---:"]
    head += [f"speedup vs {ref}" for ref in refs]
    align += ["---:"] * len(refs)
    if strongest:
        head.append(f"speedup vs strongest baseline ({strongest})")
        align.append("---:")
    if limit:
        head.append("ms / limit")
        align.append("---:")
    head.append("samples")
    align.append("---:")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        ms = r.get("ms")
        ok = ms is not None
        spv = r.get("speedup_vs") or {}
        cells = [str(r["variant"]), f"{ms:.1f}" if ok else "FAILED"]
        if per_inv:
            cells.append(fmt_runs(r.get("runs") or []))
        cells += [fmt_bytes(r.get("bytes")) if ok else "n/a", _x(r.get("speedup")) if ok else "n/a"]
        cells += [_x(spv.get(ref)) if ok else "n/a" for ref in refs]
        if strongest:
            cells.append(_x(r.get("speedup_strongest")) if ok else "n/a")
        if limit:
            cells.append(_x(r.get("vs_limit")) if ok else "n/a")
        cells.append(str(r.get("n", "")) if ok else "0")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


COMM_LABELS = {"comm_grad_intra_ms": "grad intra", "comm_grad_inter_ms": "grad inter",
               "comm_grad_exposed_ms": "grad exposed", "comm_weight_ms": "weight",
               "comm_weight_exposed_ms": "weight exposed"}


def comm_table(rows: List[Dict[str, object]]) -> str:
    """Second table: medians of the trainer-logged communication ms per iteration (``COMM_KEYS``);
    '' when no row has any."""
    keys = [k for k in COMM_KEYS if any(k in (r.get("comm") or {}) for r in rows)]
    if not keys:
        return ""
    lines = ["| variant | " + " | ".join(f"{COMM_LABELS[k]} ms" for k in keys) + " |",
             "|---|" + "---:|" * len(keys)]
    for r in rows:
        c = r.get("comm") or {}
        lines.append(f"| {r['variant']} | "
                     + " | ".join(f"{c[k]:.1f}" if c.get(k) is not None else "n/a" for k in keys)
                     + " |")
    return "\n".join(lines)


def target_statements(ms: Dict[str, Optional[float]]) -> List[str]:
    """Issue 11's targets as plain statements with the measured numbers (informational)."""
    ov, bf, lim = ms.get("sdp4bit-overlap"), ms.get("baseline-bf16"), ms.get("limit")

    def why(*names):
        return "n/a (" + ", ".join(n for n in names if not ms.get(n)) + " not run or failed)"

    speedup = f"{bf / ov:.2f}x" if ov and bf else why("sdp4bit-overlap", "baseline-bf16")
    ratio = f"{ov / lim:.2f}x" if ov and lim else why("sdp4bit-overlap", "limit")
    return [f"sdp4bit-overlap vs baseline-bf16: {speedup} (target >= 1.8x at 1 Gbit/s, >= 3.5x at "
            f"200 Mbit/s)",
            f"sdp4bit-overlap / limit: {ratio} (target <= 1.15x)"]


# --- link counters -------------------------------------------------------------------------------

def read_link_tx(topo: Topology) -> Optional[int]:
    """Sum of the veth tx byte counters of all namespaces (= bytes that crossed the link)."""
    if not topo.use_netns:
        return None
    total = 0
    for ns, ifname in zip(topo.namespaces, topo.ifnames):
        try:
            out = subprocess.run(["ip", "netns", "exec", ns, "cat",
                                  f"/sys/class/net/{ifname}/statistics/tx_bytes"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
            total += int(out.strip())
        except (subprocess.SubprocessError, ValueError):
            return None
    return total


def parse_retrans_segs(snmp_text: str) -> Optional[int]:
    """``RetransSegs`` from the text of ``/proc/net/snmp`` (a "Tcp:" header line, then values)."""
    lines = [ln.split() for ln in snmp_text.splitlines() if ln.startswith("Tcp:")]
    if len(lines) < 2 or "RetransSegs" not in lines[0]:
        return None
    return int(lines[1][lines[0].index("RetransSegs")])


def read_tcp_retrans(topo: Topology) -> Optional[int]:
    """TCP segments retransmitted so far in all namespaces (drops at the tbf queue show up here)."""
    if not topo.use_netns:
        return None
    total = 0
    for ns in topo.namespaces:
        try:
            out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
        except subprocess.SubprocessError:
            return None
        v = parse_retrans_segs(out)
        if v is None:
            return None
        total += v
    return total


class JsonlCounterSampler(threading.Thread):
    """Polls the jsonl log; when a new line appears records (iteration, link tx bytes)."""

    def __init__(self, topo: Topology, path: str, period: float = 0.05):
        super().__init__(daemon=True)
        self.topo, self.path, self.period = topo, path, period
        self.samples: List[tuple] = []  # (iteration, tx_bytes)
        self.loads: List[tuple] = []    # (iteration, 1-min load average) -- the machine is shared
        self._halt = threading.Event()
        self._pos = 0

    def run(self) -> None:
        buf = ""
        while not self._halt.is_set():
            try:
                with open(self.path) as f:
                    f.seek(self._pos)
                    chunk = f.read()
                    self._pos = f.tell()
            except OSError:
                chunk = ""
            if chunk:
                tx = read_link_tx(self.topo)
                buf += chunk
                *full, buf = buf.split("\n")
                for line in full:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(rec, dict) and "iteration" in rec:
                        self.samples.append((int(rec["iteration"]), tx))
                        try:
                            self.loads.append((int(rec["iteration"]), os.getloadavg()[0]))
                        except OSError:
                            pass
            self._halt.wait(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def load_summary(self, warmup: int) -> Optional[str]:
        """'min-max (median m)' of the 1-min load average over the timed (post-warm-up)
        iterations."""
        vals = sorted(v for it, v in self.loads if it > warmup)
        if not vals:
            return None
        return f"{vals[0]:.1f}-{vals[-1]:.1f} (median {statistics.median(vals):.1f})"

    def load_median(self, warmup: int) -> Optional[float]:
        """Median 1-min load average over the timed (post-warm-up) iterations."""
        vals = [v for it, v in self.loads if it > warmup]
        return statistics.median(vals) if vals else None

    def bytes_per_iter(self, warmup: int) -> Optional[float]:
        pts = [(it, tx) for it, tx in self.samples if tx is not None and it >= warmup]
        if len(pts) < 2:
            return None
        (i0, b0), (i1, b1) = pts[0], pts[-1]
        return (b1 - b0) / (i1 - i0) if i1 > i0 else None


# --- launching -----------------------------------------------------------------------------------

def run_nodes(cmds: List[List[str]], timeout: float, log_prefix: str) -> int:
    """Start every node's command, wait for all (bounded), kill the process groups on timeout."""
    procs, logs = [], []
    for k, cmd in enumerate(cmds):
        log = open(f"{log_prefix}.node{k}.log", "w")
        logs.append(log)
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                      start_new_session=True))
    deadline = time.time() + timeout
    rc = 0
    try:
        for p in procs:
            left = max(0.1, deadline - time.time())
            try:
                r = p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                print(f"[bench] timeout after {timeout:.0f}s; killing", file=sys.stderr)
                rc = 124
                break
            rc = rc or r
            if r != 0:
                break  # one node failed: do not wait for the other to time out
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for log in logs:
            log.close()
    return rc


def tail(path: str, n: int = 15) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def link_control(action: str, topo: Topology, script: str, bandwidth: Optional[str] = None,
                 timeout: float = 120) -> tuple:
    """``bash setup_netns.sh unlimit|limit`` for this topology's namespaces/veth ends: (ok, output).
    The shaping knobs (LATENCY, BURST, STATE_FILE) come from this process's environment (run_bench.sh
    exports them); BANDWIDTH from ``bandwidth`` when given."""
    env = dict(os.environ, NS0=topo.namespaces[0], NS1=topo.namespaces[1],
               IF0=topo.ifnames[0], IF1=topo.ifnames[1])
    if bandwidth:
        env["BANDWIDTH"] = bandwidth
    try:
        p = subprocess.run(["bash", script, action], env=env, capture_output=True, text=True,
                           timeout=timeout)
    except (subprocess.SubprocessError, OSError) as e:
        return False, str(e)
    return p.returncode == 0, (p.stdout + p.stderr).strip()


# --- CLI -----------------------------------------------------------------------------------------

def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("train", "collectives"), default="train")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated, run in this order (train default: {DEFAULT_TRAIN_VARIANTS}; "
                        f"collectives default: {DEFAULT_COLLECTIVE_VARIANTS})")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the whole variant list this many times back to back (train mode); the "
                        "table shows the median over the invocations and every invocation's value")
    p.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE,
                   help="--ddp-bucket-size of baseline-bf16, sdp4bit-overlap and limit (elements)")
    p.add_argument("--pipeline", type=int, default=DEFAULT_PIPELINE,
                   help="--gradient-alltoall-pipeline of sdp4bit-overlap and limit")
    p.add_argument("--bf16-rs-algo", choices=("ring", "a2a"), default=DEFAULT_BF16_RS_ALGO,
                   help="baseline-bf16's ring-volume reduce-scatter (ring_volume_rs.py)")
    p.add_argument("--bandwidth", default=os.environ.get("BANDWIDTH"),
                   help="link rate of the setup (tc syntax; default $BANDWIDTH): re-applied after "
                        "`limit` and printed with the targets")
    p.add_argument("--link-script", default=os.path.join(HERE, "setup_netns.sh"),
                   help="script whose `unlimit` / `limit` remove / re-apply the link limit around "
                        "the `limit` variant")
    p.add_argument("--namespaces", default=None, help="comma-separated: node0,node1 (from setup_netns.sh)")
    p.add_argument("--ifnames", default="emu0,emu1")
    p.add_argument("--master-addr", default="10.77.0.1")
    p.add_argument("--master-port", type=int, default=29555)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--no-netns", action="store_true", help="single-node loopback run (4 ranks)")
    p.add_argument("--model", default="small", choices=sorted(MODEL_PRESETS))
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=None, help="override the preset's sequence length")
    p.add_argument("--iters", type=int, default=8, help="train: --train-iters; collectives: timed steps")
    p.add_argument("--warmup", type=int, default=2, help="iterations excluded from the median")
    p.add_argument("--numel", type=int, default=None,
                   help="collectives: elements (default: the parameter count of --model)")
    p.add_argument("--threads", type=int, default=1, help="OMP/torch threads per rank")
    p.add_argument("--timeout", type=float, default=600, help="seconds per variant")
    p.add_argument("--train-extra", default="", help="extra pretrain_gpt.py flags (all variants)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--link-info", default="", help="free text for the report (bandwidth check etc.)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    return p.parse_args(argv)


def topology_from_args(args: argparse.Namespace) -> Topology:
    if args.no_netns:
        return Topology(namespaces=[], ifnames=[], master_port=args.master_port,
                        nproc_per_node=args.nproc_per_node, use_netns=False)
    if not args.namespaces:
        raise SystemExit("--namespaces NS0,NS1 is required (or --no-netns)")
    return Topology(namespaces=args.namespaces.split(","), ifnames=args.ifnames.split(","),
                    master_addr=args.master_addr, master_port=args.master_port,
                    nproc_per_node=args.nproc_per_node)


def run_train_invocation(args: argparse.Namespace, topo: Topology, v: str, cmds: List[List[str]],
                         jsonl: str, log_prefix: str) -> Dict[str, object]:
    """Run one variant once (all nodes, bounded) and return its per-invocation result."""
    sampler = JsonlCounterSampler(topo, jsonl)
    sampler.start()
    t0 = time.time()
    retrans0 = read_tcp_retrans(topo)
    rc = run_nodes(cmds, args.timeout, log_prefix)
    retrans1 = read_tcp_retrans(topo)
    sampler.stop()
    recs = parse_jsonl(jsonl)
    summ = summarize_iterations(recs, args.warmup)
    print(f"[bench] {v}: rc={rc} wall={time.time() - t0:.0f}s iters={len(recs)} "
          f"median={summ['ms_per_iter_median']} ms all={summ['ms_all']}", flush=True)
    if rc != 0 or summ["ms_per_iter_median"] is None:
        print(tail(f"{log_prefix}.node0.log", 30), file=sys.stderr)
    logged = logged_inter_bytes(recs, args.warmup)
    rs_lines: List[str] = []
    if v in RS_VARIANTS:  # show that the replacement reduce-scatter was used
        rs_lines = [ln.strip() for k in range(len(cmds))
                    for ln in tail(f"{log_prefix}.node{k}.log", 400).splitlines()
                    if "[ring_volume_rs]" in ln]
        print("[bench]   " + "\n[bench]   ".join(rs_lines or ["no [ring_volume_rs] line"]), flush=True)
    load = sampler.load_summary(args.warmup)
    extra = ([f"trainer-logged inter-node payload (rank 0 accounting): {fmt_bytes(logged)}/iter"]
             if logged is not None else [])
    extra += [f"per-iteration ms: {summ['ms_all']}"]
    if retrans0 is not None and retrans1 is not None:
        extra.append(f"TCP segments retransmitted in both namespaces during the run "
                     f"(all iterations and start-up): {retrans1 - retrans0}")
    if load:
        extra.append(f"1-min load average during the timed iterations: {load}")
    if rs_lines:
        extra.append("replacement reduce-scatter: " + " / ".join(rs_lines))
    return {"ms": summ["ms_per_iter_median"] if rc == 0 else None, "rc": rc,
            "bytes": sampler.bytes_per_iter(args.warmup), "n": summ["n"],
            "load": sampler.load_median(args.warmup), "comm": comm_medians(recs, args.warmup),
            "extra": "; ".join(extra)}


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    topo = topology_from_args(args)
    if args.variants is None:
        args.variants = DEFAULT_TRAIN_VARIANTS if args.mode == "train" else DEFAULT_COLLECTIVE_VARIANTS
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    model = dict(MODEL_PRESETS[args.model])
    if args.seq_length:
        model["seq_length"] = args.seq_length
    nparams = approx_gpt_params(**model)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    work = os.path.join(out_dir, f"emulated_{stamp}")
    if not args.dry_run:
        os.makedirs(work, exist_ok=True)  # also creates out_dir

    rows: List[Dict[str, object]] = []
    commands: Dict[str, List[List[str]]] = {}
    notes: List[str] = []  # report lines below the table
    strongest, limit_ran = None, False
    if args.mode == "collectives":
        numel = args.numel or nparams
        out_json = os.path.join(work, "collectives.json")
        script = collective_args(numel, args.iters, args.warmup, variants, out_json)
        cmds = node_commands(topo, script, threads=args.threads)
        commands[" + ".join(variants) + " (one invocation)"] = cmds
        print("[bench] " + "\n[bench] ".join(shlex.join(c) for c in cmds), flush=True)
        if args.dry_run:
            return 0
        t0 = time.time()
        rc = run_nodes(cmds, args.timeout * len(variants), os.path.join(work, "collectives"))
        print(f"[bench] collectives rc={rc} in {time.time() - t0:.0f}s", flush=True)
        res = {}
        if os.path.exists(out_json):
            with open(out_json) as f:
                res = json.load(f)["results"]
        else:
            print(tail(os.path.join(work, "collectives.node0.log"), 30), file=sys.stderr)
        ms = {v: (res.get(v) or {}).get("ms_per_step_median") for v in variants}
        sp = speedups(ms)
        for v in variants:
            r = res.get(v) or {}
            rows.append({"variant": v, "ms": ms[v], "bytes": r.get("inter_node_bytes_per_step"),
                         "speedup": sp[v], "n": args.iters,
                         "extra": f"rs {r.get('ms_rs_median_rank0', 0):.0f} ms, ag "
                                  f"{r.get('ms_ag_median_rank0', 0):.0f} ms (rank 0), grad rel err "
                                  f"{r.get('grad_rel_err_vs_exact', 0):.3f}" if r else ""})
        unit = "ms/step"
        what = f"bench_collectives.py, N = {numel:,} elements (~{args.model} GPT)"
    else:
        for v in variants:  # fail before anything runs
            variant_flags(v, args.bucket_size, args.pipeline)
        runs: Dict[str, List[Dict[str, object]]] = {v: [] for v in variants}
        extras: List[str] = []
        limit_log: List[str] = []
        aborted = None
        shaped = topo.use_netns  # the link limit can be removed only between two namespaces
        for rep in range(args.repeats):
            if aborted:
                break
            if args.repeats > 1:
                print(f"[bench] === invocation {rep + 1}/{args.repeats}", flush=True)
            for j, v in enumerate(variants):
                tag = v if args.repeats == 1 else f"{v}.run{rep + 1}"
                jsonl = os.path.join(work, f"{tag}.jsonl")
                script = train_args(model, v, args.iters, jsonl, args.micro_batch_size, topo.world,
                                    shlex.split(args.train_extra), bucket_size=args.bucket_size,
                                    pipeline=args.pipeline, bf16_rs_algo=args.bf16_rs_algo)
                port = args.master_port + rep * len(variants) + j
                topo_v = Topology(**{**topo.__dict__, "master_port": port})
                cmds = node_commands(topo_v, script, threads=args.threads,
                                     extra_env=VARIANT_ENV.get(v))
                commands.setdefault(v, cmds)
                print(f"[bench] {tag}:\n[bench]   " + "\n[bench]   ".join(shlex.join(c) for c in cmds),
                      flush=True)
                unlimited = v in UNLIMITED_VARIANTS and shaped
                if unlimited:
                    print(f"[bench]   {v}: link limit removed for this run only: `bash "
                          f"{args.link_script} unlimit` before, `... limit` after "
                          f"(NS0={topo.namespaces[0]} NS1={topo.namespaces[1]})", flush=True)
                if args.dry_run:
                    continue
                if unlimited:
                    try:
                        ok, out = link_control("unlimit", topo, args.link_script, args.bandwidth)
                        print("[bench]   unlimit: " + out.replace("\n", " | "), flush=True)
                        limit_log.append(f"invocation {rep + 1}: unlimit: {out.replace(chr(10), ' | ')}")
                        if ok:
                            res = run_train_invocation(args, topo_v, v, cmds, jsonl,
                                                       os.path.join(work, tag))
                        else:
                            print(f"[bench] {v}: could not remove the link limit: not run",
                                  file=sys.stderr)
                            res = {"ms": None, "rc": -1, "n": 0, "extra": "not run: unlimit failed"}
                    finally:  # always: unlimit may have failed half-way
                        ok, out = link_control("limit", topo, args.link_script, args.bandwidth)
                        print("[bench]   limit: " + out.replace("\n", " | "), flush=True)
                        limit_log.append(f"invocation {rep + 1}: limit re-applied: "
                                         f"{out.replace(chr(10), ' | ')}")
                        if not ok:
                            aborted = ("could not re-apply the link limit after `limit` "
                                       f"(invocation {rep + 1}); later runs were skipped")
                else:
                    res = run_train_invocation(args, topo_v, v, cmds, jsonl, os.path.join(work, tag))
                runs[v].append(res)
                if res.get("extra"):
                    extras.append(f"- {tag}: {res['extra']}")
                if aborted:
                    print(f"[bench] ABORTED: {aborted}", file=sys.stderr)
                    break
        if args.dry_run:
            return 0
        built = build_rows(variants, runs)
        rows, strongest, limit_ran = built["rows"], built["strongest"], built["limit_ran"]
        unit = "ms/iter"
        m = model
        moe = (f", {m['num_experts']} experts top-2 (EP {m['expert_model_parallel_size']}, "
               f"alltoall)" if m.get("num_experts") else "")
        what = (f"pretrain_gpt.py, GPT {args.model}: {m['num_layers']} layers, hidden "
                f"{m['hidden_size']}, {m['num_attention_heads']} heads, seq {m['seq_length']}, vocab "
                f"{m['vocab_size']}{moe} (~{nparams / 1e6:.1f}M params), micro-batch "
                f"{args.micro_batch_size}, global batch {args.micro_batch_size * topo.world}")
        knobs = [f"bucket size {args.bucket_size:,} elements (baseline-bf16, sdp4bit-overlap, limit)"]
        if any(v in ("sdp4bit-overlap", *UNLIMITED_VARIANTS) for v in variants):
            knobs.append(f"--gradient-alltoall-pipeline {args.pipeline}")
        if "baseline-bf16" in variants:
            knobs.append(f"baseline-bf16 reduce-scatter: {args.bf16_rs_algo} (ring_volume_rs.py, "
                         f"async calls on a worker thread)")
        notes.append("- knobs: " + ", ".join(knobs))
        if any(v in UNLIMITED_VARIANTS for v in variants):
            if shaped:
                notes.append("- **limit ran WITHOUT the link limit**: the tc qdiscs (tbf, and netem "
                             "if any) were removed from both veth ends for its runs only "
                             "(`setup_netns.sh unlimit`) and re-applied right after (`setup_netns.sh "
                             "limit`); every byte at veth/loopback speed, same namespaces and torchrun "
                             "layout, same arguments as sdp4bit-overlap")
                notes += [f"  - {ln}" for ln in limit_log]
            else:
                notes.append("- limit: loopback run (--no-netns): identical to sdp4bit-overlap (no "
                             "link limit to remove)")
        if aborted:
            notes.append(f"- **ABORTED**: {aborted}")
        if strongest:
            notes.append(f"- strongest baseline present (fastest of {', '.join(BASELINES)} by "
                         f"median): {strongest}")
        rows_extra = extras

    if args.mode == "train":
        table = markdown_table(rows, unit=unit, strongest=strongest, limit=limit_ran)
        ctable = comm_table(rows)
    else:
        table, ctable, rows_extra = markdown_table(rows, unit=unit), "", \
            [f"- {r['variant']}: {r['extra']}" for r in rows if r.get("extra")]
    ok = any(r.get("ms") for r in rows)
    report = [f"# Emulated two-node benchmark ({args.mode})", "",
              f"- date: {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}",
              f"- machine: {os.cpu_count()}-core CPU (shared; timings are noisy), torch gloo backend",
              f"- topology: {topo.nnodes} node(s) x "
              f"{topo.nproc_per_node if topo.use_netns else topo.world} ranks"
              + (f", namespaces {','.join(topo.namespaces)} via veth {'/'.join(topo.ifnames)}"
                 if topo.use_netns else " (loopback, no emulated link)"),
              f"- link: {args.link_info or (args.bandwidth or 'n/a')}",
              f"- workload: {what}",
              f"- median over {args.iters - args.warmup if args.mode == 'train' else args.iters} "
              f"iterations after {args.warmup} warm-up"
              + (f"; {args.repeats} invocations of the whole variant list back to back, the table's "
                 f"ms/iter is the median over them" if args.mode == "train" and args.repeats > 1 else "")
              + "; bytes = veth tx counters of both namespaces",
              f"- raw logs: {work}", *notes, "", table, ""]
    if ctable:
        report += ["Trainer-logged communication time per iteration (median ms; total vs exposed = "
                   "waited on by the main thread):", "", ctable, ""]
    if args.mode == "train":
        report += [f"Targets (issue 11; informational; link of this run: {args.bandwidth or 'n/a'}"
                   f"{', no link (loopback)' if not topo.use_netns else ''}):", ""]
        report += [f"- {t}" for t in target_statements({r['variant']: r['ms'] for r in rows})] + [""]
    report += rows_extra
    report += ["", "Commands (one per emulated node"
               + ("; invocation k of --repeats uses master port + (k-1) x variants and jsonl "
                  "<variant>.run<k>.jsonl" if args.mode == "train" and args.repeats > 1 else "")
               + "):", ""]
    for v, cmds in commands.items():
        report.append(f"- **{v}**" + (" (run without the link limit)"
                                      if v in UNLIMITED_VARIANTS and topo.use_netns
                                      and args.mode == "train" else "") + ":")
        report.append("  ```")
        report += ["  " + shlex.join(c) for c in cmds]
        report.append("  ```")
    text = "\n".join(report) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.join(work, "report.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    print(f"[bench] wrote {args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
