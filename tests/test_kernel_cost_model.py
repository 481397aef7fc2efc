"""bench/kernel_cost_model.py on a recorded SASS snippet: no compiler, no GPU.

The snippet is cut down from ``cuobjdump -sass`` of the middle-hop kernel compiled for sm_90
(a runtime loop over the slots: two 8-byte code loads and a scale load per iteration), with a
spill, shared-memory traffic and a division slow path after the EXIT added in the same format.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import kernel_cost_model as C  # noqa: E402

SASS = """
	code for sm_90a
		Function : _dsum_requant_kernel
	.headerflags	@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                /* 0x00000a00ff017b82 */
                                                                                         /* 0x000fe20000000800 */
        /*0010*/                   S2R R9, SR_TID.X ;                                    /* 0x0000000000097919 */
                                                                                         /* 0x000e2e0000002100 */
        /*0020*/                   STL.64 [R1], R12 ;                                    /* 0x0000000c01007387 */
                                                                                         /* 0x000fe20000100a00 */
        /*0030*/                   CS2R R12, SRZ ;                                       /* 0x00000000000c7805 */
                                                                                         /* 0x000fe4000001ff00 */
        /*0040*/              @!P0 LDG.E.64 R12, desc[UR6][R36.64] ;                     /* 0x00000006240c8981 */
                                                                                         /* 0x000ea4000c1e1b00 */
        /*0050*/              @!P0 LDG.E R24, desc[UR6][R38.64] ;                        /* 0x0000000626188981 */
                                                                                         /* 0x000f22000c1e1900 */
        /*0060*/              @!P0 LDG.E.64 R40, desc[UR6][R36.64+0x8] ;                 /* 0x0000080624288981 */
                                                                                         /* 0x000162000c1e1b00 */
        /*0070*/                   FADD R3, R3, R12 ;                                    /* 0x0000000c03037221 */
                                                                                         /* 0x000fe20000000000 */
        /*0080*/                   UIADD3 UR4, UR4, -0x1, URZ ;                          /* 0xffffffff04047890 */
                                                                                         /* 0x000fe2000fffe03f */
        /*0090*/               @P1 BRA 0x40 ;                                            /* 0xfffffff400201947 */
                                                                                         /* 0x000fea000383ffff */
        /*00a0*/                   STS [R0+UR4], R13 ;                                   /* 0x0000000d00007988 */
                                                                                         /* 0x000fe20008000804 */
        /*00b0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                         /* 0x0000000000007b1d */
                                                                                         /* 0x000fec0000010000 */
        /*00c0*/                   LDS.128 R4, [R10] ;                                   /* 0x000000000a047984 */
                                                                                         /* 0x000e280000000c00 */
        /*00d0*/                   LDL.64 R12, [R1] ;                                    /* 0x00000000010c7983 */
                                                                                         /* 0x000ea20000100a00 */
        /*00e0*/                   NOP ;                                                 /* 0x0000000000007918 */
                                                                                         /* 0x000fc00000000000 */
        /*00f0*/               @P0 EXIT ;                                                /* 0x000000000000094d */
                                                                                         /* 0x000fea0003800000 */
        /*0100*/                   STG.E.128 desc[UR6][R36.64], R4 ;                     /* 0x0000000424007986 */
                                                                                         /* 0x000fe2000c101d06 */
        /*0110*/                   EXIT ;                                                /* 0x000000000000794d */
                                                                                         /* 0x000fea0003800000 */
        /*0120*/                   FCHK P0, R5, R4 ;                                     /* 0x0000000405007302 */
                                                                                         /* 0x000e220000000000 */
        /*0130*/                   LDG.E R4, desc[UR6][R2.64] ;                          /* 0x0000000602047981 */
                                                                                         /* 0x000ea4000c1e1900 */
        /*0140*/                   BRA 0x140;                                            /* 0xfffffffc00fc7947 */
                                                                                         /* 0x000fc0000383ffff */
