"""One config object for every quantized-communication option.

Built from the command-line flags in exactly one place (:func:`QuantizationConfig.from_args`),
then handed to the DDP bucket groups, the distributed optimizer and the collectives. Mirrors
megatron-core's habit of dataclass configs (``DistributedDataParallelConfig``).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any, List, Mapping, Optional, Tuple

from .kernels.reference import SUPPORTED_BITS  # the one definition (the kernels' numerics)
from .loco import LOCO_ERROR_BITS  # the one definition (the error buffers' storage)

__all__ = ["QuantizationConfig", "HopSpec", "ParoConfig", "SUPPORTED_BITS", "FIDELITY_NOTES", "TopologyUnknownError",
           "launcher_ranks_per_node", "ranks_per_node_from_hosts"]

LAUNCHER_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                            "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
"""Ranks on this node as launchers publish it: torchrun, Open MPI, MPICH/Intel MPI (Hydra),
MVAPICH2, SLURM's ``srun --ntasks-per-node``. ``SLURM_STEP_TASKS_PER_NODE`` /
``SLURM_TASKS_PER_NODE`` (``"8(x2)"``) are read after these."""


class TopologyUnknownError(ValueError):
    """No flag and no launcher variable says how many ranks share a node."""


def launcher_ranks_per_node(environ: Mapping[str, str] = os.environ) -> Optional[Tuple[int, str]]:
    """``(ranks on this node, the variable that said so)`` from the launcher's environment, or
    None when no launcher variable is set (``python pretrain_gpt.py`` under a plain
    ``mpirun``/``srun`` without ``--ntasks-per-node`` may set none).

    SLURM's per-node task lists (``"8(x2)"``, ``"8,8"``) count only when every node has the same
    number: the two-level layout needs D ranks on every node."""
    for var in LAUNCHER_LOCAL_SIZE_VARS:
        value = environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value), var
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        value = environ.get(var, "").strip()
        counts = {int(m.group(1)) for m in re.finditer(r"(\d+)(?:\(x\d+\))?", value)}
        if len(counts) == 1 and min(counts) > 0:
            return counts.pop(), var
    return None


def ranks_per_node_from_hosts(hostnames: List[str], group_ranks: List[int]) -> int:
    """Ranks of ``group_ranks`` per host, from every world rank's hostname (``hostnames[r]``):
    the ground truth when no launcher variable says it. Raises :class:`TopologyUnknownError`
    naming ``--data-parallel-intra-node-size`` when the group is not node-major with the same
    number of ranks on every host (the two-level layout's r = node*D + local)."""
    hosts = [hostnames[r] for r in group_ranks]
    runs: List[Tuple[str, int]] = []
    for h in hosts:
        if runs and runs[-1][0] == h:
            runs[-1] = (h, runs[-1][1] + 1)
        else:
            runs.append((h, 1))
    sizes = {n for _, n in runs}
    if len(sizes) != 1 or len(runs) != len(set(hosts)):
        raise TopologyUnknownError(
            f"the data-parallel ranks {group_ranks} sit on hosts {hosts}: not the same number "
            f"of consecutive ranks on every host, so the two-level (intra/inter-node) layout is "
            f"undefined; pass --data-parallel-intra-node-size")
    return sizes.pop()

FIDELITY_NOTES = {
    "grad_2bit": ("2-bit gradient codes are outside what was found safe: the M x D error study "
                  "(docs/results.md) measured 38-113% relative error of the 2-bit inter-node "
                  "reduce-scatter against 5.5-17% at 4 bits (M = 2..16 nodes), a real 2 x 2 run "
                  "logged a gradient cosine of 0.71-0.73 (0.986 at 4 bits), and the tiny GPT's "
                  "loss rose 23% within 30 iterations; use 4 bits (SDP4Bit's setting), or watch "
                  "--quantization-error-interval"),
    "weight_2bit": ("2-bit weight codes are outside what was found safe (qW/qWD were studied at 4 "
                    "bits and above, docs/results.md); use 4 bits, or watch "
                    "--quantization-error-interval"),
}
"""Why a setting is risky, with the measurement behind it (:meth:`QuantizationConfig.fidelity_warnings`)."""


@dataclass(frozen=True)
class HopSpec:
    """How one hop of a quantized collective encodes what it sends.

    One value per hop so a collective takes one argument per hop rather than one per setting
    (:func:`.collectives.gradients.two_level_reduce_scatter` takes ``intra`` and ``inter``,
    :func:`.collectives.weights.quantized_all_gather` one ``spec``); the trainer's come from
    :class:`QuantizationConfig` (:attr:`~QuantizationConfig.gradient_intra_hop`, ...)."""

    bits: int
    """Bits per code on the wire; one of :data:`SUPPORTED_BITS`."""
    group_size: int
    """Elements per quantization group (one fp32 scale each)."""
    stochastic: bool = True
    """Round codes stochastically (unbiased) instead of to nearest."""
    hadamard: bool = False
    """Walsh-Hadamard transform before quantizing (TLq-HS); a two-hop collective applies it once
    before its first hop and inverts it after its last, so its hops must agree."""
    hadamard_block: int = 32
    """Elements per Hadamard block; a power of two dividing :attr:`group_size`."""


@dataclass(frozen=True)
class ParoConfig:
    """``--paro-strategy`` and what choosing and reporting a strategy needs to know of the run.

    Read from the command line once (:meth:`from_args`, at argument validation) so the layer
    never reads the trainer's argparse Namespace afterwards: ``auto`` is resolved from this
    (:func:`.paro.integration.resolve_auto_strategy` returns the new config, the trainer records
    it) and the startup report is written from it."""

    strategy: Optional[str] = None
    """The canonical strategy name (e.g. 'NIG'), 'auto' (resolved at startup), or None (none)."""
    group_size: Optional[int] = None
    """Data-parallel ranks per PaRO group: resolved with a strategy, as given without one."""
    gpu_memory_gb: Optional[float] = None
    """``--paro-gpu-memory-gb``: memory per rank ``auto`` may fill; None: the device's."""
    reserved_memory_gb: Optional[float] = None
    """``--paro-reserved-memory-gb``: memory per rank ``auto`` keeps free; None: its default."""
    intra_bandwidth_gbs: float = 150.0
    """Intra-group bandwidth per GPU in GB/s (the cost model's)."""
    inter_bandwidth_gbs: float = 12.5
    """Inter-group bandwidth per GPU in GB/s (the cost model's)."""
    data_parallel_size: int = 1
    """The run's data-parallel size (the ranks the strategy partitions over)."""
    tensor_model_parallel_size: int = 1
    """The run's tensor-parallel size (the default group is a node's ranks // TP)."""
    pipeline_model_parallel_size: int = 1
    """The run's pipeline-parallel size (with TP: the report's figures are this rank's share)."""
    device: str = "cpu"
    """'cuda' or 'cpu': whose memory ``auto`` measures without ``--paro-gpu-memory-gb``."""
    param_bytes: float = 4.0
    """Bytes per stored parameter element (2 with --bf16 / --fp16; also the memory report's)."""
    grad_bytes: float = 4.0
    """Bytes per stored gradient element (4 with fp32 accumulation or fp32 parameters)."""

    @classmethod
    def from_args(cls, args: Any) -> "ParoConfig":
        """The ``--paro-*`` flags as given, and the run's sizes and precision (those of validated
        arguments: the data-parallel size is derived there). :meth:`resolved` finishes it."""
        mixed = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
        fp32_grads = bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False)) or not mixed
        defaults = cls()
        return cls(strategy=getattr(args, "paro_strategy", None),
                   group_size=getattr(args, "paro_group_size", None),
                   gpu_memory_gb=getattr(args, "paro_gpu_memory_gb", None),
                   reserved_memory_gb=getattr(args, "paro_reserved_memory_gb", None),
                   intra_bandwidth_gbs=getattr(args, "paro_intra_bandwidth_gbs",
                                               defaults.intra_bandwidth_gbs),
                   inter_bandwidth_gbs=getattr(args, "paro_inter_bandwidth_gbs",
                                               defaults.inter_bandwidth_gbs),
                   data_parallel_size=getattr(args, "data_parallel_size", None) or 1,
                   tensor_model_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
                   pipeline_model_parallel_size=getattr(args, "pipeline_model_parallel_size", 1),
                   device=getattr(args, "device", None) or "cpu",
                   param_bytes=2.0 if mixed else 4.0, grad_bytes=4.0 if fp32_grads else 2.0)

    def resolved(self, use_distributed_optimizer: bool) -> "ParoConfig":
        """The strategy's canonical name (or 'auto') and its group size, for training with
        ``use_distributed_optimizer`` (:func:`.paro.strategy.check_trainable`,
        :func:`.paro.strategy.resolve_group_size`); unchanged without a strategy. ValueError
        with the fix."""
        from .paro.strategy import AUTO, check_trainable, resolve_group_size

        if self.strategy is None:
            return self
        parsed = check_trainable(self.strategy, use_distributed_optimizer)
        group_size = resolve_group_size(self.data_parallel_size, self.group_size,
                                        self.tensor_model_parallel_size)
        return replace(self, strategy=parsed if parsed == AUTO else parsed.name,
                       group_size=group_size)


