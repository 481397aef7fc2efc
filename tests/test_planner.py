"""The speed planner (tools/planner.py): each term against a hand-computed case, the bytes against
the collectives' accounting, the recipe path end to end, and ``--measure`` on 4 gloo ranks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron.distributed.quant.accounting import CommAccounting
from megatron.distributed.quant.config import HopSpec, QuantizationConfig
from megatron.distributed.quant.kernels.reference import QuantizedTensor
from megatron.planner import calibration
from megatron.planner.calibration import Contention, DeviceRates, KernelRate, fit_kernel
from megatron.planner.cluster import (Cluster, Link, MeasuredCollective, all_reduce_time,
                                      all_to_all_time, ring_time)
from megatron.planner.measure import (MAX_PROBE_BYTES, PROBE_SIZES, fit_link, median_seconds,
                                      probe_sizes, read_measurement, write_measurement)
from megatron.planner.timeline import (OPTIMIZER_BYTES_PER_ELEMENT, grad_bucket_cost, predict,
                                       two_lanes, weight_bucket_cost)
from megatron.planner.variants import (parse_run_args, recipe_variant_flags,
                                                         strip_quantization_flags)
from megatron.planner.workload import (Workload, count_parameters, moe_layer_pattern,
                                       parameter_counts, set_default_ffn_hidden_size,
                                       set_padded_vocab_size)

ROOT = Path(__file__).resolve().parents[1]

GPT_1_3B = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
            "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
            "--global-batch-size", "16", "--bf16", "--use-distributed-optimizer", "--mock-data",
            "--vocab-size", "50257", "--lr", "1e-4", "--train-iters", "1"]


def _cluster(nodes=2, gpn=4, intra_bw=100e9, intra_lat=2e-6, inter_bw=10e9, inter_lat=10e-6):
    return Cluster(nodes, gpn, Link(intra_bw, intra_lat), Link(inter_bw, inter_lat))


def _rates(kernel=KernelRate(1e-5, 1e11), tflops=100.0, contention=None):
    return DeviceRates(device="test", source="hand", contention=contention or {},
                       compute=(calibration.ComputeRate("x", 1_000_000, tflops),),
                       kernels={k: kernel for k in calibration.KERNELS}, copy_bandwidth=1e12)


# -- the collectives' costs ----------------------------------------------------------------------
def test_ring_time_by_hand():
    c = _cluster()
    # 8 ranks over 2 nodes, 4 groups per node share the 10 GB/s NICs: 7 steps of 10 us, and
    # 7/8 x 80 MB at 10/4 GB/s
    assert ring_time(80e6, 8, 2, 4, c) == pytest.approx(7 * 10e-6 + 70e6 / 2.5e9)
    # one node: the GPU's port
    assert ring_time(80e6, 4, 1, 1, c) == pytest.approx(3 * 2e-6 + 60e6 / 100e9)
    assert ring_time(80e6, 1, 1, 1, c) == 0.0


def test_all_reduce_picks_tree_for_small_and_ring_for_large():
    c = _cluster()
    small, large = 1e3, 1e9
    tree_small = 2 * math.ceil(math.log2(8)) * 10e-6 + 2 * small / 10e9
    assert all_reduce_time(small, 8, 2, 1, c) == pytest.approx(tree_small)
    assert all_reduce_time(large, 8, 2, 1, c) == pytest.approx(2 * ring_time(large, 8, 2, 1, c))


def test_all_to_all_shares_the_nic():
    link = Link(10e9, 5e-6)
    assert all_to_all_time(1e6, link, 4) == pytest.approx(5e-6 + 4e6 / 10e9)
    assert all_to_all_time(0, link) == 0.0


def test_a_measured_collective_interpolates_between_its_sizes():
    curve = MeasuredCollective(ranks=2, ranks_per_node=1, points=((4e6, 0.5), (1e6, 0.1), (16e6, 1.1)))
    assert curve.points[0] == (1e6, 0.1)                      # kept sorted by size
    assert curve.seconds(1e6) == pytest.approx(0.1)
    assert curve.seconds(2.5e6) == pytest.approx(0.3)         # half-way between 1 and 4 MB
    assert curve.seconds(10e6) == pytest.approx(0.8)          # half-way between 4 and 16 MB
    assert curve.seconds(28e6) == pytest.approx(1.7)          # the last segment, extended
    assert curve.seconds(0.25e6) == pytest.approx(0.0)        # the first one, not below zero
    assert curve.seconds(0) == 0.0
    # a small size slower than a larger one (a descheduled rank) reads as the larger one's time
    noisy = MeasuredCollective(ranks=2, ranks_per_node=1, points=((1e3, 0.2), (1e6, 0.1), (2e6, 0.2)))
    assert noisy.seconds(1e3) == pytest.approx(0.1) and noisy.seconds(1.5e6) == pytest.approx(0.15)
    for bad in (((1e6, 0.1),), ((1e6, 0.1), (1e6, 0.2)), ((0, 0.1), (1e6, 0.2)),
                ((1e3, -1.0), (1e6, 0.2))):
        with pytest.raises(ValueError, match="two or more distinct positive sizes"):
            MeasuredCollective(ranks=2, ranks_per_node=1, points=bad)
    with pytest.raises(ValueError, match="1 to all of them per node"):
        MeasuredCollective(ranks=2, ranks_per_node=3, points=((1e3, 0.1), (1e6, 0.2)))


def test_measured_collectives_replace_the_formulas_for_their_group_size():
    cfg_base = QuantizationConfig()
    cfg_q = QuantizationConfig.from_args(parse_run_args(GPT_1_3B + [
        "--quantized-gradients", "--quantized-weights"]))
    # 2 nodes x 4: the data-parallel group of 8 has 4 ranks per node, the inter-node one 1
    rs = MeasuredCollective(ranks=8, ranks_per_node=4, points=((1e6, 1e-3), (1e9, 1.001)))
    ag = MeasuredCollective(ranks=8, ranks_per_node=4, points=((1e6, 2e-3), (1e9, 2.0)))
    inter = MeasuredCollective(ranks=2, ranks_per_node=1, points=((1e6, 5e-3), (1e9, 5.0)))
    measured = replace(_cluster(), measured={"reduce_scatter": rs, "all_gather": ag,
                                             "all_to_all_inter": inter})
    w = Workload.from_args(parse_run_args(GPT_1_3B), measured)
    n = 10_000_000
    assert grad_bucket_cost(n, w, cfg_base, _rates()).seconds == pytest.approx(rs.seconds(4 * n))
    assert weight_bucket_cost(n, w, cfg_base, _rates()).seconds == pytest.approx(ag.seconds(2 * n))
    stated = Workload.from_args(parse_run_args(GPT_1_3B), _cluster())
    assert grad_bucket_cost(n, stated, cfg_base, _rates()).seconds == pytest.approx(
        ring_time(4 * n, 8, 2, 1, _cluster()))
    # the quantized inter-node hop reads its curve; the intra-node one (not measured) the formula:
    # one pipeline chunk, so the bucket's time differs by exactly the inter-node hop's
    assert cfg_q.gradient_alltoall_pipeline == 1
    q_measured = grad_bucket_cost(n, w, cfg_q, _rates()).seconds
    q_stated = grad_bucket_cost(n, stated, cfg_q, _rates()).seconds
    q2 = QuantizedTensor.wire_bytes(n // 4, cfg_q.gradient_quantization_bits_inter,
                                    cfg_q.gq_group_size_inter)
    assert q_measured - q_stated == pytest.approx(
        inter.seconds(q2) - all_to_all_time(q2 / 2, _cluster().inter, 4))
    # measured on another group: another size, or as many ranks placed otherwise (one node)
    for other_rs in (replace(rs, ranks=4), replace(rs, ranks_per_node=8)):
        other = replace(_cluster(), measured={"reduce_scatter": other_rs})
        w_other = Workload.from_args(parse_run_args(GPT_1_3B), other)
        assert grad_bucket_cost(n, w_other, cfg_base, _rates()).seconds == pytest.approx(
            ring_time(4 * n, 8, 2, 1, _cluster()))
    with pytest.raises(ValueError, match="unknown measured collective"):
        replace(_cluster(), measured={"broadcast": rs})


def test_fits_recover_their_line():
    k = fit_kernel([(1e6, 1e-5 + 1e6 / 5e11), (1e9, 1e-5 + 1e9 / 5e11)])
    assert k.fixed_s == pytest.approx(1e-5) and k.bandwidth == pytest.approx(5e11)
    link = fit_link([(1e4, 2e-4 + 1e4 / 1e8), (1e7, 2e-4 + 1e7 / 1e8)], concurrent=2)
    assert link.latency == pytest.approx(2e-4) and link.bandwidth == pytest.approx(2e8)


# -- the workload ---------------------------------------------------------------------------------
def test_parameter_count_matches_the_trainers():
    # the trainer printed these counts for the 125m and 1.3b recipes (docs/performance.md)
    args = parse_run_args(GPT_1_3B)
    w = Workload.from_args(args, _cluster(nodes=2, gpn=8))
    assert w.parameters == 1_315_819_520
    small = parse_run_args(GPT_1_3B[:1] + ["12"] + GPT_1_3B[2:3] + ["768"] + GPT_1_3B[4:5] + ["12"]
                           + GPT_1_3B[6:])
    small.padded_vocab_size = 50304
    assert count_parameters(small) == 125_262_336


def test_layout_and_buckets():
    args = parse_run_args(GPT_1_3B + ["--overlap-grad-reduce", "--tensor-model-parallel-size", "2"])
    w = Workload.from_args(args, _cluster(nodes=2, gpn=8))
    assert (w.tp, w.dp, w.dp_per_node, w.dp_nodes, w.micro_batches) == (2, 8, 4, 2, 2)
    assert sum(w.buckets) == w.rank_parameters and max(w.buckets) <= 40_000_000
    one = Workload.from_args(parse_run_args(GPT_1_3B), _cluster(nodes=2, gpn=8))
    assert one.buckets == (one.rank_parameters,)
    with pytest.raises(ValueError, match="MICRO_BATCH_SIZE"):
        Workload.from_args(parse_run_args(GPT_1_3B), _cluster(nodes=4, gpn=8))


# -- each bucket's cost ---------------------------------------------------------------------------
def test_two_level_bucket_by_hand():
    c = _cluster()   # D=4, M=2
    args = parse_run_args(GPT_1_3B[:12] + ["--global-batch-size", "8"] + GPT_1_3B[14:])
    w = Workload.from_args(args, c)
    cfg = QuantizationConfig(quantized_gradients=True, gradient_quantization_bits_intra=8,
                             gq_group_size_intra=128, gradient_quantization_bits_inter=4,
                             gq_group_size_inter=128, hadamard_transform=True)
    k = KernelRate(1e-5, 1e11)
    n = 8 * 2**20
    q1 = QuantizedTensor.wire_bytes(n, 8, 128)
    q2 = QuantizedTensor.wire_bytes(n // 4, 4, 128)
    hop1 = k.seconds(4 * n + q1)
    a = 2e-6 + 3 / 4 * q1 / 100e9
    b = k.seconds(q1 + q2) + (10e-6 + 4 * q2 / 2 / 10e9) + k.seconds(q2 + 4 * n / 8)
    cost = grad_bucket_cost(n, w, cfg, _rates(k))
    assert cost.seconds == pytest.approx(hop1 + a + b)
    assert cost.kernels == pytest.approx(hop1 + k.seconds(q1 + q2) + k.seconds(q2 + 4 * n / 8))
    # two pipeline chunks: each stage's chunk, then the longer one once more
    cost2 = grad_bucket_cost(n, w, replace(cfg, gradient_alltoall_pipeline=2), _rates(k))
    a2 = 2e-6 + 3 / 4 * QuantizedTensor.wire_bytes(n // 2, 8, 128) / 100e9
    q2c = QuantizedTensor.wire_bytes(n // 8, 4, 128)
    q1c = QuantizedTensor.wire_bytes(n // 2, 8, 128)
    b2 = k.seconds(q1c + q2c) + (10e-6 + 4 * q2c / 2 / 10e9) + k.seconds(q2c + 4 * n / 2 / 8)
    assert cost2.seconds == pytest.approx(hop1 + a2 + b2 + max(a2, b2))
    # the baseline: a ring reduce-scatter of fp32 gradients
    base = grad_bucket_cost(n, w, QuantizationConfig(), _rates(k))
    assert base.seconds == pytest.approx(ring_time(4 * n, 8, 2, 1, c))


def test_weight_bucket_by_hand():
    c = _cluster()
    w = Workload.from_args(parse_run_args(GPT_1_3B[:12] + ["--global-batch-size", "8"] + GPT_1_3B[14:]), c)
    k = KernelRate(2e-5, 2e11)
    n = 8 * 2**20
    cfg = QuantizationConfig(quantized_weights=True, weight_quantization_bits=4, wq_group_size=2048)
    shard = n // 8
    wire = QuantizedTensor.wire_bytes
    expect = (k.seconds(6 * shard + wire(shard, 4, 2048))
              + ring_time(8 * wire(shard, 4, 2048), 8, 2, 1, c)
              + k.seconds(wire(n, 4, 2048) + 4 * n))
    assert weight_bucket_cost(n, w, cfg, _rates(k)).seconds == pytest.approx(expect)
    assert weight_bucket_cost(n, w, QuantizationConfig(), _rates(k)).seconds == \
        pytest.approx(ring_time(2 * n, 8, 2, 1, c))


def test_planner_bytes_are_the_collectives_accounting():
    """The bytes the planner records are what CommAccounting's helper records for the
    collective (the same call), and the two-level hop sizes follow the wire format."""
    acc = CommAccounting()
    n, p, d = 1 << 20, 8, 4
    acc.record_two_level_reduce_scatter("b", numel=n, elem_size=4, dp_size=p, intra_size=d,
                                        intra=HopSpec(8, 128), inter=HopSpec(4, 128))
    g = acc.totals()["grad"]
    assert g["intra"]["bytes"] == QuantizedTensor.wire_bytes(n, 8, 128) * 3 // 4
    assert g["inter"]["bytes"] == QuantizedTensor.wire_bytes(n // 4, 4, 128) // 2
    acc.record_quantized_all_gather("w", shard_numel=4096, elem_size=2, spec=HopSpec(4, 2048),
                                    hops=[(3, 4)])
    wt = acc.totals()["weight"]
    assert wt["inter"]["bytes"] == QuantizedTensor.wire_bytes(4096, 4, 2048) * 1   # (M-1) shares
    assert wt["intra"]["bytes"] == QuantizedTensor.wire_bytes(4096, 4, 2048) * 3 * 2


# -- the timeline -----------------------------------------------------------------------------------
def _run(extra=(), quant=()):
    c = _cluster()
    argv = GPT_1_3B[:12] + ["--global-batch-size", "8"] + GPT_1_3B[14:] + list(extra) + list(quant)
    args = parse_run_args(argv)
    return Workload.from_args(args, c), QuantizationConfig.from_args(args)


def test_without_overlap_everything_adds_up():
    w, cfg = _run()
    rates = _rates()
    p = predict("baseline", w, cfg, rates)
    compute = w.flops_per_rank / 100e12
    optimizer = w.rank_parameters / 8 * OPTIMIZER_BYTES_PER_ELEMENT / 1e12
    assert p.compute_s == pytest.approx(compute)
    assert p.grad_exposed_s == pytest.approx(p.grad_total_s)
    assert p.weight_exposed_s == pytest.approx(p.weight_total_s)
    assert p.iteration_s == pytest.approx(compute + p.grad_total_s + optimizer + p.weight_total_s)


def test_a_measured_optimizer_rate_replaces_the_copy_estimate():
    w, cfg = _run()
    measured = replace(_rates(), optimizer_seconds_per_element=1e-8)
    p = predict("baseline", w, cfg, measured)
    assert p.optimizer_s == pytest.approx(w.rank_parameters / 8 * 1e-8)


def test_weight_gathers_start_after_the_step_not_during_it():
    """--overlap-param-gather-with-optimizer-step: the trainer dispatches every gather right
    after the step (install_gather_after_step), so none hides behind the step itself: one after
    another from the step's end, the forward of the last bucket starts when all are done."""
    flags = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "200000000"]
    w, cfg = _run(flags + ["--overlap-param-gather-with-optimizer-step"])
    rates = replace(_rates(tflops=1e6), optimizer_seconds_per_element=1e-6)   # a long step
    p = predict("b", w, cfg, rates)
    assert len(w.buckets) > 2 and p.optimizer_s > p.weight_total_s
    forward = p.compute_s / w.micro_batches / 3
    last_share = w.buckets[0] / w.rank_parameters   # bucket 0 holds the last layers: forward's last
    assert forward < 0.01 * p.weight_total_s        # the gathers, not the forward, set the pace
    assert p.weight_exposed_s >= p.weight_total_s - (1 - last_share) * forward - 1e-12
    # megatron-core's own one-ahead prefetch exposes at least as much
    w1, cfg1 = _run(flags)
    assert predict("b", w1, cfg1, rates).weight_exposed_s >= p.weight_exposed_s - 1e-12


