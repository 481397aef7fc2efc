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
    assert out.count("ip netns exec") == 4  # 2 variants x 2 nodes
    assert "--quantized-gradients" in out


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
    return res


def test_ring_volume_reduce_scatter_matches_gloo(tmp_path):
    pytest.importorskip("megatron.core")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from dist_harness import run_distributed

    import torch

    world = 4
    results = run_distributed(world, _rs_rank, tmp_path)
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
