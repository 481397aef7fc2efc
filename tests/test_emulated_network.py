"""Cheap checks of the emulated two-node benchmark (bench/emulated_network): command construction,
result parsing and the namespace setup. No benchmark is run here."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BENCH = os.path.join(ROOT, "bench", "emulated_network")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_emu_{name}", os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def emu():
    return _load("bench_emulated")


def _topo(emu):
    return emu.Topology(namespaces=["a_n0", "a_n1"], ifnames=["emu0", "emu1"],
                        master_addr="10.77.0.1", master_port=29555, nproc_per_node=2)


def test_node_commands_one_torchrun_per_namespace(emu):
    cmds = emu.node_commands(_topo(emu), ["script.py", "--x", "1"])
    assert len(cmds) == 2
    for k, (cmd, ns, ifname) in enumerate(zip(cmds, ["a_n0", "a_n1"], ["emu0", "emu1"])):
        assert cmd[:4] == ["ip", "netns", "exec", ns]
        assert f"GLOO_SOCKET_IFNAME={ifname}" in cmd
        assert "OMP_NUM_THREADS=1" in cmd
        i = cmd.index("torchrun")
        tr = cmd[i:]
        assert tr[tr.index("--nnodes") + 1] == "2"
        assert tr[tr.index("--node-rank") + 1] == str(k)
        assert tr[tr.index("--nproc-per-node") + 1] == "2"
        assert tr[tr.index("--master-addr") + 1] == "10.77.0.1"
        assert tr[-3:] == ["script.py", "--x", "1"]


def test_loopback_command(emu):
    topo = emu.Topology(namespaces=[], ifnames=[], use_netns=False, nproc_per_node=2)
    (cmd,) = emu.node_commands(topo, ["s.py"])
    assert "ip" not in cmd[:1] and "torchrun" in cmd
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert not any(c.startswith("GLOO_SOCKET_IFNAME") for c in cmd)


def test_train_args_variants(emu):
    m = emu.MODEL_PRESETS["small"]
    base = emu.train_args(m, "baseline", 8, "/tmp/x.jsonl", micro_batch_size=1, dp_size=4)
    for flag in ("--device", "--distributed-backend", "--mock-data", "--use-distributed-optimizer",
                 "--bf16", "--jsonl-log", "--eval-iters", "--vocab-size"):
        assert flag in base
    assert base[base.index("--distributed-backend") + 1] == "gloo"
    assert base[base.index("--global-batch-size") + 1] == "4"
    assert base[base.index("--log-interval") + 1] == "1"
    assert "--quantized-gradients" not in base
    q = emu.train_args(m, "sdp4bit", 8, "/tmp/x.jsonl", dp_size=4)
    assert q[:len(base)] == base  # same model and schedule, only quantization flags appended
    extra = q[len(base):]
    for flag, val in (("--gq-group-size-intra", "128"), ("--gq-group-size-inter", "128"),
                      ("--gradient-quantization-bits-intra", "8"),
                      ("--gradient-quantization-bits-inter", "4"), ("--wq-group-size", "2048"),
                      ("--weight-quantization-bits", "4")):
        assert extra[extra.index(flag) + 1] == val
    for flag in ("--quantized-weights", "--quantized-gradients", "--hadamard-transform"):
        assert flag in extra
    with pytest.raises(ValueError):
        emu.train_args(m, "nope", 8, "/tmp/x.jsonl")


def test_sdp4bit_flags_are_known_to_the_parser(emu):
    """Every flag the benchmark passes must exist in the quantization argument group."""
    argmod = pytest.importorskip("megatron.distributed.quant.arguments")
    import argparse
    adder = getattr(argmod, "add_quantization_args", None)
    if adder is None:
        pytest.skip("megatron.distributed.quant.arguments has no add_quantization_args")
    p = argparse.ArgumentParser()
    adder(p)
    ns = p.parse_args(emu.SDP4BIT_FLAGS)
    assert ns.quantized_weights and ns.quantized_gradients and ns.hadamard_transform
    assert (ns.gq_group_size_intra, ns.gq_group_size_inter, ns.wq_group_size) == (128, 128, 2048)


def test_model_presets_sizes(emu):
    sizes = {k: emu.approx_gpt_params(**v) for k, v in emu.MODEL_PRESETS.items()}
    assert sizes["tiny"] < sizes["small"] < sizes["medium"]
    assert 15e6 < sizes["small"] < 20e6
    assert 30e6 < sizes["medium"] < 40e6
    assert emu.approx_gpt_params(untied=True, **emu.MODEL_PRESETS["small"]) > sizes["small"]


def test_jsonl_parsing_and_summary(emu, tmp_path):
    path = tmp_path / "log.jsonl"
    lines = [{"iteration": i, "elapsed_time_per_iteration_ms": 100.0 * i} for i in range(1, 6)]
    lines.insert(2, {"event": "checkpoint"})  # non-iteration records are ignored
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    recs = emu.parse_jsonl(str(path))
    assert [r["iteration"] for r in recs] == [1, 2, 3, 4, 5]
    s = emu.summarize_iterations(recs, warmup=2)
    assert s["n"] == 3 and s["ms_per_iter_median"] == 400.0
    assert emu.iteration_ms({"iteration_time": 0.25}) == 250.0
    assert emu.iteration_ms({"foo": 1}) is None
    assert emu.summarize_iterations([], 2)["ms_per_iter_median"] is None
    assert emu.parse_jsonl(str(tmp_path / "missing.jsonl")) == []


def test_speedup_and_table(emu):
    sp = emu.speedups({"baseline": 300.0, "sdp4bit": 100.0, "broken": None})
    assert sp == {"baseline": 1.0, "sdp4bit": 3.0, "broken": None}
    table = emu.markdown_table([
        {"variant": "baseline", "ms": 300.0, "bytes": 87e6, "speedup": 1.0, "n": 6},
        {"variant": "sdp4bit", "ms": 100.0, "bytes": 7.5e6, "speedup": 3.0, "n": 6},
        {"variant": "broken", "ms": None},
    ])
    rows = table.splitlines()
    assert rows[0].startswith("| variant |") and len(rows) == 5
    assert "| sdp4bit | 100.0 | 7.50 MB | 3.00x | 6 |" in table
    assert "FAILED" in rows[-1]


def test_sampler_bytes_per_iter(emu):
    s = emu.JsonlCounterSampler(_topo(emu), "/nonexistent")
    s.samples = [(1, 0), (2, 100), (3, 1100), (4, 2100), (5, 3100)]
    assert s.bytes_per_iter(warmup=2) == 1000.0
    s.samples = [(1, None)]
    assert s.bytes_per_iter(warmup=0) is None


def test_dry_run_prints_commands(emu, tmp_path, capsys):
    rc = emu.main(["--mode", "train", "--namespaces", "x_n0,x_n1", "--dry-run",
                   "--out", str(tmp_path / "r.md")])
    assert rc == 0
    out = capsys.readouterr().out
    # default: baseline, baseline-bf16, sdp4bit, sdp4bit-overlap, limit -- x 2 nodes
    assert out.count("ip netns exec") == 10
    assert "--quantized-gradients" in out
    order = [out.index(f"[bench] {v}:\n") for v in emu.DEFAULT_TRAIN_VARIANTS.split(",")]
    assert order == sorted(order)
    assert emu.DEFAULT_TRAIN_VARIANTS == "baseline,baseline-bf16,sdp4bit,sdp4bit-overlap,limit"
    # the link limit is lifted for `limit` only
    assert out.count("link limit removed for this run only") == 1
    assert out.index("link limit removed") > out.index("[bench] limit:\n")
    assert not (tmp_path / "r.md").exists()  # a dry run writes no report


def test_collectives_args_defaults_follow_the_paper():
    col = _load("bench_collectives")
    a = col.parse_args([])
    assert (a.bits_intra, a.bits_inter, a.gq_group_size_intra, a.gq_group_size_inter) == (8, 4, 128, 128)
    assert (a.weight_bits, a.wq_group_size, a.hadamard) == (4, 2048, True)


def test_shell_scripts_parse():
    for script in ("setup_netns.sh", "run_bench.sh"):
        subprocess.run(["bash", "-n", os.path.join(BENCH, script)], check=True)


def _netns_usable():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    return subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _netns_usable(), reason="needs root and `ip netns`")
def test_setup_netns_same_namespace_traffic_uses_lo():
    env = dict(os.environ, NS_PREFIX=f"t{uuid.uuid4().hex[:6]}", BANDWIDTH="1gbit", LATENCY="0")
    script = os.path.join(BENCH, "setup_netns.sh")
    try:
        subprocess.run(["bash", script, "up"], env=env, check=True, capture_output=True, timeout=60)
        out = subprocess.run(["bash", script, "check"], env=env, check=True, capture_output=True,
                             text=True, timeout=60).stdout
        lines = out.strip().splitlines()
        assert "local 10.77.0.1 dev lo" in lines[0]
        assert "local 10.77.0.2 dev lo" in lines[1]
        assert "dev emu0" in lines[2]
        st = subprocess.run(["bash", script, "status"], env=env, check=True, capture_output=True,
                            text=True, timeout=60).stdout
        assert "tbf" in st and "rate 1Gbit" in st
    finally:
        subprocess.run(["bash", script, "down"], env=env, capture_output=True, timeout=60)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert env["NS_PREFIX"] not in listed


# --- ring-volume reduce-scatter baselines (bench/emulated_network/ring_volume_rs.py) -------------

def _rs_rank(rank, world):
    """Runs on each of 4 gloo ranks: the replacement reduce-scatters against gloo's own."""
    import torch
    import torch.distributed as dist

    rv = _load("ring_volume_rs")
    orig_rs = dist.reduce_scatter_tensor
    res = {}
    n = 1031  # odd, not a multiple of anything convenient
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(-(2 ** 12), 2 ** 12, (world * n,), generator=g).float()  # sums exact in fp32
    ref = torch.empty(n)
    orig_rs(ref, x.clone())
    res["ref"] = ref
    sub = dist.new_group([1, 2, 3])  # collective: every rank creates it
    for algo, fn in (("a2a", rv.reduce_scatter_a2a), ("ring", rv.reduce_scatter_ring)):
        o = torch.full((n,), float("nan"))
        res[f"{algo}_sync_ret"] = fn(o, x.clone())
        res[f"{algo}_sum"] = o
        buf = x.clone()  # megatron's layout: the output is this rank's shard *of the input*
        fn(buf[rank * n:(rank + 1) * n], buf)
        res[f"{algo}_alias"] = buf[rank * n:(rank + 1) * n].clone()
        o = torch.empty(n)
        fn(o, x.clone(), op=dist.ReduceOp.AVG)
        res[f"{algo}_avg"] = o
        o = torch.empty(n)
        h = fn(o, x.view(world, n).clone(), async_op=True)  # stacked input, async handle
        res[f"{algo}_async_wait"] = h.wait()
        res[f"{algo}_async"] = o
        xf = torch.randn(world * n, generator=g)  # non-integer data: only rounding may differ
        of, rf = torch.empty(n), torch.empty(n)
        fn(of, xf.clone())
        orig_rs(rf, xf.clone())
        res[f"{algo}_float_maxdiff"] = (of - rf).abs().max().item()
        if rank in (1, 2, 3):  # a 3-rank subgroup: group ranks != global ranks
            xs = x[: 3 * n].clone()
            o, r = torch.empty(n), torch.empty(n)
            fn(o, xs.clone(), group=sub)
            orig_rs(r, xs.clone(), group=sub)
            res[f"{algo}_subgroup_equal"] = torch.equal(o, r)
        # megatron-core's call site: dist_reduce_scatter_func inside _coalescing_manager
        import megatron.core.distributed.param_and_grad_buffer as pgb

        rv.install(algo)
        res[f"{algo}_installed"] = (pgb.dist_reduce_scatter_func is fn
                                    and dist.reduce_scatter_tensor is fn)
        for async_ops in (False, True):
            buf = x.clone()
            before = rv.STATS["calls"]
            with pgb._coalescing_manager(dist.group.WORLD, async_ops=async_ops) as cm:
                pgb.dist_reduce_scatter_func(buf[rank * n:(rank + 1) * n], buf,
                                             op=dist.ReduceOp.SUM, group=dist.group.WORLD,
                                             async_op=async_ops)
            if async_ops:
                cm.wait()
            res[f"{algo}_coalesced_{async_ops}"] = buf[rank * n:(rank + 1) * n].clone()
            res[f"{algo}_coalesced_calls_{async_ops}"] = rv.STATS["calls"] - before
        before = rv.STATS["fallbacks"]
        o, r = torch.empty(n), torch.empty(n)
        dist.reduce_scatter_tensor(o, x.clone(), op=dist.ReduceOp.MAX)  # not SUM/AVG: gloo's own
        rv.uninstall()
        orig_rs(r, x.clone(), op=dist.ReduceOp.MAX)
        res[f"{algo}_max_fallback"] = (rv.STATS["fallbacks"] - before, torch.equal(o, r))
        res[f"{algo}_uninstalled"] = (dist.reduce_scatter_tensor is orig_rs
                                      and pgb.dist_reduce_scatter_func is orig_rs)

    # --- bf16 buffers (--grad-reduce-in-bf16) and async_op=True served on the worker thread -----
    import megatron.core.distributed.param_and_grad_buffer as pgb

    shard = slice(rank * n, (rank + 1) * n)
    xb = torch.randint(-16, 16, (world * n,), generator=g).float()  # |sum of 4| < 64: exact in bf16
    refb = torch.empty(n)
    orig_rs(refb, xb.clone())
    res["bf16_ref"] = refb
    xb16 = xb.to(torch.bfloat16)
    for algo, fn in (("a2a", rv.reduce_scatter_a2a), ("ring", rv.reduce_scatter_ring)):
        o = torch.empty(n, dtype=torch.bfloat16)
        fn(o, xb16.clone())
        res[f"{algo}_bf16_sync"] = o
        buf = xb16.clone()
        h = fn(buf[shard], buf, async_op=True)  # megatron's layout, bf16, async
        res[f"{algo}_bf16_handle"] = type(h).__name__
        t = torch.full((4,), float(rank))  # the main thread keeps communicating meanwhile:
        dist.all_reduce(t)                  # a collective and a synchronous reduce-scatter
        res[f"{algo}_main_allreduce"] = t
        o2 = torch.empty(n)
        fn(o2, x.clone())
        res[f"{algo}_main_sync_rs"] = o2
        res[f"{algo}_bf16_async_wait"] = h.wait()
        res[f"{algo}_bf16_async"] = buf[shard].clone()
        # several reduce-scatters in flight (megatron's buckets), waited on in reverse order
        bufs = [x * (k + 1) for k in range(3)]
        hs = [fn(b[shard], b, async_op=True) for b in bufs]
        for h in reversed(hs):
            h.wait()
        res[f"{algo}_inflight"] = [b[shard].clone() for b in bufs]
        # megatron-core's call: bf16 bucket, async_op=True inside _coalescing_manager; megatron
        # keeps `cm` as its handle, so the job must be in cm.works
        rv.install(algo)
        buf = xb16.clone()
        with pgb._coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
            pgb.dist_reduce_scatter_func(buf[shard], buf, op=dist.ReduceOp.SUM,
                                         group=dist.group.WORLD, async_op=True)
        res[f"{algo}_cm_works"] = [type(w).__name__ for w in cm.works]
        cm.wait()
        res[f"{algo}_bf16_coalesced"] = buf[shard].clone()
        # async_mode="sync": served on the calling thread, a completed handle
        rv.install(algo, async_mode="sync")
        buf = xb16.clone()
        h = pgb.dist_reduce_scatter_func(buf[shard], buf, op=dist.ReduceOp.SUM,
                                         group=dist.group.WORLD, async_op=True)
        res[f"{algo}_sync_mode"] = (type(h).__name__, h.wait(), torch.equal(buf[shard].float(), refb))
        rv.uninstall()
        res[f"{algo}_cm_restored"] = (pgb._coalescing_manager is dist._coalescing_manager
                                      and dist._coalescing_manager.__name__ == "_coalescing_manager")
    return res


