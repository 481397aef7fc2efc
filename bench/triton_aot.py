#!/usr/bin/env python3
"""Ahead-of-time compile every Triton kernel specialisation the trainer can launch, without a GPU.

    python bench/triton_aot.py --targets sm_80,sm_90            # full set, table on stdout
    python bench/triton_aot.py --quick                          # one per entry kernel x target (CI)
    python bench/triton_aot.py --markdown > table.md            # the table of docs/performance.md
    python bench/triton_aot.py --list                           # the specialisations, no compile

Why: the Triton kernels are tested only under ``TRITON_INTERPRET=1`` on CPU machines, which
never runs the compiler. A constexpr combination that the real compiler (Triton -> PTX -> ptxas)
rejects, or that spills registers, would only show up on the first GPU. Triton and ptxas both
ship in the triton wheel, so every specialisation can be compiled here for sm_80 / sm_90 and its
registers, spills and shared memory read from ptxas.

How the specialisations are found (nothing is re-derived by hand):

1. The flag space: bits from ``config.SUPPORTED_BITS``; group sizes and the Hadamard block from
   the ``QuantizationConfig`` defaults plus every value the recipes in ``examples/`` pass; input
   dtypes from what the call sites in ``collectives/`` / ``loco.py`` / ``paro/`` hand to
   the kernels (fp32 / bf16 gradient buffers, bf16 / fp32 / fp16 parameters).
2. For each reachable combination, the *launcher's own* host function in ``triton_launch.py``
   (``quantize_partitions``, ``dequantize_sum_requantize``, ...) is called on small CPU tensors
   while each entry kernel is replaced by a recorder, so the block sizes (``R``, ``GP``,
   ``BLOCK``) and every constexpr come from the launcher itself.
3. Each recorded launch is turned into ``(signature, constexprs, attrs, options)`` by Triton's own
   JIT binder (``create_function_from_signature`` + ``JITFunction._pack_args``), i.e. exactly the
   specialisation (pointer alignment, ``== 1`` and ``% 16`` integer specialisation, launch options
   such as ``enable_fp_fusion=False``) the JIT would compile on a GPU, then compiled with
   ``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``.

Every ``@triton.jit`` function of ``triton_device.py`` that no other jit function calls is an
entry kernel; one that no scenario launches is an error (a new kernel must be added to the
scenarios here).

Results are cached per (kernel source hash incl. its jit callees, specialisation, target, options,
Triton version, cache-invalidating env vars) under ``--cache-dir`` (default
``$XDG_CACHE_HOME/sdp4bit-megatron/triton_aot`` or ``~/.cache/...``): a JSON record plus the cubin,
written atomically and checked against the cubin's sha256 when read back, so a repeated CI run
only re-compiles what changed.

The byte columns are a static traffic model (from the argument dtypes, bits and group sizes, not
measured): bytes read + written in HBM per element, and the time to move that many bytes for a
1.3e9-element bucket at the H100 SXM HBM3 bandwidth of 3.35 TB/s, the floor for a memory-bound
kernel. The last column is bench/kernel_cost_model.py's modelled % of copy bandwidth on an H200
(from the SASS: instructions per element, local and shared memory traffic, occupancy; modelled,
not measured) and the bound that sets it.

Budget: a reachable specialisation with a register spill, a stack frame or more than
``MAX_REGISTERS`` registers is reported as OVER BUDGET and fails the run. Exit status: 0 all
compiled within budget, 1 a compile failed or a specialisation is over budget, 2 a usage /
coverage error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
SCHEMA = 2                       # bump when the cached record's fields change
HBM_BYTES_PER_S = 3.35e12        # H100 SXM HBM3
BUCKET_ELEMENTS = 1.3e9          # a 1.3B-parameter model's gradient / weight bucket
GPUS_PER_NODE = 8                # D: the layout's GPUs per node (shard geometry of the scenarios)
NODES = 4                        # M: nodes of the scenarios' layout
SOURCE_COUNTS = (2, 4, 8)
"""Slots S the middle and final hops sum: GPUs per node (the middle hop, LoCo's intra sum) and
nodes or GPUs per node (the final hop). 8 is what an 8-GPU node with TP 1 runs; 4 and 2 are TP 2
and TP 4 (or 2 and 4 nodes). S is a constexpr, so each is its own specialisation."""
FINAL_SOURCE_COUNTS = SOURCE_COUNTS + (16,)
"""Slots S the final hop sums: the nodes of the layout (M) on a two-level one, so 16 at 16 x 8
GPUs as well as the GPUs per node of a one-level layout."""
DEFAULT_TARGETS = "sm_80,sm_90"
MAX_REGISTERS = 128
"""Register budget per thread: 4 CTAs of 128 threads per SM, enough loads in flight for HBM
(bench/kernel_cost_model.py). A reachable specialisation over it, or with any spill or stack,
fails the run."""
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8, "u8": 1, "i8": 1, "i32": 4}
# The SDP4Bit sample recipe (examples/sdp4bit/common.sh): what --quick compiles per kernel.
SDP4BIT_RECIPE = {"bits_intra": 8, "gs_intra": 128, "bits_inter": 4, "gs_inter": 128,
                  "wbits": 4, "wgs": 2048}


class AotError(Exception):
    """A usage or coverage problem (exit status 2), as opposed to a compile failure (1)."""


# ------------------------------------------------------------------------------------------------
# the flag space
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FlagSpace:
    """Values of the quantization flags whose kernels we compile (defaults + recipes)."""

    bits: Tuple[int, ...]
    gs_intra: Tuple[int, ...]
    gs_inter: Tuple[int, ...]
    gs_weight: Tuple[int, ...]
    hadamard_blocks: Tuple[int, ...]


_RECIPE_FLAG_RE = re.compile(
    r"--(wq-group-size|gq-group-size-intra|gq-group-size-inter|hadamard-block-size)[ =]+(\d+)")


def flag_space(examples_dir: Path = REPO / "examples") -> FlagSpace:
    """Defaults from ``QuantizationConfig`` plus every group size / Hadamard block the recipes pass.

    Reading the recipes (instead of listing values here) keeps the AOT set in step with them."""
    from megatron.distributed.quant.config import SUPPORTED_BITS, QuantizationConfig

    d = QuantizationConfig()
    found: Dict[str, set] = {"wq-group-size": {d.wq_group_size},
                             "gq-group-size-intra": {d.gq_group_size_intra},
                             "gq-group-size-inter": {d.gq_group_size_inter},
                             "hadamard-block-size": {d.hadamard_block_size}}
    for path in sorted(examples_dir.rglob("*.sh")):
        for flag, value in _RECIPE_FLAG_RE.findall(path.read_text(encoding="utf-8")):
            found[flag].add(int(value))
    return FlagSpace(bits=tuple(sorted(SUPPORTED_BITS)),
                     gs_intra=tuple(sorted(found["gq-group-size-intra"])),
                     gs_inter=tuple(sorted(found["gq-group-size-inter"])),
                     gs_weight=tuple(sorted(found["wq-group-size"])),
                     hadamard_blocks=tuple(sorted(found["hadamard-block-size"])))


# ------------------------------------------------------------------------------------------------
# scenarios: calls of the launcher's host functions that the trainer makes
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Scenario:
    """One host-function call the trainer can make; ``run(T)`` performs it on CPU tensors."""

    used_by: str
    quick: bool
    run: Callable[[Any], None]


def _typical_generator(T) -> Any:
    """A CPU generator whose first stochastic-rounding seed (drawn by the launcher's own ``_seed``)
    is neither 1 nor a multiple of 16: the specialisation 15 of 16 launches get (the JIT
    specialises the int ``seed`` argument on ``== 1`` and ``% 16``)."""
    import torch

    for k in range(1000):
        probe = torch.Generator().manual_seed(k)
        s = T._seed(True, probe)
        if s != 1 and s % 16:
            return torch.Generator().manual_seed(k)
    raise AotError("no generator seed gives a typical stochastic-rounding seed")


def scenarios(space: FlagSpace) -> List[Scenario]:
    """Every launcher call reachable from the flags, grouped by the call site that makes it.

    Call sites (megatron/distributed/quant/): collectives.gradients.two_level_reduce_scatter (TLq /
    TLq-HS: hop 1 ``quantize_partitions`` into D*M destination slots, middle
    ``dequantize_sum_requantize`` over D sources, final ``dequantize_sum`` over M (or D) sources
    into the fp32 grad shard; with LoCo hop 1's residual ``h - sent`` is one
    ``dequantize_partitions`` over the slot table, the middle hop is ``dequantize_sum`` +
    ``quantize`` + ``dequantize`` instead and loco.py stores 8-bit error buffers);
    collectives.weights.quantized_all_gather (qWD:
    ``quantize_difference`` + ``dequantize_add``; qW: ``quantize`` + ``dequantize`` into the
    param buffer, and the PaRO engine's sync_params through the runtime: fp32 optimizer-state
    shard vs the param dtype). The trainer's first quantization of a payload (hop 1, the qWD and
    qW sends) gets the runtime's per-step NaN/Inf counter (``nonfinite_counter``: the kernel's
    fused ``CHECK``, agreed on across ranks once per step); its other quantizations pass
    ``check_finite=False``; the public-API default ``check_finite=True`` (bench_quant.py, tests)
    is the last group. Sizes mimic a padded bucket (every count a multiple of 16), P = D*M = 32 ranks.
    """
    import torch

    from megatron.distributed.quant.kernels.reference import QuantizedTensor

    fp32, bf16, fp16 = torch.float32, torch.bfloat16, torch.float16
    grad_dtypes = (fp32, bf16)          # grad buffer: fp32 (--bf16's default), bf16 (--grad-accum-dtype bf16)
    param_dtypes = (bf16, fp32, fp16)   # --bf16, fp32, --fp16
    D, M = GPUS_PER_NODE, NODES
    P = D * M
    all_gs = sorted(set(space.gs_intra) | set(space.gs_inter) | set(space.gs_weight))
    unit = math.lcm(*all_gs, *space.hadamard_blocks) * 16     # elements per rank shard
    grad_gs = sorted(set(space.gs_intra) | set(space.gs_inter))   # hop 1 uses intra (D>1) or inter (D=1)
    r = SDP4BIT_RECIPE
    out: List[Scenario] = []
    step_counter = torch.zeros(1, dtype=torch.int32)   # the runtime's per-step NaN/Inf flag

    def qt(numel: int, bits: int, gs: int) -> QuantizedTensor:
        return QuantizedTensor(torch.zeros(numel * bits // 8, dtype=torch.uint8),
                               torch.zeros(numel // gs, dtype=torch.float32), bits, gs, numel)

    def add(used_by: str, quick: bool, fn: Callable[[Any], None]) -> None:
        out.append(Scenario(used_by, quick, fn))

    def had_options(gs: int) -> List[Tuple[bool, int]]:
        return [(False, 32)] + [(True, hb) for hb in space.hadamard_blocks if gs % hb == 0]

    # -- TLq hop 1: [Hadamard ->] quantize into destination-major slots --------------------------
    for dt in grad_dtypes:
        for bits in space.bits:
            for gs in grad_gs:
                for had, hb in had_options(gs):
                    for sr in (True, False):
                        quick = (dt == fp32 and bits == r["bits_intra"] and gs == r["gs_intra"]
                                 and had and sr)
                        add("TLq hop 1", quick,
                            lambda T, dt=dt, bits=bits, gs=gs, had=had, hb=hb, sr=sr:
                            T.quantize_partitions(torch.zeros(P * unit, dtype=dt), P,
                                                  list(reversed(range(P))), bits, gs, stochastic=sr,
                                                  generator=_typical_generator(T), hadamard=had,
                                                  hadamard_block=hb, check_finite=False,
                                                  nonfinite_counter=step_counter))
    # -- TLq middle hop: dequantize S sources, fp32 sum, requantize to inter bits / group ----------
    middle = [(S, bi, gi, bo, go, sr) for S in SOURCE_COUNTS for bi in space.bits
              for gi in space.gs_intra for bo in space.bits for go in space.gs_inter
              for sr in (True, False)]
    for S, bits_in, gs_in, bits_out, gs_out, sr in middle:
        quick = (bits_in == r["bits_intra"] and gs_in == r["gs_intra"] and bits_out == r["bits_inter"]
                 and gs_out == r["gs_inter"] and sr and S == D)
        add("TLq middle", quick,
            lambda T, bi=bits_in, gi=gs_in, bo=bits_out, go=gs_out, sr=sr, S=S:
            T.dequantize_sum_requantize(qt(S * unit, bi, gi), S, bo, group_size_out=go,
                                        stochastic=sr, generator=_typical_generator(T)))
    # -- TLq final hop: dequantize + sum S (nodes, or GPUs per node) sources [-> inverse Hadamard] --
    for S in FINAL_SOURCE_COUNTS:
        for bits in space.bits:
            for gs in grad_gs:
                for had, hb in had_options(gs):
                    quick = bits == r["bits_inter"] and gs == r["gs_inter"] and had and S == D
                    add("TLq final", quick,
                        lambda T, bits=bits, gs=gs, had=had, hb=hb, S=S:
                        T.dequantize_sum(qt(S * unit, bits, gs), S, hadamard=had,
                                         hadamard_block=hb, out=torch.empty(unit, dtype=fp32)))
    # -- LoCo: hop-1 residual h - sent over the slot table (one call, in place into h), middle hop
    #    unfused ('sent' of the inter requantization), 8-bit error buffers ------------------------
    for bits in space.bits:
        for gs in grad_gs:
            for had, hb in had_options(gs):
                quick = bits == r["bits_intra"] and gs == r["gs_intra"] and had
                add("LoCo hop 1", quick, lambda T, bits=bits, gs=gs, had=had, hb=hb: (
                    lambda h: T.dequantize_partitions(
                        qt(P * unit, bits, gs), P, list(reversed(range(P))), hadamard=had,
                        hadamard_block=hb, subtract_from=h, out=h))(
                            torch.zeros(P * unit, dtype=fp32)))
            add("LoCo", False, lambda T, bits=bits, gs=gs:
                T.dequantize(qt(P * unit, bits, gs)))
        for gs in space.gs_intra:
            for S in SOURCE_COUNTS:
                add("LoCo", False, lambda T, bits=bits, gs=gs, S=S:
                    T.dequantize_sum(qt(S * unit, bits, gs), S))
        for gs in space.gs_inter:
            for sr in (True, False):
                add("LoCo", False, lambda T, bits=bits, gs=gs, sr=sr:
                    T.quantize(torch.zeros(unit, dtype=fp32), bits, gs, stochastic=sr,
                               generator=_typical_generator(T), check_finite=False))
    for gs in grad_gs:
        add("LoCo", False, lambda T, gs=gs:
            T.quantize(torch.zeros(unit, dtype=fp32), 8, gs, stochastic=False, check_finite=False))
    # -- qWD (megatron-core DDP and PaRO engine) and qW --------------------------------------------
    weight_pairs = [(pdt, pdt, "qWD send") for pdt in param_dtypes] + [(fp32, bf16, "PaRO qWD send")]
    for new_dt, ref_dt, who in weight_pairs:
        for bits in space.bits:
            for gs in space.gs_weight:
                for sr in (True, False):
                    quick = ref_dt == bf16 and new_dt == bf16 and bits == r["wbits"] and gs == r["wgs"] and sr
                    add(who, quick, lambda T, a=new_dt, b=ref_dt, bits=bits, gs=gs, sr=sr:
                        T.quantize_difference(torch.zeros(unit, dtype=a),
                                              torch.zeros(P * unit, dtype=b)[unit:2 * unit], bits, gs,
                                              stochastic=sr, generator=_typical_generator(T),
                                              check_finite=False, nonfinite_counter=step_counter))
    for pdt in param_dtypes:
        for bits in space.bits:
            for gs in space.gs_weight:
                quick = pdt == bf16 and bits == r["wbits"] and gs == r["wgs"]
                add("qWD recv", quick, lambda T, pdt=pdt, bits=bits, gs=gs: (
                    lambda ref: T.dequantize_add(qt(P * unit, bits, gs), ref, out=ref))(
                        torch.zeros(P * unit, dtype=pdt)))
                for sr in (True, False):
                    add("qW send", False, lambda T, pdt=pdt, bits=bits, gs=gs, sr=sr:
                        T.quantize(torch.zeros(unit, dtype=pdt), bits, gs, stochastic=sr,
                                   generator=_typical_generator(T), check_finite=False,
                                   nonfinite_counter=step_counter))
                add("qW recv", False, lambda T, pdt=pdt, bits=bits, gs=gs:
                    T.dequantize(qt(P * unit, bits, gs), out=torch.empty(P * unit, dtype=pdt)))
    # -- public-API default check_finite=True (not reached by the trainer) -------------------------
    add("API default", False, lambda T:
        T.dequantize_partitions(qt(P * unit, r["bits_intra"], r["gs_intra"]), P,
                                list(range(P)), hadamard=True))
    for dt in grad_dtypes:
        add("API default", False, lambda T, dt=dt:
            T.quantize_partitions(torch.zeros(P * unit, dtype=dt), P, list(range(P)), r["bits_intra"],
                                  r["gs_intra"], generator=_typical_generator(T), hadamard=True))
        add("API default", False, lambda T, dt=dt:
            T.quantize(torch.zeros(unit, dtype=dt), r["bits_inter"], r["gs_inter"],
                       generator=_typical_generator(T)))
    return out


# ------------------------------------------------------------------------------------------------
# capture: what the launcher would launch
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Launch:
    """One recorded ``kernel[grid](*args, **kwargs)`` of the launcher."""

    kernel: str
    fn: Any
    args: tuple
    kwargs: dict
    used_by: str
    quick: bool


class _Recorder:
    """Stands in for a JITFunction in the kernels module: ``rec[grid](...)`` records the call."""

    def __init__(self, name: str, fn: Any, sink: List[Launch], scenario: List[Scenario]) -> None:
        self.name, self.fn, self.sink, self.scenario = name, fn, sink, scenario

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            sc = self.scenario[0]
            self.sink.append(Launch(self.name, self.fn, args, kwargs, sc.used_by, sc.quick))
        return record


def kernels_module():
    """Import the Triton launchers (``triton_launch.py``), with the jit functions of
    ``triton_device.py`` compiled for real (not the CPU interpreter)."""
    from triton.runtime.jit import JITFunction

    from megatron.distributed.quant.kernels import triton_device as J
    from megatron.distributed.quant.kernels import triton_launch as T

    fns = [v for v in vars(J).values() if hasattr(v, "src") and hasattr(v, "params")]
    if not fns or not all(isinstance(v, JITFunction) for v in fns):
        raise AotError("the Triton kernels were imported under TRITON_INTERPRET=1 (interpreter "
                       "functions cannot be compiled): run this tool in a fresh process without it")
    return T


def entry_kernels(module: Any = None) -> Dict[str, Any]:
    """Name -> JITFunction for every jit function of ``module`` (default ``triton_device.py``)
    that no other jit function calls or passes on (``tl.reduce(x, 1, _max_nan)``)."""
    from triton.runtime.jit import JITFunction

    if module is None:
        from megatron.distributed.quant.kernels import triton_device as module

    fns = {n: v for n, v in vars(module).items() if isinstance(v, JITFunction)}
    return {n: v for n, v in fns.items()   # called, or passed (a tl.reduce combine function)
            if not any(re.search(rf"\b{re.escape(n)}\s*\(|[(,]\s*{re.escape(n)}\s*[,)]", w.src)
                       for m, w in fns.items() if m != n)}


def capture(T, scens: Sequence[Scenario]) -> List[Launch]:
    """Run every scenario through the launchers ``T`` with the entry kernels swapped for
    recorders (the launchers look them up as module globals of ``T`` at every launch)."""
    entries = entry_kernels()
    sink: List[Launch] = []
    current: List[Scenario] = [scens[0]] if scens else []
    try:
        for name, fn in entries.items():
            setattr(T, name, _Recorder(name, fn, sink, current))
        for sc in scens:
            current[:] = [sc]
            before = len(sink)
            sc.run(T)
            if len(sink) == before:
                raise AotError(f"scenario {sc.used_by!r} launched no kernel")
    finally:
        for name, fn in entries.items():
            setattr(T, name, fn)
    missing = sorted(set(entries) - {l.kernel for l in sink})
    if missing:
        raise AotError(f"entry kernel(s) {missing} are launched by no scenario: add the call site "
                       f"that launches them to scenarios() in {Path(__file__).name}")
    return sink


# ------------------------------------------------------------------------------------------------
# specialisation (Triton's own JIT binder) and compilation
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Spec:
    """A JIT specialisation of one entry kernel for one target, ready for ``triton.compile``."""

    kernel: str
    fn: Any
    target: int
    signature: Dict[str, str]
    constexprs: Dict[tuple, Any]
    attrs: Dict[tuple, Any]
    options: Any
    args: Dict[str, Any]
    used_by: List[str]
    quick: bool
    key: str = ""
    """Cache key: this specialisation on this target with these options and this Triton."""
    spec_id: str = ""
    """The specialisation without the target (rows of different targets share it)."""

    @property
    def constexpr_by_name(self) -> Dict[str, Any]:
        names = self.fn.arg_names
        return {names[k[0]]: v for k, v in self.constexprs.items()}


def specialise(launch: Launch, capability: int) -> Spec:
    """The (signature, constexprs, attrs, options) the JIT would build for this launch on a GPU of
    ``capability`` -- through Triton's own binder, so integer / alignment specialisation and the
    launch options match a real launch."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound,
                                                          specialization, options)
    spec = Spec(launch.kernel, fn, capability, signature, constexprs, attrs, options,
                {k: v for k, v in bound.items()}, [launch.used_by], launch.quick)
    src = ASTSource(fn, signature, constexprs, attrs)
    key = json.dumps({"schema": SCHEMA, "triton": triton.__version__, "src": src.hash(),
                      "target": capability, "options": options.hash(),
                      "env": get_cache_invalidating_env_vars()}, sort_keys=True, default=str)
    spec.key = hashlib.sha256(key.encode()).hexdigest()[:32]
    spec.spec_id = src.hash()[:16]
    return spec


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str, kernel: str) -> Dict[str, int]:
    """Registers, spills, stack and static shared memory of ``kernel`` from ``ptxas -v`` output."""
    start = log.find(f"Compiling entry function '{kernel}'")
    if start < 0:
        raise RuntimeError(f"ptxas log has no entry function {kernel!r}:\n{log[-2000:]}")
    part = log[start:]
    regs = _PTXAS_REGS.search(part)
    spill = _PTXAS_SPILL.search(part)
    if regs is None or spill is None:
        raise RuntimeError(f"cannot read registers / spills of {kernel!r} from ptxas:\n{part[-2000:]}")
    stack = _PTXAS_STACK.search(part)
    smem = _PTXAS_SMEM.search(part)
    return {"regs": int(regs.group(1)), "spill_stores": int(spill.group(1)),
            "spill_loads": int(spill.group(2)), "stack": int(stack.group(1)) if stack else 0,
            "smem_static": int(smem.group(1)) if smem else 0}


