"""Cross-stream lifetimes and error delivery of the CUDA communication stages, without a GPU.

Why (issue 25, review items 1 and 3): on CUDA the middle hop's codes of the two-level gradient
reduce-scatter are allocated on the ``intra`` stage's stream and read by the ``inter`` stage's
all-to-all; the job dropped their last reference as soon as the all-to-all was *enqueued*, so the
caching allocator could hand the block to the next intra job (the next pipeline chunk or bucket)
before the inter all-to-all had read it: silently wrong gradients on D>1, M>1 runs with overlap or
``--gradient-alltoall-pipeline``. And an inter job queued after a failed intra job ran anyway,
raised ``KeyError(('q2', 0))`` and hid the real error.

The collectives run here on one rank of a 2x2 layout whose transport (``dist``) is a loopback that
records each collective's input, under the fake ``torch.cuda`` of ``fake_cuda.py`` and an
allocation tracker (which stage's stream allocated each tensor). The product's rule, asserted: a
tensor allocated by one stage and read by a collective of another is ``record_stream``-ed to the
reader. The torch reference kernels run (``QUANT_KERNELS=torch``) so every allocation goes through
the dispatcher.
"""

from __future__ import annotations

import gc
from typing import Any, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from fake_cuda import FakeCuda, StreamAllocationCheck
from megatron.distributed.quant.collectives import common, gradients, weights
from megatron.distributed.quant.config import HopSpec
from megatron.distributed.quant.loco import LoCoErrorFeedback
from megatron.distributed.quant.streams import STAGES, CommStreams
from megatron.distributed.quant.topology import TwoLevelGroups

GS = 64  # group size of both hops (a multiple of the Hadamard block)


class _Group:
    def __init__(self, size: int) -> None:
        self.size = size


class LoopbackDist:
    """The ``torch.distributed`` calls of the collectives for rank 0 of a world whose peers all
    send what this rank sends (numbers do not matter here, lifetimes do); each call reports its
    input to the allocation check."""

    ReduceOp = dist.ReduceOp

    def __init__(self, check: StreamAllocationCheck) -> None:
        self.check = check
        self.calls: List[Tuple[str, str]] = []

    def get_world_size(self, group: Any = None) -> int:
        return group.size

    def get_rank(self, group: Any = None) -> int:
        return 0

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, group: Any = None,
                          async_op: bool = False) -> None:
        """Piece j arrives from peer j as this rank's piece k-1-j: the pieces change places,
        so a packing that cut the message into other pieces than the peers' shows."""
        self.check.note_read(inp)
        self.calls.append(("all_to_all", self.check.fake.current.name))
        out.view(group.size, -1).copy_(inp.view(group.size, -1).flip(0))

    def all_gather_single(self, out: torch.Tensor, inp: torch.Tensor, group: Any = None,
                          async_op: bool = False) -> None:
        self.check.note_read(inp)
        self.calls.append(("all_gather", self.check.fake.current.name))
        out.view(group.size, -1).copy_(inp.view(1, -1))

    all_gather_into_tensor = all_gather_single


def _install_transport(monkeypatch, transport: LoopbackDist) -> None:
    """``transport`` as ``dist`` of every collectives module that looks it up."""
    for module in (common, gradients, weights):
        monkeypatch.setattr(module, "dist", transport)


def _groups_2x2() -> TwoLevelGroups:
    return TwoLevelGroups(dp_group=_Group(4), intra_group=_Group(2), inter_group=_Group(2),
                          dp_size=4, dp_rank=0, intra_size=2, inter_size=2, node=0, local=0,
                          dp_ranks=[0, 1, 2, 3])


@pytest.fixture
def fake_world(monkeypatch):
    monkeypatch.setenv("QUANT_KERNELS", "torch")
    fake = FakeCuda()
    fake.install(monkeypatch)
    check = StreamAllocationCheck(fake)
    transport = LoopbackDist(check)
    _install_transport(monkeypatch, transport)
    return fake, check, transport


def _cuda_streams() -> CommStreams:
    """CUDA stages created in the fake's naming order (intra, inter, weights)."""
    streams = CommStreams("cuda", device="cuda:0")
    for name in STAGES:
        streams.stage(name)
    return streams