def test_ring_volume_reduce_scatter_matches_gloo(tmp_path):
    pytest.importorskip("megatron.core")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_harness import run_distributed

    import torch

    world = 4
    results = run_distributed(world, _rs_rank, tmp_path, trace=False)  # it swaps dist functions itself
    # independent reference: the sum over ranks of each rank's chunk
    xs = []
    for r in range(world):
        g = torch.Generator().manual_seed(100 + r)
        xs.append(torch.randint(-(2 ** 12), 2 ** 12, (world * 1031,), generator=g).float())
    total = torch.stack(xs).sum(0)
    for rank, res in enumerate(results):
        expect = total[rank * 1031:(rank + 1) * 1031]
        assert torch.equal(res["ref"], expect)  # gloo's own result is the exact sum
        for algo in ("a2a", "ring"):
            assert res[f"{algo}_sync_ret"] is None
            for key in ("sum", "alias", "async", "coalesced_False", "coalesced_True"):
                assert torch.equal(res[f"{algo}_{key}"], expect), (rank, algo, key)
            assert torch.equal(res[f"{algo}_avg"], expect / world)  # /4 is exact
            assert res[f"{algo}_async_wait"] is True
            assert res[f"{algo}_float_maxdiff"] < 1e-5  # N(0,1) data, 4 terms: rounding only
            if rank in (1, 2, 3):
                assert res[f"{algo}_subgroup_equal"]
            assert res[f"{algo}_installed"] and res[f"{algo}_uninstalled"]
            assert res[f"{algo}_coalesced_calls_False"] == 1
            assert res[f"{algo}_coalesced_calls_True"] == 1
            assert res[f"{algo}_max_fallback"] == (1, True)
            # bf16 grad buffers and async_op=True on the worker thread
            expect_b = res["bf16_ref"].to(torch.bfloat16)
            for key in ("bf16_sync", "bf16_async", "bf16_coalesced"):
                got = res[f"{algo}_{key}"]
                assert got.dtype == torch.bfloat16 and torch.equal(got, expect_b), (rank, algo, key)
            assert res[f"{algo}_bf16_handle"] == "_ThreadWork"
            assert res[f"{algo}_bf16_async_wait"] is True
            assert torch.equal(res[f"{algo}_main_allreduce"], torch.full((4,), 6.0))
            assert torch.equal(res[f"{algo}_main_sync_rs"], expect)
            for k, got in enumerate(res[f"{algo}_inflight"]):
                assert torch.equal(got, expect * (k + 1)), (rank, algo, k)
            assert res[f"{algo}_cm_works"] == ["_ThreadWork"]
            assert res[f"{algo}_sync_mode"] == ("_DoneWork", True, True)
            assert res[f"{algo}_cm_restored"]