def test_overlap_hides_what_the_backward_covers():
    w, cfg = _run(["--overlap-grad-reduce", "--ddp-bucket-size", "200000000"])
    slow = predict("b", w, cfg, _rates(tflops=1.0))     # long backward: only the last bucket shows
    last = grad_bucket_cost(w.buckets[-1], w, cfg, _rates(tflops=1.0)).seconds
    assert slow.grad_exposed_s == pytest.approx(last)
    fast = predict("b", w, cfg, _rates(tflops=1e6))     # no backward to hide behind
    assert fast.grad_exposed_s == pytest.approx(fast.grad_total_s, rel=1e-3)


def test_two_lanes_by_hand():
    # job j waits for compute piece j; both busy: compute at 1/2 speed, the jobs at 1/3
    slow = Contention(compute=2.0, communication=3.0)
    # t 0-1 piece 0 alone; t 1-3 piece 1 (2 s at half speed) beside job 0 (2/3 done);
    # t 3-3.33 job 0's last third alone; t 3.33-4.33 job 1 alone
    assert two_lanes([1, 1], [1, 1], [0, 1], [-1, -1], slow) == pytest.approx((3.0, 13 / 3))
    # alone speeds: the plain one-at-a-time chain
    assert two_lanes([1, 1], [1, 1], [0, 1], [-1, -1]) == pytest.approx((2.0, 3.0))
    # the forward's shape: piece k waits for gather k
    assert two_lanes([1, 1], [0.5, 0.5], [-1, -1], [0, 1]) == pytest.approx((2.5, 1.0))
    with pytest.raises(ValueError, match="cycle"):
        two_lanes([1], [1], [0], [0])


