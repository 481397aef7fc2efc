"""The PaRO engine's optimizer: fp32 AdamW / SGD on this rank's optimizer-state shard."""

from __future__ import annotations

import math
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from .engine import ParoDataParallel
from .strategy import Level

__all__ = ["ParoOptimizer", "model_state_bytes", "sum_of_squares", "GRAD_NORM_CHUNK_NUMEL"]

GRAD_NORM_CHUNK_NUMEL = 1 << 24
"""Elements per chunk of the grad-norm reduction (64 MiB of fp32 scratch). Each chunk's sum of
squares is an fp32 reduction (as megatron-core's fp32 grad norm) and the chunks' sums are added
in fp64, so the rounding error stays that of a 16M-element fp32 reduction however large the
shard is, and the only temporary is one chunk's squares."""


def sum_of_squares(t: torch.Tensor, chunk_numel: int = GRAD_NORM_CHUNK_NUMEL) -> torch.Tensor:
    """Sum of the squares of ``t``'s elements as a 0-d fp64 tensor on ``t``'s device.

    Chunked fp32 squares summed into fp64 partials: no fp64 copy of ``t``, no host sync. Overflow
    of the fp32 range gives inf, a NaN gives NaN.
    """
    # See [Note: chunked sum of squares] in docs/architecture.md
    if chunk_numel <= 0:
        raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=t.device)
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    chunks = flat.split(chunk_numel)
    partials = torch.empty(len(chunks), dtype=acc, device=t.device)
    for i, c in enumerate(chunks):
        torch.sum(torch.square(c.to(acc)), dim=0, out=partials[i])
    return partials.double().sum()


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` that does not alias it (also when ``t`` already is on the CPU)."""
    return t.detach().to("cpu", copy=True)


class ParoOptimizer:
    """fp32 AdamW (or SGD with momentum) on this rank's optimizer-state shard of a
    :class:`ParoDataParallel` chunk.

    State per rank: fp32 master parameters, and for Adam the two moments, all at the os level
    (K = 12 bytes per element, as the cost model assumes; fp32 training keeps the master copy too).
    The update reproduces ``torch.optim.AdamW`` (what megatron-core uses without Apex/TE) with
    megatron-core's default parameter groups (no weight decay for biases and 1-D parameters), so
    every strategy follows the same trajectory as ZeRO-1 up to summation order. Exposes what the
    trainer and ``OptimizerParamScheduler`` use: ``param_groups``, ``config``, ``prepare_grads``,
    ``get_grad_norm``, ``get_parameters`` (for megatron-core's clip), ``step_with_ready_grads``,
    ``zero_grad``, ``scale_loss``, ``get_loss_scale``, ``state_dict``, ``load_state_dict``,
    ``reload_model_params``.
    """

    def __init__(self, engine: ParoDataParallel, config: Any) -> None:
        if getattr(config, "fp16", False):
            raise NotImplementedError("PaRO engine strategies support bf16 and fp32, not fp16 "
                                      "(no loss scaling); use --bf16")
        if config.optimizer not in ("adam", "sgd"):
            raise NotImplementedError(f"optimizer {config.optimizer!r} is not supported by the PaRO engine")
        self.engine = engine
        self.config = config
        self.is_stub_optimizer = False
        o = engine.strategy.optim
        # params_at_level returns a fresh copy: fp32 params become the master without another
        # copy (bf16 ones are converted once). The decay mask is built at the shard's size on the
        # device (1 byte per shard element, no model-sized host mask or index tensor).
        self.master = torch.nn.Parameter(engine.params_at_level(o).float())
        self.decay_mask = engine.weight_decay_mask(o, device=self.master.device)
        if config.optimizer == "adam":
            self.exp_avg = torch.zeros_like(self.master.data)
            self.exp_avg_sq = torch.zeros_like(self.master.data)
        else:
            self.exp_avg = torch.zeros_like(self.master.data)  # momentum buffer
            self.exp_avg_sq = None
        self.step_count = 0
        common = {"params": [], "lr": config.lr, "lr_mult": 1.0, "default_config": True,
                  "is_expert_parallel": False, "is_decoupled_lr": False}
        self.param_groups: List[Dict[str, Any]] = [
            dict(common, weight_decay=config.weight_decay, wd_mult=1.0),
            dict(common, weight_decay=0.0, wd_mult=0.0),
        ]
        # Scope over which the os shards partition the model: the grad norm sums over it.
        self._norm_group = {Level.N: None, Level.I: engine.intra_group,
                            Level.G: engine.groups.dp_group}[o]
        self._norm_ranks = {Level.N: 1, Level.I: engine.m, Level.G: engine.n}[o]

    # -- trainer interface
    def get_parameters(self) -> List[torch.Tensor]:
        """The tensor whose ``.grad`` megatron-core's ``clip_grad_by_total_norm_fp32`` scales."""
        self.master.grad = self.engine.main_grad
        return [self.master]

    def prepare_grads(self) -> bool:
        """True (skip the step) when a quantized collective of this step met NaN/Inf on any rank
        (the runtime's once-per-step agreement, as megatron-core's ``found_inf``). No loss
        scaling, so nothing else overflows here; non-finite exact gradients give a non-finite
        norm, which the caller catches."""
        if self.engine.main_grad is None:
            raise RuntimeError("finalize_model_grads was not called before the optimizer step")
        self.master.grad = self.engine.main_grad
        rt = self.engine.quant_runtime
        return rt is not None and rt.agree_nonfinite(self.master.device)

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """L2 norm of the DP-averaged gradient; shards summed over the scope that splits them
        (replicas counted once).

        fp32 arithmetic on the gradient, as megatron-core's ``get_grad_norm_fp32`` (see
        :func:`sum_of_squares`): no fp64 copy of the shard, only one fp64 scalar per chunk."""
        sq = sum_of_squares(self.engine.main_grad, GRAD_NORM_CHUNK_NUMEL).reshape(1)
        if self._norm_ranks > 1:
            dist.all_reduce(sq, group=self._norm_group)
        return float(sq.item()) ** 0.5

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        grad = self.engine.main_grad
        lr = self.param_groups[0]["lr"]
        wd = self.param_groups[0]["weight_decay"]
        wd_nodecay = self.param_groups[1]["weight_decay"]
        p = self.master.data
        self.step_count += 1
        if self.config.optimizer == "adam":
            p.mul_(torch.where(self.decay_mask, 1 - lr * wd, 1 - lr * wd_nodecay).to(p.dtype))
            b1, b2 = self.config.adam_beta1, self.config.adam_beta2
            self.exp_avg.lerp_(grad, 1 - b1)
            self.exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            bc1 = 1 - b1 ** self.step_count
            bc2 = 1 - b2 ** self.step_count
            denom = (self.exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(self.config.adam_eps)
            p.addcdiv_(self.exp_avg, denom, value=-(lr / bc1))
        else:  # torch.optim.SGD with momentum and coupled weight decay
            d = grad + torch.where(self.decay_mask, wd, wd_nodecay).to(p.dtype) * p
            mom = self.config.sgd_momentum
            if self.step_count == 1:
                self.exp_avg.copy_(d)
            else:
                self.exp_avg.mul_(mom).add_(d)
            p.add_(self.exp_avg if mom else d, alpha=-lr)
        self.engine.sync_params(p)
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.master.grad = None
        self.engine.zero_grad_buffer()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor(1.0)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Re-derive the fp32 master shard from the model's parameters (after loading weights)."""
        self.master.data.copy_(self.engine.params_at_level(self.engine.strategy.optim).float())

    # -- checkpoint
    def state_dict(self) -> Dict[str, Any]:
        """Everything for an exact resume of this rank: master shard, moments, step, groups.

        The tensors are host copies (bit-identical to the state), not device clones: a clone would
        add 12 bytes per shard element on the device only for ``torch.save`` to copy to the host."""
        return {"paro_strategy": self.engine.strategy.name,
                "padded_numel": self.engine.padded_numel,
                "group_size": self.engine.m,
                "master": _host_copy(self.master),
                "exp_avg": _host_copy(self.exp_avg),
                "exp_avg_sq": None if self.exp_avg_sq is None else _host_copy(self.exp_avg_sq),
                "step": self.step_count,
                "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                 for g in self.param_groups]}

    @torch.no_grad()
    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd.get("paro_strategy") != self.engine.strategy.name or \
                sd.get("padded_numel") != self.engine.padded_numel:
            raise RuntimeError(
                f"checkpoint optimizer state is for PaRO strategy {sd.get('paro_strategy')} "
                f"({sd.get('padded_numel')} elements), this run uses {self.engine.strategy.name} "
                f"({self.engine.padded_numel}): resume with the same strategy and layout")
        if sd.get("group_size", self.engine.m) != self.engine.m:   # older states: not recorded
            raise RuntimeError(
                f"checkpoint optimizer state was sharded over PaRO groups of {sd['group_size']} "
                f"ranks, this run's are {self.engine.m} (--paro-group-size): each rank's slice "
                f"would hold another rank's state; resume with --paro-group-size "
                f"{sd['group_size']}")
        self.master.data.copy_(sd["master"])
        self.exp_avg.copy_(sd["exp_avg"])
        if self.exp_avg_sq is not None:
            self.exp_avg_sq.copy_(sd["exp_avg_sq"])
        self.step_count = int(sd["step"])
        for group, saved in zip(self.param_groups, sd["param_groups"]):
            group.update(saved)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state resident on this rank (storage sizes)."""
        tensors = [self.master.data, self.exp_avg, self.exp_avg_sq]
        return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


def model_state_bytes(engine: ParoDataParallel, optimizer: ParoOptimizer) -> Dict[str, int]:
    """Measured persistent model-state bytes of this rank, by state (compare with
    :func:`.cost.model_state_memory`)."""
    out = engine.model_state_bytes()
    out["optimizer_states"] = optimizer.state_bytes()
    out["total"] = out["params"] + out["grads"] + out["optimizer_states"]
    return out