def test_launcher_strips_rs_algo():
    la = _load("pretrain_a2a_rs")
    assert la.split_argv(["--rs-algo", "ring", "--bf16"]) == ("ring", ["--bf16"])
    assert la.split_argv(["--lr", "1", "--rs-algo=a2a"]) == ("a2a", ["--lr", "1"])
    assert la.split_argv(["--lr", "1"]) == ("a2a", ["--lr", "1"])
    with pytest.raises(SystemExit):
        la.split_argv(["--rs-algo", "tree"])


def test_ring_volume_variants_in_driver(emu, tmp_path):
    m = emu.MODEL_PRESETS["small"]
    base = emu.train_args(m, "baseline", 8, "/tmp/x.jsonl", dp_size=4)
    for v, algo in (("baseline-a2a", "a2a"), ("baseline-ring", "ring")):
        a = emu.train_args(m, v, 8, "/tmp/x.jsonl", dp_size=4)
        assert a[0].endswith("pretrain_a2a_rs.py") and a[1:3] == ["--rs-algo", algo]
        assert a[3:] == base[1:]  # same pretrain_gpt.py flags as the baseline
    table = emu.markdown_table([
        {"variant": "baseline", "ms": 300.0, "bytes": 1e6, "speedup": 1.0,
         "speedup_vs": {"baseline-a2a": 0.5}, "n": 2},
        {"variant": "baseline-a2a", "ms": 150.0, "bytes": 1e6, "speedup": 2.0,
         "speedup_vs": {"baseline-a2a": 1.0}, "n": 2},
        {"variant": "sdp4bit", "ms": 100.0, "bytes": 1e6, "speedup": 3.0,
         "speedup_vs": {"baseline-a2a": 1.5}, "n": 2},
    ], refs=["baseline-a2a"])
    assert "speedup vs baseline-a2a |" in table.splitlines()[0]
    assert "| sdp4bit | 100.0 | 1.00 MB | 3.00x | 1.50x | 2 |" in table
    rc = emu.main(["--mode", "train", "--namespaces", "x_n0,x_n1", "--dry-run",
                   "--variants", "baseline,baseline-a2a,sdp4bit", "--out", str(tmp_path / "r.md")])
    assert rc == 0


