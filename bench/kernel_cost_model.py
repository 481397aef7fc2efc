#!/usr/bin/env python3
"""A static cost model of the Triton kernels from their compiled SASS: time per call on a GPU
that this machine does not have.

    python bench/kernel_cost_model.py --calibrate            # against the 2026-11-27 H200 table
    python bench/triton_aot.py --targets sm_90               # prints the modelled % beside regs

Why: the kernels are compiled ahead of time on CPU machines (bench/triton_aot.py), and sessions
without a GPU still have to choose between formulations (a loop over slots or unrolled loads, a
tile size, a register budget). The SASS says what a thread issues; with the bytes a kernel must
move and the GPU's figures, three bounds follow, and the modelled time combines them (their
p-norm, ``OVERLAP_EXPONENT``: close to the largest when one dominates):

* memory: bytes the kernel must move (+ local-memory spill traffic) / the HBM bandwidth a copy
  reaches;
* issue: warp instructions issued (the main body, loop bodies times their trip count) / (4
  schedulers x SMs x clock x the issue efficiency fitted on the measured table);
* latency: Little's law, bytes in flight per SM (resident threads at the occupancy the registers
  and shared memory allow x the global-load bytes a thread has outstanding in one phase: the
  whole straight-line body, or one iteration of a loop) / the loaded HBM latency.

Shared-memory traffic (LDS/STS bytes) is a fourth bound at 128 B per clock per SM. Modelled,
not measured: calibrate() compares it with the H200 measurements of docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent


ISSUE_EFFICIENCY = 0.55
OVERLAP_EXPONENT = 3.0
"""Fitted on the 2026-11-27 H200 table (calibrate(); docs/performance.md): the two free
parameters of the model."""


@dataclasses.dataclass(frozen=True)
class Device:
    """What the model needs to know about a GPU (sm_90 limits per SM)."""

    name: str
    hbm_bytes_per_s: float
    """Peak HBM bandwidth."""
    copy_fraction: float
    """Of the peak, what a device-to-device copy reaches: the memory bound's bandwidth."""
    sms: int
    clock_hz: float
    issue_efficiency: float
    """Fraction of the schedulers' peak issue rate (1 warp instruction / clock each) a memory
    streaming kernel sustains (dependency and memory stalls): fitted on the measured table."""
    mem_latency_s: float
    """Loaded HBM latency of a global load, for Little's law."""
    overlap_exponent: float
    """How the bounds combine: their p-norm with this p (infinity: the largest bound alone,
    perfect overlap of memory traffic and issue; the fitted 3: a kernel whose memory and issue
    times are equal runs at about 1.26 x either)."""
    schedulers_per_sm: int = 4
    regs_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_ctas_per_sm: int = 32
    smem_per_sm: int = 228 * 1024
    smem_bytes_per_clock: int = 128

    @property
    def copy_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.copy_fraction


H200 = Device(name="H200 (sm_90)", hbm_bytes_per_s=4.8e12, copy_fraction=4.11 / 4.8, sms=132,
              clock_hz=1.98e9, issue_efficiency=ISSUE_EFFICIENCY, mem_latency_s=800e-9,
              overlap_exponent=OVERLAP_EXPONENT)
"""4.8 TB/s HBM3e, 132 SMs, 1.98 GHz boost; the copy reached 4.11 TB/s at 256M elements in the
2026-11-27 run; issue efficiency and latency are fitted / assumed (see calibrate())."""


# ------------------------------------------------------------------------------------------------
# SASS
# ------------------------------------------------------------------------------------------------

_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_WIDTH = re.compile(r"\.(64|128|U8|S8|U16|S16)\b")


def _access_bytes(op: str) -> int:
    m = _WIDTH.search(op)
    if m is None:
        return 4
    return {"64": 8, "128": 16, "U8": 1, "S8": 1, "U16": 2, "S16": 2}[m.group(1)]


@dataclasses.dataclass(frozen=True)
class Instruction:
    address: int
    predicated: bool
    op: str
    operands: str


def parse_sass(text: str, kernel: Optional[str] = None) -> List[Instruction]:
    """The instructions of one function of ``cuobjdump -sass`` / ``nvdisasm`` output (the first
    function, or the one named ``kernel``), in address order."""
    if kernel is not None:
        start = text.find(f"Function : {kernel}")
        if start >= 0:
            text = text[start:]
            nxt = text.find("Function : ", len("Function : "))
            text = text if nxt < 0 else text[:nxt]
    return [Instruction(int(m.group(1), 16), m.group(2) is not None, m.group(3), m.group(4))
            for m in _SASS_LINE.finditer(text)]


