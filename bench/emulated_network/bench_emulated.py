"""Emulated two-node benchmark driver: baseline vs SDP4Bit over a rate-limited veth link.

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

``--no-netns`` runs one torchrun with ``--nproc-per-node 4`` on loopback (quick functional check).
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
}

# --- variants ------------------------------------------------------------------------------------
# SDP4Bit as in the paper: TLq-HS 8-bit intra / 4-bit inter gradients (group 128/128, Hadamard)
# and qWD 4-bit weight differences (group 2048).
SDP4BIT_FLAGS = [
    "--quantized-weights", "--weight-quantization-bits", "4", "--wq-group-size", "2048",
    "--quantized-gradients", "--gradient-quantization-bits-intra", "8",
    "--gradient-quantization-bits-inter", "4", "--gq-group-size-intra", "128",
    "--gq-group-size-inter", "128", "--hadamard-transform",
]
TRAIN_VARIANTS: Dict[str, List[str]] = {"baseline": [], "sdp4bit": SDP4BIT_FLAGS,
                                         "sdp4bit-torch": SDP4BIT_FLAGS,
                                         "baseline-a2a": [], "baseline-ring": []}
# Benchmark-only baselines: the same exact fp32 training as "baseline", but megatron-core's gradient
# reduce-scatter (an all-reduce on gloo, 2x NCCL's ring bytes) is replaced for gloo groups by an
# exact reduce-scatter with ring volume, (P-1)/P*N elements sent per rank (ring_volume_rs.py):
# baseline-a2a = all_to_all_single + local sum in rank order, baseline-ring = P2P ring.
VARIANT_SCRIPT: Dict[str, List[str]] = {
    "baseline-a2a": [os.path.join(HERE, "pretrain_a2a_rs.py"), "--rs-algo", "a2a"],
    "baseline-ring": [os.path.join(HERE, "pretrain_a2a_rs.py"), "--rs-algo", "ring"],
}
# per-variant environment of the ranks: sdp4bit-torch = SDP4Bit with the pure-PyTorch reference
# quantizer (the state before the C++ CPU kernels), for before/after comparisons in one invocation
VARIANT_ENV: Dict[str, Dict[str, str]] = {"sdp4bit-torch": {"QUANT_KERNELS": "torch"}}
COLLECTIVE_VARIANTS = ("baseline", "sdp4bit")


def approx_gpt_params(num_layers: int, hidden_size: int, vocab_size: int, seq_length: int,
                      untied: bool = False, **_: int) -> int:
    """Parameter count of a Megatron GPT (12h^2+13h per layer, embeddings, final LN; the output
    layer shares the word embeddings unless ``untied``, Megatron's default)."""
    h = hidden_size
    per_layer = 12 * h * h + 13 * h
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
               micro_batch_size: int = 1, dp_size: int = 4, extra: Sequence[str] = ()) -> List[str]:
    """pretrain_gpt.py arguments of one variant (the same model for every variant)."""
    if variant not in TRAIN_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {sorted(TRAIN_VARIANTS)}")
    m = model
    args = [
        *VARIANT_SCRIPT.get(variant, [os.path.join(REPO, "pretrain_gpt.py")]),
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
    return args + list(TRAIN_VARIANTS[variant]) + list(extra)


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


def speedups(ms: Dict[str, Optional[float]], baseline: str = "baseline") -> Dict[str, Optional[float]]:
    base = ms.get(baseline)
    return {k: (base / v if base and v else None) for k, v in ms.items()}


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "n/a"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def markdown_table(rows: List[Dict[str, object]], unit: str = "ms/iter",
                   refs: Sequence[str] = ()) -> str:
    """One row per variant; ``refs`` adds a "speedup vs REF" column per extra reference variant
    (from each row's ``speedup_vs`` dict), e.g. the ring-volume baselines."""
    head = f"| variant | {unit} (median) | inter-node bytes / iter | speedup vs baseline |"
    head += "".join(f" speedup vs {ref} |" for ref in refs) + " samples |"
    lines = [head, "|---|---:|---:|---:|" + "---:|" * len(refs) + "---:|"]
    for r in rows:
        ms = r.get("ms")
        sp = r.get("speedup")
        spv = r.get("speedup_vs") or {}
        cols = "".join(f" {(f'{spv[ref]:.2f}x' if spv.get(ref) else 'n/a')} |" for ref in refs)
        lines.append(f"| {r['variant']} | {ms:.1f} | {fmt_bytes(r.get('bytes'))} | "
                     f"{(f'{sp:.2f}x' if sp else 'n/a')} |{cols} {r.get('n', '')} |"
                     if ms is not None else
                     f"| {r['variant']} | FAILED | n/a | n/a |" + " n/a |" * len(refs) + " 0 |")
    return "\n".join(lines)


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
        """'min-max (median m)' of the 1-min load average over the post-warm-up iterations."""
        vals = sorted(v for it, v in self.loads if it >= warmup)
        if not vals:
            return None
        return f"{vals[0]:.1f}-{vals[-1]:.1f} (median {statistics.median(vals):.1f})"

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


# --- CLI -----------------------------------------------------------------------------------------

def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("train", "collectives"), default="train")
    p.add_argument("--variants", default="baseline,sdp4bit")
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


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    topo = topology_from_args(args)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
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
        for i, v in enumerate(variants):
            jsonl = os.path.join(work, f"{v}.jsonl")
            script = train_args(model, v, args.iters, jsonl, args.micro_batch_size, topo.world,
                                shlex.split(args.train_extra))
            topo_v = Topology(**{**topo.__dict__, "master_port": args.master_port + i})
            cmds = node_commands(topo_v, script, threads=args.threads,
                                 extra_env=VARIANT_ENV.get(v))
            commands[v] = cmds
            print(f"[bench] {v}:\n[bench]   " + "\n[bench]   ".join(shlex.join(c) for c in cmds),
                  flush=True)
            if args.dry_run:
                continue
            sampler = JsonlCounterSampler(topo, jsonl)
            sampler.start()
            t0 = time.time()
            retrans0 = read_tcp_retrans(topo)
            rc = run_nodes(cmds, args.timeout, os.path.join(work, v))
            retrans1 = read_tcp_retrans(topo)
            sampler.stop()
            recs = parse_jsonl(jsonl)
            summ = summarize_iterations(recs, args.warmup)
            print(f"[bench] {v}: rc={rc} wall={time.time() - t0:.0f}s iters={len(recs)} "
                  f"median={summ['ms_per_iter_median']} ms all={summ['ms_all']}", flush=True)
            if rc != 0 or summ["ms_per_iter_median"] is None:
                print(tail(os.path.join(work, f"{v}.node0.log"), 30), file=sys.stderr)
            logged = logged_inter_bytes(recs, args.warmup)
            if v in VARIANT_SCRIPT:  # show that the replacement reduce-scatter was used
                rs_lines = [ln.strip() for k in range(len(cmds))
                            for ln in tail(os.path.join(work, f"{v}.node{k}.log"), 400).splitlines()
                            if "[ring_volume_rs]" in ln]
                print("[bench]   " + "\n[bench]   ".join(rs_lines or ["no [ring_volume_rs] line"]),
                      flush=True)
            rows.append({"variant": v, "ms": summ["ms_per_iter_median"] if rc == 0 else None,
                         "bytes": sampler.bytes_per_iter(args.warmup), "n": summ["n"],
                         "extra": "; ".join(
                             ([f"trainer-logged inter-node payload (rank 0 accounting): "
                               f"{fmt_bytes(logged)}/iter"] if logged is not None else [])
                             + [f"per-iteration ms: {summ['ms_all']}"]
                             + ([f"TCP segments retransmitted in both namespaces during the run "
                                 f"(all iterations and start-up): {retrans1 - retrans0}"]
                                if retrans0 is not None and retrans1 is not None else [])
                             + ([f"1-min load average during the timed iterations: "
                                 f"{sampler.load_summary(args.warmup)}"]
                                if sampler.load_summary(args.warmup) else []))})
        if args.dry_run:
            return 0
        ms_by = {r["variant"]: r["ms"] for r in rows}
        sp = speedups(ms_by)
        refs = [v for v in variants if v in VARIANT_SCRIPT]  # the ring-volume baselines present
        sp_refs = {ref: speedups(ms_by, baseline=ref) for ref in refs}
        for r in rows:
            r["speedup"] = sp[r["variant"]]
            r["speedup_vs"] = {ref: sp_refs[ref][r["variant"]] for ref in refs}
        unit = "ms/iter"
        m = model
        what = (f"pretrain_gpt.py, GPT {args.model}: {m['num_layers']} layers, hidden "
                f"{m['hidden_size']}, {m['num_attention_heads']} heads, seq {m['seq_length']}, vocab "
                f"{m['vocab_size']} (~{nparams / 1e6:.1f}M params), micro-batch "
                f"{args.micro_batch_size}, global batch {args.micro_batch_size * topo.world}")

    table = markdown_table(rows, unit=unit,
                           refs=[v for v in variants if v in VARIANT_SCRIPT] if args.mode == "train" else ())
    ok = any(r.get("ms") for r in rows)
    report = [f"# Emulated two-node benchmark ({args.mode})", "",
              f"- date: {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}",
              f"- machine: {os.cpu_count()}-core CPU (shared; timings are noisy), torch gloo backend",
              f"- topology: {topo.nnodes} node(s) x "
              f"{topo.nproc_per_node if topo.use_netns else topo.world} ranks"
              + (f", namespaces {','.join(topo.namespaces)} via veth {'/'.join(topo.ifnames)}"
                 if topo.use_netns else " (loopback, no emulated link)"),
              f"- link: {args.link_info or 'n/a'}",
              f"- workload: {what}",
              f"- median over {args.iters - args.warmup if args.mode == 'train' else args.iters} "
              f"iterations after {args.warmup} warm-up; bytes = veth tx counters of both namespaces",
              f"- raw logs: {work}", "", table, ""]
    for r in rows:
        if r.get("extra"):
            report.append(f"- {r['variant']}: {r['extra']}")
    report += ["", "Commands (one per emulated node):", ""]
    for v, cmds in commands.items():
        report.append(f"- **{v}**:")
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