"""


def test_parse_reads_every_instruction_with_its_predicate() -> None:
    ins = C.parse_sass(SASS, "_dsum_requant_kernel")
    assert len(ins) == 21
    assert (ins[0].address, ins[0].op, ins[0].predicated) == (0, "LDC", False)
    assert (ins[4].op, ins[4].predicated) == ("LDG.E.64", True)
    assert ins[-1].op == "BRA" and ins[-1].address == 0x140
    assert C.parse_sass(SASS, "no_such_kernel") == ins        # no such function: the first one


def test_counts_weight_the_loop_by_its_trips_and_stop_at_the_exit() -> None:
    counts = C.count(C.parse_sass(SASS), trips=8)
    # main body: 18 instructions up to the unpredicated EXIT, minus the NOP = 17; the loop
    # (0x40..0x90, 6 instructions) runs 8 times: 17 + 6 * 7
    assert counts.instructions == 17 + 6 * 7
    assert counts.loops == 1
    assert counts.global_load_bytes == 8 * (8 + 4 + 8)     # the slow path's LDG after EXIT: out
    assert counts.in_flight_load_bytes == 8 + 4 + 8       # one slot's loads at a time
    assert counts.global_store_bytes == 16
    assert counts.local_bytes == 8 + 8                     # STL.64 + LDL.64
    assert counts.shared_bytes == 4 + 16                   # STS + LDS.128
    assert counts.barriers == 1
    once = C.count(C.parse_sass(SASS), trips=1)
    assert once.instructions == 17 and once.global_load_bytes == 20


def test_occupancy_from_registers_warps_and_shared_memory() -> None:
    dev = C.H200
    assert C.ctas_per_sm(dev, 128, 4, 0) == 4              # 65536 / (128 * 128)
    assert C.ctas_per_sm(dev, 255, 4, 0) == 2              # allocated as 256 per thread
    assert C.ctas_per_sm(dev, 32, 4, 0) == 16              # 64 warps per SM at most
    assert C.ctas_per_sm(dev, 32, 4, 100 * 1024) == 2      # 228 KiB of shared memory per SM
    assert C.ctas_per_sm(dev, 64, 8, 0) == 4


def test_estimate_picks_the_bound_and_its_percent_of_copy() -> None:
    dev = dataclasses.replace(C.H200, overlap_exponent=math.inf)   # the largest bound alone
    # a copy-like kernel: 8 B per element, 4 instructions per element, plenty in flight
    copy = C.SassCounts(instructions=4 * 32, global_load_bytes=128, global_store_bytes=128,
                        local_bytes=0, shared_bytes=0, barriers=0, in_flight_load_bytes=128,
                        loops=0)
    shape = C.KernelShape(elements_per_program=4096, num_warps=4, bytes_per_element=8.0, regs=32,
                          smem_bytes=0)
    est = C.estimate(copy, shape, 1 << 28, dev)
    assert est.bound == "memory" and est.percent_of_copy == pytest.approx(100.0)
    assert est.instructions_per_element == pytest.approx(4.0)
    # the same kernel issuing 100 instructions per element is issue bound, at the issue rate
    busy = C.SassCounts(**{**copy.__dict__, "instructions": 100 * 32})
    est = C.estimate(busy, shape, 1 << 28, dev)
    warp_instr = (1 << 28) / 4096 * 4 * 100 * 32
    rate = 4 * dev.sms * dev.clock_hz * dev.issue_efficiency
    assert est.bound == "issue" and est.seconds == pytest.approx(warp_instr / rate)
    # one slot of 4 bytes in flight per thread: latency bound (Little's law)
    starved = C.SassCounts(**{**copy.__dict__, "in_flight_load_bytes": 4})
    est = C.estimate(starved, shape, 1 << 28, dev)
    in_flight = dev.sms * 16 * 128 * 4                      # 16 CTAs of 128 threads (32 regs)
    loaded = (1 << 28) / 4096 * 128 * 128
    assert est.bound == "latency"
    assert est.latency_s == pytest.approx(loaded / (in_flight / dev.mem_latency_s))
    # spills add local-memory traffic per element
    spilling = C.SassCounts(**{**copy.__dict__, "local_bytes": 64})
    est = C.estimate(spilling, shape, 1 << 28, dev)
    assert est.local_bytes_per_element == pytest.approx(2.0)
    assert est.percent_of_copy == pytest.approx(100 * 8 / 10)
    # the fitted overlap (p-norm) is slower than the largest bound alone when two are close
    both = C.estimate(C.SassCounts(**{**copy.__dict__, "instructions": 24 * 32}), shape, 1 << 28)
    assert both.seconds > max(both.memory_s, both.issue_s)


def test_calibration_targets_are_the_documented_table() -> None:
    """The measured figures the model is fitted on are docs/performance.md's 256M column."""
    doc = (C.REPO / "docs" / "performance.md").read_text(encoding="utf-8")
    for pct in (40.7, 29.9, 28.3, 17.8, 36.1, 75.0, 80.6, 51.9, 83.5, 87.6, 82.8):
        assert f"{pct}" in doc, pct
    assert set(C.MEASURED_256M.values()) == {40.7, 29.9, 28.3, 17.8, 36.1, 75.0, 80.6, 51.9,
                                             83.5, 87.6, 82.8}


def test_loop_trips_follow_the_final_hops_chunks_of_eight_slots() -> None:
    """Up to 8 slots the kernels are unrolled (no loop); beyond, the final hop loops over chunks
    of 8 (triton_device.SOURCES_UNROLLED) and the rest is straight-line code."""
    assert C.SOURCES_UNROLLED == 8
    assert [C.loop_trips({"S": s}) for s in (1, 2, 4, 8, 16, 11, 24)] == [1, 2, 4, 8, 2, 1, 3]
    assert C.loop_trips({}) == 1
    src = (C.REPO / "megatron" / "distributed" / "quant" / "kernels" /
           "triton_device.py").read_text(encoding="utf-8")
    assert "SOURCES_UNROLLED = tl.constexpr(8)" in src
    assert C.shape_of("_dsum_kernel", {"S": 16, "BLOCK": 4096}, 6.0, 64, 0, 4).trips == 2