class Cache:
    """Compile results on disk: ``<key>.json`` + ``<key>.cubin``, each written via a temporary file
    and ``os.replace`` (atomic: concurrent runs write identical content, a reader never sees half
    a file); a record is trusted only if its cubin exists and matches the recorded sha256."""

    def __init__(self, root: Optional[Path]) -> None:
        self.root = root
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> Optional[Dict[str, Any]]:
        if self.root is None:
            return None
        try:
            rec = json.loads((self.root / f"{key}.json").read_text(encoding="utf-8"))
            cubin = (self.root / f"{key}.cubin").read_bytes()
        except (OSError, ValueError):
            return None
        if rec.get("schema") != SCHEMA or hashlib.sha256(cubin).hexdigest() != rec.get("cubin_sha256"):
            return None
        return rec

    def cubin(self, key: str) -> Optional[bytes]:
        """The cached cubin of ``key`` (checked by get() before a record is used)."""
        if self.root is None:
            return None
        try:
            return (self.root / f"{key}.cubin").read_bytes()
        except OSError:
            return None

    def put(self, key: str, rec: Dict[str, Any], cubin: bytes) -> None:
        if self.root is None:
            return
        self._atomic_write(self.root / f"{key}.cubin", cubin)
        self._atomic_write(self.root / f"{key}.json", json.dumps(rec, sort_keys=True).encode())

    @staticmethod
    def _atomic_write(path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def data_movement_counts(ttgir: str, ptx: str) -> Dict[str, int]:
    """What moves data between threads, statically: Triton's layout conversions (TTGIR
    ``ttg.convert_layout``, through shared memory or shuffles), CTA barriers and warp shuffles in
    the PTX. In these memory-bound kernels each is arithmetic-free overhead beside the HBM
    traffic (the Hadamard butterfly's cost, docs/performance.md)."""
    return {"layout_conversions": ttgir.count("ttg.convert_layout"),
            "barriers": len(re.findall(r"\b(?:bar|barrier)\.sync\b", ptx)),
            "shuffles": len(re.findall(r"\bshfl\.sync\b", ptx))}


def compile_spec(spec: Spec, triton_cache_dir: str) -> Tuple[Dict[str, Any], bytes]:
    """``triton.compile`` one specialisation; returns (record, cubin).

    Triton's own cache is pointed at a scratch directory so ptxas really runs (its ``-v`` log,
    printed through ``knobs.nvidia.dump_ptxas_log``, is where registers and spills come from)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    buf = io.StringIO()
    t0 = time.perf_counter()
    with knobs.cache.scope(), knobs.nvidia.scope():
        knobs.cache.dir = triton_cache_dir
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(buf):
            ck = triton.compile(ASTSource(spec.fn, spec.signature, spec.constexprs, spec.attrs),
                                target=GPUTarget("cuda", spec.target, 32),
                                options=dict(spec.options.__dict__))
    seconds = time.perf_counter() - t0
    cubin = ck.asm.get("cubin", b"")
    if not cubin.startswith(b"\x7fELF") or spec.kernel.encode() not in cubin:
        raise RuntimeError(f"{spec.kernel}: triton.compile returned no cubin with the entry function")
    rec = {"schema": SCHEMA, **parse_ptxas_log(buf.getvalue(), spec.kernel),
           **data_movement_counts(ck.asm.get("ttgir", ""), ck.asm.get("ptx", "")),
           "smem_dynamic": int(ck.metadata.shared), "num_warps": int(ck.metadata.num_warps),
           "cubin_bytes": len(cubin), "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
           "compile_s": round(seconds, 3), "arch": ck.metadata.target.arch}
    return rec, cubin


# ------------------------------------------------------------------------------------------------
# static traffic model and labels
# ------------------------------------------------------------------------------------------------

def _es(sig: str) -> int:
    return ELEMENT_BYTES[sig.lstrip("*")]


def traffic(spec: Spec) -> Optional[Tuple[float, float, str]]:
    """(bytes read, bytes written, what an element is) per element, from the argument dtypes and
    constexprs; None for a kernel without a model. Index / slot / counter loads are per group or
    per program and left out; sources S are the constexpr ``S`` (D for the middle hop, M for the
    final one)."""
    c, s = spec.constexpr_by_name, spec.signature
    per = lambda bits, gs: bits / 8 + 4 / gs       # packed codes + one fp32 scale per group
    if spec.kernel == "_quantize_kernel":
        read = _es(s["x_ptr"]) + (_es(s["ref_ptr"]) if c["DIFF"] else 0)
        return read, per(c["BITS"], c["GS"]), "input element"
    if spec.kernel == "_dsum_requant_kernel":
        return c["S"] * per(c["BITS_IN"], c["GS_IN"]), per(c["BITS"], c["GS"]), "output element"
    if spec.kernel == "_dsum_kernel":
        return c["S"] * per(c["BITS"], c["GS"]), _es(s["out_ptr"]), "output element"
    if spec.kernel == "_dequant_parts_kernel":
        return per(c["BITS"], c["GS"]) + (_es(s["sub_ptr"]) if c["SUB"] else 0), 4.0, "element"
    if spec.kernel == "_dequant_add_kernel":
        return per(c["BITS"], c["GS"]) + _es(s["ref_ptr"]), _es(s["out_ptr"]), "element"
    return None


_SHORT_DTYPE = {"*fp32": "fp32", "*bf16": "bf16", "*fp16": "fp16"}


def label(spec: Spec) -> str:
    """Compact specialisation name: float pointer dtypes, sources, then the declared constexprs
    (booleans by name when on; GP only when it differs from GS; HB only with the Hadamard
    transform). Runtime ints the JIT specialised to constexpr 1 (``out_stride``) are not
    listed."""
    c = spec.constexpr_by_name
    declared = {p.name for p in spec.fn.params if p.is_constexpr}
    parts = []
    for name, sig in spec.signature.items():
        if sig not in _SHORT_DTYPE or name in ("scales_ptr", "out_scales_ptr"):
            continue
        if (name == "ref_ptr" and c.get("DIFF") is False) or (
                name == "sub_ptr" and c.get("SUB") is False):
            continue                            # the launcher passes another buffer again
        parts.append(f"{name.replace('_ptr', '')}:{_SHORT_DTYPE[sig]}")
    for name, v in c.items():
        if name not in declared:
            continue
        if (name == "GP" and v == c.get("GS")) or (name == "HB" and not c.get("HADAMARD")):
            continue
        if isinstance(v, bool):
            if v:
                parts.append(name)
        else:
            parts.append(f"{name}={v}")
    return " ".join(parts)


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------

def parse_targets(text: str) -> List[int]:
    """'sm_80,sm_90' (also '80', 'sm_90a') -> [80, 90]."""
    caps = []
    for item in (t.strip() for t in text.split(",")):
        m = re.fullmatch(r"(?:sm_?)?(\d{2,3})a?", item)
        if not m:
            raise AotError(f"--targets: {item!r} is not a CUDA arch like sm_80 or sm_90")
        cap = int(m.group(1))
        if cap < 75:
            raise AotError(f"--targets: sm_{cap} is older than what Triton supports (sm_75+)")
        if cap not in caps:
            caps.append(cap)
    if not caps:
        raise AotError("--targets is empty")
    return caps


def build_specs(targets: Sequence[int], quick: bool) -> List[Spec]:
    """All distinct specialisations (one per kernel in ``quick`` mode), per target, in scenario
    order; ``used_by`` collects every call site that reaches the same specialisation."""
    T = kernels_module()
    launches = capture(T, scenarios(flag_space()))
    specs: List[Spec] = []
    for cap in targets:
        seen: Dict[str, Spec] = {}
        for launch in launches:
            sp = specialise(launch, cap)
            if sp.key in seen:
                old = seen[sp.key]
                if launch.used_by not in old.used_by:
                    old.used_by.append(launch.used_by)
                old.quick = old.quick or launch.quick
                continue
            seen[sp.key] = sp
        chosen = list(seen.values())
        if quick:
            per_kernel: Dict[str, Spec] = {}
            for sp in chosen:                         # the recipe's spec, else the kernel's first
                if sp.kernel not in per_kernel or (sp.quick and not per_kernel[sp.kernel].quick):
                    per_kernel[sp.kernel] = sp
            chosen = list(per_kernel.values())
        specs.extend(chosen)
    return specs


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sdp4bit-megatron" / "triton_aot"


def over_budget(row: Dict[str, Any], max_registers: int) -> List[str]:
    """What of the budget a compiled row breaks: spills, a stack frame, registers."""
    out = []
    if row["spill_stores"] or row["spill_loads"]:
        out.append(f"spills {row['spill_stores']}/{row['spill_loads']} B")
    if row.get("stack"):
        out.append(f"stack {row['stack']} B")
    if row["regs"] > max_registers:
        out.append(f"{row['regs']} > {max_registers} registers")
    return out


def sass_counts(spec: Spec, cubin: bytes) -> Dict[str, Any]:
    """The cost model's per-thread counts of the cubin's SASS (bench/kernel_cost_model.py)."""
    import kernel_cost_model as C

    trips = C.loop_trips(spec.constexpr_by_name)
    counts = C.count(C.parse_sass(C.disassemble(cubin), spec.kernel), trips)
    return dataclasses.asdict(counts) | {"trips": trips}


def sass_current(spec: Spec, rec: Dict[str, Any]) -> bool:
    """Whether ``rec`` holds SASS counts made with the loop trip count the model now assigns
    (a record cached before a change of :func:`kernel_cost_model.loop_trips` is recounted)."""
    import kernel_cost_model as C

    return rec.get("sass", {}).get("trips") == C.loop_trips(spec.constexpr_by_name)


def model(spec: Spec, rec: Dict[str, Any], tr: Tuple[float, float, str]) -> Dict[str, Any]:
    """Modelled % of copy bandwidth on an H200 and its bound, from the cached SASS counts."""
    import kernel_cost_model as C

    counts = C.SassCounts(**{k: v for k, v in rec["sass"].items() if k != "trips"})
    shape = C.shape_of_record(spec, rec, tr)
    est = C.estimate(counts, shape, 256 << 20)
    return {"modelled_pct": round(est.percent_of_copy, 1), "bound": est.bound,
            "instr_per_elem": round(est.instructions_per_element, 1),
            "local_B_per_elem": round(est.local_bytes_per_element, 2),
            "warps_per_sm": est.occupancy_warps}


def run(targets: Sequence[int], quick: bool, cache_dir: Optional[Path],
        progress: Callable[[str], None] = lambda s: None, only: Optional[str] = None,
        max_registers: int = MAX_REGISTERS) -> List[Dict[str, Any]]:
    """Compile every specialisation (cached) and return one row per (specialisation, target);
    ``only``: a regular expression on "kernel specialisation"."""
    specs = build_specs(targets, quick)
    if only is not None:
        specs = [sp for sp in specs if re.search(only, f"{sp.kernel} {label(sp)}")]
        if not specs:
            raise AotError(f"--only {only!r} matches no specialisation")
    cache = Cache(cache_dir)
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="triton_aot_") as scratch:
        for i, sp in enumerate(specs, 1):
            row: Dict[str, Any] = {"kernel": sp.kernel, "specialisation": label(sp),
                                   "used_by": ", ".join(sp.used_by), "target": f"sm_{sp.target}",
                                   "key": sp.key, "spec_id": sp.spec_id, "error": None}
            try:
                tr = traffic(sp)
            except (KeyError, TypeError):   # a kernel whose arguments changed: no model
                tr = None
            if tr is not None:
                row.update(bytes_read=tr[0], bytes_written=tr[1], element=tr[2],
                           roofline_ms=(tr[0] + tr[1]) * BUCKET_ELEMENTS / HBM_BYTES_PER_S * 1e3)
            rec = cache.get(sp.key)
            if rec is not None:
                row.update(rec, cached=True)
                cubin = cache.cubin(sp.key)
            else:
                try:
                    rec, cubin = compile_spec(sp, scratch)
                    cache.put(sp.key, rec, cubin)
                    row.update(rec, cached=False)
                except Exception as exc:  # every failure is reported, then the exit status is 1
                    row["error"] = f"{type(exc).__name__}: {exc}"
            if not row["error"]:
                row["over_budget"] = over_budget(row, max_registers)
                if tr is not None and cubin is not None:
                    try:
                        if not sass_current(sp, rec):   # SASS counts cached beside the record
                            rec["sass"] = sass_counts(sp, cubin)
                            cache.put(sp.key, rec, cubin)
                        row.update(model(sp, rec, tr))
                    except (OSError, subprocess.CalledProcessError) as exc:  # no cuobjdump
                        row["model_error"] = f"{type(exc).__name__}: {exc}"
            status = "FAILED" if row["error"] else ("cached" if row.get("cached") else
                                                     f"{row['compile_s']:.1f}s")
            progress(f"[{i}/{len(specs)}] {row['target']} {sp.kernel} {row['specialisation']}: {status}")
            rows.append(row)
    return rows


def _fmt_bytes(row: Dict[str, Any]) -> str:
    if "bytes_read" not in row:
        return "n/a"
    return f"{row['bytes_read']:.3g}+{row['bytes_written']:.3g}"


def _fmt_model(row: Dict[str, Any]) -> str:
    if "modelled_pct" not in row:
        return "n/a"
    return f"{row['modelled_pct']:.0f} ({row['bound']})"


def format_text(rows: Sequence[Dict[str, Any]]) -> str:
    """Aligned plain-text table, one line per (specialisation, target)."""
    head = ["kernel", "specialisation", "used by", "target", "regs", "spill st/ld B", "stack B",
            "smem B", "cvt/bar/shfl", "B/elem R+W", "1.3B @3.35TB/s ms", "model % copy"]
    body = []
    for r in rows:
        if r["error"]:
            body.append([r["kernel"], r["specialisation"], r["used_by"], r["target"],
                         "FAILED", "-", "-", "-", "-", _fmt_bytes(r), "-", "-"])
            continue
        body.append([r["kernel"], r["specialisation"], r["used_by"], r["target"], str(r["regs"]),
                     f"{r['spill_stores']}/{r['spill_loads']}", str(r.get("stack", 0)),
                     str(r["smem_dynamic"] + r["smem_static"]),
                     f"{r['layout_conversions']}/{r['barriers']}/{r['shuffles']}", _fmt_bytes(r),
                     f"{r['roofline_ms']:.2f}" if "roofline_ms" in r else "n/a",
                     _fmt_model(r)])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def format_markdown(rows: Sequence[Dict[str, Any]]) -> str:
    """Markdown table, one row per specialisation with the targets side by side ("sm_80, sm_90");
    a spill cell is 0 or "<stores>st <loads>ld" bytes."""
    targets: List[str] = []
    grouped: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for r in rows:
        if r["target"] not in targets:
            targets.append(r["target"])
        grouped.setdefault(r["spec_id"], {})[r["target"]] = r
    tg = ", ".join(targets)
    out = [f"| kernel | specialisation | used by | regs ({tg}) | spills B ({tg}) | "
           f"stack B ({tg}) | smem B ({tg}) | B/elem R+W | 1.3B @ 3.35 TB/s (ms) | "
           f"modelled % of copy (H200) |",
           "|---|---|---|---|---|---|---|---:|---:|---:|"]
    for per in grouped.values():
        cells: Dict[str, List[str]] = {"regs": [], "spill": [], "stack": [], "smem": []}
        for t in targets:
            r = per.get(t)
            if r is None or r["error"]:
                for k in cells:
                    cells[k].append("FAILED" if r is not None else "-")
                continue
            cells["regs"].append(str(r["regs"]))
            spilled = r["spill_stores"] or r["spill_loads"]
            cells["spill"].append(f"**{r['spill_stores']}st {r['spill_loads']}ld**" if spilled else "0")
            cells["stack"].append(str(r.get("stack", 0)))
            cells["smem"].append(str(r["smem_dynamic"] + r["smem_static"]))
        any_row = next(iter(per.values()))
        sm90 = per.get("sm_90", any_row)
        roof = f"{any_row['roofline_ms']:.2f}" if "roofline_ms" in any_row else "n/a"
        out.append(f"| `{any_row['kernel']}` | {any_row['specialisation']} | {any_row['used_by']} | "
                   f"{', '.join(cells['regs'])} | {', '.join(cells['spill'])} | "
                   f"{', '.join(cells['stack'])} | {', '.join(cells['smem'])} | "
                   f"{_fmt_bytes(any_row)} | {roof} | {_fmt_model(sm90)} |")
    return "\n".join(out)


def summary(rows: Sequence[Dict[str, Any]], seconds: float,
            max_registers: int = MAX_REGISTERS) -> str:
    ok = [r for r in rows if not r["error"]]
    failed = [r for r in rows if r["error"]]
    spilled = [r for r in ok if r["spill_stores"] or r["spill_loads"]]
    over = [r for r in ok if r.get("over_budget")]
    kernels = sorted({r["kernel"] for r in rows})
    targets = sorted({r["target"] for r in rows})
    compiled = sum(1 for r in ok if not r.get("cached"))
    lines = [f"{len(rows)} compiles ({len({r['spec_id'] for r in rows})} "
             f"specialisations of {len(kernels)} entry kernels x {len(targets)} targets "
             f"{','.join(targets)}): {compiled} compiled, {len(ok) - compiled} from cache, "
             f"{len(failed)} failed; {len(spilled)} with spills; {len(over)} over budget "
             f"(spill, stack or > {max_registers} registers); {seconds:.1f} s"]
    if ok:
        lines.append("registers per target: " + "; ".join(
            f"{t} {min(r['regs'] for r in ok if r['target'] == t)}-"
            f"{max(r['regs'] for r in ok if r['target'] == t)}" for t in targets
            if any(r["target"] == t for r in ok)))
    for r in spilled:
        lines.append(f"SPILLS {r['target']} {r['kernel']} {r['specialisation']}: "
                     f"{r['spill_stores']} B stores / {r['spill_loads']} B loads")
    for r in over:
        lines.append(f"OVER BUDGET {r['target']} {r['kernel']} {r['specialisation']}: "
                     f"{', '.join(r['over_budget'])}")
    for r in failed:
        lines.append(f"FAILED {r['target']} {r['kernel']} {r['specialisation']}: {r['error']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=DEFAULT_TARGETS,
                    help=f"comma-separated CUDA archs (default {DEFAULT_TARGETS})")
    ap.add_argument("--quick", action="store_true",
                    help="one specialisation per entry kernel x target (the SDP4Bit recipe's)")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help=f"compile cache (default {default_cache_dir()})")
    ap.add_argument("--no-cache", action="store_true", help="compile everything, store nothing")
    ap.add_argument("--list", action="store_true", help="print the specialisations, compile nothing")
    ap.add_argument("--only", default=None, metavar="REGEX",
                    help="compile only the specialisations whose 'kernel specialisation' matches")
    ap.add_argument("--max-registers", type=int, default=MAX_REGISTERS,
                    help=f"register budget per thread (default {MAX_REGISTERS})")
    ap.add_argument("--markdown", action="store_true",
                    help="print the table as markdown, targets side by side (docs/performance.md)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    ap.add_argument("-v", "--verbose", action="store_true", help="one progress line per compile (stderr)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        targets = parse_targets(args.targets)
        if args.list:
            for sp in build_specs(targets, args.quick):
                print(f"sm_{sp.target}  {sp.kernel}  {label(sp)}  [{', '.join(sp.used_by)}]")
            return 0
        cache_dir = None if args.no_cache else (args.cache_dir or default_cache_dir())
        progress = (lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else (lambda s: None)
        rows = run(targets, args.quick, cache_dir, progress, args.only, args.max_registers)
    except AotError as exc:
        print(f"triton_aot: error: {exc}", file=sys.stderr)
        return 2
    print(format_markdown(rows) if args.markdown else format_text(rows))
    print()
    print(summary(rows, time.perf_counter() - t0, args.max_registers))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1, sort_keys=True), encoding="utf-8")
    return 1 if any(r["error"] or r.get("over_budget") for r in rows) else 0


if __name__ == "__main__":
    # Must precede the first import of triton_device: under the interpreter nothing compiles.
    if os.environ.pop("TRITON_INTERPRET", None) not in (None, "", "0"):
        print("triton_aot: note: ignoring TRITON_INTERPRET (this tool compiles for real)",
              file=sys.stderr)
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "bench"))
    sys.exit(main())