def _final_losses(path):
    out = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type", "train") == "train" and "lm_loss" in rec:
                out.append((rec["iteration"], rec["lm_loss"], rec["grad_norm"]))
    return out


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun")
def test_ring_volume_baselines_train_like_the_baseline(tmp_path):
    """4-rank loopback training: the two benchmark baselines give the baseline's losses."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "r.md"
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCH, "bench_emulated.py"), "--mode", "train", "--no-netns",
         "--model", "tiny", "--iters", "3", "--warmup", "1", "--timeout", "300",
         "--variants", "baseline,baseline-a2a,baseline-ring", "--out", str(out),
         "--master-port", str(__import__("dist_harness").free_port())],
        capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    work = [ln.split("raw logs: ", 1)[1].strip() for ln in out.read_text().splitlines()
            if "raw logs: " in ln][0]
    losses = {v: _final_losses(os.path.join(work, f"{v}.jsonl"))
              for v in ("baseline", "baseline-a2a", "baseline-ring")}
    assert [it for it, _, _ in losses["baseline"]] == [1, 2, 3]
    for v in ("baseline-a2a", "baseline-ring"):
        assert [it for it, _, _ in losses[v]] == [1, 2, 3]
        for (_, l0, g0), (_, l1, g1) in zip(losses["baseline"], losses[v]):
            # exact fp32 sums in another order: equal up to the last bits (rel. 1e-5)
            assert l1 == pytest.approx(l0, rel=1e-5, abs=0), (v, l0, l1)
            assert g1 == pytest.approx(g0, rel=1e-5, abs=0), (v, g0, g1)
        # the replacement really ran: one call per iteration (tiny model = one bucket) on each rank
        node_log = open(os.path.join(work, f"{v}.node0.log")).read()
        calls = [int(tok.split("=")[1]) for ln in node_log.splitlines() if "[ring_volume_rs]" in ln
                 for tok in ln.split() if tok.startswith("calls=")]
        assert len(calls) == 4 and all(c == 3 for c in calls), calls


def test_parse_retrans_segs(emu):
    snmp = ("Ip: Forwarding DefaultTTL\nIp: 1 64\n"
            "Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails "
            "EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors\n"
            "Tcp: 1 200 120000 -1 5 6 0 0 3 1000 900 17 0 2 0\n")
    assert emu.parse_retrans_segs(snmp) == 17
    assert emu.parse_retrans_segs("Ip: 1 2\n") is None
    with open("/proc/net/snmp") as f:  # the real file of this (test) namespace parses
        assert emu.parse_retrans_segs(f.read()) is not None


# --- issue 11 item 4: baseline-bf16, sdp4bit-overlap, limit, repeats, report -----------------------

def _split(a, n_script):
    """(script part, pretrain_gpt.py flags) of a train_args() list."""
    return a[:n_script], a[n_script:]


def test_baseline_bf16_args(emu):
    m = emu.MODEL_PRESETS["small"]
    base = emu.train_args(m, "baseline", 8, "/tmp/x.jsonl", dp_size=4)
    a = emu.train_args(m, "baseline-bf16", 8, "/tmp/x.jsonl", dp_size=4)
    script, flags = _split(a, 5)
    assert script[0].endswith("pretrain_a2a_rs.py")
    assert script[1:] == ["--rs-algo", "ring", "--rs-async", "thread"]  # default: the ring
    assert flags[:len(base) - 1] == base[1:]  # same model and schedule as the baseline
    assert flags[len(base) - 1:] == ["--grad-reduce-in-bf16", "--overlap-grad-reduce",
                                     "--overlap-param-gather",
                                     "--overlap-param-gather-with-optimizer-step",
                                     "--ddp-bucket-size", "4000000"]
    assert emu.DEFAULT_BUCKET_SIZE == 4_000_000 and emu.DEFAULT_BF16_RS_ALGO == "ring"
    b = emu.train_args(m, "baseline-bf16", 8, "/tmp/x.jsonl", dp_size=4, bucket_size=123,
                       bf16_rs_algo="a2a", pipeline=7)
    assert b[1:3] == ["--rs-algo", "a2a"]
    assert b[b.index("--ddp-bucket-size") + 1] == "123"
    assert "--gradient-alltoall-pipeline" not in b and "--quantized-gradients" not in b
    with pytest.raises(ValueError):
        emu.train_args(m, "baseline-bf16", 8, "/tmp/x.jsonl", bf16_rs_algo="tree")
    # the launcher strips its own flags and hands the rest to pretrain_gpt.py unchanged
    la = _load("pretrain_a2a_rs")
    vals, rest = la.parse_launcher_args(a[1:])
    assert vals == {"--rs-algo": "ring", "--rs-async": "thread",
                    "--rs-script": "pretrain_gpt.py"} and rest == flags


def test_sdp4bit_overlap_and_limit_args(emu):
    m = emu.MODEL_PRESETS["small"]
    q = emu.train_args(m, "sdp4bit", 8, "/tmp/x.jsonl", dp_size=4)
    o = emu.train_args(m, "sdp4bit-overlap", 8, "/tmp/x.jsonl", dp_size=4)
    assert o[:len(q)] == q  # SDP4BIT_FLAGS as in sdp4bit, then the overlap flags
    assert o[len(q):] == ["--grad-accum-dtype", "bf16", "--overlap-grad-reduce", "--overlap-param-gather",
                          "--overlap-param-gather-with-optimizer-step", "--ddp-bucket-size",
                          "4000000", "--gradient-alltoall-pipeline", "2"]
    assert o[0].endswith("/pretrain_gpt.py")
    for kw in ({}, {"bucket_size": 1000, "pipeline": 4}, {"pipeline": 1, "bf16_rs_algo": "a2a"}):
        lim = emu.train_args(m, "limit", 8, "/tmp/x.jsonl", dp_size=4, **kw)
        assert lim == emu.train_args(m, "sdp4bit-overlap", 8, "/tmp/x.jsonl", dp_size=4, **kw)
    lim = emu.train_args(m, "limit", 8, "/tmp/x.jsonl", dp_size=4, bucket_size=1000, pipeline=4)
    assert lim[-4:] == ["--ddp-bucket-size", "1000", "--gradient-alltoall-pipeline", "4"]
    assert emu.variant_flags("limit") == emu.variant_flags("sdp4bit-overlap")
    assert "limit" in emu.UNLIMITED_VARIANTS and "sdp4bit-overlap" not in emu.UNLIMITED_VARIANTS
    with pytest.raises(ValueError):
        emu.variant_flags("nope")


def test_new_variant_flags_are_known_to_the_trainer(emu):
    """The trainer's parser (with its validation) accepts every new variant's flags."""
    arguments = pytest.importorskip("megatron.training.arguments")
    la = _load("pretrain_a2a_rs")
    m = emu.MODEL_PRESETS["small"]
    for v in ("baseline-bf16", "sdp4bit-overlap", "limit"):
        a = emu.train_args(m, v, 8, "/tmp/x.jsonl", dp_size=1, pipeline=3, bucket_size=5000)
        _, rest = la.parse_launcher_args(a[1:])
        ns = arguments.parse_args(rest)
        assert ns.overlap_grad_reduce and ns.overlap_param_gather and ns.ddp_bucket_size == 5000
        assert ns.overlap_param_gather_with_optimizer_step
        assert ns.grad_accum_dtype == "bf16"  # both peers keep bf16 gradient buffers
        if v == "baseline-bf16":
            assert ns.grad_reduce_in_bf16 and not ns.quantized_gradients
        else:
            assert ns.quantized_gradients and ns.gradient_alltoall_pipeline == 3


def test_strongest_baseline(emu):
    ms = {"baseline": 300.0, "baseline-bf16": 200.0, "baseline-ring": 150.0, "baseline-a2a": 180.0,
          "sdp4bit": 100.0, "limit": 50.0}
    assert emu.strongest_baseline(ms) == "baseline-ring"  # quantized variants / limit never count
    assert emu.strongest_baseline({**ms, "baseline-ring": None}) == "baseline-a2a"  # failed: skip
    assert emu.strongest_baseline({"baseline": 300.0, "baseline-bf16": 200.0}) == "baseline-bf16"
    assert emu.strongest_baseline({"baseline": 300.0, "sdp4bit": 1.0}) == "baseline"
    assert emu.strongest_baseline({"sdp4bit": 1.0, "baseline": None}) is None


def test_comm_medians(emu):
    recs = [{"iteration": i, "ms_per_iteration": 10.0, "comm_grad_inter_ms": float(i),
             "comm_weight_ms": 2.0 * i} for i in range(1, 6)]
    recs[4].pop("comm_weight_ms")
    c = emu.comm_medians(recs, warmup=2)
    assert c == {"comm_grad_inter_ms": 4.0, "comm_weight_ms": 7.0}  # iterations 3..5 only
    assert emu.comm_medians([{"iteration": 3, "ms_per_iteration": 1.0}], warmup=0) == {}


def test_repeat_aggregation_and_rows(emu):
    runs = {
        "baseline": [{"ms": 400.0, "load": 3.0, "bytes": 10e6, "n": 6},
                     {"ms": 440.0, "load": 5.0, "bytes": 12e6, "n": 6},
                     {"ms": 420.0, "load": 4.0, "bytes": 11e6, "n": 6}],
        "baseline-bf16": [{"ms": 300.0, "load": 3.1, "bytes": 5e6, "n": 6},
                          {"ms": None, "n": 0},  # one failed invocation: left out of the median
                          {"ms": 320.0, "load": 4.2, "bytes": 5e6, "n": 6}],
        "sdp4bit-overlap": [{"ms": 150.0, "load": 1.0, "n": 6, "comm": {"comm_grad_inter_ms": 9.0}},
                            {"ms": 160.0, "load": 1.0, "n": 6, "comm": {"comm_grad_inter_ms": 11.0}},
                            {"ms": 140.0, "load": 1.0, "n": 6, "comm": {"comm_grad_inter_ms": 30.0}}],
        "limit": [{"ms": 120.0, "n": 6}, {"ms": 125.0, "n": 6}, {"ms": 130.0, "n": 6}],
    }
    built = emu.build_rows(list(runs), runs)
    rows = {r["variant"]: r for r in built["rows"]}
    assert [r["variant"] for r in built["rows"]] == list(runs)
    assert rows["baseline"]["ms"] == 420.0 and rows["baseline"]["bytes"] == 11e6
    assert rows["baseline-bf16"]["ms"] == 310.0 and rows["baseline-bf16"]["n"] == 12
    assert rows["sdp4bit-overlap"]["comm"] == {"comm_grad_inter_ms": 11.0}
    assert built["strongest"] == "baseline-bf16" and built["limit_ran"]
    assert rows["sdp4bit-overlap"]["speedup"] == pytest.approx(420 / 150)
    assert rows["sdp4bit-overlap"]["speedup_strongest"] == pytest.approx(310 / 150)
    assert rows["sdp4bit-overlap"]["vs_limit"] == pytest.approx(150 / 125)
    assert rows["limit"]["vs_limit"] == 1.0
    table = emu.markdown_table(built["rows"], strongest=built["strongest"], limit=True)
    head, _, *body = table.splitlines()
    assert head == ("| variant | ms/iter (median of 3 invocations) | per invocation: ms/iter "
                    "(1-min load avg) | inter-node bytes / iter | speedup vs baseline | speedup vs "
                    "strongest baseline (baseline-bf16) | ms / limit | samples |")
    assert body[1] == ("| baseline-bf16 | 310.0 | 300 (load 3.1); FAILED; 320 (load 4.2) | 5.00 MB "
                       "| 1.35x | 1.00x | 2.48x | 12 |")
    assert body[2] == ("| sdp4bit-overlap | 150.0 | 150 (load 1.0); 160 (load 1.0); 140 (load 1.0) "
                       "| n/a | 2.80x | 2.07x | 1.20x | 18 |")
    assert body[3].startswith("| limit | 125.0 | 120 (load n/a); 125 (load n/a); 130 (load n/a) |")
    # all invocations failed: the row says so
    failed = emu.build_rows(["baseline"], {"baseline": [{"ms": None}, {"ms": None}]})["rows"]
    t = emu.markdown_table(failed)
    assert t.splitlines()[-1] == "| baseline | FAILED | FAILED; FAILED | n/a | n/a | 0 |"
    ct = emu.comm_table(built["rows"])
    assert ct.splitlines()[0] == "| variant | grad inter ms |"
    assert "| sdp4bit-overlap | 11.0 |" in ct and "| baseline | n/a |" in ct
    assert emu.comm_table(failed) == ""


def test_target_statements(emu):
    t = emu.target_statements({"baseline-bf16": 300.0, "sdp4bit-overlap": 150.0, "limit": 125.0})
    assert t == ["sdp4bit-overlap vs baseline-bf16: 2.00x (target >= 1.8x at 1 Gbit/s, >= 3.5x at "
                 "200 Mbit/s)", "sdp4bit-overlap / limit: 1.20x (target <= 1.15x)"]
    t = emu.target_statements({"baseline-bf16": 300.0, "sdp4bit-overlap": None})
    assert t[0].startswith("sdp4bit-overlap vs baseline-bf16: n/a (sdp4bit-overlap not run")
    assert t[1].startswith("sdp4bit-overlap / limit: n/a (sdp4bit-overlap, limit not run")


# A fake `ip` (namespaces and tc emulated in a state directory) and a fake `torchrun` (writes the
# jsonl log at once) let the driver's whole train loop run without root, namespaces or a trainer.
_FAKE_IP = r'''#!/usr/bin/env bash
# only `ip netns exec NS CMD...`; tc qdisc state kept in $FAKE_STATE/NS.DEV
[[ "$1 $2" == "netns exec" ]] || { echo "fake ip: unsupported: $*" >&2; exit 2; }
ns=$3; shift 3
if [[ "$1" == tc ]]; then
  [[ "$2" == qdisc ]] || exit 2
  action=$3; dev=$5; f="$FAKE_STATE/$ns.$dev"
  case $action in
    del) [[ -s $f ]] || { echo "Error: Cannot delete qdisc with handle of zero." >&2; exit 2; }
         rm -f "$f" ;;
    add) shift 5; echo "qdisc $*" >> "$f" ;;
    show) if [[ -s $f ]]; then cat "$f"; else echo "qdisc noqueue 0: root refcnt 2"; fi ;;
  esac
  exit 0
fi
if [[ "$1" == cat && "$2" == /sys/* ]]; then exit 1; fi  # no veth counters here
export FAKE_NS=$ns
exec "$@"
'''

_FAKE_TORCHRUN = r'''
import json, os, sys
argv = sys.argv[1:]
node = int(argv[argv.index("--node-rank") + 1])
jsonl = argv[argv.index("--jsonl-log") + 1]
iters = int(argv[argv.index("--train-iters") + 1])
ns = os.environ.get("FAKE_NS")
shaped = None
if ns:
    qd = "".join(open(os.path.join(os.environ["FAKE_STATE"], f)).read()
                 for f in os.listdir(os.environ["FAKE_STATE"]) if f.startswith(ns + "."))
    shaped = "tbf" in qd
with open(os.path.join(os.environ["FAKE_STATE"], "calls.jsonl"), "a") as f:
    f.write(json.dumps({"ns": ns, "node": node, "jsonl": os.path.basename(jsonl),
                        "shaped": shaped}) + "\n")
if "--gradient-alltoall-pipeline" in argv:
    ms = 120.0 if shaped is False else 150.0
elif "--quantized-gradients" in argv:
    ms = 200.0
elif "--grad-reduce-in-bf16" in argv:
    ms = 300.0
else:
    ms = 400.0
if ".run2." in jsonl:
    ms *= 1.1
if node == 0:
    with open(jsonl, "w") as f:
        for i in range(1, iters + 1):
            rec = {"iteration": i, "type": "train", "elapsed_time_per_iteration_ms": ms}
            if "--quantized-gradients" in argv:
                rec.update(comm_grad_inter_ms=ms / 10, comm_grad_exposed_ms=ms / 20)
            f.write(json.dumps(rec) + "\n")
'''


@pytest.fixture
def fake_cluster(tmp_path, monkeypatch):
    bindir, state = tmp_path / "bin", tmp_path / "state"
    bindir.mkdir()
    state.mkdir()
    (bindir / "ip").write_text(_FAKE_IP)
    (bindir / "torchrun").write_text(f"#!{sys.executable}\n" + _FAKE_TORCHRUN)
    for f in ("ip", "torchrun"):
        os.chmod(bindir / f, 0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_STATE", str(state))
    for k in ("STATE_FILE", "NS_PREFIX", "NS0", "NS1", "BURST"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LATENCY", "0")
    return state


def _calls(state):
    return [json.loads(ln) for ln in (state / "calls.jsonl").read_text().splitlines()]


def test_setup_netns_unlimit_limit(fake_cluster, tmp_path):
    """unlimit removes the shaping from both ends, limit puts it back (fake ip/tc)."""
    state = fake_cluster
    script = os.path.join(BENCH, "setup_netns.sh")
    env = dict(os.environ, NS0="a_n0", NS1="a_n1", BANDWIDTH="200mbit")
    for f in ("a_n0.emu0", "a_n1.emu1"):
        (state / f).write_text("qdisc root handle 10: tbf rate 200mbit burst 256kb latency 50ms\n")
    out = subprocess.run(["bash", script, "unlimit"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert not (state / "a_n0.emu0").exists() and not (state / "a_n1.emu1").exists()
    assert "a_n0/emu0: qdisc noqueue" in out.stdout and "a_n1/emu1: qdisc noqueue" in out.stdout
    # again: nothing to delete is fine
    assert subprocess.run(["bash", script, "unlimit"], env=env, capture_output=True,
                          timeout=60).returncode == 0
    # limit: tbf at the given rate on both ends; with netem recorded as applied, netem + tbf
    sf = tmp_path / "state_file"
    sf.write_text("LATENCY_APPLIED=2ms\n")
    out = subprocess.run(["bash", script, "limit"], env=dict(env, LATENCY="2ms", STATE_FILE=str(sf)),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for f in ("a_n0.emu0", "a_n1.emu1"):
        q = (state / f).read_text().splitlines()
        assert q == ["qdisc root handle 1: netem delay 2ms",
                     "qdisc parent 1:1 handle 10: tbf rate 200mbit burst 256kb latency 50ms"]
    # limit replaces what is there (no doubled qdisc); netem not applied at `up` -> none now
    sf.write_text("LATENCY_APPLIED=none\n")
    out = subprocess.run(["bash", script, "limit"], env=dict(env, LATENCY="2ms", STATE_FILE=str(sf)),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (state / "a_n1.emu1").read_text().splitlines() == [
        "qdisc root handle 10: tbf rate 200mbit burst 256kb latency 50ms"]
    # a limit that cannot be verified fails
    bad = tmp_path / "badbin"
    bad.mkdir()
    (bad / "ip").write_text("#!/usr/bin/env bash\n[[ $4 == tc && $6 == show ]] && echo 'qdisc noqueue'\n"
                            "exit 0\n")
    os.chmod(bad / "ip", 0o755)
    out = subprocess.run(["bash", script, "limit"], env=dict(env, PATH=f"{bad}:{env['PATH']}"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no tbf" in out.stderr


def test_train_loop_repeats_and_limit_without_qdisc(emu, fake_cluster, tmp_path):
    """Whole train loop with fakes: 2 invocations x 5 variants in order; `limit` (only) runs with
    no qdisc on either veth end, which is back afterwards; the report has the per-invocation
    values, the medians, the ratios, the comm table and the target statements."""
    state = fake_cluster
    for f in ("x_n0.emu0", "x_n1.emu1"):
        (state / f).write_text("qdisc root handle 10: tbf rate 1gbit burst 256kb latency 50ms\n")
    out = tmp_path / "r.md"
    rc = emu.main(["--mode", "train", "--namespaces", "x_n0,x_n1", "--iters", "3", "--warmup", "1",
                   "--repeats", "2", "--bandwidth", "1gbit", "--timeout", "60", "--out", str(out)])
    assert rc == 0
    calls = [c for c in _calls(state) if c["node"] == 0]
    variants = emu.DEFAULT_TRAIN_VARIANTS.split(",")
    assert [c["jsonl"] for c in calls] == [f"{v}.run{k}.jsonl" for k in (1, 2) for v in variants]
    for c in _calls(state):  # both nodes
        assert c["shaped"] is (not c["jsonl"].startswith("limit.")), c
    for f in ("x_n0.emu0", "x_n1.emu1"):
        assert "tbf rate 1gbit" in (state / f).read_text()  # re-applied at the end
    text = out.read_text()
    assert "**limit ran WITHOUT the link limit**" in text
    # medians over the 2 invocations: baseline (400, 440) -> 420, sdp4bit-overlap (150, 165)
    # -> 157.5, limit (120, 132) -> 126, baseline-bf16 (300, 330) -> 315 (strongest baseline)
    assert ("| sdp4bit-overlap | 157.5 | 150 (load " in text)
    row = [ln for ln in text.splitlines() if ln.startswith("| sdp4bit-overlap | 157.5")][0]
    assert row.endswith("| n/a | 2.67x | 2.00x | 1.25x | 4 |")
    assert "speedup vs strongest baseline (baseline-bf16)" in text
    assert "- sdp4bit-overlap vs baseline-bf16: 2.00x (target >= 1.8x at 1 Gbit/s" in text
    assert "- sdp4bit-overlap / limit: 1.25x (target <= 1.15x)" in text
    assert "| variant | grad inter ms | grad exposed ms |" in text
    assert "| sdp4bit-overlap | 15.8 | 7.9 |" in text  # medians of 15 / 16.5 and 7.5 / 8.25


def test_train_loop_limit_failures(emu, fake_cluster, tmp_path):
    """unlimit fails -> limit is not run (FAILED), the rest runs; re-limit fails -> abort."""
    state = fake_cluster
    out = tmp_path / "r.md"
    bad_unlimit = tmp_path / "bad_unlimit.sh"
    bad_unlimit.write_text('[[ $1 == unlimit ]] && { echo "nope"; exit 1; }; exit 0\n')
    rc = emu.main(["--namespaces", "x_n0,x_n1", "--iters", "2", "--warmup", "0",
                   "--variants", "limit,baseline", "--link-script", str(bad_unlimit),
                   "--timeout", "60", "--out", str(out)])
    assert rc == 0
    assert [c["jsonl"] for c in _calls(state) if c["node"] == 0] == ["baseline.jsonl"]
    text = out.read_text()
    assert "| limit | FAILED |" in text and "| baseline | 400.0 |" in text
    (state / "calls.jsonl").unlink()
    bad_limit = tmp_path / "bad_limit.sh"
    bad_limit.write_text('[[ $1 == limit ]] && exit 1; exit 0\n')
    rc = emu.main(["--namespaces", "x_n0,x_n1", "--iters", "2", "--warmup", "0",
                   "--variants", "limit,baseline", "--link-script", str(bad_limit),
                   "--timeout", "60", "--out", str(out)])
    assert [c["jsonl"] for c in _calls(state) if c["node"] == 0] == ["limit.jsonl"]
    text = out.read_text()
    assert "**ABORTED**: could not re-apply the link limit" in text
    assert "| baseline | FAILED |" in text


def test_loopback_limit_is_sdp4bit_overlap(emu, fake_cluster, tmp_path, capsys):
    """--no-netns: limit runs the sdp4bit-overlap arguments and never touches a link script."""
    state = fake_cluster
    out = tmp_path / "r.md"
    rc = emu.main(["--no-netns", "--iters", "2", "--warmup", "0", "--variants",
                   "sdp4bit-overlap,limit", "--link-script", "/nonexistent/x.sh", "--timeout", "60",
                   "--out", str(out)])
    assert rc == 0
    assert "link limit removed" not in capsys.readouterr().out
    calls = _calls(state)
    assert [c["shaped"] for c in calls] == [None, None]
    text = out.read_text()
    assert "limit: loopback run (--no-netns): identical to sdp4bit-overlap" in text
    assert "- sdp4bit-overlap / limit: 1.00x (target <= 1.15x)" in text


def test_ring_volume_worker_thread_handles():
    """The async handle: FIFO jobs on one worker thread, wait() re-raises, idempotent; the tracking
    coalescing manager records the open manager (no process group needed)."""
    import contextlib
    import threading

    rv = _load("ring_volume_rs")
    w = rv._Worker()
    gate, order = threading.Event(), []
    h1 = w.submit(lambda: (gate.wait(10), order.append(1)))
    h2 = w.submit(lambda: order.append(2))
    h3 = w.submit(lambda: 1 / 0)
    assert not h1.is_completed()
    gate.set()
    assert h2.wait() is True and h1.wait() is True and order == [1, 2]
    with pytest.raises(ZeroDivisionError):
        h3.wait()
    assert h3.is_completed() and not h3.is_success()
    with pytest.raises(ZeroDivisionError):
        h3.wait()  # every wait re-raises
    after = w.submit(lambda: order.append(3))   # the stage stopped at its first error
    with pytest.raises(ZeroDivisionError):
        after.wait()
    assert order == [1, 2]
    blocked = rv._Worker().submit(lambda: gate.clear() or threading.Event().wait(0.5))
    with pytest.raises(RuntimeError):
        blocked.wait(timeout=0.01)
    assert blocked.wait() is True

    class CM:
        def __init__(self):
            self.works = []

        def append(self, work=None):
            if work:
                self.works.append(work)

    @contextlib.contextmanager
    def orig_cm(group=None, async_ops=False):
        yield CM()

    tracking = rv._make_tracking_cm(orig_cm)
    assert rv._open_cm_stack() == []
    with tracking(None, async_ops=True) as cm:
        assert rv._open_cm_stack() == [cm]
        with tracking(None) as inner:
            assert rv._open_cm_stack()[-1] is inner
        assert rv._open_cm_stack() == [cm]
    assert rv._open_cm_stack() == []
    assert rv.summary().endswith("async_calls=0 async_mode=thread")
    with pytest.raises(ValueError):
        rv.install("ring", async_mode="later")


def _ddp_bf16_overlap_rank(rank, world):
    """megatron-core DDP exactly as baseline-bf16 configures it (bf16 grad buffers,
    overlap_grad_reduce + overlap_param_gather, several buckets) with the replacement installed:
    every reduce-scatter's output is checked against the fp64 sum of its captured inputs."""
    import torch
    import torch.distributed as dist
    import megatron.core.distributed.param_and_grad_buffer as pgb
    import test_integration_ddp as tid

    rv = _load("ring_volume_rs")
    orig_rs = dist.reduce_scatter_tensor
    res = {}
    for algo in ("ring", "a2a"):
        fn = rv.install(algo)
        phase, captured = ["?"], []

        def spy(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            captured.append((phase[0], async_op, input.detach().clone(), output))
            return fn(output, input, op=op, group=group, async_op=async_op)

        pgb.dist_reduce_scatter_func = spy
        chunks, opt, _ = tid.build(ddpkw={"overlap_grad_reduce": True, "overlap_param_gather": True,
                                          "bucket_size": 4000},
                                   plain=True, grad_reduce_in_fp32=False)
        ddp = chunks[0]
        steps = []
        for it in range(2):
            captured.clear()
            ddp.zero_grad_buffer()
            opt.zero_grad()
            phase[0] = "backward"
            tid.forward_backward(ddp, rank, it)
            phase[0] = "finish"
            ddp.finish_grad_sync()
            phase[0] = "?"
            checks = []
            for ph, async_op, inp, out in captured:
                got = out.detach().double().reshape(-1)
                exact = torch.empty(got.numel(), dtype=torch.float64)
                absum = torch.empty(got.numel(), dtype=torch.float64)
                orig_rs(exact, inp.double().reshape(-1))
                orig_rs(absum, inp.double().abs().reshape(-1))
                # bf16 sums of 4 terms: error <= 3 roundings of 2^-8 relative to sum |terms|
                bound = 3 * 2.0 ** -8 * absum + 1e-30
                checks.append((ph, async_op, str(inp.dtype), bool(((got - exact).abs() <= bound).all()),
                               float(exact.abs().max())))
            steps.append(checks)
            ok, _, _ = opt.step()
            assert ok
        ddp.disable_forward_pre_hook()  # the pending parameter all-gather
        ddp.enable_forward_pre_hook()
        res[algo] = {"steps": steps, "buckets": sum(len(bg.buckets) for bg in ddp.bucket_groups),
                     "grad_dtype": str(ddp.buffers[0].grad_data.dtype)}
        rv.uninstall()
    return res


def test_ring_volume_rs_in_megatron_ddp_bf16_overlap(tmp_path):
    """baseline-bf16's configuration on 4 loopback ranks (spawned, no torchrun): bf16 grad buffers
    and async reduce-scatters dispatched by the backward hooks (step 2; step 1 is megatron-core's
    first-batch path from finish_grad_sync), each result within bf16 rounding of the exact sum."""
    pytest.importorskip("megatron.core")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_integration_ddp as tid

    results = tid.run_distributed(_ddp_bf16_overlap_rank, 4)
    for rank, res in enumerate(results):
        assert "__error__" not in res, res.get("__error__")
        for algo in ("ring", "a2a"):
            r = res[algo]
            assert r["grad_dtype"] == "torch.bfloat16" and r["buckets"] >= 3, r
            first, second = r["steps"]
            for step, phase in ((first, "finish"), (second, "backward")):
                assert len(step) == r["buckets"], (rank, algo, step)
                for ph, async_op, dtype, within, amax in step:
                    assert (ph, async_op, dtype, within) == (phase, True, "torch.bfloat16", True), \
                        (rank, algo, step)
                    assert amax > 0


def test_moe_preset_trains_experts_over_their_own_group(emu, tmp_path):
    """moe-small: 8 experts top-2 at EP 2 (one expert-DP rank per emulated node), every variant
    with the same MoE flags; its size counts all experts."""
    m = emu.MODEL_PRESETS["moe-small"]
    dense = dict(m, num_experts=0)
    assert emu.approx_gpt_params(**m) > 4 * emu.approx_gpt_params(**dense) - 4 * 8192 * 256
    for variant in ("baseline", "sdp4bit-overlap"):
        argv = emu.train_args(m, variant, 4, str(tmp_path / "x.jsonl"))
        i = argv.index("--num-experts")
        assert argv[i:i + 4] == ["--num-experts", "8", "--expert-model-parallel-size", "2"]
        assert "--moe-token-dispatcher-type" in argv