def test_measured_contention_costs_only_what_overlaps():
    flags = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "200000000"]
    quant = ["--quantized-gradients", "--quantized-weights"]
    w, cfg = _run(flags, quant)
    slow = {"quantized": Contention(compute=1.5, communication=2.0)}
    alone = predict("q", w, cfg, _rates(tflops=1.0))
    beside = predict("q", w, cfg, _rates(tflops=1.0, contention=slow))
    assert alone.contention_s == 0.0
    assert beside.contention_s > 0
    assert beside.iteration_s == pytest.approx(alone.iteration_s + beside.contention_s)
    # the kind that overlaps decides: a 'plain' slowdown leaves quantized collectives alone
    plain = predict("q", w, cfg, _rates(tflops=1.0, contention={"plain": slow["quantized"]}))
    assert plain.iteration_s == pytest.approx(alone.iteration_s)
    # nothing overlaps without the overlap flags: nothing to contend
    w0, cfg0 = _run(["--ddp-bucket-size", "200000000"], quant)
    assert predict("q", w0, cfg0, _rates(contention=slow)).iteration_s == pytest.approx(
        predict("q", w0, cfg0, _rates()).iteration_s)


# -- variants, calibration files, the tool ---------------------------------------------------------
def test_variants_come_from_the_recipe():
    flags = recipe_variant_flags("sdp4bit")
    assert "--hadamard-transform" in flags and "--quantized-weights" in flags
    assert strip_quantization_flags(["--bf16", *flags, "--lr", "1"]) == ["--bf16", "--lr", "1"]


