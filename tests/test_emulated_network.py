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