@dataclasses.dataclass(frozen=True)
class SassCounts:
    """Per thread and per program, over the instructions a thread issues (the main body up to its
    final unpredicated EXIT, loop bodies counted ``trips`` times; slow-path subroutines after the
    EXIT are left out)."""

    instructions: float
    global_load_bytes: float
    global_store_bytes: float
    local_bytes: float
    """LDL + STL bytes (register spills and stack)."""
    shared_bytes: float
    """LDS + STS bytes."""
    barriers: float
    in_flight_load_bytes: float
    """Global-load bytes a thread has outstanding in one phase: the straight-line body's, or the
    largest loop body's per iteration."""
    loops: int


def count(instrs: Sequence[Instruction], trips: int = 1) -> SassCounts:
    """Counts of one function's instructions; every loop (a backward branch) runs ``trips``
    times (the kernels' only loop is the final hop's over chunks of slots: :func:`loop_trips`)."""
    body: List[Instruction] = []
    for ins in instrs:
        if ins.op == "NOP":
            continue
        body.append(ins)
        if ins.op == "EXIT" and not ins.predicated:
            break
    weight = [1.0] * len(body)
    loops: List[Tuple[int, int]] = []
    for i, ins in enumerate(body):
        if ins.op.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", ins.operands)
            if m and int(m.group(1), 16) < ins.address:
                target = int(m.group(1), 16)
                first = next(j for j, x in enumerate(body) if x.address >= target)
                loops.append((first, i))
                for j in range(first, i + 1):
                    weight[j] *= trips
    tot: Dict[str, float] = {"ldg": 0.0, "stg": 0.0, "local": 0.0, "shared": 0.0, "bar": 0.0}
    for ins, w in zip(body, weight):
        op = ins.op
        if op.startswith("LDG"):
            tot["ldg"] += w * _access_bytes(op)
        elif op.startswith(("STG", "RED", "ATOMG")):
            tot["stg"] += w * _access_bytes(op)
        elif op.startswith(("LDL", "STL")):
            tot["local"] += w * _access_bytes(op)
        elif op.startswith(("LDS", "STS")):
            tot["shared"] += w * _access_bytes(op)
        elif op.startswith("BAR"):
            tot["bar"] += w
    in_loop = [sum(_access_bytes(x.op) for x in body[a:b + 1] if x.op.startswith("LDG"))
               for a, b in loops]
    outside = tot["ldg"] - sum(in_loop) * trips
    in_flight = max([outside] + in_loop)
    return SassCounts(instructions=sum(weight), global_load_bytes=tot["ldg"],
                      global_store_bytes=tot["stg"], local_bytes=tot["local"],
                      shared_bytes=tot["shared"], barriers=tot["bar"],
                      in_flight_load_bytes=in_flight, loops=len(loops))


# ------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------