def test_kernel_and_compute_json(tmp_path):
    kj = tmp_path / "k.json"
    rows = [{"kernel": "quantize", "backend": "triton", "numel": n, "seconds": 1e-5 + 4.5 * n / 1e12,
             "moved_bytes": 4.5 * n, "copy_gbps": 3000.0} for n in (1 << 20, 1 << 28)]
    kj.write_text(json.dumps({"device": "GPU X", "rows": rows}))
    r = calibration.load_kernels_json(str(kj), calibration.default_rates())
    assert r.kernel("quantize").bandwidth == pytest.approx(1e12)
    assert r.kernel("quantize").fixed_s == pytest.approx(1e-5)
    cj = tmp_path / "c.json"
    cj.write_text(json.dumps({"device": "GPU X", "rows": [
        {"run": "baseline", "shape": "1.3b", "parameters": 1_315_819_520, "tflops_per_gpu": 400.0}]}))
    assert calibration.load_compute_json(str(cj), r).tflops_for(1e9).tflops == 400.0
    with pytest.raises(ValueError, match="gpu_throughput"):
        calibration.load_compute_json(str(kj), r)
    a100 = calibration.for_gpu(calibration.default_rates(), "A100")
    assert a100.tflops_for(1.3e9).tflops == pytest.approx(469.8 * 312 / 989)


def test_probe_sizes_add_the_runs_largest_call():
    assert probe_sizes(1 << 20) == PROBE_SIZES
    assert probe_sizes(67_235_840) == PROBE_SIZES + (67_235_840,)   # a whole 16.8M fp32 bucket
    assert probe_sizes(1 << 40) == PROBE_SIZES + (MAX_PROBE_BYTES,)


def test_measurement_round_trip_and_damage(tmp_path):
    c = replace(_cluster(), measured={"all_gather": MeasuredCollective(8, 4, ((1e6, 1e-3), (1e8, 0.1)))})
    r = _rates()
    path = tmp_path / "m.json"
    write_measurement(str(path), c, r)
    c2, r2 = read_measurement(str(path))
    assert c2 == c and r2.kernels == r.kernels and r2.compute == r.compute
    r = _rates(contention={"quantized": Contention(1.25, 1.5)})
    write_measurement(str(path), c, r)
    assert read_measurement(str(path))[1].contention == r.contention
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a planner measurement"):
        read_measurement(str(path))
    # a file from before contention was measured: measure again, not a silently faster plan
    path.write_text(json.dumps({"cluster": {"nodes": 1, "gpus_per_node": 1, "intra": {}, "inter": {}},
                                "rates": {"kernels_share_compute": True}}))
    with pytest.raises(ValueError, match="measure again"):
        read_measurement(str(path))
    with pytest.raises(ValueError, match="finite number >= 1"):
        Contention(compute=float("nan"))


def _tool(*argv, env=None):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "planner.py"), *argv], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=600)


