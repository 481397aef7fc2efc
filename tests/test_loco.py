"""Tests of LoCo error feedback: the buffer mechanics (single process) and its effect inside the
quantized reduce-scatter on gloo (2 ranks as 2x1: E1 only; 4 ranks as 2x2: E1 + E2)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from megatron.distributed.quant.collectives.common import required_padding_multiple
from megatron.distributed.quant.collectives.gradients import two_level_reduce_scatter
from megatron.distributed.quant.config import HopSpec, QuantizationConfig
from megatron.distributed.quant.loco import LoCoErrorFeedback
from megatron.distributed.quant.topology import build_two_level_groups
from dist_harness import run_distributed

GS_INTRA, GS_INTER = 64, 128


# ------------------------------------------------------------------------------------------------
# spawn harness: tests/dist_harness.py
# ------------------------------------------------------------------------------------------------

def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# ------------------------------------------------------------------------------------------------
# single-process mechanics
# ------------------------------------------------------------------------------------------------

def test_update_rule_fp32_storage():
    fb = LoCoErrorFeedback(beta=0.8, reset_interval=100, error_bits=32)
    b = fb.bucket("b0")
    g = torch.Generator().manual_seed(0)
    x1, s1 = torch.randn(256, generator=g), torch.randn(256, generator=g)
    h1 = b.compensate("e1", x1, group_size=64)
    assert torch.equal(h1, x1)                       # empty buffer = zero error
    b.update("e1", h1, s1)
    e1 = 0.2 * (h1 - s1)
    assert torch.allclose(b.error("e1", 256, torch.device("cpu")), e1, rtol=0, atol=1e-7)
    x2, s2 = torch.randn(256, generator=g), torch.randn(256, generator=g)
    h2 = b.compensate("e1", x2, group_size=64)
    assert torch.allclose(h2, x2 + e1, atol=1e-6)
    b.update("e1", h2, s2)
    assert torch.allclose(b.error("e1", 256, torch.device("cpu")), 0.8 * e1 + 0.2 * (h2 - s2), atol=1e-6)
    assert fb.memory_bytes() == 256 * 4


def test_beta_zero_is_classic_error_feedback():
    fb = LoCoErrorFeedback(beta=0.0, error_bits=32)
    b = fb.bucket(0)
    x, sent = torch.randn(128), torch.randn(128)
    h = b.compensate("e2", x, group_size=128)
    b.update("e2", h, sent)
    # DeepSpeed's unit test identity: x + e_old == sent + e_new
    assert torch.allclose(x + 0.0, sent + b.error("e2", 128, x.device), atol=1e-6)


def test_int8_storage_accuracy_memory_and_rescale():
    fb = LoCoErrorFeedback(beta=0.5, error_bits=8)
    b = fb.bucket(0)
    x = torch.randn(1024)
    h = b.compensate("e1", x, group_size=128)
    b.update("e1", h, torch.zeros(1024))
    e_true = 0.5 * x
    e = b.error("e1", 1024, x.device)
    step = e_true.abs().view(-1, 128).amax(1).repeat_interleave(128) / 127
    assert ((e - e_true).abs() <= 0.5 * step * (1 + 1e-5) + 1e-8).all()   # round to nearest
    assert fb.memory_bytes() == 1024 + 4 * (1024 // 128)
    fb.rescale(2.0)
    assert torch.equal(b.error("e1", 1024, x.device), 2.0 * e)            # power of two: exact
    with pytest.raises(ValueError, match="positive"):
        fb.rescale(float("nan"))


def test_bf16_storage():
    fb = LoCoErrorFeedback(beta=0.0, error_bits=16)
    b = fb.bucket(0)
    x = torch.randn(64)
    b.update("e1", b.compensate("e1", x, group_size=64), torch.zeros(64))
    assert fb.memory_bytes() == 64 * 2
    assert torch.equal(b.error("e1", 64, x.device), x.to(torch.bfloat16).float())


def test_reset_every_interval_for_all_buckets_and_drop():
    fb = LoCoErrorFeedback(beta=0.8, reset_interval=3, error_bits=8)
    for k in range(3):
        b = fb.bucket(k)
        b.update("e1", b.compensate("e1", torch.randn(128), group_size=64), torch.zeros(128))
    assert fb.memory_bytes() > 0
    assert fb.step() is False and fb.step() is False
    assert fb.memory_bytes() > 0
    assert fb.step() is True                       # third optimizer step: all buckets at once
    assert fb.memory_bytes() == 0 and fb.steps_since_reset == 0
    assert torch.equal(fb.bucket(1).error("e1", 128, torch.device("cpu")), torch.zeros(128))
    b = fb.bucket(0)
    b.update("e1", b.compensate("e1", torch.randn(128), group_size=64), torch.zeros(128))
    fb.step()
    fb.drop()
    assert fb.memory_bytes() == 0 and fb.steps_since_reset == 0


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_state_dict_round_trip_exact(bits):
    torch.manual_seed(0)
    fb = LoCoErrorFeedback(beta=0.8, reset_interval=7, error_bits=bits)
    for k in ("a", "b"):
        b = fb.bucket(k)
        for _ in range(3):
            for which, gs, n in (("e1", 64, 512), ("e2", 128, 256)):
                b.update(which, b.compensate(which, torch.randn(n), group_size=gs), torch.randn(n))
    fb.step()
    fb2 = LoCoErrorFeedback(beta=0.1, reset_interval=1, error_bits=bits)
    fb2.load_state_dict(_roundtrip(fb.state_dict()))
    assert (fb2.beta, fb2.reset_interval, fb2.steps_since_reset) == (0.8, 7, 1)
    cpu = torch.device("cpu")
    for k in ("a", "b"):
        for which, n in (("e1", 512), ("e2", 256)):
            assert torch.equal(fb.bucket(k).error(which, n, cpu), fb2.bucket(k).error(which, n, cpu))
    # identical continuation
    x, s = torch.randn(512), torch.randn(512)
    for f in (fb, fb2):
        b = f.bucket("a")
        b.update("e1", b.compensate("e1", x, group_size=64), s)
    assert torch.equal(fb.bucket("a").error("e1", 512, cpu), fb2.bucket("a").error("e1", 512, cpu))
    assert fb.memory_bytes() == fb2.memory_bytes()


def test_clear_value_errors():
    with pytest.raises(ValueError, match="beta"):
        LoCoErrorFeedback(beta=1.0)
    with pytest.raises(ValueError, match="bits"):
        LoCoErrorFeedback(error_bits=4)
    with pytest.raises(ValueError, match="reset"):
        LoCoErrorFeedback(reset_interval=0)
    fb = LoCoErrorFeedback(error_bits=8)
    b = fb.bucket(0)
    b.update("e1", b.compensate("e1", torch.randn(128), group_size=64), torch.zeros(128))
    with pytest.raises(ValueError, match="bucket layout changed"):
        b.compensate("e1", torch.randn(256), group_size=64)
    with pytest.raises(ValueError, match="group size"):
        b.compensate("e1", torch.randn(128), group_size=128)
    with pytest.raises(ValueError, match="one of"):
        b.compensate("e3", torch.randn(128), group_size=64)
    with pytest.raises(ValueError, match="error_bits"):
        LoCoErrorFeedback(error_bits=32).load_state_dict(fb.state_dict())


def test_from_config():
    cfg = QuantizationConfig(quantized_gradients=True, loco=True, loco_error_beta=0.5,
                             loco_reset_interval=10, loco_error_bits=32)
    fb = LoCoErrorFeedback.from_config(cfg)
    assert (fb.beta, fb.reset_interval, fb.error_bits) == (0.5, 10, 32)


# ------------------------------------------------------------------------------------------------
# distributed: accumulated error with and without LoCo on the same gradient stream
# ------------------------------------------------------------------------------------------------

def _loco_worker(rank: int, world: int, intra: int, steps: int) -> dict:
    g = build_two_level_groups(list(range(world)), intra)
    p = g.dp_size
    n = required_padding_multiple(p, intra, GS_INTRA, GS_INTER) * 8
    out: dict = {}
    for ht in (False, True):
        kw = dict(intra=HopSpec(8, GS_INTRA, hadamard=ht), inter=HopSpec(4, GS_INTER, hadamard=ht))
        stream = torch.Generator().manual_seed(1000 + rank)
        mu = torch.randn(n, generator=stream) * 0.3          # persistent per-rank component
        fb = LoCoErrorFeedback(beta=0.8, reset_interval=10_000, error_bits=8)
        gens = {m: torch.Generator().manual_seed(77 + rank) for m in ("loco", "plain")}
        acc = {m: torch.zeros(n // p) for m in ("loco", "plain")}
        acc_exact = torch.zeros(n // p)
        saved = None
        replay = []
        for t in range(steps):
            x = mu + torch.randn(n, generator=stream)
            exact = torch.empty(n // p)
            dist.reduce_scatter_tensor(exact, x.clone(), group=g.dp_group)
            acc_exact += exact
            for mode in ("loco", "plain"):
                o = torch.empty(n // p)
                two_level_reduce_scatter(x, o, g, generator=gens[mode],
                                         error_feedback=fb.bucket(0) if mode == "loco" else None, **kw)
                acc[mode] += o
                if mode == "loco" and saved is not None:
                    replay.append((x, o))
            fb.step()
            if t == steps - 4:    # checkpoint, then replay the last 3 steps from it
                saved = (_roundtrip(fb.state_dict()), gens["loco"].get_state())
        fb2 = LoCoErrorFeedback(beta=0.3, reset_interval=5, error_bits=8)
        fb2.load_state_dict(saved[0])
        gen2 = torch.Generator()
        gen2.set_state(saved[1])
        same = True
        for x, o in replay:
            o2 = torch.empty(n // p)
            two_level_reduce_scatter(x, o2, g, generator=gen2, error_feedback=fb2.bucket(0), **kw)
            fb2.step()
            same = same and bool(torch.equal(o, o2))
        tag = "ht" if ht else "plain"
        for mode in ("loco", "plain"):
            out[f"{tag}_{mode}_acc_err"] = float((acc[mode] - acc_exact).norm() / acc_exact.norm())
        out[f"{tag}_resume_identical"] = same
        out[f"{tag}_replayed"] = len(replay)
        out["memory_bytes"] = fb.memory_bytes()
        out["n"] = n
    return out


@pytest.fixture(scope="module")
def loco_2x1(tmp_path_factory):
    return run_distributed(2, _loco_worker, tmp_path_factory.mktemp("loco2"), 1, 30)


@pytest.fixture(scope="module")
def loco_2x2(tmp_path_factory):
    return run_distributed(4, _loco_worker, tmp_path_factory.mktemp("loco4"), 2, 30)


@pytest.mark.parametrize("topo", ["loco_2x1", "loco_2x2"])
def test_loco_reduces_accumulated_error(topo, request):
    res = request.getfixturevalue(topo)
    for r in res:
        for tag in ("plain", "ht"):
            loco, plain = r[f"{tag}_loco_acc_err"], r[f"{tag}_plain_acc_err"]
            assert loco < 0.5 * plain, (topo, tag, loco, plain)
    print(topo, {k: round(v, 5) for k, v in res[0].items() if k.endswith("acc_err")})


@pytest.mark.parametrize("topo", ["loco_2x1", "loco_2x2"])
def test_loco_checkpoint_resume_bit_identical(topo, request):
    res = request.getfixturevalue(topo)
    for r in res:
        for tag in ("plain", "ht"):
            assert r[f"{tag}_replayed"] == 3 and r[f"{tag}_resume_identical"], (topo, tag)


def test_loco_memory(loco_2x1, loco_2x2):
    n = loco_2x1[0]["n"]          # 2x1: E1 only (inter hop 4-bit/128 grouping)
    assert loco_2x1[0]["memory_bytes"] == n + 4 * n // GS_INTER
    n = loco_2x2[0]["n"]          # 2x2: E1 (N, groups of 64) + E2 (N/2, groups of 128)
    assert loco_2x2[0]["memory_bytes"] == n + 4 * n // GS_INTRA + n // 2 + 4 * (n // 2) // GS_INTER


# ------------------------------------------------------------------------------------------------
# the first hop's residual in one call over the slot table == slot by slot, bit for bit
# ------------------------------------------------------------------------------------------------

def _slot_by_slot(q, num_partitions, order, *, hadamard, hadamard_block, subtract_from, out):
    """LoCo's first hop as it was before ``dequantize_partitions``: one dequantize call per slot
    into its partition's place of a new buffer, then ``torch.sub(h, sent)`` into that buffer."""
    from megatron.distributed.quant.kernels.dispatch import QuantizedTensor, dequantize

    res = torch.empty(q.numel, dtype=torch.float32)
    part = res.view(num_partitions, -1)
    cb, ng = q.codes.numel() // num_partitions, q.scales.numel() // num_partitions
    for slot, partition in enumerate(order):
        piece = QuantizedTensor(q.codes[slot * cb:(slot + 1) * cb],
                                q.scales[slot * ng:(slot + 1) * ng], q.bits, q.group_size,
                                q.numel // num_partitions)
        dequantize(piece, hadamard=hadamard, hadamard_block=hadamard_block, out=part[partition])
    return torch.sub(subtract_from, res, out=res)


def _same(a, b) -> bool:
    """Bit-for-bit equality of nested dicts / lists / tensors (fp32 compared as int32 bits)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        if a.dtype == torch.float32:
            a, b = a.view(torch.int32), b.view(torch.int32)
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _first_hop_worker(rank: int, world: int, intra: int, steps: int) -> dict:
    """Per backend (torch, cpp, Triton in the interpreter) and with / without Hadamard: ``steps``
    LoCo reduce-scatters with the first hop's residual from one ``dequantize_partitions`` call,
    then the same with the slot-by-slot path; the hop-1 codes and scales, the outputs and the
    error buffers (E1, E2) after every step must agree bit for bit."""
    import os

    from megatron.distributed.quant.collectives import gradients as G
    from megatron.distributed.quant.kernels import dispatch as K

    g = build_two_level_groups(list(range(world)), intra)
    p = g.dp_size
    n = required_padding_multiple(p, intra, GS_INTRA, GS_INTER) * 2
    res: dict = {}
    fused, quantize_partitions = G.dequantize_partitions, G.quantize_partitions
    for backend in ("torch", "cpp", "triton"):
        os.environ["QUANT_KERNELS"] = backend
        if (backend == "cpp" and not K.cpu_kernels_available()) or (
                backend == "triton" and not K.triton_available()):
            continue
        for ht in (False, True):
            kw = dict(intra=HopSpec(4, GS_INTRA, hadamard=ht),
                      inter=HopSpec(4, GS_INTER, hadamard=ht))
            runs = []
            for first_hop in (fused, _slot_by_slot):
                codes: list = []

                def recording(*a, **k):
                    q = quantize_partitions(*a, **k)
                    codes.append((q.codes.clone(), q.scales.clone()))
                    return q
                G.dequantize_partitions, G.quantize_partitions = first_hop, recording
                try:
                    fb = LoCoErrorFeedback(beta=0.8, reset_interval=10_000, error_bits=32)
                    gen = torch.Generator().manual_seed(5 + rank)
                    stream = torch.Generator().manual_seed(100 + rank)
                    outs, errs = [], []
                    for _ in range(steps):
                        x = torch.randn(n, generator=stream)
                        o = torch.empty(n // p)
                        two_level_reduce_scatter(x, o, g, generator=gen,
                                                 error_feedback=fb.bucket(0), **kw)
                        outs.append(o)
                        errs.append(fb.bucket(0).state_dict())
                finally:
                    G.dequantize_partitions, G.quantize_partitions = fused, quantize_partitions
                runs.append((outs, codes, errs))
            res[f"{backend} ht={ht}"] = _same(runs[0], runs[1])
            res[f"{backend} ht={ht} calls"] = len(runs[0][1])
    return res


@pytest.mark.parametrize("world,intra", [(4, 2), (2, 1)])
def test_first_hop_residual_in_one_call_is_bit_identical(tmp_path, world, intra):
    """2x2 (two-level: the swizzled slot order) and 2x1 (one hop, the identity order)."""
    from megatron.distributed.quant.kernels import dispatch as K

    steps = 3
    backends = ["torch"] + ["cpp"] * K.cpu_kernels_available() + ["triton"] * K.triton_available()
    for r in run_distributed(world, _first_hop_worker, tmp_path, intra, steps):
        assert {k for k in r if not k.endswith("calls")} == {
            f"{b} ht={ht}" for b in backends for ht in (False, True)}
        for key, same in r.items():
            if key.endswith("calls"):
                assert same == steps, (key, same)
            else:
                assert same, f"{key}: differs from the slot-by-slot first hop"