def ctas_per_sm(dev: Device, regs: int, num_warps: int, smem_bytes: int) -> int:
    """Resident CTAs per SM: registers (allocated per warp in units of 256), warps, CTA slots and
    shared memory, whichever binds first."""
    regs_per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = dev.regs_per_sm // (regs_per_warp * num_warps)
    by_warps = dev.max_warps_per_sm // num_warps
    by_smem = dev.smem_per_sm // smem_bytes if smem_bytes > 0 else dev.max_ctas_per_sm
    return max(0, min(by_regs, by_warps, by_smem, dev.max_ctas_per_sm))


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """What the model needs besides the SASS: per program, the elements it covers (the unit of
    ``bytes_per_element``) and its threads; the bytes each element must move in HBM."""

    elements_per_program: int
    num_warps: int
    bytes_per_element: float
    regs: int
    smem_bytes: int
    trips: int = 1


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Modelled time of one call over ``elements`` and its bounds (seconds)."""

    elements: float
    memory_s: float
    issue_s: float
    latency_s: float
    shared_s: float
    occupancy_warps: int
    instructions_per_element: float
    local_bytes_per_element: float
    shared_bytes_per_element: float
    copy_s: float
    """A copy of the same bytes at the device's copy bandwidth: the % column's numerator."""
    overlap_exponent: float = math.inf

    @property
    def seconds(self) -> float:
        bounds = (self.memory_s, self.issue_s, self.latency_s, self.shared_s)
        p = self.overlap_exponent
        if math.isinf(p):
            return max(bounds)
        top = max(bounds)
        return top * sum((b / top) ** p for b in bounds) ** (1.0 / p) if top > 0 else 0.0

    @property
    def bound(self) -> str:
        bounds = {"memory": self.memory_s, "issue": self.issue_s, "latency": self.latency_s,
                  "shared": self.shared_s}
        return max(bounds, key=bounds.get)

    @property
    def percent_of_copy(self) -> float:
        return 100.0 * self.copy_s / self.seconds if self.seconds > 0 else 0.0


def estimate(counts: SassCounts, shape: KernelShape, elements: float,
             dev: Device = H200) -> Estimate:
    """The modelled time of a call over ``elements`` (module docstring)."""
    threads = shape.num_warps * 32
    per_thread = shape.elements_per_program / threads
    programs = elements / shape.elements_per_program
    local_pe = counts.local_bytes / per_thread
    moved = elements * shape.bytes_per_element
    memory = (moved + elements * local_pe) / dev.copy_bytes_per_s
    warp_instr = programs * shape.num_warps * counts.instructions
    issue = warp_instr / (dev.schedulers_per_sm * dev.sms * dev.clock_hz * dev.issue_efficiency)
    ctas = ctas_per_sm(dev, shape.regs, shape.num_warps, shape.smem_bytes)
    if ctas == 0:
        latency = float("inf")
    else:
        in_flight = dev.sms * ctas * threads * max(counts.in_flight_load_bytes, 1.0)
        loaded = programs * threads * counts.global_load_bytes
        latency = loaded / (in_flight / dev.mem_latency_s)
    shared = programs * threads * counts.shared_bytes / (dev.smem_bytes_per_clock * dev.sms
                                                         * dev.clock_hz)
    return Estimate(elements=elements, memory_s=memory, issue_s=issue, latency_s=latency,
                    shared_s=shared, occupancy_warps=ctas * shape.num_warps,
                    instructions_per_element=counts.instructions / per_thread,
                    local_bytes_per_element=local_pe,
                    shared_bytes_per_element=counts.shared_bytes / per_thread,
                    copy_s=moved / dev.copy_bytes_per_s,
                    overlap_exponent=dev.overlap_exponent)


# ------------------------------------------------------------------------------------------------
# from a triton_aot.py specialisation
# ------------------------------------------------------------------------------------------------

def disassemble(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin, with the cuobjdump the triton wheel ships."""
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], check=True, capture_output=True,
                              text=True).stdout


def elements_per_program(kernel: str, constexprs: Dict[str, object]) -> int:
    """Elements one program covers, in the unit of triton_aot.traffic (input elements for
    quantize, output elements for the hops)."""
    c = constexprs
    if kernel in ("_quantize_kernel", "_dsum_requant_kernel"):
        return int(c["R"]) * int(c["GS"])
    return int(c["BLOCK"])


SOURCES_UNROLLED = 8
"""triton_device.SOURCES_UNROLLED: a summing kernel over more slots loops over chunks of 8."""


def loop_trips(constexprs: Dict[str, object]) -> int:
    """How often a specialisation's loop body runs: the kernels' only loop is the final hop's
    over chunks of SOURCES_UNROLLED slots when S exceeds it (S // 8 iterations; the rest of S is
    straight-line code); S up to 8 is fully unrolled (no loop: the value does not matter)."""
    s = int(constexprs.get("S", 1))
    return s // SOURCES_UNROLLED if s > SOURCES_UNROLLED else s


def shape_of(kernel: str, constexprs: Dict[str, object], bytes_per_element: float, regs: int,
             smem_bytes: int, num_warps: int) -> KernelShape:
    """The KernelShape of one compiled specialisation (its loop runs :func:`loop_trips` times)."""
    return KernelShape(elements_per_program=elements_per_program(kernel, constexprs),
                       num_warps=num_warps, bytes_per_element=bytes_per_element, regs=regs,
                       smem_bytes=smem_bytes, trips=loop_trips(constexprs))


# ------------------------------------------------------------------------------------------------
# calibration on the 2026-11-27 H200 measurements
# ------------------------------------------------------------------------------------------------