def test_the_tool_plans_a_recipe():
    env = dict(os.environ, MICRO_BATCH_SIZE="2")
    out = _tool("--recipe", "examples/sdp4bit/run_1.3b.sh", "--nodes", "16", "--gpus-per-node", "8",
                "--inter-gbit", "100", env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines()
            if line.startswith("| ") and "variant" not in line}
    assert {"baseline", "SDP4Bit", "TLq-HS", "qWD", "SDP4Bit+LoCo"} <= set(rows)
    ms = {k: float(v.split("|")[2]) for k, v in rows.items()}
    assert ms["SDP4Bit"] < ms["baseline"]
    assert "recommended:" in out.stdout


def test_measure_on_four_gloo_ranks(tmp_path):
    """--measure with the flags of an SDP4Bit run with both overlaps (the run a user plans): the
    compute probe must not gather parameters in its forward pass (megatron-core's pre-hooks
    would, and quantized weights need the trainer's optimizer hook for that)."""
    out_json = tmp_path / "measure.json"
    run = ["--device", "cpu", "--distributed-backend", "gloo", "--mock-data",
           "--use-distributed-optimizer", "--num-layers", "2", "--hidden-size", "64",
           "--num-attention-heads", "4", "--seq-length", "8", "--max-position-embeddings", "8",
           "--vocab-size", "256", "--micro-batch-size", "1", "--global-batch-size", "4",
           "--train-iters", "1", "--lr", "1e-4", "--eval-iters", "0",
           "--bf16", "--quantized-weights", "--quantized-gradients", "--hadamard-transform",
           "--overlap-grad-reduce", "--overlap-param-gather"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "tools" / "planner.py"), "--measure", "--out", str(out_json),
           "--variants", "baseline,SDP4Bit", "--", *run]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    cluster, rates = read_measurement(str(out_json))
    assert (cluster.nodes, cluster.gpus_per_node) == (1, 4)
    assert 0 < cluster.intra.bandwidth < 1e12 and cluster.intra.latency >= 0
    assert rates.compute[0].tflops > 0
    # the compute beside each kind of collective, and the collective beside the compute
    assert set(rates.contention) == {"quantized", "plain"}
    assert all(c.compute >= 1.0 and c.communication >= 1.0 for c in rates.contention.values())
    assert rates.optimizer_seconds_per_element > 0
    assert set(rates.kernels) == set(calibration.KERNELS)
    # the run's own collectives at two sizes on its groups (one node: no inter-node all-to-all)
    assert set(cluster.measured) == {"all_to_all_intra", "reduce_scatter", "all_gather"}
    for curve in cluster.measured.values():
        assert (curve.ranks, curve.ranks_per_node) == (4, 4)
        assert [b for b, _ in curve.points] == [1 << 16, 1 << 20, 1 << 24]
        assert all(t > 0 for _, t in curve.points)
    assert "| SDP4Bit |" in res.stdout and "| baseline |" in res.stdout
    # 4 ranks on this machine: over-subscribed where it has fewer cores, said with the rates
    cores = len(os.sched_getaffinity(0))
    assert ("over-subscribed" in rates.source) == (cores < 4), rates.source