@dataclass(frozen=True)
class QuantizationConfig:
    """All quantization options of the communication layer.

    Frozen: built and validated once (:meth:`from_args`) and shared by every component, so none
    can change an option under another; derive variants with ``dataclasses.replace``. Each field
    but :attr:`paro` is the flag of the same name; collectives take per-hop :class:`HopSpec` values.
    """

    # --- qWD / qW: weight all-gather ---------------------------------------------------------
    quantized_weights: bool = False
    """Quantize the distributed optimizer's parameter all-gather (qWD by default)."""
    weight_quantization_bits: int = 4
    """Bits per weight code on the all-gather wire; one of :data:`SUPPORTED_BITS`."""
    wq_group_size: int = 2048
    """Elements per weight quantization group (one fp32 scale each); a positive multiple of 8."""
    weight_quantization_mode: str = "diff"
    """'diff' = qWD (quantize new - reconstructed weights); 'direct' = qW / ZeRO++ qwZ
    (quantize the weights themselves)."""

    # --- TLq / TLq-HS: gradient reduce-scatter ------------------------------------------------
    quantized_gradients: bool = False
    """Replace the gradient reduce-scatter by the two-level quantized one (TLq, or TLq-HS with
    :attr:`hadamard_transform`)."""
    gradient_quantization_bits_intra: int = 8
    """Bits per gradient code on the intra-node hop; one of :data:`SUPPORTED_BITS`."""
    gq_group_size_intra: int = 512
    """Elements per quantization group on the intra-node hop; a positive multiple of 8."""
    gradient_quantization_bits_inter: int = 4
    """Bits per gradient code on the inter-node hop; one of :data:`SUPPORTED_BITS`."""
    gq_group_size_inter: int = 128
    """Elements per quantization group on the inter-node hop. Unlike the reference (which
    silently used the intra group size on both hops) the inter hop really uses this size."""
    hadamard_transform: bool = False
    """Walsh-Hadamard transform of the gradients before quantization (TLq-HS): spreads outliers
    over a block so a group's scale is not set by one element."""
    hadamard_block_size: int = 32
    """Elements per Hadamard block; a power of two dividing both gradient group sizes."""
    gradients_quantization_start_iteration: int = 0
    """Iterations before this one reduce gradients exactly (megatron-core's collective)."""
    gradient_alltoall_pipeline: int = 1
    """Pipeline chunks per bucket (the reference's name): the exchanges of a bucket's two-level
    reduce-scatter run in this many chunks, so the intra-node hop of chunk y+1 overlaps the
    inter-node hop of chunk y. Numerics do not depend on it
    (collectives.gradients.pipeline_bounds)."""
    data_parallel_intra_node_size: Optional[int] = None
    """Data-parallel ranks per node for two-level grouping; None = LOCAL_WORLD_SIZE // TP."""
    distributed_timeout_minutes: Optional[int] = None
    """The run's ``--distributed-timeout-minutes``: how long a collective of every communicator
    this layer creates may wait (torch gives a new group its backend's default, 10 or 30
    minutes, not the default group's); None: that default."""

    # --- stochastic rounding ---------------------------------------------------------------------
    stochastic_rounding: bool = True
    """Round codes stochastically (unbiased) instead of to nearest."""
    seed: int = 1234
    """Seed of the stochastic-rounding generators (reference used the clock; we are reproducible)."""

    # --- LoCo error feedback ---------------------------------------------------------------------
    loco: bool = False
    """LoCo error feedback on the quantized gradient hops (one buffer per bucket and hop)."""
    loco_error_beta: float = 0.8
    """Decay of the stored error, ``e <- beta * e + (1 - beta) * new error``; in [0, 1)."""
    loco_reset_interval: int = 1024
    """Optimizer steps between resets of every error buffer; positive."""
    loco_error_bits: int = 8
    """Storage of the error buffers: 8 (int8 + per-group scale), 16 (bf16) or 32 (fp32) bits."""

    # --- gradient accumulation dtype -------------------------------------------------------------
    grad_accum_dtype: Optional[str] = None
    """'fp32' | 'bf16' | None (None keeps megatron-core's default)."""

    # --- fidelity monitor ----------------------------------------------------------------------
    quantization_error_interval: int = 0
    """Every this many iterations run the exact reduce-scatter beside each quantized one (and
    compare the qWD / qW reconstruction with the exact weights) and report the relative error
    (``quant_error_*`` in the log line, tensorboard and jsonl); those iterations run without
    communication overlap. 0 = off (the reference's debug environment variable, as a flag)."""

    # --- PaRO --------------------------------------------------------------------------------
    paro: ParoConfig = field(default_factory=ParoConfig)
    """``--paro-strategy`` and the run facts choosing and reporting it needs (:class:`ParoConfig`)."""

    def fidelity_warnings(self) -> List[str]:
        """Settings outside what the error study found safe, each with the measured reason
        (docs/results.md); the trainer prints them at startup. Empty when nothing is risky."""
        out = []
        if self.quantized_gradients:
            for hop in ("intra", "inter"):
                bits = getattr(self, f"gradient_quantization_bits_{hop}")
                if bits < 4:
                    out.append(
                        f"--gradient-quantization-bits-{hop} {bits}: {FIDELITY_NOTES['grad_2bit']}")
        if self.quantized_weights and self.weight_quantization_bits < 4:
            out.append(f"--weight-quantization-bits {self.weight_quantization_bits}: "
                       f"{FIDELITY_NOTES['weight_2bit']}")
        return out

    @property
    def gradient_intra_hop(self) -> HopSpec:
        """The gradient reduce-scatter's intra-node hop."""
        return HopSpec(self.gradient_quantization_bits_intra, self.gq_group_size_intra,
                       self.stochastic_rounding, self.hadamard_transform, self.hadamard_block_size)

    @property
    def gradient_inter_hop(self) -> HopSpec:
        """The gradient reduce-scatter's inter-node hop."""
        return HopSpec(self.gradient_quantization_bits_inter, self.gq_group_size_inter,
                       self.stochastic_rounding, self.hadamard_transform, self.hadamard_block_size)

    @property
    def weight_hop(self) -> HopSpec:
        """The weight all-gather's codes (every hop of it: quantized once, forwarded)."""
        return HopSpec(self.weight_quantization_bits, self.wq_group_size, self.stochastic_rounding)

    @property
    def enabled(self) -> bool:
        """Whether any collective is quantized."""
        return self.quantized_weights or self.quantized_gradients

    def validate(self) -> None:
        """Raise ValueError with a reason for any value the layer cannot run with.

        Which flag needs which switch (``--loco`` / ``--hadamard-transform`` without
        ``--quantized-gradients``, ...) is decided on the command line, where "given" is known:
        :func:`megatron.distributed.quant.arguments.check_flag_dependencies`."""
        for name in ("weight_quantization_bits", "gradient_quantization_bits_intra",
                     "gradient_quantization_bits_inter"):
            bits = getattr(self, name)
            if bits not in SUPPORTED_BITS:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {SUPPORTED_BITS}, got {bits}")
        if self.loco_error_bits not in LOCO_ERROR_BITS:
            raise ValueError(f"--loco-error-bits must be one of {LOCO_ERROR_BITS}, got "
                             f"{self.loco_error_bits}")
        for name in ("wq_group_size", "gq_group_size_intra", "gq_group_size_inter"):
            gs = getattr(self, name)
            if gs <= 0 or gs % 8 != 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive multiple of 8, got {gs}")
        hb = self.hadamard_block_size
        if hb <= 0 or hb & (hb - 1):
            raise ValueError(f"--hadamard-block-size must be a power of two, got {hb}")
        from .kernels.reference import HADAMARD_MAX_BLOCK

        if hb > HADAMARD_MAX_BLOCK:
            raise ValueError(f"--hadamard-block-size must be at most {HADAMARD_MAX_BLOCK} (the "
                             f"largest block the kernels transform), got {hb}")
        if self.hadamard_transform:
            for name in ("gq_group_size_intra", "gq_group_size_inter"):
                if getattr(self, name) % hb:
                    raise ValueError(
                        f"--hadamard-transform needs --{name.replace('_', '-')} to be a multiple of "
                        f"--hadamard-block-size {hb}, got {getattr(self, name)}")
        if self.quantization_error_interval < 0:
            raise ValueError(f"--quantization-error-interval must be >= 0, got "
                             f"{self.quantization_error_interval}")
        if self.weight_quantization_mode not in ("diff", "direct"):
            raise ValueError(f"--weight-quantization-mode must be 'diff' or 'direct', got "
                             f"{self.weight_quantization_mode!r}")
        if not 0.0 <= self.loco_error_beta < 1.0:
            raise ValueError(f"--loco-error-beta must be in [0, 1), got {self.loco_error_beta}")
        if self.loco_reset_interval <= 0:
            raise ValueError("--loco-reset-interval must be positive")
        if self.grad_accum_dtype not in (None, "fp32", "bf16"):
            raise ValueError(f"--grad-accum-dtype must be fp32 or bf16, got {self.grad_accum_dtype}")
        if self.data_parallel_intra_node_size is not None and self.data_parallel_intra_node_size <= 0:
            raise ValueError("--data-parallel-intra-node-size must be positive")
        if self.gradient_alltoall_pipeline < 1:
            raise ValueError(f"--gradient-alltoall-pipeline must be >= 1, got "
                             f"{self.gradient_alltoall_pipeline}")
        if self.gradients_quantization_start_iteration < 0:
            raise ValueError("--gradients-quantization-start-iteration must be >= 0")

    def intra_node_size(self, data_parallel_size: int, tensor_model_parallel_size: int = 1, *,
                        dp_ranks_per_host: Optional[int] = None,
                        environ: Mapping[str, str] = os.environ) -> int:
        """DP ranks that share a node (at most the DP size: a DP group inside one node is one
        "node"): the explicit setting; else the launcher's ranks per node // TP
        (:func:`launcher_ranks_per_node`: torchrun, SLURM, Open MPI, MPICH, MVAPICH2); else
        ``dp_ranks_per_host``, counted by the runtime from the ranks' hostnames.

        Without any of them it raises :class:`TopologyUnknownError` rather than assume one node
        (which would run a multi-node job's intra-node hop over the inter-node network). The one
        resolver of this number (``validate_args`` and the runtime both call it); raises
        ValueError naming the flag."""
        launcher = launcher_ranks_per_node(environ)
        if self.data_parallel_intra_node_size is not None:
            d = self.data_parallel_intra_node_size
            source = f"--data-parallel-intra-node-size {d}"
        elif launcher is not None:
            local, var = launcher
            d = max(1, local // tensor_model_parallel_size)
            source = (f"the intra-node data-parallel size {d} ({var} {local} // "
                      f"--tensor-model-parallel-size {tensor_model_parallel_size}; set "
                      f"--data-parallel-intra-node-size to override)")
        elif dp_ranks_per_host is not None:
            d = dp_ranks_per_host
            source = (f"the intra-node data-parallel size {d} (data-parallel ranks per host, from "
                      f"the hostnames; set --data-parallel-intra-node-size to override)")
        else:
            raise TopologyUnknownError(
                "cannot tell how many data-parallel ranks share a node: none of "
                f"{', '.join(LAUNCHER_LOCAL_SIZE_VARS)}, SLURM_TASKS_PER_NODE is set; pass "
                "--data-parallel-intra-node-size")
        d = min(d, data_parallel_size)
        if data_parallel_size % d:
            raise ValueError(f"{source} does not divide the data-parallel size {data_parallel_size}")
        return d

    @property
    def communicator_timeout(self) -> Optional[timedelta]:
        """:attr:`distributed_timeout_minutes` as the ``timeout`` of a new process group."""
        if self.distributed_timeout_minutes is None:
            return None
        return timedelta(minutes=self.distributed_timeout_minutes)

    @classmethod
    def from_args(cls, args: Any) -> "QuantizationConfig":
        """The one place flags become a QuantizationConfig: derived values finished (the
        ``--quantized-grad-bits`` shorthand), validated, and the PaRO flags read as given
        (:meth:`ParoConfig.from_args`; the trainer's ``integration.build_quantization_config``
        resolves them). ValueError naming the flag."""
        kwargs: dict = {}
        for name in cls.__dataclass_fields__:
            if name != "paro" and hasattr(args, name):
                kwargs[name] = getattr(args, name)
        cfg = cls(**kwargs)
        if getattr(args, "quantized_grad_bits", None) is not None:
            cfg = replace(cfg, quantized_gradients=True,
                          gradient_quantization_bits_inter=args.quantized_grad_bits)
        cfg.validate()
        return replace(cfg, paro=ParoConfig.from_args(args))

    def to_dict(self) -> dict:
        """Plain dict of every field (logs, dry run, the quantization state's config record)."""
        return asdict(self)