CALIBRATION_COMMIT = "4f5975c"
"""The kernels the measurements below timed (triton_kernels.py of that commit: Philox-10, the
permute/split/join butterfly, packed-row middle and final hops)."""

MEASURED_256M = {
    # name: (% of copy bandwidth at 256M elements, docs/performance.md table)
    "quantize SR": 40.7,
    "quantize+HT32 SR": 29.9,
    "quantize_partitions(4)+HT SR": 28.3,
    "dequant_sum_requant S=4 SR": 17.8,
    "dequant_sum_requant S=4 SR 8-bit": 36.1,
    "dequant_sum S=4": 75.0,
    "dequant_sum S=4 8-bit": 80.6,
    "quantize_difference bf16 SR": 51.9,
    "dequantize": 83.5,
    "dequantize 8-bit": 87.6,
    "dequantize_add bf16": 82.8,
}
"""H200, 2026-11-27, ``bench_quant.py --sizes ... --bits 4[,8] --group-size 128`` (one call +
synchronize per timing: a host round trip or two per call is inside these figures)."""

CALIBRATION_ELEMENTS = 256 << 20


def _calibration_calls(T, torch):
    """(name, elements in the model's unit, call) of bench_quant.py's rows on small CPU tensors
    (the same specialisations: every size a multiple of 16)."""
    from megatron.distributed.quant.kernels import reference as R

    n = 4 * 4096 * 4
    x = torch.zeros(n)
    g = torch.Generator().manual_seed(3)
    N = CALIBRATION_ELEMENTS
    q4 = R.quantize(torch.randn(n), 4, 128, stochastic=False)
    q8 = R.quantize(torch.randn(n), 8, 128, stochastic=False)
    ref = torch.zeros(n, dtype=torch.bfloat16)
    return [
        ("quantize SR", N, lambda: T.quantize(x, 4, 128, generator=g, check_finite=False)),
        ("quantize+HT32 SR", N, lambda: T.quantize(x, 4, 128, hadamard=True, generator=g,
                                                    check_finite=False)),
        ("quantize_partitions(4)+HT SR", N, lambda: T.quantize_partitions(
            x, 4, [0, 2, 1, 3], 4, 128, hadamard=True, generator=g, check_finite=False)),
        ("dequant_sum_requant S=4 SR", N // 4, lambda: T.dequantize_sum_requantize(q4, 4, 4,
                                                                                   generator=g)),
        ("dequant_sum_requant S=4 SR 8-bit", N // 4,
         lambda: T.dequantize_sum_requantize(q8, 4, 8, generator=g)),
        ("dequant_sum S=4", N // 4, lambda: T.dequantize_sum(q4, 4, out=torch.empty(n // 4))),
        ("dequant_sum S=4 8-bit", N // 4, lambda: T.dequantize_sum(q8, 4,
                                                                   out=torch.empty(n // 4))),
        ("quantize_difference bf16 SR", N, lambda: T.quantize_difference(
            x, ref, 4, 128, generator=g, check_finite=False)),
        ("dequantize", N, lambda: T.dequantize(q4)),
        ("dequantize 8-bit", N, lambda: T.dequantize(q8)),
        ("dequantize_add bf16", N, lambda: T.dequantize_add(q4, ref)),
    ]


def calibration_rows(kernels_file: Path, dev: Device = H200) -> List[Dict[str, object]]:
    """Compile (sm_90) the kernels of ``kernels_file`` (a launcher module holding its own jit
    kernels, like ``git show 4f5975c:.../triton_kernels.py``) as bench_quant.py called them, and
    model each measured row at 256M elements."""
    import importlib.util
    import tempfile

    import torch

    sys.path.insert(0, str(REPO / "bench"))
    sys.path.insert(0, str(REPO))
    import triton_aot as A

    name = "megatron.distributed.quant.kernels._calibration_kernels"
    spec = importlib.util.spec_from_file_location(name, kernels_file)
    T = importlib.util.module_from_spec(spec)
    sys.modules[name] = T
    spec.loader.exec_module(T)
    entries = A.entry_kernels(T)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for label, elements, call in _calibration_calls(T, torch):
            sink: List[A.Launch] = []
            cur = [A.Scenario(label, False, lambda T: None)]
            for k, fn in entries.items():
                setattr(T, k, A._Recorder(k, fn, sink, cur))
            try:
                call()
            finally:
                for k, fn in entries.items():
                    setattr(T, k, fn)
            sp = A.specialise(sink[-1], 90)
            rec, cubin = A.compile_spec(sp, scratch)
            rows.append(model_row(sp, rec, cubin, elements, dev) | {
                "name": label, "measured_pct": MEASURED_256M[label]})
    return rows


def shape_of_record(sp: Any, rec: Dict[str, Any], traffic: Tuple[float, float, str]) -> Any:
    """:func:`shape_of` of a compiled triton_aot.py specialisation ``sp``, from its compile
    record ``rec`` and its traffic (bytes read, bytes written, unit)."""
    return shape_of(sp.kernel, sp.constexpr_by_name, traffic[0] + traffic[1], int(rec["regs"]),
                    int(rec["smem_dynamic"]) + int(rec.get("smem_static", 0)),
                    int(rec["num_warps"]))


def model_row(sp, rec: Dict[str, object], cubin: bytes, elements: float,
              dev: Device = H200) -> Dict[str, object]:
    """Model one compiled triton_aot.py specialisation at ``elements`` (its traffic unit)."""
    import triton_aot as A

    shape = shape_of_record(sp, rec, A.traffic(sp))
    counts = count(parse_sass(disassemble(cubin), sp.kernel), shape.trips)
    est = estimate(counts, shape, elements, dev)
    return {"counts": counts, "shape": shape, "elements": elements,"kernel": sp.kernel, "modelled_pct": est.percent_of_copy, "bound": est.bound,
            "instr_per_elem": est.instructions_per_element,
            "local_B_per_elem": est.local_bytes_per_element,
            "shared_B_per_elem": est.shared_bytes_per_element,
            "warps_per_sm": est.occupancy_warps, "seconds": est.seconds, "regs": rec["regs"],
            "loops": counts.loops}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibrate", type=Path, required=True, metavar="KERNELS_FILE",
                    help="a launcher module with its own kernels, e.g. git show "
                         f"{CALIBRATION_COMMIT}:megatron/distributed/quant/kernels/triton_kernels.py")
    ap.add_argument("--fit", action="store_true", help="also grid-fit the two free parameters")
    args = ap.parse_args(argv)
    rows = calibration_rows(args.calibrate)
    print(calibration_table(rows))
    if args.fit:
        print("\nfit (issue efficiency, overlap exponent) -> worst |error|:")
        for eta, p, worst in fit(rows)[:5]:
            print(f"  {eta:.2f} {p:g} -> {worst:.1f} %")
    return 0


def _pct(r: Dict[str, object], dev: Device) -> float:
    return estimate(r["counts"], r["shape"], r["elements"], dev).percent_of_copy


def calibration_table(rows: Sequence[Dict[str, object]], dev: Device = H200) -> str:
    """Markdown: measured against modelled (this model, and with the largest bound alone)."""
    alone = dataclasses.replace(dev, overlap_exponent=math.inf)
    out = ["| kernel (H200, 256M, group 128) | measured % | modelled % | error | largest bound "
           "alone % | bound | instr/elem | warps/SM |", "|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        est = estimate(r["counts"], r["shape"], r["elements"], dev)
        err = (est.percent_of_copy - r["measured_pct"]) / r["measured_pct"] * 100
        out.append(f"| {r['name']} | {r['measured_pct']:.1f} | {est.percent_of_copy:.1f} | "
                   f"{err:+.0f} % | {_pct(r, alone):.1f} | {est.bound} | "
                   f"{est.instructions_per_element:.1f} | {est.occupancy_warps} |")
    return "\n".join(out)


def fit(rows: Sequence[Dict[str, object]], dev: Device = H200) -> List[Tuple[float, float, float]]:
    """(issue efficiency, overlap exponent, worst relative error %) over a grid, best first."""
    res = []
    for eta in [x / 100 for x in range(40, 81, 5)]:
        for p in (1.5, 2.0, 3.0, 4.0, math.inf):
            d = dataclasses.replace(dev, issue_efficiency=eta, overlap_exponent=p)
            worst = max(abs(_pct(r, d) / r["measured_pct"] - 1) * 100 for r in rows)
            res.append((eta, p, worst))
    return sorted(res, key=lambda t: t[2])


if __name__ == "__main__":
    sys.exit(main())