def _reduce_scatter(streams: CommStreams, *, pipeline: int, loco: bool, hadamard: bool,
                    buckets: int = 2, ef_owner: Optional[LoCoErrorFeedback] = None) -> None:
    groups = _groups_2x2()
    gen = torch.Generator().manual_seed(0)
    flag = torch.zeros(1, dtype=torch.int32)
    if ef_owner is None and loco:
        ef_owner = LoCoErrorFeedback()
    handles = []
    for b in range(buckets):
        x = torch.randn(4 * 2 * GS * 2, generator=gen)
        out = torch.empty(x.numel() // 4)
        handles.append(gradients.two_level_reduce_scatter(
            x, out, groups, intra=HopSpec(8, GS, hadamard=hadamard),
            inter=HopSpec(4, GS, hadamard=hadamard), generator=gen, async_op=True,
            nonfinite_flag=flag, pipeline=pipeline, streams=streams,
            error_feedback=None if ef_owner is None else ef_owner.bucket(b)))
    for h in handles:
        h.wait()


@pytest.mark.parametrize("pipeline,loco,hadamard", [(1, False, False), (2, False, True),
                                                    (2, True, True)])
def test_middle_hop_codes_are_kept_for_the_inter_stage(fake_world, pipeline: int, loco: bool,
                                                       hadamard: bool) -> None:
    fake, check, transport = fake_world
    streams = _cuda_streams()
    with check:
        _reduce_scatter(streams, pipeline=pipeline, loco=loco, hadamard=hadamard)
    assert ("all_to_all", "intra") in transport.calls and ("all_to_all", "inter") in transport.calls
    crossing = {number for _, a, r, number in check.reads if a == "intra" and r == "inter"}
    # codes + scales, per bucket and chunk (LoCo: per bucket, the inter stage slices the chunks)
    assert len(crossing) == 2 * 2 * (1 if loco else pipeline)
    assert check.hazards() == []


def test_weight_gather_reads_only_its_own_stage(fake_world) -> None:
    fake, check, transport = fake_world
    streams = _cuda_streams()
    shard = torch.randn(2 * GS, dtype=torch.bfloat16)
    ref = torch.randn(4 * 2 * GS, dtype=torch.bfloat16)
    with check:
        weights.quantized_all_gather(shard, ref, ref, _Group(4), spec=HopSpec(4, GS),
                                     generator=torch.Generator().manual_seed(1),
                                     nonfinite_flag=torch.zeros(1, dtype=torch.int32), async_op=True,
                                     streams=streams).wait()
    assert ("all_gather", "weights") in transport.calls and check.hazards() == []


def test_the_check_catches_an_unprotected_cross_stage_read(fake_world, monkeypatch) -> None:
    """The check itself can fail: with the stage's ``record_stream`` hand-over disabled (the
    code before the fix), the middle hop's codes are flagged."""
    fake, check, _ = fake_world
    monkeypatch.setattr(gradients, "used_on_this_stage", lambda *tensors: None)
    with check:
        _reduce_scatter(_cuda_streams(), pipeline=2, loco=False,
                        hadamard=False)
    assert check.hazards() and set(check.hazards()) == {("intra", "inter")}


@pytest.mark.parametrize("pipeline,loco", [(1, False), (3, False), (2, True)])
def test_first_hop_codes_are_freed_once_sent(fake_world, monkeypatch, pipeline: int,
                                              loco: bool) -> None:
    """The bucket's first-hop codes (the whole bucket at 8 bits) are needed until the last chunk
    has queued its exchange; the jobs' closures held them until ``finish_grad_sync`` waited, one
    byte per parameter held across the whole backward on CUDA."""
    import gc
    import weakref

    codes = []
    real = gradients.quantize_partitions

    def spy(*args, **kwargs):
        q = real(*args, **kwargs)
        codes.append(weakref.ref(q.codes))
        return q

    monkeypatch.setattr(gradients, "quantize_partitions", spy)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4 * 2 * GS * 2 * pipeline, generator=gen)
    handle = gradients.two_level_reduce_scatter(
        x, torch.empty(x.numel() // 4), _groups_2x2(), intra=HopSpec(8, GS, hadamard=True),
        inter=HopSpec(4, GS, hadamard=True), generator=gen, async_op=True,
        nonfinite_flag=torch.zeros(1, dtype=torch.int32), pipeline=pipeline,
        streams=_cuda_streams(), error_feedback=LoCoErrorFeedback().bucket(0) if loco else None)
    gc.collect()
    assert len(codes) == 1 and codes[0]() is None      # queued, sent, and released
    handle.wait()


@pytest.mark.parametrize("error_bits", [8, 16])
@pytest.mark.parametrize("made_by", ["resume", "inline step"])
def test_loco_errors_made_on_the_compute_stream_are_kept_for_the_stage(
        fake_world, monkeypatch, made_by: str, error_bits: int) -> None:
    """LoCo's stored errors are normally made and replaced on the ``intra`` stage. After a resume
    (``load_state_dict`` copies them on the compute stream) or an iteration that ran its
    collectives inline (``--quantization-error-interval``), they belong to the compute stream's
    pool; the next overlapped step's intra job reads them and then replaces them, and without a
    hand-over the compute stream could reuse the block while the stage's dequantize is still
    pending: wrong errors, wrong gradients. With ``used_on_this_stage`` disabled (the code
    before the fix) the check flags exactly those blocks."""
    fake, check, _ = fake_world
    streams = _cuda_streams()

    def step_after(made_by: str) -> List[Tuple[str, str]]:
        check.freed_while_read.clear()
        check.reads.clear()
        ef = LoCoErrorFeedback(error_bits=error_bits)
        with check:
            if made_by == "resume":
                warm = LoCoErrorFeedback(error_bits=error_bits)
                _reduce_scatter(CommStreams("inline"), pipeline=1, loco=True, hadamard=True,
                                ef_owner=warm)
                ef.load_state_dict(warm.state_dict())
            else:
                _reduce_scatter(CommStreams("inline"), pipeline=1, loco=True, hadamard=True,
                                ef_owner=ef)
            _reduce_scatter(streams, pipeline=2, loco=True, hadamard=True, ef_owner=ef)
        return check.hazards()

    assert step_after(made_by) == []
    monkeypatch.setattr("megatron.distributed.quant.loco.used_on_this_stage", lambda *t: None)
    assert set(step_after(made_by)) == {("default", "intra")}


def _block_read_by(fake: FakeCuda, stage: str) -> List[Any]:
    """A block allocated on the compute stream, read on ``stage``, and held only by a reference
    cycle (so refcounting never frees it: only the cyclic collector does)."""
    block = torch.ones(64) * 2        # an allocation on the default stream
    with torch.cuda.stream(fake.Stream(fake, stage)):
        block.sum()                   # read on the stage
    cycle: List[Any] = [block]
    cycle.append(cycle)
    return cycle


def test_the_check_blames_a_stage_that_drops_a_block_it_read(fake_world) -> None:
    """The planted hazard: the stage itself drops the last reference of a block it read."""
    fake, check, _ = fake_world
    with check:
        block = torch.ones(64) * 2
        with torch.cuda.stream(fake.Stream(fake, "intra")):
            block.sum()
            del block
    assert check.hazards() == [("default", "intra")]


def test_a_block_the_cyclic_collector_frees_is_no_stage_s_free(fake_world) -> None:
    """Issue 35: a block in a reference cycle is freed whenever a full collection runs, on the
    thread that triggered it, with that thread's current stage. That is no stage dropping the
    block (a real run's caching allocator returns it to its allocating stream's pool), so the
    check records nothing -- also for blocks of an earlier check freed during a later run."""
    fake, check, _ = fake_world
    gc.collect()
    with check:
        cycle = _block_read_by(fake, "intra")
        del cycle
        with torch.cuda.stream(fake.Stream(fake, "intra")):
            assert gc.collect() > 0
    assert check.hazards() == []

    later = StreamAllocationCheck(fake)
    with check:
        cycle = _block_read_by(fake, "intra")
    del cycle
    with later, torch.cuda.stream(fake.Stream(fake, "intra")):
        torch.ones(8).sum()
        assert gc.collect() > 0          # the earlier check's block, freed in the later run
    assert check.hazards() == [] and later.hazards() == []


@pytest.mark.parametrize("pipeline,loco", [(1, False), (2, False), (2, True)])
def test_inter_node_hops_send_codes_and_scales_as_one_message(fake_world, monkeypatch,
                                                               pipeline: int, loco: bool) -> None:
    """Review item 8: a hop that crosses nodes pays one all-to-all latency, not two (codes and
    scales packed in one message); the intra-node hop keeps two (a copy costs more than a
    message on NVLink). Packing changes no number: the shards equal those of the two-message
    exchange bit for bit (here with pieces that change places; against the exact
    reduce-scatter on real gloo ranks in tests/test_collectives.py)."""
    fake, check, transport = fake_world
    streams = _cuda_streams()

    def shards() -> List[torch.Tensor]:
        transport.calls.clear()
        gen = torch.Generator().manual_seed(0)
        ef = LoCoErrorFeedback() if loco else None
        outs = []
        for b in range(2):
            x = torch.randn(4 * 2 * GS * 2, generator=gen)
            outs.append(torch.empty(x.numel() // 4))
            gradients.two_level_reduce_scatter(
                x, outs[-1], _groups_2x2(), intra=HopSpec(8, GS, hadamard=True),
                inter=HopSpec(4, GS, hadamard=True), generator=gen, pipeline=pipeline,
                nonfinite_flag=torch.zeros(1, dtype=torch.int32), async_op=True,
                streams=streams, error_feedback=None if ef is None else ef.bucket(b)).wait()
        return outs

    packed = shards()
    per_stage = {stage: transport.calls.count(("all_to_all", stage))
                 for stage in ("intra", "inter")}
    chunks = 2 * pipeline                          # 2 buckets
    assert per_stage == {"intra": 2 * (2 if loco else chunks), "inter": chunks}
    monkeypatch.setattr(gradients, "_one_message", lambda link: False)
    two_messages = shards()
    assert transport.calls.count(("all_to_all", "inter")) == 2 * chunks
    assert all(torch.equal(a, b) for a, b in zip(packed, two_messages))


@pytest.mark.parametrize("links,gathers", [(None, 1), (["intra"] * 4, 2)])
def test_weight_gather_messages_follow_the_links(fake_world, links, gathers: int) -> None:
    """One all-gather of codes and scales across nodes (or where the links are unknown), two
    inside a node; same reconstruction either way."""
    fake, check, transport = fake_world
    outs = []
    for link_list in (links, None if links else ["intra"] * 4):
        transport.calls.clear()
        shard = torch.randn(2 * GS, generator=torch.Generator().manual_seed(2)).bfloat16()
        ref = torch.zeros(4 * 2 * GS, dtype=torch.bfloat16)
        out = torch.empty_like(ref)
        weights.quantized_all_gather(
            shard, ref, out, _Group(4), spec=HopSpec(4, GS),
            generator=torch.Generator().manual_seed(1),
            link_of_peer=None if link_list is None else link_list.__getitem__,
            nonfinite_flag=torch.zeros(1, dtype=torch.int32))
        outs.append(out)
        if link_list is links:
            assert [c for c, _ in transport.calls] == ["all_gather"] * gathers
    assert torch.equal(outs[0], outs[1])


class NanCheckingDist(LoopbackDist):
    """The loopback transport with ``TORCH_NCCL_NAN_CHECK=1``'s rule: a floating-point input
    holding NaN stops the collective (NCCL traps on the device)."""

    def _check(self, inp: torch.Tensor) -> None:
        if inp.is_floating_point() and bool(torch.isnan(inp).any()):
            raise RuntimeError(f"NaN check: a {inp.dtype} input of {inp.numel()} holds NaN")

    def all_to_all_single(self, out, inp, group=None, async_op=False):  # noqa: ANN001
        self._check(inp)
        return super().all_to_all_single(out, inp, group, async_op)

    def all_gather_single(self, out, inp, group=None, async_op=False):  # noqa: ANN001
        self._check(inp)
        return super().all_gather_single(out, inp, group, async_op)

    all_gather_into_tensor = all_gather_single


@pytest.mark.parametrize("one_message", [True, False])
def test_a_poisoned_group_passes_nccls_nan_check(fake_world, monkeypatch,
                                                 one_message: bool) -> None:
    """Issue 36: a group holding NaN/Inf gets a NaN scale by design (its step is skipped, the
    flag counts it). Sent as fp32, the intra-node hop's scales (and the intra-only weight
    gather's) trapped in NCCL's NaN check instead; the scales now travel as bytes. The
    gradient and the weights still reach every rank as non-finite, and the flag counts them."""
    fake, check, _ = fake_world
    transport = NanCheckingDist(check)
    _install_transport(monkeypatch, transport)
    for module in (gradients, weights):
        monkeypatch.setattr(module, "_one_message", lambda link: one_message)
    x = torch.randn(4 * 2 * GS * 2, generator=torch.Generator().manual_seed(0))
    x[5] = float("nan")
    x[3 * GS] = float("inf")
    out = torch.empty(x.numel() // 4)
    flag = torch.zeros(1, dtype=torch.int32)
    gradients.two_level_reduce_scatter(
        x, out, _groups_2x2(), intra=HopSpec(8, GS, hadamard=True),
        inter=HopSpec(4, GS, hadamard=True), generator=torch.Generator().manual_seed(1),
        nonfinite_flag=flag, pipeline=2,
        error_feedback=LoCoErrorFeedback().bucket(0))
    assert int(flag) == 2 and not bool(torch.isfinite(out).all())
    shard = torch.randn(2 * GS, generator=torch.Generator().manual_seed(2))
    shard[7] = float("nan")
    ref = torch.zeros(4 * 2 * GS)
    gathered = torch.empty_like(ref)
    weights.quantized_all_gather(
        shard, ref, gathered, _Group(4), spec=HopSpec(4, GS),
        generator=torch.Generator().manual_seed(1), link_of_peer=lambda r: "intra",
        nonfinite_flag=flag)
    assert int(flag) == 3 and not bool(torch.isfinite(gathered).all())
    # the check does trap a NaN in a floating-point input (what the scales were)
    with pytest.raises(RuntimeError, match="NaN check"):
        transport.all_to_all_single(torch.empty(4), torch.full((4,), float("nan")), _Group(4))


def test_cpu_stages_need_no_hand_over(monkeypatch) -> None:
    """Worker threads and inline runs share one allocator timeline: no ``record_stream``."""
    calls = []
    monkeypatch.setenv("QUANT_KERNELS", "torch")
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: calls.append(s))
    _install_transport(monkeypatch, LoopbackDist(StreamAllocationCheck(FakeCuda())))
    _reduce_scatter(CommStreams("thread"), pipeline=2, loco=False, hadamard=False)
    _reduce_scatter(CommStreams("inline"), pipeline=1, loco=True, hadamard=True)
    assert calls == []


@pytest.mark.parametrize("kind", ["cuda", "thread"])
@pytest.mark.parametrize("failing_stage", ["intra", "inter"])
def test_a_failed_job_stops_its_dependents_and_its_stages_with_the_original_error(
        fake_world, failing_stage: str, kind: str) -> None:
    """Item 3: the dependent job is not run (it would enter a collective the failed rank never
    joins, and its own error would hide the cause); the original error reaches every waiter.
    Nor does a later job of a stage that failed (the next bucket's all-to-all would pair with
    the peers' exchange of the failed bucket: wrong data, or a hang)."""
    fake, _, _ = fake_world
    streams = _cuda_streams() if kind == "cuda" else CommStreams("thread")
    ran = []

    def boom() -> None:
        raise ValueError("kernel launch failed")

    first = streams.submit(failing_stage, boom)
    second = streams.submit("weights", lambda: ran.append("second"), after=[first])
    third = streams.submit("inter", lambda: ran.append("third"), after=[second])
    later = streams.submit(failing_stage, lambda: ran.append("next bucket"))
    for job in (first, second, third, later):
        with pytest.raises(ValueError, match="kernel launch failed"):
            job.wait()
    assert ran == []
    fresh = CommStreams("thread")      # stages of another model (another test) are unaffected
    fresh.submit(failing_stage, lambda: ran.append("other model")).wait()
    assert ran == ["other model"]


def test_cuda_stages_have_high_priority(fake_world) -> None:
    fake, _, _ = fake_world
    streams = _cuda_streams()
    for name in ("intra", "inter", "weights"):
        assert streams.stage(name).stream.priority < 0


def test_resumed_quantization_state_lands_on_the_model_device() -> None:
    """Item 2: checkpoints are read with ``map_location="cpu"``; LoCo's error buffers (8-bit codes
    and scales, or dense) and the qWD reference shards must follow the model to its device
    (on a GPU they stayed on the CPU and the first step after a resume mixed devices). The
    "meta" device stands in for CUDA here."""
    from megatron.distributed.quant.config import QuantizationConfig
    from megatron.distributed.quant.runtime import QuantizationRuntime

    for error_bits in (8, 32):
        cfg = QuantizationConfig(quantized_weights=True, quantized_gradients=True, loco=True,
                                 loco_error_bits=error_bits, gq_group_size_intra=GS,
                                 gq_group_size_inter=GS)
        saved = QuantizationRuntime(cfg, _groups_2x2())
        saved.register("b0", 0)
        errors = saved.loco.bucket("b0")
        x = torch.randn(4 * GS)
        errors.update("e1", errors.compensate("e1", x, group_size=GS), torch.zeros_like(x))
        saved.note_weights_updated("b0", torch.randn(2 * GS, dtype=torch.bfloat16))
        state = saved.state_dict()

        resumed = QuantizationRuntime(cfg, _groups_2x2())
        resumed.register("b0", 0)
        resumed.load_state_dict(state, device=torch.device("meta"))
        stored = resumed.loco.bucket("b0")._buf["e1"]
        tensors = [stored.q.codes, stored.q.scales] if stored.q is not None else [stored.dense]
        tensors.append(resumed.reference_shards["b0"])
        assert [t.device.type for t in tensors] == ["meta"] * len(tensors)


def test_quantization_state_of_another_bucket_layout_is_told_apart() -> None:
    """A resharding checkpoint's "same layout" is the parallel sizes; the buckets
    (--ddp-bucket-size, --overlap-grad-reduce) and the ranks per node (the launcher's node shape)
    shape the quantization state too. The runtime records them and names a difference, so the
    trainer re-derives the state (LoCo stopped the first resumed step with a size error)."""
    from megatron.distributed.quant import integration
    from megatron.distributed.quant.config import QuantizationConfig
    from megatron.distributed.quant.runtime import QuantizationRuntime

    cfg = QuantizationConfig(quantized_gradients=True, loco=True, gq_group_size_intra=GS,
                             gq_group_size_inter=GS)

    def runtime(sizes, groups=None) -> QuantizationRuntime:
        rt = QuantizationRuntime(cfg, groups or _groups_2x2())
        for i, n in enumerate(sizes):
            rt.register(f"b{i}", i, n)
        return rt

    state = runtime([4096, 1024]).state_dict()
    assert runtime([4096, 1024]).layout_difference(state) is None
    assert "gradient buckets (2 of" in runtime([2048, 2048, 1024]).layout_difference(state)
    one_node = TwoLevelGroups(dp_group=_Group(4), intra_group=_Group(4), inter_group=None,
                              dp_size=4, dp_rank=0, intra_size=4, inter_size=1, node=0, local=0,
                              dp_ranks=[0, 1, 2, 3])
    assert runtime([4096, 1024], one_node).layout_difference(state) == \
        "data-parallel ranks per node 2 -> 4"
    older = {k: v for k, v in state.items() if k != "layout"}     # saved before it was recorded
    assert runtime([2048]).layout_difference(older) is None

    class Chunk(torch.nn.Module):
        def __init__(self, rt):
            super().__init__()
            self.quant_runtime = rt

    # re-derived at a resume: the counters follow the checkpoint, no iteration is timed
    fresh = runtime([4096])
    integration.reset_quantization_state([Chunk(fresh)], 10)
    assert (fresh.iteration, fresh.last_stepped_iteration, fresh.timing.iterations) == (10, 10, 0)
    saved = {"runtimes": [state]}
    assert integration.quantization_state_difference([Chunk(runtime([4096, 1024]))], saved) is None
    assert "gradient buckets" in integration.quantization_state_difference(
        [Chunk(runtime([4096]))], saved)