def _slowest_rank_worker(rank: int, store: str, out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    from megatron.planner.measure import slowest_rank_median

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    slow = {0: (0, 1), 1: (2,)}[rank]   # the repeats this rank is the slow one in
    repeat = iter(range(5))
    own: list = []

    def work() -> None:
        k = next(repeat)
        t = time.perf_counter()
        time.sleep(0.05 if k in slow else 0.001)
        own.append(time.perf_counter() - t)

    got = slowest_rank_median(work, 5, lambda: None, torch.device("cpu"))
    Path(f"{out}.{rank}").write_text(json.dumps({"slowest": got, "own": own}))
    dist.destroy_process_group()


def test_slowest_rank_median_takes_each_repeats_slowest_rank(tmp_path):
    """A synchronous step waits for its last rank every time: with rank 0 slow in two repeats
    and rank 1 in a third, each rank's own median is fast while three of five steps were slow;
    every rank gets the same answer."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "res")
    mp.spawn(_slowest_rank_worker, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    res = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    assert res[0]["slowest"] == res[1]["slowest"] >= 0.05
    assert max(sorted(r["own"])[2] for r in res) < 0.05   # the larger of the ranks' medians


def test_bench_quant_json_feeds_the_planner(tmp_path):
    out = tmp_path / "quant.json"
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_quant.py"), "--sizes",
                          "64K,256K", "--device", "cpu", "--bits", "4", "--iters", "1", "--json",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rates = calibration.load_kernels_json(str(out), calibration.default_rates())
    assert rates.device.startswith("CPU")
    for name in calibration.KERNELS:
        assert rates.kernel(name).bandwidth > 0 and rates.kernel(name).fixed_s >= 0


def test_a_one_node_measurement_needs_the_inter_node_link_stated(tmp_path):
    path = tmp_path / "one_node.json"
    intra = MeasuredCollective(4, 4, ((1e6, 1e-3), (1e8, 0.1)))
    write_measurement(str(path), Cluster(1, 4, Link(1e9, 1e-4), Link(float("inf"), 0.0),
                                         measured={"all_to_all_intra": intra}), _rates())
    run = ["--", *GPT_1_3B[:12], "--global-batch-size", "64", *GPT_1_3B[14:]]
    out = _tool("--measured", str(path), "--nodes", "4", *run)
    assert out.returncode != 0 and "--inter-gbit" in out.stderr
    out = _tool("--measured", str(path), "--nodes", "4", "--inter-gbit", "100", *run)
    assert out.returncode == 0 and "| SDP4Bit |" in out.stdout, out.stderr[-2000:]
    # timed on one node: not for four
    assert "timed collectives are not used for another layout" in out.stderr


def test_bad_plans_are_one_line_errors():
    out = _tool("--recipe", "examples/sdp4bit/run_1.3b.sh", "--nodes", "16", "--gpus-per-node", "8")
    assert out.returncode == 2 and "MICRO_BATCH_SIZE" in out.stderr and "Traceback" not in out.stderr
    out = _tool("--variants", "SDP8Bit", "--", *GPT_1_3B)
    assert out.returncode == 2 and "--variants: unknown ['SDP8Bit']" in out.stderr


def test_side_by_side_sees_two_threads_share_a_core(tmp_path):
    """Two pure-Python loops hold the GIL in turn: beside each other each runs at about half
    speed, which the contention probe must report (one rank; a job that leaves the GIL alone is
    what a real collective is, here the worst case it must not miss)."""
    import time

    import torch
    import torch.distributed as dist

    from megatron.planner.compute_probe import side_by_side

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds   # CPU time of this thread: holds the GIL throughout
        while time.thread_time() < end:
            pass

    calls = []

    def job() -> None:
        calls.append(1)
        spin(0.004)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        step_alone = median_seconds(lambda: spin(0.012), 3, lambda: None)
        slow = side_by_side(lambda: spin(0.012), job, lambda: None, step_alone,
                            torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert slow.compute > 1.3 and slow.communication > 1.3, slow   # about 2 each
    assert len(calls) >= 1 + 3 + 3   # warm-up, the three timed alone, at least three beside


def test_the_planner_reproduces_the_recorded_emulated_check():
    """bench/results/planner_check (``check_planner.py --record``): from each link's stored
    ``--measure`` output the planner predicts every recorded run again, as it did when the check
    ran (a change to the model fails here: run the check again and record it), and each
    prediction is within 15 % of the median of the runs it was checked against."""
    record_dir = ROOT / "bench" / "results" / "planner_check"
    record = json.loads((record_dir / "runs.json").read_text())
    assert {c["variant"] for c in record["cells"]} == {"baseline-ring", "sdp4bit", "sdp4bit-overlap"}
    assert len({c["link"] for c in record["cells"]}) == 3
    for cell in record["cells"]:
        cluster, rates = read_measurement(str(record_dir / cell["measurement"]))
        assert rates.contention and cluster.measured   # what --measure adds to the links
        args = parse_run_args(cell["trainer_argv"])
        ms = 1e3 * predict(cell["variant"], Workload.from_args(args, cluster),
                           QuantizationConfig.from_args(args), rates).iteration_s
        where = f"{cell['link']} {cell['variant']}"
        assert ms == pytest.approx(cell["predicted_ms"], rel=1e-9), where
        assert abs(ms / cell["median_ms"] - 1) <= 0.15, (where, ms, cell["runs_ms"])


def test_contention_is_at_worst_serial():
    """A probe that reads both lanes slower together than one after the other (4 CPU ranks on 2
    cores read 161x / 13x) is used at the serial bound, in its own proportion."""
    fine = Contention(compute=2.0, communication=1.5)
    assert not fine.worse_than_serial and fine.bounded() == fine
    bad = Contention(compute=161.0, communication=13.0)
    b = bad.bounded()
    assert bad.worse_than_serial and 1 / b.compute + 1 / b.communication == pytest.approx(1.0)
    assert b.compute / b.communication == pytest.approx(161.0 / 13.0)
    assert _rates(contention={"quantized": bad}).contention_for("quantized") == b
    # serial: two equal lanes at the bound take as long as one after the other
    half = Contention(compute=2.0, communication=2.0)
    assert two_lanes([1.0], [1.0], [-1], [-1], half) == pytest.approx((2.0, 2.0))


# -- Mixture-of-Experts (issue 48) -----------------------------------------------------------------
MOE_FLAGS = ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "8",
             "--moe-token-dispatcher-type", "alltoall"]
MIXTRAL_TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
                "--mock-data", "--vocab-size", "128", "--lr", "1e-4", "--train-iters", "1"]


def _mcore_moe_counts(args, block_spec=False):
    """(all, routed-expert) parameters of megatron-core's GPTModel built from ``args`` on a gloo
    world of one (the sequential expert MLPs of the local spec; ``block_spec``: the decoder block
    spec, which honours --moe-layer-freq)."""
    import torch.nn.functional as F

    from dist_harness import model_parallel_world_of_one

    with model_parallel_world_of_one(seed=0):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                              get_gpt_layer_local_spec)
        from megatron.core.transformer import TransformerConfig

        cfg = TransformerConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups if args.group_query_attention else None,
            ffn_hidden_size=args.ffn_hidden_size, gated_linear_unit=args.swiglu,
            activation_func=F.silu if args.swiglu else F.gelu,
            add_bias_linear=args.add_bias_linear, normalization=args.normalization,
            use_cpu_initialization=True, num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_layer_freq=args.moe_layer_freq, moe_grouped_gemm=False)
        spec = (get_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                           normalization=args.normalization) if block_spec
                else get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False,
                                              normalization=args.normalization))
        model = GPTModel(cfg, spec, vocab_size=args.padded_vocab_size,
                         max_sequence_length=args.max_position_embeddings,
                         position_embedding_type=args.position_embedding_type,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
        named = list(model.named_parameters())
    return (sum(p.numel() for _, p in named),
            sum(p.numel() for n, p in named if ".experts." in n))


MOE_MODELS = {
    # Mixtral's shape: SwiGLU experts, RMSNorm, RoPE, GQA, untied, no biases
    "mixtral": ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                "--group-query-attention", "--num-query-groups", "2",
                "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                "--ffn-hidden-size", "96", "--num-experts", "4", "--moe-ffn-hidden-size", "40"],
    # GPT's: plain MLP experts with biases (the router then has one too), LayerNorm, tied
    "gpt-biases": ["--num-experts", "4", "--moe-router-topk", "1", "--moe-router-pre-softmax"],
    # a shared expert beside the routed ones (bias-free, as megatron-core requires)
    "shared": ["--swiglu", "--disable-bias-linear", "--num-experts", "4",
               "--moe-shared-expert-intermediate-size", "24"],
}


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_moe_parameter_count_is_megatron_cores(name):
    args = parse_run_args(MIXTRAL_TINY + MOE_MODELS[name])
    args.padded_vocab_size = 128
    set_default_ffn_hidden_size(args)
    args.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size   # the trainer's rule
    total, expert = _mcore_moe_counts(args)
    c = parameter_counts(args)
    assert (c.total, c.expert) == (total, expert) and count_parameters(args) == total
    assert c.active == c.dense + c.expert * args.moe_router_topk // args.num_experts


def test_moe_layer_freq_is_megatron_cores():
    """--moe-layer-freq as a list (Megatron-LM's string) and as an int: the dense layers keep
    the --ffn-hidden-size MLP, as megatron-core's decoder block spec builds them."""
    for freq in ("([0]*1+[1]*2)", "2"):
        args = parse_run_args(MIXTRAL_TINY[:1] + ["3"] + MIXTRAL_TINY[2:] + [
            "--swiglu", "--disable-bias-linear", "--num-experts", "4", "--moe-layer-freq", freq])
        args.padded_vocab_size = 128
        set_default_ffn_hidden_size(args)
        args.moe_ffn_hidden_size = args.ffn_hidden_size
        assert moe_layer_pattern(args) == ([False, True, True] if "[" in freq else [True, False, True])
        assert (count_parameters(args), parameter_counts(args).expert) == _mcore_moe_counts(
            args, block_spec=True), freq
    dense = parse_run_args(MIXTRAL_TINY)
    assert moe_layer_pattern(dense) == [False, False]


def test_moe_flops_follow_the_active_parameters():
    from megatron.training.model.flops import training_flops_per_iteration

    dense = parse_run_args(GPT_1_3B + ["--swiglu", "--group-query-attention", "--num-query-groups", "4"])
    set_padded_vocab_size(dense)
    set_default_ffn_hidden_size(dense)
    assert (training_flops_per_iteration(dense)
            == training_flops_per_iteration(dense_like(dense)))
    args = parse_run_args(GPT_1_3B + ["--swiglu", "--num-experts", "8", "--moe-router-topk", "2",
                                      "--moe-ffn-hidden-size", "1024",
                                      "--moe-shared-expert-intermediate-size", "512"])
    set_padded_vocab_size(args)
    set_default_ffn_hidden_size(args)
    h, f, tokens = 2048, args.ffn_hidden_size, 16 * 2048
    # each of the 24 layers: its MLP (3 h f) replaced by the router and what a token meets
    extra = 24 * (h * 8 + 2 * 3 * h * 1024 + 3 * h * 512 - 3 * h * f)
    assert training_flops_per_iteration(args) == pytest.approx(
        training_flops_per_iteration(dense_like(args)) + 6 * extra * tokens)
    # 8 experts top-8 of width f/8 (+ router): the dense model's MLP FLOPs
    even = parse_run_args(GPT_1_3B + ["--swiglu", "--num-experts", "8", "--moe-router-topk", "8",
                                      "--moe-ffn-hidden-size", str(args.ffn_hidden_size // 8)])
    set_padded_vocab_size(even)
    set_default_ffn_hidden_size(even)
    assert args.ffn_hidden_size % 8 == 0
    assert training_flops_per_iteration(even) == pytest.approx(
        training_flops_per_iteration(dense_like(even)) + 6 * 24 * h * 8 * tokens)


def dense_like(args):
    """``args`` without the MoE flags."""
    import argparse

    out = argparse.Namespace(**vars(args))
    out.num_experts = None
    return out


def _moe_work(nodes, gpn, ep, extra=(), experts=8):
    args = parse_run_args(GPT_1_3B[:12] + ["--global-batch-size", str(nodes * gpn)] + GPT_1_3B[14:]
                          + ["--swiglu", "--num-experts", str(experts), "--expert-model-parallel-size",
                             str(ep), "--moe-ffn-hidden-size", "1024"] + list(extra))
    return Workload.from_args(args, _cluster(nodes=nodes, gpn=gpn)), args


def test_moe_layout_dense_and_expert_groups():
    # EP 8 in a node of 8: one expert-DP rank per node, the group spans every node
    w, args = _moe_work(16, 8, 8)
    c = parameter_counts(args)
    assert (w.dp, w.dp_per_node, w.dp_nodes) == (128, 8, 16)
    assert (w.ep, w.expert_dp, w.expert_dp_per_node, w.expert_dp_nodes) == (8, 16, 1, 16)
    assert w.rank_expert_parameters == c.expert // 8 and w.rank_dense_parameters == c.dense
    assert sum(w.expert_buckets) == w.rank_expert_parameters and sum(w.buckets) == c.dense
    assert w.parameters == c.total and w.compute_parameters == c.active
    # EP 4 on 2 nodes of 8: expert-DP 4, two of them per node
    w4, _ = _moe_work(2, 8, 4)
    assert (w4.expert_dp, w4.expert_dp_per_node, w4.expert_dp_nodes) == (4, 2, 2)
    # EP 16 across two nodes of 8 (D divides EP): one per node
    w16, _ = _moe_work(4, 8, 16, experts=16)
    assert (w16.expert_dp, w16.expert_dp_per_node, w16.expert_dp_nodes) == (2, 1, 2)
    # EP 1: the experts are dense parameters, no expert buffers
    w1, _ = _moe_work(2, 8, 1)
    assert w1.expert_buckets == () and w1.rank_parameters == c.total == sum(w1.buckets)
    for ep, match in ((3, "does not divide the data-parallel"), (16, "does not divide --num-experts")):
        with pytest.raises(ValueError, match=match):
            _moe_work(2, 8, ep)
    with pytest.raises(ValueError, match="different number of ranks on each node"):
        _moe_work(2, 6, 4)   # 6 DP ranks per node, EP 4: 2 or 1 of a group on a node


def test_moe_bytes_per_group_are_the_collectives_accounting():
    """Dense buffers over the data-parallel group, expert buffers over the expert-data-parallel
    group, each recorded as its collectives record it; with EP 8 of a node the expert group has
    one rank per node, so its bytes all cross nodes."""
    from megatron.planner.timeline import _record_bytes, padded_buckets

    for quant in ((), ("--quantized-gradients", "--quantized-weights", "--hadamard-transform")):
        w, args = _moe_work(4, 8, 8, quant)
        cfg = QuantizationConfig.from_args(args)
        p = predict("x", w, cfg, _rates())
        eb = padded_buckets(w, cfg, expert=True)
        assert len(eb) == len(w.expert_buckets) and all(x >= y for x, y in zip(eb, w.expert_buckets))
        ex = _record_bytes(w, cfg, eb, w.expert_group)
        de = _record_bytes(w, cfg, padded_buckets(w, cfg))
        assert p.bytes_per_link == {"intra": de["intra"], "inter": de["inter"],
                                    "expert_intra": ex["intra"], "expert_inter": ex["inter"]}
        assert p.bytes_per_link["expert_intra"] == 0 and p.bytes_per_link["expert_inter"] > 0
        # the same buckets over a group of 4 nodes, one rank each, recorded by hand
        acc = CommAccounting()
        in_bytes = w.grad_bytes(cfg.grad_accum_dtype)
        for i, n in enumerate(eb):
            if cfg.quantized_gradients:
                acc.record_two_level_reduce_scatter(f"g{i}", numel=n - n % 4, elem_size=in_bytes,
                                                    dp_size=4, intra_size=1,
                                                    intra=cfg.gradient_intra_hop,
                                                    inter=cfg.gradient_inter_hop)
            else:
                acc.record_baseline(f"g{i}", kind="grad", numel=n - n % 4, elem_size=in_bytes,
                                    dp_size=4, peers_intra=0, peers_inter=3)
        grad = acc.totals()["grad"]["inter"]
        assert grad["bytes" if quant else "baseline_bytes"] <= ex["inter"]
    # a dense model and EP 1 have no expert bytes, and the table no expert columns
    w1, args1 = _moe_work(2, 8, 1)
    p1 = predict("baseline", w1, QuantizationConfig.from_args(args1), _rates())
    assert p1.bytes_per_link["expert_inter"] == p1.bytes_per_link["expert_intra"] == 0
    from megatron.planner.report import format_table

    assert "expert inter" not in format_table([p1]) and "expert inter" in format_table([p])


def test_moe_memory_divides_experts_by_ep_and_their_states_by_expert_dp():
    w, args = _moe_work(4, 8, 8)
    w1, _ = _moe_work(4, 8, 1)
    cfg = QuantizationConfig()
    c = parameter_counts(args)
    m8, m1 = predict("b", w, cfg, _rates()).memory_bytes, predict("b", w1, cfg, _rates()).memory_bytes
    # EP 8 holds 1/8 of the experts (6 bytes each: bf16 weight, fp32 gradient) but shards their
    # 12 bytes of optimizer state over 4 expert-DP ranks instead of 32 DP ranks
    expect = (6 * (c.expert / 8 - c.expert) + 12 * (c.expert / 8 / 4 - c.expert / 32))
    assert m8 - m1 == pytest.approx(expect, rel=1e-6)


def test_moe_overlap_queues_both_buffers_in_backward_order():
    """With a long backward only what fills last is exposed: the last bucket of each buffer, both
    full when the backward ends (the first layers'), one after the other."""
    from megatron.planner.timeline import padded_buckets

    w, args = _moe_work(4, 8, 8, ["--overlap-grad-reduce", "--ddp-bucket-size", "20000000"])
    cfg = QuantizationConfig.from_args(args)
    assert len(w.buckets) > 2 and len(w.expert_buckets) > 2
    slow = predict("b", w, cfg, _rates(tflops=0.01))
    last = (grad_bucket_cost(padded_buckets(w, cfg)[-1], w, cfg, _rates()).seconds
            + grad_bucket_cost(padded_buckets(w, cfg, expert=True)[-1], w, cfg, _rates(),
                               w.expert_group).seconds)
    assert slow.grad_exposed_s == pytest.approx(last)
    fast = predict("b", w, cfg, _rates(tflops=1e6))   # a backward of the EP all-to-alls only
    backward = 2 * fast.compute_s / 3
    assert fast.grad_total_s - backward - 1e-12 <= fast.grad_exposed_s < fast.grad_total_s
    assert fast.grad_total_s == pytest.approx(
        sum(grad_bucket_cost(n, w, cfg, _rates()).seconds for n in w.buckets)
        + sum(grad_bucket_cost(n, w, cfg, _rates(), w.expert_group).seconds for n in w.expert_buckets))


def test_the_tool_plans_the_moe_recipe():
    out = _tool("--recipe", "examples/moe/run_8x0.8b.sh", "--nodes", "16", "--gpus-per-node", "8",
                "--inter-gbit", "100", "--paro")
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("EP 8: expert buffers over expert-DP 16 (D=1 per node x M=16 nodes)" in out.stdout
            and "2.09B active" in out.stdout), out.stdout
    head = next(line for line in out.stdout.splitlines() if line.startswith("| variant"))
    assert "| expert inter MB/GPU | expert intra MB/GPU |" in head
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.stdout.splitlines()
            if line.startswith("| ") and "variant" not in line}
    assert {"baseline", "SDP4Bit", "TLq-HS", "qWD", "SDP4Bit+LoCo"} <= set(rows)
    ms = {k: float(v[2]) for k, v in rows.items() if "n/a" not in v[2]}
    assert ms["SDP4Bit"] < ms["TLq-HS"] < ms["baseline"]
    expert_inter = {k: float(rows[k][12]) for k in ("baseline", "SDP4Bit")}
    assert expert_inter["SDP4Bit"] < expert_inter["baseline"] / 4
    assert "engine does not shard expert parameters" in rows["PaRO GGG"][2]
    assert "recommended: SDP4Bit" in out.stdout
